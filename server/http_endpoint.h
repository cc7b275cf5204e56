// The server's plain-HTTP port, for operators and their tools (not for clients of the model):
//
//   GET /metrics   200, the page the metrics callback renders (the server's: its prometheus-cpp
//                  registry, server/metrics/exposition.h), as Content-Type
//                  text/plain; version=0.0.4
//   GET /healthz   200 "ok", or 503 "not serving: <reason>" when the health callback returns an
//                  error (e.g. the model is still loading, or the server is draining)
//   anything else  404
//
// An HttpEndpoint listens from Start() until it is destroyed, on its own threads (cpp-httplib:
// one accepting, a small pool answering).
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

namespace sdm {

struct HttpEndpointOptions {
  // Address to listen on: "0.0.0.0" (all IPv4 interfaces), "127.0.0.1", "::" ...
  std::string host = "0.0.0.0";
  // 0: a free port, chosen by the system (see HttpEndpoint::port()).
  int port = 0;
  // Threads answering requests.
  int threads = 2;
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
