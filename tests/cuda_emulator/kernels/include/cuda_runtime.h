// CPU emulation of the part of the CUDA runtime / device intrinsics the sdmserve kernels use
// (testing only). Device code is run by emu.cc: one fiber per CUDA thread, cooperative, so every
// plain read-modify-write is atomic; warp intrinsics and __syncthreads are barriers.
#pragma once
#include <utility>

#include "emu_cuda_common.h"

// Static __shared__ declarations are rewritten by transform.py; anything left is a bug there.
#define __shared__ EMU_UNTRANSFORMED_SHARED_DECLARATION

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
// Runs every block of the grid, a cluster's blocks together (cluster 1 x 1 x 1: one block at a
// time). An invalid configuration runs nothing and returns (and records) its error.
cudaError_t RunGrid(const char* kernel, void (*fn)(void*), void* ctx, dim3 grid, dim3 block,
                    size_t smem, dim3 cluster = dim3(1, 1, 1));
template <class F>
cudaError_t Launch(const char* kernel, F f, dim3 grid, dim3 block, size_t smem = 0,
                   cudaStream_t = nullptr, dim3 cluster = dim3(1, 1, 1)) {
  return RunGrid(
      kernel, [](void* c) { (*static_cast<F*>(c))(); }, &f, grid, block, smem, cluster);
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
// References rather than macros, so that cudaLaunchConfig_t's members of the same names compile.
inline const dim3& blockIdx = ::emu::g_block_idx;
inline const dim3& blockDim = ::emu::g_block_dim;
inline const dim3& gridDim = ::emu::g_grid_dim;
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

// Streams and events: synchronous, so their handles are placeholders.
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
void AllowNonPortableClusters();
}  // namespace emu
// Approximation: the largest opt-in of any kernel (and the non-portable cluster opt-in of any)
// applies to every kernel.
template <class K>
cudaError_t cudaFuncSetAttribute(K, cudaFuncAttribute attribute, int value) {
  if (attribute == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    emu::SetMaxDynamicSmem(static_cast<size_t>(value));
  } else if (attribute == cudaFuncAttributeNonPortableClusterSizeAllowed && value != 0) {
    emu::AllowNonPortableClusters();
  }
  return cudaSuccess;
}
// Runs the kernel at once (streams are synchronous), with the configuration's cluster dimension.
template <class... Expected, class... Actual>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(Expected...),
                               Actual&&... args) {
  return [&](Expected... coerced) {
    return emu::Launch(
        "(cudaLaunchKernelEx)", [&] { kernel(coerced...); }, config->gridDim, config->blockDim,
        config->dynamicSmemBytes, config->stream, EmuClusterDim(*config));
  }(std::forward<Actual>(args)...);
}
