// Sessions' state in device memory for the CUDA backend (docs/model-spec.md §7, §6; layout in
// kernels/common/device_layout.h).
//
// CudaDeviceContext owns what all device-resident sessions share: the compute and transfer
// streams, the SDM row arena with its device free list, one KV page arena per attention layer,
// and the per-session private-row counters. CudaSessionState is one session's residency
// (state_store/device_residency.h): its slot->row tables and page tables; destroying it returns
// its rows and pages.
//
// Ordering: every free-list operation (allocation in a step, scatter on upload, release) runs on
// the compute stream, so they never race. A park's gathers and copies run on the transfer
// stream, after an event on the compute stream; a resume's copies and scatters run on the
// compute stream (the scatter pops the free list, and the next step needs the session anyway).
// Both move the state through the context's TransferStaging (below). A resume may be staged
// ahead of its step (CudaStagedUpload, Engine::StageResume): the host-side conversion to the
// bf16 image runs then, on the staging thread, into page-locked memory from the context's
// staged-image pool, and where the prefetch pool has room its copy to the device starts then
// too, on a third stream, the prefetch stream (the scatter stays on the compute stream, after
// the copy's event): the step only scatters, or copies and scatters. Host bookkeeping (free pages,
// counter slots) is guarded by the context's mutex: the store's worker thread parks sessions
// while the scheduler thread runs steps.
#ifndef SDMSERVE_ENGINE_CUDA_DEVICE_STATE_H_
#define SDMSERVE_ENGINE_CUDA_DEVICE_STATE_H_

#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
#include "engine/budgeted_buffer_pool.h"
#include "engine/engine_backend.h"
#include "engine/transfer_plan.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/sdm.h"
#include "state_store/device_residency.h"
#include "state_store/session_state.h"
#include "state_store/state_layout.h"

namespace sdm {

// CUDA errors as statuses: out-of-memory is RESOURCE_EXHAUSTED, the rest INTERNAL. Propagate
// with SDM_RETURN_IF_ERROR(CudaStatus(cudaCall(...), "what")) (base/status_macros.h).
absl::Status CudaStatus(cudaError_t err, const char* what);

struct DeviceStateSizes {
  int64_t sdm_rows = 0;           // rows in the SDM arena
  std::vector<int64_t> kv_pages;  // per layer: pages in its arena (0 for SDM layers)
  int64_t max_context = 0;        // full-attention page tables hold this many positions
  int64_t max_sessions = 4096;    // device-resident sessions at once (row counters)
  // The most a transfer's device chunk holds (TransferStaging); 0: kTransferChunkBytes.
  int64_t transfer_chunk_bytes = 0;
  // Testing only (EngineOptions::inject_transfer_fault): the transfer chunk numbered this,
  // counted over the context's life, fails once after its copies were enqueued. -1: never.
  int64_t inject_transfer_fault = -1;
  // Testing only (EngineOptions::written_list_capacity): the most pairs ListWrittenRows lists
  // per layer; negative: the layer's private-row count.
  int64_t written_list_capacity = -1;
  // The most page-locked host memory staged uploads hold at once, pooled buffers included
  // (EngineOptions::resume_staging_bytes). 0: nothing is staged.
  int64_t staged_bytes = 0;
  // The most device memory staged images copied ahead of their step hold at once, pooled
  // buffers included (EngineOptions::resume_prefetch_bytes). 0: none is copied ahead.
  int64_t prefetch_bytes = 0;
};

// What the staged-image pool has done (CudaDeviceContext::staged_image_stats; tests, logs).
using StagedImageStats = BufferPoolStats;

// Element counts a transfer needs of each TransferStaging buffer.
struct TransferSizes {
  int64_t image = 0;     // bf16: the host image of the rows and pages that move
  int64_t host_ids = 0;  // int32: SDM tables (park), slot, row and page ids, row counts
  int64_t chunk = 0;     // bf16: the device chunk the image moves through
  int64_t ids = 0;       // int32: the ids on the device
};

// The device chunk a transfer moves its image through, at most this many bytes (64 MiB: a few
// copies for the largest sessions, about 15 us of a copy's fixed cost against ~2 ms of data at
// PCIe rates, and little device memory taken from the activations' reserve).
inline constexpr int64_t kTransferChunkBytes = int64_t{64} << 20;

// The largest block a park or resume moves whole (an SDM row or a KV page of `layout`), in bytes:
// the least a transfer chunk must hold.
int64_t LargestTransferBlockBytes(const StateLayout& layout);

// The buffers that parks and resumes move state through (docs/architecture.md, CUDA backend),
// owned by the context and reused by every transfer: page-locked host memory for the bf16 image
// of what moves and for the ids that say where, and on the device one chunk and the ids. A park
// gathers rows and pages into the chunk and copies it out, chunk by chunk (the chunks planned by
// engine/transfer_plan.h); a resume copies each chunk in and scatters it. Each buffer grows to
// the largest transfer seen (by at least a quarter of its size, so a slowly growing session does
// not reallocate every time; the chunk stops at its limit, by default kTransferChunkBytes) and is
// freed only with the context. So a park or resume allocates nothing once sizes repeat, and none
// frees memory per call (cudaFree and cudaFreeHost synchronise the whole device, stalling every
// other session's step). Not thread-safe by itself: CudaDeviceContext::WithTransferStaging hands it
// to one transfer at a time.
class TransferStaging {
 public:
  // The chunk never grows past `chunk_limit_elems` (> 0). `inject_fault`: DeviceStateSizes.
  explicit TransferStaging(int64_t chunk_limit_elems, int64_t inject_fault = -1)
      : chunk_limit_elems_(chunk_limit_elems), fault_(inject_fault) {}

