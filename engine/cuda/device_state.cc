#include "engine/cuda/device_state.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "kernels/common/device_layout.h"

namespace sdm {
namespace {

namespace kc = kernels::cuda;
using bf16 = __nv_bfloat16;

bool IsSdm(const LayerStateLayout& l) { return l.kind == LayerStateLayout::Kind::kSdm; }

int64_t SlotsOf(const LayerStateLayout& l) { return l.sdm_heads * l.slots_per_head; }

}  // namespace

absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  if (err == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(
        absl::StrCat("out of device memory in ", what, ": ", kc::CudaErrorText(err)));
  }
  return absl::InternalError(absl::StrCat("CUDA error in ", what, ": ", kc::CudaErrorText(err)));
}

absl::StatusOr<std::shared_ptr<CudaDeviceContext>> CudaDeviceContext::Create(
    const StateLayout& layout, const DeviceStateSizes& sizes, std::vector<const bf16*> m0) {
  std::shared_ptr<CudaDeviceContext> ctx(new CudaDeviceContext(layout, sizes));
  // Nothing else sees ctx yet; the lock only lets the thread-safety analysis check the writes.
  absl::MutexLock init_lock(&ctx->mu_);
  SDM_RETURN_IF_ERROR(CudaStatus(ctx->compute_.Create(), "creating the compute stream"));
  SDM_RETURN_IF_ERROR(CudaStatus(ctx->transfer_.Create(), "creating the transfer stream"));
  const int64_t n_layers = static_cast<int64_t>(layout.layers.size());
  ctx->m0_ = std::move(m0);
  ctx->m0_.resize(n_layers, nullptr);
  ctx->sdm_index_.assign(n_layers, -1);
  ctx->kv_pools_.resize(n_layers);
  ctx->free_pages_.resize(n_layers);
  for (int64_t l = 0; l < n_layers; ++l) {
    const LayerStateLayout& ls = layout.layers[l];
    if (IsSdm(ls)) {
      ctx->sdm_index_[l] = ctx->num_sdm_layers_++;
      ctx->row_width_ = ls.row_width;
    } else if (l < static_cast<int64_t>(sizes.kv_pages.size()) && sizes.kv_pages[l] > 0) {
      const int64_t pages = sizes.kv_pages[l];
      SDM_RETURN_IF_ERROR(
          CudaStatus(ctx->kv_pools_[l].Allocate(pages * kernels::KvPageElements(ls.kv_row_width)),
                     "allocating a KV page arena"));
      std::vector<int32_t>& free = ctx->free_pages_[l];
      free.resize(pages);
      // Popped from the back: hand out low pages first.
      for (int64_t i = 0; i < pages; ++i) free[i] = static_cast<int32_t>(pages - 1 - i);
    }
  }
  if (ctx->num_sdm_layers_ > 0 && sizes.sdm_rows > 0) {
    SDM_RETURN_IF_ERROR(CudaStatus(ctx->rows_.Allocate(sizes.sdm_rows * ctx->row_width_),
                                   "allocating the SDM row arena"));
    SDM_RETURN_IF_ERROR(
        CudaStatus(ctx->free_list_.Allocate(sizes.sdm_rows), "allocating the row free list"));
    SDM_RETURN_IF_ERROR(CudaStatus(ctx->free_count_.Allocate(1), "allocating the row free count"));
    SDM_RETURN_IF_ERROR(
        CudaStatus(kc::SdmInitFreeList(ctx->row_arena(), sizes.sdm_rows, ctx->compute()),
                   "initialising the row free list"));
    ctx->free_rows_ = sizes.sdm_rows;
  }
  const int64_t counters = sizes.max_sessions * std::max<int64_t>(1, ctx->num_sdm_layers_);
  SDM_RETURN_IF_ERROR(CudaStatus(ctx->counters_.Allocate(counters), "allocating row counters"));
  SDM_RETURN_IF_ERROR(CudaStatus(
      cudaMemsetAsync(ctx->counters_.get(), 0, counters * sizeof(int32_t), ctx->compute()),
      "clearing row counters"));
  SDM_RETURN_IF_ERROR(
      CudaStatus(ctx->counters_host_.Allocate(counters), "allocating pinned counters"));
  SDM_RETURN_IF_ERROR(
      CudaStatus(ctx->free_count_host_.Allocate(1), "allocating the pinned free count"));
  ctx->counters_published_.assign(counters, 0);
  ctx->free_slots_.resize(sizes.max_sessions);
  for (int64_t i = 0; i < sizes.max_sessions; ++i) {
    ctx->free_slots_[i] = static_cast<int32_t>(sizes.max_sessions - 1 - i);
  }
  SDM_RETURN_IF_ERROR(
      CudaStatus(cudaStreamSynchronize(ctx->compute()), "initialising device state"));
  return ctx;
}

