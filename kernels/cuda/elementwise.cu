// Row-wise and elementwise kernels of the CUDA backend (kernels/cuda/elementwise.h).
//
// Row kernels (RmsNorm, LayerNorm) run one block per row and reduce in fp32 with a fixed order
// (warp shuffles, then the per-warp partials summed in warp order by every thread), so a row's
// result depends only on its inputs, never on the launch. Elementwise kernels are grid-stride
// loops that take 16-byte (fp32) or 8-byte (bf16) vector accesses when every pointer is aligned
// for them, and scalar accesses otherwise. Each kernel evaluates its CPU twin's formula in the
// same operation order (kernels/cpu/{norm,rope,vector_math}.cc); what differs is the summation
// order of reductions (fp32 tree here, double there) and the last ulp of device transcendentals.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/common/fp_math.h"
#include "kernels/common/rope_math.h"
#include "kernels/common/sdm_math.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/rope_freqs.h"

namespace sdm::kernels::cuda {
namespace {

constexpr int kThreads = 256;  // every launch; a multiple of 32 (BlockSum relies on it)
// Grid-stride launches stop growing here: enough blocks to fill an H200 (132 SMs) many times.
constexpr int64_t kMaxBlocks = 4096;

unsigned int GridFor(int64_t work) {
  return static_cast<unsigned int>(std::min<int64_t>(BlocksFor(work, kThreads), kMaxBlocks));
}

// Four bf16 (8 bytes) and eight bf16 (16 bytes), for vector loads and stores.
struct alignas(8) Bf16x4 {
  __nv_bfloat162 lo, hi;
};
struct alignas(16) Bf16x8 {
  __nv_bfloat162 v[4];
};

__device__ __forceinline__ void StoreBf16x4(bf16* p, float4 f) {
  Bf16x4 q;
  q.lo = __floats2bfloat162_rn(f.x, f.y);  // .x (low half) is the first element
  q.hi = __floats2bfloat162_rn(f.z, f.w);
  *reinterpret_cast<Bf16x4*>(p) = q;
}

__device__ __forceinline__ float4 LoadBf16x4(const bf16* p) {
  const Bf16x4 q = *reinterpret_cast<const Bf16x4*>(p);
  const float2 lo = __bfloat1622float2(q.lo), hi = __bfloat1622float2(q.hi);
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

__device__ __forceinline__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t GridStride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Item i of a [rows, cols] output whose inputs' rows are `stride` apart: the input offset.
// Vec4 needs cols % 4 == 0 and stride % 4 == 0, so four items share a row and stay aligned.
__device__ __forceinline__ int64_t StridedOffset(int64_t i, int64_t cols, int64_t stride) {
  const int64_t r = i / cols;
  return r * stride + (i - r * cols);
}

// Sum of v over the block, returned to every thread. scratch: one float per warp. Ends with a
// barrier, so scratch may be reused by the next call.
__device__ float BlockSum(float v, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  const int n_warps = blockDim.x >> 5;
  for (int i = 0; i < n_warps; ++i) total += scratch[i];
  __syncthreads();
  return total;
}

// ---- Embedding ----------------------------------------------------------------------------

// One item per 8 columns (vec) or per column; rows are independent.
__global__ void EmbeddingKernel(const bf16* table, const int32_t* tokens, int64_t n, int64_t dim,
                                float* out, bool vec) {
  const int64_t per_row = vec ? dim / 8 : dim;
  const int64_t total = n * per_row;
  for (int64_t idx = GlobalThread(); idx < total; idx += GridStride()) {
    const int64_t r = idx / per_row, c = idx % per_row;
    const int64_t src = static_cast<int64_t>(tokens[r]) * dim;
    if (vec) {
      const Bf16x8 q = reinterpret_cast<const Bf16x8*>(table + src)[c];
      const float2 a = __bfloat1622float2(q.v[0]), b = __bfloat1622float2(q.v[1]);
      const float2 d = __bfloat1622float2(q.v[2]), e = __bfloat1622float2(q.v[3]);
      float4* o = reinterpret_cast<float4*>(out + r * dim) + 2 * c;
      o[0] = make_float4(a.x, a.y, b.x, b.y);
      o[1] = make_float4(d.x, d.y, e.x, e.y);
    } else {
      out[r * dim + c] = __bfloat162float(table[src + c]);
    }
  }
}

// ---- Norms ---------------------------------------------------------------------------------

// One block per row. out_f32 may alias x: each thread rewrites only the elements it read, and
// all reads of the first pass end at BlockSum's barrier.
// With `delta` (AddRmsNorm), x += delta first, row by row: each thread adds and stores the
// elements it then squares and, after the reduction, reads back (the same elements in both
// loops), so the norm sees exactly the sums AddInPlace would have stored. With `table`
// (EmbeddingRmsNorm), row r of x is first written from the table's row tokens[r] the same way.
// `vec` picks the float4 path (RmsNormVectorPath); `source_vec` says whether delta's or the
// table's rows may be read with vector loads on it (16 and 8 bytes), else a value at a time.
__global__ void RmsNormKernel(float* x, const float* delta, const bf16* table,
                              const int32_t* tokens, const float* w, int64_t n, float eps,
                              float* out_f32, bf16* out_bf16, bool vec, bool source_vec) {
  __shared__ float scratch[kThreads / 32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * n;
  float* xr = x + base;
  const bf16* er =
      table != nullptr ? table + static_cast<int64_t>(tokens[blockIdx.x]) * n : nullptr;
  float ss = 0.0f;
  if (vec) {
    for (int64_t v = threadIdx.x; v < n / 4; v += blockDim.x) {
      float4 q;
      if (er != nullptr) {
        // The table's or delta's rows may be misaligned where x is not (source_vec false: read
        // a value at a time): the same sums either way.
        q = source_vec
                ? LoadBf16x4(er + 4 * v)
                : make_float4(__bfloat162float(er[4 * v]), __bfloat162float(er[4 * v + 1]),
                              __bfloat162float(er[4 * v + 2]), __bfloat162float(er[4 * v + 3]));
        reinterpret_cast<float4*>(xr)[v] = q;
      } else {
        q = reinterpret_cast<const float4*>(xr)[v];
      }
      if (delta != nullptr) {
        const float* dr = delta + base + 4 * v;
        const float4 d = source_vec ? *reinterpret_cast<const float4*>(dr)
                                    : make_float4(dr[0], dr[1], dr[2], dr[3]);
        q = make_float4(q.x + d.x, q.y + d.y, q.z + d.z, q.w + d.w);
        reinterpret_cast<float4*>(xr)[v] = q;
      }
      ss += q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w;
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      if (er != nullptr) xr[i] = __bfloat162float(er[i]);
      if (delta != nullptr) xr[i] = xr[i] + delta[base + i];
      ss += xr[i] * xr[i];
    }
  }
  ss = BlockSum(ss, scratch);
  // cpu::RmsNorm: inv = 1 / sqrt(mean + eps), then (x * inv) * w (IEEE sqrt and division).
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(n) + eps);
  if (vec) {
    for (int64_t v = threadIdx.x; v < n / 4; v += blockDim.x) {
      const float4 q = reinterpret_cast<const float4*>(xr)[v];
      const float4 g = reinterpret_cast<const float4*>(w)[v];
      const float4 o =
          make_float4((q.x * inv) * g.x, (q.y * inv) * g.y, (q.z * inv) * g.z, (q.w * inv) * g.w);
      if (out_f32 != nullptr) reinterpret_cast<float4*>(out_f32 + base)[v] = o;
      if (out_bf16 != nullptr) StoreBf16x4(out_bf16 + base + 4 * v, o);
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const float o = (xr[i] * inv) * w[i];
      if (out_f32 != nullptr) out_f32[base + i] = o;
      if (out_bf16 != nullptr) out_bf16[base + i] = __float2bfloat16_rn(o);
    }
  }
}

// One block per row, two-pass (mean, then biased variance of x - mean), as cpu::LayerNorm.
// Rows are re-read from global memory; they are short (a head, hd values) and stay in L1/L2.
// out_bf16 null: the result replaces x (LayerNorm). Else x is left as it is and element i of the
// result goes to out_bf16[i], times Sigmoid(g[StridedOffset(i, g_cols, g_stride)]) when g is set
// (LayerNormToBf16: what MulSigmoidToBf16 or FloatToBf16 would make of the stored result).
__global__ void LayerNormKernel(float* x, const float* w, const float* b, int64_t n, float eps,
                                const float* g, int64_t g_cols, int64_t g_stride, bf16* out_bf16) {
  __shared__ float scratch[kThreads / 32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * n;
  float* xr = x + base;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += xr[i];
  const float mean = BlockSum(sum, scratch) / static_cast<float>(n);
  float sq = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float d = xr[i] - mean;
    sq += d * d;
  }
  const float var = BlockSum(sq, scratch) / static_cast<float>(n);
  const float inv = 1.0f / sqrtf(var + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    // Separately rounded (fp_math.h), so that both outputs hold the same value whatever the
    // compiler contracts in each.
    float o = MulRn(SubRn(xr[i], mean), inv);
    if (w != nullptr) o = MulRn(o, w[i]);
    if (b != nullptr) o = AddRn(o, b[i]);
    if (out_bf16 == nullptr) {
      xr[i] = o;
    } else {
      if (g != nullptr) o *= Sigmoid(g[StridedOffset(base + i, g_cols, g_stride)]);
      out_bf16[base + i] = __float2bfloat16_rn(o);
    }
  }
}

__global__ void BatchNormEvalKernel(float* x, const float* w, const float* b, const float* mean,
                                    const float* var, int64_t rows, int64_t n, float eps) {
  const int64_t total = rows * n;
  for (int64_t idx = GlobalThread(); idx < total; idx += GridStride()) {
    const int64_t j = idx % n;
    // cpu::BatchNormEval's operations, each rounded alike (no contraction into an fma): the
    // addressing that follows selects from bit-identical scores on both backends.
    x[idx] = BatchNormEvalValue(x[idx], mean[j], var[j], w[j], b[j], eps);
  }
}

// ---- RoPE ----------------------------------------------------------------------------------

// Frequencies from the host table (rope_freqs.h) for heads of up to 1024 dims; wider heads
// compute them on the device with the same helper (device powf, within 2 ulp).
// One item per (row, head, pair); consecutive items are consecutive pairs of a head.
__global__ void ApplyRopeKernel(float* x, int64_t rows, int64_t row_stride, int64_t n_heads,
                                int64_t head_dim, const int32_t* positions, float theta,
                                RopeFreqs freqs, bool host_freqs, bool vec) {
  const int64_t half = head_dim / 2;
  const int64_t total = rows * n_heads * half;
  for (int64_t idx = GlobalThread(); idx < total; idx += GridStride()) {
    const int64_t i = idx % half;
    const int64_t rh = idx / half;  // row * n_heads + head
    const int64_t r = rh / n_heads;
    const int64_t head = rh - r * n_heads;
    const float inv_freq = host_freqs ? freqs.inv_freq[i] : RopeInvFreq(i, head_dim, theta);
    const float angle = RopeAngle(positions[r], inv_freq);
    float s, c;
    sincosf(angle, &s, &c);
    float* p = x + r * row_stride + head * head_dim + 2 * i;
    if (vec) {
      // Even head_dim and row_stride, 8-byte aligned x: every pair starts at an even offset.
      float2 q = *reinterpret_cast<float2*>(p);
      RopeRotatePairRounded(c, s, &q.x, &q.y);
      *reinterpret_cast<float2*>(p) = q;
    } else {
      float x0 = p[0], x1 = p[1];
      RopeRotatePairRounded(c, s, &x0, &x1);
      p[0] = x0;
      p[1] = x1;
    }
  }
}

// ---- Elementwise maps ----------------------------------------------------------------------

// Runs op over n items: op.Vec4(v) covers items 4v..4v+3 (when `vec`), op.Scalar(i) one item.
template <typename Op>
__global__ void MapKernel(Op op, int64_t n, bool vec) {
  int64_t start = 0;
  if (vec) {
    const int64_t nv = n / 4;
    for (int64_t v = GlobalThread(); v < nv; v += GridStride()) op.Vec4(v);
    start = nv * 4;
  }
  for (int64_t i = start + GlobalThread(); i < n; i += GridStride()) op.Scalar(i);
}

template <typename Op>
cudaError_t LaunchMap(const Op& op, int64_t n, bool vec, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  MapKernel<<<GridFor(vec ? (n + 3) / 4 : n), kThreads, 0, stream>>>(op, n, vec);
  return cudaGetLastError();
}

struct AddOp {
  const float* x;
  float* y;
  __device__ void Vec4(int64_t v) const {
    const float4 a = reinterpret_cast<const float4*>(x)[v];
    float4 o = reinterpret_cast<float4*>(y)[v];
    o.x += a.x;
    o.y += a.y;
    o.z += a.z;
    o.w += a.w;
    reinterpret_cast<float4*>(y)[v] = o;
  }
  __device__ void Scalar(int64_t i) const { y[i] += x[i]; }
};

// Vec4 needs cols % 4 == 0, so the four items of a vector share a row and bias[c..c+3].
struct AddBiasOp {
  float* y;
  const float* bias;
  int64_t cols;
  __device__ void Vec4(int64_t v) const {
    const int64_t c = (4 * v) % cols;
    const float4 b = *reinterpret_cast<const float4*>(bias + c);
    float4 o = reinterpret_cast<float4*>(y)[v];
    o.x += b.x;
    o.y += b.y;
    o.z += b.z;
    o.w += b.w;
    reinterpret_cast<float4*>(y)[v] = o;
  }
  __device__ void Scalar(int64_t i) const { y[i] += bias[i % cols]; }
};

struct SwiGluOp {
  const float* gate;
  const float* up;
  int64_t cols, stride;
  bf16* out;
  __device__ void Vec4(int64_t v) const {
    const int64_t at = StridedOffset(4 * v, cols, stride);
    const float4 g = *reinterpret_cast<const float4*>(gate + at);
    const float4 u = *reinterpret_cast<const float4*>(up + at);
    StoreBf16x4(out + 4 * v,
                make_float4(Silu(g.x) * u.x, Silu(g.y) * u.y, Silu(g.z) * u.z, Silu(g.w) * u.w));
  }
  __device__ void Scalar(int64_t i) const {
    const int64_t at = StridedOffset(i, cols, stride);
    out[i] = __float2bfloat16_rn(Silu(gate[at]) * up[at]);
  }
};

// cpu::MulSigmoid's x * sigmoid(g) on four lanes (MulSigmoidOp, MulSigmoidToBf16Op).
__device__ float4 MulSigmoid4(float4 g, float4 x) {
  x.x *= Sigmoid(g.x);
  x.y *= Sigmoid(g.y);
  x.z *= Sigmoid(g.z);
  x.w *= Sigmoid(g.w);
  return x;
}

struct MulSigmoidOp {
  const float* g;
  float* x;
  __device__ void Vec4(int64_t v) const {
    reinterpret_cast<float4*>(x)[v] =
        MulSigmoid4(reinterpret_cast<const float4*>(g)[v], reinterpret_cast<const float4*>(x)[v]);
  }
  __device__ void Scalar(int64_t i) const { x[i] *= Sigmoid(g[i]); }
};

// MulSigmoidOp then ToBf16Op on each element, x left as it is: the same fp32 product, rounded.
// g's rows are g_stride apart (StridedOffset); x and out are contiguous.
struct MulSigmoidToBf16Op {
  const float* g;
  int64_t cols, g_stride;
  const float* x;
  bf16* out;
  __device__ void Vec4(int64_t v) const {
    StoreBf16x4(
        out + 4 * v,
        MulSigmoid4(*reinterpret_cast<const float4*>(g + StridedOffset(4 * v, cols, g_stride)),
                    reinterpret_cast<const float4*>(x)[v]));
  }
  __device__ void Scalar(int64_t i) const {
    out[i] = __float2bfloat16_rn(x[i] * Sigmoid(g[StridedOffset(i, cols, g_stride)]));
  }
};

struct ToBf16Op {
  const float* x;
  bf16* out;
  __device__ void Vec4(int64_t v) const {
    StoreBf16x4(out + 4 * v, reinterpret_cast<const float4*>(x)[v]);
  }
  __device__ void Scalar(int64_t i) const { out[i] = __float2bfloat16_rn(x[i]); }
};

struct ToFloatOp {
  const bf16* x;
  float* out;
  __device__ void Vec4(int64_t v) const {
    reinterpret_cast<float4*>(out)[v] = LoadBf16x4(x + 4 * v);
  }
  __device__ void Scalar(int64_t i) const { out[i] = __bfloat162float(x[i]); }
};

// Gates of docs/model-spec.md §5.1 through the shared helpers of kernels/common/sdm_math.h.
struct SdmGatesOp {
  const float* a;
  const float* b;
  int64_t in_stride;
  const float* a_log;
  const float* dt_bias;
  int64_t heads;
  float* log_decay;
  float* beta;
  __device__ void Vec4(int64_t) const {}  // launched scalar only (rows * heads is small)
  __device__ void Scalar(int64_t i) const {
    const int64_t h = i % heads;
    const int64_t at = StridedOffset(i, heads, in_stride);
    log_decay[i] = SdmLogDecay(a_log[h], a[at], dt_bias[h]);
    beta[i] = Sigmoid(b[at]);
  }
};

}  // namespace

namespace {

// One grid-stride pass over every vector of every block (a block may be far larger than a thread
// block: a KV page is up to hundreds of KB, so the work is split by vector, not by block).
// gather: packed[i] = blocks[ids[i]] (from = blocks, to = packed); else blocks[ids[i]] =
// packed[i] (from = packed, to = blocks). T: uint4 (16-byte vectors) or bf16.
template <typename T>
__global__ void MoveBlocksKernel(const T* from, T* to, int64_t per_block, const int32_t* ids,
                                 int64_t count, bool gather) {
  const int64_t total = count * per_block;
  for (int64_t idx = GlobalThread(); idx < total; idx += GridStride()) {
    const int64_t i = idx / per_block, c = idx % per_block;
    const int64_t block_at = static_cast<int64_t>(ids[i]) * per_block + c;
    const int64_t packed_at = i * per_block + c;
    to[gather ? packed_at : block_at] = from[gather ? block_at : packed_at];
  }
}

// The launch of both directions; 16-byte vectors when block_elems % 8 == 0 and both base
// pointers are 16-byte aligned.
cudaError_t MoveBlocks(const bf16* from, bf16* to, int64_t block_elems, const int32_t* ids,
                       int64_t count, bool gather, cudaStream_t stream) {
  if (count < 0 || block_elems < 0) return cudaErrorInvalidValue;
  if (count == 0 || block_elems == 0) return cudaSuccess;
  if (from == nullptr || to == nullptr || ids == nullptr) return cudaErrorInvalidValue;
  if (block_elems % 8 == 0 && Aligned(from, 16) && Aligned(to, 16)) {
    const int64_t per_block = block_elems / 8;
    MoveBlocksKernel<<<GridFor(count * per_block), kThreads, 0, stream>>>(
        reinterpret_cast<const uint4*>(from), reinterpret_cast<uint4*>(to), per_block, ids, count,
        gather);
  } else {
    MoveBlocksKernel<<<GridFor(count * block_elems), kThreads, 0, stream>>>(from, to, block_elems,
                                                                            ids, count, gather);
  }
  return cudaGetLastError();
}

// Whether RmsNormKernel takes its float4 path for these operands: one rule for every norm of the
// family, since the path decides the order of the sum of squares (bit for bit across launches).
bool RmsNormVectorPath(const float* x, const float* w, int64_t n, const float* out_f32,
                       const bf16* out_bf16) {
  return n % 4 == 0 && Aligned(x, 16) && Aligned(w, 16) && Aligned(out_f32, 16) &&
         Aligned(out_bf16, 8);
}

}  // namespace

cudaError_t GatherBlocks(const bf16* blocks, int64_t block_elems, const int32_t* ids, int64_t count,
                         bf16* packed, cudaStream_t stream) {
  return MoveBlocks(blocks, packed, block_elems, ids, count, /*gather=*/true, stream);
}

cudaError_t ScatterBlocks(const bf16* packed, int64_t block_elems, const int32_t* ids,
                          int64_t count, bf16* blocks, cudaStream_t stream) {
  return MoveBlocks(packed, blocks, block_elems, ids, count, /*gather=*/false, stream);
}

cudaError_t EmbeddingLookup(const bf16* table, const int32_t* tokens, int64_t n, int64_t dim,
                            float* out, cudaStream_t stream) {
  if (n <= 0 || dim <= 0) return cudaSuccess;
  // Rows of the table start 16-byte aligned when dim % 8 == 0 (and the table is).
  const bool vec = dim % 8 == 0 && Aligned(table, 16) && Aligned(out, 16);
  EmbeddingKernel<<<GridFor(n * (vec ? dim / 8 : dim)), kThreads, 0, stream>>>(table, tokens, n,
                                                                               dim, out, vec);
  return cudaGetLastError();
}

cudaError_t RmsNorm(const float* x, const float* w, int64_t rows, int64_t n, float eps,
                    float* out_f32, bf16* out_bf16, cudaStream_t stream) {
  if (rows <= 0 || n <= 0 || (out_f32 == nullptr && out_bf16 == nullptr)) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;  // one block per row
  const bool vec = RmsNormVectorPath(x, w, n, out_f32, out_bf16);
  // Without a delta the kernel never writes x.
  RmsNormKernel<<<static_cast<unsigned int>(rows), kThreads, 0, stream>>>(
      const_cast<float*>(x), nullptr, nullptr, nullptr, w, n, eps, out_f32, out_bf16, vec, false);
  return cudaGetLastError();
}

cudaError_t AddRmsNorm(const float* delta, float* x, const float* w, int64_t rows, int64_t n,
                       float eps, float* out_f32, bf16* out_bf16, cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return cudaSuccess;
  if (out_f32 == nullptr && out_bf16 == nullptr) return AddInPlace(delta, x, rows * n, stream);
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;  // one block per row
  // RmsNorm's path whatever delta's alignment (a misaligned delta is read a value at a time).
  const bool vec = RmsNormVectorPath(x, w, n, out_f32, out_bf16);
  RmsNormKernel<<<static_cast<unsigned int>(rows), kThreads, 0, stream>>>(
      x, delta, nullptr, nullptr, w, n, eps, out_f32, out_bf16, vec, Aligned(delta, 16));
  return cudaGetLastError();
}

cudaError_t EmbeddingRmsNorm(const bf16* table, const int32_t* tokens, float* x, const float* w,
                             int64_t rows, int64_t n, float eps, float* out_f32, bf16* out_bf16,
                             cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return cudaSuccess;
  if (out_f32 == nullptr && out_bf16 == nullptr) {
    return EmbeddingLookup(table, tokens, rows, n, x, stream);
  }
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;  // one block per row
  // RmsNorm's path (the order of the sum of squares depends on it); the table's rows start
  // 8-byte aligned when n % 4 == 0 and the table is.
  const bool vec = RmsNormVectorPath(x, w, n, out_f32, out_bf16);
  RmsNormKernel<<<static_cast<unsigned int>(rows), kThreads, 0, stream>>>(
      x, nullptr, table, tokens, w, n, eps, out_f32, out_bf16, vec, Aligned(table, 8));
  return cudaGetLastError();
}

cudaError_t LayerNorm(float* x, const float* w, const float* b, int64_t rows, int64_t n, float eps,
                      cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;
  LayerNormKernel<<<static_cast<unsigned int>(rows), kThreads, 0, stream>>>(x, w, b, n, eps,
                                                                            nullptr, 0, 0, nullptr);
  return cudaGetLastError();
}

cudaError_t LayerNormToBf16(const float* x, const float* w, const float* b, int64_t rows, int64_t n,
                            float eps, const float* g, int64_t g_cols, int64_t g_stride, bf16* out,
                            cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return cudaSuccess;
  if (rows > 0x7fffffff || out == nullptr ||
      (g != nullptr && (g_cols <= 0 || g_stride < g_cols || (rows * n) % g_cols != 0))) {
    return cudaErrorInvalidValue;
  }
  LayerNormKernel<<<static_cast<unsigned int>(rows), kThreads, 0, stream>>>(
      const_cast<float*>(x), w, b, n, eps, g, g_cols, g_stride, out);
  return cudaGetLastError();
}

cudaError_t BatchNormEval(float* x, const float* w, const float* b, const float* mean,
                          const float* var, int64_t rows, int64_t n, float eps,
                          cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return cudaSuccess;
  BatchNormEvalKernel<<<GridFor(rows * n), kThreads, 0, stream>>>(x, w, b, mean, var, rows, n, eps);
  return cudaGetLastError();
}

cudaError_t ApplyRope(float* x, int64_t rows, int64_t row_stride, int64_t n_heads, int64_t head_dim,
                      const int32_t* positions, float theta, cudaStream_t stream) {
  const int64_t half = head_dim / 2;
  if (rows <= 0 || n_heads <= 0 || half <= 0) return cudaSuccess;
  if (row_stride < n_heads * head_dim) return cudaErrorInvalidValue;
  const bool vec = head_dim % 2 == 0 && row_stride % 2 == 0 && Aligned(x, 8);
  RopeFreqs freqs{};
  const bool host_freqs = HostRopeFreqs(head_dim, theta, &freqs);
  ApplyRopeKernel<<<GridFor(rows * n_heads * half), kThreads, 0, stream>>>(
      x, rows, row_stride, n_heads, head_dim, positions, theta, freqs, host_freqs, vec);
  return cudaGetLastError();
}

cudaError_t AddInPlace(const float* x, float* y, int64_t n, cudaStream_t stream) {
  return LaunchMap(AddOp{x, y}, n, Aligned(x, 16) && Aligned(y, 16), stream);
}

cudaError_t AddBias(float* y, const float* bias, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const bool vec = cols % 4 == 0 && Aligned(y, 16) && Aligned(bias, 16);
  return LaunchMap(AddBiasOp{y, bias, cols}, rows * cols, vec, stream);
}

cudaError_t SwiGlu(const float* gate, const float* up, int64_t rows, int64_t cols,
                   int64_t in_stride, bf16* out, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  if (in_stride < cols) return cudaErrorInvalidValue;
  const bool vec = cols % 4 == 0 && in_stride % 4 == 0 && Aligned(gate, 16) && Aligned(up, 16) &&
                   Aligned(out, 8);
  return LaunchMap(SwiGluOp{gate, up, cols, in_stride, out}, rows * cols, vec, stream);
}

cudaError_t MulSigmoid(const float* g, float* x, int64_t n, cudaStream_t stream) {
  return LaunchMap(MulSigmoidOp{g, x}, n, Aligned(g, 16) && Aligned(x, 16), stream);
}

cudaError_t MulSigmoidToBf16(const float* g, int64_t g_stride, const float* x, int64_t rows,
                             int64_t cols, bf16* out, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  if (g_stride < cols) return cudaErrorInvalidValue;
  const bool vec =
      cols % 4 == 0 && g_stride % 4 == 0 && Aligned(g, 16) && Aligned(x, 16) && Aligned(out, 8);
  return LaunchMap(MulSigmoidToBf16Op{g, cols, g_stride, x, out}, rows * cols, vec, stream);
}

cudaError_t FloatToBf16(const float* x, int64_t n, bf16* out, cudaStream_t stream) {
  return LaunchMap(ToBf16Op{x, out}, n, Aligned(x, 16) && Aligned(out, 8), stream);
}

cudaError_t Bf16ToFloat(const bf16* x, int64_t n, float* out, cudaStream_t stream) {
  return LaunchMap(ToFloatOp{x, out}, n, Aligned(x, 8) && Aligned(out, 16), stream);
}

cudaError_t SdmGates(const float* a, const float* b, int64_t in_stride, const float* a_log,
                     const float* dt_bias, int64_t rows, int64_t heads, float* log_decay,
                     float* beta, cudaStream_t stream) {
  if (heads <= 0) return cudaSuccess;
  if (in_stride < heads) return cudaErrorInvalidValue;
  return LaunchMap(SdmGatesOp{a, b, in_stride, a_log, dt_bias, heads, log_decay, beta},
                   rows * heads,
                   /*vec=*/false, stream);
}

}  // namespace sdm::kernels::cuda
