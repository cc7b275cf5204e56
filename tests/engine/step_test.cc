// Engine::Step: a mixed step (prefill chunks of some sessions, decode tokens of others, several
// passes when a segment spans several prefill chunks) gives every session exactly the bits of
// running its parts alone, and a malformed step is refused before anything is consumed.
#include <algorithm>
#include <cstdint>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine/engine.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/sampler.h"
#include "gtest/gtest.h"
#include "tests/engine/test_model_util.h"

namespace sdm {
namespace {

// Every layer SDM (no attention at all).
ModelConfig SdmOnly() {
  ModelConfig c = testing::TinyConfig();
  c.swa_at = {};
  c.sdm_at = {0, 1, 2, 3};
  EXPECT_TRUE(FinalizeModelConfig(c).ok());
  return c;
}

// All three layer types; its window (6) is crossed by the prefill chunks below.
ModelConfig Hybrid() { return testing::MiniHybridConfig(); }

constexpr int64_t kChunk = 4;  // small, so prompts span several chunks and steps several passes

std::unique_ptr<Engine> MakeEngine(const ModelConfig& c, DType dtype = DType::kF32) {
  EngineOptions o;
  o.num_threads = 2;
  o.cpu_dtype = dtype;
  o.prefill_chunk = kChunk;
  auto e = Engine::Create(RandomModel(c, 21), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return *std::move(e);
}

std::vector<float> Row(const std::vector<float>& logits, int64_t row, int64_t vocab) {
  return std::vector<float>(logits.begin() + row * vocab, logits.begin() + (row + 1) * vocab);
}

// One session's script: a prompt, then decode tokens fed one per step.
struct Script {
  std::vector<int32_t> prompt;
  std::vector<int32_t> decodes;
  // Solo reference: the logits of every prompt position (one Prefill), then of every decode.
  std::vector<float> prompt_logits;
  std::vector<std::vector<float>> decode_logits;
};

// Runs `sessions` scripts through random mixed steps and checks every logit row it asked for
// against the solo reference, bit for bit.
void RunMixedSteps(const ModelConfig& c, DType dtype, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t vocab = c.vocab_size;
  auto engine = MakeEngine(c, dtype);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab) - 1);
  const int kSessions = 6;
  std::vector<Script> scripts(kSessions);
  for (int i = 0; i < kSessions; ++i) {
    Script& s = scripts[i];
    // Sessions 0 and 1 make sure that some step mixes prefill and decode: 0 has a one-token
    // prompt (it decodes from its second step on) and 1 a prompt longer than the most one step
    // feeds (3 chunks), and neither sits a step out until a mixed step happened.
    const int prompt_len =
        i == 0   ? 1
        : i == 1 ? std::uniform_int_distribution<int>(3 * kChunk + 1, 3 * kChunk + 17)(rng)
                 : std::uniform_int_distribution<int>(1, 17)(rng);
    s.prompt.resize(prompt_len);
    for (int32_t& t : s.prompt) t = token(rng);
    s.decodes.resize(std::uniform_int_distribution<int>(1, 8)(rng));
    for (int32_t& t : s.decodes) t = token(rng);
    auto solo = engine->NewSession();
    ASSERT_TRUE(engine->Prefill(*solo, s.prompt, /*all_positions=*/true, &s.prompt_logits).ok());
    for (int32_t t : s.decodes) {
      std::vector<float> l(vocab);
      SessionState* p = solo.get();
      ASSERT_TRUE(engine->Decode({&p, 1}, {&t, 1}, l).ok());
      s.decode_logits.push_back(std::move(l));
    }
  }

