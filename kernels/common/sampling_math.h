// Per-row decisions of token sampling (engine/sampler.h's SampleToken), shared by the CPU sampler
// and the CUDA sampling kernel (kernels/cuda/sampling.cu) so that both pick the same token from
// the same logits, ties and rounding included.
//
// Bit-identical results on both sides need bit-identical arithmetic, so:
//  - the weight exp((l - max) / T) uses SampleExp below, built from +, /, rint and explicit fma
//    only (no libm exp, whose last bit differs between glibc and CUDA), and ends in an exponent
//    bit operation, so no compiler can contract it into a neighbouring add (the engine is built
//    with FMA enabled and nvcc contracts by default);
//  - sums of weights follow one fixed order, the three-level "chunked CDF" below, which the CPU
//    runs sequentially and the GPU in parallel, with the same additions in the same order.
//
// The chunked CDF over weights w(0..n-1) (in id order, or in sorted order for top-k/top-p):
// positions are cut into chunks of kCdfChunk, chunks into groups of kCdfGroupChunks. With
//   p(j)    = w(first of j's chunk) + ... + w(j)              (left to right, from 0)
//   B1(c)   = sum of the chunk totals before c in its group   (left to right, from 0)
//   B2(g)   = sum of the group totals before g                (left to right, from 0)
// the cumulative probability mass is cum(j) = B2(g) + (B1(c) + p(j)). It is non-decreasing in j
// (rounding is monotone, and at each chunk or group end the expression equals the next base
// exactly), and cum(n - 1) is the total. Sequential summation would serialise 128k additions in
// one GPU thread; this order keeps every sequential run at <= 32 (<= n / 1024 at the top).
#ifndef SDMSERVE_KERNELS_COMMON_SAMPLING_MATH_H_
#define SDMSERVE_KERNELS_COMMON_SAMPLING_MATH_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/common/host_device.h"

