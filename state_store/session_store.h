// SessionStateStore: where every session's state lives between steps (docs/model-spec.md §7).
//
// Tiers: resident (SessionState objects the engine can step; on the CPU backend a bounded "hot"
// budget), host (the compact serialised form, state_codec.h) and disk (one snapshot file per
// session under `dir`, written atomically, state_files.h). A session in use is pinned resident
// by its SessionLease. When resident bytes exceed their budget, the least recently used idle
// sessions are serialised to host; when host bytes exceed theirs, the oldest host sessions are
// written to disk. Both moves run on a background worker, off the decode path; Acquire() of a
// parked session moves it back on demand. Only a session's own rows, tables and small buffers
// move, never the shared M0. Idle sessions are deleted once their TTL has passed.
//
// Resuming is exact: a session parked on host or disk and restored continues bit for bit as if
// it had stayed resident. Forks share SDM rows copy-on-write while both are resident.
//
// On Open() the store lists the snapshots in `dir`. A snapshot that is truncated, corrupted, of
// another format version or of another model is moved to `dir/quarantine/` under a unique name
// (never deleted) and that session's Acquire() answers DATA_LOSS (damage) or FAILED_PRECONDITION
// (version or model) with the reason; every other session is unaffected.
//
// Device residency (state_store/device_residency.h): on an accelerator backend a resident
// session's layers may live in device memory. Its resident bytes then count the device bytes
// and the stale host copy (which still occupies RAM). Every path that reads or copies its layers
// on the host syncs it first (SessionState::SyncToHost()): parking to host or disk, PersistAll,
// Fork. A failed sync is an error of that session only: it stays resident and usable, the caller
// gets the status, and background eviction logs it, counts StoreStats::sync_errors and parks
// other sessions instead. Syncs and the destruction of residencies happen outside the store's
// lock. Deleting or expiring a session destroys its residency (freeing its device memory).
//
// Thread-safety: every method is thread-safe. A lease must be released (destroyed) before the
// store is destroyed.
#ifndef SDMSERVE_STATE_STORE_SESSION_STORE_H_
#define SDMSERVE_STATE_STORE_SESSION_STORE_H_

#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "state_store/session_state.h"
#include "state_store/state_codec.h"
#include "state_store/state_files.h"
#include "state_store/state_layout.h"

namespace sdm {

enum class Tier { kResident = 0, kHost = 1, kDisk = 2 };
inline constexpr int kNumTiers = 3;
absl::string_view TierName(Tier tier);

struct SessionStoreOptions {
  // Bytes of resident state (SDM rows, slot tables, KV pages) before idle sessions are parked.
  int64_t resident_budget_bytes = int64_t{4} << 30;
  // Bytes of serialised sessions in host memory before the oldest are written to disk.
  int64_t host_budget_bytes = int64_t{8} << 30;
  // Snapshot directory; empty: no disk tier (host is then the last tier and may exceed its
  // budget, which Stats() reports).
  std::filesystem::path dir;
  // TTL of sessions created without one; InfiniteDuration(): never expire.
  absl::Duration default_ttl = absl::InfiniteDuration();
  StateFiles* files = StateFiles::Default();
  // false: evictions and expiry run inline in the calling thread (deterministic tests).
  bool background = true;
};

struct SessionInfo {
  std::string id;
  std::string metadata;
  Tier tier = Tier::kResident;
  bool in_use = false;
  int64_t position = -1;       // tokens in the history; -1 when not known without loading
  bool pending_token = false;  // position known: a sampled token waits to be fed (not counted)
  int64_t bytes = 0;           // in its current tier
  int64_t private_rows = 0;    // resident only: SDM rows it maps
  int64_t shared_rows = 0;     // resident only: of those, shared with a fork
  absl::Time last_used;
  absl::Duration ttl;
  std::string error;  // non-empty: its snapshot failed its checks (quarantined)
};

struct StoreStats {
  int64_t sessions[kNumTiers] = {0, 0, 0};
  int64_t bytes[kNumTiers] = {0, 0, 0};      // resident: exact (shared rows once)
  int64_t evictions[kNumTiers] = {0, 0, 0};  // moves out of the tier
  int64_t restores[kNumTiers] = {0, 0, 0};   // moves from the tier back to resident
  int64_t rows_live = 0;                     // SDM rows allocated (resident)
  int64_t rows_shared = 0;                   // of those, referenced by more than one session
  int64_t snapshot_errors = 0;               // failed disk writes
  int64_t sync_errors = 0;                   // failed device -> host copies (session kept)
  int64_t quarantined = 0;
  int64_t expired = 0;
  int64_t in_use = 0;
};

class SessionStateStore;

// A session pinned resident for one caller. Movable; releases the pin when destroyed.
class SessionLease {
 public:
  SessionLease() = default;
  SessionLease(SessionLease&& other) noexcept;
  SessionLease& operator=(SessionLease&& other) noexcept;
  ~SessionLease();

  SessionState& state() const { return *state_; }
  const std::string& id() const { return id_; }
  explicit operator bool() const { return state_ != nullptr; }