  std::vector<std::unique_ptr<SessionState>> states;
  std::vector<size_t> fed(kSessions, 0), decoded(kSessions, 0);
  for (int i = 0; i < kSessions; ++i) states.push_back(engine->NewSession());
  int steps = 0;
  int64_t rows_checked = 0;
  int mixed_steps = 0;  // steps with prompt tokens of some sessions and decodes of others
  auto finished = [&](int i) { return decoded[i] == scripts[i].decodes.size(); };
  auto all_finished = [&] {
    for (int i = 0; i < kSessions; ++i) {
      if (!finished(i)) return false;
    }
    return true;
  };
  while (!all_finished()) {
    ASSERT_LT(++steps, 200);
    // What each session does this step, and what it checks afterwards.
    struct Part {
      int session;
      size_t from, n;  // prompt tokens [from, from + n), or n == 0: decode token `from`
      StepLogits logits;
      int64_t row;
    };
    std::vector<Part> parts;
    StepBatch batch;
    // Random order of sessions in the batch; some sit the step out.
    std::vector<int> order(kSessions);
    for (int i = 0; i < kSessions; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    for (int i : order) {
      const bool may_sit_out = mixed_steps > 0 || i > 1;
      if (finished(i) || (may_sit_out && std::bernoulli_distribution(0.25)(rng))) continue;
      const Script& s = scripts[i];
      Part p{i, 0, 0, StepLogits::kLast, -1};
      if (fed[i] < s.prompt.size()) {
        // Whole chunks (or the rest), so the cut matches the solo Prefill's.
        const size_t chunks = std::uniform_int_distribution<size_t>(1, 3)(rng);
        p.from = fed[i];
        p.n = std::min(chunks * kChunk, s.prompt.size() - fed[i]);
        p.logits = static_cast<StepLogits>(std::uniform_int_distribution<int>(0, 2)(rng));
        p.row = batch.Add(*states[i], std::span<const int32_t>(s.prompt).subspan(p.from, p.n),
                          p.logits);
      } else {
        p.from = decoded[i];
        p.logits = std::bernoulli_distribution(0.8)(rng) ? StepLogits::kLast : StepLogits::kNone;
        p.row =
            batch.Add(*states[i], std::span<const int32_t>(s.decodes).subspan(p.from, 1), p.logits);
      }
      parts.push_back(p);
    }
    std::vector<float> logits(batch.LogitRows() * vocab);
    ASSERT_TRUE(engine->Step(batch, logits).ok());
    const bool has_prompt =
        std::any_of(parts.begin(), parts.end(), [](const Part& p) { return p.n > 0; });
    const bool has_decode =
        std::any_of(parts.begin(), parts.end(), [](const Part& p) { return p.n == 0; });
    mixed_steps += has_prompt && has_decode;
    for (const Part& p : parts) {
      SCOPED_TRACE(::testing::Message() << "step " << steps << " session " << p.session);
      const Script& s = scripts[p.session];
      if (p.n > 0) {
        fed[p.session] += p.n;
        if (p.logits == StepLogits::kAll) {
          for (size_t t = 0; t < p.n; ++t) {
            EXPECT_EQ(Row(logits, p.row + static_cast<int64_t>(t), vocab),
                      Row(s.prompt_logits, static_cast<int64_t>(p.from + t), vocab))
                << "prompt position " << p.from + t;
            ++rows_checked;
          }
        } else if (p.logits == StepLogits::kLast) {
          EXPECT_EQ(Row(logits, p.row, vocab),
                    Row(s.prompt_logits, static_cast<int64_t>(p.from + p.n - 1), vocab));
          ++rows_checked;
        }
      } else {
        ++decoded[p.session];
        if (p.logits == StepLogits::kLast) {
          EXPECT_EQ(Row(logits, p.row, vocab), s.decode_logits[p.from]) << "decode " << p.from;
          ++rows_checked;
        }
      }
      EXPECT_EQ(states[p.session]->position(),
                static_cast<int64_t>(fed[p.session] + decoded[p.session]));
    }
  }
  // The script really mixed prefill and decode in one step, and compared something.
  EXPECT_GT(mixed_steps, 0);
  EXPECT_GT(rows_checked, kSessions);
}

// (config: 0 SDM only, 1 hybrid; the CPU's storage type, fp32 or bf16).
class MixedStepTest : public ::testing::TestWithParam<std::tuple<int, DType>> {
 protected:
  ModelConfig Config() const { return std::get<0>(GetParam()) == 0 ? SdmOnly() : Hybrid(); }
  DType Dtype() const { return std::get<1>(GetParam()); }
};

TEST_P(MixedStepTest, EachSessionGetsTheBitsOfRunningAlone) {
  const ModelConfig c = Config();
  for (uint32_t seed : {1u, 2u, 3u}) RunMixedSteps(c, Dtype(), seed);
  const uint32_t fresh = std::random_device{}();
  std::cout << "MixedStepTest fresh seed: " << fresh << "\n";
  RunMixedSteps(c, Dtype(), fresh);
}

INSTANTIATE_TEST_SUITE_P(Configs, MixedStepTest,
                         ::testing::Combine(::testing::Values(0, 1),
                                            ::testing::Values(DType::kF32, DType::kBf16)));

TEST(StepTest, LogitRowsFollowTheSegments) {
  const ModelConfig c = Hybrid();
  auto engine = MakeEngine(c);
  auto a = engine->NewSession();
  auto b = engine->NewSession();
  auto d = engine->NewSession();
  const std::vector<int32_t> ta = {1, 2, 3}, tb = {4, 5}, td = {6};
  StepBatch batch;
  EXPECT_EQ(batch.Add(*a, ta, StepLogits::kAll), 0);
  EXPECT_EQ(batch.Add(*b, tb, StepLogits::kNone), -1);
  EXPECT_EQ(batch.Add(*d, td, StepLogits::kLast), 3);
  EXPECT_EQ(batch.LogitRows(), 4);
  EXPECT_EQ(batch.TokenCount(), 6);
  EXPECT_EQ(batch.Draws(), 0);
  std::vector<float> logits(4 * c.vocab_size);
  ASSERT_TRUE(engine->Step(batch, logits).ok());
  EXPECT_EQ(a->position(), 3);
  EXPECT_EQ(b->position(), 2);
  EXPECT_EQ(d->position(), 1);
  // An empty step is a no-op.
  EXPECT_TRUE(engine->Step(StepBatch{}, {}).ok());
}

// A step that draws tokens (StepSegment::sampling) gives each drawing segment exactly
// SampleToken(its last token's logits, params, draw index), whatever else the segment and the
// step ask for; the logits it also returns are those of a step without draws, bit for bit.
void RunDrawingStep(uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const ModelConfig c = Hybrid();
  const int64_t vocab = c.vocab_size;
  auto drawing = MakeEngine(c);
  auto plain = MakeEngine(c);  // same weights (same seed): the reference logits
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab) - 1);
  constexpr int kSessions = 7;
  // Segment lengths: decode tokens, a chunk, several chunks (the draw comes from the last pass).
  const int lengths[kSessions] = {1, 1, 3, 4, 3 * kChunk + 2, 2, 5};
  const StepLogits asks[kSessions] = {StepLogits::kNone, StepLogits::kLast, StepLogits::kAll,
                                      StepLogits::kNone, StepLogits::kAll,  StepLogits::kLast,
                                      StepLogits::kNone};
  const bool draws[kSessions] = {true, true, true, true, true, false, false};
  std::vector<SamplingParams> params(kSessions);
  for (int i = 0; i < kSessions; ++i) {
    SamplingParams& p = params[i];
    switch (i % 4) {
      case 0:
        break;  // greedy
      case 1:
        p.temperature = 1.5;
        break;
      case 2:
        p.temperature = 0.8;
        p.top_k = 5;
        break;
      case 3:
        p.temperature = 1.2;
        p.top_p = 0.7;
        break;
    }
    p.seed = rng();
  }
  std::vector<std::unique_ptr<SessionState>> ds, ps;
  std::vector<std::vector<int32_t>> tokens(kSessions);
  std::vector<uint64_t> draw_index(kSessions);
  for (int i = 0; i < kSessions; ++i) {
    ds.push_back(drawing->NewSession());
    ps.push_back(plain->NewSession());
    // Some history first, so decode tokens see a cache.
    std::vector<int32_t> history(1 + rng() % 6);
    for (int32_t& t : history) t = token(rng);
    ASSERT_TRUE(drawing->Prefill(*ds[i], history, false, nullptr).ok());
    ASSERT_TRUE(plain->Prefill(*ps[i], history, false, nullptr).ok());
    tokens[i].resize(lengths[i]);
    for (int32_t& t : tokens[i]) t = token(rng);
    draw_index[i] = rng() % 1000;
    ds[i]->sampler_draws = 17;  // the step neither reads nor changes it
  }
  StepBatch batch, reference;
  std::vector<int64_t> slot(kSessions, -1);
  std::vector<int64_t> row(kSessions, -1);  // reference's row holding each last token
  for (int i = 0; i < kSessions; ++i) {
    if (draws[i]) {
      slot[i] = batch.AddDraw(*ds[i], tokens[i], asks[i], params[i], draw_index[i]);
    } else {
      batch.Add(*ds[i], tokens[i], asks[i]);
    }
    const int64_t first = reference.Add(*ps[i], tokens[i], StepLogits::kAll);
    row[i] = first + lengths[i] - 1;
  }
  ASSERT_EQ(batch.Draws(), 5);
  std::vector<float> logits(batch.LogitRows() * vocab), want(reference.LogitRows() * vocab);
  std::vector<int32_t> sampled(batch.Draws(), -1);
  absl::Status st = drawing->Step(batch, logits, sampled);
  ASSERT_TRUE(st.ok()) << st;
  st = plain->Step(reference, want);
  ASSERT_TRUE(st.ok()) << st;
  int64_t out_row = 0;
  for (int i = 0; i < kSessions; ++i) {
    SCOPED_TRACE(::testing::Message() << "segment " << i);
    EXPECT_EQ(ds[i]->position(), ps[i]->position());
    EXPECT_EQ(ds[i]->sampler_draws, 17u);
    if (draws[i]) {
      const std::vector<float> last = Row(want, row[i], vocab);
      EXPECT_EQ(sampled[slot[i]], SampleToken(last, params[i], draw_index[i]));
    }
    // The returned logits are the reference's rows, bit for bit.
    const int64_t n = asks[i] == StepLogits::kAll ? lengths[i] : asks[i] == StepLogits::kLast;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t ref_row = row[i] - (n - 1) + t;
      EXPECT_EQ(Row(logits, out_row + t, vocab), Row(want, ref_row, vocab)) << "row " << t;
    }
    out_row += n;
  }
  EXPECT_EQ(out_row, batch.LogitRows());
}

