#include "server/service.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/logprobs.h"
#include "engine/model_config.h"
#include "engine/sampler.h"
#include "engine/weight_spec.h"
#include "server/generate_stream.h"
#include "server/grpc_status.h"

namespace sdm {
namespace {

// Marks ContextTooLong's statuses.
constexpr absl::string_view kContextTooLongPayload = "sdmserve/context-too-long";

// A prompt of `tokens` (`with_bos`: " with BOS" or "") over max_prompt_tokens.
absl::Status PromptTooLongError(size_t tokens, absl::string_view with_bos,
                                int64_t max_prompt_tokens) {
  return ContextTooLong(absl::InvalidArgumentError(absl::StrCat(
      "the prompt has ", tokens, " tokens", with_bos,
      ", more than this server's maximum context length for a prompt (", max_prompt_tokens,
      " tokens, ModelInfo.max_prompt_tokens): shorten it, or feed it to a session in parts")));
}

void SetTimestamp(absl::Time t, google::protobuf::Timestamp& out) {
  const int64_t ns = absl::ToUnixNanos(t);
  int64_t seconds = ns / 1'000'000'000;
  int64_t nanos = ns % 1'000'000'000;
  if (nanos < 0) {
    nanos += 1'000'000'000;
    --seconds;
  }
  out.set_seconds(seconds);
  out.set_nanos(static_cast<int32_t>(nanos));
}

void SetDuration(absl::Duration d, google::protobuf::Duration& out) {
  const int64_t ns = absl::ToInt64Nanoseconds(d);
  out.set_seconds(ns / 1'000'000'000);
  out.set_nanos(static_cast<int32_t>(ns % 1'000'000'000));
}

// A request's ttl: unset or zero means the server's default (returned as ZeroDuration).
absl::StatusOr<absl::Duration> TtlOf(bool has_ttl, const google::protobuf::Duration& ttl,
                                     absl::string_view field) {
  if (!has_ttl) return absl::ZeroDuration();
  const int64_t s = ttl.seconds();
  const int32_t n = ttl.nanos();
  const bool valid = n > -1'000'000'000 && n < 1'000'000'000 && !(s > 0 && n < 0) &&
                     !(s < 0 && n > 0) && s <= int64_t{315'576'000'000};
  if (!valid || s < 0 || n < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " must be a non-negative duration (0 or unset: the server's default), got ", s, "s ",
        n, "ns"));
  }
  const absl::Duration d = absl::Seconds(s) + absl::Nanoseconds(n);
  if (d > kMaxSessionTtl) return TtlTooLongError(field, absl::StrCat(s, "s"));
  if (d > absl::ZeroDuration() && d < kMinSessionTtl) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be 0 or unset (the server's default) or at least ",
                     absl::FormatDuration(kMinSessionTtl),
                     " (shorter, the session could expire before it is "
                     "used), got ",
                     absl::FormatDuration(d)));
  }
  return d;
}

v1::Tier ToProtoTier(Tier tier) {
  switch (tier) {
    case Tier::kResident:
      return v1::TIER_RESIDENT;
    case Tier::kHost:
      return v1::TIER_HOST;
    case Tier::kDisk:
      return v1::TIER_DISK;
  }
  return v1::TIER_UNSPECIFIED;
}

v1::LayerType ToProtoLayerType(LayerType type) {
  switch (type) {
    case LayerType::kAttn:
      return v1::LAYER_TYPE_ATTENTION;
    case LayerType::kSwa:
      return v1::LAYER_TYPE_SLIDING_WINDOW;
    case LayerType::kSdm:
      return v1::LAYER_TYPE_SPARSE_DELTA_MEMORY;
  }
  return v1::LAYER_TYPE_UNSPECIFIED;
}

std::string ModelName(const Model& model, const std::string& configured) {
  if (!configured.empty()) return configured;
  std::filesystem::path dir = model.dir.lexically_normal();
  if (dir.filename().empty()) dir = dir.parent_path();
  const std::string name = dir.filename().string();
  return name.empty() ? "model" : name;
}

v1::ModelInfo BuildModelInfo(const Model& model, const Engine& engine, const Tokenizer& tokenizer,
                             const ServiceOptions& options) {
  const ModelConfig& c = model.config;
  v1::ModelInfo info;
  info.set_name(ModelName(model, options.model_name));
  info.set_dim(c.dim);
  info.set_n_layers(c.n_layers);
  int64_t counts[3] = {0, 0, 0};
  for (const LayerType type : c.layer_types) {
    info.add_layer_types(ToProtoLayerType(type));
    ++counts[static_cast<int>(type)];
  }
  const int64_t window =
      counts[static_cast<int>(LayerType::kSwa)] > 0 ? c.swa_window.value_or(0) : 0;
  info.set_swa_window(window);
  std::vector<std::string> parts;
  if (const int64_t n = counts[static_cast<int>(LayerType::kAttn)]; n > 0) {
    parts.push_back(absl::StrCat(n, " attn"));
  }
  if (const int64_t n = counts[static_cast<int>(LayerType::kSwa)]; n > 0) {
    parts.push_back(absl::StrCat(n, " swa window ", window));
  }
  if (const int64_t n = counts[static_cast<int>(LayerType::kSdm)]; n > 0) {
    const SdmGeometry g = SdmGeometryOf(c);
    v1::SdmInfo& sdm = *info.mutable_sdm();
    sdm.set_num_heads(g.heads);
    sdm.set_slots_per_head(g.slots_per_head);
    sdm.set_head_width(g.head_width);
    sdm.set_num_writes(c.sdm.num_writes);
    sdm.set_num_reads(c.sdm.num_reads);
    parts.push_back(absl::StrCat(n, " sdm ", g.heads, "x", g.slots_per_head, "x", g.head_width));
  }
  info.set_summary(absl::StrCat("dim ", c.dim, ", ", c.n_layers, " layers (",
                                absl::StrJoin(parts, ", "), "), vocab ", engine.vocab_size()));
  info.set_vocab_size(engine.vocab_size());
  v1::TokenizerInfo& tok = *info.mutable_tokenizer();
  tok.set_name(std::string(tokenizer.name()));
  tok.set_bos_id(tokenizer.bos_id());
  tok.set_eos_id(tokenizer.eos_id());
  tok.set_vocab_size(tokenizer.vocab_size());
  const ParameterCounts params = CountParameters(c);
  info.set_parameters(params.total);
  info.set_parameters_without_memory(params.without_m0);
  info.set_max_sdm_state_bytes(SdmStateElements(c) * static_cast<int64_t>(sizeof(float)));
  info.set_attention_cache_bytes_per_token(FullAttentionKvElementsPerToken(c) *
                                           engine.host_kv_value_bytes());
  info.set_max_prompt_tokens(options.max_prompt_tokens);
  info.set_max_tokens_limit(options.max_tokens_limit);
  info.set_config_json(ModelConfigToJson(c));
  info.set_max_session_tokens(options.max_session_tokens);
  return info;
}

absl::Status NotFound(absl::string_view id) {
  return absl::NotFoundError(absl::StrCat("session '", id, "' not found"));
}

// A store error as the caller sees it. The store names sessions by their id already; a snapshot
// of another format version or model (FAILED_PRECONDITION there) failed its checks like a
// damaged one, which callers see as DATA_LOSS. The file system refusing the server (EACCES or
// EPERM on its state directory: PERMISSION_DENIED from state_store/state_files.h) is the
// server's fault, INTERNAL: PERMISSION_DENIED would tell the caller it lacks a permission.
absl::Status FromStore(const absl::Status& status) {
  if (status.code() == absl::StatusCode::kPermissionDenied) {
    return absl::InternalError(
        absl::StrCat("the server's state directory refused it: ", status.message()));
  }
  if (status.code() != absl::StatusCode::kFailedPrecondition) return status;
  absl::Status out(absl::StatusCode::kDataLoss, status.message());
  if (const auto retry = RetryAfter(status)) out = WithRetryAfter(out, *retry);
  return out;
}

// The call's deadline; gRPC reports "none" as the clock's far future.
absl::Time DeadlineOf(const grpc::CallbackServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline >=
      std::chrono::system_clock::time_point::max() - std::chrono::hours(24 * 365 * 100)) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(deadline);
}

}  // namespace

