// One session's memory for one SDM layer: per head, s^2 rows of hd floats, held copy-on-write
// over the model's shared initial memory M0 (design brief §4).
//
// A slot that was never written reads M0 (or zeros when the model has no learned memory). The
// first write to a slot gives it a private row, initialised from M0; later writes update that
// row in place. So a session's private bytes are (distinct slots written) x hd x 4, not the
// table's full size. Row pointers stay valid until the table is destroyed (rows never move).
//
// Not thread-safe; one session is used by one thread at a time.
#ifndef SDMSERVE_STATE_STORE_SDM_TABLE_H_
#define SDMSERVE_STATE_STORE_SDM_TABLE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "state_store/state_layout.h"

namespace sdm {

class SdmTable {
 public:
  explicit SdmTable(const LayerStateLayout& layout);
  SdmTable(int64_t heads, int64_t slots_per_head, int64_t row_width,
           std::shared_ptr<const float> m0);
  SdmTable(const SdmTable&) = delete;
  SdmTable& operator=(const SdmTable&) = delete;
  SdmTable(SdmTable&&) = default;
  SdmTable& operator=(SdmTable&&) = default;

  int64_t heads() const { return heads_; }
  int64_t slots_per_head() const { return slots_per_head_; }
  int64_t row_width() const { return row_width_; }

  // The current row of (head, slot): private if written, else M0's (or a zero row).
  const float* Row(int64_t head, int64_t slot) const {
    const int32_t r = slot_to_row_[head * slots_per_head_ + slot];
    if (r >= 0) return PrivateRow(r);
    return m0_ ? m0_.get() + (head * slots_per_head_ + slot) * row_width_ : zeros_.data();
  }

  // A writable row for (head, slot), copied from M0 on first use.
  float* MutableRow(int64_t head, int64_t slot);

  bool IsPrivate(int64_t head, int64_t slot) const {
    return slot_to_row_[head * slots_per_head_ + slot] >= 0;
  }
  int64_t private_rows() const { return num_rows_; }
  // Bytes this session holds for the layer: private rows plus the slot->row table.
  int64_t ResidentBytes() const;

  // A deep copy of the private rows and table (M0 stays shared).
  SdmTable Clone() const;

 private:
  static constexpr int64_t kRowsPerChunk = 64;
  const float* PrivateRow(int32_t r) const {
    return chunks_[r / kRowsPerChunk].get() + (r % kRowsPerChunk) * row_width_;
  }

  int64_t heads_;
  int64_t slots_per_head_;
  int64_t row_width_;
  std::shared_ptr<const float> m0_;
  std::vector<float> zeros_;          // the row every unwritten slot reads when M0 is null
  std::vector<int32_t> slot_to_row_;  // [heads * slots_per_head], -1 = reads M0
  std::vector<std::unique_ptr<float[]>> chunks_;
  int64_t num_rows_ = 0;
};

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_SDM_TABLE_H_
