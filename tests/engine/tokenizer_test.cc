#include "engine/tokenizer.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace sdm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr char kFffd[] = "\xEF\xBF\xBD";  // U+FFFD

std::vector<int32_t> BytesOf(const std::string& s) {
  std::vector<int32_t> ids;
  for (const char c : s) ids.push_back(static_cast<uint8_t>(c));
  return ids;
}

bool IsValidUtf8(const std::string& s) { return SanitizeUtf8(s, /*final=*/true, nullptr) == s; }

ModelConfig BytesConfig(int64_t vocab_size) {
  ModelConfig config;
  config.vocab_size = vocab_size;
  config.tokenizer.name = "bytes";
  return config;
}

// Feeds `ids` one at a time; returns the deltas, Flush() last.
std::vector<std::string> Stream(const Tokenizer& tokenizer, const std::vector<int32_t>& ids) {
  IncrementalDetokenizer detok(tokenizer);
  std::vector<std::string> deltas;
  for (const int32_t id : ids) deltas.push_back(detok.Add(id));
  deltas.push_back(detok.Flush());
  return deltas;
}

std::string Concat(const std::vector<std::string>& parts) {
  std::string all;
  for (const std::string& p : parts) all += p;
  return all;
}

// ---------------------------------------------------------------------------------------------
// Byte tokenizer

TEST(ByteTokenizerTest, SpecialIdsAndVocabularyMatchTheReference) {
  auto tok = Tokenizer::CreateByteTokenizer();
  EXPECT_EQ(tok->name(), "bytes");
  EXPECT_EQ(tok->bos_id(), 256);
  EXPECT_EQ(tok->eos_id(), 257);
  EXPECT_EQ(tok->vocab_size(), 258);
  EXPECT_TRUE(tok->IsValid(0));
  EXPECT_TRUE(tok->IsValid(257));
  EXPECT_FALSE(tok->IsValid(258));
  EXPECT_FALSE(tok->IsValid(-1));
}

TEST(ByteTokenizerTest, EncodesUtf8BytesWithOptionalBos) {
  auto tok = Tokenizer::CreateByteTokenizer();
  // "é" is C3 A9.
  EXPECT_THAT(tok->Encode("h\xC3\xA9", /*add_bos=*/true), ElementsAre(256, 'h', 0xC3, 0xA9));
  EXPECT_THAT(tok->Encode("h\xC3\xA9", /*add_bos=*/false), ElementsAre('h', 0xC3, 0xA9));
  EXPECT_TRUE(tok->Encode("", false).empty());
  EXPECT_THAT(tok->Encode("", true), ElementsAre(256));
}

TEST(ByteTokenizerTest, RoundTripsMultiByteText) {
  auto tok = Tokenizer::CreateByteTokenizer();
  // 1-, 2-, 3- and 4-byte characters, and a NUL byte.
  const std::string text = std::string("a\xC3\xA9\xE6\x97\xA5\xF0\x9F\x98\x80 z") + '\0' + "!";
  const std::vector<int32_t> ids = tok->Encode(text, /*add_bos=*/true);
  EXPECT_EQ(ids.size(), text.size() + 1);
  EXPECT_EQ(tok->Decode(ids), text);
}

TEST(ByteTokenizerTest, DecodeSkipsSpecialAndOutOfRangeIds) {
  auto tok = Tokenizer::CreateByteTokenizer();
  EXPECT_EQ(tok->Decode(std::vector<int32_t>{256, 'h', 257, 'i', 258, 100000, -1, '!'}), "hi!");
}

TEST(ByteTokenizerTest, TokenBytesAreTheIdsByteEvenMidCharacter) {
  auto tok = Tokenizer::CreateByteTokenizer();
  EXPECT_EQ(tok->TokenBytes('h'), "h");
  EXPECT_EQ(tok->TokenBytes(0xC3), "\xC3");  // the first byte of a two-byte character, as is
  EXPECT_EQ(tok->TokenBytes(0), std::string(1, '\0'));
  for (const int32_t none : {tok->bos_id(), tok->eos_id(), -1, 258}) {
    EXPECT_EQ(tok->TokenBytes(none), "") << none;
  }
}

