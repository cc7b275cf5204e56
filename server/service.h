// SdmServiceImpl: the sdm.v1.SdmService RPCs (proto/sdm/v1/sdm.proto, docs/api.md) on top of the
// engine, the session store and the scheduler. Protobuf <-> native conversion happens here and
// nowhere below.
//
// Every RPC uses gRPC's callback API. Each call first authenticates (ApiKeyAuthenticator: the
// `authorization: Bearer KEY` metadata names the tenant), then validates everything it was sent,
// and only then acts; every failure is an absl::Status turned into the call's gRPC status by
// ToGrpcStatus (server/grpc_status.h), with a message naming the field or session and what to do.
//
// Tenancy: sessions are stored under SessionKey{tenant, id} (state_store/session_key.h), so
// another tenant's session is NOT_FOUND exactly like one that does not exist, and the store's
// errors name a session by the id its user gave. Per-tenant limits (TenantLimitsConfig) are
// enforced at CreateSession and ForkSession (sessions and state bytes) and at Generate on a
// session (state bytes), as RESOURCE_EXHAUSTED with a retry hint, against the store's per-tenant
// counters (no listing).
//
// Generate: validated, tokenized (BOS policy in docs/api.md), then submitted to the Scheduler,
// which refuses a full queue, a busy or unknown session before anything is sent. Tokens reach the
// call through a GenerateStream (server/generate_stream.h), which never blocks the scheduler's step
// thread: chunks not yet written are merged into one pending chunk, so a slow reader receives
// fewer, larger chunks; memory stays bounded by max_tokens_limit. Client cancellation and the
// call's deadline end the job within one scheduler step.
//
// Thread-safety: the RPC methods run concurrently on gRPC's threads; StopAdmitting() may be
// called from any thread. Everything passed in ServiceDeps must outlive the service.
#ifndef SDMSERVE_SERVER_SERVICE_H_
#define SDMSERVE_SERVER_SERVICE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/reloadable.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/tokenizer.h"
#include "grpcpp/grpcpp.h"
#include "sdm/v1/sdm.grpc.pb.h"
#include "server/auth.h"
#include "server/metrics/server_metrics.h"
#include "server/scheduler.h"
#include "server/tenancy.h"
#include "server/tenant_limits.h"
#include "state_store/session_store.h"

