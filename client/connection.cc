#include "client/connection.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_keepalive.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace sdm::client {
namespace {

// Returns the environment's value of `name` when set and non-empty.
std::optional<std::string> NonEmpty(const EnvLookup& env, absl::string_view name) {
  if (!env) return std::nullopt;
  std::optional<std::string> v = env(name);
  if (v.has_value() && v->empty()) return std::nullopt;
  return v;
}

// An API key file larger than this is not one (a path to a device or a log by mistake): it is
// refused rather than read to its end and sent.
constexpr size_t kMaxApiKeyFileBytes = 8192;

// The API key in `path`: its content less trailing line ends (the newline an editor or `echo`
// leaves). INVALID_ARGUMENT names the path, never the content.
absl::StatusOr<std::string> ReadApiKeyFile(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("--api_key_file must name a file");
  const auto unreadable = [&path](int error) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read the API key file '", path,
                                                   "' (--api_key_file): ", std::strerror(error)));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return unreadable(errno);
  std::string key;
  char buffer[1024];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      ::close(fd);
      return unreadable(error);
    }
    if (n == 0) break;
    key.append(buffer, static_cast<size_t>(n));
    if (key.size() > kMaxApiKeyFileBytes) {
      ::close(fd);
      return absl::InvalidArgumentError(
          absl::StrCat("the API key file '", path, "' (--api_key_file) holds more than ",
                       kMaxApiKeyFileBytes, " bytes: not an API key"));
    }
  }
  ::close(fd);
  while (!key.empty() && (key.back() == '\n' || key.back() == '\r')) key.pop_back();
  if (key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the API key file '", path, "' (--api_key_file) is empty"));
  }
  return key;
}

}  // namespace

EnvLookup ProcessEnv() {
  return [](absl::string_view name) -> std::optional<std::string> {
    const char* v = std::getenv(std::string(name).c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

void AddConnectionFlags(FlagSet& flags, ConnectionFlags* values) {
  flags.AddString(
      "host", &values->host,
      absl::StrCat("server address host:port (env SDM_HOST; default ", kDefaultHost, ")"));
  flags.AddString("api_key", &values->api_key,
                  "API key, sent as 'authorization: Bearer KEY' (env SDM_API_KEY)");
  flags.AddString("api_key_file", &values->api_key_file,
                  "read the API key from FILE (trailing newline dropped; an empty file is "
                  "refused); not with --api_key; wins over SDM_API_KEY");
  flags.AddBool("tls", &values->tls, "connect with TLS (env SDM_TLS=1; implied by --tls_ca)");
  flags.AddString("tls_ca", &values->tls_ca,
                  "PEM file of the CA certificates to trust; implies --tls (env SDM_TLS_CA; "
                  "default: the system's roots)");
  flags.AddDouble("timeout", &values->timeout, "deadline of each call in seconds; 0: none");
}

absl::StatusOr<ConnectionOptions> ResolveConnectionOptions(const FlagSet& flags,
                                                           const ConnectionFlags& values,
                                                           const EnvLookup& env) {
  ConnectionOptions options;
  if (flags.IsSet("host")) {
    options.host = values.host;
  } else if (auto v = NonEmpty(env, "SDM_HOST")) {
    options.host = *v;
  }
  if (options.host.empty()) return absl::InvalidArgumentError("--host must not be empty");

  // Where the key came from, for the check below (which must not quote the key).
  absl::string_view key_source;
  if (flags.IsSet("api_key") && flags.IsSet("api_key_file")) {
    return absl::InvalidArgumentError("give the API key once: --api_key or --api_key_file");
  }
  if (flags.IsSet("api_key_file")) {
    absl::StatusOr<std::string> key = ReadApiKeyFile(values.api_key_file);
    if (!key.ok()) return key.status();
    options.api_key = *std::move(key);
    key_source = "the file of --api_key_file";
  } else if (flags.IsSet("api_key")) {
    options.api_key = values.api_key;
    key_source = "--api_key";
  } else if (auto v = NonEmpty(env, "SDM_API_KEY")) {
    options.api_key = *v;
    key_source = "SDM_API_KEY";
  }
  for (const char c : options.api_key) {
    if (!absl::ascii_isprint(static_cast<unsigned char>(c)) || c == ' ') {
      return absl::InvalidArgumentError(absl::StrCat(
          "the API key must be printable ASCII without spaces (check ", key_source, ")"));
    }
  }

  if (flags.IsSet("tls_ca")) {
    options.tls_ca_file = values.tls_ca;
  } else if (auto v = NonEmpty(env, "SDM_TLS_CA")) {
    options.tls_ca_file = *v;
  }
  // --tls, else a --tls_ca flag, else SDM_TLS, else whether a CA file came from anywhere.
  if (flags.IsSet("tls")) {
    options.tls = values.tls;
  } else if (flags.IsSet("tls_ca") && !values.tls_ca.empty()) {
    options.tls = true;
  } else if (auto v = NonEmpty(env, "SDM_TLS")) {
    const std::string s = absl::AsciiStrToLower(*v);
    if (s == "1" || s == "true" || s == "yes") {
      options.tls = true;
    } else if (s == "0" || s == "false" || s == "no") {
      options.tls = false;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("SDM_TLS must be 1/true or 0/false, got '", *v, "'"));
    }
  } else {
    options.tls = !options.tls_ca_file.empty();
  }
  if (!options.tls) options.tls_ca_file.clear();

  if (values.timeout < 0) return absl::InvalidArgumentError("--timeout must be >= 0");
  if (values.timeout > 0) options.timeout = absl::Seconds(values.timeout);
  return options;
}

grpc::ChannelArguments ClientChannelArguments() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  for (const GrpcIntArg& arg : kClientKeepaliveArgs) args.SetInt(arg.name, arg.value);
  return args;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const ConnectionOptions& options) {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options.tls) {
    grpc::SslCredentialsOptions ssl;
    if (!options.tls_ca_file.empty()) {
      std::ifstream in(options.tls_ca_file, std::ios::binary);
      std::ostringstream pem;
      pem << in.rdbuf();
      if (!in || pem.str().empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("cannot read the CA file '", options.tls_ca_file, "' (--tls_ca)"));
      }
      ssl.pem_root_certs = pem.str();
    }
    credentials = grpc::SslCredentials(ssl);
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  return grpc::CreateCustomChannel(options.host, credentials, ClientChannelArguments());
}