TEST(ByteTokenizerTest, DecodeReplacesEachMaximalIllFormedSubsequence) {
  auto tok = Tokenizer::CreateByteTokenizer();
  const auto decode = [&](const std::string& bytes) { return tok->Decode(BytesOf(bytes)); };
  // Expected values are what Python's bytes.decode("utf-8", "replace") returns.
  EXPECT_EQ(decode("\xFF"), kFffd);
  EXPECT_EQ(decode("\xC3"), kFffd);      // truncated at the end
  EXPECT_EQ(decode("\xE2\x82"), kFffd);  // one subpart, one U+FFFD
  EXPECT_EQ(decode("\xF0\x9F\x98"
                   "A"),
            absl::StrCat(kFffd, "A"));  // broken by 'A'
  EXPECT_EQ(decode("\xE0\x80"
                   "A"),
            absl::StrCat(kFffd, kFffd, "A"));                            // overlong: E0 80 bad
  EXPECT_EQ(decode("\xED\xA0\x80"), absl::StrCat(kFffd, kFffd, kFffd));  // surrogate
  EXPECT_EQ(decode("\xF4\x90\x80\x80"), absl::StrCat(kFffd, kFffd, kFffd, kFffd));  // > U+10FFFF
  EXPECT_EQ(decode("\xC0\xAF"), absl::StrCat(kFffd, kFffd));  // overlong 2-byte lead
  EXPECT_EQ(decode("x\xC3\xA9\x80y"), absl::StrCat("x\xC3\xA9", kFffd, "y"));
}

TEST(SanitizeUtf8Test, KeepsAnIncompleteTailWhenNotFinal) {
  std::string tail = "stale";
  EXPECT_EQ(SanitizeUtf8("ab\xE6\x97", /*final=*/false, &tail), "ab");
  EXPECT_EQ(tail, "\xE6\x97");
  EXPECT_EQ(SanitizeUtf8("ab\xE6\x97\xA5", /*final=*/false, &tail), "ab\xE6\x97\xA5");
  EXPECT_EQ(tail, "");
  // An ill-formed tail is not incomplete: it is replaced at once.
  EXPECT_EQ(SanitizeUtf8("ab\xE0\x80", /*final=*/false, &tail), absl::StrCat("ab", kFffd, kFffd));
  EXPECT_EQ(tail, "");
}

TEST(ByteTokenizerTest, CreateChecksNameAndModelVocabulary) {
  EXPECT_TRUE(Tokenizer::Create(BytesConfig(258), "").ok());
  EXPECT_TRUE(Tokenizer::Create(BytesConfig(512), "").ok());  // padded model vocabulary

  absl::StatusOr<std::unique_ptr<Tokenizer>> small = Tokenizer::Create(BytesConfig(257), "");
  ASSERT_FALSE(small.ok());
  EXPECT_EQ(small.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(small.status().message(), HasSubstr("vocab_size 257"));
  EXPECT_THAT(small.status().message(), HasSubstr("258"));

  ModelConfig unknown = BytesConfig(258);
  unknown.tokenizer.name = "tiktoken";
  absl::StatusOr<std::unique_ptr<Tokenizer>> bad = Tokenizer::Create(unknown, "");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("tiktoken"));
}

// ---------------------------------------------------------------------------------------------
// Incremental detokenizer, byte tokenizer

TEST(IncrementalDetokenizerTest, HoldsBackASplitMultiByteCharacter) {
  auto tok = Tokenizer::CreateByteTokenizer();
  IncrementalDetokenizer detok(*tok);
  EXPECT_EQ(detok.Add('a'), "a");
  EXPECT_EQ(detok.Add(0xC3), "");
  EXPECT_EQ(detok.Add(0xA9), "\xC3\xA9");
  EXPECT_EQ(detok.Add(0xF0), "");
  EXPECT_EQ(detok.Add(0x9F), "");
  EXPECT_EQ(detok.Add(0x98), "");
  EXPECT_EQ(detok.Add(0x80), "\xF0\x9F\x98\x80");
  EXPECT_EQ(detok.Flush(), "");
}

