// The OpenAI-compatible HTTP API end to end: SdmServer in-process on 127.0.0.1 with its HTTP API
// on a free port, the tiny random model, cpp-httplib as the client; gRPC alongside on the same
// server for the shared-batch and tenancy checks.
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "engine/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "server/grpc_status.h"
#include "server/http/chat_template.h"
#include "server/http/http_status.h"
#include "server/http/openai_json.h"
#include "server/service.h"
#include "tests/base/eventually.h"
#include "tests/server/http_test_client.h"
#include "tests/server/server_test_util.h"

namespace sdm::testing {
namespace {

using Json = nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

// A tool as OpenAI's chat API takes it (its "function" part is a deprecated `functions` entry).
const Json kWeatherTool = Json::parse(R"({"type": "function", "function": {"name": "weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})");

class OpenAiHttpTest : public ::testing::Test {
 protected:
  ServerOptions Options() const {
    ServerOptions o = TestOptions(dir_.path() / "state");
    o.http.port = 0;
    o.http.host = "127.0.0.1";
    return o;
  }
  ScopedTempDir dir_;
};

struct Reply {
  int status = 0;
  Json body;
  std::string raw;
  std::string retry_after;
  std::string session_header;
};

// One HTTP request with a JSON body (empty: none); the reply's body parsed when it is JSON.
Reply Call(int port, const std::string& method, const std::string& path, const std::string& body,
           const std::string& api_key = "", const httplib::Headers& extra = {},
           const std::string& content_type = "application/json") {
  httplib::Client client = TestHttpClient(port);
  httplib::Headers headers = extra;
  if (!api_key.empty()) headers.emplace("Authorization", "Bearer " + api_key);
  httplib::Result r = method == "GET"      ? client.Get(path, headers)
                      : method == "DELETE" ? client.Delete(path, headers)
                                           : client.Post(path, headers, body, content_type);
  Reply out;
  EXPECT_TRUE(r) << method << " " << path << " failed: " << httplib::to_string(r.error());
  if (!r) return out;
  out.status = r->status;
  out.raw = r->body;
  out.retry_after = r->get_header_value("Retry-After");
  out.session_header = r->get_header_value("X-Session-Id");
  out.body = Json::parse(r->body, nullptr, /*allow_exceptions=*/false);
  return out;
}

Reply Post(int port, const std::string& path, const Json& body, const std::string& key = "") {
  return Call(port, "POST", path, body.dump(), key);
}

// The data events of an SSE body, in order ("[DONE]" kept as a string); comments skipped.
std::vector<std::string> SseData(const std::string& body) {
  std::vector<std::string> out;
  for (absl::string_view event : absl::StrSplit(body, "\n\n", absl::SkipEmpty())) {
    for (absl::string_view line : absl::StrSplit(event, '\n', absl::SkipEmpty())) {
      if (absl::ConsumePrefix(&line, "data: "))
        out.emplace_back(line);
      else
        EXPECT_TRUE(absl::StartsWith(line, ":")) << "not an SSE line: " << line;
    }
  }
  return out;
}

// What a stream said: the concatenated text, the finish reason, the usage chunk.
struct Streamed {
  std::string text;
  std::string finish_reason;
  Json usage;
  Json session;
  int chunks = 0;
  // The choices' log-probabilities, concatenated: chat's `content` entries, or the completion's
  // fields (tokens, token_logprobs, top_logprobs, text_offset) each as one array.
  Json logprobs;
};

Streamed ParseStream(const std::string& body, bool chat) {
  Streamed s;
  const std::vector<std::string> data = SseData(body);
  EXPECT_FALSE(data.empty());
  if (data.empty()) return s;
  EXPECT_EQ(data.back(), "[DONE]");
  for (size_t i = 0; i + 1 < data.size(); ++i) {
    const Json c = Json::parse(data[i], nullptr, false);
    EXPECT_FALSE(c.is_discarded()) << data[i];
    EXPECT_EQ(c["object"], chat ? "chat.completion.chunk" : "text_completion") << data[i];
    EXPECT_TRUE(absl::StartsWith(c["id"].get<std::string>(), chat ? "chatcmpl-" : "cmpl-"));
    ++s.chunks;
    if (c["choices"].empty()) {  // the usage chunk, last
      EXPECT_EQ(i + 2, data.size());
      s.usage = c["usage"];
      continue;
    }
    const Json& choice = c["choices"][0];
    if (chat) {
      if (i == 0) {
        EXPECT_EQ(choice["delta"]["role"], "assistant");
      }
      if (choice["delta"].contains("content")) s.text += choice["delta"]["content"];
    } else {
      s.text += choice["text"];
    }
    if (!choice["logprobs"].is_null()) {
      if (chat) {
        for (const Json& e : choice["logprobs"]["content"]) s.logprobs.push_back(e);
      } else {
        for (const auto& [field, values] : choice["logprobs"].items()) {
          for (const Json& v : values) s.logprobs[field].push_back(v);
        }
      }
    }
    if (!choice["finish_reason"].is_null()) {
      EXPECT_TRUE(s.finish_reason.empty()) << "two finish reasons";
      s.finish_reason = choice["finish_reason"];
      if (c.contains("session")) s.session = c["session"];
    }
  }
  return s;
}

TEST(HttpStatusTest, EveryCodeHasItsHttpStatusAndOpenAiBody) {
  const HttpError e = ToHttpError(absl::NotFoundError("session 'x' not found"));
  EXPECT_EQ(e.status, 404);
  const Json body = Json::parse(e.body);
  EXPECT_EQ(body["error"]["message"], "session 'x' not found");
  EXPECT_EQ(body["error"]["type"], "not_found_error");
  EXPECT_EQ(body["error"]["code"], "not_found");
  EXPECT_TRUE(body["error"]["param"].is_null());
  EXPECT_EQ(ToHttpError(absl::InvalidArgumentError("x")).status, 400);
  EXPECT_EQ(ToHttpError(absl::UnauthenticatedError("x")).status, 401);
  // OpenAI's codes where clients look for them.
  EXPECT_EQ(Json::parse(ToHttpError(absl::UnauthenticatedError("x")).body)["error"]["code"],
            "invalid_api_key");
  EXPECT_EQ(Json::parse(ToHttpError(absl::ResourceExhaustedError("x")).body)["error"]["code"],
            "rate_limit_exceeded");
  EXPECT_EQ(
      Json::parse(ToHttpError(absl::ResourceExhaustedError("x"), "mine").body)["error"]["code"],
      "mine");
  EXPECT_EQ(ToHttpError(absl::AbortedError("x")).status, 409);
  EXPECT_EQ(ToHttpError(absl::AlreadyExistsError("x")).status, 409);
  const HttpError limited =
      ToHttpError(WithRetryAfter(absl::ResourceExhaustedError("x"), absl::Milliseconds(1500)));
  EXPECT_EQ(limited.status, 429);
  EXPECT_EQ(limited.retry_after_seconds, 2);
  EXPECT_EQ(ToHttpError(absl::UnavailableError("x")).status, 503);
  EXPECT_EQ(ToHttpError(absl::DataLossError("x")).status, 500);
  // Statuses of the HTTP server's own: a 4xx is the request's fault, a 5xx the server's.
  for (const int status : {405, 413, 414, 416}) {
    EXPECT_EQ(Json::parse(ErrorBody(status, "x", "c"))["error"]["type"], "invalid_request_error")
        << status;
  }
  EXPECT_EQ(Json::parse(ErrorBody(502, "x", "c"))["error"]["type"], "server_error");
}

TEST(ChatTemplateTest, DefaultRendersPlainTextAndFilesOverrideIt) {
  const ChatTemplate t;
  const std::vector<ChatMessage> m = {{"system", "Be terse."}, {"user", "Hi {role}"}};
  EXPECT_EQ(t.Render(m, false), "System: Be terse.\nUser: Hi {role}\nAssistant:");
  EXPECT_EQ(t.Render({m.data() + 1, 1}, true), "\nUser: Hi {role}\nAssistant:");
  absl::StatusOr<ChatTemplate> custom =
      ChatTemplate::FromJson(R"({"message": "<{role}>{content}", "stop": ["<"]})", "t");
  ASSERT_TRUE(custom.ok()) << custom.status();
  EXPECT_EQ(custom->Render(m, false), "<system>Be terse.<user>Hi {role}Assistant:");
  EXPECT_EQ(custom->stop, std::vector<std::string>{"<"});
  EXPECT_FALSE(ChatTemplate::FromJson(R"({"message": "no content"})", "t").ok());
  EXPECT_FALSE(ChatTemplate::FromJson(R"({"stop": "x"})", "t").ok());
}

// A template's stop strings go with every chat request, counted in its limits: a template past
// them was accepted, and then every chat completion was refused ("with the chat template's 17 at
// most -1 are allowed"). It is refused when loaded, naming the file and the limit.
TEST(ChatTemplateTest, StopStringsPastARequestsLimitsAreRefusedWhenLoaded) {
  ScopedTempDir dir;
  const auto load = [&](const std::vector<std::string>& stop) {
    const std::filesystem::path path = dir.path() / "chat_template.json";
    std::ofstream(path) << Json{{"stop", stop}}.dump();
    return ChatTemplate::FromFile(path);
  };
  const std::string file = (dir.path() / "chat_template.json").string();
  EXPECT_TRUE(load(std::vector<std::string>(kMaxStopStrings, "z")).ok());
  const absl::StatusOr<ChatTemplate> too_many =
      load(std::vector<std::string>(kMaxStopStrings + 1, "z"));
  ASSERT_FALSE(too_many.ok());
  EXPECT_THAT(too_many.status().message(), HasSubstr(file));
  EXPECT_THAT(too_many.status().message(),
              HasSubstr(absl::StrCat("at most ", kMaxStopStrings, " are allowed")));
  EXPECT_TRUE(load({"z", std::string(kMaxStopStringBytes, 'x')}).ok());
  const absl::StatusOr<ChatTemplate> too_long =
      load({"z", std::string(kMaxStopStringBytes + 1, 'x')});
  ASSERT_FALSE(too_long.ok());
  EXPECT_THAT(too_long.status().message(), HasSubstr(file));
  EXPECT_THAT(too_long.status().message(),
              HasSubstr(absl::StrCat("'stop'[1] has ", kMaxStopStringBytes + 1, " bytes; at most ",
                                     kMaxStopStringBytes)));
}

// A \u escape of a lone surrogate is valid JSON syntax (RFC 8259), and JavaScript writes one for a
// string cut in the middle of an emoji: it is read as U+FFFD (the request was refused as "not
// valid JSON"). Pairs, other escapes and an escaped backslash before a "u" are read as before.
// ignore_eos (our extension, vLLM's name) reaches the Generate request; absent is false.
TEST(OpenAiJsonTest, IgnoreEosReachesTheGenerateRequest) {
  for (const bool ignore : {true, false}) {
    absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(
        Json{{"prompt", "x"}, {"ignore_eos", ignore}}.dump(), OpenAiEndpoint::kCompletions);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(ToGenerateRequest(*r, "x", {}).sampling().ignore_eos(), ignore);
  }
  absl::StatusOr<OpenAiRequest> absent =
      ParseOpenAiRequest(Json{{"prompt", "x"}}.dump(), OpenAiEndpoint::kCompletions);
  ASSERT_TRUE(absent.ok()) << absent.status();
  EXPECT_FALSE(ToGenerateRequest(*absent, "x", {}).sampling().ignore_eos());
}

// top_k (vLLM's extension) reaches SamplingParams.top_k as sent; its range is the service's to
// check (EveryBadInputGetsItsStatusAndTheServerKeepsServing), what int32 cannot hold is refused.
TEST(OpenAiJsonTest, TopKReachesTheGenerateRequest) {
  for (const int top_k : {0, 1, 40, -1, std::numeric_limits<int32_t>::max()}) {
    SCOPED_TRACE(top_k);
    absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(
        Json{{"prompt", "x"}, {"top_k", top_k}}.dump(), OpenAiEndpoint::kCompletions);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(ToGenerateRequest(*r, "x", {}).sampling().top_k(), top_k);
  }
  for (const std::string body : {R"({"prompt": "x"})", R"({"prompt": "x", "top_k": null})"}) {
    absl::StatusOr<OpenAiRequest> absent = ParseOpenAiRequest(body, OpenAiEndpoint::kCompletions);
    ASSERT_TRUE(absent.ok()) << absent.status();
    EXPECT_EQ(ToGenerateRequest(*absent, "x", {}).sampling().top_k(), 0);  // no limit
  }
  for (const auto& [value, message] : std::vector<std::pair<std::string, std::string>>{
           {R"("5")", "'top_k' must be an integer"},
           {"1.5", "'top_k' must be an integer"},
           {"true", "'top_k' must be an integer"},
           {"2147483648", "'top_k' = 2147483648 is out of range for a 32-bit integer"},
           {"-2147483649", "'top_k' = -2147483649 is out of range for a 32-bit integer"}}) {
    SCOPED_TRACE(value);
    absl::StatusOr<OpenAiRequest> r =
        ParseOpenAiRequest(absl::StrCat(R"({"messages": [{"role": "user", "content": "x"}], )",
                                        R"("top_k": )", value, "}"),
                           OpenAiEndpoint::kChatCompletions);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(), message);
  }
}

TEST(OpenAiJsonTest, ALoneSurrogateEscapeIsReadAsTheReplacementCharacter) {
  const std::string replacement = "\xEF\xBF\xBD";  // U+FFFD in UTF-8
  for (const auto& [json, text] : std::vector<std::pair<std::string, std::string>>{
           {R"({"prompt": "\ud800"})", replacement},
           {R"({"prompt": "a\uDFFFb"})", "a" + replacement + "b"},
           {R"({"prompt": "\ud83d\ud83d\ude00\ud83d"})",  // lone, pair, lone at the end
            replacement + "\xF0\x9F\x98\x80" + replacement},
           {R"({"prompt": "\ud83d\u0041\"\\ud800"})", replacement + "A\"\\ud800"},
           {R"({"model": "\udc00", "prompt": "x"})", "x"}}) {
    SCOPED_TRACE(json);
    const absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(json, OpenAiEndpoint::kCompletions);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->prompts.size(), 1u);
    EXPECT_EQ(r->prompts[0].text, text);
  }
  EXPECT_EQ(ParseJsonBody(R"({"model": "\udc00"})")["model"], replacement);
  // Still not JSON: a lone surrogate does not mend anything else.
  EXPECT_TRUE(ParseJsonBody(R"({"prompt": "\ud800)").is_discarded());
  EXPECT_TRUE(ParseJsonBody(R"({"prompt": "\ud80"})").is_discarded());
}

