// Attention on the GPU over the paged KV layout of kernels/common/device_layout.h: the cache
// append, decode attention (one query token per sequence, split-K over long contexts) and
// prefill attention (a chunk of one sequence's queries). Same contract as kernels/cpu/attention.h:
// a query at position p sees keys j <= p, and p - j < window when window > 0; scores scaled by
// 1/sqrt(head_dim); GQA (query head h reads kv head h / (n_heads / n_kv_heads)); RoPE applied by
// the caller. Cached rows are bf16, everything else fp32, accumulation fp32. All pointers are
// device memory; work is enqueued on `stream`.
#ifndef SDMSERVE_KERNELS_CUDA_ATTENTION_H_
#define SDMSERVE_KERNELS_CUDA_ATTENTION_H_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace sdm::kernels::cuda {

// One attention layer's cache as seen by a batch of sequences.
struct KvLayerView {
  __nv_bfloat16* pool = nullptr;  // the layer's page arena
  int64_t kv_width = 0;           // n_kv_heads * head_dim
  int32_t ring_pages = 0;         // 0: full attention; > 0: sliding-window ring
  // [num_seqs] device array of device pointers: sequence i's page table.
  const int32_t* const* page_tables = nullptr;
};

struct AttentionDims {
  int32_t n_heads = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  int64_t window = 0;  // 0: full causal attention
};

// Positions per block in split-K decode: a sequence's visible keys are cut into chunks of this
// many positions, each reduced by its own block; the partial softmax states are then merged
// (kernels/common/attention_math.h).
inline constexpr int64_t kAttentionSplitTokens = 512;

// Stores row r of k and v (kv_width fp32 each at k + r * row_stride and v + r * row_stride, k
// already rotated; row_stride >= kv_width and a multiple of 4, more than kv_width when k and v
// are parts of a fused projection's output) as bf16 at position row_pos[r] of sequence
// row_seq[r]. The pages must already be in the sequence's page table.
cudaError_t KvAppend(const float* k, const float* v, int64_t row_stride, int64_t rows,
                     const int32_t* row_seq, const int32_t* row_pos, const KvLayerView& kv,
                     cudaStream_t stream);

// Floats of scratch AttentionDecode needs for `batch` sequences of at most `max_visible` visible
// positions each.
int64_t AttentionDecodeScratchFloats(int64_t batch, const AttentionDims& dims, int64_t max_visible);

// Sequence b's query (n_heads * head_dim fp32 at q + b * q_stride; q_stride >= that and a
// multiple of 4) at positions[b], whose own key and value are already in the cache. out is
// [batch, n_heads * head_dim] contiguous. `max_visible` bounds every sequence's visible
// positions (positions[b] < max_visible); it sizes the grid, clamped to dims.window for a
// sliding window (DecodeGridChunkCount). scratch: AttentionDecodeScratchFloats floats.
cudaError_t AttentionDecode(const float* q, int64_t q_stride, int64_t batch,
                            const int32_t* positions, int64_t max_visible, const KvLayerView& kv,
                            const AttentionDims& dims, float* scratch, float* out,
                            cudaStream_t stream);

// Queries of sequence `seq` (index into kv.page_tables) at positions pos0 .. pos0 + num_tokens - 1,
// token t's at q + t * q_stride (as AttentionDecode's), out [num_tokens, n_heads * head_dim]
// contiguous; their keys and values are already in the cache.
cudaError_t AttentionPrefill(const float* q, int64_t q_stride, int64_t num_tokens, int64_t pos0,
                             int32_t seq, const KvLayerView& kv, const AttentionDims& dims,
                             float* out, cudaStream_t stream);

}  // namespace sdm::kernels::cuda

#endif  // SDMSERVE_KERNELS_CUDA_ATTENTION_H_
