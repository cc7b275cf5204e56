// RAII owners for CUDA resources (device and pinned host memory, streams, events) and the error
// plumbing the CUDA backend shares. Host code only; every owner frees what it holds exactly once.
// Allocation failures are reported (ok() / cudaError_t), never thrown.
#ifndef SDMSERVE_KERNELS_CUDA_CUDA_UTIL_H_
#define SDMSERVE_KERNELS_CUDA_CUDA_UTIL_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "base/status_macros.h"

// SDM_RETURN_IF_ERROR(cudaCall(...)) returns the CUDA error from an enclosing function that
// returns cudaError_t.
namespace sdm::base_internal {
inline constexpr bool IsOk(cudaError_t err) { return err == cudaSuccess; }
}  // namespace sdm::base_internal

namespace sdm::kernels::cuda {

// Whether `p` is a multiple of `bytes` (the alignment a kernel's vector accesses need).
inline bool Aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// "cudaErrorMemoryAllocation: out of memory" style text for messages.
inline std::string CudaErrorText(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

// Where a CudaBuffer's memory comes from: device memory (cudaMalloc; never managed memory) or
// page-locked host memory (cudaMallocHost) for async copies.
struct DeviceMemory {
  static cudaError_t Allocate(void** p, size_t bytes) { return cudaMalloc(p, bytes); }
  static void Free(void* p) { cudaFree(p); }
};
struct PinnedHostMemory {
  static cudaError_t Allocate(void** p, size_t bytes) { return cudaMallocHost(p, bytes); }
  static void Free(void* p) { cudaFreeHost(p); }
};

// `count` elements of T in memory from `Memory`, freed exactly once.
template <typename T, typename Memory>
class CudaBuffer {
 public:
  CudaBuffer() = default;
  explicit CudaBuffer(size_t count) { Allocate(count); }
  ~CudaBuffer() { Reset(); }
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;
  CudaBuffer(CudaBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  CudaBuffer& operator=(CudaBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }

  // Frees what is held and allocates `count` elements (0: holds nothing).
  cudaError_t Allocate(size_t count) {
    Reset();
    if (count == 0) return cudaSuccess;
    void* p = nullptr;
    const cudaError_t err = Memory::Allocate(&p, count * sizeof(T));
    if (err != cudaSuccess) {
      cudaGetLastError();  // allocation errors are not sticky; clear the last-error slot
      return err;
    }
    ptr_ = static_cast<T*>(p);
    count_ = count;
    return cudaSuccess;
  }
  void Reset() {
    if (ptr_ != nullptr) Memory::Free(ptr_);
    ptr_ = nullptr;
    count_ = 0;
  }

  T* get() const { return ptr_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }
  bool ok() const { return ptr_ != nullptr || count_ == 0; }

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

template <typename T>
using DeviceBuffer = CudaBuffer<T, DeviceMemory>;
template <typename T>
using PinnedBuffer = CudaBuffer<T, PinnedHostMemory>;

// A non-blocking stream (does not synchronise with the legacy default stream).
class CudaStream {
 public:
  CudaStream() = default;
  ~CudaStream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaError_t Create() { return cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

class CudaEvent {
 public:
  CudaEvent() = default;
  ~CudaEvent() {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  // timing: false makes the event cheaper (no timestamp) for pure ordering.
  cudaError_t Create(bool timing = false) {
    return cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming);
  }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Blocks of `threads` covering `n` items.
inline unsigned int BlocksFor(int64_t n, int threads) {
  return static_cast<unsigned int>((n + threads - 1) / threads);
}

}  // namespace sdm::kernels::cuda

#endif  // SDMSERVE_KERNELS_CUDA_CUDA_UTIL_H_
