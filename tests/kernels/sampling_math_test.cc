// The per-row sampling arithmetic shared by the CPU sampler and the CUDA kernel
// (kernels/common/sampling_math.h), checked against independent naive versions of its
// definitions: the portable exp against libm, the sort key against the comparison it encodes, and
// the chunked CDF and its searches against the formula cum(j) = B2(g) + (B1(c) + p(j)).
#include "kernels/common/sampling_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace sdm::kernels {
namespace {

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// A fresh seed each run (printed), besides the fixed ones: the properties hold for all inputs.
uint32_t FreshSeed() {
  const uint32_t seed = std::random_device{}();
  std::printf("fresh seed %u\n", seed);
  return seed;
}

TEST(SampleExpTest, MatchesLibmToAFewUlp) {
  EXPECT_EQ(SampleExp(0.0), 1.0);
  EXPECT_EQ(SampleExp(-0.0), 1.0);
  EXPECT_EQ(SampleExp(-std::numeric_limits<double>::infinity()), 0.0);
  EXPECT_EQ(SampleExp(-708.5), 0.0);  // below kSampleExpMin: taken as 0
  EXPECT_GT(SampleExp(kSampleExpMin), 0.0);
  for (const uint32_t seed : {1u, FreshSeed()}) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> wide(kSampleExpMin, 0.0), narrow(-2.0, 0.0);
    for (int i = 0; i < 200000; ++i) {
      const double x = i % 2 ? wide(rng) : narrow(rng);
      const double want = std::exp(x);
      // Taylor to r^13 with |r| <= ln2/2 plus the reduction's rounding: well under 4 ulp; a wrong
      // coefficient or split of ln 2 is off by far more.
      ASSERT_NEAR(SampleExp(x), want, 4 * 0x1.0p-52 * want) << "x " << x << " seed " << seed;
    }
  }
  // Half-way points of the range reduction, where k changes.
  for (int k = -1021; k <= 0; ++k) {
    const double x = (k + 0.5) * std::log(2.0);
    if (x < kSampleExpMin) continue;
    ASSERT_NEAR(SampleExp(x), std::exp(x), 4 * 0x1.0p-52 * std::exp(x)) << "k " << k;
  }
}

TEST(SampleWeightTest, FollowsTheSamplerContract) {
  const SampleWeightParams finite{2.0f, false, 0.5};
  EXPECT_EQ(SampleWeight(2.0f, finite), 1.0);
  EXPECT_NEAR(SampleWeight(1.0f, finite), std::exp(-2.0), 1e-15);
  EXPECT_EQ(SampleWeight(kNan, finite), 0.0);
  EXPECT_EQ(SampleWeight(-kInf, finite), 0.0);
  EXPECT_EQ(SampleWeight(-1000.0f, finite), 0.0);
  const SampleWeightParams inf{kInf, true, 1.0};
  EXPECT_EQ(SampleWeight(kInf, inf), 1.0);
  EXPECT_EQ(SampleWeight(1e30f, inf), 0.0);
  EXPECT_EQ(SampleWeight(kNan, inf), 0.0);
  EXPECT_TRUE(SampleIsPosInf(kInf));
  EXPECT_FALSE(SampleIsPosInf(std::numeric_limits<float>::max()));
  EXPECT_FALSE(SampleIsPosInf(-kInf));
}

