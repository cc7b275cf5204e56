// The project's percentile convention (common/percentile.h): linear interpolation between the
// two nearest ranks, checked on cases small enough to work out by hand.
#include "common/percentile.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace sdm {
namespace {

TEST(PercentileTest, InterpolatesLinearlyBetweenTheNearestRanks) {
  const std::vector<double> four = {1, 2, 3, 4};
  // rank = p / 100 * (n - 1): p50 -> 1.5 (between 2 and 3), p90 -> 2.7 (70% from 3 to 4).
  EXPECT_DOUBLE_EQ(PercentileOfSorted(four, 0), 1);
  EXPECT_DOUBLE_EQ(PercentileOfSorted(four, 50), 2.5);
  EXPECT_DOUBLE_EQ(PercentileOfSorted(four, 90), 3.7);
  EXPECT_DOUBLE_EQ(PercentileOfSorted(four, 100), 4);
  // 11 samples 0, 10, ..., 100: every percentile lands where its value says.
  std::vector<double> tens;
  for (int i = 0; i <= 10; ++i) tens.push_back(10.0 * i);
  for (double p : {0.0, 5.0, 37.5, 50.0, 99.0, 100.0})
    EXPECT_DOUBLE_EQ(PercentileOfSorted(tens, p), p);
}

TEST(PercentileTest, AnOddCountsMedianIsTheMiddleSampleAndAnEvenCountsTheMeanOfTheTwo) {
  EXPECT_DOUBLE_EQ(PercentileOfSorted(std::vector<double>{1, 5, 9}, 50), 5);
  EXPECT_DOUBLE_EQ(PercentileOfSorted(std::vector<double>{1, 5, 9, 13}, 50), 7);
}

TEST(PercentileTest, ClampsPAndHandlesOneOrNoSample) {
  const std::vector<double> four = {1, 2, 3, 4};
  EXPECT_DOUBLE_EQ(PercentileOfSorted(four, 150), 4);
  EXPECT_DOUBLE_EQ(PercentileOfSorted(four, -5), 1);
  EXPECT_DOUBLE_EQ(PercentileOfSorted(std::vector<double>{7}, 99), 7);
  EXPECT_TRUE(std::isnan(PercentileOfSorted({}, 50)));
  EXPECT_TRUE(std::isnan(Percentile({}, 50)));
}

TEST(PercentileTest, UnsortedSamplesGiveTheSameAsSortedOnes) {
  const std::vector<double> shuffled = {4, 1, 3, 2};
  EXPECT_DOUBLE_EQ(Percentile(shuffled, 50), 2.5);
  EXPECT_DOUBLE_EQ(Percentile(shuffled, 90), 3.7);
  EXPECT_DOUBLE_EQ(Percentile(shuffled, 0), 1);
}

}  // namespace
}  // namespace sdm
