#include "server/server.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "base/heap.h"
#include "base/log.h"
#include "base/reloadable.h"
#include "base/status_macros.h"
#include "base/thread_priority.h"
#include "common/grpc_keepalive.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/tokenizer.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "openssl/bio.h"
#include "openssl/pem.h"
#include "openssl/x509.h"
#include "prometheus/registry.h"
#include "server/auth.h"
#include "server/http/listen_socket.h"
#include "server/http_endpoint.h"
#include "server/malformed_requests.h"
#include "server/metrics/exposition.h"
#include "server/metrics/server_metrics.h"
#include "server/service.h"
#include "server/stall_watch.h"
#include "server/tenant_limits.h"
#include "state_store/session_store.h"

namespace sdm {

std::string HostPort(const std::string& host, int port) {
  if (absl::StrContains(host, ':') && !absl::StartsWith(host, "[")) {
    return absl::StrCat("[", host, "]:", port);
  }
  return absl::StrCat(host, ":", port);
}

namespace {

constexpr char kServiceName[] = "sdm.v1.SdmService";
// After the streams' final chunks (ServerOptions::final_write_grace), how long other calls get.
constexpr auto kUnaryGrace = std::chrono::milliseconds(200);

// INVALID_ARGUMENT unless `cert_pem` starts with a PEM certificate and `key_pem` is a PEM private
// key that goes with it: gRPC's builder only fails to start then, which read as a port that
// cannot be bound.
absl::Status CheckTlsKeyPair(const std::string& cert_pem, const std::filesystem::path& cert_file,
                             const std::string& key_pem, const std::filesystem::path& key_file) {
  BIO* cert_bio = BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size()));
  X509* cert = PEM_read_bio_X509(cert_bio, nullptr, nullptr, nullptr);
  BIO_free(cert_bio);
  if (cert == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("the TLS certificate ", cert_file.string(), " holds no PEM certificate"));
  }
  BIO* key_bio = BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size()));
  EVP_PKEY* key = PEM_read_bio_PrivateKey(key_bio, nullptr, nullptr, nullptr);
  BIO_free(key_bio);
  absl::Status status;
  if (key == nullptr) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "the TLS key ", key_file.string(), " holds no PEM private key (or one with a passphrase)"));
  } else if (X509_check_private_key(cert, key) != 1) {
    status = absl::InvalidArgumentError(absl::StrCat("the TLS key ", key_file.string(),
                                                     " does not go with the certificate ",
                                                     cert_file.string()));
  }
  EVP_PKEY_free(key);
  X509_free(cert);
  return status;
}

absl::StatusOr<std::string> ReadTextFile(const std::filesystem::path& path,
                                         absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read the ", what, " ", path.string()));
  }
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

