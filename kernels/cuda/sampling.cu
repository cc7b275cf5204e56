// Token sampling on the GPU, one block per row, with the per-row arithmetic of the CPU sampler
// (kernels/common/sampling_math.h, kernels/common/philox.h), so that both pick the same token.
//
// Per row: a block-wide argmax (greedy rows stop there); then either the id-order inverse CDF
// (no top-k / top-p) or a bitonic sort of the positive-weight tokens by (logit desc, id asc) as
// 64-bit keys in device scratch, the chunked CDF over the first top_k of them, the nucleus and the
// draw. Chunk totals and group scans run in parallel; the short sequential searches on thread 0.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/philox.h"
#include "kernels/common/sampling_math.h"
#include "kernels/cuda/sampling.h"

namespace sdm::kernels::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kTile = 4096;     // sort keys per shared-memory tile (32 KiB)
constexpr int64_t kMaxSlots = 128;  // blocks, each with its scratch slot; more rows loop
constexpr int64_t kAlign = 256;
constexpr uint64_t kNoKey = ~uint64_t{0};  // sorts after every candidate key

int64_t AlignUp(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

int64_t NextPow2(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Where one block's scratch lives: sort keys (a power of two >= vocab), chunk sums, group ends.
struct SlotLayout {
  int64_t sort_n;
  int64_t chunk_offset;
  int64_t group_offset;
  int64_t bytes;
};

SlotLayout LayoutFor(int64_t vocab) {
  SlotLayout l;
  l.sort_n = NextPow2(vocab);
  l.chunk_offset = AlignUp(l.sort_n * static_cast<int64_t>(sizeof(uint64_t)));
  l.group_offset =
      l.chunk_offset + AlignUp(CdfChunkCount(vocab) * static_cast<int64_t>(sizeof(double)));
  l.bytes = l.group_offset + AlignUp(CdfGroupCount(vocab) * static_cast<int64_t>(sizeof(double)));
  return l;
}

struct SharedStorage {
  uint64_t tile[kTile];
  float warp_value[kWarps];
  int32_t warp_id[kWarps];
  int64_t warp_count[kWarps];
};

// Weight of position j in id order.
struct IdWeights {
  const float* row;
  SampleWeightParams wp;
  SDM_HOST_DEVICE double operator()(int64_t j) const { return SampleWeight(row[j], wp); }
};

// Weight of position j in sorted order.
struct SortedWeights {
  const float* row;
  const uint64_t* keys;
  SampleWeightParams wp;
  SDM_HOST_DEVICE double operator()(int64_t j) const {
    return SampleWeight(row[SampleOrderKeyId(keys[j])], wp);
  }
};

struct ArgmaxPair {
  float value;
  int32_t id;
};

__device__ __forceinline__ ArgmaxPair BetterOf(ArgmaxPair a, ArgmaxPair b) {
  return ArgmaxBefore(b.value, b.id, a.value, a.id) ? b : a;
}

__device__ __forceinline__ ArgmaxPair WarpArgmax(ArgmaxPair best) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const ArgmaxPair other{__shfl_down_sync(0xffffffffu, best.value, offset),
                           __shfl_down_sync(0xffffffffu, best.id, offset)};
    best = BetterOf(best, other);
  }
  return best;
}

// ArgmaxBefore is a strict order on non-NaN entries, so any reduction order finds the CPU's
// winner; a NaN result means every logit is NaN. Ends synchronised (shared memory reusable).
__device__ ArgmaxPair BlockArgmax(const float* row, int64_t vocab, SharedStorage& sh) {
  const float nan = __int_as_float(0x7fc00000);
  ArgmaxPair best{nan, 0};
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
    best = BetterOf(best, ArgmaxPair{row[i], static_cast<int32_t>(i)});
  }
  best = WarpArgmax(best);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) {
    sh.warp_value[warp] = best.value;
    sh.warp_id[warp] = best.id;
  }
  __syncthreads();
  if (warp == 0) {
    best = lane < kWarps ? ArgmaxPair{sh.warp_value[lane], sh.warp_id[lane]} : ArgmaxPair{nan, 0};
    best = WarpArgmax(best);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    sh.warp_value[0] = best.value;
    sh.warp_id[0] = best.id;
  }
  __syncthreads();
  const ArgmaxPair result{sh.warp_value[0], sh.warp_id[0]};
  __syncthreads();
  return result;
}

