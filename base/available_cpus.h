// How many CPUs this process may use, for sizing thread pools by default.
//
// std::thread::hardware_concurrency() counts the machine's CPUs, whatever the process is allowed:
// a container limited to 8 CPUs of a 64-core node (its cpuset, or a Kubernetes CPU limit, which
// is a CFS quota) would start 64 busy-waiting engine threads, throttled by the quota.
//
// Thread-safety: free functions; AvailableCpus reads /proc and /sys on each call.
#ifndef SDMSERVE_BASE_AVAILABLE_CPUS_H_
#define SDMSERVE_BASE_AVAILABLE_CPUS_H_

#include <optional>

#include "absl/strings/string_view.h"

namespace sdm {

// The CPUs of the calling thread's affinity mask (taskset, a cpuset), capped by the CPU quota of
// the process's cgroup (v2: cpu.max of its cgroup or an ancestor's, rounded up). At least 1; the
// machine's count where the mask cannot be read.
int AvailableCpus();

// The CPUs a cgroup v2 `cpu.max` text allows ("QUOTA PERIOD" in microseconds, rounded up, at
// least 1); nullopt for no limit ("max ...") or text that does not parse.
std::optional<int> CpusOfCgroupQuota(absl::string_view cpu_max);

}  // namespace sdm

#endif  // SDMSERVE_BASE_AVAILABLE_CPUS_H_
