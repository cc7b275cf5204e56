#include "base/heap.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace sdm {
namespace {

#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
constexpr bool kGlibc = true;
#else
constexpr bool kGlibc = false;
#endif

// RssAnon of this process in KiB (/proc/self/status), or -1 where there is none.
int64_t RssAnonKib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("RssAnon:", 0) == 0) return std::strtoll(line.c_str() + 8, nullptr, 10);
  }
  return -1;
}

// Touches every page of a block so that it is resident. The empty asm keeps the compiler from
// eliding the malloc/free pair.
void* Touched(size_t bytes) {
  void* p = std::malloc(bytes);
  std::memset(p, 1, bytes);
  asm volatile("" : : "r"(p) : "memory");
  return p;
}

// Mapped on its own: a block that counts in mallinfo2's hblks while it lives.
bool IsMapped(size_t bytes) {
  const int64_t before = GetHeapUsage().mapped_blocks;
  void* p = Touched(bytes);
  const bool mapped = GetHeapUsage().mapped_blocks == before + 1;
  std::free(p);
  return mapped;
}

// glibc's default threshold rises to the size of a mapped block once it is freed, so a later block
// of about that size comes from an arena and stays there. A fixed threshold keeps mapping it.
// (One test process: the fixed threshold, once set, stays for the tests after it.)
TEST(HeapTest, AFixedMmapThresholdKeepsMappingBlocksOfItsSize) {
  if (!kGlibc) GTEST_SKIP() << "glibc malloc only";
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
      std::getenv("GLIBC_TUNABLES") != nullptr) {
    GTEST_SKIP() << "the environment sets malloc's tuning";
  }
  // Default (dynamic): a freed 1 MiB block raises the threshold past 512 KiB blocks.
  ASSERT_TRUE(IsMapped(size_t{1} << 20));
  EXPECT_FALSE(IsMapped(size_t{512} << 10)) << "glibc's dynamic threshold did not rise";

  ASSERT_TRUE(SetMmapThreshold(kSoakMmapThreshold));
  TrimHeap();  // the arena's top still holds the free space the dynamic rule let it keep
  EXPECT_TRUE(IsMapped(size_t{512} << 10));
  EXPECT_TRUE(IsMapped(kSoakMmapThreshold));
  ASSERT_TRUE(IsMapped(size_t{4} << 20));
  EXPECT_TRUE(IsMapped(kSoakMmapThreshold)) << "the threshold moved after a free";
  EXPECT_FALSE(IsMapped(kSoakMmapThreshold / 4));
}

TEST(HeapTest, TheEnvironmentWinsOverSetMmapThreshold) {
  if (!kGlibc) GTEST_SKIP() << "glibc malloc only";
  const char* old = std::getenv("MALLOC_MMAP_THRESHOLD_");
  ASSERT_EQ(old, nullptr);
  ::setenv("MALLOC_MMAP_THRESHOLD_", "131072", 1);
  EXPECT_FALSE(SetMmapThreshold(kSoakMmapThreshold));
  ::unsetenv("MALLOC_MMAP_THRESHOLD_");
}

// Arenas malloc_info() reports (its <heap nr="..."> elements), or -1 where it cannot be read.
int ArenaCount() {
#if defined(__GLIBC__)
  char* text = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&text, &size);
  if (f == nullptr) return -1;
  const int rc = malloc_info(0, f);
  std::fclose(f);
  int count = 0;
  for (const char* p = text; rc == 0 && (p = std::strstr(p, "<heap nr=")) != nullptr; ++p) {
    ++count;
  }
  std::free(text);
  return rc == 0 ? count : -1;
#else
  return -1;
#endif
}

// Arenas that exist after `threads` threads each allocated (and still hold) a block at the same
// time, less those before.
int NewArenasFromThreads(int threads) {
  const int before = ArenaCount();
  std::mutex mu;
  std::condition_variable cv;
  int holding = 0;
  bool release = false;
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) {
    pool.emplace_back([&] {
      void* p = Touched(4096);
      std::unique_lock<std::mutex> lock(mu);
      ++holding;
      cv.notify_all();
      cv.wait(lock, [&] { return release; });
      lock.unlock();
      std::free(p);
    });
  }
  int after;
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return holding == threads; });
    after = ArenaCount();
    release = true;
    cv.notify_all();
  }
  for (std::thread& t : pool) t.join();
  return after - before;
}

