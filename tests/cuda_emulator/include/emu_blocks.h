// The blocks of one running cluster and their shared memory, for both emulator dialects'
// schedulers (testing only; include from the dialect's emu.cc only: it defines the
// cluster_group entry points of emu_cuda_common.h). A launch without a cluster is a
// cluster of one block. Each block has its dynamic shared memory and its static __shared__
// variables (allocated on first use, filled with garbage); when all its threads have exited its
// shared memory is freed, so a distributed read through a pointer mapped earlier is a
// use-after-free that ASan reports, and mapping into it is refused.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_runtime.h"

namespace emu {

enum State { kRunnable, kWaitBlock, kWaitWarp, kWaitCluster, kDone };

// What the schedulers keep of every fiber (each dialect's Thread derives from it): its state, its
// block's rank in the cluster, and its cluster-barrier arrivals (so far, whether one awaits its
// wait, and the count a waiting thread needs every non-exited thread of the cluster to reach).
struct EmuFiber {
  void* sp = nullptr;
  char* stack = nullptr;  // kept across launches
  State state = kDone;
  uint3 tid{};
  int lane = 0;
  int warp = 0;  // within its block
  int rank = 0;
  uint64_t arrivals = 0;
  bool arrived = false;
  uint64_t wait_for = 0;

  // Makes this fiber thread i of a block of `block` threads in cluster rank `rank`, runnable
  // from `entry` on a fresh stack frame (emu_switch pops six callee-saved registers, then
  // returns into entry).
  void Start(int i, int rank_in_cluster, dim3 block, size_t stack_bytes, void (*entry)()) {
    if (stack == nullptr) stack = static_cast<char*>(std::malloc(stack_bytes));
    uint64_t* top = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(stack + stack_bytes) &
                                                ~uintptr_t{15});
    *--top = 0;
    *--top = reinterpret_cast<uint64_t>(entry);
    for (int reg = 0; reg < 6; ++reg) *--top = 0;
    sp = top;
    state = kRunnable;
    tid = {static_cast<unsigned>(i % block.x), static_cast<unsigned>((i / block.x) % block.y),
           static_cast<unsigned>(i / (block.x * block.y))};
    lane = i % 32;
    warp = i / 32;
    rank = rank_in_cluster;
    arrivals = 0;
    arrived = false;
    wait_for = 0;
  }
};

struct EmuSharedVar {
  const void* tag;
  void* p;
  size_t bytes;
  size_t align;
};

struct EmuBlock {
  dim3 idx;
  char* smem = nullptr;
  std::vector<EmuSharedVar> statics;
  size_t static_bytes = 0;
  bool exited = false;
};

// The running cluster: blocks by rank, the dynamic shared memory size of the launch, the fill
// byte of fresh shared memory, and the dialect's failure report (aborts).
//
// `coresident`: the blocks are not a cluster but a group of a cluster-less launch's blocks run
// together (EMU_CORESIDENT, kernels/emu.cc) so that their warps interleave, as blocks resident
// on a device at once do; to the kernel each block is then a cluster of one (rank 0, one block,
// its cluster barrier waits for its own threads, map_shared_rank reaches only itself).
struct EmuCluster {
  std::vector<EmuBlock> blocks;
  dim3 dim{1, 1, 1};
  bool coresident = false;
  size_t dyn_smem = 0;
  int fill = 0xff;
  void (*fail)(const char*) = nullptr;  // reports and aborts

  [[noreturn]] void Fail(const char* what) const {
    fail(what);
    std::abort();
  }

  // barrier.cluster.arrive / wait (the caller yields after BeginWait).
  void Arrive(EmuFiber& t) const {
    if (t.arrived) Fail("cluster barrier_arrive twice without a barrier_wait between");
    t.arrived = true;
    ++t.arrivals;
  }
  void BeginWait(EmuFiber& t) const {
    if (!t.arrived) Fail("cluster barrier_wait without a barrier_arrive before it");
    t.arrived = false;
    t.wait_for = t.arrivals;
    t.state = kWaitCluster;
  }
  dim3 IndexInCluster(dim3 block_idx) const {
    if (coresident) return dim3(0, 0, 0);
    return dim3(block_idx.x % dim.x, block_idx.y % dim.y, block_idx.z % dim.z);
  }
  // The cluster's shape as the kernel sees it.
  dim3 KernelDim() const { return coresident ? dim3(1, 1, 1) : dim; }

