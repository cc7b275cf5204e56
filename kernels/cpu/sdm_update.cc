#include "kernels/cpu/sdm_update.h"

#include <algorithm>

#include "base/check.h"
#include "kernels/common/sdm_math.h"

namespace sdm::kernels::cpu {
namespace {
constexpr int64_t kTile = 64;  // columns handled together: vhat stays in registers/L1
}

void SdmWriteColumns(std::span<float* const> rows, std::span<const float> k,
                     std::span<const float> alpha, float beta, const float* v, SdmRule rule,
                     int64_t c0, int64_t c1) {
  const int64_t n = static_cast<int64_t>(rows.size());
  SDM_CHECK(static_cast<int64_t>(k.size()) == n);
  SDM_CHECK(alpha.size() == 1 || static_cast<int64_t>(alpha.size()) == n);
  const bool per_row = alpha.size() != 1;
  float vhat[kTile];
  for (int64_t t0 = c0; t0 < c1; t0 += kTile) {
    const int64_t w = std::min(kTile, c1 - t0);
    if (rule == SdmRule::kSharedResidual) {
      for (int64_t c = 0; c < w; ++c) vhat[c] = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        const float ka = k[i] * (per_row ? alpha[i] : alpha[0]);
        const float* row = rows[i] + t0;
        for (int64_t c = 0; c < w; ++c) vhat[c] += ka * row[c];
      }
      for (int64_t c = 0; c < w; ++c) vhat[c] = beta * (v[t0 + c] - vhat[c]);  // now delta
      for (int64_t i = 0; i < n; ++i) {
        const float a = per_row ? alpha[i] : alpha[0];
        const float ki = k[i];
        float* row = rows[i] + t0;
        for (int64_t c = 0; c < w; ++c) row[c] = SdmSharedResidual(a * row[c], ki, vhat[c]);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const float a = per_row ? alpha[i] : alpha[0];
        const float ki = k[i];
        float* row = rows[i] + t0;
        for (int64_t c = 0; c < w; ++c) {
          row[c] = SdmSlotResidual(a * row[c], ki, beta, v[t0 + c]);
        }
      }
    }
  }
}

void SdmWriteRows(std::span<float* const> rows, std::span<const float> k,
                  std::span<const float> alpha, float beta, const float* v, int64_t row_width,
                  uint32_t rule) {
  SDM_CHECK(rule <= static_cast<uint32_t>(SdmRule::kSlotResidual));
  for (int64_t c0 = 0; c0 < row_width; c0 += kSdmWriteColumnTile) {
    SdmWriteColumns(rows, k, alpha, beta, v, static_cast<SdmRule>(rule), c0,
                    std::min(row_width, c0 + kSdmWriteColumnTile));
  }
}

void SdmReadColumns(std::span<const float* const> rows, std::span<const float> q, float* y,
                    int64_t c0, int64_t c1) {
  SDM_CHECK(rows.size() == q.size());
  for (int64_t c = c0; c < c1; ++c) y[c] = 0.0f;
  for (size_t j = 0; j < rows.size(); ++j) {
    const float qj = q[j];
    const float* row = rows[j];
    for (int64_t c = c0; c < c1; ++c) y[c] += qj * row[c];
  }
}

}  // namespace sdm::kernels::cpu
