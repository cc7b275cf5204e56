// What the state-store fuzzers share (tests/fuzz/state_*_fuzzer.cc), besides
// tests/fuzz/fuzz_util.h: a fixed small layout (no model needed) — a full-attention KV layer, an
// SDM layer and a sliding-window KV layer whose ring wraps after 3 tokens — and a session filled
// recognisably.
#ifndef SDMSERVE_TESTS_FUZZ_FUZZ_STATE_UTIL_H_
#define SDMSERVE_TESTS_FUZZ_FUZZ_STATE_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

#include "state_store/session_state.h"
#include "state_store/state_layout.h"
#include "tests/fuzz/fuzz_util.h"

namespace sdm::fuzz {

inline constexpr uint64_t kFingerprint = 0x5d3c0dec5eed0001ull;
inline constexpr int64_t kWidth = 4;
inline constexpr int64_t kSdmHeads = 2;
inline constexpr int64_t kSlots = 8;
inline constexpr int64_t kRing = 3;

inline StateLayout MakeLayout() {
  LayerStateLayout full;
  full.kind = LayerStateLayout::Kind::kKv;
  full.kv_row_width = kWidth;
  LayerStateLayout table;
  table.kind = LayerStateLayout::Kind::kSdm;
  table.sdm_heads = kSdmHeads;
  table.slots_per_head = kSlots;
  table.row_width = kWidth;
  auto m0 = std::make_shared<float[]>(kSdmHeads * kSlots * kWidth);
  for (int64_t i = 0; i < kSdmHeads * kSlots * kWidth; ++i) m0[i] = 0.25f * static_cast<float>(i);
  table.m0 = std::shared_ptr<const float>(m0, m0.get());
  table.row_pool = std::make_shared<RowPool>(kWidth, /*max_rows=*/4096);
  LayerStateLayout ring = full;
  ring.ring_capacity = kRing;
  StateLayout layout;
  layout.layers = {full, table, ring};
  return layout;
}

inline const StateLayout& Layout() {
  static const StateLayout layout = MakeLayout();
  return layout;
}

// Feeds `tokens` recognisable tokens to `state` (KV rows and one SDM row write per token).
inline void FillState(SessionState& state, int tokens) {
  for (int t = 0; t < tokens; ++t) {
    for (int layer : {0, 2}) {
      float* k = state.kv(layer).NextKeyRow();
      float* v = state.kv(layer).NextValueRow();
      for (int64_t i = 0; i < kWidth; ++i) {
        k[i] = static_cast<float>(t * 10 + i);
        v[i] = -static_cast<float>(t * 10 + i);
      }
      state.kv(layer).Commit();
    }
    float* row = state.sdm(1).MutableRow(t % kSdmHeads, (t * 5) % kSlots);
    row[t % kWidth] += 1.0f;
    state.AdvancePosition();
  }
  state.sampler_seed = 7;
  state.sampler_draws = static_cast<uint64_t>(state.position());
  state.pending_token = state.position() > 0 ? 65 : -1;
}

// A fuzzer's LLVMFuzzerTestOneInput: a mode byte, then the bytes; mode bit 0 runs `fix_up`
// on them (checksums recomputed) before `check`.
inline int RunInput(const uint8_t* data, size_t size, void (*fix_up)(std::string& bytes),
                    void (*check)(const std::string& bytes)) {
  if (size == 0) return 0;
  std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 1) fix_up(bytes);
  check(bytes);
  return 0;
}

}  // namespace sdm::fuzz

#endif  // SDMSERVE_TESTS_FUZZ_FUZZ_STATE_UTIL_H_