absl::Status TtlTooLongError(absl::string_view field, absl::string_view got) {
  return absl::InvalidArgumentError(absl::StrCat(field, " must be at most 100 years (",
                                                 absl::ToInt64Seconds(kMaxSessionTtl),
                                                 " s; unset: the server's default), got ", got));
}

SdmServiceImpl::SdmServiceImpl(const ServiceDeps& deps, const ServiceOptions& options)
    : deps_(deps),
      options_(options),
      model_info_(BuildModelInfo(deps.model, deps.engine, deps.tokenizer, options)) {}

SdmServiceImpl::~SdmServiceImpl() = default;

void SdmServiceImpl::StopAdmitting() { admitting_.store(false); }

absl::StatusOr<std::string> SdmServiceImpl::TenantOf(
    const grpc::CallbackServerContext& context) const {
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find("authorization");
  absl::string_view authorization;
  if (it != metadata.end()) authorization = absl::string_view(it->second.data(), it->second.size());
  return deps_.auth.Get()->TenantFor(authorization, KeyCarrier::kGrpcMetadata);
}

void SdmServiceImpl::RecordRequest(absl::string_view method, absl::StatusCode code,
                                   Clock::time_point start) {
  deps_.metrics.Request(method, code).Increment();
  deps_.metrics.RequestDuration(method).Observe(
      std::chrono::duration<double>(Clock::now() - start).count());
}

