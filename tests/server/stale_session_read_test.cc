// A Generate prepared from a read of its session that is stale by the time the job takes the
// session (another turn, or another replica, wrote it in between) must not run on that read:
// PrepareGenerate decides BOS and the limits from the session's history, which Submit checks
// again under the lease (GenerateJob::expected_history, server/scheduler.h). The service runs
// here without gRPC (its transport-independent methods, server/service.h) over a tiny random model
// and an in-memory store; the HTTP API's two reads (a chat's template and the job) through its
// own halves (server/http/openai_prompt.h).
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "engine/model.h"
#include "engine/tokenizer.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "server/auth.h"
#include "server/http/chat_template.h"
#include "server/http/openai_json.h"
#include "server/http/openai_prompt.h"
#include "server/metrics/server_metrics.h"
#include "server/scheduler.h"
#include "server/service.h"
#include "server/tenant_limits.h"
#include "state_store/session_store.h"

namespace sdm {
namespace {

// One job's usage and error; Wait() returns once it has finished.
class Turn : public JobObserver {
 public:
  void OnToken(int32_t, absl::string_view, const TokenLogprobs*) override {}
  void OnHeldText(absl::string_view) override {}
  void OnFinish(FinishReason, const Usage& u, const absl::Status& e) override {
    usage = u;
    error = e;
    done.Notify();
  }
  bool IsCancelled() const override { return false; }
  void Wait() { done.WaitForNotification(); }

  Usage usage;  // written on the step thread before `done`
  absl::Status error;
  absl::Notification done;
};

class StaleSessionReadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = RandomModel(*PresetConfig("tiny"), 7);
    auto engine = Engine::Create(model_, EngineOptions{});
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
    tokenizer_ = Tokenizer::CreateByteTokenizer();
    SessionStoreOptions store_options;
    store_options.background = false;
    auto store =
        SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), store_options);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    metrics_ = std::make_unique<ServerMetrics>(registry_);
    scheduler_ = std::make_unique<Scheduler>(*engine_, *store_, *tokenizer_, SchedulerOptions{});
    service_ = std::make_unique<SdmServiceImpl>(ServiceDeps{*model_, *engine_, *tokenizer_, *store_,
                                                            *scheduler_, *metrics_, auth_, limits_},
                                                ServiceOptions{});
    v1::CreateSessionRequest create;
    create.set_session_id("chat");
    v1::Session session;
    ASSERT_TRUE(service_->DoCreateSession(kTenant, create, session).ok());
  }
  void TearDown() override { scheduler_.reset(); }

  v1::GenerateRequest Request(const std::string& text) const {
    v1::GenerateRequest request;
    request.set_session_id("chat");
    request.set_text(text);
    request.mutable_sampling()->set_max_tokens(4);
    return request;
  }
  // A chat request continuing the session "chat" with one user message.
  static absl::StatusOr<OpenAiRequest> ChatTurn() {
    return ParseOpenAiRequest(
        R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "session_id": "chat"})",
        OpenAiEndpoint::kChatCompletions);
  }
  absl::Status Prepare(const std::string& text, GenerateJob& job) {
    return service_->PrepareGenerate(kTenant, absl::InfiniteFuture(), Request(text), job);
  }

  static constexpr char kTenant[] = "";  // the default tenant (no API keys)
  std::shared_ptr<const Model> model_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<SessionStateStore> store_;
  prometheus::Registry registry_;
  std::unique_ptr<ServerMetrics> metrics_;
  Reloadable<ApiKeyAuthenticator> auth_;
  Reloadable<TenantLimitsConfig> limits_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<SdmServiceImpl> service_;
};

