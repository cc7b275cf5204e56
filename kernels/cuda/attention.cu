// CUDA attention over the paged KV cache (kernels/cuda/attention.h, layout in
// kernels/common/device_layout.h, softmax merge rule in kernels/common/attention_math.h).
//
// Requirements checked on the host (cudaErrorInvalidValue otherwise): n_heads a multiple of
// n_kv_heads, head_dim a multiple of 8 and at most 256, kv_width == n_kv_heads * head_dim. With
// head_dim % 8 == 0 every cached row slice of one kv head starts on a 16-byte boundary (the arena
// comes from cudaMalloc), which the 16-byte loads and stores below rely on; q, k, v and out must
// be 16-byte aligned as well (rows of whole heads in cudaMalloc'ed buffers are; q, k and v rows
// may sit inside a wider row of a fused projection's output when its stride is a multiple of 4).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/common/attention_math.h"
#include "kernels/common/device_layout.h"
#include "kernels/common/rope_math.h"
#include "kernels/common/sdm_math.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/rope_freqs.h"

namespace sdm::kernels::cuda {
namespace {

constexpr int kMaxHeadDim = 256;
constexpr unsigned kFullMask = 0xffffffffu;

// bf16 -> fp32 is exact: a bf16 is the top half of an fp32. Element 2i of a packed pair is the
// low half (little-endian, lower address).
__device__ __forceinline__ float Bf16Lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ void Bf16x8ToFloat(const uint4& v, float* f) {
  f[0] = Bf16Lo(v.x);
  f[1] = Bf16Hi(v.x);
  f[2] = Bf16Lo(v.y);
  f[3] = Bf16Hi(v.y);
  f[4] = Bf16Lo(v.z);
  f[5] = Bf16Hi(v.z);
  f[6] = Bf16Lo(v.w);
  f[7] = Bf16Hi(v.w);
}

__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);  // round to nearest even
  return *reinterpret_cast<const uint32_t*>(&p);
}

__device__ __forceinline__ uint4 LoadBf16x8(const __nv_bfloat16* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

bool ValidDims(const KvLayerView& kv, const AttentionDims& dims) {
  return dims.n_heads > 0 && dims.n_kv_heads > 0 && dims.n_heads % dims.n_kv_heads == 0 &&
         dims.head_dim > 0 && dims.head_dim % 8 == 0 && dims.head_dim <= kMaxHeadDim &&
         kv.kv_width == static_cast<int64_t>(dims.n_kv_heads) * dims.head_dim &&
         kv.pool != nullptr && kv.page_tables != nullptr && kv.ring_pages >= 0 && dims.window >= 0;
}

// A query row's stride: at least a row of heads, and a multiple of 4 floats so that every row
// stays 16-byte aligned (the kernels load q as float4).
bool ValidQueryStride(int64_t q_stride, const AttentionDims& dims) {
  return q_stride >= static_cast<int64_t>(dims.n_heads) * dims.head_dim && q_stride % 4 == 0;
}

// The output's pointers and gate stride (AttentionOutput): exactly one of f32 and bf16 (f32's
// alignment is the file comment's), a gate only with bf16; the bf16 and gate alignments are the
// prefill kernel's vector accesses.
bool ValidOutput(const AttentionOutput& out, const AttentionDims& dims) {
  if ((out.f32 == nullptr) == (out.bf16 == nullptr)) return false;
  if (out.f32 != nullptr) return out.gate == nullptr;
  return Aligned(out.bf16, 8) &&
         (out.gate == nullptr ||
          (Aligned(out.gate, 16) && out.gate_stride % 4 == 0 &&
           out.gate_stride >= static_cast<int64_t>(dims.n_heads) * dims.head_dim));
}

// Element `col` of output row `row` (rows of `width`): FloatToBf16's or MulSigmoidToBf16's
// rounding of v (elementwise.cu) when the output is bf16.
__device__ __forceinline__ void StoreOutput(const AttentionOutput& out, int64_t row, int64_t width,
                                            int64_t col, float v) {
  if (out.bf16 == nullptr) {
    out.f32[row * width + col] = v;
    return;
  }
  if (out.gate != nullptr) v *= Sigmoid(out.gate[row * out.gate_stride + col]);
  out.bf16[row * width + col] = __float2bfloat16_rn(v);
}

// ---------------------------------------------------------------------------------------------
// KvAppend: one thread per 8 consecutive values of one row (two float4 loads of k and of v, one
// 16-byte bf16 store each). Rows with a negative position are padding and are skipped.

__global__ void KvAppendKernel(const float* __restrict__ k, const float* __restrict__ v,
                               int64_t row_stride, int64_t rows,
                               const int32_t* __restrict__ row_seq,
                               const int32_t* __restrict__ row_pos, KvLayerView kv) {
  const int64_t vecs_per_row = kv.kv_width / 8;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * vecs_per_row) return;
  const int64_t r = i / vecs_per_row;
  const int64_t col = (i % vecs_per_row) * 8;
  const int64_t pos = row_pos[r];
  if (pos < 0) return;
  const int32_t* table = kv.page_tables[row_seq[r]];
  const int32_t page = table[KvPageTableIndex(pos, kv.ring_pages)];
  const int64_t src = r * row_stride + col;
  const float4 k0 = *reinterpret_cast<const float4*>(k + src);
  const float4 k1 = *reinterpret_cast<const float4*>(k + src + 4);
  const float4 v0 = *reinterpret_cast<const float4*>(v + src);
  const float4 v1 = *reinterpret_cast<const float4*>(v + src + 4);
  const uint4 kp = {PackBf16x2(k0.x, k0.y), PackBf16x2(k0.z, k0.w), PackBf16x2(k1.x, k1.y),
                    PackBf16x2(k1.z, k1.w)};
  const uint4 vp = {PackBf16x2(v0.x, v0.y), PackBf16x2(v0.z, v0.w), PackBf16x2(v1.x, v1.y),
                    PackBf16x2(v1.z, v1.w)};
  *reinterpret_cast<uint4*>(kv.pool + KvRowOffset(page, pos, kv.kv_width, false) + col) = kp;
  *reinterpret_cast<uint4*>(kv.pool + KvRowOffset(page, pos, kv.kv_width, true) + col) = vp;
}

