#include "state_store/state_files.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/scoped_fd.h"
#include "base/status_macros.h"

namespace sdm {
namespace {

absl::Status Errno(absl::string_view what, const std::filesystem::path& path, int err) {
  std::string msg = absl::StrCat(what, " ", path.string(), ": ", std::strerror(err));
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(msg);
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  return absl::InternalError(msg);
}

// Reads up to `n` bytes at `offset` of `fd` into `out` (fewer at the end of the file): the bytes
// read.
absl::StatusOr<uint64_t> ReadUpTo(int fd, const std::filesystem::path& path, char* out, uint64_t n,
                                  uint64_t offset) {
  uint64_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd, out + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      return Errno("cannot read", path, errno);
    }
    if (got == 0) break;  // end of file
    done += static_cast<uint64_t>(got);
  }
  return done;
}

// flock(2) of `fd` (the file at `path`) with `operation` (LOCK_EX, LOCK_SH), without waiting:
// FAILED_PRECONDITION when another open of the file holds a conflicting lock, UNIMPLEMENTED on a
// file system without such locks (ENOLCK, EOPNOTSUPP, EINVAL).
absl::Status TryFlock(int fd, int operation, const std::filesystem::path& path) {
  if (::flock(fd, operation | LOCK_NB) == 0) return absl::OkStatus();
  const int error = errno;
  if (error == EWOULDBLOCK) {
    return absl::FailedPreconditionError(absl::StrCat(path.string(), " is locked"));
  }
  if (error == ENOLCK || error == EOPNOTSUPP || error == EINVAL) {
    return absl::UnimplementedError(
        absl::StrCat("cannot lock ", path.string(), ": ", std::strerror(error)));
  }
  return Errno("cannot lock", path, error);
}

// Direct I/O (see the header): whole blocks of this size, at offsets that are multiples of it,
// from a buffer aligned to it (4 KiB covers the logical block size of every disk we target).
constexpr uint64_t kDirectBlock = 4096;
// Each writing thread's aligned staging buffer: allocated (and faulted in) once per thread, then
// reused; a write larger than this goes out in several chunks.
constexpr uint64_t kDirectChunk = uint64_t{4} << 20;

// A kDirectChunk buffer aligned for O_DIRECT, one per thread and `Use` (null when allocation
// failed): allocated on a thread's first write and reused by every later one.
enum class ChunkUse { kDirectStaging, kSourceChunk };
template <ChunkUse Use>
char* ThreadChunkBuffer() {
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<char, Free> buffer(
      static_cast<char*>(std::aligned_alloc(kDirectBlock, kDirectChunk)));
  return buffer.get();
}

// The staging copy of an unaligned O_DIRECT write.
char* DirectBuffer() { return ThreadChunkBuffer<ChunkUse::kDirectStaging>(); }
// WriteSource()'s chunk buffer (a chunk is staged in DirectBuffer() only when its file offset is
// unaligned).
char* SourceChunkBuffer() { return ThreadChunkBuffer<ChunkUse::kSourceChunk>(); }

bool IsAligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kDirectBlock == 0; }

absl::Status SourceChunkError(const std::filesystem::path& path) {
  return absl::ResourceExhaustedError(
      absl::StrCat("cannot write ", path.string(), ": no memory for a write buffer"));
}

