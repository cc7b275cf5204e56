// A file descriptor closed when its owner goes out of scope (every return path of a function that
// opens one). Not copyable; Release() hands the descriptor back (to close it and see the error).
// Thread-compatible.
#ifndef SDMSERVE_BASE_SCOPED_FD_H_
#define SDMSERVE_BASE_SCOPED_FD_H_

#include <unistd.h>

namespace sdm {

class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;

  int get() const { return fd_; }  // -1 (or any negative value): none
  int Release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

}  // namespace sdm

#endif  // SDMSERVE_BASE_SCOPED_FD_H_
