#include "engine/engine.h"

#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "base/thread_priority.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "gtest/gtest.h"
#include "tests/engine/test_model_util.h"

namespace sdm {
namespace {

ModelConfig Tiny() {
  auto c = PresetConfig("tiny");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

ModelConfig MiniHybrid() { return testing::MiniHybridConfig(); }

std::vector<int32_t> RandomTokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, 257);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = tok(rng);
  return t;
}

std::unique_ptr<Engine> MakeEngine(const ModelConfig& c, int64_t prefill_chunk = 256,
                                   DType dtype = DType::kF32) {
  EngineOptions o;
  o.num_threads = 2;
  o.prefill_chunk = prefill_chunk;
  o.cpu_dtype = dtype;
  auto e = Engine::Create(RandomModel(c, 11), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return *std::move(e);
}

double MaxRelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0, scale = 1e-6;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::abs(a[i] - b[i])));
    scale = std::max(scale, static_cast<double>(std::abs(b[i])));
  }
  return worst / scale;
}

// (config: 0 tiny, 1 mini hybrid; the CPU's storage type): every property below holds for both.
class EngineConfigTest : public ::testing::TestWithParam<std::tuple<int, DType>> {
 protected:
  ModelConfig Config() const { return std::get<0>(GetParam()) == 0 ? Tiny() : MiniHybrid(); }
  DType Dtype() const { return std::get<1>(GetParam()); }
  std::unique_ptr<Engine> MakeEngine(const ModelConfig& c, int64_t prefill_chunk = 256) const {
    return ::sdm::MakeEngine(c, prefill_chunk, Dtype());
  }
};

TEST_P(EngineConfigTest, PrefillEqualsTokenByTokenDecode) {
  const ModelConfig c = Config();
  auto engine = MakeEngine(c);
  const auto tokens = RandomTokens(30, 5);  // longer than the SWA windows
  auto a = engine->NewSession();
  std::vector<float> prefill;
  ASSERT_TRUE(engine->Prefill(*a, tokens, /*all_positions=*/true, &prefill).ok());
  ASSERT_EQ(a->position(), 30);

  auto b = engine->NewSession();
  std::vector<float> decoded, step(c.vocab_size);
  for (int32_t t : tokens) {
    SessionState* s = b.get();
    ASSERT_TRUE(engine->Decode({&s, 1}, {&t, 1}, step).ok());
    decoded.insert(decoded.end(), step.begin(), step.end());
  }
  ASSERT_EQ(prefill.size(), decoded.size());
  // The paths reduce attention in different orders: fp32 rounding apart. In bf16 a key or value
  // one fp32 ulp apart can round to neighbouring bf16 values (2^-8 apart), so the bound is wider.
  EXPECT_LT(MaxRelDiff(prefill, decoded), Dtype() == DType::kF32 ? 1e-4 : 2e-3);
}

TEST_P(EngineConfigTest, PrefillChunkingDoesNotChangeLogits) {
  const ModelConfig c = Config();
  const auto tokens = RandomTokens(40, 6);
  std::vector<float> whole, chunked;
  auto e1 = MakeEngine(c, 256);
  auto s1 = e1->NewSession();
  ASSERT_TRUE(e1->Prefill(*s1, tokens, true, &whole).ok());
  auto e2 = MakeEngine(c, 7);  // chunks smaller than, and crossing, the SWA window
  auto s2 = e2->NewSession();
  ASSERT_TRUE(e2->Prefill(*s2, tokens, true, &chunked).ok());
  EXPECT_LT(MaxRelDiff(chunked, whole), Dtype() == DType::kF32 ? 1e-4 : 2e-3);
  // Last-position logits are the last row of the all-position logits.
  auto s3 = e2->NewSession();
  std::vector<float> last;
  ASSERT_TRUE(e2->Prefill(*s3, tokens, false, &last).ok());
  std::vector<float> want(chunked.end() - c.vocab_size, chunked.end());
  EXPECT_EQ(last, want);
}

