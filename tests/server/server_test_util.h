// Helpers for tests that talk to a real SdmServer over loopback gRPC: a tiny random model on disk,
// server options sized for tests, and a client-side Generate that collects a whole stream.
#ifndef SDMSERVE_TESTS_SERVER_SERVER_TEST_UTIL_H_
#define SDMSERVE_TESTS_SERVER_SERVER_TEST_UTIL_H_

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/model_config.h"
#include "engine/model_writer.h"
#include "engine/safetensors.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/client_unary_call.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "sdm/v1/sdm.grpc.pb.h"
#include "server/server.h"
#include "tests/base/eventually.h"
#include "tests/engine/test_model_util.h"
#include "tests/server/http_test_client.h"
#include "tests/server/prometheus_text_parser.h"

namespace sdm::testing {

// A directory holding the "tiny" preset with random weights (seed 7), written once per process.
inline const std::filesystem::path& TinyModelDir() {
  static ScopedTempDir dir;  // removed at exit
  static const std::filesystem::path model = [] {
    const std::filesystem::path path = dir.path() / "tiny-model";
    std::filesystem::create_directories(path);
    RandomModelOptions options;
    options.seed = 7;
    options.threads = 1;
    const absl::Status s = WriteRandomModel(TinyConfig(), path, options);
    EXPECT_TRUE(s.ok()) << s;
    return path;
  }();
  return model;
}

// The same model with the output row of EOS (id 257) zeroed: its logit is always 0, below the
// maximum of the 257 other (random) logits, so greedy decoding never ends a stream by itself.
// Long streams (cancellation, deadlines, queueing, shutdown) run on it.
inline const std::filesystem::path& NoEosModelDir() {
  static const std::filesystem::path model = [] {
    const std::filesystem::path path = TinyModelDir().parent_path() / "tiny-model-no-eos";
    std::filesystem::create_directories(path);
    RandomModelOptions options;
    options.seed = 7;
    options.threads = 1;
    const absl::Status s = WriteRandomModel(TinyConfig(), path, options);
    EXPECT_TRUE(s.ok()) << s;
    const std::filesystem::path weights = path / "model.safetensors";
    absl::StatusOr<SafetensorsIndex> index = ReadSafetensorsIndex(weights);
    EXPECT_TRUE(index.ok()) << index.status();
    const SafetensorsEntry* output = index.ok() ? index->Find("output.weight") : nullptr;
    EXPECT_TRUE(output != nullptr && output->dtype == TensorDtype::kF32);
    if (output == nullptr) return path;
    const int64_t dim = output->shape[1];
    std::fstream f(weights, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(index->data_offset + output->begin + 257 * dim * 4);
    const std::string zeros(static_cast<size_t>(dim * 4), '\0');
    f.write(zeros.data(), static_cast<std::streamsize>(zeros.size()));
    EXPECT_TRUE(f.good());
    return path;
  }();
  return model;
}

// A server on free loopback ports (gRPC and HTTP), one engine thread, snapshots in `state_dir`.
inline ServerOptions TestOptions(const std::filesystem::path& state_dir) {
  ServerOptions o;
  o.model_dir = NoEosModelDir();
  o.host = "127.0.0.1";
  o.port = 0;
  o.metrics_host = "127.0.0.1";
  o.metrics_port = 0;
  o.store.dir = state_dir;
  o.engine.num_threads = 1;
  o.service.max_prompt_tokens = 256;
  o.service.max_tokens_limit = 1'000'000;  // long streams for cancellation tests
  o.shutdown_grace = absl::Seconds(5);
  o.final_write_grace = absl::Minutes(1);  // a loaded machine may take seconds to write a chunk
  return o;
}

struct Served {
  std::unique_ptr<SdmServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::SdmService::Stub> stub;
};

inline Served Serve(const ServerOptions& options) {
  Served s;
  absl::StatusOr<std::unique_ptr<SdmServer>> server = SdmServer::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return s;
  s.server = *std::move(server);
  s.channel = grpc::CreateChannel(s.server->address(), grpc::InsecureChannelCredentials());
  s.stub = v1::SdmService::NewStub(s.channel);
  return s;
}

struct CallOptions {
  std::string api_key = "";  // sent as "authorization: Bearer KEY" when set
  std::chrono::milliseconds timeout{60'000};
  int cancel_after_chunks = 0;  // > 0: the client cancels after this many chunks
};

inline void Prepare(grpc::ClientContext& context, const CallOptions& call) {
  if (!call.api_key.empty()) context.AddMetadata("authorization", "Bearer " + call.api_key);
  context.set_deadline(std::chrono::system_clock::now() + call.timeout);
}

// A whole Generate stream, as the client saw it.
struct Completion {
  grpc::Status status;
  std::vector<int32_t> tokens;
  std::string text;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  v1::Usage usage;
  int chunks = 0;
  std::multimap<std::string, std::string> trailers;
};

inline Completion Generate(v1::SdmService::Stub& stub, const v1::GenerateRequest& request,
                           const CallOptions& call = {}) {
  grpc::ClientContext context;
  Prepare(context, call);
  Completion c;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
      stub.Generate(&context, request);
  v1::GenerateResponse chunk;
  while (reader->Read(&chunk)) {
    ++c.chunks;
    c.tokens.insert(c.tokens.end(), chunk.token_ids().begin(), chunk.token_ids().end());
    c.text += chunk.text();
    if (chunk.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      EXPECT_EQ(c.finish, v1::FINISH_REASON_UNSPECIFIED) << "two final chunks";
      c.finish = chunk.finish_reason();
      c.usage = chunk.usage();
    }
    if (call.cancel_after_chunks > 0 && c.chunks == call.cancel_after_chunks) context.TryCancel();
  }
  c.status = reader->Finish();
  for (const auto& [key, value] : context.GetServerTrailingMetadata()) {
    c.trailers.emplace(std::string(key.data(), key.size()),
                       std::string(value.data(), value.size()));
  }
  return c;
}

inline v1::GenerateRequest TextRequest(const std::string& text, int64_t max_tokens,
                                       const std::string& session = "") {
  v1::GenerateRequest r;
  r.set_text(text);
  r.set_session_id(session);
  r.mutable_sampling()->set_max_tokens(max_tokens);
  return r;
}

inline v1::GenerateRequest IdsRequest(const std::vector<int32_t>& ids, int64_t max_tokens,
                                      const std::string& session = "") {
  v1::GenerateRequest r;
  for (int32_t id : ids) r.mutable_token_ids()->add_ids(id);
  r.set_session_id(session);
  r.mutable_sampling()->set_max_tokens(max_tokens);
  return r;
}

// A one-shot stream that runs until the test cancels it (a million tokens on the no-EOS model of
// TestOptions): while it runs, every other job shares its engine steps. Tests that need batches
// of more than one sequence hold one, rather than hoping that concurrent clients meet in a step
// (on a loaded machine they may arrive one after another). The constructor returns once the
// stream has produced its first chunk, so it is running; the destructor cancels it and requires
// that it ran until then.
class HeldStream {
 public:
  explicit HeldStream(v1::SdmService::Stub& stub) {
    Prepare(context_, {.timeout = std::chrono::hours(1)});  // ends by the test's cancellation
    reader_ = stub.Generate(&context_, TextRequest("held", 1'000'000));
    v1::GenerateResponse chunk;
    running_ = reader_->Read(&chunk);
    EXPECT_TRUE(running_) << "the held stream ended before its first chunk";
  }
  ~HeldStream() {
    context_.TryCancel();
    v1::GenerateResponse chunk;
    while (reader_->Read(&chunk)) {
      EXPECT_EQ(chunk.finish_reason(), v1::FINISH_REASON_UNSPECIFIED) << "ended by itself";
    }
    EXPECT_EQ(reader_->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  HeldStream(const HeldStream&) = delete;
  HeldStream& operator=(const HeldStream&) = delete;

  bool running() const { return running_; }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader_;
  bool running_ = false;
};

// The /metrics page of the server's HTTP port, parsed (a parse failure fails the test).
inline ParsedPage ScrapeMetrics(int port) {
  httplib::Client client = TestHttpClient(port);
  const httplib::Result response = client.Get("/metrics");
  ParsedPage page;
  EXPECT_TRUE(response) << "GET /metrics failed";
  if (!response) return page;
  EXPECT_EQ(response->status, 200);
  std::string error;
  EXPECT_TRUE(ParsePrometheusText(response->body, &page, &error)) << error;
  return page;
}

inline double MetricValue(const ParsedPage& page, const std::string& name,
                          const std::map<std::string, std::string>& labels = {}) {
  return page.Value(name, labels).value_or(0.0);
}

// Waits (Eventually: tests/base/eventually.h) until the metric on the server's HTTP port has
// `value`: the server records a call's outcome just after the client has heard it, and gauges
// follow the scheduler's steps. False if it never does.
inline bool WaitForMetric(int port, const std::string& name,
                          const std::map<std::string, std::string>& labels, double value) {
  return Eventually([&] { return MetricValue(ScrapeMetrics(port), name, labels) == value; });
}

// Session calls, as a client makes them (api_key: sent when non-empty).
inline grpc::Status CreateSession(v1::SdmService::Stub& stub, const std::string& id,
                                  v1::Session* out = nullptr, const std::string& api_key = "") {
  grpc::ClientContext context;
  Prepare(context, {.api_key = api_key});
  v1::CreateSessionRequest request;
  request.set_session_id(id);
  v1::Session session;
  grpc::Status s = stub.CreateSession(&context, request, &session);
  if (out != nullptr) *out = session;
  return s;
}

inline grpc::Status GetSession(v1::SdmService::Stub& stub, const std::string& id, v1::Session* out,
                               const std::string& api_key = "") {
  grpc::ClientContext context;
  Prepare(context, {.api_key = api_key});
  v1::GetSessionRequest request;
  request.set_session_id(id);
  return stub.GetSession(&context, request, out);
}

// Raw gRPC bytes, for calls made without generated stubs.
inline std::string Bytes(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& slice : slices) {
    out.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return out;
}

inline grpc::ByteBuffer Buffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// grpc.health.v1.Health/Check{service}, encoded by hand (field 1, a string); returns the
// response's bytes: "\x08\x01" SERVING, "\x08\x02" NOT_SERVING.
inline std::string HealthCheck(grpc::Channel& channel, const std::string& service) {
  grpc::ClientContext context;
  Prepare(context, {});
  grpc::ByteBuffer response;
  const grpc::Status status = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      &channel,
      grpc::internal::RpcMethod("/grpc.health.v1.Health/Check",
                                grpc::internal::RpcMethod::NORMAL_RPC),
      &context, Buffer(std::string("\x0a") + static_cast<char>(service.size()) + service),
      &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return Bytes(response);
}

inline const std::string kServing("\x08\x01", 2), kNotServing("\x08\x02", 2);

}  // namespace sdm::testing

#endif  // SDMSERVE_TESTS_SERVER_SERVER_TEST_UTIL_H_