template <typename Body>
grpc::ServerUnaryReactor* SdmServiceImpl::Unary(grpc::CallbackServerContext* context,
                                                absl::string_view method, Body&& body) {
  const Clock::time_point start = Clock::now();
  absl::StatusOr<std::string> tenant = TenantOf(*context);
  const absl::Status status = tenant.ok() ? body(*tenant) : tenant.status();
  RecordRequest(method, status.code(), start);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status, *context));
  return reactor;
}

absl::StatusOr<SdmServiceImpl::OwnedSession> SdmServiceImpl::FindSession(
    absl::string_view tenant, absl::string_view id) const {
  if (absl::Status s = ValidateSessionId(id); !s.ok()) return s;
  absl::StatusOr<SessionInfo> info = deps_.store.Get(SessionKey(tenant, id));
  if (!info.ok()) return FromStore(info.status());
  OwnedSession found;
  absl::StatusOr<SessionMetadata> metadata = DecodeSessionMetadata(info->metadata);
  if (metadata.ok()) {
    found.metadata = *std::move(metadata);
  } else if (info->error.empty()) {
    return NotFound(id);  // not a session this service created
  } else {
    // A snapshot whose record failed its checks at start-up: its metadata is lost, but its key
    // is this caller's (tenant, id), so the session is theirs to see and delete.
    found.metadata.tenant = std::string(tenant);
    found.metadata.id = std::string(id);
  }
  found.info = *std::move(info);
  // Past its ttl, a session is gone even before the store's sweep removes it (which can take a
  // moment, e.g. just after a restart).
  if (!found.info.in_use && found.info.ttl != absl::InfiniteDuration() &&
      found.info.last_used + found.info.ttl <= absl::Now()) {
    return NotFound(id);
  }
  return found;
}

absl::Mutex& SdmServiceImpl::CreateMutexFor(absl::string_view tenant) {
  absl::MutexLock lock(&create_mus_mu_);
  auto it = create_mus_.find(tenant);
  if (it == create_mus_.end()) {
    it = create_mus_.emplace(std::string(tenant), std::make_unique<absl::Mutex>()).first;
  }
  return *it->second;
}

absl::Status SdmServiceImpl::CheckTenantLimits(absl::string_view tenant, bool new_session) const {
  const TenantLimits limits = deps_.tenant_limits.Get()->For(tenant);
  if (!limits.max_sessions.has_value() && !limits.max_state_bytes.has_value()) {
    return absl::OkStatus();
  }
  const TenantUsage usage = deps_.store.Usage(tenant);
  absl::Status admitted = limits.Admit(tenant, usage.sessions, usage.state_bytes, new_session);
  if (admitted.ok()) return admitted;
  deps_.metrics.TenantLimitRefusals(tenant, RefusingTenantLimit(admitted)).Increment();
  if (!absl::IsResourceExhausted(admitted)) return admitted;  // a limit of 0: no retry
  return WithRetryAfter(admitted, options_.tenant_limit_retry_after);
}

void SdmServiceImpl::FillSession(const SessionInfo& info, const SessionMetadata& metadata,
                                 v1::Session& out) const {
  out.set_id(metadata.id);
  if (metadata.create_time != absl::Time()) {
    SetTimestamp(metadata.create_time, *out.mutable_create_time());
  }
  SetTimestamp(info.last_used, *out.mutable_last_used_time());
  if (info.ttl != absl::InfiniteDuration()) {
    SetDuration(info.ttl, *out.mutable_ttl());
    SetTimestamp(info.last_used + info.ttl, *out.mutable_expire_time());
  }
  for (const auto& [key, value] : metadata.labels) (*out.mutable_labels())[key] = value;
  // The history includes a token the scheduler left pending (generated, not read yet).
  out.set_position(info.position >= 0 ? info.position + (info.pending_token ? 1 : 0) : -1);
  out.set_state_bytes(info.bytes);
  out.set_tier(ToProtoTier(info.tier));
  out.set_generating(info.in_use);
  out.set_error(info.error);
}