TEST_P(EngineConfigTest, BatchEqualsEachSessionAlone) {
  const ModelConfig c = Config();
  auto engine = MakeEngine(c);
  const int kSessions = 5, kSteps = 12;
  std::vector<std::unique_ptr<SessionState>> batch, solo;
  std::vector<std::vector<int32_t>> feeds;
  for (int i = 0; i < kSessions; ++i) {
    batch.push_back(engine->NewSession());
    solo.push_back(engine->NewSession());
    const auto prompt = RandomTokens(3 + 4 * i, 100 + i);  // different lengths and positions
    ASSERT_TRUE(engine->Prefill(*batch.back(), prompt, false, nullptr).ok());
    ASSERT_TRUE(engine->Prefill(*solo.back(), prompt, false, nullptr).ok());
    feeds.push_back(RandomTokens(kSteps, 200 + i));
  }
  for (int step = 0; step < kSteps; ++step) {
    std::vector<SessionState*> ptrs;
    std::vector<int32_t> toks;
    for (int i = 0; i < kSessions; ++i) {
      ptrs.push_back(batch[i].get());
      toks.push_back(feeds[i][step]);
    }
    std::vector<float> batched(kSessions * c.vocab_size);
    ASSERT_TRUE(engine->Decode(ptrs, toks, batched).ok());
    for (int i = 0; i < kSessions; ++i) {
      std::vector<float> alone(c.vocab_size);
      SessionState* s = solo[i].get();
      ASSERT_TRUE(engine->Decode({&s, 1}, {&toks[i], 1}, alone).ok());
      std::vector<float> row(batched.begin() + i * c.vocab_size,
                             batched.begin() + (i + 1) * c.vocab_size);
      EXPECT_EQ(row, alone) << "session " << i << " step " << step;
    }
  }
}

TEST_P(EngineConfigTest, DeterministicAcrossRuns) {
  const ModelConfig c = Config();
  const auto tokens = RandomTokens(17, 9);
  std::vector<float> a, b;
  auto e = MakeEngine(c);
  auto s1 = e->NewSession();
  auto s2 = e->NewSession();
  ASSERT_TRUE(e->Prefill(*s1, tokens, true, &a).ok());
  ASSERT_TRUE(e->Prefill(*s2, tokens, true, &b).ok());
  EXPECT_EQ(a, b);
}

INSTANTIATE_TEST_SUITE_P(Configs, EngineConfigTest,
                         ::testing::Combine(::testing::Values(0, 1),
                                            ::testing::Values(DType::kF32, DType::kBf16)));

TEST(EngineTest, SdmStateGrowsByDistinctSlotsWritten) {
  auto engine = MakeEngine(Tiny());
  auto s = engine->NewSession();
  const int sdm_layer = 3;
  EXPECT_EQ(s->sdm(sdm_layer).private_rows(), 0);
  ASSERT_TRUE(engine->Prefill(*s, RandomTokens(5, 1), false, nullptr).ok());
  const int64_t rows = s->sdm(sdm_layer).private_rows();
  // 5 tokens x 2 heads x 8 writes at most, and at least one token's worth.
  EXPECT_GE(rows, 2 * 8);
  EXPECT_LE(rows, 5 * 2 * 8);
}

