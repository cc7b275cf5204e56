// Which device a benchmark runs on, and the device's own bandwidth ceiling, shared by
// `sdm-bench decode`, `state` and `kernels`. Compiled in every build; the CUDA parts answer
// "built without CUDA" where the build has none (SDM_HAVE_CUDA unset).
#ifndef SDMSERVE_TOOLS_SDM_BENCH_DEVICE_INFO_H_
#define SDMSERVE_TOOLS_SDM_BENCH_DEVICE_INFO_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/engine.h"

namespace sdm::bench {

// True when this binary was built with the CUDA backend.
bool BuiltWithCuda();

// The device a run will use (never kAuto), resolved as Engine::Create does: kAuto is CUDA when
// the build has it and a device is present, else the CPU. kCuda fails with Unimplemented on a
// build without CUDA (a usage error: exit 2) and Unavailable when no device is present, each
// with a message that says which.
absl::StatusOr<EngineDevice> ResolveBenchDevice(EngineDevice requested);

// Device-to-device cudaMemcpy between two device buffers of `buffer_bytes` each on a dedicated
// stream: `warmup` untimed copies, then `reps` copies each timed with cudaEvents. Rates count the
// bytes read plus the bytes written (2 x buffer_bytes per copy), the GPU convention of
// docs/model-spec.md §9 (about 4.3 TB/s on an H200).
struct DeviceCopyBandwidth {
  int64_t buffer_bytes = 0;
  int reps = 0;
  double median_s = 0;
  double min_s = 0;
  double median_gbps = 0;  // 2 x buffer_bytes / median_s
  double best_gbps = 0;    // 2 x buffer_bytes / min_s
};
absl::StatusOr<DeviceCopyBandwidth> MeasureDeviceCopyBandwidth(int64_t buffer_bytes, int warmup,
                                                               int reps);

}  // namespace sdm::bench

#endif  // SDMSERVE_TOOLS_SDM_BENCH_DEVICE_INFO_H_