absl::Status ValidateServerOptions(const ServerOptions& o) {
  // Messages name sdm-server's flags, which mirror the fields (the fields no flag sets by their
  // own names), and the value given.
  using absl::InvalidArgumentError;
  using absl::StrCat;
  if (o.model_dir.empty()) return InvalidArgumentError("--model (a model directory) is required");
  if (o.port < 0 || o.port > 65535) {
    return InvalidArgumentError(StrCat("--port must be in [0, 65535], got ", o.port));
  }
  if (o.metrics_port < -1 || o.metrics_port > 65535) {
    return InvalidArgumentError(StrCat(
        "--metrics_port must be in [0, 65535], or -1 for no HTTP endpoint, got ", o.metrics_port));
  }
  if (o.http.port < -1 || o.http.port > 65535) {
    return InvalidArgumentError(
        StrCat("--http_port must be in [0, 65535], or -1 for no HTTP API, got ", o.http.port));
  }
  if (o.http.max_connections < 1) {
    return InvalidArgumentError(
        StrCat("--http_max_connections must be >= 1, got ", o.http.max_connections));
  }
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return InvalidArgumentError(
        "TLS needs both --tls_cert and --tls_key (or neither), got only the " +
        std::string(o.tls_cert_file.empty() ? "key" : "certificate"));
  }
  for (const auto& [flag, bytes] : {std::pair{"--resident_budget", o.store.resident_budget_bytes},
                                    std::pair{"--host_budget", o.store.host_budget_bytes},
                                    std::pair{"--device_budget", o.store.device_budget_bytes}}) {
    if (bytes < 0) return InvalidArgumentError(StrCat(flag, " must not be negative, got ", bytes));
  }
  if (o.engine.num_threads < 0) {
    return InvalidArgumentError(
        StrCat("--threads must be >= 0 (0: one per CPU), got ", o.engine.num_threads));
  }
  // The engine checks these too, but only once the model has loaded.
  if (absl::Status nice = CheckNiceIncrement(o.engine.decode_nice); !nice.ok()) {
    return InvalidArgumentError(StrCat("--decode_nice: ", nice.message()));
  }
  if (o.engine.device == EngineDevice::kCuda && o.engine.cpu_dtype != DType::kF32) {
    return InvalidArgumentError(
        "--cpu_dtype applies to the CPU engine only (the CUDA engine stores bf16 already); "
        "use --device cpu or auto");
  }
  for (const auto& [flag, value] :
       {std::pair{"--prefill_chunk", o.engine.prefill_chunk},
        std::pair{"--max_running", static_cast<int64_t>(o.scheduler.max_running)},
        std::pair{"--prefill_token_budget", o.scheduler.prefill_token_budget},
        std::pair{"--max_prompt_tokens", o.service.max_prompt_tokens},
        std::pair{"--max_tokens_limit", o.service.max_tokens_limit},
        std::pair{"--default_max_tokens", o.service.default_max_tokens}}) {
    if (value < 1) return InvalidArgumentError(StrCat(flag, " must be >= 1, got ", value));
  }
  if (o.scheduler.max_waiting < 0) {
    return InvalidArgumentError(
        StrCat("--max_waiting must be >= 0, got ", o.scheduler.max_waiting));
  }
  if (o.service.max_session_tokens < -1) {
    return InvalidArgumentError(
        StrCat("--max_session_tokens must be >= 0 (0: no limit), or -1 (what the memory budget "
               "holds), got ",
               o.service.max_session_tokens));
  }
  for (const auto& [flag, keepalive] :
       {std::pair{"grpc_keepalive_time", o.grpc_keepalive_time},
        std::pair{"grpc_keepalive_timeout", o.grpc_keepalive_timeout}}) {
    if (keepalive < absl::Milliseconds(1) ||
        keepalive > absl::Milliseconds(std::numeric_limits<int>::max())) {
      return InvalidArgumentError(
          StrCat(flag, " must be in [1ms, 2^31 ms), got ", absl::FormatDuration(keepalive)));
    }
  }
  for (const auto& [flag, duration] :
       {std::pair{"--persist_stall_timeout (0: off)", o.persist_stall_timeout},
        std::pair{"--shutdown_grace", o.shutdown_grace},
        std::pair{"final_write_grace", o.final_write_grace},
        std::pair{"--malloc_trim_interval (0: never)", o.malloc_trim_interval}}) {
    if (duration < absl::ZeroDuration()) {
      return InvalidArgumentError(
          StrCat(flag, " must not be negative, got ", absl::FormatDuration(duration)));
    }
  }
  return absl::OkStatus();
}

namespace {

// The service's options with max_session_tokens resolved (ResolveMaxSessionTokens): a negative
// value (the default) is DefaultMaxSessionTokens of the model within the resident budget (and
// the device's capacity); none is past what the engine can hold.
ServiceOptions WithSessionLimit(const ServerOptions& options, const Engine& engine) {
  ServiceOptions service = options.service;
  int64_t budget = options.store.resident_budget_bytes;
  if (engine.device_state_capacity_bytes() > 0) {
    budget = std::min(budget, engine.device_state_capacity_bytes());
  }
  const int64_t derived = DefaultMaxSessionTokens(
      FullAttentionKvElementsPerToken(engine.config()) * engine.host_kv_value_bytes(), budget);
  const int64_t engine_limit = engine.max_session_positions();
  service.max_session_tokens =
      ResolveMaxSessionTokens(service.max_session_tokens, derived, engine_limit);
  if (options.service.max_session_tokens >= 0 &&
      service.max_session_tokens != options.service.max_session_tokens) {
    SDM_LOG(WARNING) << "sdm-server: max_session_tokens lowered to " << engine_limit
                     << " (the engine's max_context)";
  }
  return service;
}

}  // namespace

class SdmServer::Impl final : public SchedulerListener {
 public:
  explicit Impl(const ServerOptions& o) : options(o) {}

  absl::Status Init();
  absl::Status Shutdown();
  absl::StatusOr<std::string> ReloadConfig();
  // Shutdown()'s step 1b: the gRPC server's Shutdown() starts on grpc_stopper.
  void StopListeningEarly();

  // SchedulerListener, on the step thread.
  void OnStep(int decode_batch, int64_t prefill_tokens, double seconds) override {
    if (decode_batch > 0) metrics->batch_size.Observe(decode_batch);
  }
  void OnFirstToken(double seconds) override { metrics->time_to_first_token.Observe(seconds); }
  void OnInterToken(double seconds) override { metrics->inter_token_latency.Observe(seconds); }
  void OnStepFailed(const absl::Status&) override { metrics->engine_step_failures.Increment(); }

  // At every scrape: gauges from the scheduler and the store, counters from the store's totals.
  void UpdateGauges();

