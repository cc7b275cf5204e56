// Log-probabilities of generated tokens, reported on request (GenerateRequest.logprobs in
// proto/sdm/v1/sdm.proto; OpenAI's `logprobs` and `top_logprobs`, docs/api.md).
//
// A token's log-probability is under the model's own distribution at its position:
// log_softmax(logits), at temperature 1 and before top-k and top-p, whatever the request samples
// with. So a greedy and a sampled request on the same history report the same numbers, and they
// score the text as the model does (what OpenAI's API and vLLM's default report). Computed in
// double over the non-NaN logits (a NaN logit has probability 0, as the sampler never draws it:
// engine/sampler.h); when the largest logit is +inf, the +inf ones share all the probability.
//
// Thread-safety: pure functions.
#ifndef SDMSERVE_ENGINE_LOGPROBS_H_
#define SDMSERVE_ENGINE_LOGPROBS_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace sdm {

// The most alternatives a request may ask for per token (OpenAI's top_logprobs limit).
inline constexpr int kMaxTopLogprobs = 20;

// OK when `n` alternatives per token may be asked for, [0, kMaxTopLogprobs]; else
// INVALID_ARGUMENT naming `field` as the caller's API spells it (e.g. "logprobs",
// "'top_logprobs'").
absl::Status CheckTopLogprobs(int64_t n, absl::string_view field);

struct TokenLogprob {
  int32_t token = 0;
  double logprob = 0;  // <= 0; -inf for a token of probability 0
};

struct TokenLogprobs {
  TokenLogprob chosen;            // the generated token
  std::vector<TokenLogprob> top;  // the position's most probable tokens, most probable first
};

// The log-probability of `token` and of the `top_n` most probable tokens (fewer when the
// vocabulary is smaller; ties: lowest id first; NaN logits last) at the position whose logits
// these are. Requires non-empty logits, `token` in [0, logits.size()) and top_n >= 0.
TokenLogprobs ComputeLogprobs(std::span<const float> logits, int32_t token, int top_n);

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_LOGPROBS_H_
