// SdmServer: one model served over gRPC (sdm.v1.SdmService, grpc.health.v1.Health, server
// reflection) with Prometheus metrics and /healthz on a separate HTTP port, and optionally the
// OpenAI-compatible HTTP API on a third port (server/http/openai_server.h), which shares the
// service, scheduler, auth, limits and metrics with gRPC.
//
// It owns, in dependency order: the model, tokenizer and engine; the session state store (with
// a state directory, sessions survive restarts); the scheduler; the metrics registry and its
// HTTP endpoint; the API keys and tenant limits; the service and the gRPC server.
//
// Lifecycle: Start() returns once both ports accept calls (port 0 picks a free one; port() and
// metrics_port() say which). Shutdown() drains gracefully:
//   1. stop admitting: new Generate calls (and HTTP completions: 503) fail with UNAVAILABLE,
//      health reports NOT_SERVING and /healthz 503; other RPCs keep working. On a shared state
//      directory (replicas: others can serve the sessions) the gRPC port closes instead and its
//      connections get GOAWAY, so that a router sends every new call elsewhere at once; the
//      calls in flight go on;
//   2. wait for the requests in flight (running or queued) up to shutdown_grace;
//   3. cancel what is left: those streams end with a final chunk whose finish_reason is
//      FINISH_REASON_CANCELLED (status OK), their sessions keeping what was generated;
//   4. stop the gRPC server (calls still open after final_write_grace are cancelled), then the
//      HTTP API the same way (its streams end with finish_reason "cancelled");
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
#include "common/grpc_keepalive.h"
#include "engine/engine.h"
#include "server/cluster/etcd_ownership.h"
#include "server/http/openai_server.h"
#include "server/scheduler.h"
#include "server/service.h"
#include "state_store/session_store.h"

namespace sdm {

// Every default is stated once, in the struct that owns the setting; server/main.cc's flags take
// their defaults from here.
struct ServerOptions {
  // The model directory (config.json, model.safetensors, tokenizer file). Required.
  std::filesystem::path model_dir;

  // gRPC address. Port 0: a free port, chosen by the system (see port()).
  std::string host = "127.0.0.1";
  int port = 50051;
  // HTTP /metrics and /healthz. Port 0: a free port; -1: no HTTP endpoint.
  std::string metrics_host = "127.0.0.1";
  int metrics_port = 9090;

  // The OpenAI-compatible HTTP API (server/http/openai_server.h): address, limits, chat
  // template. Off unless http.port is set.
  OpenAiServerOptions http;

  // TLS for the gRPC port: PEM files of the certificate chain and its private key. Both or
  // neither; with them the port serves TLS only.
  std::filesystem::path tls_cert_file;
  std::filesystem::path tls_key_file;

  // API keys (server/auth.h) and per-tenant limits (server/tenant_limits.h); empty: none.
  std::filesystem::path api_keys_file;
  std::filesystem::path tenant_limits_file;

  // Session state: budgets of the resident and host tiers, the default ttl, and the snapshot
  // directory (the disk tier; empty: none, sessions do not survive a restart). The server keeps
  // snapshots under ./sdm-state unless told otherwise. `files`, `background` and `legacy_key`
  // are the server's own.
  SessionStoreOptions store = {.dir = "sdm-state"};
  // Replicas (docs/replicas.md): session ownership in etcd; endpoint empty: none (the server
  // runs alone). The store's `ownership` is then the server's own.
  EtcdOwnershipOptions etcd;
  // Where and how the engine runs (auto: CUDA when a device is present).
  EngineOptions engine = {.device = EngineDevice::kAuto};
  SchedulerOptions scheduler;
  // Model name, limits on prompts and max_tokens, retry hints.
  ServiceOptions service;

  // Health is degraded (/healthz 503) while a write to the state directory, or a turn waiting
  // for its write, has gone on this long (SessionStateStore::OldestPendingPersist): a stalled
  // volume blocks writes rather than failing them. Zero: not checked.
  absl::Duration persist_stall_timeout = absl::Seconds(60);
  // How long Shutdown() lets requests in flight finish before cancelling them.
  absl::Duration shutdown_grace = absl::Seconds(30);
  // After that, how long the cancelled streams get to send their final chunk (each API's) before
  // their calls are cancelled. A stream writes it within a step, so this only bounds a client that
  // does not read; tests on loaded machines raise it.
  absl::Duration final_write_grace = absl::Seconds(5);
  // The server's keepalive pings on its gRPC connections: after this long without reading
  // anything, and how long their answer may take before the connection is closed and its calls
  // cancelled (common/grpc_keepalive.h says why). Tests shorten them.
  absl::Duration grpc_keepalive_time = absl::Milliseconds(kServerKeepaliveTimeMs);
  absl::Duration grpc_keepalive_timeout = absl::Milliseconds(kServerKeepaliveTimeoutMs);

  // How often at most the heap's free pages go back to the system, and the span whose highest
  // bytes in use the current ones must be near for a trim (base/heap.h, HeapTrimmer,
  // HeapTrimSchedule: keeps RSS tracking the bytes in use under a long serving load); zero: never.
  absl::Duration malloc_trim_interval = absl::Seconds(10);
};

// INVALID_ARGUMENT naming the first option out of range (what Start() checks first); the
// command line reports it as a usage error.
absl::Status ValidateServerOptions(const ServerOptions& options);

// "host:port", an IPv6 host in brackets ("[::1]:port").
std::string HostPort(const std::string& host, int port);

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
  // The port of the OpenAI-compatible HTTP API (0 when there is none).
  int http_port() const;
  // "host:port" of the gRPC port, for clients to connect to ("[::1]:port" for IPv6 hosts): a
  // wildcard --host (0.0.0.0, ::) is named by its loopback address (127.0.0.1, ::1).
  std::string address() const;
  // "host:port" the gRPC port is bound to, --host as given ("0.0.0.0:port", "[::]:port"), for
  // operators (sdm-server's "listening on" line).
  std::string listen_address() const;

  // Graceful shutdown (see above). Returns the outcome of persisting the sessions (OK without a
  // state directory).
  absl::Status Shutdown();

  // Reads --api_keys and --tenant_limits again (sdm-server does on SIGHUP): new requests are
  // authenticated and limited by the files as they are now; requests already admitted keep what
  // they were admitted with. Both files are read before either replaces the one in force, so a
  // file that does not parse changes nothing (its error, saying the previous keys and limits
  // stay). Returns what was reloaded; FAILED_PRECONDITION when the server has neither file.
  // Thread-safe.
  absl::StatusOr<std::string> ReloadConfig();

  class Impl;
  explicit SdmServer(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_SERVER_H_
