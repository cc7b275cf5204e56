#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "base/check.h"
#include "kernels/common/philox.h"
#include "kernels/common/sampling_math.h"

namespace sdm {

// The generator and the per-row arithmetic live in kernels/common/ so that the CUDA sampler
// (kernels/cuda/sampling.cu) runs the same code; these are thin wrappers.
std::array<uint32_t, 4> Philox4x32_10(std::array<uint32_t, 4> counter,
                                      std::array<uint32_t, 2> key) {
  const kernels::PhiloxBlock x = kernels::Philox4x32_10(
      kernels::PhiloxBlock{{counter[0], counter[1], counter[2], counter[3]}}, key[0], key[1]);
  return {x.v[0], x.v[1], x.v[2], x.v[3]};
}

double UniformDraw(uint64_t seed, uint64_t draw_index) {
  return kernels::UniformDraw(seed, draw_index);
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
  if (!(params.top_p >= 0 && params.top_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "top_p must be in [0, 1] (1 means no nucleus limit, 0 the most probable token), got ",
        params.top_p));
  }
  if (params.max_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens must be >= 0 (0: read the prompt only), got ", params.max_tokens));
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
  const int64_t n = static_cast<int64_t>(logits.size());
  const int32_t best = kernels::SampleArgmax(logits.data(), n);
  if (params.temperature == 0) return best;

  const float max_logit = logits[best];
  // All NaN, or every probability exp(-inf) = 0: nothing to sample from.
  if (kernels::SampleIsNan(max_logit) || max_logit == -std::numeric_limits<float>::infinity()) {
    return best;
  }
  const kernels::SampleWeightParams wp{max_logit, kernels::SampleIsPosInf(max_logit),
                                       params.temperature};
  const double u = kernels::UniformDraw(params.seed, draw_index);
  const bool restrict_k = params.top_k > 0 && params.top_k < n;
  const bool restrict_p = params.top_p < 1.0;
  // Mass sums follow the chunked order of kernels/common/sampling_math.h (the GPU's too).
  std::vector<double> chunk(kernels::CdfChunkCount(n));
  std::vector<double> group_end(kernels::CdfGroupCount(n));
  double cum = 0;

  if (!restrict_k && !restrict_p) {
    // The whole distribution, in id order: no sort needed.
    const auto weight_at = [&](int64_t id) { return kernels::SampleWeight(logits[id], wp); };
    const double total = kernels::CdfBuild(weight_at, n, chunk.data(), group_end.data());
    const int64_t id =
        kernels::CdfFind(weight_at, n, chunk.data(), group_end.data(), u * total, true, &cum);
    // Not found: u * total rounded up to total.
    return static_cast<int32_t>(id < n ? id : kernels::LastPositive(weight_at, n, best));
  }

  // Tokens with probability 0 can neither be drawn nor bring the nucleus closer to top_p, so only
  // the others are sorted: by descending logit (= descending probability), ties by lowest id.
  struct Candidate {
    uint64_t key;
    double weight;
  };
  std::vector<Candidate> candidates;
  for (int64_t id = 0; id < n; ++id) {
    const double w = kernels::SampleWeight(logits[id], wp);
    if (w > 0)
      candidates.push_back({kernels::SampleOrderKey(logits[id], static_cast<int32_t>(id)), w});
  }
  SDM_CHECK(!candidates.empty());  // the argmax has weight 1
  const auto before = [](const Candidate& a, const Candidate& b) { return a.key < b.key; };
  int64_t kept = static_cast<int64_t>(candidates.size());
  if (restrict_k && params.top_k < kept) {
    kept = params.top_k;
    std::partial_sort(candidates.begin(), candidates.begin() + kept, candidates.end(), before);
  } else {
    std::sort(candidates.begin(), candidates.end(), before);
  }
  const auto weight_at = [&](int64_t j) { return candidates[j].weight; };
  const double total = kernels::CdfBuild(weight_at, kept, chunk.data(), group_end.data());
  const int64_t j = kernels::CdfDrawSorted(weight_at, kept, chunk.data(), group_end.data(), total,
                                           restrict_p, params.top_p, u);
  return kernels::SampleOrderKeyId(candidates[j].key);
}

}  // namespace sdm
