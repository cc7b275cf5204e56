// Who is calling: API keys mapped to tenants.
//
// A key file holds one `KEY TENANT` pair per line, separated by spaces or tabs. Blank lines and
// lines whose first non-blank character is '#' are ignored, except that a line like
// `#xxxxxxxxxxxxxxxx tenant` (no blank after the '#', a key-sized first field, a tenant name) is
// an error: it would be a key beginning with '#' read as a comment. Keys are 16 to 4096 printable
// ASCII characters without spaces and never begin with '#', each on one line only; tenant names are
// 1 to 64 characters of [A-Za-z0-9._-]. Several keys may map to one tenant (key rotation). Example:
//
//   # key                               tenant
//   sk-4f9c2e7a1b8d6f3e0a5c9b2d7e1f4a8c  research
//   sk-0b7e3d9a5c1f8e2b6d4a0c9f7e3b1d5a  research
//   sk-9a1c5e3b7d0f2a4c6e8b1d3f5a7c9e0b  support
//
// Clients send `authorization: Bearer KEY` as gRPC metadata, or as the HTTP header of that name
// (the OpenAI-compatible API). Without a key file every caller is the tenant "default", whatever
// it sends.
//
// The key check takes the same time whichever key is presented and however much of it matches
// (every configured key is compared, each in constant time), and no error message repeats a key:
// neither the presented one nor one from the file.
//
// Thread-safety: immutable after creation; TenantFor may run concurrently.
#ifndef SDMSERVE_SERVER_AUTH_H_
#define SDMSERVE_SERVER_AUTH_H_

#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace sdm {

// The tenant of every caller when no key file is configured.
inline constexpr char kDefaultTenant[] = "default";

// 1 to 64 characters of [A-Za-z0-9._-].
bool IsValidTenantName(absl::string_view name);

// How a call carries its key: the refusals say what to send in the caller's terms.
enum class KeyCarrier {
  kGrpcMetadata,  // the metadata `authorization`
  kHttpHeader,    // the header `Authorization`
};

class ApiKeyAuthenticator {
 public:
  // No keys: everyone is the tenant "default".
  ApiKeyAuthenticator() = default;

  // Reads a key file. Errors (InvalidArgument, as "PATH:LINE: problem"): a line that is not two
  // fields, a key shorter than 16 characters or not printable ASCII, a key given twice, a bad
  // tenant name, a file without any key. NotFound / PermissionDenied when it cannot be read.
  static absl::StatusOr<ApiKeyAuthenticator> FromFile(const std::filesystem::path& path);

  // The same from the file's text; `source` names it in errors.
  static absl::StatusOr<ApiKeyAuthenticator> FromText(absl::string_view text,
                                                      absl::string_view source = "key file");

  // Whether keys are required (a key file was loaded).
  bool enabled() const { return !entries_.empty(); }

  // The tenant of a call whose `authorization` metadata or header (`carrier`) has this value
  // (empty when the call has none). With keys: "Bearer KEY" (the scheme in any case, surrounding
  // spaces ignored) whose KEY is in the file; otherwise Unauthenticated, saying whether the key
  // was missing, malformed or unknown, without repeating it, and what to send through `carrier`.
  // Without keys: "default".
  absl::StatusOr<std::string> TenantFor(absl::string_view authorization, KeyCarrier carrier) const;

  // Number of keys, and the distinct tenants they map to (sorted).
  size_t num_keys() const { return entries_.size(); }
  std::vector<std::string> tenants() const;

 private:
  struct Entry {
    std::string key;
    std::string tenant;
  };
  std::vector<Entry> entries_;
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_AUTH_H_