namespace sdm {

struct ServiceOptions {
  // The model's name in ModelInfo; empty: the model directory's name.
  std::string model_name;
  // Limits on a prompt (tokens, with an added BOS) and on SamplingParams.max_tokens.
  int64_t max_prompt_tokens = 8192;
  int64_t max_tokens_limit = 4096;
  // max_tokens when the request leaves it unset (at most max_tokens_limit).
  int64_t default_max_tokens = 256;
  // The longest history (tokens) a session may reach; 0: no limit; negative: SdmServer derives
  // it from the model and its budgets (DefaultMaxSessionTokens).
  int64_t max_session_tokens = -1;
  // Retry hints sent with RESOURCE_EXHAUSTED.
  absl::Duration queue_full_retry_after = absl::Seconds(1);
  absl::Duration tenant_limit_retry_after = absl::Seconds(30);
};

// The default limit on a session's history: the tokens whose full-attention key/value cache
// (kv_bytes_per_token each; ModelInfo.attention_cache_bytes_per_token) fills `budget_bytes`,
// the memory one session may occupy while it is stepped (the resident tier's budget, or the
// device's session-state capacity when that is smaller). 0 (no limit) when the model has no
// full-attention layer: SDM and sliding-window state has a fixed size.
int64_t DefaultMaxSessionTokens(int64_t kv_bytes_per_token, int64_t budget_bytes);

// ServiceOptions::max_session_tokens as the server applies it: `configured` (0: none; negative:
// `derived`, DefaultMaxSessionTokens), never past `engine_limit` (Engine::max_session_positions:
// 0 none), where a longer session would fail its step, and every other request of that step.
int64_t ResolveMaxSessionTokens(int64_t configured, int64_t derived, int64_t engine_limit);

// The shortest ttl a session may be given (Create, Fork): a shorter one could expire before its
// creator's next call reached the server (0 or unset means the server's default instead).
inline constexpr absl::Duration kMinSessionTtl = absl::Seconds(1);
// The longest: 100 years (a longer one would not fit the nanoseconds of the times reported with
// it, expire_time included; 292 years is the int64 limit). Longer ones are refused.
inline constexpr absl::Duration kMaxSessionTtl = absl::Hours(24 * 36525);
// The error for a ttl longer than kMaxSessionTtl: "`field` must be at most 100 years (...), got
// `got`". Both APIs refuse one with it (HTTP's ttl_seconds may be past what a
// google.protobuf.Duration holds, so it is refused before it reaches the service).
absl::Status TtlTooLongError(absl::string_view field, absl::string_view got);

// Limits on what a Generate request may carry besides the prompt.
inline constexpr int kMaxStopStrings = 16;
inline constexpr size_t kMaxStopStringBytes = 256;
inline constexpr int kMaxStopTokenIds = 1024;
// SamplingParams.logit_bias: at most this many ids, each bias in [-kMaxLogitBiasValue,
// kMaxLogitBiasValue] (OpenAI's limits).
inline constexpr int kMaxLogitBias = 300;
inline constexpr float kMaxLogitBiasValue = 100;

// How many times a front end prepares and submits one Generate when its session changed between
// the read that prepared it and the lease (IsSessionChanged): another turn or replica wrote the
// session in that window, which is rare, so a few tries settle it; the last refusal (ABORTED)
// goes to the client.
inline constexpr int kGenerateAttempts = 3;

// Runs `attempt` (read the session, prepare a job, submit it) again while it fails with
// IsSessionChanged, at most kGenerateAttempts times in all; returns its last status.
absl::Status RetryWhileSessionChanged(absl::FunctionRef<absl::Status()> attempt);

// A Generate refused because its prompt does not fit this server's context limits: a prompt over
// max_prompt_tokens (INVALID_ARGUMENT), or one that leaves no room in its session under
// max_session_tokens (OUT_OF_RANGE). Marked so that IsContextTooLong recognises it (the HTTP API
// answers it as OpenAI's context_length_exceeded, which clients trim their history on).
absl::Status ContextTooLong(absl::Status status);
bool IsContextTooLong(const absl::Status& status);

struct ServiceDeps {
  const Model& model;
  const Engine& engine;
  const Tokenizer& tokenizer;
  SessionStateStore& store;
  Scheduler& scheduler;
  ServerMetrics& metrics;
  // Replaced whole on a reload (SdmServer::ReloadConfig); a request uses the snapshot it took.
  const Reloadable<ApiKeyAuthenticator>& auth;
  const Reloadable<TenantLimitsConfig>& tenant_limits;
};

class SdmServiceImpl final : public v1::SdmService::CallbackService {
 public:
  SdmServiceImpl(const ServiceDeps& deps, const ServiceOptions& options);
  ~SdmServiceImpl() override;

  // From now on, Generate calls are refused with UNAVAILABLE (graceful shutdown: the server
  // drains). Other RPCs keep working until the gRPC server stops.
  void StopAdmitting();

  // Generate calls whose reactor has not finished yet.
  int active_generates() const { return active_generates_.load(); }

  const v1::ModelInfo& model_info() const { return model_info_; }
  const Tokenizer& tokenizer() const { return deps_.tokenizer; }

  // ---- Transport-independent API, shared with the OpenAI-compatible HTTP front
  // (server/http/openai_server.h). The caller has authenticated `tenant`; every method validates
  // its request exactly as the RPC of the same name does and returns the same errors.

