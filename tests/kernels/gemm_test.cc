#include "kernels/cpu/gemm.h"

#include <random>
#include <vector>

#include "gtest/gtest.h"
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
    EXPECT_EQ(2 * half.bytes(), full.bytes());
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
