// Cooperative-fiber emulation of CUDA blocks: every CUDA thread is a fiber; __syncthreads and
// warp shuffles are barriers; divergent shuffles or barrier deadlocks abort.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "cuda_runtime.h"
#include "emu_blocks.h"
#include "emu_fiber_switch.h"

namespace emu {
constexpr size_t kStack = 256 * 1024;
struct Thread : EmuFiber {
  unsigned wmask = 0;
  int wkind = 0;
};
dim3 g_block_idx, g_block_dim, g_grid_dim;
static Thread* g_cur = nullptr;
static void* g_sched_sp = nullptr;
// The running cluster's threads: rank r's thread i at r * g_block_slots + i (i < g_block_threads;
// slots are padded to whole warps so that no warp spans two blocks).
static std::vector<Thread> g_threads;
static EmuCluster g_cluster;  // the running cluster's blocks, by rank
static int g_block_threads = 0, g_block_slots = 0;
static void (*g_fn)(void*) = nullptr;
static void* g_ctx = nullptr;
static std::vector<uint64_t> g_warp_vals;
static const void* g_main_bottom = nullptr;
static size_t g_main_size = 0;
static cudaError_t g_last_error = cudaSuccess;
static const char* g_kernel_name = "";

// EMU_ORDER: fwd (default), rev, or rand[:seed] -- order of fibers within a scheduling round and
// of blocks in the grid, to expose missing barriers and inter-block order dependence.
// EMU_FILL: byte that fresh device and shared memory is filled with (default 0xff).
// EMU_CORESIDENT: K > 1, with EMU_ORDER=rand, runs a cluster-less launch's blocks in groups of
// K consecutive blocks (x fastest; the last group may be shorter) whose warps interleave like a
// cluster's, and lets a thread's atomics, fences and __ldcg hand over to the others
// (InterleavePoint): blocks that talk through global memory during one launch then meet each
// other mid-way, as resident blocks do on a device. Ignored with fwd and rev.
static int g_order = -1;  // 0 fwd, 1 rev, 2 rand
static uint64_t g_rng = 88172645463325252ull;
static int g_fill = 0xff;
static unsigned g_coresident = 1;  // 1 when EMU_CORESIDENT is unset, or the order is not rand
static void InitConfig() {
  if (g_order >= 0) return;
  g_order = 0;
  if (const char* k = std::getenv("EMU_CORESIDENT")) {
    const unsigned long v = std::strtoul(k, nullptr, 10);
    g_coresident = v < 1 ? 1 : (v > 64 ? 64 : static_cast<unsigned>(v));
  }
  if (const char* o = std::getenv("EMU_ORDER")) {
    if (std::strncmp(o, "rev", 3) == 0) g_order = 1;
    if (std::strncmp(o, "rand", 4) == 0) {
      g_order = 2;
      if (o[4] == ':') g_rng = std::strtoull(o + 5, nullptr, 10) * 2654435761ull + 1;
    }
  }
  if (g_order != 2 && g_coresident > 1) {
    if (std::getenv("EMU_QUIET") == nullptr) {
      std::fprintf(stderr, "EMU note: EMU_CORESIDENT needs EMU_ORDER=rand; ignored\n");
    }
    g_coresident = 1;
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
void* SharedMem() { return g_cluster.blocks[g_cur->rank].smem; }

void Fail(const char* what) {
  std::fprintf(stderr, "EMU FAILURE: %s in kernel %s at block (%u,%u,%u)", what, g_kernel_name,
               g_block_idx.x, g_block_idx.y, g_block_idx.z);
  if (g_cur != nullptr) std::fprintf(stderr, " thread %u", g_cur->tid.x);
  std::fprintf(stderr, "\n");
  std::abort();
}

void* StaticShared(const void* tag, size_t bytes, size_t align) {
  return g_cluster.Static(g_cur->rank, tag, bytes, align);
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
  const int base = me->rank * g_block_slots + me->warp * 32;
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

// ---- Clusters (the cluster_group entry points are in emu_blocks.h) ----
EmuCluster& RunningCluster() { return g_cluster; }
EmuFiber& RunningFiber() { return *g_cur; }
void YieldToScheduler() { Yield(); }
void InterleavePoint() {
  if (g_cur != nullptr && g_cluster.coresident) Yield();  // stays runnable
}

static void Entry() {
  __sanitizer_finish_switch_fiber(nullptr, &g_main_bottom, &g_main_size);
  g_fn(g_ctx);
  g_cur->state = kDone;
  __sanitizer_start_switch_fiber(nullptr, g_main_bottom, g_main_size);
  emu_switch(&g_cur->sp, g_sched_sp);
  std::abort();
}

// Releases every group of warp (rank, w) whose lanes all wait at the same collective; fails on a
// group that can never complete (a lane of the mask exited, waits at a barrier, or at another
// collective). Called only when no lane of the warp is runnable.
static bool ReleaseWarp(int rank, int w) {
  const int n = g_block_threads;
  Thread* const lanes = &g_threads[rank * g_block_slots + w * 32];
  bool released = false, waiting = false;
  unsigned handled = 0;
  for (int l = 0; l < 32 && w * 32 + l < n; ++l) {
    const Thread& t = lanes[l];
    if (t.state != kWaitWarp || ((handled >> l) & 1u)) continue;
    const unsigned m = t.wmask;
    bool complete = true;
    for (int i = 0; i < 32; ++i) {
      if (((m >> i) & 1u) == 0) continue;
      if (w * 32 + i >= n) Fail("warp collective mask names a lane beyond the block");
      const Thread& o = lanes[i];
      if (o.state == kDone) Fail("warp collective waits for an exited lane");
      if (o.state == kWaitBlock) Fail("warp collective waits for a lane parked at __syncthreads");
      if (o.state == kWaitCluster) Fail("warp collective waits for a lane at a cluster barrier");
      // A lane released by an earlier group of this pass has not arrived yet; a lane waiting at
      // another collective may be released later in the pass. Either way: not yet.
      if (o.state != kWaitWarp || o.wmask != m || o.wkind != t.wkind) complete = false;
    }
    if (!complete) {
      waiting = true;
      continue;
    }
    for (int i = 0; i < 32; ++i) {
      if ((m >> i) & 1u) lanes[i].state = kRunnable;
    }
    handled |= m;
    released = true;
  }
  if (waiting && !released) {
    Fail("warp collectives that can never complete (divergent lanes: different masks or calls)");
  }
  return released;
}

// Whether a lane of warp w of block `rank` can run (one paused at an interleave point).
static bool WarpRunnable(int rank, int w) {
  const Thread* const lanes = &g_threads[rank * g_block_slots + w * 32];
  for (int l = 0; l < 32 && w * 32 + l < g_block_threads; ++l) {
    if (lanes[l].state == kRunnable) return true;
  }
  return false;
}

// Runs one cluster (g_cluster, started) to completion.
static void RunCluster() {
  const int n = g_block_threads;
  const int warps = (n + 31) / 32;
  const int ranks = static_cast<int>(g_cluster.blocks.size());
  g_block_slots = warps * 32;
  const size_t total = static_cast<size_t>(ranks) * g_block_slots;
  if (g_threads.size() < total) g_threads.resize(total);
  g_warp_vals.assign(total, 0);
  auto thread_of = [&](int r, int i) -> Thread& { return g_threads[r * g_block_slots + i]; };
  g_cluster.StartFibers(n, g_block_slots, thread_of, g_block_dim, kStack, &Entry);
  // Warp at a time: a warp runs (through its warp collectives) until every lane waits at a
  // barrier or exited, then the next warp (in EMU_ORDER) runs. Warps thus overtake each other as
  // far as the barriers allow, which exposes a missing __syncthreads in one order or the other;
  // lanes within a warp run in EMU_ORDER too. Then the barriers every thread they wait for has
  // reached are released. The blocks of a cluster: with fwd (rev) one block at a time, the
  // lowest (highest) rank that can run goes as far as it can before any other runs, so a block
  // exits as early as the barriers let it (a read of its shared memory that a missing cluster
  // barrier left late then fails in MapSharedRank); with rand the warps of all of them
  // interleave. A co-resident group's blocks (EMU_CORESIDENT) are scheduled the same way, and
  // a lane paused at an interleave point lets the next warp run.
  std::vector<int> warp_order(ranks * warps), lane_order(32);
  // A co-resident group under rand: each round, each warp runs with probability 1/2 (at least
  // one runnable warp does), so that warps and blocks drift whole barrier phases apart instead
  // of moving in step from barrier to barrier.
  std::vector<char> stalled(ranks * warps, 0);
  std::vector<int> runnable;
  const bool stalls = g_cluster.coresident;  // under rand only (InitConfig)
  for (;;) {
    Order(warp_order);
    int only_rank = -1;
    if (ranks > 1 && g_order != 2) {
      for (int k = 0; k < ranks && only_rank < 0; ++k) {
        const int r = g_order == 1 ? ranks - 1 - k : k;
        if (EmuCluster::Runnable(r, n, thread_of)) only_rank = r;
      }
    }
    if (stalls) {
      runnable.clear();
      bool one_runs = false;
      for (int rw = 0; rw < ranks * warps; ++rw) {
        stalled[rw] = Rand() % 2 == 0;
        if (WarpRunnable(rw / warps, rw % warps)) {
          runnable.push_back(rw);
          one_runs = one_runs || !stalled[rw];
        }
      }
      if (!one_runs && !runnable.empty()) stalled[runnable[Rand() % runnable.size()]] = 0;
    }
    for (int rw : warp_order) {
      const int r = rw / warps, w = rw % warps;
      if (only_rank >= 0 && r != only_rank) continue;
      if (stalls && stalled[rw]) continue;
      g_block_idx = g_cluster.blocks[r].idx;
      for (;;) {
        Order(lane_order);
        for (int l : lane_order) {
          const int i = w * 32 + l;
          if (i >= n) continue;
          Thread& t = thread_of(r, i);
          if (t.state != kRunnable) continue;
          g_cur = &t;
          void* fake = nullptr;
          __sanitizer_start_switch_fiber(&fake, t.stack, kStack);
          emu_switch(&g_sched_sp, t.sp);
          __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
        }
        g_cur = nullptr;
        // A lane that stopped at an interleave point lets the other warps go first; with rand,
        // a co-resident group's warp goes on three times in four, so that warps drift apart
        // (one reads what another has not written yet, or writes after it).
        if (WarpRunnable(r, w)) {
          if (g_cluster.coresident && Rand() % 4 != 0) continue;
          break;
        }
        if (!ReleaseWarp(r, w)) break;
      }
    }
    // Every thread of the blocks that ran now waits at __syncthreads or a cluster barrier, or
    // exited; the other blocks' may still be runnable.
    if (g_cluster.EndRound(n, thread_of, g_block_idx)) break;
  }
}

static size_t g_max_dyn_smem = 48 * 1024;
void SetMaxDynamicSmem(size_t bytes) { g_max_dyn_smem = std::max(g_max_dyn_smem, bytes); }
static bool g_non_portable_clusters = false;
void AllowNonPortableClusters() { g_non_portable_clusters = true; }

static uint64_t g_launches = 0;
cudaError_t RunGrid(const char* kernel, void (*fn)(void*), void* ctx, dim3 grid, dim3 block,
                    size_t smem, dim3 cluster) {
  InitConfig();
  ++g_launches;
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  const size_t allowed = g_max_dyn_smem;
  g_kernel_name = kernel;
  auto refuse = [&](cudaError_t e, const char* why) {
    if (std::getenv("EMU_QUIET") == nullptr) {
      std::fprintf(stderr,
                   "EMU: invalid launch configuration (%s) grid (%u,%u,%u) block (%u,%u,%u) "
                   "cluster (%u,%u,%u) smem %zu\n",
                   why, grid.x, grid.y, grid.z, block.x, block.y, block.z, cluster.x, cluster.y,
                   cluster.z, smem);
    }
    g_last_error = e;
    return e;
  };
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0 || threads > 1024 || block.z > 64 ||
      grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535 || smem > allowed ||
      smem > 227 * 1024) {
    return refuse(cudaErrorInvalidConfiguration, "grid, block or shared memory");
  }
  if (const char* why = ClusterRefusal(grid, cluster, g_non_portable_clusters)) {
    return refuse(cudaErrorInvalidClusterSize, why);
  }
  if (threads % 32 != 0 && std::getenv("EMU_QUIET") == nullptr) {
    std::fprintf(stderr, "EMU note: block of %llu threads (not a multiple of 32)\n",
                 static_cast<unsigned long long>(threads));
  }
  g_fn = fn;
  g_ctx = ctx;
  g_grid_dim = grid;
  g_block_dim = block;
  // A cluster-less launch under EMU_CORESIDENT runs as groups of g_coresident consecutive
  // blocks (to the kernel each still a cluster of one).
  const bool coresident = g_coresident > 1 && cluster.x * cluster.y * cluster.z == 1;
  g_cluster.coresident = coresident;
  g_cluster.dim = cluster;
  g_cluster.dyn_smem = smem;
  g_cluster.fill = g_fill;
  g_cluster.fail = [](const char* what) { Fail(what); };
  g_block_threads = static_cast<int>(threads);
  const uint64_t n_blocks = uint64_t{grid.x} * grid.y * grid.z;
  const uint64_t n_clusters =
      coresident ? (n_blocks + g_coresident - 1) / g_coresident
                 : uint64_t{grid.x / cluster.x} * (grid.y / cluster.y) * (grid.z / cluster.z);
  std::vector<uint64_t> order;
  if (g_order != 0) {
    order.resize(n_clusters);
    for (uint64_t i = 0; i < n_clusters; ++i) order[i] = i;
    if (g_order == 1) std::reverse(order.begin(), order.end());
    if (g_order == 2) {
      for (uint64_t i = n_clusters; i > 1; --i) std::swap(order[i - 1], order[Rand() % i]);
    }
  }
  for (uint64_t c = 0; c < n_clusters; ++c) {
    const uint64_t id = g_order != 0 ? order[c] : c;
    if (coresident) {
      const uint64_t first = id * g_coresident;
      const uint64_t left = n_blocks - first;
      g_cluster.StartGroup(grid, first,
                           static_cast<unsigned>(left < g_coresident ? left : g_coresident));
    } else {
      g_cluster.Start(ClusterFirstBlock(grid, cluster, id));
    }
    RunCluster();
  }
  g_cluster.Finish();
  g_cluster.dim = dim3(1, 1, 1);
  g_cluster.coresident = false;
  return cudaSuccess;
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
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
  if (device != 0 || attribute != cudaDevAttrClusterLaunch) return cudaErrorInvalidValue;
  *value = 1;  // a Hopper: clusters of up to 8 blocks, 16 after the non-portable opt-in
  return cudaSuccess;
}
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
std::string DescribeDevice() {
  emu::InitConfig();
  if (emu::g_coresident > 1) {
    return "CPU fiber emulator, co-resident blocks (EMU_CORESIDENT=" +
           std::to_string(emu::g_coresident) + ")";
  }
  return "CPU fiber emulator";
}
}  // namespace sdm::kernels::cuda
