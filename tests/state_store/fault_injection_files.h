// A StateFiles that injects faults into the disk tier's file operations, for tests (in the spirit
// of LevelDB's FaultInjectionTestEnv).
//
// Each operation can be made to fail once (or from then on: sticky), after a number of calls that
// succeed: a write cut short after its first N bytes (what a crash or a full disk leaves in
// `<path>.tmp`), a failed rename, a failed directory fsync, a full disk (ResourceExhausted, like
// ENOSPC). With crash_at_fault set, the process is treated as dead from the moment the fault fires:
// every later operation that would change the disk (write, rename, fsync, remove, mkdir) fails
// without touching it, so the clean-up that WriteAtomically does after an error never happens and
// the directory is left exactly as the crash left it.
//
// Everything else is the real POSIX implementation. Thread-safe.
#ifndef SDMSERVE_TESTS_STATE_STORE_FAULT_INJECTION_FILES_H_
#define SDMSERVE_TESTS_STATE_STORE_FAULT_INJECTION_FILES_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "base/status_macros.h"
#include "state_store/byte_source.h"
#include "state_store/state_files.h"

namespace sdm::testing {

class FaultInjectionFiles : public StateFiles {
 public:
  enum class Op {
    kWriteAndSync,
    kRename,
    kSyncDir,
    kRemove,
    kCreateDirs,
    kRead,
    kReadRange,
    kList,
    kWriteAt,
    kSync,       // the background fsync of a file written without one (--persist_sync=write)
    kLock,       // the directory's lock when a store opens it
    kWriteBack,  // an unsynced snapshot's data written out before its rename
  };
  static constexpr int kNumOps = 12;

  struct Fault {
    // The error the failing call returns.
    absl::Status status = absl::InternalError("injected fault");
    // Calls of the operation that succeed before the one that fails.
    int skip = 0;
    // kWriteAndSync only: >= 0 writes the first min(partial_bytes, size) bytes of the data (not
    // fsynced) before failing; -1 fails before creating the file.
    int64_t partial_bytes = -1;
    // Every later call fails too (a read-only or full file system), until ClearFaults().
    bool sticky = false;
  };

  // The next call of `op` (after fault.skip successful ones) fails with fault.status.
  void FailNext(Op op, Fault fault) {
    absl::MutexLock lock(&mu_);
    faults_[Index(op)] = std::move(fault);
  }
  // Common faults.
  void FailWriteAfter(int64_t bytes) {
    FailNext(Op::kWriteAndSync, {absl::InternalError("injected: write cut short"), 0, bytes});
  }
  void FailWriteNoSpace(int64_t bytes_written_first = -1) {
    FailNext(Op::kWriteAndSync, {absl::ResourceExhaustedError("injected: No space left on device"),
                                 0, bytes_written_first});
  }
  void FailRename() {
    FailNext(Op::kRename, {absl::InternalError("injected: rename failed"), 0, -1});
  }
  // Every write fails, as on a read-only or full file system, until ClearFaults().
  void FailWritesAlways(absl::Status status) {
    FailNext(Op::kWriteAndSync, {status, 0, -1, /*sticky=*/true});
    FailNext(Op::kWriteAt, {std::move(status), 0, -1, /*sticky=*/true});
  }
  void FailSyncDir() {
    FailNext(Op::kSyncDir, {absl::InternalError("injected: directory fsync failed"), 0, -1});
  }
  // The next Sync() (a file's background fsync) fails, as an fsync does after a disk error.
  void FailSync() {
    FailNext(Op::kSync, {absl::InternalError("injected: Input/output error"), 0, -1});
  }
  // Counts the writes that fsynced their data (WriteAndSync and WriteAt with sync) and those
  // that did not.
  int synced_writes() const {
    absl::MutexLock lock(&mu_);
    return synced_writes_;
  }
  int unsynced_writes() const {
    absl::MutexLock lock(&mu_);
    return unsynced_writes_;
  }

  // From the first injected fault on, operations that change the disk fail without effect.
  void set_crash_at_fault(bool crash) {
    absl::MutexLock lock(&mu_);
    crash_at_fault_ = crash;
  }
  bool crashed() const {
    absl::MutexLock lock(&mu_);
    return crashed_;
  }
  // Injected faults that fired.
  int faults_fired() const {
    absl::MutexLock lock(&mu_);
    return fired_;
  }
  // Calls of `op` so far (failed ones included).
  int calls(Op op) const {
    absl::MutexLock lock(&mu_);
    return calls_[Index(op)];
  }
  // Clears pending faults and the crashed state (counters are kept).
  void ClearFaults() {
    absl::MutexLock lock(&mu_);
    for (auto& f : faults_) f.reset();
    crashed_ = false;
  }

