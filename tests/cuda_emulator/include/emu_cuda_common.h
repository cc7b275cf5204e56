// The part of the fake CUDA headers both emulator dialects share (kernels/, engine/; testing
// only): qualifiers, error codes and handle types, vector types, bit casts and math intrinsics,
// atomics, and the device-memory host API. Each dialect's cuda_runtime.h adds its scheduler's
// entry points (launch, barriers, warp collectives), `__shared__`, streams and events.
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
  cudaErrorNotReady = 600,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorInvalidClusterSize = 912,
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
  cudaFuncAttributeNonPortableClusterSizeAllowed = 14,
};
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
enum cudaDeviceAttr { cudaDevAttrClusterLaunch = 120 };
// Each dialect defines these; its device launches clusters (a Hopper).
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device);

// cudaLaunchKernelEx's configuration (each dialect's cuda_runtime.h defines the launch): only
// the cluster dimension attribute is modelled.
enum cudaLaunchAttributeID { cudaLaunchAttributeClusterDimension = 4 };
union cudaLaunchAttributeValue {
  char pad[64];
  struct {
    unsigned x, y, z;
  } clusterDim;
};
struct cudaLaunchAttribute {
  cudaLaunchAttributeID id;
  char pad[8 - sizeof(cudaLaunchAttributeID)];
  cudaLaunchAttributeValue val;
};
struct cudaLaunchConfig_t {
  dim3 gridDim;
  dim3 blockDim;
  size_t dynamicSmemBytes;
  cudaStream_t stream;
  cudaLaunchAttribute* attrs;
  unsigned numAttrs;
};
// The cluster dimension a launch configuration asks for (1 x 1 x 1 without the attribute).
inline dim3 EmuClusterDim(const cudaLaunchConfig_t& config) {
  dim3 cluster(1, 1, 1);
  for (unsigned i = 0; i < config.numAttrs; ++i) {
    if (config.attrs[i].id == cudaLaunchAttributeClusterDimension) {
      cluster = dim3(config.attrs[i].val.clusterDim.x, config.attrs[i].val.clusterDim.y,
                     config.attrs[i].val.clusterDim.z);
    }
  }
  return cluster;
}

// Thread-block clusters (cooperative_groups.h's cluster_group): each dialect's scheduler runs a
// cluster's blocks together (include/emu_blocks.h).
namespace emu {
void ClusterArrive();
void ClusterWait();
unsigned ClusterBlockRank();
dim3 ClusterDim();
dim3 ClusterBlockIndex();
void* MapSharedRank(const void* addr, unsigned rank);
unsigned QuerySharedRank(const void* addr);
// Where the running thread may let others run before it goes on: atomics, fences and L2 reads
// (__ldcg), the operations through which blocks running at once talk. The kernel dialect
// switches fibers there when the launch's blocks run as co-resident groups (EMU_CORESIDENT);
// otherwise, and in the engine dialect, it does nothing.
void InterleavePoint();
}  // namespace emu

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
inline T __ldcg(const T* p) {
  emu::InterleavePoint();
  return *p;
}
template <class T>
inline void __stcs(T* p, T v) {
  *p = v;
}
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline void __threadfence() { emu::InterleavePoint(); }
inline void __threadfence_block() {}

// Atomics: the overloads CUDA has (so argument conversions match). Cooperative fibers never
// preempt, so a plain read-modify-write is atomic; other threads may run just before it.
#define EMU_ATOMIC_RMW(NAME, T, EXPR) \
  inline T NAME(T* p, T v) {          \
    emu::InterleavePoint();           \
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
    emu::InterleavePoint();              \
    T old = *p;                          \
    if (old == cmp) *p = v;              \
    return old;                          \
  }
EMU_ATOMIC_CAS(int)
EMU_ATOMIC_CAS(unsigned)
EMU_ATOMIC_CAS(unsigned long long)
#undef EMU_ATOMIC_CAS

// Host API: device memory is host memory, tracked by the dialect's emu.cc so that copies check
// their direction and bounds.
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
template <class T>
cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
template <class T>
cudaError_t cudaMallocHost(T** p, size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void**>(p), bytes);
}
