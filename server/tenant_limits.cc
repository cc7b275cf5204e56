#include "server/tenant_limits.h"

#include <cstdint>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/json_snippet.h"
#include "nlohmann/json.hpp"
#include "server/auth.h"

namespace sdm {
namespace {

using json = nlohmann::json;

struct Unit {
  const char* name;
  int64_t multiplier;
};

constexpr Unit kUnits[] = {
    {"", 1},
    {"B", 1},
    {"KB", 1000},
    {"MB", 1000 * 1000},
    {"GB", int64_t{1000} * 1000 * 1000},
    {"TB", int64_t{1000} * 1000 * 1000 * 1000},
    {"KiB", int64_t{1} << 10},
    {"MiB", int64_t{1} << 20},
    {"GiB", int64_t{1} << 30},
    {"TiB", int64_t{1} << 40},
};

// A limit: a non-negative integer (or, with `byte_size`, a size string); null is unlimited.
absl::StatusOr<std::optional<int64_t>> ParseLimit(const json& value, const std::string& field,
                                                  bool byte_size) {
  if (value.is_null()) return std::optional<int64_t>();
  if (value.is_number_integer()) {
    // Also catches unsigned values above int64 (stored as unsigned, read back negative).
    const bool negative =
        value.is_number_unsigned() ? value.get<uint64_t>() > INT64_MAX : value.get<int64_t>() < 0;
    if (negative) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": must be an integer in [0, 2^63), got ", JsonSnippet(value)));
    }
    return std::optional<int64_t>(value.get<int64_t>());
  }
  if (byte_size && value.is_string()) {
    absl::StatusOr<int64_t> bytes = ParseByteSize(value.get<std::string>());
    if (!bytes.ok())
      return absl::InvalidArgumentError(absl::StrCat(field, ": ", bytes.status().message()));
    return std::optional<int64_t>(*bytes);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": expected ",
      byte_size ? "a byte size (e.g. 68719476736 or \"64GiB\")" : "a non-negative integer",
      " or null, got ", JsonSnippet(value)));
}

// Applies the fields present in `object` to `limits`.
absl::Status ApplyLimits(const json& object, const std::string& path, TenantLimits& limits) {
  if (!object.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": expected an object like {\"max_sessions\": 10}, got ", JsonSnippet(object)));
  }
  for (const auto& [key, value] : object.items()) {
    const std::string field = absl::StrCat(path, ".", key);
    if (key == "max_sessions") {
      absl::StatusOr<std::optional<int64_t>> limit = ParseLimit(value, field, false);
      if (!limit.ok()) return limit.status();
      limits.max_sessions = *limit;
    } else if (key == "max_state_bytes") {
      absl::StatusOr<std::optional<int64_t>> limit = ParseLimit(value, field, true);
      if (!limit.ok()) return limit.status();
      limits.max_state_bytes = *limit;
    } else if (key == "max_requests") {
      absl::StatusOr<std::optional<int64_t>> limit = ParseLimit(value, field, false);
      if (!limit.ok()) return limit.status();
      limits.max_requests = *limit;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": unknown field (known: max_sessions, max_state_bytes, max_requests)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> ParseByteSize(absl::string_view text) {
  const absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  size_t digits = 0;
  while (digits < trimmed.size() &&
         absl::ascii_isdigit(static_cast<unsigned char>(trimmed[digits]))) {
    ++digits;
  }
  const absl::string_view unit = absl::StripLeadingAsciiWhitespace(trimmed.substr(digits));
  int64_t number = 0;
  if (digits == 0 || !absl::SimpleAtoi(trimmed.substr(0, digits), &number)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text,
        "' is not a byte size: expected an integer and an optional unit (B, KB, MB, GB, "
        "TB, KiB, MiB, GiB, TiB)"));
  }
  for (const Unit& known : kUnits) {
    if (unit != known.name) continue;
    if (number > std::numeric_limits<int64_t>::max() / known.multiplier) {
      return absl::InvalidArgumentError(absl::StrCat("'", text, "' is too large"));
    }
    return number * known.multiplier;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("'", text, "': unknown unit '", unit,
                   "' (known: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; case matters)"));
}

namespace {
constexpr absl::string_view kTenantLimitPayload = "sdmserve/tenant-limit";
}  // namespace

absl::Status RefusedByTenantLimit(absl::Status refusal, absl::string_view limit) {
  refusal.SetPayload(kTenantLimitPayload, absl::Cord(limit));
  return refusal;
}

