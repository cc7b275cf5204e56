// The SDM layer on the GPU (see sdm.h; docs/model-spec.md §5, §6). Selection and update math
// come from the SDM_HOST_DEVICE helpers that the CPU kernels use (kernels/common/
// sdm_addressing_math.h, sdm_math.h), so the CPU tests cover them.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <span>

#include "kernels/common/device_layout.h"
#include "kernels/common/fp_math.h"
#include "kernels/common/sdm_addressing_math.h"
#include "kernels/common/sdm_decode_plan.h"
#include "kernels/common/sdm_math.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/sdm.h"

namespace sdm::kernels::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

// Limits of the kernels' fixed-size shared arrays.
constexpr int64_t kMaxSelected = 256;  // slots per (row, head): AddressCount(k, s) <= 256
constexpr int64_t kMaxSide = 1024;     // s; candidates k_sub^2 <= 65536, slots < 2^20

__device__ __forceinline__ unsigned LaneMaskLt(int lane) { return (1u << lane) - 1u; }

// Block-wide reduction with `op` (every thread of the block calls it; blockDim a multiple of
// 32). scratch: 32 entries of shared memory; reusable right after the call returns.
template <typename T, typename Op>
__device__ T BlockReduce(T x, T* scratch, Op op) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = static_cast<int>(blockDim.x >> 5);
  for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(kFullMask, x, o));
  __syncthreads();  // a previous call may still be reading scratch
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  T r = scratch[0];
  for (int w = 1; w < warps; ++w) r = op(r, scratch[w]);
  return r;
}

// ---------------------------------------------------------------------------------------------
// Addressing: one block of kAddressThreads per (row, head).
//   1. Each half's top k_sub by rank: a thread per element counts the elements whose rank key
//      (precomputed in shared memory) is larger; no synchronisation. idx[half][r] is the half's
//      r-th best index, so the halves come out in rank order.
//   2. The count-th largest candidate rank key by an MSD radix select over the pruned candidate
//      pairs (kernels/common/sdm_addressing_math.h, "Candidate pruning": (i + 1)(j + 1) <= count,
//      about count * ln(count) pairs instead of k_sub^2; sums computed on the fly, never stored):
//      per 8-bit digit a shared histogram built with warp-aggregated atomics, then
//      RadixSelectDigit on one thread. If a row's first pair beyond the pruned ones ties the
//      threshold's value, the select reruns over all k_sub^2 pairs (exact ties only).
//   3. Candidates with key >= threshold (exactly count of them: keys are distinct) are appended
//      to shared memory, then placed by rank of slot, so the output is sorted ascending.
//   4. Activation with block reductions (same final formulas as the CPU's serial helper).
// The CPU twin (kernels/cpu/sdm_addressing.cc) runs the same selection serially
// (AddressSelectPrunedSerial), so both give the slots and sums of the full selection bit for bit.
constexpr int kAddressThreads = 256;

// Candidate e of a selection as a pair of ranks (i, j). Full: all k_sub^2 pairs row-major.
// Pruned: row i holds AddressPrunedRowLength(i) pairs starting at row_start[i] (k_sub + 1
// prefix sums in shared memory); a binary search finds the row.
struct CandidatePairs {
  const int32_t* row_start;  // null: full
  int32_t rows;              // k_sub
  __device__ void Of(int32_t e, int32_t* i, int32_t* j) const {
    if (row_start == nullptr) {
      *i = e / rows;
      *j = e % rows;
      return;
    }
    int32_t lo = 0, hi = rows - 1;  // the last row whose start is <= e
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) >> 1;
      if (row_start[mid] <= e) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    *i = lo;
    *j = e - row_start[lo];
  }
};

