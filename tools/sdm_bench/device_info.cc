#include "tools/sdm_bench/device_info.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/percentile.h"
#include "kernels/cuda/cuda_runtime_info.h"

#if defined(SDM_HAVE_CUDA)
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_util.h"
#endif

namespace sdm::bench {

bool BuiltWithCuda() {
#if defined(SDM_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

absl::StatusOr<EngineDevice> ResolveBenchDevice(EngineDevice requested) {
  switch (requested) {
    case EngineDevice::kCpu:
      return EngineDevice::kCpu;
    case EngineDevice::kAuto:
      return kernels::cuda::DeviceCount() > 0 ? EngineDevice::kCuda : EngineDevice::kCpu;
    case EngineDevice::kCuda:
      if (!BuiltWithCuda()) {
        return absl::UnimplementedError(
            "--device cuda: this sdm-bench was built without CUDA (configure where nvcc is found, "
            "with -DSDM_CUDA=ON)");
      }
      if (kernels::cuda::DeviceCount() == 0) {
        return absl::UnavailableError(
            absl::StrCat("--device cuda: no CUDA device (", kernels::cuda::DescribeDevice(), ")"));
      }
      return EngineDevice::kCuda;
  }
  return absl::InvalidArgumentError("unknown device");
}

#if defined(SDM_HAVE_CUDA)

namespace {

absl::Status Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  const std::string text = kernels::cuda::CudaErrorText(err);
  cudaGetLastError();  // clear a non-sticky error so later calls are not blamed for it
  return err == cudaErrorMemoryAllocation
             ? absl::ResourceExhaustedError(absl::StrCat(what, ": ", text))
             : absl::InternalError(absl::StrCat(what, ": ", text));
}

}  // namespace

absl::StatusOr<DeviceCopyBandwidth> MeasureDeviceCopyBandwidth(int64_t buffer_bytes, int warmup,
                                                               int reps) {
  namespace kc = kernels::cuda;
  if (buffer_bytes <= 0 || reps < 1 || warmup < 0) {
    return absl::InvalidArgumentError("device copy bandwidth: bad buffer size or repetitions");
  }
  kc::DeviceBuffer<unsigned char> src, dst;
  if (auto s = Check(src.Allocate(buffer_bytes), "allocating the copy source"); !s.ok()) return s;
  if (auto s = Check(dst.Allocate(buffer_bytes), "allocating the copy destination"); !s.ok()) {
    return s;
  }
  kc::CudaStream stream;
  kc::CudaEvent start, stop;
  if (auto s = Check(stream.Create(), "creating a stream"); !s.ok()) return s;
  if (auto s = Check(start.Create(/*timing=*/true), "creating an event"); !s.ok()) return s;
  if (auto s = Check(stop.Create(/*timing=*/true), "creating an event"); !s.ok()) return s;
  // Touch both buffers once (first-use page mapping is not what we measure).
  if (auto s = Check(cudaMemsetAsync(src.get(), 0x3c, buffer_bytes, stream.get()), "memset");
      !s.ok()) {
    return s;
  }
  if (auto s = Check(cudaMemsetAsync(dst.get(), 0, buffer_bytes, stream.get()), "memset");
      !s.ok()) {
    return s;
  }
  std::vector<double> times;
  for (int i = 0; i < warmup + reps; ++i) {
    if (auto s = Check(cudaEventRecord(start.get(), stream.get()), "recording an event"); !s.ok()) {
      return s;
    }
    if (auto s = Check(cudaMemcpyAsync(dst.get(), src.get(), buffer_bytes, cudaMemcpyDeviceToDevice,
                                       stream.get()),
                       "device-to-device copy");
        !s.ok()) {
      return s;
    }
    if (auto s = Check(cudaEventRecord(stop.get(), stream.get()), "recording an event"); !s.ok()) {
      return s;
    }
    if (auto s = Check(cudaEventSynchronize(stop.get()), "waiting for the copy"); !s.ok()) {
      return s;
    }
    float ms = 0;
    if (auto s = Check(cudaEventElapsedTime(&ms, start.get(), stop.get()), "reading an event");
        !s.ok()) {
      return s;
    }
    if (i >= warmup) times.push_back(ms * 1e-3);
  }
  std::sort(times.begin(), times.end());
  DeviceCopyBandwidth bw;
  bw.buffer_bytes = buffer_bytes;
  bw.reps = reps;
  bw.median_s = PercentileOfSorted(times, 50);
  bw.min_s = times.front();
  bw.median_gbps = 2.0 * static_cast<double>(buffer_bytes) / bw.median_s / 1e9;
  bw.best_gbps = 2.0 * static_cast<double>(buffer_bytes) / bw.min_s / 1e9;
  return bw;
}

#else

absl::StatusOr<DeviceCopyBandwidth> MeasureDeviceCopyBandwidth(int64_t, int, int) {
  return absl::UnimplementedError("device copy bandwidth: this sdm-bench was built without CUDA");
}

#endif

}  // namespace sdm::bench
