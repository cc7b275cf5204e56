#include "state_store/session_store.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/check.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "base/thread_name.h"
#include "state_store/state_codec.h"
#include "state_store/state_log.h"

namespace sdm {
namespace {

constexpr absl::string_view kSnapshotSuffix = ".sdmstate";
constexpr absl::string_view kLogSuffix = ".sdmlog";
// A log is compacted into a full snapshot once it would pass log_compact_ratio times the
// snapshot's size, or this many records (each costs a small read when the directory is listed at
// start-up).
constexpr int64_t kMaxLogRecords = 256;
constexpr absl::string_view kTmpSuffix = ".tmp";
// A store holds this file of its directory locked while it is open (exclusively; shared on a
// shared directory), so that two stores never write one directory unawares (their snapshots and
// logs interleave, and a session's next read finds it damaged).
constexpr char kDirLockName[] = "LOCK";

absl::Status DirectoryInUseError(const std::filesystem::path& dir, bool shared) {
  const int64_t holder = HolderOfLock(dir / kDirLockName);
  const std::string by =
      holder > 0 ? absl::StrCat("process ", holder, ", which opened it for itself alone")
                 : std::string("processes that share it");
  return absl::FailedPreconditionError(absl::StrCat(
      "it is in use by ", by,
      " (two servers writing one directory unawares corrupt its sessions): stop that one or use "
      "another directory; servers meant to share one must all be started as sharing it",
      shared ? "" : " (this one was not)"));
}
// Fenced snapshots (SessionOwnership::FencesSnapshots): every snapshot under a unique name here.
constexpr char kGenerationsDir[] = "generations";
// A quarantined snapshot whose session was deleted: renamed with this suffix (never removed), so
// that the next Open does not restore the session as a quarantined one.
constexpr absl::string_view kDeletedSuffix = ".deleted";

absl::Status NotFound(const SessionKey& key) {
  return absl::NotFoundError(absl::StrCat("session '", key.id, "' not found"));
}

absl::Status AlreadyExists(const SessionKey& key) {
  return absl::AlreadyExistsError(absl::StrCat("session '", key.id, "' already exists"));
}

int64_t ToMs(absl::Duration d) {
  return d == absl::InfiniteDuration() ? -1 : absl::ToInt64Milliseconds(d);
}
absl::Duration FromMs(int64_t ms) {
  return ms < 0 ? absl::InfiniteDuration() : absl::Milliseconds(ms);
}

// A failed device -> host copy, naming the session; keeps the residency's code.
absl::Status SyncError(absl::string_view id, const absl::Status& why) {
  return absl::Status(
      why.code(),
      absl::StrCat("session '", id, "' could not be copied back from the device: ", why.message()));
}

// A failed write's cause for messages: its code and the system's error (the text after the last
// ": "), without the paths before it (which name the session's tenant).
std::string CauseOf(const absl::Status& why) {
  const absl::string_view message = why.message();
  const size_t colon = message.rfind(": ");
  return absl::StrCat(absl::StatusCodeToString(why.code()), ": ",
                      colon == absl::string_view::npos ? message : message.substr(colon + 2));
}

// What a turn waiting for its write (WhenPersisted) is told when the write failed, or when it
// ends while writes fail: it is not on disk, but the session goes on with it.
absl::Status NotWrittenError(absl::string_view id, absl::string_view cause) {
  return absl::UnavailableError(absl::StrCat(
      "session '", id,
      "': this turn was generated and the session continues with it, held in memory, but it is "
      "not saved: writes to the state directory fail (",
      cause,
      "); the server writes it once writes succeed again, and a crash of the server before then "
      "may lose it"));
}

// What a turn waiting for its write (WhenPersisted) is told when the session is deleted (or
// expires) before the write: its state was never written, and never will be.
absl::Status DeletedBeforeWrittenError(absl::string_view id) {
  return absl::AbortedError(absl::StrCat("session '", id,
                                         "': this turn was not saved: the session was deleted "
                                         "before the turn was written"));
}

// Why a session of the shared directory whose snapshot failed its checks is refused, its file
// left in place (Discover, LoadDirectory).
// A snapshot of another model or format version (its check FAILED_PRECONDITION): sound files,
// only not this server's, so never moved or removed but by a Delete. On a shared directory other
// replicas may serve them (a rolling upgrade); on a server's own directory, a start with the wrong
// model (the right one, restarted, serves them) or an upgrade (the session is to be deleted).
absl::Status RefusedInPlace(const absl::Status& check, bool shared_dir) {
  if (shared_dir) {
    return absl::Status(check.code(),
                        absl::StrCat(check.message(),
                                     " (its copy in the shared directory, left in place); delete "
                                     "the session to free its id"));
  }
  return absl::Status(
      check.code(),
      absl::StrCat(check.message(),
                   "; its files are intact and left in place: a server started with the model "
                   "(and build) that wrote them serves the session; deleting the session "
                   "discards them"));
}

// A shared directory's snapshot may be replaced (another store's rename) during a read of it: the
// read is made again, at most this many times in all (ReadSharedRecord, DecodeParked) ...
constexpr int kSharedReadAttempts = 3;
// ... and then this is the answer.
absl::Status ReplacedAtEveryRead(const std::filesystem::path& path) {
  return absl::UnavailableError(absl::StrCat(
      "cannot read ", path.string(), ": replaced during each of ", kSharedReadAttempts, " reads"));
}

// ... when the store closes before the write (its worker and writers have stopped).
absl::Status ClosedBeforeWrittenError(absl::string_view id) {
  return absl::UnavailableError(
      absl::StrCat("session '", id,
                   "': this turn was not saved: the server stopped before the turn was written; "
                   "the session restarts from its last saved state, without this turn"));
}

// The end of a failed-writes episode's log line: how many failures it did not log.
std::string UnloggedFailures(int64_t unlogged) {
  if (unlogged == 0) return "";
  return absl::StrCat(" (", unlogged, " more failed writes meanwhile, not logged)");
}

}  // namespace

absl::string_view PersistPolicyName(PersistPolicy policy) {
  switch (policy) {
    case PersistPolicy::kTurn:
      return "turn";
    case PersistPolicy::kIdle:
      return "idle";
    case PersistPolicy::kShutdown:
      return "shutdown";
  }
  return "?";
}

absl::StatusOr<PersistPolicy> ParsePersistPolicy(absl::string_view name) {
  for (PersistPolicy p : {PersistPolicy::kTurn, PersistPolicy::kIdle, PersistPolicy::kShutdown}) {
    if (name == PersistPolicyName(p)) return p;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown persist policy '", name, "' (turn, idle or shutdown)"));
}

absl::string_view PersistSyncName(PersistSync sync) {
  switch (sync) {
    case PersistSync::kWrite:
      return "write";
    case PersistSync::kFsync:
      return "fsync";
  }
  return "?";
}

absl::StatusOr<PersistSync> ParsePersistSync(absl::string_view name) {
  for (PersistSync p : {PersistSync::kWrite, PersistSync::kFsync}) {
    if (name == PersistSyncName(p)) return p;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown persist sync policy '", name, "' (write or fsync)"));
}

absl::string_view TierName(Tier tier) {
  switch (tier) {
    case Tier::kResident:
      return "resident";
    case Tier::kHost:
      return "host";
    case Tier::kDisk:
      return "disk";
  }
  return "?";
}

// Shared directory: identifies one version of a snapshot file. Each write is a new file
// (written aside and renamed), but file times are coarse (a few ms) and inode numbers are reused,
// so the record's position and last use (a turn moves both) are part of it too.
struct SessionStateStore::SnapshotStamp {
  uintmax_t inode = 0;
  uintmax_t size = 0;
  int64_t mtime_ns = 0;
  int64_t position = 0;
  int32_t pending_token = -1;
  int64_t last_used_unix_ms = 0;
  bool operator==(const SnapshotStamp&) const = default;
};

// A WhenPersisted callback waiting for the write of `version`; `seq` orders arrivals, `since`
// is when it arrived (the wait counted in StoreStats::persist_wait_us).
struct PersistWaiter {
  uint64_t version = 0;
  uint64_t seq = 0;
  std::function<void(const absl::Status&)> done;
  std::chrono::steady_clock::time_point since;
};
constexpr uint64_t kNoWaiter = ~uint64_t{0};

struct SessionStateStore::Entry {
  SessionKey key;
  std::string metadata;
  Tier tier = Tier::kResident;
  std::unique_ptr<SessionState> state;  // kResident
  std::string blob;                     // kHost
  int64_t disk_bytes = 0;               // kDisk: snapshot file size
  int64_t position = -1;                // last known
  bool pending = false;                 // with position: state->pending_token >= 0
  bool in_use = false;                  // pinned by a lease
  bool busy = false;                    // being moved by the store, outside the lock
  // Replicas: a Park to disk is giving the session's claim up (SessionOwnership::Release,
  // outside the lock); `handoffs` counts those finished. An Acquire whose claim may predate
  // one (it saw another count, or one in progress) claims again (see Acquire).
  bool handing_off = false;
  uint64_t handoffs = 0;
  // Replicas: the version whose write was refused because this store no longer owns the session
  // (another replica took it over: that version's turn is not in the state it continues from),
  // and the error WhenPersisted answers for it.
  uint64_t fenced_version = 0;
  absl::Status fenced;
  uint64_t tick = 0;  // LRU order
  absl::Time last_used;
  // last_used before the session's lease touched it: what a lease that changed nothing leaves
  // (SessionLease::ReleaseUnchanged).
  absl::Time last_used_before_lease;
  absl::Duration ttl = absl::InfiniteDuration();
  // Its snapshot failed its checks (quarantined), or (broken_in_step) an engine step failed
  // part-way and left its state half-updated (SessionState::failed): the code and the reason,
  // without its name.
  absl::Status broken;
  bool broken_in_step = false;
  // kResident, refreshed whenever the session is not in use: bytes of its KV pages and slot
  // tables (rows are counted from the pool), its mapped rows and bytes with rows counted fully.
  int64_t own_bytes = 0;
  int64_t rows = 0;
  int64_t resident_bytes = 0;
  // kResident: device bytes of its residency (the device tier), refreshed with the rest and,
  // for sessions in use, by RunDeviceMoves() between steps.
  int64_t device_bytes = 0;
  // Bytes this entry adds to its tenant's usage (TierBytes() when last accounted).
  int64_t counted_bytes = 0;
  // Durability: `version` counts changes (creation, turns, metadata); `persisted_version` is the
  // version its snapshot file holds. Equal: the file is current.
  uint64_t version = 0;
  uint64_t persisted_version = 0;
  int64_t persisted_bytes = 0;   // the size of its snapshot file; 0: none written or found
  bool persist_failing = false;  // its last write failed (counted once per episode)
  std::string persist_cause;     // why (CauseOf), while persist_failing
  // Its latest write attempt failed: a sync round that then fsyncs an earlier write (the full
  // snapshot that ends a failed fsync) does not end the failure.
  bool write_failed = false;
  // The delta log (state_store/state_log.h) extending the snapshot: the snapshot's id, the
  // log's good bytes (0: none) and records, and the position the disk holds (snapshot + log).
  // needs_full: the next write must be a full snapshot (the dirty-row marks do not cover
  // everything since the last write: a fork, a park to host, a device copy-back, metadata; or
  // the log's base is unknown: a snapshot write failed).
  uint64_t base_id = 0;
  uint64_t log_bytes = 0;
  int64_t log_records = 0;
  int64_t persisted_position = 0;
  bool needs_full = true;
  // WhenPersisted callbacks, each with the version it waits for; `attempted_version` is the
  // version of the last write tried (written or failed). `first_waiter`: the order in which the
  // oldest of them arrived (kNoWaiter: none), which orders the writes.
  std::vector<PersistWaiter> waiters;
  uint64_t first_waiter = kNoWaiter;
  uint64_t attempted_version = 0;
  // PersistSync::kWrite: `write_seq` counts its successful writes; `durable_full_seq` is the
  // write_seq of its last full snapshot written with an fsync (a park to disk); while
  // `sync_failed_seq` is not 0 a background fsync of its files failed (at that write_seq): it is
  // failing until a full snapshot written after that (write_seq greater) is fsynced.
  uint64_t write_seq = 0;
  uint64_t last_full_seq = 0;
  uint64_t durable_full_seq = 0;
  uint64_t sync_failed_seq = 0;
  // Shared directory: the size and modification time of its snapshot file when this store last
  // read or wrote it; nullopt: it has not seen one.
  std::optional<SnapshotStamp> disk_stamp;
  // Fenced snapshots: the committed snapshot (a name under dir/generations/) this copy was read
  // from or last wrote; "" none. Never changed while the entry is busy.
  std::string snapshot_file;
  // Quarantined: where its snapshot went (empty: it could not be moved, or it is not quarantined).
  std::filesystem::path quarantined_as;
  // Fenced snapshots: the file a write in progress is writing and committing ("" none), and
  // files whose commit's answer never came (they may be the committed one; removed once a later
  // commit succeeds). The sweep of orphan files (SweepGenerations) leaves them alone.
  std::string writing_file;
  std::vector<std::string> uncommitted;
  // When the write in progress (WriteChanges, outside the lock) began; nullopt: none.
  std::optional<std::chrono::steady_clock::time_point> write_since;

  int64_t TierBytes() const {
    switch (tier) {
      case Tier::kResident:
        return resident_bytes;
      case Tier::kHost:
        return static_cast<int64_t>(blob.size());
      case Tier::kDisk:
        return disk_bytes;
    }
    return 0;
  }

  // `broken` naming the session by `name` (its id, as its user knows it).
  absl::Status BrokenError(absl::string_view name) const {
    if (broken_in_step) {
      return absl::Status(broken.code(), absl::StrCat("session '", name, "': ", broken.message(),
                                                      "; delete the session to start again"));
    }
    return absl::Status(
        broken.code(),
        absl::StrCat("session '", name, "': its snapshot failed its checks: ", broken.message()));
  }

  // What a turn waiting for its write is told once the session is broken before the write: it
  // will never be written (a broken session is not).
  absl::Status NotSavedError(absl::string_view name) const {
    return absl::DataLossError(absl::StrCat("this turn was not saved: before it was written, ",
                                            BrokenError(name).message()));
  }

  // Precondition: resident and not being stepped.
  void Refresh() {
    resident_bytes = state->ResidentBytes();
    device_bytes = state->DeviceBytes();
    own_bytes = resident_bytes;
    rows = 0;
    for (int64_t l = 0; l < state->num_layers(); ++l) {
      if (!state->is_sdm(l)) continue;
      const SdmTable& t = std::as_const(*state).sdm(l);  // a read: keeps a staged upload
      rows += t.private_rows();
      own_bytes -= t.private_rows() * t.row_width() * static_cast<int64_t>(sizeof(float));
    }
    position = state->position();
    pending = state->pending_token >= 0;
  }
};

// ---- SessionLease ----

SessionLease::SessionLease(SessionLease&& o) noexcept
    : store_(o.store_),
      key_(std::move(o.key_)),
      state_(o.state_),
      owned_(std::move(o.owned_)),
      one_shot_bytes_(o.one_shot_bytes_) {
  o.store_ = nullptr;
  o.state_ = nullptr;
}

SessionLease& SessionLease::operator=(SessionLease&& o) noexcept {
  if (this != &o) {
    Reset();
    store_ = o.store_;
    key_ = std::move(o.key_);
    state_ = o.state_;
    owned_ = std::move(o.owned_);
    one_shot_bytes_ = o.one_shot_bytes_;
    o.store_ = nullptr;
    o.state_ = nullptr;
  }
  return *this;
}

SessionLease::~SessionLease() { Reset(); }

void SessionLease::ReleaseWhenPersisted(std::function<void(const absl::Status&)> done) {
  if (store_ == nullptr || owned_ != nullptr) {
    Reset();
    done(absl::OkStatus());
    return;
  }
  SessionStateStore* store = store_;
  store_ = nullptr;
  state_ = nullptr;
  store->Release(key_, std::move(done));
}

void SessionLease::ReleaseUnchanged() {
  if (store_ != nullptr && owned_ == nullptr) {
    store_->Release(key_, nullptr, /*changed=*/false);
    store_ = nullptr;
    state_ = nullptr;
  }
  Reset();  // an empty lease, or a one-shot session's
}

void SessionLease::Reset() {
  if (store_ != nullptr) {
    if (owned_ != nullptr) {
      owned_.reset();  // returns its rows to the store's pool first
      store_->ReleaseOneShot(one_shot_bytes_);
    } else {
      store_->Release(key_);
    }
  }
  store_ = nullptr;
  state_ = nullptr;
}

// ---- SessionStateStore ----

SessionStateStore::SessionStateStore(PassKey, const StateLayout& layout, uint64_t fingerprint,
                                     const SessionStoreOptions& options)
    : layout_(layout), fingerprint_(fingerprint), options_(options) {
  // The store's own row pool, handed to every session it makes: its accounting is then exact.
  for (LayerStateLayout& l : layout_.layers) {
    if (l.kind != LayerStateLayout::Kind::kSdm) continue;
    if (pool_ == nullptr) pool_ = std::make_shared<RowPool>(l.row_width);
    l.row_pool = pool_;
    // Writes are journaled only where deltas are written (a shared directory has none).
    l.sdm_write.record = options.journal_writes && l.sdm_write.apply != nullptr &&
                         !options.dir.empty() && !options.shared_dir &&
                         options.persist != PersistPolicy::kShutdown;
  }
}

absl::StatusOr<std::unique_ptr<SessionStateStore>> SessionStateStore::Open(
    const StateLayout& layout, uint64_t fingerprint, const SessionStoreOptions& options) {
  if (options.files == nullptr) return absl::InvalidArgumentError("store needs a file system");
  if (!(options.log_compact_ratio >= 0.0 && options.log_compact_ratio <= 1e6)) {
    return absl::InvalidArgumentError("log_compact_ratio must be between 0 and 1e6");
  }
  auto store = std::make_unique<SessionStateStore>(PassKey(), layout, fingerprint, options);
  const int64_t min_bytes = store->MinSessionBytes();
  if (options.resident_budget_bytes < min_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("resident budget of ", options.resident_budget_bytes,
                     " bytes is smaller than one session's minimum of ", min_bytes,
                     " bytes (its SDM slot tables)"));
  }
  if (options.shared_dir && options.default_ttl != absl::InfiniteDuration()) {
    return SharedTtlError();
  }
  if (options.host_budget_bytes < 0) {
    return absl::InvalidArgumentError("host budget must not be negative");
  }
  if (!options.dir.empty()) {
    // Locked before anything in it is read or moved (a store refused here changes nothing).
    SDM_RETURN_IF_ERROR(options.files->CreateDirs(options.dir));
    absl::StatusOr<std::unique_ptr<FileLock>> dir_lock =
        options.files->Lock(options.dir / kDirLockName, /*exclusive=*/!options.shared_dir);
    absl::MutexLock lock(&store->mu_);
    if (dir_lock.ok()) {
      store->dir_lock_ = *std::move(dir_lock);
    } else if (absl::IsFailedPrecondition(dir_lock.status())) {
      return DirectoryInUseError(options.dir, options.shared_dir);
    } else if (absl::IsUnimplemented(dir_lock.status())) {
      store->open_errors_.push_back(absl::StrCat(dir_lock.status().message(),
                                                 ": nothing stops another server from writing ",
                                                 options.dir.string(), " too"));
    } else {
      return dir_lock.status();
    }
    if (auto s = store->LoadDirectory(); !s.ok()) return s;
  }
  if (store->fenced()) {
    SDM_RETURN_IF_ERROR(options.files->CreateDirs(options.dir / kGenerationsDir));
  }
  if (options.background) {
    store->worker_ = std::thread([s = store.get()] { s->WorkerLoop(); });
    if (!options.dir.empty() && !store->SyncOnWrite()) {
      store->syncer_ = std::thread([s = store.get()] { s->SyncerLoop(); });
    }
    if (!options.dir.empty() && options.persist != PersistPolicy::kShutdown) {
      for (int i = 1; i < options.persist_writers; ++i) {
        store->writers_.emplace_back([s = store.get()] { s->WriterLoop(); });
      }
    }
  }
  return store;
}

SessionStateStore::~SessionStateStore() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    changed_.SignalAll();
  }
  if (worker_.joinable()) worker_.join();
  for (std::thread& t : writers_) t.join();
  if (syncer_.joinable()) syncer_.join();
  SyncWritten();  // what was handed to the kernel reaches the disk before the store goes
  {
    absl::MutexLock lock(&mu_);
    for (auto& [key, e] : entries_) {
      SettleWaiters(*e, /*all=*/true, ClosedBeforeWrittenError(key.id));
    }
  }
  FlushReady();
}

