// ChatTemplate: how the OpenAI chat API's messages become the prompt text of a byte-level model
// (docs/api.md, "Chat template").
//
// The default is plain text, one line per message and a generation prompt:
//
//   System: You are terse.
//   User: Hello
//   Assistant:
//
// i.e. each message is `message` with {Role} (capitalised role), {role} and {content} replaced,
// then `generation_prompt`. A request continuing a session that already holds a conversation
// starts with `continuation_prefix` (the previous reply ended without a newline). `stop` strings
// end a reply where the model starts the next user turn; they are added to the request's own.
//
// A model directory may hold chat_template.json, and --chat_template may name a file, with any
// of these keys (the rest keep their defaults):
//   {"message": "{Role}: {content}\n", "generation_prompt": "Assistant:",
//    "continuation_prefix": "\n", "stop": ["\nUser:"]}
//
// Thread-safety: immutable after creation.
#ifndef SDMSERVE_SERVER_HTTP_CHAT_TEMPLATE_H_
#define SDMSERVE_SERVER_HTTP_CHAT_TEMPLATE_H_

#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace sdm {

struct ChatMessage {
  std::string role;  // system, developer, user, assistant or tool
  std::string content;
};

struct ChatTemplate {
  std::string message = "{Role}: {content}\n";
  std::string generation_prompt = "Assistant:";
  std::string continuation_prefix = "\n";
  std::vector<std::string> stop = {"\nUser:"};

  // The template in `path` (JSON as above). Errors name the file and the key; stop strings past
  // a request's limits (kMaxStopStrings, kMaxStopStringBytes in server/service.h) are refused.
  static absl::StatusOr<ChatTemplate> FromFile(const std::filesystem::path& path);
  static absl::StatusOr<ChatTemplate> FromJson(absl::string_view json, absl::string_view source);

  // `flag_path` when not empty, else MODEL_DIR/chat_template.json when it exists, else the
  // default.
  static absl::StatusOr<ChatTemplate> Resolve(const std::filesystem::path& flag_path,
                                              const std::filesystem::path& model_dir);

  // The prompt text of `messages`; `continuing`: the session already holds earlier turns.
  std::string Render(std::span<const ChatMessage> messages, bool continuing) const;
};

// The file name looked for in a model directory.
inline constexpr char kChatTemplateFileName[] = "chat_template.json";

}  // namespace sdm

#endif  // SDMSERVE_SERVER_HTTP_CHAT_TEMPLATE_H_
