// Durability through the server (state_store/session_store.h, "Durability"; docs/api.md): each
// turn is written behind the stream, so what the state directory holds once the server says
// nothing is unpersisted restores every session in a new server (a kill -9 at that moment); when
// writes fail the server says so on /healthz, gRPC health and /metrics, and recovers with the
// disk.
#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "server/auth.h"
#include "state_store/session_key.h"
#include "tests/server/server_test_util.h"
#include "tests/state_store/fault_injection_files.h"

namespace sdm {
namespace {

using testing::FaultInjectionFiles;
using testing::ScopedTempDir;
using testing::TestHttpClient;

// Waits until `done` holds, polling; the store's worker acts on every change and at least once
// a second, so this converges quickly. Fails the test after a generous bound rather than hang.
bool Eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 12'000; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return done();
}

int64_t Position(v1::SdmService::Stub& stub, const std::string& id) {
  v1::Session session;
  const grpc::Status status = testing::GetSession(stub, id, &session);
  EXPECT_TRUE(status.ok()) << id << ": " << status.error_message();
  return status.ok() ? session.position() : -1;
}

double Metric(int port, const std::string& name) {
  return testing::MetricValue(testing::ScrapeMetrics(port), name);
}

TEST(ServerDurabilityTest, EveryTurnIsOnDiskBehindTheStream) {
  ScopedTempDir state, crashed;
  ServerOptions options = testing::TestOptions(state.path());
  ASSERT_EQ(options.store.persist, PersistPolicy::kTurn);  // the default
  testing::Served s = testing::Serve(options);
  ASSERT_NE(s.server, nullptr);
  ASSERT_TRUE(testing::CreateSession(*s.stub, "chat").ok());
  int64_t position = 0;
  for (int turn = 0; turn < 3; ++turn) {
    const testing::Completion c =
        testing::Generate(*s.stub, testing::TextRequest("turn " + std::to_string(turn), 4, "chat"));
    ASSERT_TRUE(c.status.ok()) << c.status.error_message();
    position = Position(*s.stub, "chat");
  }
  const int port = s.server->metrics_port();
  ASSERT_TRUE(Eventually([&] { return Metric(port, "sdm_sessions_unpersisted") == 0; }));
  // Created, then the turns (coalesced when a turn ends before the previous one is written).
  EXPECT_GE(Metric(port, "sdm_persist_writes_total"), 2);
  EXPECT_GT(Metric(port, "sdm_persist_bytes_total"), 0);
  EXPECT_EQ(Metric(port, "sdm_persistence_healthy"), 1);
#if defined(__GLIBC__)
  // The heap's figures (base/heap.h): what it holds covers what is in use, sessions included.
  const auto page = testing::ScrapeMetrics(port);  // both from one scrape
  EXPECT_GT(testing::MetricValue(page, "sdm_heap_in_use_bytes"), 0);
  EXPECT_GE(testing::MetricValue(page, "sdm_heap_system_bytes"),
            testing::MetricValue(page, "sdm_heap_in_use_bytes"));
#endif
  // kill -9 now: what the directory holds is what a restarted server finds.
  std::filesystem::copy(
      state.path(), crashed.path(),
      std::filesystem::copy_options::recursive | std::filesystem::copy_options::overwrite_existing);
  testing::Served restarted = testing::Serve(testing::TestOptions(crashed.path()));
  ASSERT_NE(restarted.server, nullptr);
  EXPECT_EQ(Position(*restarted.stub, "chat"), position);
}

// The heap trimmer's work shows on /metrics (base/heap.h): an idle server's bytes in use are
// flat, so it trims every interval.
TEST(ServerHeapTest, TrimsAreCountedOnTheMetricsPage) {
#if !defined(__GLIBC__)
  GTEST_SKIP() << "the trimmer trims glibc's heap";
#endif
  ScopedTempDir state;
  ServerOptions options = testing::TestOptions(state.path());
  options.malloc_trim_interval = absl::Milliseconds(4);
  testing::Served s = testing::Serve(options);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->metrics_port();
  ASSERT_TRUE(Eventually([&] { return Metric(port, "sdm_heap_trims_total") >= 2; }));

  options.malloc_trim_interval = absl::ZeroDuration();  // no trimmer: the counter stays at 0
  ScopedTempDir other;
  options.store.dir = other.path();
  testing::Served off = testing::Serve(options);
  ASSERT_NE(off.server, nullptr);
  EXPECT_EQ(Metric(off.server->metrics_port(), "sdm_heap_trims_total"), 0);
}

// A server keeping its state in `state` through `files` (which both must outlive), with the
// OpenAI-compatible HTTP API on a port of its own (SdmServer::http_port).
testing::Served ServeThrough(const ScopedTempDir& state, FaultInjectionFiles& files) {
  ServerOptions options = testing::TestOptions(state.path());
  options.store.files = &files;
  options.http.port = 0;
  options.http.host = "127.0.0.1";
  // A non-streaming HTTP turn is answered whole, with its own status, however slow the machine.
  options.http.status_wait = absl::Minutes(5);
  return testing::Serve(options);
}

// What a turn that could not be written ends with, after its tokens: not a final chunk, but
// UNAVAILABLE saying the turn is kept in memory and not saved (and why).
void ExpectNotSaved(absl::string_view message) {
  for (const char* says : {"session 'a'", "continues with it", "in memory", "not saved",
                           "No space left on device", "once writes succeed again", "crash"}) {
    EXPECT_NE(message.find(says), absl::string_view::npos) << says << ": " << message;
  }
}

// A stalled volume blocks a write instead of failing it, so the store never reports an error:
// health used to stay 200 while turns waited for ever. Past --persist_stall_timeout it is
// degraded and says why; it comes back when the write finishes.
TEST(ServerDurabilityTest, AWriteThatHangsDegradesHealthUntilItFinishes) {
  ScopedTempDir state;
  testing::SessionWriteFiles files;
  ServerOptions options = testing::TestOptions(state.path());
  options.store.files = &files;
  options.persist_stall_timeout = absl::Milliseconds(200);
  testing::Served s = testing::Serve(options);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->metrics_port();
  httplib::Client http = TestHttpClient(port);
  ASSERT_TRUE(testing::CreateSession(*s.stub, "a").ok());
  ASSERT_TRUE(Eventually([&] { return Metric(port, "sdm_sessions_unpersisted") == 0; }));
  EXPECT_EQ(http.Get("/healthz")->status, 200);

  files.Hold(SessionFileStem({kDefaultTenant, "a"}));
  testing::Completion turn;
  std::thread client(
      [&] { turn = testing::Generate(*s.stub, testing::TextRequest("hi", 2, "a")); });
  ASSERT_TRUE(files.WaitHeld(absl::Minutes(1)));  // its write is stuck in the volume
  ASSERT_TRUE(Eventually([&] {
    const httplib::Result health = http.Get("/healthz");
    return health && health->status == 503;
  }));
  const httplib::Result health = http.Get("/healthz");
  EXPECT_NE(health->body.find("a write to the state directory has not finished for"),
            std::string::npos)
      << health->body;
  EXPECT_GE(Metric(port, "sdm_persist_oldest_pending_seconds"), 0.2);
  // The gRPC health service too (it hears of no failure: the server polls for the stall).
  EXPECT_TRUE(Eventually([&] {
    return testing::HealthCheck(*s.channel, "sdm.v1.SdmService") == testing::kNotServing;
  }));
  EXPECT_EQ(testing::HealthCheck(*s.channel, ""), testing::kNotServing);

  files.Open();
  client.join();
  EXPECT_TRUE(turn.status.ok()) << turn.status.error_message();  // acknowledged once written
  ASSERT_TRUE(Eventually([&] {
    const httplib::Result h = http.Get("/healthz");
    return h && h->status == 200;
  }));
  EXPECT_EQ(Metric(port, "sdm_persist_oldest_pending_seconds"), 0);
  EXPECT_TRUE(Eventually(
      [&] { return testing::HealthCheck(*s.channel, "sdm.v1.SdmService") == testing::kServing; }));
}

// A full disk: health degrades and says why, turns are served but not acknowledged as saved
// (before, a turn whose write failed ended with a normal final chunk, status OK), and everything
// comes back with the disk.
TEST(ServerDurabilityTest, FailedWritesDegradeHealthUntilTheDiskComesBack) {
  ScopedTempDir state;
  FaultInjectionFiles files;
  testing::Served s = ServeThrough(state, files);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->metrics_port();
  httplib::Client http = TestHttpClient(port);
  EXPECT_EQ(http.Get("/healthz")->status, 200);

  files.FailWritesAlways(absl::ResourceExhaustedError("injected: No space left on device"));
  ASSERT_TRUE(testing::CreateSession(*s.stub, "a").ok());  // memory still has room: accepted
  ASSERT_TRUE(Eventually([&] {
    const httplib::Result health = http.Get("/healthz");
    return health && health->status == 503;
  }));
  const httplib::Result health = http.Get("/healthz");
  EXPECT_NE(health->body.find("degraded"), std::string::npos) << health->body;
  EXPECT_NE(health->body.find("No space left on device"), std::string::npos) << health->body;
  EXPECT_EQ(testing::HealthCheck(*s.channel, "sdm.v1.SdmService"), testing::kNotServing);
  EXPECT_EQ(testing::HealthCheck(*s.channel, ""), testing::kNotServing);
  const testing::ParsedPage page = testing::ScrapeMetrics(port);
  EXPECT_EQ(testing::MetricValue(page, "sdm_persistence_healthy"), 0);
  EXPECT_EQ(testing::MetricValue(page, "sdm_persist_failures_total"), 1);
  EXPECT_EQ(testing::MetricValue(page, "sdm_sessions_unpersisted"), 1);
  // The session still serves (memory has room), but its turns are not acknowledged as saved:
  // the tokens stream, then UNAVAILABLE says the turn is kept in memory and not on disk; the
  // session continues with it.
  const testing::Completion turn = testing::Generate(*s.stub, testing::TextRequest("hi", 2, "a"));
  EXPECT_EQ(turn.status.error_code(), grpc::StatusCode::UNAVAILABLE) << turn.status.error_message();
  EXPECT_FALSE(turn.tokens.empty());
  EXPECT_EQ(turn.finish, v1::FINISH_REASON_UNSPECIFIED);  // no final chunk
  ExpectNotSaved(turn.status.error_message());
  const int64_t after_turn = Position(*s.stub, "a");
  EXPECT_GT(after_turn, 0);
  // The same over HTTP: the text streams, then an error event says so.
  httplib::Client api = TestHttpClient(s.server->http_port());
  const httplib::Result streamed = api.Post(
      "/v1/completions", R"({"prompt": "hi", "max_tokens": 2, "session_id": "a", "stream": true})",
      "application/json");
  ASSERT_TRUE(streamed);
  EXPECT_EQ(streamed->status, 200);  // sent before the turn ended
  const size_t error_event = streamed->body.find("data: {\"error\"");
  ASSERT_NE(error_event, std::string::npos) << streamed->body;
  EXPECT_NE(streamed->body.find("\"text\""), std::string::npos) << streamed->body;
  EXPECT_EQ(streamed->body.find("[DONE]"), std::string::npos) << streamed->body;
  ExpectNotSaved(absl::string_view(streamed->body).substr(error_event));
  const int64_t after_streamed = Position(*s.stub, "a");
  EXPECT_GT(after_streamed, after_turn);
  // Not streamed, a turn that ends within the response's status wait is answered with its error's
  // status (it was a 200 whose body was the error, which OpenAI's SDKs take for a completion).
  const httplib::Result whole =
      api.Post("/v1/completions", R"({"prompt": "hi", "max_tokens": 2, "session_id": "a"})",
               "application/json");
  ASSERT_TRUE(whole);
  EXPECT_EQ(whole->status, 503) << whole->body;
  ExpectNotSaved(whole->body);
  EXPECT_GT(Position(*s.stub, "a"), after_streamed);

  files.ClearFaults();
  ASSERT_TRUE(Eventually([&] {
    const httplib::Result h = http.Get("/healthz");
    return h && h->status == 200;
  }));
  EXPECT_EQ(testing::HealthCheck(*s.channel, "sdm.v1.SdmService"), testing::kServing);
  // Written again: a turn ends with its final chunk.
  const testing::Completion saved = testing::Generate(*s.stub, testing::TextRequest("hi", 2, "a"));
  EXPECT_TRUE(saved.status.ok()) << saved.status.error_message();
  EXPECT_NE(saved.finish, v1::FINISH_REASON_UNSPECIFIED);
  ASSERT_TRUE(Eventually([&] { return Metric(port, "sdm_sessions_unpersisted") == 0; }));
  EXPECT_EQ(Metric(port, "sdm_persistence_healthy"), 1);
  EXPECT_EQ(Metric(port, "sdm_persist_failures_total"), 1);  // one episode
}

// The server's own file system refusing it (EACCES on its state directory) is the server's
// fault, not the caller's: a DeleteSession whose snapshot cannot be removed answers INTERNAL
// saying the state directory refused, never PERMISSION_DENIED (which would tell a client with a
// valid key that it lacks a permission). The session is still there, and deletable once the
// directory is.
TEST(ServerDurabilityTest, AStateDirectoryThatRefusesTheServerIsNotTheCallersPermission) {
  ScopedTempDir state;
  FaultInjectionFiles files;
  testing::Served s = ServeThrough(state, files);
  ASSERT_NE(s.server, nullptr);
  ASSERT_TRUE(testing::CreateSession(*s.stub, "a").ok());
  ASSERT_TRUE(testing::Generate(*s.stub, testing::TextRequest("hi", 2, "a")).status.ok());
  const int port = s.server->metrics_port();
  ASSERT_TRUE(Eventually([&] { return Metric(port, "sdm_sessions_unpersisted") == 0; }));
  files.FailNext(FaultInjectionFiles::Op::kRemove,
                 {.status = absl::PermissionDeniedError("injected: Permission denied")});
  const auto remove = [&] {
    grpc::ClientContext context;
    v1::DeleteSessionRequest request;
    request.set_session_id("a");
    v1::DeleteSessionResponse response;
    return s.stub->DeleteSession(&context, request, &response);
  };
  const grpc::Status refused = remove();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INTERNAL) << refused.error_message();
  EXPECT_NE(refused.error_message().find("state directory"), std::string::npos)
      << refused.error_message();
  EXPECT_NE(refused.error_message().find("Permission denied"), std::string::npos)
      << refused.error_message();
  v1::Session still;
  EXPECT_TRUE(testing::GetSession(*s.stub, "a", &still).ok());
  const grpc::Status deleted = remove();
  EXPECT_TRUE(deleted.ok()) << deleted.error_message();
}

}  // namespace
}  // namespace sdm