int64_t SessionStateStore::MinSessionBytes() const {
  int64_t bytes = 0;
  for (const LayerStateLayout& l : layout_.layers) {
    if (l.kind == LayerStateLayout::Kind::kSdm) {
      bytes += l.sdm_heads * l.slots_per_head * static_cast<int64_t>(sizeof(int32_t));
    }
  }
  return bytes;
}

std::unique_ptr<SessionState> SessionStateStore::NewState() const {
  return std::make_unique<SessionState>(layout_);
}

std::filesystem::path SessionStateStore::PathOf(const SessionKey& key) const {
  return options_.dir / absl::StrCat(SessionFileStem(key), kSnapshotSuffix);
}

bool SessionStateStore::fenced() const {
  return options_.shared_dir && options_.ownership != nullptr &&
         options_.ownership->FencesSnapshots();
}

std::filesystem::path SessionStateStore::SnapshotPathOf(const Entry& e) const {
  if (!fenced()) return PathOf(e.key);
  return options_.dir / kGenerationsDir / e.snapshot_file;
}

std::string SessionStateStore::NewSnapshotName(const SessionKey& key) const {
  // 128 random bits: no two writes, on any replica, pick the same name.
  std::random_device random;
  const uint64_t high = (uint64_t{random()} << 32) | random();
  const uint64_t low = (uint64_t{random()} << 32) | random();
  return absl::StrCat(SessionFileStem(key), ".", absl::Hex(high, absl::kZeroPad16),
                      absl::Hex(low, absl::kZeroPad16), kSnapshotSuffix);
}

void SessionStateStore::ObserveShared(const SessionKey& key) const {
  if (!fenced()) return;
  const auto name = options_.ownership->Observe(key);
  absl::MutexLock lock(&observe_log_mu_);
  if (name.ok()) {
    if (int64_t unlogged = 0; observe_failures_.Succeeded(&unlogged)) {
      SDM_LOG(INFO) << "sdm state store: etcd lookups succeed again (" << unlogged
                    << " more failed meanwhile, not logged)";
    }
    return;
  }
  if (observe_failures_.Failed(name.status().ToString())) {
    SDM_LOG(WARNING) << "sdm state store: could not look up session '" << key.id
                     << "' in etcd: " << name.status()
                     << " (further failures of this cause are not logged until a lookup "
                        "succeeds)";
  }
}

namespace {

// Whether `name` under dir/generations/ is a snapshot of the session whose file stem is
// `stem` (StrCat(stem, ".", 32 hex digits, kSnapshotSuffix), NewSnapshotName) or the temporary
// file of one (`<snapshot>.<unique>.tmp`, StateFiles::WriteAtomically; `<snapshot>.tmp` from
// earlier builds); `base` receives the snapshot's name.
bool IsGenerationOf(absl::string_view name, absl::string_view stem, std::string* base) {
  if (!absl::ConsumePrefix(&name, stem) || !absl::ConsumePrefix(&name, ".")) return false;
  if (absl::ConsumeSuffix(&name, kTmpSuffix)) {
    const size_t snapshot_end = name.rfind(kSnapshotSuffix);
    if (snapshot_end == absl::string_view::npos) return false;
    name = name.substr(0, snapshot_end + kSnapshotSuffix.size());
  }
  if (!absl::ConsumeSuffix(&name, kSnapshotSuffix) || name.size() != 32) return false;
  for (char c : name) {
    if (!absl::ascii_isxdigit(c)) return false;
  }
  *base = absl::StrCat(stem, ".", name, kSnapshotSuffix);
  return true;
}

}  // namespace

absl::Duration SessionStateStore::TtlOfRecord(int64_t ttl_ms) const {
  // Shared directory: sessions do not expire (SharedTtlError); a ttl that a snapshot written by
  // a server running alone carries is dropped.
  return options_.shared_dir ? absl::InfiniteDuration() : FromMs(ttl_ms);
}

absl::Status SessionStateStore::SharedTtlError() {
  return absl::InvalidArgumentError(
      "session TTLs are not supported on a shared state directory (replicas): a replica expires "
      "sessions by its own view of their last use and would delete a session another replica "
      "is serving; sessions there never expire (delete them explicitly)");
}

void SessionStateStore::SweepGenerations(const SessionKey& key, bool force) {
  if (!fenced()) return;
  const int64_t claim = options_.ownership->ClaimEpoch(key);
  if (claim == 0) return;  // only under a claim: another replica may be committing
  {
    absl::MutexLock lock(&mu_);
    auto it = swept_.find(key);
    if (!force && it != swept_.end() && it->second == claim) return;  // nobody else wrote since
  }
  const std::filesystem::path dir = options_.dir / kGenerationsDir;
  absl::StatusOr<std::vector<std::string>> names = options_.files->List(dir);
  if (!names.ok()) {
    SDM_LOG(WARNING) << "sdm state store: cannot list " << dir.string() << ": " << names.status();
    return;
  }
  const std::string stem = SessionFileStem(key);
  std::vector<std::pair<std::string, std::string>> found;  // (file, the snapshot it is of)
  for (const std::string& name : *names) {
    std::string base;
    if (IsGenerationOf(name, stem, &base)) found.emplace_back(name, base);
  }
  std::vector<std::string> doomed;
  {
    absl::MutexLock lock(&mu_);
    if (options_.ownership->ClaimEpoch(key) != claim) return;
    const std::optional<std::string> committed = options_.ownership->Committed(key);
    if (!committed.has_value()) return;
    auto it = entries_.find(key);
    const Entry* e = it == entries_.end() ? nullptr : it->second.get();
    for (const auto& [name, base] : found) {
      if (base == *committed) continue;
      if (e != nullptr &&
          (base == e->snapshot_file || base == e->writing_file ||
           std::find(e->uncommitted.begin(), e->uncommitted.end(), base) != e->uncommitted.end())) {
        continue;  // this store's: read from, being written, or perhaps committed
      }
      doomed.push_back(name);
    }
  }
  if (!doomed.empty()) {
    // After the listing: each file listed was written under a claim obtained before it was
    // created (a writer claims, then writes). If `claim` is still the current one in etcd, every
    // other claim has ended for good, and a commit passes only under the claim its file was
    // written under (SessionOwnership::CommitSnapshot): nobody can commit these any more (this
    // store's own writes under `claim` were excluded above, and later ones use new names).
    if (absl::Status s = options_.ownership->VerifyClaim(key, claim); !s.ok()) return;
  }
  {
    absl::MutexLock lock(&mu_);
    swept_[key] = claim;
    counters_.orphans_removed += static_cast<int64_t>(doomed.size());
  }
  for (const std::string& name : doomed) options_.files->Remove(dir / name).IgnoreError();
  if (!doomed.empty()) {
    SDM_LOG(INFO) << "sdm state store: removed " << doomed.size()
                  << " uncommitted snapshot file(s) of session '" << key.id
                  << "' (writes never committed, or lost their commit)";
  }
}

std::filesystem::path SessionStateStore::LogPathOf(const SessionKey& key) const {
  return options_.dir / absl::StrCat(SessionFileStem(key), kLogSuffix);
}

std::vector<std::string> SessionStateStore::open_errors() const {
  absl::MutexLock lock(&mu_);
  return open_errors_;
}

// ---- Accounting ----

void SessionStateStore::Insert(std::unique_ptr<Entry> e) {
  ++usage_[e->key.tenant].sessions;
  e->counted_bytes = 0;
  Account(*e);
  SessionKey key = e->key;
  entries_.emplace(std::move(key), std::move(e));
}

std::unique_ptr<SessionStateStore::Entry> SessionStateStore::Erase(EntryMap::iterator it) {
  std::unique_ptr<Entry> e = std::move(it->second);
  // Every waiter left waits for a state that was not written (a write settles the ones it covers).
  SettleWaiters(*e, /*all=*/true, DeletedBeforeWrittenError(e->key.id));
  entries_.erase(it);
  auto usage = usage_.find(e->key.tenant);
  SDM_CHECK(usage != usage_.end());
  usage->second.state_bytes -= e->counted_bytes;
  if (--usage->second.sessions == 0) usage_.erase(usage);
  return e;
}

void SessionStateStore::Account(Entry& e) {
  const int64_t bytes = e.TierBytes();
  usage_[e.key.tenant].state_bytes += bytes - e.counted_bytes;
  e.counted_bytes = bytes;
}

void SessionStateStore::Refresh(Entry& e) {
  e.Refresh();
  Account(e);
}

TenantUsage SessionStateStore::Usage(absl::string_view tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = usage_.find(tenant);
  return it == usage_.end() ? TenantUsage() : it->second;
}

// ---- Snapshots found at Open ----

std::filesystem::path SessionStateStore::QuarantinePathOf(const std::filesystem::path& file) const {
  // A unique name: an earlier quarantined copy of the same session is never overwritten.
  std::filesystem::path dest = options_.dir / "quarantine" / file.filename();
  dest += absl::StrCat(".", absl::ToUnixMillis(absl::Now()));
  for (int i = 1; std::filesystem::exists(dest); ++i) {
    dest = options_.dir / "quarantine" / file.filename();
    dest += absl::StrCat(".", absl::ToUnixMillis(absl::Now()), ".", i);
  }
  return dest;
}

void SessionStateStore::Quarantine(Entry& e, const std::filesystem::path& file,
                                   const absl::Status& why) {
  const std::filesystem::path dest = QuarantinePathOf(file);
  absl::Status moved = options_.files->Rename(file, dest);
  if (moved.ok()) e.quarantined_as = dest;
  e.broken = absl::Status(
      why.code(), absl::StrCat(why.message(), moved.ok() ? " (moved to " + dest.string() + ")"
                                                         : " (could not quarantine it)"));
  ++counters_.quarantined;
}

void SessionStateStore::QuarantineLog(const std::filesystem::path& log) {
  options_.files->Rename(log, QuarantinePathOf(log)).IgnoreError();  // absent: nothing to keep
}

absl::StatusOr<SessionRecord> SessionStateStore::ReadRecord(StateFiles& files,
                                                            const std::filesystem::path& path,
                                                            uint64_t size,
                                                            uint64_t* snapshot_id) const {
  auto first = files.ReadRange(path, 0, kRecordPrefixBytes);
  if (!first.ok()) return first.status();
  auto prefix_size = RecordPrefixSize(*first, size, fingerprint_);
  if (!prefix_size.ok()) return prefix_size.status();
  auto prefix = files.ReadRange(path, 0, *prefix_size);
  if (!prefix.ok()) return prefix.status();
  *snapshot_id = SnapshotId(*prefix);
  return DecodeSessionRecord(*prefix, size, fingerprint_);
}

