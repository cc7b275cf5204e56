// The process heap of a long-running server (glibc malloc): keeps its resident size tracking the
// bytes in use rather than the highest any allocator arena ever reached.
//
// Left alone, glibc's malloc lets RSS creep up under a serving load although the bytes in use are
// flat (docs/robustness.md, Soak test, has the figures): each of its arenas (up to 8 per core,
// taken by whichever threads allocate) keeps the pages of chunks freed below its top, and its
// dynamic mmap threshold rises to the size of the largest block freed (up to 32 MiB), after which
// blocks of that size (a session's KV pages, encode buffers, forks' clones) come from the arenas
// too and are never returned. Three remedies (SetArenaMax is declared below):
//
//   SetMmapThreshold(bytes): blocks of at least `bytes` are mapped on their own and unmapped on
//     free (a fixed threshold also turns the dynamic one off), and an arena's top is trimmed
//     once it holds more than 2 x bytes free. Call once, early in main(): a block is mapped only
//     when no free space already held fits it.
//   HeapTrimmer: a thread that calls malloc_trim(0) at most every `interval`, handing the free
//     pages inside every arena back to the system (madvise), not only those at an arena's top,
//     but only when the bytes in use are within a slack of their highest sample of the last
//     interval (HeapTrimSchedule): bursts of work less than an interval apart are not trimmed in
//     the gaps between them. Trims in the gaps handed 30-80 MB back on debug_sdm, which the next
//     burst faulted back in, and coincided with its refusals taking 58-81 ms at p99 instead of
//     7-45 (docs/benchmarks.md, "Overload rejection latency": why is not established).
//
// Both are no-ops (returning false / trimming nothing) where the C library is not glibc.
//
// Thread-safety: SetMmapThreshold() and SetArenaMax() are safe to call from any thread but meant
// for startup;
// TrimHeap() and HeapTrimmer's methods are thread-safe.
#ifndef SDMSERVE_BASE_HEAP_H_
#define SDMSERVE_BASE_HEAP_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace sdm {

// The threshold the soak test measured (--malloc_mmap_threshold=65536): a tiny model's KV page
// (2 x 256 rows of 128 bytes) and everything larger is mapped on its own. Not sdm-server's
// default (0: glibc's dynamic threshold): a fixed one maps and unmaps every large per-step
// temporary of the CPU engine, which cost 0.72-0.81x decode throughput at batch 8
// (docs/benchmarks.md, "What the fixed mmap threshold costs in decode").
inline constexpr size_t kSoakMmapThreshold = size_t{64} << 10;

// Sets glibc's M_MMAP_THRESHOLD to `bytes` and M_TRIM_THRESHOLD to 2 x bytes (fixed: no dynamic
// adjustment) unless the environment
// already sets it (MALLOC_MMAP_THRESHOLD_, or glibc.malloc.mmap_threshold in GLIBC_TUNABLES),
// which then wins. Returns whether this call set it.
bool SetMmapThreshold(size_t bytes);

// Caps glibc's malloc arenas at `arenas` (M_ARENA_MAX) unless the environment already sets it
// (MALLOC_ARENA_MAX, or glibc.malloc.arena_max in GLIBC_TUNABLES), which then wins. Once as many
// arenas exist, a thread without one shares an existing arena instead of creating another. Each
// arena keeps its used part at the peak of the threads that allocate from it, which the soak
// test saw as most of its RSS growth (docs/robustness.md, Soak test); with one arena the heap
// held stayed flat. Call early in main(), before the threads that allocate start; arenas
// created before the call stay. Returns whether this call set it.
bool SetArenaMax(int arenas);

