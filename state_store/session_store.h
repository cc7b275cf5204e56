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
// Sessions are named by SessionKey (state_store/session_key.h): a tenant and an id. Errors name a
// session by its id only (the caller's own name for it); its tenant never appears in them.
//
// Accounting: the store keeps, per tenant, the number of sessions and the bytes of their state
// in their current tier (Usage()), updated whenever a session is created, forked, deleted,
// expired, parked, restored or returned by its lease, so a caller enforcing per-tenant limits
// never lists the store. A session's position (SessionInfo::position) is kept in its entry, from
// the state when its lease is returned and from the snapshot's record for sessions found on disk,
// so it is known without a lease. The store owns the SDM row pool every session's rows come from:
// one-shot sessions (NewSession(), the state of a request on no named session) come from it too
// and count in the resident bytes while they live. While a session is leased its rows are
// counted live (from the pool) and its KV pages and slot tables as of when it was acquired.
//
// Durability (docs/state-format.md, "Durability"): with a snapshot directory, `persist` says
// when sessions are written there while they stay in memory. kTurn (the default): a session is
// written when it is created or forked and after every turn (its lease returned), by the
// background worker, behind the decode path: turns that end before the worker gets to a session
// are coalesced into one write, and the write never blocks a step (an Acquire of that session
// waits for a write under way, and makes the write itself, on its own thread, when no writer has
// begun it, so that the turn's acknowledgement never waits for the next turn; a write of a
// session on the device first waits for the end of the current step, whose thread copies the
// session's changes back). WhenPersisted() lets the caller acknowledge a
// turn only once it is written (the scheduler does), so a kill -9 loses at most the turn in flight.
// The first write is a full snapshot; later ones are deltas appended to the session's log
// (state_store/state_log.h: the KV rows the turns appended and, per SDM layer, the writes they made
// or the rows they touched, whichever is smaller: journal_writes), compacted into a full snapshot
// once the log would pass log_compact_ratio times the larger of the last snapshot and the snapshot
// the session would write now, or 256 records. Up to persist_writers sessions are written at once,
// the turns someone waits for first, and each waiter is called as soon as its own write is done.
// What "written" means is SessionStoreOptions::persist_sync: with PersistSync::kWrite (the
// default) a write is done once write(2) and rename(2) have handed it to the kernel — a process
// crash (kill -9, OOM kill) cannot lose it — and a background syncer fsyncs the files written
// since its last round, one fsync per file and one of the directory per round, a round at most
// every persist_sync_interval (group commit); a power loss or kernel crash loses at most the
// writes since the last completed round (recovery: snapshot plus the log's good records; a
// snapshot's data is written back before its rename, StateFiles::WriteAtomically). With
// PersistSync::kFsync a write is done once it is fsynced (and its directory, when it created or
// renamed a file): a power loss loses at most the turn in flight too. A background fsync that
// fails is a failed write (counted, logged, health UNAVAILABLE); the session is then written
// again in full, fsynced, and is healthy once that has reached the disk. Parks to disk (eviction,
// PersistAll) always fsync; so does a shared directory (other stores read it).
// kIdle: once a session has been idle for `persist_idle`. kShutdown: only PersistAll() and eviction
// to disk write. A session an accelerator holds on the device is written as any other where its
// residency copies back what changed (DeviceResidency::CopiesChanges, the CUDA backend's): before
// the write, the step thread copies the turns' changes to the host layers between steps, and the
// session stays on the device. Where it does not, such a session is written only when it leaves
// the device (its host layers are stale until then) and nobody waits for its turns.
//
// Failures are loud: a failed write is counted once per session and episode
// (StoreStats::persist_failures), logged once per distinct cause, and turns PersistHealth() to
// UNAVAILABLE naming the cause until a write succeeds; a turn whose write failed, or that ends
// while its session's writes fail, is not acknowledged as saved (WhenPersisted answers UNAVAILABLE:
// kept in memory, written once writes succeed again). While writes fail and host memory is over its
// budget, Create() and Acquire() answer UNAVAILABLE (retryable) rather than accept work the store
// could neither write nor hold, and resident sessions are not moved to host.
//
// On Open() the store lists the snapshots in `dir`. A snapshot that is truncated or corrupted is
// moved to `dir/quarantine/` under a unique name (never deleted) and that session's Acquire()
// answers DATA_LOSS with the reason; every other session is unaffected. One of another format
// version or of another model is sound, only not this store's: it is left in place with its log,
// and the session answers FAILED_PRECONDITION (listed, never expired) until it is deleted (which
// removes its files) or a store of its model opens the directory and serves it. A quarantined
// session stays a session (listed, with SessionInfo::error) until it is deleted, also across
// restarts: Open() makes one, answering DATA_LOSS, for each key whose latest copy under
// dir/quarantine/ is not marked deleted and that has no snapshot in `dir` (not on a shared
// directory, nor for hashed file names, which do not name their key). Delete() of a quarantined
// session renames its copy to <name>.deleted (kept for the operator, no longer a session).
//
// The device tier (state_store/device_residency.h): on an accelerator backend a resident
// session's layers may live in device memory. The store budgets the device bytes separately
// (device_budget_bytes, StoreStats::device_bytes); the resident bytes count host memory only
// (a session on device keeps its host copy, stale or, where its turns are copied back to be
// written, current, which still occupies RAM). Device-host moves
// and the destruction of residencies run only on the step thread between steps: a thread that
// runs engine steps registers itself (SetStepThread) and calls RunDeviceMoves() before each
// step; the store queues work for it and wakes it. RunDeviceMoves() copies back the least
// recently used idle sessions while the device tier is over budget, serves the copies that
// Park, Fork, PersistAll and the eviction worker asked for (they wait for it), and destroys the
// residencies of deleted and expired sessions. Without a registered step thread (tests,
// sdm-cli), or on that thread itself, the moves run inline on the caller. A failed copy is an
// error of that session only: it stays resident and usable on its device copy, the caller gets
// the status, and background eviction logs it, counts StoreStats::sync_errors and parks other
// sessions instead.
//
// Shared snapshot directory (SessionStoreOptions::shared_dir; a hook for replicas kept apart
// from the rest, docs/replicas.md): several stores may use one `dir`, each serving the sessions
// a router sends it. A lookup of a session this store does not hold (Get, Acquire, Delete, Fork,
// Park, SetMetadata) reads its snapshot's record from `dir` and adopts it as a disk session;
// Create answers ALREADY_EXISTS when `dir` holds the id's snapshot. Acquire of a session this
// store holds first compares its snapshot file's size and modification time with those of the
// file it last read or wrote: when another store has written the file since, this store's copy
// is dropped and the file is read (turns this store had not written yet are lost, and logged);
// when another store has deleted it, the session is gone here too. What this does not do: stop
// two stores that both hold a session from both writing it (the last write wins). Ownership
// (one store per session at a time, fenced writes) is the router's and etcd's job (issue 14).
// A snapshot found this way, or at Open, or whose full read at Acquire fails (each read again
// while another store replaces it), that fails its checks is reported (DATA_LOSS,
// FAILED_PRECONDITION) but not quarantined: it is not this store's file to move (a rename by path
// could move another store's sound replacement), fenced or not. A damaged one answers DATA_LOSS
// to that call only; the next call reads it again.
//
// Ownership (SessionStoreOptions::ownership, replicas; state_store/session_ownership.h): Create,
// Fork (its new session), Acquire and Delete first claim the session, and answer the claim's error
// (UNAVAILABLE while another replica owns it). Each snapshot write is preceded by CheckWrite: a
// refused write is not made, counted (StoreStats::fenced_writes) and logged, and not retried
// (this copy is stale; the owner holds the newer state); the session is not marked failing.
// Delete and Park to disk release the session. The store calls it without its lock. A claim of a
// session the store already holds is answered as it stands, so a Create or Fork of a session id
// that a Delete (or a hand-off) releases meanwhile claims again once that release is done: its
// session is made under a claim the release did not end.
// Fenced snapshots (when the ownership's FencesSnapshots() is true, as EtcdOwnership's is):
// snapshots are never overwritten. Each write goes to a new uniquely named file under
// dir/generations/ and becomes the session's state only when the ownership commits its name
// (CommitSnapshot: atomically, only while this store still owns the session and its copy derives
// from the committed snapshot); a refused commit removes the file, counts a fenced write and logs
// it. Reads (Discover, Acquire, Get) use only the committed name; a held copy whose name is no
// longer the committed one is dropped and re-read. Delete removes the committed name, fenced the
// same way. A commit passes only under the claim its file was written under, so the files of
// writes that were never committed (a crash between write and commit) are garbage once that
// claim is over: a store that takes a session up under a new claim removes them
// (SweepGenerations; StoreStats::orphans_removed). The top-level snapshot files and delta logs are
// then not used.
//
// Thread-safety: every method is thread-safe. A lease must be released (destroyed) before the
// store is destroyed.
#ifndef SDMSERVE_STATE_STORE_SESSION_STORE_H_
#define SDMSERVE_STATE_STORE_SESSION_STORE_H_

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/failure_episode.h"
#include "state_store/row_pool.h"
#include "state_store/session_key.h"
#include "state_store/session_ownership.h"
#include "state_store/session_state.h"
#include "state_store/state_codec.h"
#include "state_store/state_files.h"
#include "state_store/state_layout.h"