// ---- Generate -------------------------------------------------------------------------------

absl::Status SdmServiceImpl::PrepareGenerate(absl::string_view tenant, absl::Time deadline,
                                             const v1::GenerateRequest& request, GenerateJob& job) {
  if (!admitting_.load()) {
    // Retryable at once: a router sends the retry to another replica (docs/replicas.md).
    return WithRetryAfter(
        absl::UnavailableError("the server is shutting down; retry when it is back"),
        options_.queue_full_retry_after);
  }
  const int64_t vocab = deps_.engine.vocab_size();
  // The caller's tenant, a one-shot job's too: the scheduler counts a tenant's requests
  // (max_requests) and shares the batch's places between tenants by it.
  job.session.tenant = std::string(tenant);
  job.tenant_max_requests = deps_.tenant_limits.Get()->For(tenant).max_requests;

  // The prompt, before anything that costs more than a check.
  switch (request.prompt_case()) {
    case v1::GenerateRequest::kText:
      if (request.text().empty()) {
        return absl::InvalidArgumentError("the prompt is empty: send non-empty text or token_ids");
      }
      break;
    case v1::GenerateRequest::kTokenIds: {
      const auto& ids = request.token_ids().ids();
      if (ids.empty()) {
        return absl::InvalidArgumentError("the prompt is empty: send non-empty text or token_ids");
      }
      for (int i = 0; i < ids.size(); ++i) {
        if (ids[i] < 0 || ids[i] >= vocab) {
          return absl::InvalidArgumentError(absl::StrCat(
              "token_ids.ids[", i, "] = ", ids[i], " is outside the vocabulary [0, ", vocab, ")"));
        }
      }
      if (static_cast<int64_t>(ids.size()) > options_.max_prompt_tokens) {
        return PromptTooLongError(ids.size(), "", options_.max_prompt_tokens);
      }
      break;
    }
    default:
      return absl::InvalidArgumentError("the prompt is missing: set text or token_ids");
  }

  // Sampling.
  const v1::SamplingParams& s = request.sampling();
  SamplingParams& p = job.sampling;
  p.max_tokens = s.has_max_tokens()
                     ? s.max_tokens()
                     : std::min(options_.default_max_tokens, options_.max_tokens_limit);
  if (p.max_tokens < 0 || p.max_tokens > options_.max_tokens_limit) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.max_tokens must be in [0, ",
                                                   options_.max_tokens_limit, "] (0: read the ",
                                                   "prompt only), got ", p.max_tokens));
  }
  p.temperature = s.temperature();
  p.top_k = s.top_k();
  p.top_p = s.has_top_p() ? s.top_p() : 1.0;
  p.seed = s.seed();
  if (s.stop_token_ids_size() > kMaxStopTokenIds) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.stop_token_ids has ",
                                                   s.stop_token_ids_size(), " ids; at most ",
                                                   kMaxStopTokenIds, " are allowed"));
  }
  p.stop_token_ids.assign(s.stop_token_ids().begin(), s.stop_token_ids().end());
  p.ignore_eos = s.ignore_eos();
  if (s.logit_bias_size() > kMaxLogitBias) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.logit_bias has ", s.logit_bias_size(),
                                                   " ids; at most ", kMaxLogitBias,
                                                   " are allowed"));
  }
  for (const auto& [id, bias] : s.logit_bias()) {
    if (id < 0 || id >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sampling.logit_bias: token id ", id, " is outside the vocabulary [0, ", vocab, ")"));
    }
    if (!(bias >= -kMaxLogitBiasValue && bias <= kMaxLogitBiasValue)) {  // NaN fails too
      return absl::InvalidArgumentError(absl::StrCat("sampling.logit_bias[", id, "] = ", bias,
                                                     " must be in [-", kMaxLogitBiasValue, ", ",
                                                     kMaxLogitBiasValue, "]"));
    }
    job.logit_bias.emplace_back(id, bias);
  }
  std::sort(job.logit_bias.begin(), job.logit_bias.end());  // the map's order is unspecified
  if (absl::Status v = ValidateSamplingParams(p, vocab); !v.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.", v.message()));
  }
  if (s.stop_size() > kMaxStopStrings) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.stop has ", s.stop_size(),
                                                   " strings; at most ", kMaxStopStrings,
                                                   " are allowed"));
  }
  for (int i = 0; i < s.stop_size(); ++i) {
    if (s.stop(i).empty() || s.stop(i).size() > kMaxStopStringBytes) {
      return absl::InvalidArgumentError(absl::StrCat("sampling.stop[", i, "] must have 1 to ",
                                                     kMaxStopStringBytes, " bytes, got ",
                                                     s.stop(i).size()));
    }
    job.stop_strings.push_back(s.stop(i));
  }
  if (request.has_logprobs()) {
    if (absl::Status s = CheckTopLogprobs(request.logprobs(), "logprobs"); !s.ok()) return s;
    job.logprobs = request.logprobs();
  }
  if (request.has_prompt_logprobs()) {
    if (absl::Status s = CheckTopLogprobs(request.prompt_logprobs(), "prompt_logprobs"); !s.ok()) {
      return s;
    }
    job.prompt_logprobs = request.prompt_logprobs();
  }

  // The session, and whether the sequence starts here.
  bool at_start = true;
  int64_t history = 0;  // tokens the session has read or will read before the prompt
  if (!request.session_id().empty()) {
    absl::StatusOr<OwnedSession> session = FindSession(tenant, request.session_id());
    if (!session.ok()) return session.status();
    if (!session->info.error.empty()) return absl::DataLossError(session->info.error);
    if (absl::Status limit = CheckTenantLimits(tenant, /*new_session=*/false); !limit.ok()) {
      return limit;
    }
    // The store knows every intact session's position (from its record when it is on disk).
    at_start = session->info.position == 0 && !session->info.pending_token;
    history = session->info.position + (session->info.pending_token ? 1 : 0);
    job.session = session->info.key;
    job.expected_history = history;  // Submit refuses the job if the session moved on meanwhile
  }
  const bool add_bos = request.has_add_bos() ? request.add_bos() : at_start;
  std::vector<int32_t>& prompt = job.prompt;
  if (request.prompt_case() == v1::GenerateRequest::kText) {
    prompt = deps_.tokenizer.Encode(request.text(), add_bos);
  } else {
    if (add_bos && deps_.tokenizer.bos_id() >= 0) prompt.push_back(deps_.tokenizer.bos_id());
    prompt.insert(prompt.end(), request.token_ids().ids().begin(), request.token_ids().ids().end());
  }
  if (prompt.empty()) {
    return absl::InvalidArgumentError("the prompt's text encodes to no tokens");
  }
  if (static_cast<int64_t>(prompt.size()) > options_.max_prompt_tokens) {
    return PromptTooLongError(prompt.size(), add_bos ? " with BOS" : "",
                              options_.max_prompt_tokens);
  }
  if (absl::Status s = FitInSession(request.session_id(), history, prompt.size(), job.sampling);
      !s.ok()) {
    return s;
  }
  job.deadline = deadline;
  return absl::OkStatus();
}

