#include <cooperative_groups.h>
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
// Cluster bugs, launched as clusters of two blocks.
__global__ void C(int* out, int mode) {
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  __shared__ int s[64];
  s[threadIdx.x] = threadIdx.x;
  const unsigned rank = cluster.block_rank();
  if (mode == 4) {  // one thread of rank 1 at the cluster barrier, the rest at __syncthreads
    if (rank == 1 && threadIdx.x != 0) {
      __syncthreads();
    } else {
      cluster.sync();
    }
  }
  if (mode == 5) {  // rank 0 exits while rank 1 still reads its shared memory
    cluster.sync();
    if (rank == 0) return;
    cluster.sync();  // returns once rank 0 has exited (it counts non-exited threads only)
    out[threadIdx.x] = *cluster.map_shared_rank(&s[threadIdx.x], 0);
  }
  if (mode == 6) cluster.barrier_wait();  // a wait with no arrive before it
  out[64 * rank + threadIdx.x] = s[threadIdx.x];
}
int main(int argc, char** argv) {
  int* out;
  cudaMalloc(&out, 128 * 4);
  const int mode = atoi(argv[1]);
  if (mode < 4) {
    K<<<1, 64>>>(out, mode);
    return 0;
  }
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 2;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(2);
  config.blockDim = dim3(64);
  config.attrs = &cluster;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, C, out, mode);
  return 0;
}