// In a child process (the cap is process-wide and permanent): 20 threads allocating at once make
// new arenas by default (glibc allows 8 per core), none once SetArenaMax(1) capped them.
TEST(HeapTest, SetArenaMaxStopsNewArenas) {
  if (!kGlibc) GTEST_SKIP() << "glibc malloc only";
  if (std::getenv("MALLOC_ARENA_MAX") != nullptr || std::getenv("GLIBC_TUNABLES") != nullptr) {
    GTEST_SKIP() << "the environment sets malloc's tuning";
  }
  ASSERT_GE(ArenaCount(), 1);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::exit(NewArenasFromThreads(20) > 0 ? 0 : 1), ::testing::ExitedWithCode(0), "")
      << "without a cap, threads allocating at once did not create arenas";
  EXPECT_EXIT(
      {
        if (!SetArenaMax(1)) std::exit(2);
        std::exit(NewArenasFromThreads(20) == 0 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "")
      << "with the cap at 1, threads created arenas";
}

TEST(HeapTest, TheEnvironmentWinsOverSetArenaMax) {
  if (!kGlibc) GTEST_SKIP() << "glibc malloc only";
  ASSERT_EQ(std::getenv("MALLOC_ARENA_MAX"), nullptr);
  ::setenv("MALLOC_ARENA_MAX", "4", 1);
  EXPECT_FALSE(SetArenaMax(1));
  ::unsetenv("MALLOC_ARENA_MAX");
  EXPECT_FALSE(SetArenaMax(0)) << "0 arenas is refused";
}

#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
// Bytes that reach malloc's fast bins when this thread frees seven 100-byte blocks it has just
// allocated: none while the thread has a tcache (its bin of that size holds 7, and is empty
// after the seven allocations took from it), all seven chunks (7 x 112 bytes) without one.
int64_t FastBinBytesFromSevenFrees() {
  void* blocks[7];
  for (void*& b : blocks) b = Touched(100);
  const size_t before = mallinfo2().fsmblks;
  for (void* b : blocks) std::free(b);
  return static_cast<int64_t>(mallinfo2().fsmblks) - static_cast<int64_t>(before);
}
#else
int64_t FastBinBytesFromSevenFrees() { return 0; }
#endif

// The death tests below run in children that execute this binary again and run the test from its
// start, some of them with GLIBC_TUNABLES set by the test itself (or by a re-execution): the
// parent marks its environment as its own, so that such a child does not skip the test as one
// whose environment tunes malloc (a skip would pass without running the statement).
constexpr char kOwnTunables[] = "SDM_HEAP_TEST_OWN_TUNABLES";

bool EnvironmentTunesMalloc() {
  return std::getenv("GLIBC_TUNABLES") != nullptr && std::getenv(kOwnTunables) == nullptr;
}

// Sets the mark for the test's lifetime.
class OwnTunables {
 public:
  OwnTunables() { ::setenv(kOwnTunables, "1", 1); }
  ~OwnTunables() { ::unsetenv(kOwnTunables); }
  OwnTunables(const OwnTunables&) = delete;
  OwnTunables& operator=(const OwnTunables&) = delete;
};

// In child processes: by default the frees go to the tcache; after ReexecWithTcacheCount(0) the
// process runs again (same pid, the death test's own arguments) without one, and they reach the
// fast bins. The re-executed child sees the count in its environment and does not re-execute.
TEST(HeapTest, ReexecWithTcacheCountZeroTurnsTheCacheOff) {
  if (!kGlibc) GTEST_SKIP() << "glibc malloc only";
  if (EnvironmentTunesMalloc()) GTEST_SKIP() << "the environment sets malloc's tuning";
  const OwnTunables own;
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::exit(FastBinBytesFromSevenFrees() == 0 ? 0 : 1), ::testing::ExitedWithCode(0),
              "")
      << "with glibc's tcache, freed 100-byte blocks reached the fast bins";
  EXPECT_EXIT(
      {
        const absl::Status s = ReexecWithTcacheCount(0);
        if (!s.ok()) std::exit(2);
        if (TcacheCountFromEnvironment() != 0) std::exit(3);
        std::exit(FastBinBytesFromSevenFrees() >= 7 * 100 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "")
      << "after re-executing with tcache_count=0, the frees did not reach the fast bins";
}

TEST(HeapTest, TheEnvironmentWinsOverReexecWithTcacheCount) {
  if (!kGlibc) GTEST_SKIP() << "glibc malloc only";
  if (EnvironmentTunesMalloc()) GTEST_SKIP() << "the environment sets malloc's tuning";
  const OwnTunables own;
  constexpr char kSet[] = "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=3";
  ::setenv("GLIBC_TUNABLES", kSet, 1);
  EXPECT_EQ(TcacheCountFromEnvironment(), 3);
  // Returns OK without re-executing, the environment untouched. In a child process: had it
  // re-executed, the child would run again with GLIBC_TUNABLES extended and exit 1 (a
  // re-execution of this process itself would go unseen).
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        if (!ReexecWithTcacheCount(0).ok()) std::exit(2);
        const char* t = std::getenv("GLIBC_TUNABLES");
        std::exit(t != nullptr && std::strcmp(t, kSet) == 0 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "")
      << "a count in the environment did not win";
  ::setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_countx=3", 1);
  EXPECT_EQ(TcacheCountFromEnvironment(), -1) << "another tunable's name";
  ::unsetenv("GLIBC_TUNABLES");
  EXPECT_EQ(TcacheCountFromEnvironment(), -1);
  EXPECT_TRUE(ReexecWithTcacheCount(-1).ok()) << "a negative count leaves glibc's default";
}

// Freed small blocks below a live one at an arena's top stay resident; TrimHeap() returns their
// pages. Fresh seed each run for the block sizes, printed for a rerun.
TEST(HeapTest, TrimHeapReturnsFreePagesBelowTheTop) {
  if (!kGlibc || RssAnonKib() < 0) GTEST_SKIP() << "glibc malloc and /proc only";
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<size_t> size(1024, 8192);  // below any mmap threshold
  std::vector<void*> blocks;
  size_t total = 0;
  while (total < (size_t{64} << 20)) {
    const size_t n = size(rng);
    blocks.push_back(Touched(n));
    total += n;
  }
  void* top = Touched(4096);  // keeps the arena's top from shrinking on its own
  for (void* p : blocks) std::free(p);
  const int64_t before = RssAnonKib();
  EXPECT_TRUE(TrimHeap());
  const int64_t after = RssAnonKib();
  EXPECT_LT(after, before - 32 * 1024) << "RssAnon " << before << " -> " << after << " KiB";
  std::free(top);
}

constexpr int64_t kMiB = int64_t{1} << 20;

// Feeds a schedule samples every `step` from `from` to `to` (exclusive) of `in_use(t)` (t in
// seconds since the epoch) and returns the times, in seconds, of the trims it asked for.
template <typename F>
std::vector<double> TrimTimes(HeapTrimSchedule& schedule, double from, double to, double step,
                              F in_use) {
  std::vector<double> trims;
  for (double t = from; t < to; t += step) {
    if (schedule.Sample(absl::FromUnixSeconds(0) + absl::Seconds(t), in_use(t))) {
      trims.push_back(t);
    }
  }
  return trims;
}

TEST(HeapTrimScheduleTest, ASteadyLoadTrimsEveryInterval) {
  HeapTrimSchedule schedule(absl::Seconds(10));
  std::mt19937 rng(1);
  std::uniform_int_distribution<int64_t> noise(-2 * kMiB, 2 * kMiB);
  const std::vector<double> trims =
      TrimTimes(schedule, 0, 61, 1, [&](double) { return 500 * kMiB + noise(rng); });
  EXPECT_EQ(trims, (std::vector<double>{10, 20, 30, 40, 50, 60}));
}

TEST(HeapTrimScheduleTest, AGrowingLoadTrimsEveryInterval) {
  HeapTrimSchedule schedule(absl::Seconds(10));
  const std::vector<double> trims = TrimTimes(
      schedule, 0, 31, 1, [](double t) { return 100 * kMiB + static_cast<int64_t>(t) * 5 * kMiB; });
  EXPECT_EQ(trims, (std::vector<double>{10, 20, 30}));
}

// The overload benchmark's pattern: a burst every 4.5 s that holds 80 MB more for 2.5 s.
TEST(HeapTrimScheduleTest, BurstsLessThanAnIntervalApartAreNotTrimmedBetween) {
  HeapTrimSchedule schedule(absl::Seconds(10));
  auto in_burst = [](double t) { return t < 60 && std::fmod(t, 4.5) < 2.5; };
  auto in_use = [&](double t) { return 1000 * kMiB + (in_burst(t) ? 80 * kMiB : 0); };
  // Sampled every 0.25 s, as HeapTrimmer samples at a 1 s interval. Between bursts their pages
  // are free and are not trimmed: a trim may come only while a burst holds them.
  const std::vector<double> during = TrimTimes(schedule, 0, 60, 0.25, in_use);
  for (double t : during) EXPECT_TRUE(in_burst(t)) << "a trim between bursts at " << t;
  // The last burst (from 58.5) is cut at 60: its last sample is 59.75, and the next trim is the
  // first sample an interval after it; then one every interval.
  EXPECT_EQ(TrimTimes(schedule, 60, 80, 0.25, in_use), (std::vector<double>{69.75, 79.75}));
}

TEST(HeapTrimScheduleTest, ADropWithinTheSlackTrimsAndOneBeyondItWaits) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  for (int64_t extra : {int64_t{0}, int64_t{1}}) {
    HeapTrimSchedule schedule(absl::Seconds(10), /*slack_bytes=*/4 * kMiB);
    EXPECT_FALSE(schedule.Sample(t0, 100 * kMiB));
    EXPECT_FALSE(schedule.Sample(t0 + absl::Seconds(5), 104 * kMiB + extra));
    // An interval since the first sample; the peak of the last interval is 4 MiB (+ extra) up.
    EXPECT_EQ(schedule.Sample(t0 + absl::Seconds(10), 100 * kMiB), extra == 0) << extra;
    if (extra == 0) continue;
    // The peak leaves the window once it is an interval old.
    EXPECT_FALSE(schedule.Sample(t0 + absl::Seconds(14.9), 100 * kMiB));
    EXPECT_TRUE(schedule.Sample(t0 + absl::Seconds(15), 100 * kMiB));
  }
}

// Against the rule as written (HeapTrimSchedule, base/heap.h), over every sample kept: random
// times and loads with bursts, fixed seeds and a fresh one.
TEST(HeapTrimScheduleTest, AgreesWithTheRuleOverRandomLoads) {
  std::vector<uint32_t> seeds = {1, 2, 3, 4, 5};
  seeds.push_back(std::random_device{}());
  for (uint32_t seed : seeds) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    const absl::Duration interval = absl::Seconds(std::uniform_int_distribution<int>(2, 12)(rng));
    const int64_t slack = std::uniform_int_distribution<int64_t>(0, 16)(rng) * kMiB;
    HeapTrimSchedule schedule(interval, slack);
    std::vector<std::pair<absl::Time, int64_t>> seen;
    absl::Time now = absl::FromUnixSeconds(1);
    absl::Time last_trim = absl::InfinitePast();  // the first sample starts the first interval
    int64_t base = 200 * kMiB;
    int trims = 0;
    for (int i = 0; i < 3000; ++i) {
      now += absl::Milliseconds(std::uniform_int_distribution<int>(0, 2000)(rng));
      base += std::uniform_int_distribution<int64_t>(-kMiB, kMiB)(rng);
      const int64_t burst = std::bernoulli_distribution(0.2)(rng)
                                ? std::uniform_int_distribution<int64_t>(0, 64)(rng) * kMiB
                                : 0;
      const int64_t in_use = base + burst;
      seen.emplace_back(now, in_use);
      if (i == 0) last_trim = now;
      int64_t peak = 0;
      for (const auto& [t, bytes] : seen) {
        if (t > now - interval) peak = std::max(peak, bytes);
      }
      const bool expected = now - last_trim >= interval && peak - in_use <= slack;
      ASSERT_EQ(schedule.Sample(now, in_use), expected) << "sample " << i;
      if (expected) {
        last_trim = now;
        ++trims;
      }
    }
    EXPECT_GT(trims, 0);
  }
}

TEST(HeapTest, TrimmerTrimsUntilDestroyed) {
  HeapTrimmer trimmer(absl::Milliseconds(1));
  trimmer.AwaitTrims(3);
  EXPECT_GE(trimmer.trims(), 3);
}

}  // namespace
}  // namespace sdm
