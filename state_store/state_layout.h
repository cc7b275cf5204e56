// The shape of one session's recurrent state, layer by layer, independent of the model config:
// the state store knows shapes, never weights (the engine builds a StateLayout from its config).
#ifndef SDMSERVE_STATE_STORE_STATE_LAYOUT_H_
#define SDMSERVE_STATE_STORE_STATE_LAYOUT_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "base/bf16.h"
#include "state_store/row_pool.h"

namespace sdm {

// How an SDM layer's delta-rule writes are journaled (SdmTable's write journal) and applied again
// from a journal (recovery from a delta log, state_store/state_log.h). `apply` is the engine's own
// write of one token and head (kernels/cpu/sdm_update.h, SdmWriteRows), so rows rebuilt from a
// journal are bit for bit the rows the engine wrote.
struct SdmWriteSpec {
  using Apply = void (*)(std::span<float* const> rows, std::span<const float> k,
                         std::span<const float> alpha, float beta, const float* v,
                         int64_t row_width, uint32_t rule);
  Apply apply = nullptr;  // null: writes are never journaled (deltas carry the rows)
  int64_t writes = 0;     // rows written per token and head (W)
  int64_t alphas = 0;     // decays per write: 1, or W with key-weighted decay
  uint32_t rule = 0;      // the update rule, as `apply` numbers it
  // Journal writes (needs `apply`): the state store turns it on when it persists deltas.
  bool record = false;
};

struct LayerStateLayout {
  enum class Kind { kKv, kSdm };
  Kind kind = Kind::kKv;
  // kKv: one key row and one value row of `kv_row_width` floats per cached token.
  int64_t kv_row_width = 0;
  int64_t ring_capacity = 0;  // > 0: only the last ring_capacity tokens are kept (sliding window)
  // How the rows are stored in memory (snapshots and deltas hold fp32 whatever this is).
  DType kv_element = DType::kF32;
  // kSdm: `sdm_heads` tables of `slots_per_head` rows of `row_width` floats.
  int64_t sdm_heads = 0;
  int64_t slots_per_head = 0;
  int64_t row_width = 0;
  // Shared read-only initial memory M0, [sdm_heads * slots_per_head, row_width]; null means
  // zeros. The shared_ptr keeps the model's storage alive as long as any session refers to it.
  std::shared_ptr<const float> m0;
  // Where the layer's private rows come from: one pool (of row_width floats) per model, shared
  // by all its SDM layers and sessions, so forks can share rows across sessions.
  std::shared_ptr<RowPool> row_pool;
  // How its writes are journaled and applied (see SdmWriteSpec).
  SdmWriteSpec sdm_write;
};

struct StateLayout {
  std::vector<LayerStateLayout> layers;  // one per model layer
};

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_STATE_LAYOUT_H_