  // Testing seam: called by a park or resume after each chunk's copies were enqueued; the
  // injected error when this chunk is the one DeviceStateSizes::inject_transfer_fault names.
  absl::Status ChunkFault() {
    return fault_.Fire() ? absl::InternalError("injected transfer fault") : absl::OkStatus();
  }

  // The chunk a transfer of `image` elements moves through: all of it, up to the limit.
  int64_t ChunkElemsFor(int64_t image) const { return std::min(image, chunk_limit_elems_); }
  // Makes each buffer hold at least `sizes` elements. A buffer already large enough keeps its
  // contents; one that grows loses them (callers reserve before writing).
  absl::Status Reserve(const TransferSizes& sizes);

  __nv_bfloat16* image() const { return image_.get(); }
  int32_t* host_ids() const { return host_ids_.get(); }
  __nv_bfloat16* chunk() const { return chunk_.get(); }
  int64_t chunk_elems() const { return static_cast<int64_t>(chunk_.size()); }
  int32_t* ids() const { return ids_.get(); }
  // Buffers (re)allocated so far: constant once the transfers' sizes repeat.
  int64_t allocations() const { return allocations_; }
  // Chunks that parks and resumes moved through the staging so far (ChunkFault() calls).
  int64_t chunks() const { return fault_.calls(); }

