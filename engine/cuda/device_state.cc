#include "engine/cuda/device_state.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/parallel_tasks.h"
#include "engine/transfer_plan.h"
#include "kernels/common/device_layout.h"
#include "kernels/cuda/elementwise.h"

namespace sdm {
namespace {

namespace kc = kernels::cuda;
using bf16 = __nv_bfloat16;

bool IsSdm(const LayerStateLayout& l) { return l.kind == LayerStateLayout::Kind::kSdm; }

// Threads that convert a park's or resume's image of `elems` values between fp32 and bf16 on
// the host, one layer each: one per 4 M values, at most 8 (sdm_flagship's 805 M values of a full
// table take ~0.6 s on one core; a small session's conversion is not worth a thread's start,
// and a park runs on the step thread).
int ConversionThreads(int64_t elems) {
  return static_cast<int>(std::clamp<int64_t>(elems / (int64_t{4} << 20), 1, 8));
}

int64_t SlotsOf(const LayerStateLayout& l) { return l.sdm_heads * l.slots_per_head; }

// A pool buffer of `elems` bf16 values for the staged-image and prefetch pools; `code` and `what`
// say what failed ("could not allocate N bytes <what>"). Allocation errors are not sticky: the
// last error is cleared for the next call.
template <typename Buffer>
absl::StatusOr<Buffer> AllocateImage(int64_t elems, absl::StatusCode code, const char* what) {
  Buffer buffer;
  if (const cudaError_t err = buffer.Allocate(elems); err != cudaSuccess) {
    cudaGetLastError();
    return absl::Status(
        code, absl::StrCat("could not allocate ", elems * static_cast<int64_t>(sizeof(bf16)),
                           " bytes ", what, ": ", kc::CudaErrorText(err)));
  }
  return buffer;
}

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
  SDM_RETURN_IF_ERROR(CudaStatus(ctx->prefetch_.Create(), "creating the prefetch stream"));
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

CudaDeviceContext::~CudaDeviceContext() {
  if (compute_.get() != nullptr) cudaStreamSynchronize(compute_.get());
  if (transfer_.get() != nullptr) cudaStreamSynchronize(transfer_.get());
  if (prefetch_.get() != nullptr) cudaStreamSynchronize(prefetch_.get());
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

absl::StatusOr<int64_t> CudaDeviceContext::PagesCovering(int64_t layer, int64_t end) const {
  if (end <= 0) return 0;
  const int64_t entries = page_table_entries(layer);
  const int64_t logical = (end - 1) / kernels::kKvPageTokens + 1;
  if (layout_.layers[layer].ring_capacity == 0 && logical > entries) {
    return absl::OutOfRangeError(absl::StrCat("position ", end - 1,
                                              " is past the engine's max_context of ",
                                              sizes_.max_context, " tokens"));
  }
  return std::min(logical, entries);
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

void CudaDeviceContext::SetRowCount(int32_t slot, int64_t sdm_index, int32_t rows) {
  absl::MutexLock lock(&mu_);
  counters_published_[slot * std::max<int64_t>(1, num_sdm_layers_) + sdm_index] = rows;
}

int64_t CudaDeviceContext::free_rows_lower_bound() const {
  absl::MutexLock lock(&mu_);
  return free_rows_;
}

absl::Status CudaDeviceContext::ReserveRows(int64_t rows) {
  {
    absl::MutexLock lock(&mu_);
    SDM_RETURN_IF_ERROR(free_list_error_);  // once corrupt, every reservation fails
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

absl::Status CudaDeviceContext::FinishRefresh() {
  absl::MutexLock lock(&mu_);
  std::memcpy(counters_published_.data(), counters_host_.get(), counters_.bytes());
  if (free_count_.get() == nullptr) return absl::OkStatus();
  const int32_t device_free = *free_count_host_.get();
  // Out of range: this step failed, and ReserveRows() fails from now on (logged once).
  SDM_RETURN_IF_ERROR(CheckFreeCount(device_free));
  free_rows_ = device_free;
  return absl::OkStatus();
}

namespace {

// Grows `buffer` to at least `need` elements: by at least a quarter of its size, but not past
// `limit` unless `need` is. Counts each allocation in `*allocations`.
template <typename Buffer>
absl::Status GrowTo(Buffer& buffer, int64_t need, int64_t limit, const char* what,
                    int64_t* allocations) {
  const int64_t have = static_cast<int64_t>(buffer.size());
  if (need <= have) return absl::OkStatus();
  const int64_t count = std::max(need, std::min(have + have / 4, limit));
  ++*allocations;
  if (const cudaError_t err = buffer.Allocate(count); err != cudaSuccess) {
    // Left empty rather than half-sized: the next Reserve tries again from scratch.
    return CudaStatus(err, what);
  }
  return absl::OkStatus();
}

constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();

}  // namespace

int64_t LargestTransferBlockBytes(const StateLayout& layout) {
  int64_t largest = 0;
  for (const LayerStateLayout& ls : layout.layers) {
    const int64_t elems = IsSdm(ls) ? ls.row_width : kernels::KvPageElements(ls.kv_row_width);
    largest = std::max<int64_t>(largest, elems * static_cast<int64_t>(sizeof(bf16)));
  }
  return largest;
}

absl::Status TransferStaging::Reserve(const TransferSizes& sizes) {
  SDM_RETURN_IF_ERROR(
      GrowTo(image_, sizes.image, kNoLimit, "allocating pinned transfer staging", &allocations_));
  SDM_RETURN_IF_ERROR(
      GrowTo(host_ids_, sizes.host_ids, kNoLimit, "allocating pinned transfer ids", &allocations_));
  SDM_RETURN_IF_ERROR(GrowTo(chunk_, sizes.chunk, chunk_limit_elems_,
                             "allocating the device transfer chunk", &allocations_));
  return GrowTo(ids_, sizes.ids, kNoLimit, "allocating device transfer ids", &allocations_);
}

absl::Status CudaDeviceContext::WithTransferStaging(
    absl::FunctionRef<absl::Status(TransferStaging&)> transfer) {
  absl::MutexLock lock(&staging_mu_);
  absl::Status status = transfer(staging_);
  if (!status.ok()) {
    // Copies and kernels the failed transfer enqueued may still use the staging: let them end
    // before the next transfer rewrites or regrows it (errors here add nothing to `status`).
    cudaStreamSynchronize(transfer_.get());
    cudaStreamSynchronize(compute_.get());
    cudaGetLastError();
  }
  return status;
}

int64_t CudaDeviceContext::transfer_staging_allocations() const {
  absl::MutexLock lock(&staging_mu_);
  return staging_.allocations();
}

int64_t CudaDeviceContext::transfer_chunks() const {
  absl::MutexLock lock(&staging_mu_);
  return staging_.chunks();
}

absl::Status CudaDeviceContext::TakeTable(int64_t entries, kc::DeviceBuffer<int32_t>* table) {
  {
    absl::MutexLock lock(&mu_);
    auto it = free_tables_.find(entries);
    if (it != free_tables_.end() && !it->second.empty()) {
      *table = std::move(it->second.back());
      it->second.pop_back();
      return absl::OkStatus();
    }
    ++table_allocations_;
  }
  return CudaStatus(table->Allocate(static_cast<size_t>(entries)), "allocating a session table");
}

void CudaDeviceContext::ReturnTable(kc::DeviceBuffer<int32_t> table) {
  if (table.get() == nullptr) return;
  const auto entries = static_cast<int64_t>(table.size());
  absl::MutexLock lock(&mu_);
  free_tables_[entries].push_back(std::move(table));
}

absl::StatusOr<kc::PinnedBuffer<bf16>> CudaDeviceContext::AllocateStagedImage(int64_t elems) {
  return AllocateImage<kc::PinnedBuffer<bf16>>(elems, absl::StatusCode::kUnavailable,
                                               "of host memory to stage a resume (pinned)");
}

absl::StatusOr<kc::DeviceBuffer<bf16>> CudaDeviceContext::AllocatePrefetchImage(int64_t elems) {
  return AllocateImage<kc::DeviceBuffer<bf16>>(elems, absl::StatusCode::kResourceExhausted,
                                               "of device memory to copy a resume ahead");
}

void CudaDeviceContext::ReturnCopiedAhead(kc::PinnedBuffer<bf16> image,
                                          kc::DeviceBuffer<bf16> device,
                                          std::unique_ptr<kc::CudaEvent> copied) {
  const cudaError_t done = cudaEventQuery(copied->get());
  if (done == cudaErrorNotReady) {
    absl::MutexLock lock(&retired_mu_);
    retired_.push_back({std::move(image), std::move(device), std::move(copied)});
    return;
  }
  if (done != cudaSuccess) cudaGetLastError();  // a failed copy is not running either
  ReturnPrefetchImage(std::move(device));
  ReturnStagedImage(std::move(image));
}

void CudaDeviceContext::ReclaimCopiesAhead() {
  std::vector<RetiredCopy> retired;
  {
    absl::MutexLock lock(&retired_mu_);
    retired.swap(retired_);
  }
  for (RetiredCopy& r : retired) {
    if (cudaEventSynchronize(r.copied->get()) != cudaSuccess) cudaGetLastError();
    ReturnPrefetchImage(std::move(r.device));
    ReturnStagedImage(std::move(r.image));
  }
}

int64_t CudaDeviceContext::copies_ahead_pending() const {
  absl::MutexLock lock(&retired_mu_);
  return static_cast<int64_t>(retired_.size());
}

int64_t CudaDeviceContext::table_allocations() const {
  absl::MutexLock lock(&mu_);
  return table_allocations_;
}

// ---------------------------------------------------------------------------------------------

absl::StatusOr<UploadPlan> PlanUpload(const CudaDeviceContext& ctx, const SessionState& host) {
  const StateLayout& layout = ctx.layout();
  const int64_t n_layers = static_cast<int64_t>(layout.layers.size());
  UploadPlan plan;
  plan.position = host.position();
  for (int64_t l = 0; l < n_layers; ++l) {
    const LayerStateLayout& ls = layout.layers[l];
    if (!IsSdm(ls)) continue;
    const int64_t first = static_cast<int64_t>(plan.slot_ids.size());
    host.sdm(l).ForEachPrivateRow([&](int64_t head, int64_t slot, const float*) {
      plan.slot_ids.push_back(static_cast<int32_t>(head * ls.slots_per_head + slot));
    });
    plan.run_layer.push_back(l);
    plan.runs.push_back({ls.row_width, static_cast<int64_t>(plan.slot_ids.size()) - first});
  }
  for (int64_t l = 0; l < n_layers; ++l) {
    const LayerStateLayout& ls = layout.layers[l];
    if (IsSdm(ls)) continue;
    absl::StatusOr<int64_t> pages = ctx.PagesCovering(l, plan.position);
    if (!pages.ok()) return pages.status();
    if (*pages == 0) continue;
    plan.run_layer.push_back(l);
    plan.runs.push_back({kernels::KvPageElements(ls.kv_row_width), *pages});
  }
  plan.run_offset = TransferRunOffsets(plan.runs);
  return plan;
}

void WriteUploadImage(const CudaDeviceContext& ctx, const UploadPlan& plan,
                      const SessionState& host, bf16* image) {
  const StateLayout& layout = ctx.layout();
  // Each run (a layer) reads its own layer and writes its own part of the image.
  RunTasksInParallel(
      static_cast<int64_t>(plan.runs.size()), ConversionThreads(plan.image_elems()),
      [&](int64_t r) {
        const int64_t l = plan.run_layer[r];
        const LayerStateLayout& ls = layout.layers[l];
        bf16* dst = image + plan.run_offset[r];
        if (IsSdm(ls)) {
          host.sdm(l).ForEachPrivateRow([&](int64_t, int64_t, const float* row) {
            for (int64_t c = 0; c < ls.row_width; ++c) dst[c] = __float2bfloat16_rn(row[c]);
            dst += ls.row_width;
          });
          return;
        }
        const TransferRun& run = plan.runs[r];
        std::memset(static_cast<void*>(dst), 0, run.count * run.block_elems * sizeof(bf16));
        const KvCache& kv = host.kv(l);
        const int32_t ring = ls.ring_capacity > 0 ? kernels::KvRingPages(ls.ring_capacity) : 0;
        for (int64_t pos = kv.first_position(); pos < kv.length(); ++pos) {
          // Page-table entry e is the run's block e (the pages in table order).
          const int64_t entry = kernels::KvPageTableIndex(pos, ring);
          for (int value = 0; value < 2; ++value) {
            const float* src = value ? kv.ValueRow(pos) : kv.KeyRow(pos);
            bf16* row = dst + entry * run.block_elems +
                        kernels::KvRowOffset(0, pos, ls.kv_row_width, value != 0);
            for (int64_t c = 0; c < ls.kv_row_width; ++c) row[c] = __float2bfloat16_rn(src[c]);
          }
        }
      });
}

absl::StatusOr<std::unique_ptr<CudaStagedUpload>> CudaStagedUpload::Stage(
    std::shared_ptr<CudaDeviceContext> ctx, const SessionState& host) {
  absl::StatusOr<UploadPlan> plan = PlanUpload(*ctx, host);
  if (!plan.ok()) return plan.status();
  if (plan->image_elems() == 0) return nullptr;  // nothing to convert
  ctx->ReclaimCopiesAhead();  // buffers of dropped stagings whose copies were still running
  absl::StatusOr<kc::PinnedBuffer<bf16>> image = ctx->TakeStagedImage(plan->image_elems());
  if (!image.ok()) return image.status();
  WriteUploadImage(*ctx, *plan, host, image->get());
  std::unique_ptr<CudaStagedUpload> staged(
      new CudaStagedUpload(std::move(ctx), *std::move(plan), *std::move(image)));
  staged->StartCopy();
  return staged;
}

void CudaStagedUpload::StartCopy() {
  const int64_t elems = plan_.image_elems();
  absl::StatusOr<kc::DeviceBuffer<bf16>> device = ctx_->TakePrefetchImage(elems);
  if (!device.ok()) return;  // no room (or memory): the step copies from the page-locked image
  auto copied = std::make_unique<kc::CudaEvent>();
  if (copied->Create() != cudaSuccess) {
    cudaGetLastError();
    ctx_->ReturnPrefetchImage(*std::move(device));
    return;
  }
  // On the prefetch stream, which nothing else uses: the copy overlaps the steps and parks that
  // run meanwhile. The upload orders its scatter after `copied_` on the compute stream.
  const cudaError_t copy = cudaMemcpyAsync(device->get(), image_.get(), elems * sizeof(bf16),
                                           cudaMemcpyHostToDevice, ctx_->prefetch());
  const cudaError_t record =
      copy == cudaSuccess ? cudaEventRecord(copied->get(), ctx_->prefetch()) : copy;
  if (record != cudaSuccess) {
    SDM_LOG(WARNING) << "sdm cuda: copying a staged resume ahead failed ("
                     << kc::CudaErrorText(record) << "); its step copies it";
    // Whatever was enqueued must finish before the buffers go back (the staging thread waits).
    cudaStreamSynchronize(ctx_->prefetch());
    cudaGetLastError();
    ctx_->ReturnPrefetchImage(*std::move(device));
    return;
  }
  device_image_ = *std::move(device);
  copied_ = std::move(copied);
}

absl::Status CudaStagedUpload::WaitForCopy() const {
  if (copied_ == nullptr) return absl::OkStatus();
  return CudaStatus(cudaEventSynchronize(copied_->get()), "waiting for a resume's copy ahead");
}

CudaStagedUpload::~CudaStagedUpload() {
  if (copied_ != nullptr) {
    // The copy reads the page-locked image and writes the device one: both stay out of the
    // pools until it is done (at once when an upload used it: the upload waited for its scatter).
    ctx_->ReturnCopiedAhead(std::move(image_), std::move(device_image_), std::move(copied_));
  } else {
    ctx_->ReturnStagedImage(std::move(image_));
  }
}

absl::StatusOr<std::unique_ptr<CudaSessionState>> CudaSessionState::Upload(
    std::shared_ptr<CudaDeviceContext> ctx, const SessionState& host,
    const CudaStagedUpload* staged) {
  // A staged image is host's as it is now (SessionState drops one whenever the layers or the
  // position change); should one not match anyway, converting here is always right.
  if (staged != nullptr &&
      (staged->owner() != ctx.get() || staged->plan().position != host.position())) {
    staged = nullptr;
  }
  UploadPlan planned;
  if (staged == nullptr) {
    absl::StatusOr<UploadPlan> plan = PlanUpload(*ctx, host);
    if (!plan.ok()) return plan.status();
    planned = *std::move(plan);
  }
  const UploadPlan& plan = staged != nullptr ? staged->plan() : planned;

  std::unique_ptr<CudaSessionState> s(new CudaSessionState(ctx));
  absl::StatusOr<int32_t> slot = ctx->AllocateCounterSlot();
  if (!slot.ok()) return slot.status();
  s->counter_slot_ = *slot;
  const StateLayout& layout = ctx->layout();
  const int64_t n_layers = static_cast<int64_t>(layout.layers.size());
  s->layers_.resize(n_layers);
  for (int64_t l = 0; l < n_layers; ++l) {
    const LayerStateLayout& ls = layout.layers[l];
    Layer& layer = s->layers_[l];
    if (IsSdm(ls)) {
      SDM_RETURN_IF_ERROR(ctx->TakeTable(SlotsOf(ls), &layer.table));
      // 0xff bytes make every entry kSdmNoRow (-1).
      SDM_RETURN_IF_ERROR(
          CudaStatus(cudaMemsetAsync(layer.table.get(), 0xff, layer.table.bytes(), ctx->compute()),
                     "clearing an SDM slot table"));
      layer.cleared = true;
      SDM_RETURN_IF_ERROR(ctx->TakeTable((SlotsOf(ls) + 3) / 4, &layer.written));
      SDM_RETURN_IF_ERROR(
          CudaStatus(cudaMemsetAsync(layer.written.get(), 0, layer.written.bytes(), ctx->compute()),
                     "clearing written marks"));
    } else {
      SDM_RETURN_IF_ERROR(ctx->TakeTable(ctx->page_table_entries(l), &layer.table));
      layer.pages.reserve(ctx->page_table_entries(l));
    }
  }
  s->marks_cleared_at_ = host.position();
  if (auto st = s->EnsurePages(host.position()); !st.ok()) return st;
  // The ids: the SDM runs' slot ids, then each KV run's pages in table order; run r's are at
  // run_first[r] (a block per id).
  std::vector<int32_t> ids = plan.slot_ids;
  const int64_t total_rows = static_cast<int64_t>(ids.size());
  std::vector<int64_t> run_first;
  int64_t next_id = 0;
  for (size_t r = 0; r < plan.runs.size(); ++r) {
    run_first.push_back(next_id);
    next_id += plan.runs[r].count;
    const int64_t l = plan.run_layer[r];
    if (IsSdm(layout.layers[l])) continue;
    const std::vector<int32_t>& pages = s->layers_[l].pages;
    if (static_cast<int64_t>(pages.size()) != plan.runs[r].count) {
      return absl::InternalError("an upload's plan disagrees with the session's page tables");
    }
    ids.insert(ids.end(), pages.begin(), pages.end());
  }
  if (total_rows > 0) {
    if (auto st = ctx->ReserveRows(total_rows); !st.ok()) return st;
  }
  const int64_t image_elems = plan.image_elems();
  if (image_elems == 0) return s;

  const int64_t n_ids = static_cast<int64_t>(ids.size());
  // A staged image copied ahead is scattered from the device; nothing is copied here.
  const bf16* copied_ahead = staged != nullptr ? staged->device_image() : nullptr;
  TransferSizes need;
  need.image = staged != nullptr ? 0 : image_elems;  // a staged image has its own buffer
  need.host_ids = n_ids + n_layers;                  // the ids, then a row count per layer
  need.ids = n_ids;
  SDM_RETURN_IF_ERROR(ctx->WithTransferStaging([&](TransferStaging& staging) -> absl::Status {
    // Chunks of the same size either way (the transfer-fault seam counts them alike); only a
    // copy needs the device chunk (which Reserve makes at least this large).
    const int64_t chunk_elems = staging.ChunkElemsFor(image_elems);
    need.chunk = copied_ahead != nullptr ? 0 : chunk_elems;
    SDM_RETURN_IF_ERROR(staging.Reserve(need));
    absl::StatusOr<std::vector<TransferChunk>> chunks = PlanTransferChunks(plan.runs, chunk_elems);
    if (!chunks.ok()) return chunks.status();
    const bf16* image = staged != nullptr ? staged->image() : staging.image();
    if (staged == nullptr) WriteUploadImage(*ctx, plan, host, staging.image());
    std::memcpy(staging.host_ids(), ids.data(), n_ids * sizeof(int32_t));

    // Everything on the compute stream, in order: the rows' scatter pops the free list, which
    // only the compute stream touches (and the next step needs the session anyway). Copies
    // come from page-locked memory; each chunk's copy waits for the previous chunk's scatter.
    // A copy made ahead (on the prefetch stream) is waited for by its event instead.
    cudaStream_t c = ctx->compute();
    if (copied_ahead != nullptr) {
      SDM_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(c, staged->copied(), 0),
                                     "waiting for a resume's copy ahead"));
    }
    SDM_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(staging.ids(), staging.host_ids(), n_ids * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, c),
                   "uploading slot and page ids"));
    for (const TransferChunk& chunk : *chunks) {
      const bf16* chunk_src = staging.chunk();
      if (copied_ahead != nullptr) {
        chunk_src = copied_ahead + chunk.image_offset;
      } else {
        SDM_RETURN_IF_ERROR(
            CudaStatus(cudaMemcpyAsync(staging.chunk(), image + chunk.image_offset,
                                       chunk.elems * sizeof(bf16), cudaMemcpyHostToDevice, c),
                       "uploading session state"));
      }
      for (const TransferPiece& p : chunk.pieces) {
        const int64_t l = plan.run_layer[p.run];
        const int32_t* piece_ids = staging.ids() + run_first[p.run] + p.first;
        const bf16* src = chunk_src + p.chunk_offset;
        if (IsSdm(layout.layers[l])) {
          SDM_RETURN_IF_ERROR(
              CudaStatus(kc::SdmScatterRows(src, piece_ids, p.count, s->layers_[l].table.get(),
                                            ctx->row_arena(), c),
                         "scattering uploaded rows"));
        } else {
          const kc::KvLayerView arena = ctx->kv_arena(l);
          SDM_RETURN_IF_ERROR(CudaStatus(kc::ScatterBlocks(src, plan.runs[p.run].block_elems,
                                                           piece_ids, p.count, arena.pool, c),
                                         "scattering uploaded pages"));
        }
      }
      SDM_RETURN_IF_ERROR(staging.ChunkFault());
    }
    // Each SDM layer's row counter, from page-locked memory after the ids.
    int32_t* counts = staging.host_ids() + n_ids;
    for (size_t r = 0; r < plan.runs.size(); ++r) {
      const int64_t l = plan.run_layer[r];
      if (!IsSdm(layout.layers[l]) || plan.runs[r].count == 0) continue;
      counts[l] = static_cast<int32_t>(plan.runs[r].count);
      SDM_RETURN_IF_ERROR(
          CudaStatus(cudaMemcpyAsync(ctx->row_counter(s->counter_slot_, ctx->sdm_index(l)),
                                     counts + l, sizeof(int32_t), cudaMemcpyHostToDevice, c),
                     "setting a row counter"));
    }
    // The staging (and a staged image) is the next transfer's: wait for the copies and
    // scatters (a resume is one upload of at most the session's state; the next step would
    // wait for it anyway). On error WithTransferStaging waits for both streams.
    return CudaStatus(cudaStreamSynchronize(c), "uploading a session");
  }));
  // The counters are on the device now: the host mirror says so before the next refresh (the
  // step's row reservation reads it).
  for (size_t r = 0; r < plan.runs.size(); ++r) {
    const int64_t l = plan.run_layer[r];
    if (!IsSdm(layout.layers[l]) || plan.runs[r].count == 0) continue;
    ctx->SetRowCount(s->counter_slot_, ctx->sdm_index(l), static_cast<int32_t>(plan.runs[r].count));
  }
  return s;
}

CudaSessionState::~CudaSessionState() {
  if (ctx_ == nullptr) return;
  const StateLayout& layout = ctx_->layout();
  for (int64_t l = 0; l < static_cast<int64_t>(layers_.size()); ++l) {
    Layer& layer = layers_[l];
    if (IsSdm(layout.layers[l])) {
      if (layer.cleared && ctx_->row_arena().rows != nullptr) {
        kc::SdmReleaseRows(layer.table.get(), SlotsOf(layout.layers[l]), ctx_->row_arena(),
                           ctx_->compute());
      }
    } else if (!layer.pages.empty()) {
      ctx_->FreePages(l, layer.pages);
    }
    // To the pool, with the release kernel that reads it still queued: its next session's first
    // use comes after it on the same stream (CudaDeviceContext::TakeTable), so nothing waits.
    ctx_->ReturnTable(std::move(layer.table));
    if (layer.written.get() != nullptr) ctx_->ReturnTable(std::move(layer.written));
  }
  if (counter_slot_ >= 0) {
    const int64_t n = std::max<int64_t>(1, ctx_->num_sdm_layers());
    cudaMemsetAsync(ctx_->row_counter(counter_slot_, 0), 0, n * sizeof(int32_t), ctx_->compute());
    ctx_->FreeCounterSlot(counter_slot_);
  }
}

absl::Status CudaSessionState::EnsurePages(int64_t end) {
  const StateLayout& layout = ctx_->layout();
  for (int64_t l = 0; l < static_cast<int64_t>(layers_.size()); ++l) {
    const LayerStateLayout& ls = layout.layers[l];
    if (IsSdm(ls) || end <= 0) continue;
    absl::StatusOr<int64_t> covering = ctx_->PagesCovering(l, end);
    if (!covering.ok()) return covering.status();
    const int64_t needed = *covering;
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
    // From pageable memory: CUDA has read the source when the call returns, so the mirror may
    // change or go (a failed upload frees it) while the copy is queued.
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
    bytes += static_cast<int64_t>(layers_[l].table.bytes() + layers_[l].written.bytes());
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
  return Download(host, /*changes_only=*/false);
}

absl::Status CudaSessionState::CopyChangesToHost(SessionState& host) {
  return Download(host, /*changes_only=*/true);
}

absl::StatusOr<bool> CudaSessionState::ListWrittenRows(TransferStaging& staging,
                                                       cudaStream_t stream, int64_t position,
                                                       std::vector<RowDownload>& rows) {
  const StateLayout& layout = ctx_->layout();
  // Per SDM layer: its index, the most pairs its list may hold and where they go. A written
  // slot with a row is a private one (so at most the private rows as of the last step's
  // refresh), and a token writes at most heads * writes slots (so at most that many per token
  // since the marks were zeroed): a bound that stays near a turn's writes keeps the staging
  // from growing with the session. A step that wrote without advancing the position (one that
  // failed) may exceed it: the count says so, and the copy reads the tables instead.
  std::vector<int64_t> layers, capacity, offset;
  int64_t pairs = 0;
  const int64_t testing_cap = ctx_->sizes().written_list_capacity;
  const int64_t tokens = std::max<int64_t>(0, position - marks_cleared_at_);
  for (int64_t l = 0; l < static_cast<int64_t>(layers_.size()); ++l) {
    const LayerStateLayout& ls = layout.layers[l];
    if (!IsSdm(ls)) continue;
    layers.push_back(l);
    const int64_t private_rows =
        std::max<int64_t>(0, ctx_->row_count(counter_slot_, ctx_->sdm_index(l)));
    const int64_t token_writes = ls.sdm_heads * std::max<int64_t>(1, ls.sdm_write.writes);
    // tokens <= private_rows / token_writes makes tokens * token_writes <= private_rows (and
    // keeps the product from overflowing).
    capacity.push_back(testing_cap >= 0                       ? testing_cap
                       : tokens > private_rows / token_writes ? private_rows
                                                              : tokens * token_writes);
    offset.push_back(pairs);
    pairs += capacity.back();
  }
  const int64_t n = static_cast<int64_t>(layers.size());
  if (n == 0) return true;
  // ids and host_ids: the n counts, then the lists (two int32 a pair).
  TransferSizes need;
  need.ids = n + 2 * pairs;
  need.host_ids = n + 2 * pairs;
  SDM_RETURN_IF_ERROR(staging.Reserve(need));
  int32_t* const counts = staging.ids();
  int32_t* const lists = counts + n;
  SDM_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(counts, 0, n * sizeof(int32_t), stream),
                                 "clearing written-row counts"));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t l = layers[i];
    SDM_RETURN_IF_ERROR(CudaStatus(
        kc::SdmCollectWritten(layers_[l].table.get(), written_marks(l), SlotsOf(layout.layers[l]),
                              lists + 2 * offset[i], capacity[i], counts + i, stream),
        "listing written rows"));
  }
  int32_t* const host_counts = staging.host_ids();
  SDM_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(host_counts, counts, n * sizeof(int32_t), cudaMemcpyDeviceToHost, stream),
      "downloading written-row counts"));
  SDM_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "listing written rows"));
  for (int64_t i = 0; i < n; ++i) {
    if (host_counts[i] > capacity[i]) return false;  // the counts were stale: read the tables
  }
  for (int64_t i = 0; i < n; ++i) {
    if (host_counts[i] == 0) continue;
    SDM_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(host_counts + n + 2 * offset[i], lists + 2 * offset[i],
                                   2 * static_cast<int64_t>(host_counts[i]) * sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, stream),
                   "downloading written rows"));
  }
  SDM_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "downloading written rows"));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t* list = host_counts + n + 2 * offset[i];
    const size_t first = rows.size();
    for (int32_t k = 0; k < host_counts[i]; ++k) {
      rows.push_back({layers[i], list[2 * k], list[2 * k + 1]});
    }
    std::sort(rows.begin() + first, rows.end(),
              [](const RowDownload& a, const RowDownload& b) { return a.slot < b.slot; });
  }
  return true;
}

