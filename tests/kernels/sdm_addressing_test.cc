#include "kernels/cpu/sdm_addressing.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/common/sdm_addressing_math.h"

namespace sdm::kernels::cpu {
namespace {

// Exact top-k over all s^2 sums by brute force, ties toward the lower slot; sorted by slot.
void BruteForce(const std::vector<float>& scores, int64_t s, int64_t k, std::vector<int32_t>& slots,
                std::vector<float>& sums) {
  std::vector<std::pair<float, int32_t>> all;
  for (int64_t a = 0; a < s; ++a) {
    for (int64_t b = 0; b < s; ++b) {
      all.push_back({scores[a] + scores[s + b], static_cast<int32_t>(a * s + b)});
    }
  }
  std::sort(all.begin(), all.end(), [](const auto& x, const auto& y) {
    return x.first > y.first || (x.first == y.first && x.second < y.second);
  });
  all.resize(AddressCount(k, s));
  std::sort(all.begin(), all.end(),
            [](const auto& x, const auto& y) { return x.second < y.second; });
  slots.clear();
  sums.clear();
  for (const auto& [v, slot] : all) {
    slots.push_back(slot);
    sums.push_back(v);
  }
}

void ExpectMatchesBruteForce(const std::vector<float>& scores, int64_t s, int64_t k) {
  const int64_t count = AddressCount(k, s);
  std::vector<int32_t> slots(count);
  std::vector<float> sums(count);
  AddressScratch scratch;
  SelectSlots(scores.data(), s, k, slots, sums, scratch);
  std::vector<int32_t> want_slots;
  std::vector<float> want_sums;
  BruteForce(scores, s, k, want_slots, want_sums);
  ASSERT_EQ(slots, want_slots) << "s=" << s << " k=" << k;
  for (int64_t i = 0; i < count; ++i) EXPECT_EQ(sums[i], want_sums[i]);
}

TEST(SdmAddressingTest, CountIsCappedByCandidates) {
  EXPECT_EQ(AddressCount(32, 64), 32);
  EXPECT_EQ(AddressCount(8, 8), 8);
  EXPECT_EQ(AddressCount(64, 8), 64);   // k_sub = 8, 64 candidates
  EXPECT_EQ(AddressCount(100, 8), 64);  // never more than s^2
  EXPECT_EQ(AddressCount(3, 2), 3);     // k_sub = 2 -> 4 candidates
}

TEST(SdmAddressingTest, EqualsBruteForceOnRandomScores) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal;
  for (int64_t s : {2, 3, 8, 16}) {
    for (int64_t k : {1, 2, 5, 8, 17, 64, 300}) {
      for (int rep = 0; rep < 20; ++rep) {
        std::vector<float> scores(2 * s);
        for (float& x : scores) x = normal(rng);
        ExpectMatchesBruteForce(scores, s, k);
      }
    }
  }
}

TEST(SdmAddressingTest, EqualsBruteForceWithTies) {
  // Scores from a tiny set of values make many equal sums; selection must still be exact.
  std::mt19937 rng(99);
  std::uniform_int_distribution<int> pick(0, 2);
  for (int64_t s : {2, 4, 8}) {
    for (int64_t k : {1, 3, 4, 7, 16}) {
      for (int rep = 0; rep < 50; ++rep) {
        std::vector<float> scores(2 * s);
        for (float& x : scores) x = 0.5f * static_cast<float>(pick(rng));
        ExpectMatchesBruteForce(scores, s, k);
      }
    }
  }
  // All equal: the lowest slots win.
  std::vector<float> flat(2 * 4, 1.0f);
  std::vector<int32_t> slots(3);
  std::vector<float> sums(3);
  AddressScratch scratch;
  SelectSlots(flat.data(), 4, 3, slots, sums, scratch);
  EXPECT_EQ(slots, (std::vector<int32_t>{0, 1, 2}));  // pairs (0,0) (0,1) (0,2)
}

TEST(SdmAddressingTest, SlotIsAtimesSidePlusB) {
  // Half A peaks at a=2, half B at b=1: the best slot is 2*4+1 = 9.
  std::vector<float> scores = {0, 0, 5, 0, /*B*/ 0, 7, 0, 0};
  std::vector<int32_t> slots(1);
  std::vector<float> sums(1);
  AddressScratch scratch;
  SelectSlots(scores.data(), 4, 1, slots, sums, scratch);
  EXPECT_EQ(slots[0], 9);
  EXPECT_EQ(sums[0], 12.0f);
}

TEST(SdmAddressingTest, NanScoresRankLast) {
  const float nan = std::nanf("");
  std::vector<float> scores = {nan, 1.0f, nan, 2.0f};  // s = 2
  std::vector<int32_t> slots(1);
  std::vector<float> sums(1);
  AddressScratch scratch;
  SelectSlots(scores.data(), 2, 1, slots, sums, scratch);
  EXPECT_EQ(slots[0], 1 * 2 + 1);
}

TEST(SdmAddressingTest, Activations) {
  std::vector<float> v = {1.0f, 2.0f, 3.0f};
  ActivateAddress(AddressAct::kSoftmax, 2.0f, v);
  const double z = std::exp(2.0) + std::exp(4.0) + std::exp(6.0);
  EXPECT_NEAR(v[0], std::exp(2.0) / z, 1e-6);
  EXPECT_NEAR(v[2], std::exp(6.0) / z, 1e-6);
  std::vector<float> l2 = {3.0f, 4.0f};
  ActivateAddress(AddressAct::kL2Normalize, 1.0f, l2);
  EXPECT_NEAR(l2[0], 0.6f, 1e-6);
  EXPECT_NEAR(l2[1], 0.8f, 1e-6);
  std::vector<float> r = {-1.0f, 2.0f};
  ActivateAddress(AddressAct::kRelu, 1.0f, r);
  EXPECT_EQ(r[0], 0.0f);
  EXPECT_EQ(r[1], 2.0f);
  std::vector<float> sg = {0.0f};
  ActivateAddress(AddressAct::kSigmoid, 1.0f, sg);
  EXPECT_FLOAT_EQ(sg[0], 0.5f);
}

// The selection before it moved into the shared helpers (partial_sort of each half by (value
// desc, index asc), nth_element over the k_sub^2 sums by (sum desc, slot asc), sorted by slot).
// The shared radix-select version must reproduce it bit for bit, including on ties and NaN.
float LegacyKey(float v) { return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v; }
void LegacyTop(const float* values, int64_t n, int64_t k, std::vector<int32_t>& out) {
  out.resize(n);
  std::iota(out.begin(), out.end(), 0);
  std::partial_sort(out.begin(), out.begin() + k, out.end(), [values](int32_t x, int32_t y) {
    const float vx = LegacyKey(values[x]), vy = LegacyKey(values[y]);
    return vx > vy || (vx == vy && x < y);
  });
  out.resize(k);
}
void LegacySelect(const float* scores, int64_t side, int64_t k, std::vector<int32_t>& slots,
                  std::vector<float>& sums) {
  const int64_t k_sub = std::min(k, side);
  const int64_t count = AddressCount(k, side);
  std::vector<int32_t> ia, ib;
  LegacyTop(scores, side, k_sub, ia);
  LegacyTop(scores + side, side, k_sub, ib);
  std::vector<float> cs;
  std::vector<int32_t> cl;
  for (int64_t i = 0; i < k_sub; ++i) {
    for (int64_t j = 0; j < k_sub; ++j) {
      cs.push_back(scores[ia[i]] + scores[side + ib[j]]);
      cl.push_back(static_cast<int32_t>(ia[i] * side + ib[j]));
    }
  }
  std::vector<int32_t> order(cs.size());
  std::iota(order.begin(), order.end(), 0);
  auto better = [&](int32_t x, int32_t y) {
    const float vx = LegacyKey(cs[x]), vy = LegacyKey(cs[y]);
    return vx > vy || (vx == vy && cl[x] < cl[y]);
  };
  if (count < static_cast<int64_t>(order.size())) {
    std::nth_element(order.begin(), order.begin() + count, order.end(), better);
  }
  order.resize(count);
  std::sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return cl[x] < cl[y]; });
  slots.clear();
  sums.clear();
  for (int32_t o : order) {
    slots.push_back(cl[o]);
    sums.push_back(cs[o]);
  }
}

uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

// Scores mixing normal values, a small set of repeated values (ties), NaN, +-inf and -0.
std::vector<float> NastyScores(std::mt19937& rng, int64_t n) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> kind(0, 19);
  const float values[] = {0.0f, -0.0f, 0.5f, -0.5f, 1.0f};
  std::vector<float> out(n);
  for (float& x : out) {
    const int c = kind(rng);
    if (c == 0) {
      x = std::nanf("");
    } else if (c == 1) {
      x = -std::numeric_limits<float>::infinity();
    } else if (c == 2) {
      x = std::numeric_limits<float>::infinity();
    } else if (c < 10) {
      x = values[c % 5];
    } else {
      x = normal(rng);
    }
  }
  return out;
}

void ExpectMatchesLegacy(const std::vector<float>& scores, int64_t s, int64_t k) {
  const int64_t count = AddressCount(k, s);
  std::vector<int32_t> slots(count);
  std::vector<float> sums(count);
  AddressScratch scratch;
  SelectSlots(scores.data(), s, k, slots, sums, scratch);
  std::vector<int32_t> want_slots;
  std::vector<float> want_sums;
  LegacySelect(scores.data(), s, k, want_slots, want_sums);
  ASSERT_EQ(slots, want_slots) << "s=" << s << " k=" << k;
  for (int64_t i = 0; i < count; ++i) ASSERT_EQ(Bits(sums[i]), Bits(want_sums[i])) << i;
}

