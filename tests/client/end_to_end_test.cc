// The built binaries together: sdm-model makes a tiny model, sdm-server serves it on a free
// port, and sdm-client and sdm-bench-serve talk to it as a user would. Skipped when a binary has
// not been built (the test target does not depend on the server's).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace sdm::client {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const fs::path kSdmModel = SDM_BINARY_DIR "/tools/sdm_model/sdm-model";
const fs::path kServer = SDM_BINARY_DIR "/server/sdm-server";
const fs::path kClient = SDM_BINARY_DIR "/client/sdm-client";
const fs::path kBench = SDM_BINARY_DIR "/tools/sdm_bench/sdm-bench-serve";

struct Result {
  int exit = -1;
  std::string output;  // stdout and stderr
};

// Runs a shell command line, capturing its output.
Result Shell(const std::string& command) {
  Result r;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) r.output.append(buffer, n);
  const int status = ::pclose(pipe);
  r.exit = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

class EndToEndTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const fs::path& p : {kSdmModel, kServer, kClient, kBench}) {
      if (!fs::exists(p)) GTEST_SKIP() << p << " is not built";
    }
    dir_ = fs::path(::testing::TempDir()) / absl::StrCat("sdm_client_e2e_", ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    const Result model = Shell(absl::StrCat(
        kSdmModel.string(), " init --preset tiny --seed 0 --out ", (dir_ / "model").string()));
    ASSERT_EQ(model.exit, 0) << model.output;

    // The server prints "listening on HOST:PORT" on stdout once it accepts calls.
    int out[2];
    ASSERT_EQ(::pipe(out), 0);
    server_pid_ = ::fork();
    ASSERT_GE(server_pid_, 0);
    if (server_pid_ == 0) {
      ::dup2(out[1], STDOUT_FILENO);
      ::close(out[0]);
      ::close(out[1]);
      const std::string model_dir = (dir_ / "model").string();
      const std::string state_dir = (dir_ / "state").string();
      ::execl(kServer.c_str(), kServer.c_str(), "--model", model_dir.c_str(), "--port", "0",
              "--metrics_port", "0", "--state_dir", state_dir.c_str(), "--threads", "1",
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(out[1]);
    FILE* stream = ::fdopen(out[0], "r");
    char line[512];
    std::string first;
    if (std::fgets(line, sizeof(line), stream) != nullptr) first = line;
    std::fclose(stream);
    ASSERT_TRUE(absl::StartsWith(first, "listening on ")) << "sdm-server printed: " << first;
    // "listening on HOST:PORT (metrics: URL)\n"
    const std::vector<std::string> words = absl::StrSplit(first, absl::ByAnyChar(" \n"));
    ASSERT_GE(words.size(), 3u);
    host_ = words[2];
  }

  void TearDown() override {
    if (server_pid_ > 0) {
      ::kill(server_pid_, SIGTERM);
      int status = 0;
      ::waitpid(server_pid_, &status, 0);
    }
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  Result Client(const std::string& args, const std::string& stdin_text = "") {
    std::string command = absl::StrCat(kClient.string(), " --host ", host_, " ", args);
    if (!stdin_text.empty()) {
      const fs::path input = dir_ / "stdin.txt";
      std::ofstream(input) << stdin_text;
      absl::StrAppend(&command, " < ", input.string());
    }
    return Shell(command);
  }

  fs::path dir_;
  pid_t server_pid_ = -1;
  std::string host_;
};

TEST_F(EndToEndTest, ClientAndLoadGeneratorAgainstTheRealServer) {
  Result r = Client("info");
  ASSERT_EQ(r.exit, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("model: model"));
  EXPECT_THAT(r.output, HasSubstr("tokenizer: bytes"));

  r = Client("generate --prompt 'Hello' --max_tokens 5 --json");
  ASSERT_EQ(r.exit, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output.substr(0, r.output.find('\n')));
  EXPECT_EQ(j["usage"]["prompt_tokens"], 6);  // BOS + 5 bytes
  EXPECT_LE(j["usage"]["generated_tokens"].get<int>(), 5);
  EXPECT_GE(j["usage"]["generated_tokens"].get<int>(), 1);

  // Log-probabilities: one entry per token id, the greedy token the most probable.
  r = Client("generate --prompt 'Hello' --max_tokens 5 --json --logprobs 2");
  ASSERT_EQ(r.exit, 0) << r.output;
  const nlohmann::json lp = nlohmann::json::parse(r.output.substr(0, r.output.find('\n')));
  ASSERT_EQ(lp["logprobs"].size(), lp["token_ids"].size()) << r.output;
  for (size_t i = 0; i < lp["token_ids"].size(); ++i) {
    ASSERT_EQ(lp["logprobs"][i]["top"].size(), 2u) << r.output;
    EXPECT_EQ(lp["logprobs"][i]["top"][0]["token_id"], lp["token_ids"][i]);
    EXPECT_EQ(lp["logprobs"][i]["top"][0]["logprob"], lp["logprobs"][i]["logprob"]);
    EXPECT_LE(lp["logprobs"][i]["logprob"].get<double>(), 0.0);
  }
  EXPECT_EQ(lp["token_ids"], j["token_ids"]);  // asking for them changes nothing
  // The prompt's tokens (BOS, then a byte per character) scored, the first with nothing before
  // it.
  r = Client("generate --prompt 'Hello' --max_tokens 1 --json --prompt_logprobs 1");
  ASSERT_EQ(r.exit, 0) << r.output;
  const nlohmann::json scored = nlohmann::json::parse(r.output.substr(0, r.output.find('\n')));
  ASSERT_EQ(scored["prompt_logprobs"].size(), 6u) << r.output;
  EXPECT_TRUE(scored["prompt_logprobs"][0]["logprob"].is_null()) << r.output;
  for (size_t i = 1; i < 6; ++i) {
    EXPECT_EQ(scored["prompt_logprobs"][i]["token_id"], static_cast<int>("Hello"[i - 1]));
    EXPECT_LE(scored["prompt_logprobs"][i]["logprob"].get<double>(), 0.0) << r.output;
    EXPECT_EQ(scored["prompt_logprobs"][i]["top"].size(), 1u) << r.output;
  }
  r = Client("generate --prompt 'Hello' --prompt_logprobs 2");
  EXPECT_NE(r.exit, 0);
  EXPECT_THAT(r.output, HasSubstr("--prompt_logprobs needs --json"));
  r = Client("generate --prompt 'Hello' --logprobs 2");
  EXPECT_EQ(r.exit, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--logprobs needs --json"));

  r = Client("tokenize hi");
  ASSERT_EQ(r.exit, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("104,105"));

  // A conversation left and resumed by a second process.
  r = Client("chat --session talk --create --max_tokens 4", "one\n/quit\n");
  ASSERT_EQ(r.exit, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("[5 prompt tokens + 0 history tokens carried"));
  r = Client("sessions get talk --json");
  ASSERT_EQ(r.exit, 0) << r.output;
  const int64_t position =
      std::stoll(nlohmann::json::parse(r.output)["position"].get<std::string>());
  EXPECT_GE(position, 6);
  r = Client("chat --session talk --max_tokens 4", "two\n");
  ASSERT_EQ(r.exit, 0) << r.output;
  EXPECT_THAT(r.output,
              HasSubstr(absl::StrCat("[4 prompt tokens + ", position, " history tokens carried")));

  r = Client("generate --prompt x --max_tokens -1");
  EXPECT_EQ(r.exit, 1);
  EXPECT_THAT(r.output, HasSubstr("INVALID_ARGUMENT"));
  // --logit_bias: +100 on 'A' (the byte tokenizer's 65) forces it; a malformed pair is a usage
  // error.
  r = Client("generate --prompt x --max_tokens 3 --logit_bias 65:100");
  ASSERT_EQ(r.exit, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("AAA"));
  r = Client("generate --prompt x --logit_bias 65");
  EXPECT_NE(r.exit, 0);
  EXPECT_THAT(r.output, HasSubstr("--logit_bias: '65' is not ID:BIAS"));
  // max_tokens 0 reads the prompt only.
  r = Client("generate --prompt x --max_tokens 0");
  EXPECT_EQ(r.exit, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("finish_reason=length prompt_tokens=2 history_tokens=0 "
                                  "generated_tokens=0"));
  r = Client("sessions delete talk");
  EXPECT_EQ(r.exit, 0) << r.output;
  r = Client("sessions get talk");
  EXPECT_EQ(r.exit, 1);
  EXPECT_THAT(r.output, HasSubstr("NOT_FOUND"));

  const fs::path json = dir_ / "bench.json";
  r = Shell(absl::StrCat(kBench.string(), " serve --host ", host_,
                         " --concurrency 3 --requests 9 --prompt_tokens uniform:4:12 "
                         "--max_tokens 4 --session_reuse 0.5 --sessions 2 --json ",
                         json.string()));
  ASSERT_EQ(r.exit, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("TTFT"));
  std::ifstream in(json);
  const nlohmann::json bench = nlohmann::json::parse(in);
  EXPECT_EQ(bench["requests"]["ok"], 9);
  EXPECT_TRUE(bench["ttft_ms"]["p50"].is_number());
  // The bench deleted its sessions.
  r = Client("sessions list --json");
  ASSERT_EQ(r.exit, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output)["sessions"].size(), 0u);
}

}  // namespace
}  // namespace sdm::client
