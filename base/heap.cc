#include "base/heap.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/check.h"
#include "base/thread_name.h"

#if defined(__GLIBC__)
#include <malloc.h>
#define SDM_HAVE_GLIBC_MALLOC 1
#if __GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33)
#define SDM_HAVE_MALLINFO2 1
#endif
#endif

namespace sdm {

bool SetMmapThreshold(size_t bytes) {
#if defined(SDM_HAVE_GLIBC_MALLOC)
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr) return false;
  if (const char* t = std::getenv("GLIBC_TUNABLES");
      t != nullptr && std::strstr(t, "glibc.malloc.mmap_threshold") != nullptr) {
    return false;
  }
  // The trim threshold as glibc's dynamic rule would pair it (twice the mmap threshold): fixed
  // too, so that an arena's top shrinks back past it.
  return mallopt(M_MMAP_THRESHOLD, static_cast<int>(bytes)) == 1 &&
         mallopt(M_TRIM_THRESHOLD, static_cast<int>(2 * bytes)) == 1;
#else
  (void)bytes;
  return false;
#endif
}

bool SetArenaMax(int arenas) {
#if defined(SDM_HAVE_GLIBC_MALLOC)
  if (arenas < 1) return false;
  if (std::getenv("MALLOC_ARENA_MAX") != nullptr) return false;
  if (const char* t = std::getenv("GLIBC_TUNABLES");
      t != nullptr && std::strstr(t, "glibc.malloc.arena_max") != nullptr) {
    return false;
  }
  return mallopt(M_ARENA_MAX, arenas) == 1;
#else
  (void)arenas;
  return false;
#endif
}

namespace {
constexpr char kTcacheTunable[] = "glibc.malloc.tcache_count";
}  // namespace

int TcacheCountFromEnvironment() {
  const char* t = std::getenv("GLIBC_TUNABLES");
  if (t == nullptr) return -1;
  const char* at = std::strstr(t, kTcacheTunable);
  if (at == nullptr || at[sizeof(kTcacheTunable) - 1] != '=') return -1;
  const char* value = at + sizeof(kTcacheTunable);
  const char* end = std::strchr(value, ':');
  int count = -1;
  if (!absl::SimpleAtoi(end == nullptr ? std::string(value) : std::string(value, end), &count)) {
    return -1;
  }
  return count;
}

absl::Status ReexecWithTcacheCount(int count) {
  if (count < 0) return absl::OkStatus();
  const char* env = std::getenv("GLIBC_TUNABLES");
  if (env != nullptr && std::strstr(env, kTcacheTunable) != nullptr) {
    return absl::OkStatus();  // set by the environment (or by the re-execution itself)
  }
  const bool had_tunables = env != nullptr;
  const std::string tunables = had_tunables ? env : "";
  std::ifstream cmdline("/proc/self/cmdline", std::ios::binary);
  const std::string raw((std::istreambuf_iterator<char>(cmdline)),
                        std::istreambuf_iterator<char>());
  if (!cmdline.good() && !cmdline.eof()) {
    return absl::UnavailableError("cannot read /proc/self/cmdline to re-execute");
  }
  std::vector<std::string> args;
  for (size_t at = 0; at < raw.size();) {
    const size_t end = raw.find('\0', at);
    args.push_back(raw.substr(at, end == std::string::npos ? std::string::npos : end - at));
    if (end == std::string::npos) break;
    at = end + 1;
  }
  if (args.empty()) return absl::UnavailableError("empty /proc/self/cmdline");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string value =
      absl::StrCat(tunables.empty() ? "" : absl::StrCat(tunables, ":"), kTcacheTunable, "=", count);
  if (setenv("GLIBC_TUNABLES", value.c_str(), 1) != 0) {
    return absl::Status(absl::ErrnoToStatusCode(errno),
                        absl::StrCat("setenv GLIBC_TUNABLES: ", std::strerror(errno)));
  }
  execv("/proc/self/exe", argv.data());
  const int err = errno;  // execv returns only on failure: restore the environment
  if (had_tunables) {
    setenv("GLIBC_TUNABLES", tunables.c_str(), 1);
  } else {
    unsetenv("GLIBC_TUNABLES");
  }
  return absl::Status(
      absl::ErrnoToStatusCode(err),
      absl::StrCat("re-executing /proc/self/exe with a tcache count: ", std::strerror(err)));
}

HeapUsage GetHeapUsage() {
  HeapUsage u;
#if defined(SDM_HAVE_MALLINFO2)
  const struct mallinfo2 m = mallinfo2();
  u.in_use_bytes = static_cast<int64_t>(m.uordblks + m.hblkhd);
  u.system_bytes = static_cast<int64_t>(m.arena + m.hblkhd);
  u.mapped_blocks = static_cast<int64_t>(m.hblks);
#endif
  return u;
}

bool TrimHeap() {
#if defined(SDM_HAVE_GLIBC_MALLOC)
  return malloc_trim(0) == 1;
#else
  return false;
#endif
}

HeapTrimSchedule::HeapTrimSchedule(absl::Duration interval, int64_t slack_bytes)
    : interval_(interval), slack_bytes_(slack_bytes) {}

bool HeapTrimSchedule::Sample(absl::Time now, int64_t in_use_bytes) {
  if (last_trim_ == absl::InfinitePast()) last_trim_ = now;
  while (!peaks_.empty() && peaks_.front().first <= now - interval_) peaks_.pop_front();
  while (!peaks_.empty() && peaks_.back().second <= in_use_bytes) peaks_.pop_back();
  peaks_.emplace_back(now, in_use_bytes);
  const int64_t peak = peaks_.front().second;
  if (now - last_trim_ < interval_ || peak - in_use_bytes > slack_bytes_) return false;
  last_trim_ = now;
  return true;
}

HeapTrimmer::HeapTrimmer(absl::Duration interval) : interval_(interval) {
  SDM_CHECK(interval > absl::ZeroDuration());
  thread_ = std::thread([this] { Loop(); });
}

HeapTrimmer::~HeapTrimmer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    changed_.SignalAll();
  }
  thread_.join();
}

int64_t HeapTrimmer::trims() const {
  absl::MutexLock lock(&mu_);
  return trims_;
}

void HeapTrimmer::AwaitTrims(int64_t n) const {
  absl::MutexLock lock(&mu_);
  while (trims_ < n) changed_.Wait(&mu_);
}

void HeapTrimmer::Loop() {
  SetCurrentThreadName("sdm-heap-trim");
  HeapTrimSchedule schedule(interval_);
  const absl::Duration sample_every = std::min(interval_ / 4, absl::Seconds(1));
  absl::MutexLock lock(&mu_);
  while (true) {
    mu_.Unlock();
    const bool trim = schedule.Sample(absl::Now(), GetHeapUsage().in_use_bytes);
    if (trim) TrimHeap();
    mu_.Lock();
    if (trim) {
      ++trims_;
      changed_.SignalAll();
    }
    const absl::Time deadline = absl::Now() + sample_every;
    while (!stop_ && absl::Now() < deadline) changed_.WaitWithDeadline(&mu_, deadline);
    if (stop_) return;
  }
}

}  // namespace sdm
