#include "tools/sdm_bench/system_info.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/utsname.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

extern "C" char* openblas_get_config(void);

#ifndef SDM_SOURCE_DIR
#define SDM_SOURCE_DIR ""
#endif
#ifndef SDM_BUILD_TYPE
#define SDM_BUILD_TYPE "unknown"
#endif
#ifndef SDM_BUILD_CXX_FLAGS
#define SDM_BUILD_CXX_FLAGS "unknown"
#endif
#ifndef SDM_BUILD_CPU_ARCH_FLAGS
#define SDM_BUILD_CPU_ARCH_FLAGS "unknown"
#endif

namespace sdm::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Runs fn(thread_index, begin, end) over [0, n) split into `threads` contiguous parts; returns
// the wall time in seconds.
template <typename Fn>
double TimeSplit(int64_t n, int threads, Fn&& fn) {
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> pool;
  const int64_t part = (n + threads - 1) / threads;
  for (int t = 1; t < threads; ++t) {
    const int64_t b = std::min(n, t * part), e = std::min(n, (t + 1) * part);
    pool.emplace_back([&fn, t, b, e] { fn(t, b, e); });
  }
  fn(0, 0, std::min(n, part));
  for (std::thread& th : pool) th.join();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The first line of a command's output, without the newline; empty on failure.
std::string CommandLine(const std::string& command) {
  FILE* pipe = ::popen((command + " 2>/dev/null").c_str(), "r");
  if (pipe == nullptr) return "";
  std::array<char, 512> line{};
  std::string out;
  if (std::fgets(line.data(), line.size(), pipe) != nullptr) out = line.data();
  ::pclose(pipe);
  return std::string(absl::StripTrailingAsciiWhitespace(out));
}

}  // namespace

Bandwidth MeasureBandwidth(int64_t buffer_bytes, int threads) {
  threads = std::max(1, threads);
  const int64_t words = std::max<int64_t>(buffer_bytes / 8, 1 << 20);
  const int64_t bytes = words * 8;
  auto src = std::make_unique<uint64_t[]>(words);
  auto dst = std::make_unique<uint64_t[]>(words);
  // Touch every page (in parallel, as the measurement will) so no page fault is timed.
  TimeSplit(words, threads, [&](int, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) src[i] = static_cast<uint64_t>(i);
    std::memset(dst.get() + b, 0, (e - b) * 8);
  });
  const Clock::time_point start = Clock::now();
  Bandwidth bw;
  auto rounds = [&](auto&& one_round, double bytes_per_round) {
    double best = 0;
    const Clock::time_point t0 = Clock::now();
    // At least 4 rounds; more (up to 40) until 0.6 s have passed.
    for (int r = 0;
         r < 4 || (r < 40 && std::chrono::duration<double>(Clock::now() - t0).count() < 0.6); ++r) {
      best = std::max(best, bytes_per_round / one_round() / 1e9);
    }
    return best;
  };
  bw.copy_gbps = rounds(
      [&] {
        return TimeSplit(words, threads, [&](int, int64_t b, int64_t e) {
          std::memcpy(dst.get() + b, src.get() + b, (e - b) * 8);
        });
      },
      2.0 * bytes);
  std::vector<uint64_t> sums(threads);
  bw.read_gbps = rounds(
      [&] {
        return TimeSplit(words, threads, [&](int t, int64_t b, int64_t e) {
          uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
          int64_t i = b;
          for (; i + 4 <= e; i += 4) {
            a0 += src[i];
            a1 += src[i + 1];
            a2 += src[i + 2];
            a3 += src[i + 3];
          }
          for (; i < e; ++i) a0 += src[i];
          sums[t] = a0 + a1 + a2 + a3;
        });
      },
      static_cast<double>(bytes));
  // Keep the sums observable so the reads cannot be optimised away.
  volatile uint64_t sink = 0;
  for (uint64_t s : sums) sink = sink + s;
  (void)sink;
  bw.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return bw;
}

nlohmann::json LoadAverage() {
  double load[3] = {0, 0, 0};
  if (::getloadavg(load, 3) != 3) return nlohmann::json::array();
  return {load[0], load[1], load[2]};
}

std::string LoadAverageText() {
  double load[3] = {0, 0, 0};
  if (::getloadavg(load, 3) != 3) return "unknown";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f, %.2f, %.2f", load[0], load[1], load[2]);
  return buf;
}

nlohmann::json MachineInfo() {
  nlohmann::json m;
  std::string cpu = "unknown";
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (absl::StartsWith(line, "model name")) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        cpu = std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
      }
      break;
    }
  }
  m["cpu"] = cpu;
  m["hardware_threads"] = std::thread::hardware_concurrency();
  double mem_gb = 0;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    if (absl::StartsWith(line, "MemTotal:")) {
      mem_gb = std::atof(line.c_str() + 9) * 1024.0 / (1u << 30);
      break;
    }
  }
  m["memory_gib"] = mem_gb;
  struct utsname u;
  m["kernel"] = ::uname(&u) == 0 ? absl::StrCat(u.sysname, " ", u.release, " ", u.machine) : "";
  m["load_average_start"] = LoadAverage();
  return m;
}

double PeakRssBytes() {
  struct rusage usage;
  if (::getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return static_cast<double>(usage.ru_maxrss) * 1024.0;  // Linux reports kilobytes
}

nlohmann::json BuildInfo() {
  nlohmann::json b;
#if defined(__clang__)
  b["compiler"] = absl::StrCat("clang ", __clang_version__);
#elif defined(__GNUC__)
  b["compiler"] = absl::StrCat("gcc ", __VERSION__);
#else
  b["compiler"] = "unknown";
#endif
  b["build_type"] = SDM_BUILD_TYPE;
  b["cxx_flags"] = SDM_BUILD_CXX_FLAGS;
  b["cpu_arch_flags"] = SDM_BUILD_CPU_ARCH_FLAGS;
#ifdef NDEBUG
  b["assertions"] = "off (NDEBUG)";
#else
  b["assertions"] = "on";
#endif
  const char* blas = openblas_get_config();
  b["openblas"] = blas != nullptr ? std::string(absl::StripAsciiWhitespace(blas)) : "";
  const std::string src = SDM_SOURCE_DIR;
  b["source_dir"] = src;
  b["git_commit"] =
      src.empty() ? "" : CommandLine("git -C '" + src + "' rev-parse --short=12 HEAD");
  b["git_dirty"] =
      !src.empty() &&
      !CommandLine("git -C '" + src + "' status --porcelain --untracked-files=no").empty();
  return b;
}

std::string UtcNow() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace sdm::bench
