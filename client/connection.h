// How the client tools reach a server: address, API key and TLS, from flags or the environment.
//
//   flag           environment    default            meaning
//   --host         SDM_HOST       127.0.0.1:50051    the server's gRPC address (host:port)
//   --api_key      SDM_API_KEY    (none)             sent as `authorization: Bearer KEY`
//   --api_key_file                (none)             the API key read from this file
//   --tls          SDM_TLS        false              connect with TLS (SDM_TLS: 1/true, 0/false)
//   --tls_ca       SDM_TLS_CA     (system roots)     PEM file of the CA that signs the server's
//                                                    certificate; setting it turns TLS on
//
// A flag given on the command line wins over the environment, even when its value is empty
// (`--api_key=` sends no key whatever SDM_API_KEY says; `--tls=false` connects in plaintext
// whatever SDM_TLS_CA says). Empty environment variables count as unset. --api_key_file is such
// a flag too (it wins over SDM_API_KEY), and is refused together with --api_key; the file's
// content less its trailing line ends is the key (an empty one is refused, so that a key file
// left empty by mistake does not silently send none). TLS is on when --tls says so; else when
// --tls_ca names a file; else as SDM_TLS says; else when SDM_TLS_CA is set. --timeout SECONDS
// (flag only; default none) sets the deadline of each call. No error message quotes a key.
//
// Thread-safety: the functions are thread-compatible; a channel is thread-safe.
#ifndef SDMSERVE_CLIENT_CONNECTION_H_
#define SDMSERVE_CLIENT_CONNECTION_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/flags.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/status.h"

namespace sdm::client {

inline constexpr char kDefaultHost[] = "127.0.0.1:50051";

// Reads an environment variable: nullopt when unset. Tests pass a map's lookup.
using EnvLookup = std::function<std::optional<std::string>(absl::string_view name)>;

// The process environment (getenv).
EnvLookup ProcessEnv();

struct ConnectionOptions {
  std::string host = kDefaultHost;
  std::string api_key;  // empty: no authorization metadata
  bool tls = false;
  std::string tls_ca_file;  // empty: the system's root certificates (with tls)
  absl::Duration timeout = absl::InfiniteDuration();  // deadline of each call
};

// The connection flags' raw values, registered on a FlagSet by AddConnectionFlags.
struct ConnectionFlags {
  std::string host;
  std::string api_key;
  std::string api_key_file;
  bool tls = false;
  std::string tls_ca;
  double timeout = 0;  // seconds; 0: none
};

// Registers --host, --api_key, --api_key_file, --tls, --tls_ca and --timeout.
void AddConnectionFlags(FlagSet& flags, ConnectionFlags* values);

// Applies the precedence above, reading --api_key_file. INVALID_ARGUMENT for an empty host,
// --api_key with --api_key_file, a key file that cannot be read (or is not a small file) or is
// empty, an API key that cannot travel in gRPC metadata (not printable ASCII), or a negative
// timeout.
absl::StatusOr<ConnectionOptions> ResolveConnectionOptions(const FlagSet& flags,
                                                           const ConnectionFlags& values,
                                                           const EnvLookup& env);

// The arguments of MakeChannel's channels: responses up to 64 MiB, and keepalive pings
// (common/grpc_keepalive.h) so that a connection that died silently fails its calls within
// about 40 s rather than TCP's minutes.
grpc::ChannelArguments ClientChannelArguments();

// A channel to options.host: plaintext, or TLS with options.tls_ca_file's roots, with
// ClientChannelArguments(). INVALID_ARGUMENT if the CA file cannot be read. Does not connect yet
// (the first call does).
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const ConnectionOptions& options);

// Prepares a call's context: the authorization metadata and the deadline.
void PrepareContext(const ConnectionOptions& options, grpc::ClientContext& context);

// The gRPC metadata key naming the session a call is about, so that a proxy in front of several
// replicas can route every call of one session to the same replica by consistent hash
// (deploy/nginx/nginx.conf, docs/replicas.md). The server does not need it.
inline constexpr char kSessionRoutingKey[] = "x-session-id";
// Adds `x-session-id: session_id` to the call's metadata; nothing for an empty id (a one-shot
// request, or a session whose id the server picks), which a proxy spreads freely, nor for one
// with a byte outside printable ASCII (no valid id has one; gRPC cannot carry it).
void AddSessionRouting(absl::string_view session_id, grpc::ClientContext& context);

// The canonical name of a gRPC status code ("NOT_FOUND"); "UNKNOWN" outside the canonical set.
absl::string_view StatusCodeName(grpc::StatusCode code);

// "NOT_FOUND: session 'x' not found" (the name alone when the message is empty).
std::string FormatStatus(const grpc::Status& status);

// What the user of a client tool can do about a call that failed with `code` and `message`, to
// print after them; empty when there is nothing to add. UNAUTHENTICATED: where the tools take the
// API key from (the server's message names the metadata, not these flags). Without TLS
// (`options.tls` false), a connection that was not established though something listens (gRPC's
// own UNAVAILABLE "failed to connect to all addresses", before any response, but not "Connection
// refused"; what a plaintext client gets from a TLS port): whether the server uses TLS.
std::string FailureHint(grpc::StatusCode code, absl::string_view message,
                        const ConnectionOptions& options);

}  // namespace sdm::client

#endif  // SDMSERVE_CLIENT_CONNECTION_H_
