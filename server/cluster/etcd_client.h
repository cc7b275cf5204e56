// EtcdClient: requests to etcd v3's JSON gateway (POST /v3/...) with cpp-httplib, over one or
// more endpoints of one etcd cluster, with reused connections, optional username/password
// authentication and optional TLS. EtcdOwnership (etcd_ownership.h) speaks to etcd through it.
//
// Endpoints. A request goes to the endpoint that last answered (the first one at the start);
// if that one cannot be reached (the connection is refused, the TLS handshake fails) or does not
// answer within `request_timeout` (connect, write or read), it goes to the next one, and so on
// once around the list. A request that an endpoint ANSWERED, with success or an error (an HTTP
// status other than 200: a refused compare is a 200), is never sent to another endpoint: the
// answer is the cluster's. An endpoint that answered is tried first by the next request.
//
// A request that went unanswered may nevertheless have reached etcd and been applied (its answer
// was lost, or it timed out while etcd was applying it); sending it again to another member can
// then apply it twice. Post() says so through `unanswered` so that the caller can read the answer
// to the retry accordingly; EtcdOwnership lists why each of its requests is safe to send twice.
// A request refused before it was sent (the connection failed, the TLS handshake failed) is
// never applied.
//
// Connections: each endpoint keeps a small pool of idle HTTP/1.1 keep-alive clients (one TCP or
// TLS connection each). A request takes an idle one or opens a new one, and gives it back
// when answered; a client whose request failed is closed. httplib::Client is not safe for
// concurrent use, so no two requests share one, and no request waits for another's connection
// (a keepalive is never queued behind a slow transaction).
//
// Authentication (`username` non-empty): Create() authenticates (/v3/auth/authenticate) and every
// request carries the token in the `Authorization` header. A request refused for its token
// ("invalid auth token": a simple token expired, or etcd restarted, or the password changed) is
// authenticated again and resent once to the same endpoint (etcd refused it before applying it).
// The password is never logged nor put in an error message.
//
// TLS: https:// endpoints verify etcd's certificate (and host name) against `ca_file`, or the
// system's CAs when it is empty; `cert_file` and `key_file` are a client certificate for etcd's
// --client-cert-auth. A request blocks SIGPIPE in its thread while it runs (OpenSSL writes
// without MSG_NOSIGNAL: a TLS connection etcd closed would otherwise kill the process).
//
// Thread-safety: thread-safe.
#ifndef SDMSERVE_SERVER_CLUSTER_ETCD_CLIENT_H_
#define SDMSERVE_SERVER_CLUSTER_ETCD_CLIENT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace httplib {
class Client;
}

namespace sdm {

// Testing only: what happens to one attempt of a request (one endpoint). kDropped fails it before
// it is sent; kAnswerLost sends it and then fails as if its answer were lost (etcd applied it).
enum class EtcdRequestFault { kNone, kDropped, kAnswerLost };

struct EtcdClientOptions {
  // Client URLs of one etcd cluster's members: http://host:port or https://host:port.
  std::vector<std::string> endpoints;
  // Per attempt (one endpoint): the connect, each write and each read.
  absl::Duration request_timeout = absl::Seconds(2);
  // Authentication: none when `username` is empty; else `password` must be set.
  std::string username;
  std::string password;
  // TLS (https:// endpoints): a PEM CA bundle to verify etcd's certificate (empty: the system's),
  // and a client certificate and its key (both or neither).
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  // Testing only: asked before each attempt with the gateway path and the JSON body.
  std::function<EtcdRequestFault(const std::string& path, const std::string& body)>
      testing_request_fault;
};

// Splits a comma-separated list of endpoints (etcdctl's --endpoints); INVALID_ARGUMENT naming
// the problem for an empty list or entry. Surrounding blanks of an entry are dropped.
absl::StatusOr<std::vector<std::string>> ParseEtcdEndpoints(absl::string_view list);

// OK, or INVALID_ARGUMENT naming the problem: no endpoint, an endpoint that is not
// http(s)://host[:port] (an empty entry, no scheme, a path), https:// in a build of cpp-httplib
// without OpenSSL, a TLS file that cannot be read or given with no https:// endpoint, a client
// certificate without its key (or the reverse), a username without a password (or the reverse).
absl::Status ValidateEtcdClientOptions(const EtcdClientOptions& options);

class EtcdClient {
 public:
  // Validates the options (INVALID_ARGUMENT) and, with a username, authenticates: UNAUTHENTICATED
  // when etcd refuses the name or password, UNAVAILABLE when no endpoint answers. Etcd is not
  // otherwise contacted.
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(EtcdClientOptions options);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // POSTs the JSON `body` to the gateway `path` (the class comment says where). The answer's body
  // when etcd answered 200; UNAVAILABLE with etcd's message when it answered another status, or
  // naming each endpoint's failure when none answered. `unanswered`, when not null, is set to
  // whether some attempt may have reached etcd without its answer coming back (it may have been
  // applied), whatever the result.
  absl::StatusOr<std::string> Post(const std::string& path, const std::string& body,
                                   bool* unanswered = nullptr) ABSL_LOCKS_EXCLUDED(token_mu_);

  // The endpoints, comma-separated (for logs).
  std::string Describe() const;
  // Successful authentications so far (Create's included).
  int64_t authentications() const ABSL_LOCKS_EXCLUDED(token_mu_);

 private:
  struct Endpoint;
  struct Attempt;
  explicit EtcdClient(EtcdClientOptions options);
  // One attempt on endpoint `e`, re-authenticating once on a refused token.
  Attempt Send(size_t e, const std::string& path, const std::string& body);
  // One HTTP exchange on endpoint `e` with `token` (empty: none).
  Attempt Exchange(size_t e, const std::string& path, const std::string& body,
                   const std::string& token);
  // Authenticates through endpoint `e`; the token is stored when etcd granted one.
  Attempt Authenticate(size_t e) ABSL_LOCKS_EXCLUDED(token_mu_);
  std::unique_ptr<httplib::Client> NewClient(const Endpoint& endpoint) const;

  const EtcdClientOptions options_;
  std::vector<std::unique_ptr<Endpoint>> endpoints_;
  std::atomic<size_t> preferred_{0};  // the endpoint that answered last
  mutable absl::Mutex token_mu_;
  std::string token_ ABSL_GUARDED_BY(token_mu_);
  int64_t authentications_ ABSL_GUARDED_BY(token_mu_) = 0;
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_CLUSTER_ETCD_CLIENT_H_
