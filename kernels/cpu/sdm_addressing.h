// Product-key addressing (docs/model-spec.md §5.2) on the CPU: thin wrappers over the
// shared host/device helpers in kernels/common/sdm_addressing_math.h (which the CUDA kernels use
// too), so the CPU tests cover the selection the GPU runs.
//
// A head's 2s scores split into half A (first s) and half B (next s); slot (a, b) = a * s + b
// scores A[a] + B[b]. The top K slots are found from the top min(K, s) of each half and their
// pairwise sums. Ties are broken toward the lower index (in each half, and by slot among sums),
// which makes the two-stage selection equal to the exact top-K over all s^2 sums: a pair outside
// a half's top k_sub is beaten by k_sub pairs that rank strictly before it. NaN scores rank last.
#ifndef SDMSERVE_KERNELS_CPU_SDM_ADDRESSING_H_
#define SDMSERVE_KERNELS_CPU_SDM_ADDRESSING_H_

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/common/sdm_addressing_math.h"

namespace sdm::kernels::cpu {

using AddressAct = kernels::AddressAct;
using kernels::AddressCount;  // min(k, min(k, s)^2)

// Selects the top slots for `scores` [2 * side]. Writes AddressCount(k, side) slots, sorted
// ascending, to `slots` and their score sums to `sums`. `scratch` is reused between calls.
struct AddressScratch {
  std::vector<int32_t> idx_a, idx_b;
  std::vector<uint64_t> keys;
  std::vector<int32_t> hist;
};
void SelectSlots(const float* scores, int64_t side, int64_t k, std::span<int32_t> slots,
                 std::span<float> sums, AddressScratch& scratch);

// Turns the selected sums into weights in place: softmax(scale * x), x / (|x|_2 + 1e-12),
// identity, sigmoid or relu (scale applies to softmax only, as in the reference).
void ActivateAddress(AddressAct act, float scale, std::span<float> values);

}  // namespace sdm::kernels::cpu

#endif  // SDMSERVE_KERNELS_CPU_SDM_ADDRESSING_H_
