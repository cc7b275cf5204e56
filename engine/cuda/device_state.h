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
// the compute stream, so they never race; bulk copies between host and device run on the
// transfer stream, ordered against the compute stream by events. Host bookkeeping (free pages,
// counter slots) is guarded by the context's mutex: the store's worker thread parks sessions
// while the scheduler thread runs steps.
#ifndef SDMSERVE_ENGINE_CUDA_DEVICE_STATE_H_
#define SDMSERVE_ENGINE_CUDA_DEVICE_STATE_H_

#include <cuda_bf16.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
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
};

class CudaDeviceContext {
 public:
  // Allocates the arenas for `layout`. m0[l] is layer l's M0 on the device (null: zeros).
  static absl::StatusOr<std::shared_ptr<CudaDeviceContext>> Create(
      const StateLayout& layout, const DeviceStateSizes& sizes,
      std::vector<const __nv_bfloat16*> m0);

  cudaStream_t compute() const { return compute_.get(); }
  cudaStream_t transfer() const { return transfer_.get(); }
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
  int64_t page_bytes(int64_t layer) const;

  // Host bookkeeping, thread-safe.
  absl::StatusOr<int32_t> AllocatePage(int64_t layer);
  void FreePages(int64_t layer, const std::vector<int32_t>& pages);
  absl::StatusOr<int32_t> AllocateCounterSlot();
  void FreeCounterSlot(int32_t slot);
  // Device int32 counting the private rows of (session counter slot, sdm layer index).
  int32_t* row_counter(int32_t slot, int64_t sdm_index) const;
  // Host mirror of the counters, refreshed by RefreshCounters (after each step).
  int32_t row_count(int32_t slot, int64_t sdm_index) const;

  // Free rows as of the last refresh, minus what was reserved since: a lower bound.
  int64_t free_rows_lower_bound() const;
  // Takes `rows` from the lower bound. When it is too low, first re-reads the device's count
  // (rows released since the last step), synchronising the compute stream; ResourceExhausted
  // if even that is short. Call only when no allocation is pending on the compute stream
  // (before a step enqueues its work, or before an upload's scatter).
  absl::Status ReserveRows(int64_t rows);
  // Enqueues copies of the free-row count and the counters to pinned host memory on the compute
  // stream; FinishRefresh (after the stream was synchronised) publishes them.
  absl::Status StartRefresh();
  void FinishRefresh();

 private:
  CudaDeviceContext(const StateLayout& layout, const DeviceStateSizes& sizes)
      : layout_(layout), sizes_(sizes) {}

  StateLayout layout_;
  DeviceStateSizes sizes_;
  kernels::cuda::CudaStream compute_, transfer_;
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
};

// One session's residency on the device.
class CudaSessionState final : public DeviceResidency {
 public:
  // Copies `host`'s layers to the device (bulk copies on the transfer stream, row scatter on the
  // compute stream, which waits for them) and returns the residency to attach to it.
  static absl::StatusOr<std::unique_ptr<CudaSessionState>> Upload(
      std::shared_ptr<CudaDeviceContext> ctx, const SessionState& host);
  ~CudaSessionState() override;

  absl::Status CopyToHost(SessionState& host) override;
  int64_t DeviceBytes() const override;

  // Makes the page tables of every attention layer cover positions [0, end) (the ring's pages
  // once it is full). ResourceExhausted when an arena is out of pages; OutOfRange past
  // max_context.
  absl::Status EnsurePages(int64_t end);

  int32_t* sdm_table(int64_t layer) const { return layers_[layer].table.get(); }
  int32_t* page_table(int64_t layer) const { return layers_[layer].table.get(); }
  int32_t counter_slot() const { return counter_slot_; }

 private:
  // Owned by its context (DeviceResidency::owner()): only the backend of that context steps it.
  explicit CudaSessionState(std::shared_ptr<CudaDeviceContext> ctx)
      : DeviceResidency(ctx.get()), ctx_(std::move(ctx)) {}

  struct Layer {
    // SDM: slot->row table [heads * slots]; attention: page table [page_table_entries].
    kernels::cuda::DeviceBuffer<int32_t> table;
    std::vector<int32_t> pages;  // attention: arena pages in table order (host mirror)
  };
  std::shared_ptr<CudaDeviceContext> ctx_;
  std::vector<Layer> layers_;
  int32_t counter_slot_ = -1;
};

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_CUDA_DEVICE_STATE_H_
