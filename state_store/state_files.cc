#include "state_store/state_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace sdm {
namespace {

absl::Status Errno(absl::string_view what, const std::filesystem::path& path, int err) {
  std::string msg = absl::StrCat(what, " ", path.string(), ": ", std::strerror(err));
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(msg);
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  return absl::InternalError(msg);
}

// Closes a file descriptor on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int Release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

}  // namespace

StateFiles* StateFiles::Default() {
  static StateFiles files;  // stateless
  return &files;
}

absl::Status StateFiles::WriteAtomically(const std::filesystem::path& path, absl::string_view data,
                                         bool sync) {
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  if (auto s = WriteAndSync(tmp, data, sync); !s.ok()) {
    Remove(tmp).IgnoreError();
    return s;
  }
  if (auto s = Rename(tmp, path); !s.ok()) {
    Remove(tmp).IgnoreError();
    return s;
  }
  if (!sync) return absl::OkStatus();
  return SyncDir(path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path());
}

absl::Status StateFiles::WriteAndSync(const std::filesystem::path& path, absl::string_view data,
                                      bool sync) {
  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return Errno("cannot create", path, errno);
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd.get(), data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("cannot write", path, errno);
    }
    done += static_cast<size_t>(n);
  }
  if (sync && ::fsync(fd.get()) != 0) return Errno("cannot fsync", path, errno);
  if (::close(fd.Release()) != 0) return Errno("cannot close", path, errno);
  return absl::OkStatus();
}

absl::Status StateFiles::WriteAt(const std::filesystem::path& path, uint64_t offset,
                                 absl::string_view data, bool sync) {
  const bool existed = ::access(path.c_str(), F_OK) == 0;
  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
  if (fd.get() < 0) return Errno("cannot open", path, errno);
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::pwrite(fd.get(), data.data() + done, data.size() - done,
                               static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("cannot write", path, errno);
    }
    done += static_cast<size_t>(n);
  }
  if (::ftruncate(fd.get(), static_cast<off_t>(offset + data.size())) != 0) {
    return Errno("cannot truncate", path, errno);
  }
  if (sync && ::fsync(fd.get()) != 0) return Errno("cannot fsync", path, errno);
  if (::close(fd.Release()) != 0) return Errno("cannot close", path, errno);
  if (sync && !existed) {
    return SyncDir(path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path());
  }
  return absl::OkStatus();
}

absl::Status StateFiles::Sync(const std::filesystem::path& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Errno("cannot open", path, errno);
  if (::fsync(fd.get()) != 0) return Errno("cannot fsync", path, errno);
  return absl::OkStatus();
}

absl::Status StateFiles::SyncDir(const std::filesystem::path& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return Errno("cannot open directory", dir, errno);
  if (::fsync(fd.get()) != 0) return Errno("cannot fsync directory", dir, errno);
  return absl::OkStatus();
}

absl::StatusOr<std::string> StateFiles::Read(const std::filesystem::path& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
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
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Errno("cannot open", path, errno);
  std::string out(n, '\0');
  size_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd.get(), out.data() + done, n - done, offset + done);
    if (got < 0) {
      if (errno == EINTR) continue;
      return Errno("cannot read", path, errno);
    }
    if (got == 0) break;  // end of file
    done += static_cast<size_t>(got);
  }
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

absl::Status StateFiles::CreateDirs(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Errno("cannot create directory", dir, ec.value());
  return absl::OkStatus();
}

}  // namespace sdm
