// Rows of SDM memory (hd floats each) shared by every session of a model: the unit that
// copy-on-write, fork, parking and snapshots move (docs/model-spec.md §5.6).
//
// A row has a reference count: a session's table holds one reference per slot it maps to the row;
// Fork() adds references instead of copying; a writer whose row is shared takes a private copy
// first (SdmTable::MutableRow). Allocate() returns a row with one reference and unspecified
// contents; Release() frees it when the count drops to zero.
//
// Thread-safety: all methods are thread-safe. Row pointers are stable for the life of the pool
// (rows live in chunks that never move), so readers need no lock.
#ifndef SDMSERVE_STATE_STORE_ROW_POOL_H_
#define SDMSERVE_STATE_STORE_ROW_POOL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace sdm {

class RowPool {
 public:
  // At most max_rows rows can be live at once (the chunk table is reserved up front so readers
  // never see it move).
  explicit RowPool(int64_t row_width, int64_t max_rows = int64_t{1} << 28);
  RowPool(const RowPool&) = delete;
  RowPool& operator=(const RowPool&) = delete;

  int64_t row_width() const { return row_width_; }
  int64_t row_bytes() const { return row_width_ * static_cast<int64_t>(sizeof(float)); }

  // A new row with one reference, or -1 when max_rows rows are live.
  int32_t Allocate();
  void AddRef(int32_t row);
  void Release(int32_t row);
  int32_t RefCount(int32_t row) const {
    return chunks_[row / kChunkRows]->refs[row % kChunkRows].load(std::memory_order_acquire);
  }

  float* Row(int32_t row) const {
    return chunks_[row / kChunkRows]->data.get() + (row % kChunkRows) * row_width_;
  }

  int64_t live_rows() const { return live_rows_.load(std::memory_order_relaxed); }
  // Rows referenced more than once (shared between forks).
  int64_t shared_rows() const { return shared_rows_.load(std::memory_order_relaxed); }
  int64_t live_bytes() const { return live_rows() * row_bytes(); }
  // Bytes of all chunks ever allocated (freed rows are reused, not returned to the system).
  int64_t reserved_bytes() const;

 private:
  static constexpr int64_t kChunkRows = 1024;
  struct Chunk {
    explicit Chunk(int64_t floats)
        : data(std::make_unique<float[]>(floats)),
          refs(std::make_unique<std::atomic<int32_t>[]>(kChunkRows)) {}
    std::unique_ptr<float[]> data;
    std::unique_ptr<std::atomic<int32_t>[]> refs;
  };

  const int64_t row_width_;
  const int64_t max_rows_;
  mutable absl::Mutex mu_;
  // Appended under mu_, read without it (Row, RefCount): reserved to max_rows / kChunkRows, so
  // its elements never move. Not ABSL_GUARDED_BY for that reason.
  std::vector<std::unique_ptr<Chunk>> chunks_;
  std::vector<int32_t> free_ ABSL_GUARDED_BY(mu_);
  int64_t next_row_ ABSL_GUARDED_BY(mu_) = 0;  // rows ever handed out
  std::atomic<int64_t> live_rows_{0};
  std::atomic<int64_t> shared_rows_{0};
};

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_ROW_POOL_H_
