#include <cuda_runtime.h>

#include <cstdio>

#include "kernels/cuda/cuda_runtime_info.h"

namespace sdm::kernels::cuda {

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

std::string DescribeDevice() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string("no CUDA device: ") + cudaGetErrorString(err);
  }
  if (n == 0) return "no CUDA device";
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, 0);
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%s, sm_%d%d, %.1f GiB", p.name, p.major, p.minor,
                static_cast<double>(p.totalGlobalMem) / (1 << 30));
  return buf;
}

}  // namespace sdm::kernels::cuda
