#include "engine/weight_init.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tests/engine/test_model_util.h"

namespace sdm {
namespace {

using ::sdm::testing::TinyConfig;

TensorSpec NormalSpec(const std::string& name, int64_t n, double std, double bound) {
  TensorSpec s;
  s.name = name;
  s.shape = {n};
  s.init = WeightInit::kTruncNormal;
  s.init_std = std;
  s.init_bound = bound;
  return s;
}

std::vector<float> Fill(const ModelConfig& c, const TensorSpec& s, uint64_t seed) {
  std::vector<float> out(static_cast<size_t>(NumElements(s)));
  FillTensor(c, s, seed, 0, out);
  return out;
}

double Phi(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }
double Pdf(double x) { return std::exp(-x * x / 2) / std::sqrt(2 * M_PI); }

// Standard deviation of N(0, 1) truncated to [-k, k].
double TruncatedStd(double k) { return std::sqrt(1 - 2 * k * Pdf(k) / (2 * Phi(k) - 1)); }

TEST(NormalQuantileTest, MatchesKnownValues) {
  EXPECT_NEAR(NormalQuantile(0.5), 0.0, 1e-15);
  EXPECT_NEAR(NormalQuantile(0.975), 1.959963984540054, 1e-13);
  EXPECT_NEAR(NormalQuantile(0.025), -1.959963984540054, 1e-13);
  EXPECT_NEAR(NormalQuantile(0.841344746068543), 1.0, 1e-12);
  EXPECT_NEAR(NormalQuantile(0.00134989803163009), -3.0, 1e-11);
  EXPECT_NEAR(NormalQuantile(1e-10), -6.361340902404056, 1e-11);
  for (double p : {1e-7, 0.01, 0.3, 0.6, 0.9, 0.999}) {
    EXPECT_NEAR(Phi(NormalQuantile(p)), p, 1e-14 + 1e-12 * p) << p;
  }
}

TEST(WeightInitTest, ValuesDoNotDependOnChunkingOrThreads) {
  const ModelConfig c = TinyConfig();
  const TensorSpec s = NormalSpec("layers.0.attention.wq.weight", 300001, 0.02, 0.06);
  const std::vector<float> whole = Fill(c, s, 11);
  std::vector<float> pieces(whole.size());
  std::mt19937 rng(5);
  for (size_t i = 0; i < pieces.size();) {
    const size_t n = std::min<size_t>(pieces.size() - i, 1 + rng() % 5000);
    FillTensor(c, s, 11, static_cast<int64_t>(i), std::span(pieces).subspan(i, n));
    i += n;
  }
  EXPECT_EQ(pieces, whole);
  std::vector<float> parallel(whole.size());
  FillTensorParallel(c, s, 11, 0, parallel, 7);
  EXPECT_EQ(parallel, whole);
  std::vector<float> tail(1000);
  FillTensorParallel(c, s, 11, 299001, tail, 3);
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), whole.end() - 1000));
}

TEST(WeightInitTest, DependsOnSeedAndName) {
  const ModelConfig c = TinyConfig();
  const TensorSpec a = NormalSpec("a", 1000, 1.0, 3.0);
  const TensorSpec b = NormalSpec("b", 1000, 1.0, 3.0);
  const auto a1 = Fill(c, a, 1);
  EXPECT_EQ(Fill(c, a, 1), a1);
  const auto a2 = Fill(c, a, 2);
  const auto b1 = Fill(c, b, 1);
  int same_seed = 0, same_name = 0;
  for (size_t i = 0; i < a1.size(); ++i) {
    same_seed += a1[i] == a2[i];
    same_name += a1[i] == b1[i];
  }
  EXPECT_EQ(same_seed, 0);
  EXPECT_EQ(same_name, 0);
}

