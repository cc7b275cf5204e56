#include "server/scheduler.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "base/check.h"
#include "base/thread_priority.h"
#include "engine/engine.h"
#include "engine/logprobs.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/tokenizer.h"
#include "gtest/gtest.h"
#include "state_store/session_ownership.h"
#include "tests/base/captured_log.h"
#include "tests/base/eventually.h"
#include "tests/server/server_test_util.h"
#include "tests/state_store/fault_injection_files.h"

namespace sdm {
namespace {

// Collects a job's output; Wait() blocks until it finished.
class Collector : public JobObserver {
 public:
  void OnToken(int32_t token, absl::string_view text, const TokenLogprobs* lp) override {
    std::lock_guard<std::mutex> lock(mu_);
    step_thread_nice = CurrentThreadNice();  // observers run on the step thread
    tokens.push_back(token);
    if (lp != nullptr) logprobs.push_back(*lp);
    this->text += std::string(text);
    if (cancel_after > 0 && static_cast<int>(tokens.size()) >= cancel_after) cancelled = true;
  }
  void OnPromptLogprobs(std::span<const PromptTokenLogprobs> scored, bool done) override {
    std::lock_guard<std::mutex> lock(mu_);
    prompt_before_tokens = prompt_before_tokens && tokens.empty() && !prompt_done;
    prompt.insert(prompt.end(), scored.begin(), scored.end());
    prompt_done = done;
  }
  void OnHeldText(absl::string_view text) override {
    std::lock_guard<std::mutex> lock(mu_);
    this->text += std::string(text);
  }
  void OnFinish(FinishReason r, const Usage& u, const absl::Status& e) override {
    std::lock_guard<std::mutex> lock(mu_);
    reason = r;
    usage = u;
    error = e;
    finished = true;
    cv_.notify_all();
  }
  bool IsCancelled() const override { return cancelled.load(); }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return finished; });
  }
  // Whether it finished within `timeout`.
  bool WaitFor(std::chrono::seconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return finished; });
  }

  std::vector<int32_t> tokens;
  std::vector<TokenLogprobs> logprobs;      // of `tokens`, when the job asked for them
  std::vector<PromptTokenLogprobs> prompt;  // OnPromptLogprobs's, in order
  bool prompt_done = false;                 // the last OnPromptLogprobs call said so
  bool prompt_before_tokens = true;         // every call came before the tokens, none after done
  std::string text;
  FinishReason reason = FinishReason::kError;
  Usage usage;
  absl::Status error;
  bool finished = false;
  int cancel_after = 0;
  std::atomic<bool> cancelled{false};
  int step_thread_nice = 0;  // as OnToken last saw it

 private:
  std::mutex mu_;
  std::condition_variable cv_;
};

// A staged upload (state_store/device_residency.h) that records when it is let go: what a CUDA
// engine's StageResume attaches to a job's session, faked so the CPU scheduler tests see it.
class FakeStaged : public StagedUpload {
 public:
  explicit FakeStaged(std::shared_ptr<std::atomic<bool>> dropped)
      : StagedUpload(nullptr), dropped_(std::move(dropped)) {}
  ~FakeStaged() override { *dropped_ = true; }

 private:
  std::shared_ptr<std::atomic<bool>> dropped_;
};

std::vector<int32_t> Tokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, 255);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = tok(rng);
  return t;
}

class SchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ModelConfig c = *PresetConfig("tiny");
    auto e = Engine::Create(RandomModel(c, 5), EngineOptions{});
    ASSERT_TRUE(e.ok());
    engine_ = *std::move(e);
    SetUpStore();
  }
  // For tests whose long jobs must not end early by sampling EOS: the tiny model whose EOS logit
  // is zeroed (tests/server/server_test_util.h), so a greedy job runs until it is stopped.
  void UseNoEosModel(const EngineOptions& options = {}) {
    store_.reset();
    auto model = LoadModel(sdm::testing::NoEosModelDir());
    ASSERT_TRUE(model.ok()) << model.status();
    auto e = Engine::Create(*model, options);
    ASSERT_TRUE(e.ok());
    engine_ = *std::move(e);
    std::filesystem::remove_all(dir_);
    OpenStore();
  }
  void SetUpStore() {
    tokenizer_ = Tokenizer::CreateByteTokenizer();
    dir_ = std::filesystem::temp_directory_path() / absl::StrCat("sdm_sched_", ::getpid());
    std::filesystem::remove_all(dir_);
    OpenStore();
  }
  void TearDown() override {
    scheduler_.reset();
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  void OpenStore() {
    SessionStoreOptions o;
    o.dir = dir_;
    auto s = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }
  void StartScheduler(SchedulerOptions o = {}) {
    scheduler_ = std::make_unique<Scheduler>(*engine_, *store_, *tokenizer_, o);
  }

  // Greedy generation computed directly with the engine, one session alone: the reference. Like
  // the scheduler it stops after n tokens or at EOS (not returned); `last` receives the final
  // sampled token (EOS included), which a session keeps pending.
  std::vector<int32_t> Direct(SessionState& s, const std::vector<int32_t>& prompt, int n,
                              int32_t* last = nullptr) {
    std::vector<float> logits;
    SDM_CHECK(engine_->Prefill(s, prompt, false, &logits).ok());
    SamplingParams greedy;
    std::vector<int32_t> out;
    int32_t token = SampleToken(logits, greedy, 0);
    std::vector<float> step(engine_->vocab_size());
    while (true) {
      if (last != nullptr) *last = token;
      if (token == tokenizer_->eos_id()) break;
      out.push_back(token);
      if (static_cast<int>(out.size()) >= n) break;
      SessionState* p = &s;
      SDM_CHECK(engine_->Decode({&p, 1}, {&token, 1}, step).ok());
      token = SampleToken(step, greedy, 0);
    }
    return out;
  }

  // What a session's next turn feeds: its pending token, then the prompt.
  static std::vector<int32_t> AfterPending(int32_t pending, const std::vector<int32_t>& prompt) {
    std::vector<int32_t> feed = {pending};
    feed.insert(feed.end(), prompt.begin(), prompt.end());
    return feed;
  }

  GenerateJob Job(std::string session, std::vector<int32_t> prompt, int max_tokens) {
    GenerateJob j;
    j.session = SessionKey(std::move(session));
    j.prompt = std::move(prompt);
    j.sampling.max_tokens = max_tokens;
    j.sampling.stop_token_ids = {};
    return j;
  }

  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::filesystem::path dir_;
  std::unique_ptr<SessionStateStore> store_;
  std::unique_ptr<Scheduler> scheduler_;
};

TEST_F(SchedulerTest, OneShotGreedyEqualsDirectEngine) {
  StartScheduler();
  const auto prompt = Tokens(9, 1);
  auto c = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("", prompt, 12), c).ok());
  c->Wait();
  EXPECT_EQ(c->reason, FinishReason::kLength);
  scheduler_.reset();
  auto s = engine_->NewSession();
  EXPECT_EQ(c->tokens, Direct(*s, prompt, 12));
  EXPECT_EQ(c->usage.prompt_tokens, 9);
  EXPECT_EQ(c->usage.history_tokens, 0);
  EXPECT_EQ(c->usage.generated_tokens, 12);
  EXPECT_EQ(c->text, tokenizer_->Decode(c->tokens));
}

TEST_F(SchedulerTest, ConcurrentSessionsEqualTheirSoloRuns) {
  SchedulerOptions o;
  o.max_running = 32;
  o.prefill_token_budget = 40;  // prompts are spread over several steps
  StartScheduler(o);
  const int kJobs = 32, kTokens = 10;
  std::vector<std::shared_ptr<Collector>> out;
  for (int i = 0; i < kJobs; ++i) {
    const std::string id = absl::StrCat("c", i);
    ASSERT_TRUE(store_->Create(id, "").ok());
    out.push_back(std::make_shared<Collector>());
    ASSERT_TRUE(scheduler_->Submit(Job(id, Tokens(5 + i % 7, 10 + i), kTokens), out.back()).ok());
  }
  for (auto& c : out) c->Wait();
  scheduler_.reset();  // the engine serves one caller at a time: the references come after
  for (int i = 0; i < kJobs; ++i) {
    auto s = engine_->NewSession();
    EXPECT_EQ(out[i]->tokens, Direct(*s, Tokens(5 + i % 7, 10 + i), kTokens)) << "job " << i;
  }
}

TEST_F(SchedulerTest, LogprobsAreTheModelsAtEachTokenAndChangeNothingElse) {
  SchedulerOptions o;
  o.prefill_token_budget = 16;  // prompts over several steps, beside other jobs' decodes
  StartScheduler(o);
  // Sampled jobs in one batch, half asking for log-probabilities: theirs must be the solo
  // engine's logits' (batch-invariant, so equal to the bit), and asking must not change tokens.
  const int kJobs = 6, kTokens = 9;
  const auto job = [&](int i, std::optional<int> logprobs) {
    GenerateJob j = Job("", Tokens(7 + 3 * i, 40 + i), kTokens);
    j.sampling.temperature = 0.9;
    j.sampling.seed = 100 + i;
    j.logprobs = logprobs;
    return j;
  };
  std::vector<std::shared_ptr<Collector>> with, without;
  for (int i = 0; i < kJobs; ++i) {
    with.push_back(std::make_shared<Collector>());
    without.push_back(std::make_shared<Collector>());
    ASSERT_TRUE(scheduler_->Submit(job(i, i % 3), with.back()).ok());
    ASSERT_TRUE(scheduler_->Submit(job(i, std::nullopt), without.back()).ok());
  }
  for (int i = 0; i < kJobs; ++i) {
    with[i]->Wait();
    without[i]->Wait();
  }
  scheduler_.reset();
  for (int i = 0; i < kJobs; ++i) {
    SCOPED_TRACE(i);
    const Collector& c = *with[i];
    EXPECT_EQ(c.tokens, without[i]->tokens);
    EXPECT_TRUE(without[i]->logprobs.empty());
    ASSERT_EQ(c.logprobs.size(), c.tokens.size());
    // The reference: the same job, alone, through the engine.
    const GenerateJob spec = job(i, std::nullopt);
    auto s = engine_->NewSession();
    std::vector<float> logits;
    ASSERT_TRUE(engine_->Prefill(*s, spec.prompt, false, &logits).ok());
    for (size_t t = 0; t < c.tokens.size(); ++t) {
      ASSERT_EQ(c.tokens[t], SampleToken(logits, spec.sampling, t));
      const TokenLogprobs want = ComputeLogprobs(logits, c.tokens[t], i % 3);
      EXPECT_EQ(c.logprobs[t].chosen.token, c.tokens[t]);
      EXPECT_EQ(c.logprobs[t].chosen.logprob, want.chosen.logprob) << "token " << t;
      ASSERT_EQ(c.logprobs[t].top.size(), static_cast<size_t>(i % 3));
      for (size_t k = 0; k < want.top.size(); ++k) {
        EXPECT_EQ(c.logprobs[t].top[k].token, want.top[k].token);
        EXPECT_EQ(c.logprobs[t].top[k].logprob, want.top[k].logprob);
      }
      SessionState* p = s.get();
      const int32_t next = c.tokens[t];
      ASSERT_TRUE(engine_->Decode({&p, 1}, {&next, 1}, logits).ok());
    }
  }
}

