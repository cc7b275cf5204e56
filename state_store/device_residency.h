// A session's state while an accelerator backend keeps it in device memory (docs/model-spec.md §7:
// the resident tier lives in HBM on the CUDA backend).
//
// The host SessionState stays the canonical format (the codec, forks and the host/disk tiers use
// it). When a backend first runs a session it copies the session's layers to the device and
// attaches a DeviceResidency; from then on the device copy is the truth and the host layers are
// stale (position and sampler fields stay on the host and current). Anything that reads or
// copies the layers on the host must first call SessionState::SyncToHost(), which moves the
// device copy back and detaches it. Destroying the residency frees its device memory.
//
// Threads: the store calls CopyToHost() and destroys residencies from its own threads (the
// eviction worker, a Delete/Fork/Park caller), never while the session is in an engine step and
// never with the store's lock held; an implementation selects its device and stream itself and
// must finish (or fence) any work still using the memory before freeing it.
#ifndef SDMSERVE_STATE_STORE_DEVICE_RESIDENCY_H_
#define SDMSERVE_STATE_STORE_DEVICE_RESIDENCY_H_

#include <cstdint>

#include "absl/status/status.h"

namespace sdm {

class SessionState;

class DeviceResidency {
 public:
  virtual ~DeviceResidency() = default;

  // Copies the device layers into `host`'s layers (overwriting their stale content; KV caches
  // are extended to host.position(), SDM rows the device wrote get private host rows). Returns
  // only once the host bytes are in place. On error `host` may be partly written and the
  // residency stays attached (the device copy is intact). Called by SessionState::SyncToHost().
  virtual absl::Status CopyToHost(SessionState& host) = 0;

  // Device bytes this session alone holds (KV pages, private SDM rows, slot tables; not the
  // shared weights or M0). Counted in SessionState::ResidentBytes() and the store's resident
  // budget.
  virtual int64_t DeviceBytes() const = 0;
};

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_DEVICE_RESIDENCY_H_
