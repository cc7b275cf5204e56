#include "client/interrupt.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace sdm::client {
namespace {

// The router's pipe (its write end) while one is installed, else -1: all the handler reads.
std::atomic<int> sigint_pipe{-1};
static_assert(std::atomic<int>::is_always_lock_free, "the handler may use lock-free atomics only");

// Whether a router exists, from Install to the end of its destructor.
std::atomic<bool> router_exists{false};

// Async-signal-safe: an atomic load and write(2), errno kept for the code it interrupted.
void OnSigint(int) {
  const int saved_errno = errno;
  const int fd = sigint_pipe.load();
  if (fd >= 0) {
    const char byte = 1;
    // The write end is non-blocking: a pipe full of unread Ctrl-Cs drops this one.
    [[maybe_unused]] const ssize_t written = ::write(fd, &byte, 1);
  }
  errno = saved_errno;
}

absl::Status ErrnoError(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

void TurnInterrupter::BeginTurn(grpc::ClientContext* context) {
  absl::MutexLock lock(&mu_);
  context_ = context;
  cancelled_ = false;
}

bool TurnInterrupter::EndTurn() {
  absl::MutexLock lock(&mu_);
  context_ = nullptr;
  return std::exchange(cancelled_, false);
}

bool TurnInterrupter::Interrupt() {
  absl::MutexLock lock(&mu_);
  if (context_ == nullptr || cancelled_) return false;
  context_->TryCancel();
  cancelled_ = true;
  return true;
}

absl::StatusOr<std::unique_ptr<SigintRouter>> SigintRouter::Install(TurnInterrupter* interrupter) {
  if (router_exists.exchange(true)) {
    return absl::FailedPreconditionError("a SigintRouter is installed already");
  }
  // From here on the destructor undoes whatever was done, and clears router_exists.
  std::unique_ptr<SigintRouter> router(new SigintRouter());
  router->interrupter_ = interrupter;
  // Read before the thread starts, which reads it (thread creation orders the two).
  if (::sigaction(SIGINT, nullptr, &router->previous_) != 0) return ErrnoError("sigaction");
  if ((router->previous_.sa_flags & SA_SIGINFO) == 0 && router->previous_.sa_handler == SIG_IGN) {
    return router;  // a background job: Ctrl-C is not ours to take
  }
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return ErrnoError("pipe2");
  router->read_fd_ = fds[0];
  router->write_fd_ = fds[1];
  if (::fcntl(router->write_fd_, F_SETFL, O_NONBLOCK) != 0) return ErrnoError("fcntl");
  router->thread_ = std::thread(&SigintRouter::Run, router.get());
  sigint_pipe.store(router->write_fd_);
  struct sigaction action = {};
  action.sa_handler = OnSigint;
  sigemptyset(&action.sa_mask);
  // Reads interrupted by the handler go on (chat's read of stdin would otherwise see an error
  // and end the chat as if at the end of its input).
  action.sa_flags = SA_RESTART;
  if (::sigaction(SIGINT, &action, nullptr) != 0) return ErrnoError("sigaction");
  router->installed_ = true;
  return router;
}

SigintRouter::~SigintRouter() {
  if (installed_) ::sigaction(SIGINT, &previous_, nullptr);
  sigint_pipe.store(-1);
  if (write_fd_ >= 0) ::close(write_fd_);  // Run() reads the end of the pipe and returns
  if (thread_.joinable()) thread_.join();
  if (read_fd_ >= 0) ::close(read_fd_);
  router_exists.store(false);
}

void SigintRouter::Run() {
  while (true) {
    char byte;
    const ssize_t n = ::read(read_fd_, &byte, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    if (interrupter_->Interrupt()) continue;
    // Not a turn's first Ctrl-C: what SIGINT would have done without the router (by default the
    // process ends, killed by the signal, as its parent sees).
    ::sigaction(SIGINT, &previous_, nullptr);
    ::raise(SIGINT);
  }
}

}  // namespace sdm::client