  // Everything Generate checks and computes before it submits; the prompt in `job` has BOS.
  // `deadline`: when the job must end (InfiniteFuture: none).
  absl::Status PrepareGenerate(absl::string_view tenant, absl::Time deadline,
                               const v1::GenerateRequest& request, GenerateJob& job);
  // Submits a prepared job; refusals carry the RPC's messages and retry hints.
  absl::Status SubmitGenerate(GenerateJob job, std::shared_ptr<JobObserver> observer);
  absl::Status DoCreateSession(absl::string_view tenant, const v1::CreateSessionRequest& request,
                               v1::Session& response);
  absl::Status DoGetSession(absl::string_view tenant, const v1::GetSessionRequest& request,
                            v1::Session& response);
  absl::Status DoListSessions(absl::string_view tenant, const v1::ListSessionsRequest& request,
                              v1::ListSessionsResponse& response);
  absl::Status DoDeleteSession(absl::string_view tenant, const v1::DeleteSessionRequest& request);
  absl::Status DoForkSession(absl::string_view tenant, const v1::ForkSessionRequest& request,
                             v1::Session& response);
  absl::Status DoDetokenize(const v1::DetokenizeRequest& request, v1::DetokenizeResponse& response);
  // The most requests `tenant` may have waiting or running (TenantLimits::max_requests; nullopt:
  // no limit), as the key and limits files say now.
  std::optional<int64_t> TenantMaxRequests(absl::string_view tenant) const {
    return deps_.tenant_limits.Get()->For(tenant).max_requests;
  }
  // Counts one finished request of `method` in the server's metrics.
  void RecordRequest(absl::string_view method, absl::StatusCode code,
                     std::chrono::steady_clock::time_point start);

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* context,
                                          const v1::CreateSessionRequest* request,
                                          v1::Session* response) override;
  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* context,
                                       const v1::GetSessionRequest* request,
                                       v1::Session* response) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* context,
                                         const v1::ListSessionsRequest* request,
                                         v1::ListSessionsResponse* response) override;
  grpc::ServerUnaryReactor* DeleteSession(grpc::CallbackServerContext* context,
                                          const v1::DeleteSessionRequest* request,
                                          v1::DeleteSessionResponse* response) override;
  grpc::ServerUnaryReactor* ForkSession(grpc::CallbackServerContext* context,
                                        const v1::ForkSessionRequest* request,
                                        v1::Session* response) override;
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* context,
                                     const v1::TokenizeRequest* request,
                                     v1::TokenizeResponse* response) override;
  grpc::ServerUnaryReactor* Detokenize(grpc::CallbackServerContext* context,
                                       const v1::DetokenizeRequest* request,
                                       v1::DetokenizeResponse* response) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::ModelInfo* response) override;

 private:
  using Clock = std::chrono::steady_clock;

  // A session of the caller's tenant, found in the store.
  struct OwnedSession {
    SessionInfo info;  // info.key: the caller's tenant and the id it gave
    SessionMetadata metadata;
  };

  // The caller's tenant, or UNAUTHENTICATED.
  absl::StatusOr<std::string> TenantOf(const grpc::CallbackServerContext& context) const;
  // Runs a unary RPC body (after authentication), records its metrics and finishes the call.
  template <typename Body>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* context, absl::string_view method,
                                  Body&& body);

  // NOT_FOUND unless `tenant` owns a session `id`.
  absl::StatusOr<OwnedSession> FindSession(absl::string_view tenant, absl::string_view id) const;
  // RESOURCE_EXHAUSTED when one more session (new_session) or any more state would pass the
  // tenant's limits.
  absl::Status CheckTenantLimits(absl::string_view tenant, bool new_session) const;
  void FillSession(const SessionInfo& info, const SessionMetadata& metadata,
                   v1::Session& out) const;
  // Applies max_session_tokens to a turn on a session holding `history` tokens (0 for a
  // one-shot request): OUT_OF_RANGE naming the limit when the prompt leaves no room for one
  // generated token, else cuts sampling.max_tokens to the room left.
  absl::Status FitInSession(absl::string_view session_id, int64_t history, int64_t prompt_tokens,
                            SamplingParams& sampling) const;

  const ServiceDeps deps_;
  const ServiceOptions options_;
  v1::ModelInfo model_info_;
  std::atomic<bool> admitting_{true};
  std::atomic<int> active_generates_{0};
  // Serialises a tenant's session creation (Create, Fork), so that its limits are checked and the
  // session added as one step. One mutex per tenant: a fork may decode a parked session or wait
  // for etcd, and other tenants do not wait for it. Tenants are the key file's (or "default"):
  // the map stays small, and entries stay.
  absl::Mutex& CreateMutexFor(absl::string_view tenant) ABSL_LOCKS_EXCLUDED(create_mus_mu_);
  absl::Mutex create_mus_mu_;
  std::map<std::string, std::unique_ptr<absl::Mutex>, std::less<>> create_mus_
      ABSL_GUARDED_BY(create_mus_mu_);
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_SERVICE_H_
