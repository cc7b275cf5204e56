#include "state_store/session_store.h"

#include <algorithm>
#include <set>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/check.h"
#include "base/log.h"
#include "state_store/state_codec.h"

namespace sdm {
namespace {

constexpr absl::string_view kSnapshotSuffix = ".sdmstate";
constexpr absl::string_view kTmpSuffix = ".tmp";

bool ValidId(absl::string_view id) {
  if (id.empty() || id.size() > 128) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return id != "." && id != "..";
}

absl::Status InvalidId(absl::string_view id) {
  return absl::InvalidArgumentError(absl::StrCat(
      "session id '", id, "' is invalid: use 1-128 characters of letters, digits, '.', '_', '-'"));
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

}  // namespace

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

struct SessionStateStore::Entry {
  std::string id;
  std::string metadata;
  Tier tier = Tier::kResident;
  std::unique_ptr<SessionState> state;  // kResident
  std::string blob;                     // kHost
  int64_t disk_bytes = 0;               // kDisk: snapshot file size
  int64_t position = -1;                // last known
  bool pending = false;                 // with position: state->pending_token >= 0
  bool in_use = false;                  // pinned by a lease
  bool busy = false;                    // being moved by the store, outside the lock
  uint64_t tick = 0;                    // LRU order
  absl::Time last_used;
  absl::Duration ttl = absl::InfiniteDuration();
  absl::Status broken;  // its snapshot failed its checks (quarantined)
  // kResident, refreshed whenever the session is not in use: bytes of its KV pages and slot
  // tables (rows are counted from the pool), its mapped rows and bytes with rows counted fully.
  int64_t own_bytes = 0;
  int64_t rows = 0;
  int64_t resident_bytes = 0;

