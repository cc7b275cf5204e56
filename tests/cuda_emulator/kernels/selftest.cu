// Self-test of the emulator's warp intrinsics and atomics against CUDA's documented semantics.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
__global__ void K(int* out, unsigned long long* out64, float* outf) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ int counter;
  if (threadIdx.x == 0) counter = 0;
  __syncthreads();
  int* o = out + threadIdx.x * 16;
  o[0] = __shfl_down_sync(0xffffffffu, lane * 10, 3);  // lane+3 or own if > 31
  o[1] = __shfl_up_sync(0xffffffffu, lane * 10, 2);    // lane-2 or own if < 0
  o[2] = __shfl_xor_sync(0xffffffffu, lane, 5);
  o[3] = __shfl_sync(0xffffffffu, lane, lane + 33);  // src mod 32
  o[4] = __shfl_down_sync(0xffffffffu, lane, 1, 8);  // within 8-lane segments
  o[5] = static_cast<int>(__ballot_sync(0xffffffffu, lane % 3 == 0));
  o[6] = static_cast<int>(__match_any_sync(0xffffffffu, lane / 4 + (lane == 31 ? 100 : 0)));
  o[7] = static_cast<int>(__match_any_sync(0xffffffffu, static_cast<long long>(lane & 1) << 40));
  if (lane < 16) {  // partial mask
    o[8] = __shfl_sync(0x0000ffffu, lane * 2, 15 - lane);
    o[9] = static_cast<int>(__ballot_sync(0x0000ffffu, 1));
  } else {
    o[8] = -1;
    o[9] = static_cast<int>(__ballot_sync(0xffff0000u, lane & 1));
  }
  const unsigned long long v = (static_cast<unsigned long long>(lane) << 33) | 7;
  out64[threadIdx.x] = __shfl_xor_sync(0xffffffffu, v, 1);
  outf[threadIdx.x] = __shfl_sync(0xffffffffu, static_cast<float>(lane) + 0.5f, 31);
  o[10] = atomicAdd(&counter, 1) >= 0;
  o[11] = __any_sync(0xffffffffu, lane == 7);
  o[12] = __all_sync(0xffffffffu, lane < 31);
  __syncthreads();
  o[13] = counter;
  o[14] = warp;
}
// Clusters: each block fills a static and its dynamic shared memory, then (after a cluster
// barrier) reads both from the next rank's block through map_shared_rank; a split
// arrive/wait keeps every block alive until the last read.
__global__ void ClusterKernel(int* out) {
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  __shared__ int s_static[64];
  extern __shared__ int s_dynamic[];
  const unsigned rank = cluster.block_rank();
  s_static[threadIdx.x] = 1000 * static_cast<int>(blockIdx.x) + static_cast<int>(threadIdx.x);
  s_dynamic[threadIdx.x] = -s_static[threadIdx.x];
  cluster.sync();
  const unsigned next = (rank + 1) % cluster.num_blocks();
  const int a = *cluster.map_shared_rank(&s_static[threadIdx.x], next);
  const int b = *cluster.map_shared_rank(&s_dynamic[threadIdx.x], next);
  cluster.barrier_arrive();
  int* o = out + (blockIdx.x * 64 + threadIdx.x) * 6;
  o[0] = a;
  o[1] = b;
  o[2] = static_cast<int>(rank);
  o[3] = static_cast<int>(cluster.num_blocks());
  o[4] = static_cast<int>(cluster.query_shared_rank(cluster.map_shared_rank(s_static, next)));
  o[5] = static_cast<int>(cluster.block_index().x);
  cluster.barrier_wait();
}
cudaError_t LaunchClusters(int* out, unsigned blocks, unsigned cluster_blocks) {
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = cluster_blocks;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(64);
  config.dynamicSmemBytes = 64 * sizeof(int);
  config.attrs = &cluster;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, ClusterKernel, out);
}
// Blocks of a cluster-less launch: thread 0 of each counts itself in twice on one counter, a
// fence between. Run one after another, every block sees its own two counts adjacent; run as a
// co-resident group (EMU_CORESIDENT with EMU_ORDER=rand), some block sees another's count between
// them. Either way each block is a cluster of one to the kernel.
__global__ void CoresidentKernel(unsigned* counter, int* out) {
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  __shared__ int s[64];
  s[threadIdx.x] = static_cast<int>(threadIdx.x);
  cluster.sync();
  int* o = out + (blockIdx.x * 64 + threadIdx.x) * 4;
  o[0] = static_cast<int>(cluster.block_rank());
  o[1] = static_cast<int>(cluster.num_blocks());
  o[2] = *cluster.map_shared_rank(&s[(threadIdx.x + 1) % 64], 0);
  o[3] = 0;
  if (threadIdx.x == 0) {
    const unsigned first = atomicAdd(counter, 1u);
    __threadfence();
    o[3] = static_cast<int>(atomicAdd(counter, 1u) - first);
  }
}
// Returns the number of failed checks. The mode is on when EMU_CORESIDENT > 1 and EMU_ORDER is
// rand (the emulator's own rule, kernels/emu.cc): then, within a few launches, some block must
// be overtaken (one launch may happen not to interleave them); otherwise none ever is.
int CoresidentSelftest() {
  const char* k = std::getenv("EMU_CORESIDENT");
  const char* order = std::getenv("EMU_ORDER");
  const bool coresident =
      k != nullptr && std::atoi(k) > 1 && order != nullptr && std::strncmp(order, "rand", 4) == 0;
  int bad = 0;
  auto check = [&](bool ok, const char* what, int t) {
    if (!ok) {
      ++bad;
      std::printf("BAD %s thread %d\n", what, t);
    }
  };
  constexpr int kBlocks = 8;
  constexpr int kLaunches = 8;
  unsigned* counter;
  int* out;
  cudaMalloc(&counter, sizeof(unsigned));
  cudaMalloc(&out, kBlocks * 64 * 4 * sizeof(int));
  (void)cudaGetLastError();  // the cluster checks' refused launches
  int overtaken = 0, launches = 0;
  while (launches < kLaunches && (overtaken == 0 || !coresident)) {
    ++launches;
    cudaMemset(counter, 0, sizeof(unsigned));
    CoresidentKernel<<<kBlocks, 64>>>(counter, out);
    check(cudaGetLastError() == cudaSuccess, "co-resident launch", -1);
    int h[kBlocks * 64 * 4];
    unsigned total = 0;
    cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost);
    cudaMemcpy(&total, counter, sizeof(total), cudaMemcpyDeviceToHost);
    check(total == 2 * kBlocks, "every count", -1);
    for (int t = 0; t < kBlocks * 64; ++t) {
      const int* o = h + t * 4;
      check(o[0] == 0, "block_rank of a cluster of one", t);
      check(o[1] == 1, "num_blocks of a cluster of one", t);
      check(o[2] == (t % 64 + 1) % 64, "map_shared_rank to itself", t);
      if (t % 64 == 0) {
        check(o[3] >= 1 && o[3] < 2 * kBlocks, "counts", t);
        overtaken += o[3] > 1;
      }
    }
  }
  if (coresident) {
    check(overtaken > 0, "blocks interleaved (some block overtaken between its two counts)", -1);
  } else {
    check(overtaken == 0, "blocks one after another (no block overtaken)", -1);
  }
  std::printf("co-resident blocks %s: %d blocks overtaken in %d launches of %d\n",
              coresident ? "on" : "off", overtaken, launches, kBlocks);
  return bad;
}

