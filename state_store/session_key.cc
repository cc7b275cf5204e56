#include "state_store/session_key.h"

#include <openssl/sha.h>

#include <cstdint>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace sdm {
namespace {

bool IsKeyChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
}

bool ValidChars(absl::string_view s) {
  for (char c : s) {
    if (!IsKeyChar(c)) return false;
  }
  return true;
}

// Length of the run of decimal digits `s` starts with.
size_t LeadingDigits(absl::string_view s) {
  size_t n = 0;
  while (n < s.size() && absl::ascii_isdigit(static_cast<unsigned char>(s[n]))) ++n;
  return n;
}

// Whether a bare id could be read as one of the other forms: "<digits>-..." or "h-...".
bool LooksPrefixed(absl::string_view id) {
  const size_t digits = LeadingDigits(id);
  return (digits > 0 && digits < id.size() && id[digits] == '-') || absl::StartsWith(id, "h-");
}

std::string Sha256Hex(absl::string_view bytes) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), sizeof(digest)));
}

absl::Status BadRecordId(absl::string_view record_id) {
  return absl::InvalidArgumentError(absl::StrCat("'", absl::CHexEscape(record_id.substr(0, 300)),
                                                 "' does not name a session key"));
}

}  // namespace

std::string DebugString(const SessionKey& key) {
  return key.tenant.empty() ? key.id : absl::StrCat(key.tenant, "/", key.id);
}

absl::Status ValidateSessionKey(const SessionKey& key) {
  if (key.tenant.size() > kMaxTenantLength || !ValidChars(key.tenant)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tenant '", absl::CHexEscape(key.tenant.substr(0, 100)),
                     "' is invalid: use 0-64 characters of letters, digits, '.', '_', '-'"));
  }
  if (key.id.empty() || key.id.size() > kMaxSessionIdLength || !ValidChars(key.id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("session id '", absl::CHexEscape(key.id.substr(0, 200)),
                     "' is invalid: use 1-128 characters of letters, digits, '.', '_', '-'"));
  }
  return absl::OkStatus();
}

std::string SessionRecordId(const SessionKey& key) {
  if (key.tenant.empty() && !LooksPrefixed(key.id)) return key.id;
  return absl::StrCat(key.tenant.size(), "-", key.tenant, "-", key.id);
}

std::string SessionFileStem(const SessionKey& key) {
  std::string record_id = SessionRecordId(key);
  if (record_id.size() <= kMaxSessionIdLength) return record_id;
  return absl::StrCat("h-", Sha256Hex(record_id));
}

absl::StatusOr<SessionKey> ParseSessionRecordId(absl::string_view record_id) {
  SessionKey key;
  const size_t digits = LeadingDigits(record_id);
  if (digits > 0 && digits < record_id.size() && record_id[digits] == '-') {
    uint64_t n = 0;
    if (digits > 3 || !absl::SimpleAtoi(record_id.substr(0, digits), &n)) {
      return BadRecordId(record_id);
    }
    const absl::string_view rest = record_id.substr(digits + 1);
    if (rest.size() < n + 1 || rest[n] != '-') return BadRecordId(record_id);
    key.tenant = std::string(rest.substr(0, n));
    key.id = std::string(rest.substr(n + 1));
  } else {
    key.id = std::string(record_id);
  }
  // Rejects bad characters and lengths, and non-canonical spellings ("007-...", "0--plain").
  if (!ValidateSessionKey(key).ok() || SessionRecordId(key) != record_id) {
    return BadRecordId(record_id);
  }
  return key;
}

bool IsHashedFileStem(absl::string_view stem) {
  if (stem.size() != 2 + 2 * SHA256_DIGEST_LENGTH || !absl::StartsWith(stem, "h-")) return false;
  for (char c : stem.substr(2)) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c)) && !(c >= 'a' && c <= 'f')) {
      return false;
    }
  }
  return true;
}

}  // namespace sdm