  // The schedulers' fibers: `fiber(r, i)` is rank r's thread i, for i < `slots` (a block's
  // threads rounded up to whole warps); threads i >= n, the last warp's padding, never run.

  // Starts every block's threads from `entry`.
  template <class FiberOf>
  void StartFibers(int n, int slots, FiberOf fiber, dim3 block, size_t stack_bytes,
                   void (*entry)()) {
    for (int r = 0; r < static_cast<int>(blocks.size()); ++r) {
      for (int i = 0; i < slots; ++i) {
        EmuFiber& t = fiber(r, i);
        t.state = kDone;
        if (i < n) t.Start(i, r, block, stack_bytes, entry);
      }
    }
  }

  // The fewest cluster-barrier arrivals of a non-exited thread of block `rank`.
  template <class FiberOf>
  static uint64_t LeastArrivals(int rank, int n, FiberOf fiber) {
    uint64_t least = UINT64_MAX;
    for (int i = 0; i < n; ++i) {
      const EmuFiber& t = fiber(rank, i);
      if (t.state != kDone && t.arrivals < least) least = t.arrivals;
    }
    return least;
  }

  // Whether a thread of block `rank` can run.
  template <class FiberOf>
  static bool Runnable(int rank, int n, FiberOf fiber) {
    for (int i = 0; i < n; ++i) {
      if (fiber(rank, i).state == kRunnable) return true;
    }
    return false;
  }

  // Ends a scheduling round: releases the barriers (ReleaseBarriers) and fails on a deadlock
  // (nothing released and nothing runnable). Returns true when every thread has exited.
  template <class FiberOf>
  bool EndRound(int n, FiberOf fiber, dim3& block_idx) {
    bool all_done = false;
    bool progress = ReleaseBarriers(n, fiber, block_idx, &all_done);
    if (all_done) return true;
    for (int r = 0; r < static_cast<int>(blocks.size()) && !progress; ++r) {
      progress = Runnable(r, n, fiber);
    }
    if (!progress) {
      Fail("deadlock (threads wait at __syncthreads or a cluster barrier others never reach)");
    }
    return false;
  }

  // Once no block can run further: marks the blocks whose threads all exited (freeing their
  // shared memory), then releases each block barrier its whole block has reached and each
  // cluster wait every non-exited thread of the cluster has arrived at as often as the waiter.
  // `block_idx` is set to the block a failure names. Returns whether anything was released;
  // *all_done when every thread exited.
  template <class FiberOf>
  bool ReleaseBarriers(int n, FiberOf fiber, dim3& block_idx, bool* all_done) {
    const int ranks = static_cast<int>(blocks.size());
    int cluster_done = 0;
    uint64_t least_arrivals = UINT64_MAX;
    for (int r = 0; r < ranks; ++r) {
      int done = 0;
      for (int i = 0; i < n; ++i) {
        const EmuFiber& t = fiber(r, i);
        if (t.state == kDone) {
          ++done;
        } else {
          least_arrivals = t.arrivals < least_arrivals ? t.arrivals : least_arrivals;
        }
      }
      cluster_done += done;
      if (done == n) Exited(r);
    }
    *all_done = cluster_done == ranks * n;
    if (*all_done) return false;
    bool released = false;
    for (int r = 0; r < ranks; ++r) {
      block_idx = blocks[r].idx;
      int done = 0, wait_block = 0;
      for (int i = 0; i < n; ++i) {
        done += fiber(r, i).state == kDone;
        wait_block += fiber(r, i).state == kWaitBlock;
      }
      if (wait_block == 0 || wait_block + done != n) continue;
      if (done > 0) Fail("__syncthreads after some threads exited");
      for (int i = 0; i < n; ++i) fiber(r, i).state = kRunnable;
      released = true;
    }
    for (int r = 0; r < ranks; ++r) {
      // A co-resident group's blocks are clusters of one: a wait counts its own block's arrivals.
      const uint64_t least = coresident ? LeastArrivals(r, n, fiber) : least_arrivals;
      for (int i = 0; i < n; ++i) {
        EmuFiber& t = fiber(r, i);
        if (t.state == kWaitCluster && t.wait_for <= least) {
          t.state = kRunnable;
          released = true;
        }
      }
    }
    block_idx = blocks[0].idx;
    return released;
  }