absl::Status SdmServiceImpl::SubmitGenerate(GenerateJob job,
                                            std::shared_ptr<JobObserver> observer) {
  const std::string user_id = job.session.id;
  const std::string tenant = job.session.tenant;
  absl::Status s = deps_.scheduler.Submit(std::move(job), std::move(observer));
  if (const std::string limit = RefusingTenantLimit(s); !limit.empty()) {
    deps_.metrics.TenantLimitRefusals(tenant, limit).Increment();
  }
  if (s.code() == absl::StatusCode::kResourceExhausted ||
      (s.code() == absl::StatusCode::kUnavailable && !RetryAfter(s).has_value())) {
    // Queue full; shutting down (a router sends the retry to another replica).
    s = WithRetryAfter(s, options_.queue_full_retry_after);
  } else if (s.code() == absl::StatusCode::kAborted && !IsSessionChanged(s)) {
    s = absl::AbortedError(absl::StrCat("session '", user_id,
                                        "' is already generating: one Generate at a time per "
                                        "session; retry when that call has finished"));
  }
  return FromStore(s);
}

absl::Status SdmServiceImpl::FitInSession(absl::string_view session_id, int64_t history,
                                          int64_t prompt_tokens, SamplingParams& sampling) const {
  const int64_t limit = options_.max_session_tokens;
  if (limit <= 0) return absl::OkStatus();  // none (a negative limit was never resolved)
  const int64_t room = limit - history - prompt_tokens;
  // Room for one generated token, unless the request generates none.
  if (room < (sampling.max_tokens == 0 ? 0 : 1)) {
    const std::string whose =
        session_id.empty() ? std::string("a one-shot request")
                           : absl::StrCat("session '", session_id, "' (", history, " tokens)");
    return ContextTooLong(absl::OutOfRangeError(absl::StrCat(
        "the prompt's ", prompt_tokens, " tokens leave no room in ", whose,
        " under this server's maximum context length of ", limit,
        " tokens of history per session (ModelInfo.max_session_tokens): start a new session")));
  }
  sampling.max_tokens = std::min(sampling.max_tokens, room);  // ends with FINISH_REASON_LENGTH
  return absl::OkStatus();
}