absl::Status CudaSessionState::ScanTables(TransferStaging& staging, cudaStream_t stream,
                                          bool marked_only, std::vector<RowDownload>& rows) {
  const StateLayout& layout = ctx_->layout();
  const int64_t n_layers = static_cast<int64_t>(layers_.size());
  // host_ids: each SDM table, with marked_only its marks after it (int32 words holding a byte
  // per entry).
  std::vector<int64_t> table_offset(n_layers, 0), marks_offset(n_layers, 0);
  int64_t words = 0;
  for (int64_t l = 0; l < n_layers; ++l) {
    if (!IsSdm(layout.layers[l])) continue;
    table_offset[l] = words;
    words += SlotsOf(layout.layers[l]);
    if (marked_only) {
      marks_offset[l] = words;
      words += static_cast<int64_t>(layers_[l].written.size());
    }
  }
  TransferSizes need;
  need.host_ids = words;
  SDM_RETURN_IF_ERROR(staging.Reserve(need));
  for (int64_t l = 0; l < n_layers; ++l) {
    if (!IsSdm(layout.layers[l])) continue;
    SDM_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(staging.host_ids() + table_offset[l], layers_[l].table.get(),
                                   SlotsOf(layout.layers[l]) * sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, stream),
                   "downloading an SDM table"));
    if (marked_only) {
      SDM_RETURN_IF_ERROR(
          CudaStatus(cudaMemcpyAsync(staging.host_ids() + marks_offset[l], layers_[l].written.get(),
                                     layers_[l].written.bytes(), cudaMemcpyDeviceToHost, stream),
                     "downloading written marks"));
    }
  }
  SDM_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "downloading SDM tables"));
  for (int64_t l = 0; l < n_layers; ++l) {
    if (!IsSdm(layout.layers[l])) continue;
    const int32_t* table = staging.host_ids() + table_offset[l];
    const auto* marks = reinterpret_cast<const uint8_t*>(staging.host_ids() + marks_offset[l]);
    for (int64_t i = 0; i < SlotsOf(layout.layers[l]); ++i) {
      // A marked slot without a row only follows a step that ran out of rows, which failed its
      // sessions: nothing of it is copied.
      if (table[i] < 0 || (marked_only && marks[i] == 0)) continue;
      rows.push_back({l, i, table[i]});
    }
  }
  return absl::OkStatus();
}

