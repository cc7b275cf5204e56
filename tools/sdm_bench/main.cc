// sdm-bench: benchmarks of sdmserve (not tests; docs/benchmarks.md says how to reproduce each).
//
//   sdm-bench decode [--device auto|cpu|cuda] [--pair debug,cpu_hybrid] [--presets P,...]
//                    [--set key=value ...]
//                    [--contexts 512,2048,...] [--batches 1,4,16] [--fit_batch] [--max_batch 16]
//                    [--steps 10] [--warmup 2] [--threads 0] [--prefill_chunk 256]
//                    [--state_budget_gb 4] [--device_state_gb 0] [--seed 1]
//                    [--bandwidth_mb 512] [--json FILE] [--csv FILE] [--report DIR]
//   sdm-bench report --from results.json [--report DIR] [--json FILE] [--csv FILE]
//   sdm-bench state [--device auto|cpu|cuda] [--presets debug_sdm] [--lengths 128,1024,8192]
//                   [--full_table] [--dir DIR] [--json FILE]
//   sdm-bench cpu-attention [--presets debug] [--attention_contexts 8192]
//                           [--attention_batches 1,8] [--window 0] [--kernel_reps 20]
//                           [--kernel_warmup 3] [--threads 0] [--bandwidth_mb 512] [--seed 1]
//   sdm-bench cpu-gemm [--presets debug] [--gemm_batches 1,8] [--gemm_isas avx2,avx512]
//                      [--gemm_mb 256] [--kernel_reps 20]
//                      [--kernel_warmup 3] [--threads 0] [--seed 1]
//   sdm-bench kernels [--kernel_batches 1,8,64] [--kernel_context 32768] [--kernel_reps 20]
//                     [--kernel_warmup 3] [--bandwidth_mb 2048] [--seed 1] [--json FILE]
//
// Exit status: 0 on success, 2 on usage errors (including --device cuda or `kernels` on a build
// without CUDA), 1 when the benchmark fails (including "no CUDA device").
// Flags are Abseil flags, dispatched by subcommand by common/command_line.h: each subcommand
// accepts only its own (`sdm-bench SUBCOMMAND --help` lists them).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/command_line.h"
#include "engine/engine.h"
#include "tools/sdm_bench/cpu_attention_benchmark.h"
#include "tools/sdm_bench/cpu_gemm_benchmark.h"
#include "tools/sdm_bench/decode_benchmark.h"
#include "tools/sdm_bench/device_info.h"
#include "tools/sdm_bench/state_benchmark.h"

#if defined(SDM_HAVE_CUDA)
#include "tools/sdm_bench/kernel_benchmark.h"
#endif

ABSL_FLAG(std::string, device, "auto",
          "decode, state: where the engine runs: auto (CUDA when built with it and a device is "
          "present, else the CPU), cpu or cuda");
ABSL_FLAG(double, device_state_gb, 0,
          "decode on CUDA: device memory for sessions' state in GB (0: the engine's default share "
          "of what the weights leave free)");
ABSL_FLAG(std::vector<std::string>, kernel_batches, std::vector<std::string>({"1", "8", "64"}),
          "kernels: batch sizes of the SDM step, attention decode and GEMM microbenchmarks");
ABSL_FLAG(int64_t, kernel_context, 32768, "kernels: cached positions per attention sequence");
ABSL_FLAG(int, kernel_reps, 20, "kernels: timed repetitions (the median is reported)");
ABSL_FLAG(int, kernel_warmup, 3, "kernels: untimed repetitions first");

ABSL_FLAG(std::vector<std::string>, cpu_attention, std::vector<std::string>({"blocked"}),
          "decode: the CPU engine's decode attention kernel(s): blocked (the default) and/or "
          "per_head (the earlier kernel). With both, each model of a --presets group is measured "
          "with each, interleaved (the per_head copy named MODEL[per_head]); pairs use the first");
ABSL_FLAG(std::string, cpu_dtype, sdm::CpuDtypeName(sdm::EngineOptions{}.cpu_dtype),
          "decode: how the CPU engine stores matrices and KV rows: fp32 or bf16 (SDM rows stay "
          "fp32); the byte model counts the same");
ABSL_FLAG(std::vector<std::string>, attention_contexts, std::vector<std::string>({"8192"}),
          "cpu-attention: cached positions per session");