// The count-th largest rank key among candidates [0, n) of `pairs` (every thread of the block
// calls it; returns the same key on every thread). hist, sh_digit, sh_remaining: shared.
__device__ uint64_t SelectThreshold(const float* sc, int64_t side, const int32_t* idx_a,
                                    const int32_t* idx_b, CandidatePairs pairs, int32_t n,
                                    int64_t count, int slot_bytes, int32_t* hist, int32_t* sh_digit,
                                    int64_t* sh_remaining) {
  const int tid = threadIdx.x, lane = tid & 31;
  uint64_t prefix = 0, prefix_mask = 0;
  if (tid == 0) *sh_remaining = count;
  for (int shift = AddressRankKeyBits(slot_bytes) - 8; shift >= 0; shift -= 8) {
    for (int d = tid; d < 256; d += blockDim.x) hist[d] = 0;
    __syncthreads();
    // Uniform trip count per warp, so the warp-wide match below sees every lane.
    for (int32_t base = 0; base < n; base += static_cast<int32_t>(blockDim.x)) {
      int digit = -1;
      if (base + tid < n) {
        int32_t i, j;
        pairs.Of(base + tid, &i, &j);
        const uint64_t key = AddressCandidateOf(sc, side, idx_a[i], idx_b[j], slot_bytes).key;
        if ((key & prefix_mask) == prefix) digit = static_cast<int>((key >> shift) & 0xff);
      }
      const unsigned peers = __match_any_sync(kFullMask, digit);
      if (digit >= 0 && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
    }
    __syncthreads();
    if (tid == 0) {
      int64_t remaining = *sh_remaining;
      *sh_digit = RadixSelectDigit(hist, &remaining);
      *sh_remaining = remaining;
    }
    __syncthreads();
    prefix |= static_cast<uint64_t>(*sh_digit) << shift;
    prefix_mask |= uint64_t{0xff} << shift;
  }
  return prefix;
}

// Up to two addressing jobs of the same rows, heads and side (a step's write and read
// addressing): blockIdx.y picks the job, blockIdx.x the (row, head).
struct AddressJobPair {
  SdmAddressJob job[2];
};

__global__ void __launch_bounds__(kAddressThreads)
    AddressKernel(AddressJobPair jobs, int64_t heads, int64_t side, SdmGateJob gates) {
  if (gates.log_decay != nullptr && blockIdx.y == 0 && threadIdx.x == 0) {
    // SdmGatesOp's (elementwise.cu) for this block's row and head.
    const int64_t rh = blockIdx.x;
    const int64_t h = rh % heads;
    const int64_t at = (rh / heads) * gates.in_stride + h;
    gates.log_decay[rh] = SdmLogDecay(gates.a_log[h], gates.a[at], gates.dt_bias[h]);
    gates.beta[rh] = Sigmoid(gates.b[at]);
  }
  // A select, not a run-time index into the parameter array (which would copy it to the stack).
  const SdmAddressJob job = blockIdx.y == 0 ? jobs.job[0] : jobs.job[1];
  const float* scores = job.scores;
  const int64_t k = job.k;
  const AddressAct act = job.act;
  const float scale = job.scale;
  int32_t* slots_out = job.slots;
  float* weights_out = job.weights;
  // Dynamic: scores [2 * side] (half A then half B), then their rank keys [2 * side].
  extern __shared__ float sc[];
  uint64_t* half_key = reinterpret_cast<uint64_t*>(sc + 2 * side);  // 8-byte aligned: 8 * side
  __shared__ int32_t idx[2][kMaxSelected];
  __shared__ int32_t row_start[kMaxSelected + 1];
  __shared__ int32_t hist[256];
  __shared__ int32_t sel_slot[kMaxSelected], out_slot[kMaxSelected];
  __shared__ float sel_sum[kMaxSelected], out_sum[kMaxSelected];
  __shared__ int32_t sel_n, sh_digit, sh_full;
  __shared__ int64_t sh_remaining;
  __shared__ float red_f[32];
  __shared__ double red_d[32];

  const int tid = threadIdx.x;
  const int64_t rh = blockIdx.x;
  const float* src = scores + (rh / heads) * job.scores_stride + (rh % heads) * 2 * side;
  const int half_bytes = AddressIndexBytes(side);
  const SdmScoreNorm& norm = job.norm;
  const int64_t first_column = (rh % heads) * 2 * side;  // of this head's scores in the row
  for (int64_t i = tid; i < 2 * side; i += blockDim.x) {
    float x = src[i];
    if (norm.w != nullptr) {
      const int64_t j = first_column + i;
      x = BatchNormEvalValue(x, norm.mean[j], norm.var[j], norm.w[j], norm.b[j], norm.eps);
    }
    sc[i] = x;
    half_key[i] = AddressRankKey(x, i < side ? i : i - side, half_bytes);
  }
  const int64_t k_sub = AddressSubCount(k, side);
  const int64_t count = AddressCount(k, side);
  if (tid == 0) {
    sel_n = 0;
    sh_full = 0;
    int32_t start = 0;  // k_sub <= kMaxSelected (count <= kMaxSelected and k_sub <= count)
    for (int64_t i = 0; i < k_sub; ++i) {
      row_start[i] = start;
      start += static_cast<int32_t>(AddressPrunedRowLength(i, count, k_sub));
    }
    row_start[k_sub] = start;
  }
  __syncthreads();

  for (int64_t i = tid; i < 2 * side; i += blockDim.x) {
    const int half = i >= side ? 1 : 0;
    const uint64_t* keys = half_key + half * side;
    const uint64_t mine = half_key[i];
    int64_t rank = 0;  // AddressRankOf over precomputed keys
    for (int64_t j = 0; j < side; ++j) rank += keys[j] > mine ? 1 : 0;
    if (rank < k_sub) idx[half][rank] = static_cast<int32_t>(i - half * side);
  }
  __syncthreads();

  const int32_t n_full = static_cast<int32_t>(k_sub * k_sub);
  const int slot_bytes = AddressIndexBytes(side * side);
  CandidatePairs pairs{nullptr, static_cast<int32_t>(k_sub)};
  int32_t n = n_full;
  uint64_t threshold = 0;  // count == n_full: every candidate
  if (count < n_full) {
    pairs.row_start = row_start;
    n = row_start[k_sub];
    threshold = SelectThreshold(sc, side, idx[0], idx[1], pairs, n, count, slot_bytes, hist,
                                &sh_digit, &sh_remaining);
    for (int64_t i = tid; i < k_sub; i += blockDim.x) {
      if (AddressPrunedRowReachesThreshold(sc, side, idx[0], idx[1], i, count, k_sub, threshold,
                                           slot_bytes)) {
        sh_full = 1;  // benign race: every writer stores 1
      }
    }
    __syncthreads();
    if (sh_full != 0) {
      pairs.row_start = nullptr;
      n = n_full;
      threshold = SelectThreshold(sc, side, idx[0], idx[1], pairs, n, count, slot_bytes, hist,
                                  &sh_digit, &sh_remaining);
    }
  }

  for (int32_t e = tid; e < n; e += static_cast<int32_t>(blockDim.x)) {
    int32_t i, j;
    pairs.Of(e, &i, &j);
    const AddressCandidate c = AddressCandidateOf(sc, side, idx[0][i], idx[1][j], slot_bytes);
    if (c.key >= threshold) {
      const int pos = atomicAdd(&sel_n, 1);
      if (pos < kMaxSelected) {
        sel_slot[pos] = c.slot;
        sel_sum[pos] = c.sum;
      }
    }
  }
  __syncthreads();
  for (int64_t t = tid; t < count; t += blockDim.x) {
    const int32_t mine = sel_slot[t];
    int rank = 0;
    for (int64_t u = 0; u < count; ++u) rank += sel_slot[u] < mine ? 1 : 0;
    out_slot[rank] = mine;
    out_sum[rank] = sel_sum[t];
  }
  __syncthreads();

  // count <= kMaxSelected == blockDim.x: thread t owns output t.
  const bool has = tid < count;
  float x = has ? out_sum[tid] : 0.0f;
  float y = x;
  if (act == AddressAct::kSoftmax) {
    x *= scale;
    const float max_v = BlockReduce(has ? x : -INFINITY, red_f,
                                    [](float a, float b) { return fmaxf(a, b); });  // skips NaN
    const float ex = has ? expf(x - max_v) : 0.0f;
    const double sum =
        BlockReduce(static_cast<double>(ex), red_d, [](double a, double b) { return a + b; });
    y = ex * AddressSoftmaxInv(sum);
  } else if (act == AddressAct::kL2Normalize) {
    const double ss = BlockReduce(has ? static_cast<double>(x) * x : 0.0, red_d,
                                  [](double a, double b) { return a + b; });
    y = x / AddressL2Denominator(ss);
  } else {
    y = AddressActPointwise(act, x);
  }
  if (has) {
    slots_out[rh * count + tid] = out_slot[tid];
    weights_out[rh * count + tid] = y;
  }
}

// ---------------------------------------------------------------------------------------------
// Row copies (a warp per row). kVec16: 16-byte accesses (row_width % 8 == 0, aligned pointers).
template <bool kVec16>
__device__ void WarpCopyRow(__nv_bfloat16* dst, const __nv_bfloat16* src, int64_t width, int lane) {
  if constexpr (kVec16) {
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4* s = reinterpret_cast<const uint4*>(src);
    for (int64_t c = lane; c < width / 8; c += 32)
      d[c] = s != nullptr ? s[c] : make_uint4(0, 0, 0, 0);
  } else {
    for (int64_t c = lane; c < width; c += 32)
      dst[c] = src != nullptr ? src[c] : __float2bfloat16(0.0f);
  }
}

// ---------------------------------------------------------------------------------------------
// Copy-on-write preparation, three kernels in stream order:
//   PrepareAllocKernel: a warp per (segment, head) walks that segment's write entries in token
//     then slot order, 32 at a time. A slot still at kSdmNoRow gets a row popped from the free
//     list (one atomicSub per chunk; lanes take consecutive entries in lane order), the table is
//     updated, and a later entry of the same slot (same chunk: __match_any_sync leader; later
//     chunk: it sees the table) gets the same row. The allocating entry's w_rows is marked
//     -2 - row so the next kernel knows which rows to initialise.
//   PrepareCopyKernel: a warp per marked entry copies M0's row (or zeros) into the new row.
//   PrepareRefsKernel: clears the marks and resolves the read references from the tables, now
//     that every allocation of the batch is done.
// Free-list exhaustion (a broken precondition) leaves the slot at kSdmNoRow, writes kSdmNoRow to
// w_rows (SdmStep skips such writes) and leaves *free_count negative for the engine to see.
constexpr int kPrepareThreads = 128;

// Head h's written marks of segment `seg` (SdmSegments::written; byte `slot` is the slot's), or
// null where marks are not kept. Several threads may mark one byte: they store the same value.
__device__ __forceinline__ uint8_t* WrittenMarks(const SdmSegments& segs, int64_t seg, int64_t h,
                                                 int64_t slots_per_head) {
  if (segs.written == nullptr || segs.written[seg] == nullptr) return nullptr;
  return segs.written[seg] + h * slots_per_head;
}

// The row at position `pos` of the free list, or kSdmNoRow where the position or the entry there
// is outside the list: a count pushed out of range (a broken precondition, which the engine's
// refresh reports, CudaDeviceContext::CheckFreeCount) must not become a read past the list or a
// write to a row outside the arena.
__device__ __forceinline__ int32_t PopFreeRow(const int32_t* free_list, int64_t capacity,
                                              int64_t pos) {
  if (pos < 0 || pos >= capacity) return kSdmNoRow;
  const int32_t row = free_list[pos];
  return row >= 0 && row < capacity ? row : kSdmNoRow;
}

__global__ void __launch_bounds__(kPrepareThreads)
    PrepareAllocKernel(const int32_t* w_slots, int64_t n_w, SdmSegments segs, int64_t heads,
                       int64_t slots_per_head, SdmRowArena arena, int32_t* w_rows) {
  const int lane = threadIdx.x & 31;
  const int64_t group = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (group >= segs.num * heads) return;  // whole warps exit together
  const int64_t seg = group / heads, h = group % heads;
  const int64_t first = segs.first_row[seg];
  const int64_t total = static_cast<int64_t>(segs.length[seg]) * n_w;
  int32_t* table = segs.tables[seg] + h * slots_per_head;
  uint8_t* const written = WrittenMarks(segs, seg, h, slots_per_head);
  int32_t allocated = 0;
  for (int64_t base = 0; base < total; base += 32) {
    const int64_t w = base + lane;
    const bool valid = w < total;
    const int64_t e = ((first + w / n_w) * heads + h) * n_w + w % n_w;
    const int32_t slot = valid ? w_slots[e] : -1;
    const bool in_range = valid && slot >= 0 && slot < slots_per_head;
    const int32_t entry = in_range ? table[slot] : kSdmNoRow;
    const bool need = in_range && entry == kSdmNoRow;
    if (in_range && written != nullptr) written[slot] = 1;
    // Lanes needing the same slot group together; the lowest lane allocates.
    const unsigned same = __match_any_sync(kFullMask, need ? slot : -1 - lane);
    const int leader = __ffs(same) - 1;
    const bool is_new = need && lane == leader;
    const unsigned news = __ballot_sync(kFullMask, is_new);
    int32_t top = 0;
    if (news != 0) {
      if (lane == 0) top = atomicSub(arena.free_count, __popc(news));
      top = __shfl_sync(kFullMask, top, 0);
    }
    int32_t row = entry;
    if (is_new) {
      const int32_t pos = top - 1 - __popc(news & LaneMaskLt(lane));
      row = PopFreeRow(arena.free_list, arena.capacity, pos);
      if (row >= 0) table[slot] = row;
    }
    const int32_t leader_row = __shfl_sync(kFullMask, row, leader);
    if (need) row = leader_row;
    if (valid) w_rows[e] = (is_new && row >= 0) ? -2 - row : row;
    allocated += __popc(__ballot_sync(kFullMask, is_new && row >= 0));
    __syncwarp();  // this chunk's table writes are seen by the next chunk's reads
  }
  if (lane == 0 && allocated > 0 && segs.row_counts != nullptr && segs.row_counts[seg] != nullptr) {
    atomicAdd(segs.row_counts[seg], allocated);
  }
}

template <bool kVec16>
__global__ void __launch_bounds__(kPrepareThreads)
    PrepareCopyKernel(const int32_t* w_slots, int64_t n_w, SdmSegments segs, int64_t heads,
                      int64_t slots_per_head, const __nv_bfloat16* m0, __nv_bfloat16* rows,
                      int64_t width, const int32_t* w_rows) {
  const int lane = threadIdx.x & 31;
  const int64_t q = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  for (int64_t seg = blockIdx.y; seg < segs.num; seg += gridDim.y) {
    const int64_t per_row = heads * n_w;
    if (q >= segs.length[seg] * per_row) continue;
    const int64_t e = segs.first_row[seg] * per_row + q;
    const int32_t mark = w_rows[e];
    if (mark > -2) continue;
    const int64_t row = -2 - static_cast<int64_t>(mark);
    const int64_t h = (e / n_w) % heads;
    const __nv_bfloat16* src =
        m0 != nullptr ? m0 + (h * slots_per_head + w_slots[e]) * width : nullptr;
    WarpCopyRow<kVec16>(rows + row * width, src, width, lane);
  }
}

__global__ void __launch_bounds__(kPrepareThreads)
    PrepareRefsKernel(int64_t n_w, const int32_t* r_slots, int64_t n_r, SdmSegments segs,
                      int64_t heads, int64_t slots_per_head, int32_t* w_rows, int32_t* r_refs) {
  const int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t seg = blockIdx.y; seg < segs.num; seg += gridDim.y) {
    const int64_t len = segs.length[seg], first = segs.first_row[seg];
    if (q < len * heads * n_w) {
      const int64_t e = first * heads * n_w + q;
      const int32_t mark = w_rows[e];
      if (mark <= -2) w_rows[e] = -2 - mark;
    } else if (q < len * heads * (n_w + n_r)) {
      const int64_t e = first * heads * n_r + (q - len * heads * n_w);
      const int64_t h = (e / n_r) % heads;
      const int32_t slot = r_slots[e];
      const int32_t entry = segs.tables[seg][h * slots_per_head + slot];
      r_refs[e] = entry >= 0 ? entry : SdmM0Ref(h, slot, slots_per_head);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The fused write + read. Tiling: block (segment, column tile, head) with kStepWarps warps. A
// tile is 32 lanes x kVec columns (kVec = 8: 16-byte bf16 loads, 256 columns = 512 B of a row
// per warp access, coalesced). The columns are independent (docs/model-spec.md §5.7), so a block
// owns its tile of every row of its head for the whole segment and walks the segment's tokens
// in order with no inter-block communication. Within a token the warps split the rows (warp w
// takes rows w, w + 8, ...), each warp keeping kBatch rows' loads in flight, and per-warp
// column partial sums are combined through shared memory:
//   stage   indices, weights, decays, v tile into shared memory          | sync
//   A       vhat partials = sum_i k_i alpha_i M_i (shared residual only) | sync
//           delta = beta (v - vhat) per column                            | sync
//   B       M_i = SdmSharedResidualRn / SdmSlotResidualRn (kernels/common/sdm_math.h), bf16 | sync
//   read    y partials = sum_j q_j M_j (arena row, M0 row or zeros)      | sync
//           y per column -> readings
// B re-reads the rows A read (same warp, same lanes; L1/L2 hits). The sync after B makes the
// block's bf16 stores visible to the read and to the next token (rows are plain global loads,
// never the non-coherent read-only path). No other block touches these columns of these rows.
constexpr int kStepThreads = 256;
constexpr int kStepWarps = kStepThreads / 32;
constexpr int kBatch = 4;

template <int kVec>
__device__ __forceinline__ void LoadBf16(const __nv_bfloat16* p, float (&x)[kVec]) {
  if constexpr (kVec == 8) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h2[i]);
      x[2 * i] = f.x;
      x[2 * i + 1] = f.y;
    }
  } else if constexpr (kVec == 2) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
    x[0] = f.x;
    x[1] = f.y;
  } else {
    x[0] = __bfloat162float(*p);
  }
}

