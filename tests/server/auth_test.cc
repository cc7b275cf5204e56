#include "server/auth.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace sdm {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kResearchKey[] = "sk-4f9c2e7a1b8d6f3e0a5c9b2d7e1f4a8c";
constexpr char kResearchKey2[] = "sk-0b7e3d9a5c1f8e2b6d4a0c9f7e3b1d5a";
constexpr char kSupportKey[] = "sk-9a1c5e3b7d0f2a4c6e8b1d3f5a7c9e0b";

std::string KeyFile() {
  return std::string("# key  tenant\n\n") + kResearchKey + " research\n" + "   " + kResearchKey2 +
         "\tresearch   \r\n" +  // tabs, indentation and CRLF are fine
         "  # an indented comment\n" + kSupportKey + " support";  // no final newline
}

ApiKeyAuthenticator Load(const std::string& text) {
  absl::StatusOr<ApiKeyAuthenticator> auth = ApiKeyAuthenticator::FromText(text, "keys.txt");
  EXPECT_TRUE(auth.ok()) << auth.status();
  return auth.ok() ? *std::move(auth) : ApiKeyAuthenticator();
}

// The tenant, or the error's text (so that tests compare plain strings).
std::string Tenant(const ApiKeyAuthenticator& auth, const std::string& authorization) {
  absl::StatusOr<std::string> tenant = auth.TenantFor(authorization, KeyCarrier::kGrpcMetadata);
  return tenant.ok() ? *tenant : "error: " + tenant.status().ToString();
}

absl::Status LoadError(const std::string& text) {
  return ApiKeyAuthenticator::FromText(text, "keys.txt").status();
}

TEST(ApiKeyAuthenticatorTest, WithoutKeysEveryoneIsTheDefaultTenant) {
  const ApiKeyAuthenticator auth;
  EXPECT_FALSE(auth.enabled());
  EXPECT_EQ(Tenant(auth, ""), "default");
  EXPECT_EQ(Tenant(auth, "Bearer whatever-they-send"), "default");
  EXPECT_EQ(Tenant(auth, "garbage"), "default");
}

TEST(ApiKeyAuthenticatorTest, KeysMapToTheirTenants) {
  const ApiKeyAuthenticator auth = Load(KeyFile());
  EXPECT_TRUE(auth.enabled());
  EXPECT_EQ(auth.num_keys(), 3u);
  EXPECT_THAT(auth.tenants(), ElementsAre("research", "support"));
  EXPECT_EQ(Tenant(auth, std::string("Bearer ") + kResearchKey), "research");
  EXPECT_EQ(Tenant(auth, std::string("Bearer ") + kResearchKey2), "research");
  EXPECT_EQ(Tenant(auth, std::string("Bearer ") + kSupportKey), "support");
  // The scheme in any case; extra spaces around and between.
  EXPECT_EQ(Tenant(auth, std::string("bearer ") + kSupportKey), "support");
  EXPECT_EQ(Tenant(auth, std::string("  BEARER   ") + kSupportKey + "  "), "support");
}

TEST(ApiKeyAuthenticatorTest, RejectionsSayWhyWithoutRepeatingTheKey) {
  const ApiKeyAuthenticator auth = Load(KeyFile());
  auto expect_unauthenticated = [&](const std::string& header, const std::string& why) {
    for (const KeyCarrier carrier : {KeyCarrier::kGrpcMetadata, KeyCarrier::kHttpHeader}) {
      const absl::StatusOr<std::string> tenant = auth.TenantFor(header, carrier);
      ASSERT_FALSE(tenant.ok()) << header;
      EXPECT_EQ(tenant.status().code(), absl::StatusCode::kUnauthenticated) << header;
      EXPECT_THAT(tenant.status().message(), HasSubstr(why)) << header;
      EXPECT_THAT(tenant.status().message(), Not(HasSubstr("sk-"))) << header;
    }
  };
  expect_unauthenticated("", "missing API key");
  expect_unauthenticated("   ", "missing API key");
  expect_unauthenticated("Bearer", "malformed");
  expect_unauthenticated("Bearer   ", "malformed");
  expect_unauthenticated(std::string("Basic ") + kResearchKey, "malformed");
  expect_unauthenticated(std::string("Bearer") + kResearchKey, "malformed");
  expect_unauthenticated(kResearchKey, "malformed");
  expect_unauthenticated(std::string("Bearer ") + kResearchKey + " extra", "malformed");
  expect_unauthenticated("Bearer sk-0000000000000000000000000000000", "unknown API key");
  // A prefix, an extension and a case change of a real key are different keys.
  const std::string key = kResearchKey;
  expect_unauthenticated("Bearer " + key.substr(0, key.size() - 1), "unknown API key");
  expect_unauthenticated("Bearer " + key + "0", "unknown API key");
  expect_unauthenticated("Bearer SK-4F9C2E7A1B8D6F3E0A5C9B2D7E1F4A8C", "unknown API key");
}

