// Scalar math of the SDM layer (docs/model-spec.md §5.1, §5.4), shared by the CPU and CUDA kernels.
//
// Gates per head: g = -exp(A_log) * softplus(a + dt_bias) (log decay, alpha = exp(g)),
// beta = sigmoid(b). The update of one write row i, column c, given the decayed value
// mt = alpha_i * M[i][c] and the shared prediction vhat[c] = sum_i k_i * mt_i:
//   shared residual (reference, default): M[i][c] = mt + k_i * beta * (v[c] - vhat[c])
//   slot residual (paper's printed Eq. 4, opt-in): M[i][c] = mt + beta * k_i * (v[c] - mt)
#ifndef SDMSERVE_KERNELS_COMMON_SDM_MATH_H_
#define SDMSERVE_KERNELS_COMMON_SDM_MATH_H_

#include <cmath>

#include "kernels/common/fp_math.h"
#include "kernels/common/host_device.h"

namespace sdm::kernels {

// torch.nn.functional.softplus with its default threshold: x above 20 is returned as is.
SDM_HOST_DEVICE float Softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

SDM_HOST_DEVICE float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

SDM_HOST_DEVICE float Silu(float x) { return x * Sigmoid(x); }

// Log decay g of one head (negative): alpha = exp(g).
SDM_HOST_DEVICE float SdmLogDecay(float a_log, float a, float dt_bias) {
  return -expf(a_log) * Softplus(a + dt_bias);
}

// New value of one written cell under the shared-residual rule: delta = beta * (v - vhat) is
// the same for every write row of the column.
SDM_HOST_DEVICE float SdmSharedResidual(float decayed, float k, float delta) {
  return decayed + k * delta;
}

// New value of one written cell under the slot-residual rule.
SDM_HOST_DEVICE float SdmSlotResidual(float decayed, float k, float beta, float v) {
  return decayed + beta * k * (v - decayed);
}

// The same two rules from the stored value m and the decay alpha, every operation rounded as
// written whatever the compiler contracts (kernels/common/fp_math.h): the form the CUDA kernels
// use, so that the two kernels that update a cell (SdmStep and SdmDecodeStep, kernels/cuda/sdm.h)
// write the same bits, on the device and under the CPU emulator alike. The shared rule fuses the
// decay into the update, alpha * m + (k * delta), which is what GCC makes of SdmSharedResidual.
SDM_HOST_DEVICE float SdmSharedResidualRn(float alpha, float m, float k, float delta) {
  return FmaRn(alpha, m, MulRn(k, delta));
}

SDM_HOST_DEVICE float SdmSlotResidualRn(float alpha, float m, float k, float beta, float v) {
  const float decayed = MulRn(alpha, m);
  return FmaRn(MulRn(beta, k), SubRn(v, decayed), decayed);
}

}  // namespace sdm::kernels

#endif  // SDMSERVE_KERNELS_COMMON_SDM_MATH_H_