  // Precondition: resident and not being stepped.
  void Refresh() {
    resident_bytes = state->ResidentBytes();
    own_bytes = resident_bytes;
    rows = 0;
    for (int64_t l = 0; l < state->num_layers(); ++l) {
      if (!state->is_sdm(l)) continue;
      const SdmTable& t = state->sdm(l);
      rows += t.private_rows();
      own_bytes -= t.private_rows() * t.row_width() * static_cast<int64_t>(sizeof(float));
    }
    position = state->position();
    pending = state->pending_token >= 0;
  }
};

// ---- SessionLease ----

SessionLease::SessionLease(SessionLease&& o) noexcept
    : store_(o.store_), id_(std::move(o.id_)), state_(o.state_) {
  o.store_ = nullptr;
  o.state_ = nullptr;
}

SessionLease& SessionLease::operator=(SessionLease&& o) noexcept {
  if (this != &o) {
    Reset();
    store_ = o.store_;
    id_ = std::move(o.id_);
    state_ = o.state_;
    o.store_ = nullptr;
    o.state_ = nullptr;
  }
  return *this;
}

SessionLease::~SessionLease() { Reset(); }

void SessionLease::Reset() {
  if (store_ != nullptr) store_->Release(id_);
  store_ = nullptr;
  state_ = nullptr;
}

// ---- SessionStateStore ----

SessionStateStore::SessionStateStore(Key, const StateLayout& layout, uint64_t fingerprint,
                                     const SessionStoreOptions& options)
    : layout_(layout), fingerprint_(fingerprint), options_(options) {
  // The store's own row pool: its resident accounting is then exact.
  std::shared_ptr<RowPool> pool;
  for (LayerStateLayout& l : layout_.layers) {
    if (l.kind != LayerStateLayout::Kind::kSdm) continue;
    if (pool == nullptr) pool = std::make_shared<RowPool>(l.row_width);
    l.row_pool = pool;
  }
}

absl::StatusOr<std::unique_ptr<SessionStateStore>> SessionStateStore::Open(
    const StateLayout& layout, uint64_t fingerprint, const SessionStoreOptions& options) {
  if (options.files == nullptr) return absl::InvalidArgumentError("store needs a file system");
  auto store = std::make_unique<SessionStateStore>(Key(), layout, fingerprint, options);
  const int64_t min_bytes = store->MinSessionBytes();
  if (options.resident_budget_bytes < min_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("resident budget of ", options.resident_budget_bytes,
                     " bytes is smaller than one session's minimum of ", min_bytes,
                     " bytes (its SDM slot tables)"));
  }
  if (options.host_budget_bytes < 0) {
    return absl::InvalidArgumentError("host budget must not be negative");
  }
  if (!options.dir.empty()) {
    if (auto s = store->LoadDirectory(); !s.ok()) return s;
  }
  if (options.background) store->worker_ = std::thread([s = store.get()] { s->WorkerLoop(); });
  return store;
}

SessionStateStore::~SessionStateStore() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  changed_.notify_all();
  if (worker_.joinable()) worker_.join();
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

std::filesystem::path SessionStateStore::PathOf(absl::string_view id) const {
  return options_.dir / absl::StrCat(id, kSnapshotSuffix);
}

std::vector<std::string> SessionStateStore::open_errors() const {
  std::lock_guard<std::mutex> lock(mu_);
  return open_errors_;
}

void SessionStateStore::Quarantine(Entry& e, const std::filesystem::path& file,
                                   const absl::Status& why) {
  // A unique name: an earlier quarantined copy of the same session is never overwritten.
  std::filesystem::path dest = options_.dir / "quarantine" / file.filename();
  dest += absl::StrCat(".", absl::ToUnixMillis(absl::Now()));
  for (int i = 1; std::filesystem::exists(dest); ++i) {
    dest = options_.dir / "quarantine" / file.filename();
    dest += absl::StrCat(".", absl::ToUnixMillis(absl::Now()), ".", i);
  }
  absl::Status moved = options_.files->Rename(file, dest);
  e.broken =
      absl::Status(why.code(), absl::StrCat("session '", e.id,
                                            "': its snapshot failed its checks: ", why.message(),
                                            moved.ok() ? " (moved to " + dest.string() + ")"
                                                       : " (could not quarantine it)"));
  ++counters_.quarantined;
}

absl::StatusOr<SessionRecord> SessionStateStore::ReadRecord(StateFiles& files,
                                                            const std::filesystem::path& path,
                                                            uint64_t size) const {
  auto first = files.ReadRange(path, 0, kRecordPrefixBytes);
  if (!first.ok()) return first.status();
  auto prefix_size = RecordPrefixSize(*first, size, fingerprint_);
  if (!prefix_size.ok()) return prefix_size.status();
  auto prefix = files.ReadRange(path, 0, *prefix_size);
  if (!prefix.ok()) return prefix.status();
  return DecodeSessionRecord(*prefix, size, fingerprint_);
}

absl::Status SessionStateStore::LoadDirectory() {
  StateFiles& files = *options_.files;
  if (auto s = files.CreateDirs(options_.dir / "quarantine"); !s.ok()) return s;
  auto names = files.List(options_.dir);
  if (!names.ok()) return names.status();
  std::sort(names->begin(), names->end());
  for (const std::string& name : *names) {
    const std::filesystem::path path = options_.dir / name;
    if (absl::EndsWith(name, kTmpSuffix)) {
      // A snapshot write cut short by a crash: the previous snapshot (if any) is intact.
      files.Remove(path).IgnoreError();
      continue;
    }
    if (!absl::EndsWith(name, kSnapshotSuffix)) continue;
    const std::string id = name.substr(0, name.size() - kSnapshotSuffix.size());
    if (!ValidId(id)) {
      open_errors_.push_back(absl::StrCat(path.string(), ": not a session snapshot name"));
      continue;
    }
    auto entry = std::make_unique<Entry>();
    entry->id = id;
    entry->tier = Tier::kDisk;
    entry->last_used = absl::Now();
    std::error_code ec;
    const uint64_t size = std::filesystem::file_size(path, ec);
    absl::StatusOr<SessionRecord> record =
        ec ? absl::StatusOr<SessionRecord>(absl::InternalError(ec.message()))
           : ReadRecord(files, path, size);
    if (record.ok() && record->id != id) {
      record = absl::DataLossError(absl::StrCat("it holds session '", record->id, "'"));
    }
    if (!record.ok()) {
      Quarantine(*entry, path, record.status());
      open_errors_.push_back(std::string(entry->broken.message()));
    } else {
      entry->metadata = record->metadata;
      entry->ttl = FromMs(record->ttl_ms);
      if (record->last_used_unix_ms > 0) {
        entry->last_used = absl::FromUnixMillis(record->last_used_unix_ms);
      }
      entry->disk_bytes = static_cast<int64_t>(size);
    }
    entries_.emplace(id, std::move(entry));
  }
  return absl::OkStatus();
}

absl::Status SessionStateStore::Create(absl::string_view id, absl::string_view metadata,
                                       absl::Duration ttl) {
  if (!ValidId(id)) return InvalidId(id);
  auto e = std::make_unique<Entry>();
  e->id = std::string(id);
  e->metadata = std::string(metadata);
  e->state = std::make_unique<SessionState>(layout_);
  e->Refresh();
  e->ttl = ttl > absl::ZeroDuration() ? ttl : options_.default_ttl;
  std::unique_lock<std::mutex> lock(mu_);
  if (entries_.count(id) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("session '", id, "' already exists"));
  }
  e->tick = ++clock_;
  e->last_used = absl::Now();
  entries_.emplace(std::string(id), std::move(e));
  if (options_.background) {
    changed_.notify_all();
  } else {
    Rebalance(lock);
  }
  return absl::OkStatus();
}

