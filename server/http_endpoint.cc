#include "server/http_endpoint.h"

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "httplib.h"
#include "server/http/listen_socket.h"
#include "server/metrics/exposition.h"

namespace sdm {

class HttpEndpoint::Impl {
 public:
  Impl(MetricsCallback metrics, HealthCallback health, const HttpEndpointOptions& options)
      : metrics_(std::move(metrics)), health_(std::move(health)) {
    // httplib takes ownership of the queue it is handed (and deletes it).
    const int threads = options.threads;
    server_.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    server_.set_read_timeout(absl::ToChronoMicroseconds(options.read_timeout));
    server_.set_write_timeout(absl::ToChronoMicroseconds(options.write_timeout));
    server_.set_keep_alive_timeout(static_cast<time_t>(
        absl::ToInt64Seconds(absl::Ceil(options.keep_alive_timeout, absl::Seconds(1)))));
    server_.set_keep_alive_max_count(static_cast<size_t>(options.keep_alive_max_requests));
    server_.set_socket_options(SetExclusiveListenOptions);  // a port in use fails the start
    server_.Get("/metrics", [this](const httplib::Request&, httplib::Response& response) {
      response.set_content(metrics_(), kPrometheusContentType);
    });
    server_.Get("/healthz", [this](const httplib::Request&, httplib::Response& response) {
      const absl::Status health = health_ ? health_() : absl::OkStatus();
      if (health.ok()) {
        response.set_content("ok\n", "text/plain; charset=utf-8");
      } else {
        response.status = 503;
        response.set_content(absl::StrCat("not serving: ", health.message(), "\n"),
                             "text/plain; charset=utf-8");
      }
    });
  }

  ~Impl() {
    if (thread_.joinable()) {
      server_.stop();
      thread_.join();
    }
  }

  absl::Status Listen(const std::string& host, int port) {
    errno = 0;
    if (port == 0) {
      port_ = server_.bind_to_any_port(host);
    } else {
      port_ = server_.bind_to_port(host, port) ? port : -1;
    }
    if (port_ < 0) {
      const std::string reason = errno != 0 ? std::strerror(errno) : "invalid address";
      return absl::UnavailableError(
          absl::StrCat("metrics endpoint: cannot listen on ", host, ":", port, " (", reason, ")"));
    }
    absl::StatusOr<std::thread> loop = StartAcceptLoop(server_, "sdm-metrics");
    if (!loop.ok()) {
      return absl::UnavailableError(absl::StrCat("metrics endpoint: listening on ", host, ":",
                                                 port_, ": ", loop.status().message()));
    }
    thread_ = *std::move(loop);
    return absl::OkStatus();
  }

  int port() const { return port_; }

 private:
  const MetricsCallback metrics_;
  const HealthCallback health_;
  httplib::Server server_;
  int port_ = -1;
  std::thread thread_;
};

absl::StatusOr<std::unique_ptr<HttpEndpoint>> HttpEndpoint::Start(
    const HttpEndpointOptions& options, MetricsCallback metrics, HealthCallback health) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics endpoint: port ", options.port, " is not in [0, 65535]"));
  }
  if (options.threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics endpoint: threads must be >= 1, got ", options.threads));
  }
  for (const auto& [name, timeout] :
       {std::pair{"read_timeout", options.read_timeout},
        std::pair{"write_timeout", options.write_timeout},
        std::pair{"keep_alive_timeout", options.keep_alive_timeout}}) {
    if (timeout <= absl::ZeroDuration() || timeout == absl::InfiniteDuration()) {
      return absl::InvalidArgumentError(absl::StrCat("metrics endpoint: ", name,
                                                     " must be positive and finite, got ",
                                                     absl::FormatDuration(timeout)));
    }
  }
  if (options.keep_alive_max_requests < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics endpoint: keep_alive_max_requests must be >= 1, got ",
                     options.keep_alive_max_requests));
  }
  if (!metrics) return absl::InvalidArgumentError("metrics endpoint: no metrics callback");
  auto impl = std::make_unique<Impl>(std::move(metrics), std::move(health), options);
  if (absl::Status status = impl->Listen(options.host, options.port); !status.ok()) return status;
  return std::make_unique<HttpEndpoint>(std::move(impl));
}

HttpEndpoint::HttpEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpEndpoint::~HttpEndpoint() = default;

int HttpEndpoint::port() const { return impl_->port(); }

}  // namespace sdm