void CheckLegacyOnSeed(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (int64_t s : {1, 2, 5, 8, 17, 64, 256}) {
    for (int64_t k : {1, 3, 8, 32, 128, 256, 300}) {
      const int reps = s >= 64 ? 2 : 10;
      for (int rep = 0; rep < reps; ++rep) {
        std::vector<float> scores = NastyScores(rng, 2 * s);
        ExpectMatchesLegacy(scores, s, k);
        for (float& x : scores) x = normal(rng);
        ExpectMatchesLegacy(scores, s, k);
      }
    }
  }
}

TEST(SdmAddressingTest, SharedHelpersMatchLegacySelection) { CheckLegacyOnSeed(77); }

TEST(SdmAddressingTest, SharedHelpersMatchLegacySelectionFreshSeed) {
  std::random_device rd;
  const uint32_t seed = rd();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  CheckLegacyOnSeed(seed);
}

// Candidate pruning (AddressSelectPrunedSerial, which the CUDA kernel and the CPU twin run)
// against the full k_sub^2 selection (AddressSelectSerial): the same slots in the same order and
// the same sum bits, on plain normal scores (the pruned path), on scores with many exact ties,
// NaN, +-inf and -0 (where ties at the threshold force the fallback), and on scores quantised to
// a few values. Counts how often each path ran, so the test fails if either is never exercised.
struct PruneStats {
  int pruned = 0, fell_back = 0;
};