void SessionStateStore::WaitIdle(std::unique_lock<std::mutex>& lock, Entry& e) {
  changed_.wait(lock, [&] { return !e.busy; });
}

absl::StatusOr<SessionStateStore::Entry*> SessionStateStore::FindIdle(
    std::unique_lock<std::mutex>& lock, absl::string_view id) {
  while (true) {
    auto it = entries_.find(id);
    if (it == entries_.end()) {
      return absl::NotFoundError(absl::StrCat("session '", id, "' not found"));
    }
    if (!it->second->busy) return it->second.get();
    changed_.wait(lock);  // the entry may be gone when it wakes: look it up again
  }
}

absl::StatusOr<DecodedSession> SessionStateStore::DecodeParked(const Entry& e) const {
  if (e.tier == Tier::kHost) return DecodeSessionState(e.blob, layout_, fingerprint_);
  auto blob = options_.files->Read(PathOf(e.id));
  if (!blob.ok()) return blob.status();
  return DecodeSessionState(*blob, layout_, fingerprint_);
}

absl::StatusOr<SessionLease> SessionStateStore::Acquire(absl::string_view id) {
  std::unique_lock<std::mutex> lock(mu_);
  absl::StatusOr<Entry*> found = FindIdle(lock, id);
  if (!found.ok()) return found.status();
  Entry* e = *found;
  if (!e->broken.ok()) return e->broken;
  if (e->in_use) {
    return absl::AbortedError(
        absl::StrCat("session '", id, "' is in use by another request; retry when it finishes"));
  }
  e->in_use = true;
  if (e->tier != Tier::kResident) {
    const Tier from = e->tier;
    e->busy = true;
    lock.unlock();
    absl::StatusOr<DecodedSession> decoded = DecodeParked(*e);
    const std::filesystem::path path = PathOf(e->id);
    lock.lock();
    e->busy = false;
    if (!decoded.ok()) {
      e->in_use = false;
      const absl::StatusCode code = decoded.status().code();
      if (from == Tier::kDisk &&
          (code == absl::StatusCode::kDataLoss || code == absl::StatusCode::kFailedPrecondition)) {
        Quarantine(*e, path, decoded.status());
        changed_.notify_all();
        return e->broken;
      }
      changed_.notify_all();
      return decoded.status();
    }
    e->state = std::move(decoded->state);
    e->Refresh();
    e->blob.clear();
    e->blob.shrink_to_fit();
    e->tier = Tier::kResident;
    ++counters_.restores[static_cast<int>(from)];
    changed_.notify_all();
  }
  e->tick = ++clock_;
  e->last_used = absl::Now();
  if (options_.background) changed_.notify_all();
  return SessionLease(this, e->id, e->state.get());
}

void SessionStateStore::Release(const std::string& id) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  SDM_CHECK(it != entries_.end());  // a leased session cannot be deleted
  Entry& e = *it->second;
  e.Refresh();
  e.in_use = false;
  e.tick = ++clock_;
  e.last_used = absl::Now();
  if (options_.background) {
    changed_.notify_all();
  } else {
    Rebalance(lock);
  }
}

