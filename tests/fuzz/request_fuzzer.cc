// libFuzzer target for what callers send, through the service's own validation without the
// transport: sdm.v1 request messages (proto/sdm/v1/sdm.proto) parsed from the input and handed to
// SdmServiceImpl's transport-independent methods (server/service.h) — PrepareGenerate and the
// session RPCs — and the OpenAI-compatible front's JSON bodies (server/http/openai_json.h) taken
// the way its handler takes them (parsed, the chat template rendered, then PrepareGenerate).
// Any input must be answered with a status, never a crash, undefined behaviour or a leak (built
// with ASan and UBSan; see scripts/fuzz.sh).
//
// The service runs on a tiny random model with the byte tokenizer, an in-memory store without a
// background worker, small limits (prompt, max_tokens, history, a tenant's sessions) and two
// sessions: "s1" with 40 tokens of history and "s2" with none. Nothing is ever submitted to the
// scheduler; sessions the input creates or forks are deleted again, and a deleted fixture is
// recreated, so every input meets the same service.
//
// Input: one mode byte, then the message; mode % 9 selects GenerateRequest, CreateSessionRequest,
// GetSessionRequest, ListSessionsRequest, DeleteSessionRequest, ForkSessionRequest,
// DetokenizeRequest (protobuf wire format; inputs that do not parse are skipped, as gRPC refuses
// them before any handler), or an OpenAI /v1/completions or /v1/chat/completions body (JSON).
//
// Properties: each method answers only the status codes docs/api.md lists for it; a prepared
// job has a prompt of valid ids within the limits, max_tokens within [1, the limit] and room in
// its session; a created or forked session is found by Get with the id the call returned; a
// listing's next_page_token is accepted by the next call; detokenized text is valid UTF-8.
//
// `request_fuzzer --write-seeds=DIR` writes a seed corpus of valid requests to DIR and exits.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/tokenizer.h"
#include "google/protobuf/stubs/logging.h"
#include "prometheus/registry.h"
#include "sdm/v1/sdm.pb.h"
#include "server/auth.h"
#include "server/http/chat_template.h"
#include "server/http/openai_json.h"
#include "server/metrics/server_metrics.h"
#include "server/scheduler.h"
#include "server/service.h"
#include "server/tenancy.h"
#include "server/tenant_limits.h"
#include "state_store/session_store.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using namespace sdm::fuzz;  // NOLINT: the fuzzers' shared helpers
using sdm::v1::GenerateRequest;

constexpr char kTenant[] = "default";
constexpr int64_t kMaxPromptTokens = 64;
constexpr int64_t kMaxTokensLimit = 48;
constexpr int64_t kMaxSessionTokens = 96;
constexpr int64_t kHistory = 40;  // of "s1"
constexpr int64_t kMaxSessions = 6;

enum Mode {
  kGenerate,
  kCreate,
  kGet,
  kList,
  kDelete,
  kFork,
  kDetokenize,
  kOpenAiCompletions,
  kOpenAiChat,
  kNumModes
};

// The service and everything it runs on, built once.
struct Fixture {
  std::shared_ptr<const sdm::Model> model;
  std::unique_ptr<sdm::Engine> engine;
  std::unique_ptr<sdm::Tokenizer> tokenizer;
  std::unique_ptr<sdm::SessionStateStore> store;
  std::unique_ptr<prometheus::Registry> registry;
  std::unique_ptr<sdm::ServerMetrics> metrics;
  std::unique_ptr<sdm::Scheduler> scheduler;
  sdm::Reloadable<sdm::ApiKeyAuthenticator> auth;
  sdm::Reloadable<sdm::TenantLimitsConfig> limits;
  std::unique_ptr<sdm::SdmServiceImpl> service;
  sdm::ChatTemplate chat;
};

