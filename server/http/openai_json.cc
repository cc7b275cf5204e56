#include "server/http/openai_json.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/logprobs.h"
#include "engine/tokenizer.h"

namespace sdm {
namespace {

using Json = nlohmann::json;

absl::Status WrongType(absl::string_view field, absl::string_view expected) {
  return absl::InvalidArgumentError(absl::StrCat("'", field, "' must be ", expected));
}

// The field, or nullptr when it is absent or null.
const Json* Field(const Json& body, const char* name) {
  const auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::Status GetString(const Json& body, const char* name, std::string& out) {
  const Json* v = Field(body, name);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_string()) return WrongType(name, "a string");
  out = v->get<std::string>();
  return absl::OkStatus();
}

absl::Status GetBool(const Json& body, const char* name, bool& out) {
  const Json* v = Field(body, name);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_boolean()) return WrongType(name, "a boolean");
  out = v->get<bool>();
  return absl::OkStatus();
}

absl::Status GetNumber(const Json& body, const char* name, std::optional<double>& out) {
  const Json* v = Field(body, name);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_number()) return WrongType(name, "a number");
  const double d = v->get<double>();
  if (!std::isfinite(d)) return WrongType(name, "a finite number");
  out = d;
  return absl::OkStatus();
}

absl::Status GetInteger(const Json& body, const char* name, std::optional<int64_t>& out) {
  const Json* v = Field(body, name);
  if (v == nullptr) return absl::OkStatus();
  if (v->is_number_integer()) {
    if (v->is_number_unsigned() &&
        v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return WrongType(name, "an integer within 64 bits");
    }
    out = v->get<int64_t>();
    return absl::OkStatus();
  }
  return WrongType(name, "an integer");
}

absl::Status ParseStop(const Json& body, std::vector<std::string>& out) {
  const Json* v = Field(body, "stop");
  if (v == nullptr) return absl::OkStatus();
  if (v->is_string()) {
    out.push_back(v->get<std::string>());
    return absl::OkStatus();
  }
  if (!v->is_array()) return WrongType("stop", "a string or an array of strings");
  for (const Json& s : *v) {
    if (!s.is_string()) return WrongType("stop", "a string or an array of strings");
    out.push_back(s.get<std::string>());
  }
  return absl::OkStatus();
}

// One prompt of a completion request: a string, or an array of token ids (`where` names it in
// messages: "'prompt'" or "'prompt'[i]").
absl::Status ParseOnePrompt(const Json& v, const std::string& where, CompletionPrompt& out) {
  if (v.is_string()) {
    out.text = v.get<std::string>();
    return absl::OkStatus();
  }
  if (!v.is_array()) return WrongType(where.c_str(), "a string or an array of token ids");
  out.is_tokens = true;
  for (size_t i = 0; i < v.size(); ++i) {
    const Json& t = v[i];
    if (!t.is_number_integer()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " must be a string or an array of integer token ids"));
    }
    // Checked as sent: past int64, get<int64_t>() would wrap (18446744073709551615 to -1).
    const bool in_range = t.is_number_unsigned()
                              ? t.get<uint64_t>() <= std::numeric_limits<int32_t>::max()
                              : t.get<int64_t>() >= std::numeric_limits<int32_t>::min() &&
                                    t.get<int64_t>() <= std::numeric_limits<int32_t>::max();
    if (!in_range) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "[", i, "] = ", t.dump(), " is out of range for a token id"));
    }
    out.tokens.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  return absl::OkStatus();
}