absl::Status SessionStateStore::Delete(absl::string_view id) {
  std::unique_lock<std::mutex> lock(mu_);
  absl::StatusOr<Entry*> e = FindIdle(lock, id);
  if (!e.ok()) return e.status();
  if ((*e)->in_use) {
    return absl::AbortedError(absl::StrCat("session '", id, "' is in use; cancel it first"));
  }
  if (!options_.dir.empty()) {
    if (auto s = options_.files->Remove(PathOf(id)); !s.ok()) return s;
  }
  auto it = entries_.find(id);
  std::unique_ptr<Entry> dead = std::move(it->second);
  entries_.erase(it);
  lock.unlock();
  // Destroyed outside the lock: freeing a device residency may wait on the device.
  dead.reset();
  return absl::OkStatus();
}

absl::Status SessionStateStore::Fork(absl::string_view src, absl::string_view dst,
                                     absl::string_view metadata, absl::Duration ttl) {
  if (!ValidId(dst)) return InvalidId(dst);
  std::unique_lock<std::mutex> lock(mu_);
  absl::StatusOr<Entry*> found = FindIdle(lock, src);
  if (!found.ok()) return found.status();
  Entry* e = *found;
  if (entries_.count(dst) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("session '", dst, "' already exists"));
  }
  if (!e->broken.ok()) return e->broken;
  if (e->in_use) {
    return absl::AbortedError(
        absl::StrCat("session '", src, "' is generating; fork it when the request finishes"));
  }
  std::unique_ptr<SessionState> copy;
  if (e->tier == Tier::kResident) {
    if (e->state->on_device()) {
      // Its host layers are stale. Synced outside the lock (it waits on the device); busy
      // keeps every other store operation off this entry meanwhile.
      e->busy = true;
      SessionState* state = e->state.get();
      lock.unlock();
      const absl::Status synced = state->SyncToHost();
      lock.lock();
      e->busy = false;
      e->Refresh();
      changed_.notify_all();
      if (!synced.ok()) {
        ++counters_.sync_errors;
        return SyncError(e->id, synced);
      }
      if (entries_.count(dst) > 0) {
        return absl::AlreadyExistsError(absl::StrCat("session '", dst, "' already exists"));
      }
    }
    copy = e->state->Fork();
  } else {
    e->busy = true;
    lock.unlock();
    absl::StatusOr<DecodedSession> decoded = DecodeParked(*e);
    lock.lock();
    e->busy = false;
    changed_.notify_all();
    if (!decoded.ok()) return decoded.status();
    copy = std::move(decoded->state);
    if (entries_.count(dst) > 0) {
      return absl::AlreadyExistsError(absl::StrCat("session '", dst, "' already exists"));
    }
  }
  auto n = std::make_unique<Entry>();
  n->id = std::string(dst);
  n->metadata = std::string(metadata);
  n->state = std::move(copy);
  n->Refresh();
  n->ttl = ttl > absl::ZeroDuration() ? ttl : e->ttl;
  n->tick = ++clock_;
  n->last_used = absl::Now();
  e->last_used = n->last_used;  // a fork uses its source
  entries_.emplace(std::string(dst), std::move(n));
  if (options_.background) {
    changed_.notify_all();
  } else {
    Rebalance(lock);
  }
  return absl::OkStatus();
}

absl::Status SessionStateStore::SetMetadata(absl::string_view id, absl::string_view metadata) {
  std::unique_lock<std::mutex> lock(mu_);
  absl::StatusOr<Entry*> e = FindIdle(lock, id);
  if (!e.ok()) return e.status();
  (*e)->metadata = std::string(metadata);
  return absl::OkStatus();
}

absl::StatusOr<SessionInfo> SessionStateStore::Get(absl::string_view id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    return absl::NotFoundError(absl::StrCat("session '", id, "' not found"));
  }
  const Entry& e = *it->second;
  SessionInfo info;
  info.id = e.id;
  info.metadata = e.metadata;
  info.tier = e.tier;
  info.in_use = e.in_use;
  info.position = e.position;
  info.pending_token = e.position >= 0 && e.pending;
  info.last_used = e.last_used;
  info.ttl = e.ttl;
  if (!e.broken.ok()) info.error = std::string(e.broken.message());
  if (e.tier == Tier::kResident) {
    info.bytes = e.resident_bytes;
    info.private_rows = e.rows;
    if (!e.in_use && !e.busy && e.state != nullptr) {
      for (int64_t l = 0; l < e.state->num_layers(); ++l) {
        if (e.state->is_sdm(l)) info.shared_rows += e.state->sdm(l).SharedRows();
      }
    }
  } else if (e.tier == Tier::kHost) {
    info.bytes = static_cast<int64_t>(e.blob.size());
  } else {
    info.bytes = e.disk_bytes;
  }
  return info;
}