void CreateFixtureSession(Fixture& f, const std::string& id, int64_t history) {
  sdm::v1::CreateSessionRequest create;
  create.set_session_id(id);
  (*create.mutable_labels())["app"] = "fuzz";
  sdm::v1::Session session;
  if (!f.service->DoCreateSession(kTenant, create, session).ok()) Fail("fixture session");
  if (history == 0) return;
  absl::StatusOr<sdm::SessionLease> lease = f.store->Acquire(sdm::SessionKey(kTenant, id));
  if (!lease.ok()) Fail("fixture lease");
  const std::vector<int32_t> tokens(static_cast<size_t>(history), 'a');
  if (!f.engine->Prefill(lease->state(), tokens, false, nullptr).ok()) Fail("fixture prefill");
}

Fixture& Service() {
  static Fixture* const fixture = [] {
    // Protobuf logs every string field that is not UTF-8 (such inputs are skipped, as gRPC
    // refuses them); thousands of lines a second would drown a report.
    google::protobuf::SetLogHandler(
        +[](google::protobuf::LogLevel, const char*, int, const std::string&) {});
    auto* f = new Fixture();
    absl::StatusOr<sdm::ModelConfig> config = sdm::PresetConfig("tiny");
    if (!config.ok()) Fail("tiny preset");
    f->model = sdm::RandomModel(*config, 7);
    sdm::EngineOptions engine_options;
    engine_options.num_threads = 1;
    absl::StatusOr<std::unique_ptr<sdm::Engine>> engine =
        sdm::Engine::Create(f->model, engine_options);
    if (!engine.ok()) Fail("engine");
    f->engine = *std::move(engine);
    f->tokenizer = sdm::Tokenizer::CreateByteTokenizer();
    sdm::SessionStoreOptions store_options;
    store_options.background = false;
    absl::StatusOr<std::unique_ptr<sdm::SessionStateStore>> store = sdm::SessionStateStore::Open(
        f->engine->state_layout(), f->engine->fingerprint(), store_options);
    if (!store.ok()) Fail("store");
    f->store = *std::move(store);
    f->registry = std::make_unique<prometheus::Registry>();
    f->metrics = std::make_unique<sdm::ServerMetrics>(*f->registry);
    f->scheduler = std::make_unique<sdm::Scheduler>(*f->engine, *f->store, *f->tokenizer,
                                                    sdm::SchedulerOptions{});
    absl::StatusOr<sdm::TenantLimitsConfig> limits = sdm::TenantLimitsConfig::Parse(
        absl::StrCat(R"({"default": {"max_sessions": )", kMaxSessions, "}}"));
    if (!limits.ok()) Fail("limits");
    f->limits.Set(*std::move(limits));
    sdm::ServiceOptions options;
    options.max_prompt_tokens = kMaxPromptTokens;
    options.max_tokens_limit = kMaxTokensLimit;
    options.default_max_tokens = 16;
    options.max_session_tokens = kMaxSessionTokens;
    f->service = std::make_unique<sdm::SdmServiceImpl>(
        sdm::ServiceDeps{*f->model, *f->engine, *f->tokenizer, *f->store, *f->scheduler,
                         *f->metrics, f->auth, f->limits},
        options);
    CreateFixtureSession(*f, "s1", kHistory);
    CreateFixtureSession(*f, "s2", 0);
    return f;
  }();
  return *fixture;
}

bool IsValidUtf8(const std::string& s) { return sdm::SanitizeUtf8(s, true, nullptr) == s; }

void ExpectCode(const absl::Status& s, std::initializer_list<absl::StatusCode> allowed,
                const char* method) {
  if (s.ok()) return;
  for (const absl::StatusCode code : allowed) {
    if (s.code() == code) {
      if (s.message().empty()) Fail("an error without a message");
      return;
    }
  }
  std::fprintf(stderr, "%s answered %s\n", method, s.ToString().c_str());
  Fail("a status code the method does not document");
}

// Restores the fixture sessions and removes every other (the input's creations).
void Reset(Fixture& f) {
  for (const sdm::SessionInfo& info : f.store->List(kTenant)) {
    if (info.key.id == "s1" || info.key.id == "s2") continue;
    if (!f.store->Delete(info.key).ok()) Fail("cannot delete a session the input made");
  }
  if (!f.store->Get(sdm::SessionKey(kTenant, "s1")).ok()) CreateFixtureSession(f, "s1", kHistory);
  if (!f.store->Get(sdm::SessionKey(kTenant, "s2")).ok()) CreateFixtureSession(f, "s2", 0);
}