 private:
  kernels::cuda::PinnedBuffer<__nv_bfloat16> image_;
  kernels::cuda::PinnedBuffer<int32_t> host_ids_;
  kernels::cuda::DeviceBuffer<__nv_bfloat16> chunk_;
  kernels::cuda::DeviceBuffer<int32_t> ids_;
  int64_t chunk_limit_elems_;
  int64_t allocations_ = 0;
  ForwardFaultInjector fault_;
};

// What a resume moves (engine/transfer_plan.h): one run of private rows per SDM layer, in layer
// order, then one run of pages per attention layer that holds any, block e being page-table
// entry e; the image is the runs back to back in bf16. Made from the host session alone (no
// device work), so it can be planned and its image written ahead of the step (a staged upload).
struct UploadPlan {
  int64_t position = 0;             // the session's when planned (it sizes the KV runs)
  std::vector<TransferRun> runs;    // an SDM run's count is the layer's private rows
  std::vector<int64_t> run_layer;   // per run: its layer
  std::vector<int64_t> run_offset;  // TransferRunOffsets(runs): image offsets, then the total
  // The ids the SDM runs scatter to (head * slots_per_head + slot), back to back in run order;
  // the upload appends each KV run's page ids after them.
  std::vector<int32_t> slot_ids;
  int64_t image_elems() const { return run_offset.back(); }
};

class CudaDeviceContext;

// Plans the upload of `host`'s layers (host only). OutOfRange when its position is past what the
// context's page tables hold (as EnsurePages).
absl::StatusOr<UploadPlan> PlanUpload(const CudaDeviceContext& ctx, const SessionState& host);
// Writes `plan`'s image of `host`'s layers to `image` ([plan.image_elems()]): each SDM layer's
// private rows as bf16, each page's held positions (the rest 0). Host only, any thread.
void WriteUploadImage(const CudaDeviceContext& ctx, const UploadPlan& plan,
                      const SessionState& host, __nv_bfloat16* image);

class CudaDeviceContext {
 public:
  // Allocates the arenas for `layout`. m0[l] is layer l's M0 on the device (null: zeros).
  static absl::StatusOr<std::shared_ptr<CudaDeviceContext>> Create(
      const StateLayout& layout, const DeviceStateSizes& sizes,
      std::vector<const __nv_bfloat16*> m0);
  // Waits for its streams first: the last sessions' release kernels read the tables, the free
  // list and the counters this frees.
  ~CudaDeviceContext();
  CudaDeviceContext(const CudaDeviceContext&) = delete;
  CudaDeviceContext& operator=(const CudaDeviceContext&) = delete;

  cudaStream_t compute() const { return compute_.get(); }
  cudaStream_t transfer() const { return transfer_.get(); }
  // Staged images' copies ahead (CudaStagedUpload) only: a stream of their own, so that a park
  // (on the transfer stream, waited for on the step thread) never queues behind them.
  cudaStream_t prefetch() const { return prefetch_.get(); }
  const StateLayout& layout() const { return layout_; }
  const DeviceStateSizes& sizes() const { return sizes_; }
  kernels::cuda::SdmRowArena row_arena() const;
  // The page arena of attention layer `layer` (pool, kv_width, ring_pages; no page tables).
  kernels::cuda::KvLayerView kv_arena(int64_t layer) const;
  const __nv_bfloat16* m0(int64_t layer) const { return m0_[layer]; }
  // Index of `layer` among the SDM layers (-1 for attention layers).
  int64_t sdm_index(int64_t layer) const { return sdm_index_[layer]; }
  int64_t num_sdm_layers() const { return num_sdm_layers_; }
  // Page-table entries of an attention layer: the ring, or max_context / page.
  int64_t page_table_entries(int64_t layer) const;
  // Pages of attention layer `layer` that hold positions [0, end): all of the ring's once it
  // is full. OutOfRange past max_context.
  absl::StatusOr<int64_t> PagesCovering(int64_t layer, int64_t end) const;
  int64_t page_bytes(int64_t layer) const;

  // Host bookkeeping, thread-safe.
  absl::StatusOr<int32_t> AllocatePage(int64_t layer);
  void FreePages(int64_t layer, const std::vector<int32_t>& pages);
  absl::StatusOr<int32_t> AllocateCounterSlot();
  void FreeCounterSlot(int32_t slot);
  // Device int32 counting the private rows of (session counter slot, sdm layer index).
  int32_t* row_counter(int32_t slot, int64_t sdm_index) const;
  // Host mirror of the counters, refreshed after each step (StartRefresh, FinishRefresh) and set
  // by an upload for the session it made (SetRowCount): exact for every resident session between
  // steps (only a step takes rows for a session, only its destruction returns them).
  int32_t row_count(int32_t slot, int64_t sdm_index) const;
  void SetRowCount(int32_t slot, int64_t sdm_index, int32_t rows);

  // Free rows as of the last refresh, minus what was reserved since: a lower bound.
  int64_t free_rows_lower_bound() const;
  // Takes `rows` from the lower bound. When it is too low, first re-reads the device's count
  // (rows released since the last step), synchronising the compute stream; ResourceExhausted
  // if even that is short. Call only when no allocation is pending on the compute stream
  // (before a step enqueues its work, or before an upload's scatter).
  absl::Status ReserveRows(int64_t rows);
  // Enqueues copies of the free-row count and the counters to pinned host memory on the compute
  // stream; FinishRefresh (after the stream was synchronised) publishes them. FinishRefresh
  // fails (Internal) when the count is outside [0, rows]: rows were taken or returned twice, so
  // the step that ran may have written through a row it did not own; from then on every
  // ReserveRows() fails the same way.
  absl::Status StartRefresh();
  absl::Status FinishRefresh();

