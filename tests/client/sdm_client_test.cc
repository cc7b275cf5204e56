// sdm-client against a fake SdmService on loopback: streaming, chat resumption, sessions,
// error mapping to exit codes, and where the connection options come from.
#include <signal.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "client/cli.h"
#include "client/connection.h"
#include "client/flags.h"
#include "client/interrupt.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/client/fake_sdm_service.h"

namespace sdm::client {
namespace {

using ::testing::ElementsAre;
using ::testing::EndsWith;
using testing::FakeServer;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::StartsWith;

struct RunResult {
  int exit = -1;
  std::string out;
  std::string err;
};

EnvLookup MapEnv(std::map<std::string, std::string> env) {
  return [env = std::move(env)](absl::string_view name) -> std::optional<std::string> {
    auto it = env.find(std::string(name));
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
}

RunResult RunClient(const std::vector<std::string>& args, const std::string& stdin_text = "",
                    std::map<std::string, std::string> env = {}) {
  std::istringstream in(stdin_text);
  std::ostringstream out, err;
  ClientIo io;
  io.in = &in;
  io.out = &out;
  io.err = &err;
  io.env = MapEnv(std::move(env));
  RunResult r;
  r.exit = RunSdmClient(args, io);
  r.out = out.str();
  r.err = err.str();
  return r;
}

class SdmClientTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(server_.ok()); }

  // `sdm-client COMMAND --host FAKE ARGS...`
  RunResult Run(const std::string& command, std::vector<std::string> args,
                const std::string& stdin_text = "") {
    std::vector<std::string> full;
    std::istringstream words(command);
    for (std::string w; words >> w;) full.push_back(w);
    full.push_back("--host");
    full.push_back(server_.address());
    full.insert(full.end(), args.begin(), args.end());
    return RunClient(full, stdin_text);
  }

  FakeServer server_;
};

// ---- generate -------------------------------------------------------------------------------

TEST_F(SdmClientTest, GenerateStreamsAndConcatenatesTheChunks) {
  server_.service().set_tokens_per_chunk(2);
  const RunResult r = Run("generate", {"--prompt", "Hello", "--max_tokens", "5"});
  EXPECT_EQ(r.exit, kExitOk) << r.err;
  EXPECT_EQ(r.out, "t0 t1 t2 t3 t4 ");
  EXPECT_THAT(r.err, HasSubstr("finish_reason=length"));
  EXPECT_THAT(r.err, HasSubstr("prompt_tokens=6 history_tokens=0 generated_tokens=5"));
  const auto requests = server_.service().generate_requests();
  ASSERT_EQ(requests.size(), 1u);
  EXPECT_EQ(requests[0].text(), "Hello");
  EXPECT_EQ(requests[0].session_id(), "");
  EXPECT_EQ(requests[0].sampling().max_tokens(), 5);
}

TEST_F(SdmClientTest, GenerateSendsEverySamplingFlag) {
  const RunResult r =
      Run("generate", {"The prompt", "--temperature=0.7", "--top_k", "5", "--top_p", "0.9",
                       "--seed", "18446744073709551615", "--stop", "a", "--stop", "b b",
                       "--stop_ids", "1, 2", "--noadd_bos", "--max_tokens", "1"});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  const auto requests = server_.service().generate_requests();
  ASSERT_EQ(requests.size(), 1u);
  const sdm::v1::GenerateRequest& q = requests[0];
  EXPECT_EQ(q.text(), "The prompt");
  EXPECT_DOUBLE_EQ(q.sampling().temperature(), 0.7);
  EXPECT_EQ(q.sampling().top_k(), 5);
  ASSERT_TRUE(q.sampling().has_top_p());
  EXPECT_DOUBLE_EQ(q.sampling().top_p(), 0.9);
  EXPECT_EQ(q.sampling().seed(), 18446744073709551615ull);
  EXPECT_THAT(q.sampling().stop(), ElementsAre("a", "b b"));
  EXPECT_THAT(q.sampling().stop_token_ids(), ElementsAre(1, 2));
  ASSERT_TRUE(q.has_add_bos());
  EXPECT_FALSE(q.add_bos());
}

TEST_F(SdmClientTest, GenerateLeavesUnsetFlagsToTheServer) {
  ASSERT_EQ(Run("generate", {"--prompt", "x", "--session", ""}).exit, kExitOk);
  const auto requests = server_.service().generate_requests();
  ASSERT_EQ(requests.size(), 1u);
  EXPECT_FALSE(requests[0].sampling().has_max_tokens());
  EXPECT_FALSE(requests[0].sampling().has_top_p());
  EXPECT_FALSE(requests[0].has_add_bos());
}

TEST_F(SdmClientTest, GenerateReadsThePromptFromStdin) {
  const RunResult r = Run("generate", {"--prompt", "-", "--max_tokens", "1"}, "from stdin\n");
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  EXPECT_EQ(server_.service().generate_requests().at(0).text(), "from stdin\n");
}

TEST_F(SdmClientTest, GenerateJsonPrintsOneObject) {
  server_.service().set_tokens_per_chunk(3);
  const RunResult r = Run("generate", {"--prompt", "hi", "--max_tokens", "4", "--json"});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["text"], "t0 t1 t2 t3 ");
  EXPECT_EQ(j["token_ids"], nlohmann::json({100, 101, 102, 103}));
  EXPECT_EQ(j["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["generated_tokens"], 4);
  EXPECT_EQ(j["usage"]["prompt_tokens"], 3);
}

// A call that fails prints its JSON object too (exit 1, the error on stderr as well): what
// streamed before the failure and whether the turn is in the session. Before, a turn that
// streamed its tokens and ended UNAVAILABLE printed nothing on stdout: the tokens were lost to a
// script, which could not tell either that the turn was not to be sent again.
TEST_F(SdmClientTest, GenerateJsonReportsAFailedCallWithWhatStreamed) {
  ASSERT_EQ(Run("sessions create", {"s"}).exit, kExitOk);
  server_.service().FailNextAfterTokens(
      grpc::Status(grpc::StatusCode::UNAVAILABLE, "the turn was generated but not saved"), "1000");
  RunResult r = Run("generate", {"--prompt", "a", "--session", "s", "--max_tokens", "3", "--json"});
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_THAT(r.err, HasSubstr("UNAVAILABLE: the turn was generated but not saved"));
  nlohmann::json j = nlohmann::json::parse(r.out);  // one object, nothing else
  EXPECT_EQ(j["session_id"], "s");
  EXPECT_EQ(j["text"], "t0 t1 t2 ");
  EXPECT_EQ(j["token_ids"], nlohmann::json({100, 101, 102}));
  EXPECT_EQ(j["error"], nlohmann::json({{"code", "UNAVAILABLE"},
                                        {"message", "the turn was generated but not saved"},
                                        {"turn_in_session", "yes"}}));
  EXPECT_FALSE(j.contains("finish_reason"));  // no final chunk came
  EXPECT_FALSE(j.contains("usage"));

  // How each ending leaves the turn (docs/api.md, Errors).
  const struct {
    grpc::StatusCode code;
    bool after_tokens;
    std::string retry_after_ms;
    std::string session;
    std::string turn_in_session;
  } cases[] = {
      // Rejected before any token: safe to send again.
      {grpc::StatusCode::RESOURCE_EXHAUSTED, false, "1000", "s", "no"},
      {grpc::StatusCode::UNAVAILABLE, false, "1000", "s", "no"},
      // Cut short: the session keeps what it read and generated until then.
      {grpc::StatusCode::DEADLINE_EXCEEDED, false, "", "s", "partly"},
      {grpc::StatusCode::DEADLINE_EXCEEDED, true, "", "s", "partly"},
      // A one-shot request keeps nothing anywhere.
      {grpc::StatusCode::UNAVAILABLE, true, "1000", "", "no"},
      // No hint: not the server's UNAVAILABLE but a lost connection, which says nothing.
      {grpc::StatusCode::UNAVAILABLE, true, "", "s", "unknown"},
      // Not saved (the session broke first).
      {grpc::StatusCode::DATA_LOSS, true, "", "s", "no"},
      // Already generating, or a turn cut short or not saved: the message says which.
      {grpc::StatusCode::ABORTED, false, "", "s", "unknown"},
  };
  for (const auto& c : cases) {
    const grpc::Status status(c.code, "m");
    if (c.after_tokens) {
      server_.service().FailNextAfterTokens(status, c.retry_after_ms);
    } else {
      server_.service().FailNext("Generate", status, 1, c.retry_after_ms);
    }
    r = Run("generate", {"--prompt", "a", "--session", c.session, "--max_tokens", "2", "--json"});
    const std::string what = ::testing::PrintToString(c.code) + (c.after_tokens ? " after" : "") +
                             " on '" + c.session + "'";
    EXPECT_EQ(r.exit, kExitFailure) << what;
    j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["text"], c.after_tokens ? "t0 t1 " : "") << what;
    EXPECT_EQ(j["token_ids"].size(), c.after_tokens ? 2u : 0u) << what;
    EXPECT_EQ(j["error"]["code"], std::string(StatusCodeName(c.code))) << what;
    EXPECT_EQ(j["error"]["message"], "m") << what;
    EXPECT_EQ(j["error"]["turn_in_session"], c.turn_in_session) << what;
  }
}

TEST_F(SdmClientTest, GenerateOnASessionCarriesItsHistory) {
  ASSERT_EQ(Run("sessions create", {"s"}).exit, kExitOk);
  ASSERT_EQ(Run("generate", {"--prompt", "abc", "--session", "s", "--max_tokens", "2"}).exit,
            kExitOk);
  const RunResult r = Run("generate", {"--prompt", "de", "--session", "s", "--max_tokens", "2"});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  // First call: BOS + 3 bytes + 2 generated = 6 tokens of history for the second.
  EXPECT_THAT(r.err, HasSubstr("prompt_tokens=2 history_tokens=6 generated_tokens=2"));
}

// ---- errors and exit codes ------------------------------------------------------------------

TEST_F(SdmClientTest, UsageErrorsExitWithTwoAndCallNothing) {
  for (const auto& [command, args] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"generate", {}},
           {"generate", {"--prompt", "a", "b"}},
           {"generate", {"--prompt", ""}},
           {"generate", {"--prompt", "a", "--stop_ids", "1,x"}},
           {"generate", {"--prompt", "a", "--seed", "-1"}},
           {"generate", {"--prompt", "a", "--max_tokens", "many"}},
           {"generate", {"--prompt", "a", "--frobnicate"}},
           {"generate", {"--prompt", "a", "--timeout", "-1"}},
           {"chat", {}},
           {"sessions get", {}},
           {"sessions fork", {}},
           {"sessions create", {"x", "--ttl", "soon"}},
           {"sessions list", {"--label", "novalue"}},
           {"sessions frob", {}},
           {"tokenize", {}},
           {"detokenize", {"1,a"}},
           {"info", {"extra"}},
           {"teleport", {}},
       }) {
    const RunResult r = Run(command, args);
    EXPECT_EQ(r.exit, kExitUsage) << command << " " << ::testing::PrintToString(args);
    EXPECT_THAT(r.err, Not(IsEmpty()));
  }
  EXPECT_THAT(server_.service().calls(), IsEmpty());
  EXPECT_EQ(RunClient({}).exit, kExitUsage);
}