template <int kVec>
__device__ __forceinline__ void StoreBf16(__nv_bfloat16* p, const float (&x)[kVec]) {
  if constexpr (kVec == 8) {
    uint4 raw;
    __nv_bfloat162* h2 = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h2[i] = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
  } else if constexpr (kVec == 2) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x[0], x[1]);
  } else {
    *p = __float2bfloat16_rn(x[0]);
  }
}

template <int kVec>
__global__ void __launch_bounds__(kStepThreads)
    StepKernel(SdmStepArgs args, SdmSegments segs, int64_t heads, int64_t width,
               __nv_bfloat16* rows, int64_t tiles) {
  constexpr int kTile = 32 * kVec;
  __shared__ int32_t s_wrow[kMaxSelected], s_rref[kMaxSelected];
  __shared__ float s_k[kMaxSelected], s_alpha[kMaxSelected], s_q[kMaxSelected];
  __shared__ __align__(16) float s_part[kStepWarps][kTile];
  __shared__ float s_delta[kTile], s_v[kTile];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t seg = blockIdx.x / tiles;
  const int64_t tile = blockIdx.x % tiles;
  const int64_t h = blockIdx.y;
  const int64_t first = segs.first_row[seg], len = segs.length[seg];
  const int64_t n_w = args.n_w, n_r = args.n_r;
  const int64_t c_lane = tile * kTile + lane * kVec;  // this lane's first column
  const bool active = c_lane < width;                 // width % kVec == 0
  const int64_t c_tid = tile * kTile + tid;           // column of the per-column steps
  const bool shared_residual = !args.slot_residual;
  // This thread's column of v at the segment's first token, a row of v further each token (an
  // advanced pointer, not r * v_stride: that index cost StepKernel<1> and <2> a spill).
  const float* v_at = args.v + first * args.v_stride + h * width + c_tid;

  for (int64_t t = 0; t < len; ++t, v_at += args.v_stride) {
    const int64_t r = first + t;
    const int64_t rh = r * heads + h;
    const float g = args.log_decay[rh];
    const float beta = args.beta[rh];
    for (int64_t i = tid; i < n_w; i += kStepThreads) {
      const float k = args.w_weights[rh * n_w + i];
      s_wrow[i] = args.w_rows[rh * n_w + i];
      s_k[i] = k;
      s_alpha[i] = expf(args.key_weighted_decay ? g * k : g);
    }
    for (int64_t j = tid; j < n_r; j += kStepThreads) {
      s_rref[j] = args.r_refs[rh * n_r + j];
      s_q[j] = args.r_weights[rh * n_r + j];
    }
    if (tid < kTile) s_v[tid] = c_tid < width ? *v_at : 0.0f;
    __syncthreads();

    if (shared_residual) {
      float acc[kVec] = {};
      if (active) {
        for (int64_t i0 = warp; i0 < n_w; i0 += kStepWarps * kBatch) {
          float x[kBatch][kVec];
          float ka[kBatch];
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
            const int64_t i = i0 + b * kStepWarps;
            const int32_t row = i < n_w ? s_wrow[i] : kSdmNoRow;
            ka[b] = row >= 0 ? s_k[i] * s_alpha[i] : 0.0f;
            if (row >= 0) {
              LoadBf16<kVec>(rows + row * width + c_lane, x[b]);
            } else {
#pragma unroll
              for (int c = 0; c < kVec; ++c) x[b][c] = 0.0f;
            }
          }
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
#pragma unroll
            for (int c = 0; c < kVec; ++c) acc[c] = FmaRn(ka[b], x[b][c], acc[c]);
          }
        }
      }
#pragma unroll
      for (int c = 0; c < kVec; ++c) s_part[warp][lane * kVec + c] = acc[c];
      __syncthreads();
      if (tid < kTile) {
        float vhat = 0.0f;
#pragma unroll
        for (int w = 0; w < kStepWarps; ++w) vhat += s_part[w][tid];
        s_delta[tid] = beta * (s_v[tid] - vhat);
      }
      __syncthreads();
    }

    if (active) {
      for (int64_t i0 = warp; i0 < n_w; i0 += kStepWarps * kBatch) {
        float x[kBatch][kVec];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int64_t i = i0 + b * kStepWarps;
          const int32_t row = i < n_w ? s_wrow[i] : kSdmNoRow;
          if (row >= 0) LoadBf16<kVec>(rows + row * width + c_lane, x[b]);
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int64_t i = i0 + b * kStepWarps;
          const int32_t row = i < n_w ? s_wrow[i] : kSdmNoRow;
          if (row < 0) continue;
          const float a = s_alpha[i], k = s_k[i];
          const int base = lane * kVec;
#pragma unroll
          for (int c = 0; c < kVec; ++c) {
            x[b][c] = shared_residual ? SdmSharedResidualRn(a, x[b][c], k, s_delta[base + c])
                                      : SdmSlotResidualRn(a, x[b][c], k, beta, s_v[base + c]);
          }
          StoreBf16<kVec>(rows + row * width + c_lane, x[b]);
        }
      }
    }
    __syncthreads();

    float acc[kVec] = {};
    if (active) {
      for (int64_t j0 = warp; j0 < n_r; j0 += kStepWarps * kBatch) {
        float x[kBatch][kVec];
        float qb[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int64_t j = j0 + b * kStepWarps;
          const __nv_bfloat16* src = nullptr;
          qb[b] = 0.0f;
          if (j < n_r) {
            const int32_t ref = s_rref[j];
            qb[b] = s_q[j];
            if (ref >= 0) {
              src = rows + static_cast<int64_t>(ref) * width;
            } else if (args.m0 != nullptr) {
              src = args.m0 + SdmM0RowOf(ref) * width;
            }
          }
          if (src != nullptr) {
            LoadBf16<kVec>(src + c_lane, x[b]);
          } else {
            qb[b] = 0.0f;
#pragma unroll
            for (int c = 0; c < kVec; ++c) x[b][c] = 0.0f;
          }
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
#pragma unroll
          for (int c = 0; c < kVec; ++c) acc[c] = FmaRn(qb[b], x[b][c], acc[c]);
        }
      }
    }
