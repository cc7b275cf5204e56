// SdmServer: one model served over gRPC (sdm.v1.SdmService, grpc.health.v1.Health, server
// reflection) with Prometheus metrics and /healthz on a separate HTTP port.
//
// It owns, in dependency order: the model, tokenizer and engine; the session state store (with
// a state directory, sessions survive restarts); the scheduler; the metrics registry and its
// HTTP endpoint; the API keys and tenant limits; the service and the gRPC server.
//
// Lifecycle: Start() returns once both ports accept calls (port 0 picks a free one; port() and
// metrics_port() say which). Shutdown() drains gracefully:
//   1. stop admitting: new Generate calls fail with UNAVAILABLE, health reports NOT_SERVING and
//      /healthz 503; other RPCs keep working;
//   2. wait for the requests in flight (running or queued) up to shutdown_grace;
//   3. cancel what is left: those streams end with a final chunk whose finish_reason is
//      FINISH_REASON_CANCELLED (status OK), their sessions keeping what was generated;
//   4. stop the gRPC server (calls still open after a few more seconds are cancelled);
//   5. write every session to the state directory (PersistAll);
//   6. stop the HTTP endpoint.
// The destructor calls Shutdown() if it was not called.
//
// Thread-safety: Shutdown() may be called from any thread, once or more (later calls wait for
// the first and return its result); the accessors are thread-safe.
#ifndef SDMSERVE_SERVER_SERVER_H_
#define SDMSERVE_SERVER_SERVER_H_

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "server/scheduler.h"

namespace sdm {

struct ServerOptions {
  // The model directory (config.json, model.safetensors, tokenizer file). Required.
  std::filesystem::path model_dir;
  // ModelInfo.name; empty: the model directory's name.
  std::string model_name;

  // gRPC address. Port 0: a free port, chosen by the system (see port()).
  std::string host = "127.0.0.1";
  int port = 50051;
  // HTTP /metrics and /healthz. Port 0: a free port; -1: no HTTP endpoint.
  std::string metrics_host = "127.0.0.1";
  int metrics_port = 9090;

  // TLS for the gRPC port: PEM files of the certificate chain and its private key. Both or
  // neither; with them the port serves TLS only.
  std::filesystem::path tls_cert_file;
  std::filesystem::path tls_key_file;

  // API keys (server/auth.h) and per-tenant limits (server/tenant_limits.h); empty: none.
  std::filesystem::path api_keys_file;
  std::filesystem::path tenant_limits_file;

  // Session snapshots (the disk tier); empty: no disk tier, sessions do not survive a restart.
  std::filesystem::path state_dir = "sdm-state";
  // Bytes of session state resident in the engine, and parked in host memory, before the least
  // recently used sessions move down a tier.
  int64_t resident_budget_bytes = int64_t{4} << 30;
  int64_t host_budget_bytes = int64_t{8} << 30;
  // Idle sessions are deleted after this long unless created with their own ttl.
  absl::Duration session_ttl = absl::InfiniteDuration();

  // Where the engine runs: auto (CUDA when a device is present), cpu or cuda.
  EngineDevice device = EngineDevice::kAuto;
  // Engine threads; 0: one per hardware thread.
  int threads = 0;
  // Prompt tokens per prefill chunk of the engine.
  int64_t prefill_chunk = 256;
  SchedulerOptions scheduler;
  // Limits on a prompt (tokens, with BOS) and on a request's max_tokens.
  int64_t max_prompt_tokens = 8192;
  int64_t max_tokens_limit = 4096;

  // How long Shutdown() lets requests in flight finish before cancelling them.
  absl::Duration shutdown_grace = absl::Seconds(30);
};

class SdmServer {
 public:
  // Loads the model and starts serving. Errors name what failed: the model (its loader's
  // error), the key or limits file, the state directory, TLS files, or an address that cannot be
  // bound (Unavailable).
  static absl::StatusOr<std::unique_ptr<SdmServer>> Start(const ServerOptions& options);

  ~SdmServer();
  SdmServer(const SdmServer&) = delete;
  SdmServer& operator=(const SdmServer&) = delete;

  // The gRPC port, and the HTTP port (0 when there is none).
  int port() const;
  int metrics_port() const;
  // "host:port" of the gRPC port, for clients ("[::1]:port" for IPv6 hosts).
  std::string address() const;

  // Graceful shutdown (see above). Returns the outcome of persisting the sessions (OK without a
  // state directory).
  absl::Status Shutdown();

  class Impl;
  explicit SdmServer(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_SERVER_H_
