// JSON parsed as nlohmann's parser does, noticing what it accepts silently: a key that appears
// twice in one object, of which it keeps the last value. For files whose every key matters
// (config.json, a weight file's header): a hand-edited duplicate would otherwise change a value
// with no message. Pure function: thread-safe.
#ifndef SDMSERVE_COMMON_JSON_PARSE_H_
#define SDMSERVE_COMMON_JSON_PARSE_H_

#include <string>
#include <string_view>

#include "nlohmann/json.hpp"

namespace sdm {

struct JsonParse {
  nlohmann::json value;       // is_discarded() when the text is not JSON
  std::string duplicate_key;  // the first key repeated within one object; empty: none
  int duplicate_depth = 0;    // that object's nesting depth (1: the top-level object)
};

// Memory and work are linear in the text whatever its nesting (no recursion).
JsonParse ParseJsonNoticingDuplicateKeys(std::string_view text);

}  // namespace sdm

#endif  // SDMSERVE_COMMON_JSON_PARSE_H_