  unsigned RankOf(dim3 idx) const {
    return idx.x % dim.x + (idx.y % dim.y) * dim.x + (idx.z % dim.z) * dim.x * dim.y;
  }

  // Indexes the blocks of the cluster whose first block is `first`, and gives each its dynamic
  // shared memory.
  void Start(dim3 first) {
    for (EmuBlock& b : blocks) Free(b);
    blocks.assign(static_cast<size_t>(dim.x) * dim.y * dim.z, EmuBlock{});
    for (unsigned z = 0; z < dim.z; ++z) {
      for (unsigned y = 0; y < dim.y; ++y) {
        for (unsigned x = 0; x < dim.x; ++x) {
          const dim3 idx(first.x + x, first.y + y, first.z + z);
          Open(blocks[RankOf(idx)], idx);
        }
      }
    }
  }
  // A co-resident group (coresident set): the `count` blocks of `grid` from linear index
  // `first` on (x fastest), as ranks 0 .. count - 1.
  void StartGroup(dim3 grid, uint64_t first, unsigned count) {
    for (EmuBlock& b : blocks) Free(b);
    blocks.assign(count, EmuBlock{});
    for (unsigned r = 0; r < count; ++r) {
      const uint64_t id = first + r;
      Open(blocks[r],
           dim3(static_cast<unsigned>(id % grid.x), static_cast<unsigned>((id / grid.x) % grid.y),
                static_cast<unsigned>(id / (uint64_t{grid.x} * grid.y))));
    }
  }
  // Block `idx` with fresh dynamic shared memory of the exact size (so that ASan reports an
  // overrun), filled with `fill`.
  void Open(EmuBlock& b, dim3 idx) {
    b.idx = idx;
    void* sm = nullptr;
    if (posix_memalign(&sm, 16, dyn_smem == 0 ? 1 : dyn_smem) != 0) Fail("out of memory");
    b.smem = static_cast<char*>(sm);
    std::memset(b.smem, fill, dyn_smem == 0 ? 1 : dyn_smem);
  }
  void Finish() {
    for (EmuBlock& b : blocks) Free(b);
    blocks.clear();
  }
  static void Free(EmuBlock& b) {
    std::free(b.smem);
    b.smem = nullptr;
    for (EmuSharedVar& v : b.statics) std::free(v.p);
    b.statics.clear();
    b.static_bytes = 0;
  }
  void Exited(int rank) {
    if (!blocks[rank].exited) {
      blocks[rank].exited = true;
      Free(blocks[rank]);
    }
  }

  // Static __shared__ variable `tag` of block `rank`, allocated on its first use. Sizes are
  // checked against the hardware limits.
  void* Static(int rank, const void* tag, size_t bytes, size_t align) {
    EmuBlock& b = blocks[rank];
    for (const EmuSharedVar& v : b.statics) {
      if (v.tag == tag) return v.p;
    }
    void* p = nullptr;
    if (posix_memalign(&p, align < 16 ? 16 : align, bytes == 0 ? 1 : bytes) != 0) {
      Fail("out of memory");
    }
    std::memset(p, fill, bytes);
    b.statics.push_back({tag, p, bytes, align});
    b.static_bytes += bytes;
    if (b.static_bytes > 48 * 1024) Fail("static shared memory over 48 KiB");
    if (b.static_bytes + dyn_smem > 227 * 1024) Fail("shared memory over 227 KiB");
    return p;
  }

  // map_shared_rank: `addr` in block `from`'s shared memory (dynamic, or a static variable) to
  // the same place in block `rank`.
  void* Map(int from, const void* addr, unsigned rank) {
    if (rank >= blocks.size()) Fail("map_shared_rank: rank beyond the cluster");
    const uintptr_t a = reinterpret_cast<uintptr_t>(addr);
    const EmuBlock& mine = blocks[from];
    EmuBlock& target = blocks[rank];
    const uintptr_t dyn = reinterpret_cast<uintptr_t>(mine.smem);
    const EmuSharedVar* var = nullptr;
    size_t offset = 0;
    if (mine.smem != nullptr && a >= dyn && a < dyn + (dyn_smem == 0 ? 1 : dyn_smem)) {
      offset = a - dyn;
    } else {
      for (const EmuSharedVar& v : mine.statics) {
        const uintptr_t p = reinterpret_cast<uintptr_t>(v.p);
        if (a >= p && a < p + (v.bytes == 0 ? 1 : v.bytes)) {
          var = &v;
          offset = a - p;
          break;
        }
      }
      if (var == nullptr) {
        Fail("distributed shared memory: the address is not in the calling block's shared memory");
      }
    }
    if (target.exited) Fail("map_shared_rank into a block that has exited");
    if (var == nullptr) return target.smem + offset;
    const EmuSharedVar v = *var;  // Static may grow the vector var points into (rank == from)
    return static_cast<char*>(Static(static_cast<int>(rank), v.tag, v.bytes, v.align)) + offset;
  }

