// Runs the built `sdm-bench` binary in CI size (the tiny preset, tiny contexts and batches) and
// checks that it produces a well-formed report: exit code, the JSON document's keys and one row
// per (model, context, batch), the CSV, and report.md naming every parameter. Benchmarks are not
// tests: no timing is checked. Also the --device flag (cpu works, a bad name and an absent device
// fail with clear messages) and `kernels` where it cannot run (no CUDA build or no device).
#include <filesystem>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_runtime_info.h"
#include "nlohmann/json.hpp"
#include "tests/engine/test_model_util.h"
#include "tests/tools/run_tool.h"

namespace sdm {
namespace {

using ::sdm::testing::ReadFile;
using ::sdm::testing::ScopedTempDir;
using ::testing::HasSubstr;

constexpr char kBinary[] = SDM_BINARY_DIR "/tools/sdm_bench/sdm-bench";

using Result = ::sdm::testing::ToolResult;

Result RunTool(const std::string& args) { return ::sdm::testing::RunTool(kBinary, args); }

// The keys every result row carries (the CSV columns, in order).
const std::vector<std::string> kRowKeys = {
    "group",
    "model",
    "role",
    "context",
    "batch",
    "fit_batch",
    "steps",
    "ms_per_step_median",
    "ms_per_step_p90",
    "ms_per_step_min",
    "tokens_per_s",
    "bytes_per_step",
    "weight_bytes_per_step",
    "kv_bytes_per_step_per_session",
    "swa_bytes_per_step_per_session",
    "sdm_bytes_per_step_per_session",
    "achieved_gbps",
    "fraction_of_bandwidth",
    "gflops",
    "sgemm_gflops_same_shapes",
    "fraction_of_sgemm",
    "attn_ms_per_step",
    "swa_ms_per_step",
    "sdm_ms_per_step",
    "ffn_ms_per_step",
    "head_ms_per_step",
    "attn_layers_gbps",
    "swa_layers_gbps",
    "sdm_layers_gbps",
    "state_bytes_per_session",
    "max_batch_in_budget",
    "device",
    "engine",
};

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) lines.push_back(line);
  }
  return lines;
}

class SdmBenchToolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(kBinary)) GTEST_SKIP() << "build the sdm-bench target first";
  }
  ScopedTempDir tmp_;
};