void ExpectPrunedEqualsFull(const std::vector<float>& scores, int64_t s, int64_t k,
                            PruneStats& stats) {
  const int64_t k_sub = AddressSubCount(k, s);
  const int64_t count = AddressCount(k, s);
  std::vector<int32_t> idx_a(k_sub), idx_b(k_sub), hist(256);
  std::vector<uint64_t> keys(AddressSelectKeyScratch(k, s));
  std::vector<int32_t> want_slots(count), got_slots(count, -1);
  std::vector<float> want_sums(count), got_sums(count);
  AddressSelectSerial(scores.data(), s, k, want_slots.data(), want_sums.data(), idx_a.data(),
                      idx_b.data(), keys.data(), hist.data());
  // The halves in rank order, as the CUDA kernel ranks them (position = AddressRankOf).
  std::vector<int32_t> rank_a(k_sub), rank_b(k_sub);
  for (int64_t h = 0; h < 2; ++h) {
    std::vector<int32_t>& rank = h == 0 ? rank_a : rank_b;
    for (int64_t i = 0; i < s; ++i) {
      const int64_t r = AddressRankOf(scores.data() + h * s, s, i);
      if (r < k_sub) rank[r] = static_cast<int32_t>(i);
    }
  }
  bool pruned = false;
  AddressSelectPrunedSerial(scores.data(), s, k, rank_a.data(), rank_b.data(), got_slots.data(),
                            got_sums.data(), keys.data(), hist.data(), &pruned);
  ASSERT_EQ(got_slots, want_slots) << "s=" << s << " k=" << k << " pruned=" << pruned;
  for (int64_t i = 0; i < count; ++i) ASSERT_EQ(Bits(got_sums[i]), Bits(want_sums[i])) << i;
  if (count < k_sub * k_sub) ++(pruned ? stats.pruned : stats.fell_back);
}

void CheckPruningOnSeed(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> level(-2, 2);
  PruneStats stats;
  for (int64_t s : {1, 2, 5, 8, 17, 64, 128, 256}) {
    for (int64_t k : {1, 3, 8, 32, 100, 128, 256, 300}) {
      const int reps = s >= 64 ? 2 : 8;
      for (int rep = 0; rep < reps; ++rep) {
        std::vector<float> scores(2 * s);
        for (float& x : scores) x = normal(rng);
        ExpectPrunedEqualsFull(scores, s, k, stats);
        scores = NastyScores(rng, 2 * s);
        ExpectPrunedEqualsFull(scores, s, k, stats);
        for (float& x : scores) x = 0.25f * static_cast<float>(level(rng));
        ExpectPrunedEqualsFull(scores, s, k, stats);
      }
    }
  }
  EXPECT_GT(stats.pruned, 0);
  EXPECT_GT(stats.fell_back, 0);
}

TEST(SdmAddressingTest, PrunedCandidatesGiveTheFullTopK) { CheckPruningOnSeed(91); }

TEST(SdmAddressingTest, PrunedCandidatesGiveTheFullTopKFreshSeed) {
  std::random_device rd;
  const uint32_t seed = rd();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  CheckPruningOnSeed(seed);
}

TEST(SdmAddressingTest, PrunedCandidateCounts) {
  // count 4, k_sub 4: rows of 4, 2, 1, 1 pairs.
  EXPECT_EQ(AddressPrunedRowLength(0, 4, 4), 4);
  EXPECT_EQ(AddressPrunedRowLength(1, 4, 4), 2);
  EXPECT_EQ(AddressPrunedRowLength(3, 4, 4), 1);
  EXPECT_EQ(AddressPrunedCount(4, 16), 8);
  // sdm_flagship's 128 of 128 per half: 645 candidates instead of 16,384.
  EXPECT_EQ(AddressPrunedCount(128, 128), 645);
  // count = k_sub^2 (every pair selected): no pruning.
  EXPECT_EQ(AddressPrunedCount(300, 8), 64);
}

TEST(SdmAddressingTest, OrderKeyIsMonotoneWithNanAndZeroRules) {
  const float inf = std::numeric_limits<float>::infinity();
  const float ordered[] = {-inf, -3.0f, -1e-30f, 0.0f, 1e-38f, 2.0f, 3e38f, inf};
  for (size_t i = 0; i + 1 < std::size(ordered); ++i) {
    EXPECT_LT(AddressOrderKey(ordered[i]), AddressOrderKey(ordered[i + 1])) << i;
  }
  EXPECT_EQ(AddressOrderKey(-0.0f), AddressOrderKey(0.0f));
  EXPECT_EQ(AddressOrderKey(std::nanf("")), AddressOrderKey(-inf));
  EXPECT_EQ(AddressOrderKey(-std::nanf("")), AddressOrderKey(-inf));
  // Equal values: the lower index ranks first (larger key).
  EXPECT_GT(AddressRankKey(1.0f, 3, 1), AddressRankKey(1.0f, 4, 1));
  EXPECT_GT(AddressRankKey(1.5f, 200, 1), AddressRankKey(1.0f, 0, 1));
  EXPECT_EQ(AddressIndexBytes(1), 1);
  EXPECT_EQ(AddressIndexBytes(256), 1);
  EXPECT_EQ(AddressIndexBytes(257), 2);
  EXPECT_EQ(AddressIndexBytes(65536), 2);
  EXPECT_EQ(AddressIndexBytes(65537), 3);
}

