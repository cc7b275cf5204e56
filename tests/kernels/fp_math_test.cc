// kernels/common/fp_math.h: each helper is the correctly rounded IEEE binary32 operation the
// CUDA kernels compute with their explicit-rounding intrinsics, whatever the host compiler may
// contract. This file is compiled with -ffp-contract=fast on an FMA-capable -march
// (tests/CMakeLists.txt), the setting under which a plain a * b + c becomes one fused
// multiply-add, and every case below uses inputs on which the fused and the separately rounded
// results differ, so a helper that let the compiler fuse would fail here.
//
// References are computed in double and rounded to float once per operation: for +, -, *, / and
// sqrt of binary32 operands, rounding the double result again to binary32 gives the correctly
// rounded binary32 result (53 >= 2 * 24 + 2), so each reference is exactly the IEEE operation.
#include "kernels/common/fp_math.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/common/sdm_math.h"
#include "kernels/cpu/norm.h"

namespace sdm::kernels {
namespace {

// Each result goes through a volatile: under this file's flags the compiler would otherwise turn
// (float)((double)a * b) into a float multiply (exact: the double product is exact) and fuse it
// into the next float addition, contracting the reference itself.
float Round(double x) {
  volatile float r = static_cast<float>(x);
  return r;
}
float RefMul(float a, float b) { return Round(static_cast<double>(a) * b); }
float RefAdd(float a, float b) { return Round(static_cast<double>(a) + b); }
float RefSub(float a, float b) { return Round(static_cast<double>(a) - b); }
float RefDiv(float a, float b) { return Round(static_cast<double>(a) / b); }
float RefSqrt(float a) { return Round(std::sqrt(static_cast<double>(a))); }

// Bits, so that -0 and +0 (and NaN payloads) are told apart.
uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

struct Triple {
  float a, b, c;
};

// `count` triples on which fma(a, b, c) and the separately rounded a * b + c differ (about one
// random triple in three with these magnitudes).
std::vector<Triple> ContractionSensitive(int count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<Triple> out;
  while (static_cast<int>(out.size()) < count) {
    const Triple t{normal(rng), normal(rng), normal(rng)};
    if (Bits(std::fma(t.a, t.b, t.c)) != Bits(RefAdd(RefMul(t.a, t.b), t.c))) out.push_back(t);
  }
  return out;
}

TEST(FpMathTest, MultiplyThenAddIsRoundedTwiceWhereAFusedMultiplyAddWouldNotBe) {
  const std::vector<Triple> cases = ContractionSensitive(2000, 1);
  int plain_fused = 0;
  for (const Triple& t : cases) {
    const float separate = RefAdd(RefMul(t.a, t.b), t.c);
    ASSERT_EQ(Bits(AddRn(MulRn(t.a, t.b), t.c)), Bits(separate)) << t.a << " " << t.b << " " << t.c;
    ASSERT_EQ(Bits(AddRn(t.c, MulRn(t.a, t.b))), Bits(separate));
    ASSERT_EQ(Bits(SubRn(MulRn(t.a, t.b), -t.c)), Bits(separate));
    // The fused form is explicit and rounds once.
    ASSERT_EQ(Bits(FmaRn(t.a, t.b, t.c)), Bits(std::fma(t.a, t.b, t.c)));
    ASSERT_NE(Bits(FmaRn(t.a, t.b, t.c)), Bits(separate));
    // What this file's flags do to a plain expression (not asserted: the compiler's choice).
    const float plain = t.a * t.b + t.c;
    plain_fused += Bits(plain) == Bits(std::fma(t.a, t.b, t.c)) ? 1 : 0;
  }
  // Shows that the cases are sensitive under these flags: with -ffp-contract=fast on x86-64-v3
  // GCC fuses the plain expression in every case.
  RecordProperty("plain_expression_fused", plain_fused);
  std::printf("plain a * b + c fused by the compiler in %d of %zu contraction-sensitive cases\n",
              plain_fused, cases.size());
}

TEST(FpMathTest, EachHelperIsTheCorrectlyRoundedOperation) {
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> exponent(-20.0f, 20.0f);
  for (int i = 0; i < 20000; ++i) {
    const float a = normal(rng) * std::exp2(exponent(rng));
    const float b = normal(rng) * std::exp2(exponent(rng));
    ASSERT_EQ(Bits(AddRn(a, b)), Bits(RefAdd(a, b))) << a << " " << b;
    ASSERT_EQ(Bits(SubRn(a, b)), Bits(RefSub(a, b))) << a << " " << b;
    ASSERT_EQ(Bits(MulRn(a, b)), Bits(RefMul(a, b))) << a << " " << b;
    ASSERT_EQ(Bits(DivRn(a, b)), Bits(RefDiv(a, b))) << a << " " << b;
    ASSERT_EQ(Bits(SqrtRn(std::fabs(a))), Bits(RefSqrt(std::fabs(a)))) << a;
  }
}

// The eval-mode BatchNorm value: four rounded operations, then one fused multiply-add, on inputs
// where fusing or not fusing the last step changes the result (a backend computing it either
// other way fails); the CPU kernel returns the helper's value for every element.
TEST(FpMathTest, BatchNormEvalValueIsTheExplicitFormula) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  constexpr float kEps = 1e-5f;
  constexpr int kN = 4096;
  std::vector<float> x, mean, var, w, b, want;
  while (static_cast<int>(x.size()) < kN) {
    const float xi = 3.0f * normal(rng), mi = normal(rng), wi = 1.0f + 0.3f * normal(rng);
    const float vi = normal(rng) * normal(rng) + 0.1f, bi = 0.5f * normal(rng);
    const float q = RefDiv(RefSub(xi, mi), RefSqrt(RefAdd(vi, kEps)));
    const float fused = std::fma(q, wi, bi);
    if (Bits(fused) == Bits(RefAdd(RefMul(q, wi), bi))) continue;  // insensitive: skip
    x.push_back(xi);
    mean.push_back(mi);
    var.push_back(vi);
    w.push_back(wi);
    b.push_back(bi);
    want.push_back(fused);
  }
  for (int i = 0; i < kN; ++i) {
    ASSERT_EQ(Bits(BatchNormEvalValue(x[i], mean[i], var[i], w[i], b[i], kEps)), Bits(want[i]))
        << i;
  }
  // cpu::BatchNormEval over one row of kN features (per-feature statistics) gives the same bits.
  std::vector<float> row = x;
  cpu::BatchNormEval(row.data(), w.data(), b.data(), mean.data(), var.data(), 1, kN, kEps);
  for (int i = 0; i < kN; ++i) ASSERT_EQ(Bits(row[i]), Bits(want[i])) << i;
}

// The SDM update rules in the GPU kernels' form (kernels/common/sdm_math.h): shared residual
// fma(alpha, m, k * delta) with the product k * delta rounded; slot residual with the decay, the
// gate product and the difference each rounded and one fused multiply-add. Inputs are kept only
// where the other ways a compiler could fuse (or not fuse) the same expression give other bits,
// so the test pins which of them the helpers compute.
TEST(FpMathTest, SdmUpdateRulesRoundAsWritten) {
  std::mt19937 rng(4);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> unit(0.05f, 0.99f);
  int shared = 0, slot = 0;
  for (int n = 0; n < 200000 && (shared < 2000 || slot < 2000); ++n) {
    const float alpha = unit(rng), m = normal(rng), k = unit(rng), beta = unit(rng);
    const float delta = normal(rng), v = normal(rng);
    const float want_shared = std::fma(alpha, m, RefMul(k, delta));
    const float other_shared = std::fma(k, delta, RefMul(alpha, m));
    const float unfused_shared = RefAdd(RefMul(alpha, m), RefMul(k, delta));
    if (Bits(want_shared) != Bits(other_shared) && Bits(want_shared) != Bits(unfused_shared)) {
      ASSERT_EQ(Bits(SdmSharedResidualRn(alpha, m, k, delta)), Bits(want_shared)) << n;
      ++shared;
    }
    const float decayed = RefMul(alpha, m), gate = RefMul(beta, k);
    const float diff = RefSub(v, decayed);
    const float want_slot = std::fma(gate, diff, decayed);
    const float unfused_slot = RefAdd(decayed, RefMul(gate, diff));
    if (Bits(want_slot) != Bits(unfused_slot)) {
      ASSERT_EQ(Bits(SdmSlotResidualRn(alpha, m, k, beta, v)), Bits(want_slot)) << n;
      ++slot;
    }
  }
  EXPECT_GE(shared, 2000);
  EXPECT_GE(slot, 2000);
}

}  // namespace
}  // namespace sdm::kernels