// Writes `n` bytes (whole blocks) from `data` at file offset `at` with O_DIRECT (`direct`).
// Returns the bytes written: fewer than `n` where the file system refused the rest (EINVAL: an
// alignment it does not take) or cut a write off a block boundary, for the caller to write the
// rest through the page cache; an error otherwise.
absl::StatusOr<uint64_t> WriteDirectBlocks(int direct, const std::filesystem::path& path,
                                           const char* data, uint64_t n, uint64_t at) {
  uint64_t done = 0;
  while (done < n) {
    const ssize_t w = ::pwrite(direct, data + done, n - done, static_cast<off_t>(at + done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno != EINVAL) return Errno("cannot write", path, errno);
    if (w <= 0) return done;
    done += static_cast<uint64_t>(w);
    if (done % kDirectBlock != 0) return done;
  }
  return done;
}

class DirectStateFiles : public StateFiles {
 protected:
  absl::Status WriteFd(int fd, const std::filesystem::path& path, uint64_t offset,
                       absl::string_view data) override {
    const uint64_t end = offset + data.size();
    const uint64_t first = offset - offset % kDirectBlock;  // the direct region [first, last)
    const uint64_t last = end - end % kDirectBlock;
    char* buffer = DirectBuffer();
    if (buffer == nullptr) return StateFiles::WriteFd(fd, path, offset, data);
    if (last <= first) {
      // No whole block of its own: a write's tail, or a patch over data already written (a
      // deferred checksum over an earlier chunk: WriteSource).
      if (IsOverwriteOfWholeBlocks(fd, end)) return RewriteBlocks(fd, path, offset, data, buffer);
      return StateFiles::WriteFd(fd, path, offset, data);
    }
    ScopedFd direct(::open(path.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC));
    // A file system without O_DIRECT (tmpfs: EINVAL): buffered, the same bytes.
    if (direct.get() < 0) return StateFiles::WriteFd(fd, path, offset, data);
    if (first == offset && IsAligned(data.data())) {
      // Aligned in the file and in memory (WriteSource()'s chunks): written from where it is.
      return WriteAligned(direct.get(), fd, path, offset, data, last);
    }
    uint64_t at = first;
    while (at < last) {
      const uint64_t n = std::min(kDirectChunk, last - at);
      uint64_t fill = 0;
      if (at < offset) {
        // The block's bytes before `offset` are the file's own (a log's last good record):
        // rewritten as they are. Past the file's end (a hole): zeros, as a read would give.
        fill = offset - at;
        SDM_ASSIGN_OR_RETURN(const uint64_t got, ReadUpTo(fd, path, buffer, fill, at));
        std::memset(buffer + got, 0, fill - got);
      }
      std::memcpy(buffer + fill, data.data() + (at + fill - offset), n - fill);
      SDM_ASSIGN_OR_RETURN(const uint64_t done,
                           WriteDirectBlocks(direct.get(), path, buffer, n, at));
      if (done < n) {
        // Refused or cut short: the rest goes through the page cache.
        const uint64_t from = std::max(at + done, offset);
        return StateFiles::WriteFd(fd, path, from, data.substr(from - offset));
      }
      at += n;
    }
    if (end > last) return StateFiles::WriteFd(fd, path, last, data.substr(last - offset));
    return absl::OkStatus();
  }

 private:
  static uint64_t RoundUpToBlock(uint64_t n) {
    return (n + kDirectBlock - 1) / kDirectBlock * kDirectBlock;
  }

  // Whether the blocks under [.., end) lie wholly within the file: written before, and (but for
  // the file's last partial block, which this excludes) written directly.
  static bool IsOverwriteOfWholeBlocks(int fd, uint64_t end) {
    struct stat st {};
    return ::fstat(fd, &st) == 0 && RoundUpToBlock(end) <= static_cast<uint64_t>(st.st_size);
  }

  // A small write over data already on the disk goes there the same way: its blocks are read,
  // patched and written back with O_DIRECT. Through the page cache alone it could miss a power
  // loss that the data around it, written directly, survives: a record whose checksum is lost
  // reads as damage (the session quarantined) where the record itself is whole.
  absl::Status RewriteBlocks(int fd, const std::filesystem::path& path, uint64_t offset,
                             absl::string_view data, char* buffer) {
    const uint64_t first = offset - offset % kDirectBlock;
    const uint64_t n = RoundUpToBlock(offset + data.size()) - first;  // two blocks at most
    if (n > kDirectChunk) return StateFiles::WriteFd(fd, path, offset, data);
    SDM_ASSIGN_OR_RETURN(const uint64_t got, ReadUpTo(fd, path, buffer, n, first));
    if (got < n) return StateFiles::WriteFd(fd, path, offset, data);  // cut meanwhile
    std::memcpy(buffer + (offset - first), data.data(), data.size());
    ScopedFd direct(::open(path.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC));
    if (direct.get() < 0) return StateFiles::WriteFd(fd, path, offset, data);
    SDM_ASSIGN_OR_RETURN(const uint64_t done,
                         WriteDirectBlocks(direct.get(), path, buffer, n, first));
    // Refused or cut short: the patch through the page cache (the same bytes).
    if (done < n) return StateFiles::WriteFd(fd, path, offset, data);
    return absl::OkStatus();
  }

  // `data` starts at an aligned `offset` from aligned memory: its whole blocks, up to `last`,
  // go out with O_DIRECT (`direct`) as they are, the rest through the page cache (`fd`).
  absl::Status WriteAligned(int direct, int fd, const std::filesystem::path& path, uint64_t offset,
                            absl::string_view data, uint64_t last) {
    const uint64_t n = last - offset;
    SDM_ASSIGN_OR_RETURN(const uint64_t done,
                         WriteDirectBlocks(direct, path, data.data(), n, offset));
    // Refused or cut short off a block boundary: the rest through the page cache.
    if (done < n) return StateFiles::WriteFd(fd, path, offset + done, data.substr(done));
    if (n < data.size()) return StateFiles::WriteFd(fd, path, last, data.substr(n));
    return absl::OkStatus();
  }
};

}  // namespace

