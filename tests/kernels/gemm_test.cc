#include "kernels/cpu/gemm.h"

#include <bit>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/gemm_isa.h"
#include "kernels/cpu/linear.h"

namespace sdm::kernels::cpu {
namespace {

struct Shape {
  int64_t m, n, k;
};

// Every element equals the in-order fma reduction bit for bit: the result of a row cannot depend
// on the batch it is computed in, the blocking or the threads.
TEST(LinearInvariantTest, EveryElementIsTheInOrderReduction) {
  std::mt19937 rng(21);
  std::normal_distribution<float> normal;
  ThreadPool pool(3);
  for (Shape s : {Shape{1, 1, 1}, Shape{1, 16, 8}, Shape{5, 17, 3}, Shape{6, 32, 256},
                  Shape{7, 33, 257}, Shape{13, 70, 600}, Shape{32, 48, 1024}}) {
    std::vector<float> x(s.m * s.k), w(s.n * s.k), bias(s.n), y(s.m * s.n), y1(s.m * s.n);
    for (float& v : x) v = normal(rng);
    for (float& v : w) v = normal(rng);
    for (float& v : bias) v = normal(rng);
    PackedMatrix packed(w.data(), s.n, s.k);
    LinearInvariant(x.data(), s.m, packed, bias.data(), y.data(), &pool);
    LinearInvariant(x.data(), s.m, packed, bias.data(), y1.data(), nullptr);
    for (int64_t i = 0; i < s.m; ++i) {
      for (int64_t j = 0; j < s.n; ++j) {
        const float want = DotInOrder(&x[i * s.k], &w[j * s.k], s.k) + bias[j];
        ASSERT_EQ(y[i * s.n + j], want)
            << s.m << "x" << s.n << "x" << s.k << " at " << i << "," << j;
        ASSERT_EQ(y1[i * s.n + j], want);
      }
    }
    // And a row computed alone equals the same row inside the batch.
    std::vector<float> alone(s.n);
    LinearInvariant(&x[(s.m - 1) * s.k], 1, packed, bias.data(), alone.data(), &pool);
    EXPECT_EQ(alone, std::vector<float>(y.end() - s.n, y.end()));
  }
}

// bf16 panels: every element is the fp32 kernel's result on the weights rounded to bf16, bit for
// bit (so the same in-order reduction, batch-invariant the same way), from half the bytes.
TEST(LinearInvariantTest, Bf16PanelsAreTheFp32KernelOnRoundedWeights) {
  std::mt19937 rng(23);
  std::normal_distribution<float> normal;
  ThreadPool pool(3);
  for (Shape s : {Shape{1, 1, 1}, Shape{1, 16, 8}, Shape{5, 17, 3}, Shape{6, 32, 256},
                  Shape{7, 33, 257}, Shape{13, 70, 600}}) {
    SCOPED_TRACE(::testing::Message() << s.m << "x" << s.n << "x" << s.k);
    std::vector<float> x(s.m * s.k), w(s.n * s.k), rounded(s.n * s.k), bias(s.n);
    for (float& v : x) v = normal(rng);
    for (float& v : w) v = normal(rng);
    for (float& v : bias) v = normal(rng);
    for (size_t i = 0; i < w.size(); ++i) rounded[i] = RoundToBf16(w[i]);
    const PackedMatrix half(w.data(), s.n, s.k, DType::kBf16);
    const PackedMatrix full(rounded.data(), s.n, s.k);
    EXPECT_EQ(half.type(), DType::kBf16);
    // Half the bytes, plus a zero half-pair per panel row of 16 when k is odd.
    EXPECT_EQ(2 * half.bytes(), full.bytes() + (s.k % 2) * full.panels() * 16 * 4);
    std::vector<float> y(s.m * s.n), y1(s.m * s.n), want(s.m * s.n);
    LinearInvariant(x.data(), s.m, half, bias.data(), y.data(), &pool);
    LinearInvariant(x.data(), s.m, half, bias.data(), y1.data(), nullptr);
    LinearInvariant(x.data(), s.m, full, bias.data(), want.data(), nullptr);
    EXPECT_EQ(y, want);
    EXPECT_EQ(y1, want);
    for (int64_t i = 0; i < s.m; ++i) {
      for (int64_t j = 0; j < s.n; ++j) {
        ASSERT_EQ(y[i * s.n + j], DotInOrder(&x[i * s.k], &rounded[j * s.k], s.k) + bias[j]);
      }
    }
    std::vector<float> alone(s.n);
    LinearInvariant(&x[(s.m - 1) * s.k], 1, half, bias.data(), alone.data(), &pool);
    EXPECT_EQ(alone, std::vector<float>(y.end() - s.n, y.end()));
  }
  // Rounding is real: weights that bf16 cannot hold give another product.
  const float w[16] = {1.0f + 1.0f / 1024};  // 1 + 2^-10 needs 10 mantissa bits; bf16 keeps 7
  const float x = 1.0f;
  float y16 = 0, y32 = 0;
  LinearInvariant(&x, 1, PackedMatrix(w, 1, 1, DType::kBf16), nullptr, &y16, nullptr);
  LinearInvariant(&x, 1, PackedMatrix(w, 1, 1), nullptr, &y32, nullptr);
  EXPECT_EQ(y32, 1.0f + 1.0f / 1024);
  EXPECT_EQ(y16, 1.0f);
}

// Every instruction set's micro-kernels (generic, AVX2, AVX-512: those this build and CPU have)
// compute DotInOrder bit for bit, for fp32 and bf16 panels, whatever the shape: n not a multiple of
// a panel (16) or of a 3- or 4-panel tile (48, 64), odd k (a bf16 pair half empty), every row count
// of a tile (up to AVX-512's 8-row tiles) and several tiles of rows, with threads or without. Fixed
// seeds plus a fresh one (printed).
TEST(LinearInvariantTest, EveryInstructionSetIsTheInOrderReduction) {
  const std::vector<GemmIsa> isas = AvailableGemmIsas();
  std::cout << "available:";
  for (GemmIsa isa : isas) std::cout << " " << GemmIsaName(isa);
  std::cout << "; active: " << GemmIsaName() << "\n";
  ASSERT_EQ(isas.front(), GemmIsa::kGeneric);
  std::vector<uint32_t> seeds = {1, 2, 3};
  seeds.push_back(std::random_device{}());
  std::cout << "fresh seed " << seeds.back() << "\n";
  ThreadPool pool(3);
  const std::vector<Shape> shapes = {{1, 1, 1},     {1, 16, 8},   {2, 17, 3},    {3, 64, 2},
                                     {4, 65, 5},    {5, 100, 31}, {6, 48, 257},  {7, 33, 256},
                                     {8, 130, 300}, {9, 80, 513}, {13, 70, 600}, {32, 200, 129},
                                     {8, 16, 1},    {7, 250, 33}, {8, 49, 2}};
  for (uint32_t seed : seeds) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    for (DType type : {DType::kF32, DType::kBf16}) {
      for (Shape s : shapes) {
        SCOPED_TRACE(::testing::Message()
                     << "seed " << seed << " " << (type == DType::kBf16 ? "bf16" : "fp32") << " "
                     << s.m << "x" << s.n << "x" << s.k);
        std::vector<float> x(s.m * s.k), w(s.n * s.k), bias(s.n);
        for (float& v : x) v = normal(rng);
        for (float& v : w) v = normal(rng);
        for (float& v : bias) v = normal(rng);
        // Exact zeros and signed zeros on both sides, where a stray fma would show.
        x[rng() % x.size()] = -0.0f;
        w[rng() % w.size()] = 0.0f;
        const PackedMatrix packed(w.data(), s.n, s.k, type);
        if (type == DType::kBf16) {
          for (float& v : w) v = RoundToBf16(v);
        }
        std::vector<uint32_t> want(s.m * s.n);
        for (int64_t i = 0; i < s.m; ++i) {
          for (int64_t j = 0; j < s.n; ++j) {
            want[i * s.n + j] =
                std::bit_cast<uint32_t>(DotInOrder(&x[i * s.k], &w[j * s.k], s.k) + bias[j]);
          }
        }
        for (GemmIsa isa : isas) {
          for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
            std::vector<float> y(s.m * s.n, std::nanf(""));
            LinearInvariantWith(isa, x.data(), s.m, packed, bias.data(), y.data(), p);
            for (int64_t e = 0; e < s.m * s.n; ++e) {
              ASSERT_EQ(std::bit_cast<uint32_t>(y[e]), want[e])
                  << GemmIsaName(isa) << (p ? " threads" : "") << " at " << e / s.n << ","
                  << e % s.n << ": " << y[e] << " != " << std::bit_cast<float>(want[e]);
            }
          }
        }
      }
    }
  }
}

