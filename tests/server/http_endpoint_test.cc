#include "server/http_endpoint.h"

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"
#include "server/metrics/exposition.h"
#include "tests/server/http_test_client.h"
#include "tests/server/prometheus_text_parser.h"

namespace sdm {
namespace {

using ::sdm::testing::ConnectRaw;
using ::sdm::testing::ParsedPage;
using ::sdm::testing::ParsePrometheusText;
using ::sdm::testing::SendAll;
using ::sdm::testing::TestHttpClient;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

HttpEndpointOptions Loopback(int port = 0) {
  HttpEndpointOptions options;
  options.host = "127.0.0.1";
  options.port = port;
  return options;
}

// The /metrics page of `registry`, as the server serves its own.
HttpEndpoint::MetricsCallback PageOf(const prometheus::Registry& registry) {
  return [&registry] { return RenderPrometheusText(registry); };
}

TEST(HttpEndpointTest, ServesMetricsOnAChosenPort) {
  prometheus::Registry registry;
  prometheus::Counter& tokens = prometheus::BuildCounter()
                                    .Name("sdm_generated_tokens_total")
                                    .Help("Tokens.")
                                    .Register(registry)
                                    .Add({});
  absl::StatusOr<std::unique_ptr<HttpEndpoint>> endpoint =
      HttpEndpoint::Start(Loopback(), PageOf(registry));
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const int port = (*endpoint)->port();
  ASSERT_GT(port, 0);

  httplib::Client client = TestHttpClient(port);
  tokens.Increment(42);
  const httplib::Result response = client.Get("/metrics");
  ASSERT_TRUE(response) << httplib::to_string(response.error());
  EXPECT_EQ(response->status, 200);
  EXPECT_THAT(response->get_header_value("Content-Type"), StartsWith("text/plain; version=0.0.4"));
  ParsedPage page;
  std::string error;
  ASSERT_TRUE(ParsePrometheusText(response->body, &page, &error)) << error;
  EXPECT_EQ(page.Value("sdm_generated_tokens_total"), 42);

  // Each scrape renders afresh.
  tokens.Increment();
  const httplib::Result again = client.Get("/metrics");
  ASSERT_TRUE(again);
  ASSERT_TRUE(ParsePrometheusText(again->body, &page, &error)) << error;
  EXPECT_EQ(page.Value("sdm_generated_tokens_total"), 43);
}

TEST(HttpEndpointTest, HealthFollowsTheCallback) {
  prometheus::Registry registry;
  std::atomic<bool> draining = false;
  auto endpoint = HttpEndpoint::Start(Loopback(), PageOf(registry), [&]() -> absl::Status {
    if (draining) return absl::UnavailableError("draining: 3 requests still running");
    return absl::OkStatus();
  });
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  httplib::Client client = TestHttpClient((*endpoint)->port());

  httplib::Result healthy = client.Get("/healthz");
  ASSERT_TRUE(healthy);
  EXPECT_EQ(healthy->status, 200);
  EXPECT_EQ(healthy->body, "ok\n");

  draining = true;
  httplib::Result unhealthy = client.Get("/healthz");
  ASSERT_TRUE(unhealthy);
  EXPECT_EQ(unhealthy->status, 503);
  EXPECT_EQ(unhealthy->body, "not serving: draining: 3 requests still running\n");

  draining = false;
  EXPECT_EQ(client.Get("/healthz")->status, 200);
}

TEST(HttpEndpointTest, WithoutACallbackItIsHealthy) {
  prometheus::Registry registry;
  auto endpoint = HttpEndpoint::Start(Loopback(), PageOf(registry));
  ASSERT_TRUE(endpoint.ok());
  httplib::Client client = TestHttpClient((*endpoint)->port());
  EXPECT_EQ(client.Get("/healthz")->status, 200);
}

TEST(HttpEndpointTest, OtherPathsAreNotFound) {
  prometheus::Registry registry;
  auto endpoint = HttpEndpoint::Start(Loopback(), PageOf(registry));
  ASSERT_TRUE(endpoint.ok());
  httplib::Client client = TestHttpClient((*endpoint)->port());
  const httplib::Result response = client.Get("/");
  ASSERT_TRUE(response);
  EXPECT_EQ(response->status, 404);
  EXPECT_EQ(client.Get("/metrics/extra")->status, 404);
  EXPECT_EQ(client.Post("/metrics", "", "text/plain")->status, 404);
}

TEST(HttpEndpointTest, APortInUseIsAnErrorNamingIt) {
  prometheus::Registry registry;
  auto first = HttpEndpoint::Start(Loopback(), PageOf(registry));
  ASSERT_TRUE(first.ok());
  const int port = (*first)->port();
  auto second = HttpEndpoint::Start(Loopback(port), PageOf(registry));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr("127.0.0.1:" + std::to_string(port)));
  EXPECT_THAT(second.status().message(), HasSubstr("Address already in use"));
}

TEST(HttpEndpointTest, BadOptionsAreRejected) {
  prometheus::Registry registry;
  EXPECT_EQ(HttpEndpoint::Start(Loopback(70000), PageOf(registry)).status().code(),
            absl::StatusCode::kInvalidArgument);
  HttpEndpointOptions options = Loopback();
  options.threads = 0;
  EXPECT_EQ(HttpEndpoint::Start(options, PageOf(registry)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HttpEndpoint::Start(Loopback(), HttpEndpoint::MetricsCallback()).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = Loopback();
  options.read_timeout = absl::ZeroDuration();
  EXPECT_EQ(HttpEndpoint::Start(options, PageOf(registry)).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = Loopback();
  options.keep_alive_max_requests = 0;
  EXPECT_EQ(HttpEndpoint::Start(options, PageOf(registry)).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = Loopback();
  options.host = "not an address";
  EXPECT_FALSE(HttpEndpoint::Start(options, PageOf(registry)).ok());
}

TEST(HttpEndpointTest, DestroyingStopsListening) {
  prometheus::Registry registry;
  int port = 0;
  {
    auto endpoint = HttpEndpoint::Start(Loopback(), PageOf(registry));
    ASSERT_TRUE(endpoint.ok());
    port = (*endpoint)->port();
    httplib::Client client = TestHttpClient(port);
    EXPECT_TRUE(client.Get("/healthz"));
  }
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(1);
  EXPECT_FALSE(client.Get("/healthz"));
  // The port is free again.
  auto again = HttpEndpoint::Start(Loopback(port), PageOf(registry));
  EXPECT_TRUE(again.ok()) << again.status();
}

TEST(HttpEndpointTest, StartAndStopRepeatedly) {
  prometheus::Registry registry;
  for (int i = 0; i < 20; ++i) {
    auto endpoint = HttpEndpoint::Start(Loopback(), PageOf(registry));
    ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  }
}

TEST(HttpEndpointTest, ClientsDrippingHeaderBytesDoNotStarveHealthChecks) {
  prometheus::Registry registry;
  const HttpEndpointOptions options = Loopback();
  auto endpoint = HttpEndpoint::Start(options, PageOf(registry));
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const int port = (*endpoint)->port();
  // Fewer slow clients than workers, but more than the 2 the endpoint used to have: each starts
  // a request and then sends one more header byte every 50 ms (well within read_timeout), for as
  // long as the test runs.
  const int slow_clients = options.threads / 2;
  ASSERT_GT(slow_clients, 2);
  std::vector<int> slow;
  for (int i = 0; i < slow_clients; ++i) {
    const int fd = ConnectRaw(port);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendAll(fd, "GET /healthz HTTP/1.1\r\nX-Drip: "));
    slow.push_back(fd);
  }
  std::atomic<bool> stop = false;
  std::thread drip([&] {
    while (!stop.load()) {
      for (int fd : slow) SendAll(fd, "a");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  // Health checks and scrapes are answered while the slow clients keep their connections (with
  // the old 2 workers they waited for as long as the dripping lasted; the bound here is generous).
  httplib::Client client = TestHttpClient(port);
  for (const char* path : {"/healthz", "/metrics", "/healthz"}) {
    const httplib::Result response = client.Get(path);
    ASSERT_TRUE(response) << path << ": " << httplib::to_string(response.error());
    EXPECT_EQ(response->status, 200) << path;
  }
  stop = true;
  drip.join();
  for (int fd : slow) close(fd);
}

TEST(HttpEndpointTest, AClientThatStopsSendingIsDisconnected) {
  prometheus::Registry registry;
  HttpEndpointOptions options = Loopback();
  options.read_timeout = absl::Milliseconds(200);
  auto endpoint = HttpEndpoint::Start(options, PageOf(registry));
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const int fd = ConnectRaw((*endpoint)->port());
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(fd, "GET /healthz HTTP/1.1\r\nHost: x"));  // and then nothing
  // The server gives up on the request after read_timeout: it may answer 400, then the
  // connection ends (recv returns 0, or an error once the server reset it) instead of holding a
  // worker forever. A receive timeout far above read_timeout keeps a failure from hanging the test.
  timeval limit{.tv_sec = 30, .tv_usec = 0};
  ASSERT_EQ(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit)), 0);
  std::string answer;
  char buffer[256];
  ssize_t n;
  while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0) answer.append(buffer, n);
  const bool timed_out = n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  EXPECT_FALSE(timed_out) << "the server kept the stalled connection open";
  EXPECT_THAT(answer, Not(HasSubstr("200 OK")));  // the half request was not served
  close(fd);
}

}  // namespace
}  // namespace sdm
