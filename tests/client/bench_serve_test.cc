// sdm-bench serve: its statistics on known inputs, distribution parsing, and whole runs against
// a fake SdmService on loopback.
#include "client/bench_serve.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "client/distribution.h"
#include "client/latency_stats.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/client/fake_sdm_service.h"

namespace sdm::client {
namespace {

using ::testing::DoubleNear;
using ::testing::ElementsAre;
using testing::FakeServer;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::Pointwise;

// ---- percentiles ----------------------------------------------------------------------------

// The percentile convention itself is tested in tests/common/percentile_test.cc.
TEST(LatencyStatsTest, SummarizeOneToAHundred) {
  std::vector<double> samples;
  for (int i = 100; i >= 1; --i) samples.push_back(i);  // unsorted on purpose
  const LatencySummary s = Summarize(samples);
  EXPECT_EQ(s.count, 100);
  EXPECT_DOUBLE_EQ(s.mean, 50.5);
  EXPECT_DOUBLE_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.p50, 50.5);
  EXPECT_DOUBLE_EQ(s.p90, 90.1);
  EXPECT_DOUBLE_EQ(s.p99, 99.01);
  EXPECT_DOUBLE_EQ(s.max, 100);

  const LatencySummary empty = Summarize({});
  EXPECT_EQ(empty.count, 0);
  EXPECT_TRUE(std::isnan(empty.p50));
}

// ---- distributions --------------------------------------------------------------------------

TEST(DistributionTest, ParsesEveryForm) {
  absl::StatusOr<Distribution> d = Distribution::Parse("64");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->kind(), Distribution::Kind::kFixed);
  EXPECT_EQ(d->ToString(), "64");
  d = Distribution::Parse("fixed:8");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->ToString(), "8");
  d = Distribution::Parse("uniform:16:64");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->kind(), Distribution::Kind::kUniform);
  EXPECT_EQ(d->a(), 16);
  EXPECT_EQ(d->b(), 64);
  EXPECT_EQ(d->Mean(), 40);
  EXPECT_EQ(d->ToString(), "uniform:16:64");
  d = Distribution::Parse("normal:128:32.5");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->kind(), Distribution::Kind::kNormal);
  EXPECT_EQ(d->ToString(), "normal:128:32.5");
  EXPECT_EQ(Distribution::Parse(d->ToString())->ToString(), d->ToString());
}

TEST(DistributionTest, RejectsMalformedText) {
  for (const char* bad :
       {"", "0", "-4", "abc", "fixed:0", "uniform:1", "uniform:0:3", "uniform:5:3", "uniform:a:b",
        "normal:0:1", "normal:10:-1", "normal:10:nan", "gamma:1:2", "uniform:1:2:3"}) {
    absl::StatusOr<Distribution> d = Distribution::Parse(bad);
    EXPECT_FALSE(d.ok()) << bad;
    if (!d.ok()) {
      EXPECT_THAT(d.status().message(), HasSubstr("uniform:A:B")) << bad;
    }
  }
}

TEST(DistributionTest, SamplesStayInRangeAndAreReproducible) {
  const Distribution uniform = *Distribution::Parse("uniform:3:6");
  std::mt19937_64 rng(7);
  std::set<int64_t> seen;
  for (int i = 0; i < 2000; ++i) {
    const int64_t v = uniform.Sample(rng);
    ASSERT_GE(v, 3);
    ASSERT_LE(v, 6);
    seen.insert(v);
  }
  EXPECT_EQ(seen, (std::set<int64_t>{3, 4, 5, 6}));

  const Distribution normal = *Distribution::Parse("normal:2:50");
  double sum = 0;
  for (int i = 0; i < 2000; ++i) {
    const int64_t v = normal.Sample(rng);
    ASSERT_GE(v, 1);  // clamped
    sum += v;
  }
  EXPECT_GT(sum / 2000, 2);  // the clamp lifts the mean
  EXPECT_EQ(Distribution::Parse("normal:10:0")->Sample(rng), 10);
  EXPECT_EQ(Distribution::Fixed(5).Sample(rng), 5);

  std::mt19937_64 a(42), b(42);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(uniform.Sample(a), uniform.Sample(b));
}