// Returns the number of failed checks.
int ClusterSelftest() {
  int bad = 0;
  auto check = [&](bool ok, const char* what, int t) {
    if (!ok) {
      ++bad;
      std::printf("BAD %s thread %d\n", what, t);
    }
  };
  int* out;
  cudaMalloc(&out, 32 * 64 * 6 * 4);
  check(LaunchClusters(out, 8, 4) == cudaSuccess, "cluster launch", -1);
  int h[8 * 64 * 6];
  cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost);
  for (int t = 0; t < 8 * 64; ++t) {
    const int block = t / 64, tid = t % 64, rank = block % 4;
    const int next_block = block - rank + (rank + 1) % 4;
    const int* o = h + t * 6;
    check(o[0] == 1000 * next_block + tid, "map_shared_rank static", t);
    check(o[1] == -(1000 * next_block + tid), "map_shared_rank dynamic", t);
    check(o[2] == rank, "block_rank", t);
    check(o[3] == 4, "num_blocks", t);
    check(o[4] == (rank + 1) % 4, "query_shared_rank", t);
    check(o[5] == rank, "block_index", t);
  }
  (void)cudaGetLastError();
  check(LaunchClusters(out, 6, 4) == cudaErrorInvalidClusterSize, "cluster not tiling the grid",
        -1);
  check(LaunchClusters(out, 32, 16) == cudaErrorInvalidClusterSize, "16 blocks without opt-in", -1);
  (void)cudaGetLastError();
  cudaFuncSetAttribute(ClusterKernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  check(LaunchClusters(out, 32, 16) == cudaSuccess, "16 blocks with the opt-in", -1);
  check(LaunchClusters(out, 32, 32) == cudaErrorInvalidClusterSize, "32 blocks", -1);
  return bad;
}

