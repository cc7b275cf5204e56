#include "state_store/sdm_table.h"

#include <algorithm>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/check.h"

namespace sdm {

SdmTable::SdmTable(const LayerStateLayout& layout)
    : heads_(layout.sdm_heads),
      slots_per_head_(layout.slots_per_head),
      row_width_(layout.row_width),
      m0_(layout.m0),
      pool_(layout.row_pool),
      zeros_(layout.m0 ? 0 : layout.row_width, 0.0f),
      slot_to_row_(layout.sdm_heads * layout.slots_per_head, -1),
      write_spec_(layout.sdm_write) {
  SDM_CHECK(pool_ != nullptr && pool_->row_width() == row_width_);
  if (write_spec_.apply == nullptr) write_spec_.record = false;
}

SdmTable::~SdmTable() { ReleaseAll(); }

SdmTable::SdmTable(SdmTable&& o) noexcept
    : heads_(o.heads_),
      slots_per_head_(o.slots_per_head_),
      row_width_(o.row_width_),
      m0_(std::move(o.m0_)),
      pool_(o.pool_),
      zeros_(std::move(o.zeros_)),
      slot_to_row_(std::move(o.slot_to_row_)),
      num_rows_(o.num_rows_),
      dirty_bits_(std::move(o.dirty_bits_)),
      dirty_(std::move(o.dirty_)),
      write_spec_(o.write_spec_),
      journal_(std::move(o.journal_)),
      journal_records_(o.journal_records_),
      journaled_rows_(o.journaled_rows_),
      handed_out_rows_(o.handed_out_rows_),
      journal_dropped_(o.journal_dropped_) {
  o.slot_to_row_.clear();
  o.num_rows_ = 0;
}

SdmTable& SdmTable::operator=(SdmTable&& o) noexcept {
  if (this != &o) {
    ReleaseAll();
    heads_ = o.heads_;
    slots_per_head_ = o.slots_per_head_;
    row_width_ = o.row_width_;
    m0_ = std::move(o.m0_);
    pool_ = o.pool_;
    zeros_ = std::move(o.zeros_);
    slot_to_row_ = std::move(o.slot_to_row_);
    num_rows_ = o.num_rows_;
    dirty_bits_ = std::move(o.dirty_bits_);
    dirty_ = std::move(o.dirty_);
    write_spec_ = o.write_spec_;
    journal_ = std::move(o.journal_);
    journal_records_ = o.journal_records_;
    journaled_rows_ = o.journaled_rows_;
    handed_out_rows_ = o.handed_out_rows_;
    journal_dropped_ = o.journal_dropped_;
    o.slot_to_row_.clear();
    o.num_rows_ = 0;
  }
  return *this;
}

void SdmTable::ReleaseAll() {
  for (int32_t& r : slot_to_row_) {
    if (r >= 0) pool_->Release(r);
    r = -1;
  }
  num_rows_ = 0;
}

void SdmTable::ClearDirty() {
  for (uint32_t i : dirty_) dirty_bits_[i / 64] &= ~(uint64_t{1} << (i % 64));
  dirty_.clear();
  journal_.clear();  // the capacity stays: the next turn's records are about as many
  journal_records_ = 0;
  journaled_rows_ = 0;
  handed_out_rows_ = 0;
  journal_dropped_ = false;
}

void SdmTable::DropJournal() {
  journal_dropped_ = true;
  journal_.clear();
  journal_.shrink_to_fit();
  journal_records_ = 0;
}

void SdmTable::JournalWrite(int64_t head, std::span<const int32_t> slots, std::span<const float> k,
                            std::span<const float> alpha, float beta, const float* v) {
  if (!write_spec_.record || journal_dropped_) return;
  SDM_CHECK(static_cast<int64_t>(slots.size()) == write_spec_.writes &&
            static_cast<int64_t>(k.size()) == write_spec_.writes &&
            static_cast<int64_t>(alpha.size()) == write_spec_.alphas);
  journaled_rows_ += write_spec_.writes;
  const uint64_t record = static_cast<uint64_t>(JournalRecordBytes());
  if (journal_.size() + record > static_cast<uint64_t>(DirtyRowBytes())) {
    DropJournal();
    return;
  }
  const uint32_t h = static_cast<uint32_t>(head);
  journal_.append(reinterpret_cast<const char*>(&h), 4);
  journal_.append(reinterpret_cast<const char*>(slots.data()), slots.size_bytes());
  journal_.append(reinterpret_cast<const char*>(k.data()), k.size_bytes());
  journal_.append(reinterpret_cast<const char*>(alpha.data()), alpha.size_bytes());
  journal_.append(reinterpret_cast<const char*>(&beta), 4);
  journal_.append(reinterpret_cast<const char*>(v), row_width_ * sizeof(float));
  ++journal_records_;
}

absl::Status SdmTable::ApplyJournal(absl::string_view records, int64_t count) {
  if (write_spec_.apply == nullptr) {
    // Not FAILED_PRECONDITION: a log replay treats that as a stale log and drops it.
    return absl::UnimplementedError(
        "this build cannot apply journaled SDM writes (its state layout has no write function)");
  }
  const int64_t w = write_spec_.writes;
  const int64_t record = JournalRecordBytes();
  if (count < 0 || records.size() % record != 0 ||
      static_cast<uint64_t>(count) != records.size() / record) {
    return absl::DataLossError("SDM write journal: records do not fit");
  }
  std::vector<int32_t> slots(w);
  std::vector<float> k(w), alpha(write_spec_.alphas), v(row_width_);
  std::vector<float*> rows(w);
  float beta = 0.0f;
  for (int64_t i = 0; i < count; ++i) {
    const char* p = records.data() + i * record;
    uint32_t head = 0;
    std::memcpy(&head, p, 4);
    p += 4;
    std::memcpy(slots.data(), p, w * 4);
    p += w * 4;
    std::memcpy(k.data(), p, w * 4);
    p += w * 4;
    std::memcpy(alpha.data(), p, alpha.size() * 4);
    p += alpha.size() * 4;
    std::memcpy(&beta, p, 4);
    p += 4;
    std::memcpy(v.data(), p, row_width_ * 4);
    if (head >= heads_) return absl::DataLossError("SDM write journal: head out of range");
    for (int64_t j = 0; j < w; ++j) {
      if (slots[j] < 0 || slots[j] >= slots_per_head_) {
        return absl::DataLossError("SDM write journal: slot out of range");
      }
      rows[j] = MutableRow(head, slots[j]);
      if (rows[j] == nullptr) return absl::ResourceExhaustedError("the SDM row pool is exhausted");
    }
    write_spec_.apply(rows, k, alpha, beta, v.data(), row_width_, write_spec_.rule);
  }
  return absl::OkStatus();
}

float* SdmTable::MutableRow(int64_t head, int64_t slot) {
  const int64_t index = head * slots_per_head_ + slot;
  int32_t& r = slot_to_row_[index];
  ++handed_out_rows_;
  // Marked before the row is returned (the caller writes it): a delta never misses a write.
  if (dirty_bits_.empty()) dirty_bits_.assign((slot_to_row_.size() + 63) / 64, 0);
  uint64_t& word = dirty_bits_[index / 64];
  const uint64_t bit = uint64_t{1} << (index % 64);
  if ((word & bit) == 0) {
    word |= bit;
    dirty_.push_back(static_cast<uint32_t>(index));
  }
  if (r >= 0 && pool_->RefCount(r) == 1) return pool_->Row(r);
  const int32_t fresh = pool_->Allocate();
  if (fresh < 0) return nullptr;
  float* row = pool_->Row(fresh);
  if (r >= 0) {
    // Shared with a fork: copy, then drop this table's reference to the shared row.
    std::memcpy(row, pool_->Row(r), row_width_ * sizeof(float));
    pool_->Release(r);
  } else {
    if (m0_) {
      std::memcpy(row, m0_.get() + (head * slots_per_head_ + slot) * row_width_,
                  row_width_ * sizeof(float));
    } else {
      std::fill(row, row + row_width_, 0.0f);
    }
    ++num_rows_;
  }
  r = fresh;
  return row;
}

int64_t SdmTable::SharedRows() const {
  int64_t n = 0;
  for (int32_t r : slot_to_row_) n += (r >= 0 && pool_->RefCount(r) > 1);
  return n;
}

SdmTable SdmTable::Fork() const {
  LayerStateLayout l;
  l.kind = LayerStateLayout::Kind::kSdm;
  l.sdm_heads = heads_;
  l.slots_per_head = slots_per_head_;
  l.row_width = row_width_;
  l.m0 = m0_;
  l.row_pool = pool_;
  l.sdm_write = write_spec_;
  SdmTable copy(l);
  copy.slot_to_row_ = slot_to_row_;
  copy.num_rows_ = num_rows_;
  for (int32_t r : slot_to_row_) {
    if (r >= 0) pool_->AddRef(r);
  }
  return copy;
}

SdmTable SdmTable::Clone() const {
  SdmTable copy = Fork();
  for (int32_t& r : copy.slot_to_row_) {
    if (r < 0) continue;
    const int32_t fresh = pool_->Allocate();
    SDM_CHECK(fresh >= 0);
    std::memcpy(pool_->Row(fresh), pool_->Row(r), row_width_ * sizeof(float));
    pool_->Release(r);
    r = fresh;
  }
  return copy;
}

absl::Status SdmTable::RestoreRow(int64_t head, int64_t slot, std::span<const float> values) {
  if (head < 0 || head >= heads_ || slot < 0 || slot >= slots_per_head_) {
    return absl::InvalidArgumentError(
        absl::StrCat("row (head ", head, ", slot ", slot, ") is outside the table"));
  }
  if (static_cast<int64_t>(values.size()) != row_width_) {
    return absl::InvalidArgumentError("row width does not match the table");
  }
  int32_t& r = slot_to_row_[head * slots_per_head_ + slot];
  if (r >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("slot ", slot, " of head ", head, " appears twice"));
  }
  const int32_t fresh = pool_->Allocate();
  if (fresh < 0) return absl::ResourceExhaustedError("the SDM row pool is exhausted");
  // A row the journal does not know of (restoring a table, or a device's copy coming back).
  if (write_spec_.record && !journal_dropped_) DropJournal();
  std::memcpy(pool_->Row(fresh), values.data(), row_width_ * sizeof(float));
  r = fresh;
  ++num_rows_;
  return absl::OkStatus();
}

}  // namespace sdm