TEST_F(OpenAiHttpTest, ModelsCompletionsAndChatMatchGrpc) {
  Served s = Serve(Options());
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  ASSERT_GT(port, 0);

  const Reply models = Call(port, "GET", "/v1/models", "");
  ASSERT_EQ(models.status, 200) << models.raw;
  EXPECT_EQ(models.body["object"], "list");
  const std::string model = models.body["data"][0]["id"];
  EXPECT_EQ(model, "tiny-model-no-eos");
  EXPECT_EQ(Call(port, "GET", "/v1/models/" + model, "").status, 200);
  const Reply unknown = Call(port, "GET", "/v1/models/other", "");
  EXPECT_EQ(unknown.status, 404);
  // OpenAI's code for it, as the completions answer a request naming another model.
  EXPECT_EQ(unknown.body["error"]["type"], "not_found_error");
  EXPECT_EQ(unknown.body["error"]["code"], "model_not_found") << unknown.raw;
  // The web console is one static page (driven in chromium by tests/http_clients/).
  const Reply console = Call(port, "GET", "/", "");
  EXPECT_EQ(console.status, 200);
  EXPECT_THAT(console.raw, HasSubstr("<title>sdmserve console</title>"));

  // Greedy completion: exactly gRPC's tokens for the same request.
  v1::GenerateRequest grpc_request = TextRequest("Once upon", 12);
  const Completion expected = Generate(*s.stub, grpc_request);
  ASSERT_TRUE(expected.status.ok());
  const Reply c = Post(port, "/v1/completions",
                       {{"model", model},
                        {"prompt", "Once upon"},
                        {"max_tokens", 12},
                        {"temperature", 0},
                        {"user", "u1"},
                        {"unknown_field", {1, 2}}});
  ASSERT_EQ(c.status, 200) << c.raw;
  EXPECT_EQ(c.body["object"], "text_completion");
  EXPECT_EQ(c.body["choices"][0]["text"], expected.text);
  EXPECT_EQ(c.body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(c.body["usage"]["prompt_tokens"], expected.usage.prompt_tokens());
  EXPECT_EQ(c.body["usage"]["completion_tokens"], 12);
  EXPECT_EQ(c.body["usage"]["total_tokens"], expected.usage.prompt_tokens() + 12);

  // Token ids as the prompt; a stop string ends the text before it (finish_reason stop).
  // Token ids are read as sent (no BOS: vLLM's rule, which evaluation harnesses count on).
  v1::GenerateRequest ids_request = IdsRequest({5, 6, 7}, 6);
  ids_request.set_add_bos(false);
  const Completion ids = Generate(*s.stub, ids_request);
  const Reply by_ids =
      Post(port, "/v1/completions", {{"prompt", {5, 6, 7}}, {"max_tokens", 6}, {"temperature", 0}});
  ASSERT_EQ(by_ids.status, 200) << by_ids.raw;
  EXPECT_EQ(by_ids.body["choices"][0]["text"], ids.text);
  // The first ASCII character of the greedy text after its first byte, as a stop string.
  size_t at = 1;
  while (at < expected.text.size() && static_cast<unsigned char>(expected.text[at]) >= 0x80) ++at;
  if (at < expected.text.size()) {
    const std::string stop(1, expected.text[at]);
    const Reply stopped =
        Post(port, "/v1/completions",
             {{"prompt", "Once upon"}, {"max_tokens", 12}, {"temperature", 0}, {"stop", {stop}}});
    ASSERT_EQ(stopped.status, 200) << stopped.raw;
    EXPECT_EQ(stopped.body["choices"][0]["finish_reason"], "stop");
    EXPECT_EQ(stopped.body["choices"][0]["text"],
              expected.text.substr(0, expected.text.find(stop)));
  }

  // Streaming completion: the same text, chunk by chunk, then usage and [DONE].
  const Reply streamed = Post(port, "/v1/completions",
                              {{"prompt", "Once upon"},
                               {"max_tokens", 12},
                               {"temperature", 0},
                               {"stream", true},
                               {"stream_options", {{"include_usage", true}}}});
  ASSERT_EQ(streamed.status, 200) << streamed.raw;
  const Streamed sc = ParseStream(streamed.raw, /*chat=*/false);
  EXPECT_EQ(sc.text, expected.text);
  EXPECT_EQ(sc.finish_reason, "length");
  EXPECT_EQ(sc.usage["completion_tokens"], 12);

  // Chat, seeded sampling: the stream and the whole response agree, and equal gRPC on the
  // template's rendering.
  const Json chat = {{"model", model},
                     {"messages",
                      {{{"role", "system"}, {"content", "Be brief."}},
                       {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "Hello"}}}}}}},
                     {"max_completion_tokens", 10},
                     {"temperature", 0.9},
                     {"top_p", 0.95},
                     {"seed", 42}};
  const Reply whole = Post(port, "/v1/chat/completions", chat);
  ASSERT_EQ(whole.status, 200) << whole.raw;
  EXPECT_EQ(whole.body["object"], "chat.completion");
  EXPECT_EQ(whole.body["choices"][0]["message"]["role"], "assistant");
  // OpenAI's message has a refusal, required and null when the model did not refuse.
  ASSERT_TRUE(whole.body["choices"][0]["message"].contains("refusal")) << whole.raw;
  EXPECT_TRUE(whole.body["choices"][0]["message"]["refusal"].is_null());
  v1::GenerateRequest rendered = TextRequest("System: Be brief.\nUser: Hello\nAssistant:", 10);
  rendered.mutable_sampling()->set_temperature(0.9);
  rendered.mutable_sampling()->set_top_p(0.95);
  rendered.mutable_sampling()->set_seed(42);
  rendered.mutable_sampling()->add_stop("\nUser:");
  const Completion chat_grpc = Generate(*s.stub, rendered);
  EXPECT_EQ(whole.body["choices"][0]["message"]["content"], chat_grpc.text);
  EXPECT_EQ(whole.body["usage"]["prompt_tokens"], chat_grpc.usage.prompt_tokens());
  Json chat_stream = chat;
  chat_stream["stream"] = true;
  const Reply chunks = Post(port, "/v1/chat/completions", chat_stream);
  ASSERT_EQ(chunks.status, 200) << chunks.raw;
  const Streamed sch = ParseStream(chunks.raw, /*chat=*/true);
  EXPECT_EQ(sch.text, chat_grpc.text);
  EXPECT_EQ(sch.finish_reason, whole.body["choices"][0]["finish_reason"]);
  EXPECT_TRUE(sch.usage.is_null());  // not asked for
}

// The choices of a streamed response, by index: text, finish reasons, and what came after the
// last choice chunk.
struct StreamedChoices {
  std::map<int, std::string> text;
  std::map<int, std::vector<std::string>> finish;
  Json usage;
  bool done = false;  // ended with [DONE]
};
StreamedChoices ParseChoices(const std::string& body) {
  StreamedChoices out;
  for (const std::string& data : SseData(body)) {
    if (data == "[DONE]") {
      out.done = true;
      continue;
    }
    const Json c = Json::parse(data, nullptr, false);
    EXPECT_FALSE(c.is_discarded()) << data;
    EXPECT_FALSE(out.done) << "a chunk after [DONE]";
    if (c["choices"].empty()) {
      out.usage = c["usage"];
      continue;
    }
    for (const Json& choice : c["choices"]) {
      const int index = choice["index"];
      if (choice.contains("text")) out.text[index] += choice["text"].get<std::string>();
      if (choice.contains("delta") && choice["delta"].contains("content")) {
        out.text[index] += choice["delta"]["content"].get<std::string>();
      }
      if (!choice["finish_reason"].is_null()) out.finish[index].push_back(choice["finish_reason"]);
    }
  }
  return out;
}

TEST_F(OpenAiHttpTest, SeveralPromptsAndNChoicesAreOneShotJobsEachAsGrpcs) {
  Served s = Serve(Options());
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  const auto grpc = [&](v1::GenerateRequest r, double temperature, uint64_t seed) {
    r.mutable_sampling()->set_temperature(temperature);
    r.mutable_sampling()->set_seed(seed);
    return Generate(*s.stub, r);
  };

  // A batch of prompts, text and token ids: choice i is prompt i's, greedy, as gRPC's; usage is
  // the choices' together.
  const Completion once = grpc(TextRequest("Once upon", 5), 0, 0);
  const Completion hello = grpc(TextRequest("Hello", 5), 0, 0);
  const Reply batch =
      Post(port, "/v1/completions",
           {{"prompt", {"Once upon", "Hello"}}, {"max_tokens", 5}, {"temperature", 0}});
  ASSERT_EQ(batch.status, 200) << batch.raw;
  ASSERT_EQ(batch.body["choices"].size(), 2u) << batch.raw;
  EXPECT_EQ(batch.body["choices"][0]["index"], 0);
  EXPECT_EQ(batch.body["choices"][0]["text"], once.text);
  EXPECT_EQ(batch.body["choices"][1]["index"], 1);
  EXPECT_EQ(batch.body["choices"][1]["text"], hello.text);
  EXPECT_EQ(batch.body["usage"]["prompt_tokens"],
            once.usage.prompt_tokens() + hello.usage.prompt_tokens());
  EXPECT_EQ(batch.body["usage"]["completion_tokens"],
            once.usage.generated_tokens() + hello.usage.generated_tokens());
  const Reply ids = Post(port, "/v1/completions",
                         {{"prompt", {{5, 6, 7}, {8, 9}}}, {"max_tokens", 4}, {"temperature", 0}});
  ASSERT_EQ(ids.status, 200) << ids.raw;
  const auto no_bos = [](v1::GenerateRequest r) {
    r.set_add_bos(false);  // token ids are read as sent
    return r;
  };
  EXPECT_EQ(ids.body["choices"][0]["text"], grpc(no_bos(IdsRequest({5, 6, 7}, 4)), 0, 0).text);
  EXPECT_EQ(ids.body["choices"][1]["text"], grpc(no_bos(IdsRequest({8, 9}, 4)), 0, 0).text);

  // n sampled choices of each prompt: choice prompt * n + j samples with seed + j.
  const Json sampled = {{"prompt", {"Once upon", "Hello"}},
                        {"max_tokens", 6},
                        {"temperature", 1.5},
                        {"seed", 40},
                        {"n", 3}};
  const Reply whole = Post(port, "/v1/completions", sampled);
  ASSERT_EQ(whole.status, 200) << whole.raw;
  ASSERT_EQ(whole.body["choices"].size(), 6u) << whole.raw;
  for (int i = 0; i < 6; ++i) {
    SCOPED_TRACE(i);
    const Completion want = grpc(TextRequest(i < 3 ? "Once upon" : "Hello", 6), 1.5, 40 + i % 3);
    EXPECT_EQ(whole.body["choices"][i]["index"], i);
    EXPECT_EQ(whole.body["choices"][i]["text"], want.text);
  }
  // Streamed: each choice's chunks carry its index, one finish reason each, then usage, [DONE].
  Json streamed_body = sampled;
  streamed_body["stream"] = true;
  streamed_body["stream_options"] = {{"include_usage", true}};
  const Reply streamed = Post(port, "/v1/completions", streamed_body);
  ASSERT_EQ(streamed.status, 200) << streamed.raw;
  const StreamedChoices sc = ParseChoices(streamed.raw);
  EXPECT_TRUE(sc.done);
  for (int i = 0; i < 6; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(sc.text.at(i), whole.body["choices"][i]["text"]);
    ASSERT_EQ(sc.finish.at(i).size(), 1u);
    EXPECT_EQ(sc.finish.at(i)[0], whole.body["choices"][i]["finish_reason"]);
  }
  EXPECT_EQ(sc.usage["completion_tokens"], whole.body["usage"]["completion_tokens"]);

  // Chat: n choices of the template's rendering, seed + j each, whole and streamed.
  const Json chat = {{"messages", {{{"role", "user"}, {"content", "Hello"}}}},
                     {"max_tokens", 6},
                     {"temperature", 1.5},
                     {"seed", 7},
                     {"n", 2}};
  const Reply chat_whole = Post(port, "/v1/chat/completions", chat);
  ASSERT_EQ(chat_whole.status, 200) << chat_whole.raw;
  ASSERT_EQ(chat_whole.body["choices"].size(), 2u) << chat_whole.raw;
  Json chat_stream = chat;
  chat_stream["stream"] = true;
  const Reply chat_chunks = Post(port, "/v1/chat/completions", chat_stream);
  ASSERT_EQ(chat_chunks.status, 200) << chat_chunks.raw;
  const StreamedChoices cc = ParseChoices(chat_chunks.raw);
  for (int j = 0; j < 2; ++j) {
    SCOPED_TRACE(j);
    v1::GenerateRequest rendered = TextRequest("User: Hello\nAssistant:", 6);
    rendered.mutable_sampling()->add_stop("\nUser:");
    const Completion want = grpc(rendered, 1.5, 7 + j);
    EXPECT_EQ(chat_whole.body["choices"][j]["message"]["content"], want.text);
    EXPECT_EQ(cc.text.at(j), want.text);
    EXPECT_EQ(cc.finish.at(j).size(), 1u);
  }

  // Echo with a batch: each choice leads with its own prompt.
  const Reply echoed = Post(
      port, "/v1/completions",
      {{"prompt", {"Once upon", "Hello"}}, {"max_tokens", 2}, {"temperature", 0}, {"echo", true}});
  ASSERT_EQ(echoed.status, 200) << echoed.raw;
  EXPECT_EQ(echoed.body["choices"][0]["text"],
            "Once upon" + grpc(TextRequest("Once upon", 2), 0, 0).text)
      << echoed.raw;
  EXPECT_EQ(echoed.body["choices"][1]["text"], "Hello" + grpc(TextRequest("Hello", 2), 0, 0).text)
      << echoed.raw;

  // A refused choice refuses the request, naming it; the others submitted before end.
  const Reply refused =
      Post(port, "/v1/completions", {{"prompt", {{5, 6}, {7, 99999}}}, {"max_tokens", 2}});
  EXPECT_EQ(refused.status, 400) << refused.raw;
  EXPECT_NE(refused.raw.find("choice 1 of 2"), std::string::npos) << refused.raw;
  EXPECT_NE(refused.raw.find("outside the vocabulary"), std::string::npos) << refused.raw;
}

