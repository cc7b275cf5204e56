// Cooperative-fiber emulation of CUDA blocks: every CUDA thread is a fiber; __syncthreads and
// warp shuffles are barriers; divergent shuffles or barrier deadlocks abort.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "cuda_runtime.h"
#include "emu_fiber_switch.h"

namespace emu {
enum State { kRunnable, kWaitBlock, kWaitWarp, kDone };
constexpr size_t kStack = 256 * 1024;
struct Thread {
  void* sp = nullptr;
  char* stack = nullptr;
  State state = kDone;
  uint3 tid{};
  int lane = 0;
  int warp = 0;
  unsigned wmask = 0;
  int wkind = 0;
};
dim3 g_block_idx, g_block_dim, g_grid_dim;
static Thread* g_cur = nullptr;
static void* g_sched_sp = nullptr;
static std::vector<Thread> g_threads;
static void (*g_fn)(void*) = nullptr;
static void* g_ctx = nullptr;
static char* g_smem = nullptr;
static size_t g_dyn_smem = 0;
static std::vector<uint64_t> g_warp_vals;
static const void* g_main_bottom = nullptr;
static size_t g_main_size = 0;
static cudaError_t g_last_error = cudaSuccess;
static const char* g_kernel_name = "";

// EMU_ORDER: fwd (default), rev, or rand[:seed] -- order of fibers within a scheduling round and
// of blocks in the grid, to expose missing barriers and inter-block order dependence.
// EMU_FILL: byte that fresh device and shared memory is filled with (default 0xff).
static int g_order = -1;  // 0 fwd, 1 rev, 2 rand
static uint64_t g_rng = 88172645463325252ull;
static int g_fill = 0xff;
static void InitConfig() {
  if (g_order >= 0) return;
  g_order = 0;
  if (const char* o = std::getenv("EMU_ORDER")) {
    if (std::strncmp(o, "rev", 3) == 0) g_order = 1;
    if (std::strncmp(o, "rand", 4) == 0) {
      g_order = 2;
      if (o[4] == ':') g_rng = std::strtoull(o + 5, nullptr, 10) * 2654435761ull + 1;
    }
  }
  if (const char* f = std::getenv("EMU_FILL"))
    g_fill = static_cast<int>(std::strtol(f, nullptr, 0));
}
static uint64_t Rand() {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}
static void Order(std::vector<int>& v) {
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int>(i);
  if (g_order == 1) std::reverse(v.begin(), v.end());
  if (g_order == 2) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[Rand() % i]);
  }
}

uint3 CurThreadIdx() { return g_cur->tid; }
int LaneId() { return g_cur->lane; }
void* SharedMem() { return g_smem; }

void Fail(const char* what) {
  std::fprintf(stderr, "EMU FAILURE: %s in kernel %s at block (%u,%u,%u)", what, g_kernel_name,
               g_block_idx.x, g_block_idx.y, g_block_idx.z);
  if (g_cur != nullptr) std::fprintf(stderr, " thread %u", g_cur->tid.x);
  std::fprintf(stderr, "\n");
  std::abort();
}

// Static __shared__ variables: allocated per block on first use (filled with garbage), freed at
// the block's end. Sizes are checked against the hardware limits.
struct SharedVar {
  const void* tag;
  void* p;
};
static std::vector<SharedVar> g_static;
static size_t g_static_bytes = 0;
void* StaticShared(const void* tag, size_t bytes, size_t align) {
  for (const SharedVar& v : g_static) {
    if (v.tag == tag) return v.p;
  }
  void* p = nullptr;
  if (posix_memalign(&p, align < 16 ? 16 : align, bytes == 0 ? 1 : bytes) != 0)
    Fail("out of memory");
  std::memset(p, g_fill, bytes);
  g_static.push_back({tag, p});
  g_static_bytes += bytes;
  if (g_static_bytes > 48 * 1024) Fail("static shared memory over 48 KiB");
  if (g_static_bytes + g_dyn_smem > 227 * 1024) Fail("shared memory over 227 KiB");
  return p;
}

