// BlasLtGemm::Linear (kernels/cuda/gemm.h) against a double-precision reference on bf16-rounded
// inputs: y = x W^T (+ bias), x [m, k], W [n, k] (PyTorch Linear layout). Skips without a device
// (and on builds without CUDA).
//
// Tolerance. Products of two bf16 values (8-bit significands) are exact in fp32, so the only
// error is the fp32 accumulation (and the bias addition): for any summation order that is at
// most (k + 1) * u * (sum_i |x_i w_i| + |bias|) with u = 2^-24. We allow twice that, in case the
// tensor cores round their partial sums by truncation. A layout mistake (a transposed or
// mis-strided operand) is off by O(sum |x w| / sqrt(k)), far outside. With small integer inputs
// every partial sum is an integer below 2^24, so there the result must be exact in any order.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_runtime_info.h"
#if defined(SDM_HAVE_CUDA)
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/gemm.h"
#endif

namespace sdm::kernels {
namespace {

class CudaGemmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0) {
      GTEST_SKIP() << "no CUDA device (" << cuda::DescribeDevice() << ")";
    }
#if defined(SDM_HAVE_CUDA)
    ASSERT_EQ(stream_.Create(), cudaSuccess);
    ASSERT_TRUE(gemm_.Init()) << gemm_.error();
#endif
  }

#if defined(SDM_HAVE_CUDA)
  cuda::CudaStream stream_;
  cuda::BlasLtGemm gemm_;
#endif
};

#if defined(SDM_HAVE_CUDA)
using cuda::DeviceBuffer;

