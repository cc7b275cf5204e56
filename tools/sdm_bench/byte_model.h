// The analytic model of one decode step of `sdm-bench decode`: the bytes it must move (the
// "bandwidth floor" that the %bw figures divide by) and the FLOPs it computes, from a ModelConfig
// alone (no weights, no engine). docs/benchmarks.md states the protocol these figures serve.
//
// A decode step of B sessions at context `ctx` (positions already cached) moves:
//  - the weights, once whatever B is (WeightBytesPerStep): every 2-D tensor at `elem` bytes per
//    value and every 1-D tensor (norms, biases, gains) as fp32; not the learned SDM memory M0
//    (only its touched rows, counted per session) and not the token embedding table unless it is
//    tied to the output layer (only the B gathered rows, counted per session);
//  - per session (SessionBytesPerStep): the token's embedding row; per attention layer the K and V
//    rows of every visible position plus the new K and V rows (visible: ctx + 1 positions for full
//    attention, at most the window for sliding-window attention); per SDM layer and head 2W + R
//    rows of head-width values (W rows read and written back, R rows read).
// `elem` is the bytes per stored value of matrices and KV rows: 4 for the CPU engine (fp32), 2 for
// the CUDA engine and the CPU's bf16 mode (ElemBytes()); `row_elem` that of SDM rows and the
// embedding row, which the CPU keeps fp32 in both modes (RowElemBytes(); 0: the same as elem).
//
// Every function requires a finalized config (FinalizeModelConfig) and is thread-safe (pure).
#ifndef SDMSERVE_TOOLS_SDM_BENCH_BYTE_MODEL_H_
#define SDMSERVE_TOOLS_SDM_BENCH_BYTE_MODEL_H_

#include <cstdint>

#include "engine/engine.h"
#include "engine/model_config.h"
#include "engine/weight_spec.h"

namespace sdm::bench {

// Bytes per stored matrix and KV value on `device`: 2 (bf16) on CUDA or with cpu_dtype bf16, 4
// (fp32) otherwise; per SDM row and embedding value: 2 on CUDA, 4 on the CPU.
double ElemBytes(EngineDevice device, DType cpu_dtype = DType::kF32);
double RowElemBytes(EngineDevice device);

// Whether the decode step multiplies by `t` as a dense layer (y[B, n] = x[B, k] t^T): every 2-D
// tensor except the SDM memory (read sparsely) and the embedding table unless it is tied (then it
// is also the output layer).
bool IsDecodeGemm(const ModelConfig& c, const TensorSpec& t);

// The weight bytes of one step, split by the mixer a tensor belongs to (layers.{i}.attention.*
// of a full-attention, sliding-window or SDM layer); everything else (embeddings, norms, FFNs,
// the output layer) is `other`.
struct WeightBytes {
  double attn = 0, swa = 0, sdm = 0, other = 0;
  double total() const { return attn + swa + sdm + other; }
};
WeightBytes WeightBytesPerStep(const ModelConfig& c, double elem);

// The bytes one session adds to a step at context `ctx`, split by kind.
struct SessionStepBytes {
  double kv = 0;     // full-attention layers' K and V rows
  double swa = 0;    // sliding-window layers' K and V rows
  double sdm = 0;    // SDM layers' rows
  double other = 0;  // the token's embedding row
  double total() const { return kv + swa + sdm + other; }
};
SessionStepBytes SessionBytesPerStep(const ModelConfig& c, int64_t ctx, double elem,
                                     double row_elem = 0);

// The whole step of `batch` sessions at context `ctx`: the weights once plus every session's
// bytes.
double StepBytes(const ModelConfig& c, int64_t ctx, int64_t batch, double elem,
                 double row_elem = 0);

// Bytes of K and V one cached token holds over the full-attention layers.
double KvBytesPerToken(const ModelConfig& c, double elem);

// FLOPs of one decoded token at context `ctx`: 2 n k per decode GEMM, attention over the visible
// keys (4 per key and query-head dimension: scores and the weighted sum) and the SDM rows (about
// 5 per value of the W written rows: decay, prediction, update; 2 per value of the R read rows).
double DecodeFlopsPerToken(const ModelConfig& c, int64_t ctx);

}  // namespace sdm::bench

#endif  // SDMSERVE_TOOLS_SDM_BENCH_BYTE_MODEL_H_
