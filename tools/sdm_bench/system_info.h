// What a benchmark report must say about where it ran: the machine (CPU, threads, memory, kernel,
// load), the build (compiler, flags, OpenBLAS, git commit) and the machine's memory bandwidth,
// measured in the same run as the results it qualifies.
#ifndef SDMSERVE_TOOLS_SDM_BENCH_SYSTEM_INFO_H_
#define SDMSERVE_TOOLS_SDM_BENCH_SYSTEM_INFO_H_

#include <cstdint>
#include <string>

#include "nlohmann/json.hpp"

namespace sdm::bench {

// Memory bandwidth over two buffers of `buffer_bytes` each (far larger than the last-level
// cache), split across `threads` threads: the best of several rounds of each measurement.
struct Bandwidth {
  double copy_gbps = 0;  // memcpy, counting the bytes read plus the bytes written
  double read_gbps = 0;  // streaming read (an integer sum over the buffer)
  double seconds = 0;    // wall time the measurement took
};
Bandwidth MeasureBandwidth(int64_t buffer_bytes, int threads);

// {"cpu", "hardware_threads", "memory_gb", "kernel", "load_average_start": [1, 5, 15 min]}.
nlohmann::json MachineInfo();
// The 1, 5 and 15 minute load averages, as a JSON array and as text ("1.23, 0.98, 0.75").
nlohmann::json LoadAverage();
std::string LoadAverageText();
// Peak resident memory of this process so far, in bytes.
double PeakRssBytes();
// {"compiler", "build_type", "cxx_flags", "cpu_arch_flags", "assertions", "openblas",
//  "git_commit", "git_dirty"} (git fields empty when the source tree is not a git checkout).
nlohmann::json BuildInfo();
// The current UTC time as 2024-01-31T12:34:56Z.
std::string UtcNow();

}  // namespace sdm::bench

#endif  // SDMSERVE_TOOLS_SDM_BENCH_SYSTEM_INFO_H_
