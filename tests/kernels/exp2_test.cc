// Exp2NonPositive (kernels/cpu/exp2.h): within 2 ulp of exp2 over the range the softmax uses,
// exact at integers, 0 far below, NaN and -inf taken as -127; and the 8-lane form gives the
// scalar form's bits on every input (a sweep, the edges of the rounding and of the exponent
// range, random values with a fixed and a fresh seed). Built with the kernels' -march so that
// the AVX2 form exists here.
#include "kernels/cpu/exp2.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace sdm::kernels::cpu {
namespace {

uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

// Ulps between two positive floats.
int64_t UlpDistance(float a, float b) {
  return std::abs(static_cast<int64_t>(Bits(a)) - static_cast<int64_t>(Bits(b)));
}

TEST(Exp2Test, WithinTwoUlpOfExp2) {
  int64_t worst = 0;
  float worst_x = 0;
  for (float x = 0.0f; x >= -126.0f; x -= 0.000731f) {
    const float want = static_cast<float>(std::exp2(static_cast<double>(x)));
    const int64_t d = UlpDistance(Exp2NonPositive(x), want);
    if (d > worst) {
      worst = d;
      worst_x = x;
    }
  }
  EXPECT_LE(worst, 2) << "at x = " << worst_x;
}

TEST(Exp2Test, ExactAtIntegersAndZeroFarBelow) {
  for (int n = 0; n >= -126; --n) {
    EXPECT_EQ(Exp2NonPositive(static_cast<float>(n)), std::ldexp(1.0f, n)) << n;
  }
  EXPECT_EQ(Exp2NonPositive(-126.6f), 0.0f);
  EXPECT_EQ(Exp2NonPositive(-127.0f), 0.0f);
  EXPECT_EQ(Exp2NonPositive(-1e30f), 0.0f);
  EXPECT_EQ(Exp2NonPositive(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(Exp2NonPositive(std::numeric_limits<float>::quiet_NaN()), 0.0f);
  EXPECT_EQ(Exp2NonPositive(-0.0f), 1.0f);
}

#if defined(__AVX2__) && defined(__FMA__)
void ExpectLanesMatchScalar(const std::vector<float>& xs) {
  for (size_t i = 0; i + 8 <= xs.size(); i += 8) {
    float out[8];
    _mm256_storeu_ps(out, Exp2NonPositive8(_mm256_loadu_ps(&xs[i])));
    for (int l = 0; l < 8; ++l) {
      ASSERT_EQ(Bits(out[l]), Bits(Exp2NonPositive(xs[i + l]))) << "x = " << xs[i + l];
    }
  }
}

TEST(Exp2Test, EightLanesGiveTheScalarBits) {
  std::vector<float> xs;
  for (float x = 0.0f; x >= -130.0f; x -= 0.0137f) xs.push_back(x);
  // Rounding ties and their neighbours, the exponent range's edges, specials.
  for (int n = 0; n >= -128; --n) {
    const float half = static_cast<float>(n) - 0.5f;
    xs.insert(xs.end(), {half, std::nextafter(half, 0.0f), std::nextafter(half, -200.0f),
                         static_cast<float>(n), std::nextafter(static_cast<float>(n), 0.0f)});
  }
  xs.insert(xs.end(), {-0.0f, -1e-30f, -1e30f, -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN(), -126.5f, -126.4999f});
  for (uint32_t seed : {7u, static_cast<uint32_t>(std::random_device{}())}) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-140.0f, 0.0f);
    for (int i = 0; i < 100000; ++i) xs.push_back(u(rng));
  }
  while (xs.size() % 8 != 0) xs.push_back(0.0f);
  ExpectLanesMatchScalar(xs);
}
#endif

}  // namespace
}  // namespace sdm::kernels::cpu
