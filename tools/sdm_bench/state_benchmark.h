// `sdm-bench state`: what a session's state costs and how fast it moves (issue 3's benchmark).
//
// For each preset (random weights in memory) and each history length: one session is prefilled
// with random tokens to that length inside a SessionStateStore, then measured:
//   - bytes resident (private SDM rows + slot tables + KV pages) against the full SDM table size,
//     with the number of distinct slots written that explains it;
//   - time to park it (resident -> host, host -> disk) and to resume it (host -> resident,
//     disk -> resident, the latter through a fresh store object reading the directory);
//   - time to re-prefill the same history from scratch,
// and the ratio re-prefill / resume, all in one run. Resumed sessions are checked to continue
// exactly (the next token's logits equal the never-parked session's).
//
// On the CUDA engine (device kCuda) the session is prefilled on the device, where its state then
// lives (device residency). Its host layers are brought back by SessionState::SyncToHost() before
// anything reads or copies them: that device -> host copy is timed on its own (device_to_host_s),
// the reference continuation comes from a clone of the synced state, and parking then starts from
// the host copy. The engine uploads a resumed session at its first step, so the time of that
// first step (host -> device upload plus one decode step) is reported too
// (first_step_after_resume_s). Every JSON row names the engine's device.
#ifndef SDMSERVE_TOOLS_SDM_BENCH_STATE_BENCHMARK_H_
#define SDMSERVE_TOOLS_SDM_BENCH_STATE_BENCHMARK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/engine.h"

namespace sdm::bench {

struct StateBenchOptions {
  EngineDevice device = EngineDevice::kAuto;
  std::vector<std::string> presets = {"debug_sdm"};
  std::vector<int64_t> lengths = {128, 1024, 8192};
  int threads = 0;
  uint64_t seed = 1;
  std::string dir;  // snapshot directory (default: a temporary one)
  std::string json_path;
  // Also measure a session whose SDM tables hold a row for every slot (random values): the most
  // a park or resume moves (1.61 GB of bf16 rows for sdm_flagship), through the engine's own
  // path: a resume converted inside its step and one staged ahead, and a park (SyncToHost).
  bool full_table = false;
};

absl::Status RunStateBenchmark(const StateBenchOptions& options);

}  // namespace sdm::bench

#endif  // SDMSERVE_TOOLS_SDM_BENCH_STATE_BENCHMARK_H_
