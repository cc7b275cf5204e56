// scripts/device/compare_decode.py, which the device check runs to put our decode step next to
// the reference's: fed a real `sdm-bench decode` JSON (CPU, tiny, so that our side's schema is
// the benchmark's own) and a reference JSON written here in reference_decode.py's schema, with
// the reference at twice our median for batch 1, skipped for batch 2 and present only on its
// side for batch 4. Needs /usr/bin/python3 (skips without it).
#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/engine/test_model_util.h"
#include "tests/tools/run_tool.h"

namespace sdm {
namespace {

using ::sdm::testing::ReadFile;
using ::sdm::testing::RunTool;
using ::sdm::testing::ScopedTempDir;
using ::testing::HasSubstr;
using Json = nlohmann::json;

constexpr char kBench[] = SDM_BINARY_DIR "/tools/sdm_bench/sdm-bench";
constexpr char kScript[] = SDM_SOURCE_DIR "/scripts/device/compare_decode.py";
constexpr char kPython[] = "/usr/bin/python3";

void WriteJson(const std::filesystem::path& path, const Json& j) {
  std::ofstream(path) << j.dump(1);
}

class CompareDecodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(kPython)) GTEST_SKIP() << "no " << kPython;
  }
  // compare_decode.py with our JSON and `reference`; the comparison's JSON in *out.
  ::sdm::testing::ToolResult Compare(const Json& reference, Json* out) {
    WriteJson(tmp_.path() / "reference.json", reference);
    const auto result_path = tmp_.path() / "comparison.json";
    std::filesystem::remove(result_path);
    ::sdm::testing::ToolResult r = RunTool(
        kPython, std::string(kScript) + " --model tiny --ours " +
                     (tmp_.path() / "ours.json").string() + " --reference " +
                     (tmp_.path() / "reference.json").string() + " --json " + result_path.string());
    if (std::filesystem::exists(result_path)) *out = Json::parse(ReadFile(result_path));
    return r;
  }
  ScopedTempDir tmp_;
};

TEST_F(CompareDecodeTest, SpeedupPerBatchAndWhyABatchWasNotCompared) {
  const ::sdm::testing::ToolResult bench =
      RunTool(kBench,
              "decode --device cpu --presets tiny --contexts 16 --batches 1,2 "
              "--fit_batch=false --steps 1 --warmup 0 --bandwidth_mb 8 --json " +
                  (tmp_.path() / "ours.json").string());
  ASSERT_EQ(bench.code, 0) << bench.output;
  const Json ours = Json::parse(ReadFile(tmp_.path() / "ours.json"));
  double ours_b1_ms = -1;
  for (const Json& r : ours["results"]) {
    if (r["batch"] == 1) ours_b1_ms = r["ms_per_step_median"].get<double>();
  }
  ASSERT_GT(ours_b1_ms, 0);

  const Json reference = {
      {"preset", "tiny"},
      {"context", 16},
      {"device", "a test"},
      {"reference", {{"commit", "0123456789abcdef"}}},
      {"rows", Json::array({
                   {{"batch", 1}, {"status", "ok"}, {"median_ms", 2 * ours_b1_ms}, {"tok_s", 1.5}},
                   {{"batch", 2}, {"status", "skipped"}, {"reason", "out of memory: planted"}},
                   {{"batch", 4}, {"status", "ok"}, {"median_ms", 3.0}, {"tok_s", 1333.3}},
               })}};
  Json comparison;
  const ::sdm::testing::ToolResult r = Compare(reference, &comparison);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("speedup (reference ms / ours): b1 2.00x"));
  ASSERT_EQ(comparison["rows"].size(), 3u);
  const Json& b1 = comparison["rows"][0];
  EXPECT_EQ(b1["batch"], 1);
  EXPECT_NEAR(b1["speedup"].get<double>(), 2.0, 1e-9);
  EXPECT_EQ(b1["ours_ms"].get<double>(), ours_b1_ms);
  EXPECT_TRUE(b1["ours_fraction_of_bandwidth"].is_number());
  const Json& b2 = comparison["rows"][1];
  EXPECT_FALSE(b2.contains("speedup"));
  EXPECT_THAT(b2["reason"].get<std::string>(), HasSubstr("reference: skipped (out of memory"));
  EXPECT_TRUE(b2.contains("ours_ms"));  // ours ran at batch 2
  const Json& b4 = comparison["rows"][2];
  EXPECT_FALSE(b4.contains("speedup"));
  EXPECT_THAT(b4["reason"].get<std::string>(),
              HasSubstr("ours: no tiny result at context 16, batch 4"));
  EXPECT_EQ(comparison["reference_commit"], "0123456789abcdef");
  EXPECT_EQ(comparison["summary"], "b1 2.00x");

  // A reference at another context compares nothing: exit 1, each row saying why.
  Json elsewhere = reference;
  elsewhere["context"] = 1024;
  const ::sdm::testing::ToolResult none = Compare(elsewhere, &comparison);
  EXPECT_EQ(none.code, 1) << none.output;
  EXPECT_THAT(none.output, HasSubstr("none compared"));
  EXPECT_THAT(comparison["rows"][0]["reason"].get<std::string>(),
              HasSubstr("ours: no tiny result at context 1024, batch 1"));
}

TEST_F(CompareDecodeTest, UnreadableInputIsExitTwo) {
  std::ofstream(tmp_.path() / "ours.json") << "{ not json";
  Json comparison;
  const ::sdm::testing::ToolResult r = Compare(Json{{"rows", Json::array()}}, &comparison);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("cannot read our decode JSON"));
}

}  // namespace
}  // namespace sdm