// `prompt`: a string, an array of token ids, or an array of several of either (a batch: one
// choice each, in order).
absl::Status ParsePrompt(const Json& body, OpenAiRequest& r) {
  const Json* v = Field(body, "prompt");
  if (v == nullptr) return absl::InvalidArgumentError("'prompt' is required");
  if (!v->is_string() && !v->is_array()) {
    return WrongType("prompt", "a string, an array of token ids, or an array of either");
  }
  const bool batch = v->is_array() && !v->empty() && ((*v)[0].is_string() || (*v)[0].is_array());
  if (!batch) return ParseOnePrompt(*v, "'prompt'", r.prompts.emplace_back());
  if (v->size() > static_cast<size_t>(kMaxOpenAiChoices)) {
    return absl::InvalidArgumentError(absl::StrCat("'prompt' holds ", v->size(),
                                                   " prompts; at most ", kMaxOpenAiChoices,
                                                   " are allowed per request"));
  }
  for (size_t i = 0; i < v->size(); ++i) {
    const Json& one = (*v)[i];
    if (!one.is_string() && !one.is_array()) {
      return WrongType("prompt", "a string, an array of token ids, or an array of either");
    }
    if (absl::Status s =
            ParseOnePrompt(one, absl::StrCat("'prompt'[", i, "]"), r.prompts.emplace_back());
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status ParseMessages(const Json& body, OpenAiRequest& r) {
  const Json* v = Field(body, "messages");
  if (v == nullptr) return absl::InvalidArgumentError("'messages' is required");
  if (!v->is_array() || v->empty()) return WrongType("messages", "a non-empty array");
  for (size_t i = 0; i < v->size(); ++i) {
    const Json& m = (*v)[i];
    const std::string field = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return WrongType(field, "an object with 'role' and 'content'");
    ChatMessage out;
    const Json* role = Field(m, "role");
    if (role == nullptr || !role->is_string()) {
      return WrongType(absl::StrCat(field, ".role"), "a string");
    }
    out.role = role->get<std::string>();
    if (out.role != "system" && out.role != "developer" && out.role != "user" &&
        out.role != "assistant" && out.role != "tool") {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".role must be system, developer, user, assistant or tool, got '", out.role, "'"));
    }
    const Json* content = Field(m, "content");
    if (content == nullptr) {
      // An assistant message may carry only tool calls; it has no text for the template.
    } else if (content->is_string()) {
      out.content = content->get<std::string>();
    } else if (content->is_array()) {
      for (size_t k = 0; k < content->size(); ++k) {
        const Json& part = (*content)[k];
        const Json* type = part.is_object() ? Field(part, "type") : nullptr;
        const Json* text = part.is_object() ? Field(part, "text") : nullptr;
        if (type == nullptr || *type != "text" || text == nullptr || !text->is_string()) {
          return WrongType(absl::StrCat(field, ".content[", k, "]"),
                           "a text part {\"type\": \"text\", \"text\": ...} (this model reads "
                           "text only)");
        }
        out.content += text->get<std::string>();
      }
    } else {
      return WrongType(absl::StrCat(field, ".content"), "a string or an array of text parts");
    }
    r.messages.push_back(std::move(out));
  }
  return absl::OkStatus();
}

// The code unit of the \u escape at body[at] ("\uXXXX"), or -1 when there is none there.
int EscapedCodeUnit(absl::string_view body, size_t at) {
  if (at + 6 > body.size() || body[at] != '\\' || body[at + 1] != 'u') return -1;
  int unit = 0;
  for (size_t i = at + 2; i < at + 6; ++i) {
    const char c = body[i];
    const int digit = c >= '0' && c <= '9'   ? c - '0'
                      : c >= 'a' && c <= 'f' ? c - 'a' + 10
                      : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                             : -1;
    if (digit < 0) return -1;
    unit = unit * 16 + digit;
  }
  return unit;
}

// Where in `body` a \u escape of a lone surrogate starts, in JSON strings. Outside strings no
// other token holds a quote or a backslash, so tracking the strings' quotes and escapes is
// enough; what is not JSON is left to the parser.
std::vector<size_t> LoneSurrogateEscapes(absl::string_view body) {
  const auto is_high = [](int unit) { return unit >= 0xD800 && unit <= 0xDBFF; };
  const auto is_low = [](int unit) { return unit >= 0xDC00 && unit <= 0xDFFF; };
  std::vector<size_t> out;
  bool in_string = false;
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] == '"') {
      in_string = !in_string;
    } else if (in_string && body[i] == '\\') {
      const int unit = EscapedCodeUnit(body, i);
      if (is_high(unit) && is_low(EscapedCodeUnit(body, i + 6))) {
        i += 11;  // a pair: its second escape too
      } else if (is_high(unit) || is_low(unit)) {
        out.push_back(i);
        i += 5;
      } else {
        ++i;  // the escaped character (a quote or a backslash among them)
      }
    }
  }
  return out;
}

// Whether `body`'s `field` is the string `choice`.
bool ChoiceIs(const Json& body, const char* field, const char* choice) {
  const Json* v = Field(body, field);
  return v != nullptr && *v == choice;
}

