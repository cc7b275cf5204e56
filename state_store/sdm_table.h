// One session's memory for one SDM layer: per head, s^2 rows of hd floats, held copy-on-write
// over the model's shared initial memory M0 (docs/model-spec.md §5.6).
//
// A slot that was never written reads M0 (or zeros when the model has no learned memory). The
// first write to a slot gives it a private row from the RowPool, initialised from M0; a row shared
// with a fork is copied before its first write (reference counts in the pool). So a session's own
// bytes are (distinct slots written) x hd x 4 plus a 4-byte table entry per slot — never the
// table's full size. Row pointers stay valid while the table holds the row.
//
// Not thread-safe; one session is used by one thread at a time (the pool itself is thread-safe,
// so different sessions sharing it may run on different threads).
#ifndef SDMSERVE_STATE_STORE_SDM_TABLE_H_
#define SDMSERVE_STATE_STORE_SDM_TABLE_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "state_store/row_pool.h"
#include "state_store/state_layout.h"

namespace sdm {

class SdmTable {
 public:
  // Uses layout.row_pool (which must have layout.row_width).
  explicit SdmTable(const LayerStateLayout& layout);
  ~SdmTable();
  SdmTable(const SdmTable&) = delete;
  SdmTable& operator=(const SdmTable&) = delete;
  SdmTable(SdmTable&& other) noexcept;
  SdmTable& operator=(SdmTable&& other) noexcept;

  int64_t heads() const { return heads_; }
  int64_t slots_per_head() const { return slots_per_head_; }
  int64_t row_width() const { return row_width_; }

  // The current row of (head, slot): private if written, else M0's (or a zero row).
  const float* Row(int64_t head, int64_t slot) const {
    const int32_t r = slot_to_row_[head * slots_per_head_ + slot];
    if (r >= 0) return pool_->Row(r);
    return m0_ ? m0_.get() + (head * slots_per_head_ + slot) * row_width_ : zeros_.data();
  }

  // A writable row for (head, slot): copied from M0 on the first write, and from the shared row
  // when a fork still shares it. Null only when the pool is exhausted.
  float* MutableRow(int64_t head, int64_t slot);

  bool IsPrivate(int64_t head, int64_t slot) const {
    return slot_to_row_[head * slots_per_head_ + slot] >= 0;
  }
  // Slots that have their own row (written by this session or inherited from a fork's parent).
  int64_t private_rows() const { return num_rows_; }
  // Of those, rows currently shared with another session (reference count > 1).
  int64_t SharedRows() const;
  // Bytes of the slot->row table.
  int64_t TableBytes() const { return static_cast<int64_t>(slot_to_row_.size() * sizeof(int32_t)); }
  // Bytes this session references: its rows (shared ones counted in full) plus the table.
  int64_t ResidentBytes() const { return num_rows_ * pool_->row_bytes() + TableBytes(); }

  // A table sharing every row with this one (copy-on-write; the pool's counts go up).
  SdmTable Fork() const;
  // A table with its own copy of every row (nothing shared but M0). Precondition: the pool has
  // room (SDM_CHECK).
  SdmTable Clone() const;

  // Calls fn(head, slot, row) for every slot with its own row, in slot order.
  template <typename Fn>
  void ForEachPrivateRow(Fn&& fn) const {
    for (int64_t i = 0; i < static_cast<int64_t>(slot_to_row_.size()); ++i) {
      if (slot_to_row_[i] >= 0) {
        fn(i / slots_per_head_, i % slots_per_head_,
           static_cast<const float*>(pool_->Row(slot_to_row_[i])));
      }
    }
  }

  // Gives (head, slot) its own row holding `values` (restoring a parked session). Fails when the
  // slot already has a row or the pool is exhausted.
  absl::Status RestoreRow(int64_t head, int64_t slot, std::span<const float> values);

  // Rows written since the last ClearDirty() (or since the table was made): every slot
  // MutableRow() returned a row for. What a delta of the session must carry
  // (state_store/state_log.h). Forks, clones and restored tables start clean.
  int64_t dirty_rows() const { return static_cast<int64_t>(dirty_.size()); }
  // Calls fn(head, slot, row) for every dirty slot, in slot order.
  template <typename Fn>
  void ForEachDirtyRow(Fn&& fn) const {
    std::vector<uint32_t> order = dirty_;
    std::sort(order.begin(), order.end());
    for (uint32_t i : order)
      fn(i / slots_per_head_, i % slots_per_head_, Row(i / slots_per_head_, i % slots_per_head_));
  }
  void ClearDirty();

 private:
  void ReleaseAll();

  int64_t heads_;
  int64_t slots_per_head_;
  int64_t row_width_;
  std::shared_ptr<const float> m0_;
  std::shared_ptr<RowPool> pool_;
  std::vector<float> zeros_;          // the row every unwritten slot reads when M0 is null
  std::vector<int32_t> slot_to_row_;  // [heads * slots_per_head], -1 = reads M0
  int64_t num_rows_ = 0;
  // Dirty slots: a bit per slot (sized at the first write) and the list of set bits.
  std::vector<uint64_t> dirty_bits_;
  std::vector<uint32_t> dirty_;
};

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_SDM_TABLE_H_
