#include <cuda_runtime.h>

#include <cstdlib>
__global__ void K(int* out, int mode) {
  const int lane = threadIdx.x & 31;
  int v = lane;
  if (mode == 0 && lane < 16) v = __shfl_sync(0xffffffffu, v, 0);  // divergent full-mask shuffle
  if (mode == 1 && threadIdx.x < 32) __syncthreads();              // divergent barrier
  if (mode == 2) {
    if (lane < 16)
      v = __ballot_sync(0xffffffffu, 1);
    else
      v = __shfl_sync(0xffffffffu, v, 0);
  }
  if (mode == 3 && threadIdx.x >= 32) return;
  if (mode == 3) __syncthreads();
  out[threadIdx.x] = v;
}
int main(int argc, char** argv) {
  int* out;
  cudaMalloc(&out, 64 * 4);
  K<<<1, 64>>>(out, atoi(argv[1]));
  return 0;
}