ABSL_FLAG(std::vector<std::string>, attention_batches, std::vector<std::string>({"1", "8"}),
          "cpu-attention: sessions per call");
ABSL_FLAG(std::vector<std::string>, gemm_batches, std::vector<std::string>({"1", "8"}),
          "cpu-gemm: rows per multiplication");
ABSL_FLAG(
    std::vector<std::string>, gemm_isas, std::vector<std::string>({}),
    "cpu-gemm: instruction sets to compare (generic, avx2, avx512; default: every available)");
ABSL_FLAG(int64_t, gemm_mb, 256,
          "cpu-gemm: fp32 megabytes of packed matrices (a preset's layers, repeated)");
ABSL_FLAG(int64_t, window, 0,
          "cpu-attention: a sliding window (0: full attention), over a ring of window + 256 slots");
ABSL_FLAG(std::vector<std::string>, pair, std::vector<std::string>({}),
          "Named pairs (SDM model vs its full-attention twin): tiny, debug, cpu_hybrid, flagship, "
          "7b. Default: debug,cpu_hybrid when --presets is not given either");
ABSL_FLAG(std::vector<std::string>, presets, std::vector<std::string>({}),
          "An explicit list of presets measured together (random weights, built in memory)");
ABSL_FLAG(sdm::cli::RepeatedFlag, set, {},
          "Overrides a config field of every model, as sdm-model does (repeatable: --set "
          "n_layers=4 --set swa_at=[0,1]; for a pair, of the SDM model before its twin is "
          "derived)");
ABSL_FLAG(std::vector<std::string>, contexts, std::vector<std::string>({}),
          "Context lengths reached by real prefill before each measurement (default: each "
          "pair's own list)");
ABSL_FLAG(std::vector<std::string>, batches, std::vector<std::string>({"1", "4", "16"}),
          "Decode batch sizes (sessions decoded together per step)");
ABSL_FLAG(bool, fit_batch, true,
          "Also measure the largest batch whose session state fits --state_budget_gb");
ABSL_FLAG(int64_t, max_batch, 16, "Cap on the --fit_batch batch");
ABSL_FLAG(int, steps, 10, "Timed decode steps per (model, context, batch)");
ABSL_FLAG(int, warmup, 2, "Untimed decode steps before timing");
ABSL_FLAG(int, threads, 0, "Engine threads (0: one per hardware thread)");
ABSL_FLAG(int64_t, prefill_chunk, 256, "The engine's prefill chunk (tokens)");
ABSL_FLAG(bool, cuda_graphs, sdm::EngineOptions{}.cuda_graphs,
          "CUDA: run decode steps as CUDA graphs (false: every kernel launched, for comparison)");
ABSL_FLAG(double, state_budget_gb, 4.0,
          "Per model: skip batch sizes whose session state exceeds this many GB (a pair holds both "
          "models' batches at once)");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the random weights and tokens");
ABSL_FLAG(int64_t, bandwidth_mb, 512,
          "Size (MiB) of each of the two buffers of the memory-bandwidth measurement (kernels: "
          "raised to at least 2048, the size its GPU copy figure is quoted at)");
ABSL_FLAG(std::string, json, "", "Also write the results as JSON to this file");
ABSL_FLAG(std::string, csv, "", "Also write the results as CSV to this file");
ABSL_FLAG(std::string, report, "",
          "Write report.md, results.json, results.csv and PNG plots into this directory");
ABSL_FLAG(std::string, python, "/usr/bin/python3", "Python with matplotlib, for the plots");
ABSL_FLAG(std::vector<std::string>, lengths, std::vector<std::string>({}),
          "state: history lengths (default 128,1024,8192)");
ABSL_FLAG(std::string, dir, "",
          "state: where to write snapshots (the disk to measure): a directory of its own is made "
          "in it and removed at the end (default: in the temporary directory)");
ABSL_FLAG(bool, full_table, false,
          "state: also park and resume a session whose SDM tables hold every slot (random rows): "
          "the most a park or resume moves, converted in the step and staged ahead");
ABSL_FLAG(std::string, from, "", "report: the JSON document of an earlier decode run");
ABSL_FLAG(std::string, plot_script, "",
          "plot_decode.py (default: next to the binary, else in the source tree)");