// Sum over the block. Ends synchronised.
__device__ int64_t BlockSum(int64_t x, SharedStorage& sh) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_down_sync(0xffffffffu, x, offset);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) sh.warp_count[warp] = x;
  __syncthreads();
  int64_t total = 0;
  for (int w = 0; w < kWarps; ++w) total += sh.warp_count[w];
  __syncthreads();
  return total;
}

// One compare-exchange pass (k, j) of the bitonic network over a[0, n), n a power of two, j < n.
// `offset` is a[0]'s position in the whole array: the direction of a pair depends on it.
__device__ __forceinline__ void BitonicPass(uint64_t* a, int64_t n, int64_t offset, int64_t k,
                                            int64_t j) {
  for (int64_t q = threadIdx.x; q < n / 2; q += kThreads) {
    const int64_t i = ((q & ~(j - 1)) << 1) | (q & (j - 1));  // q with a 0 inserted at bit j
    const bool ascending = ((offset + i) & k) == 0;
    const uint64_t x = a[i];
    const uint64_t y = a[i + j];
    if (ascending ? x > y : x < y) {
      a[i] = y;
      a[i + j] = x;
    }
  }
}

// Sorts keys[0, n) ascending (n a power of two; keys are distinct except kNoKey padding). Passes
// with j < kTile run in shared memory a tile at a time; only the long-stride ones touch global
// memory. Every thread runs the same loop trip counts, so the barriers are uniform.
__device__ void BitonicSort(uint64_t* keys, int64_t n, uint64_t* tile) {
  const int64_t tile_n = n < kTile ? n : kTile;
  const auto sweep_tiles = [&](int64_t k, int64_t first_j) {
    for (int64_t base = 0; base < n; base += tile_n) {
      for (int64_t i = threadIdx.x; i < tile_n; i += kThreads) tile[i] = keys[base + i];
      __syncthreads();
      for (int64_t j = first_j; j > 0; j >>= 1) {
        BitonicPass(tile, tile_n, base, k, j);
        __syncthreads();
      }
      for (int64_t i = threadIdx.x; i < tile_n; i += kThreads) keys[base + i] = tile[i];
      __syncthreads();
    }
  };
  // Every tile sorted, in the directions the global network gives it.
  for (int64_t base = 0; base < n; base += tile_n) {
    for (int64_t i = threadIdx.x; i < tile_n; i += kThreads) tile[i] = keys[base + i];
    __syncthreads();
    for (int64_t k = 2; k <= tile_n; k <<= 1) {
      for (int64_t j = k >> 1; j > 0; j >>= 1) {
        BitonicPass(tile, tile_n, base, k, j);
        __syncthreads();
      }
    }
    for (int64_t i = threadIdx.x; i < tile_n; i += kThreads) keys[base + i] = tile[i];
    __syncthreads();
  }
  for (int64_t k = 2 * tile_n; k <= n; k <<= 1) {
    for (int64_t j = k >> 1; j >= tile_n; j >>= 1) {
      BitonicPass(keys, n, 0, k, j);
      __syncthreads();  // also orders the global-memory writes within the block
    }
    sweep_tiles(k, tile_n >> 1);
  }
}

// Builds the chunked CDF of `weights` over [0, n) in chunk / group_end: steps 1 and 2 in
// parallel, step 3 (returned total) on thread 0 only.
template <typename Weights>
__device__ double BlockCdfBuild(const Weights& weights, int64_t n, double* chunk,
                                double* group_end) {
  const int64_t chunks = CdfChunkCount(n);
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) chunk[c] = CdfChunkSum(weights, n, c);
  __syncthreads();
  for (int64_t g = threadIdx.x; g < CdfGroupCount(n); g += kThreads) {
    CdfScanGroup(chunk, chunks, g);
  }
  __syncthreads();
  return threadIdx.x == 0 ? CdfScanGroups(chunk, chunks, group_end) : 0.0;
}

