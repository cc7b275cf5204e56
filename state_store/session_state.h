// Everything one session carries between tokens: per layer a KvCache (attn and swa layers) or an
// SdmTable (sdm layers), the number of tokens consumed, and the sampler's position in its random
// stream. This is the seam between the engine and the state store (docs/architecture.md): the
// engine reads and writes a session only through these accessors; the store owns where the
// storage lives (resident, host, disk) and moves it while the session is not in a step.
//
// Device residency (state_store/device_residency.h): an accelerator backend may attach a
// DeviceResidency while it keeps the session's layers in device memory. While attached the
// device copy is the truth and the host layers are stale; position, sampler fields and
// pending_token stay current on the host. Whoever reads or copies the layers on the host
// (codec, Clone, Fork, parking) calls SyncToHost() first.
//
// Staged uploads (state_store/device_residency.h, StagedUpload): a backend may attach a copy of
// a host-only session's layers prepared for its device ahead of the step that resumes it. The
// session drops it whenever the copy may go stale: on any non-const access to a layer (the
// engine writes layers only through them), a position change, or AttachDevice. So a stale copy
// is never uploaded; at worst a fresh one is discarded and the step converts the layers itself.
//
// Not thread-safe: a session takes part in at most one engine step at a time.
#ifndef SDMSERVE_STATE_STORE_SESSION_STATE_H_
#define SDMSERVE_STATE_STORE_SESSION_STATE_H_