// EngineOptions::observe_sdm_readings (what tests comparing backends layer by layer read): called
// once per SDM layer of every pass, in layer order, with the pass's rows x dim readings; a batched
// pass's readings are each session's alone, in batch order (the CPU engine is batch-invariant).
TEST(EngineTest, ObservedSdmReadingsComePerSdmLayerAndPassInRowOrder) {
  const ModelConfig c = Tiny();
  std::vector<std::pair<int64_t, std::vector<float>>> seen;
  EngineOptions o;
  o.num_threads = 2;
  o.prefill_chunk = 4;
  o.observe_sdm_readings = [&](int64_t layer, std::span<const float> readings) {
    seen.emplace_back(layer, std::vector<float>(readings.begin(), readings.end()));
  };
  auto made = Engine::Create(RandomModel(c, 11), o);
  ASSERT_TRUE(made.ok()) << made.status();
  Engine& engine = **made;
  std::vector<int64_t> sdm_layers;
  for (size_t l = 0; l < engine.state_layout().layers.size(); ++l) {
    if (engine.state_layout().layers[l].kind == LayerStateLayout::Kind::kSdm) {
      sdm_layers.push_back(static_cast<int64_t>(l));
    }
  }
  ASSERT_FALSE(sdm_layers.empty());
  const size_t per_pass = sdm_layers.size();

  // A prefill of 10 tokens in chunks of 4: passes of 4, 4 and 2 rows.
  auto a = engine.NewSession(), b = engine.NewSession();
  ASSERT_TRUE(engine.Prefill(*a, RandomTokens(10, 1), false, nullptr).ok());
  ASSERT_EQ(seen.size(), 3 * per_pass);
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].first, sdm_layers[i % per_pass]);
    const int64_t rows = i / per_pass < 2 ? 4 : 2;
    EXPECT_EQ(seen[i].second.size(), static_cast<size_t>(rows * c.dim));
  }
  ASSERT_TRUE(engine.Prefill(*b, RandomTokens(7, 2), false, nullptr).ok());

  // One decode step of a and b together, then of each alone from clones: the same bits, rows in
  // batch order.
  auto a_alone = a->Clone(), b_alone = b->Clone();
  const std::vector<int32_t> tokens = {5, 9};
  std::vector<float> logits(2 * engine.vocab_size());
  seen.clear();
  std::vector<SessionState*> both = {a.get(), b.get()};
  ASSERT_TRUE(engine.Decode(both, tokens, logits).ok());
  const auto together = seen;
  ASSERT_EQ(together.size(), per_pass);
  for (int i = 0; i < 2; ++i) {
    seen.clear();
    SessionState* alone = i == 0 ? a_alone.get() : b_alone.get();
    std::vector<float> one(engine.vocab_size());
    ASSERT_TRUE(engine.Decode({&alone, 1}, {&tokens[i], 1}, one).ok());
    ASSERT_EQ(seen.size(), per_pass);
    for (size_t l = 0; l < per_pass; ++l) {
      const std::vector<float> row(together[l].second.begin() + i * c.dim,
                                   together[l].second.begin() + (i + 1) * c.dim);
      EXPECT_EQ(row, seen[l].second) << "session " << i << ", layer " << sdm_layers[l];
    }
  }
}

TEST(EngineTest, RejectsBadInput) {
  const ModelConfig c = Tiny();
  auto engine = MakeEngine(c);
  auto s = engine->NewSession();
  std::vector<float> logits(c.vocab_size);
  std::vector<int32_t> bad = {static_cast<int32_t>(c.vocab_size)};
  EXPECT_EQ(engine->Prefill(*s, bad, false, &logits).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->Prefill(*s, {}, false, &logits).code(), absl::StatusCode::kInvalidArgument);
  std::vector<int32_t> neg = {-1};
  SessionState* p = s.get();
  EXPECT_EQ(engine->Decode({&p, 1}, neg, logits).code(), absl::StatusCode::kInvalidArgument);
  SessionState* twice[] = {p, p};
  std::vector<int32_t> two = {1, 2};
  std::vector<float> two_logits(2 * c.vocab_size);
  EXPECT_EQ(engine->Decode(twice, two, two_logits).code(), absl::StatusCode::kInvalidArgument);
  std::vector<int32_t> one = {1};
  EXPECT_EQ(engine->Decode({&p, 1}, one, two_logits).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s->position(), 0);  // nothing was consumed by the rejected calls
}

// Engine::StageResume on the CPU: nothing to convert (the CPU steps the host layers), so it
// attaches nothing and the session continues as if it had not been called; a session of another
// model is refused as Step refuses it.
TEST(EngineTest, StagingAResumeOnTheCpuAttachesNothing) {
  const ModelConfig c = Tiny();
  auto engine = MakeEngine(c);
  auto s = engine->NewSession();
  ASSERT_TRUE(engine->Prefill(*s, RandomTokens(3, 1), false, nullptr).ok());
  EXPECT_TRUE(engine->StageResume(*s).ok());
  EXPECT_EQ(s->staged(), nullptr);
  EXPECT_EQ(engine->resume_staging_stats().staged, 0);
  const ModelConfig other_config = MiniHybrid();
  ASSERT_NE(other_config.n_layers, c.n_layers);  // what tells a session's model apart
  auto other = MakeEngine(other_config);
  auto foreign = other->NewSession();
  EXPECT_EQ(engine->StageResume(*foreign).code(), absl::StatusCode::kInvalidArgument);
}

