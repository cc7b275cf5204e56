// A session's state while an accelerator backend keeps it in device memory: the store's device
// tier (docs/model-spec.md §7: the resident tier lives in HBM on the CUDA backend).
//
// The host SessionState stays the canonical format (the codec, forks and the host/disk tiers use
// it). When a backend first runs a session it copies the session's layers to the device and
// attaches a DeviceResidency; from then on the device copy is the truth and the host layers are
// stale (position and sampler fields stay on the host and current). Anything that reads or
// copies the layers on the host must first call SessionState::SyncToHost(), which moves the
// device copy back and detaches it. Destroying the residency frees its device memory.
//
// Ownership: a residency is made by one backend instance (`owner`, an address that instance
// chooses, e.g. its device context) and only that instance may step it; the backend checks
// owner() before it treats the residency as its own type (no RTTI needed, and a session resident
// on another engine's device is refused rather than misread).
//
// Threads: every device-host move and every destruction of a residency happens on the thread
// that runs engine steps, between steps (SessionStateStore::RunDeviceMoves()), or on the calling
// thread where no step thread drives the store's device moves (tests, sdm-cli). Never from the
// store's eviction worker, never during a step, never with the store's lock held. So an
// implementation may use its compute and transfer streams without further locking against
// steps; it must still finish (or fence) any work using the memory before freeing it.
//
// A StagedUpload (below) is the step before residency: a backend's copy of a host-only
// session's layers, already converted to what its device takes, made off the step thread
// (Engine::StageResume) so that the step that resumes the session only copies it (or, where the
// backend also copied it to the device ahead, only scatters it).
#ifndef SDMSERVE_STATE_STORE_DEVICE_RESIDENCY_H_
#define SDMSERVE_STATE_STORE_DEVICE_RESIDENCY_H_

#include <cstdint>

#include "absl/status/status.h"

namespace sdm {

class SessionState;

class DeviceResidency {
 public:
  explicit DeviceResidency(const void* owner) : owner_(owner) {}
  virtual ~DeviceResidency() = default;
  DeviceResidency(const DeviceResidency&) = delete;
  DeviceResidency& operator=(const DeviceResidency&) = delete;

  // The backend instance that made this residency (see Ownership above).
  const void* owner() const { return owner_; }

  // Copies the device layers into `host`'s layers (overwriting their stale content; KV caches
  // are extended to host.position(), SDM rows the device wrote get private host rows). Returns
  // only once the host bytes are in place. On error `host` may be partly written and the
  // residency stays attached (the device copy is intact). Called by SessionState::SyncToHost().
  virtual absl::Status CopyToHost(SessionState& host) = 0;

  // Makes `host`'s layers current without detaching: copies back only what changed on the
  // device since the residency was attached or since the last successful call (SDM rows the
  // device wrote, through SdmTable::MutableRow so that the host table marks them dirty, and KV
  // positions the host lacks), so that the store can write a turn's delta while the session
  // stays on the device. Returns once the host bytes are in place; on error `host` may be partly
  // written (still stale) and the next call copies everything it would have. An implementation
  // relies on the host layers holding what they held at the attach (the device copy was made
  // from them; nobody writes them while attached) plus what earlier calls copied. Unimplemented
  // by default (CopiesChanges() false): the store then writes the session only when it leaves
  // the device. Same thread rules as CopyToHost.
  virtual absl::Status CopyChangesToHost(SessionState& /*host*/) {
    return absl::UnimplementedError("this device residency copies back only whole sessions");
  }
  // Whether CopyChangesToHost is implemented.
  virtual bool CopiesChanges() const { return false; }

  // Device bytes this session alone holds (KV pages, private SDM rows, slot tables; not the
  // shared weights or M0): what it counts in the store's device tier.
  virtual int64_t DeviceBytes() const = 0;

 private:
  const void* const owner_;
};

// A host-only session's layers as a backend will upload them (e.g. converted to the device's
// number format in page-locked memory), made ahead of the step that resumes the session. It is
// a copy of the host layers at the time it was made, so SessionState drops it whenever they may
// change (any non-const access to a layer, a position change, attaching a residency); a backend
// that finds one of its own on a session it resumes uploads from it instead of converting.
//
// Threads: made on any thread while nothing steps the session (it is a read of the host
// layers); destroyed on any thread, so its destructor must not wait for the device (a backend
// gives its memory back to a pool: an upload that read it has finished or was waited for, and
// memory a copy it started ahead may still use stays out of the pool until that copy is done).
//
// Memory: what it holds is the backend's, bounded by the backend (EngineOptions::
// resume_staging_bytes on CUDA), and counted in none of the store's budgets.
class StagedUpload {
 public:
  explicit StagedUpload(const void* owner) : owner_(owner) {}
  virtual ~StagedUpload() = default;
  StagedUpload(const StagedUpload&) = delete;
  StagedUpload& operator=(const StagedUpload&) = delete;

  // The backend instance that made it (as DeviceResidency::owner()).
  const void* owner() const { return owner_; }
  // Blocks until the work it started ahead of the step (a copy to the device) is done; nothing
  // to wait for by default. Benchmarks call it to time a step apart from that work.
  virtual absl::Status WaitForCopy() const { return absl::OkStatus(); }

 private:
  const void* const owner_;
};

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_DEVICE_RESIDENCY_H_
