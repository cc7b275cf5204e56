#include "tools/sdm_bench/state_benchmark.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "nlohmann/json.hpp"
#include "state_store/session_store.h"
#include "state_store/state_codec.h"
#include "state_store/state_log.h"
#include "tools/sdm_bench/device_info.h"

namespace sdm::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::vector<int32_t> RandomTokens(int64_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> tok(0, 255);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = tok(rng);
  return t;
}

absl::Status Prefill(Engine& engine, SessionState& s, const std::vector<int32_t>& tokens,
                     const char* what, const std::string& preset) {
  const Clock::time_point t0 = Clock::now();
  const int64_t chunk = 1024;
  for (size_t done = 0; done < tokens.size(); done += chunk) {
    const size_t n = std::min<size_t>(chunk, tokens.size() - done);
    if (auto st =
            engine.Prefill(s, std::span<const int32_t>(tokens).subspan(done, n), false, nullptr);
        !st.ok()) {
      return st;
    }
    std::fprintf(stderr, "\r[%s] %s %zu/%zu tokens (%.1f s)   ", preset.c_str(), what, done + n,
                 tokens.size(), Since(t0));
  }
  std::fprintf(stderr, "\n");
  return absl::OkStatus();
}

std::vector<float> NextLogits(Engine& engine, SessionState& s, int32_t token) {
  std::vector<float> logits(engine.vocab_size());
  SessionState* p = &s;
  if (!engine.Decode({&p, 1}, {&token, 1}, logits).ok()) logits.clear();
  return logits;
}

// A resume staged ahead (Engine::StageResume, what the scheduler does on the submitting thread)
// and its first step, timed: the step uploads the staged image instead of converting.
struct StagedResume {
  double staging_s = 0;
  bool copied_ahead = false;  // the staged image's copy to the device started with it
  double copy_wait_s = 0;     // then waited for, from the end of the staging
  double first_step_s = 0;    // after that copy, if any: the step only scatters
  std::vector<float> logits;  // of that step
};
absl::StatusOr<StagedResume> TimeStagedResume(Engine& engine, SessionState& s, int32_t token) {
  StagedResume r;
  const int64_t prefetched_before = engine.resume_staging_stats().prefetched;
  Clock::time_point t0 = Clock::now();
  if (auto st = engine.StageResume(s); !st.ok()) return st;
  r.staging_s = Since(t0);
  if (engine.device() == EngineDevice::kCuda && s.staged() == nullptr) {
    return absl::InternalError(
        "the resume was not staged (EngineOptions::resume_staging_bytes is too low for it)");
  }
  r.copied_ahead = engine.resume_staging_stats().prefetched > prefetched_before;
  t0 = Clock::now();
  if (s.staged() != nullptr) {
    if (auto st = s.staged()->WaitForCopy(); !st.ok()) return st;
  }
  r.copy_wait_s = Since(t0);
  t0 = Clock::now();
  r.logits = NextLogits(engine, s, token);
  r.first_step_s = Since(t0);
  return r;
}

// Fills every slot of `s`'s SDM tables with its own row of values in [-0.05, 0.05) (a cheap
// generator: 805 M values for sdm_flagship). `s` is host-only.
absl::Status FillSdmTables(SessionState& s, uint64_t seed) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (int64_t l = 0; l < s.num_layers(); ++l) {
    if (!s.is_sdm(l)) continue;
    SdmTable& t = s.sdm(l);
    for (int64_t h = 0; h < t.heads(); ++h) {
      for (int64_t slot = 0; slot < t.slots_per_head(); ++slot) {
        float* row = t.MutableRow(h, slot);
        if (row == nullptr) return absl::ResourceExhaustedError("the host row pool is full");
        for (int64_t c = 0; c < t.row_width(); ++c) {
          x ^= x << 13;
          x ^= x >> 7;
          x ^= x << 17;
          row[c] = static_cast<float>(static_cast<int64_t>(x >> 40) - (int64_t{1} << 23)) *
                   (0.05f / (1 << 23));
        }
      }
    }
  }
  return absl::OkStatus();
}

