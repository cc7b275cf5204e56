// Cooperative-fiber emulation of CUDA blocks: every CUDA thread is a fiber; __syncthreads and
// warp collectives are barriers; divergent warp collectives or barrier deadlocks abort.
// Host runtime: device memory is malloc'd (ASan-visible) and registered so that memcpy kinds,
// ranges and GEMM operands can be checked; a capturing stream records its work for a graph
// (checked at capture and again at each replay, so a graph that outlived a buffer it refers to
// fails loudly). Streams run their work as late as CUDA allows (EMU_STREAMS=eager: when it is
// enqueued instead): only when the host waits for it (a stream or event synchronisation, a
// device synchronisation, cudaFree) or another stream waits for an event after it. Then a host
// buffer rewritten before the copy that reads it has run, a result read before the host waited
// for it, or a missing wait between streams gives other numbers, as it may on a device.
// EMU_STREAMS=shuffle:SEED also runs pending work early in random interleavings (ShuffleSeed);
// EMU_STREAMS=others-first runs every other stream's work before the one the host waits for.
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cuda_runtime.h"
#include "emu_blocks.h"
#include "emu_fiber_switch.h"

namespace emu {
enum WarpOp { kOpNone, kOpExchange, kOpBallot, kOpMatch, kOpSync, kOpPost };
constexpr size_t kStack = 128 * 1024;
struct Thread : EmuFiber {
  WarpOp op = kOpNone;
  unsigned mask = 0;
  uint64_t bits = 0;
};
Thread* g_cur = nullptr;
dim3 g_block_idx, g_block_dim, g_grid_dim;
static void* g_sched_sp = nullptr;
// The running cluster's threads: rank r's thread i at r * g_block_slots + i (i < g_nthreads;
// slots padded to whole warps so that no warp spans two blocks).
static std::vector<Thread> g_threads;
static int g_nthreads = 0, g_block_slots = 0;
static EmuCluster g_cluster;  // the running cluster's blocks, by rank
static void (*g_fn)(void*) = nullptr;
static void* g_ctx = nullptr;
static const void* g_main_bottom = nullptr;
static size_t g_main_size = 0;
static cudaError_t g_last_error = cudaSuccess;
static long g_launches = 0;
static std::mutex g_mu;  // host bookkeeping (the store may call from other threads)
static std::map<uintptr_t, size_t> g_device, g_pinned;
static size_t g_device_bytes = 0;
constexpr size_t kDeviceCapacity = size_t{8} << 30;
// Testing seam (sdm_emu_fail_device_allocation): the cudaMalloc this many calls ahead fails (0:
// none armed).
static long g_fail_malloc_in = 0;
static bool g_non_portable_clusters = false;

uint3 CurThreadIdx() { return g_cur->tid; }
int LaneId() { return g_cur->lane; }
void* SharedMem() { return g_cluster.blocks[g_cur->rank].smem; }

static void Fail(const char* what) {
  std::fprintf(stderr, "EMU FAILURE: %s at block (%u,%u,%u) thread %u (launch #%ld)\n", what,
               g_block_idx.x, g_block_idx.y, g_block_idx.z, g_cur ? g_cur->tid.x : 0u, g_launches);
  std::abort();
}
static void HostFail(const std::string& what) {
  std::fprintf(stderr, "EMU HOST FAILURE: %s\n", what.c_str());
  std::abort();
}

static int FillByte() {
  static int b = [] {
    const char* e = std::getenv("EMU_FILL");
    return e ? static_cast<int>(std::strtol(e, nullptr, 0)) : 0xff;
  }();
  return b;
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

static void WarpWait(WarpOp op, unsigned mask) {
  g_cur->op = op;
  g_cur->mask = mask;
  g_cur->state = kWaitWarp;
  Yield();
}

// The first thread of the calling thread's warp.
static Thread* WarpBase() { return &g_threads[g_cur->rank * g_block_slots + g_cur->warp * 32]; }

uint64_t WarpExchange(uint64_t bits, unsigned mask, int src) {
  g_cur->bits = bits;
  WarpWait(kOpExchange, mask);
  if (src < 0 || src > 31) Fail("shuffle source lane out of range");
  const uint64_t r = WarpBase()[src].bits;
  WarpWait(kOpPost, mask);
  return r;
}

unsigned WarpBallot(bool pred, unsigned mask) {
  g_cur->bits = pred ? 1 : 0;
  WarpWait(kOpBallot, mask);
  unsigned r = 0;
  const Thread* lanes = WarpBase();
  for (int i = 0; i < 32 && g_cur->warp * 32 + i < g_nthreads; ++i) {
    if (lanes[i].bits != 0) r |= 1u << i;
  }
  WarpWait(kOpPost, mask);
  return r & mask;
}

unsigned WarpMatchAny(uint64_t bits, unsigned mask) {
  g_cur->bits = bits;
  WarpWait(kOpMatch, mask);
  unsigned r = 0;
  const Thread* lanes = WarpBase();
  for (int i = 0; i < 32 && g_cur->warp * 32 + i < g_nthreads; ++i) {
    if (lanes[i].bits == bits) r |= 1u << i;
  }
  WarpWait(kOpPost, mask);
  return r & mask;
}

void WarpSync(unsigned mask) { WarpWait(kOpSync, mask); }

// ---- Clusters (the cluster_group entry points are in emu_blocks.h) ----
EmuCluster& RunningCluster() { return g_cluster; }
EmuFiber& RunningFiber() { return *g_cur; }
void YieldToScheduler() { Yield(); }
// Blocks run one after another here (no EMU_CORESIDENT): nothing to interleave with.
void InterleavePoint() {}

static void Entry() {
  __sanitizer_finish_switch_fiber(nullptr, &g_main_bottom, &g_main_size);
  g_fn(g_ctx);
  g_cur->state = kDone;
  __sanitizer_start_switch_fiber(nullptr, g_main_bottom, g_main_size);
  emu_switch(&g_cur->sp, g_sched_sp);
  std::abort();
}

// Runs one cluster (g_cluster, started) to completion, in forward order: the lowest rank that
// can run goes as far as its barriers let it before another runs (so a block exits as early as
// it can); each round runs that block's runnable threads in index order, then releases its
// warp collectives every lane has reached, then the barriers every thread they wait for has
// reached.
static void RunCluster() {
  const int n = g_nthreads;
  const int warps = (n + 31) / 32;
  const int ranks = static_cast<int>(g_cluster.blocks.size());
  g_block_slots = warps * 32;
  const size_t total = static_cast<size_t>(ranks) * g_block_slots;
  if (g_threads.size() < total) g_threads.resize(total);
  auto thread_of = [&](int r, int i) -> Thread& { return g_threads[r * g_block_slots + i]; };
  g_cluster.StartFibers(n, g_block_slots, thread_of, g_block_dim, kStack, &Entry);
  for (Thread& t : g_threads) t.op = kOpNone;
  for (;;) {
    int r = 0;
    while (r < ranks && !EmuCluster::Runnable(r, n, thread_of)) ++r;
    if (r < ranks) {
      g_block_idx = g_cluster.blocks[r].idx;
      for (int i = 0; i < n; ++i) {
        Thread& t = thread_of(r, i);
        if (t.state != kRunnable) continue;
        g_cur = &t;
        void* fake = nullptr;
        __sanitizer_start_switch_fiber(&fake, t.stack, kStack);
        emu_switch(&g_sched_sp, t.sp);
        __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
      }
      g_cur = nullptr;
      bool released = false;
      for (int w = 0; w < warps; ++w) {
        const int lo = w * 32, hi = std::min(n, lo + 32);
        int ww = 0;
        for (int i = lo; i < hi; ++i) ww += thread_of(r, i).state == kWaitWarp;
        if (ww == 0) continue;
        g_cur = &thread_of(r, lo);
        if (ww != hi - lo) Fail("divergent warp collective (not every lane of the warp arrived)");
        const WarpOp op = thread_of(r, lo).op;
        const unsigned mask = thread_of(r, lo).mask;
        for (int i = lo; i < hi; ++i) {
          if (thread_of(r, i).op != op) Fail("lanes of a warp in different warp collectives");
          if (thread_of(r, i).mask != mask) Fail("lanes of a warp pass different masks");
        }
        const unsigned full = hi - lo == 32 ? 0xffffffffu : ((1u << (hi - lo)) - 1u);
        if (mask != full) Fail("warp collective mask is not the set of arriving lanes");
        for (int i = lo; i < hi; ++i) thread_of(r, i).state = kRunnable;
        released = true;
      }
      g_cur = nullptr;
      if (released) continue;
    }
    // Block r is stuck: its threads wait at __syncthreads or a cluster barrier, or exited (the
    // other blocks' may still be runnable).
    if (g_cluster.EndRound(n, thread_of, g_block_idx)) break;
  }
}

}  // namespace emu

enum class EmuCapture { kNone, kActive, kInvalidated };
// What the page-locked race check (CheckPinnedAccess) needs to know of an op when it is
// enqueued: the page-locked host bytes it reads or writes (an async copy; empty for the rest),
// and for a cudaStreamWaitEvent the stream and position it waits for.
struct EmuOpOrder {
  uintptr_t host_begin = 0, host_end = 0;
  bool host_write = false;
  cudaStream_t wait_on = nullptr;
  uint64_t wait_position = 0;
  const char* kind = "other";  // what the op is, for EMU_GRAPH_STATS
};
struct EmuStream {
  int id;  // creation order (shuffled streams visit streams in this order, for reproducibility)
  EmuCapture capture = EmuCapture::kNone;
  std::thread::id capturing_thread;
  std::vector<std::function<void()>> ops;     // recorded while capturing
  std::map<std::string, int> captured_kinds;  // how many ops of each kind (EMU_GRAPH_STATS)
  // Deferred streams (the default): the work enqueued and not run yet, in order; `enqueued` counts
  // every op ever enqueued, `ran` those run (so an event names a position: "the first N ops").
  std::deque<std::function<void()>> pending;
  // For the page-locked race check (CheckPinnedAccess): per other stream, how many of its ops
  // this stream's ops enqueued from now on come after (its cudaStreamWaitEvent calls) ...
  std::map<cudaStream_t, uint64_t> waited;
  // ... and this stream's copies to or from page-locked memory that a later copy on another
  // stream could still race with.
  struct PinnedAccess {
    uint64_t index;  // the op's number in its stream
    uintptr_t begin, end;
    bool write;
  };
  std::deque<PinnedAccess> pinned;
  uint64_t enqueued = 0;
  uint64_t ran = 0;
};
struct EmuEvent {
  bool recorded;
  cudaStream_t stream = nullptr;  // deferred streams: the stream of its last record ...
  uint64_t position = 0;          // ... and how many of that stream's ops precede it
};
struct EmuGraph {
  std::vector<std::function<void()>> ops;
};
struct EmuGraphExec {
  std::vector<std::function<void()>> ops;
};

namespace emu {
static std::set<cudaStream_t> g_streams;
static std::set<cudaEvent_t> g_events;
static std::set<cudaGraph_t> g_graphs;
static std::set<cudaGraphExec_t> g_graph_execs;
// The stream this thread is capturing (cudaStreamCaptureModeThreadLocal), or null.
thread_local cudaStream_t t_capturing = nullptr;

static void CheckStream(cudaStream_t s, const char* what) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (s != nullptr && g_streams.count(s) == 0) {
    HostFail(std::string(what) + ": stream was never created or is destroyed");
  }
}

void InvalidateCapture(cudaStream_t s) {
  if (s != nullptr && s->capture == EmuCapture::kActive) {
    s->capture = EmuCapture::kInvalidated;
    s->ops.clear();
  }
}

// A call CUDA refuses while this thread captures (an allocation, a synchronous copy, a
// synchronisation): the capture is invalidated, as on the device, and the call fails.
static bool RefusedWhileCapturing(const char* what) {
  if (t_capturing == nullptr || t_capturing->capture != EmuCapture::kActive) return false;
  if (std::getenv("EMU_VERBOSE")) std::fprintf(stderr, "EMU: %s during stream capture\n", what);
  InvalidateCapture(t_capturing);
  g_last_error = cudaErrorStreamCaptureUnsupported;
  return true;
}

// EMU_STREAMS, parsed once: eager, deferred (unset, or any other value), others-first, or
// shuffle:SEED (the last two are deferred streams too; see ShuffleSeed and OthersFirst).
struct EmuStreamMode {
  bool deferred = true;
  bool others_first = false;
  std::optional<uint64_t> shuffle_seed;
};
static const EmuStreamMode& StreamMode() {
  static const EmuStreamMode mode = [] {
    EmuStreamMode m;
    const char* v = std::getenv("EMU_STREAMS");
    if (v == nullptr) return m;
    m.deferred = std::strcmp(v, "eager") != 0;
    m.others_first = std::strcmp(v, "others-first") == 0;
    if (std::strncmp(v, "shuffle:", 8) == 0) {
      char* end = nullptr;
      errno = 0;
      const uint64_t seed = std::strtoull(v + 8, &end, 10);
      if (v[8] < '0' || v[8] > '9' || *end != '\0' || errno != 0) {
        HostFail("EMU_STREAMS=shuffle:SEED needs a decimal seed");
      }
      m.shuffle_seed = seed;
    }
    return m;
  }();
  return mode;
}
static bool DeferredStreams() { return StreamMode().deferred; }

// EMU_STREAMS=shuffle:SEED: deferred streams, and besides, at every enqueue and every host wait
// a coin (seeded) decides whether some pending work runs early: a random prefix of each stream's
// pending ops, the streams interleaved at random. A device may run a stream's work any time after
// it is enqueued and its waits are met, so this is still a legal order, and it tries orders that
// deferred streams never produce: a stream the host waits for later running first (a download
// missing its wait for the step that writes what it reads, when the host then synchronises the
// step's stream first, runs in the right order deferred and in the wrong one here).
static std::optional<uint64_t> ShuffleSeed() { return StreamMode().shuffle_seed; }

// EMU_STREAMS=others-first: deferred streams, and when the host waits for one stream (its
// synchronisation, an event recorded on it), every other stream's pending work runs first, whole.
// The mirror image of deferred streams, and deterministic: work the host did not wait for runs
// as early as it can relative to the work it waits for, so a stream missing its wait for
// another's later work (a failed park's downloads still queued when the next resume refills the
// staging and uploads it) reads or writes in the wrong order every time. Deferred streams catch
// the opposite: work the host needed and did not wait for.
static bool OthersFirst() { return StreamMode().others_first; }

// Serialises running deferred work (recursive: an op that waits on an event runs another
// stream's ops first).
static std::recursive_mutex g_run_mu;

static bool LiveStream(cudaStream_t s) {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_streams.count(s) > 0;
}

// Per stream, how many of its ops the host has waited for (a stream, event or device
// synchronisation): every op enqueued later, on any stream, comes after them.
static std::map<cudaStream_t, uint64_t> g_host_waited;

// Records that the host waited for stream s's first `position` ops (and forgets their page-locked
// accesses: nothing enqueued from now on can race with them).
static void HostWaited(cudaStream_t s, uint64_t position) {
  uint64_t& waited = g_host_waited[s];
  waited = std::max(waited, position);
  while (!s->pinned.empty() && s->pinned.front().index < waited) s->pinned.pop_front();
}

// The page-locked race check, in every stream mode and whatever order the emulation runs things
// in: op number `index` of stream s, a copy to or from page-locked bytes [begin, end), against
// every copy of overlapping bytes enqueued before it on another stream t (one of the two
// writing) that it does not come after: neither a wait of s for it nor a host synchronisation
// that covered it. On a device the two may run in either order or together: fails loudly.
// (Orders through a third stream's waits are not followed; this project has two streams.)
static void CheckPinnedAccess(cudaStream_t s, uint64_t index, uintptr_t begin, uintptr_t end,
                              bool write) {
  std::vector<cudaStream_t> others;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    others.assign(g_streams.begin(), g_streams.end());
  }
  for (cudaStream_t t : others) {
    if (t == s) continue;
    const auto w = s->waited.find(t);
    const uint64_t after = std::max(w == s->waited.end() ? 0 : w->second, g_host_waited[t]);
    for (const EmuStream::PinnedAccess& a : t->pinned) {
      if (a.index < after || a.end <= begin || end <= a.begin || !(a.write || write)) continue;
      char what[300];
      std::snprintf(what, sizeof(what),
                    "race on page-locked memory: a copy %s [%#lx, %#lx) is enqueued on one "
                    "stream while a copy %s [%#lx, %#lx) on another stream, enqueued earlier, is "
                    "not ordered before it (no event wait, no host synchronisation between them)",
                    write ? "into" : "from", static_cast<unsigned long>(begin),
                    static_cast<unsigned long>(end), a.write ? "into" : "from",
                    static_cast<unsigned long>(a.begin), static_cast<unsigned long>(a.end));
      HostFail(what);
    }
  }
  s->pinned.push_back({index, begin, end, write});
}