TEST(IncrementalDetokenizerTest, SpecialIdsProduceNoTextAndDoNotBreakACharacter) {
  auto tok = Tokenizer::CreateByteTokenizer();
  IncrementalDetokenizer detok(*tok);
  EXPECT_EQ(detok.Add(256), "");
  EXPECT_EQ(detok.Add(0xE6), "");
  EXPECT_EQ(detok.Add(0x97), "");
  EXPECT_EQ(detok.Add(257), "");  // skipped, as Decode() skips it
  EXPECT_EQ(detok.Add(0xA5), "\xE6\x97\xA5");
}

TEST(IncrementalDetokenizerTest, EmitsInvalidBytesAsSoonAsTheyAreCertain) {
  auto tok = Tokenizer::CreateByteTokenizer();
  IncrementalDetokenizer detok(*tok);
  EXPECT_EQ(detok.Add(0xFF), kFffd);  // never valid: no wait
  EXPECT_EQ(detok.Add(0xC3), "");     // could still become a character
  EXPECT_EQ(detok.Add('A'), absl::StrCat(kFffd, "A"));
  EXPECT_EQ(detok.Add(0xE0), "");
  EXPECT_EQ(detok.Add(0x80), absl::StrCat(kFffd, kFffd));  // E0 80 is never valid
  EXPECT_EQ(detok.Add(0xE2), "");
  EXPECT_EQ(detok.Add(0x82), "");
  EXPECT_EQ(detok.Flush(), kFffd);  // cut short by the end of the stream
  // Flush() starts a new stream.
  EXPECT_EQ(detok.Add('z'), "z");
}

TEST(IncrementalDetokenizerTest, RandomStreamsConcatenateToDecode) {
  auto tok = Tokenizer::CreateByteTokenizer();
  std::mt19937 rng(7);
  // Valid characters of every length, stray continuation/lead bytes, and special ids.
  const std::vector<std::vector<int32_t>> atoms = {
      {'a'},  {0xC3, 0xA9}, {0xE6, 0x97, 0xA5}, {0xF0, 0x9F, 0x98, 0x80},
      {0x80}, {0xC3},       {0xF0, 0x9F},       {0xFF},
      {256},  {257},        {0xED, 0xA0}};
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int32_t> ids;
    const int n = std::uniform_int_distribution<int>(0, 30)(rng);
    for (int i = 0; i < n; ++i) {
      const auto& atom = atoms[std::uniform_int_distribution<size_t>(0, atoms.size() - 1)(rng)];
      ids.insert(ids.end(), atom.begin(), atom.end());
    }
    const std::vector<std::string> deltas = Stream(*tok, ids);
    for (const std::string& d : deltas) EXPECT_TRUE(IsValidUtf8(d));
    EXPECT_EQ(Concat(deltas), tok->Decode(ids)) << "trial " << trial;
  }
}

// ---------------------------------------------------------------------------------------------
// SentencePiece

bool HaveSpmTrain() { return std::system("command -v spm_train > /dev/null 2>&1") == 0; }

