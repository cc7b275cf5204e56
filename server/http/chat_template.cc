#include "server/http/chat_template.h"

#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "nlohmann/json.hpp"
#include "server/service.h"

namespace sdm {

absl::StatusOr<ChatTemplate> ChatTemplate::FromJson(absl::string_view json,
                                                    absl::string_view source) {
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": a chat template must be a JSON object"));
  }
  ChatTemplate t;
  for (const auto& [key, out] : {std::pair<const char*, std::string*>{"message", &t.message},
                                 {"generation_prompt", &t.generation_prompt},
                                 {"continuation_prefix", &t.continuation_prefix}}) {
    if (!j.contains(key)) continue;
    if (!j[key].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": '", key, "' must be a string"));
    }
    *out = j[key].get<std::string>();
  }
  if (j.contains("stop")) {
    const nlohmann::json& stop = j["stop"];
    if (!stop.is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": 'stop' must be an array of strings"));
    }
    // Every chat request carries these, within the limits of the request's own (the service's):
    // past them, every chat completion would be refused, so the template is refused instead.
    if (stop.size() > static_cast<size_t>(kMaxStopStrings)) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": 'stop' has ", stop.size(), " strings; at most ", kMaxStopStrings,
                       " are allowed (a chat request's and the template's together)"));
    }
    t.stop.clear();
    for (size_t i = 0; i < stop.size(); ++i) {
      if (!stop[i].is_string() || stop[i].get<std::string>().empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": 'stop' must be an array of non-empty strings"));
      }
      const std::string& s = stop[i].get_ref<const std::string&>();
      if (s.size() > kMaxStopStringBytes) {
        return absl::InvalidArgumentError(absl::StrCat(source, ": 'stop'[", i, "] has ", s.size(),
                                                       " bytes; at most ", kMaxStopStringBytes,
                                                       " are allowed"));
      }
      t.stop.push_back(s);
    }
  }
  if (t.message.find("{content}") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": 'message' must contain {content}"));
  }
  return t;
}

absl::StatusOr<ChatTemplate> ChatTemplate::FromFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return absl::NotFoundError(absl::StrCat("cannot read the chat template ", path.string()));
  std::ostringstream text;
  text << in.rdbuf();
  return FromJson(text.str(), path.string());
}

absl::StatusOr<ChatTemplate> ChatTemplate::Resolve(const std::filesystem::path& flag_path,
                                                   const std::filesystem::path& model_dir) {
  if (!flag_path.empty()) return FromFile(flag_path);
  const std::filesystem::path in_model = model_dir / kChatTemplateFileName;
  std::error_code ec;
  if (std::filesystem::exists(in_model, ec)) return FromFile(in_model);
  return ChatTemplate();
}

std::string ChatTemplate::Render(std::span<const ChatMessage> messages, bool continuing) const {
  std::string out = continuing ? continuation_prefix : "";
  for (const ChatMessage& m : messages) {
    std::string role_cap = m.role;
    if (!role_cap.empty()) role_cap[0] = absl::ascii_toupper(role_cap[0]);
    // One pass, so that a message containing "{role}" is not expanded itself.
    absl::StrAppend(
        &out, absl::StrReplaceAll(
                  message, {{"{Role}", role_cap}, {"{role}", m.role}, {"{content}", m.content}}));
  }
  absl::StrAppend(&out, generation_prompt);
  return out;
}

}  // namespace sdm
