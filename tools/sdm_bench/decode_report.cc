#include "tools/sdm_bench/decode_report.h"

#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

#ifndef SDM_SOURCE_DIR
#define SDM_SOURCE_DIR ""
#endif

namespace sdm::bench {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

double D(const json& j) { return j.is_number() ? j.get<double>() : 0.0; }
long long I(const json& j) { return j.is_number() ? j.get<long long>() : 0; }
std::string S(const json& j) { return j.is_string() ? j.get<std::string>() : j.dump(); }

// A parameter's value for the report: lists joined by commas, empty ones as "(none)".
std::string ParamValue(const json& v) {
  if (v.is_array()) {
    if (v.empty()) return "(none)";
    std::vector<std::string> parts;
    for (const json& x : v) parts.push_back(S(x));
    return absl::StrJoin(parts, ",");
  }
  if (v.is_string()) return v.get<std::string>().empty() ? "(none)" : v.get<std::string>();
  return v.dump();
}

const std::map<std::string, std::string>& ParamMeanings() {
  static const auto* m = new std::map<std::string, std::string>{
      {"device",
       "where the engine runs: auto (CUDA when built with it and a device is present), cpu or "
       "cuda"},
      {"device_state_gb",
       "CUDA: device memory for sessions' state in GB (0: the engine's default share of what the "
       "weights leave free)"},
      {"pair", "named pairs measured: an SDM model and its full-attention twin"},
      {"presets", "explicit presets measured together as one group"},
      {"set",
       "config overrides (key=value) applied to every model (to the SDM model of a pair "
       "before its twin is derived)"},
      {"contexts", "context lengths reached by real prefill before each measurement"},
      {"batches", "batch sizes measured (sessions decoded together in one step)"},
      {"fit_batch", "also measure the largest batch whose session state fits the budget"},
      {"max_batch", "cap on that largest batch"},
      {"steps", "timed decode steps per (model, context, batch)"},
      {"warmup", "untimed decode steps before the timed ones"},
      {"threads", "engine threads (0: one per hardware thread)"},
      {"prefill_chunk",
       "the engine's prefill chunk in tokens (also sizes the SWA ring: window + "
       "chunk)"},
      {"state_budget_gb",
       "CPU: session-state budget in GB, per model: a batch whose state exceeds it is skipped (a "
       "pair holds both models' batches at once); on CUDA the device's memory bounds the batch"},
      {"seed", "seed of the random weights and tokens"},
      {"bandwidth_mb",
       "size in MiB of each of the two buffers of the bandwidth measurement (CUDA: at least "
       "2048)"},
      {"json", "JSON output file"},
      {"csv", "CSV output file"},
      {"report", "report directory (report.md, results.json, results.csv, plots)"},
  };
  return *m;
}

// Runs `command`; returns its exit code (-1 if it could not run) and its output.
int RunCommand(const std::string& command, std::string* output) {
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) output->append(buf.data(), n);
  const int status = ::pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

std::string FindPlotScript(const std::string& configured) {
  if (!configured.empty()) return configured;
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path next_to_binary = self.parent_path() / "plot_decode.py";
    if (fs::exists(next_to_binary)) return next_to_binary.string();
  }
  const fs::path in_source = fs::path(SDM_SOURCE_DIR) / "tools/sdm_bench/plot_decode.py";
  if (fs::exists(in_source)) return in_source.string();
  return "";
}

absl::Status WriteText(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("could not write ", path.string()));
  return absl::OkStatus();
}

// Load averages as "1.23, 0.98, 0.75".
std::string Load(const json& v) {
  std::vector<std::string> parts;
  if (v.is_array()) {
    for (const json& x : v) parts.push_back(absl::StrFormat("%.2f", D(x)));
  }
  return parts.empty() ? "unknown" : absl::StrJoin(parts, ", ");
}

std::string Gb(double bytes) { return absl::StrFormat("%.2f", bytes / 1e9); }

bool OnCuda(const json& doc) {
  return doc.contains("device") && doc["device"].is_object() &&
         doc["device"].value("resolved", "") == "cuda";
}

// Whether the run timed each kind of layer (the engine's per-part profile): not on CUDA, where
// it would synchronise after every layer (decode_benchmark.cc), and the fields hold zeros.
bool MixersProfiled(const json& doc) { return !OnCuda(doc); }