// A fresh empty directory under the test's temporary directory, private to this process (ctest
// runs the tests of this file in parallel processes).
std::filesystem::path FreshDir(const std::string& name) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / absl::StrCat(name, "_", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Trains a small BPE model with byte fallback into `dir`/tokenizer.model. Training text: words
// drawn with a fixed seed, a few with multi-byte characters.
void TrainSentencePiece(const std::filesystem::path& dir) {
  const std::vector<std::string> words = {
      "hello",  "world", "the",    "quick",       "brown",
      "fox",    "jumps", "over",   "lazy",        "dog",
      "sparse", "delta", "memory", "caf\xC3\xA9", "\xE6\x97\xA5\xE6\x9C\xAC"};
  std::mt19937 rng(1);
  std::ofstream text(dir / "train.txt");
  for (int line = 0; line < 300; ++line) {
    for (int w = 0; w < 10; ++w) {
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
  ASSERT_EQ(std::system(command.c_str()), 0) << "spm_train failed; see " << dir / "spm_train.log";
}

ModelConfig SpConfig(int64_t vocab_size) {
  ModelConfig config;
  config.vocab_size = vocab_size;
  config.tokenizer.name = "sp";
  config.tokenizer.path = "tokenizer.model";
  return config;
}

class SentencePieceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!HaveSpmTrain()) return;
    dir_ = new std::filesystem::path(FreshDir("sp_tokenizer_test"));
    TrainSentencePiece(*dir_);
  }
  static void TearDownTestSuite() {
    if (dir_ != nullptr) std::filesystem::remove_all(*dir_);
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (dir_ == nullptr) GTEST_SKIP() << "spm_train is not installed (Debian: sentencepiece)";
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Create(SpConfig(1000), *dir_);
    ASSERT_TRUE(tok.ok()) << tok.status();
    tok_ = *std::move(tok);
  }

  static std::filesystem::path* dir_;
  std::unique_ptr<Tokenizer> tok_;
};
std::filesystem::path* SentencePieceTest::dir_ = nullptr;

TEST_F(SentencePieceTest, IdsComeFromTheModel) {
  EXPECT_EQ(tok_->name(), "sp");
  // spm_train's defaults: unk 0, bos 1, eos 2; 256 byte pieces plus merges.
  EXPECT_EQ(tok_->bos_id(), 1);
  EXPECT_EQ(tok_->eos_id(), 2);
  EXPECT_GT(tok_->vocab_size(), 256 + 3);
  EXPECT_LE(tok_->vocab_size(), 300);
}

TEST_F(SentencePieceTest, RoundTripsTextIncludingUnseenCharacters) {
  // "ω" and the emoji are not in the training text: byte fallback encodes them.
  for (const std::string text :
       {"hello world", "the lazy dog jumps", "caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC",
        "\xCF\x89orld \xF0\x9F\x98\x80!"}) {
    const std::vector<int32_t> ids = tok_->Encode(text, /*add_bos=*/false);
    ASSERT_FALSE(ids.empty());
    for (const int32_t id : ids) EXPECT_TRUE(tok_->IsValid(id));
    EXPECT_EQ(tok_->Decode(ids), text);

    const std::vector<int32_t> with_bos = tok_->Encode(text, /*add_bos=*/true);
    ASSERT_EQ(with_bos.size(), ids.size() + 1);
    EXPECT_EQ(with_bos[0], tok_->bos_id());
    EXPECT_EQ(tok_->Decode(with_bos), text);  // BOS decodes to nothing
  }
  // Learned merges: a training word takes fewer ids than its bytes.
  EXPECT_LT(tok_->Encode("hello", false).size(), 5u);
}

TEST_F(SentencePieceTest, TokenBytesKeepAPiecesLeadingSpace) {
  // Each piece as it reads after other text: concatenated, the text with SentencePiece's dummy
  // leading space, which Decode drops at the start.
  std::string joined;
  for (const int32_t id : tok_->Encode("hello world", /*add_bos=*/false)) {
    joined += tok_->TokenBytes(id);
  }
  EXPECT_EQ(joined, " hello world");
  EXPECT_EQ(tok_->TokenBytes(tok_->bos_id()), "");
  EXPECT_EQ(tok_->TokenBytes(static_cast<int32_t>(tok_->vocab_size())), "");
}

TEST_F(SentencePieceTest, DecodeSkipsOutOfRangeIds) {
  std::vector<int32_t> ids = tok_->Encode("hello", false);
  ids.insert(ids.begin() + 1, static_cast<int32_t>(tok_->vocab_size()));
  ids.push_back(-3);
  ids.push_back(tok_->eos_id());
  EXPECT_EQ(tok_->Decode(ids), "hello");
}

