#include "engine/stacked_projection.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace sdm {

std::vector<StackedPart> MixerInputParts(const LayerTensors<TensorRef, TensorRef>& layer) {
  if (layer.type == LayerType::kSdm) {
    const SdmTensors<TensorRef, TensorRef>& s = layer.sdm;
    std::vector<StackedPart> parts(kSdmInputParts);
    parts[kSdmReadQuery] = {s.wq_read, s.bq_read};
    parts[kSdmWriteKey] = {s.wk_write, s.bk_write};
    parts[kSdmValue] = {s.wv_write, s.bv_write};
    parts[kSdmOutputGate] = {s.wog, s.bog};
    parts[kSdmDecayInput] = {s.a_proj, s.a_bias};
    parts[kSdmBetaInput] = {s.b_proj, s.b_bias};
    return parts;
  }
  const AttentionTensors<TensorRef, TensorRef>& a = layer.attention;
  std::vector<StackedPart> parts(kAttnInputParts);
  parts[kAttnQuery] = {a.wq, {}};
  parts[kAttnKey] = {a.wk, {}};
  parts[kAttnValue] = {a.wv, {}};
  parts[kAttnGate] = {a.w_gate, {}};
  return parts;
}

std::vector<StackedPart> FfnInputParts(const LayerTensors<TensorRef, TensorRef>& layer) {
  std::vector<StackedPart> parts(kFfnInputParts);
  parts[kFfnGate] = {layer.w1, {}};
  parts[kFfnUp] = {layer.w3, {}};
  return parts;
}

absl::StatusOr<StackedLayout> PlanStackedProjection(const WeightSpec& spec,
                                                    std::span<const StackedPart> parts) {
  StackedLayout layout;
  layout.in = -1;
  for (const StackedPart& part : parts) {
    const TensorSpec* m = spec.Find(part.matrix);
    const TensorSpec* b = spec.Find(part.bias);
    // Where the previous part ended, rounded up to the alignment.
    const int64_t at =
        (layout.width + kStackedPartAlign - 1) / kStackedPartAlign * kStackedPartAlign;
    layout.offsets.push_back(at);
    if (m == nullptr) {
      if (b != nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("bias ", b->name, " has no matrix to stack with"));
      }
      layout.rows.push_back(0);
      continue;
    }
    if (m->shape.size() != 2 || m->shape[0] <= 0 || m->shape[1] <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(m->name, " is not a matrix"));
    }
    if (layout.in >= 0 && m->shape[1] != layout.in) {
      return absl::InvalidArgumentError(absl::StrCat(
          m->name, " reads ", m->shape[1], " inputs; the parts before it read ", layout.in));
    }
    if (b != nullptr && (b->shape.size() != 1 || b->shape[0] != m->shape[0])) {
      return absl::InvalidArgumentError(
          absl::StrCat("bias ", b->name, " does not match the rows of ", m->name));
    }
    layout.in = m->shape[1];
    layout.rows.push_back(m->shape[0]);
    layout.width = at + m->shape[0];
    layout.has_bias = layout.has_bias || b != nullptr;
  }
  if (layout.in < 0) return absl::InvalidArgumentError("no part to stack");
  layout.width = (layout.width + kStackedPartAlign - 1) / kStackedPartAlign * kStackedPartAlign;
  return layout;
}

}  // namespace sdm
