// SentencePiece and libprotobuf 3.21 in one process. Debian 12's libsentencepiece bundles and
// exports protobuf 3.14; linked into a binary that also loads libprotobuf (as this one does:
// tests/CMakeLists.txt links server tests with it) the process died at start-up. The engine now
// reaches SentencePiece only through libsdm_sentencepiece_shim.so, opened with
// dlopen(RTLD_LOCAL | RTLD_DEEPBIND) (engine/sentencepiece_shim/sentencepiece_shim.h).
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "engine/model_config.h"
#include "engine/tokenizer.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "sdm/v1/sdm.pb.h"

namespace sdm {
namespace {

using ::testing::HasSubstr;

constexpr char kShimEnvVar[] = "SDM_SENTENCEPIECE_SHIM";

// Sets (or, with nullopt, unsets) an environment variable for the scope; restores it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      setenv(name, value->c_str(), /*overwrite=*/1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), /*overwrite=*/1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

ModelConfig SpConfig() {
  ModelConfig config;
  config.vocab_size = 1000;
  config.tokenizer.name = "sp";
  config.tokenizer.path = "tokenizer.model";
  return config;
}

// A fresh directory with a small BPE model with byte fallback, tokenizer.model, trained by
// spm_train; nullopt if spm_train is not installed.
std::optional<std::filesystem::path> TrainModel() {
  if (std::system("command -v spm_train > /dev/null 2>&1") != 0) return std::nullopt;
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / absl::StrCat("sp_with_protobuf_", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::vector<std::string> words = {"hello", "world",  "session",    "state",
                                          "delta", "memory", "caf\xC3\xA9"};
  std::mt19937 rng(7);
  std::ofstream text(dir / "train.txt");
  for (int line = 0; line < 200; ++line) {
    for (int w = 0; w < 8; ++w) {
      text << (w ? " " : "")
           << words[std::uniform_int_distribution<size_t>(0, words.size() - 1)(rng)];
    }
    text << "\n";
  }
  text.close();
  const std::string command = absl::StrCat(
      "spm_train --input=", (dir / "train.txt").string(),
      " --model_prefix=", (dir / "tokenizer").string(),
      " --vocab_size=300 --model_type=bpe --byte_fallback=true --hard_vocab_limit=false"
      " --minloglevel=2 > ",
      (dir / "spm_train.log").string(), " 2>&1");
  if (std::system(command.c_str()) != 0) {
    ADD_FAILURE() << "spm_train failed; see " << dir / "spm_train.log";
    return std::nullopt;
  }
  return dir;
}

class SentencePieceWithProtobufTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::optional<std::filesystem::path> dir = TrainModel();
    if (dir) dir_ = std::make_unique<std::filesystem::path>(*std::move(dir));
  }
  static void TearDownTestSuite() {
    if (dir_ != nullptr) std::filesystem::remove_all(*dir_);
    dir_.reset();
  }
  void SetUp() override {
    if (dir_ == nullptr) GTEST_SKIP() << "spm_train is not installed (Debian: sentencepiece)";
  }

  static std::unique_ptr<std::filesystem::path> dir_;
};
std::unique_ptr<std::filesystem::path> SentencePieceWithProtobufTest::dir_;

TEST_F(SentencePieceWithProtobufTest, TokenizerAndProtobufMessagesRoundTrip) {
  // libprotobuf is live: a generated message and its descriptor.
  v1::GenerateRequest request;
  request.set_session_id("s1");
  request.set_text("hello world caf\xC3\xA9 \xCF\x89 state delta");
  ASSERT_NE(google::protobuf::DescriptorPool::generated_pool()->FindMessageTypeByName(
                "sdm.v1.GenerateRequest"),
            nullptr);

  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Create(SpConfig(), *dir_);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->name(), "sp");
  EXPECT_EQ((*tok)->bos_id(), 1);
  EXPECT_EQ((*tok)->eos_id(), 2);

  // Encode the request's text into a TokenIds message, send it through the wire format, decode.
  const std::vector<int32_t> ids = (*tok)->Encode(request.text(), /*add_bos=*/true);
  ASSERT_GT(ids.size(), 1u);
  EXPECT_EQ(ids[0], (*tok)->bos_id());
  v1::TokenIds message;
  for (const int32_t id : ids) message.add_ids(id);
  std::string wire;
  ASSERT_TRUE(message.SerializeToString(&wire));
  v1::TokenIds parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire));
  const std::vector<int32_t> parsed_ids(parsed.ids().begin(), parsed.ids().end());
  EXPECT_EQ(parsed_ids, ids);
  EXPECT_EQ((*tok)->Decode(parsed_ids), request.text());

  // Protobuf still works after the shim's protobuf copy was loaded and used.
  v1::GenerateResponse response;
  response.set_text((*tok)->Decode(parsed_ids));
  response.mutable_token_ids()->Add(parsed_ids.begin(), parsed_ids.end());
  v1::GenerateResponse response_copy;
  ASSERT_TRUE(response_copy.ParseFromString(response.SerializeAsString()));
  EXPECT_EQ(response_copy.text(), request.text());
}

TEST_F(SentencePieceWithProtobufTest, TokenizersCanBeCreatedAndDestroyedRepeatedly) {
  // Each tokenizer opens and closes the shim; the loader keeps one copy mapped.
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Create(SpConfig(), *dir_);
    ASSERT_TRUE(tok.ok()) << tok.status();
    EXPECT_EQ((*tok)->Decode((*tok)->Encode("memory session", false)), "memory session");
  }
}

TEST_F(SentencePieceWithProtobufTest, MissingShimIsFailedPreconditionNamingThePath) {
  const std::string missing = (*dir_ / "no_such_dir" / "libsdm_sentencepiece_shim.so").string();
  ScopedEnv env(kShimEnvVar, missing);
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Create(SpConfig(), *dir_);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(tok.status().message(), HasSubstr(missing));
  EXPECT_THAT(tok.status().message(), HasSubstr(kShimEnvVar));
  EXPECT_THAT(tok.status().message(), HasSubstr((*dir_ / "tokenizer.model").string()));

  // The byte tokenizer never needs the shim.
  ModelConfig bytes;
  bytes.vocab_size = 258;
  absl::StatusOr<std::unique_ptr<Tokenizer>> byte_tok = Tokenizer::Create(bytes, *dir_);
  ASSERT_TRUE(byte_tok.ok()) << byte_tok.status();
  EXPECT_EQ((*byte_tok)->Decode((*byte_tok)->Encode("hi", false)), "hi");
}

TEST_F(SentencePieceWithProtobufTest, LibraryWithoutTheShimSymbolsIsFailedPrecondition) {
  // libm loads but exports none of the shim's functions.
  ScopedEnv env(kShimEnvVar, "libm.so.6");
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Create(SpConfig(), *dir_);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(tok.status().message(), HasSubstr("missing symbol sdm_sp_v1_load"));
}

TEST_F(SentencePieceWithProtobufTest, EmptyOverrideUsesTheDefaultSearch) {
  ScopedEnv env(kShimEnvVar, "");
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Create(SpConfig(), *dir_);
  ASSERT_TRUE(tok.ok()) << tok.status();
}

}  // namespace
}  // namespace sdm