absl::Status ContextTooLong(absl::Status status) {
  status.SetPayload(kContextTooLongPayload, absl::Cord("1"));
  return status;
}

bool IsContextTooLong(const absl::Status& status) {
  return status.GetPayload(kContextTooLongPayload).has_value();
}

absl::Status RetryWhileSessionChanged(absl::FunctionRef<absl::Status()> attempt) {
  absl::Status status;
  for (int tries = 0; tries < kGenerateAttempts; ++tries) {
    status = attempt();
    if (!IsSessionChanged(status)) break;
  }
  return status;
}

int64_t DefaultMaxSessionTokens(int64_t kv_bytes_per_token, int64_t budget_bytes) {
  if (kv_bytes_per_token <= 0) return 0;
  return std::max<int64_t>(1, budget_bytes / kv_bytes_per_token);
}

int64_t ResolveMaxSessionTokens(int64_t configured, int64_t derived, int64_t engine_limit) {
  const int64_t limit = configured < 0 ? derived : configured;
  if (engine_limit <= 0) return limit;
  return limit == 0 ? engine_limit : std::min(limit, engine_limit);
}

grpc::ServerWriteReactor<v1::GenerateResponse>* SdmServiceImpl::Generate(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* request) {
  const Clock::time_point start = Clock::now();
  active_generates_.fetch_add(1);
  // gRPC owns the reactor until its OnDone (which deletes it).
  auto* reactor = new GenerateReactor([this] { active_generates_.fetch_sub(1); });
  auto stream = std::make_shared<GenerateStream>(
      reactor, context, [this, start](const absl::Status& status, const v1::Usage& usage) {
        RecordRequest("Generate", status.code(), start);
        deps_.metrics.prompt_tokens.Increment(static_cast<double>(usage.prompt_tokens()));
        deps_.metrics.history_tokens.Increment(static_cast<double>(usage.history_tokens()));
        deps_.metrics.generated_tokens.Increment(static_cast<double>(usage.generated_tokens()));
      });
  reactor->set_stream(stream);

  const absl::StatusOr<std::string> tenant = TenantOf(*context);
  absl::Status s = tenant.status();
  if (s.ok()) {
    s = RetryWhileSessionChanged([&] {
      GenerateJob job;
      if (absl::Status prepared = PrepareGenerate(*tenant, DeadlineOf(*context), *request, job);
          !prepared.ok()) {
        return prepared;
      }
      stream->set_deadline(job.deadline);
      return SubmitGenerate(std::move(job), stream);
    });
  }
  if (!s.ok()) stream->Reject(s);
  return reactor;
}

// ---- Sessions -------------------------------------------------------------------------------

absl::Status SdmServiceImpl::DoCreateSession(absl::string_view tenant,
                                             const v1::CreateSessionRequest& request,
                                             v1::Session& response) {
  if (!request.session_id().empty()) {
    if (absl::Status s = ValidateSessionId(request.session_id()); !s.ok()) return s;
  }
  const Labels labels(request.labels().begin(), request.labels().end());
  if (absl::Status s = ValidateLabels(labels); !s.ok()) return s;
  absl::StatusOr<absl::Duration> ttl = TtlOf(request.has_ttl(), request.ttl(), "ttl");
  if (!ttl.ok()) return ttl.status();

  SessionMetadata metadata;
  metadata.tenant = std::string(tenant);
  metadata.labels = labels;
  SessionKey key;
  {
    absl::MutexLock lock(&CreateMutexFor(tenant));
    if (absl::Status s = CheckTenantLimits(tenant, /*new_session=*/true); !s.ok()) return s;
    // A server-chosen id is random (96 bits): a clash is retried, not reported.
    for (int attempt = 0;; ++attempt) {
      metadata.id = request.session_id().empty() ? NewSessionId() : request.session_id();
      metadata.create_time = SessionCreateTimeNow();
      key = SessionKey(tenant, metadata.id);
      absl::Status s = deps_.store.Create(key, EncodeSessionMetadata(metadata), *ttl);
      if (s.ok()) break;
      if (s.code() == absl::StatusCode::kAlreadyExists) {
        if (request.session_id().empty() && attempt < 8) continue;
        return absl::AlreadyExistsError(
            absl::StrCat("session '", metadata.id,
                         "' already exists: choose another id, or leave it empty and the server "
                         "picks one"));
      }
      return FromStore(s);
    }
  }
  absl::StatusOr<SessionInfo> info = deps_.store.Get(key);
  if (!info.ok()) return FromStore(info.status());
  FillSession(*info, metadata, response);
  return absl::OkStatus();
}

