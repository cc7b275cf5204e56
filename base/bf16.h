// bf16 (bfloat16: the upper 16 bits of an IEEE fp32) on the host, and the element types the CPU
// engine can store weights and caches in. Header-only; pure functions, thread-safe.
//
// A bf16 value widens to fp32 exactly (a 16-bit shift), so a kernel that widens bf16 operands and
// accumulates in fp32 computes bit for bit what the fp32 kernel computes on the rounded values.
#ifndef SDMSERVE_BASE_BF16_H_
#define SDMSERVE_BASE_BF16_H_

#include <cstdint>
#include <cstring>

namespace sdm {

// How the CPU engine stores its matrices and KV rows (EngineOptions::cpu_dtype).
enum class DType { kF32, kBf16 };

// Bytes per stored value.
inline constexpr int64_t DTypeBytes(DType t) { return t == DType::kBf16 ? 2 : 4; }

// fp32 -> bf16 by round-to-nearest-even; NaN stays NaN (quiet, sign kept), +-inf stays inf.
inline uint16_t FloatToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float Bf16ToFloat(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// The fp32 value nearest to `value` that bf16 can hold (what storing it as bf16 keeps).
inline float RoundToBf16(float value) { return Bf16ToFloat(FloatToBf16(value)); }

inline void FloatsToBf16(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = FloatToBf16(src[i]);
}
inline void Bf16ToFloats(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(src[i]);
}

}  // namespace sdm

#endif  // SDMSERVE_BASE_BF16_H_
