// The SDM layer on the GPU (docs/model-spec.md §5, §6): product-key addressing, copy-on-write row
// allocation from a device free list, the fused write-then-read step tiled over row columns, and
// the row moves used to park and resume sessions. Row layout and references:
// kernels/common/device_layout.h. Rows and M0 are bf16; gates, weights, v and readings fp32;
// arithmetic fp32. All pointers are device memory; work is enqueued on `stream`.
//
// A batch is a list of segments: segment s is rows seg_first_row[s] .. + seg_length[s] - 1 of the
// activations, consecutive tokens of one session whose layer table is tables[s]. A decode batch
// has one single-token segment per session; a prefill chunk is one segment.
#ifndef SDMSERVE_KERNELS_CUDA_SDM_H_
#define SDMSERVE_KERNELS_CUDA_SDM_H_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <span>

#include "kernels/common/sdm_addressing_math.h"
#include "kernels/common/sdm_decode_plan.h"

namespace sdm::kernels::cuda {

// The device row arena every SDM layer of every resident session draws from.
struct SdmRowArena {
  __nv_bfloat16* rows = nullptr;  // [capacity, row_width]
  int32_t* free_list = nullptr;   // [capacity]: entries [0, *free_count) are free row indices
  int32_t* free_count = nullptr;  // device scalar
  int64_t row_width = 0;
  // Rows in the arena (the free list's length). A release never writes outside [0, capacity),
  // and a pop never reads outside it nor takes an entry outside [0, capacity) (it gets no row,
  // as when the list is empty): a count pushed out of range by a broken precondition is
  // reported by the engine (CudaDeviceContext's refresh), not turned into a wild access.
  int64_t capacity = 0;
};

struct SdmDims {
  int64_t heads = 0;
  int64_t side = 0;       // s; slots per head = s * s
  int64_t row_width = 0;  // head width hd
};

struct SdmSegments {
  const int32_t* first_row = nullptr;  // [num]
  const int32_t* length = nullptr;     // [num]
  int32_t* const* tables = nullptr;    // [num] device pointers to [heads * s * s] slot->row
  // [num] device pointers to one int32 per table counting its private rows (SdmPrepareRows adds
  // the rows it allocates; the engine reads them back for memory accounting). May be null.
  int32_t* const* row_counts = nullptr;
  // [num] device pointers to one byte per table entry ([heads * s * s]): the allocation sets the
  // byte of every slot a segment's tokens write to 1 (whether its row is new or not), so that a
  // backend can copy back what a turn changed (CudaSessionState::CopyChangesToHost). Never
  // cleared here. May be null, as may an entry.
  uint8_t* const* written = nullptr;
  int64_t num = 0;
  int64_t max_length = 0;  // longest segment (1 for decode)
};

// Product-key addressing of every (row, head): scores [rows, heads * 2 * side] (half A then half
// B per head, BatchNorm already applied). Writes n = AddressCount(k, side) slots per (row, head),
// sorted ascending, to slots [rows, heads, n] and their activated weights (act, scale) to
// weights [rows, heads, n]. Same selection, ties and NaN order as cpu::SelectSlots
// (kernels/common/sdm_addressing_math.h).
cudaError_t SdmAddress(const float* scores, int64_t rows, int64_t heads, int64_t side, int64_t k,
                       AddressAct act, float scale, int32_t* slots, float* weights,
                       cudaStream_t stream);

// An eval BatchNorm applied to each score as the addressing reads it: column j of a
// [rows, heads * 2 * side] score row becomes BatchNormEvalValue(x, mean[j], var[j], w[j], b[j],
// eps) (kernels/common/fp_math.h, the function BatchNormEval and cpu::BatchNormEval apply). The
// scores in memory are left as they are. w == nullptr: no normalisation.
struct SdmScoreNorm {
  const float* w = nullptr;  // [heads * 2 * side] each
  const float* b = nullptr;
  const float* mean = nullptr;
  const float* var = nullptr;
  float eps = 0.0f;  // set with w (the engine's: kSdmBatchNormEps, engine/layer_tensors.h)
};

// One SdmAddress call's own arguments, and optionally the BatchNorm its scores still need.
struct SdmAddressJob {
  const float* scores = nullptr;  // [rows, heads * 2 * side], rows scores_stride apart
  int64_t k = 0;
  AddressAct act{};
  float scale = 1.0f;
  int32_t* slots = nullptr;  // [rows, heads, AddressCount(k, side)]
  float* weights = nullptr;  // same shape
  SdmScoreNorm norm;
  // Floats from one row's scores to the next (>= heads * 2 * side: the scores may be part of a
  // fused projection's output); 0: heads * 2 * side, the rows back to back.
  int64_t scores_stride = 0;
};

// SdmGates's arguments (elementwise.h) over the same rows and heads as the addressing, for
// SdmAddressJobs to compute in its launch. log_decay == nullptr: no gates.
struct SdmGateJob {
  const float* a = nullptr;  // row r's `heads` values at r * in_stride
  const float* b = nullptr;
  int64_t in_stride = 0;
  const float* a_log = nullptr;
  const float* dt_bias = nullptr;
  float* log_decay = nullptr;  // [rows, heads] out
  float* beta = nullptr;       // [rows, heads] out
};

// SdmAddress for up to two jobs over the same rows, heads and side in one launch (a step's write
// and read addressing), each with its own BatchNorm or none: each job's outputs are exactly what
// BatchNormEval (when job.norm.w is set) then its own SdmAddress call write, bit for bit. With
// `gates`, the launch also writes what SdmGates writes for them (the block of the first job that
// selects anything computes its row and head's gates; SdmGates is launched instead when no job
// selects anything).
cudaError_t SdmAddressJobs(std::span<const SdmAddressJob> jobs, int64_t rows, int64_t heads,
                           int64_t side, cudaStream_t stream, const SdmGateJob& gates = {});

// Copy-on-write: for every segment, in token order, every write slot w_slots [rows, heads, n_w]
// whose table entry is kSdmNoRow gets a row popped from the arena's free list, initialised from
// M0 (m0 [heads * s * s, row_width], or zeros when m0 is null); the table is updated. Then writes
// w_rows [rows, heads, n_w] (row indices) and, from the tables after every allocation of the
// batch, r_refs [rows, heads, n_r] for r_slots (row index, or SdmM0Ref for a slot still at M0).
// Precondition: the free list holds at least rows * heads * n_w entries (the engine reserves
// before the step), and no session appears in two segments.
cudaError_t SdmPrepareRows(const int32_t* w_slots, int64_t n_w, const int32_t* r_slots, int64_t n_r,
                           const SdmSegments& segs, const SdmDims& dims, const __nv_bfloat16* m0,
                           const SdmRowArena& arena, int32_t* w_rows, int32_t* r_refs,
                           cudaStream_t stream);

struct SdmStepArgs {
  const int32_t* w_rows = nullptr;   // [rows, heads, n_w] from SdmPrepareRows
  const float* w_weights = nullptr;  // [rows, heads, n_w] activated write weights k_i
  int64_t n_w = 0;
  const int32_t* r_refs = nullptr;   // [rows, heads, n_r] from SdmPrepareRows
  const float* r_weights = nullptr;  // [rows, heads, n_r] activated read weights q_j
  int64_t n_r = 0;
  const float* log_decay = nullptr;  // [rows, heads] g (SdmGates)
  const float* beta = nullptr;       // [rows, heads]
  const float* v = nullptr;          // [rows, heads * row_width], rows v_stride apart
  // Floats from one row of v to the next (>= heads * row_width); 0: heads * row_width.
  int64_t v_stride = 0;
  bool key_weighted_decay = false;    // alpha_i = exp(g * k_i) instead of exp(g)
  bool slot_residual = false;         // update_rule: slot_residual instead of shared residual
  const __nv_bfloat16* m0 = nullptr;  // for M0 references (null: zeros)
  float* readings = nullptr;          // [rows, heads * row_width] out
};

// The write (cpu::SdmWriteColumns) then the read after write (cpu::SdmReadColumns) of every
// (segment, head), sequential over a segment's tokens, each block owning a tile of columns.
// Written rows are stored as bf16; the read sees the stored values.
cudaError_t SdmStep(const SdmStepArgs& args, const SdmSegments& segs, const SdmDims& dims,
                    const SdmRowArena& arena, cudaStream_t stream);

// The arguments of a decode step: the addressing's slots (not rows) and weights, the gates and v.
struct SdmDecodeArgs {
  const int32_t* w_slots = nullptr;  // [rows, heads, n_w] from SdmAddress: distinct, ascending
  const float* w_weights = nullptr;  // [rows, heads, n_w]
  int64_t n_w = 0;
  const int32_t* r_slots = nullptr;  // [rows, heads, n_r] from SdmAddress
  const float* r_weights = nullptr;  // [rows, heads, n_r]
  int64_t n_r = 0;
  const float* log_decay = nullptr;  // [rows, heads]
  const float* beta = nullptr;       // [rows, heads]
  const float* v = nullptr;          // [rows, heads * row_width], rows v_stride apart
  int64_t v_stride = 0;              // as SdmStepArgs::v_stride
  bool key_weighted_decay = false;
  bool slot_residual = false;
  const __nv_bfloat16* m0 = nullptr;  // null: zeros
  float* readings = nullptr;          // [rows, heads * row_width] out
  // [rows, heads, n_w] scratch for the allocation's result when it runs as its own launch (a
  // row of more tiles than a cluster holds: SdmDecodeAlloc::kSeparate in
  // kernels/common/sdm_decode_plan.h); its contents afterwards are unspecified.
  int32_t* w_rows = nullptr;
};

// What SdmPrepareRows then SdmStep do for a decode batch (every segment one token: segs.max_length
// == 1), bit for bit in the rows' contents, the readings, which slots get rows, the row counts,
// the written marks and the free count (the popped rows may go to the slots in another order),
// touching memory less: each written row is read from memory once and written once (SdmStep
// reads it twice and a new row is first copied from M0), each read row read once, a slot the
// token wrote not at all:
//   - a (segment, head)'s write slots are distinct (one token), so its rows are allocated in
//     parallel by one block: one atomicSub on the free count per (segment, head);
//   - a new row's first write reads M0's row (or zeros) and stores the result: no copy from M0
//     beforehand;
//   - each block stages its column tile of the token's written rows in shared memory once; the
//     update and every read of a slot written by the same token use that copy, other reads go to
//     the arena or M0.
// How a row is split over blocks follows PlanSdmDecode (kernels/common/sdm_decode_plan.h): when
// one block's column tile covers the row, that block allocates (one kernel per layer); when the
// row takes 2-16 tiles, they run as one thread-block cluster whose rank 0 allocates and the
// others read its result from rank 0's shared memory after a cluster barrier (one kernel; more
// than 8 blocks need the non-portable opt-in, and where it or cluster launch is refused the next
// case applies); otherwise a block per (segment, head) allocates first (two launches), since a
// tile block cannot see another block's allocations within a launch.
// Preconditions as SdmPrepareRows (the reserve, no session in two segments); slots within a
// (row, head) distinct. `max_cluster_blocks` caps the clusters (1: none, so rows of several
// tiles take the two launches; for comparisons: sdm-bench kernels, the tests). INVALID_VALUE for
// multi-token segments' bounds (segs.max_length != 1), n_w or n_r over 256, or a cap below 1.
cudaError_t SdmDecodeStep(const SdmDecodeArgs& args, const SdmSegments& segs, const SdmDims& dims,
                          const SdmRowArena& arena, cudaStream_t stream,
                          int64_t max_cluster_blocks = kSdmMaxClusterBlocks);

// What SdmDecodeStep launches for these arguments on the current device: PlanSdmDecode
// (kernels/common/sdm_decode_plan.h) capped by what the device grants (no clusters where it does
// not launch them; clusters of at most kSdmPortableClusterBlocks where the kernel's non-portable
// opt-in is refused, which this asks for once). For benchmarks' labels and the tests.
SdmDecodePlan SdmDecodeStepPlan(const SdmDecodeArgs& args, const SdmSegments& segs,
                                const SdmDims& dims, const SdmRowArena& arena,
                                int64_t max_cluster_blocks = kSdmMaxClusterBlocks);

// Returns every row of table [n_slots] to the free list and resets its entries to kSdmNoRow.
cudaError_t SdmReleaseRows(int32_t* table, int64_t n_slots, const SdmRowArena& arena,
                           cudaStream_t stream);

// The written slots of one table that have a row (SdmSegments::written): for every entry e of
// table [entries] with marks[e] != 0 and table[e] >= 0, the pair (e, table[e]) in pairs
// [2 * capacity], in no particular order, and one count added to *count (which the caller zeroes
// first). Every such entry is counted, also past `capacity`, whose pairs are then not written, so
// a count above capacity says the list is incomplete. Marks and table are left as they are.
// INVALID_VALUE for negative sizes or entries past 2^31.
cudaError_t SdmCollectWritten(const int32_t* table, const uint8_t* marks, int64_t entries,
                              int32_t* pairs, int64_t capacity, int32_t* count,
                              cudaStream_t stream);

// dst[i] = arena row row_ids[i] for i < count (dst contiguous [count, row_width]): GatherBlocks
// (kernels/cuda/elementwise.h) over the arena's rows.
cudaError_t SdmGatherRows(const SdmRowArena& arena, const int32_t* row_ids, int64_t count,
                          __nv_bfloat16* dst, cudaStream_t stream);

// For i < count: pops a row, copies src[i] ([count, row_width] contiguous) into it and sets
// table[slot_ids[i]] to it (slot_ids index the table: head * s * s + slot). The free list must
// hold `count` entries.
cudaError_t SdmScatterRows(const __nv_bfloat16* src, const int32_t* slot_ids, int64_t count,
                           int32_t* table, const SdmRowArena& arena, cudaStream_t stream);

// Initialises a free list holding every row: free_list[i] = i, *free_count = capacity.
cudaError_t SdmInitFreeList(const SdmRowArena& arena, int64_t capacity, cudaStream_t stream);

}  // namespace sdm::kernels::cuda

#endif  // SDMSERVE_KERNELS_CUDA_SDM_H_
