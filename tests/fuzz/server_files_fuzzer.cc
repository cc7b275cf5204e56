// libFuzzer target for the server's small input files and what a caller sends to be identified:
// the API key file and the `authorization` metadata (server/auth.h), the tenant limits file and
// byte sizes (server/tenant_limits.h). Any input must give an error or a valid result, never a
// crash or undefined behaviour (built with ASan and UBSan; see scripts/fuzz.sh).
//
// Input: one mode byte, then the text; mode % 4 selects:
//   0: a key file (ApiKeyAuthenticator::FromText). When it loads, every line of two fields that
//      is not a comment is a key the authenticator maps to that line's tenant ("Bearer KEY",
//      the scheme in any case), and a key it does not hold is UNAUTHENTICATED.
//   1: an `authorization` value, against a fixed key file: UNAUTHENTICATED or one of its tenants.
//   2: a tenant limits file (TenantLimitsConfig::Parse). When it loads, every limit is >= 0, and
//      a tenant named in it gets its own entry over the default.
//   3: a byte size (ParseByteSize): >= 0 when it parses, and FormatByteSize of it parses back to
//      the same number.
//
// `server_files_fuzzer --write-seeds=DIR` writes a seed corpus of valid inputs to DIR and exits.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "server/auth.h"
#include "server/tenant_limits.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using namespace sdm::fuzz;  // NOLINT: the fuzzers' shared helpers

constexpr char kFixedKeys[] =
    "# key tenant\n"
    "sk-aaaaaaaaaaaaaaaaaaaaaaaa research\n"
    "sk-bbbbbbbbbbbbbbbbbbbbbbbb research\n"
    "sk-cccccccccccccccccccccccc support\n";

void CheckKeyFile(const std::string& text) {
  absl::StatusOr<sdm::ApiKeyAuthenticator> auth = sdm::ApiKeyAuthenticator::FromText(text, "keys");
  if (!auth.ok()) {
    if (auth.status().code() != absl::StatusCode::kInvalidArgument) Fail("not INVALID_ARGUMENT");
    return;
  }
  if (!auth->enabled() || auth->num_keys() == 0 || auth->tenants().empty()) Fail("no keys");
  std::map<std::string, std::string> tenant_of;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    const std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() != 2) Fail("a loaded file has a line that is not two fields");
    if (!tenant_of.emplace(fields[0], fields[1]).second) Fail("a key given twice was accepted");
  }
  if (tenant_of.size() != auth->num_keys()) Fail("keys counted differently");
  for (const auto& [key, want] : tenant_of) {
    for (const char* scheme : {"Bearer ", "bearer\t", "  BEARER   "}) {
      absl::StatusOr<std::string> tenant =
          auth->TenantFor(scheme + key, sdm::KeyCarrier::kGrpcMetadata);
      if (!tenant.ok() || *tenant != want) Fail("a key of the file is not its tenant's");
    }
    const std::string other = "x" + key;  // another key, unless the file has it too
    if (tenant_of.count(other) == 0 &&
        auth->TenantFor("Bearer " + other, sdm::KeyCarrier::kGrpcMetadata).status().code() !=
            absl::StatusCode::kUnauthenticated) {
      Fail("a key not in the file is accepted");
    }
  }
}

void CheckAuthorization(const std::string& value) {
  static const sdm::ApiKeyAuthenticator auth = *sdm::ApiKeyAuthenticator::FromText(kFixedKeys);
  absl::StatusOr<std::string> tenant = auth.TenantFor(value, sdm::KeyCarrier::kGrpcMetadata);
  if (!tenant.ok()) {
    if (tenant.status().code() != absl::StatusCode::kUnauthenticated) Fail("not UNAUTHENTICATED");
    if (tenant.status().message().find("sk-") != std::string::npos) Fail("an error names a key");
    return;
  }
  if (*tenant != "research" && *tenant != "support") Fail("an unknown tenant");
}

void CheckLimits(const std::string& text) {
  absl::StatusOr<sdm::TenantLimitsConfig> config = sdm::TenantLimitsConfig::Parse(text);
  if (!config.ok()) {
    if (config.status().code() != absl::StatusCode::kInvalidArgument) Fail("not INVALID_ARGUMENT");
    return;
  }
  const auto check = [](const sdm::TenantLimits& l) {
    if (l.max_sessions.value_or(0) < 0 || l.max_state_bytes.value_or(0) < 0) {
      Fail("a negative limit");
    }
    // Admit must not overflow whatever the usage.
    (void)l.Admit("t", INT64_MAX, INT64_MAX, true);
    (void)l.Admit("t", 0, 0, false);
  };
  check(config->default_limits());
  for (const char* tenant : {"default", "research", "trial", "a"}) check(config->For(tenant));
}

void CheckByteSize(const std::string& text) {
  absl::StatusOr<int64_t> bytes = sdm::ParseByteSize(text);
  if (!bytes.ok()) {
    if (bytes.status().code() != absl::StatusCode::kInvalidArgument) Fail("not INVALID_ARGUMENT");
    return;
  }
  if (*bytes < 0) Fail("a negative byte size");
  absl::StatusOr<int64_t> again = sdm::ParseByteSize(sdm::FormatByteSize(*bytes));
  if (!again.ok() || *again != *bytes) Fail("FormatByteSize does not parse back");
}

void Run(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0:
      return CheckKeyFile(text);
    case 1:
      return CheckAuthorization(text);
    case 2:
      return CheckLimits(text);
    default:
      return CheckByteSize(text);
  }
}

int WriteSeeds(const std::filesystem::path& dir) {
  SeedWriter seeds(dir);
  const auto add = [&](char mode, const std::string& text) {
    Run(reinterpret_cast<const uint8_t*>((std::string(1, mode) + text).data()), text.size() + 1);
    seeds.Add(std::string(1, mode) + text);
  };
  add(0, kFixedKeys);
  add(0, "sk-0123456789abcdef\tt1\r\n\n## comment\n#\n  sk-fedcba9876543210  t.2_x-y  \n");
  add(1, "Bearer sk-aaaaaaaaaaaaaaaaaaaaaaaa");
  add(1, "  bearer\tsk-cccccccccccccccccccccccc ");
  add(1, "Bearer sk-unknown-unknown-unknown");
  add(2, R"({"default": {"max_sessions": 100, "max_state_bytes": "64GiB"},)"
         R"( "tenants": {"research": {"max_sessions": 1000, "max_state_bytes": null},)"
         R"( "trial": {"max_sessions": 2, "max_state_bytes": 1048576}}})");
  add(2, "{}");
  add(3, "64GiB");
  add(3, " 1000 KB ");
  add(3, "9223372036854775807");
  return seeds.Finish();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  return sdm::fuzz::InitializeFuzzer(argc, argv, WriteSeeds);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Run(data, size);
  return 0;
}