  const ServerOptions options;
  // Before the store: its worker reports persistence health here until the store is destroyed.
  absl::Mutex health_mu;
  absl::Status persist_health ABSL_GUARDED_BY(health_mu);
  // A write to the state directory pending for --persist_stall_timeout or longer (persist_watch).
  bool persist_stalled ABSL_GUARDED_BY(health_mu) = false;
  // The gRPC server's health service may be told (set once it runs, cleared before it stops).
  bool grpc_health_live ABSL_GUARDED_BY(health_mu) = false;
  // Replaced by ReloadConfig; the service and the HTTP API take a snapshot per request.
  Reloadable<ApiKeyAuthenticator> auth;
  Reloadable<TenantLimitsConfig> tenant_limits;
  std::shared_ptr<const Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<Engine> engine;
  // Before the store: a job's observer counts its tokens here when the job ends, which may be
  // when the store's destructor answers the turns still waiting for their write.
  std::unique_ptr<prometheus::Registry> registry;
  std::unique_ptr<ServerMetrics> metrics;
  // Before the store, which writes through it until it is destroyed (null without --etcd).
  std::unique_ptr<EtcdOwnership> ownership;
  std::unique_ptr<SessionStateStore> store;
  std::unique_ptr<Scheduler> scheduler;
  std::unique_ptr<SdmServiceImpl> service;
  std::unique_ptr<grpc::Server> grpc_server;
  std::unique_ptr<HttpEndpoint> http;
  std::unique_ptr<OpenAiServer> openai;
  int port = 0;
  int metrics_port = 0;
  std::atomic<bool> draining{false};
  // On a shared state directory, the gRPC server's Shutdown() runs on this thread from the start
  // of the drain (see StopListeningEarly); `grpc_stopped` is notified when it has returned.
  std::thread grpc_stopper;
  absl::Notification grpc_stopped;

  absl::Mutex shutdown_mu;
  bool shut_down ABSL_GUARDED_BY(shutdown_mu) = false;
  absl::Status shutdown_result ABSL_GUARDED_BY(shutdown_mu);

  // Health: OK, or why the server is not (draining) or degraded (session state cannot be
  // written). Pushed to the gRPC health service from here, read by /healthz.
  absl::Status Health();
  void OnPersistHealth(const absl::Status& persist);
  void ApplyGrpcHealth() ABSL_EXCLUSIVE_LOCKS_REQUIRED(health_mu);

  absl::Mutex gauges_mu;
  StoreStats last_stats ABSL_GUARDED_BY(gauges_mu);
  int64_t heap_trims_counted ABSL_GUARDED_BY(gauges_mu) = 0;   // in metrics->heap_trims
  ResumeStagingStats last_staging ABSL_GUARDED_BY(gauges_mu);  // in the resume_* metrics
  // Tenants whose sdm_tenant_requests series exists (set to 0 when they have none).
  std::set<std::string> tenants_with_requests ABSL_GUARDED_BY(gauges_mu);

  // Polls the store for a stalled write, which no failure reports, and tells the gRPC health
  // service (/healthz asks the store itself). After the store, so that it stops before it (null
  // without a state directory or with persist_stall_timeout 0).
  std::unique_ptr<StallWatch> persist_watch;
  // Last, so that it stops first (null when malloc_trim_interval is zero).
  std::unique_ptr<HeapTrimmer> heap_trimmer;
};