// ---- per-request timing and aggregation -----------------------------------------------------

TEST(BenchServeTest, TimeStreamSplitsChunkGapsPerToken) {
  // An empty first chunk, then 1 token at 100 ms, 1 at 150 ms, 2 at 350 ms, the final chunk.
  const std::vector<std::pair<double, int64_t>> chunks = {
      {0.01, 0}, {0.1, 1}, {0.15, 1}, {0.35, 2}, {0.4, 0}};
  const StreamTiming t = TimeStream(chunks);
  EXPECT_DOUBLE_EQ(t.ttft, 0.1);
  EXPECT_THAT(t.itl, Pointwise(DoubleNear(1e-12), std::vector<double>{0.05, 0.1, 0.1}));

  // Tokens of the first chunk beyond the first add no samples.
  const std::vector<std::pair<double, int64_t>> bunched = {{0.2, 3}, {0.5, 1}};
  const StreamTiming u = TimeStream(bunched);
  EXPECT_DOUBLE_EQ(u.ttft, 0.2);
  EXPECT_THAT(u.itl, Pointwise(DoubleNear(1e-12), std::vector<double>{0.3}));

  EXPECT_EQ(TimeStream({}).ttft, -1);
}

TEST(BenchServeTest, AggregateCountsTokensRatesAndErrors) {
  std::vector<RequestRecord> records(5);
  for (int i = 0; i < 3; ++i) {
    records[i].prompt_tokens = 10;
    records[i].generated_tokens = 20;
    records[i].ttft = 0.01 * (i + 1);  // 10, 20, 30 ms
    records[i].e2e = 0.1 * (i + 1);    // 100, 200, 300 ms
  }
  records[2].reused_session = true;
  records[2].history_tokens = 50;
  records[3].code = grpc::StatusCode::RESOURCE_EXHAUSTED;
  records[3].e2e = 0.004;
  records[4].code = grpc::StatusCode::RESOURCE_EXHAUSTED;
  records[4].e2e = 0.008;
  const BenchServeResult r = Aggregate(records, {0.001, 0.002, 0.003, 0.004}, 2.0);
  EXPECT_EQ(r.requests, 5);
  EXPECT_EQ(r.ok, 3);
  EXPECT_EQ(r.reused, 1);
  EXPECT_EQ(r.output_tokens, 60);
  EXPECT_EQ(r.prompt_tokens, 30);
  EXPECT_EQ(r.history_tokens, 50);
  EXPECT_DOUBLE_EQ(r.output_tokens_per_s, 30);
  EXPECT_DOUBLE_EQ(r.requests_per_s, 1.5);
  EXPECT_DOUBLE_EQ(r.prompt_tokens_per_s, 15);
  EXPECT_EQ(r.errors_by_code, (std::map<std::string, int64_t>{{"RESOURCE_EXHAUSTED", 2}}));
  EXPECT_EQ(r.ttft_ms.count, 3);
  EXPECT_NEAR(r.ttft_ms.p50, 20, 1e-9);
  EXPECT_NEAR(r.e2e_ms.p99, 298, 1e-9);
  EXPECT_EQ(r.e2e_ms.count, 3);  // failed calls are not in the ok calls' latency
  EXPECT_EQ(r.failed_e2e_ms.count, 2);
  EXPECT_NEAR(r.failed_e2e_ms.min, 4, 1e-9);
  EXPECT_NEAR(r.failed_e2e_ms.max, 8, 1e-9);
  EXPECT_EQ(r.itl_ms.count, 4);
  EXPECT_NEAR(r.itl_ms.p50, 2.5, 1e-9);

  const nlohmann::json j = ToJson(r);
  EXPECT_EQ(j["requests"]["errors"]["RESOURCE_EXHAUSTED"], 2);
  EXPECT_EQ(j["throughput"]["output_tokens_per_s"], 30.0);
  EXPECT_EQ(j["ttft_ms"]["count"], 3);
  EXPECT_EQ(j["failed_e2e_ms"]["count"], 2);
  const std::string report = FormatReport(r);
  EXPECT_THAT(report, HasSubstr("errors: RESOURCE_EXHAUSTED 2"));
  EXPECT_THAT(report, HasSubstr("30.0 output tokens/s"));
  EXPECT_THAT(report, HasSubstr("TTFT"));
  EXPECT_THAT(report, HasSubstr("failed E2E"));

  // No samples: null in JSON, "-" in the table.
  const BenchServeResult none = Aggregate({}, {}, 1.0);
  EXPECT_TRUE(ToJson(none)["ttft_ms"]["p50"].is_null());
  EXPECT_THAT(FormatReport(none), HasSubstr("errors: none"));
  EXPECT_THAT(FormatReport(none), Not(HasSubstr("failed E2E")));
}

