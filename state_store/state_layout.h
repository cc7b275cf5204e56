// The shape of one session's recurrent state, layer by layer, independent of the model config:
// the state store knows shapes, never weights (the engine builds a StateLayout from its config).
#ifndef SDMSERVE_STATE_STORE_STATE_LAYOUT_H_
#define SDMSERVE_STATE_STORE_STATE_LAYOUT_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "base/bf16.h"
#include "state_store/row_pool.h"

namespace sdm {

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
};

struct StateLayout {
  std::vector<LayerStateLayout> layers;  // one per model layer
};

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_STATE_LAYOUT_H_
