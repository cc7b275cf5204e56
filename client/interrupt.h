// Ctrl-C in `sdm-client chat`: the first one while a turn streams cancels that turn's call and
// the chat goes on; one at the prompt, or a second one within the same turn, ends the process as
// SIGINT does without a handler.
//
// TurnInterrupter knows the call in flight and decides; SigintRouter turns each SIGINT into a
// TurnInterrupter::Interrupt(). The signal handler only writes a byte to a pipe (write(2) is
// async-signal-safe); a thread of the router reads the pipe and does the rest (a lock,
// grpc::ClientContext::TryCancel, restoring SIGINT's action), none of which a handler may do.
//
// Thread-safety: TurnInterrupter is thread-safe. SigintRouter is created and destroyed by one
// thread, and at most one exists at a time (it owns the process's SIGINT action meanwhile).
#ifndef SDMSERVE_CLIENT_INTERRUPT_H_
#define SDMSERVE_CLIENT_INTERRUPT_H_

#include <signal.h>

#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/client_context.h"

namespace sdm::client {

class TurnInterrupter {
 public:
  TurnInterrupter() = default;
  TurnInterrupter(const TurnInterrupter&) = delete;
  TurnInterrupter& operator=(const TurnInterrupter&) = delete;

  // A turn's call is about to start on `context`, which must outlive the matching EndTurn().
  // One turn at a time.
  void BeginTurn(grpc::ClientContext* context);
  // The turn's call has ended (its status read): returns whether Interrupt() cancelled it.
  bool EndTurn();

  // One Ctrl-C. With a turn in flight that no interrupt has cancelled yet, cancels its call
  // (TryCancel: the call ends CANCELLED; a call that already ended is not changed) and returns
  // true. Otherwise (no turn, or its second interrupt) returns false: the process is to end.
  bool Interrupt();

 private:
  absl::Mutex mu_;
  grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

class SigintRouter {
 public:
  // Routes SIGINT to interrupter->Interrupt() until destroyed; `interrupter` must outlive the
  // router. When Interrupt() returns false, the router's thread puts back the SIGINT action
  // found here and raises SIGINT, so that the process ends as it would have without the router
  // (by default, killed by SIGINT). A SIGINT that is ignored here (a background job) stays
  // ignored: the router then installs nothing. INTERNAL if the pipe or the thread cannot be made;
  // FAILED_PRECONDITION if another router exists.
  static absl::StatusOr<std::unique_ptr<SigintRouter>> Install(TurnInterrupter* interrupter);

  // Puts back the SIGINT action found at Install and joins the thread.
  ~SigintRouter();
  SigintRouter(const SigintRouter&) = delete;
  SigintRouter& operator=(const SigintRouter&) = delete;

 private:
  SigintRouter() = default;
  void Run();  // the thread: reads the pipe until its write end is closed

  TurnInterrupter* interrupter_ = nullptr;
  bool installed_ = false;
  struct sigaction previous_ = {};
  int read_fd_ = -1;
  int write_fd_ = -1;
  std::thread thread_;
};

}  // namespace sdm::client

#endif  // SDMSERVE_CLIENT_INTERRUPT_H_
