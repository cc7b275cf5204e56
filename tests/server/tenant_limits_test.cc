#include "server/tenant_limits.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace sdm {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kGiB = int64_t{1} << 30;

TenantLimitsConfig Parse(const std::string& json) {
  absl::StatusOr<TenantLimitsConfig> config = TenantLimitsConfig::Parse(json);
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? *config : TenantLimitsConfig();
}

TEST(TenantLimitsTest, StateBytesAreLimitedByDefault) {
  const TenantLimits built_in = {
      .max_sessions = std::nullopt, .max_state_bytes = 64 * kGiB, .max_requests = std::nullopt};
  EXPECT_EQ(kDefaultTenantMaxStateBytes, 64 * kGiB);
  EXPECT_EQ(TenantLimitsConfig().For("anyone"), built_in);
  EXPECT_EQ(Parse("{}").For("anyone"), built_in);
  EXPECT_EQ(Parse(R"({"default": {}, "tenants": {}})").For("anyone"), built_in);
  EXPECT_EQ(Parse(R"({"tenants": {"t": {"max_sessions": 3}}})").For("t").max_state_bytes,
            64 * kGiB);
  // null lifts it.
  const TenantLimits unlimited;
  EXPECT_EQ(Parse(R"({"default": {"max_state_bytes": null}})").For("anyone"), unlimited);
  EXPECT_EQ(Parse(R"({"tenants": {"big": {"max_state_bytes": null}}})").For("big"), unlimited);
  // The built-in limit refuses state past it.
  EXPECT_EQ(TenantLimitsConfig().For("a").Admit("a", 1, 64 * kGiB, false).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(TenantLimitsConfig().For("a").Admit("a", 1, 64 * kGiB - 1, false).ok());
}

TEST(TenantLimitsTest, TenantEntriesOverrideTheDefaultFieldByField) {
  const TenantLimitsConfig config = Parse(R"({
    "default": {"max_sessions": 100, "max_state_bytes": "64GiB", "max_requests": 8},
    "tenants": {
      "research": {"max_sessions": 1000, "max_state_bytes": null, "max_requests": null},
      "trial": {"max_sessions": 2, "max_requests": 1},
      "frozen": {"max_sessions": 0}
    }
  })");
  EXPECT_EQ(config.For("someone").max_requests, 8);
  EXPECT_EQ(config.For("research").max_requests, std::nullopt);  // null: unlimited
  EXPECT_EQ(config.For("trial").max_requests, 1);
  EXPECT_EQ(config.For("frozen").max_requests, 8);                  // left out: the default's
  EXPECT_EQ(Parse("{}").For("anyone").max_requests, std::nullopt);  // unlimited without a file
  EXPECT_EQ(config.For("someone").max_sessions, 100);
  EXPECT_EQ(config.For("someone").max_state_bytes, 64 * kGiB);
  EXPECT_EQ(config.For("research").max_sessions, 1000);
  EXPECT_EQ(config.For("research").max_state_bytes, std::nullopt);  // null: unlimited
  EXPECT_EQ(config.For("trial").max_sessions, 2);
  EXPECT_EQ(config.For("trial").max_state_bytes, 64 * kGiB);  // left out: the default's
  EXPECT_EQ(config.For("frozen").max_sessions, 0);
  // A limit of 0 forbids (no retry can succeed); one above 0 is a retryable RESOURCE_EXHAUSTED.
  EXPECT_EQ(config.For("frozen").Admit("frozen", 0, 0, /*new_session=*/true).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(config.For("frozen").Admit("frozen", 0, 0, /*new_session=*/false).ok());
  EXPECT_EQ(config.For("trial").Admit("trial", 2, 0, /*new_session=*/true).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Parse(R"({"default": {"max_state_bytes": 0}})").For("x").Admit("x", 0, 0, false).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(config.default_limits().max_sessions, 100);
}

// The size, or -1 on error.
int64_t Bytes(const std::string& text) {
  const absl::StatusOr<int64_t> size = ParseByteSize(text);
  return size.ok() ? *size : -1;
}

TEST(TenantLimitsTest, ByteSizes) {
  EXPECT_EQ(Bytes("0"), 0);
  EXPECT_EQ(Bytes("512"), 512);
  EXPECT_EQ(Bytes("512B"), 512);
  EXPECT_EQ(Bytes("2KB"), 2000);
  EXPECT_EQ(Bytes("2KiB"), 2048);
  EXPECT_EQ(Bytes("1 MB"), 1000000);
  EXPECT_EQ(Bytes(" 3 MiB "), 3 << 20);
  EXPECT_EQ(Bytes("64GiB"), 64 * kGiB);
  EXPECT_EQ(Bytes("1TB"), int64_t{1000000000000});
  EXPECT_EQ(Bytes("2TiB"), 2048 * kGiB);
  for (const char* bad : {"", "GiB", "1.5GiB", "-1", "10gb", "10 G", "1e9", "9999999999TiB",
                          "99999999999999999999"}) {
    const absl::StatusOr<int64_t> size = ParseByteSize(bad);
    EXPECT_FALSE(size.ok()) << bad;
    EXPECT_EQ(size.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_THAT(ParseByteSize("10gb").status().message(), HasSubstr("unknown unit 'gb'"));
}

TEST(TenantLimitsTest, ByteSizesInTheFile) {
  EXPECT_EQ(Parse(R"({"default": {"max_state_bytes": 1073741824}})").For("x").max_state_bytes,
            kGiB);
  EXPECT_EQ(Parse(R"({"default": {"max_state_bytes": "512 MiB"}})").For("x").max_state_bytes,
            512 << 20);
}

TEST(TenantLimitsTest, ErrorsNameTheField) {
  auto expect_error = [](const std::string& json, const std::string& why) {
    const absl::StatusOr<TenantLimitsConfig> config = TenantLimitsConfig::Parse(json);
    ASSERT_FALSE(config.ok()) << json;
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << json;
    EXPECT_THAT(config.status().message(), HasSubstr(why)) << json;
  };
  expect_error("{", "not valid JSON");
  expect_error("[]", "expected an object");
  expect_error(R"({"defaults": {}})", "defaults: unknown field");
  expect_error(R"({"default": {"max_session": 3}})", "default.max_session: unknown field");
  expect_error(R"({"default": {"max_sessions": -1}})", "default.max_sessions: must be an integer");
  expect_error(R"({"default": {"max_sessions": 1.5}})", "default.max_sessions: expected");
  expect_error(R"({"default": {"max_sessions": "10"}})", "default.max_sessions: expected");
  expect_error(R"({"default": {"max_sessions": 18446744073709551615}})",
               "default.max_sessions: must be an integer");
  expect_error(R"({"default": {"max_state_bytes": "lots"}})", "default.max_state_bytes:");
  expect_error(R"({"default": {"max_state_bytes": true}})", "default.max_state_bytes: expected");
  expect_error(R"({"default": {"max_requests": -1}})", "default.max_requests: must be an integer");
  expect_error(R"({"default": {"max_requests": "5GiB"}})", "default.max_requests: expected");
  expect_error(R"({"default": {"max_request": 3}})",
               "unknown field (known: max_sessions, max_state_bytes, max_requests)");
  expect_error(R"({"default": 5})", "default: expected an object");
  expect_error(R"({"tenants": []})", "tenants: expected an object");
  expect_error(R"({"tenants": {"bad name": {}}})", "'bad name' is not a tenant name");
  expect_error(R"({"tenants": {"trial": {"max_sessions": -2}}})", "tenants.trial.max_sessions");
}

// nlohmann parses nesting iteratively but dumps it recursively: an error message that quoted a
// deeply nested value whole overflowed the stack. Each place that quotes a value gets one.
TEST(TenantLimitsTest, DeeplyNestedValuesAreRejectedWithoutRecursion) {
  const std::string deep = std::string(1'000'000, '[') + std::string(1'000'000, ']');
  for (const std::string& json :
       {R"({"default": )" + deep + "}", R"({"default": {"max_sessions": )" + deep + "}}",
        R"({"tenants": {"trial": {"max_state_bytes": )" + deep + "}}}"}) {
    const absl::StatusOr<TenantLimitsConfig> config = TenantLimitsConfig::Parse(json);
    ASSERT_FALSE(config.ok());
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << config.status();
    EXPECT_THAT(config.status().message(), HasSubstr("expected"));
    EXPECT_LT(config.status().message().size(), 300u) << config.status();
  }
}

TEST(TenantLimitsTest, FromFile) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("sdm_limits_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::filesystem::path path = dir / "limits.json";
  {
    std::ofstream out(path);
    out << R"({"tenants": {"trial": {"max_sessions": 2}}})";
  }
  absl::StatusOr<TenantLimitsConfig> config = TenantLimitsConfig::FromFile(path);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->For("trial").max_sessions, 2);
  EXPECT_EQ(config->For("other").max_sessions, std::nullopt);

  {
    std::ofstream out(path);
    out << R"({"tenants": {"trial": {"max_sesions": 2}}})";
  }
  const absl::Status bad = TenantLimitsConfig::FromFile(path).status();
  EXPECT_THAT(bad.message(), HasSubstr(path.string() + ": tenants.trial.max_sesions"));
  EXPECT_EQ(TenantLimitsConfig::FromFile(dir / "absent.json").status().code(),
            absl::StatusCode::kNotFound);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace sdm