namespace sdm {

enum class Tier { kResident = 0, kHost = 1, kDisk = 2 };
// When sessions are written to the snapshot directory (see the class comment).
enum class PersistPolicy { kTurn, kIdle, kShutdown };
// "turn", "idle", "shutdown".
absl::string_view PersistPolicyName(PersistPolicy policy);
absl::StatusOr<PersistPolicy> ParsePersistPolicy(absl::string_view name);
// What a write waits for before it counts as done (see the class comment, Durability).
enum class PersistSync { kWrite, kFsync };
// "write", "fsync".
absl::string_view PersistSyncName(PersistSync sync);
absl::StatusOr<PersistSync> ParsePersistSync(absl::string_view name);
inline constexpr int kNumTiers = 3;
// Durability (class comment): the default of SessionStoreOptions::log_compact_ratio.
inline constexpr double kLogCompactRatio = 2.0;
absl::string_view TierName(Tier tier);

struct SessionStoreOptions {
  // Bytes of resident state (SDM rows, slot tables, KV pages) before idle sessions are parked.
  int64_t resident_budget_bytes = int64_t{4} << 30;
  // Bytes of serialised sessions in host memory before the oldest are written to disk.
  int64_t host_budget_bytes = int64_t{8} << 30;
  // Bytes of device memory held by sessions (the device tier) before the least recently used
  // idle ones are copied back to host memory between steps. 0: none of the store's own (the
  // backend's fixed arenas bound it; the server passes the engine's device state capacity).
  int64_t device_budget_bytes = 0;
  // Snapshot directory; empty: no disk tier (host is then the last tier and may exceed its
  // budget, which Stats() reports).
  std::filesystem::path dir;
  // When sessions are written to `dir` while they stay in memory (class comment, Durability).
  PersistPolicy persist = PersistPolicy::kTurn;
  // Threads writing changed sessions at once (the worker and persist_writers - 1 writers), each
  // a different session: one session's write (its fsync above all) does not hold up the others'
  // acknowledgements. Turns someone waits for (WhenPersisted) are written first, oldest first.
  int persist_writers = 4;
  // A session's delta log is compacted into a full snapshot once the next delta would take it
  // past this many times the snapshot's size (the larger of the last one written and the one the
  // session would write now; or 256 records). A turn then writes its delta plus
  // about 1/ratio of it amortised (in full snapshots); recovery reads, and the directory holds, at
  // most (1 + ratio) x the snapshot per session. 0: every write is a full snapshot.
  double log_compact_ratio = kLogCompactRatio;
  // Deltas carry an SDM layer's writes (slot ids, weights, decays, beta, the value: the write
  // journal of state_store/sdm_table.h) instead of the rows they left, whichever is smaller, when
  // the engine's layout can apply them (SdmWriteSpec::apply). false: always the rows.
  bool journal_writes = true;
  // Sessions held on a device are written after their turns as host sessions are, their changes
  // copied back while they stay there (where the residency can: DeviceResidency::CopiesChanges).
  // The host then keeps a current (fp32) copy of each such session, which counts in
  // resident_budget_bytes: past it, the least recently used idle sessions leave the device too.
  // false: a session on the device is written only when it leaves it, its host copy stays as it
  // was when it arrived, and nobody waits for its turns.
  bool persist_device_turns = true;
  // When a write counts as done (and WhenPersisted's callback runs): handed to the kernel
  // (kWrite; fsynced in the background) or fsynced (kFsync). See the class comment.
  PersistSync persist_sync = PersistSync::kWrite;
  // kWrite: the background syncer's rounds start at most this often (each fsyncs every file
  // written since the last one); what a power loss can lose is bounded by it plus one round.
  absl::Duration persist_sync_interval = absl::Seconds(1);
  // kIdle: how long a changed session stays idle before it is written.
  absl::Duration persist_idle = absl::Seconds(10);
  // TTL of sessions created without one; InfiniteDuration(): never expire.
  absl::Duration default_ttl = absl::InfiniteDuration();
  StateFiles* files = StateFiles::Default();
  // false: evictions and expiry run inline in the calling thread (deterministic tests).
  bool background = true;
  // Snapshots written before keys were typed, under a hashed file name, hold only that digest
  // in their record: this names their key from their metadata (the server's JSON). Without it,
  // or when it answers nullopt, such a session is found when it is first looked up by the key
  // whose file stem it has, and is absent from List() and Usage() until then.
  std::function<std::optional<SessionKey>(absl::string_view metadata)> legacy_key = nullptr;
  // Told PersistHealth() each time it changes (OK <-> UNAVAILABLE): called on the worker thread,
  // never with the store's lock held; never called without a worker (background false).
  std::function<void(const absl::Status& health)> on_persist_health = nullptr;
  // Replicas (docs/replicas.md): other stores, in other processes, read and write `dir` too. See
  // "Shared snapshot directory" in the class comment. Needs `dir`. Sessions never expire then:
  // default_ttl must be infinite and a Create or Fork with a finite ttl is refused
  // (INVALID_ARGUMENT); a ttl in a snapshot found there is ignored.
  bool shared_dir = false;
  // Replicas: who may take up and write each session (state_store/session_ownership.h); null:
  // this store alone. Not owned; must outlive the store. See "Ownership" in the class comment.
  SessionOwnership* ownership = nullptr;
};

struct SessionInfo {
  SessionKey key;
  std::string metadata;
  Tier tier = Tier::kResident;
  bool in_use = false;
  int64_t position = -1;       // tokens in the history; -1: unknown (its snapshot is damaged)
  bool pending_token = false;  // position known: a sampled token waits to be fed (not counted)
  int64_t bytes = 0;           // in its current tier
  int64_t private_rows = 0;    // resident only: SDM rows it maps
  int64_t shared_rows = 0;     // resident only: of those, shared with a fork
  int64_t device_bytes = 0;    // resident only: device memory it holds (0: host-only)
  absl::Time last_used;
  absl::Duration ttl;
  std::string error;  // non-empty: its snapshot failed its checks (quarantined)
};

// What one tenant holds: its sessions, and the sum of their SessionInfo::bytes.
struct TenantUsage {
  int64_t sessions = 0;
  int64_t state_bytes = 0;