#pragma unroll
    for (int c = 0; c < kVec; ++c) s_part[warp][lane * kVec + c] = acc[c];
    __syncthreads();
    if (tid < kTile && c_tid < width) {
      float y = 0.0f;
#pragma unroll
      for (int w = 0; w < kStepWarps; ++w) y += s_part[w][tid];
      args.readings[rh * width + c_tid] = y;
    }
    // The next token's staging touches no array read above; its first phase writes s_part
    // only after the next __syncthreads, which every thread reaches after this reduction.
  }
}

// ---------------------------------------------------------------------------------------------
// The decode step (SdmDecodeStep): one token per segment. Block (segment, column tile, head),
// kStepThreads threads, the same warp split and summation order as StepKernel, so every column
// sums the same products in the same order and the two agree bit for bit. Where the write rows
// are allocated follows PlanSdmDecode (kernels/common/sdm_decode_plan.h):
//   allocate  thread i takes write entry i: a slot still at kSdmNoRow needs a row; a block-wide
//             prefix count of the needs, one atomicSub, entry i pops the row at
//             top - 1 - (needs before i). kInBlock: this block; kCluster: the cluster's rank 0
//             (tile 0), then a cluster barrier and the other ranks copy its result from rank
//             0's shared memory; kSeparate: DecodeAllocKernel ran before              | sync
//   stage     rows, weights, decays, v; each read entry looks its slot up among the
//             write slots (binary search: both lists ascending) or in the table         | sync
//   A         each warp copies its write rows' tile (the arena row, or M0 / zeros for a new
//             row) into shared memory; shared residual: vhat partials as it goes        | sync
//             delta = beta (v - vhat)                                                   | sync
//   B         M_i from the staged copy; stored as bf16 to the arena and the staged copy | sync
//   read      y partials = sum_j q_j M_j: the staged copy for a slot written this token,
//             else the arena row, M0's row or zeros                                     | sync
//             y per column -> readings
// The staged tile is n_w x kTile bf16 of dynamic shared memory (64 KiB at the flagship's
// n_w = 128 and 16-byte tiles). Registers: a warp keeps kBatch rows' raw bf16 loads in flight
// (kVec / 2 registers each) and converts as it accumulates: the 16-byte path fits in 64.
constexpr int kDecodeMinBlocks = 4;  // per SM: 65536 registers / (256 threads x 64)
static_assert(kMaxSelected <= kStepThreads, "allocation gives each write entry its own thread");

template <int kVec>
struct alignas(2 * kVec) Bf16Pack {
  __nv_bfloat16 h[kVec];
};

template <int kVec>
__device__ __forceinline__ Bf16Pack<kVec> LoadPack(const __nv_bfloat16* p) {
  return *reinterpret_cast<const Bf16Pack<kVec>*>(p);
}

template <int kVec>
__device__ __forceinline__ Bf16Pack<kVec> ZeroPack() {
  Bf16Pack<kVec> z;
#pragma unroll
  for (int c = 0; c < kVec; ++c) z.h[c] = __float2bfloat16_rn(0.0f);
  return z;
}

// Allocation of one (segment, head)'s write rows for the single token `rh` (every thread of the
// block calls it; n_w <= kStepThreads). Writes the row of entry i to s_wrow[i] (kSdmNoRow when
// the free list ran out) and whether it is new to s_fresh[i]; updates the table and row count,
// and marks each slot in `written` (the head's marks; null: none kept).
__device__ void DecodeAllocate(const int32_t* w_slots, int64_t n_w, int64_t rh, int64_t seg,
                               const SdmSegments& segs, int32_t* table, uint8_t* written,
                               int64_t slots_per_head, const SdmRowArena& arena, int32_t* s_wrow,
                               int32_t* s_fresh, int32_t* s_warp_needs, int32_t* s_top) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int32_t slot = -1, entry = kSdmNoRow;
  bool need = false;
  if (tid < n_w) {
    slot = w_slots[rh * n_w + tid];
    const bool in_range = slot >= 0 && slot < slots_per_head;
    entry = in_range ? table[slot] : kSdmNoRow;
    need = in_range && entry == kSdmNoRow;
    if (in_range && written != nullptr) written[slot] = 1;
  }
  const unsigned needs = __ballot_sync(kFullMask, need);
  if (lane == 0) s_warp_needs[warp] = __popc(needs);
  __syncthreads();
  int32_t before = __popc(needs & LaneMaskLt(lane)), total = 0;
  for (int w = 0; w < kStepWarps; ++w) {
    if (w < warp) before += s_warp_needs[w];
    total += s_warp_needs[w];
  }
  if (tid == 0) *s_top = total > 0 ? atomicSub(arena.free_count, total) : 0;
  __syncthreads();
  bool fresh = false;
  if (tid < n_w) {
    int32_t row = entry;
    if (need) {
      const int32_t pos = *s_top - 1 - before;
      row = PopFreeRow(arena.free_list, arena.capacity, pos);
      if (row >= 0) table[slot] = row;
    }
    fresh = need && row >= 0;
    s_wrow[tid] = row;
    s_fresh[tid] = fresh ? 1 : 0;
  }
  // The rows actually taken (as PrepareAllocKernel counts them): one add per warp.
  const unsigned fresh_mask = __ballot_sync(kFullMask, fresh);
  if (lane == 0 && fresh_mask != 0 && segs.row_counts != nullptr &&
      segs.row_counts[seg] != nullptr) {
    atomicAdd(segs.row_counts[seg], __popc(fresh_mask));
  }
}