void PrepareContext(const ConnectionOptions& options, grpc::ClientContext& context) {
  if (!options.api_key.empty()) {
    context.AddMetadata("authorization", absl::StrCat("Bearer ", options.api_key));
  }
  if (options.timeout != absl::InfiniteDuration()) {
    context.set_deadline(absl::ToChronoTime(absl::Now() + options.timeout));
  }
}

void AddSessionRouting(absl::string_view session_id, grpc::ClientContext& context) {
  if (session_id.empty()) return;
  // gRPC carries only printable ASCII in a text header, and aborts the process on anything else
  // (an API misuse): such an id (never a valid one) goes without the header, and the server
  // answers INVALID_ARGUMENT naming it.
  for (const char c : session_id) {
    if (c < 0x20 || c > 0x7e) return;
  }
  context.AddMetadata(kSessionRoutingKey, std::string(session_id));
}

absl::string_view StatusCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

std::string FormatStatus(const grpc::Status& status) {
  if (status.error_message().empty()) return std::string(StatusCodeName(status.error_code()));
  return absl::StrCat(StatusCodeName(status.error_code()), ": ", status.error_message());
}

std::string FailureHint(grpc::StatusCode code, absl::string_view message,
                        const ConnectionOptions& options) {
  if (code == grpc::StatusCode::UNAUTHENTICATED) {
    return "(give the API key with --api_key, --api_key_file or SDM_API_KEY)";
  }
  // gRPC's load balancing policies fail a call with this when no connection to the address could
  // be made: the server answered nothing. (sdmserve's own UNAVAILABLE, sent once connected, says
  // something else and carries a retry hint.) A TLS port closes a plaintext connection after its
  // first bytes ("Socket closed"); a refused one means nothing listens there, TLS or not.
  if (code == grpc::StatusCode::UNAVAILABLE && !options.tls &&
      absl::StrContains(message, "failed to connect to all addresses") &&
      !absl::StrContains(message, "Connection refused")) {
    return "(is the server using TLS? try --tls / --tls_ca)";
  }
  return "";
}

}  // namespace sdm::client