kc::SdmRowArena CudaDeviceContext::row_arena() const {
  kc::SdmRowArena a;
  a.rows = rows_.get();
  a.free_list = free_list_.get();
  a.free_count = free_count_.get();
  a.row_width = row_width_;
  a.capacity = sizes_.sdm_rows;
  return a;
}

kc::KvLayerView CudaDeviceContext::kv_arena(int64_t layer) const {
  const LayerStateLayout& ls = layout_.layers[layer];
  kc::KvLayerView v;
  v.pool = kv_pools_[layer].get();
  v.kv_width = ls.kv_row_width;
  v.ring_pages = ls.ring_capacity > 0 ? kernels::KvRingPages(ls.ring_capacity) : 0;
  return v;
}

int64_t CudaDeviceContext::page_table_entries(int64_t layer) const {
  const LayerStateLayout& ls = layout_.layers[layer];
  if (ls.ring_capacity > 0) return kernels::KvRingPages(ls.ring_capacity);
  return (sizes_.max_context + kernels::kKvPageTokens - 1) / kernels::kKvPageTokens;
}

int64_t CudaDeviceContext::page_bytes(int64_t layer) const {
  return kernels::KvPageElements(layout_.layers[layer].kv_row_width) *
         static_cast<int64_t>(sizeof(bf16));
}

absl::StatusOr<int32_t> CudaDeviceContext::AllocatePage(int64_t layer) {
  absl::MutexLock lock(&mu_);
  std::vector<int32_t>& free = free_pages_[layer];
  if (free.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "device KV memory is full (layer ", layer, ": ", sizes_.kv_pages[layer],
        " pages); park idle sessions (lower the resident budget) or raise --device_state_bytes"));
  }
  const int32_t page = free.back();
  free.pop_back();
  return page;
}

void CudaDeviceContext::FreePages(int64_t layer, const std::vector<int32_t>& pages) {
  absl::MutexLock lock(&mu_);
  free_pages_[layer].insert(free_pages_[layer].end(), pages.begin(), pages.end());
}

absl::StatusOr<int32_t> CudaDeviceContext::AllocateCounterSlot() {
  absl::MutexLock lock(&mu_);
  if (free_slots_.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("more than ", sizes_.max_sessions, " sessions resident on the device"));
  }
  const int32_t slot = free_slots_.back();
  free_slots_.pop_back();
  return slot;
}

void CudaDeviceContext::FreeCounterSlot(int32_t slot) {
  absl::MutexLock lock(&mu_);
  for (int64_t i = 0; i < std::max<int64_t>(1, num_sdm_layers_); ++i) {
    counters_published_[slot * std::max<int64_t>(1, num_sdm_layers_) + i] = 0;
  }
  free_slots_.push_back(slot);
}

int32_t* CudaDeviceContext::row_counter(int32_t slot, int64_t sdm_index) const {
  return counters_.get() + slot * std::max<int64_t>(1, num_sdm_layers_) + sdm_index;
}

int32_t CudaDeviceContext::row_count(int32_t slot, int64_t sdm_index) const {
  absl::MutexLock lock(&mu_);
  return counters_published_[slot * std::max<int64_t>(1, num_sdm_layers_) + sdm_index];
}

int64_t CudaDeviceContext::free_rows_lower_bound() const {
  absl::MutexLock lock(&mu_);
  return free_rows_;
}