void CheckPrepared(Fixture& f, const GenerateRequest& request, const absl::Status& s,
                   const sdm::GenerateJob& job) {
  using C = absl::StatusCode;
  ExpectCode(s, {C::kInvalidArgument, C::kNotFound, C::kOutOfRange, C::kResourceExhausted},
             "Generate");
  if (!s.ok()) return;
  if (job.prompt.empty() || static_cast<int64_t>(job.prompt.size()) > kMaxPromptTokens) {
    Fail("a prepared prompt outside the limits");
  }
  for (const int32_t id : job.prompt) {
    if (id < 0 || id >= f.engine->vocab_size()) Fail("a prepared prompt with an invalid id");
  }
  if (job.sampling.max_tokens < 0 || job.sampling.max_tokens > kMaxTokensLimit) {
    Fail("max_tokens outside [0, limit]");
  }
  const int64_t history = request.session_id() == "s1" ? kHistory : 0;
  if (history + static_cast<int64_t>(job.prompt.size()) + job.sampling.max_tokens >
      kMaxSessionTokens) {
    Fail("a prepared turn that does not fit in its session");
  }
  if (job.session.id != request.session_id()) Fail("the job is on another session");
}

void CheckGenerate(Fixture& f, const GenerateRequest& request) {
  sdm::GenerateJob job;
  const absl::Status s = f.service->PrepareGenerate(kTenant, absl::InfiniteFuture(), request, job);
  CheckPrepared(f, request, s, job);
}

// A session just made is found by its id, unless its ttl is short enough to have passed since
// (a ttl of at least kMinSessionTtl is accepted; the lookup is skipped below an hour, so that a
// stalled machine cannot fail it). A ttl below kMinSessionTtl is never accepted.
void CheckNewSession(Fixture& f, const absl::Status& s, const sdm::v1::Session& session,
                     bool has_ttl, const google::protobuf::Duration& ttl, const char* method) {
  if (!s.ok()) return;
  const absl::Duration requested =
      has_ttl ? absl::Seconds(ttl.seconds()) + absl::Nanoseconds(ttl.nanos())
              : absl::ZeroDuration();
  if (requested > absl::ZeroDuration() && requested < sdm::kMinSessionTtl) {
    std::fprintf(stderr, "%s made '%s' with ttl %s\n", method, session.id().c_str(),
                 absl::FormatDuration(requested).c_str());
    Fail("a session was made with a ttl below the minimum");
  }
  if (requested > absl::ZeroDuration() && requested < absl::Hours(1)) return;
  sdm::v1::GetSessionRequest get;
  get.set_session_id(session.id());
  sdm::v1::Session again;
  if (!f.service->DoGetSession(kTenant, get, again).ok() || again.id() != session.id()) {
    std::fprintf(stderr, "%s made '%s'\n", method, session.id().c_str());
    Fail("a new session is not found by its id");
  }
}

void CheckOpenAi(Fixture& f, const std::string& body, sdm::OpenAiEndpoint endpoint) {
  absl::StatusOr<sdm::OpenAiRequest> request = sdm::ParseOpenAiRequest(body, endpoint);
  if (!request.ok()) {
    ExpectCode(request.status(), {absl::StatusCode::kInvalidArgument}, "OpenAI parse");
    return;
  }
  if (endpoint == sdm::OpenAiEndpoint::kCompletions) {
    // Each prompt of a batch is a request of its own (server/http/openai_server.cc).
    if (request->prompts.empty() || request->prompts.size() * static_cast<size_t>(request->n) >
                                        static_cast<size_t>(sdm::kMaxOpenAiChoices)) {
      Fail("a completion request without a prompt, or with more choices than allowed");
    }
    for (const sdm::CompletionPrompt& prompt : request->prompts) {
      sdm::OpenAiRequest one = *request;
      one.prompts = {prompt};
      CheckGenerate(f, sdm::ToGenerateRequest(one, prompt.text, {}));
    }
    return;
  }
  std::string prompt_text;
  std::vector<std::string> template_stop;
  {
    bool continuing = false;
    if (!request->session_id.empty()) {
      sdm::v1::GetSessionRequest get;
      get.set_session_id(request->session_id);
      sdm::v1::Session session;
      const absl::Status s = f.service->DoGetSession(kTenant, get, session);
      ExpectCode(s, {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound}, "Get");
      if (!s.ok()) return;
      continuing = session.position() > 0;
    }
    prompt_text = f.chat.Render(request->messages, continuing);
    template_stop = f.chat.stop;
  }
  const GenerateRequest generate = sdm::ToGenerateRequest(*request, prompt_text, template_stop);
  CheckGenerate(f, generate);
}