TEST(BenchServeTest, ValidateOptions) {
  BenchServeOptions o;
  EXPECT_TRUE(ValidateOptions(o).ok());
  o.concurrency = 0;
  EXPECT_FALSE(ValidateOptions(o).ok());
  o = BenchServeOptions();
  o.session_reuse = 1.5;
  EXPECT_FALSE(ValidateOptions(o).ok());
  o.session_reuse = 0.5;
  o.sessions = 0;
  EXPECT_FALSE(ValidateOptions(o).ok());
  o = BenchServeOptions();
  o.requests = 0;
  EXPECT_FALSE(ValidateOptions(o).ok());
  o.duration = absl::Seconds(1);
  EXPECT_TRUE(ValidateOptions(o).ok());
}

// ---- whole runs against the fake ------------------------------------------------------------

class BenchServeRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.ok());
    connection_.host = server_.address();
    stub_ = sdm::v1::SdmService::NewStub(
        grpc::CreateChannel(connection_.host, grpc::InsecureChannelCredentials()));
  }

  FakeServer server_;
  ConnectionOptions connection_;
  std::unique_ptr<sdm::v1::SdmService::Stub> stub_;
};

TEST_F(BenchServeRunTest, RunsEveryRequestAndReusesSessionsOneCallAtATime) {
  server_.service().set_chunk_delay(absl::Milliseconds(1));
  BenchServeOptions o;
  o.concurrency = 4;
  o.requests = 24;
  o.warmup = 2;
  o.prompt_tokens = *Distribution::Parse("uniform:3:9");
  o.max_tokens = Distribution::Fixed(5);
  o.session_reuse = 0.5;
  o.sessions = 2;
  o.session_prefix = "b";
  std::ostringstream log;
  absl::StatusOr<BenchServeResult> r = RunBenchServe(*stub_, connection_, o, log);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->requests, 24);
  EXPECT_EQ(r->ok, 24) << FormatReport(*r);  // no ABORTED: a session never runs two calls
  EXPECT_TRUE(r->errors_by_code.empty());
  EXPECT_EQ(r->output_tokens, 24 * 5);
  EXPECT_EQ(r->ttft_ms.count, 24);
  EXPECT_EQ(r->itl_ms.count, 24 * 4);
  EXPECT_EQ(r->e2e_ms.count, 24);
  EXPECT_GT(r->output_tokens_per_s, 0);
  // The fake waits 1 ms before each of a call's 5 tokens, so no call ends sooner (how the gaps
  // between chunks fall depends on when the client reads them: not checked).
  EXPECT_GE(r->e2e_ms.min, 5.0);
  EXPECT_EQ(r->model, "fake");

  // The fake saw the warmup too; prompts are ids of the tokenizer other than BOS and EOS.
  const auto requests = server_.service().generate_requests();
  ASSERT_EQ(requests.size(), 26u);
  int64_t with_session = 0;
  for (const auto& q : requests) {
    ASSERT_TRUE(q.has_token_ids());
    EXPECT_GE(q.token_ids().ids_size(), 3);
    EXPECT_LE(q.token_ids().ids_size(), 9);
    for (const int32_t id : q.token_ids().ids()) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, 256);
    }
    EXPECT_EQ(q.sampling().max_tokens(), 5);
    EXPECT_TRUE(q.sampling().ignore_eos());  // the planned lengths are the workload
    if (!q.session_id().empty()) {
      ++with_session;
      EXPECT_TRUE(q.session_id() == "b-0" || q.session_id() == "b-1") << q.session_id();
    }
  }
  EXPECT_GT(with_session, 0);
  EXPECT_LT(with_session, 26);
  EXPECT_GT(r->reused, 0);
  EXPECT_GT(r->history_tokens, 0);  // reused sessions carried earlier turns
  // The sessions were created, then deleted at the end.
  EXPECT_EQ(server_.service().calls("CreateSession").size(), 2u);
  EXPECT_EQ(server_.service().calls("DeleteSession").size(), 2u);
  EXPECT_FALSE(server_.service().HasSession("b-0"));
}