namespace {

bool ParseInts(const std::vector<std::string>& in, std::vector<int64_t>& out, const char* what,
               bool allow_empty) {
  out.clear();
  for (const std::string& s : in) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(s, &v) || v <= 0) {
      std::fprintf(stderr, "sdm-bench: --%s: '%s' is not a positive integer\n", what, s.c_str());
      return false;
    }
    out.push_back(v);
  }
  if (out.empty() && !allow_empty) {
    std::fprintf(stderr, "sdm-bench: --%s needs at least one value\n", what);
    return false;
  }
  return true;
}

// The exit status of a failed run: 2 for usage errors (a bad flag value, a device this build
// cannot have), 1 otherwise.
int ExitCode(const absl::Status& s) {
  return absl::IsNotFound(s) || absl::IsInvalidArgument(s) || absl::IsUnimplemented(s) ? 2 : 1;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "sdm-bench: %s\n", std::string(s.message()).c_str());
  return ExitCode(s);
}

// --device, or a usage error.
absl::StatusOr<sdm::EngineDevice> DeviceFromFlag() {
  absl::StatusOr<sdm::EngineDevice> device = sdm::ParseEngineDevice(absl::GetFlag(FLAGS_device));
  if (!device.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--device: ", device.status().message()));
  }
  return device;
}

int RunKernels(const std::string& command_line) {
#if defined(SDM_HAVE_CUDA)
  sdm::bench::KernelBenchOptions ko;
  if (!ParseInts(absl::GetFlag(FLAGS_kernel_batches), ko.batches, "kernel_batches", false)) {
    return 2;
  }
  ko.context = absl::GetFlag(FLAGS_kernel_context);
  ko.reps = absl::GetFlag(FLAGS_kernel_reps);
  ko.warmup = absl::GetFlag(FLAGS_kernel_warmup);
  ko.copy_mb = std::max<int64_t>(absl::GetFlag(FLAGS_bandwidth_mb), 2048);
  ko.seed = absl::GetFlag(FLAGS_seed);
  ko.json_path = absl::GetFlag(FLAGS_json);
  ko.command_line = command_line;
  if (ko.context < 1 || ko.reps < 1 || ko.warmup < 0) {
    std::fprintf(stderr,
                 "sdm-bench kernels: --kernel_context and --kernel_reps must be >= 1, "
                 "--kernel_warmup >= 0\n");
    return 2;
  }
  const absl::Status s = sdm::bench::RunKernelBenchmark(ko);
  return s.ok() ? 0 : Fail(s);
#else
  std::fprintf(stderr,
               "sdm-bench kernels: this sdm-bench was built without CUDA (configure where nvcc "
               "is found, with -DSDM_CUDA=ON)\n");
  return 2;
#endif
}

int RunCpuAttention() {
  sdm::bench::CpuAttentionBenchOptions o;
  if (!absl::GetFlag(FLAGS_presets).empty()) o.preset = absl::GetFlag(FLAGS_presets).front();
  if (!ParseInts(absl::GetFlag(FLAGS_attention_contexts), o.contexts, "attention_contexts",
                 false) ||
      !ParseInts(absl::GetFlag(FLAGS_attention_batches), o.batches, "attention_batches", false)) {
    return 2;
  }
  o.window = absl::GetFlag(FLAGS_window);
  o.reps = absl::GetFlag(FLAGS_kernel_reps);
  o.warmup = absl::GetFlag(FLAGS_kernel_warmup);
  o.threads = absl::GetFlag(FLAGS_threads);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.bandwidth_mb = absl::GetFlag(FLAGS_bandwidth_mb);
  if (o.window < 0 || o.reps < 1 || o.warmup < 0 || o.bandwidth_mb < 1) {
    std::fprintf(stderr,
                 "sdm-bench cpu-attention: --window must be >= 0, --kernel_reps and "
                 "--bandwidth_mb >= 1, --kernel_warmup >= 0\n");
    return 2;
  }
  const absl::Status s = sdm::bench::RunCpuAttentionBenchmark(o);
  return s.ok() ? 0 : Fail(s);
}

