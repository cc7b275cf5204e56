// Random initialisation of a model's tensors, following the reference's init_weights():
// truncated normals for projections and embeddings (std and bounds from TensorSpec), zeros and
// ones for biases and norms, and the SDM decay parameters
//   A_log   = log(uniform(A_min, A_max).clamp(min=1e-4))       (A range from sdm_args)
//   dt_bias = inv_softplus(exp(uniform(log 0.001, log 0.1)).clamp(min=1e-4)),
//             inv_softplus(y) = y + log(-expm1(-y)).
//
// Values are a pure function of (seed, tensor name, element index): a counter-based generator
// (SplitMix64-style mixing of the three) gives each element its own uniform variates, so any
// range of any tensor can be produced on its own, in any chunking and on any number of threads,
// with identical results. The truncated normal is exact up to fp32 rounding: the inverse normal
// CDF of a uniform restricted to [Phi(-bound/std), Phi(bound/std)]. The values do not match
// torch's generator (nothing can); they follow the same distributions.
#ifndef SDMSERVE_ENGINE_WEIGHT_INIT_H_
#define SDMSERVE_ENGINE_WEIGHT_INIT_H_

#include <cstdint>
#include <span>

#include "engine/model_config.h"
#include "engine/weight_spec.h"

namespace sdm {

// Writes elements [first_element, first_element + out.size()) of tensor `spec` (which must be
// within the tensor) for a model with `config`, initialised with `seed`.
void FillTensor(const ModelConfig& config, const TensorSpec& spec, uint64_t seed,
                int64_t first_element, std::span<float> out);

// The same values, computed on up to `threads` threads (0: the machine's hardware threads).
void FillTensorParallel(const ModelConfig& config, const TensorSpec& spec, uint64_t seed,
                        int64_t first_element, std::span<float> out, int threads = 0);

// The standard normal quantile Phi^-1(p) for p in (0, 1), accurate to ~1e-15 relative error.
double NormalQuantile(double p);

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_WEIGHT_INIT_H_
