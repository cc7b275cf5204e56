// The decode-graph cache's bookkeeping (engine/cuda/decode_graph_cache.h) with a stand-in for the
// CUDA graph it owns: each graph is destroyed exactly once, when it is evicted or cleared.
#include "engine/cuda/decode_graph_cache.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace sdm {
namespace {

// Counts its destructions (a moved-from stand-in owns nothing).
class FakeExec {
 public:
  FakeExec(int id, std::map<int, int>* destroyed) : id_(id), destroyed_(destroyed) {}
  FakeExec(FakeExec&& o) noexcept
      : id_(std::exchange(o.id_, -1)), destroyed_(std::exchange(o.destroyed_, nullptr)) {}
  FakeExec& operator=(FakeExec&&) = delete;
  ~FakeExec() {
    if (destroyed_ != nullptr) ++(*destroyed_)[id_];
  }
  int id() const { return id_; }

 private:
  int id_;
  std::map<int, int>* destroyed_;
};

DecodeGraphKey Key(int64_t sessions, int64_t visible = 512) {
  return DecodeGraphKey{.sessions = sessions,
                        .logit_rows = 0,
                        .draws = sessions,
                        .gathered = false,
                        .visible = visible};
}

TEST(DecodeGraphCacheTest, EveryFieldOfTheKeyTellsShapesApart) {
  std::map<int, int> destroyed;
  DecodeGraphCache<FakeExec> cache(16);
  const DecodeGraphKey base{
      .sessions = 4, .logit_rows = 4, .draws = 0, .gathered = false, .visible = 512};
  std::vector<DecodeGraphKey> keys = {base, base, base, base, base};
  keys[1].logit_rows = 0;
  keys[1].draws = 4;
  keys[2].gathered = true;
  keys[3].visible = 1024;
  keys[4].sessions = 5;
  for (int i = 0; i < 5; ++i) {
    if (i > 0) {
      ASSERT_EQ(cache.Find(keys[i]), nullptr) << "key " << i;
    }
    cache.Insert(keys[i], FakeExec(i, &destroyed));
  }
  for (int i = 0; i < 5; ++i) {
    FakeExec* e = cache.Find(keys[i]);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->id(), i);
  }
  EXPECT_TRUE(destroyed.empty());
}

TEST(DecodeGraphCacheTest, TheLeastRecentlyUsedGraphIsDestroyedFirst) {
  std::map<int, int> destroyed;
  {
    DecodeGraphCache<FakeExec> cache(2);
    cache.Insert(Key(1), FakeExec(1, &destroyed));
    cache.Insert(Key(2), FakeExec(2, &destroyed));
    ASSERT_NE(cache.Find(Key(1)), nullptr);  // 2 is now the least recently used
    cache.Insert(Key(3), FakeExec(3, &destroyed));
    EXPECT_EQ(cache.size(), 2u);
    EXPECT_EQ(cache.Find(Key(2)), nullptr);
    EXPECT_EQ(destroyed, (std::map<int, int>{{2, 1}}));
    ASSERT_NE(cache.Find(Key(1)), nullptr);
    ASSERT_NE(cache.Find(Key(3)), nullptr);
  }
  // The cache's end destroys the rest, each once.
  EXPECT_EQ(destroyed, (std::map<int, int>{{1, 1}, {2, 1}, {3, 1}}));
}

TEST(DecodeGraphCacheTest, ClearDestroysEveryGraphAndForgetsRefusals) {
  std::map<int, int> destroyed;
  DecodeGraphCache<FakeExec> cache(8);
  cache.Insert(Key(1), FakeExec(1, &destroyed));
  cache.Insert(Key(2), FakeExec(2, &destroyed));
  cache.Refuse(Key(3));
  EXPECT_TRUE(cache.Refused(Key(3)));
  EXPECT_FALSE(cache.Refused(Key(1)));
  cache.Clear();
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_EQ(cache.Find(Key(1)), nullptr);
  EXPECT_FALSE(cache.Refused(Key(3)));
  EXPECT_EQ(destroyed, (std::map<int, int>{{1, 1}, {2, 1}}));
}

// Random use against a model of the same policy: the cache holds exactly the `capacity` most
// recently used keys, each graph is destroyed once, and only after it left the cache.
TEST(DecodeGraphCacheTest, MatchesAModelOfTheLeastRecentlyUsedPolicy) {
  for (const uint32_t seed : {1u, 2u, std::random_device{}()}) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int64_t> pick(1, 12);
    std::map<int, int> destroyed;
    constexpr size_t kCapacity = 5;
    DecodeGraphCache<FakeExec> cache(kCapacity);
    std::vector<int64_t> model;  // most recently used first
    std::map<int64_t, int> live_id;
    int next_id = 0;
    for (int op = 0; op < 2000; ++op) {
      const int64_t s = pick(rng);
      FakeExec* e = cache.Find(Key(s));
      auto it = std::find(model.begin(), model.end(), s);
      ASSERT_EQ(e != nullptr, it != model.end()) << "op " << op;
      if (e != nullptr) {
        EXPECT_EQ(e->id(), live_id[s]);
        model.erase(it);
      } else {
        live_id[s] = next_id;
        cache.Insert(Key(s), FakeExec(next_id++, &destroyed));
      }
      model.insert(model.begin(), s);
      if (model.size() > kCapacity) {
        const int64_t evicted = model.back();
        model.pop_back();
        EXPECT_EQ(destroyed[live_id[evicted]], 1) << "op " << op;
      }
      ASSERT_EQ(cache.size(), model.size());
    }
    for (const auto& [id, count] : destroyed) EXPECT_EQ(count, 1) << "graph " << id;
  }
}

}  // namespace
}  // namespace sdm