TEST_F(BenchServeRunTest, WithoutIgnoreEosTheServerMayEndCallsAtEos) {
  BenchServeOptions o;
  o.requests = 2;
  o.ignore_eos = false;
  std::ostringstream log;
  absl::StatusOr<BenchServeResult> r = RunBenchServe(*stub_, connection_, o, log);
  ASSERT_TRUE(r.ok()) << r.status();
  const auto q = server_.service().generate_requests();
  ASSERT_EQ(q.size(), 2u);
  for (const auto& request : q) EXPECT_FALSE(request.sampling().ignore_eos());
  EXPECT_THAT(FormatReport(*r), HasSubstr("(EOS may end a call sooner)"));
  EXPECT_EQ(ToJson(*r)["config"]["ignore_eos"], false);
}

TEST_F(BenchServeRunTest, TheSamePlanForTheSameSeed) {
  BenchServeOptions o;
  o.requests = 6;
  o.prompt_tokens = *Distribution::Parse("uniform:1:50");
  o.max_tokens = *Distribution::Parse("uniform:1:4");
  o.seed = 9;
  std::ostringstream log;
  ASSERT_TRUE(RunBenchServe(*stub_, connection_, o, log).ok());
  ASSERT_TRUE(RunBenchServe(*stub_, connection_, o, log).ok());
  const auto q = server_.service().generate_requests();
  ASSERT_EQ(q.size(), 12u);
  // Each request's plan depends on (seed, index) only; one worker runs them in order.
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(q[i].SerializeAsString(), q[i + 6].SerializeAsString()) << i;
  }
}

TEST_F(BenchServeRunTest, DurationModeRunsUntilTheTimeIsUp) {
  server_.service().set_chunk_delay(absl::Milliseconds(2));
  BenchServeOptions o;
  o.concurrency = 2;
  o.duration = absl::Seconds(1);
  o.max_tokens = Distribution::Fixed(3);
  std::ostringstream log;
  absl::StatusOr<BenchServeResult> r = RunBenchServe(*stub_, connection_, o, log);
  ASSERT_TRUE(r.ok()) << r.status();
  // It ran for the whole duration, and every call it made is counted (how many fit in the
  // second depends on the machine's load; each worker makes its first call whatever the time).
  EXPECT_GE(r->wall_seconds, 1.0);
  EXPECT_GE(r->ok, o.concurrency);
  EXPECT_EQ(r->ok, static_cast<int64_t>(server_.service().generate_requests().size()));
}

