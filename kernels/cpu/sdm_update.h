// SDM write and read of one head for one token (docs/model-spec.md §5.4, §5.5), over rows given by
// pointer, restricted to a column range so callers can tile the row width across threads
// (columns are independent).
//
// Write, for every column c in [c0, c1):
//   mt_i = alpha_i * M_i[c]
//   shared residual: vhat = sum_i k_i mt_i;  M_i[c] = mt_i + k_i * beta * (v[c] - vhat)
//   slot residual:   M_i[c] = mt_i + beta * k_i * (v[c] - mt_i)
// alpha has one entry (per-head decay) or one per write row (key_weighted_decay).
// Read (after the write): y[c] = sum_j q_j M_j[c].
#ifndef SDMSERVE_KERNELS_CPU_SDM_UPDATE_H_
#define SDMSERVE_KERNELS_CPU_SDM_UPDATE_H_

#include <cstdint>
#include <span>

namespace sdm::kernels::cpu {

enum class SdmRule { kSharedResidual, kSlotResidual };

void SdmWriteColumns(std::span<float* const> rows, std::span<const float> k,
                     std::span<const float> alpha, float beta, const float* v, SdmRule rule,
                     int64_t c0, int64_t c1);

void SdmReadColumns(std::span<const float* const> rows, std::span<const float> q, float* y,
                    int64_t c0, int64_t c1);

}  // namespace sdm::kernels::cpu

#endif  // SDMSERVE_KERNELS_CPU_SDM_UPDATE_H_
