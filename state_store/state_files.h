// The file operations of the disk tier, behind an interface so tests can inject faults (a full
// disk, a write cut short, a crash between steps) the way LevelDB's Env does.
//
// WriteAtomically() is the only way a snapshot reaches its final name: the data goes to a
// temporary file of that call's own (`<path>.<pid>-<process random>-<call>.tmp`), is fsynced,
// renamed over `path`, and the directory is fsynced. A crash at any point leaves either the
// previous file or the new one complete under `path`, plus possibly a stray `.tmp` that the store
// removes when it opens. The name is unique so that two writers of one path (replicas sharing a
// directory) never write one temporary file: both would cut and write the same inode, and the
// file renamed could be a mixture of the two. The writer holds its temporary file locked
// (flock(2), exclusive) from its creation until after the rename, so that a store opening a
// shared directory tells another replica's write under way from a crash's leftover
// (RemoveStrayTemp). With sync false (the store's
// --persist_sync=write) the two fsyncs are left out: a process crash (kill -9) after it returns
// still finds the new file (the kernel holds the data), a power loss or kernel crash before a
// later Sync() of the file and SyncDir() of its directory may find the previous file or the new
// one, and the new one whole: its data is written back (WriteBack(): on the device, waited for)
// before the rename, so a file system that journals the rename after the data's allocation (ext4,
// XFS, btrfs) cannot commit the new name with the data missing. Without that step, XFS could leave
// `path` empty after a power loss (it does not flush a file renamed over another, as ext4's
// auto_da_alloc does): the previous file gone, the new one lost.
//
// Direct I/O (StateFiles::Direct(), the server's --persist_io=direct): the same operations, but the
// data of WriteAtomically() and WriteAt() goes to the disk with O_DIRECT, in block-aligned chunks
// from a buffer each calling thread keeps, rather than through the page cache. The bytes in the
// file, the crash guarantees and what a later Sync() does are the same; what differs is the cost:
// the kernel neither copies the data into page-cache pages it allocates (and zeroes) for it nor
// writes them back later, which on debug_sdm's tens of MB per turn was nearly all the CPU that
// per-turn persistence took from decode (docs/benchmarks.md, "Per-turn persistence", 2026-12-04).
// The write returns once the device has accepted the data, which may still sit in its volatile
// cache: only Sync() covers a power loss, in both modes (and a kill -9 loses neither: the kernel
// holds a buffered write). Only whole aligned blocks go direct: the
// partial block before an unaligned offset is rewritten with the bytes the file already holds
// there (read first), the partial block at the end is written through the page cache, and a
// small write over blocks the file already holds whole (a deferred checksum: WriteSource) rewrites
// them directly, read first, so that it is on the device with the data around it. A file
// system that refuses O_DIRECT (tmpfs) gets buffered writes, silently: same bytes, same guarantees.
//
// Thread-safety: the POSIX implementations are thread-safe for different paths.
#ifndef SDMSERVE_STATE_STORE_STATE_FILES_H_
#define SDMSERVE_STATE_STORE_STATE_FILES_H_

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "state_store/byte_source.h"

namespace sdm {

// An advisory lock (flock(2)) on an open file, held until destroyed or the process ends (a
// crashed holder leaves nothing to clean up).
class FileLock {
 public:
  explicit FileLock(int fd) : fd_(fd) {}
  ~FileLock();
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_;
};

class StateFiles {
 public:
  virtual ~StateFiles() = default;

  // The POSIX file system (a process-wide instance).
  static StateFiles* Default();
  // The same with direct I/O for written data (see the file comment; a process-wide instance).
  static StateFiles* Direct();

  absl::Status WriteAtomically(const std::filesystem::path& path, const ByteSource& data,
                               bool sync = true);
  absl::Status WriteAtomically(const std::filesystem::path& path, absl::string_view data,
                               bool sync = true) {
    return WriteAtomically(path, StringSource(data), sync);
  }