TEST(SdmAddressingTest, RankOfIsThePositionInTheSortedOrder) {
  // AddressRankOf is what the GPU uses for each half; it must be a permutation that agrees with
  // the legacy (value desc, index asc, NaN last) sort.
  std::mt19937 rng(2024);
  for (int64_t n : {1, 2, 7, 64, 256}) {
    for (int rep = 0; rep < 5; ++rep) {
      std::vector<float> v = NastyScores(rng, n);
      std::vector<int32_t> want;
      LegacyTop(v.data(), n, n, want);
      for (int64_t pos = 0; pos < n; ++pos) {
        ASSERT_EQ(AddressRankOf(v.data(), n, want[pos]), pos) << "n=" << n;
      }
    }
  }
}

TEST(SdmAddressingTest, KthLargestKeyFindsTheKthKey) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint64_t> any;
  std::vector<int32_t> hist(256);
  for (int bits : {32, 40, 48, 64}) {
    std::vector<uint64_t> keys(300);
    for (size_t i = 0; i < keys.size(); ++i) {
      // Distinct keys sharing long prefixes, so that several passes matter.
      const uint64_t mask = bits == 64 ? ~uint64_t{0} : (uint64_t{1} << bits) - 1;
      keys[i] = ((any(rng) & 0xf0f) << (bits - 16) | i) & mask;
    }
    std::vector<uint64_t> sorted = keys;
    std::sort(sorted.rbegin(), sorted.rend());
    for (int64_t k : {1, 2, 150, 299, 300}) {
      std::vector<uint64_t> scratch = keys;  // overwritten
      const uint64_t got =
          KthLargestKey(scratch.data(), static_cast<int64_t>(keys.size()), k, bits, hist.data());
      EXPECT_EQ(got, sorted[k - 1]) << "bits=" << bits << " k=" << k;
    }
  }
}

TEST(SdmAddressingTest, ActivationsAreBitIdenticalToTheirDefinitions) {
  // The legacy CPU softmax and L2, written out; pieces the GPU uses give the same results.
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (int rep = 0; rep < 20; ++rep) {
    std::vector<float> x(1 + rep * 13);
    for (float& e : x) e = 3 * normal(rng);
    const float scale = 0.5f + rep * 0.1f;
    std::vector<float> sm = x;
    float max_v = -std::numeric_limits<float>::infinity();
    for (float& e : sm) max_v = std::max(max_v, e *= scale);
    double sum = 0;
    for (float& e : sm) sum += (e = std::exp(e - max_v));
    const float inv = static_cast<float>(1.0 / sum);
    for (float& e : sm) e *= inv;
    std::vector<float> got = x;
    ActivateAddress(AddressAct::kSoftmax, scale, got);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(Bits(got[i]), Bits(sm[i]));

    double ss = 0;
    for (float e : x) ss += static_cast<double>(e) * e;
    const float denom = static_cast<float>(std::sqrt(ss)) + 1e-12f;
    got = x;
    ActivateAddress(AddressAct::kL2Normalize, scale, got);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(Bits(got[i]), Bits(x[i] / denom));

    got = x;
    ActivateAddress(AddressAct::kIdentity, scale, got);
    EXPECT_EQ(got, x);
  }
  // NaN never becomes the running max.
  EXPECT_EQ(AddressMaxStep(1.0f, std::nanf("")), 1.0f);
  EXPECT_EQ(AddressMaxStep(1.0f, 2.0f), 2.0f);
}

}  // namespace
}  // namespace sdm::kernels::cpu
