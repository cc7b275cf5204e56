#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/common/check.h"

namespace sdm {
namespace {

// Lowest id among the largest non-NaN logits; 0 if all are NaN.
int32_t Argmax(std::span<const float> logits) {
  int32_t best = -1;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isnan(logits[i])) continue;
    if (best < 0 || logits[i] > logits[best]) best = static_cast<int32_t>(i);
  }
  return best < 0 ? 0 : best;
}

}  // namespace

std::array<uint32_t, 4> Philox4x32_10(std::array<uint32_t, 4> counter,
                                      std::array<uint32_t, 2> key) {
  constexpr uint64_t kMul0 = 0xD2511F53;
  constexpr uint64_t kMul1 = 0xCD9E8D57;
  constexpr uint32_t kWeyl0 = 0x9E3779B9;  // the key schedule's increments
  constexpr uint32_t kWeyl1 = 0xBB67AE85;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key[0] += kWeyl0;
      key[1] += kWeyl1;
    }
    const uint64_t p0 = kMul0 * counter[0];
    const uint64_t p1 = kMul1 * counter[2];
    counter = {static_cast<uint32_t>(p1 >> 32) ^ counter[1] ^ key[0], static_cast<uint32_t>(p1),
               static_cast<uint32_t>(p0 >> 32) ^ counter[3] ^ key[1], static_cast<uint32_t>(p0)};
  }
  return counter;
}

double UniformDraw(uint64_t seed, uint64_t draw_index) {
  const std::array<uint32_t, 4> x = Philox4x32_10(
      {static_cast<uint32_t>(draw_index), static_cast<uint32_t>(draw_index >> 32), 0, 0},
      {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
  const uint64_t bits = ((static_cast<uint64_t>(x[0]) << 32) | x[1]) >> 11;  // 53 bits
  return static_cast<double>(bits) * 0x1.0p-53;
}

absl::Status ValidateSamplingParams(const SamplingParams& params, int64_t vocab_size) {
  if (!std::isfinite(params.temperature) || params.temperature < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "temperature must be a finite number >= 0 (0 means greedy), got ", params.temperature));
  }
  if (params.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k must be >= 0 (0 means no top-k limit), got ", params.top_k));
  }
  // Written so that NaN fails too.
  if (!(params.top_p > 0 && params.top_p <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_p must be in (0, 1] (1 means no nucleus limit), got ", params.top_p));
  }
  if (params.max_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens must be >= 1, got ", params.max_tokens));
  }
  for (const int32_t id : params.stop_token_ids) {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop token id ", id, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

int32_t SampleToken(std::span<const float> logits, const SamplingParams& params,
                    uint64_t draw_index) {
  SDM_CHECK(!logits.empty());
  SDM_CHECK(params.temperature >= 0);
  if (params.temperature == 0) return Argmax(logits);

  const int32_t best = Argmax(logits);
  const float max_logit = logits[best];
  // All NaN, or every probability exp(-inf) = 0: nothing to sample from.
  if (std::isnan(max_logit) || max_logit == -std::numeric_limits<float>::infinity()) return best;
  const bool max_is_inf = std::isinf(max_logit);
  // Unnormalised probability exp((l - max) / T) <= 1, computed in double so that neither the
  // shift nor the division overflows; with +inf logits, those alone share the mass.
  const auto weight = [&](int32_t id) -> double {
    const float l = logits[id];
    if (std::isnan(l)) return 0.0;
    if (max_is_inf) return l == max_logit ? 1.0 : 0.0;
    return std::exp((static_cast<double>(l) - max_logit) / params.temperature);
  };
  const double u = UniformDraw(params.seed, draw_index);
  const int32_t n = static_cast<int32_t>(logits.size());

  const bool restrict_k = params.top_k > 0 && params.top_k < n;
  const bool restrict_p = params.top_p < 1.0;
  if (!restrict_k && !restrict_p) {
    // The whole distribution, in id order: no sort needed.
    double total = 0;
    for (int32_t id = 0; id < n; ++id) total += weight(id);
    const double target = u * total;
    double cumulative = 0;
    int32_t last_positive = best;
    for (int32_t id = 0; id < n; ++id) {
      const double w = weight(id);
      if (w <= 0) continue;
      cumulative += w;
      last_positive = id;
      if (target < cumulative) return id;
    }
    return last_positive;  // u * total rounded up to total
  }

  // Tokens with probability 0 can neither be drawn nor bring the nucleus closer to top_p, so only
  // the others are sorted: by descending logit (= descending probability), ties by lowest id.
  struct Candidate {
    int32_t id;
    double weight;
  };
  std::vector<Candidate> candidates;
  for (int32_t id = 0; id < n; ++id) {
    const double w = weight(id);
    if (w > 0) candidates.push_back({id, w});
  }
  SDM_CHECK(!candidates.empty());  // the argmax has weight 1
  const auto before = [&](const Candidate& a, const Candidate& b) {
    const float la = logits[a.id];
    const float lb = logits[b.id];
    return la > lb || (la == lb && a.id < b.id);
  };
  size_t kept = candidates.size();
  if (restrict_k && static_cast<size_t>(params.top_k) < kept) {
    kept = static_cast<size_t>(params.top_k);
    std::partial_sort(candidates.begin(), candidates.begin() + kept, candidates.end(), before);
  } else {
    std::sort(candidates.begin(), candidates.end(), before);
  }

  // Sums run in the same order everywhere, so the nucleus' running sum ends exactly at `total`
  // and the inverse CDF below retraces the same partial sums.
  double total = 0;
  for (size_t j = 0; j < kept; ++j) total += candidates[j].weight;
  if (restrict_p) {
    const double threshold = params.top_p * total;
    double cumulative = 0;
    for (size_t j = 0; j < kept; ++j) {
      cumulative += candidates[j].weight;
      if (cumulative >= threshold) {
        kept = j + 1;
        total = cumulative;
        break;
      }
    }
  }
  const double target = u * total;
  double cumulative = 0;
  for (size_t j = 0; j < kept; ++j) {
    cumulative += candidates[j].weight;
    if (target < cumulative) return candidates[j].id;
  }
  return candidates[kept - 1].id;  // u * total rounded up to total
}

}  // namespace sdm