// The token of one row (written by thread 0). Every early return is block-uniform.
__device__ void SampleRow(const float* row, int64_t vocab, const RowSampling& p, uint64_t* keys,
                          int64_t sort_n, double* chunk, double* group_end, SharedStorage& sh,
                          int32_t* token) {
  const ArgmaxPair best = BlockArgmax(row, vocab, sh);
  const int32_t best_id = SampleIsNan(best.value) ? 0 : best.id;
  // Greedy (temperature 0; anything not > 0 is treated so), all NaN, or every weight exp(-inf).
  if (!(p.temperature > 0) || SampleIsNan(best.value) || best.value == -INFINITY) {
    if (threadIdx.x == 0) *token = best_id;
    return;
  }
  const SampleWeightParams wp{best.value, SampleIsPosInf(best.value), p.temperature};
  const double u = UniformDraw(p.seed, p.draw_index);
  const bool restrict_k = p.top_k > 0 && p.top_k < vocab;
  const bool restrict_p = p.top_p < 1.0;

  if (!restrict_k && !restrict_p) {
    const IdWeights weights{row, wp};
    const double total = BlockCdfBuild(weights, vocab, chunk, group_end);
    if (threadIdx.x == 0) {
      double cum;
      const int64_t id = CdfFind(weights, vocab, chunk, group_end, u * total, true, &cum);
      *token = static_cast<int32_t>(id < vocab ? id : LastPositive(weights, vocab, best_id));
    }
    return;
  }

  // Keys of the positive-weight tokens; the rest and the padding sort last.
  int64_t positive = 0;
  for (int64_t i = threadIdx.x; i < sort_n; i += kThreads) {
    uint64_t key = kNoKey;
    if (i < vocab) {
      const float l = row[i];
      if (SampleWeight(l, wp) > 0) {
        key = SampleOrderKey(l, static_cast<int32_t>(i));
        ++positive;
      }
    }
    keys[i] = key;
  }
  const int64_t candidates = BlockSum(positive, sh);  // >= 1: the argmax has weight 1
  BitonicSort(keys, sort_n, sh.tile);
  const int64_t kept = restrict_k && p.top_k < candidates ? p.top_k : candidates;
  const SortedWeights weights{row, keys, wp};
  const double total = BlockCdfBuild(weights, kept, chunk, group_end);
  if (threadIdx.x == 0) {
    const int64_t j = CdfDrawSorted(weights, kept, chunk, group_end, total, restrict_p, p.top_p, u);
    *token = SampleOrderKeyId(keys[j]);
  }
}

__global__ void __launch_bounds__(kThreads)
    SampleTokensKernel(const float* logits, int64_t batch, int64_t vocab, const RowSampling* params,
                       unsigned char* scratch, SlotLayout layout, int32_t* tokens) {
  __shared__ SharedStorage sh;
  unsigned char* slot = scratch + static_cast<int64_t>(blockIdx.x) * layout.bytes;
  uint64_t* keys = reinterpret_cast<uint64_t*>(slot);
  double* chunk = reinterpret_cast<double*>(slot + layout.chunk_offset);
  double* group_end = reinterpret_cast<double*>(slot + layout.group_offset);
  for (int64_t row = blockIdx.x; row < batch; row += gridDim.x) {
    const RowSampling p = params[row];
    SampleRow(logits + row * vocab, vocab, p, keys, layout.sort_n, chunk, group_end, sh,
              &tokens[row]);
    __syncthreads();  // the slot and shared memory are reused by the next row
  }
}

}  // namespace

int64_t SampleTokensScratchBytes(int64_t batch, int64_t vocab) {
  if (batch <= 0 || vocab <= 0) return 0;
  return (batch < kMaxSlots ? batch : kMaxSlots) * LayoutFor(vocab).bytes;
}

cudaError_t SampleTokens(const float* logits, int64_t batch, int64_t vocab,
                         const RowSampling* params, void* scratch, int32_t* tokens,
                         cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  if (batch < 0 || vocab <= 0 || vocab > INT32_MAX || logits == nullptr || params == nullptr ||
      scratch == nullptr || tokens == nullptr) {
    return cudaErrorInvalidValue;
  }
  const unsigned int blocks = static_cast<unsigned int>(batch < kMaxSlots ? batch : kMaxSlots);
  SampleTokensKernel<<<blocks, kThreads, 0, stream>>>(
      logits, batch, vocab, params, static_cast<unsigned char*>(scratch), LayoutFor(vocab), tokens);
  return cudaGetLastError();
}

}  // namespace sdm::kernels::cuda