// One thread per 8 consecutive values of one row: the row's q_width / 8 query vectors, then its
// kv_width / 8 key-and-value vectors (as KvAppendKernel's). head_dim % 8 == 0, so a vector's
// four pairs lie in one head. A query vector is rotated in place (every row, as ApplyRope
// does); a key vector is rotated in registers and stored with its value vector as bf16, rows
// with a negative position skipped (padding), k left as it is.
__global__ void RopeKvAppendKernel(float* q, const float* __restrict__ k,
                                   const float* __restrict__ v, int64_t row_stride, int64_t rows,
                                   int64_t q_width, int32_t head_dim,
                                   const int32_t* __restrict__ row_seq,
                                   const int32_t* __restrict__ positions, RopeFreqs freqs,
                                   KvLayerView kv) {
  const int64_t q_vecs = q_width / 8;
  const int64_t per_row = q_vecs + kv.kv_width / 8;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * per_row) return;
  const int64_t r = i / per_row;
  const int64_t c = i % per_row;
  const bool query = c < q_vecs;
  const int64_t col = (query ? c : c - q_vecs) * 8;
  const int32_t pos = positions[r];
  if (!query && pos < 0) return;
  const int64_t src = r * row_stride + col;
  const float4 x0 = *reinterpret_cast<const float4*>((query ? q : k) + src);
  const float4 x1 = *reinterpret_cast<const float4*>((query ? q : k) + src + 4);
  float x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
  const int64_t pair0 = (col % head_dim) / 2;
  for (int j = 0; j < 4; ++j) {
    float sn, cs;
    sincosf(RopeAngle(pos, freqs.inv_freq[pair0 + j]), &sn, &cs);
    RopeRotatePairRounded(cs, sn, &x[2 * j], &x[2 * j + 1]);
  }
  if (query) {
    *reinterpret_cast<float4*>(q + src) = make_float4(x[0], x[1], x[2], x[3]);
    *reinterpret_cast<float4*>(q + src + 4) = make_float4(x[4], x[5], x[6], x[7]);
    return;
  }
  const int32_t* table = kv.page_tables[row_seq[r]];
  const int32_t page = table[KvPageTableIndex(pos, kv.ring_pages)];
  const float4 v0 = *reinterpret_cast<const float4*>(v + src);
  const float4 v1 = *reinterpret_cast<const float4*>(v + src + 4);
  const uint4 kp = {PackBf16x2(x[0], x[1]), PackBf16x2(x[2], x[3]), PackBf16x2(x[4], x[5]),
                    PackBf16x2(x[6], x[7])};
  const uint4 vp = {PackBf16x2(v0.x, v0.y), PackBf16x2(v0.z, v0.w), PackBf16x2(v1.x, v1.y),
                    PackBf16x2(v1.z, v1.w)};
  *reinterpret_cast<uint4*>(kv.pool + KvRowOffset(page, pos, kv.kv_width, false) + col) = kp;
  *reinterpret_cast<uint4*>(kv.pool + KvRowOffset(page, pos, kv.kv_width, true) + col) = vp;
}