absl::Status SessionStateStore::LoadDirectory() {
  StateFiles& files = *options_.files;
  if (auto s = files.CreateDirs(options_.dir / "quarantine"); !s.ok()) return s;
  // Fenced snapshots: a session is only what etcd commits (dir/generations/), found on demand;
  // top-level snapshots (of a directory used without fencing) are not sessions then.
  if (fenced()) return absl::OkStatus();
  auto names = files.List(options_.dir);
  if (!names.ok()) return names.status();
  std::sort(names->begin(), names->end());
  const std::set<std::string> all_names(names->begin(), names->end());
  const std::map<std::string, QuarantinedCopy> quarantined =
      options_.shared_dir ? std::map<std::string, QuarantinedCopy>() : LatestQuarantinedCopies();
  for (const std::string& name : *names) {
    const std::filesystem::path path = options_.dir / name;
    if (absl::EndsWith(name, kLogSuffix)) {
      const std::string stem = name.substr(0, name.size() - kLogSuffix.size());
      if (all_names.count(absl::StrCat(stem, kSnapshotSuffix)) > 0) continue;
      const auto copy = quarantined.find(stem);
      if (copy != quarantined.end() && !copy->second.deleted) {
        // Its snapshot was quarantined and a crash came before the log could follow it (the
        // two are moved one after the other): the log goes beside it, turns kept.
        QuarantineLog(path);
      } else {
        // Its snapshot is gone (deleted; the log's removal did not happen): nothing to extend.
        files.Remove(path).IgnoreError();
      }
      continue;
    }
    if (absl::EndsWith(name, kTmpSuffix)) {
      // A snapshot write cut short by a crash: the previous snapshot (if any) is intact. On a
      // shared directory it may be another store's write under way, whose rename would then
      // fail: removed only if no writer holds it (StateFiles::WriteAtomically).
      if (options_.shared_dir) {
        files.RemoveStrayTemp(path).IgnoreError();
      } else {
        files.Remove(path).IgnoreError();
      }
      continue;
    }
    if (!absl::EndsWith(name, kSnapshotSuffix)) continue;
    const std::string stem = name.substr(0, name.size() - kSnapshotSuffix.size());
    // The key: from the name, or (hashed names) from the record, checked against the name.
    std::optional<SessionKey> key;
    const bool hashed = IsHashedFileStem(stem);
    if (!hashed) {
      absl::StatusOr<SessionKey> parsed = ParseSessionRecordId(stem);
      if (!parsed.ok() || SessionFileStem(*parsed) != stem) {
        open_errors_.push_back(absl::StrCat(path.string(), ": not a session snapshot name"));
        continue;
      }
      key = *std::move(parsed);
    }
    auto entry = std::make_unique<Entry>();
    entry->tier = Tier::kDisk;
    entry->last_used = absl::Now();
    std::error_code ec;
    uint64_t size = 0;
    uint64_t snapshot_id = 0;
    std::optional<SnapshotStamp> stamp;  // shared directory: of the file the record is from
    absl::StatusOr<SessionRecord> record = absl::UnknownError("not read");
    if (options_.shared_dir) {
      record = ReadSharedRecord(path, &stamp, &snapshot_id);
      if (stamp.has_value()) size = stamp->size;
    } else {
      size = std::filesystem::file_size(path, ec);
      record = ec ? absl::StatusOr<SessionRecord>(absl::InternalError(ec.message()))
                  : ReadRecord(files, path, size, &snapshot_id);
    }
    // Its delta log: the latest record is the log's last good one.
    const std::filesystem::path log_path = options_.dir / absl::StrCat(stem, kLogSuffix);
    LogReplay log;
    if (record.ok() && all_names.count(log_path.filename().string()) > 0) {
      const uint64_t log_size = std::filesystem::file_size(log_path, ec);
      absl::StatusOr<LogReplay> scanned =
          ec ? absl::StatusOr<LogReplay>(absl::InternalError(ec.message()))
             : ScanLog([&](uint64_t offset,
                           uint64_t n) { return files.ReadRange(log_path, offset, n); },
                       log_size, fingerprint_, snapshot_id);
      if (scanned.ok()) {
        log = *std::move(scanned);
        if (log.dropped_bytes > 0) {
          // Normal after a crash mid-append (a turn not yet fsynced when it happened), but an
          // operator who finds a session behind what a client saw must be able to tell why.
          open_errors_.push_back(absl::StrCat(log_path.string(), ": its last ", log.dropped_bytes,
                                              " bytes are not a whole record (a write cut short: a "
                                              "torn tail), dropped: the session "
                                              "comes back as of the last whole record (",
                                              log.records, " in the log)"));
        }
        if (log.has_record) {
          // The record's id and metadata are the snapshot's (a delta never changes them).
          record->last_used_unix_ms = log.record.last_used_unix_ms;
          record->position = log.record.position;
          record->pending_token = log.record.pending_token;
        }
      } else if (scanned.status().code() == absl::StatusCode::kFailedPrecondition) {
        files.Remove(log_path).IgnoreError();  // stale: the snapshot holds its records
        log = LogReplay();
      } else {
        // Quarantined with its snapshot, below (and only if the snapshot could be moved).
        record = absl::Status(scanned.status().code(),
                              absl::StrCat("its delta log: ", scanned.status().message()));
      }
    }
    if (record.ok() && !hashed && record->id != stem) {
      record = absl::DataLossError(absl::StrCat("it holds session '", record->id, "'"));
    } else if (record.ok() && hashed && record->id == stem) {
      // Written before keys were typed: the record names only the digest.
      if (options_.legacy_key) {
        std::optional<SessionKey> legacy = options_.legacy_key(record->metadata);
        if (legacy.has_value() && ValidateSessionKey(*legacy).ok() &&
            SessionFileStem(*legacy) == stem) {
          key = *std::move(legacy);
        }
      }
    } else if (record.ok() && hashed) {
      absl::StatusOr<SessionKey> named = ParseSessionRecordId(record->id);
      if (named.ok() && SessionFileStem(*named) == stem) {
        key = *std::move(named);
      } else {
        record = absl::DataLossError(
            absl::StrCat("it holds session '", absl::CHexEscape(record->id.substr(0, 300)), "'"));
      }
    }
    if (!record.ok() && record.status().code() == absl::StatusCode::kFailedPrecondition) {
      // Of another model or format: broken here (as Discover makes it on a shared directory),
      // its snapshot and log left as they are (RefusedInPlace). Before, they were quarantined:
      // one start with the wrong model left every session refused until an operator moved each
      // file back by hand.
      entry->position = -1;
      entry->broken = RefusedInPlace(record.status(), options_.shared_dir);
      open_errors_.push_back(absl::StrCat(path.string(), ": ", entry->broken.message()));
    } else if (!record.ok() && options_.shared_dir) {
      // Not this store's file to move: another store may be writing it (a read that failed
      // again and again while it was replaced) or serving it. Left in place and found on demand,
      // as Discover finds it: each lookup reads it again and answers its error while it fails.
      // Before, it was quarantined, which took the session from every replica, a sound one too.
      open_errors_.push_back(absl::StrCat(path.string(), ": ", record.status().message(),
                                          " (in the shared directory: left in place)"));
      continue;
    } else if (!record.ok()) {
      Quarantine(*entry, path, record.status());
      // Its log goes with it (when the snapshot could be moved): left here, the next Open would
      // find a log without its snapshot and remove it, with every turn since the snapshot (an
      // operator who repairs the snapshot and moves it back would lose them).
      if (!entry->quarantined_as.empty() && all_names.count(log_path.filename().string()) > 0) {
        QuarantineLog(log_path);
      }
      open_errors_.push_back(absl::StrCat(path.string(), ": ", entry->broken.message()));
    } else {
      entry->metadata = record->metadata;
      entry->ttl = TtlOfRecord(record->ttl_ms);
      if (record->last_used_unix_ms > 0) {
        entry->last_used = absl::FromUnixMillis(record->last_used_unix_ms);
      }
      entry->disk_bytes = static_cast<int64_t>(size + log.valid_bytes);
      entry->persisted_bytes = static_cast<int64_t>(size);
      entry->base_id = snapshot_id;
      entry->log_bytes = log.has_record ? log.valid_bytes : 0;
      entry->log_records = log.records;
      entry->persisted_position = record->position;
      // A snapshot whose record does not name its key (written before keys were typed) is
      // rewritten whole at its first write, so that its record comes to name it; so is one whose
      // log is of an older format (records are appended only to a log of the current one).
      entry->needs_full = !key.has_value() || record->id != SessionRecordId(*key) ||
                          (log.has_record && log.version != kStateLogVersion);
      entry->position = record->position;
      entry->pending = record->pending_token >= 0;
      if (options_.shared_dir) entry->disk_stamp = stamp;
    }
    if (key.has_value()) {
      entry->key = *std::move(key);
      Insert(std::move(entry));
    } else {
      entry->key = SessionKey(stem);  // for messages to operators until it is adopted
      orphans_.emplace(stem, std::move(entry));
    }
  }
  if (!options_.shared_dir) RestoreQuarantined(quarantined);
  return absl::OkStatus();
}

std::map<std::string, SessionStateStore::QuarantinedCopy>
SessionStateStore::LatestQuarantinedCopies() const {
  std::map<std::string, QuarantinedCopy> latest;
  absl::StatusOr<std::vector<std::string>> names =
      options_.files->List(options_.dir / "quarantine");
  if (!names.ok()) return latest;
  for (const std::string& name : *names) {
    const size_t at = name.rfind(absl::StrCat(kSnapshotSuffix, "."));
    if (at == std::string::npos || at == 0) continue;
    const std::string stem = name.substr(0, at);
    absl::string_view rest = absl::string_view(name).substr(at + kSnapshotSuffix.size() + 1);
    QuarantinedCopy copy;
    copy.name = name;
    copy.deleted = absl::ConsumeSuffix(&rest, kDeletedSuffix);
    const std::vector<absl::string_view> parts = absl::StrSplit(rest, '.');
    if (parts.empty() || parts.size() > 2 || !absl::SimpleAtoi(parts[0], &copy.ms) ||
        (parts.size() == 2 && !absl::SimpleAtoi(parts[1], &copy.n))) {
      continue;
    }
    QuarantinedCopy& best = latest[stem];
    if (std::tie(copy.ms, copy.n, copy.deleted) > std::tie(best.ms, best.n, best.deleted)) {
      best = std::move(copy);
    }
  }
  return latest;
}

void SessionStateStore::RestoreQuarantined(const std::map<std::string, QuarantinedCopy>& latest) {
  for (auto& [stem, copy] : latest) {
    if (copy.deleted || IsHashedFileStem(stem)) continue;  // a hashed stem does not name its key
    absl::StatusOr<SessionKey> key = ParseSessionRecordId(stem);
    if (!key.ok() || SessionFileStem(*key) != stem || entries_.count(*key) > 0) continue;
    auto entry = std::make_unique<Entry>();
    entry->key = *std::move(key);
    entry->tier = Tier::kDisk;
    entry->last_used = absl::Now();
    entry->quarantined_as = options_.dir / "quarantine" / copy.name;
    entry->broken = absl::DataLossError(absl::StrCat(
        "it was quarantined before the server restarted (kept as ", entry->quarantined_as.string(),
        "; the server's log of then says why, at its start or at the session's first use; a "
        "copy quarantined only for being of another model, before such files were left in "
        "place, is intact and can be moved back, docs/state-format.md, Quarantine); deleting "
        "the session discards it"));
    Insert(std::move(entry));
  }
}

// ---- Shared snapshot directory (SessionStoreOptions::shared_dir) ----

std::optional<SessionStateStore::SnapshotStamp> SessionStateStore::FileStampOf(
    const std::filesystem::path& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  SnapshotStamp stamp;
  stamp.inode = st.st_ino;
  stamp.size = static_cast<uintmax_t>(st.st_size);
  stamp.mtime_ns = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  return stamp;
}

std::optional<SessionStateStore::SnapshotStamp> SessionStateStore::StampOf(
    const std::filesystem::path& path) const {
  std::optional<SnapshotStamp> stamp = FileStampOf(path);
  if (!stamp.has_value()) return std::nullopt;
  uint64_t snapshot_id = 0;
  absl::StatusOr<SessionRecord> record =
      ReadRecord(*options_.files, path, stamp->size, &snapshot_id);
  if (record.ok()) {
    stamp->position = record->position;
    stamp->pending_token = record->pending_token;
    stamp->last_used_unix_ms = record->last_used_unix_ms;
  }
  return stamp;
}

absl::StatusOr<SessionRecord> SessionStateStore::ReadSharedRecord(
    const std::filesystem::path& path, std::optional<SnapshotStamp>* stamp,
    uint64_t* snapshot_id) const {
  // Another store may rename a new snapshot over this one at any moment. Between the size and
  // the reads, the record fails against the old size (or its two reads are of two files): a
  // sound session would be taken for a damaged one. After them, a stamp taken then is of a file
  // the record was not read from: the copy would pass for current. So a read counts only if the
  // file stayed the same across it (a snapshot is never changed in place, only replaced).
  for (int attempt = 1;; ++attempt) {
    *stamp = FileStampOf(path);
    if (!stamp->has_value()) {
      return absl::NotFoundError(absl::StrCat("cannot read ", path.string(), ": it is gone"));
    }
    absl::StatusOr<SessionRecord> record =
        ReadRecord(*options_.files, path, (*stamp)->size, snapshot_id);
    if (FileStampOf(path) == *stamp) {
      if (record.ok()) {
        (*stamp)->position = record->position;
        (*stamp)->pending_token = record->pending_token;
        (*stamp)->last_used_unix_ms = record->last_used_unix_ms;
      }
      return record;
    }
    if (attempt == kSharedReadAttempts) {
      stamp->reset();
      return ReplacedAtEveryRead(path);
    }
  }
}

absl::StatusOr<std::unique_ptr<SessionStateStore::Entry>> SessionStateStore::Discover(
    const SessionKey& key) const {
  std::filesystem::path path = PathOf(key);
  std::string committed;
  if (fenced()) {
    // Only the committed snapshot is the session (etcd's answer to the last Claim or Observe).
    committed = options_.ownership->Committed(key).value_or("");
    if (committed.empty()) return NotFound(key);
    // A name only this store's kind writes (NewSnapshotName): anything else in etcd (a path with
    // '/' or '..', another session's file) was put there by something else, and is not made a
    // path to read, or to remove once the next snapshot replaces it.
    std::string base;
    if (!IsGenerationOf(committed, SessionFileStem(key), &base) || base != committed) {
      return absl::DataLossError(absl::StrCat(
          "etcd names '", absl::CHexEscape(committed.substr(0, 300)),
          "' as the snapshot of session '", key.id,
          "', which is not a snapshot name of that session: refused (was the key changed "
          "by something other than sdm-server?)"));
    }
    path = options_.dir / kGenerationsDir / committed;
  }
  // One stamped read (another store may replace the file at any moment): before, the stamp
  // (StampOf) and the record were two reads, and a replacement between them failed the record
  // against the old size (DATA_LOSS for a sound file) or kept it under another file's stamp.
  std::optional<SnapshotStamp> stamp;
  uint64_t snapshot_id = 0;
  absl::StatusOr<SessionRecord> record = ReadSharedRecord(path, &stamp, &snapshot_id);
  if (!stamp.has_value() && absl::IsNotFound(record.status())) return NotFound(key);
  if (record.ok() && record->id != SessionRecordId(key)) {
    record = absl::DataLossError("it holds another session");
  }
  if (!record.ok() && record.status().code() != absl::StatusCode::kFailedPrecondition) {
    // Damaged, or not readable now (an I/O error, too many open files, replaced at every read):
    // this call's answer, and the next call reads the file again.
    return absl::Status(
        record.status().code(),
        absl::StrCat("the snapshot of session '", key.id,
                     "' in the shared directory failed its checks: ", record.status().message()));
  }
  auto entry = std::make_unique<Entry>();
  entry->key = key;
  entry->tier = Tier::kDisk;
  entry->disk_stamp = stamp;
  entry->snapshot_file = committed;
  entry->disk_bytes = static_cast<int64_t>(stamp->size);
  entry->persisted_bytes = entry->disk_bytes;
  if (!record.ok()) {
    // Of another model or format version: a broken session (as a quarantined one is: listed
    // with its error, refused, deletable),
    // its file left where it is: another replica may read it (one of the model it was written
    // by, during a rolling upgrade). Before, the error was the answer to every call on the id,
    // its Delete included: the id could not be freed.
    entry->last_used = absl::Now();
    entry->position = -1;
    entry->broken = RefusedInPlace(record.status(), /*shared_dir=*/true);
    return entry;
  }
  entry->metadata = record->metadata;
  entry->ttl = TtlOfRecord(record->ttl_ms);
  entry->last_used =
      record->last_used_unix_ms > 0 ? absl::FromUnixMillis(record->last_used_unix_ms) : absl::Now();
  entry->position = record->position;
  entry->pending = record->pending_token >= 0;
  // Its snapshot is all there is (a shared directory holds no delta logs: WriteChanges).
  entry->base_id = snapshot_id;
  entry->persisted_position = record->position;
  entry->needs_full = false;
  return entry;
}