static void Yield() {
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, g_main_bottom, g_main_size);
  emu_switch(&g_cur->sp, g_sched_sp);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
}

void SyncThreads() {
  g_cur->state = kWaitBlock;
  Yield();
}

void WarpCollective(unsigned mask, int kind, uint64_t mine, uint64_t* all) {
  Thread* me = g_cur;
  if (((mask >> me->lane) & 1u) == 0) Fail("warp collective whose mask excludes the calling lane");
  const int base = me->warp * 32;
  g_warp_vals[base + me->lane] = mine;
  me->wmask = mask;
  me->wkind = kind;
  me->state = kWaitWarp;
  Yield();
  for (int i = 0; i < 32; ++i) all[i] = ((mask >> i) & 1u) ? g_warp_vals[base + i] : 0;
  // Second phase: nobody overwrites its value before every lane of the group has read.
  me->wkind = kind + 100;
  me->state = kWaitWarp;
  Yield();
}

static void Entry() {
  __sanitizer_finish_switch_fiber(nullptr, &g_main_bottom, &g_main_size);
  g_fn(g_ctx);
  g_cur->state = kDone;
  __sanitizer_start_switch_fiber(nullptr, g_main_bottom, g_main_size);
  emu_switch(&g_cur->sp, g_sched_sp);
  std::abort();
}

// Releases every group of warp w whose lanes all wait at the same collective; fails on a group
// that can never complete (a lane of the mask exited, waits at __syncthreads, or at another
// collective). Called only when no lane of w is runnable.
static bool ReleaseWarp(int w, int n) {
  bool released = false, waiting = false;
  unsigned handled = 0;
  for (int l = 0; l < 32 && w * 32 + l < n; ++l) {
    const Thread& t = g_threads[w * 32 + l];
    if (t.state != kWaitWarp || ((handled >> l) & 1u)) continue;
    const unsigned m = t.wmask;
    bool complete = true;
    for (int i = 0; i < 32; ++i) {
      if (((m >> i) & 1u) == 0) continue;
      if (w * 32 + i >= n) Fail("warp collective mask names a lane beyond the block");
      const Thread& o = g_threads[w * 32 + i];
      if (o.state == kDone) Fail("warp collective waits for an exited lane");
      if (o.state == kWaitBlock) Fail("warp collective waits for a lane parked at __syncthreads");
      // A lane released by an earlier group of this pass has not arrived yet; a lane waiting at
      // another collective may be released later in the pass. Either way: not yet.
      if (o.state != kWaitWarp || o.wmask != m || o.wkind != t.wkind) complete = false;
    }
    if (!complete) {
      waiting = true;
      continue;
    }
    for (int i = 0; i < 32; ++i) {
      if ((m >> i) & 1u) g_threads[w * 32 + i].state = kRunnable;
    }
    handled |= m;
    released = true;
  }
  if (waiting && !released) {
    Fail("warp collectives that can never complete (divergent lanes: different masks or calls)");
  }
  return released;
}