// Runs stream s's deferred ops until `position` of them have run.
static void RunUntil(cudaStream_t s, uint64_t position) {
  std::lock_guard<std::recursive_mutex> lock(g_run_mu);
  while (s->ran < position && !s->pending.empty()) {
    std::function<void()> op = std::move(s->pending.front());
    s->pending.pop_front();
    ++s->ran;
    op();
  }
}

// The live streams in creation order.
static std::vector<cudaStream_t> LiveStreams() {
  std::vector<cudaStream_t> streams;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    streams.assign(g_streams.begin(), g_streams.end());
  }
  std::sort(streams.begin(), streams.end(),
            [](cudaStream_t a, cudaStream_t b) { return a->id < b->id; });
  return streams;
}

// EMU_STREAMS=shuffle:SEED (above): maybe runs some pending work early. Called by the host-side
// entry points only (enqueues and waits), never by an op.
static void MaybeRunEarly() {
  const std::optional<uint64_t> seed = ShuffleSeed();
  if (!seed) return;
  std::lock_guard<std::recursive_mutex> lock(g_run_mu);
  static std::mt19937_64 rng(*seed);
  if (rng() % 2 == 0) return;
  // How far each stream runs now: a random prefix of its pending ops.
  std::vector<std::pair<cudaStream_t, uint64_t>> until;
  for (cudaStream_t s : LiveStreams()) {
    const uint64_t n = rng() % (s->pending.size() + 1);
    if (n > 0) until.emplace_back(s, s->ran + n);
  }
  while (!until.empty()) {
    const size_t i = rng() % until.size();
    cudaStream_t s = until[i].first;
    if (s->ran < until[i].second) RunUntil(s, s->ran + 1);  // one op (its waits may run others)
    if (s->ran >= until[i].second || s->pending.empty()) until.erase(until.begin() + i);
  }
}