TEST_F(OpenAiHttpTest, TokenizeAndDetokenizeAsVllmShapesThem) {
  Served s = Serve(Options());
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  const std::unique_ptr<Tokenizer> bytes = Tokenizer::CreateByteTokenizer();  // the model's
  const int32_t bos = bytes->bos_id();

  // As a one-shot prompt is fed: BOS, then the text's tokens (what a completion reports in
  // usage.prompt_tokens); without special tokens, the text's alone.
  const Reply hi = Post(port, "/tokenize", {{"prompt", "Hi"}});
  ASSERT_EQ(hi.status, 200) << hi.raw;
  EXPECT_EQ(hi.body["tokens"], Json::array({bos, 72, 105})) << hi.raw;
  EXPECT_EQ(hi.body["count"], 3);
  EXPECT_TRUE(hi.body.contains("max_model_len")) << hi.raw;
  const Completion grpc_hi = Generate(*s.stub, TextRequest("Hi", 1));
  EXPECT_EQ(hi.body["count"], grpc_hi.usage.prompt_tokens());
  const Reply plain = Post(port, "/tokenize", {{"prompt", "Hi"}, {"add_special_tokens", false}});
  ASSERT_EQ(plain.status, 200) << plain.raw;
  EXPECT_EQ(plain.body["tokens"], Json::array({72, 105})) << plain.raw;
  // Chat messages: the template's rendering.
  const Reply chat =
      Post(port, "/tokenize",
           {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"add_special_tokens", false}});
  ASSERT_EQ(chat.status, 200) << chat.raw;
  const std::vector<int32_t> rendered = bytes->Encode("User: Hi\nAssistant:", false);
  EXPECT_EQ(chat.body["tokens"], Json(rendered)) << chat.raw;

  const Reply back = Post(port, "/detokenize", {{"tokens", {72, 105}}});
  ASSERT_EQ(back.status, 200) << back.raw;
  EXPECT_EQ(back.body["prompt"], "Hi");

  for (const auto& [path, body, status, says] :
       std::vector<std::tuple<std::string, Json, int, std::string>>{
           {"/tokenize", Json::object(), 400, "'prompt' (a string) or 'messages' is required"},
           {"/tokenize", {{"prompt", 5}}, 400, "'prompt' (a string) or 'messages' is required"},
           {"/tokenize",
            {{"prompt", "x"}, {"add_special_tokens", 1}},
            400,
            "'add_special_tokens' must be a boolean"},
           {"/tokenize", {{"prompt", "x"}, {"model", "gpt-4"}}, 404, "'gpt-4' does not exist"},
           {"/detokenize", Json::object(), 400, "'tokens' (an array of token ids) is required"},
           {"/detokenize", {{"tokens", {1.5}}}, 400, "'tokens'[0] = 1.5 is not a token id"},
           {"/detokenize", {{"tokens", {1, 99999}}}, 400, "outside the vocabulary"}}) {
    SCOPED_TRACE(path + " " + body.dump());
    const Reply r = Post(port, path, body);
    EXPECT_EQ(r.status, status) << r.raw;
    EXPECT_NE(r.raw.find(says), std::string::npos) << r.raw;
  }
}

// More choices than could ever be admitted together (the queue's places, the tenant's
// max_requests) are refused up front, without a retry hint: admitted one at a time, they would be
// refused with one, and every retry refused again.
TEST_F(OpenAiHttpTest, MoreChoicesThanCanBeAdmittedAreRefusedUpFront) {
  ServerOptions o = Options();
  o.scheduler.max_running = 2;
  o.scheduler.max_waiting = 2;
  o.tenant_limits_file = dir_.path() / "limits.json";
  WriteFile(o.tenant_limits_file, R"({"default": {"max_requests": 3}})");
  Served s = Serve(o);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  const Reply fits = Post(port, "/v1/completions",
                          {{"prompt", "Hi"}, {"max_tokens", 1}, {"temperature", 0}, {"n", 3}});
  ASSERT_EQ(fits.status, 200) << fits.raw;
  EXPECT_EQ(fits.body["choices"].size(), 3u);
  const Reply tenant =
      Post(port, "/v1/completions", {{"prompt", {"Hi", "Ho"}}, {"max_tokens", 1}, {"n", 2}});
  EXPECT_EQ(tenant.status, 400) << tenant.raw;
  EXPECT_NE(tenant.raw.find("asks for 4 choices (2 prompts, n = 2), each a request of its own; "
                            "at most 3 can be admitted at once (the tenant's max_requests 3"),
            std::string::npos)
      << tenant.raw;
  EXPECT_TRUE(tenant.retry_after.empty()) << tenant.raw;
  WriteFile(o.tenant_limits_file, R"({"default": {"max_requests": 100}})");
  ASSERT_TRUE(s.server->ReloadConfig().ok());
  const Reply queue = Post(port, "/v1/chat/completions",
                           {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"n", 5}});
  EXPECT_EQ(queue.status, 400) << queue.raw;
  EXPECT_NE(queue.raw.find("the server's --max_running plus --max_waiting 4"), std::string::npos)
      << queue.raw;
}

TEST_F(OpenAiHttpTest, LogitBiasIsGrpcsSamplingLogitBias) {
  Served s = Serve(Options());
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  // +100 on 'A' (the byte tokenizer's id 65) forces it; the same as gRPC's map, sampled too.
  const Reply forced = Post(port, "/v1/completions",
                            {{"prompt", "Hi"}, {"max_tokens", 3}, {"logit_bias", {{"65", 100}}}});
  ASSERT_EQ(forced.status, 200) << forced.raw;
  EXPECT_EQ(forced.body["choices"][0]["text"], "AAA");
  v1::GenerateRequest request = TextRequest("Once upon", 8);
  request.mutable_sampling()->set_temperature(1.2);
  request.mutable_sampling()->set_seed(9);
  (*request.mutable_sampling()->mutable_logit_bias())[101] = -100;  // 'e'
  (*request.mutable_sampling()->mutable_logit_bias())[32] = 3;      // ' '
  const Completion grpc = Generate(*s.stub, request);
  ASSERT_TRUE(grpc.status.ok()) << grpc.status.error_message();
  EXPECT_EQ(grpc.text.find('e'), std::string::npos) << grpc.text;
  const Reply sampled = Post(port, "/v1/completions",
                             {{"prompt", "Once upon"},
                              {"max_tokens", 8},
                              {"temperature", 1.2},
                              {"seed", 9},
                              {"logit_bias", {{"101", -100}, {"32", 3}}}});
  ASSERT_EQ(sampled.status, 200) << sampled.raw;
  EXPECT_EQ(sampled.body["choices"][0]["text"], grpc.text);
}

TEST_F(OpenAiHttpTest, EchoScoresThePromptAsGrpcsPromptLogprobs) {
  Served s = Serve(Options());
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  const std::unique_ptr<Tokenizer> bytes = Tokenizer::CreateByteTokenizer();  // the model's
  const auto text_of = [&](int32_t id) { return LogprobTokenText(bytes->TokenBytes(id)); };

  // gRPC: every prompt token as read (the BOS the server added first, with nothing before it),
  // before the first generated token; the generated tokens unchanged.
  v1::GenerateRequest request = TextRequest("Once upon", 4);
  request.set_logprobs(2);
  request.set_prompt_logprobs(2);
  std::vector<v1::PromptTokenLogprobs> prompt;
  std::vector<v1::TokenLogprobs> generated;
  std::vector<int32_t> tokens;
  std::string text;
  int64_t prompt_tokens = 0;
  {
    grpc::ClientContext context;
    auto reader = s.stub->Generate(&context, request);
    v1::GenerateResponse chunk;
    while (reader->Read(&chunk)) {
      if (chunk.prompt_logprobs_size() > 0) {
        EXPECT_TRUE(tokens.empty()) << "prompt log-probabilities after a generated token";
      }
      prompt.insert(prompt.end(), chunk.prompt_logprobs().begin(), chunk.prompt_logprobs().end());
      tokens.insert(tokens.end(), chunk.token_ids().begin(), chunk.token_ids().end());
      generated.insert(generated.end(), chunk.logprobs().begin(), chunk.logprobs().end());
      text += chunk.text();
      if (chunk.has_usage()) prompt_tokens = chunk.usage().prompt_tokens();
    }
    ASSERT_TRUE(reader->Finish().ok());
  }
  EXPECT_EQ(tokens, Generate(*s.stub, TextRequest("Once upon", 4)).tokens);
  ASSERT_EQ(static_cast<int64_t>(prompt.size()), prompt_tokens);
  ASSERT_EQ(prompt_tokens, 1 + 9);  // BOS, then a byte per character
  EXPECT_EQ(prompt[0].token_id(), bytes->bos_id());
  EXPECT_FALSE(prompt[0].has_logprobs());
  for (size_t i = 1; i < prompt.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(prompt[i].token_id(), static_cast<uint8_t>("Once upon"[i - 1]));
    ASSERT_TRUE(prompt[i].has_logprobs());
    EXPECT_LT(prompt[i].logprobs().logprob(), 0);
    ASSERT_EQ(prompt[i].logprobs().top_size(), 2);
    EXPECT_GE(prompt[i].logprobs().top(0).logprob(), prompt[i].logprobs().logprob());
  }

  // /v1/completions with echo, whole and streamed: the prompt's text leads, and its tokens'
  // log-probabilities (the first null) come before the generated ones', all gRPC's numbers.
  const Json body = {{"prompt", "Once upon"},
                     {"max_tokens", 4},
                     {"temperature", 0},
                     {"echo", true},
                     {"logprobs", 2}};
  const Reply whole = Post(port, "/v1/completions", body);
  ASSERT_EQ(whole.status, 200) << whole.raw;
  EXPECT_EQ(whole.body["choices"][0]["text"], "Once upon" + text);
  const Json& lp = whole.body["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), prompt.size() + tokens.size()) << whole.raw;
  EXPECT_TRUE(lp["token_logprobs"][0].is_null()) << whole.raw;
  EXPECT_TRUE(lp["top_logprobs"][0].is_null()) << whole.raw;
  for (size_t i = 0; i < lp["tokens"].size(); ++i) {
    SCOPED_TRACE(i);
    const bool in_prompt = i < prompt.size();
    EXPECT_EQ(lp["tokens"][i],
              text_of(in_prompt ? prompt[i].token_id() : tokens[i - prompt.size()]));
    if (i == 0) continue;
    const v1::TokenLogprobs& want = in_prompt ? prompt[i].logprobs() : generated[i - prompt.size()];
    EXPECT_EQ(lp["token_logprobs"][i].get<double>(), want.logprob());
    ASSERT_EQ(lp["top_logprobs"][i].size(), 2u);
    EXPECT_EQ(lp["top_logprobs"][i][text_of(want.top(0).token_id())].get<double>(),
              want.top(0).logprob());
  }
  EXPECT_EQ(lp["text_offset"][0], 0);
  EXPECT_EQ(lp["text_offset"][prompt.size()], 9);  // the generated text starts after the prompt
  Json streamed_body = body;
  streamed_body["stream"] = true;
  const Reply streamed = Post(port, "/v1/completions", streamed_body);
  ASSERT_EQ(streamed.status, 200) << streamed.raw;
  const Streamed sc = ParseStream(streamed.raw, /*chat=*/false);
  EXPECT_EQ(sc.text, "Once upon" + text);
  EXPECT_EQ(sc.logprobs, lp);

  // max_tokens 0 scores the prompt without generating (OpenAI's echo for perplexity): the same
  // prompt entries, nothing after them.
  Json scoring = body;
  scoring["max_tokens"] = 0;
  const Reply scored = Post(port, "/v1/completions", scoring);
  ASSERT_EQ(scored.status, 200) << scored.raw;
  EXPECT_EQ(scored.body["choices"][0]["text"], "Once upon");
  EXPECT_EQ(scored.body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(scored.body["usage"]["completion_tokens"], 0);
  const Json& scored_lp = scored.body["choices"][0]["logprobs"];
  ASSERT_EQ(scored_lp["tokens"].size(), prompt.size()) << scored.raw;
  for (size_t i = 1; i < prompt.size(); ++i) {
    EXPECT_EQ(scored_lp["token_logprobs"][i].get<double>(), prompt[i].logprobs().logprob());
  }

  // Without logprobs the text is echoed alone; token ids echo as their text.
  const Reply plain =
      Post(port, "/v1/completions",
           {{"prompt", "Once upon"}, {"max_tokens", 4}, {"echo", true}, {"seed", 1}});
  ASSERT_EQ(plain.status, 200) << plain.raw;
  EXPECT_TRUE(absl::StartsWith(plain.body["choices"][0]["text"].get<std::string>(), "Once upon"))
      << plain.raw;
  EXPECT_TRUE(plain.body["choices"][0]["logprobs"].is_null()) << plain.raw;
  const Reply ids =
      Post(port, "/v1/completions", {{"prompt", {72, 105}}, {"max_tokens", 1}, {"echo", true}});
  ASSERT_EQ(ids.status, 200) << ids.raw;
  EXPECT_TRUE(absl::StartsWith(ids.body["choices"][0]["text"].get<std::string>(), "Hi")) << ids.raw;
  // Token ids are scored as sent (no BOS: one entry per id sent, then the generated token), what
  // an evaluation harness slices by its context's length; add_special_tokens puts BOS first.
  for (const bool special : {false, true}) {
    Json scoring_ids = {{"prompt", {72, 105, 33}},
                        {"max_tokens", 1},
                        {"temperature", 0},
                        {"echo", true},
                        {"logprobs", 1}};
    if (special) scoring_ids["add_special_tokens"] = true;
    const Reply r = Post(port, "/v1/completions", scoring_ids);
    ASSERT_EQ(r.status, 200) << r.raw;
    const Json& lp = r.body["choices"][0]["logprobs"];
    ASSERT_EQ(lp["token_logprobs"].size(), special ? 5u : 4u) << r.raw;
    EXPECT_TRUE(lp["token_logprobs"][0].is_null()) << r.raw;
    EXPECT_EQ(lp["tokens"][special ? 1 : 0], "H") << r.raw;
    EXPECT_EQ(r.body["usage"]["prompt_tokens"], special ? 4 : 3) << r.raw;
  }

  // Chat has no echo; out-of-range prompt log-probabilities are refused with gRPC's field name.
  const Reply chat = Post(port, "/v1/chat/completions",
                          {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"echo", true}});
  EXPECT_EQ(chat.status, 400) << chat.raw;
  EXPECT_NE(chat.raw.find("'echo' is a /v1/completions field"), std::string::npos) << chat.raw;
  v1::GenerateRequest too_many = TextRequest("Once upon", 1);
  too_many.set_prompt_logprobs(kMaxTopLogprobs + 1);
  const Completion refused = Generate(*s.stub, too_many);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.status.error_message().find("prompt_logprobs must be in [0, 20]"),
            std::string::npos)
      << refused.status.error_message();
}