namespace {

bool IsLoopbackHost(absl::string_view host) {
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

// Said at start-up, where an operator looks: without keys every caller is the tenant "default",
// so anyone who can reach a port off this host reads, continues and deletes every session; and a
// key file others can read hands out every key.
void WarnOfOpenAccess(const ServerOptions& options) {
  if (options.api_keys_file.empty()) {
    std::vector<std::string> open;
    if (!IsLoopbackHost(options.host)) open.push_back(HostPort(options.host, options.port));
    if (options.http.port >= 0 && !IsLoopbackHost(options.http.host)) {
      open.push_back(HostPort(options.http.host, options.http.port));
    }
    if (!open.empty()) {
      SDM_LOG(WARNING) << "sdm-server: no --api_keys: every caller on " << absl::StrJoin(open, ", ")
                       << " is the tenant 'default' and can read, continue and delete every "
                          "session; give the server a key file (docs/api.md, Authentication and "
                          "tenancy) or listen on loopback only";
    }
    return;
  }
  struct stat st {};
  if (::stat(options.api_keys_file.c_str(), &st) == 0 && (st.st_mode & S_IROTH) != 0) {
    SDM_LOG(WARNING) << "sdm-server: the API key file " << options.api_keys_file.string()
                     << " can be read by every user of this host (mode "
                     << absl::StrFormat("%04o", st.st_mode & 07777)
                     << "): chmod o-rwx it (deploy/README.md)";
  }
}

// A tenant limits entry that names no caller's tenant (a typo, or a tenant whose key is gone)
// limits nobody, and the tenant it was meant for keeps the default's limits: say so.
void WarnOfLimitsForUnknownTenants(const TenantLimitsConfig& limits,
                                   const ApiKeyAuthenticator& auth) {
  // Without keys every caller is the tenant "default".
  const std::vector<std::string> callers =
      auth.enabled() ? auth.tenants() : std::vector<std::string>{kDefaultTenant};
  std::vector<std::string> unknown;
  for (const std::string& name : limits.tenant_names()) {
    if (!std::binary_search(callers.begin(), callers.end(), name)) unknown.push_back(name);
  }
  if (unknown.empty()) return;
  SDM_LOG(WARNING) << "sdm-server: the tenant limits name tenants no API key maps to ("
                   << absl::StrJoin(unknown, ", ")
                   << "; the keys' tenants: " << absl::StrJoin(callers, ", ")
                   << "): their limits apply to nobody; check the names";
}

}  // namespace

absl::Status SdmServer::Impl::Init() {
  SDM_RETURN_IF_ERROR(ValidateServerOptions(options));
  if (options.malloc_trim_interval > absl::ZeroDuration()) {
    heap_trimmer = std::make_unique<HeapTrimmer>(options.malloc_trim_interval);
  }
  // The small files first: a typo there should not wait for the model to load.
  if (!options.api_keys_file.empty()) {
    SDM_ASSIGN_OR_RETURN(ApiKeyAuthenticator keys,
                         ApiKeyAuthenticator::FromFile(options.api_keys_file));
    auth.Set(std::move(keys));
  }
  WarnOfOpenAccess(options);
  if (!options.tenant_limits_file.empty()) {
    SDM_ASSIGN_OR_RETURN(TenantLimitsConfig limits,
                         TenantLimitsConfig::FromFile(options.tenant_limits_file));
    tenant_limits.Set(std::move(limits));
    WarnOfLimitsForUnknownTenants(*tenant_limits.Get(), *auth.Get());
  }
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (!options.tls_cert_file.empty()) {
    SDM_ASSIGN_OR_RETURN(std::string cert, ReadTextFile(options.tls_cert_file, "TLS certificate"));
    SDM_ASSIGN_OR_RETURN(std::string key, ReadTextFile(options.tls_key_file, "TLS key"));
    SDM_RETURN_IF_ERROR(CheckTlsKeyPair(cert, options.tls_cert_file, key, options.tls_key_file));
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({key, cert});
    credentials = grpc::SslServerCredentials(ssl);
  }

  // The ports, before the model loads and the state directory opens: one in use (a server
  // already running, a typo) fails the start at once rather than after minutes of loading, with
  // the directory as it was. A port taken after this check fails the bind below, as before.
  SDM_RETURN_IF_ERROR(CheckPortFree("gRPC", options.host, options.port));
  SDM_RETURN_IF_ERROR(CheckPortFree("metrics", options.metrics_host, options.metrics_port));
  SDM_RETURN_IF_ERROR(CheckPortFree("the HTTP API", options.http.host, options.http.port));

  absl::StatusOr<std::shared_ptr<const Model>> m = LoadModel(options.model_dir);
  if (!m.ok()) {
    return absl::Status(m.status().code(),
                        absl::StrCat("cannot load the model from ", options.model_dir.string(),
                                     ": ", m.status().message()));
  }
  model = *std::move(m);
  SDM_ASSIGN_OR_RETURN(tokenizer, Tokenizer::Create(model->config, model->dir));
  SDM_ASSIGN_OR_RETURN(engine, Engine::Create(model, options.engine));
  SDM_LOG(INFO) << "sdm-server: engine: " << engine->DescribeDevice();

  SessionStoreOptions store_options = options.store;
  // Snapshots written before keys were typed name their key only in the service's metadata.
  store_options.legacy_key = SessionKeyOfMetadata;
  store_options.on_persist_health = [this](const absl::Status& health) { OnPersistHealth(health); };
  if (!options.etcd.client.endpoints.empty()) {
    SDM_ASSIGN_OR_RETURN(ownership, EtcdOwnership::Start(options.etcd));
    store_options.ownership = ownership.get();
    SDM_LOG(INFO) << "sdm-server: replica '" << options.etcd.replica_id << "', etcd "
                  << ownership->endpoints()
                  << (options.etcd.client.username.empty()
                          ? ""
                          : " as user '" + options.etcd.client.username + "'")
                  << ", lease " << ownership->lease_id();
  }
  // On a device, sessions live in its fixed state arenas: a larger device budget would let steps
  // fail for want of device memory instead of copying idle sessions back to the host.
  if (const int64_t cap = engine->device_state_capacity_bytes(); cap > 0) {
    if (store_options.device_budget_bytes == 0) {
      store_options.device_budget_bytes = cap;
    } else if (store_options.device_budget_bytes > cap) {
      SDM_LOG(WARNING) << "sdm-server: device budget lowered from "
                       << store_options.device_budget_bytes << " to " << cap
                       << " bytes (device state capacity)";
      store_options.device_budget_bytes = cap;
    }
  }
  absl::StatusOr<std::unique_ptr<SessionStateStore>> st =
      SessionStateStore::Open(engine->state_layout(), engine->fingerprint(), store_options);
  if (!st.ok()) {
    // In use by another server: the flags that decide it. Another failure (not writable, not a
    // directory): where else sessions may go, or none.
    const absl::string_view flags =
        absl::IsFailedPrecondition(st.status())
            ? " (--state_dir; replicas share one directory with --shared_state_dir)"
            : " (--state_dir=DIR for another directory; --state_dir= keeps no state)";
    // A relative directory (the default) is named from where the server runs too.
    std::string dir = options.store.dir.string();
    if (options.store.dir.is_relative()) {
      std::error_code ec;
      const std::filesystem::path absolute = std::filesystem::absolute(options.store.dir, ec);
      if (!ec) absl::StrAppend(&dir, " (", absolute.string(), ")");
    }
    return absl::Status(st.status().code(), absl::StrCat("cannot open the state directory ", dir,
                                                         ": ", st.status().message(), flags));
  }
  store = *std::move(st);
  if (ownership != nullptr) {
    // Handoff (docs/replicas.md): another replica asked for a session this one owns: write it
    // to the shared directory and give it up (Park to disk releases it). Cleared in Shutdown().
    ownership->SetHandoffHandler(
        [s = store.get()](const SessionKey& key) { return s->Park(key, Tier::kDisk); });
  }
  for (const std::string& error : store->open_errors()) {
    SDM_LOG(WARNING) << "sdm-server: " << error;
  }

  registry = std::make_unique<prometheus::Registry>(prometheus::Registry::InsertBehavior::Throw);
  metrics = std::make_unique<ServerMetrics>(*registry);
  scheduler = std::make_unique<Scheduler>(*engine, *store, *tokenizer, options.scheduler, this);

  service = std::make_unique<SdmServiceImpl>(
      ServiceDeps{*model, *engine, *tokenizer, *store, *scheduler, *metrics, auth, tenant_limits},
      WithSessionLimit(options, *engine));

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string address = HostPort(options.host, options.port);
  builder.AddListeningPort(address, credentials, &port);
  // gRPC sets SO_REUSEPORT by default: a second server of the same user then binds a port in
  // use without error and the kernel splits the connections between the two (both writing the
  // same state directory). Off, a port in use fails the start (below), as the HTTP ports do.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Clients ping quiet connections every 30 s (common/grpc_keepalive.h): with gRPC's defaults
  // the fourth such ping in a row would drop the connection with GOAWAY "too_many_pings".
  for (const GrpcIntArg& arg : kServerKeepaliveArgs) {
    builder.AddChannelArgument(arg.name, arg.value);
  }
  // Its own pings find clients that vanished (common/grpc_keepalive.h).
  builder.AddChannelArgument(
      GRPC_ARG_KEEPALIVE_TIME_MS,
      static_cast<int>(absl::ToInt64Milliseconds(options.grpc_keepalive_time)));
  builder.AddChannelArgument(
      GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
      static_cast<int>(absl::ToInt64Milliseconds(options.grpc_keepalive_timeout)));
  builder.RegisterService(service.get());
  // Requests gRPC cannot parse: INVALID_ARGUMENT with a message, and counted
  // (server/malformed_requests.h).
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<MalformedRequestInterceptorFactory>(
      [this](absl::string_view method, absl::StatusCode code) {
        metrics->Request(method, code).Increment();
      }));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  grpc_server = builder.BuildAndStart();
  if (grpc_server == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", address, " (in use, or not an address of this host)"));
  }
  {
    absl::MutexLock lock(&health_mu);
    grpc_health_live = true;
    ApplyGrpcHealth();
  }
  if (store != nullptr && options.persist_stall_timeout > absl::ZeroDuration()) {
    persist_watch = std::make_unique<StallWatch>(
        options.persist_stall_timeout, [this] { return store->OldestPendingPersist(); },
        [this](bool stalled) {
          absl::MutexLock lock(&health_mu);
          persist_stalled = stalled;
          ApplyGrpcHealth();
        });
  }

