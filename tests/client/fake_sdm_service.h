// A test double of sdm.v1.SdmService for the client tests, served on loopback.
//
// It keeps sessions in a map and "generates" deterministic text: for a request with max_tokens
// N (unset: 8) it streams N tokens, token i having id 100 + i and text "t<i> ", in chunks of
// tokens_per_chunk tokens (the final chunk, with finish_reason LENGTH and usage, carries no
// tokens). Usage.prompt_tokens counts the prompt's bytes (or ids) plus one for a BOS added as the
// server would (add_bos unset and position 0); history_tokens is the session's position before
// the call, which grows by prompt + generated tokens. A Generate on a session that is already
// generating fails with ABORTED, as the real server does. Every call is recorded with its
// session id and authorization metadata; FailNext() makes the next calls of a method fail;
// StreamNextUntilCancelled() makes the next Generate stream until the client cancels it.
#ifndef SDMSERVE_TESTS_CLIENT_FAKE_SDM_SERVICE_H_
#define SDMSERVE_TESTS_CLIENT_FAKE_SDM_SERVICE_H_

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "sdm/v1/sdm.grpc.pb.h"

namespace sdm::client::testing {

class FakeSdmService final : public sdm::v1::SdmService::Service {
 public:
  struct Call {
    std::string method;
    std::string session_id;
    std::string authorization;    // the metadata's value; "" when absent
    std::string routing_session;  // the x-session-id metadata's value; "" when absent
  };

  // Knobs, set before the calls they affect.
  void set_tokens_per_chunk(int n) {
    absl::MutexLock lock(&mu_);
    tokens_per_chunk_ = n;
  }
  void set_chunk_delay(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    chunk_delay_ = d;
  }
  // The next `times` calls of `method` ("Generate", "GetSession", ...) fail with `status`, with
  // the retry hint `retry_after_ms` in their trailing metadata (grpc-retry-pushback-ms) unless
  // empty, as the server sends it (server/grpc_status.h).
  void FailNext(const std::string& method, grpc::Status status, int times = 1,
                std::string retry_after_ms = "") {
    absl::MutexLock lock(&mu_);
    failures_[method] = {status, times, std::move(retry_after_ms)};
  }

  // The next Generate streams its tokens, then ends with `status` (and the retry hint
  // `retry_after_ms` unless empty) instead of its final chunk: a turn that ran but was not saved.
  void FailNextAfterTokens(grpc::Status status, std::string retry_after_ms = "") {
    absl::MutexLock lock(&mu_);
    fail_after_tokens_ = Failure{status, 1, std::move(retry_after_ms)};
  }