StateFiles* StateFiles::Default() {
  static StateFiles files;  // stateless
  return &files;
}

StateFiles* StateFiles::Direct() {
  static DirectStateFiles files;  // stateless (each thread's buffer aside)
  return &files;
}

absl::StatusOr<StateFiles*> StateFilesForIo(absl::string_view name) {
  if (name == "buffered") return StateFiles::Default();
  if (name == "direct") return StateFiles::Direct();
  return absl::InvalidArgumentError(
      absl::StrCat("unknown I/O mode '", name, "' (expected buffered or direct)"));
}

absl::Status StateFiles::WriteFd(int fd, const std::filesystem::path& path, uint64_t offset,
                                 absl::string_view data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n =
        ::pwrite(fd, data.data() + done, data.size() - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("cannot write", path, errno);
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status StateFiles::WriteSource(int fd, const std::filesystem::path& path, uint64_t offset,
                                     const ByteSource& data) {
  if (const char* whole = data.contiguous(); whole != nullptr || data.size() == 0) {
    return WriteFd(fd, path, offset, absl::string_view(whole, data.size()));
  }
  char* chunk = SourceChunkBuffer();
  if (chunk == nullptr) return SourceChunkError(path);
  uint64_t at = offset;  // the file offset of chunk[0]
  uint64_t used = 0;
  // The first chunk ends at a block boundary of the file, so every later one starts at one.
  uint64_t room = kDirectChunk - offset % kDirectBlock;
  // One pass over the source's rows: its deferred checksums are written over their placeholders
  // afterwards (below), in the last chunk before it goes out or over what is already written.
  std::vector<ByteSource::Patch> patches;
  absl::Status written = data.EmitOnePass(
      [&](absl::string_view piece) -> absl::Status {
        while (!piece.empty()) {
          const uint64_t n = std::min<uint64_t>(piece.size(), room - used);
          std::memcpy(chunk + used, piece.data(), n);
          used += n;
          piece.remove_prefix(n);
          if (used == room) {
            SDM_RETURN_IF_ERROR(WriteFd(fd, path, at, absl::string_view(chunk, used)));
            at += used;
            used = 0;
            room = kDirectChunk;
          }
        }
        return absl::OkStatus();
      },
      patches);
  SDM_RETURN_IF_ERROR(written);
  for (const ByteSource::Patch& patch : patches) {
    if (patch.offset > data.size() || data.size() - patch.offset < 8) {  // no wrap-around
      return absl::InternalError(absl::StrCat("cannot write ", path.string(), ": a field at ",
                                              patch.offset, " lies past the data's end"));
    }
    char bytes[8];
    std::memcpy(bytes, &patch.value, 8);  // little-endian, as the formats are (byte_io.h)
    // [begin, begin + 8) in the file: the part from `at` on is still in the chunk.
    const uint64_t begin = offset + patch.offset;
    for (uint64_t i = 0; i < 8; ++i) {
      if (begin + i >= at) chunk[begin + i - at] = bytes[i];
    }
    if (begin < at) {
      const uint64_t n = std::min<uint64_t>(8, at - begin);
      SDM_RETURN_IF_ERROR(WriteFd(fd, path, begin, absl::string_view(bytes, n)));
    }
  }
  if (used > 0) return WriteFd(fd, path, at, absl::string_view(chunk, used));
  return absl::OkStatus();
}

namespace {

// The temporary file of one WriteAtomically() call (the header's comment): the process id, a
// random value drawn once per process (process ids repeat across hosts and containers sharing a
// directory) and a count of calls. The ".tmp" suffix is what a store at Open takes for a leftover.
std::filesystem::path TempPathOf(const std::filesystem::path& path) {
  static const uint64_t process_random = [] {
    std::random_device random;
    return (uint64_t{random()} << 32) | random();
  }();
  static std::atomic<uint64_t> calls{0};
  std::filesystem::path tmp = path;
  tmp += absl::StrCat(".", ::getpid(), "-", absl::Hex(process_random, absl::kZeroPad16), "-",
                      calls.fetch_add(1, std::memory_order_relaxed), ".tmp");
  return tmp;
}

// Whether `fd` is the file named `path` (not one removed, or replaced, since it was opened).
bool IsNamed(int fd, const std::filesystem::path& path) {
  struct stat held {};
  struct stat named {};
  return ::fstat(fd, &held) == 0 && ::stat(path.c_str(), &named) == 0 &&
         held.st_dev == named.st_dev && held.st_ino == named.st_ino;
}

// Creates a new temporary file for a write to `path` (its name in *tmp) and locks it until the
// lock is destroyed. The lock is flock(2)'s, which belongs to this open file description:
// WriteAndSync()'s own descriptor and Direct()'s O_DIRECT one, closed before the rename, leave it
// held (an fcntl lock would end with the first close of any descriptor of the file). A file
// system without flock: the file unlocked (RemoveStrayTemp() cannot lock it either, and leaves
// it).
absl::StatusOr<std::unique_ptr<FileLock>> CreateLockedTemp(const std::filesystem::path& path,
                                                           std::filesystem::path* tmp) {
  constexpr int kAttempts = 4;
  for (int attempt = 1;; ++attempt) {
    *tmp = TempPathOf(path);
    const int fd = ::open(tmp->c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
      if (errno == EEXIST && attempt < kAttempts) continue;  // another process's name: the next
      return Errno("cannot create", *tmp, errno);
    }
    auto lock = std::make_unique<FileLock>(fd);  // closes fd on every return below
    const absl::Status locked = TryFlock(fd, LOCK_EX, *tmp);
    if (absl::IsUnimplemented(locked)) return lock;
    if (absl::IsFailedPrecondition(locked)) {
      // A store opening the directory locked the new file first, took it for a leftover and
      // removes it: written under another name.
      if (attempt < kAttempts) continue;
      return Errno("cannot lock", *tmp, EWOULDBLOCK);
    }
    if (!locked.ok()) return locked;
    // Locked, but perhaps only after such a store removed it (and let it go).
    if (IsNamed(fd, *tmp)) return lock;
    if (attempt == kAttempts) {
      return absl::UnavailableError(
          absl::StrCat("cannot write ", path.string(), ": its temporary files were removed"));
    }
  }
}

}  // namespace

absl::Status StateFiles::WriteAtomically(const std::filesystem::path& path, const ByteSource& data,
                                         bool sync) {
  std::filesystem::path tmp;
  // Held until the rename is done: until then the file is not a leftover (RemoveStrayTemp).
  absl::StatusOr<std::unique_ptr<FileLock>> lock = CreateLockedTemp(path, &tmp);
  if (!lock.ok()) return lock.status();
  absl::Status written = WriteAndSync(tmp, data, sync);
  // Unsynced, the data reaches the device before the name does (the header's file comment).
  if (written.ok() && !sync) written = WriteBack(tmp);
  if (!written.ok()) {
    Remove(tmp).IgnoreError();
    return written;
  }
  if (auto s = Rename(tmp, path); !s.ok()) {
    Remove(tmp).IgnoreError();
    return s;
  }
  if (!sync) return absl::OkStatus();
  return SyncDir(path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path());
}

absl::Status StateFiles::WriteAndSync(const std::filesystem::path& path, const ByteSource& data,
                                      bool sync) {
  ScopedFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return Errno("cannot create", path, errno);
  if (absl::Status s = WriteSource(fd.get(), path, 0, data); !s.ok()) return s;
  if (sync && ::fsync(fd.get()) != 0) return Errno("cannot fsync", path, errno);
  if (::close(fd.Release()) != 0) return Errno("cannot close", path, errno);
  return absl::OkStatus();
}

absl::Status StateFiles::RemoveStrayTemp(const std::filesystem::path& path) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return Errno("cannot open", path, errno);
  }
  SDM_RETURN_IF_ERROR(TryFlock(fd.get(), LOCK_EX, path));  // held: a write under way
  // Its writer renamed it (to its final name) after the open, before letting the lock go.
  if (!IsNamed(fd.get(), path)) return absl::OkStatus();
  return Remove(path);
}