  bool operator==(const TenantUsage&) const = default;
};

struct StoreStats {
  int64_t sessions[kNumTiers] = {0, 0, 0};
  int64_t bytes[kNumTiers] = {0, 0, 0};      // resident: exact (shared rows once), one-shots too
  int64_t evictions[kNumTiers] = {0, 0, 0};  // moves out of the tier
  int64_t restores[kNumTiers] = {0, 0, 0};   // moves from the tier back to resident
  int64_t rows_live = 0;                     // SDM rows allocated (resident)
  int64_t rows_shared = 0;                   // of those, referenced by more than one session
  int64_t snapshot_errors = 0;               // failed disk writes (every attempt)
  int64_t persist_failures = 0;              // sessions whose writes began failing (episodes)
  int64_t persist_writes = 0;                // writes of changed sessions (snapshots, deltas)
  int64_t persist_deltas = 0;                // of those, deltas appended to a session's log
  int64_t persist_bytes = 0;                 // their bytes
  int64_t unpersisted = 0;                   // sessions whose latest turn is not on disk yet
  int64_t persist_syncs = 0;                 // background fsyncs of files (PersistSync::kWrite)
  int64_t unsynced = 0;                      // sessions written but not fsynced yet (kWrite)
  int64_t persist_waits = 0;     // WhenPersisted calls that waited for a write (then were called)
  int64_t persist_wait_us = 0;   // the microseconds they waited, in all
  int64_t sync_errors = 0;       // failed device -> host copies (session kept)
  int64_t fenced_writes = 0;     // writes refused: not the owner (ownership)
  int64_t orphans_removed = 0;   // fenced: uncommitted snapshot files swept
  int64_t device_sessions = 0;   // resident sessions on the device (as of last seen)
  int64_t device_bytes = 0;      // their device bytes (the device tier)
  int64_t device_evictions = 0;  // device -> host copies (budget, park, fork)
  int64_t quarantined = 0;
  int64_t expired = 0;
  int64_t in_use = 0;
  int64_t one_shot = 0;  // one-shot sessions alive (not in sessions[])
};

class SessionStateStore;

// A session pinned resident for one caller, or a one-shot session it owns. Movable; releases
// the pin (destroys the one-shot session) when destroyed.
class SessionLease {
 public:
  SessionLease() = default;
  SessionLease(SessionLease&& other) noexcept;
  SessionLease& operator=(SessionLease&& other) noexcept;
  ~SessionLease();