 private:
  friend class SessionStateStore;
  SessionLease(SessionStateStore* store, std::string id, SessionState* state)
      : store_(store), id_(std::move(id)), state_(state) {}
  void Reset();

  SessionStateStore* store_ = nullptr;
  std::string id_;
  SessionState* state_ = nullptr;
};

class SessionStateStore {
 public:
  // `layout` is the engine's state layout (its row pool is replaced by the store's own, so the
  // store's accounting is exact); `fingerprint` identifies the model (Engine::fingerprint()).
  static absl::StatusOr<std::unique_ptr<SessionStateStore>> Open(
      const StateLayout& layout, uint64_t fingerprint, const SessionStoreOptions& options);
  ~SessionStateStore();
  // Use Open(); the key keeps construction private to it.
  class Key {
    friend class SessionStateStore;
    Key() = default;
  };
  SessionStateStore(Key, const StateLayout& layout, uint64_t fingerprint,
                    const SessionStoreOptions& options);
  SessionStateStore(const SessionStateStore&) = delete;
  SessionStateStore& operator=(const SessionStateStore&) = delete;

  // Snapshots found at Open() that failed their checks, with reasons.
  std::vector<std::string> open_errors() const;

  // Ids: 1-128 characters of [A-Za-z0-9._-]. ttl <= 0: the default.
  absl::Status Create(absl::string_view id, absl::string_view metadata,
                      absl::Duration ttl = absl::ZeroDuration());
  // Pins the session resident, restoring it from host or disk if needed. NOT_FOUND, ABORTED
  // (already in use), DATA_LOSS / FAILED_PRECONDITION (its snapshot failed its checks).
  absl::StatusOr<SessionLease> Acquire(absl::string_view id);
  // NOT_FOUND; ABORTED while in use. Removes its snapshot file too.
  absl::Status Delete(absl::string_view id);
  // A new session `dst` continuing from `src` (which must not be in use); shares SDM rows
  // copy-on-write when `src` is resident. ttl <= 0: the source's. A source on device is synced
  // to the host first (it then stays resident, host-only); a failed sync is returned.
  absl::Status Fork(absl::string_view src, absl::string_view dst, absl::string_view metadata,
                    absl::Duration ttl = absl::ZeroDuration());
  absl::Status SetMetadata(absl::string_view id, absl::string_view metadata);

  absl::StatusOr<SessionInfo> Get(absl::string_view id) const;
  std::vector<SessionInfo> List() const;  // sorted by id

  // Moves an idle session down to `tier` now (resident -> host -> disk), synchronously. A
  // session on device is synced to the host first; if that fails it stays resident and the
  // residency's error is returned.
  absl::Status Park(absl::string_view id, Tier tier);
  // Writes every session that is not on disk yet to disk and waits (graceful shutdown). Sessions
  // in use are skipped and reported; so are those whose device copy could not be synced (they
  // stay resident).
  absl::Status PersistAll();
  // Deletes idle sessions whose TTL has passed at `now` (also run by the worker every second).
  int ExpireIdle(absl::Time now);

  StoreStats Stats() const;

  // Minimum resident bytes of one session of this layout (its SDM slot tables).
  int64_t MinSessionBytes() const;

 private:
  friend class SessionLease;
  struct Entry;

  absl::Status LoadDirectory();
  absl::StatusOr<SessionRecord> ReadRecord(StateFiles& files, const std::filesystem::path& path,
                                           uint64_t size) const;
  void Release(const std::string& id);
  std::filesystem::path PathOf(absl::string_view id) const;
  void Quarantine(Entry& e, const std::filesystem::path& file, const absl::Status& why);

  // Eviction work; `lock` is held on entry and exit, released around serialisation and I/O.
  void Rebalance(std::unique_lock<std::mutex>& lock);
  // Moves `e` down to `target`. Errors: the device sync of a resident session (it stays
  // resident), or the snapshot write (it stays on host).
  absl::Status ParkOne(std::unique_lock<std::mutex>& lock, Entry& e, Tier target);
  int64_t ResidentBytesLocked() const;
  int64_t HostBytesLocked() const;
  void WorkerLoop();
  void WaitIdle(std::unique_lock<std::mutex>& lock, Entry& e);
  // The entry of `id` once no store operation is moving it; NOT_FOUND if there is none.
  absl::StatusOr<Entry*> FindIdle(std::unique_lock<std::mutex>& lock, absl::string_view id);
  // Reads a parked (host or disk) entry's state; called without the lock while it is busy.
  absl::StatusOr<DecodedSession> DecodeParked(const Entry& e) const;

  StateLayout layout_;
  const uint64_t fingerprint_;
  const SessionStoreOptions options_;

  mutable std::mutex mu_;
  std::condition_variable changed_;  // an entry stopped being busy, or work arrived
  std::map<std::string, std::unique_ptr<Entry>, std::less<>> entries_;
  StoreStats counters_;  // evictions, restores, errors (the rest is computed)
  std::vector<std::string> open_errors_;
  uint64_t clock_ = 0;  // LRU order
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_SESSION_STORE_H_