int RunCpuGemm() {
  sdm::bench::CpuGemmBenchOptions o;
  if (!absl::GetFlag(FLAGS_presets).empty()) o.preset = absl::GetFlag(FLAGS_presets).front();
  if (!ParseInts(absl::GetFlag(FLAGS_gemm_batches), o.batches, "gemm_batches", false)) return 2;
  o.isas = absl::GetFlag(FLAGS_gemm_isas);
  o.megabytes = absl::GetFlag(FLAGS_gemm_mb);
  o.reps = absl::GetFlag(FLAGS_kernel_reps);
  o.warmup = absl::GetFlag(FLAGS_kernel_warmup);
  o.threads = absl::GetFlag(FLAGS_threads);
  o.seed = absl::GetFlag(FLAGS_seed);
  if (o.megabytes < 1 || o.reps < 1 || o.warmup < 0) {
    std::fprintf(stderr,
                 "sdm-bench cpu-gemm: --gemm_mb and --kernel_reps must be >= 1, --kernel_warmup "
                 ">= 0\n");
    return 2;
  }
  const absl::Status s = sdm::bench::RunCpuGemmBenchmark(o);
  return s.ok() ? 0 : Fail(s);
}

int RunState() {
  absl::StatusOr<sdm::EngineDevice> device = DeviceFromFlag();
  if (!device.ok()) return Fail(device.status());
  // Fail before building any model when the device cannot be had.
  if (absl::StatusOr<sdm::EngineDevice> resolved = sdm::bench::ResolveBenchDevice(*device);
      !resolved.ok()) {
    return Fail(resolved.status());
  }
  sdm::bench::StateBenchOptions so;
  so.device = *device;
  if (!absl::GetFlag(FLAGS_presets).empty()) so.presets = absl::GetFlag(FLAGS_presets);
  if (!absl::GetFlag(FLAGS_lengths).empty() &&
      !ParseInts(absl::GetFlag(FLAGS_lengths), so.lengths, "lengths", false)) {
    return 2;
  }
  so.threads = absl::GetFlag(FLAGS_threads);
  so.seed = absl::GetFlag(FLAGS_seed);
  so.dir = absl::GetFlag(FLAGS_dir);
  so.json_path = absl::GetFlag(FLAGS_json);
  so.full_table = absl::GetFlag(FLAGS_full_table);
  const absl::Status s = sdm::bench::RunStateBenchmark(so);
  if (!s.ok()) std::fprintf(stderr, "sdm-bench: %s\n", std::string(s.message()).c_str());
  return s.ok() ? 0 : ExitCode(s);  // an unknown preset is a usage error, as for decode
}