// OpenAI fields this server does not implement are refused when they ask for something: a client
// that asked for a suffix must not read a response without one as if it had it. Their
// "off" values (null, false, 0; best_of 1; response_format "text"; an empty suffix) are accepted,
// as clients send them by default.
absl::Status RefuseUnimplemented(const Json& body, OpenAiEndpoint endpoint) {
  const auto is_false_or_zero = [](const Json& v) {
    return (v.is_boolean() && !v.get<bool>()) || (v.is_number() && v.get<double>() == 0);
  };
  const auto never = [](const Json&) { return false; };  // null is off: the field is absent
  const auto is_empty_array = [](const Json& v) { return v.is_array() && v.empty(); };
  struct Unimplemented {
    const char* field;
    const char* what;
    std::function<bool(const Json&)> off;
  };
  const Unimplemented fields[] = {
      // OpenAI's best_of is at least n (1 here): 0 is no off value.
      {"best_of", "it generates one completion per request",
       [](const Json& v) { return v.is_number() && v.get<double>() == 1; }},
      {"suffix", "it does not insert text between a prompt and a suffix",
       [](const Json& v) { return v.is_string() && v.get<std::string>().empty(); }},
      {"response_format", "it has no JSON or schema-constrained output",
       [](const Json& v) { return v.is_object() && v.value("type", Json()) == "text"; }},
      // Tools (and the deprecated functions) are off when none are given or the choice is
      // "none"; "auto" without tools asks for nothing.
      {"tools", "it does not call tools",
       [&body, is_empty_array](const Json& v) {
         return is_empty_array(v) || ChoiceIs(body, "tool_choice", "none");
       }},
      {"tool_choice", "it does not call tools",
       [](const Json& v) { return v == "none" || v == "auto"; }},
      {"functions", "it does not call functions",
       [&body, is_empty_array](const Json& v) {
         return is_empty_array(v) || ChoiceIs(body, "function_call", "none");
       }},
      {"function_call", "it does not call functions",
       [](const Json& v) { return v == "none" || v == "auto"; }},
      {"presence_penalty", "it applies no repetition penalties", is_false_or_zero},
      {"frequency_penalty", "it applies no repetition penalties", is_false_or_zero},
      {"modalities", "it generates text only",
       [](const Json& v) { return v == Json::array({"text"}); }},
      {"audio", "it generates text only", never},
      {"prediction", "it does not take predicted outputs", never},
  };
  for (const Unimplemented& u : fields) {
    const Json* v = Field(body, u.field);
    if (v != nullptr && !u.off(*v)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", u.field, "' is not supported by this server (", u.what, "); leave it out"));
    }
  }
  return absl::OkStatus();
}

// `logit_bias`: an object from token ids (as strings, OpenAI's form) to biases (numbers); the
// service checks the ids against the vocabulary and the biases' range, naming gRPC's field.
absl::Status ParseLogitBias(const Json& body, std::vector<std::pair<int32_t, float>>& out) {
  const Json* v = Field(body, "logit_bias");
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_object()) return WrongType("logit_bias", "an object from token ids to biases");
  for (const auto& [key, bias] : v->items()) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(key, &id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("'logit_bias' key '", key, "' is not a token id"));
    }
    if (!bias.is_number()) {
      return absl::InvalidArgumentError(absl::StrCat("'logit_bias'['", key, "'] must be a number"));
    }
    out.emplace_back(id, bias.get<float>());
  }
  return absl::OkStatus();
}

// /v1/completions' `logprobs` (an integer: the alternatives per token; 0 asks for the generated
// tokens' own), or chat's `logprobs` (a boolean) and `top_logprobs` (the alternatives, which
// need `logprobs`: true), in [0, kMaxTopLogprobs] (the service checks the range again, naming
// gRPC's field).
absl::Status ParseLogprobs(const Json& body, OpenAiEndpoint endpoint, std::optional<int32_t>& out) {
  const auto in_range = [](absl::string_view field, int64_t v, std::optional<int32_t>& to) {
    if (absl::Status s = CheckTopLogprobs(v, absl::StrCat("'", field, "'")); !s.ok()) return s;
    to = static_cast<int32_t>(v);
    return absl::OkStatus();
  };
  std::optional<int64_t> n;
  if (endpoint == OpenAiEndpoint::kCompletions) {
    if (absl::Status s = GetInteger(body, "logprobs", n); !s.ok()) return s;
    return n.has_value() ? in_range("logprobs", *n, out) : absl::OkStatus();
  }
  bool on = false;
  if (absl::Status s = GetBool(body, "logprobs", on); !s.ok()) return s;
  if (absl::Status s = GetInteger(body, "top_logprobs", n); !s.ok()) return s;
  if (!on) {
    if (n.has_value() && *n != 0) {
      return absl::InvalidArgumentError("'top_logprobs' needs 'logprobs': true");
    }
    return absl::OkStatus();
  }
  return in_range("top_logprobs", n.value_or(0), out);
}

}  // namespace