TEST_F(SdmClientTest, HelpExitsWithZero) {
  const RunResult r = Run("generate", {"--help"});
  EXPECT_EQ(r.exit, kExitOk);
  EXPECT_THAT(r.out, HasSubstr("--max_tokens"));
  EXPECT_THAT(r.out, HasSubstr("--api_key"));
  EXPECT_EQ(RunClient({"help"}).exit, kExitOk);
}

TEST_F(SdmClientTest, FailedCallsPrintTheCodeAndExitWithOne) {
  server_.service().FailNext("Generate",
                             grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "queue full"));
  RunResult r = Run("generate", {"--prompt", "a"});
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_EQ(r.out, "");
  EXPECT_THAT(r.err, HasSubstr("RESOURCE_EXHAUSTED: queue full"));

  r = Run("generate", {"--prompt", "a", "--session", "missing"});
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_THAT(r.err, HasSubstr("NOT_FOUND: session 'missing' not found"));

  r = Run("sessions delete", {"nope"});
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_THAT(r.err, HasSubstr("NOT_FOUND"));
}

// UNAUTHENTICATED names where sdm-client takes the key from: the server's message names the
// gRPC metadata, which a user of the tool does not set.
TEST_F(SdmClientTest, AnUnauthenticatedCallNamesTheKeyFlags) {
  const std::string hint = "(give the API key with --api_key, --api_key_file or SDM_API_KEY)";
  server_.service().FailNext("GetModelInfo",
                             grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "unknown API key"));
  RunResult r = Run("info", {});
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_EQ(r.err, "sdm-client: UNAUTHENTICATED: unknown API key " + hint + "\n");
  // A streamed call's failure too.
  server_.service().FailNext(
      "Generate", grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                               "missing API key: send the metadata 'authorization: Bearer <key>'"));
  r = Run("generate", {"--prompt", "a"});
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_THAT(r.err, HasSubstr("sdm-client: UNAUTHENTICATED: missing API key: send the metadata "
                               "'authorization: Bearer <key>' " +
                               hint + "\n"));
  // Other codes get no such hint.
  r = Run("sessions get", {"nope"});
  EXPECT_EQ(r.err, "sdm-client: NOT_FOUND: session 'nope' not found\n");
}