TEST_F(BenchServeRunTest, FailedCallsAreCountedByCode) {
  server_.service().FailNext("Generate",
                             grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "queue full"), 3);
  BenchServeOptions o;
  o.requests = 5;
  o.max_tokens = Distribution::Fixed(2);
  std::ostringstream log;
  absl::StatusOr<BenchServeResult> r = RunBenchServe(*stub_, connection_, o, log);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->ok, 2);
  EXPECT_EQ(r->errors_by_code.at("RESOURCE_EXHAUSTED"), 3);
  EXPECT_EQ(r->output_tokens, 4);
  EXPECT_EQ(r->ttft_ms.count, 2);
}

// --async: one thread keeps the calls in flight on gRPC's callback API. Every call is made and
// measured as with a thread per call: the same requests for the same plan, failures counted by
// code, a burst of calls all in flight at once.
TEST_F(BenchServeRunTest, AsyncCallsAreTheSameCallsMeasuredAlike) {
  server_.service().set_chunk_delay(absl::Milliseconds(1));
  BenchServeOptions o;
  o.concurrency = 3;
  o.requests = 12;
  o.warmup = 1;
  o.prompt_tokens = *Distribution::Parse("uniform:2:20");
  o.max_tokens = Distribution::Fixed(4);
  o.seed = 5;
  std::ostringstream log;
  o.async_calls = true;
  absl::StatusOr<BenchServeResult> r = RunBenchServe(*stub_, connection_, o, log);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->requests, 12);
  EXPECT_EQ(r->ok, 12) << FormatReport(*r);
  EXPECT_EQ(r->output_tokens, 12 * 4);
  EXPECT_EQ(r->ttft_ms.count, 12);
  EXPECT_EQ(r->itl_ms.count, 12 * 3);
  EXPECT_GE(r->e2e_ms.min, 4.0);  // the fake waits 1 ms before each of the 4 tokens
  o.async_calls = false;
  ASSERT_TRUE(RunBenchServe(*stub_, connection_, o, log).ok());
  // The same 13 requests (warm-up included), in whatever order they arrived.
  std::vector<std::string> async_requests, sync_requests;
  const auto q = server_.service().generate_requests();
  ASSERT_EQ(q.size(), 26u);
  for (size_t i = 0; i < 13; ++i) async_requests.push_back(q[i].SerializeAsString());
  for (size_t i = 13; i < 26; ++i) sync_requests.push_back(q[i].SerializeAsString());
  std::sort(async_requests.begin(), async_requests.end());
  std::sort(sync_requests.begin(), sync_requests.end());
  EXPECT_EQ(async_requests, sync_requests);

  // A burst: every call in flight at once, most refused.
  server_.service().FailNext("Generate",
                             grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "queue full"), 20);
  o.async_calls = true;
  o.warmup = 0;
  o.concurrency = 24;
  o.requests = 24;
  r = RunBenchServe(*stub_, connection_, o, log);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->requests, 24);
  EXPECT_EQ(r->ok, 4);
  EXPECT_EQ(r->errors_by_code.at("RESOURCE_EXHAUSTED"), 20);
  EXPECT_EQ(r->failed_e2e_ms.count, 20);
  // No session reuse in this mode.
  o.session_reuse = 0.5;
  EXPECT_EQ(RunBenchServe(*stub_, connection_, o, log).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(BenchServeRunTest, SetupFailuresAreReturned) {
  server_.service().FailNext("GetModelInfo",
                             grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "no key"));
  std::ostringstream log;
  absl::StatusOr<BenchServeResult> r = RunBenchServe(*stub_, connection_, BenchServeOptions(), log);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(r.status().message(), HasSubstr("no key"));
}

