// sdm-model: creates randomly initialised model directories and describes models.
//
//   sdm-model init --preset NAME --seed S --out DIR [--set key=value ...] [--dtype fp32|bf16]
//                  [--force]
//   sdm-model info DIR
//   sdm-model info --preset NAME [--set key=value ...]
//
// Exit status: 0 on success, 2 on usage errors (bad flags, unknown preset, invalid override),
// 1 on failures (I/O, a non-empty output directory without --force, a malformed model).
// Flags are Abseil flags, dispatched by subcommand by common/command_line.h; `sdm-model help` and
// `sdm-model SUBCOMMAND --help` document them.
// docs/model-format.md describes the directory format and these commands.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/command_line.h"
#include "engine/model_config.h"
#include "engine/model_writer.h"
#include "engine/safetensors.h"
#include "engine/weight_file_check.h"
#include "engine/weight_spec.h"

ABSL_FLAG(std::string, preset, "", "init (required), info: the preset the config starts from.");
ABSL_FLAG(std::optional<uint64_t>, seed, std::nullopt,
          "init (required): seed of the random weights; the same seed gives the same weights.");
ABSL_FLAG(std::string, out, "",
          "init (required): the model directory to write; it must be empty or absent unless "
          "--force.");
ABSL_FLAG(sdm::cli::RepeatedFlag, set, {},
          "Overrides a config field (repeatable; dotted keys reach sdm_args, values are JSON): "
          "--set n_layers=2 --set sdm_at=[1] --set sdm_args.num_writes=16.");
ABSL_FLAG(std::string, dtype, "",
          "init: fp32 or bf16 (default: fp32 below 1e9 parameters, bf16 above).");
ABSL_FLAG(bool, force, false,
          "init: write into a non-empty directory (its config.json and model.safetensors are "
          "overwritten).");