// Runs every stream's deferred work (what a device synchronisation waits for).
static void RunAllStreams() {
  std::lock_guard<std::recursive_mutex> lock(g_run_mu);
  for (cudaStream_t s : LiveStreams()) HostWaited(s, s->enqueued);
  if (!DeferredStreams()) return;  // nothing is ever pending
  MaybeRunEarly();
  for (cudaStream_t s : LiveStreams()) RunUntil(s, s->enqueued);
}

// EMU_STREAMS=others-first: runs every stream but `waited` to its end.
static void RunOthersFirst(cudaStream_t waited) {
  if (!OthersFirst()) return;
  std::lock_guard<std::recursive_mutex> lock(g_run_mu);
  for (cudaStream_t s : LiveStreams()) {
    if (s != waited) RunUntil(s, s->enqueued);
  }
}

// Runs everything enqueued on s so far; for the legacy stream (null), on every stream (the
// legacy stream's own work runs when it is enqueued).
static void RunStream(cudaStream_t s) {
  if (s == nullptr) return RunAllStreams();
  std::lock_guard<std::recursive_mutex> lock(g_run_mu);
  HostWaited(s, s->enqueued);
  MaybeRunEarly();
  RunOthersFirst(s);
  RunUntil(s, s->enqueued);
}

// Enqueue with what the op touches of page-locked memory, or waits for (EmuOpOrder).
static void EnqueueOp(cudaStream_t s, std::function<void()> op, const EmuOpOrder& order);
void Enqueue(cudaStream_t s, std::function<void()> op, const char* kind) {
  EmuOpOrder order;
  order.kind = kind;
  EnqueueOp(s, std::move(op), order);
}
static void EnqueueOp(cudaStream_t s, std::function<void()> op, const EmuOpOrder& order) {
  if (s != nullptr && s->capture == EmuCapture::kActive) {
    s->ops.push_back(std::move(op));
    ++s->captured_kinds[order.kind];
    return;
  }
  if (s != nullptr && s->capture == EmuCapture::kInvalidated) {
    g_last_error = cudaErrorStreamCaptureInvalidated;
    return;
  }
  if (s != nullptr) {
    std::lock_guard<std::recursive_mutex> lock(g_run_mu);
    if (order.wait_on != nullptr) {
      uint64_t& waited = s->waited[order.wait_on];
      waited = std::max(waited, order.wait_position);
    }
    if (order.host_end > order.host_begin) {
      CheckPinnedAccess(s, s->enqueued, order.host_begin, order.host_end, order.host_write);
    }
    ++s->enqueued;
    if (DeferredStreams()) {
      s->pending.push_back(std::move(op));
      MaybeRunEarly();
      return;
    }
  } else if (DeferredStreams()) {
    // The legacy stream: after everything enqueued before (conservative: the project's streams
    // are non-blocking, which the legacy stream does not wait for on a device).
    std::lock_guard<std::recursive_mutex> lock(g_run_mu);
    RunAllStreams();
  }
  op();
}