// Engine logits row `row` of `all` ([rows, vocab]).
std::span<const float> Row(const std::vector<float>& all, int64_t vocab, size_t row) {
  return std::span<const float>(all).subspan(row * static_cast<size_t>(vocab),
                                             static_cast<size_t>(vocab));
}

void ExpectSameLogprobs(const TokenLogprobs& got, const TokenLogprobs& want) {
  EXPECT_EQ(got.chosen.token, want.chosen.token);
  EXPECT_EQ(got.chosen.logprob, want.chosen.logprob);
  ASSERT_EQ(got.top.size(), want.top.size());
  for (size_t k = 0; k < want.top.size(); ++k) {
    EXPECT_EQ(got.top[k].token, want.top[k].token);
    EXPECT_EQ(got.top[k].logprob, want.top[k].logprob);
  }
}

TEST_F(SchedulerTest, PromptLogprobsAreTheModelsAtEachPromptTokenAndChangeNothingElse) {
  // Prompts of several engine chunks, read over several steps beside other jobs: each prompt
  // token's log-probability is the solo engine's (to the bit), the first token of a one-shot
  // sequence has none, and asking changes no generated token.
  EngineOptions options;
  options.prefill_chunk = 8;
  store_.reset();
  auto e = Engine::Create(RandomModel(*PresetConfig("tiny"), 5), options);
  ASSERT_TRUE(e.ok());
  engine_ = *std::move(e);
  OpenStore();
  SchedulerOptions o;
  o.prefill_token_budget = 16;
  StartScheduler(o);
  const int kJobs = 6, kTokens = 4;
  const auto job = [&](int i, bool score) {
    GenerateJob j = Job("", Tokens(3 + 7 * i, 60 + i), kTokens);
    j.sampling.temperature = 0.8;
    j.sampling.seed = 7 + i;
    if (score) j.prompt_logprobs = i % 3;
    if (i % 2 == 1) j.logprobs = 2;  // the draw's row is the last of the chunk's rows
    return j;
  };
  std::vector<std::shared_ptr<Collector>> with, without;
  for (int i = 0; i < kJobs; ++i) {
    with.push_back(std::make_shared<Collector>());
    without.push_back(std::make_shared<Collector>());
    ASSERT_TRUE(scheduler_->Submit(job(i, true), with.back()).ok());
    ASSERT_TRUE(scheduler_->Submit(job(i, false), without.back()).ok());
  }
  for (int i = 0; i < kJobs; ++i) {
    with[i]->Wait();
    without[i]->Wait();
  }
  scheduler_.reset();
  const int64_t vocab = engine_->vocab_size();
  for (int i = 0; i < kJobs; ++i) {
    SCOPED_TRACE(i);
    const Collector& c = *with[i];
    EXPECT_EQ(c.tokens, without[i]->tokens);
    EXPECT_EQ(c.logprobs.size(), without[i]->logprobs.size());
    EXPECT_TRUE(without[i]->prompt.empty());
    EXPECT_TRUE(c.prompt_done);
    EXPECT_TRUE(c.prompt_before_tokens);
    const GenerateJob spec = job(i, true);
    ASSERT_EQ(c.prompt.size(), spec.prompt.size());
    EXPECT_FALSE(c.prompt[0].logprobs.has_value());
    auto s = engine_->NewSession();
    std::vector<float> all;
    ASSERT_TRUE(engine_->Prefill(*s, spec.prompt, /*all_positions=*/true, &all).ok());
    for (size_t t = 0; t < spec.prompt.size(); ++t) {
      SCOPED_TRACE(t);
      EXPECT_EQ(c.prompt[t].token, spec.prompt[t]);
      if (t == 0) continue;
      ASSERT_TRUE(c.prompt[t].logprobs.has_value());
      ExpectSameLogprobs(*c.prompt[t].logprobs,
                         ComputeLogprobs(Row(all, vocab, t - 1), spec.prompt[t], i % 3));
    }
    // The first generated token's, from the prompt's last row.
    if (spec.logprobs.has_value()) {
      ASSERT_FALSE(c.logprobs.empty());
      ExpectSameLogprobs(c.logprobs[0], ComputeLogprobs(Row(all, vocab, spec.prompt.size() - 1),
                                                        c.tokens[0], *spec.logprobs));
    }
  }
}

TEST_F(SchedulerTest, PromptLogprobsOfASessionsNextTurnScoreItsFirstToken) {
  // The previous turn's last token is read first (pending): its logits score the new prompt's
  // first token, and it is not reported itself.
  StartScheduler();
  ASSERT_TRUE(store_->Create("chat", "").ok());
  const auto p1 = Tokens(6, 2), p2 = Tokens(5, 3);
  auto t1 = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("chat", p1, 4), t1).ok());
  t1->Wait();
  GenerateJob second = Job("chat", p2, 3);
  second.prompt_logprobs = 1;
  auto t2 = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(std::move(second), t2).ok());
  t2->Wait();
  scheduler_.reset();
  auto s = engine_->NewSession();
  int32_t pending = -1;
  ASSERT_EQ(t1->tokens, Direct(*s, p1, 4, &pending));
  std::vector<float> all;
  ASSERT_TRUE(engine_->Prefill(*s, AfterPending(pending, p2), true, &all).ok());
  ASSERT_EQ(t2->prompt.size(), p2.size());
  for (size_t t = 0; t < p2.size(); ++t) {
    SCOPED_TRACE(t);
    EXPECT_EQ(t2->prompt[t].token, p2[t]);
    ASSERT_TRUE(t2->prompt[t].logprobs.has_value());
    ExpectSameLogprobs(*t2->prompt[t].logprobs,
                       ComputeLogprobs(Row(all, engine_->vocab_size(), t), p2[t], 1));
  }
}

// max_tokens 0: a turn that only reads its prompt (an agent appending a tool's output to its
// session, or a prompt scored with prompt_logprobs). It ends kLength with nothing generated and
// nothing pending, and the session's next turn continues from the whole prompt.
TEST_F(SchedulerTest, ATurnOfZeroTokensReadsItsPromptOnly) {
  StartScheduler();
  ASSERT_TRUE(store_->Create("agent", "").ok());
  const auto p1 = Tokens(6, 21), p2 = Tokens(5, 22), p3 = Tokens(4, 23);
  auto run = [&](const std::vector<int32_t>& p, int max_tokens, std::optional<int> scored) {
    GenerateJob job = Job("agent", p, max_tokens);
    job.prompt_logprobs = scored;
    auto c = std::make_shared<Collector>();
    SDM_CHECK(scheduler_->Submit(std::move(job), c).ok());
    c->Wait();
    return c;
  };
  auto t1 = run(p1, 3, std::nullopt);
  auto t2 = run(p2, 0, 0);  // appended, and scored
  auto t3 = run(p3, 3, std::nullopt);
  scheduler_.reset();
  EXPECT_EQ(t2->reason, FinishReason::kLength);
  EXPECT_TRUE(t2->tokens.empty());
  EXPECT_EQ(t2->usage.generated_tokens, 0);
  EXPECT_EQ(t2->usage.prompt_tokens, 5);
  EXPECT_TRUE(t2->prompt_done);
  ASSERT_EQ(t2->prompt.size(), p2.size());
  // t1's last token was pending: read first, it scores p2's first token.
  EXPECT_TRUE(t2->prompt[0].logprobs.has_value());
  EXPECT_EQ(t3->usage.history_tokens, 6 + t1->usage.generated_tokens + 5);
  // Reference: one session fed the same history; t2 left nothing pending.
  auto s = engine_->NewSession();
  int32_t pending = -1;
  EXPECT_EQ(t1->tokens, Direct(*s, p1, 3, &pending));
  ASSERT_TRUE(engine_->Prefill(*s, AfterPending(pending, p2), false, nullptr).ok());
  EXPECT_EQ(t3->tokens, Direct(*s, p3, 3));
}

