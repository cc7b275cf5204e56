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

enum class SdmRule : uint32_t { kSharedResidual = 0, kSlotResidual = 1 };

// Columns per task when the engine tiles a write across threads (a multiple of the write's
// internal tile of 64, so any tiling of a row by it computes each column alike).
inline constexpr int64_t kSdmWriteColumnTile = 128;

void SdmWriteColumns(std::span<float* const> rows, std::span<const float> k,
                     std::span<const float> alpha, float beta, const float* v, SdmRule rule,
                     int64_t c0, int64_t c1);

// The write over a whole row width, tile by tile as the engine runs it: what replaying a
// journaled write calls (state_store/state_layout.h, SdmWriteSpec::apply; `rule` an SdmRule), so
// the rows come out bit for bit as the engine's step left them.
void SdmWriteRows(std::span<float* const> rows, std::span<const float> k,
                  std::span<const float> alpha, float beta, const float* v, int64_t row_width,
                  uint32_t rule);

void SdmReadColumns(std::span<const float* const> rows, std::span<const float> q, float* y,
                    int64_t c0, int64_t c1);

}  // namespace sdm::kernels::cpu

#endif  // SDMSERVE_KERNELS_CPU_SDM_UPDATE_H_