// The per-thread cache of glibc's malloc (tcache) keeps up to 7 freed chunks of each size up to
// 1,032 bytes in the thread that freed them. A server that allocates on one thread and frees on
// another (requests built on gRPC threads and freed on the step thread, responses the other way)
// fills the freeing threads' caches while the allocating threads take new chunks from the
// arena: the bytes in use rise by a bounded but slow ~150 bytes a turn in the soak test (up to
// ~235 KiB per thread; docs/benchmarks.md, "The bytes in use that were per-thread caches").
// glibc reads the cache size only from GLIBC_TUNABLES at process start (mallopt has no such
// parameter), so the only way for a process to set it is to execute itself again.
//
// If the environment does not already set glibc.malloc.tcache_count (it then wins), re-executes
// /proc/self/exe with the same arguments (read from /proc/self/cmdline) and GLIBC_TUNABLES
// extended by glibc.malloc.tcache_count=`count`; on success it does not return. Returns OK
// without doing anything when count < 0 or the environment sets the count; an error when the
// re-execution failed (the process carries on with glibc's default). Call first thing in main(),
// before any thread starts and before anything is opened that must not be opened twice.
absl::Status ReexecWithTcacheCount(int count);

// The tcache count this process runs with as far as GLIBC_TUNABLES says (-1: not set there,
// glibc's default of 7).
int TcacheCountFromEnvironment();

// Bytes the heap has in use (allocated and not freed), and what it holds from the system (arena
// pages and mapped blocks). glibc's mallinfo2(); zeros elsewhere. Chunks held in the threads'
// caches (tcache, above) count as in use.
struct HeapUsage {
  int64_t in_use_bytes = 0;
  int64_t system_bytes = 0;
  int64_t mapped_blocks = 0;  // blocks mapped on their own (at least the mmap threshold)
};
HeapUsage GetHeapUsage();

// malloc_trim(0): returns free pages of every arena to the system. Returns whether any memory
// was released (false where unsupported).
bool TrimHeap();

// How far above the bytes in use now a recent peak may have been for a trim to go ahead: the
// in-flight temporaries of a steady load (a step's activations, requests being read) come and go
// below it, while a burst that starts sessions (tens of MB of rows and caches) exceeds it.
inline constexpr int64_t kHeapTrimSlackBytes = int64_t{8} << 20;

// When HeapTrimmer trims: at most once per `interval`, and only when no sample of the bytes in
// use during the last `interval` exceeded the current one by more than `slack_bytes`: a trim
// comes when the bytes in use are near their highest of the last interval, so what it hands back
// is more than that interval's peak needed. A steady or growing load trims every interval (what
// keeps RSS flat under the soak test's fragmentation); a load that comes in bursts less than an
// interval apart is not trimmed in the gaps between them (only near a burst's peak), and once
// the bursts stop the next trim comes about an interval after the last peak.
//
// A value type fed by one caller (HeapTrimmer's thread; tests feed it made-up times).
// Thread-compatible.
class HeapTrimSchedule {
 public:
  explicit HeapTrimSchedule(absl::Duration interval, int64_t slack_bytes = kHeapTrimSlackBytes);

  // Records `in_use_bytes` as the bytes in use at `now` (times must not go backwards) and says
  // whether to trim now; true counts as a trim done at `now`. The first sample starts the first
  // interval.
  bool Sample(absl::Time now, int64_t in_use_bytes);

 private:
  const absl::Duration interval_;
  const int64_t slack_bytes_;
  absl::Time last_trim_ = absl::InfinitePast();  // or the first sample's time
  // Samples of the last interval, oldest first, each above every later one (a later sample at
  // least as high makes the earlier ones irrelevant to the peak): the front is the peak.
  std::deque<std::pair<absl::Time, int64_t>> peaks_;
};

class HeapTrimmer {
 public:
  // Starts the thread, which samples the bytes in use (GetHeapUsage) every interval / 4 or every
  // second, whichever is shorter, and trims as HeapTrimSchedule(interval) says; interval must be
  // positive.
  explicit HeapTrimmer(absl::Duration interval);
  // Stops and joins the thread.
  ~HeapTrimmer();
  HeapTrimmer(const HeapTrimmer&) = delete;
  HeapTrimmer& operator=(const HeapTrimmer&) = delete;

  // Trims done so far.
  int64_t trims() const;
  // Blocks until at least `n` trims are done (for tests; no timeout).
  void AwaitTrims(int64_t n) const;

 private:
  void Loop();

  const absl::Duration interval_;
  mutable absl::Mutex mu_;
  mutable absl::CondVar changed_;  // stop_ set, or trims_ grew
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t trims_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace sdm

#endif  // SDMSERVE_BASE_HEAP_H_