// A turn that ran (its tokens streamed) and ended UNAVAILABLE was not saved but is in the
// session (docs/api.md, Errors: not to be sent again): the server's retry hint, which it attaches
// to every UNAVAILABLE, is not printed for it. Before, "retry after 1000 ms" followed the text.
TEST_F(SdmClientTest, ATurnThatRanIsNotOfferedForRetry) {
  server_.service().FailNextAfterTokens(
      grpc::Status(grpc::StatusCode::UNAVAILABLE, "this turn was generated ... not saved"), "1000");
  const RunResult r = Run("generate", {"--prompt", "a", "--max_tokens", "3"});
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_EQ(r.out, "t0 t1 t2 ");
  EXPECT_THAT(r.err, HasSubstr("UNAVAILABLE: this turn was generated"));
  EXPECT_THAT(r.err, Not(HasSubstr("retry after")));
}

// Output that cannot be written (stdout on a full disk) makes the command fail, saying so.
// Before, `sdm-client generate > out.txt` on a full disk exited 0 with a truncated file.
TEST_F(SdmClientTest, AnUnwritableStdoutFailsTheCommand) {
  std::istringstream in;
  std::ostream out(nullptr);  // every write fails (badbit)
  std::ostringstream err;
  ClientIo io;
  io.in = &in;
  io.out = &out;
  io.err = &err;
  io.env = MapEnv({});
  EXPECT_EQ(RunSdmClient({"generate", "--host", server_.address(), "--prompt", "a"}, io),
            kExitFailure);
  EXPECT_THAT(err.str(), HasSubstr("sdm-client: cannot write to standard output"));
}

// sessions delete tries every id, and fails if any failed: a cleanup list is not cut short by
// one id that is gone. Before, it stopped at the first failure.
TEST_F(SdmClientTest, SessionsDeleteTriesEveryId) {
  ASSERT_EQ(Run("sessions create", {"a1"}).exit, kExitOk);
  ASSERT_EQ(Run("sessions create", {"a2"}).exit, kExitOk);
  const RunResult r = Run("sessions delete", {"a1", "nope", "a2"});
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_EQ(r.out, "deleted a1\ndeleted a2\n");
  EXPECT_THAT(r.err, HasSubstr("nope"));
}

// The server's retry hint (grpc-retry-pushback-ms: an overloaded or draining server, a session
// being handed over by another replica) is printed for every command's failed call, not only
// generate's (docs/replicas.md, "Handoff").
TEST_F(SdmClientTest, EveryCommandPrintsTheServersRetryHint) {
  const grpc::Status unavailable(grpc::StatusCode::UNAVAILABLE, "handing over");
  ASSERT_EQ(Run("sessions create", {"s"}).exit, kExitOk);
  const struct {
    std::string method;
    std::string command;
    std::vector<std::string> args;
    std::string in;
  } cases[] = {
      {"Generate", "generate", {"--prompt", "a", "--session", "s"}, ""},
      {"Generate", "chat", {"--session", "s"}, "hi\n"},
      {"GetSession", "chat", {"--session", "s"}, ""},
      {"CreateSession", "chat", {"--session", "t", "--create"}, ""},
      {"GetSession", "sessions get", {"s"}, ""},
      {"ListSessions", "sessions list", {}, ""},
      {"CreateSession", "sessions create", {"u"}, ""},
      {"ForkSession", "sessions fork", {"s", "v"}, ""},
      {"DeleteSession", "sessions delete", {"s"}, ""},
      {"Tokenize", "tokenize", {"a"}, ""},
      {"Detokenize", "detokenize", {"1"}, ""},
      {"GetModelInfo", "info", {}, ""},
  };
  for (const auto& c : cases) {
    server_.service().FailNext(c.method, unavailable, 1, "1500");
    const RunResult r = Run(c.command, c.args, c.in);
    EXPECT_EQ(r.exit, kExitFailure) << c.command;
    EXPECT_THAT(r.err, HasSubstr("sdm-client: UNAVAILABLE: handing over\n"
                                 "sdm-client: retry after 1500 ms\n"))
        << c.command << " (" << c.method << "): " << r.err;
  }
  // Without a hint, none is printed.
  server_.service().FailNext("GetSession", unavailable);
  const RunResult r = Run("sessions get", {"s"});
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_THAT(r.err, Not(HasSubstr("retry after"))) << r.err;
  // The server answered: no question about TLS either.
  EXPECT_EQ(r.err, "sdm-client: UNAVAILABLE: handing over\n");
}

TEST(SdmClientErrorsTest, AnUnreachableServerIsUnavailable) {
  std::string address;
  {
    FakeServer gone;
    address = gone.address();
  }
  const RunResult r = RunClient({"info", "--host", address, "--timeout", "60"});
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_THAT(r.err, HasSubstr("UNAVAILABLE"));
  // Nothing listens there: TLS is not why.
  EXPECT_THAT(r.err, Not(HasSubstr("TLS")));
}

TEST(SdmClientErrorsTest, AnUnreadableCaFileIsAUsageError) {
  const RunResult r =
      RunClient({"info", "--host", "127.0.0.1:1", "--tls_ca", "/nonexistent/ca.pem"});
  EXPECT_EQ(r.exit, kExitUsage);
  EXPECT_THAT(r.err, HasSubstr("/nonexistent/ca.pem"));
}

// A server certificate for 127.0.0.1 made with the openssl command; empty when unavailable.
struct TestCertificate {
  std::string dir;
  std::string cert_pem;
  std::string key_pem;
};
std::optional<TestCertificate> MakeCertificate() {
  TestCertificate c;
  c.dir = ::testing::TempDir() + "/sdm_client_tls";
  const std::string command = "mkdir -p " + c.dir +
                              " && openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj " +
                              "/CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1 -keyout " + c.dir +
                              "/key.pem -out " + c.dir + "/cert.pem >/dev/null 2>&1";
  if (std::system(command.c_str()) != 0) return std::nullopt;
  const auto read = [](const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  c.cert_pem = read(c.dir + "/cert.pem");
  c.key_pem = read(c.dir + "/key.pem");
  if (c.cert_pem.empty() || c.key_pem.empty()) return std::nullopt;
  return c;
}

TEST(SdmClientTlsTest, TlsWithTheServersCaFromAFlagOrTheEnvironment) {
  const std::optional<TestCertificate> cert = MakeCertificate();
  if (!cert.has_value()) GTEST_SKIP() << "the openssl command cannot make a certificate";
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({cert->key_pem, cert->cert_pem});
  FakeServer server(grpc::SslServerCredentials(ssl));
  ASSERT_TRUE(server.ok());
  const std::string ca = cert->dir + "/cert.pem";

  RunResult r = RunClient({"info", "--host", server.address(), "--tls_ca", ca, "--api_key", "k"});
  EXPECT_EQ(r.exit, kExitOk) << r.err;
  EXPECT_THAT(r.out, HasSubstr("(tls)"));
  r = RunClient({"info", "--host", server.address()}, "", {{"SDM_TLS_CA", ca}});
  EXPECT_EQ(r.exit, kExitOk) << r.err;
  // Plaintext against a TLS port fails: --tls=false wins over the environment.
  r = RunClient({"info", "--host", server.address(), "--tls=false", "--timeout", "60"}, "",
                {{"SDM_TLS_CA", ca}});
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_THAT(r.err, HasSubstr("UNAVAILABLE"));
  // Its connection was closed before any response: the user is asked about TLS (it said only
  // "... Socket closed").
  EXPECT_THAT(r.err, HasSubstr("(is the server using TLS? try --tls / --tls_ca)\n"));
  // TLS with the system's roots does not trust a self-signed certificate.
  r = RunClient({"info", "--host", server.address(), "--tls", "--timeout", "60"});
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_THAT(r.err, HasSubstr("UNAVAILABLE"));
  EXPECT_THAT(r.err, Not(HasSubstr("try --tls")));  // it is using TLS
  // Through sdm-client's other calls too: a streamed Generate and chat's first call.
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"generate", "--prompt", "x"}, {"chat", "--session", "s"}}) {
    std::vector<std::string> full = args;
    full.insert(full.end(), {"--host", server.address(), "--timeout", "60"});
    r = RunClient(full, "hi\n");
    EXPECT_EQ(r.exit, kExitFailure);
    EXPECT_THAT(r.err, HasSubstr("(is the server using TLS? try --tls / --tls_ca)\n")) << args[0];
  }
  EXPECT_EQ(server.service().calls("GetModelInfo").size(), 2u);
}