// ---------------------------------------------------------------------------------------------
// Decode (flash decoding).
//
// Work split. Grid (chunk, head group, sequence). A block reduces the keys of one chunk of
// kAttentionSplitTokens visible positions of one sequence, for one kv head and the query heads
// that share it (up to G of the GQA group: every K/V byte is read from HBM once per block and used
// for all of them). Short contexts have one chunk per sequence and the block writes the output
// directly; long ones (32k -> 64 chunks) spread a sequence over many blocks, which is what fills
// the GPU at small batch and keeps enough loads in flight to run at memory bandwidth at large
// batch (batch 64 x 8 kv heads x 64 chunks = 32768 blocks of 256 KB of K/V each). Each block
// leaves a partial state (m, l, acc) per query head in scratch, and the last of a sequence's
// chunk blocks of a head group to finish folds the chunks in chunk order with the merge rule of
// attention_math.h (MergeDecodeChunks): a per-(sequence, head group) counter after the records
// says which block is last, as in the CUDA programming guide's memory-fence example, so that no
// second launch is needed.
//
// Inside a block. kLanes = head_dim / 8 rounded up to a power of two lanes share one key row:
// lane i holds dims [8i, 8i + 8) (one 16-byte load of K and of V). The block's 128 threads form
// 128 / kLanes such lane groups ("key slots"), each walking its own subsequence of the chunk's
// positions (slot, slot + slots, ...), U keys per step so that 2U 16-byte loads per thread are
// in flight. Adjacent slots read adjacent rows of a page, so a warp's loads are full 128-byte
// lines. Scores are reduced over the lanes of a slot with xor shuffles (every lane ends with the
// same bits, so the slot's lanes keep identical softmax states); each slot keeps its own online
// softmax state, and the states of the slots are merged within the warp (shuffles) and across
// the 4 warps (shared memory) at the end. q is pre-scaled by log2(e)/sqrt(head_dim) so that the
// weights are exp2 (attention_math.h).

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;

template <int G>
constexpr int DecodeUnroll() {
  return G <= 2 ? 4 : (G <= 4 ? 2 : 1);  // bounds registers: acc and q are 16 * G floats
}

// Scratch record of (sequence, query head, chunk): acc[head_dim], m, l.
__device__ __forceinline__ float* DecodeRecord(float* scratch, int64_t b, int64_t h, int64_t c,
                                               int64_t n_heads, int64_t grid_chunks, int64_t hd) {
  return scratch + ((b * n_heads + h) * grid_chunks + c) * (hd + 2);
}

// Floats of the records of `batch` sequences.
int64_t DecodeRecordFloats(int64_t batch, int64_t n_heads, int64_t chunks, int64_t head_dim) {
  return batch * n_heads * chunks * (head_dim + 2);
}

// The last block of sequence b's `chunks` chunk blocks of head group `group_index` to arrive
// folds their records (its own included) for its heads and stores the output; the others return.
// Every thread of the block calls it after writing its records. The counter goes back to 0, so
// the next launch (a graph's replay) finds it there.
__device__ void MergeDecodeChunks(float* scratch, unsigned int* counters, int64_t b,
                                  int64_t group_index, int32_t h0, int32_t heads_per_block,
                                  int64_t chunks, int32_t n_heads, int64_t grid_chunks, int64_t hd,
                                  const AttentionOutput& out) {
  __shared__ bool last;
  __threadfence();  // this thread's records are visible device-wide before the block counts in
  __syncthreads();
  if (threadIdx.x == 0) {
    // Fences on both sides of the count as well: the block's records (ordered before this
    // thread's fence by the barrier) go out before it, the other blocks' are read after it.
    __threadfence();
    unsigned int* counter = counters + b * n_heads + group_index;
    last = atomicAdd(counter, 1u) == static_cast<unsigned int>(chunks - 1);
    __threadfence();
    if (last) *counter = 0;
  }
  __syncthreads();
  if (!last) return;
  for (int64_t i = threadIdx.x; i < heads_per_block * hd; i += blockDim.x) {
    const int64_t h = h0 + i / hd;
    const int64_t d = i % hd;
    SoftmaxState st = EmptySoftmaxState();
    float a = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      // __ldcg (cached in L2, not L1): written by other blocks during this launch.
      const float* rec = DecodeRecord(scratch, b, h, c, n_heads, grid_chunks, hd);
      const SoftmaxMerge mg = MergeSoftmaxStates(st, {__ldcg(rec + hd), __ldcg(rec + hd + 1)});
      st = mg.state;
      a = a * mg.scale_a + __ldcg(rec + d) * mg.scale_b;
    }
    StoreOutput(out, b, n_heads * hd, h * hd + d, SoftmaxFinish(a, st.l));
  }
}

// Blocks per SM the decode kernel is compiled for (registers at most 65536 / (128 x that)): what
// each G reached before the chunk merge moved into the kernel (72, 96, 128 and 233 registers),
// which otherwise costs G = 2 a block per SM of a bandwidth-bound loop.
template <int G>
constexpr int DecodeMinBlocks() {
  return G == 1 ? 7 : (G == 2 ? 5 : (G == 4 ? 4 : 2));
}

