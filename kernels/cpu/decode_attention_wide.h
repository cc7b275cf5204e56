// The AVX-512 loops of the CPU decode attention (kernels/cpu/decode_attention.h), behind a table
// of plain function pointers so that they live in one file built with AVX-512 flags
// (kernels/cpu/decode_attention_avx512.cc) and run only where the CPU has them.
//
// Each loop computes, bit for bit, what the AVX2 loops of decode_attention.cc compute: a score is
// one 8-lane chain of fused multiply-adds over head_dim in order, the same fixed tree over the
// lanes (SumLanes, kernels/cpu/sum_lanes.h), then the head_dim % 8 tail in order; a value
// accumulator element is one chain of fused multiply-adds over the rows in order. The wider
// registers only hold two of those chains at once:
// two query heads of one KV group (GQA) in the two 8-lane halves of a register, against the key's
// or value's 8 values loaded into both halves, so each cached value is read and multiplied once
// for both heads. A layer whose heads do not all pair (plain multi-head attention, odd groups)
// takes the AVX2 score loop, and a head without a partner the AVX2 value loop (16-lane value
// accumulators for it measured no faster, 2026-12-04).
// Internal to kernels/cpu.
#ifndef SDMSERVE_KERNELS_CPU_DECODE_ATTENTION_WIDE_H_
#define SDMSERVE_KERNELS_CPU_DECODE_ATTENTION_WIDE_H_

#include <cstdint>

namespace sdm::kernels::cpu {

// Rows taken together by the register-blocked value loop.
inline constexpr int kDecodeRowGroup = 8;

template <typename T>
struct DecodeWideLoopsOf {
  // The scores of a block whose query heads all come in pairs (heads 2p and 2p + 1 share KV head
  // p / pairs_per_kv): scores[h * score_stride + i] = q(h) . k[i][kv(h) * hd ...] for every head
  // h < 2 * pairs and row i < n, walking the rows in order and each row's pairs in order, so the
  // keys are read front to back. q_joined holds each pair's queries joined 8 values at a time,
  // pair p's chunk c (c < hd / 8) at q_joined[(p * (hd / 8) + c) * 16]: head 2p's 8 values, then
  // head 2p + 1's; q (heads x hd, not joined) gives the head_dim % 8 tail.
  void (*dot_block_pairs)(const float* q_joined, const float* q, int64_t pairs,
                          int64_t pairs_per_kv, const T* const* k, int n, int64_t hd, float* scores,
                          int64_t score_stride);
  // acc_a[d] = fma(w_a[i], v[i][d], acc_a[d]) and the same for b, for i = 0 .. n-1 in order
  // (n <= kDecodeRowGroup), d < hd.
  void (*accumulate_rows_pair)(const float* w_a, const float* w_b, const T* const* v, int n,
                               int64_t hd, float* acc_a, float* acc_b);
};

struct DecodeWideLoops {
  DecodeWideLoopsOf<float> fp32;
  DecodeWideLoopsOf<uint16_t> bf16;  // bf16 rows, widened to fp32 as they are read
};

// The AVX-512 loops, or nullptr where this build has none (the compiler lacks the flags, or not
// x86). Call only where GemmIsaAvailable(GemmIsa::kAvx512).
const DecodeWideLoops* Avx512DecodeWideLoops();

}  // namespace sdm::kernels::cpu

#endif  // SDMSERVE_KERNELS_CPU_DECODE_ATTENTION_WIDE_H_