// A setup that fails part-way (the sixth CreateSession: its id is taken) deletes the five
// sessions it created before returning the error, trying every one and logging a deletion that
// fails; --keep_sessions, which keeps a run's sessions, does not keep these. Before, they stayed
// on the server.
TEST_F(BenchServeRunTest, ASetupThatFailsPartWayDeletesTheSessionsItCreated) {
  {
    grpc::ClientContext context;
    sdm::v1::CreateSessionRequest request;
    request.set_session_id("b-5");  // not the benchmark's
    sdm::v1::Session session;
    ASSERT_TRUE(stub_->CreateSession(&context, request, &session).ok());
  }
  server_.service().FailNext("DeleteSession",
                             grpc::Status(grpc::StatusCode::UNAVAILABLE, "draining"));
  BenchServeOptions o;
  o.session_reuse = 1;
  o.sessions = 8;
  o.session_prefix = "b";
  o.keep_sessions = true;
  std::ostringstream log;
  absl::StatusOr<BenchServeResult> r = RunBenchServe(*stub_, connection_, o, log);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(r.status().message(), HasSubstr("CreateSession b-5"));

  std::vector<std::string> created, deleted;
  for (const auto& call : server_.service().calls("CreateSession")) {
    created.push_back(call.session_id);
  }
  for (const auto& call : server_.service().calls("DeleteSession")) {
    deleted.push_back(call.session_id);
  }
  EXPECT_THAT(created, ElementsAre("b-5", "b-0", "b-1", "b-2", "b-3", "b-4", "b-5"));
  EXPECT_THAT(deleted, ElementsAre("b-0", "b-1", "b-2", "b-3", "b-4"));
  EXPECT_THAT(log.str(), HasSubstr("could not delete session b-0: UNAVAILABLE: draining"));
  EXPECT_TRUE(server_.service().HasSession("b-0"));  // its deletion failed
  for (const char* id : {"b-1", "b-2", "b-3", "b-4"}) {
    EXPECT_FALSE(server_.service().HasSession(id)) << id;
  }
  EXPECT_TRUE(server_.service().HasSession("b-5"));  // not the benchmark's to delete
  EXPECT_TRUE(server_.service().generate_requests().empty());
}

// ---- the command line -----------------------------------------------------------------------

struct CommandResult {
  int exit;
  std::string out;
  std::string err;
};

CommandResult RunCommand(const std::vector<std::string>& args) {
  std::istringstream in;
  std::ostringstream out, err;
  ClientIo io;
  io.in = &in;
  io.out = &out;
  io.err = &err;
  io.env = [](absl::string_view) { return std::nullopt; };
  const int exit = RunBenchServeCommand(args, io);
  return {exit, out.str(), err.str()};
}

TEST_F(BenchServeRunTest, CommandPrintsTheTableAndWritesJson) {
  const std::string json_path = ::testing::TempDir() + "/bench_serve_test.json";
  std::remove(json_path.c_str());
  const CommandResult r =
      RunCommand({"serve", "--host", server_.address(), "--concurrency", "2", "--requests", "6",
                  "--prompt_tokens", "uniform:2:4", "--max_tokens", "3", "--session_reuse", "1",
                  "--sessions", "2", "--json", json_path});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  EXPECT_THAT(r.out, HasSubstr("concurrency 2, 6 requests"));
  EXPECT_THAT(r.out, HasSubstr("6 requests continued a session"));
  EXPECT_THAT(r.out, HasSubstr("TTFT"));
  EXPECT_THAT(r.out, HasSubstr("ITL"));
  EXPECT_THAT(r.out, HasSubstr("E2E"));
  std::ifstream file(json_path);
  ASSERT_TRUE(file.good());
  const nlohmann::json j = nlohmann::json::parse(file);
  EXPECT_EQ(j["config"]["concurrency"], 2);
  EXPECT_EQ(j["config"]["prompt_tokens"], "uniform:2:4");
  EXPECT_EQ(j["requests"]["ok"], 6);
  EXPECT_EQ(j["tokens"]["output"], 18);
  for (const char* key : {"ttft_ms", "itl_ms", "e2e_ms"}) {
    for (const char* stat : {"p50", "p90", "p99"}) {
      EXPECT_TRUE(j[key][stat].is_number()) << key << "." << stat;
    }
  }
}