  absl::StatusOr<std::string> Read(const std::filesystem::path& path) override {
    if (auto s = Enter(Op::kRead, nullptr); !s.ok()) return s;
    return StateFiles::Read(path);
  }
  absl::StatusOr<std::string> ReadRange(const std::filesystem::path& path, uint64_t offset,
                                        uint64_t n) override {
    if (auto s = Enter(Op::kReadRange, nullptr); !s.ok()) return s;
    return StateFiles::ReadRange(path, offset, n);
  }
  absl::StatusOr<std::vector<std::string>> List(const std::filesystem::path& dir) override {
    if (auto s = Enter(Op::kList, nullptr); !s.ok()) return s;
    return StateFiles::List(dir);
  }
  absl::Status Remove(const std::filesystem::path& path) override {
    if (auto s = Enter(Op::kRemove, nullptr); !s.ok()) return s;
    return StateFiles::Remove(path);
  }
  absl::Status Rename(const std::filesystem::path& from, const std::filesystem::path& to) override {
    if (auto s = Enter(Op::kRename, nullptr); !s.ok()) return s;
    return StateFiles::Rename(from, to);
  }
  // A fault with partial_bytes >= 0 writes that prefix of the data at the offset first (a torn
  // append).
  using StateFiles::WriteAt;
  absl::Status WriteAt(const std::filesystem::path& path, uint64_t offset, const ByteSource& data,
                       bool sync) override {
    std::optional<Fault> fault;
    if (auto s = Enter(Op::kWriteAt, &fault); !s.ok()) {
      if (fault.has_value() && fault->partial_bytes >= 0) {
        const std::string prefix = SourcePrefix(data, static_cast<uint64_t>(fault->partial_bytes));
        StateFiles::WriteAt(path, offset, StringSource(prefix), sync).IgnoreError();
      }
      return s;
    }
    CountWrite(sync);
    return StateFiles::WriteAt(path, offset, data, sync);
  }
  absl::Status Sync(const std::filesystem::path& path) override {
    if (auto s = Enter(Op::kSync, nullptr); !s.ok()) return s;
    return StateFiles::Sync(path);
  }
  absl::Status SyncDir(const std::filesystem::path& dir) override {
    if (auto s = Enter(Op::kSyncDir, nullptr); !s.ok()) return s;
    return StateFiles::SyncDir(dir);
  }
  absl::Status WriteBack(const std::filesystem::path& path) override {
    if (auto s = Enter(Op::kWriteBack, nullptr); !s.ok()) return s;
    return StateFiles::WriteBack(path);
  }
  absl::StatusOr<std::unique_ptr<FileLock>> Lock(const std::filesystem::path& path,
                                                 bool exclusive) override {
    if (auto s = Enter(Op::kLock, nullptr); !s.ok()) return s;
    return StateFiles::Lock(path, exclusive);
  }
  absl::Status CreateDirs(const std::filesystem::path& dir) override {
    if (auto s = Enter(Op::kCreateDirs, nullptr); !s.ok()) return s;
    return StateFiles::CreateDirs(dir);
  }

 protected:
  absl::Status WriteAndSync(const std::filesystem::path& path, const ByteSource& data,
                            bool sync) override {
    std::optional<Fault> fault;
    if (auto s = Enter(Op::kWriteAndSync, &fault); !s.ok()) {
      if (fault.has_value() && fault->partial_bytes >= 0) {
        // The bytes that reached the file before the failure. Written with the real
        // implementation (it also fsyncs, which only makes the partial file more certain).
        const std::string prefix = SourcePrefix(data, static_cast<uint64_t>(fault->partial_bytes));
        StateFiles::WriteAndSync(path, StringSource(prefix), /*sync=*/true).IgnoreError();
      }
      return s;
    }
    CountWrite(sync);
    return StateFiles::WriteAndSync(path, data, sync);
  }

 private:
  static int Index(Op op) { return static_cast<int>(op); }
  static bool Mutates(Op op) {
    return op == Op::kWriteAndSync || op == Op::kRename || op == Op::kSyncDir ||
           op == Op::kRemove || op == Op::kCreateDirs || op == Op::kWriteAt || op == Op::kSync ||
           op == Op::kWriteBack;
  }
  void CountWrite(bool sync) {
    absl::MutexLock lock(&mu_);
    ++(sync ? synced_writes_ : unsynced_writes_);
  }

  // Counts the call; returns the error it must fail with, if any (and the fault that fired).
  absl::Status Enter(Op op, std::optional<Fault>* fired) {
    absl::MutexLock lock(&mu_);
    ++calls_[Index(op)];
    if (crashed_ && Mutates(op)) {
      return absl::UnavailableError("injected: the process crashed before this operation");
    }
    std::optional<Fault>& f = faults_[Index(op)];
    if (!f.has_value()) return absl::OkStatus();
    if (f->skip > 0) {
      --f->skip;
      return absl::OkStatus();
    }
    absl::Status status = f->status;
    if (fired != nullptr) *fired = f;
    if (!f->sticky) f.reset();
    ++fired_;
    if (crash_at_fault_) crashed_ = true;
    return status;
  }