  SessionState& state() const { return *state_; }
  // The session's key; empty for a one-shot session.
  const SessionKey& key() const { return key_; }
  bool one_shot() const { return owned_ != nullptr; }
  explicit operator bool() const { return state_ != nullptr; }

  // Releases the session (as destruction does) and asks, in the same step under the store's
  // lock, to be told when the state it leaves is written: `done` is answered as by
  // SessionStateStore::WhenPersisted called at that instant, so nothing done to the session in
  // between (a deletion, another turn) can be mistaken for this turn's outcome. A one-shot
  // session (nothing to write) or an empty lease: `done(OK)` at once. Leaves the lease empty.
  void ReleaseWhenPersisted(std::function<void(const absl::Status&)> done);
  // Releases the session as destruction does, for a holder that changed nothing in it (a turn
  // refused before it ran, its state as it found it): no turn is counted, so no write is queued
  // and its last use (and ttl) stay as they were. Leaves the lease empty.
  void ReleaseUnchanged();

 private:
  friend class SessionStateStore;
  SessionLease(SessionStateStore* store, SessionKey key, SessionState* state)
      : store_(store), key_(std::move(key)), state_(state) {}
  SessionLease(SessionStateStore* store, std::unique_ptr<SessionState> owned, int64_t bytes)
      : store_(store), state_(owned.get()), owned_(std::move(owned)), one_shot_bytes_(bytes) {}
  void Reset();

  SessionStateStore* store_ = nullptr;
  SessionKey key_;
  SessionState* state_ = nullptr;
  std::unique_ptr<SessionState> owned_;  // one-shot sessions
  int64_t one_shot_bytes_ = 0;           // what the store counts for it
};

class SessionStateStore {
 public:
  // `layout` is the engine's state layout (the store gives its sessions its own row pool, so its
  // accounting is exact); `fingerprint` identifies the model (Engine::fingerprint()).
  static absl::StatusOr<std::unique_ptr<SessionStateStore>> Open(
      const StateLayout& layout, uint64_t fingerprint, const SessionStoreOptions& options);
  ~SessionStateStore();
  // Use Open(); the pass key keeps construction private to it.
  class PassKey {
    friend class SessionStateStore;
    PassKey() = default;
  };
  SessionStateStore(PassKey, const StateLayout& layout, uint64_t fingerprint,
                    const SessionStoreOptions& options);
  SessionStateStore(const SessionStateStore&) = delete;
  SessionStateStore& operator=(const SessionStateStore&) = delete;

  // Snapshots found at Open() that failed their checks, with reasons.
  std::vector<std::string> open_errors() const;

  // Keys: see ValidateSessionKey. ttl <= 0: the default.
  absl::Status Create(const SessionKey& key, absl::string_view metadata,
                      absl::Duration ttl = absl::ZeroDuration());
  // Pins the session resident, restoring it from host or disk if needed. NOT_FOUND, ABORTED
  // (already in use), DATA_LOSS / FAILED_PRECONDITION (its snapshot failed its checks).
  absl::StatusOr<SessionLease> Acquire(const SessionKey& key);
  // A fresh session of no key, for one request: its rows come from the store's pool and it
  // counts in the resident bytes (and StoreStats::one_shot) until the lease is released, which
  // destroys it.
  SessionLease NewSession();
  // NOT_FOUND; ABORTED while in use. Removes its snapshot file too.
  absl::Status Delete(const SessionKey& key);
  // A new session `dst` continuing from `src` (which must not be in use); shares SDM rows
  // copy-on-write when `src` is resident. ttl <= 0: the default, as for Create (a fork is a new
  // session: it inherits neither the source's ttl nor its metadata). A source on device is synced
  // to the host first (it then stays resident, host-only); a failed sync is returned.
  absl::Status Fork(const SessionKey& src, const SessionKey& dst, absl::string_view metadata,
                    absl::Duration ttl = absl::ZeroDuration());
  // Replaces the session's metadata (SessionInfo::metadata, kept in its record). It is written as
  // the session's changes are (see Durability), in a full snapshot (a delta never carries the
  // record): a resident session's by the persist policy. A parked session's record is inside its
  // serialised form, which is read (on disk: the snapshot and its delta log) and encoded again
  // with the new record: a host session is then written by the persist policy; a disk session is
  // written at once whatever the policy (fsynced, replacing its log) and stays on disk. NOT_FOUND;
  // the error of reading a parked session (DATA_LOSS, FAILED_PRECONDITION, RESOURCE_EXHAUSTED:
  // nothing changed); UNAVAILABLE when a disk session's write fails (the new metadata is kept,
  // the session stays in host memory and is written again as any failed write is). With
  // fenced ownership, FAILED_PRECONDITION unless this replica holds the session's claim (it does
  // not claim one: its write would be refused as fenced); with any ownership, while the session
  // is being handed over.
  absl::Status SetMetadata(const SessionKey& key, absl::string_view metadata);

  // Fenced (replicas): a copy this store holds without the session's claim (it handed the
  // session over, or lost its lease) answers only while its snapshot is still the committed one;
  // otherwise the committed snapshot's record answers (one etcd look-up).
  absl::StatusOr<SessionInfo> Get(const SessionKey& key) const;
  std::vector<SessionInfo> List() const;                          // sorted by key
  std::vector<SessionInfo> List(absl::string_view tenant) const;  // the tenant's, sorted by id
  // The tenant's sessions and their bytes, kept up to date by every operation (no listing).
  TenantUsage Usage(absl::string_view tenant) const;