  // The next Generate ignores max_tokens and streams until the client cancels it (at most
  // kMaxStreamedUntilCancelled tokens, then it ends as if max_tokens were reached), then ends
  // CANCELLED, its session keeping the prompt and the tokens generated (docs/api.md, Generate).
  static constexpr int64_t kMaxStreamedUntilCancelled = 10000;
  void StreamNextUntilCancelled() {
    absl::MutexLock lock(&mu_);
    stream_until_cancelled_ = true;
  }
  // Blocks until no Generate is running (a cancelled one has finished on the server's side).
  void AwaitNoGenerateRunning() const {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](const int* running) { return *running == 0; }, &running_));
  }
  // Generate calls that ended because the client cancelled them.
  int cancelled_generates() const {
    absl::MutexLock lock(&mu_);
    return cancelled_generates_;
  }

  std::vector<Call> calls() const {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  std::vector<Call> calls(const std::string& method) const {
    absl::MutexLock lock(&mu_);
    std::vector<Call> out;
    for (const Call& c : calls_) {
      if (c.method == method) out.push_back(c);
    }
    return out;
  }
  std::vector<sdm::v1::GenerateRequest> generate_requests() const {
    absl::MutexLock lock(&mu_);
    return generate_requests_;
  }
  bool HasSession(const std::string& id) const {
    absl::MutexLock lock(&mu_);
    return sessions_.count(id) > 0;
  }
  int64_t Position(const std::string& id) const {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    return it == sessions_.end() ? -1 : it->second.position();
  }
  int max_concurrent_generates() const {
    absl::MutexLock lock(&mu_);
    return max_running_;
  }

  grpc::Status Generate(grpc::ServerContext* context, const sdm::v1::GenerateRequest* request,
                        grpc::ServerWriter<sdm::v1::GenerateResponse>* writer) override {
    int64_t history = 0;
    int per_chunk = 1;
    absl::Duration delay;
    bool until_cancelled = false;
    {
      absl::MutexLock lock(&mu_);
      if (auto failure = Record("Generate", request->session_id(), context)) return *failure;
      generate_requests_.push_back(*request);
      if (!request->session_id().empty()) {
        auto it = sessions_.find(request->session_id());
        if (it == sessions_.end()) return NotFound(request->session_id());
        if (it->second.generating()) {
          return grpc::Status(
              grpc::StatusCode::ABORTED,
              absl::StrCat("session '", request->session_id(), "' is already generating"));
        }
        it->second.set_generating(true);
        history = it->second.position();
      }
      max_running_ = std::max(max_running_, ++running_);
      per_chunk = tokens_per_chunk_;
      delay = chunk_delay_;
      until_cancelled = std::exchange(stream_until_cancelled_, false);
    }
    const int64_t prompt =
        (request->has_token_ids() ? request->token_ids().ids_size()
                                  : static_cast<int64_t>(request->text().size())) +
        ((!request->has_add_bos() && history == 0) || request->add_bos() ? 1 : 0);
    int64_t n = request->sampling().has_max_tokens() ? request->sampling().max_tokens() : 8;
    if (until_cancelled) n = kMaxStreamedUntilCancelled;
    sdm::v1::GenerateResponse chunk;
    for (int64_t i = 0; i < n; ++i) {
      if (until_cancelled && context->IsCancelled()) {
        absl::MutexLock lock(&mu_);
        --running_;
        ++cancelled_generates_;
        if (!request->session_id().empty()) {
          sdm::v1::Session& s = sessions_[request->session_id()];
          s.set_generating(false);
          s.set_position(history + prompt + i);
        }
        return grpc::Status::CANCELLED;
      }
      chunk.add_token_ids(static_cast<int32_t>(100 + i));
      chunk.mutable_text()->append(absl::StrCat("t", i, " "));
      if (chunk.token_ids_size() == per_chunk || i + 1 == n) {
        if (delay > absl::ZeroDuration()) absl::SleepFor(delay);
        writer->Write(chunk);
        chunk.Clear();
      }
    }
    {
      absl::MutexLock lock(&mu_);
      if (fail_after_tokens_.has_value()) {
        const Failure failure = *std::exchange(fail_after_tokens_, std::nullopt);
        --running_;
        if (!request->session_id().empty()) {
          sdm::v1::Session& s = sessions_[request->session_id()];
          s.set_generating(false);
          s.set_position(history + prompt + n);
        }
        if (!failure.retry_after_ms.empty()) {
          context->AddTrailingMetadata("grpc-retry-pushback-ms", failure.retry_after_ms);
        }
        return failure.status;
      }
    }
    chunk.set_finish_reason(sdm::v1::FINISH_REASON_LENGTH);
    chunk.mutable_usage()->set_prompt_tokens(prompt);
    chunk.mutable_usage()->set_history_tokens(history);
    chunk.mutable_usage()->set_generated_tokens(n);
    writer->Write(chunk);
    absl::MutexLock lock(&mu_);
    --running_;
    if (!request->session_id().empty()) {
      sdm::v1::Session& s = sessions_[request->session_id()];
      s.set_generating(false);
      s.set_position(history + prompt + n);
    }
    return grpc::Status::OK;
  }

  grpc::Status CreateSession(grpc::ServerContext* context,
                             const sdm::v1::CreateSessionRequest* request,
                             sdm::v1::Session* response) override {
    absl::MutexLock lock(&mu_);
    if (auto failure = Record("CreateSession", request->session_id(), context)) return *failure;
    std::string id = request->session_id();
    if (id.empty()) id = absl::StrCat("auto-", ++auto_ids_);
    if (sessions_.count(id) > 0) {
      return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                          absl::StrCat("session '", id, "' already exists"));
    }
    sdm::v1::Session& s = sessions_[id];
    s.set_id(id);
    *s.mutable_labels() = request->labels();
    if (request->has_ttl()) *s.mutable_ttl() = request->ttl();
    s.set_tier(sdm::v1::TIER_RESIDENT);
    *response = s;
    return grpc::Status::OK;
  }

  grpc::Status GetSession(grpc::ServerContext* context, const sdm::v1::GetSessionRequest* request,
                          sdm::v1::Session* response) override {
    absl::MutexLock lock(&mu_);
    if (auto failure = Record("GetSession", request->session_id(), context)) return *failure;
    auto it = sessions_.find(request->session_id());
    if (it == sessions_.end()) return NotFound(request->session_id());
    *response = it->second;
    return grpc::Status::OK;
  }

  grpc::Status ListSessions(grpc::ServerContext* context,
                            const sdm::v1::ListSessionsRequest* request,
                            sdm::v1::ListSessionsResponse* response) override {
    absl::MutexLock lock(&mu_);
    if (auto failure = Record("ListSessions", "", context)) return *failure;
    const int page = request->page_size() > 0 ? request->page_size() : 100;
    for (auto it = sessions_.upper_bound(request->page_token()); it != sessions_.end(); ++it) {
      bool match = true;
      for (const auto& [k, v] : request->label_selector()) {
        auto l = it->second.labels().find(k);
        if (l == it->second.labels().end() || l->second != v) match = false;
      }
      if (!match) continue;
      if (response->sessions_size() == page) {
        response->set_next_page_token(response->sessions(page - 1).id());
        break;
      }
      *response->add_sessions() = it->second;
    }
    return grpc::Status::OK;
  }

  grpc::Status DeleteSession(grpc::ServerContext* context,
                             const sdm::v1::DeleteSessionRequest* request,
                             sdm::v1::DeleteSessionResponse*) override {
    absl::MutexLock lock(&mu_);
    if (auto failure = Record("DeleteSession", request->session_id(), context)) return *failure;
    if (sessions_.erase(request->session_id()) == 0) return NotFound(request->session_id());
    return grpc::Status::OK;
  }

  grpc::Status ForkSession(grpc::ServerContext* context, const sdm::v1::ForkSessionRequest* request,
                           sdm::v1::Session* response) override {
    absl::MutexLock lock(&mu_);
    if (auto failure = Record("ForkSession", request->session_id(), context)) return *failure;
    auto it = sessions_.find(request->session_id());
    if (it == sessions_.end()) return NotFound(request->session_id());
    std::string id = request->new_session_id();
    if (id.empty()) id = absl::StrCat("auto-", ++auto_ids_);
    if (sessions_.count(id) > 0) {
      return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                          absl::StrCat("session '", id, "' already exists"));
    }
    sdm::v1::Session copy = it->second;
    copy.set_id(id);
    *copy.mutable_labels() = request->labels();
    sessions_[id] = copy;
    *response = copy;
    return grpc::Status::OK;
  }

  grpc::Status Tokenize(grpc::ServerContext* context, const sdm::v1::TokenizeRequest* request,
                        sdm::v1::TokenizeResponse* response) override {
    absl::MutexLock lock(&mu_);
    if (auto failure = Record("Tokenize", "", context)) return *failure;
    if (request->add_bos()) response->add_token_ids(256);
    for (const unsigned char c : request->text()) response->add_token_ids(c);
    return grpc::Status::OK;
  }

  grpc::Status Detokenize(grpc::ServerContext* context, const sdm::v1::DetokenizeRequest* request,
                          sdm::v1::DetokenizeResponse* response) override {
    absl::MutexLock lock(&mu_);
    if (auto failure = Record("Detokenize", "", context)) return *failure;
    for (const int32_t id : request->token_ids()) {
      if (id < 0 || id >= 258) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("token id ", id, " is outside [0, 258)"));
      }
      if (id < 256) response->mutable_text()->push_back(static_cast<char>(id));
    }
    return grpc::Status::OK;
  }

  grpc::Status GetModelInfo(grpc::ServerContext* context, const sdm::v1::GetModelInfoRequest*,
                            sdm::v1::ModelInfo* response) override {
    absl::MutexLock lock(&mu_);
    if (auto failure = Record("GetModelInfo", "", context)) return *failure;
    response->set_name("fake");
    response->set_summary("dim 8, 4 layers (3 swa window 4, 1 sdm 1x16x8), vocab 258");
    response->set_dim(8);
    response->set_n_layers(4);
    for (int i = 0; i < 3; ++i) response->add_layer_types(sdm::v1::LAYER_TYPE_SLIDING_WINDOW);
    response->add_layer_types(sdm::v1::LAYER_TYPE_SPARSE_DELTA_MEMORY);
    response->set_swa_window(4);
    response->set_vocab_size(258);
    response->mutable_tokenizer()->set_name("bytes");
    response->mutable_tokenizer()->set_bos_id(256);
    response->mutable_tokenizer()->set_eos_id(257);
    response->mutable_tokenizer()->set_vocab_size(258);
    response->set_max_prompt_tokens(1024);
    response->set_max_tokens_limit(512);
    return grpc::Status::OK;
  }

 private:
  // Records the call; returns the failure FailNext() scheduled, if any.
  std::optional<grpc::Status> Record(const std::string& method, const std::string& session,
                                     grpc::ServerContext* context)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::string authorization;
    const auto& md = context->client_metadata();
    if (auto it = md.find("authorization"); it != md.end()) {
      authorization.assign(it->second.data(), it->second.size());
    }
    std::string routing_session;
    if (auto it = md.find("x-session-id"); it != md.end()) {
      routing_session.assign(it->second.data(), it->second.size());
    }
    calls_.push_back({method, session, authorization, routing_session});
    auto it = failures_.find(method);
    if (it == failures_.end() || it->second.times <= 0) return std::nullopt;
    --it->second.times;
    if (!it->second.retry_after_ms.empty()) {
      context->AddTrailingMetadata("grpc-retry-pushback-ms", it->second.retry_after_ms);
    }
    return it->second.status;
  }

  static grpc::Status NotFound(const std::string& id) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND, absl::StrCat("session '", id, "' not found"));
  }

  mutable absl::Mutex mu_;
  std::vector<Call> calls_ ABSL_GUARDED_BY(mu_);
  std::vector<sdm::v1::GenerateRequest> generate_requests_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, sdm::v1::Session> sessions_ ABSL_GUARDED_BY(mu_);
  struct Failure {
    grpc::Status status;
    int times = 0;
    std::string retry_after_ms;
  };
  std::map<std::string, Failure> failures_ ABSL_GUARDED_BY(mu_);
  std::optional<Failure> fail_after_tokens_ ABSL_GUARDED_BY(mu_);
  bool stream_until_cancelled_ ABSL_GUARDED_BY(mu_) = false;
  int cancelled_generates_ ABSL_GUARDED_BY(mu_) = 0;
  int tokens_per_chunk_ ABSL_GUARDED_BY(mu_) = 1;
  absl::Duration chunk_delay_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  int max_running_ ABSL_GUARDED_BY(mu_) = 0;
  int auto_ids_ ABSL_GUARDED_BY(mu_) = 0;
};

// A FakeSdmService listening on 127.0.0.1 (a free port; plaintext unless given credentials),
// shut down on destruction.
class FakeServer {
 public:
  explicit FakeServer(
      std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials()) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", credentials, &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~FakeServer() { server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5))); }

  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  bool ok() const { return server_ != nullptr && port_ > 0; }
  FakeSdmService& service() { return service_; }

 private:
  FakeSdmService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace sdm::client::testing

#endif  // SDMSERVE_TESTS_CLIENT_FAKE_SDM_SERVICE_H_