absl::Status SdmServiceImpl::DoGetSession(absl::string_view tenant,
                                          const v1::GetSessionRequest& request,
                                          v1::Session& response) {
  absl::StatusOr<OwnedSession> session = FindSession(tenant, request.session_id());
  if (!session.ok()) return session.status();
  // A quarantined session (its snapshot failed its checks) answers as Generate and Fork do: its
  // state is lost, and the message says so and what to do (delete it).
  if (!session->info.error.empty()) return absl::DataLossError(session->info.error);
  FillSession(session->info, session->metadata, response);
  return absl::OkStatus();
}

absl::Status SdmServiceImpl::DoListSessions(absl::string_view tenant,
                                            const v1::ListSessionsRequest& request,
                                            v1::ListSessionsResponse& response) {
  if (request.page_size() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size must be >= 0 (0: 100), got ", request.page_size()));
  }
  const size_t page_size =
      request.page_size() == 0 ? 100 : static_cast<size_t>(std::min(request.page_size(), 1000));
  const Labels selector(request.label_selector().begin(), request.label_selector().end());
  std::string after;
  if (!request.page_token().empty()) {
    absl::StatusOr<std::string> last = DecodePageToken(request.page_token(), selector);
    if (!last.ok()) return last.status();
    after = *std::move(last);
  }
  // The tenant's sessions, ordered by the id its users see.
  for (const SessionInfo& info : deps_.store.List(tenant)) {
    if (info.key.id <= after) continue;
    absl::StatusOr<SessionMetadata> metadata = DecodeSessionMetadata(info.metadata);
    if (!metadata.ok()) {
      if (info.error.empty()) continue;  // not a session this service created
      // Its record failed its checks at start-up (see FindSession): listed without labels.
      metadata = SessionMetadata();
      metadata->tenant = std::string(tenant);
      metadata->id = info.key.id;
    }
    const bool selected = std::all_of(selector.begin(), selector.end(), [&](const auto& kv) {
      const auto it = metadata->labels.find(kv.first);
      return it != metadata->labels.end() && it->second == kv.second;
    });
    if (!selected) continue;
    if (static_cast<size_t>(response.sessions_size()) == page_size) {
      response.set_next_page_token(
          EncodePageToken(response.sessions(response.sessions_size() - 1).id(), selector));
      break;
    }
    FillSession(info, *metadata, *response.add_sessions());
  }
  return absl::OkStatus();
}

absl::Status SdmServiceImpl::DoDeleteSession(absl::string_view tenant,
                                             const v1::DeleteSessionRequest& request) {
  absl::StatusOr<OwnedSession> session = FindSession(tenant, request.session_id());
  if (!session.ok()) return session.status();
  absl::Status s = deps_.store.Delete(session->info.key);
  if (s.code() == absl::StatusCode::kAborted) {
    return absl::AbortedError(absl::StrCat("session '", request.session_id(),
                                           "' is generating: cancel that Generate call or wait "
                                           "for it to finish, then delete the session"));
  }
  return FromStore(s);
}

