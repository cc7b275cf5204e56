#include "kernels/cpu/sdm_addressing.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

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

}  // namespace
}  // namespace sdm::kernels::cpu
