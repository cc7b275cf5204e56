#include "server/auth.h"

#include <cstdint>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace sdm {
namespace {

constexpr size_t kMinKeyLength = 16;
constexpr size_t kMaxKeyLength = 4096;
constexpr size_t kMaxTenantLength = 64;

bool IsKeyCharacter(char c) { return c >= 0x21 && c <= 0x7e; }

// Whether a == b, in a time that depends on the sizes only, never on the contents: every byte
// of `stored` is compared and the differences are OR-ed together, without an early exit.
bool ConstantTimeEquals(absl::string_view stored, absl::string_view presented) {
  volatile uint8_t difference = stored.size() == presented.size() ? 0 : 1;
  for (size_t i = 0; i < stored.size(); ++i) {
    const uint8_t other = i < presented.size() ? static_cast<uint8_t>(presented[i]) : 0;
    difference = difference | (static_cast<uint8_t>(stored[i]) ^ other);
  }
  return difference == 0;
}

absl::Status LineError(absl::string_view source, int line, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(source, ":", line, ": ", problem));
}

}  // namespace

bool IsValidTenantName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxTenantLength) return false;
  for (const char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

absl::StatusOr<ApiKeyAuthenticator> ApiKeyAuthenticator::FromText(absl::string_view text,
                                                                  absl::string_view source) {
  ApiKeyAuthenticator result;
  std::map<std::string, int> line_of_key;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);  // also a '\r' of CRLF files
    if (line.empty()) continue;
    const std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (line[0] == '#') {
      // A comment, unless it has the shape of a key line: a key beginning with '#' would
      // otherwise be dropped without a word, and its tenant locked out.
      if (line.size() > 1 && line[1] != '#' && line[1] != ' ' && line[1] != '\t' &&
          fields.size() == 2 && fields[0].size() >= kMinKeyLength && IsValidTenantName(fields[1])) {
        return LineError(source, line_number,
                         "this line reads as a comment, but has the shape of 'KEY TENANT' with a "
                         "key beginning with '#': keys cannot begin with '#'; start comments "
                         "with '# ' (a space after the '#')");
      }
      continue;
    }
    if (fields.size() != 2) {
      return LineError(source, line_number,
                       absl::StrCat("expected 'KEY TENANT', got ", fields.size(), " fields"));
    }
    const absl::string_view key = fields[0];
    const absl::string_view tenant = fields[1];
    if (key.size() < kMinKeyLength || key.size() > kMaxKeyLength) {
      return LineError(source, line_number,
                       absl::StrCat("the key has ", key.size(), " characters; keys need ",
                                    kMinKeyLength, " to ", kMaxKeyLength));
    }
    for (const char c : key) {
      if (!IsKeyCharacter(c)) {
        return LineError(source, line_number,
                         "the key has a character that is not printable ASCII");
      }
    }
    if (!IsValidTenantName(tenant)) {
      return LineError(
          source, line_number,
          absl::StrCat("tenant name '", tenant, "' is not 1 to 64 characters of [A-Za-z0-9._-]"));
    }
    const auto [it, inserted] = line_of_key.emplace(std::string(key), line_number);
    if (!inserted) {
      return LineError(
          source, line_number,
          absl::StrCat("the same key as on line ", it->second, " (keys must be unique)"));
    }
    result.entries_.push_back({std::string(key), std::string(tenant)});
  }
  if (result.entries_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source,
                     ": no keys (expected lines 'KEY TENANT'); without a key file every "
                     "caller is the tenant 'default'"));
  }
  return result;
}

absl::StatusOr<ApiKeyAuthenticator> ApiKeyAuthenticator::FromFile(
    const std::filesystem::path& path) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    return absl::NotFoundError(absl::StrCat("API key file ", path.string(), " does not exist"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::PermissionDeniedError(
        absl::StrCat("API key file ", path.string(), " cannot be read"));
  }
  std::stringstream text;
  text << in.rdbuf();
  return FromText(text.str(), path.string());
}

absl::StatusOr<std::string> ApiKeyAuthenticator::TenantFor(absl::string_view authorization,
                                                           KeyCarrier carrier) const {
  if (entries_.empty()) return std::string(kDefaultTenant);
  // What carries the key, in the caller's terms (gRPC's metadata keys are lower case).
  const bool grpc = carrier == KeyCarrier::kGrpcMetadata;
  const absl::string_view carrier_noun = grpc ? "metadata" : "header";
  const absl::string_view carrier_name = grpc ? "authorization" : "Authorization";
  authorization = absl::StripAsciiWhitespace(authorization);
  if (authorization.empty()) {
    return absl::UnauthenticatedError(absl::StrCat("missing API key: send the ", carrier_noun, " '",
                                                   carrier_name, ": Bearer <key>'"));
  }
  constexpr absl::string_view kScheme = "bearer";
  const absl::string_view scheme = authorization.substr(0, kScheme.size());
  const absl::string_view key =
      absl::StripLeadingAsciiWhitespace(authorization.substr(scheme.size()));
  const bool separated =
      authorization.size() > kScheme.size() &&
      (authorization[kScheme.size()] == ' ' || authorization[kScheme.size()] == '\t');
  if (!absl::EqualsIgnoreCase(scheme, kScheme) || !separated || key.empty() ||
      absl::StrContains(key, ' ') || absl::StrContains(key, '\t')) {
    return absl::UnauthenticatedError(
        absl::StrCat("malformed ", carrier_name, " ", carrier_noun, ": expected 'Bearer <key>'"));
  }
  // Compare with every key, without stopping at a match.
  const Entry* match = nullptr;
  for (const Entry& entry : entries_) {
    const bool equal = ConstantTimeEquals(entry.key, key);
    match = equal ? &entry : match;
  }
  if (match == nullptr) return absl::UnauthenticatedError("unknown API key");
  return match->tenant;
}

std::vector<std::string> ApiKeyAuthenticator::tenants() const {
  std::set<std::string> names;
  for (const Entry& entry : entries_) names.insert(entry.tenant);
  return std::vector<std::string>(names.begin(), names.end());
}

}  // namespace sdm
