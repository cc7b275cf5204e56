// The OpenAI-compatible API's JSON (docs/api.md, "HTTP API"): requests of /v1/completions and
// /v1/chat/completions parsed and checked into native form, and the responses and stream chunks
// rendered. Nothing here knows HTTP or runs the engine.
//
// Parsing follows OpenAI: unknown fields are ignored; a field of the wrong type is an
// INVALID_ARGUMENT naming it; null is the same as absent. Ranges (temperature, top_p, top_k,
// max_tokens, the prompt's tokens) are checked later, by the same code as gRPC's Generate
// (SdmServiceImpl::PrepareGenerate), so both APIs accept exactly the same values.
#ifndef SDMSERVE_SERVER_HTTP_OPENAI_JSON_H_
#define SDMSERVE_SERVER_HTTP_OPENAI_JSON_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "sdm/v1/sdm.pb.h"
#include "server/http/chat_template.h"

namespace sdm {

enum class OpenAiEndpoint { kCompletions, kChatCompletions };

// The most choices one request may ask for (prompts times `n`): each is a job of its own, taking
// a place in the scheduler's queue.
inline constexpr int kMaxOpenAiChoices = 64;

// A /v1/completions prompt: text, or token ids (is_tokens).
struct CompletionPrompt {
  std::string text;
  std::vector<int32_t> tokens;
  bool is_tokens = false;
};

struct OpenAiRequest {
  OpenAiEndpoint endpoint = OpenAiEndpoint::kCompletions;
  std::string model;  // empty: not sent
  // /v1/completions: the prompts, in order (at least one; several are a batch, one choice each).
  std::vector<CompletionPrompt> prompts;
  // /v1/chat/completions.
  std::vector<ChatMessage> messages;
  // Choices per prompt (`n`): choice j of a prompt samples with seed + j. Several choices are
  // one-shot jobs: a session takes one.
  int n = 1;

  std::optional<int64_t> max_tokens;  // max_tokens, or max_completion_tokens (chat)
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::optional<int32_t> top_k;  // our extension (vLLM's name): SamplingParams.top_k
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool ignore_eos = false;  // our extension (vLLM's name): SamplingParams.ignore_eos
  std::vector<std::pair<int32_t, float>> logit_bias;  // SamplingParams.logit_bias
  // Log-probabilities asked for: the alternatives per token (GenerateRequest.logprobs).
  // /v1/completions' `logprobs` (an integer), or chat's `top_logprobs` once `logprobs` is true.
  std::optional<int32_t> logprobs;
  // /v1/completions' `echo`: the prompt's text before the completion's, and with `logprobs` the
  // prompt tokens' log-probabilities before the generated ones' (GenerateRequest.prompt_logprobs).
  bool echo = false;
  // /v1/completions' `add_special_tokens` (vLLM's name): BOS before the prompt. Unset: for text
  // as gRPC decides (BOS when the sequence starts here); token ids are read as sent, no BOS, as
  // vLLM does (an evaluation harness counts the context's tokens it sent).
  std::optional<bool> add_special_tokens;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  std::string user;
  std::string session_id;  // our extension; also the X-Session-Id header
};

// A request body parsed as JSON (discarded when it is not JSON). A \u escape of a lone surrogate
// (U+D800..U+DFFF not in a high-low pair), which RFC 8259's grammar allows and JavaScript writes
// for a string cut in the middle of an emoji, is read as U+FFFD: nlohmann::json refuses it, and
// has no option to replace it.
nlohmann::json ParseJsonBody(absl::string_view body);

// Parses a request body. Errors are INVALID_ARGUMENT with a message naming the field.
absl::StatusOr<OpenAiRequest> ParseOpenAiRequest(absl::string_view body, OpenAiEndpoint endpoint);

// OpenAI's temperature when the request has none (the gRPC API's default is 0, greedy).
inline constexpr double kOpenAiDefaultTemperature = 1.0;

// The Generate request of `request` whose prompt is `prompt_text` (the chat template's
// rendering, or the completion's text) or its first prompt's token ids.
v1::GenerateRequest ToGenerateRequest(const OpenAiRequest& request, const std::string& prompt_text,
                                      const std::vector<std::string>& extra_stop);

// A session as the HTTP API shows it.
nlohmann::json SessionToJson(const v1::Session& session);

// The common head of every completion object and chunk.
nlohmann::json CompletionHead(OpenAiEndpoint endpoint, bool chunk, absl::string_view id,
                              int64_t created, absl::string_view model);

// A token in a response's log-probabilities: its bytes (its string is LogprobTokenText's) and
// its log-probability (rendered -inf as -9999, OpenAI's floor: JSON has no infinity).
struct LogprobToken {
  std::string bytes;
  double logprob = 0;
};
// A generated token's, and its position's most probable tokens (most probable first).
struct LogprobEntry {
  LogprobToken chosen;
  std::vector<LogprobToken> top;
  // An echoed prompt token with nothing read before it (the first of a sequence): its
  // log-probability and alternatives are null.
  bool unscored = false;
};

// The string OpenAI's logprobs show for a token of these bytes: the bytes when they are valid
// UTF-8, otherwise "bytes:" and a \xNN escape per byte (a byte of a character split between
// tokens).
std::string LogprobTokenText(absl::string_view bytes);

// A chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal":
// null}.
nlohmann::json ChatLogprobsJson(const std::vector<LogprobEntry>& entries);

// A completion choice's `logprobs` (OpenAI's legacy form): tokens, token_logprobs, top_logprobs
// (an object per token, string to log-probability) and text_offset, each token's offset in the
// text, in characters; offsets start at `text_offset`, which is advanced past the entries (a
// stream's chunks continue where the previous one ended).
nlohmann::json CompletionLogprobsJson(const std::vector<LogprobEntry>& entries,
                                      int64_t& text_offset);

nlohmann::json UsageJson(int64_t prompt_tokens, int64_t completion_tokens, int64_t history_tokens);

}  // namespace sdm

#endif  // SDMSERVE_SERVER_HTTP_OPENAI_JSON_H_
