#include "state_store/row_pool.h"

#include "base/check.h"

namespace sdm {

RowPool::RowPool(int64_t row_width, int64_t max_rows) : row_width_(row_width), max_rows_(max_rows) {
  SDM_CHECK(row_width > 0 && max_rows > 0 && max_rows <= (int64_t{1} << 31) - 1);
  chunks_.reserve((max_rows + kChunkRows - 1) / kChunkRows);
}

int32_t RowPool::Allocate() {
  absl::MutexLock lock(&mu_);
  int32_t row;
  if (!free_.empty()) {
    row = free_.back();
    free_.pop_back();
  } else {
    if (next_row_ >= max_rows_) return -1;
    if (next_row_ % kChunkRows == 0) {
      chunks_.push_back(std::make_unique<Chunk>(kChunkRows * row_width_));
    }
    row = static_cast<int32_t>(next_row_++);
  }
  chunks_[row / kChunkRows]->refs[row % kChunkRows].store(1, std::memory_order_release);
  live_rows_.fetch_add(1, std::memory_order_relaxed);
  return row;
}

void RowPool::AddRef(int32_t row) {
  const int32_t before =
      chunks_[row / kChunkRows]->refs[row % kChunkRows].fetch_add(1, std::memory_order_acq_rel);
  SDM_CHECK(before > 0);
  if (before == 1) shared_rows_.fetch_add(1, std::memory_order_relaxed);
}

void RowPool::Release(int32_t row) {
  const int32_t before =
      chunks_[row / kChunkRows]->refs[row % kChunkRows].fetch_sub(1, std::memory_order_acq_rel);
  SDM_CHECK(before > 0);
  if (before == 2) shared_rows_.fetch_sub(1, std::memory_order_relaxed);
  if (before == 1) {
    absl::MutexLock lock(&mu_);
    free_.push_back(row);
    live_rows_.fetch_sub(1, std::memory_order_relaxed);
  }
}

int64_t RowPool::reserved_bytes() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(chunks_.size()) * kChunkRows * row_bytes();
}

}  // namespace sdm