bool LaunchAccepted(dim3 grid, dim3 block, size_t smem, cudaStream_t s, dim3 cluster) {
  CheckStream(s, "kernel launch");
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0 || threads > 1024 ||
      grid.y > 65535 || grid.z > 65535 || block.z > 64 || grid.x > 0x7fffffffu ||
      smem > 227 * 1024) {
    if (std::getenv("EMU_VERBOSE")) {
      std::fprintf(stderr, "EMU: invalid launch config grid (%u,%u,%u) block (%u,%u,%u) smem %zu\n",
                   grid.x, grid.y, grid.z, block.x, block.y, block.z, smem);
    }
    g_last_error = cudaErrorInvalidConfiguration;
    InvalidateCapture(s);
    return false;
  }
  if (const char* why = ClusterRefusal(grid, cluster, g_non_portable_clusters)) {
    if (std::getenv("EMU_VERBOSE")) {
      std::fprintf(stderr, "EMU: invalid cluster (%u,%u,%u) for grid (%u,%u,%u): %s\n", cluster.x,
                   cluster.y, cluster.z, grid.x, grid.y, grid.z, why);
    }
    g_last_error = cudaErrorInvalidClusterSize;
    InvalidateCapture(s);
    return false;
  }
  return true;
}

void RunGrid(void (*fn)(void*), void* ctx, dim3 grid, dim3 block, size_t smem, dim3 cluster) {
  ++g_launches;
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads % 32 != 0) {
    std::fprintf(stderr, "EMU NOTE: block of %lu threads (not a multiple of 32)\n",
                 static_cast<unsigned long>(threads));
  }
  g_fn = fn;
  g_ctx = ctx;
  g_grid_dim = grid;
  g_block_dim = block;
  g_nthreads = static_cast<int>(threads);
  if (uint64_t{cluster.x} * cluster.y * cluster.z > 1 && std::getenv("EMU_VERBOSE")) {
    std::fprintf(stderr, "EMU: launch #%ld runs clusters of (%u,%u,%u) over grid (%u,%u,%u)\n",
                 g_launches, cluster.x, cluster.y, cluster.z, grid.x, grid.y, grid.z);
  }
  g_cluster.dim = cluster;
  g_cluster.dyn_smem = smem;
  g_cluster.fill = FillByte();
  g_cluster.fail = [](const char* what) { Fail(what); };
  const uint64_t n_clusters =
      uint64_t{grid.x / cluster.x} * (grid.y / cluster.y) * (grid.z / cluster.z);
  for (uint64_t c = 0; c < n_clusters; ++c) {
    g_cluster.Start(ClusterFirstBlock(grid, cluster, c));
    RunCluster();
  }
  g_cluster.Finish();
  g_cluster.dim = dim3(1, 1, 1);
}

