// A pool of reusable buffers under a byte budget: the policy of the CUDA backend's staged-image
// pool (engine/cuda/device_state.h, CudaDeviceContext::TakeStagedImage), kept free of CUDA so
// that CI tests it on the CPU (tests/engine/budgeted_buffer_pool_test.cc).
//
// Take(elems) hands out a buffer of at least `elems` elements: the smallest pooled one that is
// large enough; else a new one from the allocator when the budget holds `elems` beside the
// buffers in use, after dropping pooled buffers (largest first) only while the request would not
// fit beside them, and a quarter larger than asked where the budget has that room free (a buffer
// asked for again after a small growth is then reused). The budget counts every buffer held, in
// use and pooled; it is never exceeded. Buffers are dropped and allocated outside the pool's
// lock (both can be slow: for page-locked memory, cudaFreeHost waits for the device and pinning
// gigabytes takes a fraction of a second), so Return() never waits for them.
//
// Buffer: movable, default-constructible (empty), with size() in elements and a destructor that
// frees it. Allocate: absl::StatusOr<Buffer>(int64_t elems), called without the lock held.
//
// Thread-safety: every method is thread-safe.
#ifndef SDMSERVE_ENGINE_BUDGETED_BUFFER_POOL_H_
#define SDMSERVE_ENGINE_BUDGETED_BUFFER_POOL_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace sdm {

// What a BudgetedBufferPool has done.
struct BufferPoolStats {
  int64_t held_bytes = 0;   // bytes of every buffer held now, in use and pooled
  int64_t allocations = 0;  // buffers allocated so far
  int64_t refusals = 0;     // Take() calls the budget could not hold beside the buffers in use
};

template <typename Buffer>
class BudgetedBufferPool {
 public:
  using Allocate = std::function<absl::StatusOr<Buffer>(int64_t elems)>;

  // `budget_bytes` >= 0 (0: every Take of a non-empty buffer is refused).
  BudgetedBufferPool(int64_t budget_bytes, int64_t elem_bytes, Allocate allocate)
      : budget_(budget_bytes), elem_bytes_(elem_bytes), allocate_(std::move(allocate)) {}
  BudgetedBufferPool(const BudgetedBufferPool&) = delete;
  BudgetedBufferPool& operator=(const BudgetedBufferPool&) = delete;

  // A buffer of at least `elems` elements (an empty one for elems <= 0), see the file comment.
  // ResourceExhausted (counted as a refusal) when the buffers in use leave no room for it; the
  // allocator's error, with nothing kept, when it fails.
  absl::StatusOr<Buffer> Take(int64_t elems) ABSL_LOCKS_EXCLUDED(mu_) {
    if (elems <= 0) return Buffer();
    const int64_t bytes = elems * elem_bytes_;
    std::vector<Buffer> to_drop;  // destroyed after the lock is released
    int64_t alloc_elems = 0;
    {
      absl::MutexLock lock(&mu_);
      auto best = pool_.end();
      for (auto it = pool_.begin(); it != pool_.end(); ++it) {
        if (Elems(*it) >= elems && (best == pool_.end() || Elems(*it) < Elems(*best))) best = it;
      }
      if (best != pool_.end()) {
        Buffer buffer = std::move(*best);
        pool_.erase(best);
        return buffer;
      }
      int64_t pooled = 0;
      for (const Buffer& b : pool_) pooled += Elems(b) * elem_bytes_;
      const int64_t in_use = stats_.held_bytes - pooled;
      if (in_use + bytes > budget_) {
        ++stats_.refusals;
        return absl::ResourceExhaustedError(
            absl::StrCat("a buffer of ", bytes, " bytes does not fit: ", in_use, " of the ",
                         budget_, " bytes allowed are in use"));
      }
      std::sort(pool_.begin(), pool_.end(),
                [](const Buffer& a, const Buffer& b) { return Elems(a) < Elems(b); });
      while (!pool_.empty() && stats_.held_bytes + bytes > budget_) {
        stats_.held_bytes -= Elems(pool_.back()) * elem_bytes_;
        to_drop.push_back(std::move(pool_.back()));
        pool_.pop_back();
      }
      const int64_t room = (budget_ - stats_.held_bytes) / elem_bytes_;
      alloc_elems = std::max(elems, std::min(elems + elems / 4, room));
      stats_.held_bytes += alloc_elems * elem_bytes_;  // reserved while allocating
    }
    to_drop.clear();
    absl::StatusOr<Buffer> buffer = allocate_(alloc_elems);
    absl::MutexLock lock(&mu_);
    if (!buffer.ok()) {
      stats_.held_bytes -= alloc_elems * elem_bytes_;
      return buffer.status();
    }
    ++stats_.allocations;
    return buffer;
  }

  // Gives a buffer from Take() back to the pool (an empty one is ignored).
  void Return(Buffer buffer) ABSL_LOCKS_EXCLUDED(mu_) {
    if (Elems(buffer) == 0) return;
    absl::MutexLock lock(&mu_);
    pool_.push_back(std::move(buffer));
  }

  BufferPoolStats stats() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return stats_;
  }

 private:
  static int64_t Elems(const Buffer& b) { return static_cast<int64_t>(b.size()); }

  const int64_t budget_;
  const int64_t elem_bytes_;
  const Allocate allocate_;
  mutable absl::Mutex mu_;
  std::vector<Buffer> pool_ ABSL_GUARDED_BY(mu_);
  BufferPoolStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_BUDGETED_BUFFER_POOL_H_
