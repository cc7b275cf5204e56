#include "state_store/kv_cache.h"

#include <algorithm>
#include <cstring>

namespace sdm {

KvCache::KvCache(int64_t row_width, int64_t ring_capacity, DType element)
    : row_width_(row_width), ring_(ring_capacity), element_(element) {}

std::byte* KvCache::EnsureRow(bool value) {
  const int64_t slot = Slot(length_);
  const int64_t page = slot / kPageTokens;
  while (static_cast<int64_t>(pages_.size()) <= page) {
    // For a ring, the last page only needs the rows up to the window; keep pages uniform anyway.
    pages_.push_back(std::make_unique<std::byte[]>(PageBytes()));
  }
  return pages_[page].get() + ((value ? kPageTokens : 0) + slot % kPageTokens) * RowBytes();
}

void KvCache::StoreBytes(std::byte* dst, const float* row) const {
  if (element_ == DType::kF32) {
    std::memcpy(dst, row, RowBytes());
  } else {
    uint16_t* out = reinterpret_cast<uint16_t*>(dst);
    FloatsToBf16(row, row_width_, out);
  }
}

void KvCache::AppendRow(const float* key, const float* value) {
  StoreBytes(EnsureRow(/*value=*/false), key);
  StoreBytes(EnsureRow(/*value=*/true), value);
  Commit();
}

void KvCache::StoreRow(int64_t pos, bool value, const float* row) {
  StoreBytes(const_cast<std::byte*>(Row(pos, value)), row);
}

KvCache KvCache::Clone() const {
  KvCache copy(row_width_, ring_, element_);
  copy.length_ = length_;
  for (const auto& page : pages_) {
    copy.pages_.push_back(std::make_unique<std::byte[]>(PageBytes()));
    std::memcpy(copy.pages_.back().get(), page.get(), PageBytes());
  }
  return copy;
}

void KvCache::ResetForRestore(int64_t length) {
  pages_.clear();
  length_ = length;
  // Slots in use: [0, length) for a full cache; the whole ring once it has wrapped.
  const int64_t slots = (ring_ > 0 && length > ring_) ? ring_ : length;
  const int64_t pages = (slots + kPageTokens - 1) / kPageTokens;
  for (int64_t i = 0; i < pages; ++i) pages_.push_back(std::make_unique<std::byte[]>(PageBytes()));
}

int64_t KvCache::ResidentBytes() const { return static_cast<int64_t>(pages_.size()) * PageBytes(); }

}  // namespace sdm