// The decode options from the flags (`report` uses only its output flags), or a usage error.
absl::StatusOr<sdm::bench::DecodeBenchOptions> DecodeOptionsFromFlags(
    const std::string& command_line) {
  absl::StatusOr<sdm::EngineDevice> device = DeviceFromFlag();
  if (!device.ok()) return device.status();
  sdm::bench::DecodeBenchOptions opt;
  opt.device = *device;
  opt.device_state_gb = absl::GetFlag(FLAGS_device_state_gb);
  opt.pairs = absl::GetFlag(FLAGS_pair);
  opt.presets = absl::GetFlag(FLAGS_presets);
  if (opt.pairs.empty() && opt.presets.empty()) opt.pairs = {"debug", "cpu_hybrid"};
  opt.overrides = absl::GetFlag(FLAGS_set).values;
  opt.cpu_attention.clear();
  for (const std::string& k : absl::GetFlag(FLAGS_cpu_attention)) {
    if (k == "blocked") {
      opt.cpu_attention.push_back(sdm::CpuDecodeAttention::kBlocked);
    } else if (k == "per_head") {
      opt.cpu_attention.push_back(sdm::CpuDecodeAttention::kPerHead);
    } else {
      std::fprintf(stderr, "sdm-bench: --cpu_attention: '%s' is not blocked or per_head\n",
                   k.c_str());
      return absl::InvalidArgumentError("");
    }
  }
  {
    absl::StatusOr<sdm::DType> dtype = sdm::ParseCpuDtype(absl::GetFlag(FLAGS_cpu_dtype));
    if (!dtype.ok()) {
      std::fprintf(stderr, "sdm-bench: --cpu_dtype: %s\n",
                   std::string(dtype.status().message()).c_str());
      return absl::InvalidArgumentError("");
    }
    opt.cpu_dtype = *dtype;
  }
  if (opt.cpu_attention.empty()) {
    std::fprintf(stderr, "sdm-bench: --cpu_attention needs at least one value\n");
    return absl::InvalidArgumentError("");
  }
  if (!ParseInts(absl::GetFlag(FLAGS_contexts), opt.contexts, "contexts", true) ||
      !ParseInts(absl::GetFlag(FLAGS_batches), opt.batches, "batches", false)) {
    return absl::InvalidArgumentError("");  // ParseInts said why
  }
  opt.fit_batch = absl::GetFlag(FLAGS_fit_batch);
  opt.max_batch = absl::GetFlag(FLAGS_max_batch);
  opt.steps = absl::GetFlag(FLAGS_steps);
  opt.warmup = absl::GetFlag(FLAGS_warmup);
  opt.threads = absl::GetFlag(FLAGS_threads);
  opt.prefill_chunk = absl::GetFlag(FLAGS_prefill_chunk);
  opt.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
  opt.state_budget_gb = absl::GetFlag(FLAGS_state_budget_gb);
  opt.seed = absl::GetFlag(FLAGS_seed);
  opt.bandwidth_mb = absl::GetFlag(FLAGS_bandwidth_mb);
  opt.json_path = absl::GetFlag(FLAGS_json);
  opt.csv_path = absl::GetFlag(FLAGS_csv);
  opt.report_dir = absl::GetFlag(FLAGS_report);
  opt.python = absl::GetFlag(FLAGS_python);
  opt.plot_script = absl::GetFlag(FLAGS_plot_script);
  opt.command_line = command_line;
  if (opt.steps < 1 || opt.warmup < 0 || opt.max_batch < 1 || opt.prefill_chunk < 1 ||
      opt.bandwidth_mb < 1 || !(opt.state_budget_gb > 0) || !(opt.device_state_gb >= 0)) {
    return absl::InvalidArgumentError(
        "--steps, --max_batch, --prefill_chunk and --bandwidth_mb must be >= 1, --warmup >= 0, "
        "--state_budget_gb > 0 and --device_state_gb >= 0");
  }
  return opt;
}

int RunDecode(const std::string& command_line) {
  absl::StatusOr<sdm::bench::DecodeBenchOptions> opt = DecodeOptionsFromFlags(command_line);
  if (!opt.ok()) return opt.status().message().empty() ? 2 : Fail(opt.status());
  // Fail before building any model when the device cannot be had.
  if (absl::StatusOr<sdm::EngineDevice> resolved = sdm::bench::ResolveBenchDevice(opt->device);
      !resolved.ok()) {
    return Fail(resolved.status());
  }
  const absl::Status s = sdm::bench::RunDecodeBenchmark(*opt);
  return s.ok() ? 0 : Fail(s);
}

