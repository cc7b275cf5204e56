// The staged-image pool's policy (engine/budgeted_buffer_pool.h) over fake buffers that record
// their allocations and frees: reuse, refusal, the quarter of headroom, freeing pooled buffers
// only when the budget needs their room, a failing allocator, and the budget under concurrent
// use (fixed and fresh seeds).
#include "engine/budgeted_buffer_pool.h"

#include <cstdint>
#include <iostream>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace sdm {
namespace {

// What the fake allocator has done: live bytes, frees. Thread-safe.
struct Ledger {
  absl::Mutex mu;
  int64_t live_elems ABSL_GUARDED_BY(mu) = 0;
  int64_t most_live_elems ABSL_GUARDED_BY(mu) = 0;
  int64_t frees ABSL_GUARDED_BY(mu) = 0;
  bool fail_next ABSL_GUARDED_BY(mu) = false;
};

// A buffer of `size()` elements that tells the ledger when it is freed.
class FakeBuffer {
 public:
  FakeBuffer() = default;
  FakeBuffer(Ledger* ledger, int64_t elems) : ledger_(ledger), elems_(elems) {
    absl::MutexLock lock(&ledger_->mu);
    ledger_->live_elems += elems_;
    ledger_->most_live_elems = std::max(ledger_->most_live_elems, ledger_->live_elems);
  }
  FakeBuffer(FakeBuffer&& o) noexcept
      : ledger_(std::exchange(o.ledger_, nullptr)), elems_(std::exchange(o.elems_, 0)) {}
  FakeBuffer& operator=(FakeBuffer&& o) noexcept {
    if (this != &o) {
      Free();
      ledger_ = std::exchange(o.ledger_, nullptr);
      elems_ = std::exchange(o.elems_, 0);
    }
    return *this;
  }
  ~FakeBuffer() { Free(); }
  size_t size() const { return static_cast<size_t>(elems_); }

 private:
  void Free() {
    if (ledger_ == nullptr) return;
    absl::MutexLock lock(&ledger_->mu);
    ledger_->live_elems -= elems_;
    ++ledger_->frees;
    ledger_ = nullptr;
    elems_ = 0;
  }
  Ledger* ledger_ = nullptr;
  int64_t elems_ = 0;
};

using Pool = BudgetedBufferPool<FakeBuffer>;

// A pool of 2-byte elements whose allocator makes FakeBuffers in `ledger`.
std::unique_ptr<Pool> MakePool(int64_t budget_bytes, Ledger& ledger) {
  return std::make_unique<Pool>(budget_bytes, 2,
                                [&ledger](int64_t elems) -> absl::StatusOr<FakeBuffer> {
                                  {
                                    absl::MutexLock lock(&ledger.mu);
                                    if (ledger.fail_next) {
                                      ledger.fail_next = false;
                                      return absl::UnavailableError("cannot pin");
                                    }
                                  }
                                  return FakeBuffer(&ledger, elems);
                                });
}

int64_t Frees(Ledger& l) {
  absl::MutexLock lock(&l.mu);
  return l.frees;
}

TEST(BudgetedBufferPoolTest, ReusesTheSmallestPooledBufferThatFits) {
  Ledger ledger;
  auto pool = MakePool(1000, ledger);
  absl::StatusOr<FakeBuffer> a = pool->Take(100);  // 125 elems with headroom: 250 bytes
  absl::StatusOr<FakeBuffer> b = pool->Take(200);  // 250 elems: 500 bytes
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->size(), 125u);
  EXPECT_EQ(b->size(), 250u);
  EXPECT_EQ(pool->stats().held_bytes, 750);
  pool->Return(*std::move(b));
  pool->Return(*std::move(a));
  absl::StatusOr<FakeBuffer> c = pool->Take(110);  // both fit: the smaller one
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->size(), 125u);
  absl::StatusOr<FakeBuffer> d = pool->Take(130);  // only the larger one fits
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->size(), 250u);
  EXPECT_EQ(pool->stats().allocations, 2);
  EXPECT_EQ(pool->stats().held_bytes, 750);
  EXPECT_EQ(Frees(ledger), 0);
}

TEST(BudgetedBufferPoolTest, RefusesWhatDoesNotFitBesideTheBuffersInUse) {
  Ledger ledger;
  auto pool = MakePool(1000, ledger);
  absl::StatusOr<FakeBuffer> a = pool->Take(300);  // headroom cut to the room: 375 elems
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->size(), 375u);
  absl::StatusOr<FakeBuffer> b = pool->Take(200);  // 750 + 400 > 1000
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted) << b.status();
  EXPECT_EQ(pool->stats().refusals, 1);
  absl::StatusOr<FakeBuffer> c = pool->Take(125);  // exactly the room left, no headroom
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->size(), 125u);
  EXPECT_EQ(pool->stats().held_bytes, 1000);
  // A budget of 0 refuses everything but an empty request.
  Ledger none;
  auto closed = MakePool(0, none);
  EXPECT_EQ(closed->Take(1).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(closed->Take(0).ok());
  EXPECT_EQ(closed->stats().allocations, 0);
}

