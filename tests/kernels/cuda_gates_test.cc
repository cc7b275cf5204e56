// The CUDA SDM gate kernel against the same shared math on the CPU. Skips without a device (and
// on builds without CUDA).
#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/common/sdm_math.h"
#include "kernels/cuda/cuda_runtime_info.h"
#if defined(SDM_HAVE_CUDA)
#include "kernels/cuda/sdm_gates.h"
#endif

namespace sdm::kernels {
namespace {

TEST(SdmMathTest, GatesMatchTheirDefinitions) {
  // Shared host/device helpers, checked on the CPU against the formulas of design brief §2.
  EXPECT_FLOAT_EQ(Softplus(0.0f), std::log(2.0f));
  EXPECT_FLOAT_EQ(Softplus(30.0f), 30.0f);  // torch's threshold: identity above 20
  EXPECT_NEAR(Softplus(-5.0f), std::log1p(std::exp(-5.0)), 1e-7);
  EXPECT_FLOAT_EQ(Sigmoid(0.0f), 0.5f);
  EXPECT_NEAR(SdmLogDecay(std::log(2.0f), 0.5f, -0.5f), -2.0 * std::log(2.0), 1e-6);
  EXPECT_FLOAT_EQ(SdmSharedResidual(2.0f, 0.5f, 3.5f), 3.75f);  // two-slot example, slot 0
  EXPECT_FLOAT_EQ(SdmSlotResidual(2.0f, 0.5f, 0.5f, 10.0f), 4.0f);
  EXPECT_NEAR(Silu(1.0f), 1.0f / (1.0f + std::exp(-1.0f)), 1e-7);
}

TEST(CudaGatesTest, MatchesCpu) {
  if (cuda::DeviceCount() == 0) {
    GTEST_SKIP() << "no CUDA device (" << cuda::DescribeDevice() << ")";
  }
#if defined(SDM_HAVE_CUDA)
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  const int64_t rows = 1000, heads = 4;
  std::vector<float> a(rows * heads), b(rows * heads), a_log(heads), dt(heads);
  for (float& x : a) x = 3 * normal(rng);
  for (float& x : b) x = 3 * normal(rng);
  for (float& x : a_log) x = normal(rng);
  for (float& x : dt) x = normal(rng);
  std::vector<float> alpha(rows * heads), beta(rows * heads);
  ASSERT_TRUE(cuda::SdmGatesOnDevice(a.data(), b.data(), a_log.data(), dt.data(), rows, heads,
                                     alpha.data(), beta.data()));
  for (int64_t i = 0; i < rows * heads; ++i) {
    const float want_alpha = std::exp(SdmLogDecay(a_log[i % heads], a[i], dt[i % heads]));
    EXPECT_NEAR(alpha[i], want_alpha, 1e-5f * (1 + want_alpha));
    EXPECT_NEAR(beta[i], Sigmoid(b[i]), 1e-6f);
  }
#endif
}

}  // namespace
}  // namespace sdm::kernels