// logit_bias: the job's tokens are drawn here from its biased logits row, exactly
// SampleToken(row + bias) of a solo engine run; its log-probabilities stay the model's own; and
// a job without bias in the same batch is unchanged.
TEST_F(SchedulerTest, LogitBiasDrawsFromTheBiasedRowAndChangesNothingElse) {
  StartScheduler();
  const std::vector<int32_t> prompt = Tokens(9, 31);
  const auto job = [&](std::vector<std::pair<int32_t, float>> bias, double temperature) {
    GenerateJob j = Job("", prompt, 6);
    j.sampling.temperature = temperature;
    j.sampling.seed = 77;
    j.logit_bias = std::move(bias);
    j.logprobs = 0;
    return j;
  };
  // Forced: +100 on one token makes it every draw's (greedy).
  const int32_t forced_token = 'q';
  auto forced = std::make_shared<Collector>();
  auto plain = std::make_shared<Collector>();
  auto banned = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(job({{forced_token, 100.0f}}, 0), forced).ok());
  ASSERT_TRUE(scheduler_->Submit(job({}, 0.9), plain).ok());
  // Sampled, with a few tokens pushed down and one up.
  const std::vector<std::pair<int32_t, float>> mixed = {{3, -100.0f}, {40, 2.5f}, {200, -7.0f}};
  ASSERT_TRUE(scheduler_->Submit(job(mixed, 0.9), banned).ok());
  forced->Wait();
  plain->Wait();
  banned->Wait();
  scheduler_.reset();
  EXPECT_EQ(forced->tokens, std::vector<int32_t>(6, forced_token));
  // The references: a solo engine run, drawing from the (biased) row on the host.
  for (const auto& [c, bias] : {std::pair{plain.get(), std::vector<std::pair<int32_t, float>>{}},
                                std::pair{banned.get(), mixed}}) {
    const GenerateJob spec = job(bias, 0.9);
    auto s = engine_->NewSession();
    std::vector<float> logits;
    ASSERT_TRUE(engine_->Prefill(*s, prompt, false, &logits).ok());
    ASSERT_EQ(c->logprobs.size(), c->tokens.size());
    for (size_t t = 0; t < c->tokens.size(); ++t) {
      std::vector<float> biased = logits;
      for (const auto& [id, b] : bias) biased[id] += b;
      ASSERT_EQ(c->tokens[t], SampleToken(biased, spec.sampling, t)) << "token " << t;
      EXPECT_EQ(c->logprobs[t].chosen.logprob,
                ComputeLogprobs(logits, c->tokens[t], 0).chosen.logprob);
      SessionState* p = s.get();
      ASSERT_TRUE(engine_->Decode({&p, 1}, {&c->tokens[t], 1}, logits).ok());
    }
  }
  EXPECT_TRUE(std::find(banned->tokens.begin(), banned->tokens.end(), 3) == banned->tokens.end());
}

TEST_F(SchedulerTest, LogprobsOutOfRangeAreRefused) {
  StartScheduler();
  for (const int n : {-1, kMaxTopLogprobs + 1}) {
    GenerateJob j = Job("", Tokens(4, 1), 2);
    j.logprobs = n;
    const absl::Status s = scheduler_->Submit(std::move(j), std::make_shared<Collector>());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << n;
    EXPECT_NE(s.message().find("logprobs must be in [0, 20]"), absl::string_view::npos) << s;
    GenerateJob prompt = Job("", Tokens(4, 1), 2);
    prompt.prompt_logprobs = n;
    const absl::Status p = scheduler_->Submit(std::move(prompt), std::make_shared<Collector>());
    EXPECT_EQ(p.code(), absl::StatusCode::kInvalidArgument) << n;
    EXPECT_NE(p.message().find("prompt_logprobs must be in [0, 20]"), absl::string_view::npos) << p;
  }
}

TEST_F(SchedulerTest, SessionTurnsContinueTheConversationAndSurviveARestart) {
  StartScheduler();
  ASSERT_TRUE(store_->Create("chat", "").ok());
  const auto p1 = Tokens(6, 2), p2 = Tokens(4, 3), p3 = Tokens(3, 4);
  auto run = [&](const std::vector<int32_t>& p) {
    auto c = std::make_shared<Collector>();
    SDM_CHECK(scheduler_->Submit(Job("chat", p, 5), c).ok());
    c->Wait();
    return c;
  };
  auto t1 = run(p1);
  auto t2 = run(p2);
  // p1 and every generated token of t1 (its last sampled token pended, and t2 read it first:
  // history, not prompt).
  EXPECT_EQ(t2->usage.history_tokens, 6 + t1->usage.generated_tokens);
  EXPECT_EQ(t2->usage.prompt_tokens, 4);
  // Restart: park everything to disk, new store and scheduler.
  scheduler_.reset();
  ASSERT_TRUE(store_->PersistAll().ok());
  store_.reset();
  OpenStore();
  StartScheduler();
  auto t3 = run(p3);
  scheduler_.reset();
  // Reference: one session fed exactly the same history.
  auto s = engine_->NewSession();
  int32_t pending = -1;
  EXPECT_EQ(t1->tokens, Direct(*s, p1, 5, &pending));
  EXPECT_EQ(t2->tokens, Direct(*s, AfterPending(pending, p2), 5, &pending));
  EXPECT_EQ(t3->tokens, Direct(*s, AfterPending(pending, p3), 5));
}

// A step failing part-way (EngineOptions::inject_forward_fault, engine/engine_backend.h): the
// job ends with the engine's error, which says its session is marked failed; the session is then
// refused before streaming (the store's FAILED_PRECONDITION) while other sessions are served,
// and its snapshot stays the last good copy (here: as created), which a restart serves again.
TEST_F(SchedulerTest, AStepFailingPartWayEndsTheJobAndRefusesItsSession) {
  ModelConfig c = *PresetConfig("tiny");
  EngineOptions o;
  // The prompt's prefill is one pass (fault points 0 .. n_layers - 1); the first decode pass
  // fails after its layer 1.
  o.inject_forward_fault = c.n_layers + 1;
  store_.reset();
  auto e = Engine::Create(RandomModel(c, 5), o);
  ASSERT_TRUE(e.ok());
  engine_ = *std::move(e);
  OpenStore();
  StartScheduler();
  ASSERT_TRUE(store_->Create("chat", "").ok());
  ASSERT_TRUE(store_->PersistAll().ok());  // its snapshot as created, before the failing turn
  auto failed = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("chat", Tokens(6, 2), 5), failed).ok());
  failed->Wait();
  EXPECT_EQ(failed->reason, FinishReason::kError);
  EXPECT_EQ(failed->error.code(), absl::StatusCode::kInternal) << failed->error;
  EXPECT_NE(failed->error.message().find("marked failed"), std::string::npos) << failed->error;
  EXPECT_EQ(failed->tokens.size(), 1u);  // sampled from the prefill; the decode failed

  auto refused = std::make_shared<Collector>();
  const absl::Status again = scheduler_->Submit(Job("chat", Tokens(3, 3), 5), refused);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  EXPECT_NE(again.message().find("half-updated"), std::string::npos) << again;
  EXPECT_FALSE(refused->finished);

  ASSERT_TRUE(store_->Create("other", "").ok());
  auto served = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("other", Tokens(6, 2), 5), served).ok());
  served->Wait();
  EXPECT_NE(served->reason, FinishReason::kError) << served->error;
  EXPECT_TRUE(served->error.ok()) << served->error;

  // A restart reads the last good snapshot of "chat": as it was created.
  scheduler_.reset();
  ASSERT_TRUE(store_->PersistAll().ok());
  store_.reset();
  OpenStore();
  auto lease = store_->Acquire("chat");
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->state().position(), 0);
  EXPECT_FALSE(lease->state().failed());
}

TEST_F(SchedulerTest, BusyAndUnknownSessionsAreRefusedBeforeStreaming) {
  StartScheduler();
  ASSERT_TRUE(store_->Create("busy", "").ok());
  auto lease = store_->Acquire("busy");
  ASSERT_TRUE(lease.ok());
  auto c = std::make_shared<Collector>();
  EXPECT_EQ(scheduler_->Submit(Job("busy", Tokens(3, 1), 3), c).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(scheduler_->Submit(Job("ghost", Tokens(3, 1), 3), c).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(scheduler_->Submit(Job("", {}, 3), c).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(c->finished);  // nothing was streamed
}

// A job prepared from a read of its session that a turn in between made stale (its
// expected_history) is refused with IsSessionChanged and changes nothing: the session keeps its
// pending token, and the job prepared again from the session as it is now continues it exactly.
TEST_F(SchedulerTest, AJobPreparedFromAStaleReadIsRefusedAndChangesNothing) {
  StartScheduler();
  ASSERT_TRUE(store_->Create("chat", "").ok());
  const auto p1 = Tokens(6, 2), p2 = Tokens(4, 3);
  auto first = std::make_shared<Collector>();
  GenerateJob turn1 = Job("chat", p1, 5);
  turn1.expected_history = 0;  // as read: a new session
  ASSERT_TRUE(scheduler_->Submit(std::move(turn1), first).ok());
  first->Wait();
  const int64_t history = 6 + first->usage.generated_tokens;  // fed tokens and the pending one
  // The refusals below are not turns: the session's last use (and ttl) stays as the first's.
  const absl::StatusOr<SessionInfo> before = store_->Get(SessionKey("chat"));
  ASSERT_TRUE(before.ok()) << before.status();

  for (const int64_t stale : {int64_t{0}, history - 1, history + 1}) {
    auto refused = std::make_shared<Collector>();
    GenerateJob job = Job("chat", p2, 5);
    job.expected_history = stale;
    const absl::Status s = scheduler_->Submit(std::move(job), refused);
    EXPECT_TRUE(IsSessionChanged(s)) << s;
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_FALSE(refused->finished);
  }
  const absl::StatusOr<SessionInfo> after = store_->Get(SessionKey("chat"));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->last_used, before->last_used);
  // Not a session change: another job holding the session is ABORTED without the mark.
  {
    auto lease = store_->Acquire("chat");
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(lease->state().position() + (lease->state().pending_token >= 0 ? 1 : 0), history);
    auto c = std::make_shared<Collector>();
    const absl::Status busy = scheduler_->Submit(Job("chat", p2, 5), c);
    EXPECT_EQ(busy.code(), absl::StatusCode::kAborted) << busy;
    EXPECT_FALSE(IsSessionChanged(busy)) << busy;
  }
  auto second = std::make_shared<Collector>();
  GenerateJob turn2 = Job("chat", p2, 5);
  turn2.expected_history = history;
  ASSERT_TRUE(scheduler_->Submit(std::move(turn2), second).ok());
  second->Wait();
  // The pending token, fed first, counts as history (the caller never sent it).
  EXPECT_EQ(second->usage.history_tokens, history);
  EXPECT_EQ(second->usage.prompt_tokens, static_cast<int64_t>(p2.size()));
  scheduler_.reset();

  auto s = engine_->NewSession();
  int32_t pending = -1;
  EXPECT_EQ(first->tokens, Direct(*s, p1, 5, &pending));
  EXPECT_EQ(second->tokens, Direct(*s, AfterPending(pending, p2), 5));
}

TEST_F(SchedulerTest, CancellationFreesTheSequenceWithinAStep) {
  SchedulerOptions o;
  o.max_running = 1;
  StartScheduler(o);
  auto first = std::make_shared<Collector>();
  first->cancel_after = 2;
  ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(4, 1), 1000), first).ok());
  auto second = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(4, 2), 3), second).ok());
  first->Wait();
  EXPECT_EQ(first->reason, FinishReason::kCancelled);
  EXPECT_LE(first->tokens.size(), 3u);  // ended within one step of the request
  second->Wait();
  EXPECT_TRUE(second->reason == FinishReason::kLength || second->reason == FinishReason::kEos);
}