TEST_F(OpenAiHttpTest, LogprobsAreGrpcsInBothApisStreamedOrNot) {
  Served s = Serve(Options());
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  const std::unique_ptr<Tokenizer> bytes = Tokenizer::CreateByteTokenizer();  // the model's

  // gRPC: one entry per token; greedy, so the token is the most probable.
  v1::GenerateRequest request = TextRequest("Once upon", 12);
  request.set_logprobs(3);
  std::vector<v1::TokenLogprobs> grpc_logprobs;
  {
    grpc::ClientContext context;
    auto reader = s.stub->Generate(&context, request);
    v1::GenerateResponse chunk;
    std::vector<int32_t> tokens;
    while (reader->Read(&chunk)) {
      tokens.insert(tokens.end(), chunk.token_ids().begin(), chunk.token_ids().end());
      grpc_logprobs.insert(grpc_logprobs.end(), chunk.logprobs().begin(), chunk.logprobs().end());
    }
    ASSERT_TRUE(reader->Finish().ok());
    EXPECT_EQ(tokens, Generate(*s.stub, TextRequest("Once upon", 12)).tokens);  // unchanged
    ASSERT_EQ(grpc_logprobs.size(), 12u);
    for (size_t i = 0; i < tokens.size(); ++i) {
      ASSERT_EQ(grpc_logprobs[i].top_size(), 3);
      EXPECT_EQ(grpc_logprobs[i].top(0).token_id(), tokens[i]);
      EXPECT_EQ(grpc_logprobs[i].top(0).logprob(), grpc_logprobs[i].logprob());
      EXPECT_LT(grpc_logprobs[i].logprob(), 0);
      EXPECT_GE(grpc_logprobs[i].top(1).logprob(), grpc_logprobs[i].top(2).logprob());
    }
    // The token strings HTTP shows: a byte of a character split between tokens as "bytes:\xNN".
    const auto text_of = [&](int32_t id) { return LogprobTokenText(bytes->TokenBytes(id)); };

    // /v1/completions, whole and streamed: the same numbers as gRPC's (doubles survive JSON).
    const Json body = {
        {"prompt", "Once upon"}, {"max_tokens", 12}, {"temperature", 0}, {"logprobs", 3}};
    const Reply whole = Post(port, "/v1/completions", body);
    ASSERT_EQ(whole.status, 200) << whole.raw;
    const Json& lp = whole.body["choices"][0]["logprobs"];
    ASSERT_EQ(lp["tokens"].size(), 12u) << whole.raw;
    int64_t offset = 0;
    for (size_t i = 0; i < tokens.size(); ++i) {
      SCOPED_TRACE(i);
      EXPECT_EQ(lp["tokens"][i], text_of(tokens[i]));
      EXPECT_EQ(lp["token_logprobs"][i].get<double>(), grpc_logprobs[i].logprob());
      ASSERT_EQ(lp["top_logprobs"][i].size(), 3u);
      EXPECT_EQ(lp["top_logprobs"][i][text_of(grpc_logprobs[i].top(1).token_id())].get<double>(),
                grpc_logprobs[i].top(1).logprob());
      EXPECT_EQ(lp["text_offset"][i], offset);
      const std::string token = lp["tokens"][i];
      offset += std::count_if(token.begin(), token.end(),
                              [](char c) { return (static_cast<uint8_t>(c) & 0xC0) != 0x80; });
    }
    Json streamed_body = body;
    streamed_body["stream"] = true;
    const Reply streamed = Post(port, "/v1/completions", streamed_body);
    ASSERT_EQ(streamed.status, 200) << streamed.raw;
    const Streamed sc = ParseStream(streamed.raw, /*chat=*/false);
    EXPECT_EQ(sc.logprobs, lp);  // with several chunks, text_offset continues across them
    // Not asked for: null.
    const Reply without = Post(port, "/v1/completions",
                               {{"prompt", "Once upon"}, {"max_tokens", 2}, {"temperature", 0}});
    EXPECT_TRUE(without.body["choices"][0]["logprobs"].is_null()) << without.raw;
  }

  // Chat: OpenAI's content entries, with bytes; the same numbers as gRPC's on the template's
  // rendering.
  v1::GenerateRequest rendered = TextRequest("User: Hello\nAssistant:", 10);
  rendered.mutable_sampling()->add_stop("\nUser:");
  rendered.set_logprobs(2);
  std::vector<v1::TokenLogprobs> chat_grpc;
  std::vector<int32_t> chat_tokens;
  {
    grpc::ClientContext context;
    auto reader = s.stub->Generate(&context, rendered);
    v1::GenerateResponse chunk;
    while (reader->Read(&chunk)) {
      chat_tokens.insert(chat_tokens.end(), chunk.token_ids().begin(), chunk.token_ids().end());
      chat_grpc.insert(chat_grpc.end(), chunk.logprobs().begin(), chunk.logprobs().end());
    }
    ASSERT_TRUE(reader->Finish().ok());
  }
  const Json chat = {{"messages", {{{"role", "user"}, {"content", "Hello"}}}},
                     {"max_tokens", 10},
                     {"temperature", 0},
                     {"logprobs", true},
                     {"top_logprobs", 2}};
  const Reply whole = Post(port, "/v1/chat/completions", chat);
  ASSERT_EQ(whole.status, 200) << whole.raw;
  const Json& content = whole.body["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), chat_tokens.size()) << whole.raw;
  for (size_t i = 0; i < chat_tokens.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(content[i]["bytes"], Json::array({chat_tokens[i]}));  // byte tokenizer: the id
    EXPECT_EQ(content[i]["token"], LogprobTokenText(bytes->TokenBytes(chat_tokens[i])));
    EXPECT_EQ(content[i]["logprob"].get<double>(), chat_grpc[i].logprob());
    ASSERT_EQ(content[i]["top_logprobs"].size(), 2u);
    EXPECT_EQ(content[i]["top_logprobs"][1]["bytes"],
              Json::array({chat_grpc[i].top(1).token_id()}));
    EXPECT_EQ(content[i]["top_logprobs"][1]["logprob"].get<double>(),
              chat_grpc[i].top(1).logprob());
  }
  Json chat_stream = chat;
  chat_stream["stream"] = true;
  const Reply chunks = Post(port, "/v1/chat/completions", chat_stream);
  ASSERT_EQ(chunks.status, 200) << chunks.raw;
  EXPECT_EQ(ParseStream(chunks.raw, /*chat=*/true).logprobs, content);
  // `logprobs` true alone: each token's, no alternatives.
  Json alone = chat;
  alone.erase("top_logprobs");
  const Reply only = Post(port, "/v1/chat/completions", alone);
  ASSERT_EQ(only.status, 200) << only.raw;
  EXPECT_EQ(only.body["choices"][0]["logprobs"]["content"][0]["top_logprobs"], Json::array());
  EXPECT_EQ(only.body["choices"][0]["logprobs"]["content"][0]["logprob"], content[0]["logprob"]);

  // gRPC's range.
  for (const int n : {-1, 21}) {
    v1::GenerateRequest bad = TextRequest("Once upon", 2);
    bad.set_logprobs(n);
    const Completion refused = Generate(*s.stub, bad);
    EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(refused.status.error_message(), HasSubstr("logprobs must be in [0, 20]"));
  }
}

TEST(OpenAiJsonTest, ATokenThatIsNotWholeCharactersIsShownAsItsBytes) {
  EXPECT_EQ(LogprobTokenText("abc"), "abc");
  EXPECT_EQ(LogprobTokenText("\xc3\xa9"), "\xc3\xa9");  // é, whole
  EXPECT_EQ(LogprobTokenText("\xc3"), "bytes:\\xc3");
  EXPECT_EQ(LogprobTokenText("a\xe2\x82"), "bytes:\\x61\\xe2\\x82");
  EXPECT_EQ(LogprobTokenText(""), "");
}

TEST_F(OpenAiHttpTest, SessionsCarryTheConversationWithTheSameTenancyAsGrpc) {
  ServerOptions o = Options();
  o.api_keys_file = dir_.path() / "keys.txt";
  WriteFile(o.api_keys_file,
            "sk-aaaaaaaaaaaaaaaaaaaa tenant-a\nsk-bbbbbbbbbbbbbbbbbbbb tenant-b\n");
  Served s = Serve(o);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  const std::string a = "sk-aaaaaaaaaaaaaaaaaaaa", b = "sk-bbbbbbbbbbbbbbbbbbbb";

  const Reply anonymous = Call(port, "GET", "/v1/models", "");
  EXPECT_EQ(anonymous.status, 401);
  // In HTTP's terms (it named gRPC's metadata).
  EXPECT_EQ(anonymous.body["error"]["message"],
            "missing API key: send the header 'Authorization: Bearer <key>'")
      << anonymous.raw;
  EXPECT_EQ(Call(port, "GET", "/v1/models", "", "sk-unknown-key-000000000").status, 401);

  const Reply created =
      Post(port, "/v1/sessions", {{"session_id", "chat"}, {"labels", {{"app", "test"}}}}, a);
  ASSERT_EQ(created.status, 200) << created.raw;
  EXPECT_EQ(created.body["id"], "chat");
  EXPECT_EQ(created.body["position"], 0);
  EXPECT_EQ(created.body["labels"]["app"], "test");
  EXPECT_EQ(Post(port, "/v1/sessions", {{"session_id", "chat"}}, a).status, 409);

  // Two turns; the second carries only its new message.
  const auto turn = [&](const std::string& text, const std::string& session, bool header) {
    Json body = {{"messages", {{{"role", "user"}, {"content", text}}}},
                 {"max_tokens", 5},
                 {"temperature", 0}};
    httplib::Headers extra;
    if (header) {
      extra.emplace("X-Session-Id", session);
    } else {
      body["session_id"] = session;
    }
    return Call(port, "POST", "/v1/chat/completions", body.dump(), a, extra);
  };
  const ParsedPage before = ScrapeMetrics(s.server->metrics_port());
  const Reply first = turn("Hi", "chat", /*header=*/false);
  ASSERT_EQ(first.status, 200) << first.raw;
  const int64_t after_first = first.body["session"]["position"];
  EXPECT_EQ(after_first, first.body["usage"]["prompt_tokens"].get<int64_t>() +
                             first.body["usage"]["completion_tokens"].get<int64_t>());
  const Reply got = Call(port, "GET", "/v1/sessions/chat", "", a);
  ASSERT_EQ(got.status, 200);
  EXPECT_EQ(got.body["position"], after_first);
  EXPECT_GT(got.body["state_bytes"], 0);
  EXPECT_EQ(got.body["tier"], "resident");

  // A fork continues exactly like its source.
  const Reply forked = Post(port, "/v1/sessions/chat/fork", {{"new_session_id", "copy"}}, a);
  ASSERT_EQ(forked.status, 200) << forked.raw;
  EXPECT_EQ(forked.body["position"], after_first);
  const Reply second = turn("More", "chat", /*header=*/true);
  ASSERT_EQ(second.status, 200) << second.raw;
  EXPECT_EQ(second.session_header, "chat");
  EXPECT_EQ(second.body["usage"]["history_tokens"], after_first);
  {
    // The metrics count the tokens as the usage does: the first turn's pending token, fed
    // ahead of the second's prompt, is history, not prompt (it was counted as prompt).
    const ParsedPage after = ScrapeMetrics(s.server->metrics_port());
    const auto delta = [&](const std::string& name) {
      return MetricValue(after, name) - MetricValue(before, name);
    };
    EXPECT_EQ(delta("sdm_prompt_tokens_total"),
              first.body["usage"]["prompt_tokens"].get<int64_t>() +
                  second.body["usage"]["prompt_tokens"].get<int64_t>());
    EXPECT_EQ(delta("sdm_history_tokens_total"), after_first);
  }
  const Reply second_copy = turn("More", "copy", /*header=*/false);
  ASSERT_EQ(second_copy.status, 200) << second_copy.raw;
  EXPECT_EQ(second_copy.body["choices"][0]["message"]["content"],
            second.body["choices"][0]["message"]["content"]);
  EXPECT_EQ(second_copy.body["session"]["position"], second.body["session"]["position"]);

  const Reply listed = Call(port, "GET", "/v1/sessions", "", a);
  ASSERT_EQ(listed.status, 200);
  ASSERT_EQ(listed.body["data"].size(), 2u);
  EXPECT_EQ(listed.body["data"][0]["id"], "chat");
  EXPECT_EQ(listed.body["data"][1]["id"], "copy");
  EXPECT_EQ(listed.body["has_more"], false);
  const Reply page = Call(port, "GET", "/v1/sessions?limit=1", "", a);
  EXPECT_EQ(page.body["data"].size(), 1u);
  EXPECT_EQ(page.body["has_more"], true);

  // Another tenant sees none of it: NOT_FOUND everywhere, as over gRPC.
  EXPECT_EQ(Call(port, "GET", "/v1/sessions", "", b).body["data"].size(), 0u);
  for (const Reply& r : {Call(port, "GET", "/v1/sessions/chat", "", b),
                         Call(port, "DELETE", "/v1/sessions/chat", "", b),
                         Post(port, "/v1/sessions/chat/fork", Json::object(), b)}) {
    EXPECT_EQ(r.status, 404) << r.raw;
  }
  const Reply other = Call(
      port, "POST", "/v1/chat/completions",
      Json{{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"session_id", "chat"}}.dump(), b);
  EXPECT_EQ(other.status, 404);
  EXPECT_EQ(other.body["error"]["type"], "not_found_error");
  EXPECT_THAT(other.body["error"]["message"].get<std::string>(), HasSubstr("'chat' not found"));

  const Reply deleted = Call(port, "DELETE", "/v1/sessions/copy", "", a);
  ASSERT_EQ(deleted.status, 200);
  EXPECT_EQ(deleted.body["deleted"], true);
  EXPECT_EQ(Call(port, "GET", "/v1/sessions/copy", "", a).status, 404);
  v1::Session over_grpc;
  EXPECT_TRUE(GetSession(*s.stub, "chat", &over_grpc, a).ok());
  EXPECT_EQ(over_grpc.position(), second.body["session"]["position"].get<int64_t>());
}

// Behind the multi-replica router a client names its session by the X-Session-Id header (nginx
// hashes it, never the body): the creation too, with the header alone or with the same id in the
// body; the two naming different sessions are refused, as the completions refuse it.
TEST_F(OpenAiHttpTest, TheSessionHeaderNamesTheSessionItCreates) {
  Served s = Serve(Options());
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();

  const Reply by_header = Call(port, "POST", "/v1/sessions", "", "", {{"X-Session-Id", "by-hdr"}});
  ASSERT_EQ(by_header.status, 200) << by_header.raw;
  EXPECT_EQ(by_header.body["id"], "by-hdr");
  EXPECT_EQ(Call(port, "GET", "/v1/sessions/by-hdr", "").status, 200);
  const Reply with_body = Call(port, "POST", "/v1/sessions", Json{{"labels", {{"a", "b"}}}}.dump(),
                               "", {{"X-Session-Id", "hdr-body"}});
  ASSERT_EQ(with_body.status, 200) << with_body.raw;
  EXPECT_EQ(with_body.body["id"], "hdr-body");
  EXPECT_EQ(with_body.body["labels"]["a"], "b");
  const Reply same = Call(port, "POST", "/v1/sessions", Json{{"session_id", "both"}}.dump(), "",
                          {{"X-Session-Id", "both"}});
  ASSERT_EQ(same.status, 200) << same.raw;
  EXPECT_EQ(same.body["id"], "both");
  // The header names an existing session: its creation is a conflict, as with the body's id.
  EXPECT_EQ(Call(port, "POST", "/v1/sessions", "", "", {{"X-Session-Id", "by-hdr"}}).status, 409);

  for (const std::string path : {"/v1/sessions", "/v1/chat/completions"}) {
    Json body = {{"session_id", "body-id"}};
    if (path != "/v1/sessions") body["messages"] = {{{"role", "user"}, {"content", "x"}}};
    const Reply mismatch =
        Call(port, "POST", path, body.dump(), "", {{"X-Session-Id", "header-id"}});
    EXPECT_EQ(mismatch.status, 400) << path << ": " << mismatch.raw;
    EXPECT_EQ(mismatch.body["error"]["type"], "invalid_request_error") << path;
    EXPECT_EQ(mismatch.body["error"]["message"],
              "'session_id' ('body-id') and the X-Session-Id header ('header-id') name different "
              "sessions")
        << path;
  }
  // Neither was created.
  EXPECT_EQ(Call(port, "GET", "/v1/sessions/body-id", "").status, 404);
  EXPECT_EQ(Call(port, "GET", "/v1/sessions/header-id", "").status, 404);
  const Reply listed = Call(port, "GET", "/v1/sessions", "");
  ASSERT_EQ(listed.status, 200);
  EXPECT_EQ(listed.body["data"].size(), 3u) << listed.raw;
}

TEST_F(OpenAiHttpTest, EveryBadInputGetsItsStatusAndTheServerKeepsServing) {
  ServerOptions o = Options();
  o.http.max_body_bytes = 64 << 10;
  Served s = Serve(o);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  const Json good = {{"prompt", "ok"}, {"max_tokens", 2}};
  const Json chat = {{"messages", {{{"role", "user"}, {"content", "ok"}}}}, {"max_tokens", 2}};
  struct Case {
    std::string path;
    std::string body;
    int status;
    std::string message_part;
  };
  const auto with = [](Json j, const std::string& key, const Json& value) {
    j[key] = value;
    return j.dump();
  };
  // A body with two fields set.
  const auto with2 = [&with](Json j, const std::string& key, const Json& value,
                             const std::string& key2, const Json& value2) {
    j[key] = value;
    return with(j, key2, value2);
  };
  const std::vector<Case> cases = {
      {"/v1/completions", "{\"prompt\": \"x\",", 400, "not valid JSON"},
      {"/v1/completions", "[1, 2]", 400, "JSON object"},
      {"/v1/completions", "{\"prompt\": \"x\", \"temperature\": NaN}", 400, "not valid JSON"},
      {"/v1/completions", Json{{"max_tokens", 2}}.dump(), 400, "'prompt' is required"},
      {"/v1/completions", with(good, "prompt", 5), 400, "'prompt'"},
      {"/v1/completions", with(good, "prompt", ""), 400, "empty"},
      {"/v1/completions", with(good, "prompt", {1, 99999}), 400, "outside the vocabulary"},
      // Past int64 (it was read as -1: "token_ids.ids[1] = -1"), and past the 32 bits of an id.
      {"/v1/completions", R"({"prompt": [1, 18446744073709551615]})", 400,
       "'prompt'[1] = 18446744073709551615 is out of range for a token id"},
      {"/v1/completions", R"({"prompt": [[5000000000]]})", 400,
       "'prompt'[0][0] = 5000000000 is out of range for a token id"},
      {"/v1/completions", R"({"prompt": [-9223372036854775808]})", 400,
       "'prompt'[0] = -9223372036854775808 is out of range"},
      {"/v1/completions", with(good, "prompt", {"a", 5}), 400, "'prompt'"},
      {"/v1/completions", R"({"prompt": [[1, 2], [3, 1.5]]})", 400,
       "'prompt'[1] must be a string or an array of integer token ids"},
      {"/v1/completions", with(good, "prompt", Json(std::vector<std::string>(65, "a"))), 400,
       "'prompt' holds 65 prompts; at most 64"},
      {"/v1/completions", with2(good, "prompt", {"a", "b"}, "n", 33), 400,
       "'n' must be in [1, 32] (at most 64 choices per request, over 2 prompts), got 33"},
      {"/v1/completions", with(good, "temperature", "hot"), 400, "'temperature'"},
      {"/v1/completions", with(good, "temperature", -1), 400, "temperature"},
      {"/v1/completions", with(good, "top_p", 2), 400, "top_p"},
      {"/v1/completions", with(good, "top_k", "5"), 400, "'top_k' must be an integer"},
      // The service's range check, gRPC's message.
      {"/v1/completions", with(good, "top_k", -1), 400, "sampling.top_k must be >= 0"},
      {"/v1/completions", with(good, "max_tokens", 1.5), 400, "'max_tokens'"},
      {"/v1/completions", with(good, "max_tokens", -1), 400, "max_tokens"},
      {"/v1/completions", with(good, "stream", "yes"), 400, "'stream'"},
      {"/v1/completions", with(good, "ignore_eos", "yes"), 400, "'ignore_eos'"},
      {"/v1/completions", with(good, "stop", {1}), 400, "'stop'"},
      {"/v1/completions", with(good, "n", 0), 400, "'n' must be in [1, 64]"},
      // n * prompts past int64 (2^62 * 4 wrapped to 0 choices, answered 200 with none).
      {"/v1/completions", with2(good, "prompt", {"a", "b", "c", "d"}, "n", 4611686018427387904LL),
       400, "'n' must be in [1, 16]"},
      {"/v1/completions", with(good, "seed", "s"), 400, "'seed'"},
      {"/v1/completions", with(good, "model", "gpt-4"), 404, "'gpt-4' does not exist"},
      {"/v1/completions", with(good, "session_id", "nope"), 404, "'nope' not found"},
      {"/v1/completions", with2(good, "session_id", "nope", "n", 2), 400,
       "a session runs one generation at a time: this request asks for 2 choices"},
      {"/v1/completions", with(good, "session_id", "bad id!"), 400, "session_id"},
      {"/v1/chat/completions", with(chat, "messages", "hi"), 400, "'messages'"},
      {"/v1/chat/completions", with(chat, "messages", Json::array()), 400, "'messages'"},
      {"/v1/chat/completions", with(chat, "messages", {{{"role", "king"}, {"content", "x"}}}), 400,
       "role"},
      {"/v1/chat/completions", with(chat, "messages", {{{"role", "user"}, {"content", 3}}}), 400,
       "content"},
      {"/v1/chat/completions", with(chat, "stream_options", 1), 400, "stream_options"},
      {"/v1/chat/completions", with(chat, "n", 65), 400, "'n' must be in [1, 64]"},
      {"/v1/chat/completions", with(chat, "echo", true), 400, "'echo' is a /v1/completions field"},
      {"/v1/chat/completions", with(chat, "session_id", "nope"), 404, "'nope' not found"},
      // What this server does not implement is refused when asked for, not silently left out.
      {"/v1/completions", with(good, "best_of", 2), 400, "'best_of' is not supported"},
      // OpenAI's best_of must be at least n (1): 0 is no off value.
      {"/v1/completions", with(good, "best_of", 0), 400, "'best_of' is not supported"},
      {"/v1/completions", with(good, "suffix", "end"), 400, "'suffix' is not supported"},
      {"/v1/completions", with(good, "logprobs", 21), 400, "'logprobs' must be in [0, 20]"},
      {"/v1/completions", with(good, "logprobs", -1), 400, "'logprobs' must be in [0, 20]"},
      {"/v1/completions", with(good, "logprobs", true), 400, "'logprobs' must be an integer"},
      {"/v1/chat/completions", with(chat, "logprobs", 3), 400, "'logprobs' must be a boolean"},
      {"/v1/chat/completions", with(chat, "top_logprobs", 2), 400,
       "'top_logprobs' needs 'logprobs': true"},
      {"/v1/chat/completions", with2(chat, "logprobs", true, "top_logprobs", 21), 400,
       "'top_logprobs' must be in [0, 20]"},
      {"/v1/chat/completions", with(chat, "response_format", {{"type", "json_object"}}), 400,
       "'response_format' is not supported"},
      // An agent given tools must not take text for a reply that chose no tool.
      {"/v1/chat/completions", with(chat, "tools", Json::array({kWeatherTool})), 400,
       "'tools' is not supported by this server (it does not call tools)"},
      {"/v1/chat/completions",
       with2(chat, "tools", Json::array({kWeatherTool}), "tool_choice", "auto"), 400,
       "'tools' is not supported"},
      {"/v1/chat/completions", with(chat, "tool_choice", "required"), 400,
       "'tool_choice' is not supported"},
      {"/v1/chat/completions", with(chat, "functions", Json::array({kWeatherTool["function"]})),
       400, "'functions' is not supported"},
      {"/v1/chat/completions", with(chat, "function_call", {{"name", "weather"}}), 400,
       "'function_call' is not supported"},
      {"/v1/completions", with(good, "presence_penalty", 0.5), 400,
       "'presence_penalty' is not supported by this server (it applies no repetition penalties)"},
      {"/v1/chat/completions", with(chat, "frequency_penalty", -1), 400,
       "'frequency_penalty' is not supported"},
      {"/v1/completions", with(good, "logit_bias", {{"abc", 1}}), 400,
       "'logit_bias' key 'abc' is not a token id"},
      {"/v1/completions", with(good, "logit_bias", {{"65", "up"}}), 400,
       "'logit_bias'['65'] must be a number"},
      {"/v1/completions", with(good, "logit_bias", {{"65", 200}}), 400,
       "sampling.logit_bias[65] = 200 must be in [-100, 100]"},
      {"/v1/completions", with(good, "logit_bias", {{"99999", 1}}), 400,
       "sampling.logit_bias: token id 99999 is outside the vocabulary"},
      {"/v1/completions", with(good, "logit_bias", 5), 400, "'logit_bias' must be an object"},
      {"/v1/completions", with(good, "add_special_tokens", 1), 400,
       "'add_special_tokens' must be a boolean"},
      {"/v1/chat/completions", with(chat, "modalities", {"text", "audio"}), 400,
       "'modalities' is not supported"},
      {"/v1/chat/completions", with(chat, "audio", {{"voice", "alloy"}, {"format", "wav"}}), 400,
       "'audio' is not supported"},
      {"/v1/chat/completions", with(chat, "prediction", {{"type", "content"}, {"content", "x"}}),
       400, "'prediction' is not supported"},
      // The chat template's stop string counts towards the 16.
      {"/v1/chat/completions", with(chat, "stop", Json(std::vector<std::string>(16, "z"))), 400,
       "with the chat template's 1 at most 15"},
      // The limit is stated, as configured (64 KiB here, 4 MiB by default).
      {"/v1/completions", std::string(100 << 10, ' '), 413,
       "the request body is larger than the 64 KiB this server accepts"},
      {"/v1/sessions", "{\"session_id\": 7}", 400, "'session_id'"},
      {"/v1/sessions", "{\"ttl_seconds\": -1}", 400, "ttl_seconds"},
      // Past the longest ttl (kMaxSessionTtl), one message however far past: 1e20 was "must be
      // a non-negative number of seconds".
      {"/v1/sessions", "{\"ttl_seconds\": 1e20}", 400,
       "'ttl_seconds' must be at most 100 years (3155760000 s; unset: the server's default), "
       "got 1e+20"},
      {"/v1/sessions", "{\"ttl_seconds\": 10000000000}", 400,
       "'ttl_seconds' must be at most 100 years (3155760000 s; unset: the server's default), "
       "got 10000000000"},
      {"/v1/sessions/nope/fork", "{\"ttl_seconds\": 1e20}", 400,
       "'ttl_seconds' must be at most 100 years"},
      {"/v1/sessions/nope/fork", "{}", 404, "'nope' not found"},
      {"/v1/nothing", "{}", 404, "no endpoint"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.path + " " + c.body.substr(0, 120));
    const Reply r = Call(port, "POST", c.path, c.body);
    EXPECT_EQ(r.status, c.status) << r.raw;
    ASSERT_TRUE(r.body.is_object()) << r.raw;
    EXPECT_TRUE(r.body["error"]["message"].is_string());
    EXPECT_TRUE(r.body["error"]["type"].is_string());
    EXPECT_THAT(r.body["error"]["message"].get<std::string>(), HasSubstr(c.message_part));
    EXPECT_TRUE(r.body["error"]["code"].is_string()) << r.raw;  // never empty: a name or null
    EXPECT_NE(r.body["error"]["code"], "") << r.raw;
    // Still serving.
    ASSERT_EQ(Post(port, "/v1/completions", good).status, 200);
  }
  // Their "off" values, which clients send by default, are accepted.
  for (const auto& [field, value] :
       std::vector<std::pair<std::string, Json>>{{"logprobs", nullptr},
                                                 {"echo", false},
                                                 {"best_of", 1},
                                                 {"suffix", ""},
                                                 {"response_format", {{"type", "text"}}}}) {
    SCOPED_TRACE(field + ": " + value.dump());
    EXPECT_EQ(Call(port, "POST", "/v1/completions", with(good, field, value)).status, 200);
  }
  EXPECT_EQ(Call(port, "POST", "/v1/chat/completions", with(chat, "logprobs", false)).status, 200);
  for (const std::string& off :
       {with(chat, "tools", Json::array()),
        with2(chat, "tools", Json::array({kWeatherTool}), "tool_choice", "none"),
        with(chat, "tool_choice", "auto"),
        with2(chat, "functions", Json::array({kWeatherTool["function"]}), "function_call", "none"),
        with(chat, "presence_penalty", 0), with(chat, "frequency_penalty", 0.0),
        with(chat, "logit_bias", Json::object()), with(chat, "modalities", {"text"}),
        with(chat, "audio", nullptr)}) {
    SCOPED_TRACE(off);
    EXPECT_EQ(Call(port, "POST", "/v1/chat/completions", off).status, 200);
  }
  EXPECT_EQ(Call(port, "POST", "/v1/chat/completions",
                 with(chat, "stop", Json(std::vector<std::string>(15, "z"))))
                .status,
            200);
  EXPECT_EQ(Call(port, "GET", "/v1/sessions/nope", "").status, 404);
  EXPECT_EQ(Call(port, "DELETE", "/v1/sessions/nope", "").status, 404);
  const Reply longest =
      Call(port, "POST", "/v1/sessions", R"({"session_id": "longest", "ttl_seconds": 3155760000})");
  ASSERT_EQ(longest.status, 200) << longest.raw;
  EXPECT_EQ(longest.body["ttl_seconds"], 3155760000) << longest.raw;
  // top_k reaches the sampler: 1 keeps only the most probable token, whatever the temperature,
  // so the completion is the greedy one (ignored, temperature 1 samples the random model's
  // nearly flat distribution).
  const Json greedy = {{"prompt", "ok"}, {"max_tokens", 16}, {"temperature", 0}};
  const Reply expected = Post(port, "/v1/completions", greedy);
  const Reply top_1 = Post(
      port, "/v1/completions",
      Json{{"prompt", "ok"}, {"max_tokens", 16}, {"temperature", 1}, {"seed", 7}, {"top_k", 1}});
  ASSERT_EQ(expected.status, 200) << expected.raw;
  ASSERT_EQ(top_1.status, 200) << top_1.raw;
  EXPECT_EQ(top_1.body["choices"][0]["text"], expected.body["choices"][0]["text"]);
  // A lone surrogate escape (JavaScript's, for a string cut mid-emoji) reads as U+FFFD, in the
  // session endpoints' bodies too.
  EXPECT_EQ(
      Call(port, "POST", "/v1/completions", R"({"prompt": "ok\ud83d", "max_tokens": 2})").status,
      200);
  const Reply labelled =
      Call(port, "POST", "/v1/sessions", R"({"session_id": "cut", "labels": {"emoji": "\ud83d"}})");
  ASSERT_EQ(labelled.status, 200) << labelled.raw;
  EXPECT_EQ(labelled.body["labels"]["emoji"], "\xEF\xBF\xBD") << labelled.raw;
}

// Streams a chat completion with a raw client, stopping (closing the connection) after
// `stop_after` data events; returns the events seen.
int StreamAndHangUp(int port, const std::string& session, int stop_after) {
  httplib::Client client = TestHttpClient(port);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  req.body = Json{
      {"messages", {{{"role", "user"}, {"content", "tell me"}}}},
      {"max_tokens", 1'000'000},
      {"temperature", 0},  // greedy: the model never ends it by itself (NoEosModelDir)
      {"stream", true},
      {"session_id",
       session}}.dump();
  req.set_header("Content-Type", "application/json");
  int events = 0;
  std::string buffer;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    buffer.append(data, n);
    size_t at;
    while ((at = buffer.find("\n\n")) != std::string::npos) {
      if (absl::StartsWith(buffer, "data: ")) ++events;
      buffer.erase(0, at + 2);
    }
    return events < stop_after;
  };
  httplib::Response res;
  httplib::Error error = httplib::Error::Success;
  client.send(req, res, error);
  return events;
}