  // Runs `transfer` with the context's staging, one transfer at a time. When `transfer` fails,
  // both streams are synchronised before the staging is handed on, so no copy it enqueued still
  // reads or writes the buffers the next transfer reuses.
  absl::Status WithTransferStaging(absl::FunctionRef<absl::Status(TransferStaging&)> transfer)
      ABSL_LOCKS_EXCLUDED(staging_mu_);
  // TransferStaging::allocations() (tests: that repeated parks and resumes allocate nothing).
  int64_t transfer_staging_allocations() const ABSL_LOCKS_EXCLUDED(staging_mu_);
  // TransferStaging::chunks() (tests: where an injected transfer fault will fire).
  int64_t transfer_chunks() const ABSL_LOCKS_EXCLUDED(staging_mu_);

  // The staged-image pool (CudaStagedUpload): page-locked buffers of bf16 under the budget
  // DeviceStateSizes::staged_bytes, by the policy of engine/budgeted_buffer_pool.h (reuse the
  // smallest that fits; allocate, a quarter larger where there is room, only when the budget
  // holds the request beside the buffers in use; free pooled buffers only when it needs their
  // room: cudaFreeHost waits for the device, so only when sizes change). ResourceExhausted when
  // the buffers in use leave no room; Unavailable when host memory cannot be pinned. Buffers go
  // back with ReturnStagedImage (precondition: no copy reads it any more) and are freed with the
  // context. Thread-safe; nothing slow runs under the pool's lock, which the step thread takes
  // to give a buffer back.
  absl::StatusOr<kernels::cuda::PinnedBuffer<__nv_bfloat16>> TakeStagedImage(int64_t elems) {
    return staged_pool_.Take(elems);
  }
  void ReturnStagedImage(kernels::cuda::PinnedBuffer<__nv_bfloat16> image) {
    staged_pool_.Return(std::move(image));
  }
  StagedImageStats staged_image_stats() const { return staged_pool_.stats(); }
  // The same for the device copies of staged images (CudaStagedUpload's copy ahead): device
  // buffers under DeviceStateSizes::prefetch_bytes, by the same policy (cudaMalloc on the staging
  // thread; cudaFree, which waits for the device, only when sizes change). ReturnPrefetchImage's
  // precondition: no copy or scatter uses the buffer any more.
  absl::StatusOr<kernels::cuda::DeviceBuffer<__nv_bfloat16>> TakePrefetchImage(int64_t elems) {
    return prefetch_pool_.Take(elems);
  }
  void ReturnPrefetchImage(kernels::cuda::DeviceBuffer<__nv_bfloat16> image) {
    prefetch_pool_.Return(std::move(image));
  }
  StagedImageStats prefetch_image_stats() const { return prefetch_pool_.stats(); }
  // The buffers of a staged upload that copied ahead, given back without waiting for the device:
  // to their pools at once when the copy is done (`copied` has fired), else kept until it is,
  // which the next staging waits for before it takes buffers (ReclaimCopiesAhead). So no
  // destructor waits for a copy, and no buffer is handed out while a copy may still use it.
  void ReturnCopiedAhead(kernels::cuda::PinnedBuffer<__nv_bfloat16> image,
                         kernels::cuda::DeviceBuffer<__nv_bfloat16> device,
                         std::unique_ptr<kernels::cuda::CudaEvent> copied)
      ABSL_LOCKS_EXCLUDED(retired_mu_);
  // Waits for the copies of buffers ReturnCopiedAhead kept and gives those buffers back to their
  // pools. Called on the staging thread before it takes buffers: never on the step thread.
  void ReclaimCopiesAhead() ABSL_LOCKS_EXCLUDED(retired_mu_);
  // Staged uploads' buffers kept until their copies are done (tests).
  int64_t copies_ahead_pending() const ABSL_LOCKS_EXCLUDED(retired_mu_);

