#include "state_store/session_key.h"

#include <set>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/hash/hash.h"
#include "gtest/gtest.h"

namespace sdm {
namespace {

bool IsFileStemAlphabet(const std::string& stem) {
  if (stem.empty() || stem.size() > 128) return false;
  for (char c : stem) {
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
          c == '_' || c == '-')) {
      return false;
    }
  }
  return true;
}

// Pairs whose naive concatenations collide, bare ids that look like the prefixed forms, and
// tenants/ids at their length limits.
std::vector<SessionKey> TrickyKeys() {
  return {
      {"a-b", "c"},
      {"a", "b-c"},
      {"a", "-b-c"},
      {"a-", "b-c"},
      {"1-a", "b"},
      {"1", "a-b"},
      {"11", "a-b"},
      {"a", "1-a-b"},
      {"", "1-a-b"},
      {"", "0--x"},
      {"", "x"},
      {"0", "-x"},
      {"", "h-x"},
      {"", std::string("h-") + std::string(64, 'a')},
      {"", "12"},
      {"x", "y"},
      {"x", "y."},
      {"x.", "y"},
      {std::string(64, 't'), "s"},
      {std::string(64, 't'), std::string(128, 's')},
      {"t", std::string(128, 's')},
      {"t", std::string(127, 's')},
      {std::string(63, 't'), std::string(128, 's')},
      {"", std::string(128, 's')},
  };
}

TEST(SessionKeyTest, NamesWrittenBeforeTypedKeysAreKept) {
  // The server's keys were "<n>-<tenant>-<id>", or "h-" + SHA-256 of that when longer than 128
  // characters; store users without tenants named files by the id.
  EXPECT_EQ(SessionFileStem({"default", "chat-1"}), "7-default-chat-1");
  const std::string longest_readable(128 - 4, 'x');  // "1-t-" + id
  EXPECT_EQ(SessionFileStem({"t", longest_readable}), "1-t-" + longest_readable);
  // sha256sum of "1-t-" followed by 125 'x'.
  EXPECT_EQ(SessionFileStem({"t", longest_readable + "x"}),
            "h-672e651a4eabe51a10defe7d98535428f321a1b98e2654008c25177d9e75a9a4");
  EXPECT_EQ(SessionFileStem(SessionKey("victim")), "victim");
  EXPECT_EQ(SessionFileStem("s"), "s");
}

TEST(SessionKeyTest, DistinctKeysStayDistinctEverywhere) {
  std::set<SessionKey> ordered;
  std::unordered_set<SessionKey, absl::Hash<SessionKey>> hashed;
  std::set<std::string> stems, record_ids;
  for (const SessionKey& key : TrickyKeys()) {
    ASSERT_TRUE(ValidateSessionKey(key).ok()) << DebugString(key);
    EXPECT_TRUE(ordered.insert(key).second) << DebugString(key);
    EXPECT_TRUE(hashed.insert(key).second) << DebugString(key);
    const std::string stem = SessionFileStem(key);
    EXPECT_TRUE(IsFileStemAlphabet(stem)) << stem;
    EXPECT_TRUE(stems.insert(stem).second) << DebugString(key) << " -> " << stem;
    const std::string record_id = SessionRecordId(key);
    EXPECT_TRUE(record_ids.insert(record_id).second) << DebugString(key) << " -> " << record_id;
    // The record id names the key back; a hashed stem only says it is one.
    absl::StatusOr<SessionKey> parsed = ParseSessionRecordId(record_id);
    ASSERT_TRUE(parsed.ok()) << record_id << ": " << parsed.status();
    EXPECT_EQ(*parsed, key) << record_id;
    EXPECT_EQ(IsHashedFileStem(stem), stem != record_id) << stem;
  }
}

TEST(SessionKeyTest, OrderedByTenantThenId) {
  EXPECT_LT(SessionKey("a", "z"), SessionKey("b", "a"));
  EXPECT_LT(SessionKey("a", "a"), SessionKey("a", "b"));
  EXPECT_LT(SessionKey("", "z"), SessionKey("a", "a"));
  EXPECT_NE(SessionKey("a", "b-c"), SessionKey("a-b", "c"));
}

TEST(SessionKeyTest, BadKeysAndRecordIds) {
  for (const SessionKey& bad :
       {SessionKey("", ""), SessionKey("t", ""), SessionKey("t", std::string(129, 's')),
        SessionKey(std::string(65, 't'), "s"), SessionKey("t/u", "s"), SessionKey("t", "a b")}) {
    EXPECT_EQ(ValidateSessionKey(bad).code(), absl::StatusCode::kInvalidArgument)
        << DebugString(bad);
  }
  // Non-canonical spellings of valid keys, and strings that are no key's record id.
  for (const char* bad : {"0--x", "01-t-x", "1-t", "1-tx", "5-ab-c", "", "a/b", "1-t-"}) {
    EXPECT_FALSE(ParseSessionRecordId(bad).ok()) << bad;
  }
  EXPECT_FALSE(IsHashedFileStem("h-abc"));
  EXPECT_FALSE(IsHashedFileStem(std::string("h-") + std::string(64, 'G')));
  EXPECT_TRUE(IsHashedFileStem(std::string("h-") + std::string(64, 'f')));
}

}  // namespace
}  // namespace sdm