void CheckTruncatedNormal(double std, double bound) {
  SCOPED_TRACE(::testing::Message() << "std " << std << " bound " << bound);
  const int64_t n = 1 << 20;
  const auto v = Fill(TinyConfig(), NormalSpec("x", n, std, bound), 42);
  double sum = 0, sq = 0, max_abs = 0;
  int64_t beyond_one_std = 0;
  for (float x : v) {
    sum += x;
    sq += double(x) * x;
    max_abs = std::max(max_abs, std::abs(double(x)));
    beyond_one_std += std::abs(x) > std;
  }
  const double k = bound / std;
  const double sigma = std * TruncatedStd(k);
  const double mean = sum / n;
  EXPECT_LT(std::abs(mean), 5 * sigma / std::sqrt(double(n)));
  EXPECT_NEAR(std::sqrt(sq / n), sigma, 0.005 * sigma);
  EXPECT_LE(max_abs, bound * (1 + 1e-6));
  if (k <= 3) {
    EXPECT_GT(max_abs, bound * 0.99);  // the tails reach the bounds
  }
  // P(|X| > std) under the truncated law.
  const double p = (2 * Phi(k) - 1 - (2 * Phi(1) - 1)) / (2 * Phi(k) - 1);
  EXPECT_NEAR(double(beyond_one_std) / n, p, 5 * std::sqrt(p * (1 - p) / n));
}

TEST(WeightInitTest, TruncatedNormalHasTheTruncatedMoments) {
  CheckTruncatedNormal(0.02, 0.06);  // the usual 3-sigma truncation: std 0.98658 * 0.02
  CheckTruncatedNormal(1.0, 1.0);    // bound = 1 std: std 0.5396, far from an untruncated 1
  CheckTruncatedNormal(0.5, 3.0);    // bound = 6 std (a depth-scaled std)
}

TEST(WeightInitTest, ZerosAndOnes) {
  const ModelConfig c = TinyConfig();
  TensorSpec s;
  s.name = "z";
  s.shape = {17};
  s.init = WeightInit::kZeros;
  EXPECT_EQ(Fill(c, s, 1), std::vector<float>(17, 0.0f));
  s.init = WeightInit::kOnes;
  EXPECT_EQ(Fill(c, s, 1), std::vector<float>(17, 1.0f));
}

TEST(WeightInitTest, ALogIsLogOfUniformInTheConfiguredRange) {
  ModelConfig c = TinyConfig();
  c.sdm.a_init_min = 1.0;
  c.sdm.a_init_max = 16.0;
  TensorSpec s;
  s.name = "layers.3.attention.A_log";
  s.shape = {200000};
  s.init = WeightInit::kSdmALog;
  const auto v = Fill(c, s, 9);
  double sum = 0;
  for (float x : v) {
    const double a = std::exp(double(x));
    ASSERT_GE(a, 1.0 - 1e-6);
    ASSERT_LE(a, 16.0 + 1e-5);
    sum += a;
  }
  // Uniform(1, 16): mean 8.5, standard deviation 15 / sqrt(12).
  EXPECT_NEAR(sum / v.size(), 8.5, 5 * (15 / std::sqrt(12.0)) / std::sqrt(double(v.size())));

  // The reference's default range (0, 16) clamps A at 1e-4 before the log.
  c.sdm.a_init_min = 0.0;
  c.sdm.a_init_max = 1e-5;
  for (float x : Fill(c, s, 9)) ASSERT_FLOAT_EQ(x, std::log(1e-4f));
}

TEST(WeightInitTest, DtBiasIsInverseSoftplusOfLogUniformStep) {
  const ModelConfig c = TinyConfig();
  TensorSpec s;
  s.name = "layers.3.attention.dt_bias";
  s.shape = {200000};
  s.init = WeightInit::kSdmDtBias;
  const auto v = Fill(c, s, 9);
  double sum_log = 0;
  for (float x : v) {
    const double dt = std::log1p(std::exp(double(x)));  // softplus undoes inv_softplus
    ASSERT_GE(dt, 0.001 * (1 - 1e-4));
    ASSERT_LE(dt, 0.1 * (1 + 1e-4));
    sum_log += std::log(dt);
  }
  // log(dt) ~ Uniform(log 0.001, log 0.1): mean log 0.01, standard deviation log(100) / sqrt(12).
  EXPECT_NEAR(sum_log / v.size(), std::log(0.01),
              5 * std::log(100.0) / std::sqrt(12.0) / std::sqrt(double(v.size())));
  // Known point: inv_softplus(0.01) = 0.01 + log(-expm1(-0.01)) = -4.600166...
  EXPECT_NEAR(0.01 + std::log(-std::expm1(-0.01)), -4.6001660, 1e-6);
  EXPECT_LT(*std::max_element(v.begin(), v.end()), -2.25f);  // inv_softplus(0.1) = -2.252
}

}  // namespace
}  // namespace sdm