std::vector<SessionInfo> SessionStateStore::List() const {
  std::vector<std::string> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, e] : entries_) ids.push_back(id);
  }
  std::vector<SessionInfo> out;
  for (const std::string& id : ids) {
    auto info = Get(id);
    if (info.ok()) out.push_back(*std::move(info));
  }
  return out;
}

int64_t SessionStateStore::ResidentBytesLocked() const {
  int64_t bytes = 0;
  const RowPool* pool = nullptr;
  for (const auto& [id, e] : entries_) {
    if (e->tier == Tier::kResident) bytes += e->own_bytes;  // rows: once, from the pool
  }
  for (const LayerStateLayout& l : layout_.layers) {
    if (l.row_pool != nullptr) pool = l.row_pool.get();
  }
  return bytes + (pool != nullptr ? pool->live_bytes() : 0);
}

int64_t SessionStateStore::HostBytesLocked() const {
  int64_t bytes = 0;
  for (const auto& [id, e] : entries_) {
    if (e->tier == Tier::kHost) bytes += static_cast<int64_t>(e->blob.size());
  }
  return bytes;
}

absl::Status SessionStateStore::ParkOne(std::unique_lock<std::mutex>& lock, Entry& e, Tier target) {
  if (e.in_use || e.busy || !e.broken.ok()) {
    return absl::AbortedError(absl::StrCat("session '", e.id, "' cannot be moved now"));
  }
  e.busy = true;
  absl::Status status;
  if (e.tier == Tier::kResident && target != Tier::kResident) {
    std::unique_ptr<SessionState> state = std::move(e.state);
    SessionRecord record{e.id, e.metadata, ToMs(e.ttl), absl::ToUnixMillis(e.last_used)};
    lock.unlock();
    // A session on device has stale host layers: copy them back before encoding them.
    absl::Status synced = state->SyncToHost();
    absl::StatusOr<std::string> blob = synced.ok()
                                           ? TryEncodeSessionState(*state, record, fingerprint_)
                                           : absl::StatusOr<std::string>(SyncError(e.id, synced));
    if (blob.ok()) state.reset();  // returns its rows to the pool
    lock.lock();
    if (blob.ok()) {
      e.blob = *std::move(blob);
      e.tier = Tier::kHost;
      ++counters_.evictions[static_cast<int>(Tier::kResident)];
    } else {
      // Only this session failed: it stays resident and usable on its device copy. Its host
      // layers may have been partly written, so its byte count is taken again.
      e.state = std::move(state);
      e.Refresh();
      ++counters_.sync_errors;
      status = blob.status();
    }
  }
  if (status.ok() && e.tier == Tier::kHost && target == Tier::kDisk) {
    if (options_.dir.empty()) {
      status = absl::FailedPreconditionError("the store has no snapshot directory");
    } else {
      lock.unlock();
      absl::Status s = options_.files->WriteAtomically(PathOf(e.id), e.blob);
      lock.lock();
      if (s.ok()) {
        e.disk_bytes = static_cast<int64_t>(e.blob.size());
        e.blob.clear();
        e.blob.shrink_to_fit();
        e.tier = Tier::kDisk;
        ++counters_.evictions[static_cast<int>(Tier::kHost)];
      } else {
        ++counters_.snapshot_errors;
        status = absl::UnavailableError(
            absl::StrCat("could not write the snapshot of session '", e.id, "': ", s.message()));
      }
    }
  }
  e.busy = false;
  changed_.notify_all();
  return status;
}

absl::Status SessionStateStore::Park(absl::string_view id, Tier tier) {
  std::unique_lock<std::mutex> lock(mu_);
  absl::StatusOr<Entry*> found = FindIdle(lock, id);
  if (!found.ok()) return found.status();
  Entry* e = *found;
  if (!e->broken.ok()) return e->broken;
  if (e->in_use) return absl::AbortedError(absl::StrCat("session '", id, "' is in use"));
  if (tier == Tier::kDisk && options_.dir.empty()) {
    return absl::FailedPreconditionError("the store has no snapshot directory");
  }
  if (static_cast<int>(e->tier) >= static_cast<int>(tier)) return absl::OkStatus();
  return ParkOne(lock, *e, tier);
}

