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

// Where an attention kernel puts its output, row r's n_heads * head_dim values (r: the sequence
// of a decode batch, the token of a prefill chunk): fp32 into f32, or, with bf16 set instead,
// rounded to bf16 (the input of the wo GEMM), first multiplied by Sigmoid of the gate when gate
// is set: what FloatToBf16 or MulSigmoidToBf16 (elementwise.h) make of the fp32 output, bit for
// bit. Rows are contiguous in f32 and bf16; row r's gate values start at gate + r * gate_stride
// (gate_stride >= n_heads * head_dim and a multiple of 4, gate 16-byte aligned: a part of a
// fused projection's output). bf16 is 8-byte aligned.
struct AttentionOutput {
  float* f32 = nullptr;
  __nv_bfloat16* bf16 = nullptr;
  const float* gate = nullptr;
  int64_t gate_stride = 0;
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
// row_seq[r]. The pages must already be in the sequence's page table. The engine appends
// through RopeKvAppend (below), which rotates k on its way.
cudaError_t KvAppend(const float* k, const float* v, int64_t row_stride, int64_t rows,
                     const int32_t* row_seq, const int32_t* row_pos, const KvLayerView& kv,
                     cudaStream_t stream);

// ApplyRope (elementwise.h) on q's n_heads and k's n_kv_heads heads of every row, then KvAppend
// of the rotated k and of v, in one launch, bit for bit what those give (both rotate with
// RopeRotatePairRounded, kernels/common/rope_math.h, from frequencies computed on the host):
// row r's query is rotated in place (n_heads * head_dim fp32 at q + r * row_stride, every row)
// and its key and value stored at position positions[r] of sequence row_seq[r] (rows with a
// negative position skipped); k itself is not written. q, k and v are 16-byte aligned and
// row_stride (a multiple of 4, at least each part's width) apart: parts of a fused projection's
// output. The pages must already be in the sequence's page table.
cudaError_t RopeKvAppend(float* q, const float* k, const float* v, int64_t row_stride, int64_t rows,
                         const int32_t* row_seq, const int32_t* positions, float theta,
                         const AttentionDims& dims, const KvLayerView& kv, cudaStream_t stream);

// Floats of partial states AttentionDecode needs for `batch` sequences of at most `max_visible`
// visible positions each (0 when no sequence spans more than one chunk).
int64_t AttentionDecodeScratchFloats(int64_t batch, const AttentionDims& dims, int64_t max_visible);
// Counters AttentionDecode needs beside them for `batch` sequences: room for one per sequence and
// query head, of which it uses one per sequence and head group (the last of a sequence's chunk
// blocks of a head group to finish merges the chunks).
int64_t AttentionDecodeCounters(int64_t batch, const AttentionDims& dims);

// AttentionDecode's working memory: both null when AttentionDecodeScratchFloats is 0. The
// counters must be zero before the first call; every call leaves them zero (so one buffer serves
// every layer and step, a CUDA graph's replays included).
struct AttentionDecodeScratch {
  float* partials = nullptr;         // AttentionDecodeScratchFloats floats
  unsigned int* counters = nullptr;  // AttentionDecodeCounters entries
};

// Sequence b's query (n_heads * head_dim fp32 at q + b * q_stride; q_stride >= that and a
// multiple of 4) at positions[b], whose own key and value are already in the cache. out is
// [batch, n_heads * head_dim] contiguous. `max_visible` bounds every sequence's visible
// positions (positions[b] < max_visible); it sizes the grid, clamped to dims.window for a
// sliding window (DecodeGridChunkCount). One launch, whatever the chunks.
cudaError_t AttentionDecode(const float* q, int64_t q_stride, int64_t batch,
                            const int32_t* positions, int64_t max_visible, const KvLayerView& kv,
                            const AttentionDims& dims, const AttentionDecodeScratch& scratch,
                            float* out, cudaStream_t stream);
// The same, the output written as `out` says (AttentionOutput).
cudaError_t AttentionDecode(const float* q, int64_t q_stride, int64_t batch,
                            const int32_t* positions, int64_t max_visible, const KvLayerView& kv,
                            const AttentionDims& dims, const AttentionDecodeScratch& scratch,
                            const AttentionOutput& out, cudaStream_t stream);

// Queries of sequence `seq` (index into kv.page_tables) at positions pos0 .. pos0 + num_tokens - 1,
// token t's at q + t * q_stride (as AttentionDecode's), out [num_tokens, n_heads * head_dim]
// contiguous; their keys and values are already in the cache.
cudaError_t AttentionPrefill(const float* q, int64_t q_stride, int64_t num_tokens, int64_t pos0,
                             int32_t seq, const KvLayerView& kv, const AttentionDims& dims,
                             float* out, cudaStream_t stream);
// The same, the output written as `out` says (AttentionOutput; row t is token t's).
cudaError_t AttentionPrefill(const float* q, int64_t q_stride, int64_t num_tokens, int64_t pos0,
                             int32_t seq, const KvLayerView& kv, const AttentionDims& dims,
                             const AttentionOutput& out, cudaStream_t stream);

}  // namespace sdm::kernels::cuda

#endif  // SDMSERVE_KERNELS_CUDA_ATTENTION_H_