template <int G>
__global__ void __launch_bounds__(kDecodeThreads, DecodeMinBlocks<G>())
    AttentionDecodeKernel(const float* __restrict__ q, int64_t q_stride,
                          const int32_t* __restrict__ positions, KvLayerView kv, int32_t n_heads,
                          int32_t head_dim, int32_t group, int32_t heads_per_block, int64_t window,
                          int32_t lanes, int64_t grid_chunks, float q_scale, float* scratch,
                          unsigned int* counters, AttentionOutput out) {
  constexpr int U = DecodeUnroll<G>();
  extern __shared__ float smem[];  // [kDecodeWarps][G][head_dim] acc, then [kDecodeWarps][G] m, l

  const int64_t b = blockIdx.z;
  const int64_t c = blockIdx.x;
  const int32_t h0 = static_cast<int32_t>(blockIdx.y) * heads_per_block;
  const int32_t kvh = h0 / group;
  const int64_t hd = head_dim;

  const int64_t pos = positions[b];
  const int64_t first = FirstVisiblePosition(pos, window);
  const int64_t chunks = DecodeChunkCount(pos - first + 1, kAttentionSplitTokens, grid_chunks);
  if (chunks == 0) {
    // Nothing visible (a negative position): the output is zero, written once by chunk 0.
    if (c == 0) {
      for (int64_t i = threadIdx.x; i < heads_per_block * hd; i += blockDim.x) {
        StoreOutput(out, b, n_heads * hd, h0 * hd + i, 0.0f);
      }
    }
    return;
  }
  if (c >= chunks) return;  // the whole block leaves before any barrier
  const PositionRange range = DecodeChunkRange(first, pos, c, chunks, kAttentionSplitTokens);

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int dim_lane = lane & (lanes - 1);
  const int slots_per_warp = 32 / lanes;
  const int slot = warp * slots_per_warp + lane / lanes;
  const int slots = kDecodeThreads / lanes;
  const bool active = dim_lane * 8 < head_dim;
  const int64_t col = static_cast<int64_t>(kvh) * hd + dim_lane * 8;

  float qr[G][8];
  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int d = 0; d < 8; ++d) {
      qr[g][d] = 0.0f;
      acc[g][d] = 0.0f;
    }
    if (g < heads_per_block && active) {
      const float* qh = q + b * q_stride + (h0 + g) * hd + dim_lane * 8;
      const float4 a = *reinterpret_cast<const float4*>(qh);
      const float4 e = *reinterpret_cast<const float4*>(qh + 4);
      qr[g][0] = a.x * q_scale;
      qr[g][1] = a.y * q_scale;
      qr[g][2] = a.z * q_scale;
      qr[g][3] = a.w * q_scale;
      qr[g][4] = e.x * q_scale;
      qr[g][5] = e.y * q_scale;
      qr[g][6] = e.z * q_scale;
      qr[g][7] = e.w * q_scale;
    }
  }

  const int32_t* table = kv.page_tables[b];
  // `base` is uniform across the block, so every lane runs the same iterations and the
  // full-mask shuffles below are safe; positions past the chunk are masked, not skipped.
  for (int64_t base = range.begin; base < range.end; base += static_cast<int64_t>(slots) * U) {
    uint4 kr[U], vr[U];
    bool valid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t p = base + slot + static_cast<int64_t>(u) * slots;
      valid[u] = p < range.end;
      kr[u] = make_uint4(0, 0, 0, 0);
      vr[u] = make_uint4(0, 0, 0, 0);
      if (valid[u] && active) {
        const int32_t page = __ldg(table + KvPageTableIndex(p, kv.ring_pages));
        kr[u] = LoadBf16x8(kv.pool + KvRowOffset(page, p, kv.kv_width, false) + col);
        vr[u] = LoadBf16x8(kv.pool + KvRowOffset(page, p, kv.kv_width, true) + col);
      }
    }
    float s[U][G];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8];
      Bf16x8ToFloat(kr[u], kf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float t = 0.0f;
#pragma unroll
        for (int d = 0; d < 8; ++d) t = fmaf(qr[g][d], kf[d], t);
        for (int off = lanes / 2; off > 0; off >>= 1) t += __shfl_xor_sync(kFullMask, t, off);
        s[u][g] = valid[u] ? t : -INFINITY;
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float m_new = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) m_new = fmaxf(m_new, s[u][g]);
      const float scale = SoftmaxRescale(m[g], m_new);
      m[g] = m_new;
      l[g] *= scale;
#pragma unroll
      for (int d = 0; d < 8; ++d) acc[g][d] *= scale;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float w = SoftmaxWeight(s[u][g], m_new);
        l[g] += w;
        float vf[8];
        Bf16x8ToFloat(vr[u], vf);
#pragma unroll
        for (int d = 0; d < 8; ++d) acc[g][d] = fmaf(w, vf[d], acc[g][d]);
      }
    }
  }

  // Merge the slots of a warp: partners differ in the lane bits above the dim lanes.
  for (int off = lanes; off < 32; off <<= 1) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const SoftmaxState other = {__shfl_xor_sync(kFullMask, m[g], off),
                                  __shfl_xor_sync(kFullMask, l[g], off)};
      const SoftmaxMerge mg = MergeSoftmaxStates({m[g], l[g]}, other);
      m[g] = mg.state.m;
      l[g] = mg.state.l;