// Text held back for a possible stop string is final when the job is cancelled: its tokens are in
// the session, so the client gets their text too (the stream's text is the decoding of its ids).
TEST_F(SchedulerTest, ACancelledJobSendsTheTextItHeldBack) {
  UseNoEosModel();  // runs until the test cancels it
  StartScheduler();
  auto c = std::make_shared<Collector>();
  c->cancel_after = 10;
  GenerateJob j = Job("", Tokens(4, 1), 100000);
  j.stop_strings = {std::string(40, '\x7f')};  // never generated: 39 bytes are always held back
  ASSERT_TRUE(scheduler_->Submit(std::move(j), c).ok());
  c->Wait();
  EXPECT_EQ(c->reason, FinishReason::kCancelled);
  ASSERT_GE(c->tokens.size(), 10u);
  EXPECT_EQ(c->text, tokenizer_->Decode(c->tokens));
}

TEST_F(SchedulerTest, DeadlineEndsTheJobAndFreesItsPlace) {
  SchedulerOptions o;
  o.max_running = 1;
  StartScheduler(o);
  auto c = std::make_shared<Collector>();
  GenerateJob j = Job("", Tokens(4, 1), 100000);
  j.deadline = absl::Now();  // already past when its first step runs
  ASSERT_TRUE(scheduler_->Submit(std::move(j), c).ok());
  auto next = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(4, 2), 3), next).ok());
  c->Wait();
  EXPECT_EQ(c->reason, FinishReason::kDeadline);
  EXPECT_TRUE(c->tokens.empty());
  next->Wait();  // the only running place was freed
  EXPECT_NE(next->reason, FinishReason::kDeadline);
}

TEST_F(SchedulerTest, AJobCancelledOrExpiredWhileWaitingEndsWithoutRunning) {
  UseNoEosModel();  // the long job runs until the test cancels it
  SchedulerOptions o;
  o.max_running = 1;
  StartScheduler(o);
  ASSERT_TRUE(store_->Create(SessionKey("chat"), "").ok());
  // A first turn leaves the session a pending token (its last sampled one, not yet read).
  auto first = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("chat", Tokens(3, 4), 2), first).ok());
  first->Wait();
  ASSERT_EQ(first->reason, FinishReason::kLength);
  const int64_t history = 3 + 2;  // its prompt and output, the last one pending
  // The session holds a staged upload (as a CUDA engine's StageResume leaves it): a job that
  // never runs must give it back when it ends, not leave it to the session's next turn.
  auto staged_dropped = std::make_shared<std::atomic<bool>>(false);
  {
    absl::StatusOr<SessionLease> lease = store_->Acquire(SessionKey("chat"));
    ASSERT_TRUE(lease.ok()) << lease.status();
    lease->state().AttachStaged(std::make_unique<FakeStaged>(staged_dropped));
  }
  // The only running place is held by a long job until the test cancels it.
  auto running = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(4, 1), 1000000), running).ok());
  auto queued = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("chat", Tokens(4, 2), 5), queued).ok());
  EXPECT_FALSE(*staged_dropped) << "dropped before the job ended";
  auto expired = std::make_shared<Collector>();
  GenerateJob late = Job("", Tokens(4, 3), 5);
  late.deadline = absl::Now();  // past by the next step
  ASSERT_TRUE(scheduler_->Submit(std::move(late), expired).ok());
  queued->cancelled = true;
  queued->Wait();  // ends while the long job still runs: it never got a running place
  expired->Wait();
  EXPECT_FALSE(running->finished);
  EXPECT_EQ(queued->reason, FinishReason::kCancelled);
  EXPECT_TRUE(*staged_dropped);
  EXPECT_TRUE(queued->tokens.empty());
  EXPECT_EQ(queued->usage.generated_tokens, 0);
  EXPECT_EQ(queued->usage.prompt_tokens, 0);  // usage counts what was read
  // The pending token it did not read stays the session's: history, as GetSession counts it.
  EXPECT_EQ(queued->usage.history_tokens, history);
  EXPECT_EQ(expired->reason, FinishReason::kDeadline);
  EXPECT_TRUE(expired->tokens.empty());
  EXPECT_EQ(expired->usage.prompt_tokens, 0);
  running->cancelled = true;
  running->Wait();
  EXPECT_EQ(running->reason, FinishReason::kCancelled);
  // The session read nothing of the cancelled turn.
  absl::StatusOr<SessionLease> lease = store_->Acquire(SessionKey("chat"));
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->state().position() + (lease->state().pending_token >= 0 ? 1 : 0), history);
}

// Holds the step thread in its first token until released (nothing steps meanwhile), so that
// jobs submitted in between share the next step.
class HeldCollector : public Collector {
 public:
  void OnToken(int32_t token, absl::string_view text, const TokenLogprobs* lp) override {
    Collector::OnToken(token, text, lp);
    if (!entered.HasBeenNotified()) {
      entered.Notify();
      release.WaitForNotification();
    }
  }
  absl::Notification entered, release;
};

TEST_F(SchedulerTest, FullQueueIsRefusedAndTheSchedulerKeepsServing) {
  SchedulerOptions o;
  o.max_running = 1;
  o.max_waiting = 2;
  StartScheduler(o);
  // The running job holds the step thread in its first token until the queue has been filled
  // and refused a job: nothing ends or is admitted meanwhile, however slow the machine.
  auto running = std::make_shared<HeldCollector>();
  absl::Cleanup release = [&] { running->release.Notify(); };
  ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(4, 0), 200), running).ok());
  ASSERT_TRUE(running->entered.WaitForNotificationWithTimeout(absl::Minutes(1)));
  std::vector<std::shared_ptr<Collector>> jobs = {running};
  for (int i = 1; i <= 2; ++i) {
    jobs.push_back(std::make_shared<Collector>());
    ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(4, i), 200), jobs.back()).ok()) << i;
  }
  auto refused_job = std::make_shared<Collector>();
  const absl::Status refused = scheduler_->Submit(Job("", Tokens(4, 3), 200), refused_job);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(std::string(refused.message()), "the queue is full (2 requests waiting); retry later");
  std::move(release).Invoke();
  for (auto& j : jobs) j->Wait();
  EXPECT_FALSE(refused_job->finished);  // the refused job never started
  auto after = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(4, 99), 2), after).ok());
  after->Wait();
  // Ends normally: its length, or EOS when the random model samples it first.
  EXPECT_TRUE(after->reason == FinishReason::kLength || after->reason == FinishReason::kEos);
}

// A turn refused at Submit leaves its session as it was: pending token and sampler seed.
TEST_F(SchedulerTest, ARefusedTurnLeavesItsSessionUnchanged) {
  UseNoEosModel();  // the jobs filling the queue run until the test cancels them
  SchedulerOptions o;
  o.max_running = 1;
  o.max_waiting = 1;
  StartScheduler(o);
  ASSERT_TRUE(store_->Create(SessionKey("chat"), "").ok());
  auto first = std::make_shared<Collector>();
  GenerateJob turn = Job("chat", Tokens(3, 4), 2);
  turn.sampling.seed = 5;
  ASSERT_TRUE(scheduler_->Submit(std::move(turn), first).ok());
  first->Wait();
  int32_t pending = -1;
  {
    absl::StatusOr<SessionLease> lease = store_->Acquire(SessionKey("chat"));
    ASSERT_TRUE(lease.ok()) << lease.status();
    ASSERT_EQ(lease->state().sampler_seed, 5u);
    pending = lease->state().pending_token;
    ASSERT_GE(pending, 0);
  }
  // One job runs and one waits, until cancelled: the queue stays full.
  std::vector<std::shared_ptr<Collector>> fillers;
  for (int i = 0; i < 2; ++i) {
    fillers.push_back(std::make_shared<Collector>());
    ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(4, i), 1000000), fillers.back()).ok());
  }
  GenerateJob refused_turn = Job("chat", Tokens(3, 5), 2);
  refused_turn.sampling.seed = 9;
  EXPECT_EQ(scheduler_->Submit(std::move(refused_turn), std::make_shared<Collector>()).code(),
            absl::StatusCode::kResourceExhausted);
  for (auto& f : fillers) f->cancelled = true;
  for (auto& f : fillers) f->Wait();
  absl::StatusOr<SessionLease> lease = store_->Acquire(SessionKey("chat"));
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->state().sampler_seed, 5u);
  EXPECT_EQ(lease->state().pending_token, pending);
}