// Allocation as its own launch (rows wider than one block's tile): block (segment, head). The
// entry's row goes to w_rows, a new row marked -2 - row for DecodeStepKernel.
__global__ void __launch_bounds__(kStepThreads)
    DecodeAllocKernel(SdmDecodeArgs args, SdmSegments segs, int64_t heads, int64_t slots_per_head,
                      SdmRowArena arena) {
  __shared__ int32_t s_wrow[kMaxSelected], s_fresh[kMaxSelected];
  __shared__ int32_t s_warp_needs[kStepWarps], s_top;
  const int64_t seg = blockIdx.x, h = blockIdx.y;
  const int64_t rh = static_cast<int64_t>(segs.first_row[seg]) * heads + h;
  int32_t* table = segs.tables[seg] + h * slots_per_head;
  DecodeAllocate(args.w_slots, args.n_w, rh, seg, segs, table,
                 WrittenMarks(segs, seg, h, slots_per_head), slots_per_head, arena, s_wrow, s_fresh,
                 s_warp_needs, &s_top);
  const int tid = threadIdx.x;
  if (tid < args.n_w) {
    const int32_t row = s_wrow[tid];
    args.w_rows[rh * args.n_w + tid] = s_fresh[tid] != 0 ? -2 - row : row;
  }
}

using ConstBf16Ptr = const __nv_bfloat16*;