absl::Status CudaDeviceContext::ReserveRows(int64_t rows) {
  {
    absl::MutexLock lock(&mu_);
    if (rows <= free_rows_) {
      free_rows_ -= rows;
      return absl::OkStatus();
    }
  }
  // The bound is stale after sessions were released (parked, deleted) since the last step's
  // refresh; without this re-read a step that fails here could never succeed again, however
  // many sessions the store parks. No allocation is pending (see the header), so once the
  // compute stream is idle the device count is exact. cudaMemcpy runs on the legacy stream,
  // which does not wait for the non-blocking compute stream: hence the synchronisation first.
  int32_t device_free = 0;
  if (free_count_.get() != nullptr) {
    SDM_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(compute()), "waiting for released rows"));
    SDM_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpy(&device_free, free_count_.get(), sizeof(int32_t), cudaMemcpyDeviceToHost),
        "reading the free row count"));
  }
  absl::MutexLock lock(&mu_);
  SDM_RETURN_IF_ERROR(CheckFreeCount(device_free));
  free_rows_ = device_free;
  if (rows > free_rows_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "device SDM row memory is full (", free_rows_, " rows free of ", sizes_.sdm_rows,
        ", this step may need ", rows,
        "); park idle sessions (lower the resident budget) or raise --device_state_bytes"));
  }
  free_rows_ -= rows;
  return absl::OkStatus();
}

absl::Status CudaDeviceContext::StartRefresh() {
  if (free_count_.get() != nullptr) {
    SDM_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(free_count_host_.get(), free_count_.get(), sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, compute()),
                   "reading the free row count"));
  }
  SDM_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(counters_host_.get(), counters_.get(), counters_.bytes(),
                                 cudaMemcpyDeviceToHost, compute()),
                 "reading the row counters"));
  return absl::OkStatus();
}

absl::Status CudaDeviceContext::CheckFreeCount(int64_t device_free) {
  if (device_free >= 0 && device_free <= sizes_.sdm_rows) return free_list_error_;
  if (free_list_error_.ok()) {
    free_list_error_ = absl::InternalError(absl::StrCat(
        "the device SDM row free list is corrupt (count ", device_free, " of ", sizes_.sdm_rows,
        " rows): rows were taken or returned twice; restart the server (sessions on the device "
        "are lost, parked ones are intact)"));
    SDM_LOG(ERROR) << "sdm cuda: " << free_list_error_;
  }
  return free_list_error_;
}

void CudaDeviceContext::FinishRefresh() {
  absl::MutexLock lock(&mu_);
  if (free_count_.get() != nullptr) {
    const int32_t device_free = *free_count_host_.get();
    // Out of range: ReserveRows() fails from now on, loudly (the error is logged once).
    if (CheckFreeCount(device_free).ok()) free_rows_ = device_free;
  }
  std::memcpy(counters_published_.data(), counters_host_.get(), counters_.bytes());
}