  if (options.http.port >= 0) {
    SDM_ASSIGN_OR_RETURN(
        openai, OpenAiServer::Start(options.http, *service, auth, *metrics, model->dir,
                                    options.scheduler.max_running + options.scheduler.max_waiting));
  }

  if (options.metrics_port >= 0) {
    HttpEndpointOptions http_options;
    http_options.host = options.metrics_host;
    http_options.port = options.metrics_port;
    SDM_ASSIGN_OR_RETURN(http, HttpEndpoint::Start(
                                   http_options,
                                   [this] {
                                     UpdateGauges();
                                     return RenderPrometheusText(*registry);
                                   },
                                   [this] { return Health(); }));
    metrics_port = http->port();
  }
  return absl::OkStatus();
}

absl::Status SdmServer::Impl::Health() {
  if (draining.load()) return absl::UnavailableError("draining before shutdown");
  {
    absl::MutexLock lock(&health_mu);
    if (!persist_health.ok()) {
      return absl::UnavailableError(absl::StrCat("degraded: ", persist_health.message()));
    }
  }
  // A stalled volume blocks writes instead of failing them: the store's errors never come.
  if (store != nullptr && options.persist_stall_timeout > absl::ZeroDuration()) {
    if (const absl::Duration pending = store->OldestPendingPersist();
        pending >= options.persist_stall_timeout) {
      return absl::UnavailableError(
          absl::StrCat("degraded: a write to the state directory has not finished for ",
                       absl::FormatDuration(absl::Trunc(pending, absl::Seconds(1))),
                       " (a stalled volume?); turns are not acknowledged as saved until it does "
                       "(--persist_stall_timeout)"));
    }
  }
  return absl::OkStatus();
}

