// GenerationPolicy: the rules that turn a stream of sampled tokens into a completion's text and
// decide where the completion ends. The server's scheduler and `sdm-cli generate` both use it,
// so a completion ends and reads the same whichever runs it.
//
// For each sampled token, in order:
//   1. The tokenizer's EOS (unless SamplingParams::ignore_eos) or one of the stop token ids ends
//      the completion (kEos / kStop). It is an end token: it has no text of its own. The text held
//      back so far is final now and goes with it (an incomplete character as U+FFFD), cut before
//      the first stop string it holds.
//   2. Otherwise the token's text is added (IncrementalDetokenizer: whole UTF-8 characters only).
//      When this token is the max_tokens-th, the detokenizer is flushed too.
//   3. A stop string in the text not yet emitted ends the completion (kStop): the text right
//      before its first occurrence (the earliest start among all stop strings) is emitted,
//      nothing after.
//   4. Otherwise the text is emitted except its last (longest stop string - 1) bytes, moved back
//      to a character boundary: they may be the start of a stop string. At max_tokens everything
//      is emitted and the completion ends (kLength).
// Every token counts towards max_tokens, end tokens included, so an EOS sampled as the
// max_tokens-th token ends the completion as kEos. Empty stop strings are ignored.
//
// The concatenation of every emitted text is the tokenizer's decoding of the accepted tokens
// (but an end token), cut before the first occurrence of a stop string, for stop strings without
// U+FFFD (an incomplete character's U+FFFD only appears when the text is flushed).
//
// Thread-safety: one policy belongs to one completion (one thread at a time). The tokenizer must
// outlive it.
#ifndef SDMSERVE_ENGINE_GENERATION_H_
#define SDMSERVE_ENGINE_GENERATION_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"

namespace sdm {

// Why a completion ended. GenerationPolicy decides kLength, kStop and kEos; the server adds the
// others (a cancelled call, a passed deadline, an engine error).
enum class FinishReason { kLength, kStop, kEos, kCancelled, kDeadline, kError };

// "length", "stop", "eos", "cancelled", "deadline", "error".
absl::string_view FinishReasonName(FinishReason reason);

class GenerationPolicy {
 public:
  // What one accepted token produces.
  struct TokenOutput {
    // The text that became final with this token (may be empty while a character or a possible
    // stop string is incomplete). Valid UTF-8, never split inside a character.
    std::string text;
    // The token is the tokenizer's EOS or a stop id: it ends the completion and is not part of
    // its text; `text` is what was held back until then.
    bool end_token = false;
    // Set when the completion ends with this token.
    std::optional<FinishReason> finish;
  };

  // From `sampling`: stop_token_ids, ignore_eos and max_tokens (>= 1: the completion ends after
  // that many tokens at the latest).
  GenerationPolicy(const Tokenizer& tokenizer, std::span<const std::string> stop_strings,
                   const SamplingParams& sampling);

  // Accepts the next sampled token. Must not be called once a TokenOutput had `finish` set. A
  // caller that ends the completion for another reason (cancelled, deadline) drops the policy
  // and with it the text held back: that text was never final.
  TokenOutput Accept(int32_t token);

  // The completion ends for a reason of the caller's (cancelled, a deadline, an error) after the
  // tokens accepted so far: the text held back is final then (its tokens are in the sequence),
  // cut before a stop string as an end token's, an incomplete character as U+FFFD. Empty once a
  // TokenOutput had `finish` set (the policy ended the completion and emitted everything), and
  // after a first Flush.
  std::string Flush();

 private:
  // Accept() but for finished_.
  TokenOutput AcceptToken(int32_t token);
  // Offset of the earliest stop string occurrence in `text`, or npos.
  size_t FirstStop(absl::string_view text) const;

  std::vector<std::string> stop_strings_;  // non-empty ones only
  std::vector<int32_t> stop_token_ids_;
  int32_t eos_id_;  // -1: none, or ignored
  int64_t max_tokens_;
  size_t hold_bytes_ = 0;  // longest stop string - 1: a stop string's start may be this long
  bool finished_ = false;  // a TokenOutput had `finish`, or Flush() was called
  IncrementalDetokenizer detokenizer_;
  std::string held_;  // decoded text not emitted yet
  int64_t accepted_ = 0;
};

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_GENERATION_H_
