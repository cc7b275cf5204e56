// The CUDA SDM gate kernel (cuda::SdmGates) against the same shared math on the CPU. Skips
// without a device (and on builds without CUDA).
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/common/sdm_math.h"
#include "kernels/cuda/cuda_runtime_info.h"
#if defined(SDM_HAVE_CUDA)
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#endif

namespace sdm::kernels {
namespace {

TEST(SdmMathTest, GatesMatchTheirDefinitions) {
  // Shared host/device helpers, checked on the CPU against the formulas of docs/model-spec.md §5.1.
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
  for (const uint32_t seed : {3u, std::random_device{}()}) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    const int64_t rows = 1000, heads = 4, n = rows * heads;
    // a spans softplus's linear region (a + dt_bias > 20) and its deep negative tail.
    std::vector<float> a(n), b(n), a_log(heads), dt(heads);
    for (float& x : a) x = 8 * normal(rng);
    for (float& x : b) x = 8 * normal(rng);
    for (float& x : a_log) x = normal(rng);
    for (float& x : dt) x = normal(rng);
    a[0] = 25.0f;
    a[1] = -40.0f;

    cuda::CudaStream stream;
    ASSERT_EQ(stream.Create(), cudaSuccess);
    cuda::DeviceBuffer<float> d_a(n), d_b(n), d_log(heads), d_dt(heads), d_g(n), d_beta(n);
    ASSERT_TRUE(d_a.ok() && d_b.ok() && d_log.ok() && d_dt.ok() && d_g.ok() && d_beta.ok());
    ASSERT_EQ(cudaMemcpy(d_a.get(), a.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_b.get(), b.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_log.get(), a_log.data(), heads * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_dt.get(), dt.data(), heads * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cuda::SdmGates(d_a.get(), d_b.get(), heads, d_log.get(), d_dt.get(), rows, heads,
                             d_g.get(), d_beta.get(), stream.get()),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream.get()), cudaSuccess);
    std::vector<float> log_decay(n), beta(n);
    ASSERT_EQ(cudaMemcpy(log_decay.data(), d_g.get(), n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(beta.data(), d_beta.get(), n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int64_t i = 0; i < n; ++i) {
      // Same helpers on both sides; device expf / log1pf are within 2 ulp of glibc's, and the
      // chain exp(A_log) * log1p(exp(.)) compounds a few of those: 2e-6 relative. Sigmoid:
      // expf, one addition and one division, 1e-6 relative. The floor covers results that
      // underflow to subnormals (a or b far below zero), where relative precision is lost.
      const float want_g = SdmLogDecay(a_log[i % heads], a[i], dt[i % heads]);
      const float want_beta = Sigmoid(b[i]);
      ASSERT_NEAR(log_decay[i], want_g, 2e-6f * std::fabs(want_g) + 1e-37f) << i;
      ASSERT_NEAR(beta[i], want_beta, 1e-6f * want_beta + 1e-37f) << i;
    }
  }
#endif
}

}  // namespace
}  // namespace sdm::kernels