  // Moves an idle session down to `tier` now (resident -> host -> disk), synchronously. A
  // session on device is synced to the host first; if that fails it stays resident and the
  // residency's error is returned. With ownership, a park to disk hands the session over: its
  // claim is released once it is written; a key this store holds no session of (NOT_FOUND: a
  // claim whose Create failed, or one between its claim and its session) has its claim released
  // as well, and a Create or Fork of it under way claims again (ClaimWatch).
  absl::Status Park(const SessionKey& key, Tier tier);
  // Writes every session that is not on disk yet to disk and waits (graceful shutdown). Sessions
  // in use are skipped and reported; so are those whose device copy could not be synced (they
  // stay resident). Logs what it is to write, its progress every kPersistAllProgressEvery, and
  // the end.
  absl::Status PersistAll();
  static constexpr absl::Duration kPersistAllProgressEvery = absl::Seconds(5);
  // Deletes idle sessions whose TTL has passed at `now` (also run by the worker every second).
  int ExpireIdle(absl::Time now);
  // Writes the sessions changed since their last write that `persist` says are due at `now`
  // (also run by the worker after every change and every second). Returns how many it wrote.
  int PersistChanged(absl::Time now);

  StoreStats Stats() const;

  // OK while sessions can be written (or nothing was tried); UNAVAILABLE naming the cause while
  // writes fail, until one succeeds.
  absl::Status PersistHealth() const;

  // How long the oldest unfinished persistence work has been going: a write in progress, or a
  // turn waiting for its write (PersistPolicy::kTurn, WhenPersisted); zero when there is none.
  // A volume that stalls (a write or fsync that blocks rather than fails: a hung NFS server, a
  // disk that stopped answering) shows here, where PersistHealth() sees only failed writes.
  absl::Duration OldestPendingPersist() const;

  // PersistSync::kWrite: fsyncs the files written without an fsync since the last round (and the
  // directory once), as the background syncer does every persist_sync_interval; a failure is a
  // failed write of that session (see the class comment). Returns how many files it fsynced.
  // Called by PersistAll() and the destructor too. Rounds run one at a time.
  int SyncWritten() ABSL_LOCKS_EXCLUDED(mu_, sync_mu_);

  // Calls `done` once the session's state as of this call has been written to the snapshot
  // directory (as persist_sync says: handed to the kernel, or fsynced) — or its write was tried and
  // failed, or the session is gone — so that a turn is acknowledged only once it is durable (the
  // scheduler calls this before a job's OnFinish). Calls it at once when nothing is to wait for: no
  // directory, a policy other than kTurn, no worker, an on-device session (written when it leaves
  // the device), or a state already written; and at once with UNAVAILABLE (below) while this
  // session's writes fail and this state is not written (another session's failure, which turns
  // health, does not: its write is tried). Otherwise `done` runs on the worker or a
  // writer thread (persist_writers), or on the thread of an Acquire of the session that found it
  // not written yet and wrote it first (before the lease lets the next turn change it: what is
  // acknowledged is the state as of this call, or a later one, never a next turn's partial
  // changes), as soon as that session's write is done, never with the store's lock held; pending
  // calls run at the latest when the store is destroyed. A call that waited is counted in
  // Stats().persist_waits, with the time from this call to the write's end in persist_wait_us
  // (what durability costs a turn's acknowledgement). `done` is given OK (never for a state that
  // was to be written and was not), or an error saying the turn was not saved: UNAVAILABLE when
  // its write failed (or, above, writes fail), naming the cause (code and system error): the
  // session continues with the turn in memory, it is written once writes succeed again, and a
  // crash before then may lose it (a write that failed late, say its fsync, may have kept it);
  // (replicas) ABORTED when the write was refused because another store took the session over (the
  // turn is not in the state the session continues from there); DATA_LOSS when the session broke
  // before its state was written (a later turn's step failed part-way: the lease's release, on its
  // thread, answers the calls still waiting, and later calls are answered at once); ABORTED when
  // the session was deleted (or expired) first; UNAVAILABLE for calls still waiting when the store
  // is destroyed.
  void WhenPersisted(const SessionKey& key, std::function<void(const absl::Status&)> done);

  // Device moves (see the class comment). SetStepThread() registers the calling thread as the
  // step thread; `wake` is called (never with the store's lock held) when device work is queued,
  // so that an idle step loop runs RunDeviceMoves(). ClearStepThread(), on that thread, runs
  // what is queued, returns the store to inline moves and waits for the calls of `wake` under
  // way (so its owner may be destroyed once it returns). RunDeviceMoves() must be called on the
  // step thread, between steps (no session of the store in an engine step); it is cheap when
  // there is nothing to do.
  void SetStepThread(std::function<void()> wake);
  void ClearStepThread();
  void RunDeviceMoves();

  // Minimum resident bytes of one session of this layout (its SDM slot tables).
  int64_t MinSessionBytes() const;

 private:
  friend class SessionLease;
  struct Entry;
  using EntryMap = std::map<SessionKey, std::unique_ptr<Entry>>;