// Replicas: a turn whose write is refused because this replica lost the session (another took
// it over while the turn ran) is not in the session's state: its client gets ABORTED, not a
// normal end. A turn whose write goes through ends normally.
TEST_F(SchedulerTest, ATurnWhoseWriteIsFencedEndsWithAborted) {
  class LosableOwnership : public SessionOwnership {
   public:
    absl::Status Claim(const SessionKey&) override { return absl::OkStatus(); }
    absl::Status CheckWrite(const SessionKey&) override {
      return lost.load() ? absl::FailedPreconditionError("the lease expired") : absl::OkStatus();
    }
    void Release(const SessionKey&) override {}
    std::atomic<bool> lost{false};
  };
  LosableOwnership ownership;
  store_.reset();
  SessionStoreOptions so;
  so.dir = dir_;
  so.shared_dir = true;
  so.ownership = &ownership;
  auto opened = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), so);
  ASSERT_TRUE(opened.ok()) << opened.status();
  store_ = *std::move(opened);
  StartScheduler();
  ASSERT_TRUE(store_->Create(SessionKey("chat"), "").ok());
  auto saved = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("chat", Tokens(4, 1), 3), saved).ok());
  saved->Wait();
  EXPECT_TRUE(saved->error.ok()) << saved->error;
  EXPECT_NE(saved->reason, FinishReason::kError);
  ownership.lost.store(true);
  auto fenced = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("chat", Tokens(4, 2), 3), fenced).ok());
  fenced->Wait();
  EXPECT_EQ(fenced->reason, FinishReason::kError);
  EXPECT_EQ(fenced->error.code(), absl::StatusCode::kAborted) << fenced->error;
  EXPECT_NE(fenced->error.message().find("send it again"), absl::string_view::npos)
      << fenced->error;
  EXPECT_EQ(store_->Stats().fenced_writes, 1);
}

// Engine options whose engine refuses (RESOURCE_EXHAUSTED, nothing changed) the first step of
// three or more segments, counting such steps in `refused`.
EngineOptions RefusingTheFirstStepOfThree(std::shared_ptr<std::atomic<int>> refused) {
  EngineOptions o;
  o.testing_refuse_step = [refused](const StepBatch& batch) {
    return batch.segments.size() >= 3 && refused->fetch_add(1) == 0;
  };
  return o;
}

// A shutdown that cancels: the running job ends cancelled (its session keeps what it did); the
// queued one, which never ran, is refused with UNAVAILABLE so that its client retries it, not
// answered with an empty "cancelled" completion (from the operability audit).
TEST_F(SchedulerTest, ACancellingShutdownRefusesTheJobsThatNeverRan) {
  UseNoEosModel();
  SchedulerOptions o;
  o.max_running = 1;
  StartScheduler(o);
  auto running = std::make_shared<HeldCollector>();
  ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(4, 1), 1'000'000), running).ok());
  running->entered.WaitForNotification();  // the step thread is held in its first token
  auto queued = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(4, 2), 5), queued).ok());
  std::thread shutdown([this] { scheduler_->Shutdown(/*cancel=*/true); });
  // The shutdown has begun once submissions are refused (the same lock sets both).
  ASSERT_TRUE(sdm::testing::Eventually([&] {
    return absl::IsUnavailable(
        scheduler_->Submit(Job("", Tokens(2, 3), 1), std::make_shared<Collector>()));
  }));
  running->release.Notify();
  shutdown.join();
  running->Wait();
  queued->Wait();
  EXPECT_EQ(running->reason, FinishReason::kCancelled);
  EXPECT_EQ(queued->reason, FinishReason::kError);
  EXPECT_TRUE(absl::IsUnavailable(queued->error)) << queued->error;
  EXPECT_NE(queued->error.message().find("nothing of it ran: retry it"), std::string::npos)
      << queued->error;
  EXPECT_TRUE(queued->tokens.empty());
  EXPECT_EQ(queued->usage.prompt_tokens, 0);
}

// A turn ends (its final chunk, OnFinish) once its own write is done, while the next turn on its
// session runs: the next turn's Submit takes the session before any writer got to the first (the
// store's only writer is held in another session's write throughout) and writes it first. Before,
// the writers skipped the session while the next turn held it, so the first turn ended only after
// the whole next turn (observed: 20k tokens later). The next turn is held in its first token until
// the first turn has ended.
TEST_F(SchedulerTest, ATurnEndsWhileTheNextTurnOnItsSessionRuns) {
  sdm::testing::SessionWriteFiles files;
  store_.reset();
  SessionStoreOptions so;
  so.dir = dir_;
  so.files = &files;
  so.persist_writers = 1;  // the worker alone
  auto opened = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), so);
  ASSERT_TRUE(opened.ok()) << opened.status();
  store_ = *std::move(opened);
  absl::Cleanup close = [&] {  // before `files` goes: the gate, then the store's threads
    files.Open();
    scheduler_.reset();
    store_.reset();
  };
  StartScheduler();
  for (const char* id : {"blocker", "chat"}) {
    ASSERT_TRUE(store_->Create(id, "").ok());
    absl::Notification written;
    store_->WhenPersisted(id, [&](const absl::Status& saved) {
      EXPECT_TRUE(saved.ok()) << saved;
      written.Notify();
    });
    ASSERT_TRUE(written.WaitForNotificationWithTimeout(absl::Minutes(1)));
  }
  files.Hold(SessionFileStem(SessionKey("blocker")));
  ASSERT_TRUE(store_->Acquire("blocker").ok());  // a turn of nothing: its write holds the writer
  ASSERT_TRUE(files.WaitHeld(absl::Minutes(1)));

  auto first = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("chat", Tokens(6, 2), 3), first).ok());
  // The next turn, as soon as the first has returned the session (refused as busy until then).
  auto next = std::make_shared<HeldCollector>();
  absl::Status submitted;
  do {
    submitted = scheduler_->Submit(Job("chat", Tokens(4, 3), 3), next);
  } while (absl::IsAborted(submitted));
  ASSERT_TRUE(submitted.ok()) << submitted;
  ASSERT_TRUE(next->entered.WaitForNotificationWithTimeout(absl::Minutes(1)));
  const bool ended = first->WaitFor(std::chrono::minutes(1));
  next->release.Notify();
  ASSERT_TRUE(ended) << "the first turn did not end while the next one ran";
  EXPECT_TRUE(first->error.ok()) << first->error;
  EXPECT_NE(first->reason, FinishReason::kError);
  files.Open();  // the next turn's own write, and its end
  ASSERT_TRUE(next->WaitFor(std::chrono::minutes(1)));
  EXPECT_TRUE(next->error.ok()) << next->error;
}

// A step that does not fit (RESOURCE_EXHAUSTED, nothing changed: a device's memory) sends the
// job admitted last back to the queue and the others step on; every job still ends with exactly
// its solo tokens (before, every job of that step failed). The step thread is held in the first
// job's first token while the two others are submitted, so that all three share the next step,
// which the engine refuses once.
TEST_F(SchedulerTest, AStepThatDoesNotFitDefersTheLastJobInsteadOfFailingAll) {
  auto refused = std::make_shared<std::atomic<int>>(0);
  UseNoEosModel(RefusingTheFirstStepOfThree(refused));
  constexpr int kTokens = 6;
  std::vector<std::vector<int32_t>> prompts, solo;
  for (int i = 0; i < 3; ++i) {
    prompts.push_back(Tokens(5 + i, 40 + i));
    auto s = engine_->NewSession();
    solo.push_back(Direct(*s, prompts[i], kTokens));
  }
  SchedulerOptions so;
  so.max_running = 3;
  StartScheduler(so);
  auto first = std::make_shared<HeldCollector>();
  ASSERT_TRUE(scheduler_->Submit(Job("", prompts[0], kTokens), first).ok());
  first->entered.WaitForNotification();
  std::vector<std::shared_ptr<Collector>> jobs = {first};
  for (int i = 1; i < 3; ++i) {
    jobs.push_back(std::make_shared<Collector>());
    ASSERT_TRUE(scheduler_->Submit(Job("", prompts[i], kTokens), jobs.back()).ok());
  }
  first->release.Notify();
  for (int i = 0; i < 3; ++i) {
    jobs[i]->Wait();
    EXPECT_TRUE(jobs[i]->error.ok()) << i << ": " << jobs[i]->error;
    EXPECT_EQ(jobs[i]->reason, FinishReason::kLength) << i;
    EXPECT_EQ(jobs[i]->tokens, solo[i]) << i;
  }
  EXPECT_GE(refused->load(), 1);
  EXPECT_EQ(scheduler_->deferred_jobs(), 1);
}

// A job alone whose step does not fit fails. While its session holds nothing of the request
// that is RESOURCE_EXHAUSTED (retry); once the session read part of the prompt it is ABORTED
// saying what the session kept, since a client retrying RESOURCE_EXHAUSTED would feed the whole
// prompt again after that part.
TEST_F(SchedulerTest, AJobAloneWhoseStepDoesNotFitSaysWhatItsSessionKept) {
  constexpr int64_t kChunk = 4;
  auto refuse_step = std::make_shared<std::atomic<int>>(1);  // the n-th step from now (1-based)
  EngineOptions eo;
  eo.prefill_chunk = kChunk;
  eo.testing_refuse_step = [refuse_step](const StepBatch&) {
    return refuse_step->fetch_sub(1) == 1;
  };
  UseNoEosModel(eo);
  StartScheduler(SchedulerOptions{});
  ASSERT_TRUE(store_->Create(SessionKey("chat"), "").ok());
  // Its first step refused: nothing read, retrying is right.
  auto first = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("chat", Tokens(3 * kChunk, 11), 5), first).ok());
  first->Wait();
  EXPECT_EQ(first->error.code(), absl::StatusCode::kResourceExhausted) << first->error;
  EXPECT_EQ(first->usage.prompt_tokens, 0);
  // Its second step refused: the session read the first chunk.
  refuse_step->store(2);
  auto second = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("chat", Tokens(3 * kChunk, 12), 5), second).ok());
  second->Wait();
  EXPECT_EQ(second->error.code(), absl::StatusCode::kAborted) << second->error;
  EXPECT_NE(second->error.message().find(absl::StrCat(kChunk, " of its ", 3 * kChunk,
                                                      " prompt tokens read, 0 tokens generated")),
            absl::string_view::npos)
      << second->error;
  EXPECT_EQ(second->usage.prompt_tokens, kChunk);
  scheduler_.reset();
  absl::StatusOr<SessionLease> lease = store_->Acquire(SessionKey("chat"));
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->state().position(), kChunk);
}