void SessionStateStore::DropReplacedLocked(EntryMap::iterator it,
                                           absl::StatusOr<std::unique_ptr<Entry>>& fresh,
                                           std::vector<std::unique_ptr<Entry>>& dead) {
  Entry& e = *it->second;
  // Turns waiting for their write are not in the state the session continues from.
  if (e.version != e.persisted_version) {
    SettleWaiters(e, /*all=*/true,
                  absl::AbortedError(absl::StrCat(
                      "the turn was not saved: another replica wrote session '", it->first.id,
                      "' before this one did; the session continues from its state without this "
                      "turn: send it again")));
  }
  const uint64_t handoffs = e.handoffs;
  dead.push_back(Erase(it));
  if (fresh.ok()) {
    (*fresh)->handoffs = handoffs;  // an Acquire compares the count across the replacement
    Insert(*std::move(fresh));
  }
}

void SessionStateStore::RefreshFromSharedDir(const SessionKey& key) {
  if (!options_.shared_dir) return;
  std::vector<std::unique_ptr<Entry>> dead;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) return;  // FindIdle() discovers it
    Entry& e = *it->second;
    // This store is using or writing it (its own copy is current), or handing it over (the
    // entry's handoff marks guard Acquire's claim: see Acquire).
    if (e.busy || e.in_use || e.handing_off) return;
    if (fenced()) {
      // The committed name as the claim just saw it: another one means another replica wrote
      // (or deleted) the session since this copy was read or written.
      const std::optional<std::string> committed = options_.ownership->Committed(key);
      if (!committed.has_value() || *committed == e.snapshot_file) return;
      absl::StatusOr<std::unique_ptr<Entry>> fresh = Discover(key);
      if (!fresh.ok() && !absl::IsNotFound(fresh.status())) return;  // Acquire() reports it
      if (e.version != e.persisted_version) {
        SDM_LOG(WARNING) << "sdm state store: session '" << key.id << "' was "
                         << (fresh.ok() ? "written" : "deleted")
                         << " by another replica; this replica's unwritten turns are dropped";
      }
      DropReplacedLocked(it, fresh, dead);
    } else {
      const std::optional<SnapshotStamp> stamp = StampOf(PathOf(key));
      if (stamp == e.disk_stamp) return;
      if (!stamp.has_value() && e.version != e.persisted_version) return;  // created, unwritten
      absl::StatusOr<std::unique_ptr<Entry>> fresh =
          stamp.has_value() ? Discover(key) : absl::StatusOr<std::unique_ptr<Entry>>(NotFound(key));
      if (!fresh.ok() && !absl::IsNotFound(fresh.status())) return;  // Acquire() reports it
      if (e.version != e.persisted_version) {
        SDM_LOG(WARNING) << "sdm state store: session '" << key.id
                         << "' was written by another replica; its turns not written here are "
                            "dropped";
      }
      DropReplacedLocked(it, fresh, dead);
    }
  }
  Bury(std::move(dead));
  FlushReady();  // the dropped turns' waiters (DropReplacedLocked), now, not after a next write
}

absl::Status SessionStateStore::CheckOwnership(const SessionKey& key) const {
  if (options_.ownership == nullptr) return absl::OkStatus();
  return options_.ownership->CheckWrite(key);
}

void SessionStateStore::WriteFenced(const SessionKey& key, const absl::Status& why) {
  ++counters_.fenced_writes;
  SDM_LOG(ERROR) << "sdm state store: write of session '" << key.id
                 << "' refused, this replica does not own it: " << why;
}

// ---- Lookup ----

const SessionStateStore::Entry* SessionStateStore::Find(const SessionKey& key) const {
  if (auto it = entries_.find(key); it != entries_.end()) return it->second.get();
  if (orphans_.empty()) return nullptr;
  auto orphan = orphans_.find(SessionFileStem(key));
  return orphan == orphans_.end() ? nullptr : orphan->second.get();
}

SessionStateStore::Entry* SessionStateStore::WaitIdle(const SessionKey& key) {
  while (true) {
    auto it = entries_.find(key);
    if (it == entries_.end()) return nullptr;
    if (!it->second->busy) return it->second.get();
    changed_.Wait(&mu_);  // the entry may be gone when it wakes (deleted, expired)
  }
}

absl::StatusOr<SessionStateStore::Entry*> SessionStateStore::FindIdle(const SessionKey& key) {
  while (true) {
    auto it = entries_.find(key);
    if (it == entries_.end() && !orphans_.empty()) {
      // Its key hashes to the orphan's file name, as its snapshot was written under: adopt it.
      auto orphan = orphans_.find(SessionFileStem(key));
      if (orphan != orphans_.end() && !orphan->second->busy) {
        std::unique_ptr<Entry> e = std::move(orphan->second);
        orphans_.erase(orphan);
        e->key = key;
        Insert(std::move(e));
        it = entries_.find(key);
      }
    }
    if (it == entries_.end() && options_.shared_dir) {
      absl::StatusOr<std::unique_ptr<Entry>> found = Discover(key);
      if (!found.ok()) return found.status();
      Insert(*std::move(found));
      it = entries_.find(key);
    }
    if (it == entries_.end()) return NotFound(key);
    if (!it->second->busy) return it->second.get();
    changed_.Wait(&mu_);  // the entry may be gone when it wakes: look it up again
  }
}

absl::StatusOr<DecodedSession> SessionStateStore::DecodeParked(const Entry& e,
                                                               ParkedLog* log) const {
  if (e.tier == Tier::kHost) return DecodeSessionState(e.blob, layout_, fingerprint_);
  if (!options_.shared_dir) return DecodeSnapshot(e, log);
  // Another store may rename a new snapshot over this one right after the read: a failure is
  // then the old file's, and the sound new one would be refused. A failure counts only if the
  // file stayed the same across the read (as in ReadSharedRecord).
  const std::filesystem::path path = SnapshotPathOf(e);
  for (int attempt = 1;; ++attempt) {
    const std::optional<SnapshotStamp> stamp = FileStampOf(path);
    *log = ParkedLog();
    absl::StatusOr<DecodedSession> decoded = DecodeSnapshot(e, log);
    if (decoded.ok() || FileStampOf(path) == stamp) return decoded;
    if (attempt == kSharedReadAttempts) return ReplacedAtEveryRead(path);
  }
}

absl::StatusOr<DecodedSession> SessionStateStore::DecodeSnapshot(const Entry& e,
                                                                 ParkedLog* log) const {
  auto blob = options_.files->Read(SnapshotPathOf(e));
  if (!blob.ok()) return blob.status();
  absl::StatusOr<DecodedSession> decoded = DecodeSessionState(*blob, layout_, fingerprint_);
  if (!decoded.ok()) return decoded;
  absl::StatusOr<uint64_t> prefix = RecordPrefixSize(*blob, blob->size(), fingerprint_);
  if (!prefix.ok()) return prefix.status();
  log->base_id = SnapshotId(absl::string_view(*blob).substr(0, *prefix));
  absl::StatusOr<std::string> log_blob = options_.files->Read(LogPathOf(e.key));
  if (!log_blob.ok()) {
    if (log_blob.status().code() == absl::StatusCode::kNotFound) return decoded;
    return log_blob.status();
  }
  absl::StatusOr<LogReplay> replay =
      ReplayLog(*log_blob, fingerprint_, log->base_id, *decoded->state);
  if (!replay.ok()) {
    if (replay.status().code() == absl::StatusCode::kFailedPrecondition) {
      log->stale = true;  // the snapshot holds its records
      return decoded;
    }
    return absl::Status(replay.status().code(),
                        absl::StrCat("its delta log: ", replay.status().message()));
  }
  if (replay->has_record) {
    decoded->record.last_used_unix_ms = replay->record.last_used_unix_ms;
    decoded->record.position = replay->record.position;
    decoded->record.pending_token = replay->record.pending_token;
    log->bytes = replay->valid_bytes;
    log->records = replay->records;
    log->version = replay->version;
  }
  log->dropped = replay->dropped_bytes;
  return decoded;
}

// ---- Sessions ----

void SessionStateStore::Changed() {
  if (options_.background) {
    worker_pending_ = true;  // a signal the worker misses while it works is not lost
    changed_.SignalAll();
  } else {
    Rebalance();
    PersistChangedLocked(absl::Now());
  }
}

void SessionStateStore::BeginReleaseLocked(const SessionKey& key) {
  ReleaseCount& count = releases_[key];
  ++count.users;
  ++count.under_way;
}

void SessionStateStore::EndReleaseLocked(const SessionKey& key) {
  auto it = releases_.find(key);
  SDM_CHECK(it != releases_.end());
  --it->second.under_way;
  ++it->second.ended;
  if (--it->second.users == 0) releases_.erase(it);
  changed_.SignalAll();  // a ClaimWatch may wait for it
}

// See ReleaseCount (session_store.h). Inactive without ownership.
class SessionStateStore::ClaimWatch {
 public:
  // Before the claim is asked for.
  ClaimWatch(SessionStateStore& store, const SessionKey& key) ABSL_LOCKS_EXCLUDED(store.mu_)
      : store_(store), key_(key), active_(store.options_.ownership != nullptr) {
    if (!active_) return;
    absl::MutexLock lock(&store_.mu_);
    ReleaseCount& count = store_.releases_[key_];
    ++count.users;
    seen_ = count.ended;
  }
  ~ClaimWatch() ABSL_LOCKS_EXCLUDED(store_.mu_) {
    if (!active_) return;
    absl::MutexLock lock(&store_.mu_);
    auto it = store_.releases_.find(key_);
    SDM_CHECK(it != store_.releases_.end());
    if (--it->second.users == 0) store_.releases_.erase(it);
  }
  ClaimWatch(const ClaimWatch&) = delete;
  ClaimWatch& operator=(const ClaimWatch&) = delete;

 private:
  friend class SessionStateStore;
  SessionStateStore& store_;
  const SessionKey key_;
  const bool active_;
  uint64_t seen_ = 0;
};

bool SessionStateStore::ReleasedLocked(const ClaimWatch& watch) const {
  if (!watch.active_) return false;
  const ReleaseCount& count = releases_.at(watch.key_);  // kept while the watch lives
  return count.under_way > 0 || count.ended != watch.seen_;
}

void SessionStateStore::AwaitReleasesLocked(ClaimWatch& watch) {
  if (!watch.active_) return;
  const ReleaseCount& count = releases_.at(watch.key_);
  while (count.under_way > 0) changed_.Wait(&mu_);
  watch.seen_ = count.ended;
}

absl::Status SessionStateStore::Create(const SessionKey& key, absl::string_view metadata,
                                       absl::Duration ttl) {
  if (absl::Status s = ValidateSessionKey(key); !s.ok()) return s;
  if (options_.shared_dir && ttl > absl::ZeroDuration() && ttl != absl::InfiniteDuration()) {
    return SharedTtlError();
  }
  auto e = std::make_unique<Entry>();
  e->key = key;
  e->metadata = std::string(metadata);
  e->state = NewState();
  e->Refresh();
  e->ttl = ttl > absl::ZeroDuration() ? ttl : options_.default_ttl;
  ClaimWatch watch(*this, key);  // before the claim: a release that ends it is seen
  while (true) {
    if (options_.ownership != nullptr) SDM_RETURN_IF_ERROR(options_.ownership->Claim(key));
    SweepGenerations(key, /*force=*/false);
    absl::MutexLock lock(&mu_);
    if (Find(key) != nullptr) return AlreadyExists(key);
    if (fenced() ? !options_.ownership->Committed(key).value_or("").empty()
                 : options_.shared_dir && StampOf(PathOf(key)).has_value()) {
      return AlreadyExists(key);
    }
    SDM_RETURN_IF_ERROR(RefuseWhenUnpersistable());
    if (ReleasedLocked(watch)) {
      // A Delete (or a hand-off) of the id released its claim meanwhile, perhaps after this
      // claim was answered: claim again once it is done.
      AwaitReleasesLocked(watch);
      continue;
    }
    e->tick = ++clock_;
    e->last_used = absl::Now();
    e->version = 1;  // not on disk yet
    Insert(std::move(e));
    Changed();
    return absl::OkStatus();
  }
}

SessionLease SessionStateStore::NewSession() {
  std::unique_ptr<SessionState> state = NewState();
  const int64_t bytes = state->ResidentBytes();  // its tables; its rows count from the pool
  absl::MutexLock lock(&mu_);
  ++one_shot_count_;
  one_shot_bytes_ += bytes;
  Changed();
  return SessionLease(this, std::move(state), bytes);
}

void SessionStateStore::ReleaseOneShot(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  --one_shot_count_;
  one_shot_bytes_ -= bytes;
}

absl::StatusOr<SessionLease> SessionStateStore::Acquire(const SessionKey& key) {
  while (true) {
    // A claim of a session this store already owns is answered locally; a Park handing it over
    // may release that claim after the answer and before this lease is taken, and another
    // replica then takes it up too. So the claim counts only if no release ended since it was
    // asked for and none is under way: otherwise (after it ends) the claim is asked again, and
    // goes to the ownership's keeper.
    uint64_t handoffs = 0;
    if (options_.ownership != nullptr) {
      {
        absl::MutexLock lock(&mu_);
        if (const Entry* e = Find(key); e != nullptr) handoffs = e->handoffs;
      }
      SDM_RETURN_IF_ERROR(options_.ownership->Claim(key));
    }
    RefreshFromSharedDir(key);
    SweepGenerations(key, /*force=*/false);
    absl::ReleasableMutexLock lock(&mu_);
    absl::StatusOr<Entry*> found = FindIdle(key);
    if (!found.ok()) return found.status();
    if ((*found)->handing_off || (*found)->handoffs != handoffs) {
      while (true) {
        auto it = entries_.find(key);
        if (it == entries_.end() || !it->second->handing_off) break;
        changed_.Wait(&mu_);
      }
      continue;
    }
    absl::StatusOr<SessionLease> lease = AcquireIdleLocked(key, **found);
    lock.Release();
    // The answers of the turns whose write AcquireIdleLocked made go out here, not from the worker
    // (which may be in another session's write).
    FlushReady();
    return lease;
  }
}

absl::StatusOr<SessionLease> SessionStateStore::AcquireIdleLocked(const SessionKey& key,
                                                                  Entry& idle) {
  Entry* e = &idle;
  if (!e->broken.ok()) return e->BrokenError(key.id);
  if (e->in_use) {
    return absl::AbortedError(absl::StrCat(
        "session '", key.id, "' is in use by another request; retry when it finishes"));
  }
  SDM_RETURN_IF_ERROR(RefuseWhenUnpersistable());
  // A session whose writes fail is tried here too (a failed write fails fast on a full or
  // read-only disk): once the disk is back, its next turn is written and acknowledged without
  // waiting for the worker's retry.
  if (options_.background && !options_.dir.empty() && options_.persist == PersistPolicy::kTurn &&
      DueLocked(*e, absl::Now())) {
    // A turn not written yet (no writer got to it: they may all be busy): written now, on this
    // thread, before the lease lets the next turn change it. Its acknowledgement (WhenPersisted,
    // asked for before or after this) then does not wait for the next turn to end, as it would if
    // the writers found the session in use, and is of its own state. A failure is the write's as
    // anywhere (counted, its waiters told); the next turn goes ahead on the memory copy.
    WriteChanges(*e, SyncOnWrite()).IgnoreError();
  }
  e->in_use = true;
  if (e->tier != Tier::kResident) {
    const Tier from = e->tier;
    e->busy = true;
    mu_.Unlock();
    ParkedLog log;
    absl::StatusOr<DecodedSession> decoded = DecodeParked(*e, &log);
    const std::filesystem::path path = SnapshotPathOf(*e);
    mu_.Lock();
    e->busy = false;
    changed_.SignalAll();
    if (!decoded.ok()) {
      e->in_use = false;
      const absl::StatusCode code = decoded.status().code();
      if (from == Tier::kDisk && code == absl::StatusCode::kFailedPrecondition) {
        // Of another model or format (on a shared directory, replaced meanwhile by a replica of
        // another model): left in place, as at Open (RefusedInPlace).
        e->position = -1;
        e->broken = RefusedInPlace(decoded.status(), options_.shared_dir);
        return e->BrokenError(key.id);
      }
      if (from == Tier::kDisk && code == absl::StatusCode::kDataLoss && options_.shared_dir) {
        // Not this store's file to move (another store may serve it, or replace it now: a
        // rename by path would move the new file): this call's answer, the file left in place,
        // and the next call reads it again, as Discover does. Before, it was quarantined, which
        // took the session from every replica, and a sound replacement with it.
        return absl::DataLossError(absl::StrCat(
            "the snapshot of session '", key.id,
            "' in the shared directory failed its checks: ", decoded.status().message()));
      }
      if (from == Tier::kDisk && code == absl::StatusCode::kDataLoss) {
        Quarantine(*e, path, decoded.status());
        // Not at Open: the operator learns of it from the log too (a restart's message points
        // there).
        SDM_LOG(WARNING) << "sdm state store: " << e->BrokenError(key.id);
        // Its log with it, only if it went: a log moved alone leaves the snapshot without its
        // turns at the next Open.
        if (!e->quarantined_as.empty()) QuarantineLog(LogPathOf(e->key));
        return e->BrokenError(key.id);
      }
      return decoded.status();
    }
    if (from == Tier::kDisk) {
      e->base_id = log.base_id;
      e->log_bytes = log.bytes;
      e->log_records = log.records;
      e->persisted_position = decoded->state->position();
      // A log of an older format is not appended to: the next write is a full snapshot.
      if (log.bytes > 0 && log.version != kStateLogVersion) e->needs_full = true;
      if (log.stale) options_.files->Remove(LogPathOf(e->key)).IgnoreError();
      if (log.dropped > 0) {
        SDM_LOG(WARNING) << "sdm state store: session '" << e->key.id
                         << "': dropped a torn tail of " << log.dropped
                         << " bytes from its delta log (a turn cut short by a crash)";
      }
    }
    e->state = std::move(decoded->state);
    e->blob.clear();
    e->blob.shrink_to_fit();
    e->tier = Tier::kResident;
    Refresh(*e);
    ++counters_.restores[static_cast<int>(from)];
  }
  e->tick = ++clock_;
  e->last_used_before_lease = e->last_used;
  e->last_used = absl::Now();
  if (options_.background) changed_.SignalAll();
  return SessionLease(this, e->key, e->state.get());
}