int RunReport(const std::string& command_line) {
  const std::string from = absl::GetFlag(FLAGS_from);
  if (from.empty()) return sdm::cli::UsageError("sdm-bench", "report", "--from FILE is required");
  absl::StatusOr<sdm::bench::DecodeBenchOptions> opt = DecodeOptionsFromFlags(command_line);
  if (!opt.ok()) return opt.status().message().empty() ? 2 : Fail(opt.status());
  const absl::Status s = sdm::bench::RenderFromJson(from, *opt);
  if (!s.ok()) {
    std::fprintf(stderr, "sdm-bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // `serve` is the gRPC load generator, a sibling binary (sdm-bench-serve, built with the server):
  // sdm-bench itself stays free of gRPC.
  constexpr char kServe[] = "serve";
  if (argc > 1 && std::strcmp(argv[1], kServe) == 0) {
    const std::string serve =
        (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "sdm-bench-serve")
            .string();
    execv(serve.c_str(), argv + 1);
    std::perror((serve + " (built only with -DSDM_SERVER=ON)").c_str());
    return 1;
  }
  // The command as typed, with the binary's directory dropped (recorded in the reports).
  std::vector<std::string> all_args(argv, argv + argc);
  all_args[0] = std::filesystem::path(all_args[0]).filename().string();
  const std::string command_line = absl::StrJoin(all_args, " ");

  const std::vector<std::string> output_flags = {"json", "csv", "report", "python", "plot_script"};
  std::vector<std::string> decode_flags = {
      "device",       "device_state_gb", "pair",          "presets",         "set",
      "contexts",     "batches",         "fit_batch",     "max_batch",       "steps",
      "warmup",       "threads",         "prefill_chunk", "state_budget_gb", "seed",
      "bandwidth_mb", "cpu_attention",   "cpu_dtype",     "cuda_graphs"};
  decode_flags.insert(decode_flags.end(), output_flags.begin(), output_flags.end());
  std::vector<std::string> report_flags = {"from"};
  report_flags.insert(report_flags.end(), output_flags.begin(), output_flags.end());

  sdm::cli::Program program;
  program.name = "sdm-bench";
  program.footer =
      "sdm-bench serve [flags]: the load generator against a running sdm-server (the binary "
      "sdm-bench-serve, built with the server; 'sdm-bench serve --help' lists its flags).\n"
      "docs/benchmarks.md says how to reproduce each benchmark.";
  program.other_subcommands = {kServe};
  program.subcommands = {
      {"decode",
       "sdm-bench decode [--device auto|cpu|cuda] [--pair debug,cpu_hybrid] [--presets P,...] "
       "[--set key=value ...] [--contexts 512,2048,...] [--batches 1,4,16] [--report DIR] "
       "[flags]",
       "Decode tokens/s of SDM models against their full-attention twins, vs context length and "
       "batch size (docs/benchmarks.md); --device auto is CUDA when this build has it and a "
       "device is present.",
       decode_flags, /*max_positional=*/0,
       [&](const sdm::cli::ParsedArgs&) { return RunDecode(command_line); }},
      {"report", "sdm-bench report --from results.json [--report DIR] [--json FILE] [--csv FILE]",
       "Renders the report, plots and files of an earlier decode run again.", report_flags,
       /*max_positional=*/0, [&](const sdm::cli::ParsedArgs&) { return RunReport(command_line); }},
      {"state",
       "sdm-bench state [--device auto|cpu|cuda] [--presets debug_sdm] [--lengths "
       "128,1024,8192] [--full_table] [--dir DIR] [--json FILE]",
       "What a session's state costs and how fast it parks and resumes against re-prefill.",
       {"device", "presets", "lengths", "threads", "seed", "dir", "json", "full_table"},
       /*max_positional=*/0,
       [](const sdm::cli::ParsedArgs&) { return RunState(); }},
      {"cpu-attention",
       "sdm-bench cpu-attention [--presets debug] [--attention_contexts 8192] "
       "[--attention_batches 1,8] [--window 0] [flags]",
       "The CPU decode attention kernels alone (blocked and per-head, interleaved): GB/s on the "
       "KV bytes read against the streaming-read bandwidth measured in the same run.",
       {"presets", "attention_contexts", "attention_batches", "window", "kernel_reps",
        "kernel_warmup", "threads", "seed", "bandwidth_mb"},
       /*max_positional=*/0,
       [](const sdm::cli::ParsedArgs&) { return RunCpuAttention(); }},
      {"cpu-gemm",
       "sdm-bench cpu-gemm [--presets debug] [--gemm_batches 1,8] [--gemm_mb 256] [flags]",
       "The CPU batch-invariant GEMM alone, every available instruction set (generic, avx2, "
       "avx512) interleaved, fp32 and bf16 panels: ms and GB/s per pass over a preset's "
       "matrices.",
       {"presets", "gemm_batches", "gemm_isas", "gemm_mb", "kernel_reps", "kernel_warmup",
        "threads", "seed"},
       /*max_positional=*/0,
       [](const sdm::cli::ParsedArgs&) { return RunCpuGemm(); }},
      {"kernels",
       "sdm-bench kernels [--kernel_batches 1,8,64] [--kernel_context 32768] [--kernel_reps 20] "
       "[--kernel_warmup 3] [--bandwidth_mb 2048] [--seed 1] [--json FILE]",
       "CUDA microbenchmarks (copy, SDM step, attention decode, park and resume, stacked and "
       "separate GEMMs) against the device's copy bandwidth (CUDA builds only).",
       {"kernel_batches", "kernel_context", "kernel_reps", "kernel_warmup", "bandwidth_mb", "seed",
        "json"},
       /*max_positional=*/0,
       [&](const sdm::cli::ParsedArgs&) { return RunKernels(command_line); }},
  };
  return sdm::cli::RunProgram(program, argc, argv);
}
