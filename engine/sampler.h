// Choosing the next token from a row of logits: greedy, or temperature sampling restricted by
// top-k and top-p (nucleus).
//
// Sampling is a pure function of (logits, params, draw index): the one uniform number a draw
// needs comes from a counter-based generator, u = f(seed, draw index) (Philox4x32-10), not from a
// generator object with hidden state. A session's sampler state is therefore just its seed and
// the number of draws it has taken (SessionState::sampler_draws): the caller passes that number
// and then increments it, once per generated token (greedy ones included, so the count is simply
// the number of tokens sampled). A session that is parked and resumed, or replayed from its
// start, draws exactly the same tokens.
//
// Thread-safety: all functions are pure.
#ifndef SDMSERVE_ENGINE_SAMPLER_H_
#define SDMSERVE_ENGINE_SAMPLER_H_

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"

namespace sdm {

struct SamplingParams {
  // 0: greedy (argmax). Otherwise logits are divided by it before the softmax: below 1 sharpens
  // the distribution, above 1 flattens it.
  double temperature = 0.0;
  // Keep only the k most probable tokens (0: all). Ties at the boundary keep the lowest ids.
  int top_k = 0;
  // Keep the smallest set of most probable tokens whose probability reaches top_p (1: all).
  // Applied after top_k, to the distribution renormalised over the top k.
  double top_p = 1.0;
  uint64_t seed = 0;
  // Stop after this many generated tokens; 0: generate none (a request that only reads its
  // prompt: appends it to a session, or scores it).
  int64_t max_tokens = 256;
  // Stop when one of these is generated (in addition to the tokenizer's EOS).
  std::vector<int32_t> stop_token_ids;
  // Do not stop at the tokenizer's EOS (GenerationPolicy): for a fixed output length.
  bool ignore_eos = false;
};

// InvalidArgument naming the field and the accepted range if any field is out of range:
// temperature negative, NaN or infinite; top_k negative; top_p not in [0, 1]; max_tokens < 0;
// a stop id outside [0, vocab_size).
absl::Status ValidateSamplingParams(const SamplingParams& params, int64_t vocab_size);

// The token for one position. Requires non-empty logits and valid params.
//
// Greedy (temperature 0): the argmax; ties go to the lowest id; NaN logits are never chosen.
// Otherwise: p = softmax(logits / temperature), computed in double, over the non-NaN logits;
// restricted to the top_k most probable (ties: lowest ids first); then to the nucleus, the
// shortest prefix of the tokens sorted by descending probability (ties: lowest id first) whose
// probability reaches top_p of what is left (at least one token); renormalised; one token drawn
// by inverse CDF with u = UniformDraw(seed, draw_index), over the kept tokens in that sorted
// order (or in id order when neither top_k nor top_p restricts anything).
// If every logit is NaN the result is 0; if the largest logit is +inf, the +inf ones share all
// the probability equally.
int32_t SampleToken(std::span<const float> logits, const SamplingParams& params,
                    uint64_t draw_index);

// A uniform number in [0, 1) with 53 random bits: the first two 32-bit words of
// Philox4x32_10(counter = {draw_index low, draw_index high, 0, 0}, key = {seed low, seed high}).
double UniformDraw(uint64_t seed, uint64_t draw_index);

// The Philox4x32-10 block function (Salmon et al., SC'11), as Random123 defines it.
std::array<uint32_t, 4> Philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_SAMPLER_H_