void SessionStateStore::Release(const SessionKey& key,
                                std::function<void(const absl::Status&)> done, bool changed) {
  bool settled = false;
  absl::Status outcome;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    SDM_CHECK(it != entries_.end());  // a leased session cannot be deleted
    Entry& e = *it->second;
    Refresh(e);
    e.in_use = false;
    e.tick = ++clock_;
    e.last_used = changed ? absl::Now() : e.last_used_before_lease;
    if (e.state != nullptr && e.state->failed()) {
      // Half-updated by a failed step: never written (the snapshot on disk, if any, stays the
      // last good copy), never parked, never leased again; Delete resets it.
      if (e.broken.ok()) {
        e.broken = absl::FailedPreconditionError(e.state->failure().message());
        e.broken_in_step = true;
        SDM_LOG(ERROR) << "sdm state store: session '" << key.id
                       << "' is refused from now on: " << e.state->failure();
      }
      // Turns still waiting for their write (earlier turns, whose state this step changed
      // before it could be written) never will be: told so now, not left waiting for good.
      settled = !e.waiters.empty();
      SettleWaiters(e, /*all=*/true, e.NotSavedError(key.id));
    } else if (changed) {
      ++e.version;  // a turn (or an attempt at one) ran: its result is not on disk yet
    }
    // Asked with the release, not after it: a Delete (or the next turn) cannot come between.
    if (done != nullptr && QueuePersistWaiterLocked(key, &e, done, &outcome)) done = nullptr;
    Changed();
  }
  // Their answers go out here, not from the worker (which may be in another session's write).
  if (settled) FlushReady();
  if (done != nullptr) done(outcome);
}

absl::Status SessionStateStore::Delete(const SessionKey& key) {
  if (options_.ownership != nullptr) SDM_RETURN_IF_ERROR(options_.ownership->Claim(key));
  std::unique_ptr<Entry> dead;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<Entry*> e = FindIdle(key);
    if (!e.ok()) return e.status();
    if ((*e)->in_use) {
      return absl::AbortedError(absl::StrCat("session '", key.id, "' is in use; cancel it first"));
    }
    if (fenced()) {
      // The deletion is the removal of the committed name, fenced like a write.
      Entry& entry = **e;
      const std::string base = entry.snapshot_file;
      entry.busy = true;
      mu_.Unlock();
      const absl::Status deleted = options_.ownership->DeleteCommitted(key, base);
      mu_.Lock();
      entry.busy = false;
      changed_.SignalAll();
      if (!deleted.ok()) {
        if (absl::IsFailedPrecondition(deleted)) {
          ++counters_.fenced_writes;
          SDM_LOG(ERROR) << "sdm state store: deletion of session '" << key.id
                         << "' refused: " << deleted;
          return absl::UnavailableError(
              absl::StrCat("session '", key.id, "' changed on another replica meanwhile; retry"));
        }
        return deleted;
      }
      if (!base.empty()) {
        options_.files->Remove(options_.dir / kGenerationsDir / base).IgnoreError();
      }
    } else if (!options_.dir.empty()) {
      if (auto s = options_.files->Remove(PathOf(key)); !s.ok()) return s;
      // After the snapshot: a log left alone is removed at the next Open.
      options_.files->Remove(LogPathOf(key)).IgnoreError();
    }
    if (const std::filesystem::path& q = (*e)->quarantined_as; !q.empty()) {
      // Kept for the operator, but no longer a session at the next Open.
      std::filesystem::path deleted = q;
      deleted += std::string(kDeletedSuffix);
      if (auto s = options_.files->Rename(q, deleted); !s.ok()) return s;
    }
    dead = Erase(entries_.find(key));
    // From here a Create of the id may claim it: it watches the release below (ClaimWatch).
    if (options_.ownership != nullptr) BeginReleaseLocked(key);
  }
  std::vector<std::unique_ptr<Entry>> buried;
  buried.push_back(std::move(dead));
  Bury(std::move(buried));
  // Its turns still waiting for their write are answered now (Erase settled them), not once the
  // worker is next done with a write: a long write of another session would hold them.
  FlushReady();
  SweepGenerations(key, /*force=*/true);  // under the claim still: files a crash left behind
  {
    absl::MutexLock lock(&mu_);
    swept_.erase(key);
  }
  if (options_.ownership != nullptr) {
    options_.ownership->Release(key);
    absl::MutexLock lock(&mu_);
    EndReleaseLocked(key);
  }
  return absl::OkStatus();
}

absl::Status SessionStateStore::Fork(const SessionKey& src, const SessionKey& dst,
                                     absl::string_view metadata, absl::Duration ttl) {
  if (absl::Status s = ValidateSessionKey(dst); !s.ok()) return s;
  if (options_.shared_dir && ttl > absl::ZeroDuration() && ttl != absl::InfiniteDuration()) {
    return SharedTtlError();
  }
  ClaimWatch watch(*this, dst);  // before the claim: a release that ends it is seen
  while (true) {
    if (options_.ownership != nullptr) SDM_RETURN_IF_ERROR(options_.ownership->Claim(dst));
    SweepGenerations(dst, /*force=*/false);
    ObserveShared(src);
    absl::MutexLock lock(&mu_);
    absl::StatusOr<Entry*> found = FindIdle(src);
    if (!found.ok()) return found.status();
    Entry* e = *found;
    if (Find(dst) != nullptr) return AlreadyExists(dst);
    if (!e->broken.ok()) return e->BrokenError(src.id);
    if (e->in_use) {
      return absl::AbortedError(
          absl::StrCat("session '", src.id, "' is generating; fork it when the request finishes"));
    }
    std::unique_ptr<SessionState> copy;
    if (e->tier == Tier::kResident) {
      if (e->state->on_device()) {
        // Its host layers are stale: copied back first (between steps, on the step thread).
        SDM_RETURN_IF_ERROR(SyncToHostLocked(*e));
        if (Find(dst) != nullptr) return AlreadyExists(dst);
      }
      copy = e->state->Fork();
    } else {
      e->busy = true;
      mu_.Unlock();
      ParkedLog unused;  // the source stays parked as it is
      absl::StatusOr<DecodedSession> decoded = DecodeParked(*e, &unused);
      mu_.Lock();
      e->busy = false;
      changed_.SignalAll();
      if (!decoded.ok()) return decoded.status();
      copy = std::move(decoded->state);
      if (Find(dst) != nullptr) return AlreadyExists(dst);
    }
    if (ReleasedLocked(watch)) {
      // A Delete (or a hand-off) of `dst` released its claim meanwhile, perhaps after this claim
      // was answered: claim again once it is done (the copy, made again, shares nothing then).
      copy.reset();
      AwaitReleasesLocked(watch);
      continue;
    }
    auto n = std::make_unique<Entry>();
    n->key = dst;
    n->metadata = std::string(metadata);
    n->state = std::move(copy);
    n->Refresh();
    n->ttl = ttl > absl::ZeroDuration() ? ttl : options_.default_ttl;  // as Create's
    n->tick = ++clock_;
    n->last_used = absl::Now();
    n->version = 1;
    e->last_used = n->last_used;  // a fork uses its source
    Insert(std::move(n));
    Changed();
    return absl::OkStatus();
  }
}

absl::Status SessionStateStore::SetMetadata(const SessionKey& key, absl::string_view metadata) {
  ObserveShared(key);
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Entry*> found = FindIdle(key);
  if (!found.ok()) return found.status();
  Entry& e = **found;
  if (options_.ownership != nullptr &&
      (e.handing_off || (fenced() && options_.ownership->ClaimEpoch(key) == 0))) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session '", key.id, "' is not held by this replica: set its metadata where it is served"));
  }
  const Tier from = e.tier;
  if (from != Tier::kResident && e.broken.ok()) {
    // A parked session's record is inside its serialised form (the host tier's blob, the disk
    // tier's snapshot, which its delta log extends; deltas never carry the metadata), and that
    // form is what is written: it is decoded (the log replayed) and encoded again under the new
    // record, as a host blob. Written from a stale blob, or not at all (a disk session's entry
    // changed, its file did not), the metadata was lost at the next restart.
    const SessionRecord record{SessionRecordId(e.key), std::string(metadata), ToMs(e.ttl),
                               absl::ToUnixMillis(e.last_used)};
    e.busy = true;
    mu_.Unlock();
    absl::StatusOr<std::string> blob = [&]() -> absl::StatusOr<std::string> {
      ParkedLog unused;  // a full snapshot (below, or by the persist policy) replaces the log
      SDM_ASSIGN_OR_RETURN(DecodedSession decoded, DecodeParked(e, &unused));
      return TryEncodeSessionState(*decoded.state, record, fingerprint_);
    }();  // the decoded rows are back in the pool here
    mu_.Lock();
    e.busy = false;
    changed_.SignalAll();
    if (!blob.ok()) return blob.status();  // nothing changed (as a Fork of it answers)
    e.blob = *std::move(blob);
    e.tier = Tier::kHost;
    Account(e);
  }
  e.metadata = std::string(metadata);
  ++e.version;
  e.needs_full = true;  // deltas never change the record's metadata
  if (from == Tier::kDisk && e.broken.ok()) {
    // Its file is its only copy (a disk session is never written by the persist policy): written
    // at once, fsynced as a park to disk is, a full snapshot that replaces the log; it stays on
    // disk. A failed write leaves it on host, due, retried as any failed write.
    if (absl::Status s = WriteChanges(e, /*sync=*/true); !s.ok()) {
      Changed();
      return absl::UnavailableError(
          absl::StrCat("could not write the snapshot of session '", key.id, "': ", s.message()));
    }
    e.blob.clear();
    e.blob.shrink_to_fit();
    e.disk_bytes = e.persisted_bytes + static_cast<int64_t>(e.log_bytes);
    e.tier = Tier::kDisk;
    Account(e);
    changed_.SignalAll();
    return absl::OkStatus();
  }
  Changed();
  return absl::OkStatus();
}

SessionInfo SessionStateStore::InfoOf(const Entry& e, const SessionKey& key) const {
  SessionInfo info;
  info.key = key;
  info.metadata = e.metadata;
  info.tier = e.tier;
  info.in_use = e.in_use;
  info.position = e.position;
  info.pending_token = e.position >= 0 && e.pending;
  info.last_used = e.last_used;
  info.ttl = e.ttl;
  if (!e.broken.ok()) info.error = std::string(e.BrokenError(key.id).message());
  info.bytes = e.TierBytes();
  if (e.tier == Tier::kResident) {
    info.private_rows = e.rows;
    info.device_bytes = e.device_bytes;
    if (!e.in_use && !e.busy && e.state != nullptr) {
      for (int64_t l = 0; l < e.state->num_layers(); ++l) {
        if (e.state->is_sdm(l)) info.shared_rows += std::as_const(*e.state).sdm(l).SharedRows();
      }
    }
  }
  return info;
}

absl::StatusOr<SessionInfo> SessionStateStore::Get(const SessionKey& key) const {
  // Fenced: the committed file may be replaced (and removed) by its owner between the look-up
  // of its name and the read: the name is looked up again (a few times at most). A copy this
  // store holds is current while it is in use or this store holds the session's claim; one it
  // holds without a claim (it handed the session over, or lost its lease) answers only while
  // its snapshot is still the committed one: else another replica wrote or deleted the session
  // since, and the answer is the committed snapshot's (the service decides from it, e.g.,
  // whether a turn starts the sequence; a stale position 0 would add a BOS mid-conversation).
  const auto owned = [&](const Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return e.in_use || e.busy || options_.ownership->ClaimEpoch(key) != 0;
  };
  for (int attempt = 0; fenced() && attempt < 3; ++attempt) {
    {
      absl::MutexLock lock(&mu_);
      if (const Entry* e = Find(key); e != nullptr && owned(*e)) return InfoOf(*e, key);
    }
    ObserveShared(key);  // what Discover reads; Committed() below is its answer
    absl::MutexLock lock(&mu_);
    if (const Entry* e = Find(key);
        e != nullptr &&
        (owned(*e) || options_.ownership->Committed(key).value_or("") == e->snapshot_file)) {
      return InfoOf(*e, key);
    }
    absl::StatusOr<std::unique_ptr<Entry>> found = Discover(key);
    if (found.ok()) return InfoOf(**found, key);
    const bool replaced = absl::IsNotFound(found.status()) &&
                          !options_.ownership->Committed(key).value_or("").empty();
    if (!replaced) return found.status();
  }
  absl::MutexLock lock(&mu_);
  const Entry* e = Find(key);
  if (e == nullptr && options_.shared_dir) {
    absl::StatusOr<std::unique_ptr<Entry>> found = Discover(key);
    if (!found.ok()) return found.status();
    return InfoOf(**found, key);
  }
  if (e == nullptr) return NotFound(key);
  if (options_.shared_dir && !fenced() && !e->in_use && !e->busy && !e->handing_off) {
    // Another store may have written or deleted the session since this one read or wrote it
    // (as Acquire's RefreshFromSharedDir finds): its file says, and the answer is the file's
    // (fenced: the committed name says, above).
    // Before, a copy cached here answered its old position and history (a client comparing
    // them with its own, or one resuming from them, was misled).
    const std::optional<SnapshotStamp> stamp = StampOf(PathOf(key));
    if (stamp != e->disk_stamp && (stamp.has_value() || e->version == e->persisted_version)) {
      if (!stamp.has_value()) return NotFound(key);
      absl::StatusOr<std::unique_ptr<Entry>> found = Discover(key);
      if (found.ok()) return InfoOf(**found, key);
      if (!absl::IsNotFound(found.status())) return found.status();
      return NotFound(key);
    }
  }
  return InfoOf(*e, key);
}

std::vector<SessionInfo> SessionStateStore::List() const {
  std::vector<SessionKey> keys;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, e] : entries_) keys.push_back(key);
  }
  std::vector<SessionInfo> out;
  for (const SessionKey& key : keys) {
    auto info = Get(key);
    if (info.ok()) out.push_back(*std::move(info));
  }
  return out;
}

