// bf16 as the CUDA headers define it for host and device (testing only): round-to-nearest-even
// conversions, NaN kept quiet.
#pragma once
#include <cstdint>
#include <cstring>

#include "cuda_runtime.h"
struct __nv_bfloat16 {
  uint16_t __x;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;
// EMU_BF16_MODE=1 (diagnostics): stochastic rounding instead of round-to-nearest-even.
int EmuBf16Mode();
uint32_t EmuRand16();
inline uint16_t EmuBf16Rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  if (EmuBf16Mode() == 1) {
    if ((u & 0x7f800000u) == 0x7f800000u) return static_cast<uint16_t>(u >> 16);
    u += EmuRand16();
    return static_cast<uint16_t>(u >> 16);
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {EmuBf16Rne(f)}; }
inline __nv_bfloat16 __float2bfloat16(float f) { return {EmuBf16Rne(f)}; }
inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = static_cast<uint32_t>(b.__x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {{EmuBf16Rne(a)}, {EmuBf16Rne(b)}};
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 f) { return __floats2bfloat162_rn(f.x, f.y); }
inline float2 __bfloat1622float2(__nv_bfloat162 h) {
  return {__bfloat162float(h.x), __bfloat162float(h.y)};
}
inline float __low2float(__nv_bfloat162 h) { return __bfloat162float(h.x); }
inline float __high2float(__nv_bfloat162 h) { return __bfloat162float(h.y); }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return {a, b}; }
