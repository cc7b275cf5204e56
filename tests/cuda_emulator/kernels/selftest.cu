// Self-test of the emulator's warp intrinsics and atomics against CUDA's documented semantics.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
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
  std::printf("%s (%d bad)\n", bad ? "SELFTEST FAILED" : "selftest ok", bad);
  return bad != 0;
}