void SdmServer::Impl::OnPersistHealth(const absl::Status& persist) {
  absl::MutexLock lock(&health_mu);
  persist_health = persist;
  ApplyGrpcHealth();
}

void SdmServer::Impl::ApplyGrpcHealth() {
  if (!grpc_health_live) return;
  // NOT_SERVING while sessions cannot be written (writes fail, or one has hung), so that
  // balancers send new work to replicas that can keep it; requests still arriving are served (or
  // refused by the store when memory is full too).
  const bool serving = !draining.load() && persist_health.ok() && !persist_stalled;
  grpc_server->GetHealthCheckService()->SetServingStatus(kServiceName, serving);
  grpc_server->GetHealthCheckService()->SetServingStatus("", serving);
}

void SdmServer::Impl::UpdateGauges() {
  absl::MutexLock lock(&gauges_mu);
  if (scheduler != nullptr) {
    metrics->requests_running.Set(scheduler->running());
    metrics->requests_waiting.Set(scheduler->waiting());
    // Per tenant: a tenant seen before and idle now reads 0 (its series stays).
    const std::map<std::string, int64_t> requests = scheduler->TenantRequests();
    for (const std::string& tenant : tenants_with_requests) {
      if (!requests.contains(tenant)) metrics->TenantRequests(tenant).Set(0);
    }
    for (const auto& [tenant, count] : requests) {
      metrics->TenantRequests(tenant).Set(static_cast<double>(count));
      tenants_with_requests.insert(tenant);
    }
  }
  const HeapUsage heap = GetHeapUsage();
  metrics->heap_in_use_bytes.Set(static_cast<double>(heap.in_use_bytes));
  metrics->heap_system_bytes.Set(static_cast<double>(heap.system_bytes));
  if (heap_trimmer != nullptr) {
    const int64_t trims = heap_trimmer->trims();
    metrics->heap_trims.Increment(static_cast<double>(trims - heap_trims_counted));
    heap_trims_counted = trims;
  }
  if (engine != nullptr) {
    const ResumeStagingStats staging = engine->resume_staging_stats();
    metrics->RecordResumeStaging(staging, last_staging);
    last_staging = staging;
  }
  if (store == nullptr) return;
  const StoreStats s = store->Stats();
  for (int t = 0; t < kNumTiers; ++t) {
    const absl::string_view tier = TierName(static_cast<Tier>(t));
    metrics->Sessions(tier).Set(static_cast<double>(s.sessions[t]));
    metrics->StateBytes(tier).Set(static_cast<double>(s.bytes[t]));
  }
  metrics->Sessions(kTierDevice).Set(static_cast<double>(s.device_sessions));
  metrics->StateBytes(kTierDevice).Set(static_cast<double>(s.device_bytes));
  const auto add = [](prometheus::Counter& counter, int64_t now, int64_t before) {
    if (now > before) counter.Increment(static_cast<double>(now - before));
  };
  const int resident = static_cast<int>(Tier::kResident);
  const int host = static_cast<int>(Tier::kHost);
  const int disk = static_cast<int>(Tier::kDisk);
  // A move out of resident lands on host, a move out of host on disk.
  add(metrics->StateOffloads(kTierHost), s.evictions[resident], last_stats.evictions[resident]);
  add(metrics->StateOffloads(kTierDisk), s.evictions[host], last_stats.evictions[host]);
  add(metrics->StateRestores(kTierHost), s.restores[host], last_stats.restores[host]);
  add(metrics->StateRestores(kTierDisk), s.restores[disk], last_stats.restores[disk]);
  add(metrics->snapshot_errors, s.snapshot_errors + s.quarantined,
      last_stats.snapshot_errors + last_stats.quarantined);
  add(metrics->persist_failures, s.persist_failures, last_stats.persist_failures);
  add(metrics->persist_writes, s.persist_writes, last_stats.persist_writes);
  add(metrics->persist_deltas, s.persist_deltas, last_stats.persist_deltas);
  add(metrics->persist_bytes, s.persist_bytes, last_stats.persist_bytes);
  metrics->sessions_unpersisted.Set(static_cast<double>(s.unpersisted));
  add(metrics->persist_syncs, s.persist_syncs, last_stats.persist_syncs);
  add(metrics->persist_waits, s.persist_waits, last_stats.persist_waits);
  if (s.persist_wait_us > last_stats.persist_wait_us) {
    metrics->persist_wait_seconds.Increment(
        static_cast<double>(s.persist_wait_us - last_stats.persist_wait_us) / 1e6);
  }
  metrics->sessions_unsynced.Set(static_cast<double>(s.unsynced));
  metrics->persistence_healthy.Set(store->PersistHealth().ok() ? 1.0 : 0.0);
  metrics->persist_oldest_pending_seconds.Set(absl::ToDoubleSeconds(store->OldestPendingPersist()));
  last_stats = s;
}