// Per-mixer figures as the report prints them: "-" where the run did not measure them.
std::string MixerMs(const json& doc, const json& v) {
  return MixersProfiled(doc) ? absl::StrFormat("%.2f", D(v)) : std::string("-");
}
std::string MixerGbps(const json& doc, const json& v) {
  return MixersProfiled(doc) ? absl::StrFormat("%.1f", D(v)) : std::string("-");
}

// A CSV cell: quoted (RFC 4180) when it holds a comma, a quote or a line break.
std::string CsvCell(const std::string& v) {
  if (v.find_first_of(",\"\n") == std::string::npos) return v;
  std::string out = "\"";
  for (char c : v) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}
std::string Mb(double bytes) { return absl::StrFormat("%.1f", bytes / 1e6); }

}  // namespace

const std::vector<std::string>& RowKeys() {
  static const auto* keys = new std::vector<std::string>{
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
  return *keys;
}

std::string TableHeader() {
  return absl::StrFormat("%-18s %7s %5s %9s %9s %9s %8s %7s %6s %8s %7s %8s %8s %8s %8s %9s %5s",
                         "model", "context", "batch", "ms/step", "p90 ms", "tok/s", "MB/step",
                         "GB/s", "%bw", "GFLOP/s", "%sgemm", "attn ms", "swa ms", "sdm ms",
                         "ffn ms", "MB/sess", "fits");
}

// A per-layer figure of the terminal's tables: "-" for 0, which a measured time never is (the
// model has no such layer, or the run did not time them: CUDA).
std::string TimedOrDash(double v, int decimals) {
  return v == 0 ? std::string("-") : absl::StrFormat("%.*f", decimals, v);
}

std::string TableRow(const json& r) {
  const json none;
  const json& sgemm = r.contains("fraction_of_sgemm") ? r["fraction_of_sgemm"] : none;
  return absl::StrFormat(
      "%-18s %7d %5d %9.2f %9.2f %9.1f %8.1f %7.2f %5.1f%% %8.1f %7s %8s %8s %8s %8s "
      "%9.1f %5d%s",
      S(r["model"]), I(r["context"]), I(r["batch"]), D(r["ms_per_step_median"]),
      D(r["ms_per_step_p90"]), D(r["tokens_per_s"]), D(r["bytes_per_step"]) / 1e6,
      D(r["achieved_gbps"]), 100 * D(r["fraction_of_bandwidth"]), D(r["gflops"]),
      sgemm.is_number() ? absl::StrFormat("%.1f%%", 100 * D(sgemm)) : std::string("-"),
      TimedOrDash(D(r["attn_ms_per_step"]), 2), TimedOrDash(D(r["swa_ms_per_step"]), 2),
      TimedOrDash(D(r["sdm_ms_per_step"]), 2), TimedOrDash(D(r["ffn_ms_per_step"]), 2),
      D(r["state_bytes_per_session"]) / 1e6, I(r["max_batch_in_budget"]),
      r["fit_batch"].get<bool>() ? " (fit)" : "");
}

std::string GroupSummary(const json& g) {
  std::string out;
  if (!g.contains("ratios") || g["ratios"].empty()) return out;
  absl::StrAppend(&out, "# ", S(g["name"]), ": SDM / full-attention tokens/s (same batch)\n");
  absl::StrAppendFormat(&out, "# %7s %5s %12s %12s %8s %10s %10s\n", "context", "batch",
                        "SDM tok/s", "attn tok/s", "ratio", "bw floor", "attn GB/s");
  for (const json& r : g["ratios"]) {
    absl::StrAppendFormat(&out, "# %7d %5d %12.1f %12.1f %7.2fx %9.2fx %10s\n", I(r["context"]),
                          I(r["batch"]), D(r["sdm_tokens_per_s"]), D(r["attention_tokens_per_s"]),
                          D(r["ratio"]), D(r["bandwidth_floor_ratio"]),
                          TimedOrDash(D(r["attention_layers_gbps"]), 1));
  }
  for (const json& f : g["fit_ratios"]) {
    absl::StrAppendFormat(&out,
                          "# at the largest batch in the budget, context %d: SDM batch %d %.1f "
                          "tok/s vs attention batch %d %.1f tok/s: %.2fx\n",
                          I(f["context"]), I(f["sdm_batch"]), D(f["sdm_tokens_per_s"]),
                          I(f["attention_batch"]), D(f["attention_tokens_per_s"]), D(f["ratio"]));
  }
  for (const json& x : g["growth"]) {
    absl::StrAppendFormat(&out,
                          "# %s batch %d: step %.2f ms at %d -> %.2f ms at %d (x%.2f); its global "
                          "layers %.2f -> %.2f ms\n",
                          S(x["model"]), I(x["batch"]), D(x["ms_shortest"]),
                          I(x["shortest_context"]), D(x["ms_longest"]), I(x["longest_context"]),
                          D(x["growth"]), D(x["global_layer_ms_shortest"]),
                          D(x["global_layer_ms_longest"]));
  }
  return out;
}

std::string CsvText(const json& doc) {
  std::string out = absl::StrJoin(RowKeys(), ",") + "\n";
  for (const json& r : doc["results"]) {
    std::vector<std::string> cells;
    for (const std::string& k : RowKeys()) {
      const json& v = r.contains(k) ? r[k] : json();
      if (v.is_string()) {
        cells.push_back(CsvCell(v.get<std::string>()));
      } else if (v.is_number_float()) {
        cells.push_back(absl::StrFormat("%.6g", v.get<double>()));
      } else if (v.is_null()) {
        cells.push_back("");
      } else {
        cells.push_back(v.dump());
      }
    }
    absl::StrAppend(&out, absl::StrJoin(cells, ","), "\n");
  }
  return out;
}

std::string MarkdownReport(const json& doc, const std::vector<std::string>& plots,
                           const std::string& plot_note) {
  std::string md;
  const json& m = doc["machine"];
  const json& b = doc["build"];
  const json& bw = doc["bandwidth"];
  absl::StrAppend(&md, "# Decode throughput: SDM against full attention\n\n");
  absl::StrAppendFormat(&md,
                        "Written by `sdm-bench decode` (%s to %s, %.0f s of wall time). The "
                        "command:\n\n```sh\n%s\n```\n\n",
                        S(doc["started_utc"]), S(doc["finished_utc"]), D(doc["wall_seconds"]),
                        S(doc["command_line"]));

  // ---- Headline ----
  absl::StrAppend(&md, "## Headline\n\n");
  for (const json& g : doc["groups"]) {
    if (!g.contains("headline")) continue;
    const json& h = g["headline"];
    if (h["ratios_at_longest_context"].empty()) continue;
    std::vector<std::string> parts;
    for (const json& r : h["ratios_at_longest_context"]) {
      parts.push_back(absl::StrFormat("%.2fx at batch %d (bandwidth floor %.2fx)", D(r["ratio"]),
                                      I(r["batch"]), D(r["bandwidth_floor_ratio"])));
    }
    absl::StrAppendFormat(&md,
                          "- **%s**, at %d tokens of context (the longest measured): SDM / full "
                          "attention tokens/s = %s",
                          S(g["name"]), I(h["longest_common_context"]), absl::StrJoin(parts, ", "));
    if (h.contains("fit_ratio_at_longest_context")) {
      const json& f = h["fit_ratio_at_longest_context"];
      absl::StrAppendFormat(&md,
                            "; at the largest batch each fits in the budget, at most --max_batch "
                            "(SDM %d, attention %d): %.2fx (bandwidth floor %.2fx)",
                            I(f["sdm_batch"]), I(f["attention_batch"]), D(f["ratio"]),
                            D(f["bandwidth_floor_ratio"]));
    }
    absl::StrAppend(&md, ".\n");
    double attn_gbps = 0;
    for (const json& r : h["ratios_at_longest_context"]) {
      attn_gbps = std::max(attn_gbps, D(r["attention_layers_gbps"]));
    }
    const double reference = D(doc["bandwidth"]["reference_gbps"]);
    if (reference > 0 && MixersProfiled(doc)) {
      absl::StrAppendFormat(
          &md,
          "  - The twin's full-attention layers moved their bytes at %.1f GB/s at most there, "
          "%.0f%% of the measured %s bandwidth (%.1f GB/s): the measured ratio includes how far "
          "this engine's attention kernel is from the bandwidth bound. The bandwidth-floor ratio "
          "is what both models moving their bytes at the same rate would give.\n",
          attn_gbps, 100 * attn_gbps / reference, OnCuda(doc) ? "device copy" : "read", reference);
    }
    for (const json& x : g["growth"]) {
      absl::StrAppendFormat(&md,
                            "  - %s, batch %d: step time %.2f ms at %d tokens, %.2f ms at %d "
                            "(x%.2f)",
                            S(x["model"]), I(x["batch"]), D(x["ms_shortest"]),
                            I(x["shortest_context"]), D(x["ms_longest"]), I(x["longest_context"]),
                            D(x["growth"]));
      if (MixersProfiled(doc)) {
        absl::StrAppendFormat(&md, "; its global layers (%s) %.2f -> %.2f ms",
                              S(x["model"]) == S(g["models"][0]["name"]) ? "SDM" : "attention",
                              D(x["global_layer_ms_shortest"]), D(x["global_layer_ms_longest"]));
      }
      absl::StrAppend(&md, ".\n");
    }
  }
  absl::StrAppend(&md, "\n");

  // ---- Machine and build ----
  absl::StrAppend(&md, "## Machine\n\n| | |\n|---|---|\n");
  absl::StrAppendFormat(&md, "| CPU | %s |\n", S(m["cpu"]));
  absl::StrAppendFormat(&md, "| hardware threads | %d |\n", I(m["hardware_threads"]));
  absl::StrAppendFormat(&md, "| memory | %.1f GiB |\n", D(m["memory_gib"]));
  absl::StrAppendFormat(&md, "| kernel | %s |\n", S(m["kernel"]));
  if (doc.contains("device") && doc["device"].is_object()) {
    absl::StrAppendFormat(&md, "| `--device` | %s (resolved to %s) |\n",
                          S(doc["device"]["requested"]), S(doc["device"]["resolved"]));
    for (const json& e : doc["device"]["engines"]) {
      absl::StrAppendFormat(&md, "| engine of %s | %s |\n", S(e["model"]), S(e["engine"]));
    }
  }
  absl::StrAppendFormat(&md, "| engine threads / OpenBLAS threads | %d / %d |\n",
                        I(m["engine_threads"]), I(m["blas_threads"]));
  if (m.contains("gemm_isa")) {
    absl::StrAppendFormat(&md, "| CPU GEMM instruction set (`SDM_CPU_ISA`) | %s |\n",
                          S(m["gemm_isa"]));
  }
  absl::StrAppendFormat(&md, "| load average (1, 5, 15 min) at start / end | %s / %s |\n",
                        Load(m["load_average_start"]), Load(m["load_average_end"]));
  for (const json& x : bw["measurements"]) {
    if (x.value("kind", "") == "device copy") {
      absl::StrAppendFormat(&md,
                            "| device copy bandwidth, %s (cudaMemcpy device to device, 2 x %d MiB, "
                            "median of %d) | %.1f GB/s (read + write; best copy %.1f GB/s) |\n",
                            S(x["when"]), I(bw["buffer_bytes"]) >> 20, I(x["reps"]),
                            D(x["copy_gbps"]), D(x["copy_best_gbps"]));
      continue;
    }
    absl::StrAppendFormat(&md,
                          "| memory bandwidth, %s (%d threads, 2 x %d MiB buffers; load %s) | "
                          "copy %.1f GB/s (read + write), read %.1f GB/s |\n",
                          S(x["when"]), I(bw["threads"]), I(bw["buffer_bytes"]) >> 20,
                          Load(x["load_average"]), D(x["copy_gbps"]), D(x["read_gbps"]));
  }
  absl::StrAppendFormat(&md, "| bandwidth the %%bw columns use | %.1f GB/s (%s) |\n",
                        D(bw["reference_gbps"]), S(bw["reference"]));
  absl::StrAppendFormat(&md, "| peak resident memory of the run | %.1f GB |\n\n",
                        D(m["peak_rss_bytes"]) / 1e9);
  absl::StrAppend(&md, "## Build\n\n| | |\n|---|---|\n");
  absl::StrAppendFormat(&md, "| compiler | %s |\n", S(b["compiler"]));
  absl::StrAppendFormat(&md, "| build type | %s |\n", S(b["build_type"]));
  absl::StrAppendFormat(&md, "| flags | `%s` (engine and kernels add `%s`) |\n", S(b["cxx_flags"]),
                        S(b["cpu_arch_flags"]));
  absl::StrAppendFormat(&md, "| assertions | %s |\n", S(b["assertions"]));
  absl::StrAppendFormat(&md, "| OpenBLAS | %s |\n", S(b["openblas"]));
  absl::StrAppendFormat(&md, "| git commit | %s%s |\n\n",
                        S(b["git_commit"]).empty() ? "(unknown)" : S(b["git_commit"]),
                        b["git_dirty"].get<bool>() ? " with uncommitted changes" : "");

  // ---- Protocol ----
  if (OnCuda(doc)) {
    absl::StrAppend(
        &md,
        "## Protocol\n\n"
        "- Engine level (no server), CUDA backend (bf16 weights, KV and SDM rows; fp32 "
        "activations and accumulation), random weights built in memory from the seed (reference "
        "initialisation), random tokens.\n"
        "- The models of a group are measured **one after the other**, each with the device to "
        "itself (its engine and sessions are freed before the next model's are made): a pair's "
        "large batches do not fit in one device's memory together, and a dedicated device has no "
        "other tenants whose load interleaving would have to share out.\n"
        "- Each model keeps a pool of sessions, each brought to every context (increasing) by its "
        "own **real prefill** on the device (the engine's chunked `Prefill`, continuing from the "
        "previous context; no synthetic fill, no host copies). A batch of B decodes the pool's "
        "first B sessions: the warm-up steps untimed, then the timed steps (one token per session "
        "per step). When the device's session memory runs out during a prefill, the pool keeps "
        "the sessions that fit less one (headroom for the decode steps) and larger batches are "
        "skipped with the reason. Decode steps advance positions, so a batch measured after "
        "another at the same context starts up to (warm-up + steps) tokens later per earlier "
        "round.\n"
        "- Step times are host wall time around `Engine::Decode` (which ends with one device "
        "synchronisation); the per-mixer ms come from the engine's profile (on CUDA they are "
        "not measured, the profile synchronising after every layer: `-`).\n"
        "- MB/step: the bytes one step must move, modelled from the config at the CUDA engine's "
        "formats: every matrix once in bf16 and every vector in fp32 (the embedding table only "
        "for the B gathered rows unless tied; M0 only through the rows touched), plus per session "
        "the bf16 K and V rows of every visible position of each attention layer (all positions "
        "for full attention, the window for SWA) and per SDM layer and head (2W + R) rows of hd "
        "bf16 values. GB/s = MB/step / median step time; %bw = GB/s as a fraction of the "
        "device's device-to-device copy bandwidth (cudaMemcpy, read + write bytes, median of 10 "
        "copies, best of the measurements at the start, before each group and at the end), the "
        "ceiling the floor of docs/model-spec.md §9 is computed from.\n"
        "- GFLOP/s: the step's FLOPs / median step time; there is no sgemm comparison on CUDA "
        "(the `%sgemm` column is empty).\n"
        "- MB/sess: the mean `SessionState::ResidentBytes()` of the pool after the prefill (device "
        "KV pages, private SDM rows and slot tables; the host layers of a device-resident session "
        "stay empty); fits: how many sessions the pool holds at that context.\n\n");
  } else {
    // --cpu_dtype bf16 (absent from older runs: fp32) stores weights and caches in 16 bits.
    const bool bf16 = doc.contains("parameters") && doc["parameters"].is_object() &&
                      doc["parameters"].value("cpu_dtype", "fp32") == "bf16";
    absl::StrAppend(
        &md, "## Protocol\n\n",
        bf16 ? "- Engine level (no server), CPU backend, bf16 weights and KV caches (`--cpu_dtype "
               "bf16`; fp32 activations, accumulation and SDM rows), random weights built in "
               "memory from the seed (reference initialisation), random tokens.\n"
             : "- Engine level (no server), CPU backend, fp32 weights and state, random weights "
               "built in memory from the seed (reference initialisation), random tokens.\n",
        "- The models of a pair are measured together: for each context (increasing), each "
        "model's one session is brought to that context by **real prefill** (the engine's "
        "chunked "
        "`Prefill`, continuing from the previous context; there is no synthetic fill); then "
        "for "
        "each batch size B, each model's session is cloned B times (`SessionState::Clone`, a "
        "deep "
        "copy) and the models' decode steps alternate, one step of each in turn (one token "
        "per "
        "session per step): the warm-up rounds untimed, then the timed rounds. So load from "
        "other "
        "processes on this shared machine falls on both models alike. Reported: the median "
        "and "
        "p90 step time, tokens/s = B / median, and the engine's per-mixer profile (attn, "
        "swa, sdm, "
        "ffn: ms per step). attn/swa/sdm GB/s: each mixer kind's bytes (its weights plus the "
        "batch's KV or SDM rows) over its profiled time: how close the full-attention "
        "baseline and "
        "the SDM layers each come to the machine's bandwidth.\n"
        "- MB/step: the bytes one step must move, modelled from the config: every weight "
        "read once "
        "(matrices at their stored width, 4 bytes or 2 with `--cpu_dtype bf16` as the KV rows; "
        "vectors 4) (the "
        "embedding table only for the B gathered rows unless tied; the learned SDM "
        "memory M0 only through the rows touched), plus per session the K and V rows of "
        "every "
        "visible position of each attention layer (all positions for full attention, the "
        "window "
        "for "
        "SWA) and per SDM layer and head (2W + R) rows of hd floats. GB/s = MB/step / median "
        "step "
        "time; %bw = GB/s as a fraction of the best streaming-read bandwidth measured in the "
        "same "
        "run (the step's bytes are reads; copy bandwidth, counting read + write bytes as the "
        "spec (docs/model-spec.md §9) "
        "does for the GPU, is listed under Machine).\n"
        "- GFLOP/s: the step's FLOPs (GEMMs, attention over the visible keys, SDM row "
        "updates) / "
        "median step time; %sgemm: as a fraction of OpenBLAS sgemm timed alone on exactly "
        "the "
        "step's GEMM shapes at the same batch, in the same run. The engine multiplies with "
        "its own "
        "batch-invariant GEMM (`kernels/cpu/gemm.h`), not OpenBLAS, so over 100% means the "
        "engine's whole step beats OpenBLAS on its GEMMs alone.\n"
        "- MB/sess: `SessionState::ResidentBytes()` after the prefill (KV pages, SDM private "
        "rows "
        "and slot tables, SWA rings); fits: the largest batch whose state fits the budget "
        "(weights "
        "are not counted). Batches over the budget are skipped and listed.\n"
        "- The machine is shared and noisy: compare models only through ratios measured in "
        "this "
        "one run.\n\n");
  }

  // ---- Parameters ----
  absl::StrAppend(&md, "## Parameters\n\n| parameter | value | meaning |\n|---|---|---|\n");
  for (const auto& [key, value] : doc["parameters"].items()) {
    auto it = ParamMeanings().find(key);
    absl::StrAppendFormat(&md, "| `--%s` | %s | %s |\n", key, ParamValue(value),
                          it != ParamMeanings().end() ? it->second : "");
  }
  absl::StrAppend(&md, "\n");

  // ---- Models ----
  absl::StrAppend(&md,
                  "## Models\n\nParameter counts with and without the learned SDM memory M0 (the "
                  "paper matches models without it).\n\n"
                  "| group | model | role | layers | parameters | without M0 | M0 | weights read "
                  "per step (MB) | full-attn KV per token (KB) | SDM rows per step per session "
                  "(MB) | SDM state per session, all rows (MB) |\n"
                  "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const json& g : doc["groups"]) {
    for (const json& x : g["models"]) {
      absl::StrAppendFormat(
          &md, "| %s | %s | %s | %s | %d | %d | %d | %s | %.1f | %s | %s |\n", S(g["name"]),
          S(x["name"]), S(x["role"]), S(x["layers"]), I(x["parameters_total"]),
          I(x["parameters_without_m0"]), I(x["parameters_m0"]), Mb(D(x["weight_bytes_per_step"])),
          D(x["kv_bytes_per_token"]) / 1e3, Mb(D(x["sdm_bytes_per_step_per_session"])),
          Mb(D(x["sdm_state_bytes_max"])));
    }
  }
  absl::StrAppend(&md, "\n");
  for (const json& g : doc["groups"]) {
    absl::StrAppendFormat(&md, "- **%s**: %s.%s\n", S(g["name"]), S(g["description"]),
                          S(g["twin_check"]).empty() ? "" : " Twin: " + S(g["twin_check"]) + ".");
  }
  absl::StrAppend(&md, "\n");

  // ---- Results per group ----
  for (const json& g : doc["groups"]) {
    const std::string name = S(g["name"]);
    absl::StrAppendFormat(&md, "## Results: %s\n\n", name);
    if (g.contains("ratios") && !g["ratios"].empty()) {
      absl::StrAppend(
          &md,
          "SDM against its twin at the same batch (median step). *Bandwidth-floor ratio*: the "
          "ratio if both steps moved their bytes at the same rate (the twin's MB/step over the "
          "SDM model's); the measured ratio exceeds it when the twin's attention runs further "
          "below the machine's bandwidth than the SDM model's step does (see *attention GB/s*, "
          "the twin's full-attention layers' achieved rate).\n\n"
          "| context | batch | SDM tok/s | attention tok/s | ratio | bandwidth-floor ratio | SDM "
          "ms/step | attention ms/step | attention GB/s |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
      for (const json& r : g["ratios"]) {
        absl::StrAppendFormat(
            &md, "| %d | %d | %.1f | %.1f | **%.2fx** | %.2fx | %s | %s | %s |\n", I(r["context"]),
            I(r["batch"]), D(r["sdm_tokens_per_s"]), D(r["attention_tokens_per_s"]), D(r["ratio"]),
            D(r["bandwidth_floor_ratio"]), MixerMs(doc, r["sdm_ms_per_step"]),
            MixerMs(doc, r["attention_ms_per_step"]), MixerGbps(doc, r["attention_layers_gbps"]));
      }
      absl::StrAppend(&md, "\n");
      if (!g["fit_ratios"].empty()) {
        absl::StrAppend(
            &md,
            "At the largest batch each model fits in the state budget (at most `--max_batch`):\n\n"
            "| context | SDM batch | SDM tok/s | attention batch | attention tok/s | "
            "ratio | bandwidth-floor ratio |\n|---:|---:|---:|---:|---:|---:|---:|\n");
        for (const json& f : g["fit_ratios"]) {
          absl::StrAppendFormat(&md, "| %d | %d | %.1f | %d | %.1f | **%.2fx** | %.2fx |\n",
                                I(f["context"]), I(f["sdm_batch"]), D(f["sdm_tokens_per_s"]),
                                I(f["attention_batch"]), D(f["attention_tokens_per_s"]),
                                D(f["ratio"]), D(f["bandwidth_floor_ratio"]));
        }
        absl::StrAppend(&md, "\n");
      }
    }
    absl::StrAppend(&md,
                    "Every measurement (ms per mixer are per step, from the engine's profile):\n\n"
                    "| model | context | batch | ms/step | p90 ms | tok/s | MB/step | GB/s | %bw | "
                    "GFLOP/s | %sgemm | attn ms | swa ms | sdm ms | ffn ms | attn GB/s | swa GB/s "
                    "| sdm GB/s | MB/sess | fits |\n"
                    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
                    "---:|---:|---:|---:|---:|\n");
    for (const json& r : doc["results"]) {
      if (S(r["group"]) != name) continue;
      absl::StrAppendFormat(
          &md,
          "| %s | %d | %d%s | %.2f | %.2f | %.1f | %.1f | %.2f | %.1f%% | %.1f | %s | %s | "
          "%s | %s | %s | %s | %s | %s | %.1f | %d |\n",
          S(r["model"]), I(r["context"]), I(r["batch"]), r["fit_batch"].get<bool>() ? " (fit)" : "",
          D(r["ms_per_step_median"]), D(r["ms_per_step_p90"]), D(r["tokens_per_s"]),
          D(r["bytes_per_step"]) / 1e6, D(r["achieved_gbps"]), 100 * D(r["fraction_of_bandwidth"]),
          D(r["gflops"]),
          r.contains("fraction_of_sgemm") && r["fraction_of_sgemm"].is_number()
              ? absl::StrFormat("%.1f%%", 100 * D(r["fraction_of_sgemm"]))
              : std::string("-"),
          MixerMs(doc, r["attn_ms_per_step"]), MixerMs(doc, r["swa_ms_per_step"]),
          MixerMs(doc, r["sdm_ms_per_step"]), MixerMs(doc, r["ffn_ms_per_step"]),
          MixerGbps(doc, r["attn_layers_gbps"]), MixerGbps(doc, r["swa_layers_gbps"]),
          MixerGbps(doc, r["sdm_layers_gbps"]), D(r["state_bytes_per_session"]) / 1e6,
          I(r["max_batch_in_budget"]));
    }
    absl::StrAppend(&md, "\n");
    std::vector<std::string> skipped;
    for (const json& s : doc["skipped"]) {
      if (S(s["group"]) != name) continue;
      skipped.push_back(absl::StrFormat("%s at %d tokens, batch %d: %s", S(s["model"]),
                                        I(s["context"]), I(s["batch"]), S(s["reason"])));
    }
    if (!skipped.empty()) {
      absl::StrAppend(&md, OnCuda(doc) ? "Skipped (device memory): " : "Skipped (state budget): ",
                      absl::StrJoin(skipped, "; "), ".\n\n");
    }
    absl::StrAppend(&md,
                    "Session state and the largest batch in the budget:\n\n"
                    "| model | context | state per session (GB) | largest batch |\n"
                    "|---|---:|---:|---:|\n");
    for (const json& c : g["capacity"]) {
      absl::StrAppendFormat(&md, "| %s | %d | %s | %d |\n", S(c["model"]), I(c["context"]),
                            Gb(D(c["state_bytes_per_session"])), I(c["max_batch_in_budget"]));
    }
    absl::StrAppend(&md,
                    "\nPrefill (real, random tokens):\n\n"
                    "| model | sessions | from | to | seconds | tok/s |\n"
                    "|---|---:|---:|---:|---:|---:|\n");
    for (const json& p : g["prefill"]) {
      absl::StrAppendFormat(&md, "| %s | %d | %d | %d | %.1f | %.0f |\n", S(p["model"]),
                            p.contains("sessions") ? I(p["sessions"]) : 1, I(p["from"]), I(p["to"]),
                            D(p["seconds"]), D(p["tokens_per_s"]));
    }
    if (!g["sgemm"].empty()) {
      absl::StrAppend(&md,
                      "\nOpenBLAS sgemm on the step's GEMM shapes:\n\n"
                      "| model | batch | GFLOP/s |\n|---|---:|---:|\n");
      for (const json& s : g["sgemm"]) {
        absl::StrAppendFormat(&md, "| %s | %d | %.1f |\n", S(s["model"]), I(s["batch"]),
                              D(s["gflops"]));
      }
    }
    absl::StrAppend(&md, "\n");
  }

  // ---- Plots ----
  absl::StrAppend(&md, "## Plots\n\n");
  if (plots.empty()) {
    absl::StrAppend(&md, "No plots: ", plot_note.empty() ? "none were made" : plot_note, ".\n");
  } else {
    for (const std::string& p : plots) absl::StrAppendFormat(&md, "![%s](%s)\n\n", p, p);
  }
  absl::StrAppend(&md,
                  "\nThe raw data: `results.json` (every field above) and `results.csv` "
                  "(one line per measurement).\n");
  return md;
}

absl::Status WriteOutputs(const json& doc, const DecodeBenchOptions& opt) {
  if (!opt.json_path.empty()) {
    if (auto s = WriteText(opt.json_path, doc.dump(2) + "\n"); !s.ok()) return s;
  }
  if (!opt.csv_path.empty()) {
    if (auto s = WriteText(opt.csv_path, CsvText(doc)); !s.ok()) return s;
  }
  if (opt.report_dir.empty()) return absl::OkStatus();
  const fs::path dir = opt.report_dir;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    return absl::InternalError(absl::StrCat("could not create ", dir.string(), ": ", ec.message()));
  if (auto s = WriteText(dir / "results.json", doc.dump(2) + "\n"); !s.ok()) return s;
  if (auto s = WriteText(dir / "results.csv", CsvText(doc)); !s.ok()) return s;

  std::vector<std::string> plots;
  std::string note;
  const std::string script = FindPlotScript(opt.plot_script);
  if (script.empty()) {
    note = "plot_decode.py was not found (pass --plot_script)";
  } else if (::access(opt.python.c_str(), X_OK) != 0) {
    note = absl::StrCat(opt.python, " is not installed");
  } else {
    std::string output;
    const int code = RunCommand(
        absl::StrCat(ShellQuote(opt.python), " ", ShellQuote(script), " ",
                     ShellQuote((dir / "results.json").string()), " ", ShellQuote(dir.string())),
        &output);
    if (code == 0) {
      for (absl::string_view line : absl::StrSplit(output, '\n', absl::SkipWhitespace())) {
        line = absl::StripAsciiWhitespace(line);
        if (absl::EndsWith(line, ".png") && fs::exists(dir / std::string(line))) {
          plots.emplace_back(line);
        }
      }
    } else {
      note = absl::StrCat(script, " failed (exit ", code,
                          "): ", absl::StripTrailingAsciiWhitespace(output));
      std::fprintf(stderr, "sdm-bench: no plots: %s\n", note.c_str());
    }
  }
  if (auto s = WriteText(dir / "report.md", MarkdownReport(doc, plots, note)); !s.ok()) return s;
  std::fprintf(stderr, "sdm-bench: wrote %s (report.md, results.json, results.csv%s)\n",
               dir.string().c_str(),
               plots.empty() ? ", no plots" : absl::StrCat(", ", plots.size(), " plots").c_str());
  return absl::OkStatus();
}

}  // namespace sdm::bench
