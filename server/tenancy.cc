#include "server/tenancy.h"

#include <openssl/sha.h>

#include <cstdint>
#include <random>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace sdm {
namespace {

bool IsIdChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

std::string Sha256Hex(absl::string_view bytes) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), sizeof(digest)));
}

// The selector in a canonical form (the map is ordered; lengths make it unambiguous), hashed.
std::string SelectorDigest(const Labels& selector) {
  std::string canonical;
  for (const auto& [key, value] : selector) {
    absl::StrAppend(&canonical, key.size(), ":", key, value.size(), ":", value);
  }
  return Sha256Hex(canonical).substr(0, 16);
}

constexpr absl::string_view kPageTokenVersion = "p1";

}  // namespace

absl::Status ValidateSessionId(absl::string_view id, absl::string_view field) {
  bool ok = !id.empty() && id.size() <= kMaxSessionIdLength;
  for (char c : id) ok = ok && IsIdChar(c);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " '", absl::CHexEscape(id.substr(0, 200)),
                   "' is invalid: use 1 to 128 characters of letters, digits, '.', '_' and '-'"));
}

absl::Status ValidateLabels(const Labels& labels, absl::string_view field) {
  if (labels.size() > kMaxLabels) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": at most ", kMaxLabels, " labels are allowed, got ", labels.size()));
  }
  for (const auto& [key, value] : labels) {
    bool ok = !key.empty() && key.size() <= kMaxLabelKeyLength && key[0] >= 'a' && key[0] <= 'z';
    for (char c : key) {
      ok = ok &&
           ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-');
    }
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": key '", absl::CHexEscape(key.substr(0, 100)),
          "' is invalid: use 1 to 63 characters of [a-z0-9_.-], starting with a letter"));
    }
    if (value.size() > kMaxLabelValueBytes) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": the value of '", key, "' has ",
                                                     value.size(), " bytes; at most ",
                                                     kMaxLabelValueBytes, " are allowed"));
    }
  }
  return absl::OkStatus();
}

absl::Time SessionCreateTimeNow() { return absl::FromUnixMillis(absl::ToUnixMillis(absl::Now())); }

std::string EncodeSessionMetadata(const SessionMetadata& metadata) {
  nlohmann::json j;
  j["v"] = 1;
  j["tenant"] = metadata.tenant;
  j["id"] = metadata.id;
  j["labels"] = nlohmann::json::object();
  for (const auto& [key, value] : metadata.labels) j["labels"][key] = value;
  j["create_ms"] = absl::ToUnixMillis(metadata.create_time);
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

absl::StatusOr<SessionMetadata> DecodeSessionMetadata(absl::string_view text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  const auto bad = [] { return absl::InvalidArgumentError("not session metadata of sdmserve"); };
  if (!j.is_object() || !j.contains("v") || j["v"] != 1) return bad();
  if (!j.contains("tenant") || !j["tenant"].is_string() || !j.contains("id") ||
      !j["id"].is_string() || !j.contains("labels") || !j["labels"].is_object() ||
      !j.contains("create_ms") || !j["create_ms"].is_number_integer()) {
    return bad();
  }
  SessionMetadata m;
  m.tenant = j["tenant"].get<std::string>();
  m.id = j["id"].get<std::string>();
  for (const auto& [key, value] : j["labels"].items()) {
    if (!value.is_string()) return bad();
    m.labels[key] = value.get<std::string>();
  }
  m.create_time = absl::FromUnixMillis(j["create_ms"].get<int64_t>());
  return m;
}

std::optional<SessionKey> SessionKeyOfMetadata(absl::string_view text) {
  absl::StatusOr<SessionMetadata> metadata = DecodeSessionMetadata(text);
  if (!metadata.ok()) return std::nullopt;
  return SessionKey(metadata->tenant, metadata->id);
}

std::string EncodePageToken(absl::string_view last_id, const Labels& selector) {
  return absl::WebSafeBase64Escape(
      absl::StrCat(kPageTokenVersion, ":", SelectorDigest(selector), ":", last_id));
}

absl::StatusOr<std::string> DecodePageToken(absl::string_view token, const Labels& selector) {
  std::string raw;
  const auto bad = [] {
    return absl::InvalidArgumentError(
        "page_token is not a token this server returned: pass next_page_token of the previous "
        "page unchanged, or an empty token for the first page");
  };
  if (!absl::WebSafeBase64Unescape(token, &raw)) return bad();
  absl::string_view rest = raw;
  if (!absl::ConsumePrefix(&rest, kPageTokenVersion) || !absl::ConsumePrefix(&rest, ":")) {
    return bad();
  }
  const size_t colon = rest.find(':');
  if (colon == absl::string_view::npos) return bad();
  if (rest.substr(0, colon) != SelectorDigest(selector)) {
    return absl::InvalidArgumentError(
        "page_token was made with another label_selector: page with the same selector, or "
        "start again with an empty token");
  }
  const absl::string_view last_id = rest.substr(colon + 1);
  if (!ValidateSessionId(last_id).ok()) return bad();
  return std::string(last_id);
}

std::string NewSessionId() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return absl::StrFormat("s-%016x%08x", rng(), static_cast<uint32_t>(rng()));
}

}  // namespace sdm
