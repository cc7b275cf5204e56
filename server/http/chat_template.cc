#include "server/http/chat_template.h"

#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "nlohmann/json.hpp"

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
    if (!j["stop"].is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": 'stop' must be an array of strings"));
    }
    t.stop.clear();
    for (const auto& s : j["stop"]) {
      if (!s.is_string() || s.get<std::string>().empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": 'stop' must be an array of non-empty strings"));
      }
      t.stop.push_back(s.get<std::string>());
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