TEST_F(SdmBenchToolTest, DecodeWritesAWellFormedReport) {
  const auto dir = tmp_.path() / "report";
  const auto json_path = tmp_.path() / "out.json";
  const auto csv_path = tmp_.path() / "out.csv";
  // A pair (tiny vs its full-attention twin) and an explicit preset group.
  const Result r = RunTool(
      "decode --pair tiny --presets tiny --contexts 8,32 --batches 1,2 --fit_batch=false "
      "--steps 2 --warmup 1 --bandwidth_mb 8 --json " +
      json_path.string() + " --csv " + csv_path.string() + " --report " + dir.string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("ms/step"));  // the table
  EXPECT_THAT(r.output, HasSubstr("tiny_attn"));

  const nlohmann::json doc = nlohmann::json::parse(ReadFile(json_path), nullptr, false);
  ASSERT_FALSE(doc.is_discarded()) << "the JSON file does not parse";
  for (const char* key : {"tool", "started_utc", "finished_utc", "command_line", "parameters",
                          "machine", "build", "bandwidth", "groups", "results", "skipped"}) {
    EXPECT_TRUE(doc.contains(key)) << key;
  }
  EXPECT_GT(doc["bandwidth"]["reference_gbps"].get<double>(), 0);
  ASSERT_EQ(doc["groups"].size(), 2u);
  const nlohmann::json& pair = doc["groups"][0];
  EXPECT_EQ(pair["name"], "tiny");
  ASSERT_EQ(pair["models"].size(), 2u);
  EXPECT_EQ(pair["models"][0]["role"], "sdm");
  EXPECT_EQ(pair["models"][1]["role"], "attention");
  EXPECT_EQ(pair["models"][1]["name"], "tiny_attn");
  // Parameter counts side by side: the twin has no M0, the SDM model's M0 is counted apart.
  EXPECT_GT(pair["models"][0]["parameters_m0"].get<int64_t>(), 0);
  EXPECT_EQ(pair["models"][1]["parameters_m0"].get<int64_t>(), 0);
  EXPECT_EQ(pair["models"][0]["parameters_total"].get<int64_t>() -
                pair["models"][0]["parameters_m0"].get<int64_t>(),
            pair["models"][0]["parameters_without_m0"].get<int64_t>());
  EXPECT_EQ(pair["ratios"].size(), 4u);  // 2 contexts x 2 batches
  EXPECT_EQ(pair["headline"]["longest_common_context"], 32);
  EXPECT_EQ(doc["groups"][1]["name"], "presets");

  // One row per (model, context, batch): 3 models x 2 contexts x 2 batches, nothing skipped.
  const nlohmann::json& rows = doc["results"];
  ASSERT_EQ(rows.size(), 12u);
  EXPECT_TRUE(doc["skipped"].empty());
  std::set<std::tuple<std::string, std::string, int64_t, int64_t>> seen;
  for (const nlohmann::json& row : rows) {
    for (const std::string& key : kRowKeys) EXPECT_TRUE(row.contains(key)) << key;
    EXPECT_GT(row["tokens_per_s"].get<double>(), 0);
    EXPECT_GT(row["bytes_per_step"].get<double>(), 0);
    EXPECT_GT(row["state_bytes_per_session"].get<double>(), 0);
    const auto key =
        std::make_tuple(row["group"].get<std::string>(), row["model"].get<std::string>(),
                        row["context"].get<int64_t>(), row["batch"].get<int64_t>());
    EXPECT_TRUE(seen.insert(key).second) << row.dump();
  }

  const std::vector<std::string> csv = Lines(ReadFile(csv_path));
  ASSERT_EQ(csv.size(), 13u);  // header + 12 rows
  std::string header;
  for (const std::string& key : kRowKeys) header += (header.empty() ? "" : ",") + key;
  EXPECT_EQ(csv[0], header);

  // The report directory: its own copies of the data, and report.md naming every parameter.
  ASSERT_TRUE(std::filesystem::exists(dir / "report.md"));
  EXPECT_TRUE(std::filesystem::exists(dir / "results.json"));
  EXPECT_TRUE(std::filesystem::exists(dir / "results.csv"));
  const std::string report = ReadFile(dir / "report.md");
  for (const auto& [key, value] : doc["parameters"].items()) {
    EXPECT_THAT(report, HasSubstr("`--" + key + "`")) << "report.md does not name --" << key;
  }
  for (const char* section : {"## Headline", "## Machine", "## Build", "## Protocol",
                              "## Parameters", "## Models", "## Results: tiny", "## Plots"}) {
    EXPECT_THAT(report, HasSubstr(section));
  }
  EXPECT_THAT(report, HasSubstr("tiny_attn"));
  // Plots when matplotlib is there; otherwise the report says why there are none.
  if (report.find("No plots:") == std::string::npos) {
    for (const char* png : {"tokens_per_s_vs_context.png", "tokens_per_s_vs_batch.png",
                            "step_ms_vs_context.png", "ratio_vs_context.png"}) {
      ASSERT_TRUE(std::filesystem::exists(dir / png)) << png;
      EXPECT_EQ(ReadFile(dir / png).substr(1, 3), "PNG") << png;
      EXPECT_THAT(report, HasSubstr(png));
    }
  }
}