class StepFailureCount : public SchedulerListener {
 public:
  void OnStepFailed(const absl::Status&) override { ++failures; }
  std::atomic<int> failures{0};
};

// A failed engine step is logged with its cause (the requests' codes alone did not say why a
// batch failed), once per cause while steps keep failing, and the recovery once; each failed step
// is counted (sdm_engine_step_failures_total).
TEST_F(SchedulerTest, FailedStepsAreLoggedOncePerCauseAndCounted) {
  auto refuse = std::make_shared<std::atomic<bool>>(true);
  EngineOptions eo;
  eo.testing_refuse_step = [refuse](const StepBatch&) { return refuse->load(); };
  UseNoEosModel(eo);
  StepFailureCount count;
  scheduler_ =
      std::make_unique<Scheduler>(*engine_, *store_, *tokenizer_, SchedulerOptions{}, &count);
  sdm::testing::CapturedLog log;
  for (int i = 0; i < 3; ++i) {  // each alone, its step refused: it fails
    auto c = std::make_shared<Collector>();
    ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(4, 20 + i), 2), c).ok());
    c->Wait();
    ASSERT_EQ(c->error.code(), absl::StatusCode::kResourceExhausted) << c->error;
  }
  refuse->store(false);
  auto served = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(4, 30), 2), served).ok());
  served->Wait();
  ASSERT_TRUE(served->error.ok()) << served->error;
  scheduler_.reset();
  const std::vector<std::string> failed = log.With("failed: RESOURCE_EXHAUSTED");
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_TRUE(absl::StartsWith(failed[0], "E sdm scheduler: an engine step of 1 requests"))
      << failed[0];
  EXPECT_EQ(log.With("engine steps succeed again").size(), 1u);
  EXPECT_EQ(count.failures.load(), 3);
}

// What RefuseOnce saw: whether it refused, and the sorted segment lengths of the step after.
struct StepAfterRefusal {
  absl::Mutex mu;
  bool refused ABSL_GUARDED_BY(mu) = false;
  std::vector<size_t> next ABSL_GUARDED_BY(mu);
};

// An EngineOptions::testing_refuse_step that refuses, once, the first step whose segments have
// the sorted lengths `refused_lengths`, and records the step after it in `record`.
std::function<bool(const StepBatch&)> RefuseOnce(std::shared_ptr<StepAfterRefusal> record,
                                                 std::vector<size_t> refused_lengths) {
  return [record, refused_lengths](const StepBatch& batch) {
    std::vector<size_t> lengths;
    for (const StepSegment& seg : batch.segments) lengths.push_back(seg.tokens.size());
    std::sort(lengths.begin(), lengths.end());
    absl::MutexLock lock(&record->mu);
    if (!record->refused) {
      record->refused = lengths == refused_lengths;
      return record->refused;
    }
    if (record->next.empty()) record->next = lengths;
    return false;
  };
}

// The job a step that does not fit defers is the last-admitted job that was in the step, not one
// the prefill budget left out of it (deferring that one changed nothing: the same step was
// refused again, and the cap was lowered for nothing). Here A decodes, B (a 3-chunk prompt) takes
// the whole budget, and C, admitted last, waits for budget: the step {B's chunk, A} is refused
// once; B is deferred, so the next step is {C's prompt, A}.
TEST_F(SchedulerTest, AStepThatDoesNotFitDefersTheLastJobThatWasInIt) {
  constexpr int64_t kChunk = 8;
  auto record = std::make_shared<StepAfterRefusal>();
  EngineOptions eo;
  eo.prefill_chunk = kChunk;
  eo.testing_refuse_step = RefuseOnce(record, {1, kChunk});
  UseNoEosModel(eo);
  constexpr int kTokens = 4;
  const std::vector<int32_t> a_prompt = Tokens(3, 80), b_prompt = Tokens(3 * kChunk - 2, 81),
                             c_prompt = Tokens(5, 82);
  std::vector<std::vector<int32_t>> solo;
  for (const auto* p : {&a_prompt, &b_prompt, &c_prompt}) {
    auto s = engine_->NewSession();
    solo.push_back(Direct(*s, *p, kTokens));
  }
  SchedulerOptions so;
  so.max_running = 3;
  so.prefill_token_budget = kChunk;
  StartScheduler(so);
  auto a = std::make_shared<HeldCollector>();
  ASSERT_TRUE(scheduler_->Submit(Job("", a_prompt, kTokens), a).ok());
  a->entered.WaitForNotification();
  auto b = std::make_shared<Collector>(), c = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("", b_prompt, kTokens), b).ok());
  ASSERT_TRUE(scheduler_->Submit(Job("", c_prompt, kTokens), c).ok());
  a->release.Notify();
  const std::vector<std::shared_ptr<Collector>> jobs = {a, b, c};
  for (size_t i = 0; i < jobs.size(); ++i) {
    jobs[i]->Wait();
    EXPECT_TRUE(jobs[i]->error.ok()) << i << ": " << jobs[i]->error;
    EXPECT_EQ(jobs[i]->tokens, solo[i]) << i;
  }
  EXPECT_EQ(scheduler_->deferred_jobs(), 1);
  absl::MutexLock lock(&record->mu);
  EXPECT_TRUE(record->refused);
  EXPECT_EQ(record->next, (std::vector<size_t>{1, c_prompt.size()}));
}

// When nothing runs, the batch cap is lifted: a cascade of steps that did not fit (every step of
// two or more jobs refused, while it lasts) caps the batch at 1 and leaves it at 3 of 4 places
// once its jobs have ended one by one; a burst that follows, with no queue (max_waiting 0), then
// got only 3 places (the fourth job refused) though nothing was running. The burst's first job
// is held in its first token while the others are submitted, so the place count is exact.
TEST_F(SchedulerTest, TheBatchCapIsLiftedWhenNothingRuns) {
  auto refusing = std::make_shared<std::atomic<bool>>(true);
  EngineOptions eo;
  eo.testing_refuse_step = [refusing](const StepBatch& batch) {
    return refusing->load() && batch.segments.size() >= 2;
  };
  UseNoEosModel(eo);
  constexpr int kTokens = 3;
  SchedulerOptions so;
  so.max_running = 4;
  so.max_waiting = 0;
  StartScheduler(so);
  // The cascade: A alone, then B, C, D submitted while A is held.
  auto first = std::make_shared<HeldCollector>();
  ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(3, 90), kTokens), first).ok());
  first->entered.WaitForNotification();
  std::vector<std::shared_ptr<Collector>> cascade = {first};
  for (int i = 1; i < 4; ++i) {
    cascade.push_back(std::make_shared<Collector>());
    ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(3, 90 + i), kTokens), cascade.back()).ok());
  }
  first->release.Notify();
  for (auto& c : cascade) {
    c->Wait();
    EXPECT_TRUE(c->error.ok()) << c->error;
  }
  EXPECT_GE(scheduler_->deferred_jobs(), 3);  // D, C and B at least, one by one
  refusing->store(false);
  // The burst: four places free, nothing waits.
  auto held = std::make_shared<HeldCollector>();
  ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(3, 95), kTokens), held).ok());
  held->entered.WaitForNotification();  // running; the step thread waits here
  std::vector<std::shared_ptr<Collector>> burst = {held};
  for (int i = 1; i < 4; ++i) {
    burst.push_back(std::make_shared<Collector>());
    const absl::Status submitted =
        scheduler_->Submit(Job("", Tokens(3, 95 + i), kTokens), burst.back());
    EXPECT_TRUE(submitted.ok()) << "job " << i << " of the burst: " << submitted;
    if (!submitted.ok()) burst.pop_back();
  }
  held->release.Notify();
  for (auto& c : burst) c->Wait();
}

// The capped batch also grows back while its jobs run on: a job deferred behind two long ones
// runs (and ends) long before they do, once 64 steps have fitted, not only when one of them ends.
TEST_F(SchedulerTest, ACappedBatchGrowsBackWhileItsJobsRunOn) {
  auto refused = std::make_shared<std::atomic<int>>(0);
  UseNoEosModel(RefusingTheFirstStepOfThree(refused));
  constexpr int kLong = 300, kShort = 6;
  const std::vector<int32_t> short_prompt = Tokens(7, 52);
  std::vector<int32_t> solo;
  {
    auto s = engine_->NewSession();
    solo = Direct(*s, short_prompt, kShort);
  }
  // Records, as it ends (on the step thread, where the other's tokens are counted), how many
  // tokens a long job had.
  class Watcher : public Collector {
   public:
    explicit Watcher(const Collector* other) : other_(other) {}
    void OnFinish(FinishReason r, const Usage& u, const absl::Status& e) override {
      other_tokens_at_end = other_->tokens.size();
      Collector::OnFinish(r, u, e);
    }
    size_t other_tokens_at_end = 0;

   private:
    const Collector* other_;
  };
  SchedulerOptions so;
  so.max_running = 3;
  StartScheduler(so);
  auto first = std::make_shared<HeldCollector>();
  ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(5, 50), kLong), first).ok());
  first->entered.WaitForNotification();
  auto second = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(6, 51), kLong), second).ok());
  auto last = std::make_shared<Watcher>(first.get());
  ASSERT_TRUE(scheduler_->Submit(Job("", short_prompt, kShort), last).ok());
  first->release.Notify();
  last->Wait();
  EXPECT_TRUE(last->error.ok()) << last->error;
  EXPECT_EQ(last->tokens, solo);
  EXPECT_EQ(scheduler_->deferred_jobs(), 1);
  // It ran while the long ones did: deferred at their second step, back after 64 more.
  EXPECT_LT(last->other_tokens_at_end, static_cast<size_t>(kLong));
  first->Wait();
  second->Wait();
  EXPECT_EQ(first->reason, FinishReason::kLength);
  EXPECT_EQ(second->reason, FinishReason::kLength);
}

