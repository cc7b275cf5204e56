// A forward pass that fails part-way (engine/engine_backend.h, ForwardCommit): before it began
// writing state its sessions are untouched; after, every session of the pass is marked failed
// and refused by the engine, the others are unaffected, and the engine keeps working. The fault
// is injected through EngineOptions::inject_forward_fault on the CPU backend (the CUDA one is
// tested the same way in tests/engine/cuda_engine_test.cc, on a device).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/engine_backend.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "gtest/gtest.h"
#include "tests/engine/test_model_util.h"

namespace sdm {
namespace {

std::unique_ptr<Engine> MakeEngine(const ModelConfig& c, int64_t inject) {
  EngineOptions o;
  o.num_threads = 2;
  o.prefill_chunk = 4;
  o.inject_forward_fault = inject;
  auto e = Engine::Create(RandomModel(c, 31), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return *std::move(e);
}

TEST(ForwardCommitTest, AFailureBeforeBeginLeavesTheSessionsAlone) {
  const ModelConfig c = testing::MiniHybridConfig();
  auto engine = MakeEngine(c, -1);
  auto a = engine->NewSession(), b = engine->NewSession();
  const Segment segs[] = {{a.get(), 0, 1, 0}, {b.get(), 1, 1, 0}};
  ForwardCommit commit(segs);
  const absl::Status s = commit.Fail(absl::ResourceExhaustedError("no rows"));
  EXPECT_EQ(s, absl::ResourceExhaustedError("no rows"));  // as is: the pass can be retried
  EXPECT_FALSE(a->failed());
  EXPECT_FALSE(b->failed());
}

TEST(ForwardCommitTest, AFailureAfterBeginMarksEverySession) {
  const ModelConfig c = testing::MiniHybridConfig();
  auto engine = MakeEngine(c, -1);
  auto a = engine->NewSession(), b = engine->NewSession(), other = engine->NewSession();
  const Segment segs[] = {{a.get(), 0, 1, 0}, {b.get(), 1, 1, 0}};
  ForwardCommit commit(segs);
  commit.Begin();
  const absl::Status s = commit.Fail(absl::InternalError("launch failed"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("launch failed"), std::string::npos) << s;
  EXPECT_NE(s.message().find("2 session(s) are marked failed"), std::string::npos) << s;
  ASSERT_TRUE(a->failed());
  ASSERT_TRUE(b->failed());
  EXPECT_NE(a->failure().message().find("launch failed"), std::string::npos);
  EXPECT_FALSE(other->failed());
  // A copy of damaged layers is damaged too.
  EXPECT_TRUE(a->Clone()->failed());
  EXPECT_TRUE(a->Fork()->failed());
}

// Prompts long enough for several prefill chunks (passes) and past the SWA window.
std::vector<int32_t> Tokens(int n, int32_t salt) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (i * 37 + salt * 11) % 250;
  return t;
}

std::vector<float> DecodeEach(Engine& e, SessionState& s, const std::vector<int32_t>& tokens) {
  std::vector<float> all, step(e.vocab_size());
  for (int32_t t : tokens) {
    SessionState* p = &s;
    const absl::Status st = e.Decode({&p, 1}, {&t, 1}, step);
    EXPECT_TRUE(st.ok()) << st;
    all.insert(all.end(), step.begin(), step.end());
  }
  return all;
}

TEST(FailedStepTest, AFaultPartWayMarksThePassSessionsAndSparesTheOthers) {
  const ModelConfig c = testing::MiniHybridConfig();
  ASSERT_GE(c.n_layers, 2);
  const int64_t layers = c.n_layers;
  // Fault points are one per layer per pass on the CPU backend. Before the failing step: the
  // bystander's prefill (6 tokens, chunk 4: two passes) and b's (3 tokens: one pass) use
  // points [0, 3 * layers); the failing step's first pass then fails after its layer 1.
  auto engine = MakeEngine(c, 3 * layers + 1);
  auto reference = MakeEngine(c, -1);  // same weights, no fault

  auto bystander = engine->NewSession(), ref_bystander = reference->NewSession();
  ASSERT_TRUE(engine->Prefill(*bystander, Tokens(6, 1), false, nullptr).ok());
  ASSERT_TRUE(reference->Prefill(*ref_bystander, Tokens(6, 1), false, nullptr).ok());
  auto a = engine->NewSession(), b = engine->NewSession();
  ASSERT_TRUE(engine->Prefill(*b, Tokens(3, 2), false, nullptr).ok());

  const std::vector<int32_t> a_tokens = Tokens(6, 3);
  const int32_t b_token = 17;
  StepBatch batch;
  batch.Add(*a, a_tokens, StepLogits::kLast);
  batch.Add(*b, std::span<const int32_t>(&b_token, 1), StepLogits::kLast);
  std::vector<float> logits(batch.LogitRows() * engine->vocab_size());
  const absl::Status failed = engine->Step(batch, logits);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal) << failed;
  EXPECT_NE(failed.message().find("injected fault after layer 1"), std::string::npos) << failed;
  EXPECT_NE(failed.message().find("2 session(s) are marked failed"), std::string::npos) << failed;
  // Both sessions of the pass are marked, and neither position moved.
  ASSERT_TRUE(a->failed());
  ASSERT_TRUE(b->failed());
  EXPECT_EQ(a->position(), 0);
  EXPECT_EQ(b->position(), 3);
  EXPECT_FALSE(bystander->failed());

  // The engine refuses them from now on (nothing consumed), alone or with others.
  for (SessionState* s : {a.get(), b.get()}) {
    StepBatch again;
    again.Add(*s, std::span<const int32_t>(&b_token, 1), StepLogits::kLast);
    std::vector<float> out(again.LogitRows() * engine->vocab_size());
    const absl::Status refused = engine->Step(again, out);
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    EXPECT_NE(refused.message().find("refused until the session is deleted"), std::string::npos)
        << refused;
    EXPECT_NE(refused.message().find("half-updated"), std::string::npos) << refused;
  }
  EXPECT_EQ(b->position(), 3);

  // The bystander continues bit for bit like the reference, and a new session on the engine
  // gets the reference's logits (the fault fired once).
  const std::vector<int32_t> more = Tokens(4, 5);
  EXPECT_EQ(DecodeEach(*engine, *bystander, more), DecodeEach(*reference, *ref_bystander, more));
  auto fresh = engine->NewSession(), ref_fresh = reference->NewSession();
  std::vector<float> got, want;
  ASSERT_TRUE(engine->Prefill(*fresh, a_tokens, true, &got).ok());
  ASSERT_TRUE(reference->Prefill(*ref_fresh, a_tokens, true, &want).ok());
  EXPECT_EQ(got, want);
  EXPECT_FALSE(fresh->failed());
}

// A fault in a later pass of a step: the failing pass's sessions are marked by the backend, and
// the sessions that earlier passes advanced (a decode token in pass 0) by the engine, since no
// caller can tell from the error how much of a segment was consumed.
TEST(FailedStepTest, AFaultInALaterPassMarksEverySessionItAdvanced) {
  const ModelConfig c = testing::MiniHybridConfig();
  const int64_t layers = c.n_layers;
  auto engine = MakeEngine(c, layers + 2);  // pass 1 of the first step, after its layer 2
  auto a = engine->NewSession(), d = engine->NewSession(), idle = engine->NewSession();
  const std::vector<int32_t> prompt = Tokens(10, 7);  // three passes of chunk 4
  const int32_t token = 9;
  StepBatch batch;
  batch.Add(*a, prompt, StepLogits::kNone);
  batch.Add(*d, std::span<const int32_t>(&token, 1), StepLogits::kLast);
  std::vector<float> logits(batch.LogitRows() * engine->vocab_size());
  const absl::Status s = engine->Step(batch, logits);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("1 session(s) are marked failed"), std::string::npos) << s;
  EXPECT_NE(s.message().find("1 session(s) advanced by earlier passes"), std::string::npos) << s;
  EXPECT_TRUE(a->failed());
  EXPECT_EQ(a->position(), 4);  // pass 0 completed
  EXPECT_TRUE(d->failed());     // its token was consumed in pass 0
  EXPECT_EQ(d->position(), 1);
  EXPECT_NE(d->failure().message().find("earlier pass"), std::string::npos) << d->failure();
  EXPECT_FALSE(idle->failed());
}

// A failure before anything was written (here: a session of another model, refused up front)
// marks nothing.
TEST(FailedStepTest, ARefusedStepMarksNothing) {
  const ModelConfig c = testing::MiniHybridConfig();
  auto engine = MakeEngine(c, -1);
  auto a = engine->NewSession();
  const int32_t token = 300000;  // outside the vocabulary
  std::vector<float> out(engine->vocab_size());
  SessionState* p = a.get();
  EXPECT_EQ(engine->Decode({&p, 1}, {&token, 1}, out).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(a->failed());
}

}  // namespace
}  // namespace sdm