  absl::Status LoadDirectory() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The latest quarantined snapshot of each file stem under dir/quarantine/ (named
  // <stem>.sdmstate.<unix ms>[.<n>][.deleted]); empty if the folder cannot be listed.
  struct QuarantinedCopy {
    int64_t ms = -1;
    int64_t n = 0;
    std::string name;
    bool deleted = false;
  };
  std::map<std::string, QuarantinedCopy> LatestQuarantinedCopies() const;
  // Makes a quarantined session of each key whose latest copy (`latest`) was not deleted and
  // that has no snapshot (see "Quarantine" in the class comment).
  void RestoreQuarantined(const std::map<std::string, QuarantinedCopy>& latest)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Shared snapshot directory (see the class comment): one version of a snapshot file, and that
  // of the file at `path` (nullopt: there is none).
  struct SnapshotStamp;
  std::optional<SnapshotStamp> StampOf(const std::filesystem::path& path) const;
  // The same from stat(2) alone (the record's fields left as a failed read leaves them).
  static std::optional<SnapshotStamp> FileStampOf(const std::filesystem::path& path);
  // Shared snapshot directory: the record of the snapshot at `path` (ReadRecord), and in *stamp
  // the stamp of the file it was read from; read again while another store replaces the file
  // under the reads (a few times: then UNAVAILABLE). Without a file: NOT_FOUND (*stamp nullopt).
  absl::StatusOr<SessionRecord> ReadSharedRecord(const std::filesystem::path& path,
                                                 std::optional<SnapshotStamp>* stamp,
                                                 uint64_t* snapshot_id) const;
  // Shared snapshot directory (see the class comment): the entry of `key`'s snapshot in `dir`,
  // as a disk session; NOT_FOUND when there is none. Reads the record's prefix under the lock
  // (ReadSharedRecord: the entry's stamp is of the file its record came from).
  absl::StatusOr<std::unique_ptr<Entry>> Discover(const SessionKey& key) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the idle entry of `key` when another store has written or deleted its snapshot since
  // this one last read or wrote it, adopting the file's version; no-op when not shared.
  void RefreshFromSharedDir(const SessionKey& key) ABSL_LOCKS_EXCLUDED(mu_);
  // RefreshFromSharedDir's replacement of the entry at `it` by `fresh` (none: deleted
  // elsewhere): its waiting turns are told they were not saved, the old entry goes to `dead`.
  void DropReplacedLocked(EntryMap::iterator it, absl::StatusOr<std::unique_ptr<Entry>>& fresh,
                          std::vector<std::unique_ptr<Entry>>& dead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ownership (see the class comment): CheckWrite of `key` (OK without ownership); a refused
  // write counted and logged. CheckOwnership is called without mu_.
  absl::Status CheckOwnership(const SessionKey& key) const ABSL_LOCKS_EXCLUDED(mu_);
  void WriteFenced(const SessionKey& key, const absl::Status& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Park without the ownership's release; `hand_off`: marks the entry handing_off (on success)
  // for the release that follows.
  absl::Status ParkByKey(const SessionKey& key, Tier tier, bool hand_off = false)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Acquire's work once the entry is idle and its claim current.
  absl::StatusOr<SessionLease> AcquireIdleLocked(const SessionKey& key, Entry& idle)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The record of the snapshot at `path` (`size` bytes) and its SnapshotId.
  absl::StatusOr<SessionRecord> ReadRecord(StateFiles& files, const std::filesystem::path& path,
                                           uint64_t size, uint64_t* snapshot_id) const;
  // `done`: SessionLease::ReleaseWhenPersisted's (nullptr: none). `changed`: false for
  // SessionLease::ReleaseUnchanged.
  void Release(const SessionKey& key, std::function<void(const absl::Status&)> done = nullptr,
               bool changed = true);
  void ReleaseOneShot(int64_t bytes);
  // WhenPersisted's decision for `e` (nullptr: no entry), under the lock: true when `done` was
  // queued as a waiter; otherwise false with `*outcome` the answer to give it at once.
  bool QueuePersistWaiterLocked(const SessionKey& key, Entry* e,
                                std::function<void(const absl::Status&)>& done,
                                absl::Status* outcome) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ownership: the releases of a session's claim (SessionOwnership::Release: Delete's, a Park's
  // hand-off), made without mu_ once the session is gone or parked. A claim of a key the store
  // already holds is answered as it stands (EtcdOwnership: the same mod revision), so such a
  // release ends the claim of every call answered before its Release call: a Create or Fork
  // making a new session of the key meanwhile would hold a session no replica owns (another may
  // take it up; this one's writes are refused). Per key, while a release of it runs or a
  // ClaimWatch looks: releases under way, and how many ended. BeginReleaseLocked: under mu_ from
  // the moment the key's session can be made anew (its entry erased, or parked for a hand-off);
  // EndReleaseLocked once Release returned.
  struct ReleaseCount {
    int users = 0;  // releases under way and ClaimWatches of the key
    int under_way = 0;
    uint64_t ended = 0;
  };
  void BeginReleaseLocked(const SessionKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndReleaseLocked(const SessionKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Made by a Create or Fork before it claims its new session's key: whether a release of the key
  // may have ended that claim before the session is made (see ReleaseCount).
  class ClaimWatch;
  // Under mu_, right before the new session's entry is made: whether a release of the watched key
  // may have ended the claim asked for after the watch was made (or last awaited releases): one
  // is under way, or one ended since (begun before or after the watch: a release under way when
  // the watch was made ends claims answered until its Release call, whenever it returns). A
  // release that ended before the watch was made ended no later claim.
  bool ReleasedLocked(const ClaimWatch& watch) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits (mu_ released meanwhile) until no release of the watched key is under way: a claim
  // asked for after this outlasts every release seen so far.
  void AwaitReleasesLocked(ClaimWatch& watch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::filesystem::path PathOf(const SessionKey& key) const;
  // Fenced snapshots (the ownership's FencesSnapshots() on a shared directory; class comment).
  bool fenced() const;
  // Where e's snapshot is: PathOf(e.key), or fenced, dir/generations/<e.snapshot_file>.
  std::filesystem::path SnapshotPathOf(const Entry& e) const;
  // Fenced: a file name for a new snapshot of `key` that no store has used.
  std::string NewSnapshotName(const SessionKey& key) const;
  // Shared directory: sessions never expire there (a replica would expire a session by its own
  // view of its last use, while another replica serves it). TtlOfRecord: a snapshot's ttl as
  // this store keeps it (infinite on a shared directory); SharedTtlError: the refusal of a
  // finite ttl (default_ttl at Open, a Create's or Fork's).
  absl::Duration TtlOfRecord(int64_t ttl_ms) const;
  static absl::Status SharedTtlError();
  // Fenced: removes `key`'s files under dir/generations/ that are neither its committed snapshot
  // nor this store's (being written, read from, or of an unknown commit): writes that were never
  // committed or lost their commit (a crash between the write and the commit, a refused commit
  // whose removal failed). Only under this store's claim, verified in etcd after the listing;
  // once per claim (a new claim: others may have written since), unless `force`. Without mu_.
  void SweepGenerations(const SessionKey& key, bool force) ABSL_LOCKS_EXCLUDED(mu_);
  // Fenced: asks etcd (the ownership's Observe) which snapshot is committed for `key`, for a
  // lookup without a claim (Get, Park, SetMetadata, Fork's source). Called without mu_. A
  // failure is logged once per cause and episode (any client can make lookups: one line each
  // flooded the log while etcd was down), the recovery once with the count not logged.
  void ObserveShared(const SessionKey& key) const ABSL_LOCKS_EXCLUDED(mu_, observe_log_mu_);
  // Its delta log, beside the snapshot (state_store/state_log.h).
  std::filesystem::path LogPathOf(const SessionKey& key) const;
  void Quarantine(Entry& e, const std::filesystem::path& file, const absl::Status& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A name under dir/quarantine/ for `file` that no earlier quarantined file has.
  std::filesystem::path QuarantinePathOf(const std::filesystem::path& file) const;
  // Moves a damaged session's delta log beside its quarantined snapshot (if there is one).
  void QuarantineLog(const std::filesystem::path& log) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The tenant counters: Insert() and Erase() add and remove an entry with its bytes; Account()
  // follows a change of its tier or size; Refresh() re-measures a resident, unleased entry.
  void Insert(std::unique_ptr<Entry> e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::unique_ptr<Entry> Erase(EntryMap::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Account(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Refresh(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Eviction work; mu_ is held on entry and exit, released around serialisation and I/O.
  void Rebalance() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rebalance() now (background == false) or wakes the worker.
  void Changed() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves `e` down to `target`. Errors: the device sync of a resident session (it stays
  // resident), or the snapshot write (it stays on host).
  absl::Status ParkOne(Entry& e, Tier target) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t ResidentBytesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t DeviceBytesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int PersistChangedLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A write of `e`'s snapshot failed or succeeded: counters, health, the log.
  void PersistFailed(Entry& e, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PersistSucceeded(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // UNAVAILABLE while writes fail and host memory is over budget (see Durability).
  absl::Status RefuseWhenUnpersistable() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves e's WhenPersisted callbacks that its last write attempt settles (all of them with
  // `all`) to ready_, for FlushReady() to call.
  // `outcome`: what they are told (OK only when their state was written).
  void SettleWaiters(Entry& e, bool all, const absl::Status& outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FlushReady() ABSL_LOCKS_EXCLUDED(mu_);
  // Makes a resident entry's host layers current (copies its device copy back): queued for the
  // step thread and awaited when one is registered and this is not it, else inline. e.busy
  // meanwhile; mu_ released while waiting or copying. A failure is counted and returned, naming
  // the session; the entry stays resident on its device copy.
  absl::Status SyncToHostLocked(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The same, but copying back only what changed and leaving `e` on the device
  // (SessionState::CopyChangesToHost), so that it can be written.
  absl::Status CopyChangesLocked(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Copies `e` back on this thread (mu_ released meanwhile): whole and detached, or with
  // `changes_only` what changed, left on the device. Precondition: e.busy.
  absl::Status CopyBackHere(Entry& e, bool changes_only = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `e` is on a device whose copy is not written while it stays there (its residency
  // does not copy changes back, or persist_device_turns is off): such an entry is written only
  // once it leaves the device.
  bool StaleOnDevice(const Entry& e) const;
  // Copies back the least recently used idle sessions on device while the device tier is over
  // its budget. Runs the copies here: on the step thread, or where there is none.
  void EnforceDeviceBudget() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether device work must go to the step thread rather than run here.
  bool DeferDeviceWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Destroys dead entries: now (outside the lock) or, for states on a device that must be freed
  // on the step thread, by queuing them there. Called without mu_.
  void Bury(std::vector<std::unique_ptr<Entry>> dead) ABSL_LOCKS_EXCLUDED(mu_);
  int64_t HostBytesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WorkerLoop();
  // The persist_writers - 1 extra writers: each writes the next due session (NextDueLocked)
  // until the store stops.
  void WriterLoop();
  // Whether `e` is to be written now under the policy (changed, idle, not on device or disk).
  bool DueLocked(const Entry& e, absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The due entry whose oldest WhenPersisted waiter came first (then any), skipping sessions
  // whose writes fail (the worker retries those every second); null when none.
  Entry* NextDueLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FlushReady() with mu_ released meanwhile (background stores only).
  void FlushReadyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The entry of `key` once nobody works on it (busy false); null when it is gone meanwhile.
  Entry* WaitIdle(const SessionKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The entry of `key` once no store operation is moving it; NOT_FOUND if there is none. Adopts
  // an orphan (see SessionStoreOptions::legacy_key) whose file stem is the key's.
  absl::StatusOr<Entry*> FindIdle(const SessionKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The entry of `key` (or the orphan it would adopt); null if there is none.
  const Entry* Find(const SessionKey& key) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SessionInfo InfoOf(const Entry& e, const SessionKey& key) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reads a parked (host or disk) entry's state — for a disk entry, its snapshot plus its delta
  // log, whose good length and base go to `log` — called without the lock while it is busy.
  struct ParkedLog {
    uint64_t base_id = 0;
    uint64_t bytes = 0;  // good bytes of the log; 0: none (or stale)
    int64_t records = 0;
    uint64_t dropped = 0;  // a torn tail
    bool stale = false;    // a log of another snapshot was found (to remove)
    uint32_t version = 0;  // with bytes: the log's format version (state_store/state_log.h)
  };
  // On a shared directory a disk entry's snapshot is read again while another store replaces
  // it (a failure of the file replaced says nothing of the one there now; a few times: then
  // UNAVAILABLE).
  absl::StatusOr<DecodedSession> DecodeParked(const Entry& e, ParkedLog* log) const;
  // DecodeParked's read of a disk entry's files, once.
  absl::StatusOr<DecodedSession> DecodeSnapshot(const Entry& e, ParkedLog* log) const;
  // Writes e's current state (resident) or blob (host): a delta appended to its log when
  // one can carry the change, else a full snapshot (which drops the log). mu_ is released
  // while encoding and writing; e.busy meanwhile. Updates the durability fields on success.
  // `sync`: fsync it before it counts as done (else it is queued for the syncer).
  absl::Status WriteChanges(Entry& e, bool sync) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether writes of changed sessions are fsynced before they count as done (not queued for
  // the background syncer): PersistSync::kFsync, or a shared directory.
  bool SyncOnWrite() const;
  // SyncWritten(), adding the sessions whose fsync failed to `failed` (when not null).
  int SyncRound(std::vector<std::string>* failed) ABSL_LOCKS_EXCLUDED(mu_, sync_mu_);
  // fsyncs e's files written without an fsync (and the directory) now, on this thread; mu_ is
  // released meanwhile (e.busy). A failure is a failed write of e (see SyncRound).
  absl::Status SyncNowLocked(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // PersistAll() under the lock: parks every idle session to disk.
  void PersistAllLocked(std::vector<std::string>& skipped, std::vector<std::string>& failed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The background syncer (PersistSync::kWrite): SyncWritten() rounds, at most one per
  // persist_sync_interval, while anything waits for one.
  void SyncerLoop();
  std::unique_ptr<SessionState> NewState() const;

  StateLayout layout_;             // with pool_
  std::shared_ptr<RowPool> pool_;  // null when the model has no SDM layer
  const uint64_t fingerprint_;
  const SessionStoreOptions options_;

  mutable absl::Mutex mu_;
  absl::CondVar changed_;  // an entry stopped being busy, or work arrived
  EntryMap entries_ ABSL_GUARDED_BY(mu_);
  // Snapshots under a hashed name whose key is not known yet, by file stem.
  std::map<std::string, std::unique_ptr<Entry>> orphans_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, TenantUsage, std::less<>> usage_ ABSL_GUARDED_BY(mu_);
  int64_t one_shot_count_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t one_shot_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  StoreStats counters_ ABSL_GUARDED_BY(mu_);  // evictions, restores, errors (the rest is computed)
  std::vector<std::string> open_errors_ ABSL_GUARDED_BY(mu_);
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;  // LRU order
  // The cause of the last failed write while writes fail; OK otherwise.
  absl::Status persist_error_ ABSL_GUARDED_BY(mu_);
  // Failed writes, for their log (once per cause and episode; the episode ends when no session
  // waits for a failed write).
  FailureEpisode persist_failures_ ABSL_GUARDED_BY(mu_);
  // ObserveShared's failures, for its log (once per cause and episode).
  mutable absl::Mutex observe_log_mu_;
  mutable FailureEpisode observe_failures_ ABSL_GUARDED_BY(observe_log_mu_);
  bool reported_healthy_ ABSL_GUARDED_BY(mu_) = true;              // as last told on_persist_health
  std::vector<std::function<void()>> ready_ ABSL_GUARDED_BY(mu_);  // settled WhenPersisted calls
  // Work arrived for the worker (Changed(), a waiter): it does not wait for the next signal.
  bool worker_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  // Device moves for the step thread (see SetStepThread).
  struct SyncJob;
  // Asks for `job` on the step thread, or runs it here (DeferDeviceWork), and returns its
  // status. Precondition: the job's entry is busy.
  absl::Status RunDeviceJobLocked(SyncJob& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What SyncToHostLocked and CopyChangesLocked share: `e` busy while the step thread (or this
  // one) copies it back, whole or (changes_only) its changes; then its accounting refreshed and
  // a failure counted and returned naming the session.
  absl::Status CopyFromDeviceLocked(Entry& e, bool changes_only) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::function<void()> wake_step_thread_ ABSL_GUARDED_BY(mu_);
  // Calls wake_step_thread_ (a copy) with mu_ released, counted so that ClearStepThread waits
  // for them. Requires one registered.
  void WakeStepThreadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int wakes_under_way_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread::id step_thread_ ABSL_GUARDED_BY(mu_);  // default id: none registered
  std::vector<SyncJob*> sync_jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<SessionState>> doomed_ ABSL_GUARDED_BY(mu_);
  uint64_t waiter_clock_ ABSL_GUARDED_BY(mu_) = 0;  // orders WhenPersisted arrivals
  // Ownership: see ReleaseCount.
  std::map<SessionKey, ReleaseCount> releases_ ABSL_GUARDED_BY(mu_);
  // Fenced: the claim (SessionOwnership::ClaimEpoch) under which each session's files were last
  // swept (SweepGenerations).
  std::map<SessionKey, int64_t> swept_ ABSL_GUARDED_BY(mu_);
  // PersistSync::kWrite: the files written without an fsync since the syncer's last round, by
  // session (its log, its snapshot), and whether the directory's entries changed meanwhile.
  struct UnsyncedFiles {
    bool log = false;
    bool snapshot = false;
  };
  std::map<SessionKey, UnsyncedFiles> unsynced_ ABSL_GUARDED_BY(mu_);
  bool unsynced_dir_ ABSL_GUARDED_BY(mu_) = false;
  std::set<SessionKey> syncing_ ABSL_GUARDED_BY(mu_);  // in the round under way
  // Held for a whole SyncWritten() round (outside mu_): rounds run one at a time, in order.
  absl::Mutex sync_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  // The directory's lock (kDirLockName): exclusive, or shared on a shared directory. Null
  // without a directory, or where the file system has no locks (an open error says so).
  std::unique_ptr<FileLock> dir_lock_;
  std::thread worker_;
  std::vector<std::thread> writers_;  // persist_writers - 1 (see WriterLoop)
  std::thread syncer_;                // PersistSync::kWrite (see SyncerLoop)
};

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_SESSION_STORE_H_