// ---- chat -----------------------------------------------------------------------------------

TEST_F(SdmClientTest, ChatResumesASessionAcrossInvocations) {
  RunResult first = Run("chat", {"--session", "c1", "--create", "--max_tokens", "3"},
                        "hello\n\nworld\n/quit\nnot sent\n");
  ASSERT_EQ(first.exit, kExitOk) << first.err;
  EXPECT_EQ(first.out, "t0 t1 t2 \nt0 t1 t2 \n");
  // hello\n: BOS + 6 bytes, 3 generated -> 10 tokens of history for the second turn.
  EXPECT_THAT(first.err, HasSubstr("[7 prompt tokens + 0 history tokens carried, 3 generated"));
  EXPECT_THAT(first.err, HasSubstr("[6 prompt tokens + 10 history tokens carried, 3 generated"));
  EXPECT_THAT(first.err, HasSubstr("kept at position 19"));

  // Later, another process: no --create, the same id, the history is still there.
  RunResult second = Run("chat", {"--session", "c1", "--max_tokens", "2"}, "again\n");
  ASSERT_EQ(second.exit, kExitOk) << second.err;
  EXPECT_THAT(second.err, HasSubstr("resumed: 19 tokens of history"));
  EXPECT_THAT(second.err, HasSubstr("[6 prompt tokens + 19 history tokens carried, 2 generated"));

  std::vector<std::string> methods;
  for (const auto& call : server_.service().calls()) {
    methods.push_back(call.method + " " + call.session_id);
  }
  EXPECT_THAT(methods, ElementsAre("CreateSession c1", "Generate c1", "Generate c1",
                                   "GetSession c1", "Generate c1"));
  std::vector<std::string> texts;
  for (const auto& q : server_.service().generate_requests()) texts.push_back(q.text());
  EXPECT_THAT(texts, ElementsAre("hello\n", "world\n", "again\n"));
  EXPECT_EQ(server_.service().Position("c1"), 27);
}

TEST_F(SdmClientTest, ChatOnAMissingSessionSuggestsCreate) {
  const RunResult r = Run("chat", {"--session", "nope"}, "hi\n");
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_THAT(r.err, HasSubstr("NOT_FOUND"));
  EXPECT_THAT(r.err, HasSubstr("--create"));
  EXPECT_TRUE(server_.service().calls("Generate").empty());
}

// --create on a session that exists: the server's message suggests another id; the client adds
// how to resume this one, what the user more likely meant.
TEST_F(SdmClientTest, ChatCreateOnAnExistingSessionSuggestsResumingIt) {
  ASSERT_EQ(Run("sessions create", {"c"}).exit, kExitOk);
  const RunResult r = Run("chat", {"--session", "c", "--create"}, "hi\n");
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_THAT(r.err, HasSubstr("ALREADY_EXISTS: session 'c' already exists\n"
                               "(to resume it, drop --create: sdm-client chat --session c)\n"));
  EXPECT_TRUE(server_.service().calls("Generate").empty());
  // Another refusal of --create gets no such line.
  server_.service().FailNext("CreateSession",
                             grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "max_sessions"));
  EXPECT_THAT(Run("chat", {"--session", "d", "--create"}, "hi\n").err, Not(HasSubstr("resume")));
}

TEST_F(SdmClientTest, ChatCreateWithoutAnIdUsesTheServersId) {
  const RunResult r = Run("chat", {"--create", "--max_tokens", "1"}, "x\n");
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  EXPECT_THAT(r.err, HasSubstr("session auto-1 created"));
  EXPECT_EQ(server_.service().generate_requests().at(0).session_id(), "auto-1");
}

TEST_F(SdmClientTest, ChatGoesOnAfterARecoverableErrorButReportsIt) {
  server_.service().FailNext("Generate",
                             grpc::Status(grpc::StatusCode::ABORTED, "already generating"));
  const RunResult r =
      Run("chat", {"--session", "c", "--create", "--max_tokens", "1"}, "one\ntwo\n");
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_THAT(r.err, HasSubstr("ABORTED: already generating"));
  EXPECT_EQ(r.out, "t0 \n");
  EXPECT_EQ(server_.service().calls("Generate").size(), 2u);
  // The last turn succeeded: its position is shown as its usage gave it, without a look-up.
  EXPECT_THAT(r.err, HasSubstr("kept at position"));
  EXPECT_TRUE(server_.service().calls("GetSession").empty());
}

// A last turn that failed may have left tokens in the session (a deadline part-way): the
// position shown at the end is read from the server again, not the one from before the turn.
TEST_F(SdmClientTest, ChatReadsThePositionAgainAfterAFailedLastTurn) {
  server_.service().FailNext("Generate",
                             grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "too slow"));
  const RunResult r = Run("chat", {"--session", "c", "--create", "--max_tokens", "1"}, "one\n");
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_THAT(r.err, HasSubstr("DEADLINE_EXCEEDED: too slow"));
  EXPECT_EQ(server_.service().calls("GetSession").size(), 1u);
  EXPECT_THAT(r.err, HasSubstr("session c kept at position 0"));
}

