#include "engine/model.h"

#include <cstring>

#include "absl/status/status.h"
#include "engine/model_writer.h"
#include "engine/safetensors.h"
#include "engine/weight_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/test_model_util.h"

namespace sdm {
namespace {

using ::sdm::testing::ScopedTempDir;
using ::sdm::testing::TinyConfig;
using ::sdm::testing::WriteFile;
using ::testing::HasSubstr;

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

void WriteModel(const ModelConfig& c, const std::filesystem::path& dir, uint64_t seed,
                TensorDtype dtype) {
  RandomModelOptions options;
  options.seed = seed;
  options.dtype = dtype;
  options.chunk_elements = 4096;
  ASSERT_TRUE(WriteRandomModel(c, dir, options).ok());
}

class LoadModelTest : public ::testing::TestWithParam<TensorDtype> {};

TEST_P(LoadModelTest, LoadsWhatInitWrote) {
  ScopedTempDir dir;
  ModelConfig c = TinyConfig();
  ASSERT_TRUE(ApplyConfigOverride(c, "sdm_args.query_batchnorm=true").ok());
  WriteModel(c, dir.path(), 99, GetParam());
  auto model = LoadModel(dir.path());
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->dir, dir.path());
  EXPECT_EQ(ModelConfigToJson((*model)->config), ModelConfigToJson(c));
  auto random = RandomModel(c, 99);
  for (const TensorSpec& s : ExpectedTensors(c)) {
    const auto got = (*model)->weights->Get(s.name);
    const auto want = random->weights->Get(s.name);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const float expected =
          GetParam() == TensorDtype::kF32 ? want[i] : Bf16ToFloat(FloatToBf16(want[i]));
      ASSERT_EQ(Bits(got[i]), Bits(expected)) << s.name << "[" << i << "]";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LoadModelTest,
                         ::testing::Values(TensorDtype::kF32, TensorDtype::kBF16),
                         [](const auto& info) { return std::string(TensorDtypeName(info.param)); });

TEST(LoadModelErrorsTest, NamesTheFileAndTheProblem) {
  ScopedTempDir dir;
  const auto config = dir.path() / "config.json";

  auto absent = LoadModel(dir.path() / "nope");
  EXPECT_EQ(absent.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(absent.status().message(), HasSubstr("nope"));

  auto no_config = LoadModel(dir.path());
  EXPECT_EQ(no_config.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(no_config.status().message(), HasSubstr(config.string()));

  WriteFile(config, "{\"dim\": ");
  auto bad_json = LoadModel(dir.path());
  EXPECT_EQ(bad_json.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_json.status().message(), HasSubstr(config.string()));
  EXPECT_THAT(bad_json.status().message(), HasSubstr("not valid JSON"));

  WriteFile(config, R"({"dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": 258,
                       "attn_at": "all", "dimension": 3})");
  auto unknown = LoadModel(dir.path());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), HasSubstr(config.string()));
  EXPECT_THAT(unknown.status().message(), HasSubstr("'dimension'"));

  // A valid config without weights.
  WriteFile(config, R"({"dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": 258,
                       "attn_at": "all"})");
  auto no_weights = LoadModel(dir.path());
  EXPECT_EQ(no_weights.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(no_weights.status().message(), HasSubstr("model.safetensors"));
}

TEST(LoadModelErrorsTest, SentencePieceModelsNeedTheirTokenizerFile) {
  ScopedTempDir dir;
  ModelConfig c = TinyConfig();
  ASSERT_TRUE(ApplyConfigOverride(c, "tokenizer.name=sp").ok());
  EXPECT_EQ(c.tokenizer.path, "tokenizer.model");
  WriteModel(c, dir.path(), 1, TensorDtype::kF32);
  auto missing = LoadModel(dir.path());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr((dir.path() / "tokenizer.model").string()));
  WriteFile(dir.path() / "tokenizer.model", "not checked here");
  EXPECT_TRUE(LoadModel(dir.path()).ok());
}

TEST(LoadModelErrorsTest, WeightsThatDoNotFitTheConfigAreRejected) {
  ScopedTempDir dir;
  ModelConfig c = TinyConfig();
  WriteModel(c, dir.path(), 1, TensorDtype::kF32);
  ModelConfig other = c;
  ASSERT_TRUE(ApplyConfigOverride(other, "sdm_args.output_gate=false").ok());
  ASSERT_TRUE(WriteModelConfig(other, dir.path()).ok());
  auto loaded = LoadModel(dir.path());
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(loaded.status().message(), HasSubstr("unexpected tensor"));
  EXPECT_THAT(loaded.status().message(), HasSubstr("layers.3.attention.Wog.weight"));
}

TEST(RandomModelTest, MatchesRandomWeights) {
  const ModelConfig c = TinyConfig();
  auto model = RandomModel(c, 4);
  EXPECT_TRUE(model->dir.empty());
  auto weights = ModelWeights::Random(c, 4);
  const auto a = model->weights->Get("tok_embeddings.weight");
  const auto b = weights->Get("tok_embeddings.weight");
  EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin(), b.end()));
}

TEST(DefaultModelDtypeTest, Bf16FromOneBillionParameters) {
  EXPECT_EQ(DefaultModelDtype(TinyConfig()), TensorDtype::kF32);
  EXPECT_EQ(DefaultModelDtype(*PresetConfig("debug_sdm")), TensorDtype::kF32);
  EXPECT_EQ(DefaultModelDtype(*PresetConfig("sdm_flagship")), TensorDtype::kBF16);
  EXPECT_EQ(DefaultModelDtype(*PresetConfig("baseline_1.4B")), TensorDtype::kBF16);
}

}  // namespace
}  // namespace sdm