// ---------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<CudaSessionState>> CudaSessionState::Upload(
    std::shared_ptr<CudaDeviceContext> ctx, const SessionState& host) {
  std::unique_ptr<CudaSessionState> s(new CudaSessionState(ctx));
  absl::StatusOr<int32_t> slot = ctx->AllocateCounterSlot();
  if (!slot.ok()) return slot.status();
  s->counter_slot_ = *slot;
  const StateLayout& layout = ctx->layout();
  const int64_t n_layers = static_cast<int64_t>(layout.layers.size());
  s->layers_.resize(n_layers);

  // Pass 1: tables, pages and the host images of what moves (bf16, pinned).
  struct SdmUpload {
    int64_t layer;
    std::vector<int32_t> slot_ids;
    int64_t offset;  // in rows, into the staging image
  };
  struct PageUpload {
    int64_t layer;
    int32_t page;
    int64_t offset;  // in elements, into the staging image
  };
  std::vector<SdmUpload> sdm_uploads;
  std::vector<PageUpload> page_uploads;
  int64_t staging_elems = 0;
  for (int64_t l = 0; l < n_layers; ++l) {
    const LayerStateLayout& ls = layout.layers[l];
    Layer& layer = s->layers_[l];
    if (IsSdm(ls)) {
      SDM_RETURN_IF_ERROR(
          CudaStatus(layer.table.Allocate(SlotsOf(ls)), "allocating an SDM slot table"));
      // 0xff bytes make every entry kSdmNoRow (-1).
      SDM_RETURN_IF_ERROR(
          CudaStatus(cudaMemsetAsync(layer.table.get(), 0xff, layer.table.bytes(), ctx->compute()),
                     "clearing an SDM slot table"));
      SdmUpload up{l, {}, staging_elems / ls.row_width};
      host.sdm(l).ForEachPrivateRow([&](int64_t head, int64_t slot, const float*) {
        up.slot_ids.push_back(static_cast<int32_t>(head * ls.slots_per_head + slot));
      });
      staging_elems += static_cast<int64_t>(up.slot_ids.size()) * ls.row_width;
      sdm_uploads.push_back(std::move(up));
    } else {
      SDM_RETURN_IF_ERROR(
          CudaStatus(layer.table.Allocate(ctx->page_table_entries(l)), "allocating a page table"));
      layer.pages.reserve(ctx->page_table_entries(l));
    }
  }
  if (auto st = s->EnsurePages(host.position()); !st.ok()) return st;
  for (int64_t l = 0; l < n_layers; ++l) {
    const LayerStateLayout& ls = layout.layers[l];
    if (IsSdm(ls)) continue;
    for (int32_t page : s->layers_[l].pages) {
      page_uploads.push_back({l, page, staging_elems});
      staging_elems += kernels::KvPageElements(ls.kv_row_width);
    }
  }
  int64_t total_rows = 0;
  for (const SdmUpload& up : sdm_uploads) total_rows += static_cast<int64_t>(up.slot_ids.size());
  if (total_rows > 0) {
    if (auto st = ctx->ReserveRows(total_rows); !st.ok()) return st;
  }
  if (staging_elems == 0) return s;

  kc::PinnedBuffer<bf16> staging;
  SDM_RETURN_IF_ERROR(
      CudaStatus(staging.Allocate(staging_elems), "allocating pinned upload staging"));
  for (const SdmUpload& up : sdm_uploads) {
    const int64_t w = layout.layers[up.layer].row_width;
    bf16* dst = staging.get() + up.offset * w;
    host.sdm(up.layer).ForEachPrivateRow([&](int64_t, int64_t, const float* row) {
      for (int64_t c = 0; c < w; ++c) dst[c] = __float2bfloat16_rn(row[c]);
      dst += w;
    });
  }
  for (const PageUpload& up : page_uploads) {
    std::memset(static_cast<void*>(staging.get() + up.offset), 0,
                kernels::KvPageElements(layout.layers[up.layer].kv_row_width) * sizeof(bf16));
  }
  // Fill each held position's key and value rows into its page's image.
  for (int64_t l = 0; l < n_layers; ++l) {
    const LayerStateLayout& ls = layout.layers[l];
    if (IsSdm(ls)) continue;
    const KvCache& kv = host.kv(l);
    const int32_t ring = ls.ring_capacity > 0 ? kernels::KvRingPages(ls.ring_capacity) : 0;
    int64_t first_upload = 0;
    while (first_upload < static_cast<int64_t>(page_uploads.size()) &&
           page_uploads[first_upload].layer != l) {
      ++first_upload;
    }
    for (int64_t pos = kv.first_position(); pos < kv.length(); ++pos) {
      const int64_t entry = kernels::KvPageTableIndex(pos, ring);
      const PageUpload& up = page_uploads[first_upload + entry];
      for (int value = 0; value < 2; ++value) {
        const float* src = value ? kv.ValueRow(pos) : kv.KeyRow(pos);
        bf16* dst =
            staging.get() + up.offset + kernels::KvRowOffset(0, pos, ls.kv_row_width, value != 0);
        for (int64_t c = 0; c < ls.kv_row_width; ++c) dst[c] = __float2bfloat16_rn(src[c]);
      }
    }
  }

  // Bulk copies on the transfer stream; the compute stream waits for them before the scatter.
  kc::DeviceBuffer<bf16> row_staging;
  kc::DeviceBuffer<int32_t> slot_ids;
  if (total_rows > 0) {
    SDM_RETURN_IF_ERROR(CudaStatus(row_staging.Allocate(total_rows * ctx->row_arena().row_width),
                                   "allocating row upload staging"));
    SDM_RETURN_IF_ERROR(
        CudaStatus(slot_ids.Allocate(total_rows), "allocating slot upload staging"));
  }
  std::vector<int32_t> all_slots;
  for (const SdmUpload& up : sdm_uploads) {
    all_slots.insert(all_slots.end(), up.slot_ids.begin(), up.slot_ids.end());
  }
  if (total_rows > 0) {
    SDM_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(row_staging.get(), staging.get(), row_staging.bytes(),
                                   cudaMemcpyHostToDevice, ctx->transfer()),
                   "uploading SDM rows"));
    SDM_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(slot_ids.get(), all_slots.data(), slot_ids.bytes(),
                                   cudaMemcpyHostToDevice, ctx->transfer()),
                   "uploading SDM slot ids"));
  }
  for (const PageUpload& up : page_uploads) {
    const kc::KvLayerView arena = ctx->kv_arena(up.layer);
    SDM_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(arena.pool + kernels::KvRowOffset(up.page, 0, arena.kv_width, false),
                        staging.get() + up.offset, ctx->page_bytes(up.layer),
                        cudaMemcpyHostToDevice, ctx->transfer()),
        "uploading KV pages"));
  }
  kc::CudaEvent uploaded;
  SDM_RETURN_IF_ERROR(CudaStatus(uploaded.Create(), "creating an event"));
  SDM_RETURN_IF_ERROR(
      CudaStatus(cudaEventRecord(uploaded.get(), ctx->transfer()), "recording an event"));
  SDM_RETURN_IF_ERROR(
      CudaStatus(cudaStreamWaitEvent(ctx->compute(), uploaded.get(), 0), "ordering streams"));
  for (const SdmUpload& up : sdm_uploads) {
    if (up.slot_ids.empty()) continue;
    const int64_t count = static_cast<int64_t>(up.slot_ids.size());
    const int64_t w = layout.layers[up.layer].row_width;
    SDM_RETURN_IF_ERROR(CudaStatus(
        kc::SdmScatterRows(row_staging.get() + up.offset * w, slot_ids.get() + up.offset, count,
                           s->layers_[up.layer].table.get(), ctx->row_arena(), ctx->compute()),
        "scattering uploaded rows"));
    const int32_t n = static_cast<int32_t>(count);
    SDM_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(ctx->row_counter(s->counter_slot_, ctx->sdm_index(up.layer)), &n,
                                   sizeof(int32_t), cudaMemcpyHostToDevice, ctx->compute()),
                   "setting a row counter"));
  }
  // The staging buffers die with this scope: wait for the copies (a resume is one upload of at
  // most the session's state; the next step would wait for it anyway).
  SDM_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(ctx->compute()), "uploading a session"));
  return s;
}