std::vector<SessionInfo> SessionStateStore::List(absl::string_view tenant) const {
  std::vector<SessionKey> keys;
  {
    absl::MutexLock lock(&mu_);
    // The map is ordered by tenant, then id: the tenant's sessions are one run from here.
    for (auto it = entries_.lower_bound(SessionKey(tenant, ""));
         it != entries_.end() && it->first.tenant == tenant; ++it) {
      keys.push_back(it->first);
    }
  }
  std::vector<SessionInfo> out;
  for (const SessionKey& key : keys) {
    auto info = Get(key);
    if (info.ok()) out.push_back(*std::move(info));
  }
  return out;
}

// ---- Tiers ----

int64_t SessionStateStore::ResidentBytesLocked() const {
  int64_t bytes = one_shot_bytes_;
  for (const auto& [key, e] : entries_) {
    if (e->tier == Tier::kResident) bytes += e->own_bytes;  // rows: once, from the pool
  }
  return bytes + (pool_ != nullptr ? pool_->live_bytes() : 0);
}

int64_t SessionStateStore::DeviceBytesLocked() const {
  int64_t bytes = 0;
  for (const auto& [key, e] : entries_) {
    if (e->tier == Tier::kResident) bytes += e->device_bytes;
  }
  return bytes;
}

int64_t SessionStateStore::HostBytesLocked() const {
  int64_t bytes = 0;
  for (const auto& [key, e] : entries_) {
    if (e->tier == Tier::kHost) bytes += static_cast<int64_t>(e->blob.size());
  }
  return bytes;
}

absl::Status SessionStateStore::ParkOne(Entry& e, Tier target) {
  if (e.in_use || e.busy || !e.broken.ok()) {
    return absl::AbortedError(absl::StrCat("session '", e.key.id, "' cannot be moved now"));
  }
  if (e.tier == Tier::kResident && target != Tier::kResident && e.state->on_device()) {
    // Its host layers are stale: copied back first, between steps. On success the lock is held
    // from the moment the entry stops being busy, so nobody leased it meanwhile.
    SDM_RETURN_IF_ERROR(SyncToHostLocked(e));
  }
  // A park to disk leaves the disk copy the only one: files written without an fsync
  // (PersistSync::kWrite) are fsynced first, and a session whose background fsync failed is
  // written again in full (with an fsync: after a failed fsync, a second one proves nothing).
  if (target == Tier::kDisk && e.sync_failed_seq == 0 && unsynced_.contains(e.key) && !e.busy &&
      !(e.tier == Tier::kResident && e.state->on_device())) {
    SDM_RETURN_IF_ERROR(SyncNowLocked(e));
  }
  // In a background round under way (SyncRound: out of unsynced_, not yet fsynced) counts as
  // unsynced too: the round's fsync may still fail, and the memory copy is what would be
  // written again then.
  const bool unsynced =
      unsynced_.contains(e.key) || syncing_.contains(e.key) || e.sync_failed_seq != 0;
  if (target == Tier::kDisk && e.version == e.persisted_version && e.persisted_bytes > 0 &&
      !unsynced && !(e.tier == Tier::kResident && e.state->on_device())) {
    // Its snapshot file is current (written after its last turn): only the memory copy goes.
    ++counters_.evictions[static_cast<int>(e.tier)];
    if (e.tier == Tier::kResident) ++counters_.evictions[static_cast<int>(Tier::kHost)];
    e.state.reset();  // returns its rows to the pool
    e.blob.clear();
    e.blob.shrink_to_fit();
    e.device_bytes = 0;
    e.disk_bytes = e.persisted_bytes + static_cast<int64_t>(e.log_bytes);
    e.tier = Tier::kDisk;
    Account(e);
    changed_.SignalAll();
    return absl::OkStatus();
  }
  e.busy = true;
  absl::Status status;
  if (e.tier == Tier::kResident && target != Tier::kResident) {
    std::unique_ptr<SessionState> state = std::move(e.state);
    SessionRecord record{SessionRecordId(e.key), e.metadata, ToMs(e.ttl),
                         absl::ToUnixMillis(e.last_used)};
    mu_.Unlock();
    absl::StatusOr<std::string> blob = TryEncodeSessionState(*state, record, fingerprint_);
    if (blob.ok()) state.reset();  // returns its rows to the pool
    mu_.Lock();
    if (blob.ok()) {
      e.blob = *std::move(blob);
      e.tier = Tier::kHost;
      e.device_bytes = 0;
      Account(e);
      ++counters_.evictions[static_cast<int>(Tier::kResident)];
      // Restored from the blob, its rows carry no dirty marks: a delta could miss writes.
      if (e.version != e.persisted_version) e.needs_full = true;
    } else {
      e.state = std::move(state);
      Refresh(e);
      status = blob.status();
    }
  }
  e.busy = false;
  if (status.ok() && e.tier == Tier::kHost && target == Tier::kDisk) {
    if (options_.dir.empty()) {
      status = absl::FailedPreconditionError("the store has no snapshot directory");
    } else if (e.version != e.persisted_version || e.persisted_bytes == 0 || unsynced) {
      // A full snapshot of the blob (the lock is held from here: nobody leased it meanwhile).
      if (absl::Status s = WriteChanges(e, /*sync=*/true); !s.ok()) {
        status = absl::UnavailableError(absl::StrCat("could not write the snapshot of session '",
                                                     e.key.id, "': ", s.message()));
      }
    }
    if (status.ok()) {
      e.blob.clear();
      e.blob.shrink_to_fit();
      e.disk_bytes = e.persisted_bytes + static_cast<int64_t>(e.log_bytes);
      e.tier = Tier::kDisk;
      Account(e);
      ++counters_.evictions[static_cast<int>(Tier::kHost)];
    }
  }
  changed_.SignalAll();
  return status;
}

absl::Status SessionStateStore::Park(const SessionKey& key, Tier tier) {
  const bool hand_off = tier == Tier::kDisk && options_.ownership != nullptr;
  absl::Status parked = ParkByKey(key, tier, hand_off);
  // The park's write settled the turns waiting for it: answered now, not once the worker or a
  // writer is next done with another session's write (before the hand-off's release, too).
  FlushReady();
  if (hand_off && absl::IsNotFound(parked)) {
    // A claim of no session here (the hand-off thread found it owned): given up too, counted as
    // a release so that a Create between its claim and its session claims again.
    {
      absl::MutexLock lock(&mu_);
      if (Find(key) != nullptr) return parked;  // made meanwhile: the next hand-off parks it
      BeginReleaseLocked(key);
    }
    options_.ownership->Release(key);
    absl::MutexLock lock(&mu_);
    EndReleaseLocked(key);
    return parked;
  }
  if (parked.ok() && hand_off) {
    options_.ownership->Release(key);  // on disk: any replica may take it up
    absl::MutexLock lock(&mu_);
    if (auto it = entries_.find(key); it != entries_.end()) {
      it->second->handing_off = false;
      ++it->second->handoffs;
    }
    EndReleaseLocked(key);
    changed_.SignalAll();
  }
  return parked;
}

absl::Status SessionStateStore::ParkByKey(const SessionKey& key, Tier tier, bool hand_off) {
  ObserveShared(key);
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Entry*> found = FindIdle(key);
  if (!found.ok()) return found.status();
  Entry* e = *found;
  if (!e->broken.ok()) return e->BrokenError(key.id);
  if (e->in_use) return absl::AbortedError(absl::StrCat("session '", key.id, "' is in use"));
  if (tier == Tier::kDisk && options_.dir.empty()) {
    return absl::FailedPreconditionError("the store has no snapshot directory");
  }
  absl::Status parked =
      static_cast<int>(e->tier) >= static_cast<int>(tier) ? absl::OkStatus() : ParkOne(*e, tier);
  // Marked before the lock is let go: no Acquire takes the claim being released for its own, and
  // a Create of the id (were it deleted meanwhile) watches the release (ClaimWatch).
  if (parked.ok() && hand_off) {
    e->handing_off = true;
    BeginReleaseLocked(key);
  }
  return parked;
}

void SessionStateStore::PersistAllLocked(std::vector<std::string>& skipped,
                                         std::vector<std::string>& failed) {
  std::vector<SessionKey> keys;
  int64_t to_write = 0;
  int64_t bytes = 0;
  for (const auto& [key, e] : entries_) {
    keys.push_back(key);
    if (e->tier != Tier::kDisk && e->broken.ok()) {
      ++to_write;
      bytes += e->TierBytes();
    }
  }
  // Progress, for an operator waiting on a shutdown (gigabytes of sessions take a while, and a
  // stalled volume takes for ever): what is to be written, every few seconds how far it got, and
  // the end. A store with nothing in memory says nothing.
  const absl::Time start = absl::Now();
  absl::Time said = start;
  if (to_write > 0) {
    SDM_LOG(INFO) << "sdm state store: writing " << to_write << " sessions in memory (" << bytes
                  << " bytes) to " << options_.dir.string();
  }
  int64_t written = 0;
  for (const SessionKey& key : keys) {
    Entry* const idle = WaitIdle(key);
    if (idle == nullptr) continue;
    Entry& e = *idle;
    if (e.tier == Tier::kDisk || !e.broken.ok()) continue;
    if (e.in_use) {
      skipped.push_back(DebugString(key));
      continue;
    }
    if (absl::Status s = ParkOne(e, Tier::kDisk); !s.ok()) {
      failed.push_back(absl::StrCat(DebugString(key), " (", s.message(), ")"));
    } else {
      ++written;
    }
    if (const absl::Time now = absl::Now(); now - said >= kPersistAllProgressEvery) {
      SDM_LOG(INFO) << "sdm state store: " << written << " of " << to_write << " sessions written ("
                    << failed.size() << " failed) in "
                    << absl::FormatDuration(absl::Trunc(now - start, absl::Seconds(1)));
      said = now;
    }
  }
  if (to_write > 0) {
    SDM_LOG(INFO) << "sdm state store: wrote " << written << " sessions in "
                  << absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1)))
                  << (failed.empty() ? "" : absl::StrCat("; ", failed.size(), " failed"))
                  << (skipped.empty() ? "" : absl::StrCat("; ", skipped.size(), " in use"));
  }
}

absl::Status SessionStateStore::PersistAll() {
  if (options_.dir.empty()) {
    return absl::FailedPreconditionError("the store has no snapshot directory");
  }
  std::vector<std::string> skipped, failed;
  {
    absl::MutexLock lock(&mu_);
    PersistAllLocked(skipped, failed);
  }
  FlushReady();  // as Park does
  // Sessions not parked (in use) may hold files written without an fsync (PersistSync::kWrite).
  SyncRound(&failed);
  if (!failed.empty()) {
    return absl::UnavailableError(
        absl::StrCat("could not persist sessions: ", absl::StrJoin(failed, ", ")));
  }
  if (!skipped.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sessions in use were not persisted: ", absl::StrJoin(skipped, ", ")));
  }
  return absl::OkStatus();
}

void SessionStateStore::Rebalance() {
  if (options_.device_budget_bytes > 0 && DeviceBytesLocked() > options_.device_budget_bytes) {
    if (DeferDeviceWork()) {
      // Copies back run between steps: the step thread is asked, nobody waits for it here.
      WakeStepThreadLocked();
    } else {
      EnforceDeviceBudget();
    }
  }
  // Sessions whose device copy would not come back in this pass (retried in the next one).
  std::set<SessionKey> unsynced;
  auto lru = [&](Tier tier) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Entry* best = nullptr;
    for (auto& [key, e] : entries_) {
      if (e->tier != tier || e->in_use || e->busy || !e->broken.ok()) continue;
      if (unsynced.count(key) > 0) continue;
      if (best == nullptr || e->tick < best->tick) best = e.get();
    }
    return best;
  };
  while (!stop_ && ResidentBytesLocked() > options_.resident_budget_bytes) {
    // Nowhere to go: host memory is full and the disk refuses writes. Parking would only move
    // the excess to host (past its budget); new work is refused meanwhile (Durability).
    if (!persist_error_.ok() && HostBytesLocked() >= options_.host_budget_bytes) break;
    Entry* e = lru(Tier::kResident);
    if (e == nullptr) break;
    // Resident -> host fails only in the device sync, which concerns this session alone.
    if (absl::Status s = ParkOne(*e, Tier::kHost); !s.ok()) {
      SDM_LOG(WARNING) << "sdm state store: eviction skipped a session: " << s;
      unsynced.insert(e->key);
    }
  }
  if (options_.dir.empty()) return;
  while (!stop_ && HostBytesLocked() > options_.host_budget_bytes) {
    Entry* e = lru(Tier::kHost);
    // A failed write most likely fails for every session (disk full): stop until the next pass.
    if (e == nullptr || !ParkOne(*e, Tier::kDisk).ok()) break;
  }
}

int SessionStateStore::ExpireIdle(absl::Time now) {
  std::vector<std::unique_ptr<Entry>> dead;
  int expired = 0;
  {
    absl::MutexLock lock(&mu_);
    const auto due = [&](const Entry& e) {
      return !e.in_use && !e.busy && e.ttl != absl::InfiniteDuration() && now - e.last_used > e.ttl;
    };
    for (auto it = entries_.begin(); it != entries_.end();) {
      auto next = std::next(it);
      if (due(*it->second)) {
        if (!options_.dir.empty()) {
          options_.files->Remove(PathOf(it->first)).IgnoreError();
          options_.files->Remove(LogPathOf(it->first)).IgnoreError();
        }
        if (const std::filesystem::path& q = it->second->quarantined_as; !q.empty()) {
          // As Delete does: kept for the operator, no longer a session at the next Open.
          std::filesystem::path deleted = q;
          deleted += std::string(kDeletedSuffix);
          if (absl::Status s = options_.files->Rename(q, deleted); !s.ok()) {
            SDM_LOG(WARNING) << "sdm state store: expired session '" << it->first.id
                             << "' stays quarantined: " << s;
          }
        }
        dead.push_back(Erase(it));
        ++expired;
      }
      it = next;
    }
    for (auto it = orphans_.begin(); it != orphans_.end();) {
      if (due(*it->second)) {
        options_.files->Remove(options_.dir / absl::StrCat(it->first, kSnapshotSuffix))
            .IgnoreError();
        options_.files->Remove(options_.dir / absl::StrCat(it->first, kLogSuffix)).IgnoreError();
        dead.push_back(std::move(it->second));
        it = orphans_.erase(it);
        ++expired;
      } else {
        ++it;
      }
    }
    counters_.expired += expired;
  }
  Bury(std::move(dead));
  FlushReady();  // as Delete does
  return expired;
}

// ---- Durability ----

int SessionStateStore::PersistChanged(absl::Time now) {
  absl::MutexLock lock(&mu_);
  return PersistChangedLocked(now);
}

int SessionStateStore::PersistChangedLocked(absl::Time now) {
  if (!persist_error_.ok() && std::none_of(entries_.begin(), entries_.end(), [](const auto& kv) {
        return kv.second->persist_failing;
      })) {
    // The sessions whose writes failed are gone (deleted, expired): nothing is at risk.
    int64_t unlogged = 0;
    persist_failures_.Succeeded(&unlogged);
    SDM_LOG(INFO) << "sdm state store: no session is waiting for a failed write any more"
                  << UnloggedFailures(unlogged);
    persist_error_ = absl::OkStatus();
  }
  if (options_.dir.empty() || options_.persist == PersistPolicy::kShutdown) return 0;
  std::vector<const Entry*> due;
  for (const auto& [key, e] : entries_) {
    if (e->version == e->persisted_version || e->in_use || e->busy || !e->broken.ok()) continue;
    // Its host layers are stale on a device that cannot copy back changes: written when it
    // leaves it (nobody waits).
    if (StaleOnDevice(*e)) {
      SettleWaiters(*e, /*all=*/true, absl::OkStatus());  // as WhenPersisted answers for it
      continue;
    }
    if (DueLocked(*e, now)) due.push_back(e.get());
  }
  // Turns someone waits for first, the longest waiting first (the same order as WriterLoop).
  std::sort(due.begin(), due.end(),
            [](const Entry* a, const Entry* b) { return a->first_waiter < b->first_waiter; });
  std::vector<SessionKey> keys;
  for (const Entry* e : due) keys.push_back(e->key);
  int written = 0;
  for (const SessionKey& key : keys) {
    if (stop_) break;
    auto it = entries_.find(key);
    if (it == entries_.end()) continue;
    Entry& e = *it->second;
    // Checked again: the lock was released by earlier writes (and writers may have taken it).
    if (!DueLocked(e, now)) continue;
    // WriteChanges keeps leases and moves off the entry (busy) while it is encoded and written
    // unlocked; an Acquire of it waits for the write (which waits for a step only to copy back
    // the changes of a session on the device, between steps).
    if (WriteChanges(e, SyncOnWrite()).ok()) ++written;
    // Each turn is acknowledged as soon as its own write is done, not after the whole batch.
    FlushReadyLocked();
  }
  return written;
}

