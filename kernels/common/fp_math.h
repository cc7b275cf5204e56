// Separately rounded fp32 arithmetic for the math the CPU and CUDA kernels must compute bit for
// bit alike (issue 16, item 4: "GPU and CPU round alike where it matters").
//
// Why. nvcc contracts a * b + c into one fused multiply-add (one rounding) by default, and so do
// host compilers on an FMA-capable -march such as the project's x86-64-v3: GCC 12 fuses
// `a * b + c` in C++ even with -std=c++20 (checked with g++ -S: vfmadd132ss), Clang within an
// expression. Whether a given line is fused is the compiler's choice, made separately on each
// side: the same source line may round once on one backend and twice on the other, a one-ulp
// difference that can flip a product-key near-tie (kernels/common/sdm_addressing_math.h), so
// that the two backends write and read different SDM slots.
//
// What. Each helper below is one IEEE-754 binary32 operation, rounded to nearest even, whatever
// the compiler or its flags; FmaRn is the fused multiply-add, rounded once, on both sides:
//   device (nvcc, __CUDA_ARCH__): the explicit-rounding intrinsics __fadd_rn, __fsub_rn,
//     __fmul_rn, __fdiv_rn, __fsqrt_rn, __fmaf_rn, which nvcc never contracts or approximates
//     (not even under --use_fast_math);
//   host (the CPU kernels, the host pass of nvcc, and the CPU emulator of the CUDA kernels in
//     tests/cuda_emulator/, whose kernel files are compiled with -ffp-contract=fast): the plain
//     operation, its operands and result passed through an empty asm statement so that the
//     optimiser cannot fuse a product into an addition across it; FmaRn is std::fma (an FMA
//     instruction on x86-64-v3, correctly rounded by the C library elsewhere).
//
// Cost: the asm statements keep the host compiler from vectorising a loop around them, so use the
// helpers where a CPU/GPU difference changes a discrete decision (eval-mode BatchNorm of the
// addressing scores), not in bandwidth-bound inner loops whose results differ between backends
// anyway (the SDM update's prediction is summed in another order on the GPU; RoPE's sines and
// cosines come from different libraries).
//
// Tested: tests/kernels/fp_math_test.cc (compiled with -ffp-contract=fast: each helper equals the
// correctly rounded double-precision computation, on inputs chosen so that a fused multiply-add
// would not) and tests/kernels/cuda_elementwise_test.cc (BatchNormEval on the device, or on the
// CPU emulator, equals the CPU kernel bit for bit).
#ifndef SDMSERVE_KERNELS_COMMON_FP_MATH_H_
#define SDMSERVE_KERNELS_COMMON_FP_MATH_H_

#include <cmath>

#include "kernels/common/host_device.h"

namespace sdm::kernels {

// Hides x from the optimiser (host only): an operation cannot be fused with one on the other
// side of it. A no-op on the device, where the intrinsics already forbid fusion.
SDM_HOST_DEVICE float FpOpaque(float x) {
#if defined(__CUDA_ARCH__)
  return x;
#elif defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && defined(__SSE2__)
  __asm__("" : "+x"(x));  // in an SSE register: rounded to binary32 already
  return x;
#elif defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(x));
  return x;
#else
  volatile float v = x;
  return v;
#endif
}

SDM_HOST_DEVICE float AddRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return FpOpaque(a) + FpOpaque(b);
#endif
}

SDM_HOST_DEVICE float SubRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return FpOpaque(a) - FpOpaque(b);
#endif
}

SDM_HOST_DEVICE float MulRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return FpOpaque(a * b);
#endif
}

SDM_HOST_DEVICE float DivRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return FpOpaque(FpOpaque(a) / FpOpaque(b));
#endif
}

SDM_HOST_DEVICE float SqrtRn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return FpOpaque(std::sqrt(FpOpaque(a)));
#endif
}

// a * b + c with one rounding, on both sides.
SDM_HOST_DEVICE float FmaRn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// Eval-mode BatchNorm1d of one value, (x - mean) / sqrt(var + eps) * w + b: the subtraction,
// addition, square root and division each rounded, then one fused multiply-add. That is what the
// CPU engine computed before these helpers existed (GCC fused the final multiply-add; checked in
// its assembly), so the CPU engine's results are unchanged (tests/reference checks it against
// PyTorch). The CPU kernel (kernels/cpu/norm.h) and the CUDA kernel (kernels/cuda/elementwise.h)
// both call this, so the addressing scores they select from are bit-identical for identical
// inputs.
SDM_HOST_DEVICE float BatchNormEvalValue(float x, float mean, float var, float w, float b,
                                         float eps) {
  const float std_dev = SqrtRn(AddRn(var, eps));
  return FmaRn(DivRn(SubRn(x, mean), std_dev), w, b);
}

}  // namespace sdm::kernels

#endif  // SDMSERVE_KERNELS_COMMON_FP_MATH_H_