CudaSessionState::~CudaSessionState() {
  if (ctx_ == nullptr) return;
  const StateLayout& layout = ctx_->layout();
  for (int64_t l = 0; l < static_cast<int64_t>(layers_.size()); ++l) {
    Layer& layer = layers_[l];
    if (IsSdm(layout.layers[l])) {
      if (layer.table.get() != nullptr && ctx_->row_arena().rows != nullptr) {
        kc::SdmReleaseRows(layer.table.get(), SlotsOf(layout.layers[l]), ctx_->row_arena(),
                           ctx_->compute());
      }
    } else if (!layer.pages.empty()) {
      ctx_->FreePages(l, layer.pages);
    }
  }
  if (counter_slot_ >= 0) {
    const int64_t n = std::max<int64_t>(1, ctx_->num_sdm_layers());
    cudaMemsetAsync(ctx_->row_counter(counter_slot_, 0), 0, n * sizeof(int32_t), ctx_->compute());
  }
  // The release kernels read the tables this object frees: let them finish first.
  cudaStreamSynchronize(ctx_->compute());
  if (counter_slot_ >= 0) ctx_->FreeCounterSlot(counter_slot_);
}

absl::Status CudaSessionState::EnsurePages(int64_t end) {
  const StateLayout& layout = ctx_->layout();
  for (int64_t l = 0; l < static_cast<int64_t>(layers_.size()); ++l) {
    const LayerStateLayout& ls = layout.layers[l];
    if (IsSdm(ls) || end <= 0) continue;
    const int64_t entries = ctx_->page_table_entries(l);
    const int64_t logical = (end - 1) / kernels::kKvPageTokens + 1;
    if (ls.ring_capacity == 0 && logical > entries) {
      return absl::OutOfRangeError(absl::StrCat("position ", end - 1,
                                                " is past the engine's max_context of ",
                                                ctx_->sizes().max_context, " tokens"));
    }
    const int64_t needed = std::min(logical, entries);
    Layer& layer = layers_[l];
    const int64_t have = static_cast<int64_t>(layer.pages.size());
    if (have >= needed) continue;
    for (int64_t i = have; i < needed; ++i) {
      absl::StatusOr<int32_t> page = ctx_->AllocatePage(l);
      if (!page.ok()) {
        // Give back this call's pages: the mirror must only hold pages the device table has
        // (a retry starts copying at pages.size(), so kept pages would stay garbage entries).
        ctx_->FreePages(l, std::vector<int32_t>(layer.pages.begin() + have, layer.pages.end()));
        layer.pages.resize(have);
        return page.status();
      }
      layer.pages.push_back(*page);
    }
    // The mirror never reallocates (reserved to `entries`), and entries once written never
    // change, so the copy may read it after this returns.
    SDM_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(layer.table.get() + have, layer.pages.data() + have,
                        (needed - have) * sizeof(int32_t), cudaMemcpyHostToDevice, ctx_->compute()),
        "updating a page table"));
  }
  return absl::OkStatus();
}