static void RunBlock() {
  const int n = g_block_dim.x * g_block_dim.y * g_block_dim.z;
  if (static_cast<int>(g_threads.size()) < n) g_threads.resize(n);
  g_warp_vals.assign(((n + 31) / 32) * 32, 0);
  const size_t smem = g_dyn_smem;
  void* sm = nullptr;
  if (posix_memalign(&sm, 16, smem == 0 ? 1 : smem) != 0) Fail("out of memory");
  g_smem = static_cast<char*>(sm);
  std::memset(g_smem, g_fill, smem == 0 ? 1 : smem);
  for (int i = 0; i < n; ++i) {
    Thread& t = g_threads[i];
    if (t.stack == nullptr) t.stack = static_cast<char*>(std::malloc(kStack));
    uint64_t* sp =
        reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(t.stack + kStack) & ~uintptr_t{15});
    *--sp = 0;
    *--sp = reinterpret_cast<uint64_t>(&Entry);
    for (int r = 0; r < 6; ++r) *--sp = 0;
    t.sp = sp;
    t.state = kRunnable;
    t.tid = {static_cast<unsigned>(i % g_block_dim.x),
             static_cast<unsigned>((i / g_block_dim.x) % g_block_dim.y),
             static_cast<unsigned>(i / (g_block_dim.x * g_block_dim.y))};
    t.lane = i % 32;
    t.warp = i / 32;
  }
  // Warp at a time: a warp runs (through its warp collectives) until every lane waits at
  // __syncthreads or exited, then the next warp (in EMU_ORDER) runs. Warps thus overtake each
  // other as far as the barriers allow, which exposes a missing __syncthreads in one order or the
  // other; lanes within a warp run in EMU_ORDER too.
  const int warps = (n + 31) / 32;
  std::vector<int> warp_order(warps), lane_order(32);
  for (;;) {
    Order(warp_order);
    for (int w : warp_order) {
      for (;;) {
        Order(lane_order);
        for (int l : lane_order) {
          const int i = w * 32 + l;
          if (i >= n) continue;
          Thread& t = g_threads[i];
          if (t.state != kRunnable) continue;
          g_cur = &t;
          void* fake = nullptr;
          __sanitizer_start_switch_fiber(&fake, t.stack, kStack);
          emu_switch(&g_sched_sp, t.sp);
          __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
        }
        g_cur = nullptr;
        if (!ReleaseWarp(w, n)) break;
      }
    }
    int done = 0, wait_block = 0;
    for (int i = 0; i < n; ++i) {
      done += g_threads[i].state == kDone;
      wait_block += g_threads[i].state == kWaitBlock;
    }
    if (done == n) break;
    if (done > 0 && wait_block > 0) Fail("__syncthreads after some threads exited");
    if (wait_block + done != n) Fail("deadlock");
    for (int i = 0; i < n; ++i) {
      if (g_threads[i].state == kWaitBlock) g_threads[i].state = kRunnable;
    }
  }
  std::free(g_smem);
  g_smem = nullptr;
  for (SharedVar& v : g_static) std::free(v.p);
  g_static.clear();
  g_static_bytes = 0;
}

static size_t g_max_dyn_smem = 48 * 1024;
void SetMaxDynamicSmem(size_t bytes) { g_max_dyn_smem = std::max(g_max_dyn_smem, bytes); }

static uint64_t g_launches = 0;
void RunGrid(const char* kernel, void (*fn)(void*), void* ctx, dim3 grid, dim3 block, size_t smem) {
  InitConfig();
  ++g_launches;
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  const size_t allowed = g_max_dyn_smem;
  g_kernel_name = kernel;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0 || threads > 1024 || block.z > 64 ||
      grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535 || smem > allowed ||
      smem > 227 * 1024) {
    if (std::getenv("EMU_QUIET") == nullptr) {
      std::fprintf(stderr,
                   "EMU: invalid launch configuration grid (%u,%u,%u) block (%u,%u,%u) smem %zu\n",
                   grid.x, grid.y, grid.z, block.x, block.y, block.z, smem);
    }
    g_last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (threads % 32 != 0 && std::getenv("EMU_QUIET") == nullptr) {
    std::fprintf(stderr, "EMU note: block of %llu threads (not a multiple of 32)\n",
                 static_cast<unsigned long long>(threads));
  }
  g_fn = fn;
  g_ctx = ctx;
  g_grid_dim = grid;
  g_block_dim = block;
  g_dyn_smem = smem;
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  std::vector<uint64_t> order;
  if (g_order != 0) {
    order.resize(blocks);
    for (uint64_t i = 0; i < blocks; ++i) order[i] = i;
    if (g_order == 1) std::reverse(order.begin(), order.end());
    if (g_order == 2) {
      for (uint64_t i = blocks; i > 1; --i) std::swap(order[i - 1], order[Rand() % i]);
    }
  }
  for (uint64_t b = 0; b < blocks; ++b) {
    const uint64_t id = g_order != 0 ? order[b] : b;
    g_block_idx =
        dim3(static_cast<unsigned>(id % grid.x), static_cast<unsigned>((id / grid.x) % grid.y),
             static_cast<unsigned>(id / (uint64_t{grid.x} * grid.y)));
    RunBlock();
  }
}
}  // namespace emu