  // query_shared_rank: the block whose shared memory holds `addr`.
  unsigned Query(const void* addr) const {
    const uintptr_t a = reinterpret_cast<uintptr_t>(addr);
    for (size_t r = 0; r < blocks.size(); ++r) {
      const EmuBlock& b = blocks[r];
      const uintptr_t dyn = reinterpret_cast<uintptr_t>(b.smem);
      if (b.smem != nullptr && a >= dyn && a < dyn + (dyn_smem == 0 ? 1 : dyn_smem)) {
        return static_cast<unsigned>(r);
      }
      for (const EmuSharedVar& v : b.statics) {
        const uintptr_t p = reinterpret_cast<uintptr_t>(v.p);
        if (a >= p && a < p + (v.bytes == 0 ? 1 : v.bytes)) return static_cast<unsigned>(r);
      }
    }
    Fail("query_shared_rank of an address in no block's shared memory");
  }
};

// The dialect's emu.cc defines these three: its running cluster, the running fiber, and the
// switch back to its scheduler. The cluster_group entry points below use them.
EmuCluster& RunningCluster();
EmuFiber& RunningFiber();
void YieldToScheduler();

void ClusterArrive() { RunningCluster().Arrive(RunningFiber()); }
void ClusterWait() {
  RunningCluster().BeginWait(RunningFiber());
  YieldToScheduler();
}
unsigned ClusterBlockRank() {
  return RunningCluster().coresident ? 0u : static_cast<unsigned>(RunningFiber().rank);
}
dim3 ClusterDim() { return RunningCluster().KernelDim(); }
dim3 ClusterBlockIndex() {
  EmuCluster& c = RunningCluster();
  return c.IndexInCluster(c.blocks[RunningFiber().rank].idx);
}
void* MapSharedRank(const void* addr, unsigned rank) {
  EmuCluster& c = RunningCluster();
  const int me = RunningFiber().rank;
  if (!c.coresident) return c.Map(me, addr, rank);
  if (rank != 0) c.Fail("map_shared_rank: rank beyond the cluster");
  return c.Map(me, addr, static_cast<unsigned>(me));
}
unsigned QuerySharedRank(const void* addr) {
  EmuCluster& c = RunningCluster();
  const unsigned r = c.Query(addr);
  if (!c.coresident) return r;
  if (r != static_cast<unsigned>(RunningFiber().rank)) {
    c.Fail("query_shared_rank of an address in another block's shared memory");
  }
  return 0;
}

// Why a launch's cluster is refused (nullptr: accepted): it must tile the grid and hold at most
// 8 blocks, or 16 after the non-portable opt-in.
inline const char* ClusterRefusal(dim3 grid, dim3 cluster, bool non_portable_allowed) {
  const uint64_t blocks = uint64_t{cluster.x} * cluster.y * cluster.z;
  if (blocks == 0 || grid.x % cluster.x != 0 || grid.y % cluster.y != 0 ||
      grid.z % cluster.z != 0) {
    return "the cluster does not tile the grid";
  }
  if (blocks > (non_portable_allowed ? 16u : 8u)) {
    return "more blocks per cluster than allowed (8, or 16 after the non-portable opt-in)";
  }
  return nullptr;
}

// The first block of cluster number `id` (clusters numbered x fastest).
inline dim3 ClusterFirstBlock(dim3 grid, dim3 cluster, uint64_t id) {
  const dim3 clusters(grid.x / cluster.x, grid.y / cluster.y, grid.z / cluster.z);
  return dim3(static_cast<unsigned>(id % clusters.x) * cluster.x,
              static_cast<unsigned>((id / clusters.x) % clusters.y) * cluster.y,
              static_cast<unsigned>(id / (uint64_t{clusters.x} * clusters.y)) * cluster.z);
}

}  // namespace emu
