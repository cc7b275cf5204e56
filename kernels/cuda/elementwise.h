// Row-wise and elementwise kernels of the CUDA backend, each with the contract of its CPU twin in
// kernels/cpu/ (named beside it). All pointers are device memory; every function enqueues its
// work on `stream` and returns the launch error (cudaSuccess if enqueued). Activations are fp32;
// matrix inputs for cuBLASLt are bf16 (kernels/cuda/gemm.h); small weight vectors (norm weights,
// biases, gates) are fp32.
#ifndef SDMSERVE_KERNELS_CUDA_ELEMENTWISE_H_
#define SDMSERVE_KERNELS_CUDA_ELEMENTWISE_H_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace sdm::kernels::cuda {

using bf16 = __nv_bfloat16;

// out[r] = table[tokens[r]] as fp32, for r < n; table is [vocab, dim] bf16.
cudaError_t EmbeddingLookup(const bf16* table, const int32_t* tokens, int64_t n, int64_t dim,
                            float* out, cudaStream_t stream);

// Block moves for parking and resuming sessions (engine/cuda/device_state.cc): `blocks` is an
// array of equal blocks of `block_elems` bf16 (a KV page arena; an SDM row arena), `packed` is
// `count` blocks back to back. GatherBlocks: packed[i] = blocks[ids[i]]; ScatterBlocks:
// blocks[ids[i]] = packed[i] (ids distinct). Exact copies; ids must index blocks that exist.
// CPU twin: a memcpy per block (tests/kernels/cuda_elementwise_test.cc checks every element).
cudaError_t GatherBlocks(const bf16* blocks, int64_t block_elems, const int32_t* ids, int64_t count,
                         bf16* packed, cudaStream_t stream);
cudaError_t ScatterBlocks(const bf16* packed, int64_t block_elems, const int32_t* ids,
                          int64_t count, bf16* blocks, cudaStream_t stream);

// cpu::RmsNorm: x [rows, n] -> x * rsqrt(mean(x^2) + eps) * w. Writes fp32 to out_f32 and/or
// bf16 to out_bf16 (either may be null).
cudaError_t RmsNorm(const float* x, const float* w, int64_t rows, int64_t n, float eps,
                    float* out_f32, bf16* out_bf16, cudaStream_t stream);

// cpu::AddInPlace(delta, x) then cpu::RmsNorm of x, in one launch: the residual add of a layer
// and the norm that follows it (x is left as AddInPlace leaves it, and out_f32 / out_bf16 as
// RmsNorm writes them, bit for bit; out_f32 may alias x). Both outputs null: the add alone.
cudaError_t AddRmsNorm(const float* delta, float* x, const float* w, int64_t rows, int64_t n,
                       float eps, float* out_f32, bf16* out_bf16, cudaStream_t stream);

// EmbeddingLookup(table, tokens, rows, n, x) then RmsNorm of x, in one launch: the embedding and
// the first layer's norm (x and out_f32 / out_bf16 as the two launches leave them, bit for bit;
// out_f32 may alias x). Both outputs null: the lookup alone.
cudaError_t EmbeddingRmsNorm(const bf16* table, const int32_t* tokens, float* x, const float* w,
                             int64_t rows, int64_t n, float eps, float* out_f32, bf16* out_bf16,
                             cudaStream_t stream);

// cpu::LayerNorm in place over rows of n (weight and bias may both be null: no affine). The
// engine normalises the SDM readings with LayerNormToBf16 (below).
cudaError_t LayerNorm(float* x, const float* w, const float* b, int64_t rows, int64_t n, float eps,
                      cudaStream_t stream);
// LayerNorm then MulSigmoidToBf16 (g set) or FloatToBf16 (g null) in one launch, bit for bit
// the two launches' result (a normalised, gated SDM reading into wo's bf16 input); x is not
// written. The result, [rows, n] contiguous like x and out, is gated as MulSigmoidToBf16 gates
// [rows * n / g_cols, g_cols]: element i by g[(i / g_cols) * g_stride + i % g_cols]
// (g_stride >= g_cols, and g_cols divides rows * n).
cudaError_t LayerNormToBf16(const float* x, const float* w, const float* b, int64_t rows, int64_t n,
                            float eps, const float* g, int64_t g_cols, int64_t g_stride, bf16* out,
                            cudaStream_t stream);