// A write selects min(num_writes, slots_per_head) slots (docs/model-spec.md §5.2). The layout
// journals that many per token and head, not num_writes: a journaled write (a state store that
// persists deltas) used to fail the table's SDM_CHECK and abort. The journal of a prefill, replayed
// over a fresh session, rebuilds every row bit for bit.
TEST(EngineTest, MoreWritesThanSlotsAreJournaledAsTheSlotsWritten) {
  for (const bool key_weighted_decay : {false, true}) {
    SCOPED_TRACE(key_weighted_decay ? "key-weighted decay" : "one decay");
    ModelConfig c = Tiny();
    c.sdm.slots_per_head = 4;
    c.sdm.num_writes = 8;
    c.sdm.key_weighted_decay = key_weighted_decay;
    ASSERT_TRUE(FinalizeModelConfig(c).ok());
    auto engine = MakeEngine(c);
    StateLayout recording = engine->state_layout();
    int64_t sdm_layers = 0;
    for (LayerStateLayout& l : recording.layers) {
      if (l.kind != LayerStateLayout::Kind::kSdm) continue;
      ++sdm_layers;
      EXPECT_EQ(l.sdm_write.writes, 4);
      EXPECT_EQ(l.sdm_write.alphas, key_weighted_decay ? 4 : 1);
      l.sdm_write.record = true;
    }
    ASSERT_GT(sdm_layers, 0);
    SessionState journaled(recording), replica(recording);
    // Two tokens: their journal stays smaller than the rows they write, so it is kept whole.
    ASSERT_TRUE(engine->Prefill(journaled, RandomTokens(2, 7), false, nullptr).ok());
    for (int64_t l = 0; l < journaled.num_layers(); ++l) {
      if (!journaled.is_sdm(l)) continue;
      const SdmTable& live = journaled.sdm(l);
      ASSERT_TRUE(live.journal_complete());
      EXPECT_EQ(live.journal_records(), 2 * live.heads());
      ASSERT_TRUE(replica.sdm(l).ApplyJournal(live.journal(), live.journal_records()).ok());
      const SdmTable& got = replica.sdm(l);
      EXPECT_EQ(got.private_rows(), live.private_rows());
      for (int64_t h = 0; h < live.heads(); ++h) {
        for (int64_t slot = 0; slot < live.slots_per_head(); ++slot) {
          EXPECT_EQ(std::memcmp(got.Row(h, slot), live.Row(h, slot), live.row_width() * 4), 0)
              << "layer " << l << " head " << h << " slot " << slot;
        }
      }
    }
  }
}

// A session is stepped only by an engine whose state layout it has: one made by an engine with
// another prefill_chunk (its sliding-window rings hold window + prefill_chunk positions, so
// attention would silently lose keys), another CPU storage type or other widths (the step would
// read and write past its rows) is refused as a session of another model, before anything is
// consumed; so is staging its resume.
TEST(EngineTest, RefusesASessionOfAnotherStateLayout) {
  const ModelConfig c = Tiny();
  ModelConfig wide = c, fewer_slots = c, fewer_writes = c;
  wide.dim = 128;
  fewer_slots.sdm.slots_per_head = 16;  // the SDM tables differ, the KV caches do not
  fewer_writes.sdm.num_writes = 4;      // only the journaled writes differ
  for (ModelConfig* other : {&wide, &fewer_slots, &fewer_writes}) {
    ASSERT_TRUE(FinalizeModelConfig(*other).ok());
  }
  auto chunk8 = MakeEngine(c, 8);
  auto chunk256 = MakeEngine(c, 256);
  auto bf16 = MakeEngine(c, 8, DType::kBf16);
  auto wider = MakeEngine(wide, 8);
  auto slots16 = MakeEngine(fewer_slots, 8);
  auto writes4 = MakeEngine(fewer_writes, 8);
  const std::vector<int32_t> tokens = RandomTokens(3, 1);
  std::vector<float> logits;
  const std::vector<std::pair<Engine*, Engine*>> foreign = {
      {chunk8.get(), chunk256.get()}, {chunk256.get(), chunk8.get()},
      {chunk8.get(), bf16.get()},     {bf16.get(), chunk8.get()},
      {chunk8.get(), wider.get()},    {wider.get(), chunk8.get()},
      {chunk8.get(), slots16.get()},  {slots16.get(), chunk8.get()},
      {chunk8.get(), writes4.get()}};
  for (size_t i = 0; i < foreign.size(); ++i) {
    SCOPED_TRACE(i);
    auto [maker, stepper] = foreign[i];
    auto session = maker->NewSession();
    const absl::Status refused = stepper->Prefill(*session, tokens, false, &logits);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_EQ(session->position(), 0);
    EXPECT_EQ(stepper->StageResume(*session).code(), absl::StatusCode::kInvalidArgument);
    // Its own engine steps it, as does another engine of the same layout.
    EXPECT_TRUE(maker->Prefill(*session, tokens, false, &logits).ok());
    auto twin =
        MakeEngine(maker->config(), maker->options().prefill_chunk, maker->options().cpu_dtype);
    EXPECT_TRUE(twin->Prefill(*session, tokens, false, &logits).ok());
    EXPECT_EQ(session->position(), 2 * static_cast<int64_t>(tokens.size()));
  }
}