// The allocation holding [p, p + n), or {0, 0}.
static std::pair<uintptr_t, size_t> Find(const std::map<uintptr_t, size_t>& m, const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = m.upper_bound(a);
  if (it == m.begin()) return {0, 0};
  --it;
  if (a >= it->first && a < it->first + std::max<size_t>(it->second, 1)) return *it;
  return {0, 0};
}

bool IsDevicePtr(const void* p, size_t n) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto [base, size] = Find(g_device, p);
  if (base == 0) return false;
  return reinterpret_cast<uintptr_t>(p) + n <= base + size;
}

enum Kind { kHost, kPinned, kDevice };
static Kind KindOf(const void* p, size_t n, const char* what) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto [base, size] = Find(g_device, p);
  if (base != 0) {
    if (reinterpret_cast<uintptr_t>(p) + n > base + size) {
      HostFail(std::string(what) + ": device range of " + std::to_string(n) +
               " bytes runs past its allocation (" + std::to_string(size) + " bytes, offset " +
               std::to_string(reinterpret_cast<uintptr_t>(p) - base) + ")");
    }
    return kDevice;
  }
  auto [pb, ps] = Find(g_pinned, p);
  if (pb != 0) {
    if (reinterpret_cast<uintptr_t>(p) + n > pb + ps) {
      HostFail(std::string(what) + ": pinned range runs past its allocation");
    }
    return kPinned;
  }
  return kHost;
}

