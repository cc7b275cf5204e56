#include "state_store/kv_cache.h"

#include <algorithm>

namespace sdm {

KvCache::KvCache(int64_t row_width, int64_t ring_capacity)
    : row_width_(row_width), ring_(ring_capacity) {}

float* KvCache::EnsureRow(bool value) {
  const int64_t slot = Slot(length_);
  const int64_t page = slot / kPageTokens;
  while (static_cast<int64_t>(pages_.size()) <= page) {
    // For a ring, the last page only needs the rows up to the window; keep pages uniform anyway.
    pages_.push_back(std::make_unique<float[]>(2 * kPageTokens * row_width_));
  }
  return pages_[page].get() + ((value ? kPageTokens : 0) + slot % kPageTokens) * row_width_;
}

float* KvCache::NextKeyRow() { return EnsureRow(/*value=*/false); }
float* KvCache::NextValueRow() { return EnsureRow(/*value=*/true); }

KvCache KvCache::Clone() const {
  KvCache copy(row_width_, ring_);
  copy.length_ = length_;
  const int64_t page_floats = 2 * kPageTokens * row_width_;
  for (const auto& page : pages_) {
    copy.pages_.push_back(std::make_unique<float[]>(page_floats));
    std::copy(page.get(), page.get() + page_floats, copy.pages_.back().get());
  }
  return copy;
}

void KvCache::ResetForRestore(int64_t length) {
  pages_.clear();
  length_ = length;
  // Slots in use: [0, length) for a full cache; the whole ring once it has wrapped.
  const int64_t slots = (ring_ > 0 && length > ring_) ? ring_ : length;
  const int64_t pages = (slots + kPageTokens - 1) / kPageTokens;
  for (int64_t i = 0; i < pages; ++i) {
    pages_.push_back(std::make_unique<float[]>(2 * kPageTokens * row_width_));
  }
}

int64_t KvCache::ResidentBytes() const {
  return static_cast<int64_t>(pages_.size()) * 2 * kPageTokens * row_width_ *
         static_cast<int64_t>(sizeof(float));
}

}  // namespace sdm
