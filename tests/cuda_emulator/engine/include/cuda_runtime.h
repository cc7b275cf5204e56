// CPU emulation of the part of the CUDA runtime the sdmserve kernels and CUDA backend use
// (testing only). Every CUDA thread is a fiber (emu.cc); warp intrinsics are warp barriers.
#pragma once
#include <functional>
#include <tuple>
#include <utility>

#include "emu_cuda_common.h"

// Stream capture and graphs (the engine's decode-step graphs): a capturing stream records what
// is enqueued on it instead of running it; a graph replays the records in order.
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2
};
enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2
};
struct EmuGraph;
struct EmuGraphExec;
typedef EmuGraph* cudaGraph_t;
typedef EmuGraphExec* cudaGraphExec_t;

// Static __shared__ declarations are rewritten by transform.py; anything left is a bug there.
#define __shared__ EMU_UNTRANSFORMED_SHARED_DECLARATION
#define __constant__ static

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
// Checks a launch's stream and configuration; false (the last error set, and a capture on `s`
// invalidated) when CUDA would refuse it.
bool LaunchAccepted(dim3 grid, dim3 block, size_t smem, cudaStream_t s, dim3 cluster);
// Runs every block of the grid, a cluster's blocks together (cluster 1 x 1 x 1: one block at a
// time).
void RunGrid(void (*fn)(void*), void* ctx, dim3 grid, dim3 block, size_t smem, dim3 cluster);
// Runs `op` now, or records it when `s` is capturing (replayed by cudaGraphLaunch). Work enqueued
// on an invalidated capture is dropped with cudaErrorStreamCaptureInvalidated as the last error.
// `kind` names the op for EMU_GRAPH_STATS ("kernel", "gemm", "copy", ...).
void Enqueue(cudaStream_t s, std::function<void()> op, const char* kind = "other");
// transform.py captures the kernel's arguments by value: a captured launch replays them as they
// were at capture, like CUDA's kernel nodes.
template <class F>
bool Launch(F f, dim3 grid, dim3 block, size_t smem = 0, cudaStream_t s = nullptr,
            dim3 cluster = dim3(1, 1, 1)) {
  if (!LaunchAccepted(grid, block, smem, s, cluster)) return false;
  Enqueue(
      s,
      [f, grid, block, smem, cluster]() mutable {
        RunGrid([](void* c) { (*static_cast<F*>(c))(); }, &f, grid, block, smem, cluster);
      },
      "kernel");
  return true;
}
// Device-memory bookkeeping for the host-side checks.
bool IsDevicePtr(const void* p, size_t n);
// Static __shared__ variables (transform.py rewrites each declaration): per block, allocated on
// first use and filled with garbage.
void* StaticShared(const void* tag, size_t bytes, size_t align);
template <class T, size_t kAlign>
T& SharedAligned(const void* tag) {
  return *static_cast<T*>(StaticShared(tag, sizeof(T), alignof(T) > kAlign ? alignof(T) : kAlign));
}
}  // namespace emu

#define threadIdx (::emu::CurThreadIdx())
// References rather than macros, so that cudaLaunchConfig_t's members of the same names compile.
inline const dim3& blockIdx = ::emu::g_block_idx;
inline const dim3& blockDim = ::emu::g_block_dim;
inline const dim3& gridDim = ::emu::g_grid_dim;
constexpr int warpSize = 32;
inline void __syncthreads() { emu::SyncThreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::WarpSync(mask); }

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

cudaError_t cudaGetDeviceCount(int* n);
cudaError_t cudaSetDevice(int d);
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
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph,
                                 unsigned long long flags = 0);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
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
// Kernel arguments by value, as transform.py's launches take them.
template <class... Expected, class... Actual>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(Expected...),
                               Actual&&... args) {
  std::tuple<Expected...> values(std::forward<Actual>(args)...);
  return emu::Launch([kernel, values] { std::apply(kernel, values); }, config->gridDim,
                     config->blockDim, config->dynamicSmemBytes, config->stream,
                     EmuClusterDim(*config))
             ? cudaSuccess
             : cudaErrorInvalidConfiguration;
}