absl::Status SessionStateStore::PersistAll() {
  if (options_.dir.empty()) {
    return absl::FailedPreconditionError("the store has no snapshot directory");
  }
  std::unique_lock<std::mutex> lock(mu_);
  std::vector<std::string> skipped, failed;
  std::vector<std::string> ids;
  for (const auto& [id, e] : entries_) ids.push_back(id);
  for (const std::string& id : ids) {
    auto it = entries_.find(id);
    if (it == entries_.end()) continue;
    Entry& e = *it->second;
    WaitIdle(lock, e);
    if (e.tier == Tier::kDisk || !e.broken.ok()) continue;
    if (e.in_use) {
      skipped.push_back(id);
      continue;
    }
    if (absl::Status s = ParkOne(lock, e, Tier::kDisk); !s.ok()) {
      failed.push_back(absl::StrCat(id, " (", s.message(), ")"));
    }
  }
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

void SessionStateStore::Rebalance(std::unique_lock<std::mutex>& lock) {
  // Sessions whose device copy would not come back in this pass (retried in the next one).
  std::set<std::string, std::less<>> unsynced;
  auto lru = [&](Tier tier) -> Entry* {
    Entry* best = nullptr;
    for (auto& [id, e] : entries_) {
      if (e->tier != tier || e->in_use || e->busy || !e->broken.ok()) continue;
      if (unsynced.count(id) > 0) continue;
      if (best == nullptr || e->tick < best->tick) best = e.get();
    }
    return best;
  };
  while (!stop_ && ResidentBytesLocked() > options_.resident_budget_bytes) {
    Entry* e = lru(Tier::kResident);
    if (e == nullptr) break;
    // Resident -> host fails only in the device sync, which concerns this session alone.
    if (absl::Status s = ParkOne(lock, *e, Tier::kHost); !s.ok()) {
      SDM_LOG(WARNING) << "sdm state store: eviction skipped a session: " << s;
      unsynced.insert(e->id);
    }
  }
  if (options_.dir.empty()) return;
  while (!stop_ && HostBytesLocked() > options_.host_budget_bytes) {
    Entry* e = lru(Tier::kHost);
    // A failed write most likely fails for every session (disk full): stop until the next pass.
    if (e == nullptr || !ParkOne(lock, *e, Tier::kDisk).ok()) break;
  }
}

int SessionStateStore::ExpireIdle(absl::Time now) {
  // Declared before the lock guard, so destroyed after it is released: freeing a device
  // residency may wait on the device.
  std::vector<std::unique_ptr<Entry>> dead;
  std::lock_guard<std::mutex> lock(mu_);
  int expired = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& e = *it->second;
    if (!e.in_use && !e.busy && e.ttl != absl::InfiniteDuration() && now - e.last_used > e.ttl) {
      if (!options_.dir.empty()) options_.files->Remove(PathOf(e.id)).IgnoreError();
      dead.push_back(std::move(it->second));
      it = entries_.erase(it);
      ++expired;
    } else {
      ++it;
    }
  }
  counters_.expired += expired;
  return expired;
}

void SessionStateStore::WorkerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    changed_.wait_for(lock, std::chrono::seconds(1));
    if (stop_) break;
    Rebalance(lock);
    lock.unlock();
    ExpireIdle(absl::Now());
    lock.lock();
  }
}

StoreStats SessionStateStore::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  StoreStats s = counters_;
  for (int t = 0; t < kNumTiers; ++t) s.sessions[t] = s.bytes[t] = 0;
  for (const auto& [id, e] : entries_) {
    ++s.sessions[static_cast<int>(e->tier)];
    if (e->in_use) ++s.in_use;
    if (e->tier == Tier::kDisk) s.bytes[static_cast<int>(Tier::kDisk)] += e->disk_bytes;
  }
  s.bytes[static_cast<int>(Tier::kResident)] = ResidentBytesLocked();
  s.bytes[static_cast<int>(Tier::kHost)] = HostBytesLocked();
  for (const LayerStateLayout& l : layout_.layers) {
    if (l.row_pool != nullptr) {
      s.rows_live = l.row_pool->live_rows();
      s.rows_shared = l.row_pool->shared_rows();
      break;
    }
  }
  return s;
}

}  // namespace sdm