// The ids of this process's threads named `name` (/proc/self/task/*/comm).
std::set<int> ThreadsNamed(const std::string& name) {
  std::set<int> ids;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string line;
    if (std::getline(comm, line) && line == name) ids.insert(std::stoi(task.path().filename()));
  }
  return ids;
}

TEST(EngineTest, DecodeNiceLowersTheKernelThreadsAndNotTheCaller) {
#if !defined(__linux__)
  GTEST_SKIP() << "thread priorities are Linux nice values";
#endif
  const int before = CurrentThreadNice();
  const std::set<int> earlier = ThreadsNamed("sdm-kernel");
  EngineOptions o;
  o.num_threads = 3;
  o.decode_nice = 5;
  auto engine = Engine::Create(RandomModel(Tiny(), 11), o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  int workers = 0;
  for (int id : ThreadsNamed("sdm-kernel")) {
    if (earlier.count(id) != 0) continue;
    ++workers;
    errno = 0;
    EXPECT_EQ(getpriority(PRIO_PROCESS, static_cast<id_t>(id)), std::min(before + 5, 19))
        << "thread " << id;
    EXPECT_EQ(errno, 0);
  }
  EXPECT_EQ(workers, 2);  // the caller is the third thread of the pool
  EXPECT_EQ(CurrentThreadNice(), before);
}

TEST(EngineTest, RefusesADecodeNiceOutsideZeroToNineteen) {
  for (int nice : {-1, kMaxNiceIncrement + 1}) {
    EngineOptions o;
    o.decode_nice = nice;
    auto engine = Engine::Create(RandomModel(Tiny(), 11), o);
    ASSERT_FALSE(engine.ok()) << nice;
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument) << engine.status();
    EXPECT_NE(engine.status().message().find("decode_nice"), std::string::npos);
  }
}

}  // namespace
}  // namespace sdm

namespace sdm {
namespace {

TEST(EngineTest, CloneContinuesExactlyLikeTheOriginal) {
  const ModelConfig c = MiniHybrid();
  auto engine = MakeEngine(c);
  auto a = engine->NewSession();
  ASSERT_TRUE(engine->Prefill(*a, RandomTokens(23, 3), false, nullptr).ok());
  auto b = a->Clone();
  EXPECT_EQ(b->position(), a->position());
  EXPECT_EQ(b->ResidentBytes(), a->ResidentBytes());
  const auto more = RandomTokens(9, 4);
  std::vector<float> la, lb;
  ASSERT_TRUE(engine->Prefill(*a, more, true, &la).ok());
  ASSERT_TRUE(engine->Prefill(*b, more, true, &lb).ok());
  EXPECT_EQ(la, lb);  // same calls, same shapes: bitwise equal
  // The copy is independent: feeding only the original changes nothing in the copy.
  const int64_t rows = b->sdm(1).private_rows();
  ASSERT_TRUE(engine->Prefill(*a, RandomTokens(5, 5), false, nullptr).ok());
  EXPECT_EQ(b->sdm(1).private_rows(), rows);
  EXPECT_EQ(b->position(), a->position() - 5);
}

}  // namespace
}  // namespace sdm