// A job feeds at most one of the engine's prefill chunks per step, whatever the budget: each
// step is then one forward pass, so a step that does not fit cannot have fed part of a prompt
// first (a second pass failing would leave the session half fed and failed). A budget above the
// chunk still feeds several jobs' prompts in one step. Every segment the engine sees is at most a
// chunk long, and each job's tokens are its solo run's.
TEST_F(SchedulerTest, AJobFeedsAtMostOnePrefillChunkPerStep) {
  constexpr int64_t kChunk = 8;
  auto longest = std::make_shared<std::atomic<size_t>>(0);
  auto widest = std::make_shared<std::atomic<int>>(0);  // prompt segments in one step
  EngineOptions eo;
  eo.prefill_chunk = kChunk;
  eo.testing_refuse_step = [longest, widest](const StepBatch& batch) {
    int prompts = 0;
    for (const StepSegment& seg : batch.segments) {
      if (seg.tokens.size() > longest->load()) longest->store(seg.tokens.size());
      prompts += seg.tokens.size() > 1 ? 1 : 0;
    }
    if (prompts > widest->load()) widest->store(prompts);
    return false;
  };
  UseNoEosModel(eo);
  constexpr int kTokens = 5;
  const std::vector<std::vector<int32_t>> prompts = {Tokens(5 * kChunk + 3, 70),
                                                     Tokens(3 * kChunk, 71)};
  std::vector<std::vector<int32_t>> solo;
  for (const auto& p : prompts) {
    auto s = engine_->NewSession();
    solo.push_back(Direct(*s, p, kTokens));
  }
  longest->store(0);  // the solo runs fed whole prompts
  widest->store(0);
  SchedulerOptions so;
  so.prefill_token_budget = 4 * kChunk;
  StartScheduler(so);
  auto first = std::make_shared<HeldCollector>();
  ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(3, 72), kTokens), first).ok());
  first->entered.WaitForNotification();  // both prompts then start in the same step
  std::vector<std::shared_ptr<Collector>> jobs;
  for (const auto& p : prompts) {
    jobs.push_back(std::make_shared<Collector>());
    ASSERT_TRUE(scheduler_->Submit(Job("", p, kTokens), jobs.back()).ok());
  }
  first->release.Notify();
  for (size_t i = 0; i < jobs.size(); ++i) {
    jobs[i]->Wait();
    EXPECT_TRUE(jobs[i]->error.ok()) << i << ": " << jobs[i]->error;
    EXPECT_EQ(jobs[i]->tokens, solo[i]) << i;
  }
  first->Wait();
  EXPECT_EQ(longest->load(), static_cast<size_t>(kChunk));
  EXPECT_EQ(widest->load(), 2);
}

// Usage counts what was read: a prompt of three engine chunks cancelled during its first step
// reports the one chunk the session read (its position says the same), not the whole prompt.
TEST_F(SchedulerTest, AJobEndedDuringItsPrefillReportsThePromptItRead) {
  constexpr int64_t kChunk = 8;
  auto job = std::make_shared<Collector>();
  EngineOptions eo;
  eo.prefill_chunk = kChunk;
  eo.testing_refuse_step = [job](const StepBatch&) {
    job->cancelled = true;  // seen before the next step: the job ends after this one
    return false;
  };
  UseNoEosModel(eo);
  StartScheduler(SchedulerOptions{});
  ASSERT_TRUE(store_->Create(SessionKey("chat"), "").ok());
  ASSERT_TRUE(scheduler_->Submit(Job("chat", Tokens(3 * kChunk, 9), 5), job).ok());
  job->Wait();
  EXPECT_EQ(job->reason, FinishReason::kCancelled);
  EXPECT_EQ(job->usage.prompt_tokens, kChunk);
  EXPECT_EQ(job->usage.history_tokens, 0);
  EXPECT_EQ(job->usage.generated_tokens, 0);
  scheduler_.reset();
  absl::StatusOr<SessionLease> lease = store_->Acquire(SessionKey("chat"));
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->state().position(), kChunk);
}

// max_waiting 0: no queue, but every free place in the batch still admits a job (it refused
// every job, even on an idle server); a job's place is free again before its client hears of
// its end.
TEST_F(SchedulerTest, NoQueueStillAdmitsAJobForEachFreePlace) {
  UseNoEosModel();
  SchedulerOptions o;
  o.max_running = 1;
  o.max_waiting = 0;
  StartScheduler(o);
  auto first = std::make_shared<Collector>();  // greedy, no EOS: runs until cancelled
  ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(4, 1), 1'000'000), first).ok());
  auto refused = std::make_shared<Collector>();
  const absl::Status no_place = scheduler_->Submit(Job("", Tokens(4, 2), 2), refused);
  EXPECT_EQ(no_place.code(), absl::StatusCode::kResourceExhausted);
  // What is true: there is no queue to be full (it said "the queue is full (0 requests
  // waiting)").
  EXPECT_EQ(std::string(no_place.message()),
            "every place in the batch is taken and this server keeps no queue (max_waiting 0); "
            "retry later");
  first->cancelled.store(true);
  first->Wait();
  EXPECT_EQ(first->reason, FinishReason::kCancelled);
  for (int i = 0; i < 3; ++i) {
    auto next = std::make_shared<Collector>();
    ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(4, 3 + i), 2), next).ok()) << i;
    next->Wait();
    EXPECT_EQ(next->reason, FinishReason::kLength);
  }
}

// Records, for the jobs given a name, the order in which their first tokens came.
class StartOrder {
 public:
  void Started(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    names_.push_back(name);
    cv_.notify_all();
  }
  void AwaitStarted(const std::string& name) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return std::find(names_.begin(), names_.end(), name) != names_.end(); });
  }
  std::vector<std::string> names() {
    std::lock_guard<std::mutex> lock(mu_);
    return names_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> names_;
};

class NamedCollector : public Collector {
 public:
  NamedCollector(std::string name, std::shared_ptr<StartOrder> order)
      : name_(std::move(name)), order_(std::move(order)) {}
  void OnToken(int32_t token, absl::string_view text, const TokenLogprobs* lp) override {
    if (!started_.exchange(true)) order_->Started(name_);
    Collector::OnToken(token, text, lp);
  }

 private:
  const std::string name_;
  const std::shared_ptr<StartOrder> order_;
  std::atomic<bool> started_{false};
};

GenerateJob TenantJob(const std::string& tenant, std::vector<int32_t> prompt, int max_tokens) {
  GenerateJob j;
  j.session.tenant = tenant;  // a one-shot job of that tenant
  j.prompt = std::move(prompt);
  j.sampling.max_tokens = max_tokens;
  j.sampling.stop_token_ids = {};
  return j;
}

// A place that frees goes to the tenant given a place least recently, not to the oldest job: a
// tenant that queued first cannot keep another waiting behind its whole burst.
TEST_F(SchedulerTest, AFreePlaceGoesToTheTenantGivenOneLeastRecently) {
  UseNoEosModel();  // greedy jobs run to max_tokens, or until cancelled
  SchedulerOptions o;
  o.max_running = 1;
  StartScheduler(o);
  auto order = std::make_shared<StartOrder>();
  // Holds the only place until cancelled.
  auto holder = std::make_shared<NamedCollector>("holder", order);
  ASSERT_TRUE(scheduler_->Submit(TenantJob("a", Tokens(4, 1), 1'000'000), holder).ok());
  order->AwaitStarted("holder");
  std::vector<std::shared_ptr<Collector>> queued;
  for (const std::string name : {"a1", "a2", "b1"}) {
    queued.push_back(std::make_shared<NamedCollector>(name, order));
    ASSERT_TRUE(
        scheduler_
            ->Submit(TenantJob(name.substr(0, 1), Tokens(4, 2 + queued.size()), 2), queued.back())
            .ok());
  }
  holder->cancelled.store(true);
  for (auto& job : queued) {
    job->Wait();
    EXPECT_EQ(job->reason, FinishReason::kLength);
  }
  // Tenant b had no place yet; a had one (the holder's). Within a tenant, first come first.
  EXPECT_EQ(order->names(), (std::vector<std::string>{"holder", "b1", "a1", "a2"}));
  holder->Wait();
}

// Among tenants waiting, the one holding the fewest places gets the next, even when another
// tenant's job waited longer.
TEST_F(SchedulerTest, AFreePlaceGoesToTheTenantHoldingFewestPlaces) {
  UseNoEosModel();
  SchedulerOptions o;
  o.max_running = 2;
  StartScheduler(o);
  auto order = std::make_shared<StartOrder>();
  // b's holder is given a place first, then a's.
  auto b_holder = std::make_shared<NamedCollector>("b holder", order);
  auto a_holder = std::make_shared<NamedCollector>("a holder", order);
  ASSERT_TRUE(scheduler_->Submit(TenantJob("b", Tokens(4, 1), 1'000'000), b_holder).ok());
  order->AwaitStarted("b holder");
  ASSERT_TRUE(scheduler_->Submit(TenantJob("a", Tokens(4, 2), 1'000'000), a_holder).ok());
  order->AwaitStarted("a holder");
  auto b1 = std::make_shared<NamedCollector>("b1", order);
  auto a1 = std::make_shared<NamedCollector>("a1", order);
  ASSERT_TRUE(scheduler_->Submit(TenantJob("b", Tokens(4, 3), 2), b1).ok());
  ASSERT_TRUE(scheduler_->Submit(TenantJob("a", Tokens(4, 4), 2), a1).ok());
  // a's place frees: a holds none now and b one, so a1 goes first though b1 waited longer (and
  // b was given a place less recently). b1 starts only once a1 has ended.
  a_holder->cancelled.store(true);
  a1->Wait();
  b1->Wait();
  EXPECT_EQ(order->names(), (std::vector<std::string>{"b holder", "a holder", "a1", "b1"}));
  b_holder->cancelled.store(true);
  b_holder->Wait();
  a_holder->Wait();
}