TEST_F(OpenAiHttpTest, DisconnectCancelsBusyIs409FullQueueIs429) {
  ServerOptions o = Options();
  o.scheduler.max_running = 1;  // the next request runs only if the cancelled one left
  o.scheduler.max_waiting = 1;
  Served s = Serve(o);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  ASSERT_EQ(Post(port, "/v1/sessions", {{"session_id", "long"}}).status, 200);

  // Hang up mid-stream: the job ends, the session is free and keeps what was generated.
  EXPECT_EQ(StreamAndHangUp(port, "long", 4), 4);
  v1::Session session;
  ASSERT_TRUE(Eventually(
      [&] { return GetSession(*s.stub, "long", &session).ok() && !session.generating(); }));
  EXPECT_GE(session.position(), 3);
  const Reply next = Post(port, "/v1/completions", {{"prompt", "next"}, {"max_tokens", 3}});
  EXPECT_EQ(next.status, 200) << next.raw;

  // A session generating over gRPC is busy for HTTP (409); with one running and one waiting,
  // the queue is full (429 with Retry-After).
  grpc::ClientContext running_context, waiting_context;
  Prepare(running_context, {});
  Prepare(waiting_context, {});
  auto running = s.stub->Generate(&running_context, TextRequest("running", 1'000'000, "long"));
  v1::GenerateResponse chunk;
  ASSERT_TRUE(running->Read(&chunk));
  const Reply busy =
      Post(port, "/v1/chat/completions",
           {{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"session_id", "long"}});
  EXPECT_EQ(busy.status, 409) << busy.raw;
  EXPECT_THAT(busy.raw, HasSubstr("already generating"));
  auto waiting = s.stub->Generate(&waiting_context, TextRequest("waiting", 1'000'000));
  ASSERT_TRUE(WaitForMetric(s.server->metrics_port(), "sdm_requests_waiting", {}, 1));
  const Reply full = Post(port, "/v1/completions", {{"prompt", "x"}, {"max_tokens", 2}});
  EXPECT_EQ(full.status, 429) << full.raw;
  EXPECT_EQ(full.retry_after, "1");
  EXPECT_EQ(full.body["error"]["type"], "rate_limit_error");
  running_context.TryCancel();
  waiting_context.TryCancel();
  while (running->Read(&chunk)) {
  }
  while (waiting->Read(&chunk)) {
  }
  running->Finish();
  waiting->Finish();
  EXPECT_TRUE(Eventually([&] {
    return Post(port, "/v1/completions", {{"prompt", "x"}, {"max_tokens", 2}}).status == 200;
  }));
  const ParsedPage page = ScrapeMetrics(s.server->metrics_port());
  EXPECT_EQ(MetricValue(page, "sdm_requests_total",
                        {{"method", "OpenAI.ChatCompletions"}, {"code", "CANCELLED"}}),
            1);
}

