// What the CUDA backend can see of the machine. Compiled only when the build has CUDA
// (SDM_HAVE_CUDA); callers on CPU-only builds use the stub answers in this header.
#ifndef SDMSERVE_KERNELS_CUDA_CUDA_RUNTIME_INFO_H_
#define SDMSERVE_KERNELS_CUDA_CUDA_RUNTIME_INFO_H_

#include <string>

namespace sdm::kernels::cuda {

#if defined(SDM_HAVE_CUDA)
// Number of CUDA devices usable by this process (0 when there is no driver or no device).
int DeviceCount();
// A one-line description of device 0, or why there is none.
std::string DescribeDevice();
#else
inline int DeviceCount() { return 0; }
inline std::string DescribeDevice() { return "built without CUDA"; }
#endif

}  // namespace sdm::kernels::cuda

#endif  // SDMSERVE_KERNELS_CUDA_CUDA_RUNTIME_INFO_H_