#pragma unroll
      for (int d = 0; d < 8; ++d) {
        const float o = __shfl_xor_sync(kFullMask, acc[g][d], off);
        acc[g][d] = acc[g][d] * mg.scale_a + o * mg.scale_b;
      }
    }
  }

  // Across warps through shared memory: the first slot of each warp publishes its state.
  float* s_acc = smem;
  float* s_m = smem + kDecodeWarps * G * hd;
  float* s_l = s_m + kDecodeWarps * G;
  if (lane < lanes) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (active) {
#pragma unroll
        for (int d = 0; d < 8; ++d) s_acc[(warp * G + g) * hd + dim_lane * 8 + d] = acc[g][d];
      }
      if (lane == 0) {
        s_m[warp * G + g] = m[g];
        s_l[warp * G + g] = l[g];
      }
    }
  }
  __syncthreads();

  for (int64_t i = threadIdx.x; i < heads_per_block * hd; i += blockDim.x) {
    const int g = static_cast<int>(i / hd);
    const int64_t d = i % hd;
    SoftmaxState st = {s_m[g], s_l[g]};
    float a = s_acc[g * hd + d];
    for (int w = 1; w < kDecodeWarps; ++w) {
      const SoftmaxMerge mg = MergeSoftmaxStates(st, {s_m[w * G + g], s_l[w * G + g]});
      st = mg.state;
      a = a * mg.scale_a + s_acc[(w * G + g) * hd + d] * mg.scale_b;
    }
    const int64_t h = h0 + g;
    if (chunks == 1) {
      StoreOutput(out, b, n_heads * hd, h * hd + d, SoftmaxFinish(a, st.l));
    } else {
      float* rec = DecodeRecord(scratch, b, h, c, n_heads, grid_chunks, hd);
      rec[d] = a;
      if (d == 0) {
        rec[hd] = st.m;
        rec[hd + 1] = st.l;
      }
    }
  }
  if (chunks == 1) return;
  MergeDecodeChunks(scratch, counters, b, blockIdx.y, h0, heads_per_block, chunks, n_heads,
                    grid_chunks, hd, out);
}

// Sized from min(max_visible, window) (attention_math.h): at long context a sliding-window layer
// launches the window's chunks, not the context's.
int64_t DecodeGridChunks(int64_t max_visible, int64_t window) {
  return DecodeGridChunkCount(max_visible, window, kAttentionSplitTokens);
}

// Query heads per decode block: the largest divisor of the GQA group that is at most 8, so that
// a block never mixes kv heads.
int32_t DecodeHeadsPerBlock(int32_t group) {
  for (int32_t d = group < 8 ? group : 8; d > 1; --d) {
    if (group % d == 0) return d;
  }
  return 1;
}

template <int G>
cudaError_t LaunchDecode(const float* q, int64_t q_stride, int64_t batch, const int32_t* positions,
                         int64_t grid_chunks, const KvLayerView& kv, const AttentionDims& dims,
                         int32_t heads_per_block, int32_t lanes,
                         const AttentionDecodeScratch& scratch, const AttentionOutput& out,
                         cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(grid_chunks),
                  static_cast<unsigned>(dims.n_heads / heads_per_block),
                  static_cast<unsigned>(batch));
  const size_t smem = sizeof(float) * kDecodeWarps * G * (dims.head_dim + 2);
  const float q_scale = kLog2e / sqrtf(static_cast<float>(dims.head_dim));
  AttentionDecodeKernel<G><<<grid, kDecodeThreads, smem, stream>>>(
      q, q_stride, positions, kv, dims.n_heads, dims.head_dim, dims.n_heads / dims.n_kv_heads,
      heads_per_block, dims.window, lanes, grid_chunks, q_scale, scratch.partials, scratch.counters,
      out);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Prefill: one block per (tile of kPrefillQueries queries, query head); keys and values of the
// tile's visible range are streamed through shared memory kPrefillKeys at a time (converted to
// fp32 once), with an online softmax per query row. Four threads ("a quad") own one query row:
// each scores 8 of the tile's 32 keys and accumulates a quarter of the head dims (float4 groups
// j, j + 4, ...). Rows and dims past the real sizes are zero-padded and never written.

constexpr int kPrefillQueries = 32;
constexpr int kPrefillKeys = 32;
constexpr int kPrefillThreads = kPrefillQueries * 4;

template <int kHd>
constexpr int PrefillStride() {
  return kHd + 4;  // floats per shared row: keeps float4 alignment, spreads rows over banks
}

template <int kHd>
constexpr size_t PrefillSmemBytes() {
  return sizeof(float) * 3 * kPrefillQueries * PrefillStride<kHd>();  // Q, K and V tiles
}

