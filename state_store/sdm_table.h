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
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
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
  // Bytes this session references: its rows (shared ones counted in full), the table and the
  // write journal.
  int64_t ResidentBytes() const {
    return num_rows_ * pool_->row_bytes() + TableBytes() +
           static_cast<int64_t>(journal_.capacity());
  }

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
  // What those rows take in a delta: each with its u32 slot index (state_store/state_log.h).
  int64_t DirtyRowBytes() const { return dirty_rows() * (4 + row_width_ * 4); }
  // Calls fn(head, slot, row) for every dirty slot, in slot order.
  template <typename Fn>
  void ForEachDirtyRow(Fn&& fn) const {
    std::vector<uint32_t> order = dirty_;
    std::sort(order.begin(), order.end());
    for (uint32_t i : order)
      fn(i / slots_per_head_, i % slots_per_head_, Row(i / slots_per_head_, i % slots_per_head_));
  }
  // Forgets the dirty rows and the write journal.
  void ClearDirty();

  // Write journal (docs/state-format.md, "Delta log"). While the layout's sdm_write.record is
  // on, the engine records every delta-rule write with its inputs (JournalWrite, after the
  // MutableRow calls for its rows), so that a delta can carry what the turns did — per token and
  // head the W slot ids, W weights, the decays, beta and the hd values — instead of the rows
  // they left (W rows of hd floats). ApplyJournal() runs such records through sdm_write.apply:
  // the engine's function on the same inputs and rows, so the same bits.
  //
  // The journal is complete — replayed over the state as of the last ClearDirty(), it rebuilds
  // every row written since — only if every row MutableRow() handed out since was for a
  // journaled write and no row was restored. It is dropped (and stays incomplete until the next
  // ClearDirty) once it would outgrow the dirty rows, whose delta is then the smaller.
  //
  // One record: u32 head | i32 slot x W | f32 k x W | f32 alpha x alphas | f32 beta |
  // f32 value x row_width (little-endian, as in memory).
  void JournalWrite(int64_t head, std::span<const int32_t> slots, std::span<const float> k,
                    std::span<const float> alpha, float beta, const float* v);
  bool journal_complete() const {
    return write_spec_.record && !journal_dropped_ && journaled_rows_ == handed_out_rows_;
  }
  absl::string_view journal() const { return journal_; }
  int64_t journal_records() const { return journal_records_; }
  const SdmWriteSpec& write_spec() const { return write_spec_; }
  int64_t JournalRecordBytes() const {
    return 4 + 8 * write_spec_.writes + 4 * write_spec_.alphas + 4 + 4 * row_width_;
  }
  // Applies `count` records (laid out as journal() holds them) in order, each through
  // MutableRow() and sdm_write.apply. Errors: Unimplemented without an apply function,
  // DataLoss for records that do not fit the table (the table may then be partly written),
  // ResourceExhausted when the pool runs out.
  absl::Status ApplyJournal(absl::string_view records, int64_t count);

 private:
  void ReleaseAll();
  void DropJournal();

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
  // The write journal (see JournalWrite), reset by ClearDirty().
  SdmWriteSpec write_spec_;
  std::string journal_;
  int64_t journal_records_ = 0;
  int64_t journaled_rows_ = 0;   // W per record
  int64_t handed_out_rows_ = 0;  // MutableRow() calls
  bool journal_dropped_ = false;
};

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_SDM_TABLE_H_