TEST(BudgetedBufferPoolTest, FreesPooledBuffersOnlyWhenTheBudgetNeedsTheirRoom) {
  Ledger ledger;
  auto pool = MakePool(1000, ledger);
  {
    absl::StatusOr<FakeBuffer> small = pool->Take(40);   // 50 elems, 100 bytes
    absl::StatusOr<FakeBuffer> large = pool->Take(160);  // 200 elems, 400 bytes
    ASSERT_TRUE(small.ok() && large.ok());
    pool->Return(*std::move(small));
    pool->Return(*std::move(large));
  }
  // 480 bytes fit beside the 500 pooled: nothing is freed, and the headroom is cut to the
  // 500 bytes of room (250 elems, not 300).
  absl::StatusOr<FakeBuffer> mid = pool->Take(240);
  ASSERT_TRUE(mid.ok()) << mid.status();
  EXPECT_EQ(mid->size(), 250u);
  EXPECT_EQ(Frees(ledger), 0);
  EXPECT_EQ(pool->stats().held_bytes, 1000);
  pool->Return(*std::move(mid));
  // 600 bytes do not fit beside the 1000 pooled: pooled buffers go, largest first, until they
  // do (the 250- and 200-element ones); the smallest stays pooled and is reused after.
  absl::StatusOr<FakeBuffer> big = pool->Take(300);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(Frees(ledger), 2);
  EXPECT_EQ(big->size(), 375u);  // a quarter more: the room allows it
  EXPECT_EQ(pool->stats().held_bytes, 100 + 750);
  const int64_t allocations = pool->stats().allocations;
  absl::StatusOr<FakeBuffer> again = pool->Take(50);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->size(), 50u);
  EXPECT_EQ(pool->stats().allocations, allocations);
}

TEST(BudgetedBufferPoolTest, AFailedAllocationKeepsNothing) {
  Ledger ledger;
  auto pool = MakePool(1000, ledger);
  {
    absl::MutexLock lock(&ledger.mu);
    ledger.fail_next = true;
  }
  absl::StatusOr<FakeBuffer> failed = pool->Take(100);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  EXPECT_EQ(pool->stats().held_bytes, 0);
  EXPECT_EQ(pool->stats().allocations, 0);
  EXPECT_EQ(pool->stats().refusals, 0);
  absl::StatusOr<FakeBuffer> next = pool->Take(400);  // the whole budget is free again
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(pool->stats().held_bytes, 1000);
}

// Threads taking and returning buffers of random sizes: the memory the allocator has handed out
// and not freed never exceeds the budget, the pool's count of held bytes is exact once every
// buffer is back, and a request refused was one that did not fit beside the buffers in use.
void RunConcurrently(uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  constexpr int64_t kBudget = 20000;
  Ledger ledger;
  auto pool = MakePool(kBudget, ledger);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&pool, t, seed] {
      std::mt19937 rng(seed * 31 + t);
      std::uniform_int_distribution<int64_t> elems(1, 3000);
      std::vector<FakeBuffer> held;
      for (int i = 0; i < 400; ++i) {
        if (!held.empty() && (rng() % 2 == 0 || held.size() > 3)) {
          pool->Return(std::move(held.back()));
          held.pop_back();
          continue;
        }
        absl::StatusOr<FakeBuffer> b = pool->Take(elems(rng));
        if (b.ok()) held.push_back(*std::move(b));
      }
      for (FakeBuffer& b : held) pool->Return(std::move(b));
    });
  }
  for (std::thread& t : threads) t.join();
  absl::MutexLock lock(&ledger.mu);
  EXPECT_LE(ledger.most_live_elems * 2, kBudget);
  EXPECT_EQ(pool->stats().held_bytes, ledger.live_elems * 2);
  EXPECT_GT(pool->stats().allocations, 0);
}

TEST(BudgetedBufferPoolTest, TheBudgetHoldsUnderConcurrentUse) {
  for (uint32_t seed : {1u, 2u}) RunConcurrently(seed);
  const uint32_t fresh = std::random_device{}();
  std::cout << "TheBudgetHoldsUnderConcurrentUse fresh seed: " << fresh << "\n";
  RunConcurrently(fresh);
}

}  // namespace
}  // namespace sdm
