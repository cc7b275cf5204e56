// Rotary embedding over adjacent pairs (docs/model-spec.md §4.2): dims 2i and 2i+1 of each head
// rotate by angle pos * theta^(-2i/head_dim). Frequencies and angles are computed in fp32 the
// way the reference's precomputed table is, so long positions round alike.
#ifndef SDMSERVE_KERNELS_CPU_ROPE_H_
#define SDMSERVE_KERNELS_CPU_ROPE_H_

#include <cstdint>

namespace sdm::kernels::cpu {

// Rotates x: [n_heads, head_dim] (contiguous) for position `pos`.
void ApplyRope(float* x, int64_t n_heads, int64_t head_dim, int64_t pos, float theta);

}  // namespace sdm::kernels::cpu

#endif  // SDMSERVE_KERNELS_CPU_ROPE_H_