static cudaError_t Copy(void* dst, const void* src, size_t n, cudaMemcpyKind kind, const char* what,
                        bool check_only = false) {
  if (n == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) HostFail(std::string(what) + ": null pointer");
  const Kind d = KindOf(dst, n, what), s = KindOf(src, n, what);
  auto fail = [&](const char* why) {
    HostFail(std::string(what) + ": " + why + " (kind " + std::to_string(kind) + ", " +
             std::to_string(n) + " bytes)");
  };
  switch (kind) {
    case cudaMemcpyHostToDevice:
      if (d != kDevice) fail("destination is not device memory");
      if (s == kDevice) fail("source is device memory");
      break;
    case cudaMemcpyDeviceToHost:
      if (s != kDevice) fail("source is not device memory");
      if (d == kDevice) fail("destination is device memory");
      break;
    case cudaMemcpyDeviceToDevice:
      if (s != kDevice || d != kDevice) fail("not device to device");
      break;
    case cudaMemcpyHostToHost:
      if (s == kDevice || d == kDevice) fail("device memory in a host-to-host copy");
      break;
    default:
      break;
  }
  if (!check_only) std::memmove(dst, src, n);
  return cudaSuccess;
}
}  // namespace emu

using namespace emu;

cudaError_t cudaMalloc(void** p, size_t bytes) {
  if (p == nullptr) return cudaErrorInvalidValue;
  if (RefusedWhileCapturing("cudaMalloc")) return cudaErrorStreamCaptureUnsupported;
  *p = nullptr;
  if (bytes == 0) return cudaSuccess;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_device_bytes + bytes > kDeviceCapacity ||
        (g_fail_malloc_in > 0 && --g_fail_malloc_in == 0)) {
      g_last_error = cudaErrorMemoryAllocation;
      return cudaErrorMemoryAllocation;
    }
  }
  void* m = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (m == nullptr) return cudaErrorMemoryAllocation;
  std::memset(m, FillByte(), bytes);  // uninitialised device memory is garbage
  std::lock_guard<std::mutex> lock(g_mu);
  g_device[reinterpret_cast<uintptr_t>(m)] = bytes;
  g_device_bytes += bytes;
  *p = m;
  return cudaSuccess;
}
// Tests under the emulator only (a weak symbol there, absent on a real device): the `n`-th
// cudaMalloc from now (1: the next) fails with cudaErrorMemoryAllocation, as a device out of
// memory does.
extern "C" void sdm_emu_fail_device_allocation(long n) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_fail_malloc_in = n;
}

cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  if (RefusedWhileCapturing("cudaFree")) return cudaErrorStreamCaptureUnsupported;
  RunAllStreams();  // cudaFree waits for the device's work
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_device.find(reinterpret_cast<uintptr_t>(p));
    if (it == g_device.end()) HostFail("cudaFree of a pointer cudaMalloc did not return");
    g_device_bytes -= it->second;
    g_device.erase(it);
  }
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t bytes) {
  if (RefusedWhileCapturing("cudaMallocHost")) return cudaErrorStreamCaptureUnsupported;
  *p = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
  if (*p == nullptr) return cudaErrorMemoryAllocation;
  std::memset(*p, FillByte(), bytes);
  std::lock_guard<std::mutex> lock(g_mu);
  g_pinned[reinterpret_cast<uintptr_t>(*p)] = bytes;
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  if (p == nullptr) return cudaSuccess;
  if (RefusedWhileCapturing("cudaFreeHost")) return cudaErrorStreamCaptureUnsupported;
  RunAllStreams();  // as cudaFree
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_pinned.find(reinterpret_cast<uintptr_t>(p));
    if (it == g_pinned.end()) HostFail("cudaFreeHost of a pointer cudaMallocHost did not return");
    g_pinned.erase(it);
  }
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind k) {
  if (RefusedWhileCapturing("cudaMemcpy")) return cudaErrorStreamCaptureUnsupported;
  return Copy(dst, src, n, k, "cudaMemcpy");
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind k,
                            cudaStream_t s) {
  CheckStream(s, "cudaMemcpyAsync");
  Copy(dst, src, n, k, "cudaMemcpyAsync", /*check_only=*/true);
  const bool capturing = s != nullptr && s->capture != EmuCapture::kNone;
  const Kind dst_kind = KindOf(dst, n, "cudaMemcpyAsync");
  const Kind src_kind = KindOf(src, n, "cudaMemcpyAsync");
  if (DeferredStreams() && !capturing && n > 0) {
    // Pageable host memory is not copied asynchronously on a device: a source is staged at the
    // call, and a copy into it returns once done (after the stream's earlier work).
    if (k == cudaMemcpyHostToDevice && src_kind == kHost) {
      auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                        static_cast<const char*>(src) + n);
      Enqueue(
          s, [=] { Copy(dst, staged->data(), n, k, "cudaMemcpyAsync"); }, "copy");
      return cudaSuccess;
    }
    if (k == cudaMemcpyDeviceToHost && dst_kind == kHost) {
      RunStream(s);
      return Copy(dst, src, n, k, "cudaMemcpyAsync");
    }
  }
  // Page-locked host bytes it reads or writes, for CheckPinnedAccess.
  EmuOpOrder order;
  if (dst_kind == kPinned) {
    order.host_begin = reinterpret_cast<uintptr_t>(dst);
    order.host_write = true;
  } else if (src_kind == kPinned) {
    order.host_begin = reinterpret_cast<uintptr_t>(src);
  }
  if (order.host_begin != 0) order.host_end = order.host_begin + n;
  order.kind = "copy";
  EnqueueOp(
      s, [=] { Copy(dst, src, n, k, "cudaMemcpyAsync"); }, order);
  return cudaSuccess;
}
static void Fill(void* p, int v, size_t n, const char* what) {
  if (n == 0) return;
  if (KindOf(p, n, what) != kDevice) HostFail(std::string(what) + " on non-device memory");
  std::memset(p, v, n);
}
cudaError_t cudaMemset(void* p, int v, size_t n) {
  if (RefusedWhileCapturing("cudaMemset")) return cudaErrorStreamCaptureUnsupported;
  Fill(p, v, n, "cudaMemset");
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t s) {
  CheckStream(s, "cudaMemsetAsync");
  if (n > 0 && KindOf(p, n, "cudaMemsetAsync") != kDevice) {
    HostFail("cudaMemsetAsync on non-device memory");
  }
  Enqueue(
      s, [=] { Fill(p, v, n, "cudaMemsetAsync"); }, "memset");
  return cudaSuccess;
}
cudaError_t cudaGetLastError() {
  const cudaError_t e = g_last_error;
  g_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return g_last_error; }
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
    case cudaErrorStreamCaptureUnsupported:
      return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated:
      return "cudaErrorStreamCaptureInvalidated";
    default:
      return "cudaErrorOther";
  }
}
const char* cudaGetErrorString(cudaError_t e) {
  if (e == cudaErrorNotReady) return "device not ready";
  return e == cudaErrorMemoryAllocation ? "out of memory" : "emulated error";
}
cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidValue; }
cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
  if (d != 0) return cudaErrorInvalidValue;
  std::memset(p, 0, sizeof(*p));
  std::snprintf(p->name, sizeof(p->name), "CPU fiber emulator");
  p->totalGlobalMem = kDeviceCapacity;
  p->sharedMemPerBlock = 48 << 10;
  p->sharedMemPerBlockOptin = 227 << 10;
  p->multiProcessorCount = 132;
  p->major = 9;
  p->minor = 0;
  p->warpSize = 32;
  p->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  std::lock_guard<std::mutex> lock(g_mu);
  *free_bytes = kDeviceCapacity - g_device_bytes;
  *total_bytes = kDeviceCapacity;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  static int created = 0;
  std::lock_guard<std::mutex> lock(g_mu);
  *s = new EmuStream{++created};
  g_streams.insert(*s);
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (LiveStream(s)) RunStream(s);  // its work still completes
  {
    std::lock_guard<std::recursive_mutex> run_lock(g_run_mu);  // before g_mu
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_streams.erase(s) == 0) HostFail("cudaStreamDestroy of an unknown stream");
    if (s->capture != EmuCapture::kNone) HostFail("cudaStreamDestroy of a capturing stream");
    // A later stream may get the same address: nothing may remember this one.
    g_host_waited.erase(s);
    for (cudaStream_t t : g_streams) t->waited.erase(s);
  }
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  CheckStream(s, "cudaStreamSynchronize");
  if (s != nullptr && s->capture != EmuCapture::kNone) {
    InvalidateCapture(s);
    g_last_error = cudaErrorStreamCaptureUnsupported;
    return cudaErrorStreamCaptureUnsupported;
  }
  RunStream(s);
  return cudaSuccess;
}
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
  CheckStream(s, "cudaStreamBeginCapture");
  if (s == nullptr) return cudaErrorStreamCaptureUnsupported;  // the legacy stream
  if (mode != cudaStreamCaptureModeThreadLocal) {
    HostFail("cudaStreamBeginCapture: only cudaStreamCaptureModeThreadLocal is emulated");
  }
  if (s->capture != EmuCapture::kNone || t_capturing != nullptr) {
    HostFail("cudaStreamBeginCapture while a capture is in progress");
  }
  s->capture = EmuCapture::kActive;
  s->capturing_thread = std::this_thread::get_id();
  s->ops.clear();
  t_capturing = s;
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  CheckStream(s, "cudaStreamEndCapture");
  *graph = nullptr;
  if (s == nullptr || s->capture == EmuCapture::kNone) return cudaErrorInvalidValue;
  if (s->capturing_thread != std::this_thread::get_id()) {
    HostFail("cudaStreamEndCapture from another thread than the one that began the capture");
  }
  const bool valid = s->capture == EmuCapture::kActive;
  s->capture = EmuCapture::kNone;
  t_capturing = nullptr;
  std::map<std::string, int> kinds = std::move(s->captured_kinds);
  s->captured_kinds.clear();
  if (!valid) {
    s->ops.clear();
    return cudaErrorStreamCaptureInvalidated;
  }
  if (std::getenv("EMU_GRAPH_STATS")) {
    std::string counts;
    for (const auto& [kind, count] : kinds) {
      counts += " " + std::to_string(count) + " " + kind;
    }
    std::fprintf(stderr, "EMU: captured a graph of %zu ops:%s\n", s->ops.size(), counts.c_str());
  }
  *graph = new EmuGraph{std::move(s->ops)};
  s->ops.clear();
  std::lock_guard<std::mutex> lock(g_mu);
  g_graphs.insert(*graph);
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  CheckStream(s, "cudaStreamIsCapturing");
  *status = s == nullptr || s->capture == EmuCapture::kNone ? cudaStreamCaptureStatusNone
            : s->capture == EmuCapture::kActive             ? cudaStreamCaptureStatusActive
                                                            : cudaStreamCaptureStatusInvalidated;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_graphs.count(graph) == 0) HostFail("cudaGraphInstantiate of an unknown graph");
  *exec = new EmuGraphExec{graph->ops};
  g_graph_execs.insert(*exec);
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  CheckStream(s, "cudaGraphLaunch");
  std::vector<std::function<void()>> ops;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_graph_execs.count(exec) == 0) HostFail("cudaGraphLaunch of an unknown graph exec");
    ops = exec->ops;
  }
  Enqueue(s, [ops = std::move(ops)] {
    for (const std::function<void()>& op : ops) op();
  });
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_graph_execs.erase(exec) == 0) HostFail("cudaGraphExecDestroy of an unknown exec");
  }
  delete exec;
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_graphs.erase(graph) == 0) HostFail("cudaGraphDestroy of an unknown graph");
  }
  delete graph;
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  CheckStream(s, "cudaStreamWaitEvent");
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_events.count(e) == 0) HostFail("cudaStreamWaitEvent on an unknown event");
  }
  if (e->stream != nullptr && e->stream != s && s != nullptr) {
    // s's later work runs after the event's stream has reached the event (eager streams ran it
    // already: only the order is recorded, for the page-locked race check).
    EmuOpOrder order;
    order.wait_on = e->stream;
    order.wait_position = e->position;
    EnqueueOp(
        s,
        [target = e->stream, position = e->position] {
          if (LiveStream(target)) RunUntil(target, position);
        },
        order);
  }
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  if (RefusedWhileCapturing("cudaDeviceSynchronize")) return cudaErrorStreamCaptureUnsupported;
  RunAllStreams();
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = new EmuEvent{false};
  std::lock_guard<std::mutex> lock(g_mu);
  g_events.insert(*e);
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_events.erase(e) == 0) HostFail("cudaEventDestroy of an unknown event");
  }
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  CheckStream(s, "cudaEventRecord");
  std::lock_guard<std::recursive_mutex> run_lock(g_run_mu);  // s->enqueued; before g_mu
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_events.count(e) == 0) HostFail("cudaEventRecord on an unknown event");
  e->recorded = true;
  // Deferred: the position in s's work (none on the legacy stream, which runs at once, or in a
  // capture, whose graph runs its work in order).
  const bool deferred_here = s != nullptr && s->capture == EmuCapture::kNone;
  e->stream = deferred_here ? s : nullptr;
  e->position = deferred_here ? s->enqueued : 0;
  return cudaSuccess;
}
// Runs what the event waits for (deferred streams).
static void ReachEvent(cudaEvent_t e) {
  if (e != nullptr && e->stream != nullptr && LiveStream(e->stream)) {
    std::lock_guard<std::recursive_mutex> lock(g_run_mu);
    HostWaited(e->stream, e->position);
    if (!DeferredStreams()) return;
    MaybeRunEarly();
    RunOthersFirst(e->stream);
    RunUntil(e->stream, e->position);
  }
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  ReachEvent(e);
  return cudaSuccess;
}
// Deferred streams answer as a device may while the work is still queued: not ready, running
// nothing (shuffled streams may first run some work early, as they do at any host call). So code
// that polls an event must cope with work that has not run yet; eager streams are always done.
cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (e != nullptr && e->stream != nullptr && LiveStream(e->stream) && DeferredStreams()) {
    std::lock_guard<std::recursive_mutex> lock(g_run_mu);
    MaybeRunEarly();
    if (e->stream->ran < e->position) return cudaErrorNotReady;
    HostWaited(e->stream, e->position);
    return cudaSuccess;
  }
  ReachEvent(e);
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  ReachEvent(a);
  ReachEvent(b);
  *ms = 1;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
  if (device != 0 || attribute != cudaDevAttrClusterLaunch) return cudaErrorInvalidValue;
  *value = 1;  // a Hopper: clusters of up to 8 blocks, 16 after the non-portable opt-in
  return cudaSuccess;
}

// Approximation: the non-portable cluster opt-in of any kernel applies to every kernel.
cudaError_t EmuFuncSetAttribute(const void*, cudaFuncAttribute attribute, int value) {
  if (attribute == cudaFuncAttributeNonPortableClusterSizeAllowed) {
    if (value != 0) emu::g_non_portable_clusters = true;
    return cudaSuccess;
  }
  return value <= 227 * 1024 ? cudaSuccess : cudaErrorInvalidValue;
}
