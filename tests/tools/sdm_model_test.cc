// Runs the built `sdm-model` binary: exit codes, the files `init` writes, and `info`.
#include <cstring>
#include <string>

#include "engine/model.h"
#include "engine/safetensors.h"
#include "engine/weight_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/test_model_util.h"
#include "tests/tools/run_tool.h"

namespace sdm {
namespace {

using ::sdm::testing::ScopedTempDir;
using ::sdm::testing::WriteFile;
using ::testing::HasSubstr;

using Result = ::sdm::testing::ToolResult;

Result RunTool(const std::string& args) {
  return ::sdm::testing::RunTool(SDM_BINARY_DIR "/tools/sdm_model/sdm-model", args);
}

class SdmModelToolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(std::filesystem::exists(SDM_BINARY_DIR "/tools/sdm_model/sdm-model"))
        << "build the sdm-model target first";
  }
  ScopedTempDir tmp_;
};

TEST_F(SdmModelToolTest, InitWritesRandomWeightsThatLoad) {
  const auto dir = tmp_.path() / "tiny";
  const Result r = RunTool("init --preset tiny --seed 12 --out " + dir.string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("54 tensors"));
  auto model = LoadModel(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  auto random = ModelWeights::Random((*model)->config, 12);
  for (const TensorSpec& s : ExpectedTensors((*model)->config)) {
    const auto got = (*model)->weights->Get(s.name);
    const auto want = random->Get(s.name);
    ASSERT_TRUE(std::equal(got.begin(), got.end(), want.begin(), want.end())) << s.name;
  }
  auto index = ReadSafetensorsIndex(dir / "model.safetensors");
  ASSERT_TRUE(index.ok());
  EXPECT_EQ(index->tensors.front().dtype, TensorDtype::kF32);  // < 1e9 parameters
  EXPECT_EQ(index->metadata.at("seed"), "12");
}

TEST_F(SdmModelToolTest, RefusesANonEmptyDirectoryWithoutForce) {
  const auto dir = tmp_.path() / "m";
  std::filesystem::create_directories(dir);
  WriteFile(dir / "notes.txt", "keep");
  Result r = RunTool("init --preset tiny --seed 1 --out " + dir.string());
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.output, HasSubstr("not empty"));
  EXPECT_THAT(r.output, HasSubstr("--force"));
  EXPECT_FALSE(std::filesystem::exists(dir / "model.safetensors"));
  r = RunTool("init --preset tiny --seed 1 --out " + dir.string() + " --force --dtype bf16");
  ASSERT_EQ(r.code, 0) << r.output;
  auto index = ReadSafetensorsIndex(dir / "model.safetensors");
  ASSERT_TRUE(index.ok());
  for (const SafetensorsEntry& e : index->tensors) EXPECT_EQ(e.dtype, TensorDtype::kBF16);
  EXPECT_TRUE(std::filesystem::exists(dir / "notes.txt"));
}

TEST_F(SdmModelToolTest, RepeatedSetOverridesApplyTogether) {
  const auto dir = tmp_.path() / "m";
  const Result r = RunTool("init --preset tiny --seed 1 --out " + dir.string() +
                           " --set swa_at=[0,1] --set sdm_at=[2,3] --set=sdm_args.num_writes=4");
  ASSERT_EQ(r.code, 0) << r.output;
  auto model = LoadModel(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->config.sdm_at, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ((*model)->config.sdm.num_writes, 4);
  EXPECT_TRUE((*model)->weights->Has("layers.2.attention.memory"));
}

TEST_F(SdmModelToolTest, UsageErrorsExitWithTwo) {
  const std::string out = " --out " + (tmp_.path() / "u").string();
  for (const std::string& args :
       {std::string(""), std::string("frobnicate"), std::string("init --seed 1") + out,
        std::string("init --preset nope --seed 1") + out,
        std::string("init --preset tiny --seed x") + out,
        std::string("init --preset tiny --seed 1"),
        std::string("init --preset tiny --seed 1 --dtype fp16") + out,
        std::string("init --preset tiny --seed 1 --set dimm=3") + out,
        std::string("init --preset tiny --seed 1 --set") + out,
        std::string("init --preset tiny --seed 1 --what") + out, std::string("info"),
        std::string("info a b")}) {
    SCOPED_TRACE(args);
    const Result r = RunTool(args);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_FALSE(r.output.empty());
  }
  EXPECT_FALSE(std::filesystem::exists(tmp_.path() / "u"));
  EXPECT_EQ(RunTool("help").code, 0);
}

TEST_F(SdmModelToolTest, InfoDescribesADirectoryFromItsHeader) {
  const auto dir = tmp_.path() / "m";
  ASSERT_EQ(RunTool("init --preset tiny --seed 1 --out " + dir.string()).code, 0);
  Result r = RunTool("info " + dir.string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("swa swa swa sdm"));
  EXPECT_THAT(r.output, HasSubstr("288,136"));
  EXPECT_THAT(r.output, HasSubstr("4,096 elements"));
  EXPECT_THAT(r.output, HasSubstr("F32"));
  EXPECT_THAT(r.output, HasSubstr("names and shapes match the config"));

  // A config that no longer fits the weights is reported, with exit code 1.
  std::string config = sdm::testing::ReadFile(dir / "config.json");
  config.replace(config.find("\"output_gate\": true"), 19, "\"output_gate\": false");
  WriteFile(dir / "config.json", config);
  r = RunTool("info " + dir.string());
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.output, HasSubstr("unexpected tensor"));

  r = RunTool("info " + (tmp_.path() / "absent").string());
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.output, HasSubstr("config.json"));
}

TEST_F(SdmModelToolTest, InfoOfAPresetNeedsNoFiles) {
  const Result r = RunTool("info --preset baseline_1.4B");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("24.6 KB bf16"));
  EXPECT_THAT(r.output, HasSubstr("none (no sdm layers)"));
  const Result flagship = RunTool("info --preset sdm_flagship");
  EXPECT_THAT(flagship.output, HasSubstr("805,306,368 elements"));
  EXPECT_THAT(flagship.output, HasSubstr("1.61 GB bf16"));
}

}  // namespace
}  // namespace sdm
