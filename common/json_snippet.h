// A bounded quotation of a JSON value, for error messages about input that may be hostile
// (config files, weight-file headers, operator files).
//
// nlohmann's dump() recurses once per nesting level, while its parser does not: a value nested a
// million levels deep (two megabytes of '[' and ']') parses fine and then overflows the stack
// when an error message dumps it. JsonSnippet's recursion and work are bounded whatever the
// value. Pure function: thread-safe.
#ifndef SDMSERVE_COMMON_JSON_SNIPPET_H_
#define SDMSERVE_COMMON_JSON_SNIPPET_H_

#include <cstddef>
#include <string>

#include "nlohmann/json_fwd.hpp"

namespace sdm {

// Compact JSON text of `value` (as dump() writes it), with containers nested more than
// kJsonSnippetDepth levels written "[...]" / "{...}", cut to at most `max_chars` bytes: a cut
// text ends in "..." and never splits a UTF-8 sequence. Bytes that are not UTF-8 are replaced
// (U+FFFD) rather than thrown about.
inline constexpr int kJsonSnippetDepth = 8;
std::string JsonSnippet(const nlohmann::json& value, size_t max_chars = 80);

}  // namespace sdm

#endif  // SDMSERVE_COMMON_JSON_SNIPPET_H_