TEST(StepTest, DrawsAreSampleTokenOfEachSegmentsLastLogits) {
  for (uint32_t seed : {1u, 2u}) RunDrawingStep(seed);
  const uint32_t fresh = std::random_device{}();
  std::cout << "DrawsAreSampleTokenOfEachSegmentsLastLogits fresh seed: " << fresh << "\n";
  RunDrawingStep(fresh);
}

TEST(StepTest, RejectsMalformedStepsWithoutConsumingAnything) {
  const ModelConfig c = Hybrid();
  auto engine = MakeEngine(c);
  auto other = MakeEngine(SdmOnly());  // a different model (layer count differs)
  ASSERT_NE(other->config().n_layers, c.n_layers);
  auto a = engine->NewSession();
  auto b = engine->NewSession();
  auto foreign = other->NewSession();
  const std::vector<int32_t> ok = {1, 2, 3};
  const std::vector<int32_t> bad = {1, static_cast<int32_t>(c.vocab_size)};
  const std::vector<int32_t> negative = {-1};
  const std::vector<int32_t> none;

  auto expect_refused = [&](const StepBatch& batch, std::span<float> logits, const char* what) {
    const absl::Status s = engine->Step(batch, logits);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what << ": " << s;
    EXPECT_EQ(a->position(), 0) << what;
    EXPECT_EQ(b->position(), 0) << what;
  };
  std::vector<float> one_row(c.vocab_size);
  {
    StepBatch batch;
    batch.Add(*a, ok, StepLogits::kNone);
    batch.Add(*b, ok, StepLogits::kLast);
    batch.Add(*a, ok, StepLogits::kNone);
    expect_refused(batch, one_row, "duplicate session");
  }
  {
    StepBatch batch;
    batch.Add(*a, ok, StepLogits::kNone);
    batch.Add(*b, bad, StepLogits::kLast);
    expect_refused(batch, one_row, "token past the vocabulary");
  }
  {
    StepBatch batch;
    batch.Add(*b, negative, StepLogits::kLast);
    expect_refused(batch, one_row, "negative token");
  }
  {
    StepBatch batch;
    batch.Add(*a, none, StepLogits::kNone);
    expect_refused(batch, {}, "empty segment");
  }
  {
    StepBatch batch;
    batch.segments.push_back({nullptr, ok, StepLogits::kNone});
    expect_refused(batch, {}, "null session");
  }
  {
    StepBatch batch;
    batch.Add(*a, ok, static_cast<StepLogits>(7));
    expect_refused(batch, one_row, "unknown logits request");
  }
  {
    StepBatch batch;
    batch.Add(*a, ok, StepLogits::kAll);  // needs 3 rows
    expect_refused(batch, one_row, "logits buffer too small");
    std::vector<float> four_rows(4 * c.vocab_size);
    expect_refused(batch, four_rows, "logits buffer too large");
  }
  {
    StepBatch batch;
    batch.Add(*a, ok, StepLogits::kNone);
    batch.Add(*foreign, ok, StepLogits::kNone);
    expect_refused(batch, {}, "session of another model");
    EXPECT_EQ(foreign->position(), 0);
  }
  // Draws: a sampled buffer of the wrong size, params out of range.
  SamplingParams greedy;
  SamplingParams negative_temperature;
  negative_temperature.temperature = -1.0;
  SamplingParams bad_top_p;
  bad_top_p.temperature = 1.0;
  bad_top_p.top_p = -0.5;
  auto expect_draw_refused = [&](const StepBatch& batch, std::span<int32_t> sampled,
                                 const char* what) {
    const absl::Status s = engine->Step(batch, {}, sampled);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what << ": " << s;
    EXPECT_EQ(a->position(), 0) << what;
    EXPECT_EQ(b->position(), 0) << what;
  };
  {
    StepBatch batch;
    EXPECT_EQ(batch.AddDraw(*a, ok, StepLogits::kNone, greedy, 0), 0);
    EXPECT_EQ(batch.AddDraw(*b, ok, StepLogits::kNone, greedy, 0), 1);
    std::vector<int32_t> one(1), three(3);
    expect_draw_refused(batch, one, "sampled buffer too small");
    expect_draw_refused(batch, three, "sampled buffer too large");
    expect_draw_refused(batch, {}, "no sampled buffer");
  }
  {
    StepBatch batch;
    batch.Add(*a, ok, StepLogits::kNone);
    batch.AddDraw(*b, ok, StepLogits::kNone, negative_temperature, 0);
    std::vector<int32_t> one(1);
    expect_draw_refused(batch, one, "negative temperature");
  }
  {
    StepBatch batch;
    batch.AddDraw(*a, ok, StepLogits::kNone, bad_top_p, 0);
    std::vector<int32_t> one(1);
    expect_draw_refused(batch, one, "top_p 0");
  }
}

}  // namespace
}  // namespace sdm