uint16_t Bf16Bits(float f) {  // round to nearest even; inputs here are finite
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float Bf16Value(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

struct Problem {
  int64_t m, n, k;
  std::vector<uint16_t> x, w;  // bf16 bits (what the device gets)
  std::vector<float> xf, wf;   // the same values widened (for the reference)
  std::vector<float> bias;
};

Problem RandomProblem(std::mt19937& rng, int64_t m, int64_t n, int64_t k, bool integers) {
  Problem p{m, n, k, {}, {}, {}, {}, {}};
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> small(-4, 4);
  auto draw = [&](float scale) {
    return integers ? static_cast<float>(small(rng)) : scale * normal(rng);
  };
  p.x.resize(m * k);
  p.w.resize(n * k);
  p.bias.resize(n);
  for (uint16_t& v : p.x) v = Bf16Bits(draw(1.0f));
  for (uint16_t& v : p.w) v = Bf16Bits(draw(1.0f / std::sqrt(static_cast<float>(k))));
  for (float& v : p.bias) v = draw(0.5f);
  for (const uint16_t v : p.x) p.xf.push_back(Bf16Value(v));
  for (const uint16_t v : p.w) p.wf.push_back(Bf16Value(v));
  return p;
}

// Runs Linear with the operands placed `offset` elements into their buffers (offset 1 makes
// every pointer misaligned for vector access) and returns y.
std::vector<float> RunLinear(cuda::BlasLtGemm& gemm, cudaStream_t stream, const Problem& p,
                             bool with_bias, int64_t offset) {
  // One spare element keeps every buffer non-empty (k = 0 has no x or w).
  DeviceBuffer<__nv_bfloat16> d_x(p.x.size() + offset + 1), d_w(p.w.size() + offset + 1);
  DeviceBuffer<float> d_b(p.bias.size() + offset + 1), d_y(p.m * p.n + offset + 1);
  auto upload = [](void* dst, const void* src, size_t bytes) {
    if (bytes > 0) {
      EXPECT_EQ(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    }
  };
  upload(d_x.get() + offset, p.x.data(), p.x.size() * 2);
  upload(d_w.get() + offset, p.w.data(), p.w.size() * 2);
  upload(d_b.get() + offset, p.bias.data(), p.bias.size() * 4);
  // Poison y: Linear must overwrite every element (beta = 0).
  EXPECT_EQ(cudaMemset(d_y.get(), 0x7f, d_y.bytes()), cudaSuccess);
  EXPECT_TRUE(gemm.Linear(d_x.get() + offset, p.m, d_w.get() + offset, p.n, p.k,
                          with_bias ? d_b.get() + offset : nullptr, d_y.get() + offset, stream))
      << gemm.error();
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<float> y(p.m * p.n);
  EXPECT_EQ(cudaMemcpy(y.data(), d_y.get() + offset, y.size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
  return y;
}

// Compares y with the double reference element by element; `exact` demands equality.
void CheckAgainstReference(const Problem& p, bool with_bias, const std::vector<float>& y,
                           bool exact) {
  const double u = std::ldexp(1.0, -24);
  for (int64_t r = 0; r < p.m; ++r) {
    for (int64_t c = 0; c < p.n; ++c) {
      double sum = 0.0, magnitude = 0.0;
      for (int64_t i = 0; i < p.k; ++i) {
        const double t = static_cast<double>(p.xf[r * p.k + i]) * p.wf[c * p.k + i];
        sum += t;
        magnitude += std::fabs(t);
      }
      if (with_bias) {
        sum += p.bias[c];
        magnitude += std::fabs(p.bias[c]);
      }
      const double got = y[r * p.n + c];
      if (exact) {
        ASSERT_EQ(got, sum) << "y[" << r << ", " << c << "]";
      } else {
        const double tol = 2.0 * static_cast<double>(p.k + 1) * u * magnitude + 1e-30;
        ASSERT_NEAR(got, sum, tol) << "y[" << r << ", " << c << "]";
      }
    }
  }
}

struct Shape {
  int64_t m, n, k;
};
// Decode (m = 1) and prefill-like shapes, odd n and k (unaligned rows), n = 1.
constexpr Shape kShapes[] = {{1, 7, 5},       {1, 2048, 2048}, {3, 33, 17},     {5, 1, 9},
                             {17, 256, 1024}, {64, 1000, 513}, {128, 768, 2048}};

TEST_F(CudaGemmTest, LinearMatchesDoubleReference) {
  for (const uint32_t seed : {7u, std::random_device{}()}) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    for (const Shape& s : kShapes) {
      SCOPED_TRACE(testing::Message() << "m " << s.m << " n " << s.n << " k " << s.k);
      const Problem p = RandomProblem(rng, s.m, s.n, s.k, /*integers=*/false);
      for (const bool with_bias : {false, true}) {
        SCOPED_TRACE(with_bias ? "with bias" : "without bias");
        const std::vector<float> y = RunLinear(gemm_, stream_.get(), p, with_bias, 0);
        CheckAgainstReference(p, with_bias, y, /*exact=*/false);
        // The same problem again gives the same bits (the cached plan without a bias; with
        // one, a plan for the new bias buffer, which the heuristic answers alike).
        EXPECT_EQ(RunLinear(gemm_, stream_.get(), p, with_bias, 0), y);
      }
    }
  }
}

TEST_F(CudaGemmTest, SmallIntegersAreExact) {
  std::mt19937 rng(11);
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(testing::Message() << "m " << s.m << " n " << s.n << " k " << s.k);
    // |x w| <= 16 per term and k <= 2048: partial sums stay far below 2^24, all exact. The
    // weight scale 1/sqrt(k) is not applied for integers (RandomProblem draws -4..4).
    const Problem p = RandomProblem(rng, s.m, s.n, s.k, /*integers=*/true);
    for (const bool with_bias : {false, true}) {
      SCOPED_TRACE(with_bias ? "with bias" : "without bias");
      CheckAgainstReference(p, with_bias, RunLinear(gemm_, stream_.get(), p, with_bias, 0),
                            /*exact=*/true);
    }
  }
}

TEST_F(CudaGemmTest, MisalignedOperands) {
  // Pointers one element into their buffers (2-byte aligned bf16, 4-byte aligned fp32): the
  // algorithm is chosen for the actual alignment, not the heuristic's default of 256 bytes.
  std::mt19937 rng(13);
  for (const Shape& s : {Shape{1, 64, 128}, Shape{9, 96, 64}, Shape{4, 33, 17}}) {
    SCOPED_TRACE(testing::Message() << "m " << s.m << " n " << s.n << " k " << s.k);
    const Problem p = RandomProblem(rng, s.m, s.n, s.k, /*integers=*/true);
    for (const bool with_bias : {false, true}) {
      const std::vector<float> aligned = RunLinear(gemm_, stream_.get(), p, with_bias, 0);
      const std::vector<float> shifted = RunLinear(gemm_, stream_.get(), p, with_bias, 1);
      CheckAgainstReference(p, with_bias, shifted, /*exact=*/true);
      EXPECT_EQ(shifted, aligned);
    }
  }
}

TEST_F(CudaGemmTest, EmptySumIsTheBias) {
  std::mt19937 rng(17);
  const Problem p = RandomProblem(rng, 3, 5, 0, /*integers=*/false);
  const std::vector<float> with_bias = RunLinear(gemm_, stream_.get(), p, true, 0);
  const std::vector<float> without = RunLinear(gemm_, stream_.get(), p, false, 0);
  for (int64_t r = 0; r < 3; ++r) {
    for (int64_t c = 0; c < 5; ++c) {
      EXPECT_EQ(with_bias[r * 5 + c], p.bias[c]);
      EXPECT_EQ(without[r * 5 + c], 0.0f);
    }
  }
}

// Plan (kernels/cuda/gemm.h) enqueues nothing and caches one plan per problem; LinearPlanned
// refuses a problem without a plan (before any launch: y untouched) and runs a planned one
// exactly as Linear does.
TEST_F(CudaGemmTest, PlannedLinearRunsOnlyPlannedProblems) {
  std::mt19937 rng(19);
  const Problem p = RandomProblem(rng, 8, 96, 64, /*integers=*/true);
  DeviceBuffer<__nv_bfloat16> d_x(p.x.size()), d_w(p.w.size());
  DeviceBuffer<float> d_b(p.bias.size()), d_y(p.m * p.n);
  ASSERT_EQ(cudaMemcpy(d_x.get(), p.x.data(), p.x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_w.get(), p.w.data(), p.w.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_b.get(), p.bias.data(), p.bias.size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemset(d_y.get(), 0x7f, d_y.bytes()), cudaSuccess);
  const size_t before = gemm_.plan_count();
  EXPECT_FALSE(gemm_.LinearPlanned(d_x.get(), p.m, d_w.get(), p.n, p.k, d_b.get(), d_y.get(),
                                   stream_.get()));
  EXPECT_NE(gemm_.error().find("not planned"), std::string::npos) << gemm_.error();
  ASSERT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess);
  std::vector<float> y(p.m * p.n);
  ASSERT_EQ(cudaMemcpy(y.data(), d_y.get(), y.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (const float v : y) ASSERT_EQ(std::memcmp(&v, "\x7f\x7f\x7f\x7f", 4), 0);  // untouched

  ASSERT_TRUE(gemm_.Plan(d_x.get(), p.m, d_w.get(), p.n, p.k, d_b.get(), d_y.get()))
      << gemm_.error();
  EXPECT_EQ(gemm_.plan_count(), before + 1);
  ASSERT_TRUE(gemm_.Plan(d_x.get(), p.m, d_w.get(), p.n, p.k, d_b.get(), d_y.get()));
  EXPECT_EQ(gemm_.plan_count(), before + 1);  // cached
  ASSERT_TRUE(
      gemm_.LinearPlanned(d_x.get(), p.m, d_w.get(), p.n, p.k, d_b.get(), d_y.get(), stream_.get()))
      << gemm_.error();
  ASSERT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(y.data(), d_y.get(), y.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  CheckAgainstReference(p, /*with_bias=*/true, y, /*exact=*/true);
  EXPECT_EQ(gemm_.plan_count(), before + 1);  // ran the plan, made none
}

// Needs no device: the uninitialised object reports instead of calling cuBLASLt.
TEST(CudaGemmNoDeviceTest, LinearBeforeInitFails) {
  cuda::BlasLtGemm gemm;
  EXPECT_FALSE(gemm.Linear(nullptr, 1, nullptr, 1, 1, nullptr, nullptr, nullptr));
  EXPECT_NE(gemm.error().find("Init"), std::string::npos) << gemm.error();
  EXPECT_FALSE(gemm.Plan(nullptr, 1, nullptr, 1, 1, nullptr, nullptr));
  EXPECT_FALSE(gemm.LinearPlanned(nullptr, 1, nullptr, 1, 1, nullptr, nullptr, nullptr));
}

#else

// Keeps the suite visible (as skipped, from SetUp) in builds without CUDA.
TEST_F(CudaGemmTest, BuiltWithoutCuda) {}

#endif  // SDM_HAVE_CUDA

}  // namespace
}  // namespace sdm::kernels