// cpu::BatchNormEval in place: x [rows, n], per-column running statistics. Bit for bit the CPU
// kernel's result (both call kernels/common/fp_math.h, BatchNormEvalValue). The engine applies
// the SDM scores' BatchNorm inside the addressing launch instead (SdmScoreNorm, sdm.h); this
// kernel is what the tests compare that with.
cudaError_t BatchNormEval(float* x, const float* w, const float* b, const float* mean,
                          const float* var, int64_t rows, int64_t n, float eps,
                          cudaStream_t stream);

// cpu::ApplyRope for every row r of x at position positions[r] (adjacent pairs,
// kernels/common/rope_math.h): row r's n_heads * head_dim values start at x + r * row_stride
// (row_stride >= n_heads * head_dim; more when x is part of a fused projection's output, whose
// other columns are left as they are). The engine rotates inside the KV append instead
// (RopeKvAppend, attention.h); this kernel is what the tests compare that with.
cudaError_t ApplyRope(float* x, int64_t rows, int64_t row_stride, int64_t n_heads, int64_t head_dim,
                      const int32_t* positions, float theta, cudaStream_t stream);

// cpu::AddInPlace: y += x.
cudaError_t AddInPlace(const float* x, float* y, int64_t n, cudaStream_t stream);
// y[r, c] += bias[c] for y [rows, cols].
cudaError_t AddBias(float* y, const float* bias, int64_t rows, int64_t cols, cudaStream_t stream);
// cpu::SwiGlu on rows: out [rows, cols] (contiguous) = silu(gate) * up, written as bf16 (the
// input of the w2 GEMM), where row r of gate and of up starts at r * in_stride (in_stride >=
// cols: w1 and w3 as one GEMM write each row's gate and up side by side).
cudaError_t SwiGlu(const float* gate, const float* up, int64_t rows, int64_t cols,
                   int64_t in_stride, bf16* out, cudaStream_t stream);
// cpu::MulSigmoid: x *= sigmoid(g).
cudaError_t MulSigmoid(const float* g, float* x, int64_t n, cudaStream_t stream);
// MulSigmoid then FloatToBf16 in one launch (a gated output into its GEMM's bf16 input):
// out = bf16(x * sigmoid(g)), bit for bit the two launches' result; x is not written. x and out
// are [rows, cols] contiguous; row r of g starts at g + r * g_stride (g_stride >= cols: the gate
// may be part of a fused projection's output).
cudaError_t MulSigmoidToBf16(const float* g, int64_t g_stride, const float* x, int64_t rows,
                             int64_t cols, bf16* out, cudaStream_t stream);

cudaError_t FloatToBf16(const float* x, int64_t n, bf16* out, cudaStream_t stream);
cudaError_t Bf16ToFloat(const bf16* x, int64_t n, float* out, cudaStream_t stream);

// SDM gates (docs/model-spec.md §5.1) for a, b (a_proj, b_proj outputs plus biases; row r's
// `heads` values of each at r * in_stride, in_stride >= heads): log_decay = SdmLogDecay(a_log[h],
// a, dt_bias[h]) and beta = Sigmoid(b) (kernels/common/sdm_math.h), both [rows, heads]
// contiguous. The decay itself, exp(g) or exp(g * k_i), is taken by SdmStep. The engine computes
// the gates in the addressing launch (SdmAddressJobs, sdm.h), which runs this kernel only when
// no addressing job selects anything.
cudaError_t SdmGates(const float* a, const float* b, int64_t in_stride, const float* a_log,
                     const float* dt_bias, int64_t rows, int64_t heads, float* log_decay,
                     float* beta, cudaStream_t stream);

}  // namespace sdm::kernels::cuda

#endif  // SDMSERVE_KERNELS_CUDA_ELEMENTWISE_H_