  // A session's slot or page table of `entries` int32 (contents undefined): one a session no
  // longer resident gave back (ReturnTable), else a new allocation. So once residency repeats a
  // resume allocates no table and a park frees none (cudaFree synchronises the whole device).
  // Reuse needs no synchronisation: a table's last use by its previous session (the release of
  // its rows) and its first by the next (clearing, or a page-table update) are both on the
  // compute stream, in that order. The pool holds at most the tables of the most sessions ever
  // resident at once (bounded by max_sessions; not counted in any session's DeviceBytes); they
  // are freed with the context. Thread-safe.
  absl::Status TakeTable(int64_t entries, kernels::cuda::DeviceBuffer<int32_t>* table);
  void ReturnTable(kernels::cuda::DeviceBuffer<int32_t> table);
  // Tables allocated so far (tests: constant once residency repeats).
  int64_t table_allocations() const;

  // How copies of turns' changes (CudaSessionState::CopyChangesToHost) found their rows so far
  // (tests): listed on the device, or read from the tables and marks.
  int64_t written_row_lists() const { return written_row_lists_.load(); }
  int64_t written_row_scans() const { return written_row_scans_.load(); }
  void CountWrittenRows(bool listed) { ++(listed ? written_row_lists_ : written_row_scans_); }

 private:
  CudaDeviceContext(const StateLayout& layout, const DeviceStateSizes& sizes)
      : layout_(layout),
        sizes_(sizes),
        staging_(
            (sizes.transfer_chunk_bytes > 0 ? sizes.transfer_chunk_bytes : kTransferChunkBytes) /
                static_cast<int64_t>(sizeof(__nv_bfloat16)),
            sizes.inject_transfer_fault),
        staged_pool_(sizes.staged_bytes, static_cast<int64_t>(sizeof(__nv_bfloat16)),
                     AllocateStagedImage),
        prefetch_pool_(sizes.prefetch_bytes, static_cast<int64_t>(sizeof(__nv_bfloat16)),
                       AllocatePrefetchImage) {}
  // The staged-image pool's allocator: page-locked memory (Unavailable when it cannot be had).
  static absl::StatusOr<kernels::cuda::PinnedBuffer<__nv_bfloat16>> AllocateStagedImage(
      int64_t elems);
  // The prefetch pool's: device memory (ResourceExhausted when the device has none left).
  static absl::StatusOr<kernels::cuda::DeviceBuffer<__nv_bfloat16>> AllocatePrefetchImage(
      int64_t elems);

  StateLayout layout_;
  DeviceStateSizes sizes_;
  kernels::cuda::CudaStream compute_, transfer_, prefetch_;
  std::vector<const __nv_bfloat16*> m0_;
  std::vector<int64_t> sdm_index_;
  int64_t num_sdm_layers_ = 0;
  int64_t row_width_ = 0;
  kernels::cuda::DeviceBuffer<__nv_bfloat16> rows_;
  kernels::cuda::DeviceBuffer<int32_t> free_list_, free_count_, counters_;
  kernels::cuda::PinnedBuffer<int32_t> free_count_host_, counters_host_;
  std::vector<kernels::cuda::DeviceBuffer<__nv_bfloat16>> kv_pools_;  // per layer

  mutable absl::Mutex mu_;
  std::vector<std::vector<int32_t>> free_pages_ ABSL_GUARDED_BY(mu_);  // per layer
  std::vector<int32_t> free_slots_ ABSL_GUARDED_BY(mu_);
  int64_t free_rows_ ABSL_GUARDED_BY(mu_) = 0;
  // Set once the device free count is seen outside [0, rows] (never cleared).
  absl::Status free_list_error_ ABSL_GUARDED_BY(mu_);
  absl::Status CheckFreeCount(int64_t device_free) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<int32_t> counters_published_ ABSL_GUARDED_BY(mu_);
  // TakeTable/ReturnTable: free tables by entry count.
  std::map<int64_t, std::vector<kernels::cuda::DeviceBuffer<int32_t>>> free_tables_
      ABSL_GUARDED_BY(mu_);
  int64_t table_allocations_ ABSL_GUARDED_BY(mu_) = 0;

