#include "engine/weight_init.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "base/available_cpus.h"
#include "base/check.h"

namespace sdm {
namespace {

// SplitMix64's finaliser: a bijective 64-bit mix with full avalanche.
inline uint64_t Mix(uint64_t z) {
  z ^= z >> 30;
  z *= 0xbf58476d1ce4e5b9ull;
  z ^= z >> 27;
  z *= 0x94d049bb133111ebull;
  z ^= z >> 31;
  return z;
}

uint64_t NameHash(absl::string_view name) {  // FNV-1a
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

// The uniform variates of one tensor: element i gets Uniform(i) in (0, 1), a pure function of
// (seed, name, i).
class CounterRng {
 public:
  CounterRng(uint64_t seed, absl::string_view name)
      : key_(Mix(Mix(seed ^ 0x5851f42d4c957f2dull) + NameHash(name))), key2_(Mix(key_)) {}

  double Uniform(int64_t i) const {
    const uint64_t bits =
        Mix(Mix(key_ + (static_cast<uint64_t>(i) + 1) * 0x9e3779b97f4a7c15ull) ^ key2_);
    return (static_cast<double>(bits >> 11) + 0.5) * 0x1p-53;
  }

 private:
  uint64_t key_;
  uint64_t key2_;
};

double NormalCdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }

}  // namespace

double NormalQuantile(double p) {
  // Acklam's rational approximation (relative error < 1.2e-9), then one Halley step on the exact
  // CDF, which brings it to double precision.
  static constexpr double a[] = {-3.969683028665376e+01, 2.209460984245205e+02,
                                 -2.759285104469687e+02, 1.383577518672690e+02,
                                 -3.066479806614716e+01, 2.506628277459239e+00};
  static constexpr double b[] = {-5.447609879822406e+01, 1.615858368580409e+02,
                                 -1.556989798598866e+02, 6.680131188771972e+01,
                                 -1.328068155288572e+01};
  static constexpr double c[] = {-7.784894002430293e-03, -3.223964580411365e-01,
                                 -2.400758277161838e+00, -2.549732539343734e+00,
                                 4.374664141464968e+00,  2.938163982698783e+00};
  static constexpr double d[] = {7.784695709041462e-03, 3.224671290700398e-01,
                                 2.445134137142996e+00, 3.754408661907416e+00};
  constexpr double kLow = 0.02425;
  double x;
  if (p < kLow) {
    const double q = std::sqrt(-2 * std::log(p));
    x = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
        ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  } else if (p <= 1 - kLow) {
    const double q = p - 0.5;
    const double r = q * q;
    x = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
        (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
  } else {
    const double q = std::sqrt(-2 * std::log1p(-p));
    x = -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
        ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  }
  const double e = NormalCdf(x) - p;
  const double u = e * std::sqrt(2 * M_PI) * std::exp(x * x / 2);
  return x - u / (1 + x * u / 2);
}

void FillTensor(const ModelConfig& config, const TensorSpec& spec, uint64_t seed,
                int64_t first_element, std::span<float> out) {
  SDM_CHECK(first_element >= 0);
  SDM_CHECK(first_element + static_cast<int64_t>(out.size()) <= NumElements(spec));
  const CounterRng rng(seed, spec.name);
  const int64_t n = static_cast<int64_t>(out.size());
  switch (spec.init) {
    case WeightInit::kZeros:
      std::fill(out.begin(), out.end(), 0.0f);
      return;
    case WeightInit::kOnes:
      std::fill(out.begin(), out.end(), 1.0f);
      return;
    case WeightInit::kTruncNormal: {
      const double std = spec.init_std;
      const double bound = spec.init_bound;
      if (!(std > 0) || !(bound > 0)) {
        std::fill(out.begin(), out.end(), 0.0f);
        return;
      }
      // Inverse CDF of a uniform on [Phi(-k), Phi(k)], k = bound / std. Symmetric: the upper
      // half is mapped through the lower tail, where Phi has full relative precision.
      const double k = bound / std;
      const double lo = NormalCdf(-k);
      const double half = 0.5 - lo;  // mass of [-k, 0]
      for (int64_t i = 0; i < n; ++i) {
        const double u = rng.Uniform(first_element + i);  // (0, 1)
        const double v = 2 * u - 1;                       // (-1, 1): sign and magnitude
        const double z = -NormalQuantile(lo + (1 - std::abs(v)) * half);  // in [0, k]
        const double x = std::min(z, k) * std * (v < 0 ? -1 : 1);
        out[i] = static_cast<float>(x);
      }
      return;
    }
    case WeightInit::kSdmALog: {
      const double a_min = config.sdm.a_init_min;
      const double a_max = config.sdm.a_init_max;
      for (int64_t i = 0; i < n; ++i) {
        const double a = a_min + (a_max - a_min) * rng.Uniform(first_element + i);
        out[i] = static_cast<float>(std::log(std::max(a, 1e-4)));
      }
      return;
    }
    case WeightInit::kSdmDtBias: {
      const double lo = std::log(0.001), hi = std::log(0.1);
      for (int64_t i = 0; i < n; ++i) {
        const double dt = std::max(std::exp(lo + (hi - lo) * rng.Uniform(first_element + i)), 1e-4);
        out[i] = static_cast<float>(dt + std::log(-std::expm1(-dt)));
      }
      return;
    }
  }
  SDM_CHECK(false);
}

void FillTensorParallel(const ModelConfig& config, const TensorSpec& spec, uint64_t seed,
                        int64_t first_element, std::span<float> out, int threads) {
  constexpr size_t kMinPerThread = size_t{1} << 16;
  if (threads <= 0) threads = AvailableCpus();
  const size_t parts = std::min<size_t>(static_cast<size_t>(threads),
                                        (out.size() + kMinPerThread - 1) / kMinPerThread);
  if (parts <= 1) {
    FillTensor(config, spec, seed, first_element, out);
    return;
  }
  const size_t per = (out.size() + parts - 1) / parts;
  std::vector<std::thread> workers;
  for (size_t p = 1; p < parts; ++p) {
    const size_t begin = std::min(out.size(), p * per);
    const size_t size = std::min(per, out.size() - begin);
    workers.emplace_back([&, begin, size] {
      FillTensor(config, spec, seed, first_element + static_cast<int64_t>(begin),
                 out.subspan(begin, size));
    });
  }
  FillTensor(config, spec, seed, first_element, out.subspan(0, std::min(per, out.size())));
  for (std::thread& t : workers) t.join();
}

}  // namespace sdm
