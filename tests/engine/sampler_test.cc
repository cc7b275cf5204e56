#include "engine/sampler.h"

#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace sdm {
namespace {

using ::testing::HasSubstr;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

SamplingParams Sampling(double temperature, int top_k = 0, double top_p = 1.0, uint64_t seed = 0) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.seed = seed;
  return p;
}

// Counts of each token over draws 0..n-1.
std::map<int32_t, int> Histogram(const std::vector<float>& logits, const SamplingParams& params,
                                 int n) {
  std::map<int32_t, int> counts;
  for (int i = 0; i < n; ++i) ++counts[SampleToken(logits, params, i)];
  return counts;
}

std::set<int32_t> Support(const std::map<int32_t, int>& counts) {
  std::set<int32_t> ids;
  for (const auto& [id, count] : counts) ids.insert(id);
  return ids;
}

// softmax(logits / t), in long double, computed independently of the sampler.
std::vector<double> Softmax(const std::vector<float>& logits, double t) {
  long double max = -INFINITY, total = 0;
  for (const float l : logits) max = std::max<long double>(max, l);
  std::vector<long double> e;
  for (const float l : logits) total += e.emplace_back(std::exp((l - max) / t));
  std::vector<double> p;
  for (const long double x : e) p.push_back(static_cast<double>(x / total));
  return p;
}

std::vector<float> RandomLogits(int n, uint32_t seed, float scale = 3.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> logits(n);
  for (float& l : logits) l = normal(rng);
  return logits;
}

// With n draws of a token of probability p, the count's standard deviation is sqrt(n p (1-p)).
// 5 standard deviations: a correct sampler fails this with probability < 1e-6 per token, and the
// seed is fixed, so a pass is reproducible; a wrong distribution (e.g. a missing renormalisation
// or temperature) moves frequencies by far more than 0.02 at these sample sizes.
void ExpectFrequenciesMatch(const std::map<int32_t, int>& counts, const std::vector<double>& p,
                            int n) {
  for (size_t id = 0; id < p.size(); ++id) {
    const auto it = counts.find(static_cast<int32_t>(id));
    const double observed = it == counts.end() ? 0.0 : static_cast<double>(it->second) / n;
    const double sigma = std::sqrt(p[id] * (1 - p[id]) / n);
    EXPECT_NEAR(observed, p[id], 5 * sigma + 1e-12) << "token " << id;
  }
}

// ---------------------------------------------------------------------------------------------
// The generator

