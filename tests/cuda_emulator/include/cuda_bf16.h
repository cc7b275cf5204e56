// Emulated bf16, shared by both emulator dialects (kernels/, engine/): the bit layout of CUDA's
// __nv_bfloat16 with its float conversions (as the CUDA headers give host and device code);
// conversions round to nearest even, NaN -> canonical 0x7fff as cvt.rn.bf16.f32 and the host
// __float2bfloat16 do.
// Diagnostics: EMU_BF16_MODE=1 (with EMU_SEED) rounds stochastically instead, to see how much a
// tolerance depends on rounding luck.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cuda_runtime.h"
inline int EmuBf16Mode() {
  static const int mode = [] {
    const char* e = std::getenv("EMU_BF16_MODE");
    return e ? std::atoi(e) : 0;
  }();
  return mode;
}
inline uint32_t EmuRand16() {
  static uint64_t x = [] {
    const char* e = std::getenv("EMU_SEED");
    return 0x9e3779b97f4a7c15ull ^ (e ? std::strtoull(e, nullptr, 0) * 0x100000001b3ull : 0);
  }();
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return static_cast<uint32_t>(x & 0xffff);
}
inline uint16_t EmuBf16Rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  if (EmuBf16Mode() == 1) {
    if ((u & 0x7f800000u) == 0x7f800000u) return static_cast<uint16_t>(u >> 16);
    u += EmuRand16();
    return static_cast<uint16_t>(u >> 16);
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float EmuBf16ToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
struct __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : __x(EmuBf16Rne(f)) {}
  __nv_bfloat16(double f) : __x(EmuBf16Rne(static_cast<float>(f))) {}
  operator float() const { return EmuBf16ToFloat(__x); }
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;
inline __nv_bfloat16 EmuBf16FromBits(uint16_t b) {
  __nv_bfloat16 r;
  r.__x = b;
  return r;
}
inline __nv_bfloat16 __float2bfloat16(float f) { return EmuBf16FromBits(EmuBf16Rne(f)); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return EmuBf16FromBits(EmuBf16Rne(f)); }
inline float __bfloat162float(__nv_bfloat16 b) { return EmuBf16ToFloat(b.__x); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 f) { return __floats2bfloat162_rn(f.x, f.y); }
inline float2 __bfloat1622float2(__nv_bfloat162 h) {
  return {__bfloat162float(h.x), __bfloat162float(h.y)};
}
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 h) { return h.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 h) { return h.y; }
inline float __low2float(__nv_bfloat162 h) { return __bfloat162float(h.x); }
inline float __high2float(__nv_bfloat162 h) { return __bfloat162float(h.y); }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return {a, b}; }