absl::Status SdmServiceImpl::DoForkSession(absl::string_view tenant,
                                           const v1::ForkSessionRequest& request,
                                           v1::Session& response) {
  absl::StatusOr<OwnedSession> source = FindSession(tenant, request.session_id());
  if (!source.ok()) return source.status();
  if (!request.new_session_id().empty()) {
    if (absl::Status s = ValidateSessionId(request.new_session_id(), "new_session_id"); !s.ok()) {
      return s;
    }
  }
  const Labels labels(request.labels().begin(), request.labels().end());
  if (absl::Status s = ValidateLabels(labels); !s.ok()) return s;
  absl::StatusOr<absl::Duration> ttl = TtlOf(request.has_ttl(), request.ttl(), "ttl");
  if (!ttl.ok()) return ttl.status();
  if (!source->info.error.empty()) return absl::DataLossError(source->info.error);

  SessionMetadata metadata;
  metadata.tenant = std::string(tenant);
  metadata.labels = labels;
  SessionKey key;
  {
    absl::MutexLock lock(&CreateMutexFor(tenant));
    if (absl::Status s = CheckTenantLimits(tenant, /*new_session=*/true); !s.ok()) return s;
    for (int attempt = 0;; ++attempt) {
      metadata.id = request.new_session_id().empty() ? NewSessionId() : request.new_session_id();
      metadata.create_time = SessionCreateTimeNow();
      key = SessionKey(tenant, metadata.id);
      absl::Status s =
          deps_.store.Fork(source->info.key, key, EncodeSessionMetadata(metadata), *ttl);
      if (s.ok()) break;
      switch (s.code()) {
        case absl::StatusCode::kAlreadyExists:
          if (request.new_session_id().empty() && attempt < 8) continue;
          return absl::AlreadyExistsError(absl::StrCat(
              "session '", metadata.id,
              "' already exists: choose another new_session_id, or leave it empty and the server "
              "picks one"));
        case absl::StatusCode::kAborted:
          return absl::AbortedError(absl::StrCat("session '", request.session_id(),
                                                 "' is generating: fork it when that Generate "
                                                 "call has finished"));
        default:
          return FromStore(s);
      }
    }
  }
  absl::StatusOr<SessionInfo> info = deps_.store.Get(key);
  if (!info.ok()) return FromStore(info.status());
  FillSession(*info, metadata, response);
  return absl::OkStatus();
}

absl::Status SdmServiceImpl::DoDetokenize(const v1::DetokenizeRequest& request,
                                          v1::DetokenizeResponse& response) {
  const int64_t vocab = deps_.engine.vocab_size();
  const auto& ids = request.token_ids();
  for (int i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token_ids[", i, "] = ", ids[i], " is outside the vocabulary [0, ", vocab, ")"));
    }
  }
  response.set_text(deps_.tokenizer.Decode(std::span<const int32_t>(ids.data(), ids.size())));
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* SdmServiceImpl::CreateSession(grpc::CallbackServerContext* context,
                                                        const v1::CreateSessionRequest* request,
                                                        v1::Session* response) {
  return Unary(context, "CreateSession", [&](absl::string_view tenant) {
    return DoCreateSession(tenant, *request, *response);
  });
}

grpc::ServerUnaryReactor* SdmServiceImpl::GetSession(grpc::CallbackServerContext* context,
                                                     const v1::GetSessionRequest* request,
                                                     v1::Session* response) {
  return Unary(context, "GetSession",
               [&](absl::string_view tenant) { return DoGetSession(tenant, *request, *response); });
}

grpc::ServerUnaryReactor* SdmServiceImpl::ListSessions(grpc::CallbackServerContext* context,
                                                       const v1::ListSessionsRequest* request,
                                                       v1::ListSessionsResponse* response) {
  return Unary(context, "ListSessions", [&](absl::string_view tenant) {
    return DoListSessions(tenant, *request, *response);
  });
}

grpc::ServerUnaryReactor* SdmServiceImpl::DeleteSession(grpc::CallbackServerContext* context,
                                                        const v1::DeleteSessionRequest* request,
                                                        v1::DeleteSessionResponse* response) {
  return Unary(context, "DeleteSession",
               [&](absl::string_view tenant) { return DoDeleteSession(tenant, *request); });
}

grpc::ServerUnaryReactor* SdmServiceImpl::ForkSession(grpc::CallbackServerContext* context,
                                                      const v1::ForkSessionRequest* request,
                                                      v1::Session* response) {
  return Unary(context, "ForkSession", [&](absl::string_view tenant) {
    return DoForkSession(tenant, *request, *response);
  });
}

grpc::ServerUnaryReactor* SdmServiceImpl::Tokenize(grpc::CallbackServerContext* context,
                                                   const v1::TokenizeRequest* request,
                                                   v1::TokenizeResponse* response) {
  return Unary(context, "Tokenize", [&](absl::string_view) {
    for (const int32_t id : deps_.tokenizer.Encode(request->text(), request->add_bos())) {
      response->add_token_ids(id);
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SdmServiceImpl::Detokenize(grpc::CallbackServerContext* context,
                                                     const v1::DetokenizeRequest* request,
                                                     v1::DetokenizeResponse* response) {
  return Unary(context, "Detokenize",
               [&](absl::string_view) { return DoDetokenize(*request, *response); });
}

grpc::ServerUnaryReactor* SdmServiceImpl::GetModelInfo(grpc::CallbackServerContext* context,
                                                       const v1::GetModelInfoRequest* request,
                                                       v1::ModelInfo* response) {
  return Unary(context, "GetModelInfo", [&](absl::string_view) {
    *response = model_info_;
    return absl::OkStatus();
  });
}

}  // namespace sdm
