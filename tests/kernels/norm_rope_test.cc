#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/common/rope_math.h"
#include "kernels/cpu/norm.h"
#include "kernels/cpu/rope.h"

namespace sdm::kernels::cpu {
namespace {

TEST(RmsNormTest, MatchesDefinition) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  const int64_t n = 37;
  std::vector<float> x(2 * n), w(n), out(2 * n);
  for (float& v : x) v = normal(rng);
  for (float& v : w) v = 1.0f + 0.1f * normal(rng);
  RmsNorm(x.data(), w.data(), 2, n, 1e-5f, out.data());
  for (int r = 0; r < 2; ++r) {
    double ss = 0;
    for (int i = 0; i < n; ++i) ss += x[r * n + i] * x[r * n + i];
    const double inv = 1.0 / std::sqrt(ss / n + 1e-5);
    for (int i = 0; i < n; ++i) EXPECT_NEAR(out[r * n + i], x[r * n + i] * inv * w[i], 1e-5);
  }
}

TEST(LayerNormTest, ZeroMeanUnitVariance) {
  std::vector<float> x = {1, 2, 3, 4, 10, 10, 10, 14}, w(4, 1.0f), b(4, 0.5f);
  LayerNorm(x.data(), w.data(), b.data(), 2, 4, 1e-6f);
  double mean = 0, var = 0;
  for (int i = 0; i < 4; ++i) mean += x[i] - 0.5;
  for (int i = 0; i < 4; ++i) var += (x[i] - 0.5) * (x[i] - 0.5);
  EXPECT_NEAR(mean, 0.0, 1e-5);
  EXPECT_NEAR(var / 4, 1.0, 1e-4);
  EXPECT_NEAR(x[7], 0.5 + 3.0 / std::sqrt(3.0), 1e-4);  // mean 11, var 3
}

TEST(BatchNormTest, EvalMode) {
  std::vector<float> x = {3.0f, -1.0f}, w = {2.0f, 1.0f}, b = {1.0f, 0.0f}, m = {1.0f, 0.0f},
                     v = {4.0f, 1.0f};
  BatchNormEval(x.data(), w.data(), b.data(), m.data(), v.data(), 1, 2, 0.0f);
  EXPECT_FLOAT_EQ(x[0], (3.0f - 1.0f) / 2.0f * 2.0f + 1.0f);
  EXPECT_FLOAT_EQ(x[1], -1.0f);
}

TEST(RopeTest, RotatesAdjacentPairs) {
  // head_dim 4: pair 0 (dims 0,1) at frequency 1, pair 1 (dims 2,3) at theta^(-1/2).
  const float theta = 10000.0f;
  const int64_t pos = 3;
  std::vector<float> x = {1, 0, 1, 0, /*head 2*/ 0, 1, 0, 2};
  ApplyRope(x.data(), 2, 4, pos, theta);
  const float f1 = 1.0f / std::pow(theta, 0.5f);
  EXPECT_NEAR(x[0], std::cos(3.0f), 1e-6);
  EXPECT_NEAR(x[1], std::sin(3.0f), 1e-6);
  EXPECT_NEAR(x[2], std::cos(3.0f * f1), 1e-6);
  EXPECT_NEAR(x[3], std::sin(3.0f * f1), 1e-6);
  // (0, 1) rotates to (-sin, cos); pairs rotate independently per head.
  EXPECT_NEAR(x[4], -std::sin(3.0f), 1e-6);
  EXPECT_NEAR(x[5], std::cos(3.0f), 1e-6);
  EXPECT_NEAR(x[6], -2 * std::sin(3.0f * f1), 1e-6);
  EXPECT_NEAR(x[7], 2 * std::cos(3.0f * f1), 1e-6);
}

TEST(RopeTest, PositionZeroIsIdentityAndNormsArePreserved) {
  std::mt19937 rng(8);
  std::normal_distribution<float> normal;
  std::vector<float> x(3 * 16);
  for (float& v : x) v = normal(rng);
  std::vector<float> y = x;
  ApplyRope(y.data(), 3, 16, 0, 10000.0f);
  EXPECT_EQ(x, y);
  ApplyRope(y.data(), 3, 16, 12345, 10000.0f);
  for (int p = 0; p < 3 * 8; ++p) {
    const double before = x[2 * p] * x[2 * p] + x[2 * p + 1] * x[2 * p + 1];
    const double after = y[2 * p] * y[2 * p] + y[2 * p + 1] * y[2 * p + 1];
    EXPECT_NEAR(before, after, 1e-4 * (1 + before));
  }
}

TEST(RopeTest, RelativePositionOnly) {
  // q.k after rotation depends on the position difference only.
  std::mt19937 rng(9);
  std::normal_distribution<float> normal;
  std::vector<float> q(8), k(8);
  for (float& v : q) v = normal(rng);
  for (float& v : k) v = normal(rng);
  auto dot_at = [&](int64_t pq, int64_t pk) {
    std::vector<float> a = q, b = k;
    ApplyRope(a.data(), 1, 8, pq, 10000.0f);
    ApplyRope(b.data(), 1, 8, pk, 10000.0f);
    double d = 0;
    for (int i = 0; i < 8; ++i) d += a[i] * b[i];
    return d;
  };
  EXPECT_NEAR(dot_at(10, 7), dot_at(103, 100), 1e-4);
}

// The SDM_HOST_DEVICE helpers of kernels/common/rope_math.h, shared with the CUDA ApplyRope.
TEST(RopeMathTest, InverseFrequencyAndAngle) {
  // theta^(-2i/head_dim): pair 0 has frequency 1, pair head_dim/4 has theta^(-1/2).
  EXPECT_EQ(RopeInvFreq(0, 64, 10000.0f), 1.0f);
  EXPECT_NEAR(RopeInvFreq(16, 64, 10000.0f), 0.01, 1e-8);
  EXPECT_NEAR(RopeInvFreq(31, 64, 500000.0f), std::pow(500000.0, -62.0 / 64.0), 1e-12);
  // The angle is the fp32 product of the position and the frequency, exact for integer
  // positions when the frequency is 1.
  EXPECT_EQ(RopeAngle(123456, 1.0f), 123456.0f);
  const float f = RopeInvFreq(5, 128, 10000.0f);
  EXPECT_EQ(RopeAngle(777, f), 777.0f * f);
}

TEST(RopeMathTest, PairRotationMatchesCosSinAndPreservesNorm) {
  std::mt19937 rng(21);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> angle_dist(-100.0f, 100.0f);
  for (int t = 0; t < 1000; ++t) {
    const float x0 = normal(rng), x1 = normal(rng);
    const float angle = angle_dist(rng);
    const double c = std::cos(static_cast<double>(angle)), s = std::sin(static_cast<double>(angle));
    float y0 = x0, y1 = x1;
    RopeRotatePair(std::cos(angle), std::sin(angle), &y0, &y1);
    // Counter-clockwise rotation: (x0 c - x1 s, x0 s + x1 c).
    const double scale = std::fabs(x0) + std::fabs(x1);
    EXPECT_NEAR(y0, x0 * c - x1 * s, 1e-6 * scale);
    EXPECT_NEAR(y1, x0 * s + x1 * c, 1e-6 * scale);
    const double before = static_cast<double>(x0) * x0 + static_cast<double>(x1) * x1;
    const double after = static_cast<double>(y0) * y0 + static_cast<double>(y1) * y1;
    EXPECT_NEAR(after, before, 1e-6 * before);
  }
  // Quarter turn: (1, 0) -> (0, 1) -> (-1, 0).
  float a = 1.0f, b = 0.0f;
  RopeRotatePair(0.0f, 1.0f, &a, &b);
  EXPECT_EQ(a, 0.0f);
  EXPECT_EQ(b, 1.0f);
  RopeRotatePair(0.0f, 1.0f, &a, &b);
  EXPECT_EQ(a, -1.0f);
  EXPECT_EQ(b, 0.0f);
}

TEST(RopeMathTest, CpuApplyRopeIsTheHelperPerPair) {
  // cpu::ApplyRope is RopeInvFreq -> RopeAngle -> cos/sin -> RopeRotatePair for every pair of
  // every head, bit for bit (the CUDA kernel uses the same helpers).
  std::mt19937 rng(22);
  std::normal_distribution<float> normal;
  const int64_t n_heads = 3, head_dim = 16, pos = 54321;
  const float theta = 10000.0f;
  std::vector<float> x(n_heads * head_dim);
  for (float& v : x) v = normal(rng);
  std::vector<float> want = x;
  for (int64_t h = 0; h < n_heads; ++h) {
    for (int64_t i = 0; i < head_dim / 2; ++i) {
      const float angle = RopeAngle(pos, RopeInvFreq(i, head_dim, theta));
      float* p = &want[h * head_dim + 2 * i];
      RopeRotatePair(std::cos(angle), std::sin(angle), &p[0], &p[1]);
    }
  }
  ApplyRope(x.data(), n_heads, head_dim, pos, theta);
  EXPECT_EQ(x, want);
}

}  // namespace
}  // namespace sdm::kernels::cpu