TEST(PhiloxTest, MatchesRandom123KnownAnswers) {
  // Random123's kat_vectors for philox4x32_10.
  EXPECT_EQ(Philox4x32_10({0, 0, 0, 0}, {0, 0}),
            (std::array<uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(
      Philox4x32_10({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
      (std::array<uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(
      Philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
      (std::array<uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(UniformDrawTest, IsAFunctionOfSeedAndIndexInTheUnitInterval) {
  EXPECT_EQ(UniformDraw(5, 17), UniformDraw(5, 17));
  EXPECT_NE(UniformDraw(5, 17), UniformDraw(5, 18));
  EXPECT_NE(UniformDraw(5, 17), UniformDraw(6, 17));
  // The high half of the index and of the seed matter too.
  EXPECT_NE(UniformDraw(5, 17), UniformDraw(5, 17 + (uint64_t{1} << 32)));
  EXPECT_NE(UniformDraw(5, 17), UniformDraw(5 + (uint64_t{1} << 32), 17));
  // 53 bits: (x0 << 32 | x1) >> 11 of the block at counter {0,0,0,0}, key {0,0}.
  EXPECT_EQ(UniformDraw(0, 0),
            static_cast<double>(((uint64_t{0x6627e8d5} << 32) | 0xe169c58d) >> 11) * 0x1.0p-53);

  const int n = 100000;
  double sum = 0, min = 1, max = 0;
  for (int i = 0; i < n; ++i) {
    const double u = UniformDraw(42, i);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    min = std::min(min, u);
    max = std::max(max, u);
  }
  // Mean of n uniforms: standard deviation sqrt(1/12/n) ~ 0.0009.
  EXPECT_NEAR(sum / n, 0.5, 0.005);
  EXPECT_LT(min, 1e-3);
  EXPECT_GT(max, 1 - 1e-3);
}

// ---------------------------------------------------------------------------------------------
// Greedy

TEST(SampleTokenTest, GreedyIsArgmaxWithTiesToTheLowestId) {
  const SamplingParams greedy = Sampling(0.0);
  EXPECT_EQ(SampleToken(std::vector<float>{1, 3, 2}, greedy, 0), 1);
  EXPECT_EQ(SampleToken(std::vector<float>{5, 1, 5}, greedy, 0), 0);
  EXPECT_EQ(SampleToken(std::vector<float>{-2, 7, 7, 7}, greedy, 9), 1);
  EXPECT_EQ(SampleToken(std::vector<float>{0.5f}, greedy, 0), 0);
  // The draw index does not matter.
  for (uint64_t i = 0; i < 10; ++i)
    EXPECT_EQ(SampleToken(std::vector<float>{1, 3, 2}, greedy, i), 1);
}

TEST(SampleTokenTest, GreedyNeverChoosesNan) {
  const SamplingParams greedy = Sampling(0.0);
  EXPECT_EQ(SampleToken(std::vector<float>{kNan, 1, 2}, greedy, 0), 2);
  EXPECT_EQ(SampleToken(std::vector<float>{3, kNan, 2}, greedy, 0), 0);
  EXPECT_EQ(SampleToken(std::vector<float>{kNan, -kInf, kNan}, greedy, 0), 1);
  EXPECT_EQ(SampleToken(std::vector<float>{1, kInf, kInf}, greedy, 0), 1);
  EXPECT_EQ(SampleToken(std::vector<float>{kNan, kNan}, greedy, 0), 0);  // documented fallback
}

TEST(SampleTokenTest, TopKOneIsGreedyAtAnyTemperature) {
  for (uint32_t trial = 0; trial < 20; ++trial) {
    std::vector<float> logits = RandomLogits(100, trial);
    if (trial % 2 == 0) logits[77] = logits[13] = 100.0f;  // a tie for the maximum
    const int32_t argmax = SampleToken(logits, Sampling(0.0), 0);
    for (const double t : {0.01, 0.7, 1.0, 10.0, 1e6}) {
      for (uint64_t i = 0; i < 20; ++i) {
        ASSERT_EQ(SampleToken(logits, Sampling(t, /*top_k=*/1, 1.0, trial), i), argmax)
            << "temperature " << t;
      }
    }
  }
}

TEST(SampleTokenTest, TinyTemperatureIsGreedy) {
  const std::vector<float> logits = RandomLogits(50, 9);
  const int32_t argmax = SampleToken(logits, Sampling(0.0), 0);
  for (uint64_t i = 0; i < 200; ++i) EXPECT_EQ(SampleToken(logits, Sampling(1e-30), i), argmax);
}

// ---------------------------------------------------------------------------------------------
// Sampling

TEST(SampleTokenTest, SameSeedAndIndexGiveTheSameTokenDifferentSeedsDiffer) {
  const std::vector<float> logits(64, 0.0f);  // uniform: 64 equally likely tokens
  std::vector<int32_t> a, b, c;
  for (uint64_t i = 0; i < 200; ++i) {
    a.push_back(SampleToken(logits, Sampling(1.0, 0, 1.0, /*seed=*/1), i));
    b.push_back(SampleToken(logits, Sampling(1.0, 0, 1.0, /*seed=*/1), i));
    c.push_back(SampleToken(logits, Sampling(1.0, 0, 1.0, /*seed=*/2), i));
  }
  EXPECT_EQ(a, b);
  int same = 0;
  for (size_t i = 0; i < a.size(); ++i) same += a[i] == c[i];
  // Independent streams agree on 200/64 ~ 3 positions on average.
  EXPECT_LT(same, 20);
  // Replay from the middle: draw i depends on i only, not on the draws before it.
  EXPECT_EQ(SampleToken(logits, Sampling(1.0, 0, 1.0, 1), 150), a[150]);
}

TEST(SampleTokenTest, InverseCdfOverIdsInOrderWithTheCounterDraw) {
  // With no truncation the token is the first id whose cumulative probability exceeds u.
  const std::vector<float> logits = RandomLogits(10, 5);
  const double t = 0.8;
  const std::vector<double> p = Softmax(logits, t);
  for (uint64_t i = 0; i < 500; ++i) {
    const double u = UniformDraw(77, i);
    int32_t expected = 0;
    double cumulative = p[0];
    while (u >= cumulative && expected + 1 < static_cast<int32_t>(p.size())) {
      cumulative += p[++expected];
    }
    EXPECT_EQ(SampleToken(logits, Sampling(t, 0, 1.0, 77), i), expected) << "u " << u;
  }
}

TEST(SampleTokenTest, FrequenciesMatchTheSoftmax) {
  const std::vector<float> logits = {1.0f, 2.5f, 0.0f, -1.0f, 2.0f, 1.5f};
  const int n = 20000;
  for (const double t : {0.7, 1.0, 2.0}) {
    SCOPED_TRACE(testing::Message() << "temperature " << t);
    ExpectFrequenciesMatch(Histogram(logits, Sampling(t, 0, 1.0, 123), n), Softmax(logits, t), n);
  }
}

TEST(SampleTokenTest, LowerTemperatureMovesMassToTheArgmax) {
  const std::vector<float> logits = {1.0f, 2.5f, 0.0f, -1.0f, 2.0f, 1.5f};
  const int n = 20000;
  std::vector<double> argmax_share;
  for (const double t : {2.0, 1.0, 0.5, 0.25}) {
    argmax_share.push_back(Histogram(logits, Sampling(t, 0, 1.0, 5), n)[1] / double{n});
  }
  // Exact shares: 0.30, 0.43, 0.64, 0.86; neighbours are > 0.1 apart, ~30 standard deviations.
  for (size_t i = 1; i < argmax_share.size(); ++i) {
    EXPECT_GT(argmax_share[i], argmax_share[i - 1] + 0.1);
  }
}

TEST(SampleTokenTest, TopKRestrictsTheSupportAndRenormalises) {
  const std::vector<float> logits = RandomLogits(50, 11, 1.0f);
  // The 5 largest logits, found independently.
  std::vector<int32_t> order(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  const std::set<int32_t> top5(order.begin(), order.begin() + 5);

  const int n = 20000;
  // A high temperature makes the distribution nearly flat: without the restriction all 50 would
  // appear.
  const std::map<int32_t, int> counts = Histogram(logits, Sampling(5.0, /*top_k=*/5, 1.0, 3), n);
  EXPECT_EQ(Support(counts), top5);
  // Within the top 5, probabilities are the softmax renormalised over them.
  std::vector<float> masked(logits.size(), -kInf);
  for (const int32_t id : top5) masked[id] = logits[id];
  ExpectFrequenciesMatch(counts, Softmax(masked, 5.0), n);
}

TEST(SampleTokenTest, TopKTiesAtTheBoundaryKeepTheLowestIds) {
  const std::vector<float> logits = {1.0f, 2.0f, 2.0f, 2.0f, 0.0f};
  const std::map<int32_t, int> counts = Histogram(logits, Sampling(1.0, /*top_k=*/2), 2000);
  EXPECT_EQ(Support(counts), (std::set<int32_t>{1, 2}));
}

TEST(SampleTokenTest, TopPRestrictsToTheNucleus) {
  // Probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1.
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f),
                                     std::log(0.05f)};
  const int n = 20000;
  // 0.5 < 0.75 <= 0.5 + 0.3: the nucleus is {0, 1}, renormalised to 0.625 / 0.375.
  std::map<int32_t, int> counts = Histogram(logits, Sampling(1.0, 0, /*top_p=*/0.75, 8), n);
  EXPECT_EQ(Support(counts), (std::set<int32_t>{0, 1}));
  ExpectFrequenciesMatch(counts, {0.625, 0.375, 0, 0}, n);
  // 0.81 needs the third token.
  counts = Histogram(logits, Sampling(1.0, 0, 0.81, 8), n);
  EXPECT_EQ(Support(counts), (std::set<int32_t>{0, 1, 2}));
  ExpectFrequenciesMatch(counts, {0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0}, n);
  // A tiny top_p still keeps one token: the most probable; so does 0 (OpenAI's API accepts it).
  EXPECT_EQ(Support(Histogram(logits, Sampling(1.0, 0, 1e-9, 8), 500)), (std::set<int32_t>{0}));
  EXPECT_EQ(Support(Histogram(logits, Sampling(1.0, 0, 0.0, 8), 500)), (std::set<int32_t>{0}));
  // The most probable also where it is not the first id.
  const std::vector<float> reversed(logits.rbegin(), logits.rend());
  EXPECT_EQ(Support(Histogram(reversed, Sampling(1.0, 0, 0.0, 8), 500)), (std::set<int32_t>{3}));
  // top_p = 1 keeps everything.
  EXPECT_EQ(Support(Histogram(logits, Sampling(1.0, 0, 1.0, 8), n)),
            (std::set<int32_t>{0, 1, 2, 3}));
}

TEST(SampleTokenTest, TopPAppliesToTheTopKRenormalisedDistribution) {
  // Probabilities 0.4, 0.3, 0.2, 0.1. After top_k = 2: 4/7 and 3/7. top_p = 0.5 < 4/7 keeps only
  // token 0; measured on the full distribution (0.4 < 0.5) it would keep token 1 too.
  const std::vector<float> logits = {std::log(0.4f), std::log(0.3f), std::log(0.2f),
                                     std::log(0.1f)};
  EXPECT_EQ(Support(Histogram(logits, Sampling(1.0, /*top_k=*/2, /*top_p=*/0.5, 4), 2000)),
            (std::set<int32_t>{0}));
  const int n = 20000;
  const std::map<int32_t, int> counts = Histogram(logits, Sampling(1.0, 3, 0.9, 4), n);
  // top_k 3: 4/9, 3/9, 2/9; cumulative 7/9 = 0.78 < 0.9, so all three stay.
  EXPECT_EQ(Support(counts), (std::set<int32_t>{0, 1, 2}));
  ExpectFrequenciesMatch(counts, {4.0 / 9, 3.0 / 9, 2.0 / 9, 0}, n);
}

TEST(SampleTokenTest, NanNeverSampledInfinityTakesAllTheMass) {
  const int n = 2000;
  EXPECT_EQ(Support(Histogram({kNan, 0.0f, 0.0f, kNan}, Sampling(1.0), n)),
            (std::set<int32_t>{1, 2}));
  EXPECT_EQ(Support(Histogram({kNan, 0.0f, 0.0f, kNan}, Sampling(1.0, 0, 0.9), n)),
            (std::set<int32_t>{1, 2}));
  EXPECT_EQ(Support(Histogram({kInf, 50.0f, kInf, -kInf}, Sampling(1.0), n)),
            (std::set<int32_t>{0, 2}));
  EXPECT_EQ(Support(Histogram({-kInf, 3.0f, -kInf}, Sampling(1.0, 2, 0.5), n)),
            (std::set<int32_t>{1}));
  // Nothing to sample from: the greedy fallback.
  EXPECT_EQ(SampleToken(std::vector<float>{-kInf, -kInf}, Sampling(1.0), 0), 0);
  EXPECT_EQ(SampleToken(std::vector<float>{kNan, kNan}, Sampling(1.0), 0), 0);
}

TEST(SampleTokenTest, NucleusBoundaryIsReachedInclusively) {
  // Four equal logits: every weight is exactly 1 and the cumulative masses 1, 2, 3, 4 are exact,
  // so the nucleus rule "mass reaches top_p of the total" (>=) decides alone; the CUDA sampler
  // follows the same rule (kernels/common/sampling_math.h).
  const std::vector<float> logits(4, 0.25f);
  EXPECT_EQ(Support(Histogram(logits, Sampling(1.0, 0, /*top_p=*/0.5, 3), 400)),
            (std::set<int32_t>{0, 1}));
  EXPECT_EQ(Support(Histogram(logits, Sampling(1.0, 0, std::nextafter(0.5, 1.0), 3), 400)),
            (std::set<int32_t>{0, 1, 2}));
  EXPECT_EQ(Support(Histogram(logits, Sampling(1.0, 0, 0.25, 3), 100)), (std::set<int32_t>{0}));
  // With top_k = 3 the total is 3: 2 / 3 reaches top_p = 0.6, so ids 0 and 1 remain.
  EXPECT_EQ(Support(Histogram(logits, Sampling(1.0, 3, 0.6, 3), 400)), (std::set<int32_t>{0, 1}));
}

TEST(SampleTokenTest, InverseCdfOverEqualWeightsSplitsTheUnitIntervalEvenly) {
  // n equal weights: the token is floor(u * n) exactly (target u * n against the integers 1..n,
  // strict comparison), in id order and, restricted by top_k, in sorted order, which for equal
  // logits is id order too.
  for (const int n : {2, 3, 7, 258}) {
    const std::vector<float> logits(n, -1.0f);
    for (uint64_t i = 0; i < 300; ++i) {
      const int32_t want = static_cast<int32_t>(std::floor(UniformDraw(21, i) * n));
      ASSERT_EQ(SampleToken(logits, Sampling(1.0, 0, 1.0, 21), i), want) << n;
      ASSERT_EQ(SampleToken(logits, Sampling(1.0, n - 1, 1.0, 21), i),
                static_cast<int32_t>(std::floor(UniformDraw(21, i) * (n - 1))))
          << n;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Validation

TEST(ValidateSamplingParamsTest, AcceptsDefaultsAndEdgeValues) {
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams{}, 258).ok());
  SamplingParams p;
  p.temperature = 1e-6;
  p.top_k = 100000;  // larger than the vocabulary: no limit
  p.top_p = 1.0;
  p.max_tokens = 1;
  p.stop_token_ids = {0, 257};
  EXPECT_TRUE(ValidateSamplingParams(p, 258).ok());
  p.top_p = 0.0;  // the most probable token only
  EXPECT_TRUE(ValidateSamplingParams(p, 258).ok());
}

TEST(ValidateSamplingParamsTest, RejectsEachBadFieldByName) {
  struct Case {
    SamplingParams params;
    const char* field;
  };
  std::vector<Case> cases;
  const auto with = [&](auto&& edit, const char* field) {
    SamplingParams p;
    edit(p);
    cases.push_back({p, field});
  };
  with([](SamplingParams& p) { p.temperature = -0.5; }, "temperature");
  with([](SamplingParams& p) { p.temperature = std::nan(""); }, "temperature");
  with([](SamplingParams& p) { p.temperature = INFINITY; }, "temperature");
  with([](SamplingParams& p) { p.top_k = -1; }, "top_k");
  with([](SamplingParams& p) { p.top_p = -0.01; }, "top_p");
  with([](SamplingParams& p) { p.top_p = 1.5; }, "top_p");
  with([](SamplingParams& p) { p.top_p = std::nan(""); }, "top_p");
  with([](SamplingParams& p) { p.max_tokens = -1; }, "max_tokens");
  with([](SamplingParams& p) { p.stop_token_ids = {3, 258}; }, "258");
  with([](SamplingParams& p) { p.stop_token_ids = {-1}; }, "-1");
  for (const Case& c : cases) {
    const absl::Status status = ValidateSamplingParams(c.params, 258);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(status.message(), HasSubstr(c.field));
  }
}

}  // namespace
}  // namespace sdm