int main() {
  int* out;
  unsigned long long* o64;
  float* of;
  cudaMalloc(&out, 64 * 16 * 4);
  cudaMalloc(&o64, 64 * 8);
  cudaMalloc(&of, 64 * 4);
  K<<<1, 64>>>(out, o64, of);
  int h[64 * 16];
  unsigned long long h64[64];
  float hf[64];
  cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost);
  cudaMemcpy(h64, o64, sizeof(h64), cudaMemcpyDeviceToHost);
  cudaMemcpy(hf, of, sizeof(hf), cudaMemcpyDeviceToHost);
  int bad = 0;
  auto check = [&](bool ok, const char* what, int t) {
    if (!ok) {
      ++bad;
      std::printf("BAD %s thread %d\n", what, t);
    }
  };
  for (int t = 0; t < 64; ++t) {
    const int l = t & 31;
    const int* o = h + t * 16;
    check(o[0] == (l + 3 <= 31 ? (l + 3) * 10 : l * 10), "shfl_down", t);
    check(o[1] == (l >= 2 ? (l - 2) * 10 : l * 10), "shfl_up", t);
    check(o[2] == (l ^ 5), "shfl_xor", t);
    check(o[3] == ((l + 33) & 31), "shfl idx mod", t);
    check(o[4] == ((l & 7) == 7 ? l : l + 1), "shfl_down width 8", t);
    unsigned b = 0;
    for (int i = 0; i < 32; ++i)
      if (i % 3 == 0) b |= 1u << i;
    check(static_cast<unsigned>(o[5]) == b, "ballot", t);
    unsigned m = 0;
    for (int i = 0; i < 32; ++i)
      if (i / 4 + (i == 31 ? 100 : 0) == l / 4 + (l == 31 ? 100 : 0)) m |= 1u << i;
    check(static_cast<unsigned>(o[6]) == m, "match_any", t);
    check(static_cast<unsigned>(o[7]) == ((l & 1) ? 0xaaaaaaaau : 0x55555555u), "match_any 64", t);
    check(o[8] == (l < 16 ? (15 - l) * 2 : -1), "partial shfl", t);
    check(static_cast<unsigned>(o[9]) == (l < 16 ? 0xffffu : 0xaaaa0000u), "partial ballot", t);
    check(h64[t] == ((static_cast<unsigned long long>(l ^ 1) << 33) | 7), "shfl u64", t);
    check(hf[t] == 31.5f, "shfl float", t);
    check(o[11] == 1 && o[12] == 0, "any/all", t);
    check(o[13] == 64, "shared atomic", t);
  }
  bad += ClusterSelftest();
  bad += CoresidentSelftest();
  std::printf("%s (%d bad)\n", bad ? "SELFTEST FAILED" : "selftest ok", bad);
  return bad != 0;
}