TEST_F(SdmBenchToolTest, ReportRendersAnEarlierRunAgain) {
  const auto json_path = tmp_.path() / "out.json";
  Result r = RunTool(
      "decode --pair tiny --contexts 8 --batches 1 --fit_batch=false --steps 1 "
      "--warmup 0 --bandwidth_mb 8 --json " +
      json_path.string());
  ASSERT_EQ(r.code, 0) << r.output;
  const auto dir = tmp_.path() / "again";
  r = RunTool("report --from " + json_path.string() + " --report " + dir.string() + " --csv " +
              (tmp_.path() / "again.csv").string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(ReadFile(dir / "report.md"), HasSubstr("## Results: tiny"));
  EXPECT_EQ(Lines(ReadFile(tmp_.path() / "again.csv")).size(), 3u);  // header + 2 rows
  EXPECT_EQ(nlohmann::json::parse(ReadFile(dir / "results.json"))["results"].size(), 2u);
  const std::string cpu_report = ReadFile(dir / "report.md");
  EXPECT_THAT(cpu_report, HasSubstr("The twin's full-attention layers moved their bytes"));
  // The same run as a CUDA run writes it (no per-layer profile there: its fields are zeros):
  // the report prints no per-layer figure (it printed the zeros as measured, and "moved their
  // bytes at 0.0 GB/s").
  nlohmann::json doc = nlohmann::json::parse(ReadFile(json_path));
  ASSERT_TRUE(doc["device"].is_object());
  doc["device"]["resolved"] = "cuda";
  for (nlohmann::json& row : doc["results"]) {
    for (const char* f :
         {"attn_ms_per_step", "swa_ms_per_step", "sdm_ms_per_step", "ffn_ms_per_step",
          "attn_layers_gbps", "swa_layers_gbps", "sdm_layers_gbps"}) {
      row[f] = 0.0;
    }
  }
  testing::WriteFile(tmp_.path() / "cuda.json", doc.dump());
  const auto cuda_dir = tmp_.path() / "cuda";
  r = RunTool("report --from " + (tmp_.path() / "cuda.json").string() + " --report " +
              cuda_dir.string());
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string cuda_report = ReadFile(cuda_dir / "report.md");
  EXPECT_THAT(cuda_report,
              ::testing::Not(HasSubstr("The twin's full-attention layers moved their bytes")));
  EXPECT_THAT(cuda_report, HasSubstr("on CUDA they are not measured"));
  EXPECT_THAT(cuda_report, HasSubstr("| - | - | - | - | - | - | - |"));
  // A --cpu_dtype bf16 run's protocol says so (it said fp32 weights and state), in full.
  nlohmann::json bf16 = nlohmann::json::parse(ReadFile(json_path));
  bf16["parameters"]["cpu_dtype"] = "bf16";
  testing::WriteFile(tmp_.path() / "bf16.json", bf16.dump());
  r = RunTool("report --from " + (tmp_.path() / "bf16.json").string() + " --report " +
              (tmp_.path() / "bf16").string());
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string bf16_report = ReadFile(tmp_.path() / "bf16" / "report.md");
  EXPECT_THAT(bf16_report, HasSubstr("bf16 weights and KV caches"));
  EXPECT_THAT(bf16_report, ::testing::Not(HasSubstr("fp32 weights and state")));
  EXPECT_THAT(bf16_report, HasSubstr("The models of a pair are measured together"));
  EXPECT_THAT(cpu_report, HasSubstr("fp32 weights and state"));
  r = RunTool("report --from " + (tmp_.path() / "missing.json").string());
  EXPECT_EQ(r.code, 1);
  r = RunTool("report");
  EXPECT_EQ(r.code, 2);
}

// --dir names the disk to measure: the benchmark works in a directory of its own there and
// leaves what the directory held alone (it used to empty --dir itself, a server's sessions say).
TEST_F(SdmBenchToolTest, StateSubcommandRuns) {
  const auto json_path = tmp_.path() / "state.json";
  const std::filesystem::path snap = tmp_.path() / "snap";
  std::filesystem::create_directories(snap);
  testing::WriteFile(snap / "keep.txt", "a session's file");
  const Result r = RunTool("state --presets tiny --lengths 16,24 --dir " + snap.string() +
                           " --json " + json_path.string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("tiny"));
  const nlohmann::json rows = nlohmann::json::parse(ReadFile(json_path), nullptr, false);
  ASSERT_TRUE(rows.is_array()) << r.output;
  for (const nlohmann::json& row : rows) EXPECT_EQ(row["exact"], true);
  EXPECT_EQ(ReadFile(snap / "keep.txt"), "a session's file");
  int left = 0;  // its own directory is gone at the end
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(snap)) ++left;
  EXPECT_EQ(left, 1);
}

TEST_F(SdmBenchToolTest, CpuAttentionComparesTheKernels) {
  const Result r = RunTool(
      "cpu-attention --presets tiny --attention_contexts 300 --attention_batches 1,2 "
      "--window 8 --kernel_reps 2 --kernel_warmup 0 --bandwidth_mb 8 --threads 2");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("memory bandwidth (start"));
  EXPECT_THAT(r.output, HasSubstr("blocked ms"));
  EXPECT_THAT(r.output, HasSubstr("per-head ms"));
  int rows = 0;  // one table row per (context, batch)
  for (const std::string& line : Lines(r.output)) rows += line.rfind("     300 ", 0) == 0;
  EXPECT_EQ(rows, 2) << r.output;
  EXPECT_EQ(RunTool("cpu-attention --window -1").code, 2);
}

