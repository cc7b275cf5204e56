// CPU emulation of the part of the CUDA runtime the sdmserve kernels and CUDA backend use
// (testing only). Every CUDA thread is a fiber (emu.cc); warp intrinsics are warp barriers.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static
#define __align__(n) alignas(n)
#define __constant__ static

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorLaunchFailure = 4,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidResourceHandle = 400,
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
struct EmuStream;
struct EmuEvent;
typedef EmuStream* cudaStream_t;
typedef EmuEvent* cudaEvent_t;
constexpr unsigned cudaStreamNonBlocking = 1, cudaEventDefault = 0, cudaEventDisableTiming = 2;

struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  size_t sharedMemPerBlock;
  size_t sharedMemPerBlockOptin;
  int multiProcessorCount;
  int major, minor;
  int warpSize;
  int maxThreadsPerBlock;
  int l2CacheSize;
  int memoryBusWidth;
  int clockRate;
  int memoryClockRate;
};

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint3 {
  unsigned x, y, z;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(8) int2 {
  int x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }
inline int2 make_int2(int a, int b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }

template <class To, class From>
inline To EmuBits(From f) {
  static_assert(sizeof(To) == sizeof(From));
  To t;
  std::memcpy(&t, &f, sizeof(t));
  return t;
}
inline float __uint_as_float(unsigned u) { return EmuBits<float>(u); }
inline float __int_as_float(int u) { return EmuBits<float>(u); }
inline unsigned __float_as_uint(float f) { return EmuBits<unsigned>(f); }
inline int __float_as_int(float f) { return EmuBits<int>(f); }
inline long long __double_as_longlong(double d) { return EmuBits<long long>(d); }
inline double __longlong_as_double(long long l) { return EmuBits<double>(l); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) {
  return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x));
}
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __saturatef(float x) { return x < 0 ? 0 : (x > 1 ? 1 : x); }
template <class T>
inline T __ldg(const T* p) {
  return *p;
}
template <class T>
inline T __ldcs(const T* p) {
  return *p;
}
template <class T>
inline void __stcs(T* p, T v) {
  *p = v;
}

namespace emu {
struct Thread;
extern Thread* g_cur;
extern dim3 g_block_idx, g_block_dim, g_grid_dim;
uint3 CurThreadIdx();
void SyncThreads();
int LaneId();
void* SharedMem();
// Warp collectives: every lane of the warp must arrive (else the emulator aborts).
// Exchange: publishes `bits` (8 bytes) and `mask`, returns lane src's bits.
uint64_t WarpExchange(uint64_t bits, unsigned mask, int src_lane);
// Ballot of pred; match_any of bits (lanes with equal bits).
unsigned WarpBallot(bool pred, unsigned mask);
unsigned WarpMatchAny(uint64_t bits, unsigned mask);
void WarpSync(unsigned mask);
void RunGrid(void (*fn)(void*), void* ctx, dim3 grid, dim3 block, size_t smem, cudaStream_t s);
template <class F>
void Launch(F f, dim3 grid, dim3 block, size_t smem = 0, cudaStream_t s = nullptr) {
  RunGrid([](void* c) { (*static_cast<F*>(c))(); }, &f, grid, block, smem, s);
}
// Device-memory bookkeeping for the host-side checks.
bool IsDevicePtr(const void* p, size_t n);
// Static __shared__ arrays (transform.py): refilled with garbage before every block.
bool RegisterShared(void* p, size_t n);
}  // namespace emu

#define threadIdx (::emu::CurThreadIdx())
#define blockIdx (::emu::g_block_idx)
#define blockDim (::emu::g_block_dim)
#define gridDim (::emu::g_grid_dim)
constexpr int warpSize = 32;
inline void __syncthreads() { emu::SyncThreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::WarpSync(mask); }
inline void __threadfence() {}
inline void __threadfence_block() {}

template <class T>
inline T EmuShfl(unsigned mask, T v, int src) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = emu::WarpExchange(bits, mask, src);
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const int lane = emu::LaneId();
  return EmuShfl(mask, v, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int off, int width = 32) {
  const int lane = emu::LaneId();
  int src = lane ^ off;
  if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
  return EmuShfl(mask, v, src);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
  const int lane = emu::LaneId();
  int src = lane + static_cast<int>(d);
  if ((src & ~(width - 1)) != (lane & ~(width - 1)) || src > 31) src = lane;
  return EmuShfl(mask, v, src);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
  const int lane = emu::LaneId();
  int src = lane - static_cast<int>(d);
  if (src < (lane & ~(width - 1))) src = lane;
  return EmuShfl(mask, v, src);
}
inline unsigned __ballot_sync(unsigned mask, int pred) { return emu::WarpBallot(pred != 0, mask); }
inline int __any_sync(unsigned mask, int pred) { return emu::WarpBallot(pred != 0, mask) != 0; }
inline int __all_sync(unsigned mask, int pred) { return emu::WarpBallot(pred != 0, mask) == mask; }
template <class T>
inline unsigned __match_any_sync(unsigned mask, T v) {
  static_assert(sizeof(T) <= 8);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return emu::WarpMatchAny(bits, mask);
}
inline unsigned __activemask() { return 0xffffffffu; }

// Atomics: fibers switch only at barriers, so a plain read-modify-write is atomic.
template <class T>
inline T atomicAdd(T* p, T v) {
  T o = *p;
  *p = o + v;
  return o;
}
template <class T>
inline T atomicSub(T* p, T v) {
  T o = *p;
  *p = o - v;
  return o;
}
template <class T>
inline T atomicMax(T* p, T v) {
  T o = *p;
  if (v > o) *p = v;
  return o;
}
template <class T>
inline T atomicMin(T* p, T v) {
  T o = *p;
  if (v < o) *p = v;
  return o;
}
template <class T>
inline T atomicExch(T* p, T v) {
  T o = *p;
  *p = v;
  return o;
}
template <class T>
inline T atomicOr(T* p, T v) {
  T o = *p;
  *p = o | v;
  return o;
}
template <class T>
inline T atomicAnd(T* p, T v) {
  T o = *p;
  *p = o & v;
  return o;
}
template <class T>
inline T atomicCAS(T* p, T cmp, T v) {
  T o = *p;
  if (o == cmp) *p = v;
  return o;
}

cudaError_t cudaMalloc(void** p, size_t bytes);
cudaError_t cudaFree(void* p);
cudaError_t cudaMallocHost(void** p, size_t bytes);
cudaError_t cudaFreeHost(void* p);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind,
                            cudaStream_t = nullptr);
cudaError_t cudaMemset(void* p, int v, size_t n);
cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t = nullptr);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorName(cudaError_t);
const char* cudaGetErrorString(cudaError_t);
cudaError_t cudaGetDeviceCount(int* n);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaGetDevice(int* d);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d);
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes);
cudaError_t cudaDriverGetVersion(int* v);
cudaError_t cudaRuntimeGetVersion(int* v);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags);
cudaError_t cudaStreamCreate(cudaStream_t* s);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags = 0);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags);
cudaError_t cudaEventCreate(cudaEvent_t* e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b);
cudaError_t EmuFuncSetAttribute(const void* fn, cudaFuncAttribute attr, int value);
template <class K>
cudaError_t cudaFuncSetAttribute(K k, cudaFuncAttribute a, int v) {
  return EmuFuncSetAttribute(reinterpret_cast<const void*>(k), a, v);
}
template <class T>
cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
template <class T>
cudaError_t cudaMallocHost(T** p, size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void**>(p), bytes);
}
