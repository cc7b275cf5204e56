#include "base/failure_episode.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace sdm {
namespace {

TEST(FailureEpisodeTest, TheFirstOfEachCauseIsLoggedAndTheEndOnceWithTheCount) {
  FailureEpisode episode;
  EXPECT_FALSE(episode.Succeeded());  // no episode yet
  EXPECT_TRUE(episode.Failed("disk full"));
  EXPECT_FALSE(episode.Failed("disk full"));
  EXPECT_FALSE(episode.Failed("disk full"));
  EXPECT_TRUE(episode.Failed("etcd down"));  // another cause is logged
  EXPECT_FALSE(episode.Failed("etcd down"));
  int64_t unlogged = -1;
  EXPECT_TRUE(episode.Succeeded(&unlogged));
  EXPECT_EQ(unlogged, 3);
  EXPECT_FALSE(episode.Succeeded(&unlogged));  // the episode ended once
  EXPECT_TRUE(episode.Failed("disk full"));    // a new episode logs its cause again
  EXPECT_TRUE(episode.Succeeded(&unlogged));
  EXPECT_EQ(unlogged, 0);
}

}  // namespace
}  // namespace sdm