TEST_F(SdmBenchToolTest, CpuGemmComparesTheInstructionSets) {
  const Result r = RunTool(
      "cpu-gemm --presets tiny --gemm_batches 1,3 --gemm_isas generic,avx2 --gemm_mb 1 "
      "--kernel_reps 2 --kernel_warmup 0 --threads 2");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("active ISA"));
  int rows = 0;  // one row per (dtype, batch, ISA), every one bit-identical to the others
  for (const std::string& line : Lines(r.output)) {
    if (line.find("batch") != std::string::npos && line.find(" ms ") != std::string::npos) {
      ++rows;
      EXPECT_THAT(line, HasSubstr("outputs bit-identical"));
    }
  }
  EXPECT_EQ(rows, 2 * 2 * 2) << r.output;
  EXPECT_EQ(RunTool("cpu-gemm --gemm_isas sse9").code, 2);
  EXPECT_EQ(RunTool("cpu-gemm --gemm_mb 0").code, 2);
}

TEST_F(SdmBenchToolTest, DecodeMeasuresBothCpuAttentionKernels) {
  const Result r = RunTool(
      "decode --device cpu --presets tiny --cpu_attention blocked,per_head --contexts 16 "
      "--batches 1 --fit_batch=false --steps 1 --warmup 0 --bandwidth_mb 8");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("tiny[per_head]"));
  const Result bad = RunTool("decode --presets tiny --cpu_attention fastest");
  EXPECT_EQ(bad.code, 2);
  EXPECT_THAT(bad.output, HasSubstr("--cpu_attention"));
}

TEST_F(SdmBenchToolTest, RejectsUnknownPairsAndBadFlags) {
  Result r = RunTool("decode --pair nope");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.output, HasSubstr("unknown pair 'nope'"));
  EXPECT_THAT(r.output, HasSubstr("cpu_hybrid"));
  r = RunTool("decode --pair tiny --contexts 0");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.output, HasSubstr("--contexts"));
  r = RunTool("decode --pair tiny --set no_such_field=1");
  EXPECT_EQ(r.code, 2);
  r = RunTool("prefill");
  EXPECT_EQ(r.code, 2);
  r = RunTool("state --presets nope");  // a usage error, as decode's (it exited 1)
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.output, HasSubstr("nope"));
}

// An unknown subcommand is refused with the list of them, serve included (sdm-bench runs it
// before its own parser, which did not list it).
TEST_F(SdmBenchToolTest, AnUnknownSubcommandListsEveryOneServeIncluded) {
  const Result r = RunTool("nosuch");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.output, HasSubstr("sdm-bench: unknown subcommand 'nosuch' (expected decode, "
                                  "report, state, cpu-attention, cpu-gemm, kernels, serve)\n"));
}

TEST_F(SdmBenchToolTest, SkipsBatchesOverTheStateBudget) {
  const auto json_path = tmp_.path() / "out.json";
  const Result r = RunTool(
      "decode --pair tiny --contexts 8 --batches 1,100000 --fit_batch=false --steps 1 "
      "--warmup 0 --bandwidth_mb 8 --state_budget_gb 0.001 --json " +
      json_path.string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("skipped"));
  const nlohmann::json doc = nlohmann::json::parse(ReadFile(json_path));
  EXPECT_EQ(doc["results"].size(), 2u);
  EXPECT_EQ(doc["skipped"].size(), 2u);
  for (const nlohmann::json& row : doc["results"]) {
    EXPECT_EQ(row["batch"], 1);
    EXPECT_LT(row["max_batch_in_budget"].get<int64_t>(), 100000);
  }
}

