// SDM_HOST_DEVICE marks math shared by the CPU kernels and the CUDA kernels: compiled by the host
// compiler as ordinary inline functions (and tested there), by nvcc for both sides.
#ifndef SDMSERVE_KERNELS_COMMON_HOST_DEVICE_H_
#define SDMSERVE_KERNELS_COMMON_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define SDM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SDM_HOST_DEVICE inline
#endif

#endif  // SDMSERVE_KERNELS_COMMON_HOST_DEVICE_H_