void SdmServer::Impl::StopListeningEarly() {
  // grpc::Server::Shutdown closes the listening port and sends GOAWAY at once, then blocks until
  // the calls in flight end (or its deadline, which Shutdown() below cuts short by cancelling
  // them): on a thread of its own, so that the drain goes on meanwhile.
  const std::chrono::system_clock::time_point deadline =
      absl::ToChronoTime(absl::Now() + options.shutdown_grace + options.final_write_grace +
                         absl::FromChrono(kUnaryGrace));
  grpc_stopper = std::thread([this, deadline] {
    grpc_server->Shutdown(deadline);
    grpc_stopped.Notify();
  });
}

absl::Status SdmServer::Impl::Shutdown() {
  absl::MutexLock lock(&shutdown_mu);
  if (shut_down) return shutdown_result;
  shut_down = true;
  // 1. Stop admitting.
  draining.store(true);
  if (service != nullptr) service->StopAdmitting();
  {
    absl::MutexLock lock(&health_mu);
    ApplyGrpcHealth();
  }
  // 1b. Replicas: other replicas can serve this one's sessions, so its gRPC port closes now and
  // its connections are told to go away (GOAWAY): a router (nginx) finds it refusing and sends
  // the sessions' calls to the next replica in its ring at once, instead of to a replica that
  // answers UNAVAILABLE for as long as its drain lasts. The calls in flight go on. A server
  // running alone keeps its port, answering with a retry hint (nobody else could serve them).
  const bool stop_listening_early = options.store.shared_dir && grpc_server != nullptr;
  if (stop_listening_early) StopListeningEarly();
  // The HTTP API's port likewise; its streams in flight go on (OpenAiServer::CloseListener).
  if (options.store.shared_dir && openai != nullptr) {
    if (absl::Status closed = openai->CloseListener(); !closed.ok()) {
      SDM_LOG(WARNING) << "sdm-server: the drain keeps the HTTP API's port open: " << closed;
    }
  }
  // 2. Let the requests in flight finish, up to the grace period.
  const absl::Time give_up = absl::Now() + options.shutdown_grace;
  while (scheduler != nullptr && service != nullptr && absl::Now() < give_up &&
         (scheduler->running() + scheduler->waiting() > 0 || service->active_generates() > 0 ||
          (openai != nullptr && openai->active_generations() > 0))) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // 3. Cancel the rest: their streams end with FINISH_REASON_CANCELLED.
  if (scheduler != nullptr) scheduler->Shutdown(/*cancel=*/true);
  // 4. Stop the gRPC server once the last chunks are out. gRPC's own drain would wait for idle
  // client connections to close until its deadline, hence the wait for the streams here and a
  // short deadline, which cancels the calls still open then.
  if (grpc_server != nullptr) {
    const absl::Time streams_done = absl::Now() + options.final_write_grace;
    while (service != nullptr && service->active_generates() > 0 && absl::Now() < streams_done) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (stop_listening_early) {
      // Its Shutdown() is under way: what is still open after the unary grace is cancelled, as
      // Shutdown(deadline) would (again until it returns: a connection accepted just before the
      // shutdown took effect would escape a single cancellation).
      if (!grpc_stopped.WaitForNotificationWithTimeout(absl::FromChrono(kUnaryGrace))) {
        do {
          grpc_server_cancel_all_calls(grpc_server->c_server());
        } while (!grpc_stopped.WaitForNotificationWithTimeout(absl::Milliseconds(50)));
      }
      grpc_stopper.join();
    } else {
      grpc_server->Shutdown(std::chrono::system_clock::now() + kUnaryGrace);
    }
    absl::MutexLock lock(&health_mu);
    grpc_health_live = false;  // the store's worker may still report until it stops
  }
  // 4b. The same for the HTTP API: its streams write their last chunk, then its port closes.
  if (openai != nullptr) {
    const absl::Time streams_done = absl::Now() + options.final_write_grace;
    while (openai->active_generations() > 0 && absl::Now() < streams_done) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    openai->Stop();
  }
  // 5. Persist every session.
  if (store != nullptr && !options.store.dir.empty()) {
    shutdown_result = store->PersistAll();
  }
  // 5b. Replicas: every session is written; release them all at once (the lease is revoked), so
  // that the other replicas take them up now rather than when this process exits.
  if (ownership != nullptr) ownership->Stop();
  // 6. The HTTP endpoint last, so that the drain can be watched.
  http.reset();
  return shutdown_result;
}

