#include "engine/generation.h"

#include <algorithm>
#include <utility>

namespace sdm {
namespace {

// Length of the longest prefix of `text` that can be emitted while keeping `hold` bytes back,
// moved back to a UTF-8 character boundary.
size_t EmittableLength(absl::string_view text, size_t hold) {
  if (text.size() <= hold) return 0;
  size_t n = text.size() - hold;
  // Back off while text[n], the first byte held, continues a character.
  while (n > 0 && n < text.size() && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) --n;
  return n;
}

}  // namespace

absl::string_view FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kDeadline:
      return "deadline";
    case FinishReason::kError:
      return "error";
  }
  return "?";
}

GenerationPolicy::GenerationPolicy(const Tokenizer& tokenizer,
                                   std::span<const std::string> stop_strings,
                                   const SamplingParams& sampling)
    : stop_token_ids_(sampling.stop_token_ids.begin(), sampling.stop_token_ids.end()),
      eos_id_(sampling.ignore_eos ? -1 : tokenizer.eos_id()),
      max_tokens_(sampling.max_tokens),
      detokenizer_(tokenizer) {
  for (const std::string& s : stop_strings) {
    if (s.empty()) continue;
    stop_strings_.push_back(s);
    hold_bytes_ = std::max(hold_bytes_, s.size() - 1);
  }
}

size_t GenerationPolicy::FirstStop(absl::string_view text) const {
  size_t first = absl::string_view::npos;
  for (const std::string& s : stop_strings_) first = std::min(first, text.find(s));
  return first;
}

GenerationPolicy::TokenOutput GenerationPolicy::Accept(int32_t token) {
  TokenOutput out = AcceptToken(token);
  if (out.finish.has_value()) finished_ = true;
  return out;
}

std::string GenerationPolicy::Flush() {
  if (finished_) return "";
  finished_ = true;
  std::string text = std::move(held_) + detokenizer_.Flush();
  held_.clear();
  text.resize(std::min(text.size(), FirstStop(text)));
  return text;
}

GenerationPolicy::TokenOutput GenerationPolicy::AcceptToken(int32_t token) {
  ++accepted_;
  TokenOutput out;
  const bool eos = eos_id_ >= 0 && token == eos_id_;
  if (eos ||
      std::find(stop_token_ids_.begin(), stop_token_ids_.end(), token) != stop_token_ids_.end()) {
    // The text held back is final now; a stop string still cuts it.
    out.text = std::move(held_) + detokenizer_.Flush();
    held_.clear();
    out.text.resize(std::min(out.text.size(), FirstStop(out.text)));
    out.end_token = true;
    out.finish = eos ? FinishReason::kEos : FinishReason::kStop;
    return out;
  }
  const bool last = accepted_ >= max_tokens_;
  held_ += detokenizer_.Add(token);
  if (last) held_ += detokenizer_.Flush();
  if (const size_t stop_at = FirstStop(held_); stop_at != absl::string_view::npos) {
    held_.resize(stop_at);
    out.text = std::move(held_);
    held_.clear();
    out.finish = FinishReason::kStop;
    return out;
  }
  const size_t n = last ? held_.size() : EmittableLength(held_, hold_bytes_);
  out.text = held_.substr(0, n);
  held_.erase(0, n);
  if (last) out.finish = FinishReason::kLength;
  return out;
}

}  // namespace sdm