TEST_F(SdmClientTest, ChatStopsAtAnUnrecoverableError) {
  server_.service().FailNext("Generate", grpc::Status(grpc::StatusCode::DATA_LOSS, "corrupt"));
  const RunResult r = Run("chat", {"--session", "c", "--create"}, "one\ntwo\n");
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_THAT(r.err, HasSubstr("DATA_LOSS: corrupt"));
  EXPECT_EQ(server_.service().calls("Generate").size(), 1u);
}

// An output stream keeping what is written, which runs `hook` at its first write (chat's first
// write to stdout is its first turn's first token).
class HookedOutput : public std::stringbuf {
 public:
  explicit HookedOutput(std::function<void()> hook) : hook_(std::move(hook)) {}

 protected:
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    RunHook();
    return std::stringbuf::xsputn(s, n);
  }
  int_type overflow(int_type c) override {
    RunHook();
    return std::stringbuf::overflow(c);
  }

 private:
  void RunHook() {
    if (hook_) std::exchange(hook_, nullptr)();
  }
  std::function<void()> hook_;
};

// An input stream of `first`, then, once `before_rest` has returned, of `rest`: lines typed
// only after something has happened.
class TwoPartInput : public std::streambuf {
 public:
  TwoPartInput(std::string first, std::function<void()> before_rest, std::string rest)
      : first_(std::move(first)), before_rest_(std::move(before_rest)), rest_(std::move(rest)) {
    setg(first_.data(), first_.data(), first_.data() + first_.size());
  }

 protected:
  int_type underflow() override {
    if (gptr() < egptr()) return traits_type::to_int_type(*gptr());
    if (!before_rest_) return traits_type::eof();
    std::exchange(before_rest_, nullptr)();
    setg(rest_.data(), rest_.data(), rest_.data() + rest_.size());
    return rest_.empty() ? traits_type::eof() : traits_type::to_int_type(*gptr());
  }

 private:
  std::string first_;
  std::function<void()> before_rest_;
  std::string rest_;
};

// Exits with status 5 unless a SIGINT handler is installed: a death test's Ctrl-C must meet the
// chat's router, not SIGINT's default action, which would pass it too.
void ExpectSigintHandled() {
  struct sigaction now = {};
  if (sigaction(SIGINT, nullptr, &now) != 0 || now.sa_handler == SIG_DFL) std::_Exit(5);
}

// `sdm-client chat ARGS` with SIGINT routed as sdm-client's main routes it, reading `in` and
// writing stdout to `out`.
int RunChatWithCtrlC(const std::vector<std::string>& args, std::streambuf* in, std::streambuf* out,
                     std::ostringstream& err) {
  std::istream in_stream(in);
  std::ostream out_stream(out);
  ClientIo io;
  io.in = &in_stream;
  io.out = &out_stream;
  io.err = &err;
  io.env = MapEnv({});
  io.route_sigint = true;
  std::vector<std::string> full = {"chat"};
  full.insert(full.end(), args.begin(), args.end());
  return RunSdmClient(full, io);
}

// The first Ctrl-C while a turn streams cancels that turn's call (the fake streams until then)
// and the chat goes on: the next line is a turn of its own, on the history the cancelled turn
// left in the session. Not a failure: exit 0. Before, the Ctrl-C killed the process.
TEST_F(SdmClientTest, CtrlCCancelsTheTurnAndTheChatGoesOn) {
  ASSERT_EQ(Run("sessions create", {"c"}).exit, kExitOk);
  server_.service().set_chunk_delay(absl::Milliseconds(1));  // paces the stream, asserts nothing
  server_.service().StreamNextUntilCancelled();
  // The second line is read once the server has ended the cancelled call, as a person typing
  // it would be later: the session is free again.
  TwoPartInput in(
      "first\n", [this] { server_.service().AwaitNoGenerateRunning(); }, "second\n");
  HookedOutput out([] { std::raise(SIGINT); });  // Ctrl-C as the first token shows
  std::ostringstream err;
  const int exit = RunChatWithCtrlC(
      {"--host", server_.address(), "--session", "c", "--max_tokens", "2"}, &in, &out, err);
  EXPECT_EQ(exit, kExitOk) << err.str();
  EXPECT_EQ(server_.service().cancelled_generates(), 1);
  EXPECT_THAT(err.str(), HasSubstr("[turn cancelled (Ctrl-C) after "));
  EXPECT_THAT(err.str(), HasSubstr("the session keeps what the turn read of its prompt"));
  EXPECT_THAT(err.str(), Not(HasSubstr("sdm-client: CANCELLED")));
  EXPECT_THAT(out.str(), StartsWith("t0 "));
  EXPECT_THAT(out.str(), EndsWith("\nt0 t1 \n"));  // the second turn, whole

  std::vector<std::string> texts;
  for (const auto& q : server_.service().generate_requests()) texts.push_back(q.text());
  EXPECT_THAT(texts, ElementsAre("first\n", "second\n"));
  // The second turn carried what the first left: its prompt (BOS + 6 bytes) and some tokens.
  const int64_t position = server_.service().Position("c");
  const int64_t carried = position - 7 - 2;  // less the second turn's prompt and tokens
  EXPECT_GT(carried, 7);
  EXPECT_THAT(err.str(), HasSubstr(absl::StrCat("[7 prompt tokens + ", carried,
                                                " history tokens carried, 2 generated")));
  EXPECT_THAT(err.str(), HasSubstr(absl::StrCat("session c kept at position ", position)));

  // The chat put SIGINT's action back as it found it.
  struct sigaction now = {};
  ASSERT_EQ(sigaction(SIGINT, nullptr, &now), 0);
  EXPECT_EQ(now.sa_handler, SIG_DFL);
}

// Ctrl-C at the prompt ends the chat as it did before the router: killed by SIGINT.
TEST(SdmClientChatDeathTest, CtrlCAtThePromptEndsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        FakeServer server;
        // Waits at the prompt as a terminal does, Ctrl-C pressed.
        TwoPartInput in(
            "",
            [] {
              ExpectSigintHandled();
              std::raise(SIGINT);
              for (;;) ::pause();
            },
            "");
        std::stringbuf out;
        std::ostringstream err;
        RunChatWithCtrlC({"--host", server.address(), "--session", "c", "--create"}, &in, &out,
                         err);
        std::_Exit(0);  // not reached
      },
      ::testing::KilledBySignal(SIGINT), "");
}

// A second Ctrl-C in one turn (a server slow to stop it) ends the chat: killed by SIGINT.
TEST(SdmClientChatDeathTest, ASecondCtrlCInOneTurnEndsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        FakeServer server;
        server.service().StreamNextUntilCancelled();
        std::string line = "hi\n";
        TwoPartInput in(
            line, [] {}, "");
        HookedOutput out([] {
          ExpectSigintHandled();
          std::raise(SIGINT);
          std::raise(SIGINT);
          for (;;) ::pause();
        });
        std::ostringstream err;
        RunChatWithCtrlC({"--host", server.address(), "--session", "c", "--create"}, &in, &out,
                         err);
        std::_Exit(0);  // not reached
      },
      ::testing::KilledBySignal(SIGINT), "");
}