template <typename Message>
bool Parse(const std::string& bytes, Message& message) {
  return message.ParseFromString(bytes);
}

void Run(const uint8_t* data, size_t size) {
  if (size == 0) return;
  Fixture& f = Service();
  const std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  using C = absl::StatusCode;
  switch (data[0] % kNumModes) {
    case kGenerate: {
      GenerateRequest request;
      if (Parse(bytes, request)) CheckGenerate(f, request);
      break;
    }
    case kCreate: {
      sdm::v1::CreateSessionRequest request;
      if (!Parse(bytes, request)) break;
      sdm::v1::Session session;
      const absl::Status s = f.service->DoCreateSession(kTenant, request, session);
      ExpectCode(s, {C::kInvalidArgument, C::kAlreadyExists, C::kResourceExhausted}, "Create");
      CheckNewSession(f, s, session, request.has_ttl(), request.ttl(), "Create");
      break;
    }
    case kGet: {
      sdm::v1::GetSessionRequest request;
      if (!Parse(bytes, request)) break;
      sdm::v1::Session session;
      const absl::Status s = f.service->DoGetSession(kTenant, request, session);
      ExpectCode(s, {C::kInvalidArgument, C::kNotFound}, "Get");
      if (s.ok() && session.id() != request.session_id()) Fail("Get answered another session");
      break;
    }
    case kList: {
      sdm::v1::ListSessionsRequest request;
      if (!Parse(bytes, request)) break;
      sdm::v1::ListSessionsResponse response;
      const absl::Status s = f.service->DoListSessions(kTenant, request, response);
      ExpectCode(s, {C::kInvalidArgument}, "List");
      if (s.ok() && !response.next_page_token().empty()) {
        request.set_page_token(response.next_page_token());
        sdm::v1::ListSessionsResponse next;
        if (!f.service->DoListSessions(kTenant, request, next).ok()) {
          Fail("a listing's next_page_token is refused");
        }
        if (next.sessions_size() > 0 && response.sessions_size() > 0 &&
            next.sessions(0).id() <= response.sessions(response.sessions_size() - 1).id()) {
          Fail("the next page does not continue after the last id");
        }
      }
      break;
    }
    case kDelete: {
      sdm::v1::DeleteSessionRequest request;
      if (!Parse(bytes, request)) break;
      ExpectCode(f.service->DoDeleteSession(kTenant, request), {C::kInvalidArgument, C::kNotFound},
                 "Delete");
      break;
    }
    case kFork: {
      sdm::v1::ForkSessionRequest request;
      if (!Parse(bytes, request)) break;
      sdm::v1::Session session;
      const absl::Status s = f.service->DoForkSession(kTenant, request, session);
      ExpectCode(s, {C::kInvalidArgument, C::kNotFound, C::kAlreadyExists, C::kResourceExhausted},
                 "Fork");
      CheckNewSession(f, s, session, request.has_ttl(), request.ttl(), "Fork");
      break;
    }
    case kDetokenize: {
      sdm::v1::DetokenizeRequest request;
      if (!Parse(bytes, request)) break;
      sdm::v1::DetokenizeResponse response;
      const absl::Status s = f.service->DoDetokenize(request, response);
      ExpectCode(s, {C::kInvalidArgument}, "Detokenize");
      if (s.ok() && !IsValidUtf8(response.text())) Fail("detokenized text is not valid UTF-8");
      break;
    }
    case kOpenAiCompletions:
      CheckOpenAi(f, bytes, sdm::OpenAiEndpoint::kCompletions);
      break;
    case kOpenAiChat:
      CheckOpenAi(f, bytes, sdm::OpenAiEndpoint::kChatCompletions);
      break;
  }
  Reset(f);
}

