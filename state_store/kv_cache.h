// Key/value rows of one attention layer of one session, stored in fixed-size pages.
//
// Full attention (ring_capacity == 0) keeps every position; pages are added as the sequence
// grows. Sliding-window attention keeps the last `ring_capacity` positions in a ring: position p
// lives in ring slot p % ring_capacity, so memory stays bounded whatever the length. The engine
// sizes the ring as window + prefill chunk, so every query of a chunk still finds its window.
//
// Positions are appended strictly in order. Row pointers stay valid until the cache is destroyed
// (pages never move). Not thread-safe; one session is used by one thread at a time.
#ifndef SDMSERVE_STATE_STORE_KV_CACHE_H_
#define SDMSERVE_STATE_STORE_KV_CACHE_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace sdm {

class KvCache {
 public:
  static constexpr int64_t kPageTokens = 256;

  KvCache(int64_t row_width, int64_t ring_capacity);
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;
  KvCache(KvCache&&) = default;
  KvCache& operator=(KvCache&&) = default;

  int64_t row_width() const { return row_width_; }
  int64_t ring_capacity() const { return ring_; }
  // Number of positions appended so far.
  int64_t length() const { return length_; }
  // First position still held: length - ring_capacity for a full ring, else 0.
  int64_t first_position() const { return (ring_ > 0 && length_ > ring_) ? length_ - ring_ : 0; }

  // Reserves the row of position length() and returns writable key and value rows for it.
  // The caller fills both, then calls Commit().
  float* NextKeyRow();
  float* NextValueRow();
  void Commit() { ++length_; }

  // Rows of a held position: first_position() <= pos < length() (or == length() before Commit).
  const float* KeyRow(int64_t pos) const { return Row(pos, /*value=*/false); }
  const float* ValueRow(int64_t pos) const { return Row(pos, /*value=*/true); }

  // Calls fn(first_pos, count, key_rows, value_rows) for maximal runs of held positions in
  // [begin, end) whose rows are contiguous (row stride row_width()), in increasing order.
  template <typename Fn>
  void ForEachSpan(int64_t begin, int64_t end, Fn&& fn) const {
    int64_t pos = begin;
    while (pos < end) {
      const int64_t slot = Slot(pos);
      int64_t run = kPageTokens - slot % kPageTokens;           // to the end of the page
      if (ring_ > 0 && ring_ - slot < run) run = ring_ - slot;  // to the ring's wrap
      if (end - pos < run) run = end - pos;
      fn(pos, run, KeyRow(pos), ValueRow(pos));
      pos += run;
    }
  }

  // Bytes held in pages.
  int64_t ResidentBytes() const;

  // A deep copy (a new session continuing from the same history).
  KvCache Clone() const;

  // Restoring a parked cache: sets the length to `length` with pages for every held position,
  // whose rows the caller then fills through MutableKeyRow/MutableValueRow.
  void ResetForRestore(int64_t length);
  float* MutableKeyRow(int64_t pos) { return const_cast<float*>(Row(pos, /*value=*/false)); }
  float* MutableValueRow(int64_t pos) { return const_cast<float*>(Row(pos, /*value=*/true)); }

 private:
  int64_t Slot(int64_t pos) const { return ring_ > 0 ? pos % ring_ : pos; }
  const float* Row(int64_t pos, bool value) const {
    const int64_t slot = Slot(pos);
    const float* page = pages_[slot / kPageTokens].get();
    return page + ((value ? kPageTokens : 0) + slot % kPageTokens) * row_width_;
  }
  float* EnsureRow(bool value);

  int64_t row_width_;
  int64_t ring_;
  int64_t length_ = 0;
  // Each page holds kPageTokens key rows followed by kPageTokens value rows.
  std::vector<std::unique_ptr<float[]>> pages_;
};

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_KV_CACHE_H_