namespace sdm::kernels {

inline constexpr int64_t kCdfChunk = 32;        // positions per chunk
inline constexpr int64_t kCdfGroupChunks = 32;  // chunks per group

// Below this, exp(x) < 2^-1021: the weight is taken as 0 (a token 1e-308 times less likely than
// the argmax is never drawn anyway), which keeps SampleExp clear of subnormal rounding.
inline constexpr double kSampleExpMin = -708.0;

SDM_HOST_DEVICE bool SampleIsNan(float x) { return x != x; }
SDM_HOST_DEVICE bool SampleIsPosInf(float x) { return x > 3.40282347e38f; }

SDM_HOST_DEVICE uint32_t SampleFloatBits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

SDM_HOST_DEVICE double SampleDoubleFromBits(uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

SDM_HOST_DEVICE uint64_t SampleDoubleBits(double x) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(x));
#else
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

// exp(x) for x <= 0 to within a few ulp, bit-identical on host and device. x = k ln2 + r with
// |r| <= ln2 / 2 (ln2 split in two parts, so r is accurate), e^r by its Taylor series to r^13
// (remainder < 1e-17), times 2^k by adding k to the exponent field (exact: e^r is in [0.7, 1.42]
// and the result stays normal above kSampleExpMin). Returns 0 below kSampleExpMin, -inf included.
SDM_HOST_DEVICE double SampleExp(double x) {
  if (!(x >= kSampleExpMin)) return 0.0;
  constexpr double kLog2e = 0x1.71547652b82fep+0;
  constexpr double kLn2Hi = 0x1.62e42fefa3800p-1;  // low 11 bits clear: k * kLn2Hi is exact
  constexpr double kLn2Lo = 0x1.ef35793c7673p-45;  // ln 2 - kLn2Hi
  const double k = rint(x * kLog2e);
  double r = fma(-k, kLn2Hi, x);
  r = fma(-k, kLn2Lo, r);
  double q = 0x1.6124613a86d09p-33;  // 1/13!
  q = fma(q, r, 0x1.1eed8eff8d898p-29);
  q = fma(q, r, 0x1.ae64567f544e4p-26);
  q = fma(q, r, 0x1.27e4fb7789f5cp-22);
  q = fma(q, r, 0x1.71de3a556c734p-19);
  q = fma(q, r, 0x1.a01a01a01a01ap-16);
  q = fma(q, r, 0x1.a01a01a01a01ap-13);
  q = fma(q, r, 0x1.6c16c16c16c17p-10);
  q = fma(q, r, 0x1.1111111111111p-7);
  q = fma(q, r, 0x1.5555555555555p-5);
  q = fma(q, r, 0x1.5555555555555p-3);
  q = fma(q, r, 0.5);
  q = fma(q, r, 1.0);
  q = fma(q, r, 1.0);
  const int64_t shift = static_cast<int64_t>(k) * (int64_t{1} << 52);  // k <= 0
  return SampleDoubleFromBits(
      static_cast<uint64_t>(static_cast<int64_t>(SampleDoubleBits(q)) + shift));
}

// Whether logit a at id ia is a better argmax than b at ib: NaN never is, a larger value is,
// equal values (-0 == +0) go to the lower id. A strict order on the non-NaN entries, so a
// sequential scan and a parallel reduction find the same winner.
SDM_HOST_DEVICE bool ArgmaxBefore(float a, int32_t ia, float b, int32_t ib) {
  if (SampleIsNan(a)) return false;
  if (SampleIsNan(b)) return true;
  return a > b || (a == b && ia < ib);
}

// Lowest id among the largest non-NaN logits; 0 if all are NaN.
SDM_HOST_DEVICE int32_t SampleArgmax(const float* logits, int64_t n) {
  int32_t best = 0;
  for (int64_t i = 1; i < n; ++i) {
    if (ArgmaxBefore(logits[i], static_cast<int32_t>(i), logits[best], best)) {
      best = static_cast<int32_t>(i);
    }
  }
  return best;
}

// What the weight of one logit depends on besides the logit.
struct SampleWeightParams {
  float max_logit;     // the argmax's logit: finite or +inf
  bool max_is_inf;     // +inf logits share all the mass
  double temperature;  // > 0
};

// Unnormalised probability exp((l - max) / T) <= 1, in double so that neither the shift nor the
// division overflows; 0 for NaN; with +inf logits, 1 for those and 0 for the rest.
SDM_HOST_DEVICE double SampleWeight(float logit, const SampleWeightParams& p) {
  if (SampleIsNan(logit)) return 0.0;
  if (p.max_is_inf) return logit == p.max_logit ? 1.0 : 0.0;
  return SampleExp((static_cast<double>(logit) - static_cast<double>(p.max_logit)) / p.temperature);
}

// Sort key of a non-NaN logit: ascending keys are descending logits, ties by ascending id (-0 and
// +0 are equal, as the float comparison says). Distinct ids give distinct keys.
SDM_HOST_DEVICE uint64_t SampleOrderKey(float logit, int32_t id) {
  const uint32_t bits = SampleFloatBits(logit == 0.0f ? 0.0f : logit);
  // Ascending float order as unsigned order: flip all bits of negatives, the sign of the rest.
  const uint32_t ascending = (bits & 0x80000000u) != 0 ? ~bits : (bits | 0x80000000u);
  return (static_cast<uint64_t>(~ascending) << 32) | static_cast<uint32_t>(id);
}

SDM_HOST_DEVICE int32_t SampleOrderKeyId(uint64_t key) {
  return static_cast<int32_t>(static_cast<uint32_t>(key));
}

SDM_HOST_DEVICE int64_t CdfChunkCount(int64_t n) { return (n + kCdfChunk - 1) / kCdfChunk; }
SDM_HOST_DEVICE int64_t CdfGroupCount(int64_t n) {
  return (CdfChunkCount(n) + kCdfGroupChunks - 1) / kCdfGroupChunks;
}

// Step 1, once per chunk in any order: the chunk's total p(last of chunk), summed left to right.
template <typename WeightAt>
SDM_HOST_DEVICE double CdfChunkSum(const WeightAt& weight_at, int64_t n, int64_t chunk) {
  const int64_t begin = chunk * kCdfChunk;
  const int64_t end = begin + kCdfChunk < n ? begin + kCdfChunk : n;
  double sum = 0.0;
  for (int64_t j = begin; j < end; ++j) sum += weight_at(j);
  return sum;
}

// Step 2, once per group in any order, after step 1: replaces the group's chunk totals by their
// running sums, so chunk[c] = B1(c) + total(c) (the end of c) and B1(c) = chunk[c - 1] (0 first).
SDM_HOST_DEVICE void CdfScanGroup(double* chunk, int64_t chunks, int64_t group) {
  const int64_t begin = group * kCdfGroupChunks;
  const int64_t end = begin + kCdfGroupChunks < chunks ? begin + kCdfGroupChunks : chunks;
  double sum = 0.0;
  for (int64_t c = begin; c < end; ++c) {
    sum += chunk[c];
    chunk[c] = sum;
  }
}

// Step 3, once, after step 2: group_end[g] = B2(g + 1). Returns the total, cum(n - 1).
SDM_HOST_DEVICE double CdfScanGroups(const double* chunk, int64_t chunks, double* group_end) {
  const int64_t groups = (chunks + kCdfGroupChunks - 1) / kCdfGroupChunks;
  double sum = 0.0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t last = (g + 1) * kCdfGroupChunks < chunks ? (g + 1) * kCdfGroupChunks : chunks;
    sum += chunk[last - 1];
    group_end[g] = sum;
  }
  return sum;
}