TEST(ArgmaxTest, LowestIdAmongTheLargestNonNan) {
  EXPECT_EQ(SampleArgmax(std::vector<float>{1, 3, 2}.data(), 3), 1);
  EXPECT_EQ(SampleArgmax(std::vector<float>{5, 1, 5}.data(), 3), 0);
  EXPECT_EQ(SampleArgmax(std::vector<float>{kNan, 1, 2}.data(), 3), 2);
  EXPECT_EQ(SampleArgmax(std::vector<float>{kNan, -kInf, kNan}.data(), 3), 1);
  EXPECT_EQ(SampleArgmax(std::vector<float>{kNan, kNan}.data(), 2), 0);
  EXPECT_EQ(SampleArgmax(std::vector<float>{-0.0f, 0.0f}.data(), 2), 0);
  EXPECT_EQ(SampleArgmax(std::vector<float>{0.0f, -0.0f}.data(), 2), 0);
  // Any reduction order finds the same winner: fold random permutations pairwise.
  std::mt19937 rng(3);
  std::vector<float> logits(200);
  for (float& l : logits) l = static_cast<float>(static_cast<int>(rng() % 5)) - 2;
  logits[17] = kNan;
  const int32_t want = SampleArgmax(logits.data(), 200);
  std::vector<int32_t> order(200);
  std::iota(order.begin(), order.end(), 0);
  for (int trial = 0; trial < 20; ++trial) {
    std::shuffle(order.begin(), order.end(), rng);
    int32_t best = order[0];
    for (const int32_t i : order) {
      if (ArgmaxBefore(logits[i], i, logits[best], best)) best = i;
    }
    ASSERT_EQ(best, want);
  }
}

TEST(SampleOrderKeyTest, AscendingKeysAreDescendingLogitsThenAscendingIds) {
  for (const uint32_t seed : {5u, FreshSeed()}) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 10.0f);
    std::vector<float> logits(3000);
    for (float& l : logits) {
      switch (rng() % 6) {
        case 0:
          l = static_cast<float>(static_cast<int>(rng() % 7) - 3);
          break;  // ties
        case 1:
          l = rng() % 2 ? 0.0f : -0.0f;
          break;
        case 2:
          l = rng() % 2 ? kInf : -kInf;
          break;
        case 3:
          l = std::numeric_limits<float>::denorm_min() * (rng() % 2 ? 1 : -1);
          break;
        default:
          l = normal(rng);
      }
    }
    std::vector<int32_t> by_key(logits.size()), by_compare(logits.size());
    std::iota(by_key.begin(), by_key.end(), 0);
    std::iota(by_compare.begin(), by_compare.end(), 0);
    std::sort(by_key.begin(), by_key.end(), [&](int32_t a, int32_t b) {
      return SampleOrderKey(logits[a], a) < SampleOrderKey(logits[b], b);
    });
    std::sort(by_compare.begin(), by_compare.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    ASSERT_EQ(by_key, by_compare) << "seed " << seed;
    for (const int32_t id : by_key) ASSERT_EQ(SampleOrderKeyId(SampleOrderKey(logits[id], id)), id);
  }
}

// cum(j) straight from the definition in sampling_math.h.
std::vector<double> NaiveCum(const std::vector<double>& w) {
  const int64_t n = static_cast<int64_t>(w.size());
  const int64_t group = kCdfChunk * kCdfGroupChunks;
  std::vector<double> cum(n);
  double b2 = 0;
  for (int64_t g = 0; g < n; g += group) {
    double b1 = 0;
    for (int64_t c = g; c < std::min(n, g + group); c += kCdfChunk) {
      double p = 0;
      for (int64_t j = c; j < std::min(n, c + kCdfChunk); ++j) {
        p += w[j];
        cum[j] = b2 + (b1 + p);
      }
      b1 = b1 + p;
    }
    b2 = b2 + b1;
  }
  return cum;
}

int64_t NaiveFind(const std::vector<double>& cum, double x, bool strict) {
  for (size_t j = 0; j < cum.size(); ++j) {
    if (strict ? x < cum[j] : cum[j] >= x) return static_cast<int64_t>(j);
  }
  return static_cast<int64_t>(cum.size());
}

std::vector<double> RandomWeights(int64_t n, std::mt19937_64& rng) {
  std::vector<double> w(n);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (double& x : w) {
    const uint64_t kind = rng() % 8;
    x = kind == 0 ? 0.0 : kind == 1 ? 1.0 : kind == 2 ? 1e-300 : unit(rng);
  }
  return w;
}