nlohmann::json ParseJsonBody(absl::string_view body) {
  const std::vector<size_t> lone = LoneSurrogateEscapes(body);
  if (lone.empty()) return Json::parse(body, nullptr, /*allow_exceptions=*/false);
  std::string replaced(body);
  for (const size_t at : lone) replaced.replace(at, 6, "\\ufffd");  // as long as what it replaces
  return Json::parse(replaced, nullptr, /*allow_exceptions=*/false);
}

absl::StatusOr<OpenAiRequest> ParseOpenAiRequest(absl::string_view body, OpenAiEndpoint endpoint) {
  const Json j = ParseJsonBody(body);
  if (j.is_discarded()) {
    return absl::InvalidArgumentError("the request body is not valid JSON");
  }
  if (!j.is_object()) return absl::InvalidArgumentError("the request body must be a JSON object");
  OpenAiRequest r;
  r.endpoint = endpoint;
  if (absl::Status s = GetString(j, "model", r.model); !s.ok()) return s;
  if (endpoint == OpenAiEndpoint::kCompletions) {
    if (absl::Status s = ParsePrompt(j, r); !s.ok()) return s;
  } else {
    if (absl::Status s = ParseMessages(j, r); !s.ok()) return s;
  }
  std::optional<int64_t> max_completion_tokens;
  if (absl::Status s = GetInteger(j, "max_tokens", r.max_tokens); !s.ok()) return s;
  if (endpoint == OpenAiEndpoint::kChatCompletions) {
    if (absl::Status s = GetInteger(j, "max_completion_tokens", max_completion_tokens); !s.ok()) {
      return s;
    }
    // The newer name wins, as in OpenAI's API.
    if (max_completion_tokens.has_value()) r.max_tokens = max_completion_tokens;
  }
  if (absl::Status s = GetNumber(j, "temperature", r.temperature); !s.ok()) return s;
  if (absl::Status s = GetNumber(j, "top_p", r.top_p); !s.ok()) return s;
  std::optional<int64_t> top_k;
  if (absl::Status s = GetInteger(j, "top_k", top_k); !s.ok()) return s;
  if (top_k.has_value()) {
    // SamplingParams.top_k is an int32: a value past it cannot reach the service's range check
    // (which refuses a negative one with gRPC's message) without being cut.
    if (*top_k < std::numeric_limits<int32_t>::min() ||
        *top_k > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'top_k' = ", *top_k, " is out of range for a 32-bit integer"));
    }
    r.top_k = static_cast<int32_t>(*top_k);
  }
  std::optional<int64_t> seed;
  if (absl::Status s = GetInteger(j, "seed", seed); !s.ok()) return s;
  if (seed.has_value()) r.seed = static_cast<uint64_t>(*seed);
  if (absl::Status s = ParseStop(j, r.stop); !s.ok()) return s;
  if (absl::Status s = GetBool(j, "ignore_eos", r.ignore_eos); !s.ok()) return s;
  std::optional<int64_t> n;
  if (absl::Status s = GetInteger(j, "n", n); !s.ok()) return s;
  if (n.has_value()) {
    const int64_t prompts = std::max<int64_t>(1, static_cast<int64_t>(r.prompts.size()));
    if (*n < 1 || *n > kMaxOpenAiChoices / prompts) {  // n * prompts could overflow
      return absl::InvalidArgumentError(absl::StrCat(
          "'n' must be in [1, ", kMaxOpenAiChoices / prompts, "] (at most ", kMaxOpenAiChoices,
          " choices per request", prompts > 1 ? absl::StrCat(", over ", prompts, " prompts") : "",
          "), got ", *n));
    }
    r.n = static_cast<int>(*n);
  }
  if (endpoint == OpenAiEndpoint::kCompletions) {
    if (absl::Status s = GetBool(j, "echo", r.echo); !s.ok()) return s;
    if (const Json* add = Field(j, "add_special_tokens"); add != nullptr) {
      if (!add->is_boolean()) return WrongType("add_special_tokens", "a boolean");
      r.add_special_tokens = add->get<bool>();
    }
  } else if (const Json* echo = Field(j, "echo");
             echo != nullptr && !(echo->is_boolean() && !echo->get<bool>()) &&
             !(echo->is_number() && echo->get<double>() == 0)) {
    // Not a field of OpenAI's chat API: a client that sends it expects something this server
    // does not do.
    return absl::InvalidArgumentError(
        "'echo' is a /v1/completions field: chat completions do not echo the messages; leave "
        "it out");
  }
  if (absl::Status s = RefuseUnimplemented(j, endpoint); !s.ok()) return s;
  if (absl::Status s = ParseLogitBias(j, r.logit_bias); !s.ok()) return s;
  if (absl::Status s = ParseLogprobs(j, endpoint, r.logprobs); !s.ok()) return s;
  if (absl::Status s = GetBool(j, "stream", r.stream); !s.ok()) return s;
  if (const Json* options = Field(j, "stream_options"); options != nullptr) {
    if (!options->is_object()) return WrongType("stream_options", "an object");
    if (absl::Status s = GetBool(*options, "include_usage", r.include_usage); !s.ok()) {
      return WrongType("stream_options.include_usage", "a boolean");
    }
  }
  if (absl::Status s = GetString(j, "user", r.user); !s.ok()) return s;
  if (absl::Status s = GetString(j, "session_id", r.session_id); !s.ok()) return s;
  return r;
}

