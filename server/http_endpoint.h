// The server's plain-HTTP port, for operators and their tools (not for clients of the model):
//
//   GET /metrics   200, the page the metrics callback renders (the server's: its prometheus-cpp
//                  registry, server/metrics/exposition.h), as Content-Type
//                  text/plain; version=0.0.4
//   GET /healthz   200 "ok", or 503 "not serving: <reason>" when the health callback returns an
//                  error (e.g. the server is draining)
//   anything else  404
//
// An HttpEndpoint listens from Start() until it is destroyed, on its own threads (cpp-httplib:
// one accepting, a pool answering, one connection per worker at a time).
//
// Slow clients: a connection holds a worker while it is read, answered and kept alive. A client
// that sends nothing (or reads nothing) for read_timeout (write_timeout) is dropped, and an idle
// kept-alive connection after keep_alive_timeout; so a few slow or stalled clients cannot starve
// /healthz and /metrics while fewer than `threads` of them are connected. A client that drips a
// byte within every read_timeout holds its worker for as long as it keeps dripping (cpp-httplib
// 0.11 has no whole-request deadline): `threads` such clients at once delay every other request
// until one leaves. Expose the port only to the scrapers and probes (bind it to loopback or a
// private interface; deploy/sdm-server.flags), never to untrusted networks.
//
// Thread-safety: Start() and the destructor from one thread; the `metrics` and `health` callbacks
// are called on the endpoint's threads, possibly concurrently.
#ifndef SDMSERVE_SERVER_HTTP_ENDPOINT_H_
#define SDMSERVE_SERVER_HTTP_ENDPOINT_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace sdm {

struct HttpEndpointOptions {
  // Address to listen on: "0.0.0.0" (all IPv4 interfaces), "127.0.0.1", "::" ...
  std::string host = "0.0.0.0";
  // 0: a free port, chosen by the system (see HttpEndpoint::port()).
  int port = 0;
  // Threads answering requests: at most this many connections are served at once (more wait).
  int threads = 16;
  // A connection is dropped when the client sends nothing for read_timeout (while a request is
  // read) or accepts nothing for write_timeout (while the answer is written).
  absl::Duration read_timeout = absl::Seconds(2);
  absl::Duration write_timeout = absl::Seconds(5);
  // An idle kept-alive connection is closed after keep_alive_timeout, and after
  // keep_alive_max_requests requests.
  absl::Duration keep_alive_timeout = absl::Seconds(2);
  int keep_alive_max_requests = 100;
};

class HttpEndpoint {
 public:
  // The /metrics page in the Prometheus text format, rendered afresh for every scrape.
  using MetricsCallback = std::function<std::string()>;
  // OK while the server can serve; otherwise the reason it cannot (its message is the 503 body).
  using HealthCallback = std::function<absl::Status()>;

  // Listens on options.host:options.port and returns once requests are being accepted.
  // `metrics` must be set; an empty `health` means always serving. What the callbacks refer to
  // must outlive the endpoint. Errors: the address cannot be bound (Unavailable, naming it), bad
  // options (InvalidArgument).
  static absl::StatusOr<std::unique_ptr<HttpEndpoint>> Start(const HttpEndpointOptions& options,
                                                             MetricsCallback metrics,
                                                             HealthCallback health = {});

  // Stops listening, waits for requests in progress to finish and for the threads to end.
  ~HttpEndpoint();

  HttpEndpoint(const HttpEndpoint&) = delete;
  HttpEndpoint& operator=(const HttpEndpoint&) = delete;

  // The port it listens on (the chosen one when options.port was 0).
  int port() const;

  class Impl;
  explicit HttpEndpoint(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_HTTP_ENDPOINT_H_
