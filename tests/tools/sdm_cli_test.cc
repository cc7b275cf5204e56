// End-to-end tests of the sdm-cli binary, run as a subprocess on a tiny random model written by
// sdm-model. The greedy test checks the engine's decode path (generate) against its prefill path
// (logits): both must pick the same tokens.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace sdm {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

const std::filesystem::path kCli = SDM_BINARY_DIR "/tools/sdm_cli/sdm-cli";
const std::filesystem::path kSdmModel = SDM_BINARY_DIR "/tools/sdm_model/sdm-model";
constexpr int32_t kBos = 256;
constexpr int32_t kEos = 257;
constexpr int64_t kTinyVocab = 258;  // the tiny preset's vocab_size (byte tokenizer)

struct Result {
  int exit_code = -1;
  std::string out;
  std::string err;
};

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string ShellQuote(const std::string& arg) {
  std::string quoted = "'";
  for (const char c : arg) {
    if (c == '\'') {
      quoted += "'\\''";
    } else {
      quoted += c;
    }
  }
  return quoted + "'";
}

std::filesystem::path ScratchDir() {
  return std::filesystem::path(::testing::TempDir()) / absl::StrCat("sdm_cli_test_", getpid());
}

// Runs `binary args...`, capturing stdout and stderr.
Result RunCommand(const std::filesystem::path& binary, const std::vector<std::string>& args) {
  const std::filesystem::path out = ScratchDir() / "stdout";
  const std::filesystem::path err = ScratchDir() / "stderr";
  std::string command = ShellQuote(binary.string());
  for (const std::string& a : args) absl::StrAppend(&command, " ", ShellQuote(a));
  absl::StrAppend(&command, " > ", ShellQuote(out.string()), " 2> ", ShellQuote(err.string()));
  const int status = std::system(command.c_str());
  Result r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = ReadFile(out);
  r.err = ReadFile(err);
  return r;
}

std::string Ids(const std::vector<int32_t>& ids) { return absl::StrJoin(ids, ","); }

class SdmCliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(kCli) || !std::filesystem::exists(kSdmModel)) return;
    std::filesystem::remove_all(ScratchDir());
    std::filesystem::create_directories(ScratchDir());
    model_dir_ = new std::string((ScratchDir() / "tiny").string());
    const Result r =
        RunCommand(kSdmModel, {"init", "--preset", "tiny", "--seed", "1", "--out", *model_dir_});
    init_ok_ = r.exit_code == 0;
    init_error_ = new std::string(r.err);
  }
  static void TearDownTestSuite() {
    if (model_dir_ != nullptr) std::filesystem::remove_all(ScratchDir());
    delete model_dir_;
    delete init_error_;
    model_dir_ = nullptr;
    init_error_ = nullptr;
  }
  void SetUp() override {
    if (model_dir_ == nullptr) {
      GTEST_SKIP() << "build sdm-cli and sdm-model first (" << kCli << ", " << kSdmModel << ")";
    }
    ASSERT_TRUE(init_ok_) << "sdm-model init failed: " << *init_error_;
  }

  // `logits` output, parsed; fails the test if the command or the JSON is bad.
  static nlohmann::json Logits(const std::vector<int32_t>& tokens, bool all) {
    std::vector<std::string> args = {"logits", "--model", *model_dir_, "--tokens", Ids(tokens)};
    if (all) args.push_back("--all");
    const Result r = RunCommand(kCli, args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    nlohmann::json j = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(j.is_discarded()) << "not JSON: " << r.out.substr(0, 200);
    return j;
  }

  // `generate --json` output, parsed.
  static nlohmann::json Generate(std::vector<std::string> flags) {
    std::vector<std::string> args = {"generate", "--model", *model_dir_, "--json"};
    args.insert(args.end(), flags.begin(), flags.end());
    const Result r = RunCommand(kCli, args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_THAT(r.err, HasSubstr("finish_reason="));
    nlohmann::json j = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(j.is_discarded()) << "not JSON: " << r.out;
    return j;
  }

  static std::string* model_dir_;
  static std::string* init_error_;
  static bool init_ok_;
};
std::string* SdmCliTest::model_dir_ = nullptr;
std::string* SdmCliTest::init_error_ = nullptr;
bool SdmCliTest::init_ok_ = false;

TEST_F(SdmCliTest, LogitsPrintsOneFiniteRowPerPositionAndTheLastRowWithoutAll) {
  const std::vector<int32_t> tokens = {kBos, 'H', 'e', 'l', 'l', 'o'};
  const nlohmann::json all = Logits(tokens, /*all=*/true);
  ASSERT_TRUE(all.is_object());
  EXPECT_EQ(all["tokens"].get<std::vector<int32_t>>(), tokens);
  const auto rows = all["logits"].get<std::vector<std::vector<double>>>();
  ASSERT_EQ(rows.size(), tokens.size());
  for (const auto& row : rows) {
    ASSERT_EQ(row.size(), static_cast<size_t>(kTinyVocab));
    for (const double v : row) ASSERT_TRUE(std::isfinite(v));
  }
  // Each position sees a different prefix: its logits differ.
  EXPECT_NE(rows[0], rows[1]);
  EXPECT_NE(rows[4], rows[5]);

  const nlohmann::json last = Logits(tokens, /*all=*/false);
  const auto last_rows = last["logits"].get<std::vector<std::vector<double>>>();
  ASSERT_EQ(last_rows.size(), 1u);
  ASSERT_EQ(last_rows[0].size(), static_cast<size_t>(kTinyVocab));
  // The output GEMM may run over one row or six: equal up to fp32 reduction order.
  for (int64_t v = 0; v < kTinyVocab; ++v) {
    EXPECT_NEAR(last_rows[0][v], rows.back()[v], 1e-5 * std::max(1.0, std::abs(rows.back()[v])));
  }
  // The prefix's own logits: feeding fewer tokens gives that position's row.
  const auto prefix = Logits({kBos, 'H'}, false)["logits"].get<std::vector<std::vector<double>>>();
  for (int64_t v = 0; v < kTinyVocab; ++v) {
    EXPECT_NEAR(prefix[0][v], rows[1][v], 1e-5 * std::max(1.0, std::abs(rows[1][v])));
  }
}

TEST_F(SdmCliTest, GreedyGenerateIsDeterministicAndMatchesThePrefillArgmax) {
  const std::vector<std::string> flags = {"--prompt", "Hello",         "--max_tokens",
                                          "8",        "--temperature", "0"};
  const nlohmann::json first = Generate(flags);
  const nlohmann::json second = Generate(flags);
  EXPECT_EQ(first, second);

  const auto prompt = first["prompt_tokens"].get<std::vector<int32_t>>();
  EXPECT_EQ(prompt,
            (std::vector<int32_t>{kBos, 'H', 'e', 'l', 'l', 'o'}));  // BOS + the prompt's bytes
  const auto generated = first["tokens"].get<std::vector<int32_t>>();
  ASSERT_FALSE(generated.empty());
  ASSERT_LE(generated.size(), 8u);
  const std::string reason = first["finish_reason"];
  EXPECT_EQ(reason, generated.back() == kEos ? "eos" : "length");
  if (reason == "length") {
    EXPECT_EQ(generated.size(), 8u);
  }

  // Replay with the prefill path: each generated token is the argmax of the logits of
  // everything before it (within fp32 noise between the two paths).
  std::vector<int32_t> sequence = prompt;
  for (const int32_t token : generated) {
    const auto row = Logits(sequence, false)["logits"][0].get<std::vector<double>>();
    ASSERT_EQ(row.size(), static_cast<size_t>(kTinyVocab));
    const double max = *std::max_element(row.begin(), row.end());
    EXPECT_GE(row[token], max - 1e-4 * std::max(1.0, std::abs(max)))
        << "after " << Ids(sequence) << ": generated " << token << " but the argmax is "
        << std::max_element(row.begin(), row.end()) - row.begin();
    sequence.push_back(token);
  }

  // The streamed text is the byte tokenizer's decoding of the generated ids (EOS adds nothing).
  const std::string expected_text = Tokenizer::CreateByteTokenizer()->Decode(generated);
  EXPECT_EQ(first["text"].get<std::string>(), expected_text);
  std::vector<std::string> text_args = {"generate", "--model", *model_dir_};
  text_args.insert(text_args.end(), flags.begin(), flags.end());
  const Result text_mode = RunCommand(kCli, text_args);
  ASSERT_EQ(text_mode.exit_code, 0) << text_mode.err;
  EXPECT_EQ(text_mode.out, expected_text);
  EXPECT_THAT(text_mode.err, HasSubstr("prompt_tokens=6"));
  EXPECT_THAT(text_mode.err, HasSubstr(absl::StrCat("generated_tokens=", generated.size())));
}

TEST_F(SdmCliTest, SamplingIsReproducibleForASeedAndVariesAcrossSeeds) {
  const auto sample = [&](const std::string& seed) {
    return Generate({"--prompt", "Once", "--max_tokens", "24", "--temperature", "1.0", "--seed",
                     seed})["tokens"]
        .get<std::vector<int32_t>>();
  };
  const std::vector<int32_t> a = sample("7");
  EXPECT_EQ(sample("7"), a);
  // A random tiny model's next-token distribution is broad: 24 tokens from two seeds agree
  // with negligible probability.
  EXPECT_NE(sample("8"), a);

  // top_k = 1 samples the argmax: the greedy completion, whatever the seed and temperature.
  const auto greedy =
      Generate({"--prompt", "Once", "--max_tokens", "8"})["tokens"].get<std::vector<int32_t>>();
  const auto top1 = Generate({"--prompt", "Once", "--max_tokens", "8", "--temperature", "3",
                              "--top_k", "1", "--seed", "99"})["tokens"]
                        .get<std::vector<int32_t>>();
  EXPECT_EQ(top1, greedy);
}

TEST_F(SdmCliTest, StopIdEndsTheCompletionWithoutItsText) {
  const auto greedy = Generate({"--prompt", "Hi", "--max_tokens", "4"});
  const auto tokens = greedy["tokens"].get<std::vector<int32_t>>();
  ASSERT_GE(tokens.size(), 1u);
  if (tokens[0] == kEos) GTEST_SKIP() << "the tiny model's greedy first token is EOS";
  const nlohmann::json stopped = Generate(
      {"--prompt", "Hi", "--max_tokens", "4", "--stop_ids", absl::StrCat("3,", tokens[0])});
  EXPECT_EQ(stopped["tokens"].get<std::vector<int32_t>>(), std::vector<int32_t>{tokens[0]});
  EXPECT_EQ(stopped["finish_reason"], "stop");
  EXPECT_EQ(stopped["text"], "");
}

TEST_F(SdmCliTest, StopStringEndsTheTextRightBeforeIt) {
  const std::unique_ptr<Tokenizer> tokenizer = Tokenizer::CreateByteTokenizer();
  const auto greedy = Generate({"--prompt", "Once", "--max_tokens", "16"});
  const auto tokens = greedy["tokens"].get<std::vector<int32_t>>();
  const std::string full = greedy["text"];
  ASSERT_EQ(full, tokenizer->Decode(tokens));
  // The stop string: the first one or two characters after the first that are not U+FFFD (a
  // random model's bytes rarely form characters).
  std::vector<std::string> characters;  // the text is valid UTF-8
  for (size_t i = 0; i < full.size();) {
    size_t end = i + 1;
    while (end < full.size() && (static_cast<unsigned char>(full[end]) & 0xC0) == 0x80) ++end;
    characters.push_back(full.substr(i, end - i));
    i = end;
  }
  const auto is_text = [&](size_t i) {
    return i < characters.size() && characters[i] != "\xEF\xBF\xBD";
  };
  size_t first = 1;
  while (first < characters.size() && !is_text(first)) ++first;
  if (first >= characters.size()) GTEST_SKIP() << "no character but U+FFFD in " << full;
  const std::string stop = characters[first] + (is_text(first + 1) ? characters[first + 1] : "");
  // Expected: the text before the stop string's first occurrence, and the tokens up to the one
  // that completes it.
  size_t completing = 0;
  while (tokenizer->Decode(std::span<const int32_t>(tokens).first(completing)).find(stop) ==
         std::string::npos) {
    ++completing;
  }
  const std::vector<int32_t> expected_tokens(tokens.begin(), tokens.begin() + completing);

  ASSERT_EQ(full.find("NEVER"), std::string::npos);
  const nlohmann::json stopped =
      Generate({"--prompt", "Once", "--max_tokens", "16", "--stop", "NEVER", "--stop", stop});
  EXPECT_EQ(stopped["finish_reason"], "stop");
  EXPECT_EQ(stopped["text"], full.substr(0, full.find(stop)));
  EXPECT_EQ(stopped["tokens"].get<std::vector<int32_t>>(), expected_tokens);
  // Streamed text is the same.
  const Result text_mode = RunCommand(kCli, {"generate", "--model", *model_dir_, "--prompt", "Once",
                                             "--max_tokens", "16", "--stop=" + stop});
  ASSERT_EQ(text_mode.exit_code, 0) << text_mode.err;
  EXPECT_EQ(text_mode.out, full.substr(0, full.find(stop)));
  EXPECT_THAT(text_mode.err, HasSubstr("finish_reason=stop"));

  // A value is one stop string, commas included (Abseil's list parser would split it).
  const std::string with_comma = stop + ",\x01never";
  ASSERT_EQ(full.find(with_comma), std::string::npos);
  const nlohmann::json unsplit =
      Generate({"--prompt", "Once", "--max_tokens", "16", "--stop", with_comma});
  EXPECT_EQ(unsplit["text"], full);
  EXPECT_EQ(unsplit["finish_reason"], greedy["finish_reason"]);

  // An empty stop string is a usage error, as the server's INVALID_ARGUMENT.
  const Result empty =
      RunCommand(kCli, {"generate", "--model", *model_dir_, "--prompt", "Once", "--stop", ""});
  EXPECT_EQ(empty.exit_code, 2);
  EXPECT_THAT(empty.err, HasSubstr("--stop"));
  EXPECT_EQ(empty.out, "");
  EXPECT_THAT(RunCommand(kCli, {"generate", "--help"}).out, HasSubstr("--stop "));
}

TEST_F(SdmCliTest, IgnoreEosGeneratesPastEosUpToMaxTokens) {
  // Accepted by generate (it was defined but not in generate's flags: exit 2, unknown flag).
  const nlohmann::json long_run =
      Generate({"--prompt", "Hi", "--max_tokens", "12", "--ignore_eos"});
  EXPECT_EQ(long_run["tokens"].size(), 12u);
  EXPECT_EQ(long_run["finish_reason"], "length");

  // A seed whose sampled completion ends at EOS goes on past it with --ignore_eos: the same
  // tokens up to and including the EOS (the sampler's draws do not depend on the flag), then
  // more, up to --max_tokens. At temperature 2 the random tiny model samples EOS about once in
  // vocab_size tokens: 10 of these 40 seeds end at EOS within 64 tokens (the first is seed 3).
  const std::vector<std::string> sampling = {"--prompt",      "Hi", "--max_tokens", "64",
                                             "--temperature", "2"};
  for (int seed = 0; seed < 40; ++seed) {
    std::vector<std::string> flags = sampling;
    flags.insert(flags.end(), {"--seed", absl::StrCat(seed)});
    const nlohmann::json ended = Generate(flags);
    if (ended["finish_reason"] != "eos") continue;
    const auto ended_tokens = ended["tokens"].get<std::vector<int32_t>>();
    ASSERT_FALSE(ended_tokens.empty());
    ASSERT_EQ(ended_tokens.back(), kEos);
    ASSERT_LT(ended_tokens.size(), 64u) << "an EOS as the last token proves nothing here";
    flags.push_back("--ignore_eos");
    const nlohmann::json past = Generate(flags);
    const auto past_tokens = past["tokens"].get<std::vector<int32_t>>();
    EXPECT_EQ(past["finish_reason"], "length") << "seed " << seed;
    ASSERT_EQ(past_tokens.size(), 64u) << "seed " << seed;
    EXPECT_EQ(std::vector<int32_t>(past_tokens.begin(), past_tokens.begin() + ended_tokens.size()),
              ended_tokens)
        << "seed " << seed;
    return;
  }
  FAIL() << "no seed in [0, 40) ended at EOS";
}

TEST_F(SdmCliTest, BadInputsExitNonZeroWithAMessage) {
  struct Case {
    std::vector<std::string> args;
    int exit_code;
    std::string message;  // expected in stderr
  };
  const std::string nonexistent = (ScratchDir() / "no_such_model").string();
  const std::vector<Case> cases = {
      {{"generate", "--prompt", "x"}, 2, "--model"},
      {{"logits", "--tokens", "1"}, 2, "--model"},
      {{"logits", "--model", *model_dir_, "--tokens", "1,258"}, 2, "258"},
      {{"logits", "--model", *model_dir_, "--tokens", "-1"}, 2, "-1"},
      {{"logits", "--model", *model_dir_, "--tokens", "1,two"}, 2, "two"},
      {{"logits", "--model", *model_dir_}, 2, "--tokens"},
      {{"logits", "--model", nonexistent, "--tokens", "1"}, 1, nonexistent},
      {{"generate", "--model", nonexistent, "--prompt", "x"}, 1, nonexistent},
      {{"generate", "--model", *model_dir_, "--temperature", "-1"}, 2, "temperature"},
      {{"generate", "--model", *model_dir_, "--top_p", "abc"}, 2, "top_p"},
      {{"generate", "--model", *model_dir_, "--stop_ids", "999"}, 2, "999"},
      {{"generate", "--model", *model_dir_, "--bogus", "1"}, 2, "bogus"},
      {{"frobnicate"}, 2, "frobnicate"},
      {{}, 2, "usage"},
  };
  for (const Case& c : cases) {
    const Result r = RunCommand(kCli, c.args);
    EXPECT_EQ(r.exit_code, c.exit_code) << absl::StrJoin(c.args, " ") << "\n" << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message)) << absl::StrJoin(c.args, " ");
    EXPECT_EQ(r.out, "") << absl::StrJoin(c.args, " ");
  }
}

TEST_F(SdmCliTest, HelpDocumentsEveryFlag) {
  const Result generate = RunCommand(kCli, {"generate", "--help"});
  EXPECT_EQ(generate.exit_code, 0);
  for (const char* flag :
       {"--model", "--prompt", "--max_tokens", "--temperature", "--top_k", "--top_p", "--seed",
        "--stop_ids", "--ignore_eos", "--no_bos", "--json", "--threads"}) {
    EXPECT_THAT(generate.out, HasSubstr(flag));
  }
  const Result logits = RunCommand(kCli, {"logits", "--help"});
  EXPECT_EQ(logits.exit_code, 0);
  for (const char* flag : {"--model", "--tokens", "--all", "--threads"}) {
    EXPECT_THAT(logits.out, HasSubstr(flag));
  }
  EXPECT_THAT(logits.out, Not(HasSubstr("--temperature")));
}

}  // namespace
}  // namespace sdm
