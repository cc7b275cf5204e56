// Names, shapes and roles of every tensor of a model: the one place that knows the reference's
// state-dict layout (Lingua's LMTransformer with SparseDeltaMemory layers). The loader checks a
// file against it, `sdm-model init` writes it, docs/model-format.md describes it, and the
// reference-checkpoint converter's test checks the reference names map onto it.
#ifndef SDMSERVE_ENGINE_WEIGHT_SPEC_H_
#define SDMSERVE_ENGINE_WEIGHT_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "engine/layer_tensors.h"
#include "engine/model_config.h"

namespace sdm {

// How `sdm-model init` initialises a tensor, following the reference's init_weights().
enum class WeightInit {
  kTruncNormal,  // trunc_normal(0, std, -3 std, 3 std)
  kZeros,        // biases, BatchNorm bias and running mean
  kOnes,         // norms, BatchNorm weight and running var
  kSdmALog,      // log(uniform(A_min, A_max).clamp(1e-4))
  kSdmDtBias,    // inv_softplus(exp(uniform(log 0.001, log 0.1)).clamp(1e-4))
};

struct TensorSpec {
  std::string name;            // the reference's state-dict name
  std::vector<int64_t> shape;  // row-major, as torch stores it ([out, in] for Linear)
  WeightInit init = WeightInit::kTruncNormal;
  double init_std = 0.0;       // for kTruncNormal: standard deviation
  double init_bound = 0.0;     // for kTruncNormal: values lie in [-bound, bound]
  bool is_sdm_memory = false;  // the learned M0 (`memory`): excluded from "parameters w/o M0"
  std::string meaning;         // one line for docs and `sdm-model info`
};

// Every tensor a model with this (finalized) config must have, in a stable order: embeddings,
// then layer by layer, then the final norm and output.
std::vector<TensorSpec> ExpectedTensors(const ModelConfig& config);

// A tensor's place in WeightSpec::tensors; absent (-1) when the config has no such tensor.
struct TensorRef {
  int32_t index = -1;
  bool present() const { return index >= 0; }
};

// The tensors of a config both as the flat list (ExpectedTensors) and by role
// (engine/layer_tensors.h), which is how backends bind weights without spelling names.
struct WeightSpec {
  std::vector<TensorSpec> tensors;
  ModelTensors<TensorRef, TensorRef> roles;

  // The spec a role refers to, or null when absent.
  const TensorSpec* Find(TensorRef ref) const {
    return ref.present() ? &tensors[static_cast<size_t>(ref.index)] : nullptr;
  }
};
WeightSpec BuildWeightSpec(const ModelConfig& config);

int64_t NumElements(const TensorSpec& spec);

struct ParameterCounts {
  int64_t total = 0;       // every tensor (BatchNorm running statistics included)
  int64_t without_m0 = 0;  // total minus the learned SDM memory (the paper's matching)
  int64_t m0 = 0;
};
ParameterCounts CountParameters(const ModelConfig& config);

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_WEIGHT_SPEC_H_