  std::atomic<int64_t> written_row_lists_{0}, written_row_scans_{0};

  mutable absl::Mutex staging_mu_;
  TransferStaging staging_ ABSL_GUARDED_BY(staging_mu_);

  BudgetedBufferPool<kernels::cuda::PinnedBuffer<__nv_bfloat16>> staged_pool_;
  BudgetedBufferPool<kernels::cuda::DeviceBuffer<__nv_bfloat16>> prefetch_pool_;

  // ReturnCopiedAhead's buffers whose copy had not finished.
  struct RetiredCopy {
    kernels::cuda::PinnedBuffer<__nv_bfloat16> image;
    kernels::cuda::DeviceBuffer<__nv_bfloat16> device;
    std::unique_ptr<kernels::cuda::CudaEvent> copied;
  };
  mutable absl::Mutex retired_mu_;
  std::vector<RetiredCopy> retired_ ABSL_GUARDED_BY(retired_mu_);
};

// A resume staged ahead of its step (state_store/device_residency.h, StagedUpload): the upload
// plan and the bf16 image of a host session's layers in a page-locked buffer of the context's
// pool and, where the prefetch pool has room, a copy of that image on the device, started on the
// context's prefetch stream when staged (the copy ahead: the step then only scatters it, after
// waiting for the copy's event). Both buffers go back to their pools when this is destroyed, on
// any thread, without waiting for the device: never while an upload reads them
// (CudaSessionState::Upload has finished with them, or waited, before it lets go), and a copy
// ahead that may still run keeps them until it is done (CudaDeviceContext::ReturnCopiedAhead).
class CudaStagedUpload final : public StagedUpload {
 public:
  // Plans and writes the image of `host` (host work, on the calling thread), then starts its copy
  // to the device if the prefetch pool holds it; null when the image is empty (nothing to
  // convert). ResourceExhausted when the staged-image budget cannot hold it; OutOfRange as
  // PlanUpload. A copy ahead that cannot start (no room, no memory) is not an error: the step
  // copies from the page-locked image.
  static absl::StatusOr<std::unique_ptr<CudaStagedUpload>> Stage(
      std::shared_ptr<CudaDeviceContext> ctx, const SessionState& host);
  ~CudaStagedUpload() override;

  const UploadPlan& plan() const { return plan_; }
  const __nv_bfloat16* image() const { return image_.get(); }
  // The image's copy on the device (null: not copied ahead), complete once copied() has fired:
  // work on another stream that reads it waits for that event first.
  __nv_bfloat16* device_image() const { return device_image_.get(); }
  cudaEvent_t copied() const { return copied_ != nullptr ? copied_->get() : nullptr; }
  // Blocks until the copy ahead (if any) is complete (tests and benchmarks).
  absl::Status WaitForCopy() const override;

 private:
  CudaStagedUpload(std::shared_ptr<CudaDeviceContext> ctx, UploadPlan plan,
                   kernels::cuda::PinnedBuffer<__nv_bfloat16> image)
      : StagedUpload(ctx.get()),
        ctx_(std::move(ctx)),
        plan_(std::move(plan)),
        image_(std::move(image)) {}
  // Starts the copy ahead if the prefetch pool holds the image; leaves none on any failure.
  void StartCopy();

  std::shared_ptr<CudaDeviceContext> ctx_;
  UploadPlan plan_;
  kernels::cuda::PinnedBuffer<__nv_bfloat16> image_;
  kernels::cuda::DeviceBuffer<__nv_bfloat16> device_image_;
  // Recorded on the prefetch stream after the copy (null: no copy ahead).
  std::unique_ptr<kernels::cuda::CudaEvent> copied_;
};

// One session's residency on the device.
class CudaSessionState final : public DeviceResidency {
 public:
  // Copies `host`'s layers to the device (copies and scatters on the compute stream, through the
  // context's staging) and returns the residency to attach to it. With `staged` (made by this
  // context from `host` as it is now: SessionState drops stale ones) the image is taken from it
  // instead of being converted here (one that does not match is ignored), and when it was copied
  // ahead the compute stream waits for that copy and scatters from its device image, copying
  // nothing; it is free to go once this returns.
  static absl::StatusOr<std::unique_ptr<CudaSessionState>> Upload(
      std::shared_ptr<CudaDeviceContext> ctx, const SessionState& host,
      const CudaStagedUpload* staged = nullptr);
  ~CudaSessionState() override;