  virtual absl::StatusOr<std::string> Read(const std::filesystem::path& path);
  // Up to n bytes from `offset` (fewer at the end of the file).
  virtual absl::StatusOr<std::string> ReadRange(const std::filesystem::path& path, uint64_t offset,
                                                uint64_t n);
  // Names (not paths) of the regular files in `dir`.
  virtual absl::StatusOr<std::vector<std::string>> List(const std::filesystem::path& dir);
  virtual absl::Status Remove(const std::filesystem::path& path);
  // Removes `path`, a temporary file of WriteAtomically(), unless its writer still holds it
  // locked (a write under way, in any process sharing the directory): FAILED_PRECONDITION then,
  // the file left. A file system without flock: UNIMPLEMENTED, the file left too (a write under
  // way cannot be told from a leftover). OK when it is gone already.
  virtual absl::Status RemoveStrayTemp(const std::filesystem::path& path);
  virtual absl::Status Rename(const std::filesystem::path& from, const std::filesystem::path& to);
  virtual absl::Status CreateDirs(const std::filesystem::path& dir);
  // Locks the file at `path` (created if missing), exclusive or shared, without waiting: another
  // open of it (in this process too) that holds a conflicting lock makes it FAILED_PRECONDITION;
  // a file system without such locks (ENOLCK, EOPNOTSUPP) UNIMPLEMENTED. With `exclusive`, the
  // file then holds this process's id (what a refused locker reads: HolderOfLock).
  virtual absl::StatusOr<std::unique_ptr<FileLock>> Lock(const std::filesystem::path& path,
                                                         bool exclusive);

  // Cuts `path` (created if missing) at `offset` (whatever followed, e.g. a torn tail, is gone),
  // then writes `data` there and fsyncs the file; when it created the file or wrote at offset 0
  // (a file's start: an earlier failed attempt may have created it), fsyncs the directory too.
  // The delta log's append (state_store/state_log.h). A crash, or a failed write, leaves a prefix
  // of `data` after `offset` and nothing else (the cut comes first), which the log's reader
  // relies on to tell a torn tail from damage. With sync false neither fsync is made (see
  // WriteAtomically).
  virtual absl::Status WriteAt(const std::filesystem::path& path, uint64_t offset,
                               const ByteSource& data, bool sync = true);
  absl::Status WriteAt(const std::filesystem::path& path, uint64_t offset, absl::string_view data,
                       bool sync = true) {
    return WriteAt(path, offset, StringSource(data), sync);
  }

  // fsyncs the file at `path` (what earlier writes without sync left in the kernel reaches the
  // disk); NOT_FOUND when there is none. The store's background group commit.
  virtual absl::Status Sync(const std::filesystem::path& path);
  // fsyncs the directory (its entries: files created, renamed, removed).
  virtual absl::Status SyncDir(const std::filesystem::path& dir);
  // Writes the file's data at `path` that is still in the page cache to the device and waits for
  // it (sync_file_range(2)), without an fsync: no metadata is committed and the device's volatile
  // cache is not flushed, so it costs the writing out only (nothing at all for what direct I/O
  // already wrote), not a journal commit. WriteAtomically's step before its rename when not
  // syncing (the file comment); a later journal commit, which flushes the device's cache first,
  // then carries the data with it.
  virtual absl::Status WriteBack(const std::filesystem::path& path);

 protected:
  // The write step of WriteAtomically (fsynced when `sync`), a fault-injection point.
  virtual absl::Status WriteAndSync(const std::filesystem::path& path, const ByteSource& data,
                                    bool sync);
  // Writes all of `data` at `offset` of the open file `fd` (opened read-write; `path` names it
  // for errors and for Direct()'s second descriptor): pwrite(2) here, direct I/O in Direct().
  virtual absl::Status WriteFd(int fd, const std::filesystem::path& path, uint64_t offset,
                               absl::string_view data);
  // The same for a ByteSource: a contiguous one in one WriteFd(); otherwise its pieces gathered
  // into chunks of a buffer each calling thread keeps (aligned, 4 MiB: allocated once), one
  // WriteFd() per chunk, every chunk after the first starting at a multiple of the direct-I/O
  // block in the file (so that Direct() writes each from that buffer with no staging copy). The
  // source is produced once (ByteSource::EmitOnePass): each deferred checksum goes into the last
  // chunk before it is written, or, when its chunk is already out, over the file's placeholder
  // with an 8-byte WriteFd(); the file ends up with Emit()'s bytes either way.
  absl::Status WriteSource(int fd, const std::filesystem::path& path, uint64_t offset,
                           const ByteSource& data);
};

// The process id an exclusive holder wrote into the lock file at `path` (Lock), 0 if none.
int64_t HolderOfLock(const std::filesystem::path& path);

// Selects Default() or Direct() by name ("buffered", "direct"; the server's --persist_io).
absl::StatusOr<StateFiles*> StateFilesForIo(absl::string_view name);

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_STATE_FILES_H_