template <int kVec, SdmDecodeAlloc kAlloc>
__global__ void __launch_bounds__(kStepThreads, kDecodeMinBlocks)
    DecodeStepKernel(SdmDecodeArgs args, SdmSegments segs, int64_t heads, int64_t slots_per_head,
                     int64_t width, SdmRowArena arena, int64_t tiles) {
  constexpr int kTile = 32 * kVec;
  __shared__ int32_t s_wslot[kMaxSelected], s_wrow[kMaxSelected], s_fresh[kMaxSelected];
  __shared__ int32_t s_rhit[kMaxSelected];
  __shared__ float s_k[kMaxSelected], s_alpha[kMaxSelected], s_q[kMaxSelected];
  __shared__ __align__(16) float s_part[kStepWarps][kTile];
  __shared__ float s_delta[kTile], s_v[kTile];
  __shared__ int32_t s_warp_needs[kStepWarps], s_top;
  // Where each write entry's old value and each read entry's value come from (row 0 of it; null:
  // zeros): the arena row, or M0's row.
  __shared__ ConstBf16Ptr s_wsrc[kMaxSelected], s_rsrc[kMaxSelected];
  extern __shared__ uint4 decode_staged_raw[];  // [n_w][kTile] bf16
  __nv_bfloat16* staged = reinterpret_cast<__nv_bfloat16*>(decode_staged_raw);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t seg = blockIdx.x / tiles;
  const int64_t tile = blockIdx.x % tiles;
  const int64_t h = blockIdx.y;
  const int n_w = static_cast<int>(args.n_w), n_r = static_cast<int>(args.n_r);  // <= 256
  const int64_t rh = static_cast<int64_t>(segs.first_row[seg]) * heads + h;
  int32_t* table = segs.tables[seg] + h * slots_per_head;
  const int64_t c_lane = tile * kTile + lane * kVec;  // this lane's first column
  const bool active = c_lane < width;                 // width % kVec == 0
  const int64_t c_tid = tile * kTile + tid;           // column of the per-column steps
  const bool shared_residual = !args.slot_residual;
  __nv_bfloat16* const staged_lane = staged + lane * kVec;  // this lane's columns of staged row 0

  if constexpr (kAlloc == SdmDecodeAlloc::kInBlock) {
    DecodeAllocate(args.w_slots, n_w, rh, seg, segs, table,
                   WrittenMarks(segs, seg, h, slots_per_head), slots_per_head, arena, s_wrow,
                   s_fresh, s_warp_needs, &s_top);
  } else if constexpr (kAlloc == SdmDecodeAlloc::kCluster) {
    // The cluster is this (segment, head)'s tiles, rank = tile (grid.x = segments x tiles, the
    // cluster tiles x 1 x 1). The barrier orders rank 0's allocation (its shared memory and the
    // table) before every rank's reads; the arrive below, waited for at the end, keeps rank 0's
    // shared memory alive until every rank has copied it.
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    const bool allocates = cluster.block_rank() == 0;
    if (allocates) {
      DecodeAllocate(args.w_slots, n_w, rh, seg, segs, table,
                     WrittenMarks(segs, seg, h, slots_per_head), slots_per_head, arena, s_wrow,
                     s_fresh, s_warp_needs, &s_top);
    }
    cluster.sync();
    if (!allocates) {
      const int32_t* const rank0_wrow = cluster.map_shared_rank(&s_wrow[0], 0);
      const int32_t* const rank0_fresh = cluster.map_shared_rank(&s_fresh[0], 0);
      for (int i = tid; i < n_w; i += kStepThreads) {
        s_wrow[i] = rank0_wrow[i];
        s_fresh[i] = rank0_fresh[i];
      }
    }
    cluster.barrier_arrive();
  } else {
    for (int i = tid; i < n_w; i += kStepThreads) {
      const int32_t mark = args.w_rows[rh * n_w + i];
      s_wrow[i] = mark <= -2 ? -2 - mark : mark;
      s_fresh[i] = mark <= -2 ? 1 : 0;
    }
  }
  const float g = args.log_decay[rh];
  const float beta = args.beta[rh];
  for (int i = tid; i < n_w; i += kStepThreads) {
    const float k = args.w_weights[rh * n_w + i];
    const int32_t slot = args.w_slots[rh * n_w + i];
    const int32_t row = s_wrow[i];  // written by this thread above
    s_wslot[i] = slot;
    s_k[i] = k;
    s_alpha[i] = expf(args.key_weighted_decay ? g * k : g);
    ConstBf16Ptr src = nullptr;
    if (row >= 0 && s_fresh[i] == 0) {
      src = arena.rows + static_cast<int64_t>(row) * width;
    } else if (row >= 0 && args.m0 != nullptr) {
      src = args.m0 + (h * slots_per_head + slot) * width;
    }
    s_wsrc[i] = src;
  }
  if (tid < kTile) {
    s_v[tid] =
        c_tid < width ? args.v[segs.first_row[seg] * args.v_stride + h * width + c_tid] : 0.0f;
  }
  __syncthreads();  // s_wslot, and (kAllocInBlock) this block's table updates
  for (int j = tid; j < n_r; j += kStepThreads) {
    const int32_t slot = args.r_slots[rh * n_r + j];
    int32_t lo = 0, hi = static_cast<int32_t>(n_w);  // the first write slot >= slot
    while (lo < hi) {
      const int32_t mid = (lo + hi) >> 1;
      if (s_wslot[mid] < slot) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    // A hit only where the written row exists (not where the free list ran out: that slot
    // still reads M0, as SdmPrepareRows resolves it).
    const bool hit = lo < n_w && s_wslot[lo] == slot && s_wrow[lo] >= 0;
    s_rhit[j] = hit ? lo : -1;
    ConstBf16Ptr src = nullptr;
    if (!hit) {
      // Not written by this token, so the table entry is the one before the step.
      const int32_t entry = table[slot];
      if (entry >= 0) {
        src = arena.rows + static_cast<int64_t>(entry) * width;
      } else if (args.m0 != nullptr) {
        src = args.m0 + (h * slots_per_head + slot) * width;
      }
    }
    s_rsrc[j] = src;
    s_q[j] = args.r_weights[rh * n_r + j];
  }
  // s_rhit / s_rsrc / s_q are first read after phase A's barrier.

  // A: stage the write rows' tile; shared residual: vhat partials.
  {
    float acc[kVec] = {};
    if (active) {
      for (int i0 = warp; i0 < n_w; i0 += kStepWarps * kBatch) {
        Bf16Pack<kVec> x[kBatch];
        float ka[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int i = i0 + b * kStepWarps;
          const bool has_row = i < n_w && s_wrow[i] >= 0;
          const ConstBf16Ptr src = has_row ? s_wsrc[i] : nullptr;
          ka[b] = has_row ? s_k[i] * s_alpha[i] : 0.0f;
          x[b] = src != nullptr ? LoadPack<kVec>(src + c_lane) : ZeroPack<kVec>();
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int i = i0 + b * kStepWarps;
          if (i < n_w) *reinterpret_cast<Bf16Pack<kVec>*>(staged_lane + i * kTile) = x[b];
          if (shared_residual) {
#pragma unroll
            for (int c = 0; c < kVec; ++c) {
              acc[c] = FmaRn(ka[b], __bfloat162float(x[b].h[c]), acc[c]);
            }
          }
        }
      }
    }
    if (shared_residual) {
#pragma unroll
      for (int c = 0; c < kVec; ++c) s_part[warp][lane * kVec + c] = acc[c];
    }
    __syncthreads();
    if (shared_residual) {
      if (tid < kTile) {
        float vhat = 0.0f;
#pragma unroll
        for (int w = 0; w < kStepWarps; ++w) vhat += s_part[w][tid];
        s_delta[tid] = beta * (s_v[tid] - vhat);
      }
      __syncthreads();
    }
  }

  // B: the update, from and back to the staged copy (each warp its own rows), and to the arena.
  if (active) {
    for (int i = warp; i < n_w; i += kStepWarps) {
      const int32_t row = s_wrow[i];
      if (row < 0) continue;
      Bf16Pack<kVec>* p = reinterpret_cast<Bf16Pack<kVec>*>(staged_lane + i * kTile);
      Bf16Pack<kVec> x = *p;
      const float a = s_alpha[i], k = s_k[i];
      const int base = lane * kVec;
#pragma unroll
      for (int c = 0; c < kVec; ++c) {
        const float m = __bfloat162float(x.h[c]);
        const float y = shared_residual ? SdmSharedResidualRn(a, m, k, s_delta[base + c])
                                        : SdmSlotResidualRn(a, m, k, beta, s_v[base + c]);
        x.h[c] = __float2bfloat16_rn(y);
      }
      *p = x;
      *reinterpret_cast<Bf16Pack<kVec>*>(arena.rows + static_cast<int64_t>(row) * width + c_lane) =
          x;
    }
  }
  __syncthreads();

  // Read after write.
  float acc[kVec] = {};
  if (active) {
    for (int j0 = warp; j0 < n_r; j0 += kStepWarps * kBatch) {
      Bf16Pack<kVec> x[kBatch];
      float qb[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int j = j0 + b * kStepWarps;
        qb[b] = 0.0f;
        x[b] = ZeroPack<kVec>();
        if (j < n_r) {
          const int32_t hit = s_rhit[j];
          if (hit >= 0) {
            qb[b] = s_q[j];
            x[b] = *reinterpret_cast<const Bf16Pack<kVec>*>(staged_lane + hit * kTile);
          } else if (const ConstBf16Ptr src = s_rsrc[j]; src != nullptr) {
            qb[b] = s_q[j];
            x[b] = LoadPack<kVec>(src + c_lane);
          }
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
#pragma unroll
        for (int c = 0; c < kVec; ++c) {
          acc[c] = FmaRn(qb[b], __bfloat162float(x[b].h[c]), acc[c]);
        }
      }
    }
  }
#pragma unroll
  for (int c = 0; c < kVec; ++c) s_part[warp][lane * kVec + c] = acc[c];
  __syncthreads();
  if (tid < kTile && c_tid < width) {
    float y = 0.0f;
#pragma unroll
    for (int w = 0; w < kStepWarps; ++w) y += s_part[w][tid];
    args.readings[rh * width + c_tid] = y;
  }
  if constexpr (kAlloc == SdmDecodeAlloc::kCluster) {
    cooperative_groups::this_cluster().barrier_wait();  // rank 0 exits after every copy
  }
}

// ---------------------------------------------------------------------------------------------
// Release, gather, scatter, free-list initialisation.
constexpr int kMoveThreads = 256;

// Warp-aggregated claim (every lane of the warp calls it, with a uniform trip count): the lanes
// that `take` get distinct consecutive positions from *counter, in lane order, with one atomicAdd
// per warp by the lowest taking lane; the others get an unspecified value.
__device__ __forceinline__ int64_t WarpClaim(bool take, int32_t* counter) {
  const unsigned mask = __ballot_sync(kFullMask, take);
  if (mask == 0) return 0;
  const int lane = threadIdx.x & 31;
  const int leader = __ffs(mask) - 1;
  int32_t pos = 0;
  if (lane == leader) pos = atomicAdd(counter, __popc(mask));
  pos = __shfl_sync(kFullMask, pos, leader);
  return static_cast<int64_t>(pos) + __popc(mask & LaneMaskLt(lane));
}

__global__ void CollectWrittenKernel(const int32_t* table, const uint8_t* marks, int64_t entries,
                                     int32_t* pairs, int64_t capacity, int32_t* count) {
  // Uniform trip count per warp (base is per block), so the ballot sees every lane.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x; base < entries;
       base += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const int32_t row = i < entries && marks[i] != 0 ? table[i] : kSdmNoRow;
    const bool hit = row >= 0;
    const int64_t at = WarpClaim(hit, count);
    if (hit && at >= 0 && at < capacity) {
      pairs[2 * at] = static_cast<int32_t>(i);
      pairs[2 * at + 1] = row;
    }
  }
}

__global__ void ReleaseKernel(int32_t* table, int64_t n_slots, int32_t* free_list,
                              int32_t* free_count, int64_t capacity) {
  // Uniform trip count per warp (base is per block), so the ballot sees every lane.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x; base < n_slots;
       base += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const int32_t row = i < n_slots ? table[i] : kSdmNoRow;
    const bool has = row >= 0;
    const int64_t at = WarpClaim(has, free_count);
    if (has) {
      // Guarded: only a count already out of range (a broken precondition, reported by the
      // engine's refresh) could put the slot outside the list; the row then leaks loudly.
      if (at >= 0 && at < capacity) free_list[at] = row;
      table[i] = kSdmNoRow;
    }
  }
}

template <bool kVec16>
__global__ void ScatterKernel(const __nv_bfloat16* src, const int32_t* slot_ids, int64_t count,
                              int32_t* table, SdmRowArena arena) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (i >= count) return;  // whole warps
  const int lane = threadIdx.x & 31;
  int32_t row = kSdmNoRow;
  if (lane == 0)
    row = PopFreeRow(arena.free_list, arena.capacity, atomicSub(arena.free_count, 1) - 1);
  row = __shfl_sync(kFullMask, row, 0);
  if (row < 0) return;  // free list exhausted (or its count out of range): reported by the engine
  const int64_t width = arena.row_width;
  WarpCopyRow<kVec16>(arena.rows + static_cast<int64_t>(row) * width, src + i * width, width, lane);
  if (lane == 0) table[slot_ids[i]] = row;
}

__global__ void InitFreeListKernel(int32_t* free_list, int32_t* free_count, int64_t capacity) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < capacity;
       i += stride) {
    free_list[i] = static_cast<int32_t>(i);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *free_count = static_cast<int32_t>(capacity);
}

unsigned int WarpBlocks(int64_t warps, int threads) {
  return static_cast<unsigned int>((warps * 32 + threads - 1) / threads);
}

unsigned int CappedBlocks(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned int>(b < 4096 ? (b > 0 ? b : 1) : 4096);
}

// Whether the decode kernel may run clusters of more than kSdmPortableClusterBlocks blocks: the
// non-portable opt-in, asked for once per kernel instantiation (Hopper grants it; where it is
// refused, wider rows take the two-launch path).
template <int kVec>
bool NonPortableClustersAllowed() {
  static const bool allowed = [] {
    const cudaError_t e = cudaFuncSetAttribute(&DecodeStepKernel<kVec, SdmDecodeAlloc::kCluster>,
                                               cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e != cudaSuccess) (void)cudaGetLastError();  // refused: not an error of this step
    return e == cudaSuccess;
  }();
  return allowed;
}