absl::Status StateFiles::WriteAt(const std::filesystem::path& path, uint64_t offset,
                                 const ByteSource& data, bool sync) {
  const bool existed = ::access(path.c_str(), F_OK) == 0;
  ScopedFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (fd.get() < 0) return Errno("cannot open", path, errno);
  // Cut at `offset` before a byte of `data` is written, so that whatever is found after `offset`
  // is a prefix of `data`. Cut after the write, a crash (or a failed write) in between left the new
  // bytes followed by what was there before, a longer torn tail's: bytes the delta log's reader
  // would have to take for damage or for a torn tail without knowing which.
  if (::ftruncate(fd.get(), static_cast<off_t>(offset)) != 0) {
    return Errno("cannot truncate", path, errno);
  }
  if (absl::Status s = WriteSource(fd.get(), path, offset, data); !s.ok()) return s;
  if (sync && ::fsync(fd.get()) != 0) return Errno("cannot fsync", path, errno);
  if (::close(fd.Release()) != 0) return Errno("cannot close", path, errno);
  // A new file's entry is in its directory only once that is fsynced too. A write at offset 0
  // starts a file (a log's first record) even where it existed: an earlier attempt that failed
  // may have created it, and its entry was never fsynced.
  if (sync && (!existed || offset == 0)) {
    return SyncDir(path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path());
  }
  return absl::OkStatus();
}