v1::GenerateRequest ToGenerateRequest(const OpenAiRequest& request, const std::string& prompt_text,
                                      const std::vector<std::string>& extra_stop) {
  v1::GenerateRequest g;
  if (request.add_special_tokens.has_value()) g.set_add_bos(*request.add_special_tokens);
  if (!request.prompts.empty() && request.prompts[0].is_tokens) {
    g.mutable_token_ids()->mutable_ids()->Add(request.prompts[0].tokens.begin(),
                                              request.prompts[0].tokens.end());
    // As sent, unless asked: a harness's context length counts its own tokens.
    if (!request.add_special_tokens.has_value()) g.set_add_bos(false);
  } else {
    g.set_text(prompt_text);
  }
  g.set_session_id(request.session_id);
  v1::SamplingParams& s = *g.mutable_sampling();
  if (request.max_tokens.has_value()) s.set_max_tokens(*request.max_tokens);
  s.set_temperature(request.temperature.value_or(kOpenAiDefaultTemperature));
  if (request.top_p.has_value()) s.set_top_p(*request.top_p);
  if (request.top_k.has_value()) s.set_top_k(*request.top_k);
  if (request.seed.has_value()) s.set_seed(*request.seed);
  s.set_ignore_eos(request.ignore_eos);
  if (request.logprobs.has_value()) {
    g.set_logprobs(*request.logprobs);
    if (request.echo) g.set_prompt_logprobs(*request.logprobs);
  }
  for (const std::string& stop : request.stop) s.add_stop(stop);
  for (const auto& [id, bias] : request.logit_bias) (*s.mutable_logit_bias())[id] = bias;
  for (const std::string& stop : extra_stop) s.add_stop(stop);
  return g;
}

nlohmann::json SessionToJson(const v1::Session& s) {
  Json j = {{"id", s.id()},
            {"object", "session"},
            {"position", s.position()},
            {"state_bytes", s.state_bytes()},
            {"generating", s.generating()},
            {"last_used_at", s.last_used_time().seconds()}};
  switch (s.tier()) {
    case v1::TIER_RESIDENT:
      j["tier"] = "resident";
      break;
    case v1::TIER_HOST:
      j["tier"] = "host";
      break;
    case v1::TIER_DISK:
      j["tier"] = "disk";
      break;
    default:
      j["tier"] = nullptr;
  }
  j["created_at"] = s.has_create_time() ? Json(s.create_time().seconds()) : Json(nullptr);
  if (s.has_ttl()) {
    j["ttl_seconds"] = s.ttl().seconds();
    j["expires_at"] = s.expire_time().seconds();
  } else {
    j["ttl_seconds"] = nullptr;
    j["expires_at"] = nullptr;
  }
  Json labels = Json::object();
  for (const auto& [k, v] : s.labels()) labels[k] = v;
  j["labels"] = std::move(labels);
  if (!s.error().empty()) j["error"] = s.error();  // quarantined (sdm.proto, Session.error)
  return j;
}