// Whether the current device launches thread-block clusters (every device the build's sm_90a
// code runs on does; asked once per process, on the first decode step).
bool DeviceLaunchesClusters() {
  static const bool launches = [] {
    int device = 0, value = 0;
    const bool ok = cudaGetDevice(&device) == cudaSuccess &&
                    cudaDeviceGetAttribute(&value, cudaDevAttrClusterLaunch, device) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();
    return ok && value != 0;
  }();
  return launches;
}

template <int kVec, SdmDecodeAlloc kAlloc>
cudaError_t LaunchDecodeKernel(const SdmDecodeArgs& args, const SdmSegments& segs,
                               const SdmDims& dims, const SdmRowArena& arena,
                               const SdmDecodePlan& plan, cudaStream_t stream) {
  auto* kernel = &DecodeStepKernel<kVec, kAlloc>;
  const size_t staged = static_cast<size_t>(plan.staged_bytes);
  // Above 48 KiB a kernel must opt in to dynamic shared memory (cheap; idempotent).
  if (staged > 48 * 1024) {
    SDM_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(staged)));
  }
  const int64_t slots_per_head = dims.side * dims.side;
  const int64_t tiles = plan.tiles;
  const dim3 grid(static_cast<unsigned int>(segs.num * tiles),
                  static_cast<unsigned int>(dims.heads));
  if constexpr (kAlloc == SdmDecodeAlloc::kCluster) {
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = static_cast<unsigned int>(plan.cluster_blocks);
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = dim3(kStepThreads);
    config.dynamicSmemBytes = staged;
    config.stream = stream;
    config.attrs = &cluster;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, args, segs, dims.heads, slots_per_head,
                              dims.row_width, arena, tiles);
  } else {
    if constexpr (kAlloc == SdmDecodeAlloc::kSeparate) {
      if (args.n_w > 0) {
        const dim3 alloc_grid(static_cast<unsigned int>(segs.num),
                              static_cast<unsigned int>(dims.heads));
        DecodeAllocKernel<<<alloc_grid, kStepThreads, 0, stream>>>(args, segs, dims.heads,
                                                                   slots_per_head, arena);
        SDM_RETURN_IF_ERROR(cudaGetLastError());
      }
    }
    kernel<<<grid, kStepThreads, staged, stream>>>(args, segs, dims.heads, slots_per_head,
                                                   dims.row_width, arena, tiles);
    return cudaGetLastError();
  }
}

template <int kVec>
cudaError_t LaunchDecodeStep(const SdmDecodeArgs& args, const SdmSegments& segs,
                             const SdmDims& dims, const SdmRowArena& arena,
                             const SdmDecodePlan& plan, cudaStream_t stream) {
  switch (plan.alloc) {
    case SdmDecodeAlloc::kInBlock:
      return LaunchDecodeKernel<kVec, SdmDecodeAlloc::kInBlock>(args, segs, dims, arena, plan,
                                                                stream);
    case SdmDecodeAlloc::kCluster:
      return LaunchDecodeKernel<kVec, SdmDecodeAlloc::kCluster>(args, segs, dims, arena, plan,
                                                                stream);
    case SdmDecodeAlloc::kSeparate:
      break;
  }
  return LaunchDecodeKernel<kVec, SdmDecodeAlloc::kSeparate>(args, segs, dims, arena, plan, stream);
}

}  // namespace

cudaError_t SdmAddressJobs(std::span<const SdmAddressJob> jobs, int64_t rows, int64_t heads,
                           int64_t side, cudaStream_t stream, const SdmGateJob& gates) {
  if (rows < 0 || heads < 0 || side <= 0 || jobs.size() > 2) return cudaErrorInvalidValue;
  if (gates.log_decay != nullptr &&
      (gates.in_stride < heads || gates.a == nullptr || gates.b == nullptr ||
       gates.a_log == nullptr || gates.dt_bias == nullptr || gates.beta == nullptr)) {
    return cudaErrorInvalidValue;
  }
  AddressJobPair pair;
  unsigned int launched = 0;
  bool too_many = false;
  for (const SdmAddressJob& job : jobs) {
    if (job.k < 0) return cudaErrorInvalidValue;
    const int64_t count = AddressCount(job.k, side);
    too_many |= count > kMaxSelected;
    if (count == 0) continue;  // a job selecting nothing launches nothing
    SdmAddressJob& launch = pair.job[launched++];
    launch = job;
    launch.scores_stride = job.scores_stride == 0 ? heads * 2 * side : job.scores_stride;
    if (launch.scores_stride < heads * 2 * side) return cudaErrorInvalidValue;
  }
  if (rows * heads == 0) return cudaSuccess;
  if (launched == 0) {
    if (gates.log_decay == nullptr) return cudaSuccess;
    return SdmGates(gates.a, gates.b, gates.in_stride, gates.a_log, gates.dt_bias, rows, heads,
                    gates.log_decay, gates.beta, stream);
  }
  if (side > kMaxSide || too_many || rows * heads > INT32_MAX) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(2 * side) * (sizeof(float) + sizeof(uint64_t));
  const dim3 grid(static_cast<unsigned int>(rows * heads), launched);
  AddressKernel<<<grid, kAddressThreads, smem, stream>>>(pair, heads, side, gates);
  return cudaGetLastError();
}

cudaError_t SdmAddress(const float* scores, int64_t rows, int64_t heads, int64_t side, int64_t k,
                       AddressAct act, float scale, int32_t* slots, float* weights,
                       cudaStream_t stream) {
  const SdmAddressJob job{
      .scores = scores, .k = k, .act = act, .scale = scale, .slots = slots, .weights = weights};
  return SdmAddressJobs(std::span<const SdmAddressJob>(&job, 1), rows, heads, side, stream);
}

cudaError_t SdmPrepareRows(const int32_t* w_slots, int64_t n_w, const int32_t* r_slots, int64_t n_r,
                           const SdmSegments& segs, const SdmDims& dims, const __nv_bfloat16* m0,
                           const SdmRowArena& arena, int32_t* w_rows, int32_t* r_refs,
                           cudaStream_t stream) {
  if (n_w < 0 || n_r < 0 || segs.num < 0 || dims.heads <= 0 || dims.side <= 0 ||
      dims.row_width != arena.row_width) {
    return cudaErrorInvalidValue;
  }
  if (segs.num == 0 || segs.max_length <= 0) return cudaSuccess;
  const int64_t slots_per_head = dims.side * dims.side;
  const int64_t width = dims.row_width;
  const unsigned int seg_blocks = static_cast<unsigned int>(segs.num < 65535 ? segs.num : 65535);
  if (n_w > 0) {
    PrepareAllocKernel<<<WarpBlocks(segs.num * dims.heads, kPrepareThreads), kPrepareThreads, 0,
                         stream>>>(w_slots, n_w, segs, dims.heads, slots_per_head, arena, w_rows);
    SDM_RETURN_IF_ERROR(cudaGetLastError());
    const dim3 grid(WarpBlocks(segs.max_length * dims.heads * n_w, kPrepareThreads), seg_blocks);
    const bool vec16 =
        width % 8 == 0 && Aligned(arena.rows, 16) && (m0 == nullptr || Aligned(m0, 16));
    if (vec16) {
      PrepareCopyKernel<true><<<grid, kPrepareThreads, 0, stream>>>(
          w_slots, n_w, segs, dims.heads, slots_per_head, m0, arena.rows, width, w_rows);
    } else {
      PrepareCopyKernel<false><<<grid, kPrepareThreads, 0, stream>>>(
          w_slots, n_w, segs, dims.heads, slots_per_head, m0, arena.rows, width, w_rows);
    }
    SDM_RETURN_IF_ERROR(cudaGetLastError());
  }
  if (n_w + n_r > 0) {
    const int64_t per_seg = segs.max_length * dims.heads * (n_w + n_r);
    const dim3 grid(static_cast<unsigned int>((per_seg + kPrepareThreads - 1) / kPrepareThreads),
                    seg_blocks);
    PrepareRefsKernel<<<grid, kPrepareThreads, 0, stream>>>(n_w, r_slots, n_r, segs, dims.heads,
                                                            slots_per_head, w_rows, r_refs);
    SDM_RETURN_IF_ERROR(cudaGetLastError());
  }
  return cudaSuccess;
}

