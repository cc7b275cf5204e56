// CPU emulation of the part of the CUDA runtime / device intrinsics the sdmserve kernels use
// (testing only). Device code is run by emu.cc: one fiber per CUDA thread, cooperative, so every
// plain read-modify-write is atomic; warp intrinsics and __syncthreads are barriers.
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
#define __noinline__
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) alignas(n)
// Static __shared__ declarations are rewritten by transform.py; anything left is a bug there.
#define __shared__ EMU_UNTRANSFORMED_SHARED_DECLARATION

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorLaunchFailure = 4,
  cudaErrorInvalidConfiguration = 9,
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
typedef struct EmuStream* cudaStream_t;
typedef struct EmuEvent* cudaEvent_t;
constexpr unsigned cudaStreamNonBlocking = 1, cudaEventDefault = 0, cudaEventDisableTiming = 2;

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
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float __int_as_float(int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline int __float_as_int(float f) {
  int u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline double __longlong_as_double(long long u) {
  double f;
  std::memcpy(&f, &u, 8);
  return f;
}
inline long long __double_as_longlong(double f) {
  long long u;
  std::memcpy(&u, &f, 8);
  return u;
}
template <class T>
inline T __ldg(const T* p) {
  return *p;
}
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
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline void __threadfence() {}
inline void __threadfence_block() {}

namespace emu {
extern dim3 g_block_idx, g_block_dim, g_grid_dim;
uint3 CurThreadIdx();
void SyncThreads();
// Warp collective: every lane in `mask` must call it (same kind, same mask). Returns the 8-byte
// values of all 32 lanes in `all` (lanes outside the mask: 0).
enum WarpKind { kShfl = 1, kBallot, kMatch, kSyncWarp, kVote };
void WarpCollective(unsigned mask, int kind, uint64_t mine, uint64_t* all);
int LaneId();
void* SharedMem();
void* StaticShared(const void* tag, size_t bytes, size_t align);
[[noreturn]] void Fail(const char* what);
void RunGrid(const char* kernel, void (*fn)(void*), void* ctx, dim3 grid, dim3 block, size_t smem);
template <class F>
void Launch(const char* kernel, F f, dim3 grid, dim3 block, size_t smem = 0,
            cudaStream_t = nullptr) {
  RunGrid(
      kernel, [](void* c) { (*static_cast<F*>(c))(); }, &f, grid, block, smem);
}
template <class T, size_t kAlign>
T& SharedAligned(const void* tag) {
  return *static_cast<T*>(StaticShared(tag, sizeof(T), alignof(T) > kAlign ? alignof(T) : kAlign));
}
template <class T>
uint64_t Bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T>
T FromBits(uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}
template <class T>
T Shfl(unsigned mask, T v, int src_lane) {
  uint64_t all[32];
  WarpCollective(mask, kShfl, Bits(v), all);
  if (((mask >> src_lane) & 1u) == 0) Fail("shuffle from a lane outside the mask");
  return FromBits<T>(all[src_lane]);
}
}  // namespace emu

#define threadIdx (::emu::CurThreadIdx())
#define blockIdx (::emu::g_block_idx)
#define blockDim (::emu::g_block_dim)
#define gridDim (::emu::g_grid_dim)
constexpr int warpSize = 32;
inline void __syncthreads() { emu::SyncThreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  uint64_t all[32];
  emu::WarpCollective(mask, emu::kSyncWarp, 0, all);
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const int lane = emu::LaneId();
  return emu::Shfl(mask, v, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
  const int lane = emu::LaneId();
  int src = lane ^ m;
  if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
  return emu::Shfl(mask, v, src);
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
  const int lane = emu::LaneId();
  int src = lane + static_cast<int>(d);
  if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
  return emu::Shfl(mask, v, src);
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
  const int lane = emu::LaneId();
  int src = lane - static_cast<int>(d);
  if (src < (lane & ~(width - 1))) src = lane;
  return emu::Shfl(mask, v, src);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  uint64_t all[32];
  emu::WarpCollective(mask, emu::kBallot, pred != 0, all);
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= (((mask >> i) & 1u) && all[i] != 0 ? 1u : 0u) << i;
  return r;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == mask; }
template <class T>
unsigned __match_any_sync(unsigned mask, T v) {
  static_assert(std::is_integral_v<T> && (sizeof(T) == 4 || sizeof(T) == 8),
                "__match_any_sync takes 32/64-bit integers");
  uint64_t all[32];
  const uint64_t mine = emu::Bits(v);
  emu::WarpCollective(mask, emu::kMatch, mine, all);
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= (((mask >> i) & 1u) && all[i] == mine ? 1u : 0u) << i;
  return r;
}
inline unsigned __activemask() { return 0xffffffffu; }  // emulator: only converged warps

// Atomics: the overloads CUDA has (so argument conversions match). Cooperative fibers never
// preempt, so a plain read-modify-write is atomic.
#define EMU_ATOMIC_RMW(NAME, T, EXPR) \
  inline T NAME(T* p, T v) {          \
    T old = *p;                       \
    *p = (EXPR);                      \
    return old;                       \
  }
EMU_ATOMIC_RMW(atomicAdd, int, old + v)
EMU_ATOMIC_RMW(atomicAdd, unsigned, old + v)
EMU_ATOMIC_RMW(atomicAdd, unsigned long long, old + v)
EMU_ATOMIC_RMW(atomicAdd, float, old + v)
EMU_ATOMIC_RMW(atomicAdd, double, old + v)
EMU_ATOMIC_RMW(atomicSub, int, old - v)
EMU_ATOMIC_RMW(atomicSub, unsigned, old - v)
EMU_ATOMIC_RMW(atomicExch, int, v)
EMU_ATOMIC_RMW(atomicExch, unsigned, v)
EMU_ATOMIC_RMW(atomicExch, unsigned long long, v)
EMU_ATOMIC_RMW(atomicExch, float, v)
EMU_ATOMIC_RMW(atomicMax, int, old > v ? old : v)
EMU_ATOMIC_RMW(atomicMax, unsigned, old > v ? old : v)
EMU_ATOMIC_RMW(atomicMax, unsigned long long, old > v ? old : v)
EMU_ATOMIC_RMW(atomicMax, long long, old > v ? old : v)
EMU_ATOMIC_RMW(atomicMin, int, old < v ? old : v)
EMU_ATOMIC_RMW(atomicMin, unsigned, old < v ? old : v)
EMU_ATOMIC_RMW(atomicMin, unsigned long long, old < v ? old : v)
EMU_ATOMIC_RMW(atomicMin, long long, old < v ? old : v)
EMU_ATOMIC_RMW(atomicOr, int, old | v)
EMU_ATOMIC_RMW(atomicOr, unsigned, old | v)
EMU_ATOMIC_RMW(atomicAnd, int, old& v)
EMU_ATOMIC_RMW(atomicAnd, unsigned, old& v)
#undef EMU_ATOMIC_RMW
#define EMU_ATOMIC_CAS(T)                \
  inline T atomicCAS(T* p, T cmp, T v) { \
    T old = *p;                          \
    if (old == cmp) *p = v;              \
    return old;                          \
  }
EMU_ATOMIC_CAS(int)
EMU_ATOMIC_CAS(unsigned)
EMU_ATOMIC_CAS(unsigned long long)
#undef EMU_ATOMIC_CAS

// Host API. Device memory is host memory (malloc'd, filled with the EMU_FILL byte, default 0xff:
// NaN floats / -1 ints) and tracked, so copies check their direction. Streams are synchronous.
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
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = reinterpret_cast<cudaStream_t>(1);
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* s) {
  *s = reinterpret_cast<cudaStream_t>(1);
  return cudaSuccess;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned = 0) {
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize();
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = reinterpret_cast<cudaEvent_t>(1);
  return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = reinterpret_cast<cudaEvent_t>(1);
  return cudaSuccess;
}
inline cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t = nullptr) { return cudaSuccess; }
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t, cudaEvent_t) {
  *ms = 1;
  return cudaSuccess;
}
namespace emu {
void SetMaxDynamicSmem(size_t bytes);
}
// Approximation: the largest opt-in of any kernel applies to every kernel.
template <class K>
cudaError_t cudaFuncSetAttribute(K, cudaFuncAttribute, int bytes) {
  emu::SetMaxDynamicSmem(static_cast<size_t>(bytes));
  return cudaSuccess;
}
template <class T>
cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
template <class T>
cudaError_t cudaMallocHost(T** p, size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void**>(p), bytes);
}