// The decision itself: an interrupt cancels a turn in flight once; at the prompt, or again in
// the same turn, it asks for the end of the process.
TEST(TurnInterrupterTest, OneCancellationPerTurn) {
  TurnInterrupter interrupter;
  EXPECT_FALSE(interrupter.Interrupt());  // no turn: at the prompt
  grpc::ClientContext first;
  interrupter.BeginTurn(&first);
  EXPECT_TRUE(interrupter.Interrupt());
  EXPECT_FALSE(interrupter.Interrupt());  // the second in the same turn
  EXPECT_TRUE(interrupter.EndTurn());
  EXPECT_FALSE(interrupter.Interrupt());  // after it
  grpc::ClientContext second;
  interrupter.BeginTurn(&second);
  EXPECT_FALSE(interrupter.EndTurn());  // a turn no interrupt cancelled
  grpc::ClientContext third;
  interrupter.BeginTurn(&third);
  EXPECT_TRUE(interrupter.Interrupt());  // a new turn's first
  EXPECT_TRUE(interrupter.EndTurn());
}

// ---- sessions, tokenize, info ---------------------------------------------------------------

TEST_F(SdmClientTest, SessionsCreateGetForkListDelete) {
  RunResult r = Run("sessions create", {"s1", "--label", "team=nlp", "--ttl", "1h"});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  EXPECT_THAT(r.out, HasSubstr("id: s1"));
  EXPECT_THAT(r.out, HasSubstr("labels: team=nlp"));
  EXPECT_THAT(r.out, HasSubstr("ttl: 3600s"));

  r = Run("sessions fork", {"s1", "s2"});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  EXPECT_TRUE(server_.service().HasSession("s2"));

  r = Run("sessions get", {"s1", "--json"});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["id"], "s1");
  EXPECT_EQ(j["labels"]["team"], "nlp");
  EXPECT_EQ(j["tier"], "TIER_RESIDENT");

  r = Run("sessions list", {});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  EXPECT_THAT(r.out, HasSubstr("ID"));
  EXPECT_THAT(r.out, HasSubstr("s1 "));
  EXPECT_THAT(r.out, HasSubstr("s2 "));

  r = Run("sessions list", {"--label", "team=nlp", "--json"});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  const nlohmann::json list = nlohmann::json::parse(r.out);
  ASSERT_EQ(list["sessions"].size(), 1u);
  EXPECT_EQ(list["sessions"][0]["id"], "s1");

  r = Run("sessions delete", {"s1", "s2"});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  EXPECT_EQ(r.out, "deleted s1\ndeleted s2\n");
  EXPECT_FALSE(server_.service().HasSession("s1"));
  EXPECT_EQ(Run("sessions get", {"s1"}).exit, kExitFailure);
}

TEST_F(SdmClientTest, SessionsListFollowsEveryPage) {
  for (const char* id : {"a", "b", "c", "d", "e"}) {
    ASSERT_EQ(Run("sessions create", {id}).exit, kExitOk);
  }
  const RunResult r = Run("sessions list", {"--page_size", "2", "--json"});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  std::vector<std::string> ids;
  for (const auto& s : j["sessions"]) ids.push_back(s["id"]);
  EXPECT_THAT(ids, ElementsAre("a", "b", "c", "d", "e"));
  EXPECT_EQ(server_.service().calls("ListSessions").size(), 3u);
}

TEST_F(SdmClientTest, TokenizeDetokenizeAndInfo) {
  RunResult r = Run("tokenize", {"hi", "--add_bos"});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  EXPECT_EQ(r.out, "256,104,105\n");
  EXPECT_THAT(r.err, HasSubstr("3 tokens"));

  r = Run("detokenize", {"104,105"});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  EXPECT_EQ(r.out, "hi");
  r = Run("detokenize", {"999"});
  EXPECT_EQ(r.exit, kExitFailure);
  EXPECT_THAT(r.err, HasSubstr("INVALID_ARGUMENT"));

  r = Run("info", {});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  EXPECT_THAT(r.out, HasSubstr("model: fake"));
  EXPECT_THAT(r.out, HasSubstr("max_prompt_tokens: 1024"));
  EXPECT_THAT(r.out, HasSubstr("max_session_tokens: no limit"));  // the fake leaves it 0
  // In the model's order of first use (a 3:1 hybrid); it was by name, "sdm x1, swa x3".
  EXPECT_THAT(r.out, HasSubstr("layers: 4\nlayer types: swa x3, sdm x1\n"));
  r = Run("info", {"--json"});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["max_tokens_limit"], "512");  // int64 as a string
}

// ---- connection options ---------------------------------------------------------------------

TEST_F(SdmClientTest, ApiKeyAndHostComeFromTheEnvironmentUnlessAFlagIsGiven) {
  const std::string fake = server_.address();
  // Everything from the environment.
  RunResult r = RunClient({"info"}, "", {{"SDM_HOST", fake}, {"SDM_API_KEY", "sk-from-env"}});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  // Flags win, host and key alike.
  r = RunClient({"info", "--host", fake, "--api_key", "sk-from-flag"}, "",
                {{"SDM_HOST", "127.0.0.1:1"}, {"SDM_API_KEY", "sk-from-env"}});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  // An empty flag still wins: no key at all.
  r = RunClient({"info", "--host", fake, "--api_key="}, "", {{"SDM_API_KEY", "sk-from-env"}});
  ASSERT_EQ(r.exit, kExitOk) << r.err;

  std::vector<std::string> keys;
  for (const auto& call : server_.service().calls()) keys.push_back(call.authorization);
  EXPECT_THAT(keys, ElementsAre("Bearer sk-from-env", "Bearer sk-from-flag", ""));
}