namespace {

// The shape the tile rules of kernels/common/sdm_decode_plan.h decide by: 16- and 4-byte accesses
// need both the arena's rows and M0 (when given) aligned.
SdmDecodeShape RowShape(const SdmSegments& segs, const SdmDims& dims, const SdmRowArena& arena,
                        const __nv_bfloat16* m0, int64_t n_w) {
  SdmDecodeShape shape;
  shape.width = dims.row_width;
  shape.n_w = n_w;
  shape.segments = segs.num;
  shape.heads = dims.heads;
  shape.rows_aligned_16 = Aligned(arena.rows, 16) && (m0 == nullptr || Aligned(m0, 16));
  shape.rows_aligned_4 = Aligned(arena.rows, 4) && (m0 == nullptr || Aligned(m0, 4));
  return shape;
}

}  // namespace

namespace {

// The step arguments' v_stride as the kernels read it (0: rows of v back to back).
int64_t ResolvedVStride(int64_t v_stride, const SdmDims& dims) {
  return v_stride == 0 ? dims.heads * dims.row_width : v_stride;
}

}  // namespace

cudaError_t SdmStep(const SdmStepArgs& given, const SdmSegments& segs, const SdmDims& dims,
                    const SdmRowArena& arena, cudaStream_t stream) {
  SdmStepArgs args = given;
  args.v_stride = ResolvedVStride(given.v_stride, dims);
  if (args.n_w < 0 || args.n_r < 0 || args.n_w > kMaxSelected || args.n_r > kMaxSelected ||
      segs.num < 0 || dims.heads <= 0 || dims.heads > 65535 || dims.row_width <= 0 ||
      dims.row_width != arena.row_width || args.v_stride < dims.heads * dims.row_width) {
    return cudaErrorInvalidValue;
  }
  if (segs.num == 0) return cudaSuccess;
  const int64_t width = dims.row_width;
  const int vec = SdmMultiTileVec(RowShape(segs, dims, arena, args.m0, /*n_w=*/0));
  const int64_t tile_cols = 32 * vec;
  const int64_t tiles = (width + tile_cols - 1) / tile_cols;
  if (segs.num * tiles > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned int>(segs.num * tiles),
                  static_cast<unsigned int>(dims.heads));
  if (vec == 8) {
    StepKernel<8>
        <<<grid, kStepThreads, 0, stream>>>(args, segs, dims.heads, width, arena.rows, tiles);
  } else if (vec == 2) {
    StepKernel<2>
        <<<grid, kStepThreads, 0, stream>>>(args, segs, dims.heads, width, arena.rows, tiles);
  } else {
    StepKernel<1>
        <<<grid, kStepThreads, 0, stream>>>(args, segs, dims.heads, width, arena.rows, tiles);
  }
  return cudaGetLastError();
}

SdmDecodePlan SdmDecodeStepPlan(const SdmDecodeArgs& args, const SdmSegments& segs,
                                const SdmDims& dims, const SdmRowArena& arena,
                                int64_t max_cluster_blocks) {
  const SdmDecodeShape shape = RowShape(segs, dims, arena, args.m0, args.n_w);
  SdmDecodePlan plan = PlanSdmDecode(shape, DeviceLaunchesClusters() ? max_cluster_blocks : 1);
  if (plan.alloc == SdmDecodeAlloc::kCluster && plan.cluster_blocks > kSdmPortableClusterBlocks) {
    const bool allowed = plan.vec == 8   ? NonPortableClustersAllowed<8>()
                         : plan.vec == 2 ? NonPortableClustersAllowed<2>()
                                         : NonPortableClustersAllowed<1>();
    if (!allowed) plan = PlanSdmDecode(shape, kSdmPortableClusterBlocks);
  }
  return plan;
}

cudaError_t SdmDecodeStep(const SdmDecodeArgs& given, const SdmSegments& segs, const SdmDims& dims,
                          const SdmRowArena& arena, cudaStream_t stream,
                          int64_t max_cluster_blocks) {
  SdmDecodeArgs args = given;
  args.v_stride = ResolvedVStride(given.v_stride, dims);
  if (args.n_w < 0 || args.n_r < 0 || args.n_w > kMaxSelected || args.n_r > kMaxSelected ||
      segs.num < 0 || dims.heads <= 0 || dims.heads > 65535 || dims.side <= 0 ||
      dims.row_width <= 0 || dims.row_width != arena.row_width || max_cluster_blocks < 1 ||
      args.v_stride < dims.heads * dims.row_width) {
    return cudaErrorInvalidValue;
  }
  if (segs.num == 0) return cudaSuccess;
  if (segs.max_length != 1) return cudaErrorInvalidValue;
  const SdmDecodePlan plan = SdmDecodeStepPlan(args, segs, dims, arena, max_cluster_blocks);
  if (segs.num * plan.tiles > INT32_MAX) return cudaErrorInvalidValue;
  if (plan.alloc == SdmDecodeAlloc::kSeparate && args.n_w > 0 && args.w_rows == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (plan.vec == 8) return LaunchDecodeStep<8>(args, segs, dims, arena, plan, stream);
  if (plan.vec == 2) return LaunchDecodeStep<2>(args, segs, dims, arena, plan, stream);
  return LaunchDecodeStep<1>(args, segs, dims, arena, plan, stream);
}

cudaError_t SdmReleaseRows(int32_t* table, int64_t n_slots, const SdmRowArena& arena,
                           cudaStream_t stream) {
  if (n_slots < 0) return cudaErrorInvalidValue;
  if (n_slots == 0) return cudaSuccess;
  ReleaseKernel<<<CappedBlocks(n_slots, kMoveThreads), kMoveThreads, 0, stream>>>(
      table, n_slots, arena.free_list, arena.free_count, arena.capacity);
  return cudaGetLastError();
}

cudaError_t SdmCollectWritten(const int32_t* table, const uint8_t* marks, int64_t entries,
                              int32_t* pairs, int64_t capacity, int32_t* count,
                              cudaStream_t stream) {
  if (entries < 0 || capacity < 0 || entries > std::numeric_limits<int32_t>::max()) {
    return cudaErrorInvalidValue;
  }
  if (entries == 0) return cudaSuccess;
  CollectWrittenKernel<<<CappedBlocks(entries, kMoveThreads), kMoveThreads, 0, stream>>>(
      table, marks, entries, pairs, capacity, count);
  return cudaGetLastError();
}

cudaError_t SdmGatherRows(const SdmRowArena& arena, const int32_t* row_ids, int64_t count,
                          __nv_bfloat16* dst, cudaStream_t stream) {
  if (count < 0 || arena.row_width <= 0) return cudaErrorInvalidValue;
  // Rows are equal blocks of the arena: the block gather of kernels/cuda/elementwise.h.
  return GatherBlocks(arena.rows, arena.row_width, row_ids, count, dst, stream);
}

cudaError_t SdmScatterRows(const __nv_bfloat16* src, const int32_t* slot_ids, int64_t count,
                           int32_t* table, const SdmRowArena& arena, cudaStream_t stream) {
  if (count < 0 || arena.row_width <= 0) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  const int64_t width = arena.row_width;
  const unsigned int blocks = WarpBlocks(count, kMoveThreads);
  if (width % 8 == 0 && Aligned(arena.rows, 16) && Aligned(src, 16)) {
    ScatterKernel<true><<<blocks, kMoveThreads, 0, stream>>>(src, slot_ids, count, table, arena);
  } else {
    ScatterKernel<false><<<blocks, kMoveThreads, 0, stream>>>(src, slot_ids, count, table, arena);
  }
  return cudaGetLastError();
}

cudaError_t SdmInitFreeList(const SdmRowArena& arena, int64_t capacity, cudaStream_t stream) {
  if (capacity < 0 || capacity > INT32_MAX) return cudaErrorInvalidValue;
  InitFreeListKernel<<<CappedBlocks(capacity, kMoveThreads), kMoveThreads, 0, stream>>>(
      arena.free_list, arena.free_count, capacity);
  return cudaGetLastError();
}

}  // namespace sdm::kernels::cuda
