#include "common/json_snippet.h"

#include "nlohmann/json.hpp"

namespace sdm {
namespace {

using json = nlohmann::json;

std::string DumpScalar(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

// Appends `j` to `out` until `out` holds more than `limit` bytes (the caller cuts it to size), so
// a long array or string costs no more than a short one.
void Append(const json& j, int depth, size_t limit, std::string& out) {
  if (j.is_string()) {
    const std::string& s = j.get_ref<const std::string&>();
    // A prefix long enough to fill the snippet (escapes only lengthen it); a sequence cut here
    // becomes U+FFFD, and the snippet is cut before it anyway.
    out += s.size() > limit ? DumpScalar(json(s.substr(0, limit + 1))) : DumpScalar(j);
    return;
  }
  if (!j.is_array() && !j.is_object()) {
    out += DumpScalar(j);
    return;
  }
  const bool array = j.is_array();
  if (j.empty()) {
    out += array ? "[]" : "{}";
    return;
  }
  if (depth >= kJsonSnippetDepth) {
    out += array ? "[...]" : "{...}";
    return;
  }
  out += array ? '[' : '{';
  bool first = true;
  for (auto it = j.begin(); it != j.end() && out.size() <= limit; ++it) {
    if (!first) out += ',';
    first = false;
    if (!array) {
      Append(json(it.key()), depth + 1, limit, out);
      out += ':';
    }
    Append(*it, depth + 1, limit, out);
  }
  out += array ? ']' : '}';
}

}  // namespace

std::string JsonSnippet(const json& value, size_t max_chars) {
  std::string out;
  Append(value, 0, max_chars, out);
  if (out.size() <= max_chars) return out;
  constexpr size_t kEllipsis = 3;
  size_t keep = max_chars > kEllipsis ? max_chars - kEllipsis : 0;
  // Back up to the start of a UTF-8 sequence (continuation bytes are 10xxxxxx).
  while (keep > 0 && (static_cast<unsigned char>(out[keep]) & 0xC0) == 0x80) --keep;
  out.resize(keep);
  return out + "...";
}

}  // namespace sdm