TEST_F(SentencePieceTest, StreamingHoldsByteFallbackCharactersAndMatchesDecode) {
  // "ω" (CF 89) is not in the training text, so it is two byte pieces.
  const std::vector<int32_t> omega = tok_->Encode("\xCF\x89", false);
  const std::vector<int32_t> ids = tok_->Encode("fox \xCF\x89 dog", false);
  const std::vector<std::string> deltas = Stream(*tok_, ids);
  EXPECT_EQ(Concat(deltas), "fox \xCF\x89 dog");
  for (const std::string& d : deltas) {
    EXPECT_TRUE(IsValidUtf8(d));
    EXPECT_EQ(d.find(kFffd), std::string::npos) << "a split character was emitted as U+FFFD";
  }
  // The id that completes "ω" emits it whole; the one before emits nothing.
  bool saw_omega = false;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (deltas[i].find("\xCF\x89") != std::string::npos) {
      saw_omega = true;
      ASSERT_GT(i, 0u);
      EXPECT_EQ(deltas[i - 1], "");
    }
  }
  EXPECT_TRUE(saw_omega);
  EXPECT_GE(omega.size(), 2u);
}

TEST_F(SentencePieceTest, StreamingMatchesDecodeOnRandomIdSequences) {
  // Random ids, not only encodings of text: whitespace pieces at the start, stray byte pieces,
  // control ids. Concatenated deltas must equal Decode() of the whole sequence.
  std::mt19937 rng(3);
  std::uniform_int_distribution<int32_t> any_id(0, static_cast<int32_t>(tok_->vocab_size()) - 1);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int32_t> ids;
    const int n = std::uniform_int_distribution<int>(0, 12)(rng);
    for (int i = 0; i < n; ++i) ids.push_back(any_id(rng));
    const std::vector<std::string> deltas = Stream(*tok_, ids);
    for (const std::string& d : deltas) EXPECT_TRUE(IsValidUtf8(d));
    EXPECT_EQ(Concat(deltas), tok_->Decode(ids)) << "trial " << trial;
  }
  // Text with leading and repeated spaces: SentencePiece drops only the text's leading ones.
  const std::vector<int32_t> spaced = tok_->Encode("hello world", false);
  std::vector<int32_t> ids = {spaced[0]};  // a word-start piece
  ids.insert(ids.end(), spaced.begin(), spaced.end());
  ids.insert(ids.end(), spaced.begin(), spaced.end());
  EXPECT_EQ(Concat(Stream(*tok_, ids)), tok_->Decode(ids));
}

TEST_F(SentencePieceTest, ModelVocabularySmallerThanTheTokenizersIsAnError) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok =
      Tokenizer::Create(SpConfig(tok_->vocab_size() - 1), *dir_);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("vocab_size"));
  EXPECT_TRUE(Tokenizer::Create(SpConfig(tok_->vocab_size()), *dir_).ok());
}

TEST(SentencePieceFileTest, MissingFileIsNotFoundAndNamesTheFile) {
  const std::filesystem::path dir = FreshDir("sp_missing");
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Create(SpConfig(1000), dir);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(tok.status().message(), HasSubstr((dir / "tokenizer.model").string()));
  std::filesystem::remove_all(dir);
}

TEST(SentencePieceFileTest, CorruptFileIsAnErrorThatNamesTheFile) {
  const std::filesystem::path dir = FreshDir("sp_corrupt");
  std::ofstream(dir / "tokenizer.model") << "this is not a serialized ModelProto \x01\x02\xff";
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Create(SpConfig(1000), dir);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr((dir / "tokenizer.model").string()));
  std::filesystem::remove_all(dir);
}

TEST(SentencePieceFileTest, EmptyPathIsAnError) {
  ModelConfig config = SpConfig(1000);
  config.tokenizer.path = "";
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Create(config, "/nonexistent");
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("tokenizer.path"));
}

}  // namespace
}  // namespace sdm
