#include "common/json_parse.h"

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace sdm {

JsonParse ParseJsonNoticingDuplicateKeys(std::string_view text) {
  using json = nlohmann::json;
  JsonParse out;
  // Each object open now, by an id of its own (two sibling objects must not share keys), and
  // every (object, key) seen: both linear in the text.
  std::vector<uint64_t> open;
  std::set<std::pair<uint64_t, std::string>> seen;
  uint64_t next_id = 0;
  auto on_event = [&](int, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        open.push_back(next_id++);
        break;
      case json::parse_event_t::object_end:
        if (!open.empty()) open.pop_back();
        break;
      case json::parse_event_t::key:
        if (!open.empty() && out.duplicate_key.empty() &&
            !seen.emplace(open.back(), parsed.get<std::string>()).second) {
          out.duplicate_key = parsed.get<std::string>();
          out.duplicate_depth = static_cast<int>(open.size());
        }
        break;
      default:
        break;
    }
    return true;
  };
  out.value = json::parse(text.begin(), text.end(), on_event, /*allow_exceptions=*/false);
  return out;
}

}  // namespace sdm