// With --json -, stdout is the JSON document and nothing else (a pipe to jq parses it): the
// report and the progress lines go to stderr. Before, the report came first on stdout.
TEST_F(BenchServeRunTest, JsonToStdoutIsTheOnlyThingOnStdout) {
  const CommandResult r =
      RunCommand({"--host", server_.address(), "--requests", "3", "--max_tokens", "2",
                  "--session_reuse", "1", "--sessions", "1", "--warmup", "1", "--json", "-"});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);  // throws on anything around it
  EXPECT_EQ(j["requests"]["ok"], 3);
  EXPECT_THAT(r.err, HasSubstr("created 1 sessions"));
  EXPECT_THAT(r.err, HasSubstr("warmup: 1 requests"));
  EXPECT_THAT(r.err, HasSubstr("measuring: concurrency 1, 3 requests"));
  EXPECT_THAT(r.err, HasSubstr("TTFT"));
  EXPECT_THAT(r.err, HasSubstr("ok 3, errors: none"));
}

// sdm-bench serve takes --api_key_file as sdm-client does (client/connection.h): every call
// carries the file's key; an empty file is refused before any call, its message quoting no key.
TEST_F(BenchServeRunTest, CommandReadsTheApiKeyFile) {
  const std::string key_file = ::testing::TempDir() + "/bench_serve_test_key";
  std::ofstream(key_file, std::ios::trunc) << "sk-bench-file\n";
  CommandResult r = RunCommand({"--host", server_.address(), "--requests", "2", "--max_tokens", "1",
                                "--api_key_file", key_file});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  ASSERT_EQ(server_.service().calls().size(), 3u);  // GetModelInfo, 2 Generate
  for (const auto& call : server_.service().calls()) {
    EXPECT_EQ(call.authorization, "Bearer sk-bench-file") << call.method;
  }
  std::ofstream(key_file, std::ios::trunc) << "";
  r = RunCommand({"--host", server_.address(), "--api_key_file", key_file});
  EXPECT_EQ(r.exit, kExitUsage);
  EXPECT_THAT(r.err, HasSubstr("(--api_key_file) is empty"));
  r = RunCommand({"--host", server_.address(), "--api_key_file", key_file, "--api_key", "sk-x"});
  EXPECT_EQ(r.exit, kExitUsage);
  EXPECT_THAT(r.err, Not(HasSubstr("sk-x")));
  EXPECT_EQ(server_.service().calls().size(), 3u);
}

TEST_F(BenchServeRunTest, CommandUsageErrorsAndFailures) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"--prompt_tokens", "uniform:9:3"},
           {"--max_tokens", "lots"},
           {"--concurrency", "0"},
           {"--session_reuse", "2"},
           {"--duration", "forever"},
           {"--seed", "x"},
           {"--bogus"},
           {"extra"},
       }) {
    std::vector<std::string> full = args;
    full.push_back("--host");
    full.push_back(server_.address());
    const CommandResult r = RunCommand(full);
    EXPECT_EQ(r.exit, kExitUsage) << ::testing::PrintToString(args);
  }
  EXPECT_TRUE(server_.service().calls().empty());

  server_.service().FailNext("Generate", grpc::Status(grpc::StatusCode::UNAVAILABLE, "draining"),
                             100);
  CommandResult r = RunCommand({"--host", server_.address(), "--requests", "3"});
  EXPECT_EQ(r.exit, kExitFailure);  // every measured call failed
  EXPECT_THAT(r.out, HasSubstr("errors: UNAVAILABLE 3"));

  server_.service().FailNext("GetModelInfo",
                             grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "no key"));
  r = RunCommand({"--host", server_.address()});
  EXPECT_EQ(r.exit, kExitFailure);
  // With where the key comes from: sdm-bench serve's own flags and variable.
  EXPECT_THAT(r.err, HasSubstr("sdm-bench serve: UNAUTHENTICATED: GetModelInfo: no key (give the "
                               "API key with --api_key, --api_key_file or SDM_API_KEY)\n"));

  EXPECT_EQ(RunCommand({"--help"}).exit, kExitOk);
}

}  // namespace
}  // namespace sdm::client