int WriteSeeds(const std::filesystem::path& dir) {
  SeedWriter seeds(dir);
  const auto add = [&](Mode mode, const std::string& message) {
    const std::string input = std::string(1, static_cast<char>(mode)) + message;
    Run(reinterpret_cast<const uint8_t*>(input.data()), input.size());  // must pass
    seeds.Add(input);
  };
  {
    GenerateRequest r;
    r.set_text("hello there");
    r.set_session_id("s1");
    r.mutable_sampling()->set_max_tokens(8);
    r.mutable_sampling()->set_temperature(0.7f);
    r.mutable_sampling()->set_top_k(5);
    r.mutable_sampling()->set_top_p(0.9f);
    r.mutable_sampling()->add_stop("\n");
    r.mutable_sampling()->add_stop_token_ids(257);
    add(kGenerate, r.SerializeAsString());
    r.Clear();
    for (int id : {104, 105, 33}) r.mutable_token_ids()->add_ids(id);
    r.set_add_bos(true);
    r.set_session_id("s2");
    add(kGenerate, r.SerializeAsString());
    r.Clear();
    r.set_text("one-shot");
    add(kGenerate, r.SerializeAsString());
  }
  {
    sdm::v1::CreateSessionRequest r;
    r.set_session_id("new-1");
    r.mutable_ttl()->set_seconds(60);
    (*r.mutable_labels())["team"] = "a";
    add(kCreate, r.SerializeAsString());
    r.Clear();
    add(kCreate, r.SerializeAsString());  // the server picks the id
    r.set_session_id("brief");
    r.mutable_ttl()->set_nanos(60);  // under kMinSessionTtl: refused (a crash this fuzzer found)
    add(kCreate, r.SerializeAsString());
    r.Clear();
  }
  {
    sdm::v1::GetSessionRequest r;
    r.set_session_id("s1");
    add(kGet, r.SerializeAsString());
  }
  {
    sdm::v1::ListSessionsRequest r;
    r.set_page_size(1);
    (*r.mutable_label_selector())["app"] = "fuzz";
    add(kList, r.SerializeAsString());
    r.Clear();
    r.set_page_token(sdm::EncodePageToken("s1", {}));
    add(kList, r.SerializeAsString());
  }
  {
    sdm::v1::DeleteSessionRequest r;
    r.set_session_id("s2");
    add(kDelete, r.SerializeAsString());
  }
  {
    sdm::v1::ForkSessionRequest r;
    r.set_session_id("s1");
    r.set_new_session_id("s1-copy");
    r.mutable_ttl()->set_seconds(5);
    add(kFork, r.SerializeAsString());
  }
  {
    sdm::v1::DetokenizeRequest r;
    for (int id : {104, 0xE6, 0x97, 256, 257, 300, -1}) r.add_token_ids(id);
    add(kDetokenize, r.SerializeAsString());
  }
  add(kOpenAiCompletions,
      R"({"prompt": "Once upon", "max_tokens": 8, "temperature": 0, "stop": ["\n"], "seed": 3})");
  add(kOpenAiCompletions, R"({"prompt": [104, 105], "session_id": "s1", "stream": true,)"
                          R"( "stream_options": {"include_usage": true}})");
  add(kOpenAiChat, R"({"messages": [{"role": "system", "content": "terse"},)"
                   R"( {"role": "user", "content": "hi"}], "max_completion_tokens": 4,)"
                   R"( "session_id": "s1", "top_p": 0.5})");
  return seeds.Finish();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  return sdm::fuzz::InitializeFuzzer(argc, argv, WriteSeeds);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Run(data, size);
  return 0;
}