  absl::Status CopyToHost(SessionState& host) override;
  // The rows written since the session came to the device or since the last call (the written
  // marks, kernels/cuda/sdm.h SdmSegments::written; each goes through SdmTable::MutableRow, so
  // the host table marks it dirty) and the KV positions the host lacks (appended; a ring the
  // session went round since is copied whole). Leaves the residency attached and, on success,
  // clears the marks. Between steps, as CopyToHost.
  absl::Status CopyChangesToHost(SessionState& host) override;
  bool CopiesChanges() const override { return true; }
  int64_t DeviceBytes() const override;

  // Makes the page tables of every attention layer cover positions [0, end) (the ring's pages
  // once it is full). ResourceExhausted when an arena is out of pages; OutOfRange past
  // max_context.
  absl::Status EnsurePages(int64_t end);

  int32_t* sdm_table(int64_t layer) const { return layers_[layer].table.get(); }
  int32_t* page_table(int64_t layer) const { return layers_[layer].table.get(); }
  // An SDM layer's written marks: a byte per table entry (SdmSegments::written).
  uint8_t* written_marks(int64_t layer) const {
    return reinterpret_cast<uint8_t*>(layers_[layer].written.get());
  }
  int32_t counter_slot() const { return counter_slot_; }

 private:
  // Owned by its context (DeviceResidency::owner()): only the backend of that context steps it.
  explicit CudaSessionState(std::shared_ptr<CudaDeviceContext> ctx)
      : DeviceResidency(ctx.get()), ctx_(std::move(ctx)) {}

  struct Layer {
    // SDM: slot->row table [heads * slots]; attention: page table [page_table_entries].
    kernels::cuda::DeviceBuffer<int32_t> table;
    // SDM: the table's clearing was enqueued, so its entries are rows to release (a table from
    // the pool holds another session's entries until then).
    bool cleared = false;
    // SDM: the written marks, a byte per table entry (in a pooled table of int32, hence the
    // entries / 4 rounded up), zeroed at upload and by each CopyChangesToHost.
    kernels::cuda::DeviceBuffer<int32_t> written;
    std::vector<int32_t> pages;  // attention: arena pages in table order (host mirror)
  };
  // CopyToHost (everything) or CopyChangesToHost (changes_only).
  absl::Status Download(SessionState& host, bool changes_only);
  // A row a download moves: SDM layer, table entry (head * slots_per_head + slot), arena row.
  struct RowDownload {
    int64_t layer = 0, slot = 0;
    int32_t row = 0;
  };
  // Download's rows, in layer then slot order, after the compute stream's work (on `stream`,
  // which waits for it). ListWrittenRows: the written ones with a row of the session at
  // `position`, listed on the device (kernels/cuda/sdm.h SdmCollectWritten) within each layer's
  // bound (its private-row count, and the writes of the tokens since the marks were zeroed); false
  // (rows left empty) when a list came out longer than that bound. ScanTables: from the downloaded
  // tables, every private row or (marked_only) the marked ones.
  absl::StatusOr<bool> ListWrittenRows(TransferStaging& staging, cudaStream_t stream,
                                       int64_t position, std::vector<RowDownload>& rows);
  absl::Status ScanTables(TransferStaging& staging, cudaStream_t stream, bool marked_only,
                          std::vector<RowDownload>& rows);
  std::shared_ptr<CudaDeviceContext> ctx_;
  std::vector<Layer> layers_;
  int32_t counter_slot_ = -1;
  // The session's position when the written marks were last zeroed (at upload and by each
  // CopyChangesToHost): every mark since is a write of a token past it, which bounds a list.
  int64_t marks_cleared_at_ = 0;
};

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_CUDA_DEVICE_STATE_H_