absl::Status CudaSessionState::Download(SessionState& host, bool changes_only) {
  const StateLayout& layout = ctx_->layout();
  const int64_t n_layers = static_cast<int64_t>(layers_.size());
  const int64_t length = host.position();
  // Everything the compute stream did to this session so far happens before the copies.
  kc::CudaEvent computed;
  SDM_RETURN_IF_ERROR(CudaStatus(computed.Create(), "creating an event"));
  SDM_RETURN_IF_ERROR(
      CudaStatus(cudaEventRecord(computed.get(), ctx_->compute()), "recording an event"));
  SDM_RETURN_IF_ERROR(
      CudaStatus(cudaStreamWaitEvent(ctx_->transfer(), computed.get(), 0), "ordering streams"));
  cudaStream_t t = ctx_->transfer();

  int64_t n_pages = 0;
  for (int64_t l = 0; l < n_layers; ++l) {
    if (!IsSdm(layout.layers[l])) n_pages += static_cast<int64_t>(layers_[l].pages.size());
  }
  // Per attention layer, the first position to copy: every held one, or (changes_only) those the
  // host does not hold yet.
  std::vector<int64_t> copy_from(n_layers, 0);
  for (int64_t l = 0; l < n_layers; ++l) {
    const LayerStateLayout& ls = layout.layers[l];
    if (IsSdm(ls)) continue;
    const int64_t ring = ls.ring_capacity;
    const int64_t held_from = ring > 0 ? std::max<int64_t>(0, length - ring) : 0;
    const int64_t host_length = host.kv(l).length();
    if (changes_only && host_length > length) {
      return absl::InternalError("the host holds positions past the session's");
    }
    copy_from[l] = changes_only ? std::max(host_length, held_from) : held_from;
  }
  const int64_t row_width = ctx_->row_arena().row_width;
  return ctx_->WithTransferStaging([&](TransferStaging& staging) -> absl::Status {
    // The rows to copy, in layer then slot order: the written ones, listed on the device so that
    // only they cross the bus, or (a whole copy, or a list that came out incomplete) every
    // private row, or the marked ones, read from the tables and marks themselves.
    std::vector<RowDownload> rows;
    bool listed = false;
    if (changes_only) {
      absl::StatusOr<bool> l = ListWrittenRows(staging, t, length, rows);
      if (!l.ok()) return l.status();
      listed = *l;
    }
    if (!listed) SDM_RETURN_IF_ERROR(ScanTables(staging, t, changes_only, rows));
    if (changes_only) ctx_->CountWrittenRows(listed);

    // The image (engine/transfer_plan.h): one run of the rows, then one run of pages per
    // attention layer; their ids in host_ids.
    TransferSizes need;
    need.host_ids = static_cast<int64_t>(rows.size()) + n_pages;
    SDM_RETURN_IF_ERROR(staging.Reserve(need));
    int32_t* ids = staging.host_ids();
    for (size_t i = 0; i < rows.size(); ++i) ids[i] = rows[i].row;
    // (A model without SDM layers has row_width 0: an empty run of 1-element blocks.)
    std::vector<TransferRun> runs = {
        {std::max<int64_t>(row_width, 1), static_cast<int64_t>(rows.size())}};
    // Per run: its layer (-1 for the rows), the arena its blocks come from, its first id, and
    // (pages) the page-table index of its first page: a run's pages are consecutive entries of
    // the table, wrapping around a ring's.
    std::vector<int64_t> run_layer = {-1}, run_ids = {0}, run_first_entry = {0};
    std::vector<const bf16*> run_blocks = {ctx_->row_arena().rows};
    int64_t n_ids = static_cast<int64_t>(rows.size());
    for (int64_t l = 0; l < n_layers; ++l) {
      const LayerStateLayout& ls = layout.layers[l];
      if (IsSdm(ls) || layers_[l].pages.empty() || copy_from[l] >= length) continue;
      const std::vector<int32_t>& pages = layers_[l].pages;
      const int64_t entries = static_cast<int64_t>(pages.size());
      // Every page in table order, or (changes_only) the table entries of the logical pages
      // that hold [copy_from, length), consecutive modulo a ring's pages (all of them at most).
      int64_t start = 0, count = entries;
      if (changes_only) {
        const int32_t ring = ls.ring_capacity > 0 ? kernels::KvRingPages(ls.ring_capacity) : 0;
        const int64_t first_logical = copy_from[l] / kernels::kKvPageTokens;
        count = std::min(entries, (length - 1) / kernels::kKvPageTokens - first_logical + 1);
        start = kernels::KvPageTableIndex(copy_from[l], ring);
      }
      run_layer.push_back(l);
      run_blocks.push_back(ctx_->kv_arena(l).pool);
      run_ids.push_back(n_ids);
      run_first_entry.push_back(start);
      for (int64_t k = 0; k < count; ++k) ids[n_ids++] = pages[(start + k) % entries];
      runs.push_back({kernels::KvPageElements(ls.kv_row_width), count});
    }
    const std::vector<int64_t> run_offset = TransferRunOffsets(runs);
    const int64_t image_elems = run_offset.back();
    need.image = image_elems;
    need.chunk = staging.ChunkElemsFor(image_elems);
    need.ids = n_ids;
    SDM_RETURN_IF_ERROR(staging.Reserve(need));  // keeps host_ids: already large enough
    absl::StatusOr<std::vector<TransferChunk>> chunks =
        PlanTransferChunks(runs, std::max<int64_t>(staging.chunk_elems(), 1));
    if (!chunks.ok()) return chunks.status();
    if (n_ids > 0) {
      SDM_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(staging.ids(), ids, n_ids * sizeof(int32_t), cudaMemcpyHostToDevice, t),
          "uploading row and page ids"));
    }
    // Each chunk: gather its pieces, copy it out; the next chunk's gathers wait for the copy
    // (stream order).
    for (const TransferChunk& chunk : *chunks) {
      for (const TransferPiece& p : chunk.pieces) {
        SDM_RETURN_IF_ERROR(
            CudaStatus(kc::GatherBlocks(run_blocks[p.run], runs[p.run].block_elems,
                                        staging.ids() + run_ids[p.run] + p.first, p.count,
                                        staging.chunk() + p.chunk_offset, t),
                       "gathering rows and pages"));
      }
      SDM_RETURN_IF_ERROR(
          CudaStatus(cudaMemcpyAsync(staging.image() + chunk.image_offset, staging.chunk(),
                                     chunk.elems * sizeof(bf16), cudaMemcpyDeviceToHost, t),
                     "downloading session state"));
      SDM_RETURN_IF_ERROR(staging.ChunkFault());
    }
    SDM_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(t), "downloading a session"));

    // Write the host layers, each layer a task of its own (tables and caches are distinct
    // objects; the row pool is thread-safe), taken here, on the calling thread: the session's
    // non-const accessors are not for concurrent use. Host private rows are a subset of the
    // device's (the device copy started from them and only gains rows); rows come in layer order.
    struct LayerWrite {
      int64_t layer;
      size_t first_row = 0, end_row = 0;  // SDM: its rows in `rows`
      int64_t run = -1;                   // attention: its pages' run, -1 for none
      SdmTable* table = nullptr;
      KvCache* kv = nullptr;
    };
    std::vector<LayerWrite> writes;
    size_t next_row = 0, r = 1;
    for (int64_t l = 0; l < n_layers; ++l) {
      LayerWrite w{l};
      if (IsSdm(layout.layers[l])) {
        w.table = &host.sdm(l);
        w.first_row = next_row;
        while (next_row < rows.size() && rows[next_row].layer == l) ++next_row;
        w.end_row = next_row;
      } else {
        w.kv = &host.kv(l);
        if (r < runs.size() && run_layer[r] == l) w.run = static_cast<int64_t>(r++);
      }
      writes.push_back(w);
    }
    std::vector<absl::Status> written(writes.size());
    RunTasksInParallel(
        static_cast<int64_t>(writes.size()), ConversionThreads(image_elems), [&](int64_t i) {
          const LayerWrite& w = writes[i];
          const LayerStateLayout& ls = layout.layers[w.layer];
          if (w.table != nullptr) {
            std::vector<float> values(row_width);
            for (size_t k = w.first_row; k < w.end_row; ++k) {
              const bf16* src = staging.image() + static_cast<int64_t>(k) * row_width;
              for (int64_t c = 0; c < row_width; ++c) values[c] = __bfloat162float(src[c]);
              const int64_t head = rows[k].slot / ls.slots_per_head;
              const int64_t slot = rows[k].slot % ls.slots_per_head;
              // A changed row goes through MutableRow, which marks it dirty (what the next
              // delta carries: state_store/sdm_table.h), copying it first from M0 or a row shared
              // with a fork.
              if (changes_only || w.table->IsPrivate(head, slot)) {
                float* row = w.table->MutableRow(head, slot);
                if (row == nullptr) {
                  written[i] = absl::ResourceExhaustedError("host row pool is exhausted");
                  return;
                }
                std::memcpy(row, values.data(), row_width * sizeof(float));
              } else if (auto st = w.table->RestoreRow(head, slot, values); !st.ok()) {
                written[i] = st;
                return;
              }
            }
            return;
          }
          // Every attention layer is reset to the session's length, also one without pages
          // (position 0), or (changes_only) extended to it: positions [copy_from, length) are
          // appended, or, where they are a whole ring, the layer is reset and they are its
          // rows. Run w.run (its pages) starts at run_offset[w.run], with the page of table
          // entry run_first_entry[w.run].
          KvCache& kv = *w.kv;
          const bool append = changes_only && copy_from[w.layer] == kv.length();
          if (!append) kv.ResetForRestore(length);
          if (w.run < 0) return;
          const int32_t ring = ls.ring_capacity > 0 ? kernels::KvRingPages(ls.ring_capacity) : 0;
          const int64_t entries = static_cast<int64_t>(layers_[w.layer].pages.size());
          std::vector<float> key(ls.kv_row_width), value(ls.kv_row_width);
          for (int64_t pos = append ? kv.length() : kv.first_position(); pos < length; ++pos) {
            const int64_t k =
                (kernels::KvPageTableIndex(pos, ring) - run_first_entry[w.run] + entries) % entries;
            const bf16* page = staging.image() + run_offset[w.run] + k * runs[w.run].block_elems;
            for (int v = 0; v < 2; ++v) {
              const bf16* src = page + kernels::KvRowOffset(0, pos, ls.kv_row_width, v != 0);
              float* dst = v ? value.data() : key.data();
              for (int64_t c = 0; c < ls.kv_row_width; ++c) dst[c] = __bfloat162float(src[c]);
            }
            if (append) {
              kv.AppendRow(key.data(), value.data());
            } else {
              kv.StoreRow(pos, /*value=*/false, key.data());
              kv.StoreRow(pos, /*value=*/true, value.data());
            }
          }
        });
    for (const absl::Status& st : written) SDM_RETURN_IF_ERROR(st);
    if (!changes_only) return absl::OkStatus();
    // The host holds every mark's row now: the next copy carries only later writes. On the
    // compute stream, before the next step's marks (the marks were read above).
    for (int64_t l = 0; l < n_layers; ++l) {
      if (!IsSdm(layout.layers[l])) continue;
      SDM_RETURN_IF_ERROR(CudaStatus(
          cudaMemsetAsync(layers_[l].written.get(), 0, layers_[l].written.bytes(), ctx_->compute()),
          "clearing written marks"));
    }
    marks_cleared_at_ = length;
    return absl::OkStatus();
  });
}

}  // namespace sdm
