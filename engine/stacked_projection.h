// Dense layers that read the same input, stacked into one matrix so that the CUDA backend runs
// them as one GEMM (engine/cuda/cuda_backend.cc): per layer, the mixer's input projections
// (attention: q, k, v and the optional output gate; SDM: read query, write key, value, the
// optional output gate, and the two gate projections a and b) and the feed-forward's w1 and w3.
// A decode step streams the same weight bytes either way; one larger GEMM instead of several
// small ones saves launches and keeps more of the device busy at small batch, where each of the
// small ones would be a few microseconds of ramp-up and tail.
//
// The stacked weight is the parts' [out, in] matrices one below the other, in the order of the
// part enums below, each starting at a multiple of kStackedPartAlign rows (zero rows fill the
// gaps), so that in each row of the GEMM's output [rows, width] every part starts 32-byte
// aligned and the kernels that read a part (rows `width` apart) keep their vector loads. The
// stacked bias, when any part has one, is the parts' biases at the same offsets (zeros elsewhere:
// adding 0 leaves a part without bias exactly as it was, up to the sign of a zero).
//
// Host logic only, no CUDA: tested on the CPU (tests/engine/stacked_projection_test.cc).
#ifndef SDMSERVE_ENGINE_STACKED_PROJECTION_H_
#define SDMSERVE_ENGINE_STACKED_PROJECTION_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/layer_tensors.h"
#include "engine/weight_spec.h"

namespace sdm {

// Output rows (columns of the GEMM's output) a part's start is rounded up to: 8 fp32 values,
// 32 bytes.
inline constexpr int64_t kStackedPartAlign = 8;

// The parts of each stack, in stacking order (the index of a part in StackedLayout::offsets).
enum AttentionInputPart : int { kAttnQuery, kAttnKey, kAttnValue, kAttnGate, kAttnInputParts };
enum SdmInputPart : int {
  kSdmReadQuery,   // wq_read, bq_read: the read scores
  kSdmWriteKey,    // wk_write, bk_write: the write scores
  kSdmValue,       // wv_write, bv_write
  kSdmOutputGate,  // wog, bog (absent unless output_gate)
  kSdmDecayInput,  // a_proj, a_bias
  kSdmBetaInput,   // b_proj, b_bias
  kSdmInputParts
};
enum FfnInputPart : int { kFfnGate, kFfnUp, kFfnInputParts };  // w1, w3

// One part: its matrix and its bias (either may be absent; an absent matrix is an absent part,
// which takes no rows).
struct StackedPart {
  TensorRef matrix;
  TensorRef bias;
};

// A layer's parts in stacking order: the mixer's inputs (attention or SDM by the layer's type)
// and the feed-forward's.
std::vector<StackedPart> MixerInputParts(const LayerTensors<TensorRef, TensorRef>& layer);
std::vector<StackedPart> FfnInputParts(const LayerTensors<TensorRef, TensorRef>& layer);

// Where the parts sit in the stack.
struct StackedLayout {
  std::vector<int64_t> offsets;  // per part: its first row (an absent part: where it would be)
  std::vector<int64_t> rows;     // per part: its rows (0 for an absent part)
  int64_t width = 0;             // rows of the stack: a multiple of kStackedPartAlign
  int64_t in = 0;                // columns: every present part's input width
  bool has_bias = false;         // some part has a bias
};

// The layout of `parts` as `spec` shapes them. InvalidArgument when no part is present, when
// the parts' input widths differ, when a bias is not a vector of its matrix's rows, or when a
// bias comes without its matrix.
absl::StatusOr<StackedLayout> PlanStackedProjection(const WeightSpec& spec,
                                                    std::span<const StackedPart> parts);

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_STACKED_PROJECTION_H_
