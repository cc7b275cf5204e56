// Key/value rows of one attention layer of one session, stored in fixed-size pages.
//
// Full attention (ring_capacity == 0) keeps every position; pages are added as the sequence
// grows. Sliding-window attention keeps the last `ring_capacity` positions in a ring: position p
// lives in ring slot p % ring_capacity, so memory stays bounded whatever the length. The engine
// sizes the ring as window + prefill chunk, so every query of a chunk still finds its window.
//
// Rows hold fp32 values, or bf16 ones (DType::kBf16, base/bf16.h: the CPU engine's 16-bit mode).
// The typed accessors (NextKeyRow<T>, KeyRow<T>, ForEachSpan<T>, ...) take the element type the
// cache was made with (float or uint16_t bf16 bits; a mismatch is a programming error, checked);
// the converting ones (AppendRow, StoreRow, ForEachSpanAsFloat) take and give fp32 whatever the
// element type, which is how snapshots stay fp32 on disk.
//
// Positions are appended strictly in order. Row pointers stay valid until the cache is destroyed
// (pages never move). Not thread-safe; one session is used by one thread at a time.
#ifndef SDMSERVE_STATE_STORE_KV_CACHE_H_
#define SDMSERVE_STATE_STORE_KV_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>
#include <vector>

#include "base/bf16.h"
#include "base/check.h"

namespace sdm {

class KvCache {
 public:
  static constexpr int64_t kPageTokens = 256;

  KvCache(int64_t row_width, int64_t ring_capacity, DType element = DType::kF32);
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;
  KvCache(KvCache&&) = default;
  KvCache& operator=(KvCache&&) = default;

  int64_t row_width() const { return row_width_; }
  int64_t ring_capacity() const { return ring_; }
  DType element() const { return element_; }
  // Number of positions appended so far.
  int64_t length() const { return length_; }
  // First position still held: length - ring_capacity for a full ring, else 0.
  int64_t first_position() const { return (ring_ > 0 && length_ > ring_) ? length_ - ring_ : 0; }

  // Reserves the row of position length() and returns writable key and value rows for it
  // (T: float for an fp32 cache, uint16_t for a bf16 one). The caller fills both, then calls
  // Commit().
  template <typename T = float>
  T* NextKeyRow() {
    CheckType<T>();
    return reinterpret_cast<T*>(EnsureRow(/*value=*/false));
  }
  template <typename T = float>
  T* NextValueRow() {
    CheckType<T>();
    return reinterpret_cast<T*>(EnsureRow(/*value=*/true));
  }
  void Commit() { ++length_; }
  // Appends one position's rows given in fp32 (rounded to bf16 for a bf16 cache) and commits.
  void AppendRow(const float* key, const float* value);

  // Rows of a held position: first_position() <= pos < length() (or == length() before Commit).
  template <typename T = float>
  const T* KeyRow(int64_t pos) const {
    CheckType<T>();
    return reinterpret_cast<const T*>(Row(pos, /*value=*/false));
  }
  template <typename T = float>
  const T* ValueRow(int64_t pos) const {
    CheckType<T>();
    return reinterpret_cast<const T*>(Row(pos, /*value=*/true));
  }

  // Calls fn(first_pos, count, key_rows, value_rows) for maximal runs of held positions in
  // [begin, end) whose rows are contiguous (row stride row_width()), in increasing order.
  template <typename T = float, typename Fn>
  void ForEachSpan(int64_t begin, int64_t end, Fn&& fn) const {
    CheckType<T>();
    int64_t pos = begin;
    while (pos < end) {
      const int64_t slot = Slot(pos);
      int64_t run = kPageTokens - slot % kPageTokens;           // to the end of the page
      if (ring_ > 0 && ring_ - slot < run) run = ring_ - slot;  // to the ring's wrap
      if (end - pos < run) run = end - pos;
      fn(pos, run, KeyRow<T>(pos), ValueRow<T>(pos));
      pos += run;
    }
  }

  // Calls fn(rows, count) for the key (value: the value) rows of [begin, end) in runs as
  // ForEachSpan cuts them, as fp32 whatever the element type (bf16 rows widened into a scratch
  // buffer that is valid during the call only).
  template <typename Fn>
  void ForEachSpanAsFloat(int64_t begin, int64_t end, bool value, Fn&& fn) const {
    if (element_ == DType::kF32) {
      ForEachSpan<float>(begin, end, [&](int64_t, int64_t n, const float* k, const float* v) {
        fn(value ? v : k, n);
      });
      return;
    }
    std::vector<float> rows;
    ForEachSpan<uint16_t>(begin, end,
                          [&](int64_t, int64_t n, const uint16_t* k, const uint16_t* v) {
                            rows.resize(n * row_width_);
                            Bf16ToFloats(value ? v : k, n * row_width_, rows.data());
                            fn(static_cast<const float*>(rows.data()), n);
                          });
  }

  // Bytes held in pages.
  int64_t ResidentBytes() const;

  // A deep copy (a new session continuing from the same history).
  KvCache Clone() const;

  // Restoring a parked cache: sets the length to `length` with pages for every held position,
  // whose rows the caller then fills through MutableKeyRow/MutableValueRow or StoreRow.
  void ResetForRestore(int64_t length);
  template <typename T = float>
  T* MutableKeyRow(int64_t pos) {
    CheckType<T>();
    return reinterpret_cast<T*>(const_cast<std::byte*>(Row(pos, /*value=*/false)));
  }
  template <typename T = float>
  T* MutableValueRow(int64_t pos) {
    CheckType<T>();
    return reinterpret_cast<T*>(const_cast<std::byte*>(Row(pos, /*value=*/true)));
  }
  // Overwrites the key (value: the value) row of a held position from fp32 (rounded to bf16 for
  // a bf16 cache).
  void StoreRow(int64_t pos, bool value, const float* row);

 private:
  template <typename T>
  void CheckType() const {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint16_t>);
    SDM_CHECK((std::is_same_v<T, uint16_t>) == (element_ == DType::kBf16))
        << "KvCache accessed with the wrong element type";
  }
  int64_t Slot(int64_t pos) const { return ring_ > 0 ? pos % ring_ : pos; }
  int64_t RowBytes() const { return row_width_ * DTypeBytes(element_); }
  int64_t PageBytes() const { return 2 * kPageTokens * RowBytes(); }
  const std::byte* Row(int64_t pos, bool value) const {
    const int64_t slot = Slot(pos);
    const std::byte* page = pages_[slot / kPageTokens].get();
    return page + ((value ? kPageTokens : 0) + slot % kPageTokens) * RowBytes();
  }
  std::byte* EnsureRow(bool value);
  void StoreBytes(std::byte* dst, const float* row) const;

  int64_t row_width_;
  int64_t ring_;
  DType element_;
  int64_t length_ = 0;
  // Each page holds kPageTokens key rows followed by kPageTokens value rows.
  std::vector<std::unique_ptr<std::byte[]>> pages_;
};

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_KV_CACHE_H_