// A proxy routes by the x-session-id metadata (deploy/nginx/nginx.conf): every call naming a
// session carries it, a fork its source's, calls naming none carry none.
TEST_F(SdmClientTest, CallsNamingASessionCarryItInTheRoutingMetadata) {
  const std::string host = server_.address();
  ASSERT_EQ(RunClient({"sessions", "create", "route-a", "--host", host}).exit, kExitOk);
  ASSERT_EQ(RunClient({"generate", "--host", host, "--session", "route-a", "--prompt", "x",
                       "--max_tokens", "2"})
                .exit,
            kExitOk);
  ASSERT_EQ(RunClient({"sessions", "get", "route-a", "--host", host}).exit, kExitOk);
  ASSERT_EQ(RunClient({"sessions", "fork", "route-a", "route-b", "--host", host}).exit, kExitOk);
  ASSERT_EQ(RunClient({"sessions", "delete", "route-b", "--host", host}).exit, kExitOk);
  ASSERT_EQ(RunClient({"generate", "--host", host, "--prompt", "x", "--max_tokens", "2"}).exit,
            kExitOk);
  ASSERT_EQ(RunClient({"sessions", "list", "--host", host}).exit, kExitOk);

  std::vector<std::string> routed;
  for (const auto& call : server_.service().calls()) {
    routed.push_back(call.method + ":" + call.routing_session);
  }
  EXPECT_THAT(routed, ElementsAre("CreateSession:route-a", "Generate:route-a", "GetSession:route-a",
                                  "ForkSession:route-a", "DeleteSession:route-b",
                                  "Generate:", "ListSessions:"));
  // An id that gRPC metadata cannot carry (it aborted the client: an API misuse) goes without
  // the header; the call itself is made (the server judges the id).
  const size_t before = server_.service().calls().size();
  for (const std::string& id : {std::string("caf\xc3\xa9"), std::string("a\tb")}) {
    const RunResult r = RunClient({"sessions", "get", id, "--host", host});
    EXPECT_TRUE(r.exit == kExitOk || r.exit == kExitFailure) << r.exit << " " << r.err;
  }
  ASSERT_EQ(server_.service().calls().size(), before + 2);
  for (size_t i = before; i < before + 2; ++i) {
    EXPECT_EQ(server_.service().calls()[i].method, "GetSession");
    EXPECT_EQ(server_.service().calls()[i].routing_session, "");
  }
}

TEST_F(SdmClientTest, ConnectionFlagsMayComeBeforeTheCommand) {
  ASSERT_EQ(RunClient({"--host", server_.address(), "sessions", "create", "x"}).exit, kExitOk);
  RunResult r = RunClient(
      {"--host=" + server_.address(), "--api_key", "sk-k", "--notls", "sessions", "list"});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  EXPECT_THAT(r.out, HasSubstr("x "));
  r = RunClient({"--host", server_.address(), "info"});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  EXPECT_EQ(server_.service().calls().at(1).authorization, "Bearer sk-k");

  EXPECT_EQ(RunClient({"--max_tokens", "3", "generate", "--prompt", "a"}).exit, kExitUsage);
  EXPECT_EQ(RunClient({"--host"}).exit, kExitUsage);
  EXPECT_EQ(RunClient({"--host", server_.address()}).exit, kExitUsage);  // no command
}

TEST(ConnectionOptionsTest, DefaultsFlagsAndEnvironment) {
  const auto resolve = [](std::vector<std::string> args, std::map<std::string, std::string> env) {
    FlagSet flags;
    ConnectionFlags values;
    AddConnectionFlags(flags, &values);
    EXPECT_TRUE(flags.Parse(args).ok());
    return ResolveConnectionOptions(flags, values, MapEnv(std::move(env)));
  };
  absl::StatusOr<ConnectionOptions> o = resolve({}, {});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->host, "127.0.0.1:50051");
  EXPECT_EQ(o->api_key, "");
  EXPECT_FALSE(o->tls);
  EXPECT_EQ(o->timeout, absl::InfiniteDuration());

  o = resolve({}, {{"SDM_HOST", "h:1"}, {"SDM_API_KEY", "k"}, {"SDM_TLS_CA", "/ca.pem"}});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->host, "h:1");
  EXPECT_EQ(o->api_key, "k");
  EXPECT_TRUE(o->tls);  // a CA file means TLS
  EXPECT_EQ(o->tls_ca_file, "/ca.pem");

  o = resolve({"--host=f:2", "--api_key", "fk", "--tls_ca", "/f.pem", "--timeout", "1.5"},
              {{"SDM_HOST", "h:1"}, {"SDM_API_KEY", "k"}, {"SDM_TLS_CA", "/ca.pem"}});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->host, "f:2");
  EXPECT_EQ(o->api_key, "fk");
  EXPECT_TRUE(o->tls);
  EXPECT_EQ(o->tls_ca_file, "/f.pem");
  EXPECT_EQ(o->timeout, absl::Milliseconds(1500));

  // --tls=false wins over the environment's CA; SDM_TLS alone turns TLS on (system roots).
  o = resolve({"--tls=false"}, {{"SDM_TLS_CA", "/ca.pem"}});
  ASSERT_TRUE(o.ok());
  EXPECT_FALSE(o->tls);
  EXPECT_EQ(o->tls_ca_file, "");
  o = resolve({}, {{"SDM_TLS", "1"}});
  ASSERT_TRUE(o.ok());
  EXPECT_TRUE(o->tls);
  EXPECT_EQ(o->tls_ca_file, "");
  o = resolve({"--tls"}, {{"SDM_TLS", "0"}});
  ASSERT_TRUE(o.ok());
  EXPECT_TRUE(o->tls);

  // Empty environment variables count as unset.
  o = resolve({}, {{"SDM_HOST", ""}, {"SDM_API_KEY", ""}});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->host, "127.0.0.1:50051");
  EXPECT_EQ(o->api_key, "");

  EXPECT_FALSE(resolve({"--host="}, {}).ok());
  EXPECT_FALSE(resolve({}, {{"SDM_API_KEY", "bad key"}}).ok());
  EXPECT_FALSE(resolve({}, {{"SDM_TLS", "maybe"}}).ok());
  EXPECT_FALSE(resolve({"--timeout=-2"}, {}).ok());
}

// Writes `content` to a file under the test's temporary directory; returns its path.
std::string WriteTempFile(const std::string& name, const std::string& content) {
  const std::string path = ::testing::TempDir() + "/sdm_client_test_" + name;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << content;
  return path;
}

// --api_key_file: the file's content less its trailing line ends is the key. It is a flag, so it
// wins over SDM_API_KEY; it is refused with --api_key, and for an empty or unreadable file, with a
// message naming the path and never the content.
TEST(ConnectionOptionsTest, ApiKeyFile) {
  const auto resolve = [](std::vector<std::string> args, std::map<std::string, std::string> env) {
    FlagSet flags;
    ConnectionFlags values;
    AddConnectionFlags(flags, &values);
    EXPECT_TRUE(flags.Parse(args).ok());
    return ResolveConnectionOptions(flags, values, MapEnv(std::move(env)));
  };
  const std::string lf = WriteTempFile("key_lf", "sk-from-file\n");
  absl::StatusOr<ConnectionOptions> o = resolve({"--api_key_file", lf}, {});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->api_key, "sk-from-file");
  o = resolve({"--api_key_file=" + lf}, {{"SDM_API_KEY", "sk-from-env"}});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->api_key, "sk-from-file");
  o = resolve({"--api_key_file", WriteTempFile("key_crlf", "sk-crlf\r\n")}, {});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->api_key, "sk-crlf");
  o = resolve({"--api_key_file", WriteTempFile("key_bare", "sk-bare")}, {});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->api_key, "sk-bare");

  // Refused, each saying why and naming what to check.
  o = resolve({"--api_key", "sk-flag", "--api_key_file", lf}, {});
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o.status().message(), HasSubstr("--api_key or --api_key_file"));
  for (const std::string& empty : {WriteTempFile("key_empty", ""), WriteTempFile("key_nl", "\n")}) {
    o = resolve({"--api_key_file", empty}, {{"SDM_API_KEY", "sk-from-env"}});
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument) << empty;
    EXPECT_THAT(o.status().message(), HasSubstr("'" + empty + "' (--api_key_file) is empty"));
  }
  o = resolve({"--api_key_file", "/nonexistent/key"}, {});
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      o.status().message(),
      HasSubstr("cannot read the API key file '/nonexistent/key' (--api_key_file): No such"));
  o = resolve({"--api_key_file", ::testing::TempDir()}, {});  // a directory
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o.status().message(), HasSubstr("cannot read the API key file"));
  o = resolve({"--api_key_file="}, {});
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  o = resolve({"--api_key_file", WriteTempFile("key_big", std::string(10000, 'k'))}, {});
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o.status().message(), HasSubstr("not an API key"));
  EXPECT_THAT(o.status().message(), Not(HasSubstr("kkkk")));
  // A key that cannot travel is refused without being quoted.
  o = resolve({"--api_key_file", WriteTempFile("key_space", "sk-two words\n")}, {});
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o.status().message(), HasSubstr("check the file of --api_key_file"));
  EXPECT_THAT(o.status().message(), Not(HasSubstr("words")));
}