bool SessionStateStore::DueLocked(const Entry& e, absl::Time now) const {
  if (e.version == e.persisted_version || e.in_use || e.busy || !e.broken.ok()) return false;
  if (e.tier == Tier::kDisk) return false;  // its file is all there is
  if (StaleOnDevice(e)) return false;
  if (options_.persist == PersistPolicy::kIdle && now - e.last_used < options_.persist_idle) {
    return false;
  }
  return true;
}

SessionStateStore::Entry* SessionStateStore::NextDueLocked(absl::Time now) {
  if (options_.dir.empty() || options_.persist == PersistPolicy::kShutdown) return nullptr;
  Entry* best = nullptr;
  for (auto& [key, e] : entries_) {
    // A failing session is retried by the worker (every second), not by the writers.
    if (e->persist_failing || !DueLocked(*e, now)) continue;
    if (best == nullptr || e->first_waiter < best->first_waiter) best = e.get();
  }
  return best;
}

void SessionStateStore::WriterLoop() {
  SetCurrentThreadName("sdm-writer");
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    Entry* e = NextDueLocked(absl::Now());
    if (e == nullptr) {
      changed_.WaitWithTimeout(&mu_, absl::Seconds(1));
      continue;
    }
    // A failure is counted and logged by WriteChanges; the worker retries it (every second).
    WriteChanges(*e, SyncOnWrite()).IgnoreError();
    FlushReadyLocked();
  }
}

void SessionStateStore::FlushReadyLocked() {
  if (ready_.empty() || !options_.background) return;
  mu_.Unlock();
  FlushReady();
  mu_.Lock();
}

bool SessionStateStore::SyncOnWrite() const {
  return options_.persist_sync == PersistSync::kFsync || options_.shared_dir;
}

absl::Status SessionStateStore::WriteChanges(Entry& e, bool sync) {
  const bool resident = e.tier == Tier::kResident;
  if (resident && e.state->on_device()) {
    // Its host layers are made current first: what its turns changed is copied back between
    // steps, and it stays on the device (mu_ released meanwhile; busy keeps leases off it).
    if (absl::Status s = CopyChangesLocked(e); !s.ok()) {
      e.attempted_version = e.version;
      e.write_failed = true;
      PersistFailed(e, s);
      SettleWaiters(e, /*all=*/false, NotWrittenError(e.key.id, CauseOf(s)));
      return s;
    }
  }
  SDM_CHECK(!e.busy && (resident ? e.state->host_current() : e.tier == Tier::kHost));
  const uint64_t version = e.version;
  const SessionKey key = e.key;
  SessionRecord record{SessionRecordId(e.key), e.metadata, ToMs(e.ttl),
                       absl::ToUnixMillis(e.last_used)};
  SessionState* state = resident ? e.state.get() : nullptr;
  const int64_t position = resident ? state->position() : e.position;
  // No deltas on a shared directory: other replicas notice a session's change by its snapshot
  // file (SnapshotStamp), which a delta leaves as it was.
  const bool try_delta = resident && e.persisted_bytes > 0 && !e.needs_full &&
                         !options_.shared_dir && position >= e.persisted_position &&
                         e.log_records < kMaxLogRecords;
  const int64_t from = e.persisted_position;
  const uint64_t log_bytes = e.log_bytes;
  const uint64_t base_id = e.base_id;
  const double compact_ratio = options_.log_compact_ratio;
  const uint64_t persisted_bytes = e.persisted_bytes;
  // Fenced: the new file's name and the claim it is written under, before it is written (a
  // commit passes only while that claim lasts, so a file of a lost claim is garbage; the sweep
  // leaves a file being written alone).
  std::string new_file;
  int64_t claim = 0;
  std::vector<std::string> uncertain;
  if (fenced()) {
    new_file = NewSnapshotName(key);
    claim = options_.ownership->ClaimEpoch(key);
    e.writing_file = new_file;
    uncertain = e.uncommitted;
  }
  e.busy = true;
  e.write_since = std::chrono::steady_clock::now();
  mu_.Unlock();
  absl::Status status;
  uint64_t written_bytes = 0;
  bool delta = false;
  uint64_t new_base = 0;
  // Ownership (class comment): a replica that lost the session never writes over its owner's.
  // Fenced snapshots: the commit is the check (below); otherwise check, then write.
  const std::string base_file = e.snapshot_file;
  bool unknown_commit = false;
  // The full snapshot of a resident session, produced from its rows: sized (without reading a
  // row) to bound the log, and written when this write is not a delta.
  std::optional<SessionStateSource> encoded;
  if (resident) encoded.emplace(*state, record, fingerprint_);
  absl::Status owned = fenced() ? absl::OkStatus() : CheckOwnership(key);
  if (!owned.ok()) {
    status = owned;
  } else if (try_delta) {
    // Sized before it is encoded: a delta that would take the log past its limit is not built.
    // The log is bounded by the ratio times the larger of the last snapshot and the snapshot
    // the session would write now (its size is known without reading a row): a session created
    // empty, whose first snapshot is a few hundred bytes, logs its first turns too.
    const uint64_t compact_at = static_cast<uint64_t>(
        static_cast<double>(std::max(persisted_bytes, encoded->size())) * compact_ratio);
    if (log_bytes + SessionDeltaBytes(*state, record, from) <= compact_at) {
      delta = true;
      // A delta to append (after the log's header when the log starts), produced straight from
      // the rows into the files' chunk buffer (state_store/byte_source.h): no buffer of its size.
      const SessionDeltaSource source(*state, record, from,
                                      log_bytes == 0 ? EncodeLogHeader(fingerprint_, base_id) : "");
      status = options_.files->WriteAt(LogPathOf(key), log_bytes, source, sync);
      written_bytes = source.size();
    }
  }
  if (owned.ok() && !delta) {
    // A full snapshot: likewise produced from the rows (not on device), or the host tier's blob
    // (e.blob: not moved while busy).
    std::optional<StringSource> held;
    const ByteSource& blob =
        resident ? static_cast<const ByteSource&>(*encoded) : held.emplace(e.blob);
    if (fenced()) {
      // A new file no reader knows yet, then the commit that makes it the session's state.
      const std::filesystem::path new_path = options_.dir / kGenerationsDir / new_file;
      if (status.ok()) status = options_.files->WriteAtomically(new_path, blob, sync);
      if (status.ok()) {
        const absl::Status committed =
            options_.ownership->CommitSnapshot(key, claim, base_file, new_file);
        if (absl::IsFailedPrecondition(committed)) {
          owned = committed;
          options_.files->Remove(new_path).IgnoreError();
        } else if (committed.ok()) {
          if (!base_file.empty()) {
            options_.files->Remove(options_.dir / kGenerationsDir / base_file).IgnoreError();
          }
          // Earlier writes whose commit was unknown compared `base_file`, which is no longer
          // the committed name: they can never be committed.
          for (const std::string& f : uncertain) {
            options_.files->Remove(options_.dir / kGenerationsDir / f).IgnoreError();
          }
        } else {
          status = committed;  // unknown: the file stays (it may be the committed one)
          unknown_commit = true;
        }
      }
    } else if (status.ok()) {
      status = options_.files->WriteAtomically(PathOf(key), blob, sync);
    }
    if (status.ok() && owned.ok()) {
      const std::string first = SourcePrefix(blob, kRecordPrefixBytes);
      absl::StatusOr<uint64_t> prefix = RecordPrefixSize(first, blob.size(), fingerprint_);
      SDM_CHECK(prefix.ok()) << prefix.status();  // it was just encoded
      new_base = SnapshotId(SourcePrefix(blob, *prefix));
      // The snapshot holds everything the log held; a log left by a failed removal is stale
      // (another base) and ignored.
      options_.files->Remove(LogPathOf(key)).IgnoreError();
      written_bytes = blob.size();
    }
  }
  mu_.Lock();
  e.busy = false;
  e.write_since.reset();
  changed_.SignalAll();
  e.attempted_version = version;
  e.writing_file.clear();
  if (unknown_commit) e.uncommitted.push_back(new_file);
  if (owned.ok() && status.ok() && fenced()) {
    std::erase_if(e.uncommitted, [&](const std::string& f) {
      return std::find(uncertain.begin(), uncertain.end(), f) != uncertain.end();
    });
  }
  if (!owned.ok()) {
    // Not this store's to write any more: its copy is given up, not retried, and its waiters
    // are told that their turns are not saved (their client may send them again).
    e.persisted_version = version;
    e.fenced_version = version;
    e.fenced = absl::AbortedError(
        absl::StrCat("the turn was not saved: another replica took session '", key.id,
                     "' over while it ran (this one lost its claim: ", owned.message(),
                     "); the session continues from its state without this turn: send it again"));
    WriteFenced(key, owned);
    SettleWaiters(e, /*all=*/false, e.fenced);
    return owned;
  }
  if (!status.ok()) {
    // A snapshot that failed may still have replaced the one the log extends (a failure after
    // the rename: the directory's fsync): the log's base is unknown, so a delta appended to it
    // could be dropped as stale at the next read, with every turn since. Only a snapshot knows.
    if (!delta) e.needs_full = true;
    e.write_failed = true;
    PersistFailed(e, status);
    SettleWaiters(e, /*all=*/false, NotWrittenError(key.id, CauseOf(status)));
    return status;
  }
  ++e.write_seq;
  e.write_failed = false;
  if (!sync) {
    // The syncer fsyncs it (and the directory, whose entries a new log, a rename or the removal
    // of a log changed) in its next round.
    UnsyncedFiles& files = unsynced_[key];
    (delta ? files.log : files.snapshot) = true;
    if (!delta || log_bytes == 0) unsynced_dir_ = true;
    changed_.SignalAll();
  }
  if (delta && e.needs_full) {
    // A background fsync of its log failed while this delta was written: the log is suspect, the
    // session is written again in full (still due). Handed to the kernel all the same.
    if (resident) state->ClearDirty();
    SettleWaiters(e, /*all=*/false, absl::OkStatus());
    return absl::OkStatus();
  }
  e.persisted_version = version;
  e.persisted_position = position;
  if (delta) {
    e.log_bytes = log_bytes + written_bytes;
    ++e.log_records;
  } else {
    e.base_id = new_base;
    e.persisted_bytes = static_cast<int64_t>(written_bytes);
    if (fenced()) {
      e.snapshot_file = new_file;
    } else if (options_.shared_dir) {
      // The stamp of the file this store wrote. Another store may have renamed its own over it
      // since (both serve the session: the last write wins); taken for this one's, the later
      // write would never be read here. Then none: the next use reads the file again.
      std::optional<SnapshotStamp> stamp;
      uint64_t found_id = 0;
      const absl::StatusOr<SessionRecord> found = ReadSharedRecord(PathOf(key), &stamp, &found_id);
      e.disk_stamp = found.ok() && found_id == new_base ? stamp : std::nullopt;
    }
    e.log_bytes = 0;
    e.log_records = 0;
    e.needs_full = false;
    e.last_full_seq = e.write_seq;
    if (sync) {
      e.durable_full_seq = e.write_seq;
      unsynced_.erase(key);  // what earlier writes left unsynced is superseded
    }
  }
  if (resident) state->ClearDirty();
  ++counters_.persist_writes;
  counters_.persist_bytes += static_cast<int64_t>(written_bytes);
  if (delta) ++counters_.persist_deltas;
  // After a failed background fsync, only a full snapshot that reached the disk (fsynced here, or
  // by the syncer: SyncWritten) ends the failure.
  if (e.sync_failed_seq != 0 && !delta && sync) e.sync_failed_seq = 0;
  if (e.sync_failed_seq == 0) PersistSucceeded(e);
  SettleWaiters(e, /*all=*/false, absl::OkStatus());
  return absl::OkStatus();
}

void SessionStateStore::SettleWaiters(Entry& e, bool all, const absl::Status& outcome) {
  if (e.waiters.empty()) return;
  auto settled = [&](const PersistWaiter& w) { return all || w.version <= e.attempted_version; };
  const auto now = std::chrono::steady_clock::now();
  for (PersistWaiter& w : e.waiters) {
    if (!settled(w)) continue;
    ready_.push_back([done = std::move(w.done), outcome] { done(outcome); });
    ++counters_.persist_waits;
    counters_.persist_wait_us +=
        std::chrono::duration_cast<std::chrono::microseconds>(now - w.since).count();
  }
  std::erase_if(e.waiters, settled);
  e.first_waiter = e.waiters.empty() ? kNoWaiter : e.waiters.front().seq;
  worker_pending_ = true;  // the worker flushes ready_
  changed_.SignalAll();
}

void SessionStateStore::FlushReady() {
  std::vector<std::function<void()>> ready;
  {
    absl::MutexLock lock(&mu_);
    ready.swap(ready_);
  }
  for (auto& done : ready) done();
}

void SessionStateStore::WhenPersisted(const SessionKey& key,
                                      std::function<void(const absl::Status&)> done) {
  absl::Status outcome;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (QueuePersistWaiterLocked(key, it == entries_.end() ? nullptr : it->second.get(), done,
                                 &outcome)) {
      return;
    }
  }
  done(outcome);
}

bool SessionStateStore::QueuePersistWaiterLocked(const SessionKey& key, Entry* e,
                                                 std::function<void(const absl::Status&)>& done,
                                                 absl::Status* outcome) {
  // Its state as of now was refused already (written before this call).
  if (e != nullptr && e->fenced_version != 0 && e->fenced_version == e->version) {
    *outcome = e->fenced;
  } else if (e != nullptr && !e->broken.ok() && e->version != e->persisted_version) {
    // Broken (a later turn failed part-way) before its state was written: it never will be.
    *outcome = e->NotSavedError(key.id);
  }
  const bool unwritten = e != nullptr && !stop_ && options_.background && !options_.dir.empty() &&
                         options_.persist == PersistPolicy::kTurn && e->broken.ok() &&
                         e->version != e->persisted_version &&
                         // (a resident entry being parked to host has no state meanwhile: busy)
                         !StaleOnDevice(*e);
  if (unwritten && e->persist_failing) {
    // Its writes fail: not waited for, and not saved. Other sessions' turns are waited for
    // while health is bad: their writes may succeed.
    *outcome = NotWrittenError(key.id, e->persist_cause);
  } else if (unwritten) {
    const uint64_t seq = ++waiter_clock_;
    if (e->waiters.empty()) e->first_waiter = seq;
    e->waiters.push_back({e->version, seq, std::move(done), std::chrono::steady_clock::now()});
    worker_pending_ = true;
    changed_.SignalAll();
    return true;
  }
  return false;
}

void SessionStateStore::PersistFailed(Entry& e, const absl::Status& why) {
  ++counters_.snapshot_errors;
  e.persist_cause = CauseOf(why);
  if (!e.persist_failing) {
    e.persist_failing = true;
    ++counters_.persist_failures;
  }
  // One log line per distinct cause (code and system error), not per session or retry.
  const std::string cause = CauseOf(why);
  if (persist_failures_.Failed(cause)) {
    SDM_LOG(ERROR) << "sdm state store: cannot persist session '" << e.key.id << "' ("
                   << PathOf(e.key).string() << "): " << why
                   << "; sessions are not durable until writes succeed again (further failures "
                   << "of this cause are not logged until then)";
  }
  persist_error_ = absl::UnavailableError(
      absl::StrCat("session state cannot be written to ", options_.dir.string(), ": ", cause));
}

