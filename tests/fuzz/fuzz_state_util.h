// What the state-store fuzzers share (tests/fuzz/state_*_fuzzer.cc), besides
// tests/fuzz/fuzz_util.h: a fixed small layout (no model needed) — a full-attention KV layer, an
// SDM layer and a sliding-window KV layer whose ring wraps after 3 tokens — and a session filled
// recognisably (its SDM writes journaled or not).
#ifndef SDMSERVE_TESTS_FUZZ_FUZZ_STATE_UTIL_H_
#define SDMSERVE_TESTS_FUZZ_FUZZ_STATE_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <span>
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

// The SDM layer's stand-in write, for journaled deltas (state_store/sdm_table.h): four rows per
// token, row[c] = alpha * row[c] + k * (v[c] - beta).
inline void StandInWrite(std::span<float* const> rows, std::span<const float> k,
                         std::span<const float> alpha, float beta, const float* v,
                         int64_t row_width, uint32_t rule) {
  for (size_t i = 0; i < rows.size(); ++i) {
    for (int64_t c = 0; c < row_width; ++c) {
      rows[i][c] = alpha[0] * rows[i][c] + k[i] * (v[c] - beta);
    }
  }
}

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
  table.sdm_write.apply = &StandInWrite;
  table.sdm_write.writes = 4;
  table.sdm_write.alphas = 1;
  table.sdm_write.record = true;
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

// The same, but the SDM layer's writes go through the write journal (four slots per token, as an
// engine writes them): a delta of `state` then carries the writes, not the rows.
inline void FillStateJournaled(SessionState& state, int tokens) {
  for (int t = 0; t < tokens; ++t) {
    const int64_t head = t % kSdmHeads;
    int32_t slots[4];
    float* rows[4];
    for (int j = 0; j < 4; ++j) {
      slots[j] = static_cast<int32_t>((t * 3 + j) % kSlots);
      rows[j] = state.sdm(1).MutableRow(head, slots[j]);
    }
    const float k[4] = {0.5f, -0.25f, 1.0f, 2.0f}, alpha[1] = {0.75f}, v[kWidth] = {1, 2, 3, 4};
    StandInWrite(rows, k, alpha, 0.5f, v, kWidth, 0);
    state.sdm(1).JournalWrite(head, slots, k, alpha, 0.5f, v);
    for (int layer : {0, 2}) {
      float* key = state.kv(layer).NextKeyRow();
      float* value = state.kv(layer).NextValueRow();
      for (int64_t i = 0; i < kWidth; ++i) key[i] = value[i] = static_cast<float>(t + i);
      state.kv(layer).Commit();
    }
    state.AdvancePosition();
  }
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
