// The AVX-512 loops of the CPU decode attention (kernels/cpu/decode_attention.h), behind a table
// of plain function pointers so that they live in one file built with AVX-512 flags
// (kernels/cpu/decode_attention_avx512.cc) and run only where the CPU has them.
//
// Each loop computes, bit for bit, what the AVX2 loops of decode_attention.cc compute: a score is
// one 8-lane chain of fused multiply-adds over head_dim in order, the same fixed tree over the
// lanes, then the head_dim % 8 tail in order; a value accumulator element is one chain of fused
// multiply-adds over the rows in order. The wider registers only hold two of those chains at once:
// two query heads of one KV group (GQA) in the two 8-lane halves of a register, against the key's
// or value's 8 values loaded into both halves, so each cached value is read and multiplied once
// for both heads. A head without a partner (plain multi-head attention, odd groups) takes the
// AVX2 loops: 16-lane value accumulators for it measured no faster (2026-12-04).
// Internal to kernels/cpu.
#ifndef SDMSERVE_KERNELS_CPU_DECODE_ATTENTION_WIDE_H_
#define SDMSERVE_KERNELS_CPU_DECODE_ATTENTION_WIDE_H_

#include <cstdint>

namespace sdm::kernels::cpu {

// Rows taken together by the register-blocked loops (a score call takes exactly this many).
inline constexpr int kDecodeRowGroup = 8;

template <typename T>
struct DecodeWideLoopsOf {
  // out_a[i] = q_a . k[i] and out_b[i] = q_b . k[i], i < kDecodeRowGroup, over hd values.
  void (*dot_rows_pair)(const float* q_a, const float* q_b, const T* const* k, int64_t hd,
                        float* out_a, float* out_b);
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
