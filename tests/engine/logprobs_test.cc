#include "engine/logprobs.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace sdm {
namespace {

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<float> RandomLogits(int n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> logits(n);
  for (float& l : logits) l = normal(rng);
  return logits;
}

// log(softmax(logits)[id]) in long double, computed independently (two passes, no shift tricks
// shared with the code under test beyond the max).
double ReferenceLogprob(const std::vector<float>& logits, int id) {
  long double max = -INFINITY;
  for (const float l : logits) max = std::max<long double>(max, l);
  long double total = 0;
  for (const float l : logits) total += std::exp(static_cast<long double>(l) - max);
  return static_cast<double>(static_cast<long double>(logits[id]) - max - std::log(total));
}

TEST(LogprobsTest, MatchTheLogSoftmaxAndSumToOne) {
  for (const uint32_t seed : {20261207u, std::random_device{}()}) {
    SCOPED_TRACE(seed);
    for (const float scale : {0.5f, 4.0f, 40.0f}) {
      const std::vector<float> logits = RandomLogits(300, seed, scale);
      const int n = static_cast<int>(logits.size());
      std::vector<double> all(n);
      double total = 0;
      for (int id = 0; id < n; ++id) {
        all[id] = ComputeLogprobs(logits, id, 0).chosen.logprob;
        EXPECT_NEAR(all[id], ReferenceLogprob(logits, id), 1e-9 * (1 + std::abs(all[id])));
        EXPECT_LE(all[id], 0.0);
        total += std::exp(all[id]);
      }
      EXPECT_NEAR(total, 1.0, 1e-9);
      // The alternatives are the most probable tokens, in order, with the same numbers.
      const TokenLogprobs lp = ComputeLogprobs(logits, 7, 20);
      EXPECT_EQ(lp.chosen.token, 7);
      ASSERT_EQ(lp.top.size(), 20u);
      int above = 0;  // tokens more probable than the 20th
      for (int id = 0; id < n; ++id) above += all[id] > lp.top.back().logprob ? 1 : 0;
      EXPECT_EQ(above, 19);
      for (size_t i = 0; i < lp.top.size(); ++i) {
        EXPECT_EQ(lp.top[i].logprob, all[lp.top[i].token]);
        if (i > 0) {
          EXPECT_GE(lp.top[i - 1].logprob, lp.top[i].logprob);
        }
      }
    }
  }
}

TEST(LogprobsTest, IndependentOfHowTheTokenWasChosen) {
  // The numbers are the model's distribution's: the same for every chosen token and top_n.
  const std::vector<float> logits = RandomLogits(50, 3, 2.0f);
  const TokenLogprobs a = ComputeLogprobs(logits, 3, 5);
  const TokenLogprobs b = ComputeLogprobs(logits, 40, 10);
  ASSERT_EQ(a.top.size(), 5u);
  for (size_t i = 0; i < a.top.size(); ++i) {
    EXPECT_EQ(a.top[i].token, b.top[i].token);
    EXPECT_EQ(a.top[i].logprob, b.top[i].logprob);
  }
  EXPECT_EQ(ComputeLogprobs(logits, a.top[0].token, 0).chosen.logprob, a.top[0].logprob);
}

TEST(LogprobsTest, TiesGoToTheLowestIdAndTopIsCutAtTheVocabulary) {
  const std::vector<float> logits = {1.0f, 2.0f, 2.0f, 0.5f};
  const TokenLogprobs lp = ComputeLogprobs(logits, 0, 20);
  ASSERT_EQ(lp.top.size(), 4u);
  EXPECT_EQ(lp.top[0].token, 1);
  EXPECT_EQ(lp.top[1].token, 2);
  EXPECT_EQ(lp.top[2].token, 0);
  EXPECT_EQ(lp.top[3].token, 3);
  EXPECT_EQ(lp.top[0].logprob, lp.top[1].logprob);
}

TEST(LogprobsTest, NanLogitsHaveProbabilityZeroAndComeLast) {
  const std::vector<float> logits = {kNan, 0.0f, kNan, 0.0f};
  const TokenLogprobs lp = ComputeLogprobs(logits, 0, 4);
  EXPECT_EQ(lp.chosen.logprob, -std::numeric_limits<double>::infinity());
  ASSERT_EQ(lp.top.size(), 4u);
  EXPECT_EQ(lp.top[0].token, 1);
  EXPECT_NEAR(lp.top[0].logprob, std::log(0.5), 1e-15);
  EXPECT_EQ(lp.top[1].token, 3);
  EXPECT_EQ(lp.top[2].token, 0);
  EXPECT_EQ(lp.top[3].token, 2);
  // Every logit NaN: nothing has probability.
  const std::vector<float> nan = {kNan, kNan};
  EXPECT_EQ(ComputeLogprobs(nan, 1, 0).chosen.logprob, -std::numeric_limits<double>::infinity());
}

TEST(LogprobsTest, InfiniteLogitsShareTheProbability) {
  const std::vector<float> logits = {kInf, 3.0f, kInf, -kInf};
  EXPECT_NEAR(ComputeLogprobs(logits, 0, 0).chosen.logprob, std::log(0.5), 1e-15);
  EXPECT_EQ(ComputeLogprobs(logits, 1, 0).chosen.logprob, -std::numeric_limits<double>::infinity());
  EXPECT_EQ(ComputeLogprobs(logits, 3, 0).chosen.logprob, -std::numeric_limits<double>::infinity());
  // A -inf logit among finite ones has probability 0; the rest still sum to 1.
  const std::vector<float> finite = {0.0f, -kInf, 0.0f};
  EXPECT_EQ(ComputeLogprobs(finite, 1, 0).chosen.logprob, -std::numeric_limits<double>::infinity());
  EXPECT_NEAR(ComputeLogprobs(finite, 2, 0).chosen.logprob, std::log(0.5), 1e-15);
}

TEST(LogprobsTest, TopIsTheFullSortsPrefixWithManyTiesAndNans) {
  // Logits from a few values (many ties), some NaN and infinite: the alternatives are the first
  // n of the whole vocabulary sorted as the header says (descending, ties by id, NaN last).
  for (const uint32_t seed : {7u, 20261208u, std::random_device{}()}) {
    SCOPED_TRACE(seed);
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> pick(0, 9);
    std::vector<float> logits(97);
    for (float& l : logits) {
      const int v = pick(rng);
      l = v == 0 ? kNan : v == 1 ? -kInf : static_cast<float>(v % 4);
    }
    std::vector<int32_t> sorted(logits.size());
    for (size_t i = 0; i < sorted.size(); ++i) sorted[i] = static_cast<int32_t>(i);
    std::stable_sort(sorted.begin(), sorted.end(), [&logits](int32_t a, int32_t b) {
      const float la = logits[a], lb = logits[b];
      if (std::isnan(la) || std::isnan(lb)) return !std::isnan(la) && std::isnan(lb);
      return la > lb;
    });
    for (const int n : {1, 5, 20}) {
      const TokenLogprobs lp = ComputeLogprobs(logits, 0, n);
      ASSERT_EQ(lp.top.size(), static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) EXPECT_EQ(lp.top[i].token, sorted[i]) << "n " << n << " i " << i;
    }
  }
}

}  // namespace
}  // namespace sdm