namespace sdm {
namespace {

using cli::kExitFailure;
using cli::kExitOk;

int UsageError(absl::string_view subcommand, const std::string& message) {
  return cli::UsageError("sdm-model", subcommand, message);
}

int Failure(const std::string& message) {
  std::fprintf(stderr, "sdm-model: %s\n", message.c_str());
  return kExitFailure;
}

// ---- Formatting ----

std::string Commas(int64_t n) {
  std::string digits = absl::StrCat(n < 0 ? -n : n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

std::string HumanCount(double n) {
  if (n >= 1e9) return absl::StrFormat("%.2f B", n / 1e9);
  if (n >= 1e6) return absl::StrFormat("%.2f M", n / 1e6);
  if (n >= 1e3) return absl::StrFormat("%.1f K", n / 1e3);
  return absl::StrFormat("%.0f", n);
}

// Decimal units, as docs/model-spec.md §8 quotes sizes (24.6 KB = 24,576 bytes).
std::string HumanBytes(double bytes) {
  if (bytes >= 1e9) return absl::StrFormat("%.2f GB", bytes / 1e9);
  if (bytes >= 1e6) return absl::StrFormat("%.2f MB", bytes / 1e6);
  if (bytes >= 1e3) return absl::StrFormat("%.1f KB", bytes / 1e3);
  return absl::StrFormat("%.0f B", bytes);
}

// ---- Config from a preset and overrides ----

// The config of --preset with every --set applied (all at once: moving layers between lists
// takes several assignments). Usage errors (unknown preset, bad override) come back as
// InvalidArgument/NotFound.
absl::StatusOr<ModelConfig> ConfigFromFlags() {
  const std::string preset = absl::GetFlag(FLAGS_preset);
  if (preset.empty()) return absl::InvalidArgumentError("--preset is required");
  auto config = PresetConfig(preset);
  if (!config.ok()) return config.status();
  if (auto s = ApplyConfigOverrides(*config, absl::GetFlag(FLAGS_set).values); !s.ok()) return s;
  return config;
}

// ---- init ----

// A progress line on stderr: redrawn in place on a terminal, a line per 10% otherwise.
class ProgressBar {
 public:
  ProgressBar(bool show, bool tty) : show_(show), tty_(tty), start_(Clock::now()) {}

  void Update(int64_t written, int64_t total) {
    if (!show_ || total <= 0) return;
    const double seconds = Seconds();
    const double fraction = static_cast<double>(written) / static_cast<double>(total);
    if (tty_) {
      if (written < total && seconds - last_draw_ < 0.1) return;
      last_draw_ = seconds;
      constexpr int kWidth = 30;
      const int filled = static_cast<int>(fraction * kWidth);
      std::fprintf(stderr, "\r%5.1f%% [%s%s] %9.1f / %.1f MB  %7.1f MB/s", 100 * fraction,
                   std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(),
                   written / 1e6, total / 1e6, Rate(written, seconds));
      if (written == total) std::fputc('\n', stderr);
    } else {
      const int decile = static_cast<int>(fraction * 10);
      if (decile <= last_decile_) return;
      last_decile_ = decile;
      std::fprintf(stderr, "%5.1f%%  %.1f / %.1f MB  %.1f MB/s\n", 100 * fraction, written / 1e6,
                   total / 1e6, Rate(written, seconds));
    }
    std::fflush(stderr);
  }

  double Seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  static double Rate(int64_t bytes, double seconds) {
    return seconds > 0 ? bytes / 1e6 / seconds : 0.0;
  }

 private:
  using Clock = std::chrono::steady_clock;
  bool show_;
  bool tty_;
  Clock::time_point start_;
  double last_draw_ = -1;
  int last_decile_ = 0;
};

int Init() {
  constexpr absl::string_view kSub = "init";
  auto config = ConfigFromFlags();
  if (!config.ok()) return UsageError(kSub, std::string(config.status().message()));
  const std::optional<uint64_t> seed = absl::GetFlag(FLAGS_seed);
  if (!seed.has_value()) return UsageError(kSub, "--seed is required");
  if (absl::GetFlag(FLAGS_out).empty()) return UsageError(kSub, "--out is required");
  const std::filesystem::path dir = absl::GetFlag(FLAGS_out);

  TensorDtype dtype = DefaultModelDtype(*config);
  if (const std::string d = absl::GetFlag(FLAGS_dtype); !d.empty()) {
    if (d == "fp32" || d == "f32") {
      dtype = TensorDtype::kF32;
    } else if (d == "bf16") {
      dtype = TensorDtype::kBF16;
    } else {
      return UsageError(kSub, absl::StrCat("--dtype must be fp32 or bf16, got '", d, "'"));
    }
  }

  std::error_code ec;
  if (std::filesystem::exists(dir, ec)) {
    if (!std::filesystem::is_directory(dir, ec)) {
      return Failure(absl::StrCat(dir.string(), " exists and is not a directory"));
    }
    if (!std::filesystem::is_empty(dir, ec) && !absl::GetFlag(FLAGS_force)) {
      return Failure(absl::StrCat(dir.string(),
                                  " is not empty; refusing to write into it (use --force to "
                                  "overwrite its config.json and model.safetensors)"));
    }
  } else {
    std::filesystem::create_directories(dir, ec);
    if (ec) return Failure(absl::StrCat("cannot create ", dir.string(), ": ", ec.message()));
  }

  const ParameterCounts params = CountParameters(*config);
  const int64_t total_bytes = params.total * TensorDtypeSize(dtype);
  ProgressBar bar(/*show=*/isatty(STDERR_FILENO) || total_bytes > 256'000'000,
                  /*tty=*/isatty(STDERR_FILENO));
  RandomModelOptions options;
  options.seed = *seed;
  options.dtype = dtype;
  options.progress = [&](int64_t written, int64_t total) { bar.Update(written, total); };
  options.metadata["generator"] = "sdm-model init";
  options.metadata["preset"] = absl::GetFlag(FLAGS_preset);
  if (auto s = WriteRandomModel(*config, dir, options); !s.ok()) {
    return Failure(std::string(s.message()));
  }
  const double seconds = bar.Seconds();
  std::fprintf(stderr, "wrote %s: %zu tensors, %s parameters, %s (%s) in %.1f s (%.1f MB/s)\n",
               dir.string().c_str(), ExpectedTensors(*config).size(), Commas(params.total).c_str(),
               HumanBytes(static_cast<double>(total_bytes)).c_str(),
               std::string(TensorDtypeName(dtype)).c_str(), seconds,
               ProgressBar::Rate(total_bytes, seconds));
  if (config->tokenizer.name == "sp") {
    std::fprintf(stderr, "note: the config names a SentencePiece tokenizer; copy it to %s\n",
                 (dir / config->tokenizer.path).string().c_str());
  }
  return 0;
}

// ---- info ----

std::string AttentionLine(const ModelConfig& c, int64_t layer) {
  const AttentionGeometry g = AttentionGeometryOf(c, layer);
  std::string s =
      absl::StrCat(g.n_heads, " q / ", g.n_kv_heads, " kv heads, head_dim ", g.head_dim);
  if (g.window > 0) absl::StrAppend(&s, ", window ", g.window);
  if (c.attn_gate) absl::StrAppend(&s, ", output gate");
  return s;
}

std::string SdmLine(const ModelConfig& c) {
  const SdmGeometry g = SdmGeometryOf(c);
  const SdmArgs& a = c.sdm;
  std::string s =
      absl::StrCat("H=", g.heads, ", s=", g.side, " (", Commas(g.slots_per_head),
                   " slots/head), hd=", g.head_width, ", W=", a.num_writes, ", R=", a.num_reads);
  std::vector<std::string> flags;
  if (a.backprop_on_memory) flags.push_back("learned M0");
  if (a.normalize_readings) flags.push_back("normalize_readings");
  if (a.output_gate) flags.push_back("output_gate");
  if (a.query_batchnorm) flags.push_back("query_batchnorm");
  if (a.key_weighted_decay) flags.push_back("key_weighted_decay");
  if (a.update_rule == UpdateRule::kSlotResidual) flags.push_back("update_rule slot_residual");
  if (!flags.empty()) absl::StrAppend(&s, "; ", absl::StrJoin(flags, ", "));
  return s;
}

void PrintConfig(const ModelConfig& c) {
  std::printf("  dim              %lld\n", static_cast<long long>(c.dim));
  std::printf("  vocab_size       %lld (tokenizer %s%s)\n", static_cast<long long>(c.vocab_size),
              c.tokenizer.name.c_str(),
              c.tokenizer.name == "sp" ? (", " + c.tokenizer.path).c_str() : "");
  std::printf("  ffn hidden       %lld (SwiGLU)\n", static_cast<long long>(FfnHiddenDim(c)));
  std::printf("  norm_eps         %g, rope_theta %g, weight_tying %s\n", c.norm_eps, c.rope_theta,
              c.weight_tying ? "true" : "false");
  std::vector<std::string> names;
  for (LayerType t : c.layer_types) names.emplace_back(LayerTypeName(t));
  std::printf("  layers           %lld: %s\n", static_cast<long long>(c.n_layers),
              absl::StrJoin(names, " ").c_str());
  // Each type once (the geometry depends only on the type), with the layers that have it.
  for (LayerType type : {LayerType::kAttn, LayerType::kSwa, LayerType::kSdm}) {
    std::vector<std::string> runs;
    int64_t count = 0, first = -1;
    for (int64_t i = 0; i < c.n_layers; ++i) {
      if (c.layer_types[i] != type) continue;
      ++count;
      if (first < 0) first = i;
      int64_t j = i;
      while (j + 1 < c.n_layers && c.layer_types[j + 1] == type) ++j;
      runs.push_back(i == j ? absl::StrCat(i) : absl::StrCat(i, "-", j));
      count += j - i;
      i = j;
    }
    if (count == 0) continue;
    std::printf("    %-4s x%-3lld %s\n", std::string(LayerTypeName(type)).c_str(),
                static_cast<long long>(count),
                (type == LayerType::kSdm ? SdmLine(c) : AttentionLine(c, first)).c_str());
    std::printf("               layers %s\n", absl::StrJoin(runs, ",").c_str());
  }
}

void PrintSizes(const ModelConfig& c) {
  const ParameterCounts p = CountParameters(c);
  std::printf("parameters\n");
  std::printf("  total            %s (%s)\n", Commas(p.total).c_str(), HumanCount(p.total).c_str());
  std::printf("  without M0       %s (%s)\n", Commas(p.without_m0).c_str(),
              HumanCount(p.without_m0).c_str());
  std::printf("  M0 (SDM memory)  %s (%s)\n", Commas(p.m0).c_str(), HumanCount(p.m0).c_str());

  const int64_t state = SdmStateElements(c);
  const int64_t kv = FullAttentionKvElementsPerToken(c);
  std::printf("per session\n");
  if (state > 0) {
    std::printf("  SDM state        %s elements (%s): %s bf16, %s fp32\n", Commas(state).c_str(),
                HumanCount(state).c_str(), HumanBytes(2.0 * state).c_str(),
                HumanBytes(4.0 * state).c_str());
    if (kv > 0) {
      std::printf("                   = %s tokens of this model's full-attention KV cache\n",
                  Commas(state / kv).c_str());
    }
  } else {
    std::printf("  SDM state        none (no sdm layers)\n");
  }
  int64_t swa = 0;
  for (int64_t i = 0; i < c.n_layers; ++i) {
    if (c.layer_types[i] != LayerType::kSwa) continue;
    const AttentionGeometry g = AttentionGeometryOf(c, i);
    swa += g.window * 2 * g.n_kv_heads * g.head_dim;
  }
  if (swa > 0) {
    std::printf("  SWA KV (full)    %s elements: %s bf16, %s fp32\n", Commas(swa).c_str(),
                HumanBytes(2.0 * swa).c_str(), HumanBytes(4.0 * swa).c_str());
  }
  if (kv > 0) {
    std::printf("  full-attn KV     %s elements per token: %s bf16, %s fp32 per token\n",
                Commas(kv).c_str(), HumanBytes(2.0 * kv).c_str(), HumanBytes(4.0 * kv).c_str());
  } else {
    std::printf("  full-attn KV     none (no attn layers)\n");
  }
}

// Describes the weight file from its header alone; false when it does not fit the config.
bool PrintWeightFile(const ModelConfig& c, const std::filesystem::path& file) {
  std::printf("weights\n");
  auto index = ReadSafetensorsIndex(file);
  if (!index.ok()) {
    std::printf("  error            %s\n", std::string(index.status().message()).c_str());
    return false;
  }
  std::map<std::string, int64_t> per_dtype;
  for (const SafetensorsEntry& e : index->tensors) {
    per_dtype[std::string(TensorDtypeName(e.dtype))] += e.num_elements;
  }
  std::vector<std::string> dtypes;
  for (const auto& [name, n] : per_dtype) dtypes.push_back(absl::StrCat(name, " x ", Commas(n)));
  std::printf("  file             %s: %s, %zu tensors\n", file.string().c_str(),
              HumanBytes(static_cast<double>(index->file_size)).c_str(), index->tensors.size());
  std::printf("  dtype            %s\n", per_dtype.size() == 1
                                             ? per_dtype.begin()->first.c_str()
                                             : absl::StrJoin(dtypes, ", ").c_str());
  for (const auto& [key, value] : index->metadata) {
    std::printf("  metadata         %s = %s\n", key.c_str(), value.c_str());
  }
  absl::Status check = CheckTensorsMatchSpec(file.string(), *index, ExpectedTensors(c));
  std::printf("  check            %s\n", check.ok() ? "names and shapes match the config"
                                                    : std::string(check.message()).c_str());
  return check.ok();
}

int Info(const cli::ParsedArgs& args) {
  constexpr absl::string_view kSub = "info";
  const bool from_preset = args.given.contains("preset");
  if (from_preset == (args.positional.size() == 1)) {
    return UsageError(kSub, "info takes a model directory or --preset NAME");
  }
  if (!from_preset && args.given.contains("set")) {
    return UsageError(kSub, "--set applies to --preset only");
  }
  ModelConfig config;
  std::filesystem::path dir;
  if (from_preset) {
    auto c = ConfigFromFlags();
    if (!c.ok()) return UsageError(kSub, std::string(c.status().message()));
    config = *std::move(c);
    std::printf("model: preset %s\n", absl::GetFlag(FLAGS_preset).c_str());
  } else {
    dir = args.positional.front();
    const std::filesystem::path path = dir / "config.json";
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) {
      return Failure(
          absl::StrCat(path.string(), ": not found (is ", dir.string(), " a model directory?)"));
    }
    std::ifstream in(path, std::ios::binary);
    if (!in) return Failure(absl::StrCat(path.string(), ": cannot read"));
    std::stringstream text;
    text << in.rdbuf();
    auto c = ParseModelConfig(text.str());
    if (!c.ok()) return Failure(absl::StrCat(path.string(), ": ", c.status().message()));
    config = *std::move(c);
    std::printf("model: %s\n", dir.string().c_str());
  }
  std::printf("config\n");
  PrintConfig(config);
  PrintSizes(config);
  if (!from_preset && !PrintWeightFile(config, dir / "model.safetensors")) return kExitFailure;
  return kExitOk;
}

int Main(int argc, char** argv) {
  cli::Program program;
  program.name = "sdm-model";
  program.footer = absl::StrCat("presets: ", absl::StrJoin(PresetNames(), ", "));
  program.subcommands = {
      {"init",
       "sdm-model init --preset NAME --seed S --out DIR [--set key=value ...] [--dtype fp32|bf16] "
       "[--force]",
       "Writes DIR/config.json and DIR/model.safetensors with randomly initialised weights (the "
       "reference's initialisation; the same seed gives the same weights).",
       {"preset", "seed", "out", "set", "dtype", "force"},
       /*max_positional=*/0,
       [](const cli::ParsedArgs&) { return Init(); }},
      {"info",
       "sdm-model info DIR | sdm-model info --preset NAME [--set key=value ...]",
       "Describes a model: config, layer types, parameter counts, SDM state and KV-cache sizes, "
       "and for DIR the weight file (only its header is read).",
       {"preset", "set"},
       /*max_positional=*/1,
       Info},
  };
  return cli::RunProgram(program, argc, argv);
}

}  // namespace
}  // namespace sdm

int main(int argc, char** argv) { return sdm::Main(argc, argv); }