// Two requests read the new session (both would start the sequence with BOS); the first runs.
// The second, submitted as prepared, is refused (its BOS would land mid-conversation); prepared
// again, it continues the conversation without BOS.
TEST_F(StaleSessionReadTest, AJobPreparedBeforeAnotherTurnIsRefusedAndPreparedAgain) {
  GenerateJob first, stale;
  ASSERT_TRUE(Prepare("hello", first).ok());
  ASSERT_TRUE(Prepare("again", stale).ok());
  ASSERT_EQ(first.prompt.front(), tokenizer_->bos_id());
  ASSERT_EQ(stale.prompt, (std::vector<int32_t>{tokenizer_->bos_id(), 'a', 'g', 'a', 'i', 'n'}));
  auto turn1 = std::make_shared<Turn>();
  ASSERT_TRUE(service_->SubmitGenerate(std::move(first), turn1).ok());
  turn1->Wait();
  ASSERT_TRUE(turn1->error.ok()) << turn1->error;

  auto refused = std::make_shared<Turn>();
  const absl::Status s = service_->SubmitGenerate(std::move(stale), refused);
  EXPECT_TRUE(IsSessionChanged(s)) << s;
  EXPECT_NE(s.message().find("changed while the request was prepared"), std::string::npos) << s;
  EXPECT_FALSE(refused->done.HasBeenNotified());

  auto turn2 = std::make_shared<Turn>();
  int attempts = 0;
  GenerateJob prepared;
  ASSERT_TRUE(RetryWhileSessionChanged([&] {
                ++attempts;
                prepared = GenerateJob();
                if (absl::Status p = Prepare("again", prepared); !p.ok()) return p;
                GenerateJob job = prepared;
                return service_->SubmitGenerate(std::move(job), turn2);
              }).ok());
  turn2->Wait();
  EXPECT_EQ(attempts, 1);
  EXPECT_EQ(prepared.prompt, (std::vector<int32_t>{'a', 'g', 'a', 'i', 'n'}));  // no BOS
  // Turn 1's prompt and every token it generated (its last one pended and was read first by
  // turn 2, as history).
  EXPECT_EQ(turn2->usage.history_tokens, 6 + turn1->usage.generated_tokens);
}

// The retry gives up after kGenerateAttempts tries, returning the last refusal; any other result
// (success, or another error: ABORTED for a busy session included) ends it at once.
TEST_F(StaleSessionReadTest, TheRetryStopsAtKGenerateAttemptsAndOnAnythingButASessionChange) {
  GenerateJob first, stale;
  ASSERT_TRUE(Prepare("hello", first).ok());
  ASSERT_TRUE(Prepare("again", stale).ok());
  auto turn1 = std::make_shared<Turn>();
  ASSERT_TRUE(service_->SubmitGenerate(std::move(first), turn1).ok());
  turn1->Wait();
  const absl::Status changed = service_->SubmitGenerate(std::move(stale), std::make_shared<Turn>());
  ASSERT_TRUE(IsSessionChanged(changed)) << changed;

  int calls = 0;
  EXPECT_EQ(RetryWhileSessionChanged([&] {
              ++calls;
              return changed;
            }),
            changed);
  EXPECT_EQ(calls, kGenerateAttempts);
  calls = 0;
  EXPECT_TRUE(RetryWhileSessionChanged([&] {
                return ++calls < kGenerateAttempts ? changed : absl::OkStatus();
              }).ok());
  EXPECT_EQ(calls, kGenerateAttempts);
  calls = 0;
  const absl::Status busy = absl::AbortedError("session 'chat' is in use");
  EXPECT_EQ(RetryWhileSessionChanged([&] {
              ++calls;
              return busy;
            }),
            busy);
  EXPECT_EQ(calls, 1);
}