// Prompt chunks go to tenants in turn: a tenant's short prompt admitted beside another tenant's
// long ones gets its first token after one of their chunks, not after all of them (oldest job
// first, it waited for a prompt of 20 steps). One chunk per step; the step thread is held in a
// third tenant's first token while the others are submitted, so that they start together.
TEST_F(SchedulerTest, TenantsTakePromptChunksInTurn) {
  constexpr int64_t kChunk = 8;
  EngineOptions eo;
  eo.prefill_chunk = kChunk;
  UseNoEosModel(eo);
  SchedulerOptions so;
  so.max_running = 5;
  so.prefill_token_budget = kChunk;
  StartScheduler(so);
  auto gate = std::make_shared<HeldCollector>();
  ASSERT_TRUE(scheduler_->Submit(TenantJob("c", Tokens(3, 1), 1'000'000), gate).ok());
  gate->entered.WaitForNotification();
  auto order = std::make_shared<StartOrder>();
  std::vector<std::shared_ptr<Collector>> jobs;
  for (const std::string name : {"a1", "b1", "a2", "a3"}) {
    jobs.push_back(std::make_shared<NamedCollector>(name, order));
    const int prompt = name[0] == 'a' ? 20 * kChunk : 5;
    ASSERT_TRUE(
        scheduler_
            ->Submit(TenantJob(name.substr(0, 1), Tokens(prompt, jobs.size()), 2), jobs.back())
            .ok());
  }
  gate->release.Notify();
  for (auto& job : jobs) {
    job->Wait();
    EXPECT_EQ(job->reason, FinishReason::kLength);
  }
  EXPECT_EQ(order->names(), (std::vector<std::string>{"b1", "a1", "a2", "a3"}));
  gate->cancelled.store(true);
  gate->Wait();
}

// A step that does not fit defers the job admitted last of the tenant holding the most places,
// not the last one admitted (here the only job of the other tenant, which the fair admission had
// just let in). a1 and a2 decode; b1's prompt joins them; that step is refused once.
TEST_F(SchedulerTest, AStepThatDoesNotFitDefersAJobOfTheTenantHoldingTheMostPlaces) {
  constexpr size_t kBPrompt = 7;
  auto record = std::make_shared<StepAfterRefusal>();
  EngineOptions eo;
  eo.testing_refuse_step = RefuseOnce(record, {1, 1, kBPrompt});
  UseNoEosModel(eo);
  SchedulerOptions so;
  so.max_running = 3;
  StartScheduler(so);
  auto a1 = std::make_shared<HeldCollector>(), a2 = std::make_shared<HeldCollector>();
  ASSERT_TRUE(scheduler_->Submit(TenantJob("a", Tokens(3, 1), 6), a1).ok());
  a1->entered.WaitForNotification();
  ASSERT_TRUE(scheduler_->Submit(TenantJob("a", Tokens(4, 2), 6), a2).ok());
  a1->release.Notify();
  a2->entered.WaitForNotification();  // a2 runs; b1 is admitted after it
  auto b1 = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(TenantJob("b", Tokens(kBPrompt, 3), 6), b1).ok());
  a2->release.Notify();
  for (auto& job : std::vector<std::shared_ptr<Collector>>{a1, a2, b1}) {
    job->Wait();
    EXPECT_TRUE(job->error.ok()) << job->error;
    EXPECT_EQ(job->reason, FinishReason::kLength);
  }
  EXPECT_EQ(scheduler_->deferred_jobs(), 1);
  absl::MutexLock lock(&record->mu);
  EXPECT_TRUE(record->refused);
  EXPECT_EQ(record->next, (std::vector<size_t>{1, kBPrompt}));  // a1's decode and b1's prompt
}

// GenerateJob::tenant_max_requests counts the tenant's jobs waiting or running, and only its own.
TEST_F(SchedulerTest, ATenantsRequestsInFlightAreLimited) {
  UseNoEosModel();
  SchedulerOptions o;
  o.max_running = 1;
  StartScheduler(o);
  auto limited = [](const std::string& tenant, uint32_t seed, int max_tokens) {
    GenerateJob job = TenantJob(tenant, Tokens(4, seed), max_tokens);
    job.tenant_max_requests = 2;
    return job;
  };
  auto running = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(limited("a", 1, 1'000'000), running).ok());
  auto waiting = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(limited("a", 2, 2), waiting).ok());
  auto third = std::make_shared<Collector>();
  const absl::Status refused = scheduler_->Submit(limited("a", 3, 2), third);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(std::string(refused.message()),
            "tenant 'a' has 2 requests waiting or running, its limit (max_requests 2); retry when "
            "one has finished");
  // Another tenant's count is its own; a job without the limit is not held to it.
  auto other = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(limited("b", 4, 2), other).ok());
  auto unlimited = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(TenantJob("a", Tokens(4, 5), 2), unlimited).ok());
  // A waiting job that ends frees its tenant's count before its client hears of it.
  waiting->cancelled.store(true);
  waiting->Wait();
  EXPECT_EQ(waiting->reason, FinishReason::kCancelled);
  auto again = std::make_shared<Collector>();
  EXPECT_EQ(scheduler_->Submit(limited("a", 6, 2), again).code(),
            absl::StatusCode::kResourceExhausted)
      << "the unlimited job still counts among a's requests";
  unlimited->cancelled.store(true);
  unlimited->Wait();
  ASSERT_TRUE(scheduler_->Submit(limited("a", 6, 2), again).ok());
  // A limit of 0 forbids: no retry would succeed.
  GenerateJob forbidden = TenantJob("c", Tokens(4, 7), 2);
  forbidden.tenant_max_requests = 0;
  const absl::Status denied =
      scheduler_->Submit(std::move(forbidden), std::make_shared<Collector>());
  EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied) << denied;
  EXPECT_EQ(std::string(denied.message()),
            "tenant 'c' may not run requests (its max_requests is 0)");
  running->cancelled.store(true);
  for (auto& job : {running, other, again}) job->Wait();
  EXPECT_EQ(other->reason, FinishReason::kLength);
  EXPECT_EQ(again->reason, FinishReason::kLength);
}

TEST_F(SchedulerTest, TheStepThreadRunsAtTheEnginesDecodeNice) {
  const int before = CurrentThreadNice();
  for (int decode_nice : {0, 6}) {
    scheduler_.reset();
    store_.reset();
    EngineOptions o;
    o.decode_nice = decode_nice;
    auto model = LoadModel(sdm::testing::NoEosModelDir());  // every job streams its tokens
    ASSERT_TRUE(model.ok()) << model.status();
    auto e = Engine::Create(*model, o);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = *std::move(e);
    OpenStore();
    StartScheduler();
    auto c = std::make_shared<Collector>();
    ASSERT_TRUE(scheduler_->Submit(Job("", Tokens(4, 1), 3), c).ok());
    c->Wait();
    ASSERT_EQ(c->tokens.size(), 3u);
    EXPECT_EQ(c->step_thread_nice, std::min(before + decode_nice, 19)) << decode_nice;
    EXPECT_EQ(CurrentThreadNice(), before);  // the thread that submitted is as it was
  }
}

TEST_F(SchedulerTest, StopIdsAndStopStrings) {
  StartScheduler();
  const auto prompt = Tokens(5, 7);
  auto free_run = std::make_shared<Collector>();
  ASSERT_TRUE(scheduler_->Submit(Job("", prompt, 8), free_run).ok());
  free_run->Wait();
  ASSERT_EQ(free_run->tokens.size(), 8u);
  // Stop at the 4th token's id.
  auto by_id = std::make_shared<Collector>();
  GenerateJob j = Job("", prompt, 8);
  j.sampling.stop_token_ids = {free_run->tokens[3]};
  ASSERT_TRUE(scheduler_->Submit(std::move(j), by_id).ok());
  by_id->Wait();
  EXPECT_EQ(by_id->reason, FinishReason::kStop);
  const size_t first =
      std::find(free_run->tokens.begin(), free_run->tokens.end(), free_run->tokens[3]) -
      free_run->tokens.begin();
  EXPECT_EQ(by_id->tokens.size(), first);  // the stop id itself is not streamed
  // Stop string: a byte model's tokens are bytes; stop on two consecutive generated bytes when
  // they form valid text, else on one.
  std::string stop = tokenizer_->Decode(
      std::vector<int32_t>(free_run->tokens.begin() + 4, free_run->tokens.begin() + 6));
  if (stop.empty() || stop.find("\xEF\xBF\xBD") != std::string::npos) GTEST_SKIP();
  auto by_string = std::make_shared<Collector>();
  GenerateJob k = Job("", prompt, 8);
  k.stop_strings = {stop};
  ASSERT_TRUE(scheduler_->Submit(std::move(k), by_string).ok());
  by_string->Wait();
  EXPECT_EQ(by_string->reason, FinishReason::kStop);
  const std::string full = tokenizer_->Decode(free_run->tokens);
  EXPECT_EQ(by_string->text, full.substr(0, full.find(stop)));
}

}  // namespace
}  // namespace sdm
