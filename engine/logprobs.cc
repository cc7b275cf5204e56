#include "engine/logprobs.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "base/check.h"

namespace sdm {

absl::Status CheckTopLogprobs(int64_t n, absl::string_view field) {
  if (n >= 0 && n <= kMaxTopLogprobs) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, " must be in [0, ", kMaxTopLogprobs,
      "] (the most probable tokens reported at each position besides the generated one), got ", n));
}

TokenLogprobs ComputeLogprobs(std::span<const float> logits, int32_t token, int top_n) {
  SDM_CHECK(!logits.empty());
  SDM_CHECK(token >= 0 && static_cast<size_t>(token) < logits.size());
  SDM_CHECK(top_n >= 0);
  constexpr double kMinusInf = -std::numeric_limits<double>::infinity();
  double max = kMinusInf;
  for (const float l : logits) {
    if (!std::isnan(l)) max = std::max(max, static_cast<double>(l));
  }
  // log(sum over non-NaN logits of exp(l)), shifted by the largest. With a +inf logit the +inf
  // ones share the probability: each is log(1 / count), every other -inf.
  double log_sum = kMinusInf;
  const bool infinite = std::isinf(max) && max > 0;
  if (infinite) {
    const auto count =
        std::count(logits.begin(), logits.end(), std::numeric_limits<float>::infinity());
    log_sum = std::log(static_cast<double>(count));
  } else if (max != kMinusInf) {
    double sum = 0;
    for (const float l : logits) {
      if (!std::isnan(l)) sum += std::exp(static_cast<double>(l) - max);
    }
    log_sum = max + std::log(sum);
  }
  const auto logprob = [&](int32_t id) {
    const double l = logits[static_cast<size_t>(id)];
    if (std::isnan(l) || log_sum == kMinusInf) return kMinusInf;  // also: every logit NaN or -inf
    if (infinite) return std::isinf(l) && l > 0 ? -log_sum : kMinusInf;
    return l - log_sum;
  };
  TokenLogprobs out;
  out.chosen = {token, logprob(token)};
  const size_t n = std::min(static_cast<size_t>(top_n), logits.size());
  if (n == 0) return out;
  // Descending logit (the order of the log-probabilities), ties and NaN as the header says.
  const auto before = [&logits](int32_t a, int32_t b) {
    const float la = logits[static_cast<size_t>(a)];
    const float lb = logits[static_cast<size_t>(b)];
    if (std::isnan(la) || std::isnan(lb)) {
      return std::isnan(la) == std::isnan(lb) ? a < b : std::isnan(lb);
    }
    return la != lb ? la > lb : a < b;
  };
  // The n best in one pass, without an index per vocabulary entry (this runs for every scored
  // prompt token): a heap whose front is the worst of those kept so far.
  std::vector<int32_t> best;
  best.reserve(n);
  for (int32_t id = 0; static_cast<size_t>(id) < logits.size(); ++id) {
    if (best.size() < n) {
      best.push_back(id);
      std::push_heap(best.begin(), best.end(), before);
    } else if (before(id, best.front())) {
      std::pop_heap(best.begin(), best.end(), before);
      best.back() = id;
      std::push_heap(best.begin(), best.end(), before);
    }
  }
  std::sort_heap(best.begin(), best.end(), before);
  const std::vector<int32_t>& ids = best;
  out.top.reserve(n);
  for (size_t i = 0; i < n; ++i) out.top.push_back({ids[i], logprob(ids[i])});
  return out;
}

}  // namespace sdm