std::string RefusingTenantLimit(const absl::Status& status) {
  const auto limit = status.GetPayload(kTenantLimitPayload);  // absl::optional
  return limit.has_value() ? std::string(*limit) : std::string();
}

std::string FormatByteSize(int64_t bytes) {
  // The binary units, largest first: the last four of kUnits.
  for (auto unit = std::rbegin(kUnits); unit != std::rbegin(kUnits) + 4; ++unit) {
    if (bytes != 0 && bytes % unit->multiplier == 0) {
      return absl::StrCat(bytes / unit->multiplier, unit->name);
    }
  }
  return absl::StrCat(bytes);
}

absl::StatusOr<TenantLimitsConfig> TenantLimitsConfig::Parse(absl::string_view json_text) {
  const json root = json::parse(json_text.begin(), json_text.end(), nullptr,
                                /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return absl::InvalidArgumentError("tenant limits: not valid JSON");
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        "tenant limits: expected an object with \"default\" and/or \"tenants\"");
  }
  TenantLimitsConfig config;
  if (root.contains("default")) {
    if (absl::Status status = ApplyLimits(root["default"], "default", config.default_);
        !status.ok()) {
      return status;
    }
  }
  for (const auto& [key, value] : root.items()) {
    if (key != "default" && key != "tenants") {
      return absl::InvalidArgumentError(
          absl::StrCat(key, ": unknown field (known: default, tenants)"));
    }
  }
  if (root.contains("tenants")) {
    const json& tenants = root["tenants"];
    if (!tenants.is_object()) {
      return absl::InvalidArgumentError(
          "tenants: expected an object mapping tenant names to limits");
    }
    for (const auto& [tenant, value] : tenants.items()) {
      if (!IsValidTenantName(tenant)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tenants: '", tenant, "' is not a tenant name (1 to 64 characters of [A-Za-z0-9._-])"));
      }
      TenantLimits limits = config.default_;
      if (absl::Status status = ApplyLimits(value, absl::StrCat("tenants.", tenant), limits);
          !status.ok()) {
        return status;
      }
      config.tenants_.emplace(tenant, limits);
    }
  }
  return config;
}

absl::StatusOr<TenantLimitsConfig> TenantLimitsConfig::FromFile(const std::filesystem::path& path) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    return absl::NotFoundError(
        absl::StrCat("tenant limits file ", path.string(), " does not exist"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::PermissionDeniedError(
        absl::StrCat("tenant limits file ", path.string(), " cannot be read"));
  }
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<TenantLimitsConfig> config = Parse(text.str());
  if (!config.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": ", config.status().message()));
  }
  return config;
}

absl::Status TenantLimits::Admit(absl::string_view tenant, int64_t sessions, int64_t state_bytes,
                                 bool new_session) const {
  // A limit of 0 forbids: no retry would succeed, so it is not the retryable RESOURCE_EXHAUSTED.
  if (new_session && max_sessions == 0) {
    return RefusedByTenantLimit(
        absl::PermissionDeniedError(
            absl::StrCat("tenant '", tenant, "' may not create sessions (its max_sessions is 0)")),
        "max_sessions");
  }
  if (max_state_bytes == 0) {
    return RefusedByTenantLimit(
        absl::PermissionDeniedError(absl::StrCat(
            "tenant '", tenant, "' may not hold session state (its max_state_bytes is 0)")),
        "max_state_bytes");
  }
  if (new_session && max_sessions.has_value() && sessions >= *max_sessions) {
    return RefusedByTenantLimit(
        absl::ResourceExhaustedError(absl::StrCat(
            "tenant '", tenant, "' has ", sessions, " sessions, its limit (max_sessions ",
            *max_sessions, "): delete sessions it no longer needs, then retry")),
        "max_sessions");
  }
  if (max_state_bytes.has_value() && state_bytes >= *max_state_bytes) {
    return RefusedByTenantLimit(
        absl::ResourceExhaustedError(
            absl::StrCat("tenant '", tenant, "' holds ", state_bytes,
                         " bytes of session state, at or over its limit (max_state_bytes ",
                         *max_state_bytes, "): delete sessions it no longer needs, then retry")),
        "max_state_bytes");
  }
  return absl::OkStatus();
}

std::vector<std::string> TenantLimitsConfig::tenant_names() const {
  std::vector<std::string> names;
  for (const auto& [name, limits] : tenants_) names.push_back(name);
  return names;
}

TenantLimits TenantLimitsConfig::For(absl::string_view tenant) const {
  const auto it = tenants_.find(tenant);
  return it == tenants_.end() ? default_ : it->second;
}

}  // namespace sdm