// Through the command line: the key from the file reaches the server, with the flag before the
// command or after it; a bad file is a usage error that quotes no key, and no call is made.
TEST_F(SdmClientTest, ApiKeyFileSendsTheFilesKey) {
  const std::string key_file = WriteTempFile("cli_key", "sk-cli-file\n");
  RunResult r = RunClient({"info", "--host", server_.address(), "--api_key_file", key_file}, "",
                          {{"SDM_API_KEY", "sk-from-env"}});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  r = RunClient({"--api_key_file", key_file, "--host", server_.address(), "sessions", "list"});
  ASSERT_EQ(r.exit, kExitOk) << r.err;
  std::vector<std::string> keys;
  for (const auto& call : server_.service().calls()) keys.push_back(call.authorization);
  EXPECT_THAT(keys, ElementsAre("Bearer sk-cli-file", "Bearer sk-cli-file"));

  const std::string secret_file = WriteTempFile("cli_secret", "sk secret-part\n");
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"info", "--api_key_file", WriteTempFile("cli_empty", "")},
           {"info", "--api_key_file", "/nonexistent/key"},
           {"info", "--api_key", "sk-secret-flag", "--api_key_file", key_file},
           {"info", "--api_key_file", secret_file},
       }) {
    std::vector<std::string> full = args;
    full.push_back("--host");
    full.push_back(server_.address());
    r = RunClient(full);
    EXPECT_EQ(r.exit, kExitUsage) << ::testing::PrintToString(args);
    EXPECT_THAT(r.err, HasSubstr("sdm-client info: ")) << r.err;
    EXPECT_THAT(r.err, Not(HasSubstr("secret"))) << r.err;
    EXPECT_THAT(r.err, Not(HasSubstr("sk-cli-file"))) << r.err;
  }
  EXPECT_EQ(server_.service().calls().size(), 2u);
}

TEST(ConnectionOptionsTest, StatusCodeNames) {
  EXPECT_EQ(StatusCodeName(grpc::StatusCode::OK), "OK");
  EXPECT_EQ(StatusCodeName(grpc::StatusCode::RESOURCE_EXHAUSTED), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(StatusCodeName(grpc::StatusCode::UNAUTHENTICATED), "UNAUTHENTICATED");
  EXPECT_EQ(StatusCodeName(static_cast<grpc::StatusCode>(99)), "UNKNOWN");
  EXPECT_EQ(FormatStatus(grpc::Status(grpc::StatusCode::NOT_FOUND, "x")), "NOT_FOUND: x");
  EXPECT_EQ(FormatStatus(grpc::Status(grpc::StatusCode::ABORTED, "")), "ABORTED");
}

// ---- flags ----------------------------------------------------------------------------------

TEST(FlagSetTest, ParsesEveryForm) {
  FlagSet flags;
  std::string s = "default";
  int64_t n = 0;
  double d = 0;
  bool b = true;
  bool c = false;
  std::vector<std::string> list = {"x"};
  flags.AddString("s", &s, "");
  flags.AddInt("n", &n, "");
  flags.AddDouble("d", &d, "");
  flags.AddBool("b", &b, "");
  flags.AddBool("c", &c, "");
  flags.AddStringList("l", &list, "");
  absl::StatusOr<std::vector<std::string>> pos =
      flags.Parse({"p1", "--s", "v", "-n=-3", "--d", "2.5", "--nob", "--c", "--l", "a", "--l=b",
                   "-", "--", "--s", "p3"});
  ASSERT_TRUE(pos.ok()) << pos.status();
  EXPECT_THAT(*pos, ElementsAre("p1", "-", "--s", "p3"));
  EXPECT_EQ(s, "v");
  EXPECT_EQ(n, -3);
  EXPECT_EQ(d, 2.5);
  EXPECT_FALSE(b);
  EXPECT_TRUE(c);
  EXPECT_THAT(list, ElementsAre("a", "b"));  // replaces the default
  EXPECT_TRUE(flags.IsSet("s"));
  EXPECT_TRUE(flags.IsSet("b"));
  EXPECT_THAT(flags.Help(), HasSubstr("--s (string, default \"default\")"));
}

TEST(FlagSetTest, RejectsWhatItCannotParse) {
  const auto parse = [](std::vector<std::string> args) {
    FlagSet flags;
    int64_t n = 0;
    double d = 0;
    bool b = false;
    std::string s;
    flags.AddInt("n", &n, "");
    flags.AddDouble("d", &d, "");
    flags.AddBool("b", &b, "");
    flags.AddString("s", &s, "");
    return flags.Parse(args).status();
  };
  EXPECT_TRUE(parse({"--n", "1"}).ok());
  EXPECT_THAT(parse({"--x"}).message(), HasSubstr("unknown flag --x"));
  EXPECT_THAT(parse({"--s"}).message(), HasSubstr("--s needs a value"));
  EXPECT_THAT(parse({"--n", "1.5"}).message(), HasSubstr("not an integer"));
  EXPECT_THAT(parse({"--d", "nan"}).message(), HasSubstr("not a finite number"));
  EXPECT_THAT(parse({"--b=maybe"}).message(), HasSubstr("expected true or false"));
  EXPECT_THAT(parse({"--nob=true"}).message(), HasSubstr("takes no value"));
  EXPECT_THAT(parse({"--nos"}).message(), HasSubstr("unknown flag"));
  EXPECT_TRUE(WantsHelp({"a", "--help"}));
  EXPECT_FALSE(WantsHelp({"--", "--help"}));
}

}  // namespace
}  // namespace sdm::client