TEST(ChunkedCdfTest, BuildAndFindFollowTheDefinition) {
  for (const uint32_t seed : {11u, FreshSeed()}) {
    std::mt19937_64 rng(seed);
    for (const int64_t n : {1, 2, 31, 32, 33, 1023, 1024, 1025, 5000, 40000}) {
      SCOPED_TRACE(testing::Message() << "n " << n << " seed " << seed);
      const std::vector<double> w = RandomWeights(n, rng);
      const auto weight_at = [&](int64_t j) { return w[j]; };
      std::vector<double> chunk(CdfChunkCount(n)), group_end(CdfGroupCount(n));
      const double total = CdfBuild(weight_at, n, chunk.data(), group_end.data());
      const std::vector<double> cum = NaiveCum(w);
      ASSERT_EQ(total, cum.back());
      long double exact = 0;
      for (int64_t j = 0; j < n; ++j) {
        exact += w[j];
        if (j > 0) {
          ASSERT_GE(cum[j], cum[j - 1]) << j;  // monotone, the searches rely on it
        }
        ASSERT_NEAR(cum[j], static_cast<double>(exact), 1e-13 * (1 + static_cast<double>(exact)));
      }
      // Targets at, just below and just above the cumulative values (the boundaries where the
      // strict and non-strict searches differ), and random ones.
      std::vector<double> targets = {0.0, total, std::nextafter(total, 0.0), 2 * total};
      for (int i = 0; i < 300; ++i) {
        const double c = cum[rng() % n];
        targets.push_back(c);
        targets.push_back(std::nextafter(c, 0.0));
        targets.push_back(std::nextafter(c, 1e300));
        targets.push_back(std::uniform_real_distribution<double>(0, total)(rng));
      }
      for (const double x : targets) {
        for (const bool strict : {true, false}) {
          double at = -1;
          const int64_t j = CdfFind(weight_at, n, chunk.data(), group_end.data(), x, strict, &at);
          ASSERT_EQ(j, NaiveFind(cum, x, strict)) << "x " << x << " strict " << strict;
          if (j < n) {
            ASSERT_EQ(at, cum[j]);
          }
        }
      }
    }
  }
}

TEST(ChunkedCdfTest, DrawSortedIsTheNucleusThenTheInverseCdf) {
  for (const uint32_t seed : {13u, FreshSeed()}) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    for (const int64_t n : {1, 7, 100, 3000}) {
      SCOPED_TRACE(testing::Message() << "n " << n << " seed " << seed);
      std::vector<double> w(n);
      for (double& x : w) x = rng() % 4 == 0 ? 1.0 : unit(rng) + 1e-3;  // positive, with ties
      std::sort(w.rbegin(), w.rend());
      const auto weight_at = [&](int64_t j) { return w[j]; };
      std::vector<double> chunk(CdfChunkCount(n)), group_end(CdfGroupCount(n));
      const double total = CdfBuild(weight_at, n, chunk.data(), group_end.data());
      const std::vector<double> cum = NaiveCum(w);
      for (int i = 0; i < 500; ++i) {
        const double top_p = i % 5 == 0 ? 1.0 : unit(rng);
        const double u = i % 7 == 0 ? std::nextafter(1.0, 0.0) : unit(rng);
        const bool restrict_p = top_p < 1.0;
        // Naive: nucleus = first j with cum >= top_p * total; draw = first j with u * mass < cum.
        int64_t limit = n;
        double mass = total;
        if (restrict_p) {
          limit = NaiveFind(cum, top_p * total, false) + 1;
          mass = cum[limit - 1];
        }
        const int64_t found = NaiveFind(cum, u * mass, true);
        const int64_t want = found < limit ? found : limit - 1;
        ASSERT_EQ(CdfDrawSorted(weight_at, n, chunk.data(), group_end.data(), total, restrict_p,
                                top_p, u),
                  want)
            << "top_p " << top_p << " u " << u;
      }
    }
  }
}

TEST(ChunkedCdfTest, LastPositive) {
  const std::vector<double> w = {0, 1, 0, 2, 0, 0};
  const auto weight_at = [&](int64_t j) { return w[j]; };
  EXPECT_EQ(LastPositive(weight_at, 6, -1), 3);
  EXPECT_EQ(LastPositive(weight_at, 1, -1), -1);
}

}  // namespace
}  // namespace sdm::kernels