int64_t CudaSessionState::DeviceBytes() const {
  const StateLayout& layout = ctx_->layout();
  int64_t bytes = 0;
  for (int64_t l = 0; l < static_cast<int64_t>(layers_.size()); ++l) {
    const LayerStateLayout& ls = layout.layers[l];
    bytes += static_cast<int64_t>(layers_[l].table.bytes());
    if (IsSdm(ls)) {
      bytes += static_cast<int64_t>(ctx_->row_count(counter_slot_, ctx_->sdm_index(l))) *
               ls.row_width * static_cast<int64_t>(sizeof(bf16));
    } else {
      bytes += static_cast<int64_t>(layers_[l].pages.size()) * ctx_->page_bytes(l);
    }
  }
  return bytes;
}

absl::Status CudaSessionState::CopyToHost(SessionState& host) {
  const StateLayout& layout = ctx_->layout();
  const int64_t n_layers = static_cast<int64_t>(layers_.size());
  // Everything the compute stream did to this session so far happens before the copies.
  kc::CudaEvent computed;
  SDM_RETURN_IF_ERROR(CudaStatus(computed.Create(), "creating an event"));
  SDM_RETURN_IF_ERROR(
      CudaStatus(cudaEventRecord(computed.get(), ctx_->compute()), "recording an event"));
  SDM_RETURN_IF_ERROR(
      CudaStatus(cudaStreamWaitEvent(ctx_->transfer(), computed.get(), 0), "ordering streams"));
  cudaStream_t t = ctx_->transfer();

  // The SDM tables first: they say which rows to move.
  std::vector<kc::PinnedBuffer<int32_t>> tables(n_layers);
  for (int64_t l = 0; l < n_layers; ++l) {
    if (!IsSdm(layout.layers[l])) continue;
    SDM_RETURN_IF_ERROR(
        CudaStatus(tables[l].Allocate(layers_[l].table.size()), "allocating pinned tables"));
    SDM_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(tables[l].get(), layers_[l].table.get(),
                                   layers_[l].table.bytes(), cudaMemcpyDeviceToHost, t),
                   "downloading an SDM table"));
  }
  SDM_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(t), "downloading SDM tables"));
  struct RowDownload {
    int64_t layer, slot, offset;  // offset in rows into the staging image
  };
  std::vector<RowDownload> rows;
  std::vector<int32_t> row_ids;
  for (int64_t l = 0; l < n_layers; ++l) {
    if (!IsSdm(layout.layers[l])) continue;
    for (int64_t i = 0; i < static_cast<int64_t>(layers_[l].table.size()); ++i) {
      const int32_t r = tables[l].get()[i];
      if (r < 0) continue;
      rows.push_back({l, i, static_cast<int64_t>(row_ids.size())});
      row_ids.push_back(r);
    }
  }
  int64_t page_elems = 0;
  for (int64_t l = 0; l < n_layers; ++l) {
    if (IsSdm(layout.layers[l])) continue;
    page_elems += static_cast<int64_t>(layers_[l].pages.size()) *
                  kernels::KvPageElements(layout.layers[l].kv_row_width);
  }
  const int64_t row_width = ctx_->row_arena().row_width;
  const int64_t row_elems = static_cast<int64_t>(row_ids.size()) * row_width;
  kc::PinnedBuffer<bf16> staging;
  SDM_RETURN_IF_ERROR(
      CudaStatus(staging.Allocate(row_elems + page_elems), "allocating pinned staging"));
  kc::DeviceBuffer<int32_t> ids;
  kc::DeviceBuffer<bf16> gathered;
  if (!row_ids.empty()) {
    SDM_RETURN_IF_ERROR(CudaStatus(ids.Allocate(row_ids.size()), "allocating row ids"));
    SDM_RETURN_IF_ERROR(CudaStatus(gathered.Allocate(row_elems), "allocating gather staging"));
    SDM_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(ids.get(), row_ids.data(), ids.bytes(), cudaMemcpyHostToDevice, t),
        "uploading row ids"));
    SDM_RETURN_IF_ERROR(
        CudaStatus(kc::SdmGatherRows(ctx_->row_arena(), ids.get(),
                                     static_cast<int64_t>(row_ids.size()), gathered.get(), t),
                   "gathering rows"));
    SDM_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(staging.get(), gathered.get(), gathered.bytes(), cudaMemcpyDeviceToHost, t),
        "downloading rows"));
  }
  int64_t offset = row_elems;
  std::vector<std::vector<int64_t>> page_offsets(n_layers);
  for (int64_t l = 0; l < n_layers; ++l) {
    if (IsSdm(layout.layers[l])) continue;
    const kc::KvLayerView arena = ctx_->kv_arena(l);
    for (int32_t page : layers_[l].pages) {
      page_offsets[l].push_back(offset);
      SDM_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(staging.get() + offset,
                          arena.pool + kernels::KvRowOffset(page, 0, arena.kv_width, false),
                          ctx_->page_bytes(l), cudaMemcpyDeviceToHost, t),
          "downloading KV pages"));
      offset += kernels::KvPageElements(arena.kv_width);
    }
  }
  SDM_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(t), "downloading a session"));

  // Write the host layers. Host private rows are a subset of the device's (the device copy
  // started from them and only gains rows).
  std::vector<float> values(row_width);
  for (const RowDownload& d : rows) {
    const LayerStateLayout& ls = layout.layers[d.layer];
    const bf16* src = staging.get() + d.offset * row_width;
    for (int64_t c = 0; c < row_width; ++c) values[c] = __bfloat162float(src[c]);
    SdmTable& table = host.sdm(d.layer);
    const int64_t head = d.slot / ls.slots_per_head, slot = d.slot % ls.slots_per_head;
    if (table.IsPrivate(head, slot)) {
      float* row = table.MutableRow(head, slot);
      if (row == nullptr) return absl::ResourceExhaustedError("host row pool is exhausted");
      std::memcpy(row, values.data(), row_width * sizeof(float));
    } else if (auto st = table.RestoreRow(head, slot, values); !st.ok()) {
      return st;
    }
  }
  for (int64_t l = 0; l < n_layers; ++l) {
    const LayerStateLayout& ls = layout.layers[l];
    if (IsSdm(ls)) continue;
    KvCache& kv = host.kv(l);
    const int64_t length = host.position();
    kv.ResetForRestore(length);
    const int32_t ring = ls.ring_capacity > 0 ? kernels::KvRingPages(ls.ring_capacity) : 0;
    for (int64_t pos = kv.first_position(); pos < length; ++pos) {
      const int64_t base = page_offsets[l][kernels::KvPageTableIndex(pos, ring)];
      for (int value = 0; value < 2; ++value) {
        const bf16* src =
            staging.get() + base + kernels::KvRowOffset(0, pos, ls.kv_row_width, value != 0);
        float* dst = value ? kv.MutableValueRow(pos) : kv.MutableKeyRow(pos);
        for (int64_t c = 0; c < ls.kv_row_width; ++c) dst[c] = __bfloat162float(src[c]);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace sdm