template <int kHd>
__global__ void __launch_bounds__(kPrefillThreads)
    AttentionPrefillKernel(const float* __restrict__ q, int64_t q_stride, int64_t num_tokens,
                           int64_t pos0, int32_t seq, KvLayerView kv, int32_t n_heads,
                           int32_t head_dim, int32_t group, int64_t window, float q_scale,
                           AttentionOutput out) {
  static_assert(kHd % 16 == 0 && kPrefillKeys == 32 && kPrefillQueries == 32);
  constexpr int kStride = PrefillStride<kHd>();
  constexpr int kVecs = kHd / 8;   // 8-value vectors per row
  constexpr int kAcc4 = kHd / 16;  // float4 accumulators per thread
  extern __shared__ float4 smem4[];
  float* s_q = reinterpret_cast<float*>(smem4);
  float* s_k = s_q + kPrefillQueries * kStride;
  float* s_v = s_k + kPrefillKeys * kStride;

  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kPrefillQueries;
  const int32_t h = blockIdx.y;
  const int64_t hd = head_dim;
  const int64_t out_stride = static_cast<int64_t>(n_heads) * hd;
  const int64_t col = static_cast<int64_t>(h / group) * hd;
  const int64_t t_last =
      (t0 + kPrefillQueries < num_tokens ? t0 + kPrefillQueries : num_tokens) - 1;
  const int64_t key_begin = FirstVisiblePosition(pos0 + t0, window);
  const int64_t key_end = pos0 + t_last;  // inclusive
  const int32_t* table = kv.page_tables[seq];

  // Q tile, scaled to log2 units; zeros past num_tokens or head_dim.
  for (int i = threadIdx.x; i < kPrefillQueries * kVecs; i += blockDim.x) {
    const int r = i / kVecs;
    const int d = (i % kVecs) * 8;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f), e = a;
    if (t0 + r < num_tokens && d < head_dim) {
      const float* src = q + (t0 + r) * q_stride + h * hd + d;
      a = *reinterpret_cast<const float4*>(src);
      e = *reinterpret_cast<const float4*>(src + 4);
      a = make_float4(a.x * q_scale, a.y * q_scale, a.z * q_scale, a.w * q_scale);
      e = make_float4(e.x * q_scale, e.y * q_scale, e.z * q_scale, e.w * q_scale);
    }
    *reinterpret_cast<float4*>(s_q + r * kStride + d) = a;
    *reinterpret_cast<float4*>(s_q + r * kStride + d + 4) = e;
  }

  const int row = threadIdx.x >> 2;  // query row of this thread's quad
  const int j = threadIdx.x & 3;     // position in the quad
  const int quad_base = (threadIdx.x & 31) & ~3;
  const int64_t t = t0 + row;
  const int64_t p = pos0 + t;
  // Visible keys of this row: [lo, p]; a padding row sees nothing.
  const int64_t lo = t < num_tokens ? FirstVisiblePosition(p, window) : INT64_MAX;

  float m = -INFINITY, l = 0.0f;
  float4 acc[kAcc4];
#pragma unroll
  for (int i = 0; i < kAcc4; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);

  for (int64_t kb = key_begin; kb <= key_end; kb += kPrefillKeys) {
    __syncthreads();  // the previous tile's K/V (and, first time, nothing) are no longer read
    for (int i = threadIdx.x; i < kPrefillKeys * kVecs; i += blockDim.x) {
      const int r = i / kVecs;
      const int d = (i % kVecs) * 8;
      const int64_t kp = kb + r;
      float kf[8], vf[8];
      if (kp <= key_end && d < head_dim) {
        const int32_t page = __ldg(table + KvPageTableIndex(kp, kv.ring_pages));
        Bf16x8ToFloat(LoadBf16x8(kv.pool + KvRowOffset(page, kp, kv.kv_width, false) + col + d),
                      kf);
        Bf16x8ToFloat(LoadBf16x8(kv.pool + KvRowOffset(page, kp, kv.kv_width, true) + col + d), vf);
      } else {
#pragma unroll
        for (int x = 0; x < 8; ++x) kf[x] = vf[x] = 0.0f;
      }
      float* kd = s_k + r * kStride + d;
      float* vd = s_v + r * kStride + d;
      *reinterpret_cast<float4*>(kd) = make_float4(kf[0], kf[1], kf[2], kf[3]);
      *reinterpret_cast<float4*>(kd + 4) = make_float4(kf[4], kf[5], kf[6], kf[7]);
      *reinterpret_cast<float4*>(vd) = make_float4(vf[0], vf[1], vf[2], vf[3]);
      *reinterpret_cast<float4*>(vd + 4) = make_float4(vf[4], vf[5], vf[6], vf[7]);
    }
    __syncthreads();

    // Scores of keys j, j + 4, ..., j + 28 of the tile for this row.
    float s[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = 0.0f;
    const float* qrow = s_q + row * kStride;
#pragma unroll 4
    for (int d = 0; d < kHd; d += 4) {
      const float4 qv = *reinterpret_cast<const float4*>(qrow + d);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float4 kv4 = *reinterpret_cast<const float4*>(s_k + (j + 4 * i) * kStride + d);
        s[i] = fmaf(qv.x, kv4.x, s[i]);
        s[i] = fmaf(qv.y, kv4.y, s[i]);
        s[i] = fmaf(qv.z, kv4.z, s[i]);
        s[i] = fmaf(qv.w, kv4.w, s[i]);
      }
    }
    float tile_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int64_t kp = kb + j + 4 * i;
      if (kp < lo || kp > p) s[i] = -INFINITY;  // causal and window mask (kp > key_end too)
      tile_max = fmaxf(tile_max, s[i]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
    const float m_new = fmaxf(m, tile_max);
    const float scale = SoftmaxRescale(m, m_new);
    m = m_new;
    float w[8], sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      w[i] = SoftmaxWeight(s[i], m_new);
      sum += w[i];
    }
    sum += __shfl_xor_sync(kFullMask, sum, 1);
    sum += __shfl_xor_sync(kFullMask, sum, 2);
    l = l * scale + sum;
#pragma unroll
    for (int i = 0; i < kAcc4; ++i) {
      acc[i].x *= scale;
      acc[i].y *= scale;
      acc[i].z *= scale;
      acc[i].w *= scale;
    }
    // acc += sum_k w_k v_k: the weight of key k lives in quad lane k % 4, slot k / 4.
#pragma unroll
    for (int k = 0; k < kPrefillKeys; ++k) {
      const float wk = __shfl_sync(kFullMask, w[k / 4], quad_base + (k & 3));
      const float* vrow = s_v + k * kStride;
#pragma unroll
      for (int i = 0; i < kAcc4; ++i) {
        const float4 vv = *reinterpret_cast<const float4*>(vrow + 4 * (j + 4 * i));
        acc[i].x = fmaf(wk, vv.x, acc[i].x);
        acc[i].y = fmaf(wk, vv.y, acc[i].y);
        acc[i].z = fmaf(wk, vv.z, acc[i].z);
        acc[i].w = fmaf(wk, vv.w, acc[i].w);
      }
    }
  }

  if (t >= num_tokens) return;
