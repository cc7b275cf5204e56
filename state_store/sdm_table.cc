#include "state_store/sdm_table.h"

#include <algorithm>
#include <cstring>

namespace sdm {

SdmTable::SdmTable(const LayerStateLayout& layout)
    : SdmTable(layout.sdm_heads, layout.slots_per_head, layout.row_width, layout.m0) {}

SdmTable::SdmTable(int64_t heads, int64_t slots_per_head, int64_t row_width,
                   std::shared_ptr<const float> m0)
    : heads_(heads),
      slots_per_head_(slots_per_head),
      row_width_(row_width),
      m0_(std::move(m0)),
      zeros_(m0_ ? 0 : row_width, 0.0f),
      slot_to_row_(heads * slots_per_head, -1) {}

SdmTable SdmTable::Clone() const {
  SdmTable copy(heads_, slots_per_head_, row_width_, m0_);
  copy.slot_to_row_ = slot_to_row_;
  copy.num_rows_ = num_rows_;
  for (const auto& chunk : chunks_) {
    copy.chunks_.push_back(std::make_unique<float[]>(kRowsPerChunk * row_width_));
    std::copy(chunk.get(), chunk.get() + kRowsPerChunk * row_width_, copy.chunks_.back().get());
  }
  return copy;
}

float* SdmTable::MutableRow(int64_t head, int64_t slot) {
  int32_t& r = slot_to_row_[head * slots_per_head_ + slot];
  if (r < 0) {
    if (num_rows_ % kRowsPerChunk == 0) {
      chunks_.push_back(std::make_unique<float[]>(kRowsPerChunk * row_width_));
    }
    r = static_cast<int32_t>(num_rows_++);
    float* row = chunks_[r / kRowsPerChunk].get() + (r % kRowsPerChunk) * row_width_;
    if (m0_) {
      std::memcpy(row, m0_.get() + (head * slots_per_head_ + slot) * row_width_,
                  row_width_ * sizeof(float));
    } else {
      std::fill(row, row + row_width_, 0.0f);
    }
    return row;
  }
  return chunks_[r / kRowsPerChunk].get() + (r % kRowsPerChunk) * row_width_;
}

int64_t SdmTable::ResidentBytes() const {
  return static_cast<int64_t>(chunks_.size()) * kRowsPerChunk * row_width_ *
             static_cast<int64_t>(sizeof(float)) +
         static_cast<int64_t>(slot_to_row_.size() * sizeof(int32_t));
}

}  // namespace sdm
