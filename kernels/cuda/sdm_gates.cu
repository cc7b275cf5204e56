#include <cuda_runtime.h>

#include "kernels/common/sdm_math.h"
#include "kernels/cuda/sdm_gates.h"

namespace sdm::kernels::cuda {
namespace {

// One thread per (row, head).
__global__ void SdmGatesKernel(const float* a, const float* b, const float* a_log,
                               const float* dt_bias, int64_t rows, int64_t heads, float* alpha,
                               float* beta) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * heads) return;
  const int64_t h = i % heads;
  alpha[i] = expf(SdmLogDecay(a_log[h], a[i], dt_bias[h]));
  beta[i] = Sigmoid(b[i]);
}

// RAII device buffer.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) { ok_ = cudaMalloc(&ptr_, bytes) == cudaSuccess; }
  ~DeviceBuffer() {
    if (ok_) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  float* get() const { return static_cast<float*>(ptr_); }
  bool ok() const { return ok_; }

 private:
  void* ptr_ = nullptr;
  bool ok_ = false;
};

}  // namespace

bool SdmGatesOnDevice(const float* a, const float* b, const float* a_log, const float* dt_bias,
                      int64_t rows, int64_t heads, float* alpha, float* beta) {
  const size_t n = static_cast<size_t>(rows * heads) * sizeof(float);
  const size_t hn = static_cast<size_t>(heads) * sizeof(float);
  DeviceBuffer da(n), db(n), dl(hn), dd(hn), dalpha(n), dbeta(n);
  if (!da.ok() || !db.ok() || !dl.ok() || !dd.ok() || !dalpha.ok() || !dbeta.ok()) return false;
  bool ok = cudaMemcpy(da.get(), a, n, cudaMemcpyHostToDevice) == cudaSuccess &&
            cudaMemcpy(db.get(), b, n, cudaMemcpyHostToDevice) == cudaSuccess &&
            cudaMemcpy(dl.get(), a_log, hn, cudaMemcpyHostToDevice) == cudaSuccess &&
            cudaMemcpy(dd.get(), dt_bias, hn, cudaMemcpyHostToDevice) == cudaSuccess;
  if (!ok) return false;
  const int threads = 256;
  const int blocks = static_cast<int>((rows * heads + threads - 1) / threads);
  SdmGatesKernel<<<blocks, threads>>>(da.get(), db.get(), dl.get(), dd.get(), rows, heads,
                                      dalpha.get(), dbeta.get());
  if (cudaGetLastError() != cudaSuccess) return false;
  return cudaMemcpy(alpha, dalpha.get(), n, cudaMemcpyDeviceToHost) == cudaSuccess &&
         cudaMemcpy(beta, dbeta.get(), n, cudaMemcpyDeviceToHost) == cudaSuccess;
}

}  // namespace sdm::kernels::cuda