nlohmann::json CompletionHead(OpenAiEndpoint endpoint, bool chunk, absl::string_view id,
                              int64_t created, absl::string_view model) {
  const char* object = endpoint == OpenAiEndpoint::kCompletions
                           ? "text_completion"
                           : (chunk ? "chat.completion.chunk" : "chat.completion");
  return Json{{"id", std::string(id)},
              {"object", object},
              {"created", created},
              {"model", std::string(model)},
              {"system_fingerprint", nullptr}};
}

std::string LogprobTokenText(absl::string_view bytes) {
  if (SanitizeUtf8(bytes, /*final=*/true, nullptr) == bytes) return std::string(bytes);
  std::string text = "bytes:";
  for (const char c : bytes) absl::StrAppendFormat(&text, "\\x%02x", static_cast<uint8_t>(c));
  return text;
}

namespace {

// -inf (a token of probability 0) as OpenAI's floor: JSON has no infinity.
double LogprobNumber(double logprob) { return std::max(logprob, -9999.0); }

Json BytesJson(const std::string& bytes) {
  Json out = Json::array();
  for (const char c : bytes) out.push_back(static_cast<uint8_t>(c));
  return out;
}

// Characters (code points) of UTF-8 text, as Python and JavaScript clients index it by.
int64_t CharacterCount(absl::string_view text) {
  int64_t count = 0;
  for (const char c : text) count += (static_cast<uint8_t>(c) & 0xC0) != 0x80 ? 1 : 0;
  return count;
}

}  // namespace

nlohmann::json ChatLogprobsJson(const std::vector<LogprobEntry>& entries) {
  Json content = Json::array();
  for (const LogprobEntry& e : entries) {
    Json top = Json::array();
    for (const LogprobToken& t : e.top) {
      top.push_back({{"token", LogprobTokenText(t.bytes)},
                     {"logprob", LogprobNumber(t.logprob)},
                     {"bytes", BytesJson(t.bytes)}});
    }
    content.push_back({{"token", LogprobTokenText(e.chosen.bytes)},
                       {"logprob", LogprobNumber(e.chosen.logprob)},
                       {"bytes", BytesJson(e.chosen.bytes)},
                       {"top_logprobs", std::move(top)}});
  }
  return Json{{"content", std::move(content)}, {"refusal", nullptr}};
}

nlohmann::json CompletionLogprobsJson(const std::vector<LogprobEntry>& entries,
                                      int64_t& text_offset) {
  Json tokens = Json::array(), logprobs = Json::array(), top = Json::array(),
       offsets = Json::array();
  for (const LogprobEntry& e : entries) {
    const std::string text = LogprobTokenText(e.chosen.bytes);
    tokens.push_back(text);
    offsets.push_back(text_offset);
    text_offset += CharacterCount(text);
    if (e.unscored) {
      logprobs.push_back(nullptr);
      top.push_back(nullptr);
      continue;
    }
    logprobs.push_back(LogprobNumber(e.chosen.logprob));
    Json alternatives = Json::object();
    // Two tokens of one string (not possible with distinct valid UTF-8 tokens) keep the first,
    // the more probable.
    for (const LogprobToken& t : e.top) {
      alternatives.emplace(LogprobTokenText(t.bytes), LogprobNumber(t.logprob));
    }
    top.push_back(std::move(alternatives));
  }
  return Json{{"tokens", std::move(tokens)},
              {"token_logprobs", std::move(logprobs)},
              {"top_logprobs", std::move(top)},
              {"text_offset", std::move(offsets)}};
}

nlohmann::json UsageJson(int64_t prompt_tokens, int64_t completion_tokens, int64_t history_tokens) {
  return Json{{"prompt_tokens", prompt_tokens},
              {"completion_tokens", completion_tokens},
              {"total_tokens", prompt_tokens + completion_tokens},
              {"history_tokens", history_tokens}};
}

}  // namespace sdm