// ---- Host API ------------------------------------------------------------------------------
static std::map<uintptr_t, size_t> g_dev;  // device allocations: start -> bytes
static size_t g_dev_bytes = 0;
static size_t DevCap() {
  static size_t cap = [] {
    const char* c = std::getenv("EMU_MEM_CAP_MB");
    return (c ? std::strtoull(c, nullptr, 10) : 6144ull) << 20;
  }();
  return cap;
}
// True when [p, p + n) lies inside one device allocation.
static bool IsDevice(const void* p, size_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = g_dev.upper_bound(a);
  if (it == g_dev.begin()) return false;
  --it;
  return a >= it->first && a + n <= it->first + it->second;
}
static bool TouchesDevice(const void* p) { return IsDevice(p, 1); }

cudaError_t cudaMalloc(void** p, size_t bytes) {
  emu::InitConfig();
  *p = nullptr;
  if (bytes == 0) return cudaSuccess;
  if (g_dev_bytes + bytes > DevCap()) return cudaErrorMemoryAllocation;
  // cudaMalloc: 256-byte aligned. Exact size, so ASan reports overruns.
  if (posix_memalign(p, 256, bytes) != 0) {
    *p = nullptr;
    return cudaErrorMemoryAllocation;
  }
  std::memset(*p, emu::g_fill, bytes);
  g_dev[reinterpret_cast<uintptr_t>(*p)] = bytes;
  g_dev_bytes += bytes;
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  auto it = g_dev.find(reinterpret_cast<uintptr_t>(p));
  if (it == g_dev.end()) emu::Fail("cudaFree of a pointer cudaMalloc did not return");
  g_dev_bytes -= it->second;
  g_dev.erase(it);
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t bytes) {
  *p = std::malloc(bytes == 0 ? 1 : bytes);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeHost(void* p) {
  std::free(p);
  return cudaSuccess;
}
static cudaError_t CopyChecked(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  if (n == 0) return cudaSuccess;
  bool ok = true;
  switch (kind) {
    case cudaMemcpyHostToDevice:
      ok = IsDevice(dst, n) && !TouchesDevice(src);
      break;
    case cudaMemcpyDeviceToHost:
      ok = IsDevice(src, n) && !TouchesDevice(dst);
      break;
    case cudaMemcpyDeviceToDevice:
      ok = IsDevice(src, n) && IsDevice(dst, n);
      break;
    case cudaMemcpyDefault:
      ok = (IsDevice(src, n) || !TouchesDevice(src)) && (IsDevice(dst, n) || !TouchesDevice(dst));
      break;
    default:
      break;
  }
  if (!ok) {
    std::fprintf(stderr,
                 "EMU: cudaMemcpy kind %d does not match the pointers (or overruns an allocation), "
                 "%zu bytes\n",
                 kind, n);
    return cudaErrorInvalidValue;
  }
  std::memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind k) {
  return CopyChecked(dst, src, n, k);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind k, cudaStream_t) {
  return CopyChecked(dst, src, n, k);
}
cudaError_t cudaMemset(void* p, int v, size_t n) {
  if (n == 0) return cudaSuccess;
  if (!IsDevice(p, n)) {
    std::fprintf(stderr, "EMU: cudaMemset outside device memory\n");
    return cudaErrorInvalidValue;
  }
  std::memset(p, v, n);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) { return cudaMemset(p, v, n); }
cudaError_t cudaGetLastError() {
  const cudaError_t e = emu::g_last_error;
  emu::g_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return emu::g_last_error; }
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    default:
      return "cudaError";
  }
}
const char* cudaGetErrorString(cudaError_t) { return "emulated"; }

namespace sdm::kernels::cuda {
int DeviceCount() { return 1; }
std::string DescribeDevice() { return "CPU fiber emulator"; }
}  // namespace sdm::kernels::cuda