// All three steps, sequentially (the CPU's way). chunk: CdfChunkCount(n) entries, group_end:
// CdfGroupCount(n). Returns the total.
template <typename WeightAt>
SDM_HOST_DEVICE double CdfBuild(const WeightAt& weight_at, int64_t n, double* chunk,
                                double* group_end) {
  const int64_t chunks = CdfChunkCount(n);
  for (int64_t c = 0; c < chunks; ++c) chunk[c] = CdfChunkSum(weight_at, n, c);
  for (int64_t g = 0; g < CdfGroupCount(n); ++g) CdfScanGroup(chunk, chunks, g);
  return CdfScanGroups(chunk, chunks, group_end);
}

// The first position j in [0, n) whose cum(j) reaches x: x < cum(j) when strict (the inverse CDF
// draw), cum(j) >= x otherwise (the nucleus); n if none. *cum_at = cum(j) when found. Since cum is
// non-decreasing, binary searches over the group and chunk ends find j's group and chunk; the
// partial sums inside the chunk are recomputed in their defining order.
template <typename WeightAt>
SDM_HOST_DEVICE int64_t CdfFind(const WeightAt& weight_at, int64_t n, const double* chunk,
                                const double* group_end, double x, bool strict, double* cum_at) {
  const auto reaches = [x, strict](double cum) { return strict ? x < cum : cum >= x; };
  const int64_t chunks = CdfChunkCount(n);
  int64_t lo = 0;
  int64_t hi = CdfGroupCount(n);
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (reaches(group_end[mid])) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  if (lo == CdfGroupCount(n)) return n;
  const int64_t group = lo;
  const double group_base = group == 0 ? 0.0 : group_end[group - 1];
  const int64_t first_chunk = group * kCdfGroupChunks;
  const int64_t end_chunk =
      first_chunk + kCdfGroupChunks < chunks ? first_chunk + kCdfGroupChunks : chunks;
  // The group's last chunk ends at group_base + chunk[last] == group_end[group], which reaches x.
  lo = first_chunk;
  hi = end_chunk - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (reaches(group_base + chunk[mid])) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  const int64_t c = lo;
  const double chunk_base = c == first_chunk ? 0.0 : chunk[c - 1];
  const int64_t begin = c * kCdfChunk;
  const int64_t end = begin + kCdfChunk < n ? begin + kCdfChunk : n;
  double partial = 0.0;
  double cum = 0.0;
  for (int64_t j = begin; j < end; ++j) {
    partial += weight_at(j);
    cum = group_base + (chunk_base + partial);
    if (reaches(cum)) {
      *cum_at = cum;
      return j;
    }
  }
  // Unreachable: the chunk's last cum is the value that reached x above.
  *cum_at = cum;
  return end - 1;
}

// The draw over the kept, sorted candidates [0, kept) with their CDF built (total = cum(kept-1)):
// with restrict_p, first the nucleus, the shortest prefix whose mass reaches top_p * total (at
// least one position); then the first position whose cum exceeds u * (nucleus mass), or the last
// kept one if u * mass rounded up to the mass. Returns the position.
template <typename WeightAt>
SDM_HOST_DEVICE int64_t CdfDrawSorted(const WeightAt& weight_at, int64_t kept, const double* chunk,
                                      const double* group_end, double total, bool restrict_p,
                                      double top_p, double u) {
  int64_t limit = kept;
  double mass = total;
  double cum = 0.0;
  if (restrict_p) {
    const int64_t j =
        CdfFind(weight_at, kept, chunk, group_end, top_p * total, /*strict=*/false, &cum);
    if (j < kept) {  // always: cum(kept - 1) = total >= top_p * total
      limit = j + 1;
      mass = cum;
    }
  }
  const int64_t j = CdfFind(weight_at, kept, chunk, group_end, u * mass, /*strict=*/true, &cum);
  return j < limit ? j : limit - 1;
}

// The last position with a positive weight (the id-order draw's fallback when u * total rounded
// up to the total); `fallback` if none.
template <typename WeightAt>
SDM_HOST_DEVICE int64_t LastPositive(const WeightAt& weight_at, int64_t n, int64_t fallback) {
  for (int64_t j = n - 1; j >= 0; --j) {
    if (weight_at(j) > 0) return j;
  }
  return fallback;
}

}  // namespace sdm::kernels

#endif  // SDMSERVE_KERNELS_COMMON_SAMPLING_MATH_H_