void SessionStateStore::PersistSucceeded(Entry& e) {
  e.persist_failing = false;
  // Healthy again once no session waits for a failed write (one success among failures, e.g.
  // a small snapshot on a nearly full disk, is not recovery).
  if (!persist_error_.ok() && std::none_of(entries_.begin(), entries_.end(), [](const auto& kv) {
        return kv.second->persist_failing;
      })) {
    int64_t unlogged = 0;
    persist_failures_.Succeeded(&unlogged);
    SDM_LOG(INFO) << "sdm state store: session state is written again"
                  << UnloggedFailures(unlogged);
    persist_error_ = absl::OkStatus();
  }
}

absl::Status SessionStateStore::PersistHealth() const {
  absl::MutexLock lock(&mu_);
  return persist_error_;
}

absl::Duration SessionStateStore::OldestPendingPersist() const {
  const auto now = std::chrono::steady_clock::now();
  std::chrono::steady_clock::duration oldest{0};
  absl::MutexLock lock(&mu_);
  for (const auto& [key, e] : entries_) {
    if (e->write_since.has_value()) oldest = std::max(oldest, now - *e->write_since);
    // Waiters are queued in order: the first waited longest.
    if (!e->waiters.empty()) oldest = std::max(oldest, now - e->waiters.front().since);
  }
  return absl::FromChrono(oldest);
}

absl::Status SessionStateStore::RefuseWhenUnpersistable() const {
  if (persist_error_.ok() || HostBytesLocked() < options_.host_budget_bytes) {
    return absl::OkStatus();
  }
  return absl::UnavailableError(
      absl::StrCat(persist_error_.message(),
                   "; host memory for sessions is full, so no new work is accepted; retry later"));
}

// ---- The device tier ----

// A device -> host copy a thread asked the step thread for; lives on the asker's stack until
// `done`.
struct SessionStateStore::SyncJob {
  Entry* entry;
  bool changes_only = false;  // CopyChangesLocked's: stays on the device
  bool done = false;
  absl::Status status;
};

bool SessionStateStore::StaleOnDevice(const Entry& e) const {
  return e.tier == Tier::kResident && e.state != nullptr && e.state->on_device() &&
         (!options_.persist_device_turns || !e.state->device()->CopiesChanges());
}

bool SessionStateStore::DeferDeviceWork() const {
  return wake_step_thread_ != nullptr && std::this_thread::get_id() != step_thread_;
}

absl::Status SessionStateStore::CopyBackHere(Entry& e, bool changes_only) {
  SessionState* state = e.state.get();
  mu_.Unlock();
  absl::Status status = changes_only ? state->CopyChangesToHost() : state->SyncToHost();
  mu_.Lock();
  return status;
}

absl::Status SessionStateStore::RunDeviceJobLocked(SyncJob& job) {
  if (!DeferDeviceWork()) return CopyBackHere(*job.entry, job.changes_only);
  sync_jobs_.push_back(&job);
  WakeStepThreadLocked();
  while (!job.done && DeferDeviceWork()) changed_.Wait(&mu_);
  if (job.done) return job.status;
  // The step thread went away before it got to this job (ClearStepThread ran the queue it saw;
  // this one came later): it is ours to run.
  sync_jobs_.erase(std::find(sync_jobs_.begin(), sync_jobs_.end(), &job));
  return CopyBackHere(*job.entry, job.changes_only);
}

absl::Status SessionStateStore::CopyFromDeviceLocked(Entry& e, bool changes_only) {
  SDM_CHECK(e.tier == Tier::kResident && !e.busy && !e.in_use);
  e.busy = true;  // keeps every other store operation (and lease) off it meanwhile
  SyncJob job{.entry = &e, .changes_only = changes_only, .done = false, .status = absl::OkStatus()};
  const absl::Status status = RunDeviceJobLocked(job);
  e.busy = false;
  Refresh(e);  // also after a failure: the host layers may have been partly written
  changed_.SignalAll();
  if (!status.ok()) {
    ++counters_.sync_errors;
    return SyncError(e.key.id, status);
  }
  return absl::OkStatus();
}

absl::Status SessionStateStore::CopyChangesLocked(Entry& e) {
  if (e.state->host_current()) return absl::OkStatus();
  return CopyFromDeviceLocked(e, /*changes_only=*/true);
}

absl::Status SessionStateStore::SyncToHostLocked(Entry& e) {
  if (!e.state->on_device()) return absl::OkStatus();
  // A residency that copies changes brings the host current with them first (only the rows the
  // device wrote, through the host table's dirty marks), rather than copying everything back:
  // rows a fork shares stay shared, and the next write is a delta. Then it is only detached.
  // (The lock is held from there to the detach: nobody leases the session in between.)
  if (e.state->device()->CopiesChanges()) SDM_RETURN_IF_ERROR(CopyChangesLocked(e));
  // A session whose turns were copied back since its last step is only detached, and its dirty
  // marks still say what its next delta must carry.
  const bool whole_copy = !e.state->host_current();
  SDM_RETURN_IF_ERROR(CopyFromDeviceLocked(e, /*changes_only=*/false));
  ++counters_.device_evictions;
  // A whole copy-back rewrote host rows outside the dirty marks' view: the next write is whole.
  if (whole_copy) e.needs_full = true;
  return absl::OkStatus();
}

void SessionStateStore::Bury(std::vector<std::unique_ptr<Entry>> dead) {
  {
    absl::MutexLock lock(&mu_);
    if (DeferDeviceWork()) {
      bool queued = false;
      for (std::unique_ptr<Entry>& e : dead) {
        if (e != nullptr && e->state != nullptr && e->state->on_device()) {
          doomed_.push_back(std::move(e->state));
          queued = true;
        }
      }
      if (queued) WakeStepThreadLocked();
    }
  }
  // The rest is destroyed here, outside the lock (host memory only, or no step thread).
  dead.clear();
}

void SessionStateStore::WakeStepThreadLocked() {
  std::function<void()> wake = wake_step_thread_;
  ++wakes_under_way_;
  mu_.Unlock();
  wake();
  mu_.Lock();
  if (--wakes_under_way_ == 0) changed_.SignalAll();
}

void SessionStateStore::SetStepThread(std::function<void()> wake) {
  SDM_CHECK(wake != nullptr);
  absl::MutexLock lock(&mu_);
  SDM_CHECK(wake_step_thread_ == nullptr);  // one step thread at a time
  wake_step_thread_ = std::move(wake);
  step_thread_ = std::this_thread::get_id();
}

void SessionStateStore::ClearStepThread() {
  RunDeviceMoves();
  absl::MutexLock lock(&mu_);
  SDM_CHECK(std::this_thread::get_id() == step_thread_);
  wake_step_thread_ = nullptr;
  step_thread_ = std::thread::id();
  changed_.SignalAll();  // waiters whose job was queued after the run above do it themselves
  // A wake copied before the line above may still be running: its owner (the scheduler) must
  // outlive it.
  while (wakes_under_way_ > 0) changed_.Wait(&mu_);
}

void SessionStateStore::RunDeviceMoves() {
  std::vector<std::unique_ptr<SessionState>> doomed;
  {
    absl::MutexLock lock(&mu_);
    SDM_CHECK(wake_step_thread_ == nullptr || std::this_thread::get_id() == step_thread_);
    doomed.swap(doomed_);
    // Copies other threads wait for. Each entry is kept busy by its asker.
    std::vector<SyncJob*> jobs;
    jobs.swap(sync_jobs_);
    for (SyncJob* job : jobs) {
      job->status = CopyBackHere(*job->entry, job->changes_only);
      job->done = true;
    }
    if (!jobs.empty()) changed_.SignalAll();
    if (options_.device_budget_bytes > 0) {
      // Between steps nobody touches a leased session: its device bytes can be read now.
      for (auto& [key, e] : entries_) {
        if (e->tier == Tier::kResident && e->in_use && !e->busy) {
          e->device_bytes = e->state->DeviceBytes();
        }
      }
      EnforceDeviceBudget();
    }
  }
  // Freed here, on the step thread, outside the lock.
  doomed.clear();
}

void SessionStateStore::EnforceDeviceBudget() {
  std::set<SessionKey> failed;  // not copied back in this pass (retried in the next one)
  while (options_.device_budget_bytes > 0 && DeviceBytesLocked() > options_.device_budget_bytes) {
    Entry* lru = nullptr;
    for (auto& [key, e] : entries_) {
      if (e->tier != Tier::kResident || e->in_use || e->busy || e->device_bytes == 0) continue;
      if (failed.count(key) > 0) continue;
      if (lru == nullptr || e->tick < lru->tick) lru = e.get();
    }
    if (lru == nullptr) break;  // the rest is in use: released sessions are seen later
    if (absl::Status s = SyncToHostLocked(*lru); !s.ok()) {
      SDM_LOG(WARNING) << "sdm state store: the device tier skipped a session: " << s;
      failed.insert(lru->key);
    }
  }
}

int SessionStateStore::SyncWritten() { return SyncRound(nullptr); }

absl::Status SessionStateStore::SyncNowLocked(Entry& e) {
  auto it = unsynced_.find(e.key);
  if (it == unsynced_.end()) return absl::OkStatus();
  const UnsyncedFiles files = it->second;
  unsynced_.erase(it);
  const SessionKey key = e.key;
  const uint64_t write_seq = e.write_seq;
  e.busy = true;
  mu_.Unlock();
  absl::Status status;
  auto sync = [&](const std::filesystem::path& path) {
    if (!status.ok()) return;
    absl::Status s = options_.files->Sync(path);
    if (!s.ok() && !absl::IsNotFound(s)) status = s;
  };
  if (files.log) sync(LogPathOf(key));
  if (files.snapshot) sync(PathOf(key));
  // The directory too: the file may be new (its entry is then in no earlier round's fsync).
  if (status.ok()) status = options_.files->SyncDir(options_.dir);
  mu_.Lock();
  e.busy = false;
  changed_.SignalAll();
  if (!status.ok() && e.durable_full_seq <= write_seq) {
    PersistFailed(e, status);
    e.sync_failed_seq = e.write_seq;
    e.needs_full = true;
    e.persisted_version = 0;
    Changed();
  }
  return status;
}

int SessionStateStore::SyncRound(std::vector<std::string>* failed) {
  absl::MutexLock round(&sync_mu_);
  struct Job {
    SessionKey key;
    UnsyncedFiles files;
    uint64_t write_seq = 0;  // the writes it covers: those up to this one
    uint64_t full_seq = 0;   // its last full snapshot among them
    absl::Status status;
  };
  std::vector<Job> jobs;
  bool dir = false;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, files] : unsynced_) {
      Job job;
      job.key = key;
      job.files = files;
      if (auto it = entries_.find(key); it != entries_.end()) {
        job.write_seq = it->second->write_seq;
        job.full_seq = it->second->last_full_seq;
      }
      jobs.push_back(std::move(job));
      syncing_.insert(key);
    }
    unsynced_.clear();
    dir = unsynced_dir_;
    unsynced_dir_ = false;
  }
  if (jobs.empty() && !dir) return 0;
  // One fsync per file (a log or snapshot removed or replaced since is not an error: the
  // replacement is in this round or a later one), then one of the directory.
  int synced = 0;
  auto sync = [&](const std::filesystem::path& path, absl::Status& status) {
    if (!status.ok()) return;
    absl::Status s = options_.files->Sync(path);
    if (s.ok()) ++synced;
    if (!s.ok() && !absl::IsNotFound(s)) status = s;
  };
  for (Job& job : jobs) {
    if (job.files.log) sync(LogPathOf(job.key), job.status);
    if (job.files.snapshot) sync(PathOf(job.key), job.status);
  }
  if (dir) {
    if (absl::Status s = options_.files->SyncDir(options_.dir); !s.ok()) {
      for (Job& job : jobs) {
        if (job.status.ok()) job.status = s;  // each may have created or renamed a file
      }
    }
  }
  absl::MutexLock lock(&mu_);
  counters_.persist_syncs += synced;
  syncing_.clear();
  for (Job& job : jobs) {
    auto it = entries_.find(job.key);
    if (it == entries_.end()) continue;  // deleted or expired: nothing to keep
    Entry& e = *it->second;
    if (!job.status.ok()) {
      // A full snapshot fsynced since (a park to disk) holds everything: nothing is lost.
      if (e.durable_full_seq > job.write_seq) continue;
      // What these writes handed the kernel may never reach the disk (after a failed fsync the
      // kernel may drop the pages and report the next fsync as fine): the session is written
      // again in full, and stays failing until that snapshot has been fsynced.
      PersistFailed(e, job.status);
      if (failed != nullptr) {
        failed->push_back(absl::StrCat(DebugString(job.key), " (", job.status.message(), ")"));
      }
      e.sync_failed_seq = e.write_seq;
      e.needs_full = true;
      e.persisted_version = 0;  // due again (versions start at 1)
      Changed();
    } else if (e.sync_failed_seq != 0 && job.full_seq > e.sync_failed_seq) {
      e.sync_failed_seq = 0;
      // Unless a later write failed: the session is still behind its latest turn, and due.
      if (!e.write_failed) PersistSucceeded(e);
    }
  }
  return synced;
}

void SessionStateStore::SyncerLoop() {
  SetCurrentThreadName("sdm-syncer");
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    if (unsynced_.empty() && !unsynced_dir_) {
      changed_.WaitWithTimeout(&mu_, absl::Seconds(1));
      continue;
    }
    // Group commit: one round for everything written since the last; the next at most one
    // interval after this one began, so that a burst of turns shares its fsyncs.
    const absl::Time next = absl::Now() + options_.persist_sync_interval;
    mu_.Unlock();
    SyncWritten();
    mu_.Lock();
    while (!stop_ && absl::Now() < next) changed_.WaitWithDeadline(&mu_, next);
  }
}

void SessionStateStore::WorkerLoop() {
  SetCurrentThreadName("sdm-store");
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    if (!worker_pending_) changed_.WaitWithTimeout(&mu_, absl::Seconds(1));
    worker_pending_ = false;
    if (stop_) break;
    Rebalance();
    PersistChangedLocked(absl::Now());
    const absl::Status health = persist_error_;
    const bool tell = options_.on_persist_health != nullptr && health.ok() != reported_healthy_;
    reported_healthy_ = health.ok();
    if (!health.ok()) {
      // A session whose writes fail: nobody waits for them, and nobody is told that a turn not
      // written is saved. (The others' writes are tried: one session's failure, say a device
      // copy-back, says nothing of theirs.)
      // Not one being written (busy): that write settles its waiters itself, and may succeed
      // (a background fsync that failed while it ran marks it failing; the write is handed to
      // the kernel all the same and answered OK).
      for (auto& [key, e] : entries_) {
        if (e->persist_failing && !e->busy) {
          SettleWaiters(*e, /*all=*/true, NotWrittenError(key.id, e->persist_cause));
        }
      }
    }
    mu_.Unlock();
    if (tell) options_.on_persist_health(health);
    FlushReady();
    ExpireIdle(absl::Now());
    mu_.Lock();
  }
}

StoreStats SessionStateStore::Stats() const {
  absl::MutexLock lock(&mu_);
  StoreStats s = counters_;
  for (int t = 0; t < kNumTiers; ++t) s.sessions[t] = s.bytes[t] = 0;
  for (const auto& [key, e] : entries_) {
    ++s.sessions[static_cast<int>(e->tier)];
    if (e->in_use) ++s.in_use;
    if (e->tier == Tier::kDisk) s.bytes[static_cast<int>(Tier::kDisk)] += e->disk_bytes;
    if (e->tier == Tier::kResident && e->device_bytes > 0) ++s.device_sessions;
    if (e->version != e->persisted_version) ++s.unpersisted;
    if (e->sync_failed_seq != 0 || unsynced_.contains(key) || syncing_.contains(key)) ++s.unsynced;
  }
  for (const auto& [stem, e] : orphans_) {
    ++s.sessions[static_cast<int>(Tier::kDisk)];
    s.bytes[static_cast<int>(Tier::kDisk)] += e->disk_bytes;
  }
  s.device_bytes = DeviceBytesLocked();
  s.bytes[static_cast<int>(Tier::kResident)] = ResidentBytesLocked();
  s.bytes[static_cast<int>(Tier::kHost)] = HostBytesLocked();
  s.one_shot = one_shot_count_;
  if (pool_ != nullptr) {
    s.rows_live = pool_->live_rows();
    s.rows_shared = pool_->shared_rows();
  }
  return s;
}

}  // namespace sdm
