// Everything one session carries between tokens: per layer a KvCache (attn and swa layers) or an
// SdmTable (sdm layers), the number of tokens consumed, and the sampler's position in its random
// stream. This is the seam between the engine and the state store (docs/architecture.md): the
// engine reads and writes a session only through these accessors; the store owns where the
// storage lives (resident, host, disk) and moves it while the session is not in a step.
//
// Not thread-safe: a session takes part in at most one engine step at a time.
#ifndef SDMSERVE_STATE_STORE_SESSION_STATE_H_
#define SDMSERVE_STATE_STORE_SESSION_STATE_H_

#include <cstdint>
#include <memory>
#include <variant>
#include <vector>

#include "state_store/kv_cache.h"
#include "state_store/sdm_table.h"
#include "state_store/state_layout.h"

namespace sdm {

class SessionState {
 public:
  explicit SessionState(const StateLayout& layout);
  SessionState(const SessionState&) = delete;
  SessionState& operator=(const SessionState&) = delete;

  // Tokens consumed so far; the next token fed is at this position.
  int64_t position() const { return position_; }
  void AdvancePosition() { ++position_; }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  bool is_sdm(int64_t layer) const { return std::holds_alternative<SdmTable>(layers_[layer]); }
  // Precondition: the layer is of the matching kind (the engine's layout guarantees it).
  KvCache& kv(int64_t layer) { return std::get<KvCache>(layers_[layer]); }
  const KvCache& kv(int64_t layer) const { return std::get<KvCache>(layers_[layer]); }
  SdmTable& sdm(int64_t layer) { return std::get<SdmTable>(layers_[layer]); }
  const SdmTable& sdm(int64_t layer) const { return std::get<SdmTable>(layers_[layer]); }

  // The session's sampler stream (engine/sampler.h draws token i of a stream from
  // (seed, draw index)): resuming a parked session continues the same stream.
  uint64_t sampler_seed = 0;
  uint64_t sampler_draws = 0;
  // The last sampled token that has not been fed back into the state yet (-1: none). A turn
  // that ends on a sampled token leaves it here; the next turn feeds it first.
  int32_t pending_token = -1;

  // Bytes of state this session holds (KV pages, private SDM rows, slot tables).
  int64_t ResidentBytes() const;

  // A deep copy: a new session whose continuation equals this one's (shares only M0).
  std::unique_ptr<SessionState> Clone() const;
  // A copy that shares every SDM row copy-on-write (KV rows are copied); writing to either
  // session copies only the rows it writes.
  std::unique_ptr<SessionState> Fork() const;

  // For restoring a parked session (state_store/state_codec.h).
  void set_position(int64_t position) { position_ = position; }

 private:
  std::unique_ptr<SessionState> Copy(bool share_rows) const;

  int64_t position_ = 0;
  std::vector<std::variant<KvCache, SdmTable>> layers_;
};

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_SESSION_STATE_H_
