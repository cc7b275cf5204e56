// sdm-bench: benchmarks of sdmserve (not tests; docs/benchmarks.md says how to reproduce each).
//
//   sdm-bench decode [--presets debug_sdm,debug] [--contexts 512,4096,16384]
//                    [--batches 1,4,8,16,32] [--steps 10] [--warmup 2] [--threads 0]
//                    [--state_budget_gb 8] [--seed 1] [--json FILE]
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "tools/sdm_bench/decode_benchmark.h"

ABSL_FLAG(std::vector<std::string>, presets, std::vector<std::string>({"debug_sdm", "debug"}),
          "Model presets to compare (random weights, built in memory)");
ABSL_FLAG(std::vector<std::string>, contexts, std::vector<std::string>({"512", "4096", "16384"}),
          "Context lengths reached by real prefill before each measurement");
ABSL_FLAG(std::vector<std::string>, batches, std::vector<std::string>({"1", "4", "8", "16", "32"}),
          "Decode batch sizes (sessions decoded together per step)");
ABSL_FLAG(int, steps, 10, "Timed decode steps per (context, batch)");
ABSL_FLAG(int, warmup, 2, "Untimed decode steps before timing");
ABSL_FLAG(int, threads, 0, "Engine threads (0: one per hardware thread)");
ABSL_FLAG(double, state_budget_gb, 8.0, "Skip batch sizes whose session state exceeds this");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the random weights and tokens");
ABSL_FLAG(std::string, json, "", "Also write the results as JSON to this file");

namespace {

bool ParseInts(const std::vector<std::string>& in, std::vector<int64_t>& out, const char* what) {
  out.clear();
  for (const std::string& s : in) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(s, &v) || v <= 0) {
      std::fprintf(stderr, "sdm-bench: --%s: '%s' is not a positive integer\n", what, s.c_str());
      return false;
    }
    out.push_back(v);
  }
  return !out.empty();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "sdmserve benchmarks.\n  sdm-bench decode [flags]   decode tokens/s vs batch and context");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2 || std::string(args[1]) != "decode") {
    std::fprintf(stderr, "usage: sdm-bench decode [flags]  (see --help)\n");
    return 2;
  }
  sdm::bench::DecodeBenchOptions opt;
  opt.presets = absl::GetFlag(FLAGS_presets);
  if (!ParseInts(absl::GetFlag(FLAGS_contexts), opt.contexts, "contexts") ||
      !ParseInts(absl::GetFlag(FLAGS_batches), opt.batches, "batches")) {
    return 2;
  }
  opt.steps = absl::GetFlag(FLAGS_steps);
  opt.warmup = absl::GetFlag(FLAGS_warmup);
  opt.threads = absl::GetFlag(FLAGS_threads);
  opt.state_budget_gb = absl::GetFlag(FLAGS_state_budget_gb);
  opt.seed = absl::GetFlag(FLAGS_seed);
  opt.json_path = absl::GetFlag(FLAGS_json);
  if (opt.steps < 1 || opt.warmup < 0) {
    std::fprintf(stderr, "sdm-bench: --steps must be >= 1 and --warmup >= 0\n");
    return 2;
  }
  absl::Status s = sdm::bench::RunDecodeBenchmark(opt);
  if (!s.ok()) {
    std::fprintf(stderr, "sdm-bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