// SDM_CPU_ISA picks the active instruction set (ctest reruns this binary with avx2 and generic).
TEST(GemmIsaTest, TheEnvironmentChoosesTheActiveInstructionSet) {
  const char* env = std::getenv("SDM_CPU_ISA");
  const std::optional<GemmIsa> asked = env == nullptr ? std::nullopt : ParseGemmIsa(env);
  EXPECT_EQ(ActiveGemmIsa(), BestGemmIsa(asked.value_or(GemmIsa::kAvx512)));
  EXPECT_TRUE(GemmIsaAvailable(ActiveGemmIsa()));
  EXPECT_STREQ(GemmIsaName(), GemmIsaName(ActiveGemmIsa()));
  for (GemmIsa isa : {GemmIsa::kGeneric, GemmIsa::kAvx2, GemmIsa::kAvx512}) {
    EXPECT_EQ(ParseGemmIsa(GemmIsaName(isa)), isa);
    EXPECT_LE(BestGemmIsa(isa), isa);
  }
  EXPECT_EQ(BestGemmIsa(GemmIsa::kGeneric), GemmIsa::kGeneric);
  EXPECT_FALSE(ParseGemmIsa("sse2").has_value());
#if defined(SDM_GEMM_BUILT_AVX512)
  // On a CPU with AVX-512 a build with the AVX-512 kernels must use them.
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    EXPECT_TRUE(GemmIsaAvailable(GemmIsa::kAvx512));
    if (env == nullptr) {
      EXPECT_EQ(ActiveGemmIsa(), GemmIsa::kAvx512);
    }
  }
#endif
}

TEST(LinearInvariantTest, AgreesWithOpenBlasUpToRounding) {
  std::mt19937 rng(22);
  std::normal_distribution<float> normal;
  const int64_t m = 9, n = 40, k = 300;
  std::vector<float> x(m * k), w(n * k), y(m * n), ref(m * n);
  for (float& v : x) v = normal(rng);
  for (float& v : w) v = normal(rng);
  LinearInvariant(x.data(), m, PackedMatrix(w.data(), n, k), nullptr, y.data(), nullptr);
  Linear(x.data(), m, k, w.data(), n, nullptr, ref.data());
  for (int64_t i = 0; i < m * n; ++i) EXPECT_NEAR(y[i], ref[i], 1e-3);
}

}  // namespace
}  // namespace sdm::kernels::cpu
