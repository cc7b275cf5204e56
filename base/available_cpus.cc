#include "base/available_cpus.h"

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace sdm {
namespace {

std::optional<std::string> ReadSmallFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The smallest quota of the process's cgroup and its ancestors (a limit set on a parent applies
// to its children). The cgroup's path is the "0::PATH" line of /proc/self/cgroup (v2 only).
std::optional<int> CgroupQuotaCpus() {
  const std::optional<std::string> self = ReadSmallFile("/proc/self/cgroup");
  if (!self.has_value()) return std::nullopt;
  std::string relative;
  for (absl::string_view line : absl::StrSplit(*self, '\n')) {
    if (line.substr(0, 3) == "0::") relative = std::string(line.substr(3));
  }
  const std::filesystem::path root = "/sys/fs/cgroup";
  std::filesystem::path dir = root;
  const std::filesystem::path below = std::filesystem::path(relative).lexically_normal();
  if (below.has_relative_path() && *below.relative_path().begin() != "..") {
    dir /= below.relative_path();
  }
  std::optional<int> cpus;
  while (true) {
    if (const std::optional<std::string> max = ReadSmallFile(dir / "cpu.max")) {
      if (const std::optional<int> limit = CpusOfCgroupQuota(*max)) {
        cpus = cpus.has_value() ? std::min(*cpus, *limit) : *limit;
      }
    }
    if (dir == root) break;
    dir = dir.parent_path();
  }
  return cpus;
}

}  // namespace

std::optional<int> CpusOfCgroupQuota(absl::string_view cpu_max) {
  const std::vector<absl::string_view> fields =
      absl::StrSplit(absl::StripAsciiWhitespace(cpu_max), ' ', absl::SkipEmpty());
  int64_t quota = 0;
  int64_t period = 0;
  if (fields.size() != 2 || !absl::SimpleAtoi(fields[0], &quota) ||
      !absl::SimpleAtoi(fields[1], &period) || quota <= 0 || period <= 0) {
    return std::nullopt;  // "max PERIOD" (no limit) included
  }
  return static_cast<int>(std::max<int64_t>(1, (quota + period - 1) / period));
}

int AvailableCpus() {
  int cpus = 0;
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0) cpus = CPU_COUNT(&mask);
  if (cpus <= 0) cpus = static_cast<int>(std::thread::hardware_concurrency());
  if (const std::optional<int> quota = CgroupQuotaCpus()) cpus = std::min(cpus, *quota);
  return std::max(1, cpus);
}

}  // namespace sdm