absl::Status StateFiles::Sync(const std::filesystem::path& path) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Errno("cannot open", path, errno);
  if (::fsync(fd.get()) != 0) return Errno("cannot fsync", path, errno);
  return absl::OkStatus();
}

absl::Status StateFiles::WriteBack(const std::filesystem::path& path) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Errno("cannot open", path, errno);
#if defined(__linux__)
  // Waits for writes under way, starts the rest, waits for those: the whole file (nbytes 0).
  if (::sync_file_range(
          fd.get(), 0, 0,
          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER) != 0) {
    return Errno("cannot write back", path, errno);
  }
#else
  if (::fdatasync(fd.get()) != 0) return Errno("cannot write back", path, errno);
#endif
  return absl::OkStatus();
}

absl::Status StateFiles::SyncDir(const std::filesystem::path& dir) {
  ScopedFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return Errno("cannot open directory", dir, errno);
  if (::fsync(fd.get()) != 0) return Errno("cannot fsync directory", dir, errno);
  return absl::OkStatus();
}

absl::StatusOr<std::string> StateFiles::Read(const std::filesystem::path& path) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Errno("cannot open", path, errno);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return Errno("cannot stat", path, errno);
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::read(fd.get(), out.data() + done, out.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("cannot read", path, errno);
    }
    if (n == 0) break;  // shrank while reading
    done += static_cast<size_t>(n);
  }
  out.resize(done);
  return out;
}

absl::StatusOr<std::string> StateFiles::ReadRange(const std::filesystem::path& path,
                                                  uint64_t offset, uint64_t n) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Errno("cannot open", path, errno);
  std::string out(n, '\0');
  SDM_ASSIGN_OR_RETURN(const uint64_t done, ReadUpTo(fd.get(), path, out.data(), n, offset));
  out.resize(done);
  return out;
}

absl::StatusOr<std::vector<std::string>> StateFiles::List(const std::filesystem::path& dir) {
  std::error_code ec;
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.is_regular_file(ec)) names.push_back(entry.path().filename().string());
  }
  if (ec) return Errno("cannot list", dir, ec.value());
  return names;
}

absl::Status StateFiles::Remove(const std::filesystem::path& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return Errno("cannot remove", path, errno);
  return absl::OkStatus();
}

absl::Status StateFiles::Rename(const std::filesystem::path& from,
                                const std::filesystem::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) return Errno("cannot rename", from, errno);
  return absl::OkStatus();
}

FileLock::~FileLock() { ::close(fd_); }

absl::StatusOr<std::unique_ptr<FileLock>> StateFiles::Lock(const std::filesystem::path& path,
                                                           bool exclusive) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("cannot open", path, errno);
  auto lock = std::make_unique<FileLock>(fd);  // closes fd on every return below
  SDM_RETURN_IF_ERROR(TryFlock(fd, exclusive ? LOCK_EX : LOCK_SH, path));
  if (exclusive) {
    const std::string pid = absl::StrCat(::getpid(), "\n");
    if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) < 0) {
      return Errno("cannot write to", path, errno);
    }
  }
  return lock;
}

int64_t HolderOfLock(const std::filesystem::path& path) {
  std::ifstream in(path);
  int64_t pid = 0;
  if (!(in >> pid) || pid < 0) return 0;
  return pid;
}

absl::Status StateFiles::CreateDirs(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Errno("cannot create directory", dir, ec.value());
  return absl::OkStatus();
}

}  // namespace sdm