#pragma unroll
  for (int i = 0; i < kAcc4; ++i) {
    const int d = 4 * (j + 4 * i);
    if (d < head_dim) {
      const float4 o = make_float4(SoftmaxFinish(acc[i].x, l), SoftmaxFinish(acc[i].y, l),
                                   SoftmaxFinish(acc[i].z, l), SoftmaxFinish(acc[i].w, l));
      const int64_t at = t * out_stride + h * hd + d;
      if (out.bf16 == nullptr) {
        *reinterpret_cast<float4*>(out.f32 + at) = o;
        continue;
      }
      // StoreOutput on four elements at once (ValidOutput's alignments: a 16-byte gate load, an
      // 8-byte store).
      float4 v = o;
      if (out.gate != nullptr) {
        const float4 g =
            *reinterpret_cast<const float4*>(out.gate + t * out.gate_stride + h * hd + d);
        v.x *= Sigmoid(g.x);
        v.y *= Sigmoid(g.y);
        v.z *= Sigmoid(g.z);
        v.w *= Sigmoid(g.w);
      }
      const uint2 packed = {PackBf16x2(v.x, v.y), PackBf16x2(v.z, v.w)};
      *reinterpret_cast<uint2*>(out.bf16 + at) = packed;
    }
  }
}

template <int kHd>
cudaError_t LaunchPrefill(const float* q, int64_t q_stride, int64_t num_tokens, int64_t pos0,
                          int32_t seq, const KvLayerView& kv, const AttentionDims& dims,
                          const AttentionOutput& out, cudaStream_t stream) {
  constexpr size_t smem = PrefillSmemBytes<kHd>();
  auto* kernel = &AttentionPrefillKernel<kHd>;
  // Above 48 KB a kernel must opt in to dynamic shared memory (cheap; idempotent).
  SDM_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(static_cast<unsigned>((num_tokens + kPrefillQueries - 1) / kPrefillQueries),
                  static_cast<unsigned>(dims.n_heads));
  const float q_scale = kLog2e / sqrtf(static_cast<float>(dims.head_dim));
  kernel<<<grid, kPrefillThreads, smem, stream>>>(
      q, q_stride, num_tokens, pos0, seq, kv, dims.n_heads, dims.head_dim,
      dims.n_heads / dims.n_kv_heads, dims.window, q_scale, out);
  return cudaGetLastError();
}

}  // namespace

cudaError_t KvAppend(const float* k, const float* v, int64_t row_stride, int64_t rows,
                     const int32_t* row_seq, const int32_t* row_pos, const KvLayerView& kv,
                     cudaStream_t stream) {
  if (rows < 0 || kv.kv_width <= 0 || kv.kv_width % 8 != 0 || kv.pool == nullptr ||
      kv.page_tables == nullptr || kv.ring_pages < 0 || row_stride < kv.kv_width ||
      row_stride % 4 != 0) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t n = rows * (kv.kv_width / 8);
  KvAppendKernel<<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(k, v, row_stride, rows, row_seq,
                                                                  row_pos, kv);
  return cudaGetLastError();
}