  mutable absl::Mutex mu_;
  std::array<std::optional<Fault>, kNumOps> faults_ ABSL_GUARDED_BY(mu_);
  std::array<int, kNumOps> calls_ ABSL_GUARDED_BY(mu_){};
  bool crash_at_fault_ ABSL_GUARDED_BY(mu_) = false;
  bool crashed_ ABSL_GUARDED_BY(mu_) = false;
  int fired_ ABSL_GUARDED_BY(mu_) = 0;
  int synced_writes_ ABSL_GUARDED_BY(mu_) = 0;
  int unsynced_writes_ ABSL_GUARDED_BY(mu_) = 0;
};

// Faults of one session's writes, for tests of what the other sessions and turns do meanwhile.
// Every write of session data (a snapshot or a log append) to a file whose name starts with a
// stem (SessionFileStem of the session's key) is
//  - held at that stem's gate once Hold(stem) is called, until Open(stem) or Open(): a store's
//    writer stuck in that session's write (a slow disk, a long fsync). Several stems may be held,
//    each at its own gate; Open() opens every gate, and later ones too;
//  - failed with ResourceExhausted once Fail(stem) is called, until ClearFailing(): a fault of
//    that session only (say its device copy-back) while the others' writes succeed.
// Everything else is FaultInjectionFiles.
class SessionWriteFiles : public FaultInjectionFiles {
 public:
  void Hold(std::string stem) {
    absl::MutexLock lock(&mu_);
    if (first_held_.empty()) first_held_ = stem;
    gates_.try_emplace(std::move(stem), std::make_unique<Gate>());
  }
  // Whether a held write reached the gate (of the first stem held) within `timeout`.
  bool WaitHeld(absl::Duration timeout) { return WaitHeld(FirstHeld(), timeout); }
  bool WaitHeld(const std::string& stem, absl::Duration timeout) {
    Gate* gate = GateOf(stem);
    return gate != nullptr && gate->held.WaitForNotificationWithTimeout(timeout);
  }
  void Open() {
    absl::MutexLock lock(&mu_);
    all_open_ = true;
    for (auto& [stem, gate] : gates_) gate->OpenOnce();
  }
  void Open(const std::string& stem) {
    if (Gate* gate = GateOf(stem); gate != nullptr) gate->OpenOnce();
  }
  void Fail(std::string stem) {
    absl::MutexLock lock(&mu_);
    failing_stem_ = std::move(stem);
  }
  void ClearFailing() {
    absl::MutexLock lock(&mu_);
    failing_stem_.clear();
  }

  using StateFiles::WriteAt;
  absl::Status WriteAt(const std::filesystem::path& path, uint64_t offset, const ByteSource& data,
                       bool sync) override {
    SDM_RETURN_IF_ERROR(Intercept(path));
    return FaultInjectionFiles::WriteAt(path, offset, data, sync);
  }

 protected:
  absl::Status WriteAndSync(const std::filesystem::path& path, const ByteSource& data,
                            bool sync) override {
    SDM_RETURN_IF_ERROR(Intercept(path));
    return FaultInjectionFiles::WriteAndSync(path, data, sync);
  }

 private:
  struct Gate {
    absl::Notification held, open;
    void OpenOnce() {
      if (!open.HasBeenNotified()) open.Notify();
    }
  };

  std::string FirstHeld() {
    absl::MutexLock lock(&mu_);
    return first_held_;
  }
  Gate* GateOf(const std::string& stem) {
    absl::MutexLock lock(&mu_);
    auto it = gates_.find(stem);
    return it == gates_.end() ? nullptr : it->second.get();  // gates are never removed
  }

  absl::Status Intercept(const std::filesystem::path& path) {
    const std::string name = path.filename().string();
    const auto of = [&](const std::string& stem) {
      return !stem.empty() && absl::StartsWith(name, stem);
    };
    Gate* gate = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (of(failing_stem_))
        return absl::ResourceExhaustedError("injected: this session's writes fail");
      for (auto& [stem, g] : gates_) {
        if (of(stem)) gate = g.get();
      }
      if (gate == nullptr) return absl::OkStatus();
      if (!gate->held.HasBeenNotified()) gate->held.Notify();
      if (all_open_) return absl::OkStatus();
    }
    gate->open.WaitForNotification();
    return absl::OkStatus();
  }

  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<Gate>> gates_ ABSL_GUARDED_BY(mu_);
  std::string first_held_ ABSL_GUARDED_BY(mu_);
  bool all_open_ ABSL_GUARDED_BY(mu_) = false;
  std::string failing_stem_ ABSL_GUARDED_BY(mu_);
};

}  // namespace sdm::testing

#endif  // SDMSERVE_TESTS_STATE_STORE_FAULT_INJECTION_FILES_H_