TEST_F(SdmBenchToolTest, DeviceCpuIsRecordedInEveryOutput) {
  const auto json_path = tmp_.path() / "out.json";
  const auto csv_path = tmp_.path() / "out.csv";
  const auto dir = tmp_.path() / "report";
  const Result r = RunTool(
      "decode --device cpu --pair tiny --contexts 8 --batches 1 --fit_batch=false --steps 1 "
      "--warmup 0 --bandwidth_mb 8 --json " +
      json_path.string() + " --csv " + csv_path.string() + " --report " + dir.string());
  ASSERT_EQ(r.code, 0) << r.output;
  // The terminal names the device and each engine's own description.
  EXPECT_THAT(r.output, HasSubstr("# device: cpu (--device cpu)"));
  EXPECT_THAT(r.output, HasSubstr("tiny engine: cpu"));
  const nlohmann::json doc = nlohmann::json::parse(ReadFile(json_path), nullptr, false);
  ASSERT_FALSE(doc.is_discarded());
  EXPECT_EQ(doc["parameters"]["device"], "cpu");
  EXPECT_EQ(doc["device"]["requested"], "cpu");
  EXPECT_EQ(doc["device"]["resolved"], "cpu");
  const std::string described = doc["device"]["description"].get<std::string>();
  EXPECT_THAT(described, ::testing::StartsWith("cpu"));
  EXPECT_EQ(doc["device"]["engines"].size(), 2u);  // the pair's two engines
  EXPECT_EQ(doc["bandwidth"]["kind"], "host memory");
  ASSERT_EQ(doc["results"].size(), 2u);
  for (const nlohmann::json& row : doc["results"]) {
    EXPECT_EQ(row["device"], "cpu");
    EXPECT_EQ(row["engine"], described);
    EXPECT_TRUE(row["sgemm_gflops_same_shapes"].is_number());  // CPU only
  }
  // The CSV's engine column is quoted when the description holds commas ("cpu, 2 threads").
  const std::vector<std::string> csv = Lines(ReadFile(csv_path));
  ASSERT_EQ(csv.size(), 3u);
  if (described.find(',') != std::string::npos) {
    EXPECT_THAT(csv[1], HasSubstr(",cpu,\"" + described + "\""));
  } else {
    EXPECT_THAT(csv[1], HasSubstr(",cpu," + described));
  }
  const std::string report = ReadFile(dir / "report.md");
  EXPECT_THAT(report, HasSubstr("`--device` | cpu (resolved to cpu)"));
  EXPECT_THAT(report, HasSubstr("| engine of tiny | " + described));
}

TEST_F(SdmBenchToolTest, StateRecordsTheDevice) {
  const auto json_path = tmp_.path() / "state.json";
  const Result r = RunTool("state --device cpu --presets tiny --lengths 16 --dir " +
                           (tmp_.path() / "snap").string() + " --json " + json_path.string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("tiny engine: cpu"));
  const nlohmann::json rows = nlohmann::json::parse(ReadFile(json_path), nullptr, false);
  ASSERT_TRUE(rows.is_array());
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0]["device"], "cpu");
  EXPECT_TRUE(rows[0]["device_to_host_s"].is_null());  // nothing to sync on the CPU
  EXPECT_TRUE(rows[0]["exact"].get<bool>());
}

TEST_F(SdmBenchToolTest, RejectsUnknownDevices) {
  for (const char* command : {"decode --pair tiny --contexts 8", "state --presets tiny"}) {
    const Result r = RunTool(std::string(command) + " --device bogus");
    EXPECT_EQ(r.code, 2) << command;
    EXPECT_THAT(r.output, HasSubstr("unknown device 'bogus'")) << command;
    EXPECT_THAT(r.output, HasSubstr("auto, cpu or cuda")) << command;
  }
}

// --device cuda where no device can be had fails before building any model, with a message that
// says why; it never crashes. (Where a device is present the decode would run for real: a
// benchmark, not a test, so the case is skipped there.)
TEST_F(SdmBenchToolTest, DeviceCudaWithoutADeviceFailsClearly) {
  if (kernels::cuda::DeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present";
  for (const char* command : {"decode --pair tiny --contexts 8 --batches 1 --fit_batch=false "
                              "--steps 1 --warmup 0 --bandwidth_mb 8",
                              "state --presets tiny --lengths 16"}) {
    const Result r = RunTool(std::string(command) + " --device cuda");
    EXPECT_NE(r.code, 0) << command;
    EXPECT_GT(r.code, 0) << "killed by a signal? " << r.output;  // -1: not a normal exit
    EXPECT_THAT(r.output, HasSubstr("--device cuda")) << command;
#if defined(SDM_HAVE_CUDA)
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_THAT(r.output, HasSubstr("no CUDA device")) << command;
#else
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_THAT(r.output, HasSubstr("built without CUDA")) << command;
#endif
    EXPECT_THAT(r.output, ::testing::Not(HasSubstr("ms/step"))) << "it measured something";
  }
  // auto falls back to the CPU.
  const Result r = RunTool(
      "decode --device auto --pair tiny --contexts 8 --batches 1 --fit_batch=false --steps 1 "
      "--warmup 0 --bandwidth_mb 8");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("# device: cpu (--device auto)"));
}

TEST_F(SdmBenchToolTest, KernelsNeedsCudaAndADevice) {
  if (kernels::cuda::DeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present";
  const Result r = RunTool("kernels --kernel_reps 1");
#if defined(SDM_HAVE_CUDA)
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("no CUDA device"));
#else
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("built without CUDA"));
#endif
}

}  // namespace
}  // namespace sdm