cudaError_t RopeKvAppend(float* q, const float* k, const float* v, int64_t row_stride, int64_t rows,
                         const int32_t* row_seq, const int32_t* positions, float theta,
                         const AttentionDims& dims, const KvLayerView& kv, cudaStream_t stream) {
  const int64_t q_width = static_cast<int64_t>(dims.n_heads) * dims.head_dim;
  RopeFreqs freqs{};
  // ValidDims bounds head_dim by kMaxHeadDim, whose pairs the host table holds.
  if (rows < 0 || !ValidDims(kv, dims) || row_stride < q_width || row_stride < kv.kv_width ||
      row_stride % 4 != 0 || !Aligned(q, 16) || !Aligned(k, 16) || !Aligned(v, 16) ||
      !HostRopeFreqs(dims.head_dim, theta, &freqs)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t n = rows * ((q_width + kv.kv_width) / 8);
  RopeKvAppendKernel<<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(
      q, k, v, row_stride, rows, q_width, dims.head_dim, row_seq, positions, freqs, kv);
  return cudaGetLastError();
}

int64_t AttentionDecodeScratchFloats(int64_t batch, const AttentionDims& dims,
                                     int64_t max_visible) {
  const int64_t chunks = DecodeGridChunks(max_visible, dims.window);
  if (chunks <= 1) return 0;  // single-chunk decode writes the output directly
  return DecodeRecordFloats(batch, dims.n_heads, chunks, dims.head_dim);
}

int64_t AttentionDecodeCounters(int64_t batch, const AttentionDims& dims) {
  return batch * dims.n_heads;
}

cudaError_t AttentionDecode(const float* q, int64_t q_stride, int64_t batch,
                            const int32_t* positions, int64_t max_visible, const KvLayerView& kv,
                            const AttentionDims& dims, const AttentionDecodeScratch& scratch,
                            float* out, cudaStream_t stream) {
  return AttentionDecode(q, q_stride, batch, positions, max_visible, kv, dims, scratch,
                         AttentionOutput{.f32 = out}, stream);
}

cudaError_t AttentionDecode(const float* q, int64_t q_stride, int64_t batch,
                            const int32_t* positions, int64_t max_visible, const KvLayerView& kv,
                            const AttentionDims& dims, const AttentionDecodeScratch& scratch,
                            const AttentionOutput& out, cudaStream_t stream) {
  if (!ValidDims(kv, dims) || batch < 0 || batch > 65535 || !ValidQueryStride(q_stride, dims)) {
    return cudaErrorInvalidValue;
  }
  if (batch == 0) return cudaSuccess;
  if (!ValidOutput(out, dims)) return cudaErrorInvalidValue;
  const int64_t grid_chunks = DecodeGridChunks(max_visible, dims.window);
  if (grid_chunks > 1 && (scratch.partials == nullptr || scratch.counters == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const int32_t heads_per_block = DecodeHeadsPerBlock(dims.n_heads / dims.n_kv_heads);
  int32_t lanes = 1;
  while (lanes * 8 < dims.head_dim) lanes *= 2;  // <= 32 since head_dim <= 256
  cudaError_t err;
  if (heads_per_block <= 1) {
    err = LaunchDecode<1>(q, q_stride, batch, positions, grid_chunks, kv, dims, heads_per_block,
                          lanes, scratch, out, stream);
  } else if (heads_per_block <= 2) {
    err = LaunchDecode<2>(q, q_stride, batch, positions, grid_chunks, kv, dims, heads_per_block,
                          lanes, scratch, out, stream);
  } else if (heads_per_block <= 4) {
    err = LaunchDecode<4>(q, q_stride, batch, positions, grid_chunks, kv, dims, heads_per_block,
                          lanes, scratch, out, stream);
  } else {
    err = LaunchDecode<8>(q, q_stride, batch, positions, grid_chunks, kv, dims, heads_per_block,
                          lanes, scratch, out, stream);
  }
  return err;
}

cudaError_t AttentionPrefill(const float* q, int64_t q_stride, int64_t num_tokens, int64_t pos0,
                             int32_t seq, const KvLayerView& kv, const AttentionDims& dims,
                             float* out, cudaStream_t stream) {
  return AttentionPrefill(q, q_stride, num_tokens, pos0, seq, kv, dims, AttentionOutput{.f32 = out},
                          stream);
}

cudaError_t AttentionPrefill(const float* q, int64_t q_stride, int64_t num_tokens, int64_t pos0,
                             int32_t seq, const KvLayerView& kv, const AttentionDims& dims,
                             const AttentionOutput& out, cudaStream_t stream) {
  if (!ValidDims(kv, dims) || num_tokens < 0 || pos0 < 0 || seq < 0 ||
      !ValidQueryStride(q_stride, dims)) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0) return cudaSuccess;
  if (!ValidOutput(out, dims)) return cudaErrorInvalidValue;
  if (dims.head_dim <= 16)
    return LaunchPrefill<16>(q, q_stride, num_tokens, pos0, seq, kv, dims, out, stream);
  if (dims.head_dim <= 32)
    return LaunchPrefill<32>(q, q_stride, num_tokens, pos0, seq, kv, dims, out, stream);
  if (dims.head_dim <= 64)
    return LaunchPrefill<64>(q, q_stride, num_tokens, pos0, seq, kv, dims, out, stream);
  if (dims.head_dim <= 128) {
    return LaunchPrefill<128>(q, q_stride, num_tokens, pos0, seq, kv, dims, out, stream);
  }
  return LaunchPrefill<256>(q, q_stride, num_tokens, pos0, seq, kv, dims, out, stream);
}

}  // namespace sdm::kernels::cuda