// Sends `GET path` on the raw connection `fd` (kept alive: HTTP/1.1) and reads the whole response,
// headers and Content-Length bytes of body; empty when the connection failed, closed, or gave no
// answer within a minute.
std::string RawExchange(int fd, const std::string& request);

std::string KeepAliveExchange(int fd, const std::string& path) {
  return RawExchange(fd, absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"));
}

// Reads one response with a Content-Length from `fd`, within a minute; empty on failure. What was
// received past its end goes to `*after` when given.
std::string ReadResponse(int fd, std::string* after = nullptr);

// Sends `request` (raw HTTP/1.1) on `fd` and reads one response with a Content-Length, within a
// minute; empty on failure.
std::string RawExchange(int fd, const std::string& request) {
  if (!SendAll(fd, request)) return "";
  return ReadResponse(fd);
}

std::string ReadResponse(int fd, std::string* after) {
  const timeval timeout{60, 0};
  if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout)) != 0) return "";
  std::string response;
  size_t header_end = std::string::npos;
  size_t body_bytes = 0;
  while (header_end == std::string::npos || response.size() < header_end + body_bytes) {
    char buffer[4096];
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) return "";
    response.append(buffer, n);
    if (header_end != std::string::npos) continue;
    const size_t blank = response.find("\r\n\r\n");
    if (blank == std::string::npos) continue;
    header_end = blank + 4;
    const std::string headers = absl::AsciiStrToLower(response.substr(0, blank));
    const size_t length = headers.find("\r\ncontent-length: ");
    if (length == std::string::npos) return "";
    if (!absl::SimpleAtoi(
            headers.substr(length + 18, headers.find("\r\n", length + 2) - (length + 18)),
            &body_bytes)) {
      return "";
    }
  }
  if (after != nullptr) *after = response.substr(header_end + body_bytes);
  response.resize(header_end + body_bytes);
  return response;
}

// Everything `fd` receives until the server closes the connection (or a minute passes).
std::string ReadUntilClosed(int fd) {
  const timeval timeout{60, 0};
  if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout)) != 0) return "";
  std::string received;
  char buffer[4096];
  ssize_t n;
  while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0) received.append(buffer, n);
  return received;
}

// With API keys, a request body from a caller without a valid key is refused before it is read
// (401, the connection closed): before, the server read up to 4 MiB of it first, for anyone who
// could connect. Here not one byte of the body is sent, and the answer comes all the same.
TEST_F(OpenAiHttpTest, AnUnauthenticatedBodyIsRefusedBeforeItIsRead) {
  ServerOptions o = Options();
  o.api_keys_file = dir_.path() / "keys.txt";
  WriteFile(o.api_keys_file, "sk-aaaaaaaaaaaaaaaaaaaa tenant-a\n");
  Served s = Serve(o);
  ASSERT_NE(s.server, nullptr);
  for (const std::string key : {"", "Authorization: Bearer sk-unknown-key-000000000\r\n"}) {
    SCOPED_TRACE(key.empty() ? "no key" : "a wrong key");
    const int fd = ConnectRaw(s.server->http_port());
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendAll(fd, absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\n", key,
                                         "Content-Type: application/json\r\n"
                                         "Content-Length: 4000000\r\n\r\n")));
    const std::string reply = ReadUntilClosed(fd);
    close(fd);
    EXPECT_TRUE(absl::StartsWith(reply, "HTTP/1.1 401 ")) << reply;
    EXPECT_THAT(reply, HasSubstr("Connection: close"));
    EXPECT_THAT(reply, HasSubstr("authentication_error"));
  }
  // With a key, the same request is read (and its body awaited).
  const Reply ok = Post(s.server->http_port(), "/v1/completions",
                        {{"prompt", "x"}, {"max_tokens", 1}}, "sk-aaaaaaaaaaaaaaaaaaaa");
  EXPECT_EQ(ok.status, 200) << ok.raw;
}

// The status of KeepAliveExchange's response, or 0 when there was none.
int KeepAliveGet(int fd, const std::string& path) {
  const std::string response = KeepAliveExchange(fd, path);
  int status = 0;
  if (!absl::StartsWith(response, "HTTP/1.1 ") ||
      !absl::SimpleAtoi(response.substr(9, 3), &status)) {
    return 0;
  }
  return status;
}

// Idle keep-alive connections (an SDK keeps a pool of them) do not keep a new client waiting:
// with 2 threads kept, 2 connections that have had their answer stay open, and a new client is
// answered (a thread is started for it). With a fixed pool of 2 threads it waited, unanswered,
// until one of them closed: here after the keep-alive timeout, longer than the client's minute.
TEST_F(OpenAiHttpTest, IdleKeepAliveConnectionsDoNotKeepANewClientWaiting) {
  ServerOptions o = Options();
  o.http.threads = 2;
  o.http.keep_alive_timeout = absl::Minutes(10);
  Served s = Serve(o);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  std::vector<int> idle;
  // Closed before the server stops (which waits for its connections).
  absl::Cleanup close_idle = [&idle] {
    for (int fd : idle) close(fd);
  };
  for (int i = 0; i < o.http.threads; ++i) {
    const int fd = ConnectRaw(port);
    ASSERT_GE(fd, 0);
    idle.push_back(fd);
    ASSERT_EQ(KeepAliveGet(fd, "/v1/models"), 200);
  }
  const Reply models = Call(port, "GET", "/v1/models", "");
  ASSERT_EQ(models.status, 200) << models.raw;
  EXPECT_EQ(models.body["object"], "list");
  // The idle connections were kept open, and are served again.
  for (int fd : idle) EXPECT_EQ(KeepAliveGet(fd, "/v1/models"), 200);
}