// A refusal says what to send as the caller sends it: gRPC metadata (lower-case key) or the
// HTTP header. Before, an HTTP client was told to send "the metadata 'authorization: ...'".
TEST(ApiKeyAuthenticatorTest, RefusalsNameTheMetadataOrTheHeader) {
  const ApiKeyAuthenticator auth = Load(KeyFile());
  const auto message = [&](absl::string_view authorization, KeyCarrier carrier) {
    return std::string(auth.TenantFor(authorization, carrier).status().message());
  };
  EXPECT_EQ(message("", KeyCarrier::kGrpcMetadata),
            "missing API key: send the metadata 'authorization: Bearer <key>'");
  EXPECT_EQ(message("", KeyCarrier::kHttpHeader),
            "missing API key: send the header 'Authorization: Bearer <key>'");
  EXPECT_EQ(message("Basic abc", KeyCarrier::kGrpcMetadata),
            "malformed authorization metadata: expected 'Bearer <key>'");
  EXPECT_EQ(message("Basic abc", KeyCarrier::kHttpHeader),
            "malformed Authorization header: expected 'Bearer <key>'");
  EXPECT_EQ(message("Bearer sk-0000000000000000", KeyCarrier::kHttpHeader), "unknown API key");
}

TEST(ApiKeyAuthenticatorTest, FileErrorsNameTheLine) {
  auto expect_error = [](const std::string& text, const std::string& where,
                         const std::string& why) {
    const absl::Status status = LoadError(text);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(status.message(), AllOf(HasSubstr(where), HasSubstr(why))) << text;
    EXPECT_THAT(status.message(), Not(HasSubstr("sk-"))) << text;
  };
  const std::string good = std::string(kResearchKey) + " research\n";
  expect_error(good + kSupportKey + "\n", "keys.txt:2:", "expected 'KEY TENANT', got 1 fields");
  expect_error(good + kSupportKey + " support extra\n", "keys.txt:2:", "got 3 fields");
  expect_error("\n# c\nsk-short support\n", "keys.txt:3:", "keys need 16 to 4096");
  expect_error(good + "\n" + kResearchKey + " support\n",
               "keys.txt:3:", "the same key as on line 1");
  expect_error(good + kSupportKey + " bad/tenant\n", "keys.txt:2:", "tenant name");
  expect_error(good + "sk-0123456789abcdef\xc3\xa9 support\n", "keys.txt:2:", "printable ASCII");
  expect_error("", "keys.txt", "no keys");
  expect_error("# only comments\n\n", "keys.txt", "no keys");
  expect_error(good + kSupportKey + " " + std::string(65, 't') + "\n",
               "keys.txt:2:", "tenant name");
}

TEST(ApiKeyAuthenticatorTest, AKeyBeginningWithHashIsAnErrorNotAComment) {
  const std::string good = std::string(kResearchKey) + " research\n";
  const absl::Status status = LoadError(good + "#Zk-0123456789abcdef support\n");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("keys.txt:2:"));
  EXPECT_THAT(status.message(), HasSubstr("keys cannot begin with '#'"));
  EXPECT_THAT(status.message(), Not(HasSubstr("Zk-")));  // the key is not repeated
  // Comments, commented-out keys written as "# KEY TENANT", and other '#' lines stay comments.
  const ApiKeyAuthenticator auth =
      Load(good + "# sk-0123456789abcdef support\n" + "## sk-0123456789abcdef support\n" +
           "#\tsk-0123456789abcdef support\n" + "#disabled: old\n" + "#short support\n" +
           "#sk-0123456789abcdef bad/tenant\n");
  EXPECT_EQ(Tenant(auth, std::string("Bearer ") + kResearchKey), "research");
  EXPECT_THAT(Tenant(auth, "Bearer sk-0123456789abcdef"), HasSubstr("error"));
}

TEST(ApiKeyAuthenticatorTest, FromFile) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("sdm_auth_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::filesystem::path path = dir / "keys.txt";
  {
    std::ofstream out(path);
    out << KeyFile();
  }
  absl::StatusOr<ApiKeyAuthenticator> auth = ApiKeyAuthenticator::FromFile(path);
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_EQ(Tenant(*auth, std::string("Bearer ") + kSupportKey), "support");

  {
    std::ofstream out(path);
    out << kResearchKey << "\n";
  }
  const absl::Status bad = ApiKeyAuthenticator::FromFile(path).status();
  EXPECT_THAT(bad.message(), HasSubstr(path.string() + ":1:"));

  const absl::Status missing = ApiKeyAuthenticator::FromFile(dir / "absent.txt").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("absent.txt"));
  std::filesystem::remove_all(dir);
}

TEST(ApiKeyAuthenticatorTest, TenantNames) {
  EXPECT_TRUE(IsValidTenantName("research"));
  EXPECT_TRUE(IsValidTenantName("team-a.prod_2"));
  EXPECT_TRUE(IsValidTenantName(std::string(64, 'x')));
  EXPECT_FALSE(IsValidTenantName(""));
  EXPECT_FALSE(IsValidTenantName(std::string(65, 'x')));
  EXPECT_FALSE(IsValidTenantName("a b"));
  EXPECT_FALSE(IsValidTenantName("a/b"));
  EXPECT_FALSE(IsValidTenantName("caf\xc3\xa9"));
}

}  // namespace
}  // namespace sdm