// The HTTP API renders a chat's template from one read of the session (RenderOpenAiPrompt) and
// prepares the job from another (PrepareGenerate's, which Submit checks under the lease). A turn
// that finishes between the two would give a template rendered for a new conversation to a job
// continuing one: PrepareOpenAiJob refuses it, and rendered again the prompt continues.
TEST_F(StaleSessionReadTest, AChatPromptRenderedBeforeAnotherTurnIsRefusedAndRenderedAgain) {
  const absl::StatusOr<OpenAiRequest> chat = ChatTurn();
  ASSERT_TRUE(chat.ok()) << chat.status();
  const ChatTemplate chat_template;
  absl::StatusOr<OpenAiPrompt> stale = RenderOpenAiPrompt(*service_, kTenant, *chat, chat_template);
  ASSERT_TRUE(stale.ok()) << stale.status();
  EXPECT_EQ(stale->history, 0);
  EXPECT_EQ(stale->text, chat_template.Render(chat->messages, /*continuing=*/false));
  EXPECT_EQ(stale->stop, chat_template.stop);

  // Another turn runs on the session between the render and the job.
  GenerateJob other;
  ASSERT_TRUE(Prepare("hello", other).ok());
  auto turn = std::make_shared<Turn>();
  ASSERT_TRUE(service_->SubmitGenerate(std::move(other), turn).ok());
  turn->Wait();
  ASSERT_TRUE(turn->error.ok()) << turn->error;

  GenerateJob job;
  const absl::Status refused = PrepareOpenAiJob(*service_, kTenant, *chat, *stale, job);
  EXPECT_TRUE(IsSessionChanged(refused)) << refused;

  absl::StatusOr<OpenAiPrompt> fresh = RenderOpenAiPrompt(*service_, kTenant, *chat, chat_template);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(fresh->history, 6 + turn->usage.generated_tokens);  // BOS, "hello", the reply
  EXPECT_EQ(fresh->text, chat_template.Render(chat->messages, /*continuing=*/true));
  EXPECT_NE(fresh->text, stale->text);
  job = GenerateJob();
  ASSERT_TRUE(PrepareOpenAiJob(*service_, kTenant, *chat, *fresh, job).ok());
  EXPECT_EQ(job.expected_history, fresh->history);
  ASSERT_FALSE(job.prompt.empty());
  EXPECT_NE(job.prompt.front(), tokenizer_->bos_id());

  // A completion reads no session: nothing to disagree with.
  absl::StatusOr<OpenAiRequest> completion = ParseOpenAiRequest(
      R"({"prompt": "x", "max_tokens": 2, "session_id": "chat"})", OpenAiEndpoint::kCompletions);
  ASSERT_TRUE(completion.ok()) << completion.status();
  absl::StatusOr<OpenAiPrompt> plain =
      RenderOpenAiPrompt(*service_, kTenant, *completion, chat_template);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->history, -1);
  EXPECT_EQ(plain->text, "x");
  EXPECT_TRUE(plain->stop.empty());
  job = GenerateJob();
  EXPECT_TRUE(PrepareOpenAiJob(*service_, kTenant, *completion, *plain, job).ok());
}

// The handler's whole path (SubmitOpenAiRequest): a turn that finishes between a chat's render
// and its job makes it render again, and the job that runs continues the conversation; a session
// that changes in that window every time is refused after kGenerateAttempts renders.
TEST_F(StaleSessionReadTest, TheHttpPathRendersAgainWhenATurnFinishesBetweenItsReads) {
  const absl::StatusOr<OpenAiRequest> chat = ChatTurn();
  ASSERT_TRUE(chat.ok()) << chat.status();
  const ChatTemplate chat_template;
  int64_t history = 0;  // the session's tokens, a pending one included
  const auto another_turn = [&] {
    GenerateJob job;
    ASSERT_TRUE(Prepare("hello", job).ok());
    const int64_t prompt = static_cast<int64_t>(job.prompt.size());
    auto turn = std::make_shared<Turn>();
    ASSERT_TRUE(service_->SubmitGenerate(std::move(job), turn).ok());
    turn->Wait();
    ASSERT_TRUE(turn->error.ok()) << turn->error;
    history += prompt + turn->usage.generated_tokens;
  };

  int renders = 0;
  auto reply = std::make_shared<Turn>();
  absl::StatusOr<int64_t> prompt_tokens =
      SubmitOpenAiRequest(*service_, kTenant, *chat, chat_template, reply, [&] {
        if (++renders == 1) another_turn();
      });
  ASSERT_TRUE(prompt_tokens.ok()) << prompt_tokens.status();
  reply->Wait();
  ASSERT_TRUE(reply->error.ok()) << reply->error;
  EXPECT_EQ(renders, 2);
  ASSERT_GE(history, 6 + 1);  // BOS, "hello", the reply
  // The continuing template without BOS (the stale render would be shorter, BOS one longer).
  const std::string continued = chat_template.Render(chat->messages, /*continuing=*/true);
  EXPECT_EQ(*prompt_tokens, static_cast<int64_t>(tokenizer_->Encode(continued, false).size()));
  EXPECT_EQ(reply->usage.history_tokens + reply->usage.prompt_tokens, history + *prompt_tokens);

  renders = 0;
  auto refused = std::make_shared<Turn>();
  const absl::StatusOr<int64_t> changing =
      SubmitOpenAiRequest(*service_, kTenant, *chat, chat_template, refused, [&] {
        ++renders;
        another_turn();
      });
  EXPECT_TRUE(IsSessionChanged(changing.status())) << changing.status();
  EXPECT_EQ(renders, kGenerateAttempts);
  EXPECT_FALSE(refused->done.HasBeenNotified());
}

}  // namespace
}  // namespace sdm