// A connection that no thread can take (here the only one, --http_max_connections 1, is held by an
// idle keep-alive connection) is answered 503 with Retry-After and Connection: close once it has
// waited pool.max_wait (here 0: at once), and closed, instead of waiting unanswered until the
// other closes (never, for a keep-alive connection kept in use). Once the thread is free, a new
// client is served again.
TEST_F(OpenAiHttpTest, AConnectionNoThreadTakesIsAnswered503) {
  ServerOptions o = Options();
  o.http.threads = 1;
  o.http.max_connections = 1;
  o.http.keep_alive_timeout = absl::Minutes(10);
  o.http.pool.max_wait = absl::ZeroDuration();
  Served s = Serve(o);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  int holder = ConnectRaw(port);
  ASSERT_GE(holder, 0);
  absl::Cleanup close_holder = [&holder] {
    if (holder >= 0) close(holder);
  };
  ASSERT_EQ(KeepAliveGet(holder, "/v1/models"), 200);  // it holds the thread from now on
  const int refused_fd = ConnectRaw(port);
  ASSERT_GE(refused_fd, 0);
  absl::Cleanup close_refused = [refused_fd] { close(refused_fd); };
  const std::string refused = KeepAliveExchange(refused_fd, "/v1/models");
  ASSERT_TRUE(absl::StartsWith(refused, "HTTP/1.1 503 ")) << refused;
  const std::string head =
      absl::AsciiStrToLower(refused.substr(0, refused.find("\r\n\r\n") + 2));  // with a CRLF
  EXPECT_THAT(head, HasSubstr("\r\nretry-after: 1\r\n"));
  EXPECT_THAT(head, HasSubstr("\r\nconnection: close\r\n"));
  const Json body = Json::parse(refused.substr(refused.find("\r\n\r\n") + 4), nullptr, false);
  EXPECT_EQ(body["error"]["type"], "service_unavailable") << refused;
  // As it says, the connection is closed after it (a client that would keep it is not served).
  SendAll(refused_fd, "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
  EXPECT_EQ(ReadUntilClosed(refused_fd), "");
  // A request with a body on another refused connection is refused too, before its body is read
  // (here past the 4 KiB httplib reads at once: the rest, left on a connection kept open, would
  // be read as a request line too long to read, 414).
  const int post_fd = ConnectRaw(port);
  ASSERT_GE(post_fd, 0);
  absl::Cleanup close_post = [post_fd] { close(post_fd); };
  const std::string prompt =
      Json{{"prompt", "hello there"}, {"max_tokens", 1}}.dump() + std::string(20'000, ' ');
  std::thread sender([post_fd, &prompt] {
    SendAll(post_fd, absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                  "Content-Type: application/json\r\nContent-Length: ",
                                  prompt.size(), "\r\n\r\n", prompt));
  });
  const std::string post = ReadResponse(post_fd);
  sender.join();
  EXPECT_TRUE(absl::StartsWith(post, "HTTP/1.1 503 ")) << post;
  SendAll(post_fd, "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
  EXPECT_EQ(ReadUntilClosed(post_fd), "");
  // Counted (their requests never reached a route: not in sdm_requests_total).
  EXPECT_EQ(
      MetricValue(ScrapeMetrics(s.server->metrics_port()), "sdm_http_connections_refused_total"),
      2);
  // The holder is still served on its thread.
  EXPECT_EQ(KeepAliveGet(holder, "/v1/models"), 200);
  close(holder);
  holder = -1;
  // Its thread notices the close on its own time: until then a new client may be refused too.
  EXPECT_TRUE(Eventually([port] {
    httplib::Client client = TestHttpClient(port);
    httplib::Result r = client.Get("/v1/models");
    return r && r->status == 200;
  }));
}

// Also for a client that accepts compressed responses, as the official SDKs do (httpx, undici:
// "gzip, deflate, br"): a compressor would hold the heartbeats back and the hang-up would go
// unnoticed.
TEST_F(OpenAiHttpTest, ANonStreamingClientThatHangsUpCancelsItsRequest) {
  ServerOptions o = Options();
  o.scheduler.max_running = 1;
  Served s = Serve(o);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  for (const std::string& encodings : {std::string(), std::string("gzip, deflate, br")}) {
    SCOPED_TRACE("Accept-Encoding: " + encodings);
    const std::string id = encodings.empty() ? "whole" : "whole-compressible";
    ASSERT_EQ(Post(port, "/v1/sessions", {{"session_id", id}}).status, 200);
    const auto counted = [&](const std::string& name) {
      return MetricValue(ScrapeMetrics(s.server->metrics_port()), name);
    };
    const double generated_before = counted("sdm_generated_tokens_total");
    const double prompt_before = counted("sdm_prompt_tokens_total");
    httplib::Headers headers;
    if (!encodings.empty()) headers.emplace("Accept-Encoding", encodings);
    httplib::Client client = TestHttpClient(port);
    std::atomic<bool> returned{false};
    std::thread waiting([&] {
      const httplib::Result r =
          client.Post("/v1/completions", headers,
                      Json{{"prompt", "go"},
                           {"max_tokens", 1'000'000},
                           {"temperature", 0},  // greedy: never ended by the model itself
                           {"session_id", id}}
                          .dump(),
                      "application/json");
      EXPECT_FALSE(r && r->status == 200 && absl::StrContains(r->body, "choices"));
      returned.store(true);
    });
    // Generating (no response yet: it would come after a million tokens), then the client
    // leaves.
    v1::Session session;
    ASSERT_TRUE(
        Eventually([&] { return GetSession(*s.stub, id, &session).ok() && session.generating(); }));
    client.stop();
    waiting.join();
    EXPECT_TRUE(returned.load());
    EXPECT_TRUE(Eventually([&] {
      return GetSession(*s.stub, id, &session).ok() && !session.generating();
    })) << "the job kept running after its client left";
    // What it read and generated is counted, as for a gRPC call that was cancelled.
    EXPECT_TRUE(
        Eventually([&] { return counted("sdm_generated_tokens_total") > generated_before; }));
    EXPECT_GT(counted("sdm_prompt_tokens_total"), prompt_before);
    // Its place in the batch (max_running 1) is free again.
    EXPECT_EQ(Post(port, "/v1/completions", {{"prompt", "next"}, {"max_tokens", 2}}).status, 200);
  }
  // A whole response to such a client comes uncompressed, its type with a charset.
  httplib::Client client = TestHttpClient(port);
  const httplib::Result r =
      client.Post("/v1/completions", {{"Accept-Encoding", "gzip, deflate, br"}},
                  Json{{"prompt", "go"}, {"max_tokens", 2}}.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->get_header_value("Content-Encoding"), "");
  EXPECT_EQ(r->get_header_value("Content-Type"), "application/json; charset=utf-8");
}

// A POST with neither Content-Length nor Transfer-Encoding has an empty body (`curl -X POST`
// sends such a request): answered at once, as with `Content-Length: 0`. httplib read it as a
// body that ends when the connection closes: the client waited for the read timeout, then 400.
TEST_F(OpenAiHttpTest, APostWithoutABodyIsAnsweredAsAnEmptyOne) {
  ServerOptions o = Options();
  o.http.read_timeout = absl::Hours(1);  // the old wait, long enough to fail the test's bound
  Served s = Serve(o);
  ASSERT_NE(s.server, nullptr);
  const int fd = ConnectRaw(s.server->http_port());
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(fd, "POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"));
  // Read the answer's head; a server waiting for the body sends nothing (bounded by a timeout on
  // the socket, so a wrong server fails the test rather than hanging it).
  timeval bound{.tv_sec = 60, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof(bound));
  std::string answer;
  char buffer[4096];
  ssize_t n;
  while (answer.find("\r\n\r\n") == std::string::npos &&
         (n = recv(fd, buffer, sizeof(buffer), 0)) > 0) {
    answer.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  EXPECT_TRUE(absl::StartsWith(answer, "HTTP/1.1 200")) << answer;
}

// A body is read as JSON up to --http_max_body_bytes whatever its Content-Type says: `curl -d`
// sends application/x-www-form-urlencoded, which httplib itself caps at 8 KiB.
TEST_F(OpenAiHttpTest, BodiesAreReadAsJsonWhateverTheirContentType) {
  ServerOptions o = Options();
  o.http.max_body_bytes = 64 << 10;
  Served s = Serve(o);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  const std::string form = "application/x-www-form-urlencoded";
  const std::string long_body =
      Json{{"prompt", "x"}, {"max_tokens", 2}, {"user", std::string(20'000, 'u')}}.dump();
  for (const std::string& type :
       {form, std::string("text/plain"), std::string("application/json")}) {
    SCOPED_TRACE(type);
    const Reply r = Call(port, "POST", "/v1/completions", long_body, "", {}, type);
    EXPECT_EQ(r.status, 200) << r.raw.substr(0, 300);
    EXPECT_EQ(r.body["usage"]["completion_tokens"], 2);
    // A session endpoint too (JSON allows the trailing whitespace that makes it long).
    const std::string id = "s-" + std::to_string(type.size());
    const Reply created =
        Call(port, "POST", "/v1/sessions",
             Json{{"session_id", id}}.dump() + std::string(10'000, ' '), "", {}, type);
    EXPECT_EQ(created.status, 200) << created.raw.substr(0, 300);
    EXPECT_EQ(created.body["id"], id);
    // Past the limit: 413 in OpenAI's shape, and the connection's next request is served.
    const Reply big =
        Call(port, "POST", "/v1/completions", std::string(100 << 10, ' '), "", {}, type);
    EXPECT_EQ(big.status, 413) << big.raw.substr(0, 300);
    EXPECT_EQ(big.body["error"]["message"],
              "the request body is larger than the 64 KiB this server accepts");
  }
  // multipart/form-data is not JSON: 400 (it was a 500, httplib's multipart parser throwing).
  {
    httplib::Client client = TestHttpClient(port);
    const httplib::MultipartFormDataItems items = {{"prompt", "x", "", ""}};
    const httplib::Result r = client.Post("/v1/completions", items);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << r->body;
    EXPECT_THAT(r->body, HasSubstr("multipart/form-data"));
  }
  // A chunked body (no Content-Length) past the limit: 413 too.
  httplib::Client client = TestHttpClient(port);
  size_t sent = 0;
  const httplib::Result chunked = client.Post(
      "/v1/completions",
      [&](size_t, httplib::DataSink& sink) {
        const std::string piece(16 << 10, ' ');
        if (sent < (128 << 10)) {
          sink.write(piece.data(), piece.size());
          sent += piece.size();
        } else {
          sink.done();
        }
        return true;
      },
      "application/json");
  if (chunked) {  // else the server closed the connection before reading all of it
    EXPECT_EQ(chunked->status, 413);
    EXPECT_THAT(chunked->body, HasSubstr("larger than the 64 KiB this server accepts"));
  }
  EXPECT_EQ(Post(port, "/v1/completions", {{"prompt", "x"}, {"max_tokens", 2}}).status, 200);
}

// A request whose body the server leaves unread (a chunked body past the limit, not read past it;
// a GET's) is answered, then its connection is closed: httplib kept it open and read the rest of
// the body as the next requests (lines of spaces longer than a request line: 414 after 414),
// and the client's next real request on it went unanswered. A client sees its answer, then the
// close (it reconnects), never what the rest of its body would have been parsed as.
TEST_F(OpenAiHttpTest, ABodyLeftUnreadEndsItsConnection) {
  ServerOptions o = Options();
  o.http.max_body_bytes = 64 << 10;
  Served s = Serve(o);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  const std::string spaces(20 << 10, ' ');  // JSON whitespace; no request line is this long
  std::string chunked =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      "Transfer-Encoding: chunked\r\n\r\n";
  for (int i = 0; i < 5; ++i) {  // 100 KiB: past the limit in the fourth chunk
    absl::StrAppend(&chunked, absl::Hex(spaces.size()), "\r\n", spaces, "\r\n");
  }
  chunked += "0\r\n\r\n";
  const std::string get_with_body =
      absl::StrCat("GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: ", spaces.size(),
                   "\r\n\r\n", spaces);
  const std::string next = "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  for (const auto& [request, status] :
       std::vector<std::pair<std::string, int>>{{chunked, 413}, {get_with_body, 200}}) {
    SCOPED_TRACE(request.substr(0, request.find('\r')));
    const int fd = ConnectRaw(port);
    ASSERT_GE(fd, 0);
    absl::Cleanup close_fd = [fd] { close(fd); };
    // Sent alongside the reading: a server that stops reading may close before all is sent.
    std::thread sender([fd, &data = request] { SendAll(fd, data); });
    std::string after;  // what follows the answer
    const std::string answer = ReadResponse(fd, &after);
    sender.join();
    ASSERT_TRUE(absl::StartsWith(answer, absl::StrCat("HTTP/1.1 ", status, " "))) << answer;
    const std::string head = absl::AsciiStrToLower(answer.substr(0, answer.find("\r\n\r\n") + 2));
    EXPECT_THAT(head, HasSubstr("\r\nconnection: close\r\n"));
    EXPECT_THAT(head, Not(HasSubstr("keep-alive:")));
    if (status == 413) {
      const Json body = Json::parse(answer.substr(answer.find("\r\n\r\n") + 4), nullptr, false);
      EXPECT_EQ(body["error"]["type"], "invalid_request_error") << answer;
      EXPECT_EQ(body["error"]["code"], "payload_too_large") << answer;
    }
    // The connection's next request: the server has closed it (the send may fail), so nothing
    // but the close follows; never an answer to the rest of the body.
    SendAll(fd, next);
    after += ReadUntilClosed(fd);
    EXPECT_EQ(after, "");
    // The client reconnects and is served.
    EXPECT_EQ(Call(port, "GET", "/v1/models", "").status, 200);
  }
}

// What no route takes is answered in OpenAI's shape, as a request error: a method its path does not
// take 405 with Allow (it was 404; a PUT or PATCH without a length was read until the client
// closed, then 400 "could not be read as HTTP/1.1"), a path without routes 404, a URI too long
// 414 (it was "server_error", "HTTP 414"). A request httplib cannot parse stays 400. Those
// answered before their end was read close their connection; the others keep it.
TEST_F(OpenAiHttpTest, WhatNoRouteTakesIsARequestErrorInOpenAisShape) {
  ServerOptions o = Options();
  o.http.read_timeout = absl::Hours(1);  // the old wait for a PUT's body, past the test's bound
  Served s = Serve(o);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  const auto request = [](const std::string& line, const std::string& headers = "") {
    return absl::StrCat(line, " HTTP/1.1\r\nHost: 127.0.0.1\r\n", headers, "\r\n");
  };
  struct Case {
    std::string request;
    int status;
    std::string type;
    std::string code;
    std::string message_part;
    std::string allow;  // the Allow header; empty: none
    bool kept;          // the connection serves a next request
  };
  const std::vector<Case> cases = {
      {request("PUT /v1/sessions/x"), 405, "invalid_request_error", "method_not_allowed",
       "no endpoint PUT /v1/sessions/x; /v1/sessions/x takes GET, HEAD, DELETE",
       "GET, HEAD, DELETE", true},
      {request("PATCH /v1/models", "Content-Length: 0\r\n"), 405, "invalid_request_error",
       "method_not_allowed", "PATCH /v1/models", "GET, HEAD", true},
      {request("POST /v1/models", "Content-Length: 2\r\n") + "{}", 405, "invalid_request_error",
       "method_not_allowed", "POST /v1/models", "GET, HEAD", false},  // its body left unread
      {request("GET /v1/chat/completions"), 405, "invalid_request_error", "method_not_allowed",
       "takes POST", "POST", true},
      {request("DELETE /v1/sessions/x/fork"), 405, "invalid_request_error", "method_not_allowed",
       "takes POST", "POST", true},
      {request("PUT /v1/nothing"), 404, "not_found_error", "not_found",
       "no endpoint PUT /v1/nothing", "", true},
      {request("GET /v1/" + std::string(9000, 'a')), 414, "invalid_request_error", "uri_too_long",
       "the URI is too long", "", false},
      {"GARBAGE\r\n\r\n", 400, "invalid_request_error", "invalid_argument",
       "could not be read as HTTP/1.1", "", false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.request.substr(0, 60));
    const int fd = ConnectRaw(port);
    ASSERT_GE(fd, 0);
    absl::Cleanup close_fd = [fd] { close(fd); };
    const std::string answer = RawExchange(fd, c.request);
    if (!absl::StartsWith(answer, absl::StrCat("HTTP/1.1 ", c.status, " "))) {
      ADD_FAILURE() << "answered: " << answer;
      continue;
    }
    const size_t blank = answer.find("\r\n\r\n");
    const std::string head = absl::AsciiStrToLower(answer.substr(0, blank + 2));
    if (c.allow.empty()) {
      EXPECT_THAT(head, Not(HasSubstr("\r\nallow:")));
    } else {
      EXPECT_THAT(head,
                  HasSubstr(absl::StrCat("\r\nallow: ", absl::AsciiStrToLower(c.allow), "\r\n")));
    }
    const Json body = Json::parse(answer.substr(blank + 4), nullptr, false);
    if (!body.is_object()) {
      ADD_FAILURE() << "not JSON: " << answer;
      continue;
    }
    EXPECT_EQ(body["error"]["type"], c.type) << answer;
    EXPECT_EQ(body["error"]["code"], c.code) << answer;
    EXPECT_THAT(body["error"]["message"].get<std::string>(), HasSubstr(c.message_part));
    if (c.kept) {
      EXPECT_EQ(KeepAliveGet(fd, "/v1/models"), 200);
    } else {
      EXPECT_THAT(head, HasSubstr("\r\nconnection: close\r\n"));
      SendAll(fd, request("GET /v1/models"));
      EXPECT_EQ(ReadUntilClosed(fd), "");
    }
  }
}

// A chat completion without max_tokens runs until it ends by itself, up to the server's limit
// (OpenAI's chat API has no default); a completion's default is the server's, as gRPC's.
TEST_F(OpenAiHttpTest, AChatCompletionWithoutMaxTokensRunsUpToTheLimit) {
  ServerOptions o = Options();
  o.service.max_tokens_limit = 300;  // past the default of 256
  o.service.default_max_tokens = 5;
  o.service.max_session_tokens = 0;  // no room to cut it to
  Served s = Serve(o);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  // The no-EOS model: only max_tokens ends them.
  const Reply chat = Post(port, "/v1/chat/completions",
                          {{"messages", {{{"role", "user"}, {"content", "go"}}}},
                           {"temperature", 0},
                           {"stop", Json::array()}});
  ASSERT_EQ(chat.status, 200) << chat.raw;
  EXPECT_EQ(chat.body["usage"]["completion_tokens"], 300) << chat.raw;
  EXPECT_EQ(chat.body["choices"][0]["finish_reason"], "length");
  const Reply completion = Post(port, "/v1/completions", {{"prompt", "go"}, {"temperature", 0}});
  ASSERT_EQ(completion.status, 200) << completion.raw;
  EXPECT_EQ(completion.body["usage"]["completion_tokens"], 5) << completion.raw;
  // Asked for, max_tokens is what it says.
  const Reply asked = Post(port, "/v1/chat/completions",
                           {{"messages", {{{"role", "user"}, {"content", "go"}}}},
                            {"temperature", 0},
                            {"max_tokens", 7}});
  ASSERT_EQ(asked.status, 200) << asked.raw;
  EXPECT_EQ(asked.body["usage"]["completion_tokens"], 7) << asked.raw;
}

// A prompt past the server's context limits is OpenAI's context_length_exceeded, naming the field
// (clients trim their history on that code), over max_prompt_tokens or past a session's room.
TEST_F(OpenAiHttpTest, APromptPastTheContextLimitsIsContextLengthExceeded) {
  ServerOptions o = Options();  // max_prompt_tokens 256 (TestOptions)
  o.service.max_session_tokens = 300;
  Served s = Serve(o);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  const auto chat = [](const std::string& content) {
    return Json{{"messages", {{{"role", "user"}, {"content", content}}}}, {"max_tokens", 2}};
  };
  const auto expect_too_long = [](const Reply& r, const std::string& param) {
    EXPECT_EQ(r.status, 400) << r.raw;
    EXPECT_EQ(r.body["error"]["code"], "context_length_exceeded") << r.raw;
    EXPECT_EQ(r.body["error"]["param"], param) << r.raw;
    EXPECT_EQ(r.body["error"]["type"], "invalid_request_error") << r.raw;
    EXPECT_THAT(r.body["error"]["message"].get<std::string>(), HasSubstr("maximum context length"));
  };
  expect_too_long(Post(port, "/v1/chat/completions", chat(std::string(300, 'a'))), "messages");
  expect_too_long(
      Post(port, "/v1/completions", {{"prompt", std::string(300, 'a')}, {"max_tokens", 2}}),
      "prompt");
  // A session with 200 tokens of history has no room for 150 more under 300.
  ASSERT_EQ(Post(port, "/v1/sessions", {{"session_id", "full"}}).status, 200);
  Json first = chat(std::string(200, 'b'));
  first["session_id"] = "full";
  ASSERT_EQ(Post(port, "/v1/chat/completions", first).status, 200);
  Json next = chat(std::string(150, 'c'));
  next["session_id"] = "full";
  expect_too_long(Post(port, "/v1/chat/completions", next), "messages");
  // Other refusals keep their own code and no param.
  const Reply other = Post(port, "/v1/chat/completions", {{"messages", "x"}});
  EXPECT_EQ(other.status, 400);
  EXPECT_EQ(other.body["error"]["code"], "invalid_argument") << other.raw;
  EXPECT_TRUE(other.body["error"]["param"].is_null()) << other.raw;
}

// CORS, for browser apps on other origins: off by default; an allowed origin's preflight is 204
// and its responses carry Access-Control-Allow-Origin; other origins get nothing of it.
TEST_F(OpenAiHttpTest, BrowserOriginsAreAllowedOnlyWhenConfigured) {
  const std::string app = "https://app.example.com";
  const httplib::Headers preflight = {{"Origin", app},
                                      {"Access-Control-Request-Method", "POST"},
                                      {"Access-Control-Request-Headers", "authorization"}};
  const Json body = {{"prompt", "hi"}, {"max_tokens", 2}};
  {
    Served s = Serve(Options());  // no origins
    ASSERT_NE(s.server, nullptr);
    httplib::Client client = TestHttpClient(s.server->http_port());
    const httplib::Result options = client.Options("/v1/completions", preflight);
    ASSERT_TRUE(options);
    EXPECT_EQ(options->status, 405);
    EXPECT_FALSE(options->has_header("Access-Control-Allow-Origin"));
    const httplib::Result post =
        client.Post("/v1/completions", {{"Origin", app}}, body.dump(), "application/json");
    ASSERT_TRUE(post);
    EXPECT_EQ(post->status, 200);
    EXPECT_FALSE(post->has_header("Access-Control-Allow-Origin"));
  }
  for (const std::string& allowed : {app, std::string("*")}) {
    SCOPED_TRACE(allowed);
    ServerOptions o = Options();
    o.http.cors_origins = {"http://localhost:3000", allowed};
    Served s = Serve(o);
    ASSERT_NE(s.server, nullptr);
    httplib::Client client = TestHttpClient(s.server->http_port());
    const httplib::Result options = client.Options("/v1/completions", preflight);
    ASSERT_TRUE(options);
    EXPECT_EQ(options->status, 204);
    EXPECT_EQ(options->get_header_value("Access-Control-Allow-Origin"), allowed);
    EXPECT_EQ(options->get_header_value("Access-Control-Allow-Methods"), "POST");
    EXPECT_THAT(options->get_header_value("Access-Control-Allow-Headers"),
                HasSubstr("Authorization"));
    const httplib::Result post =
        client.Post("/v1/completions", {{"Origin", app}}, body.dump(), "application/json");
    ASSERT_TRUE(post);
    EXPECT_EQ(post->status, 200) << post->body;
    EXPECT_EQ(post->get_header_value("Access-Control-Allow-Origin"), allowed);
    EXPECT_THAT(post->get_header_value("Access-Control-Expose-Headers"), HasSubstr("X-Session-Id"));
    // Errors too: a browser app reads why it was refused.
    const httplib::Result refused =
        client.Post("/v1/completions", {{"Origin", app}}, R"({"prompt": 5})", "application/json");
    ASSERT_TRUE(refused);
    EXPECT_EQ(refused->status, 400);
    EXPECT_EQ(refused->get_header_value("Access-Control-Allow-Origin"), allowed);
    if (allowed != "*") {
      // Another origin: no preflight answer, no header.
      const httplib::Result other = client.Options(
          "/v1/completions",
          {{"Origin", "https://evil.example"}, {"Access-Control-Request-Method", "POST"}});
      ASSERT_TRUE(other);
      EXPECT_EQ(other->status, 405);
      EXPECT_FALSE(other->has_header("Access-Control-Allow-Origin"));
    }
  }
  // What is not an origin is refused at start.
  for (const std::string bad : {"app.example.com", "https://app.example.com/", "https://*.x.com"}) {
    ServerOptions o = Options();
    o.http.cors_origins = {bad};
    const absl::StatusOr<std::unique_ptr<SdmServer>> server = SdmServer::Start(o);
    ASSERT_FALSE(server.ok()) << bad;
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(server.status().message(), HasSubstr("is not an origin")) << bad;
  }
}

// Sampling as OpenAI's API: without a seed each request samples afresh; with one it is
// reproducible; top_p 0 keeps only the most probable token (so it samples greedily).
TEST_F(OpenAiHttpTest, WithoutASeedEachRequestSamplesAfresh) {
  Served s = Serve(Options());
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  const auto text = [&](const Json& body) {
    const Reply r = Post(port, "/v1/completions", body);
    EXPECT_EQ(r.status, 200) << r.raw;
    return r.status == 200 ? r.body["choices"][0]["text"].get<std::string>() : std::string();
  };
  const Json sampled = {{"prompt", "Once upon"}, {"max_tokens", 24}};  // temperature 1
  std::set<std::string> texts;
  for (int i = 0; i < 3; ++i) texts.insert(text(sampled));
  // Three draws of 24 tokens from a random model's near-flat distributions: equal only if the
  // seed was the same.
  EXPECT_EQ(texts.size(), 3u);
  Json seeded = sampled;
  seeded["seed"] = 7;
  EXPECT_EQ(text(seeded), text(seeded));
  Json nucleus_of_one = sampled;
  nucleus_of_one["top_p"] = 0;
  Json greedy = sampled;
  greedy["temperature"] = 0;
  EXPECT_EQ(text(nucleus_of_one), text(greedy));
}

TEST_F(OpenAiHttpTest, HttpAndGrpcInOneBatchEachGetTheirSoloTokens) {
  Served s = Serve(Options());
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  constexpr int kEach = 6;
  const auto prompt = [](int i) { return absl::StrCat("req ", i, std::string(i % 5, 'y')); };
  // Odd requests are sampled with their own seed, even ones greedy.
  const auto grpc_request = [&](int i) {
    v1::GenerateRequest r = TextRequest(prompt(i), 16);
    if (i % 2 == 1) {
      r.mutable_sampling()->set_temperature(0.8);
      r.mutable_sampling()->set_seed(100 + i);
    }
    return r;
  };
  const auto http_body = [&](int i) {
    Json j = {{"prompt", prompt(i)}, {"max_tokens", 16}, {"stream", i % 4 < 2}};
    j["temperature"] = i % 2 == 1 ? 0.8 : 0.0;
    if (i % 2 == 1) j["seed"] = 100 + i;
    return j;
  };
  const auto http_text = [&](const Reply& r, int i) {
    if (i % 4 < 2) return ParseStream(r.raw, /*chat=*/false).text;
    return r.body["choices"][0]["text"].get<std::string>();
  };
  std::vector<Completion> over_grpc(kEach);
  std::vector<Reply> over_http(kEach);
  {
    // Every step of the requests below is shared at least with the held stream.
    HeldStream held(*s.stub);
    ASSERT_TRUE(held.running());
    std::atomic<int> ready{0};
    std::vector<std::thread> clients;
    for (int i = 0; i < 2 * kEach; ++i) {
      clients.emplace_back([&, i] {
        ready.fetch_add(1);
        while (ready.load() < 2 * kEach) std::this_thread::yield();
        if (i < kEach) {
          over_grpc[i] = Generate(*s.stub, grpc_request(i));
        } else {
          over_http[i - kEach] = Post(port, "/v1/completions", http_body(i - kEach));
        }
      });
    }
    for (std::thread& t : clients) t.join();
  }
  const ParsedPage page = ScrapeMetrics(s.server->metrics_port());
  EXPECT_LT(MetricValue(page, "sdm_batch_size_bucket", {{"le", "1"}}),
            MetricValue(page, "sdm_batch_size_count"));
  for (int i = 0; i < kEach; ++i) {
    SCOPED_TRACE(i);
    ASSERT_EQ(over_http[i].status, 200) << over_http[i].raw;
    ASSERT_TRUE(over_grpc[i].status.ok());
    // Solo runs, one at a time, on each API.
    const Completion solo = Generate(*s.stub, grpc_request(i));
    EXPECT_EQ(over_grpc[i].tokens, solo.tokens);
    EXPECT_EQ(http_text(over_http[i], i), solo.text);
    const Reply solo_http = Post(port, "/v1/completions", http_body(i));
    EXPECT_EQ(http_text(solo_http, i), solo.text);
  }
}

// A second server on the HTTP port another one serves fails to start, naming it: with httplib's
// default SO_REUSEPORT both listened and the kernel split the connections between the two (the
// one without API keys answering half of the unauthenticated requests).
TEST_F(OpenAiHttpTest, AnHttpPortInUseFailsTheStart) {
  Served first = Serve(Options());
  ASSERT_NE(first.server, nullptr);
  ServerOptions o = Options();
  o.store.dir = dir_.path() / "second-state";
  o.http.port = first.server->http_port();
  absl::StatusOr<std::unique_ptr<SdmServer>> second = SdmServer::Start(o);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr(absl::StrCat(":", first.server->http_port(), " for the HTTP API")));
}

// A start that fails after the HTTP API listens (here: the metrics address is not one of this
// host's, 192.0.2.1 of TEST-NET-1, which only the bind finds: a port in use is found before
// anything starts) returns its error: the HTTP listener it had started is stopped and joined.
// httplib's stop() does nothing before its accept loop runs, so a stop right after the start
// could wait for ever.
TEST_F(OpenAiHttpTest, AStartFailingAfterTheHttpApiListensReturns) {
  for (int i = 0; i < 20; ++i) {
    ServerOptions o = Options();
    o.store.dir = dir_.path() / absl::StrCat("state-", i);
    o.metrics_host = "192.0.2.1";
    o.metrics_port = 9;
    absl::StatusOr<std::unique_ptr<SdmServer>> second = SdmServer::Start(o);
    ASSERT_FALSE(second.ok());
    EXPECT_THAT(std::string(second.status().message()), HasSubstr("metrics endpoint"));
  }
}

TEST_F(OpenAiHttpTest, WhileTheServerDrainsNewRequestsGet503WithRetryAfter) {
  ServerOptions o = Options();
  o.shutdown_grace = absl::Hours(1);  // never reached: the running stream below keeps it draining
                                      // until the test cancels it
  Served s = Serve(o);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  ASSERT_EQ(Post(port, "/v1/sessions", {{"session_id", "drain"}}).status, 200);
  grpc::ClientContext running_context;
  Prepare(running_context, {});
  auto running = s.stub->Generate(&running_context, TextRequest("running", 1'000'000, "drain"));
  v1::GenerateResponse chunk;
  ASSERT_TRUE(running->Read(&chunk));
  std::thread shutdown([&] { EXPECT_TRUE(s.server->Shutdown().ok()); });
  Reply refused;
  Eventually([&] {
    refused = Post(port, "/v1/completions", {{"prompt", "x"}, {"max_tokens", 2}});
    return refused.status == 503;
  });
  EXPECT_EQ(refused.status, 503) << refused.raw;
  EXPECT_EQ(refused.retry_after, "1");
  EXPECT_EQ(refused.body["error"]["type"], "service_unavailable");
  // Other endpoints keep working while it drains.
  EXPECT_EQ(Call(port, "GET", "/v1/sessions/drain", "").status, 200);
  running_context.TryCancel();
  while (running->Read(&chunk)) {
  }
  running->Finish();
  shutdown.join();
}

// Streams a completion of up to a million tokens ("prompt": "go", with `fields` added) from the
// HTTP API at `port`, its pieces to `receiver` (false ends the stream), until it ends.
void PostEndlessStream(int port, const Json& fields,
                       httplib::ContentReceiverWithProgress receiver) {
  Json body = {{"prompt", "go"}, {"max_tokens", 1'000'000}, {"stream", true}};
  body.update(fields);
  httplib::Client client = TestHttpClient(port);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.content_receiver = std::move(receiver);
  httplib::Response res;
  httplib::Error error = httplib::Error::Success;
  client.send(req, res, error);
}

// On a shared state directory (replicas) the drain closes the HTTP API's port as it does the gRPC
// port: a router's new connections are refused and go to another replica, while the stream in
// flight goes on, and an answer on a connection kept alive from before ends that connection.
// Before, the port stayed open until the end of the drain, answering completions 503.
TEST_F(OpenAiHttpTest, OnASharedDirectoryTheDrainClosesTheHttpPortWhileStreamsGoOn) {
  ServerOptions o = Options();
  o.store.shared_dir = true;
  o.shutdown_grace = absl::Hours(1);  // never reached: the client below ends its stream
  // The kept-alive connection idles between its two requests: never long enough to be closed.
  o.http.keep_alive_timeout = absl::Minutes(10);
  Served s = Serve(o);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  httplib::Client kept = TestHttpClient(port);
  kept.set_keep_alive(true);
  const httplib::Result before = kept.Get("/v1/models");
  ASSERT_TRUE(before);
  ASSERT_EQ(before->status, 200);
  EXPECT_NE(before->get_header_value("Connection"), "close");
  std::atomic<int> pieces{0};
  std::atomic<bool> hang_up{false};
  std::thread client([&] {
    PostEndlessStream(port, {{"ignore_eos", true}}, [&](const char*, size_t, uint64_t, uint64_t) {
      ++pieces;
      return !hang_up.load();
    });
  });
  absl::Cleanup end_stream = [&] {
    hang_up.store(true);
    client.join();
  };
  ASSERT_TRUE(Eventually([&] { return pieces.load() > 0; })) << "the stream sent nothing";
  std::thread shutdown([&] { EXPECT_TRUE(s.server->Shutdown().ok()); });
  absl::Cleanup join_shutdown = [&] {
    hang_up.store(true);  // the drain waits for the stream
    shutdown.join();
  };
  EXPECT_TRUE(Eventually([&] {
    const int fd = ConnectRaw(port);
    if (fd >= 0) close(fd);
    return fd < 0;
  })) << "the port stays open";
  const int seen = pieces.load();
  EXPECT_TRUE(Eventually([&] { return pieces.load() >= seen + 3; })) << "the stream stopped";
  const httplib::Result during = kept.Get("/v1/models");
  ASSERT_TRUE(during) << "the kept-alive connection was not answered";
  EXPECT_EQ(during->status, 200);
  EXPECT_EQ(during->get_header_value("Connection"), "close");
}

TEST_F(OpenAiHttpTest, ShutdownEndsHttpStreamsCleanly) {
  ServerOptions o = Options();
  o.shutdown_grace = absl::ZeroDuration();
  Served s = Serve(o);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->http_port();
  std::atomic<bool> got_chunk{false};
  std::string body;
  std::thread client([&] {
    PostEndlessStream(port, {{"temperature", 0}},
                      [&](const char* data, size_t n, uint64_t, uint64_t) {
                        body.append(data, n);
                        if (absl::StrContains(body, "data: {")) got_chunk.store(true);
                        return true;
                      });
  });
  EXPECT_TRUE(Eventually([&] { return got_chunk.load(); })) << "the stream sent no chunk";
  EXPECT_TRUE(s.server->Shutdown().ok());
  client.join();
  const Streamed streamed = ParseStream(body, /*chat=*/false);
  EXPECT_EQ(streamed.finish_reason, "cancelled");
}

}  // namespace
}  // namespace sdm::testing
