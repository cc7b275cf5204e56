// Checks a safetensors header against the tensors a model config requires (engine/weight_spec.h)
// without reading any tensor data: used by ModelWeights::Load() and `sdm-model info`.
#ifndef SDMSERVE_ENGINE_WEIGHT_FILE_CHECK_H_
#define SDMSERVE_ENGINE_WEIGHT_FILE_CHECK_H_

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "engine/safetensors.h"
#include "engine/weight_spec.h"

namespace sdm {

// InvalidArgument, prefixed with `label`, naming the first missing tensors, else the first
// unexpected ones, else the first tensor whose shape differs (expected vs found).
absl::Status CheckTensorsMatchSpec(absl::string_view label, const SafetensorsIndex& index,
                                   const std::vector<TensorSpec>& expected);

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_WEIGHT_FILE_CHECK_H_