// The full-table measurement (StateBenchOptions::full_table): a session prefilled with 16 tokens
// whose SDM tables then hold a random row in every slot, and its clone. The session's first
// step resumes it converting inside the step; a park (SyncToHost) brings it back; the clone is
// staged ahead (Engine::StageResume), its copy to the device (made ahead where
// resume_prefetch_bytes holds it) waited for, and its first step resumes it from the staged image
// (its logits must equal the session's, else `mismatch`); then one step of the resident clone. On
// the CPU there is no device: the steps are plain steps and the park and staging do nothing.
absl::Status MeasureFullTable(Engine& engine, const std::string& preset,
                              const std::string& described, std::mt19937& rng,
                              nlohmann::json& results, absl::Status* mismatch) {
  std::unique_ptr<SessionState> s = engine.NewSession();
  const std::vector<int32_t> prompt = RandomTokens(16, rng);
  if (auto st = Prefill(engine, *s, prompt, "full table: prefill", preset); !st.ok()) return st;
  if (auto st = s->SyncToHost(); !st.ok()) return st;
  std::fprintf(stderr, "[%s] full table: filling every SDM slot...\n", preset.c_str());
  if (auto st = FillSdmTables(*s, rng()); !st.ok()) return st;
  int64_t rows = 0, row_width = 0;
  for (int64_t l = 0; l < s->num_layers(); ++l) {
    if (!s->is_sdm(l)) continue;
    rows += std::as_const(*s).sdm(l).private_rows();
    row_width = std::as_const(*s).sdm(l).row_width();
  }
  if (rows == 0) return absl::OkStatus();  // a model without SDM layers: nothing to measure
  std::unique_ptr<SessionState> clone = s->Clone();
  const bool cuda = engine.device() == EngineDevice::kCuda;
  // What moves: the rows in the device's format (bf16 on CUDA), the KV of 16 tokens aside.
  const double bytes = static_cast<double>(rows) * row_width * (cuda ? 2 : 4);
  const std::vector<int32_t> next = RandomTokens(2, rng);

  Clock::time_point t0 = Clock::now();
  const std::vector<float> want = NextLogits(engine, *s, next[0]);
  const double step_converting = Since(t0);
  t0 = Clock::now();
  if (auto st = s->SyncToHost(); !st.ok()) return st;
  const double park = Since(t0);
  s.reset();  // its host copy and, on the device, nothing left
  absl::StatusOr<StagedResume> staged = TimeStagedResume(engine, *clone, next[0]);
  if (!staged.ok()) return staged.status();
  const double staging = staged->staging_s, step_staged = staged->first_step_s;
  const double copy_wait = staged->copy_wait_s;
  const bool exact = staged->logits == want;
  t0 = Clock::now();
  if (NextLogits(engine, *clone, next[1]).empty()) return absl::InternalError("a step failed");
  const double step_resident = Since(t0);
  if (cuda) {
    std::printf(
        "#   %s full table: %lld rows, %.3f GB as the device holds them; first step converting "
        "in the step %.2f ms, park (SyncToHost) %.2f ms (%.2f GB/s); staged ahead %.2f ms (%.2f "
        "GB/s of rows, off the step thread), its copy to the device %s (%.2f ms more to wait), "
        "then the first step %.2f ms; a resident step %.2f ms; staged continuation exact: %s\n",
        preset.c_str(), static_cast<long long>(rows), bytes / 1e9, step_converting * 1e3,
        park * 1e3, bytes / park / 1e9, staging * 1e3, bytes / staging / 1e9,
        staged->copied_ahead ? "ahead" : "in the step", copy_wait * 1e3, step_staged * 1e3,
        step_resident * 1e3, exact ? "yes" : "NO");
  } else {
    std::printf(
        "#   %s full table: %lld rows, %.3f GB; no device (nothing to park or stage): a step "
        "%.2f ms, the clone's %.2f ms, then %.2f ms; the clone continues exactly: %s\n",
        preset.c_str(), static_cast<long long>(rows), bytes / 1e9, step_converting * 1e3,
        step_staged * 1e3, step_resident * 1e3, exact ? "yes" : "NO");
  }
  std::fflush(stdout);
  results.push_back({{"model", preset},
                     {"device", EngineDeviceName(engine.device())},
                     {"engine", described},
                     {"full_table", true},
                     {"sdm_rows", rows},
                     {"row_bytes_moved", bytes},
                     {"first_step_converting_s", step_converting},
                     {"park_s", park},
                     {"park_gbps", cuda ? nlohmann::json(bytes / park / 1e9) : nlohmann::json()},
                     {"staging_s", staging},
                     {"copied_ahead", staged->copied_ahead},
                     {"copy_ahead_wait_s", copy_wait},
                     {"first_step_after_staged_resume_s", step_staged},
                     {"resident_step_s", step_resident},
                     {"staged_exact", exact}});
  if (!exact && mismatch->ok()) {
    *mismatch = absl::InternalError(
        absl::StrCat(preset, " full table: the staged resume did not continue bit for bit"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunStateBenchmark(const StateBenchOptions& opt) {
  absl::StatusOr<EngineDevice> device = ResolveBenchDevice(opt.device);
  if (!device.ok()) return device.status();
  nlohmann::json results = nlohmann::json::array();
  absl::Status mismatch;  // the first resume that did not continue exactly
  // A directory of its own, emptied before each length and removed at the end: under --dir
  // (the disk to measure), never --dir itself, whose contents (a server's sessions, say) it
  // would delete.
  const std::filesystem::path dir =
      (opt.dir.empty() ? std::filesystem::temp_directory_path() : std::filesystem::path(opt.dir)) /
      absl::StrCat("sdm-bench-state-", ::getpid());
  std::error_code removed;
  std::printf("# sdm-bench state: snapshot dir %s, engine threads %d, seed %llu\n", dir.c_str(),
              opt.threads, static_cast<unsigned long long>(opt.seed));
  std::printf("%-13s %6s %9s %10s %10s %8s %9s %9s %9s %9s %10s %9s %9s %6s\n", "model", "tokens",
              "slots", "rows MB", "table MB", "KV MB", "full MB", "park h ms", "park d ms",
              "resume h", "resume d", "prefill s", "x host", "exact");
  for (const std::string& preset : opt.presets) {
    auto config = PresetConfig(preset);
    if (!config.ok()) return config.status();
    std::fprintf(stderr, "[%s] building random weights...\n", preset.c_str());
    auto model = RandomModel(*config, opt.seed);
    EngineOptions eo;
    eo.device = *device;
    eo.num_threads = opt.threads;
    auto engine_or = Engine::Create(model, eo);
    if (!engine_or.ok()) return engine_or.status();
    Engine& engine = **engine_or;
    const std::string described = engine.DescribeDevice();
    std::printf("# %s engine: %s\n", preset.c_str(), described.c_str());
    const SdmGeometry g = SdmGeometryOf(*config);
    int64_t sdm_layers = 0;
    for (LayerType t : config->layer_types) sdm_layers += t == LayerType::kSdm;
    const double full_table_mb = sdm_layers * g.heads * g.slots_per_head * g.head_width * 4 / 1e6;
    std::mt19937 rng(static_cast<uint32_t>(opt.seed));
    for (int64_t length : opt.lengths) {
      std::filesystem::remove_all(dir, removed);
      if (removed) {
        return absl::InternalError(
            absl::StrCat("cannot empty ", dir.string(), ": ", removed.message()));
      }
      SessionStoreOptions so;
      so.dir = dir;
      so.background = false;
      const std::vector<int32_t> history = RandomTokens(length, rng);
      const int32_t next = history.back();
      std::vector<float> want;
      int64_t rows = 0, table_bytes = 0, kv_bytes = 0, slots = 0;
      double park_host = 0, park_disk = 0, resume_host = 0, resume_disk = 0, prefill = 0;
      double device_to_host = -1;  // CUDA: the SyncToHost of the prefilled session
      {
        auto store_or = SessionStateStore::Open(engine.state_layout(), engine.fingerprint(), so);
        if (!store_or.ok()) return store_or.status();
        SessionStateStore& store = **store_or;
        if (auto s = store.Create("bench", ""); !s.ok()) return s;
        {
          auto lease = store.Acquire("bench");
          if (!lease.ok()) return lease.status();
          const Clock::time_point t0 = Clock::now();
          if (auto s = Prefill(engine, lease->state(), history, "prefill", preset); !s.ok()) {
            return s;
          }
          prefill = Since(t0);
          SessionState& st = lease->state();
          if (st.on_device()) {
            // The host layers are stale while the device holds the state: bring them back
            // before reading or cloning them (SessionState::Clone requires it).
            const Clock::time_point t1 = Clock::now();
            if (auto s = st.SyncToHost(); !s.ok()) return s;
            device_to_host = Since(t1);
          }
          for (int64_t l = 0; l < st.num_layers(); ++l) {
            if (st.is_sdm(l)) {
              slots += st.sdm(l).private_rows();
              table_bytes += st.sdm(l).TableBytes();
            } else {
              kv_bytes += st.kv(l).ResidentBytes();
            }
          }
          rows = slots;
          // The reference continuation of a session that never leaves residency.
          auto copy = st.Clone();
          want = NextLogits(engine, *copy, next);
        }
        Clock::time_point t0 = Clock::now();
        if (auto s = store.Park("bench", Tier::kHost); !s.ok()) return s;
        park_host = Since(t0);
        t0 = Clock::now();
        {
          auto lease = store.Acquire("bench");
          if (!lease.ok()) return lease.status();
          resume_host = Since(t0);
        }
        if (auto s = store.Park("bench", Tier::kHost); !s.ok()) return s;
        t0 = Clock::now();
        if (auto s = store.Park("bench", Tier::kDisk); !s.ok()) return s;
        park_disk = Since(t0);
      }
      // A new store object reading the directory: resume from disk.
      auto store_or = SessionStateStore::Open(engine.state_layout(), engine.fingerprint(), so);
      if (!store_or.ok()) return store_or.status();
      const Clock::time_point t0 = Clock::now();
      auto lease = (*store_or)->Acquire("bench");
      if (!lease.ok()) return lease.status();
      resume_disk = Since(t0);
      // On CUDA the first step after a resume also uploads the state to the device: converted
      // inside the step (first_step), or staged ahead (Engine::StageResume, which the scheduler
      // runs on the submitting thread: staging_s) so that the step only copies, or only
      // scatters when the copy was made ahead too and waited for (first_step_staged), measured
      // on a copy of the restored session.
      std::unique_ptr<SessionState> staged_copy;
      if (engine.device() == EngineDevice::kCuda) staged_copy = lease->state().Clone();
      const Clock::time_point t1 = Clock::now();
      const bool exact = NextLogits(engine, lease->state(), next) == want;
      const double first_step = Since(t1);
      double staging = -1, first_step_staged = -1;
      bool staged_exact = true;
      if (staged_copy != nullptr) {
        absl::StatusOr<StagedResume> staged = TimeStagedResume(engine, *staged_copy, next);
        if (!staged.ok()) return staged.status();
        staging = staged->staging_s;
        first_step_staged = staged->first_step_s;
        staged_exact = staged->logits == want;
      }
      // What per-turn persistence writes (state_store/state_log.h): the delta of a 1-token and
      // of a 16-token turn after this history, against a full snapshot. The restored session
      // carries no dirty marks, so the delta holds exactly what the turn touched. CPU only (a
      // device copy-back would mark every row).
      // The store journals SDM writes (state_store/sdm_table.h): a delta carries them where they
      // are smaller than the rows they touched; the rows are printed beside for comparison.
      int64_t delta_1 = -1, delta_16 = -1, snapshot_bytes = -1, rows_1 = -1, rows_16 = -1;
      const auto sdm_rows_bytes = [](const SessionState& st) {
        int64_t bytes = 0;
        for (int64_t l = 0; l < st.num_layers(); ++l) {
          if (st.is_sdm(l)) bytes += st.sdm(l).DirtyRowBytes();
        }
        return bytes;
      };
      if (!lease->state().on_device()) {
        SessionState& st = lease->state();
        const SessionRecord record{"bench", ""};
        delta_1 = static_cast<int64_t>(EncodeSessionDelta(st, record, length).size());
        rows_1 = sdm_rows_bytes(st);
        std::vector<float> logits(engine.vocab_size());
        for (int32_t token : RandomTokens(15, rng)) {
          SessionState* batch[] = {&st};
          if (auto s = engine.Decode(batch, {&token, 1}, logits); !s.ok()) return s;
        }
        delta_16 = static_cast<int64_t>(EncodeSessionDelta(st, record, length).size());
        rows_16 = sdm_rows_bytes(st);
        snapshot_bytes = static_cast<int64_t>(EncodeSessionState(st, record, 0).size());
        std::printf(
            "#   %s at %lld tokens: a turn's delta %.3f MB (1 token), %.3f MB (16 tokens); the "
            "SDM rows those turns wrote %.3f MB, %.3f MB; full snapshot %.3f MB\n",
            preset.c_str(), static_cast<long long>(length), delta_1 / 1e6, delta_16 / 1e6,
            rows_1 / 1e6, rows_16 / 1e6, snapshot_bytes / 1e6);
      }
      const double rows_mb = rows * g.head_width * 4 / 1e6;
      std::printf(
          "%-13s %6lld %9lld %10.2f %10.2f %8.2f %9.1f %9.2f %9.2f %9.2f %10.2f %9.2f %9.0f %6s\n",
          preset.c_str(), static_cast<long long>(length), static_cast<long long>(slots), rows_mb,
          table_bytes / 1e6, kv_bytes / 1e6, full_table_mb, park_host * 1e3, park_disk * 1e3,
          resume_host * 1e3, resume_disk * 1e3, prefill, prefill / resume_host,
          exact ? "yes" : "NO");
      if (device_to_host >= 0) {
        std::printf(
            "#   %s at %lld tokens: device -> host sync %.2f ms; first step after the "
            "resume from disk (upload + one decode step) %.2f ms\n",
            preset.c_str(), static_cast<long long>(length), device_to_host * 1e3, first_step * 1e3);
      }
      if (staging >= 0) {
        std::printf(
            "#   %s at %lld tokens: resume staged ahead %.2f ms (off the step thread), then the "
            "first step %.2f ms (upload from the staged image + one decode step; exact: %s)\n",
            preset.c_str(), static_cast<long long>(length), staging * 1e3, first_step_staged * 1e3,
            staged_exact ? "yes" : "NO");
      }
      std::fflush(stdout);
      results.push_back({{"model", preset},
                         {"device", EngineDeviceName(engine.device())},
                         {"engine", described},
                         {"tokens", length},
                         {"distinct_slots_written", slots},
                         {"private_row_bytes", rows * g.head_width * 4},
                         {"row_bytes", g.head_width * 4},
                         {"table_bytes", table_bytes},
                         {"kv_bytes", kv_bytes},
                         {"full_table_bytes", full_table_mb * 1e6},
                         {"park_host_s", park_host},
                         {"park_disk_s", park_disk},
                         {"resume_host_s", resume_host},
                         {"resume_disk_s", resume_disk},
                         {"reprefill_s", prefill},
                         {"reprefill_over_resume_host", prefill / resume_host},
                         {"reprefill_over_resume_disk", prefill / resume_disk},
                         {"device_to_host_s",
                          device_to_host >= 0 ? nlohmann::json(device_to_host) : nlohmann::json()},
                         {"first_step_after_resume_s", first_step},
                         {"staging_s", staging >= 0 ? nlohmann::json(staging) : nlohmann::json()},
                         {"first_step_after_staged_resume_s",
                          staging >= 0 ? nlohmann::json(first_step_staged) : nlohmann::json()},
                         {"staged_exact", staged_exact},
                         {"turn_delta_bytes_1_token", delta_1},
                         {"turn_delta_bytes_16_tokens", delta_16},
                         {"turn_sdm_rows_bytes_1_token", rows_1},
                         {"turn_sdm_rows_bytes_16_tokens", rows_16},
                         {"snapshot_bytes_after_16", snapshot_bytes},
                         {"exact", exact}});
      if (!exact && mismatch.ok()) {
        mismatch = absl::InternalError(absl::StrCat(
            preset, " at ", length, " tokens: the resumed session did not continue bit for bit"));
      }
      if (!staged_exact && mismatch.ok()) {
        mismatch = absl::InternalError(absl::StrCat(preset, " at ", length,
                                                    " tokens: the staged resume did not continue "
                                                    "bit for bit"));
      }
    }
    if (opt.full_table) {
      if (auto st = MeasureFullTable(engine, preset, described, rng, results, &mismatch);
          !st.ok()) {
        return st;
      }
    }
  }
  std::filesystem::remove_all(dir, removed);
  if (!opt.json_path.empty()) {
    std::ofstream out(opt.json_path);
    out << results.dump(2) << "\n";
    if (!out) return absl::InternalError(absl::StrCat("could not write ", opt.json_path));
  }
  return mismatch;  // a resume that did not continue exactly fails the run, JSON written
}

}  // namespace sdm::bench