#include <cstdint>
#include <memory>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "state_store/device_residency.h"
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
  void AdvancePosition() {
    staged_.reset();
    host_current_ = false;
    ++position_;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  bool is_sdm(int64_t layer) const { return std::holds_alternative<SdmTable>(layers_[layer]); }
  // Precondition: the layer is of the matching kind (the engine's layout guarantees it).
  // The non-const accessors drop a staged upload (see above).
  KvCache& kv(int64_t layer) {
    staged_.reset();
    return std::get<KvCache>(layers_[layer]);
  }
  const KvCache& kv(int64_t layer) const { return std::get<KvCache>(layers_[layer]); }
  SdmTable& sdm(int64_t layer) {
    staged_.reset();
    return std::get<SdmTable>(layers_[layer]);
  }
  const SdmTable& sdm(int64_t layer) const { return std::get<SdmTable>(layers_[layer]); }

  // The session's sampler stream (engine/sampler.h draws token i of a stream from
  // (seed, draw index)): resuming a parked session continues the same stream.
  uint64_t sampler_seed = 0;
  uint64_t sampler_draws = 0;
  // The last sampled token that has not been fed back into the state yet (-1: none). A turn
  // that ends on a sampled token leaves it here; the next turn feeds it first.
  int32_t pending_token = -1;

  // Host memory this session's layers occupy (KV pages, private SDM rows, slot tables), also
  // while on device (the stale host copy still occupies RAM). The store budgets it in the
  // resident tier.
  int64_t ResidentBytes() const;
  // Device memory it holds: device()->DeviceBytes() while on device, else 0. The store budgets
  // it in the device tier, separately (HBM and RAM are different budgets).
  int64_t DeviceBytes() const { return device_ != nullptr ? device_->DeviceBytes() : 0; }

  // A deep copy: a new session whose continuation equals this one's (shares only M0).
  // Precondition: !on_device() (SDM_CHECK; these cannot report a failed copy, so callers
  // SyncToHost() first). The copy is host-only.
  std::unique_ptr<SessionState> Clone() const;
  // A copy that shares every SDM row copy-on-write (KV rows are copied); writing to either
  // session copies only the rows it writes. Same precondition as Clone().
  std::unique_ptr<SessionState> Fork() const;

  // Hands the layers' truth to `residency` (called by a backend after it copied the layers to
  // the device). Precondition: not on device already (SDM_CHECK) and residency non-null.
  void AttachDevice(std::unique_ptr<DeviceResidency> residency);
  // Attaches a backend's staged copy of the host layers (replacing any earlier one).
  // Precondition: not on device (SDM_CHECK: the host layers are stale there) and non-null.
  void AttachStaged(std::unique_ptr<StagedUpload> staged);
  // The staged upload; null when none is attached or it was dropped.
  const StagedUpload* staged() const { return staged_.get(); }
  // Detaches and returns it (null if none): the backend that resumes the session takes it.
  std::unique_ptr<StagedUpload> TakeStaged() { return std::move(staged_); }
  // Drops it (its memory goes back to its backend), e.g. when a job that staged the session
  // ends without running it.
  void DropStaged() { staged_.reset(); }
  // The attached residency; null while host-only.
  DeviceResidency* device() const { return device_.get(); }
  bool on_device() const { return device_ != nullptr; }
  // Makes the host layers current: no-op when host-only; else copies the device layers back
  // and detaches (destroying the residency frees its device memory); when the host layers are
  // current already (host_current(): copied back since the last step) it only detaches. On
  // error the session stays on device (the device copy is intact, the host layers may be partly
  // written and are still stale) and the error is returned.
  absl::Status SyncToHost();
  // Makes the host layers current and stays on device (DeviceResidency::CopyChangesToHost):
  // no-op when host-only or already current. Until the next position change (a step) the host
  // layers may then be read (encoded, written) as a host-only session's are. Same thread rules
  // as SyncToHost; errors as CopyChangesToHost (Unimplemented where the backend cannot).
  absl::Status CopyChangesToHost();
  // Whether the host layers are current: host-only, or on device and copied back
  // (CopyChangesToHost) since it was attached and since the last position change.
  bool host_current() const { return device_ == nullptr || host_current_; }
  // Drops the residency without copying back (the device copy is lost; the host layers stay
  // as stale as they were). For sessions being deleted, or a backend discarding its copy.
  // Frees device memory: same thread rules as SyncToHost (state_store/device_residency.h).
  void DetachDevice() { device_.reset(); }

  // For restoring a parked session (state_store/state_codec.h).
  void set_position(int64_t position) {
    staged_.reset();
    host_current_ = false;
    position_ = position;
  }

  // Damage. A backend whose forward pass fails after it began changing the layers (engine/
  // engine_backend.h, ForwardCommit) marks every session of that pass failed: its layers may
  // hold part of the pass (some layers written, positions not advanced), so stepping it again
  // would apply writes twice. The engine refuses failed sessions (FAILED_PRECONDITION) and the
  // state store neither persists nor parks them and refuses to lease them again (delete the
  // session to reset it; its last snapshot on disk, if any, is the last good copy). The mark is
  // not serialised and never cleared: a failed session is discarded, not repaired.
  void MarkFailed(absl::Status cause) {
    if (cause.ok()) cause = absl::InternalError("marked failed");
    if (failure_.ok()) failure_ = std::move(cause);
  }
  bool failed() const { return !failure_.ok(); }
  // OK, or the cause passed to the first MarkFailed.
  const absl::Status& failure() const { return failure_; }

  // Forgets which SDM rows were written and the writes journaled (SdmTable::ClearDirty on every
  // SDM layer): called once what the session holds is on disk, so that the next delta carries
  // only later writes.
  void ClearDirty() {
    for (auto& layer : layers_) {
      if (auto* table = std::get_if<SdmTable>(&layer)) table->ClearDirty();
    }
  }

 private:
  std::unique_ptr<SessionState> Copy(bool share_rows) const;

  int64_t position_ = 0;
  // On device: the host layers hold what the device does (see host_current()).
  bool host_current_ = false;
  absl::Status failure_;
  std::vector<std::variant<KvCache, SdmTable>> layers_;
  // Declared after layers_ so that it is destroyed first: a residency may refer to the host
  // layers (e.g. pinned staging registered over them) until it is gone.
  std::unique_ptr<DeviceResidency> device_;
  std::unique_ptr<StagedUpload> staged_;  // only while host-only
};

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_SESSION_STATE_H_