absl::StatusOr<std::string> SdmServer::Impl::ReloadConfig() {
  if (options.api_keys_file.empty() && options.tenant_limits_file.empty()) {
    return absl::FailedPreconditionError(
        "nothing to reload: the server runs without --api_keys and --tenant_limits");
  }
  // Both files are read before either is replaced: a reload applies whole or not at all.
  std::optional<ApiKeyAuthenticator> keys;
  std::optional<TenantLimitsConfig> limits;
  const auto kept = [](const absl::Status& why) {
    return absl::Status(
        why.code(), absl::StrCat(why.message(), "; the previous keys and limits stay in force"));
  };
  if (!options.api_keys_file.empty()) {
    absl::StatusOr<ApiKeyAuthenticator> read = ApiKeyAuthenticator::FromFile(options.api_keys_file);
    if (!read.ok()) return kept(read.status());
    keys = *std::move(read);
  }
  if (!options.tenant_limits_file.empty()) {
    absl::StatusOr<TenantLimitsConfig> read =
        TenantLimitsConfig::FromFile(options.tenant_limits_file);
    if (!read.ok()) return kept(read.status());
    limits = *std::move(read);
  }
  std::vector<std::string> what;
  if (keys.has_value()) {
    what.push_back(absl::StrCat(keys->num_keys(), " API keys of ", keys->tenants().size(),
                                " tenants from ", options.api_keys_file.string()));
  }
  if (limits.has_value()) {
    what.push_back(absl::StrCat("the limits of ", limits->tenant_names().size(),
                                " tenants and the default from ",
                                options.tenant_limits_file.string()));
    // The limits first: a key added now is never served before its tenant's limits are in force.
    tenant_limits.Set(*std::move(limits));
  }
  if (keys.has_value()) {
    auth.Set(*std::move(keys));
    WarnOfOpenAccess(options);  // the file's mode, again
  }
  WarnOfLimitsForUnknownTenants(*tenant_limits.Get(), *auth.Get());
  // Requests already admitted keep the snapshot they took; the next ones use these.
  return absl::StrCat("reloaded ", absl::StrJoin(what, " and "));
}

absl::StatusOr<std::unique_ptr<SdmServer>> SdmServer::Start(const ServerOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  if (absl::Status s = impl->Init(); !s.ok()) {
    impl->Shutdown().IgnoreError();  // nothing was served; persists nothing new
    return s;
  }
  return std::make_unique<SdmServer>(std::move(impl));
}

SdmServer::SdmServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

SdmServer::~SdmServer() {
  if (impl_ != nullptr) impl_->Shutdown().IgnoreError();
}

int SdmServer::port() const { return impl_->port; }
int SdmServer::metrics_port() const { return impl_->metrics_port; }
int SdmServer::http_port() const { return impl_->openai != nullptr ? impl_->openai->port() : 0; }

std::string SdmServer::address() const {
  std::string host = impl_->options.host;
  if (host == "0.0.0.0") host = "127.0.0.1";
  if (host == "::") host = "::1";
  return HostPort(host, impl_->port);
}

std::string SdmServer::listen_address() const { return HostPort(impl_->options.host, impl_->port); }

absl::Status SdmServer::Shutdown() { return impl_->Shutdown(); }

absl::StatusOr<std::string> SdmServer::ReloadConfig() { return impl_->ReloadConfig(); }

}  // namespace sdm
