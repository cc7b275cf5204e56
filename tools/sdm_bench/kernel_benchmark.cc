#include "tools/sdm_bench/kernel_benchmark.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "common/percentile.h"
#include "kernels/common/device_layout.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_runtime_info.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/sdm.h"
#include "nlohmann/json.hpp"
#include "tools/sdm_bench/device_info.h"
#include "tools/sdm_bench/system_info.h"

namespace sdm::bench {
namespace {

namespace kc = kernels::cuda;
using bf16 = __nv_bfloat16;
using nlohmann::json;

// The targets.
constexpr double kKernelTargetFraction = 0.70;  // SDM step and attention decode, of copy
constexpr double kParkTargetGbps = 25.0;        // each way through pinned host memory

// sdm_flagship's SDM geometry (docs/model-spec.md §8) and baseline_1.4B's full attention.
constexpr int64_t kSdmHeads = 2, kSdmSide = 256, kSdmWidth = 1024, kSdmW = 128, kSdmR = 128;
constexpr int64_t kSdmSlots = kSdmSide * kSdmSide;
constexpr int64_t kSdmLayers = 6;
constexpr int32_t kAttnHeads = 16, kAttnKvHeads = 8, kAttnHeadDim = 128;
constexpr int64_t kDim = 2048, kFfnHidden = 5632;  // sdm_flagship's layer input and FFN width
constexpr int kStackCopies = 8;                    // BenchStackedGemm: weights per cycle

absl::Status Cuda(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return absl::OkStatus();
  const std::string text = kc::CudaErrorText(err);
  cudaGetLastError();
  return err == cudaErrorMemoryAllocation
             ? absl::ResourceExhaustedError(absl::StrCat(what, ": ", text))
             : absl::InternalError(absl::StrCat(what, ": ", text));
}

// Rounds to the nearest bf16, ties to even (inputs are finite).
uint16_t Bf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

template <typename T>
absl::Status Upload(T* dst, const std::vector<T>& src, const char* what) {
  return Cuda(cudaMemcpy(dst, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice), what);
}

template <typename T>
absl::Status Alloc(kc::DeviceBuffer<T>& buf, size_t count, const std::string& what) {
  return Cuda(buf.Allocate(count),
              absl::StrFormat("allocating %s (%.2f GB)", what, count * sizeof(T) / 1e9));
}

// Fills `count` bf16 values at `dst` with uniform values in [-scale, scale]: a 64 MiB random
// chunk uploaded as often as needed (the contents do not change the memory traffic; they only
// have to be finite and varied).
absl::Status FillBf16(bf16* dst, size_t count, float scale, std::mt19937_64& rng) {
  const size_t chunk = std::min<size_t>(count, size_t{32} << 20);
  std::vector<uint16_t> host(chunk);
  std::uniform_real_distribution<float> u(-scale, scale);
  for (auto& x : host) x = Bf16Bits(u(rng));
  for (size_t done = 0; done < count; done += chunk) {
    const size_t n = std::min(chunk, count - done);
    SDM_RETURN_IF_ERROR(
        Cuda(cudaMemcpy(dst + done, host.data(), n * sizeof(uint16_t), cudaMemcpyHostToDevice),
             "uploading random values"));
  }
  return absl::OkStatus();
}

std::vector<float> RandomFloats(size_t n, float lo, float hi, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// Weights like an activated softmax: positive, summing to 1 over each group of `k`.
std::vector<float> RandomWeights(size_t groups, int64_t k, std::mt19937_64& rng) {
  std::vector<float> v = RandomFloats(groups * k, 0.1f, 1.0f, rng);
  for (size_t g = 0; g < groups; ++g) {
    float sum = 0;
    for (int64_t i = 0; i < k; ++i) sum += v[g * k + i];
    for (int64_t i = 0; i < k; ++i) v[g * k + i] /= sum;
  }
  return v;
}

struct Timing {
  double median_s = 0;
  double min_s = 0;
};

// Times `body(rep)` on `stream`: warm-up repetitions, then `reps` timed ones, each between two
// events; the median and the minimum.
absl::StatusOr<Timing> Time(cudaStream_t stream, int warmup, int reps,
                            const std::function<cudaError_t(int)>& body, const char* what) {
  kc::CudaEvent start, stop;
  SDM_RETURN_IF_ERROR(Cuda(start.Create(/*timing=*/true), "creating an event"));
  SDM_RETURN_IF_ERROR(Cuda(stop.Create(/*timing=*/true), "creating an event"));
  std::vector<double> times;
  for (int i = 0; i < warmup + reps; ++i) {
    SDM_RETURN_IF_ERROR(Cuda(cudaEventRecord(start.get(), stream), "recording an event"));
    SDM_RETURN_IF_ERROR(Cuda(body(i), what));
    SDM_RETURN_IF_ERROR(Cuda(cudaEventRecord(stop.get(), stream), "recording an event"));
    // Synchronising on the event also surfaces errors raised while the kernels ran.
    SDM_RETURN_IF_ERROR(Cuda(cudaEventSynchronize(stop.get()), what));
    float ms = 0;
    SDM_RETURN_IF_ERROR(
        Cuda(cudaEventElapsedTime(&ms, start.get(), stop.get()), "reading an event"));
    if (i >= warmup) times.push_back(ms * 1e-3);
  }
  std::sort(times.begin(), times.end());
  return Timing{PercentileOfSorted(times, 50), times.front()};
}

// One line of the table (and of the JSON document).
struct Row {
  std::string benchmark;
  std::string shape;
  int64_t batch = 0;  // 0: not batched
  double bytes = 0;   // moved per repetition
  Timing t;
  double copy_gbps = 0;  // the reference
  // Target: a fraction of copy bandwidth (> 0), or an absolute rate in GB/s.
  double target_fraction = 0;
  double target_gbps = 0;

  double gbps() const { return bytes / t.median_s / 1e9; }
  double fraction() const { return copy_gbps > 0 ? gbps() / copy_gbps : 0; }
  bool has_target() const { return target_fraction > 0 || target_gbps > 0; }
  bool meets() const {
    return target_fraction > 0 ? fraction() >= target_fraction : gbps() >= target_gbps;
  }
  std::string target() const {
    if (target_fraction > 0) return absl::StrFormat(">= %.0f%% copy", 100 * target_fraction);
    if (target_gbps > 0) return absl::StrFormat(">= %.0f GB/s", target_gbps);
    return "-";
  }
  json ToJson() const {
    json j = {{"benchmark", benchmark},
              {"shape", shape},
              {"batch", batch},
              {"bytes", bytes},
              {"median_ms", t.median_s * 1e3},
              {"min_ms", t.min_s * 1e3},
              {"gbps", gbps()},
              {"fraction_of_copy", fraction()},
              {"target", target()}};
    j["meets_target"] = has_target() ? json(meets()) : json();
    return j;
  }
};

std::string TableHeader() {
  return absl::StrFormat("%-22s %-44s %5s %10s %10s %10s %9s %7s %-14s %5s", "benchmark", "shape",
                         "batch", "MB moved", "median ms", "min ms", "GB/s", "% copy", "target",
                         "meets");
}

std::string TableRow(const Row& r) {
  return absl::StrFormat(
      "%-22s %-44s %5s %10.1f %10.3f %10.3f %9.1f %6.1f%% %-14s %5s", r.benchmark, r.shape,
      r.batch > 0 ? absl::StrCat(r.batch) : "-", r.bytes / 1e6, r.t.median_s * 1e3, r.t.min_s * 1e3,
      r.gbps(), 100 * r.fraction(), r.target(), r.has_target() ? (r.meets() ? "yes" : "NO") : "-");
}

void Print(const Row& r) {
  std::printf("%s\n", TableRow(r).c_str());
  std::fflush(stdout);
}

// ---- SDM step ----

// Where a decode plan allocates the write rows, for the benchmark's label.
std::string PlanAllocation(const kernels::SdmDecodePlan& plan) {
  switch (plan.alloc) {
    case kernels::SdmDecodeAlloc::kInBlock:
      return "allocated in the block";
    case kernels::SdmDecodeAlloc::kCluster:
      return absl::StrFormat("clusters of %d", plan.cluster_blocks);
    case kernels::SdmDecodeAlloc::kSeparate:
      return "allocated by a launch of its own";
  }
  return "?";
}

// SdmStep (and SdmPrepareRows + SdmStep) at `batch` sessions of sdm_flagship's geometry.
absl::Status BenchSdm(int64_t batch, const KernelBenchOptions& opt, double copy_gbps,
                      cudaStream_t stream, std::mt19937_64& rng, std::vector<Row>& rows) {
  const int64_t per_set = batch * kSdmHeads;  // (session, head) pairs
  const double set_bytes = static_cast<double>(per_set) * (kSdmW + kSdmR) * kSdmWidth * 2;
  // Sets of distinct slots cycled through by the repetitions: enough that one cycle touches at
  // least 256 MB of rows (several times the L2 cache), and every set's slots are distinct from
  // every other's (K * (W + R) <= s * s).
  const int64_t max_sets = kSdmSlots / (kSdmW + kSdmR);
  const int64_t sets = std::clamp<int64_t>(static_cast<int64_t>(std::ceil(256e6 / set_bytes)), 4,
                                           std::min<int64_t>(200, max_sets));
  // Rows: every set's write and read rows, plus the reserve SdmPrepareRows requires free
  // (rows * heads * n_w) for the timed prepare (which allocates nothing: its slots have rows).
  const int64_t capacity = sets * per_set * (kSdmW + kSdmR) + per_set * kSdmW;

  kc::DeviceBuffer<bf16> arena_rows, m0;
  kc::DeviceBuffer<int32_t> free_list, free_count, tables, counters, first_row, length;
  kc::DeviceBuffer<int32_t*> table_ptrs, counter_ptrs;
  SDM_RETURN_IF_ERROR(Alloc(arena_rows, capacity * kSdmWidth, "the SDM row arena"));
  SDM_RETURN_IF_ERROR(Alloc(m0, kSdmHeads * kSdmSlots * kSdmWidth, "M0"));
  SDM_RETURN_IF_ERROR(Alloc(free_list, capacity, "the free list"));
  SDM_RETURN_IF_ERROR(Alloc(free_count, 1, "the free count"));
  SDM_RETURN_IF_ERROR(Alloc(tables, batch * kSdmHeads * kSdmSlots, "slot tables"));
  SDM_RETURN_IF_ERROR(Alloc(counters, batch, "row counters"));
  SDM_RETURN_IF_ERROR(Alloc(first_row, batch, "segments"));
  SDM_RETURN_IF_ERROR(Alloc(length, batch, "segments"));
  SDM_RETURN_IF_ERROR(Alloc(table_ptrs, batch, "segments"));
  SDM_RETURN_IF_ERROR(Alloc(counter_ptrs, batch, "segments"));

  SDM_RETURN_IF_ERROR(FillBf16(arena_rows.get(), arena_rows.size(), 0.5f, rng));
  SDM_RETURN_IF_ERROR(FillBf16(m0.get(), m0.size(), 0.5f, rng));
  // Every slot at M0 (kSdmNoRow = -1 is all one bits), no private rows counted yet.
  static_assert(kernels::kSdmNoRow == -1);
  SDM_RETURN_IF_ERROR(
      Cuda(cudaMemset(tables.get(), 0xff, tables.bytes()), "resetting the slot tables"));
  SDM_RETURN_IF_ERROR(Cuda(cudaMemset(counters.get(), 0, counters.bytes()), "memset"));
  {
    std::vector<int32_t> fr(batch), len(batch, 1);
    std::iota(fr.begin(), fr.end(), 0);
    std::vector<int32_t*> tp(batch), cp(batch);
    for (int64_t b = 0; b < batch; ++b) {
      tp[b] = tables.get() + b * kSdmHeads * kSdmSlots;
      cp[b] = counters.get() + b;
    }
    SDM_RETURN_IF_ERROR(Upload(first_row.get(), fr, "uploading segments"));
    SDM_RETURN_IF_ERROR(Upload(length.get(), len, "uploading segments"));
    SDM_RETURN_IF_ERROR(Upload(table_ptrs.get(), tp, "uploading segments"));
    SDM_RETURN_IF_ERROR(Upload(counter_ptrs.get(), cp, "uploading segments"));
  }
  const kc::SdmRowArena arena{arena_rows.get(), free_list.get(), free_count.get(), kSdmWidth,
                              capacity};
  const kc::SdmDims dims{kSdmHeads, kSdmSide, kSdmWidth};
  kc::SdmSegments segs;
  segs.first_row = first_row.get();
  segs.length = length.get();
  segs.tables = table_ptrs.get();
  segs.row_counts = counter_ptrs.get();
  segs.num = batch;
  segs.max_length = 1;
  SDM_RETURN_IF_ERROR(
      Cuda(kc::SdmInitFreeList(arena, capacity, stream), "initialising the free list"));

  // Slots: per (session, head) a random permutation of its s * s slots; set k writes the sorted
  // slots [k (W + R), k (W + R) + W) and reads the next R (sorted, as SdmAddress emits them).
  const int64_t nw = per_set * kSdmW, nr = per_set * kSdmR;
  std::vector<int32_t> w_slots(sets * nw), r_slots(sets * nr);
  {
    std::vector<int32_t> perm(kSdmSlots);
    for (int64_t p = 0; p < per_set; ++p) {
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int64_t k = 0; k < sets; ++k) {
        int32_t* w = &w_slots[k * nw + p * kSdmW];
        int32_t* r = &r_slots[k * nr + p * kSdmR];
        const int32_t* src = &perm[k * (kSdmW + kSdmR)];
        std::copy(src, src + kSdmW, w);
        std::copy(src + kSdmW, src + kSdmW + kSdmR, r);
        std::sort(w, w + kSdmW);
        std::sort(r, r + kSdmR);
      }
    }
  }
  kc::DeviceBuffer<int32_t> d_w_slots, d_r_slots, w_rows, r_refs, tmp_rows, tmp_refs;
  SDM_RETURN_IF_ERROR(Alloc(d_w_slots, w_slots.size(), "write slots"));
  SDM_RETURN_IF_ERROR(Alloc(d_r_slots, r_slots.size(), "read slots"));
  SDM_RETURN_IF_ERROR(Alloc(w_rows, w_slots.size(), "write rows"));
  SDM_RETURN_IF_ERROR(Alloc(r_refs, r_slots.size(), "read references"));
  SDM_RETURN_IF_ERROR(Alloc(tmp_rows, std::max(nw, nr), "scratch rows"));
  SDM_RETURN_IF_ERROR(Alloc(tmp_refs, std::max(nw, nr), "scratch references"));
  SDM_RETURN_IF_ERROR(Upload(d_w_slots.get(), w_slots, "uploading slots"));
  SDM_RETURN_IF_ERROR(Upload(d_r_slots.get(), r_slots, "uploading slots"));
  // Make every set's rows private: first the read slots are written (allocating their rows), then
  // the write slots, whose prepare also resolves the read slots to those private rows (a session
  // whose state is mostly written, the steady state after a few thousand tokens).
  for (int64_t k = 0; k < sets; ++k) {
    SDM_RETURN_IF_ERROR(Cuda(
        kc::SdmPrepareRows(d_r_slots.get() + k * nr, kSdmR, d_r_slots.get() + k * nr, kSdmR, segs,
                           dims, m0.get(), arena, tmp_rows.get(), tmp_refs.get(), stream),
        "SdmPrepareRows (allocating the read rows)"));
    SDM_RETURN_IF_ERROR(
        Cuda(kc::SdmPrepareRows(d_w_slots.get() + k * nw, kSdmW, d_r_slots.get() + k * nr, kSdmR,
                                segs, dims, m0.get(), arena, w_rows.get() + k * nw,
                                r_refs.get() + k * nr, stream),
             "SdmPrepareRows (allocating the write rows)"));
  }
  SDM_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream), "preparing rows"));
  // Check what the prepare produced: every reference a private row inside the arena, and the free
  // list down by exactly the rows allocated (else the figures below would not mean what they say).
  {
    std::vector<int32_t> wr(w_rows.size()), rr(r_refs.size());
    int32_t free_left = -1;
    SDM_RETURN_IF_ERROR(Cuda(
        cudaMemcpy(wr.data(), w_rows.get(), w_rows.bytes(), cudaMemcpyDeviceToHost), "readback"));
    SDM_RETURN_IF_ERROR(Cuda(
        cudaMemcpy(rr.data(), r_refs.get(), r_refs.bytes(), cudaMemcpyDeviceToHost), "readback"));
    SDM_RETURN_IF_ERROR(
        Cuda(cudaMemcpy(&free_left, free_count.get(), sizeof(int32_t), cudaMemcpyDeviceToHost),
             "readback"));
    auto bad = [&](int32_t x) { return x < 0 || x >= capacity; };
    const int64_t bad_w = std::count_if(wr.begin(), wr.end(), bad);
    const int64_t bad_r = std::count_if(rr.begin(), rr.end(), bad);
    const int64_t expected_free = capacity - sets * per_set * (kSdmW + kSdmR);
    if (bad_w != 0 || bad_r != 0 || free_left != expected_free) {
      return absl::InternalError(absl::StrFormat(
          "SdmPrepareRows at batch %d: %d write rows and %d read references are not private rows, "
          "%d rows free (expected %d)",
          batch, bad_w, bad_r, free_left, expected_free));
    }
  }

  // The step's small inputs (the same every repetition: a few hundred KB, L2-resident anyway).
  kc::DeviceBuffer<float> w_weights, r_weights, log_decay, beta, v, readings;
  SDM_RETURN_IF_ERROR(Alloc(w_weights, nw, "write weights"));
  SDM_RETURN_IF_ERROR(Alloc(r_weights, nr, "read weights"));
  SDM_RETURN_IF_ERROR(Alloc(log_decay, per_set, "decays"));
  SDM_RETURN_IF_ERROR(Alloc(beta, per_set, "betas"));
  SDM_RETURN_IF_ERROR(Alloc(v, per_set * kSdmWidth, "values"));
  SDM_RETURN_IF_ERROR(Alloc(readings, per_set * kSdmWidth, "readings"));
  SDM_RETURN_IF_ERROR(Upload(w_weights.get(), RandomWeights(per_set, kSdmW, rng), "upload"));
  SDM_RETURN_IF_ERROR(Upload(r_weights.get(), RandomWeights(per_set, kSdmR, rng), "upload"));
  // alpha = exp(g) in (0.9, 1): rows stay bounded over any number of repetitions.
  SDM_RETURN_IF_ERROR(
      Upload(log_decay.get(), RandomFloats(per_set, -0.1f, -0.001f, rng), "upload"));
  SDM_RETURN_IF_ERROR(Upload(beta.get(), RandomFloats(per_set, 0.1f, 0.9f, rng), "upload"));
  SDM_RETURN_IF_ERROR(
      Upload(v.get(), RandomFloats(per_set * kSdmWidth, -1.0f, 1.0f, rng), "upload"));

  kc::SdmStepArgs args;
  args.w_weights = w_weights.get();
  args.n_w = kSdmW;
  args.r_weights = r_weights.get();
  args.n_r = kSdmR;
  args.log_decay = log_decay.get();
  args.beta = beta.get();
  args.v = v.get();
  args.m0 = m0.get();
  args.readings = readings.get();

  const std::string shape =
      absl::StrFormat("flagship: heads 2, s 256, hd 1024, W=R=128, %d sets", sets);
  const double bytes = static_cast<double>(per_set) * (2 * kSdmW + kSdmR) * kSdmWidth * 2;
  // Times `body(k)` with repetition i on set k = i % sets (each set its own slots).
  auto time_sets = [&](const char* what, const std::function<cudaError_t(int64_t)>& body) {
    return Time(
        stream, opt.warmup, opt.reps, [&](int rep) { return body(rep % sets); }, what);
  };
  absl::StatusOr<Timing> step = time_sets("SdmStep", [&](int64_t k) {
    kc::SdmStepArgs a = args;
    a.w_rows = w_rows.get() + k * nw;
    a.r_refs = r_refs.get() + k * nr;
    return kc::SdmStep(a, segs, dims, arena, stream);
  });
  if (!step.ok()) return step.status();
  rows.push_back({"sdm step", shape, batch, bytes, *step, copy_gbps, kKernelTargetFraction, 0});
  Print(rows.back());

  absl::StatusOr<Timing> both = time_sets("SdmPrepareRows + SdmStep", [&](int64_t k) {
    // The slots already have rows: nothing is allocated (the steady state).
    const cudaError_t err =
        kc::SdmPrepareRows(d_w_slots.get() + k * nw, kSdmW, d_r_slots.get() + k * nr, kSdmR, segs,
                           dims, m0.get(), arena, tmp_rows.get(), tmp_refs.get(), stream);
    if (err != cudaSuccess) return err;
    kc::SdmStepArgs a = args;
    a.w_rows = tmp_rows.get();
    a.r_refs = tmp_refs.get();
    return kc::SdmStep(a, segs, dims, arena, stream);
  });
  if (!both.ok()) return both.status();
  rows.push_back(
      {"sdm prepare+step", shape, batch, bytes, *both, copy_gbps, kKernelTargetFraction, 0});
  Print(rows.back());

  // The decode kernel on the same steady state: its bytes are the same (each written row read
  // and written once, each read row read once; reads of a slot written this token hit the
  // staged copy, none here: the sets' write and read slots are disjoint).
  kc::SdmDecodeArgs dec;
  dec.w_weights = w_weights.get();
  dec.n_w = kSdmW;
  dec.r_weights = r_weights.get();
  dec.n_r = kSdmR;
  dec.log_decay = log_decay.get();
  dec.beta = beta.get();
  dec.v = v.get();
  dec.m0 = m0.get();
  dec.readings = readings.get();
  dec.w_rows = tmp_rows.get();
  // The decode step with clusters up to `max_cluster_blocks` (1: none).
  auto time_decode = [&](int64_t max_cluster_blocks, const char* what) {
    return time_sets(what, [&](int64_t k) {
      kc::SdmDecodeArgs a = dec;
      a.w_slots = d_w_slots.get() + k * nw;
      a.r_slots = d_r_slots.get() + k * nr;
      return kc::SdmDecodeStep(a, segs, dims, arena, stream, max_cluster_blocks);
    });
  };
  absl::StatusOr<Timing> decode = time_decode(kernels::kSdmMaxClusterBlocks, "SdmDecodeStep");
  if (!decode.ok()) return decode.status();
  // What the step launched (kernels/common/sdm_decode_plan.h, capped by what this device
  // grants): at these shapes a row is several tiles, run as one cluster whose rank 0 allocates;
  // the row after it is the same step without clusters (the allocation in a launch of its own),
  // to show what the clusters save.
  kc::SdmDecodeArgs plan_args = dec;
  plan_args.w_slots = d_w_slots.get();
  plan_args.r_slots = d_r_slots.get();
  const kernels::SdmDecodePlan plan = kc::SdmDecodeStepPlan(plan_args, segs, dims, arena);
  rows.push_back({"sdm decode step",
                  absl::StrFormat("%s; %d-byte tiles, %d per row, %s", shape, 2 * plan.vec,
                                  plan.tiles, PlanAllocation(plan)),
                  batch, bytes, *decode, copy_gbps, kKernelTargetFraction, 0});
  Print(rows.back());
  absl::StatusOr<Timing> separate = time_decode(1, "SdmDecodeStep without clusters");
  if (!separate.ok()) return separate.status();
  rows.push_back({"sdm decode step, no clusters", shape, batch, bytes, *separate, copy_gbps,
                  kKernelTargetFraction, 0});
  Print(rows.back());

  // What was timed computes the same bits (the kernel tests check these paths against the CPU
  // twins at these shapes, tests/kernels/cuda_sdm_test.cc): set 0's step from one copy of the
  // arena by SdmStep, by the decode step and by the decode step without clusters; every row of
  // the arena and every reading of the last two must equal the first's.
  kc::DeviceBuffer<bf16> saved;
  SDM_RETURN_IF_ERROR(Alloc(saved, arena_rows.size(), "a copy of the SDM row arena"));
  SDM_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(saved.get(), arena_rows.get(), arena_rows.bytes(),
                                           cudaMemcpyDeviceToDevice, stream),
                           "copying the arena"));
  struct Outcome {
    std::vector<uint16_t> rows;  // bf16 bits
    std::vector<float> readings;
  };
  auto run_from_copy = [&](const char* what,
                           const std::function<cudaError_t()>& body) -> absl::StatusOr<Outcome> {
    SDM_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(arena_rows.get(), saved.get(), saved.bytes(),
                                             cudaMemcpyDeviceToDevice, stream),
                             "restoring the arena"));
    // NaN bits, so that readings a kernel failed to write cannot match the previous run's.
    SDM_RETURN_IF_ERROR(
        Cuda(cudaMemsetAsync(readings.get(), 0xff, readings.bytes(), stream), "clearing readings"));
    SDM_RETURN_IF_ERROR(Cuda(body(), what));
    SDM_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream), what));
    Outcome o;
    o.rows.resize(arena_rows.size());
    o.readings.resize(readings.size());
    SDM_RETURN_IF_ERROR(Cuda(
        cudaMemcpy(o.rows.data(), arena_rows.get(), arena_rows.bytes(), cudaMemcpyDeviceToHost),
        "reading the arena back"));
    SDM_RETURN_IF_ERROR(Cuda(
        cudaMemcpy(o.readings.data(), readings.get(), readings.bytes(), cudaMemcpyDeviceToHost),
        "reading the readings back"));
    return o;
  };
  absl::StatusOr<Outcome> want = run_from_copy("SdmStep", [&] {
    kc::SdmStepArgs a = args;
    a.w_rows = w_rows.get();
    a.r_refs = r_refs.get();
    return kc::SdmStep(a, segs, dims, arena, stream);
  });
  if (!want.ok()) return want.status();
  for (const int64_t max_cluster_blocks : {kernels::kSdmMaxClusterBlocks, int64_t{1}}) {
    absl::StatusOr<Outcome> got = run_from_copy("SdmDecodeStep", [&] {
      kc::SdmDecodeArgs a = dec;
      a.w_slots = d_w_slots.get();
      a.r_slots = d_r_slots.get();
      return kc::SdmDecodeStep(a, segs, dims, arena, stream, max_cluster_blocks);
    });
    if (!got.ok()) return got.status();
    int64_t rows_differ = 0, readings_differ = 0;
    for (size_t i = 0; i < want->rows.size(); ++i) rows_differ += got->rows[i] != want->rows[i];
    for (size_t i = 0; i < want->readings.size(); ++i) {
      readings_differ +=
          std::memcmp(&got->readings[i], &want->readings[i], sizeof(float)) != 0 ? 1 : 0;
    }
    if (rows_differ != 0 || readings_differ != 0) {
      return absl::InternalError(absl::StrFormat(
          "SdmDecodeStep (clusters of up to %d blocks) at batch %d differs from SdmStep: %d of "
          "%d row elements and %d of %d readings",
          max_cluster_blocks, batch, rows_differ, want->rows.size(), readings_differ,
          want->readings.size()));
    }
  }
  std::printf(
      "# sdm decode step at batch %lld: the same bits as SdmStep (with and without "
      "clusters)\n",
      static_cast<long long>(batch));
  return absl::OkStatus();
}

// ---- Attention decode ----

absl::Status BenchAttention(const KernelBenchOptions& opt, double copy_gbps, cudaStream_t stream,
                            std::mt19937_64& rng, std::vector<Row>& rows) {
  const int64_t ctx = opt.context;
  const int64_t kv_width = int64_t{kAttnKvHeads} * kAttnHeadDim;
  const int64_t pages_per_seq = (ctx + kernels::kKvPageTokens - 1) / kernels::kKvPageTokens;
  const int64_t max_batch = *std::max_element(opt.batches.begin(), opt.batches.end());
  // As many sequences as the largest batch: a smaller batch cycles through them, so consecutive
  // repetitions read different sequences (one sequence's cache is 128 MB at 32k, beyond L2).
  const int64_t seqs = max_batch;
  const int64_t pages = seqs * pages_per_seq;
  const double pool_bytes =
      static_cast<double>(pages) * kernels::KvPageElements(kv_width) * sizeof(bf16);
  size_t free_bytes = 0, total_bytes = 0;
  SDM_RETURN_IF_ERROR(Cuda(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));
  if (pool_bytes > 0.9 * static_cast<double>(free_bytes)) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "attention decode: %d sequences x %d positions need %.1f GB of KV, %.1f GB are free "
        "(lower --kernel_context or the largest --kernel_batches)",
        seqs, ctx, pool_bytes / 1e9, free_bytes / 1e9));
  }
  kc::DeviceBuffer<bf16> pool;
  kc::DeviceBuffer<int32_t> page_ids, positions;
  kc::DeviceBuffer<const int32_t*> table_ptrs;
  kc::DeviceBuffer<float> q, out, scratch;
  kc::DeviceBuffer<unsigned int> counters;
  SDM_RETURN_IF_ERROR(Alloc(pool, pages * kernels::KvPageElements(kv_width), "the KV pool"));
  SDM_RETURN_IF_ERROR(FillBf16(pool.get(), pool.size(), 1.0f, rng));
  // Pages scattered at random in the arena, as a long-running server's would be.
  std::vector<int32_t> ids(pages);
  {
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    SDM_RETURN_IF_ERROR(Alloc(page_ids, pages, "page tables"));
    SDM_RETURN_IF_ERROR(Upload(page_ids.get(), ids, "uploading page tables"));
    std::vector<const int32_t*> tp(seqs);
    for (int64_t i = 0; i < seqs; ++i) tp[i] = page_ids.get() + i * pages_per_seq;
    SDM_RETURN_IF_ERROR(Alloc(table_ptrs, seqs, "page table pointers"));
    SDM_RETURN_IF_ERROR(Upload(table_ptrs.get(), tp, "uploading page tables"));
  }
  // Every query at position ctx - 1: it sees all ctx cached positions (its own included).
  SDM_RETURN_IF_ERROR(Alloc(positions, max_batch, "positions"));
  SDM_RETURN_IF_ERROR(Upload(positions.get(),
                             std::vector<int32_t>(max_batch, static_cast<int32_t>(ctx - 1)),
                             "uploading positions"));
  const int64_t q_width = int64_t{kAttnHeads} * kAttnHeadDim;
  SDM_RETURN_IF_ERROR(Alloc(q, max_batch * q_width, "queries"));
  SDM_RETURN_IF_ERROR(Alloc(out, max_batch * q_width, "outputs"));
  const std::vector<float> q_host = RandomFloats(max_batch * q_width, -1.0f, 1.0f, rng);
  SDM_RETURN_IF_ERROR(Upload(q.get(), q_host, "uploading queries"));
  kc::AttentionDims dims;
  dims.n_heads = kAttnHeads;
  dims.n_kv_heads = kAttnKvHeads;
  dims.head_dim = kAttnHeadDim;
  dims.window = 0;
  int64_t scratch_floats = 1;
  for (int64_t b : opt.batches) {
    scratch_floats = std::max(scratch_floats, kc::AttentionDecodeScratchFloats(b, dims, ctx));
  }
  SDM_RETURN_IF_ERROR(Alloc(scratch, scratch_floats, "attention scratch"));
  int64_t counter_count = 1;
  for (int64_t b : opt.batches) {
    counter_count = std::max(counter_count, kc::AttentionDecodeCounters(b, dims));
  }
  SDM_RETURN_IF_ERROR(Alloc(counters, counter_count, "attention counters"));
  SDM_RETURN_IF_ERROR(
      Cuda(cudaMemset(counters.get(), 0, counters.bytes()), "zeroing attention counters"));
  SDM_RETURN_IF_ERROR(Cuda(cudaDeviceSynchronize(), "zeroing attention counters"));

  for (int64_t b : opt.batches) {
    const int64_t groups = seqs / b;  // >= 1: b <= seqs
    absl::StatusOr<Timing> t = Time(
        stream, opt.warmup, opt.reps,
        [&](int rep) {
          kc::KvLayerView kv;
          kv.pool = pool.get();
          kv.kv_width = kv_width;
          kv.ring_pages = 0;
          kv.page_tables = table_ptrs.get() + (rep % groups) * b;
          return kc::AttentionDecode(q.get(), q_width, b, positions.get(), ctx, kv, dims,
                                     {scratch.get(), counters.get()}, out.get(), stream);
        },
        "AttentionDecode");
    if (!t.ok()) return t.status();
    const double bytes = static_cast<double>(b) * ctx * kv_width * 2 * sizeof(bf16);
    rows.push_back({"attention decode",
                    absl::StrFormat("baseline_1.4B: 16 q / 8 kv heads, hd 128, ctx %d", ctx), b,
                    bytes, *t, copy_gbps, kKernelTargetFraction, 0});
    Print(rows.back());
  }

  // What was timed computes attention: the first sequence's output (every head, over every
  // position of the context) against the CPU twin (kernels/cpu/attention.h) on the same bf16
  // keys and values. The kernel tests check the kernel closely (tests/kernels/
  // cuda_attention_test.cc); this tolerance only catches a kernel that reads the wrong keys.
  kc::KvLayerView kv;
  kv.pool = pool.get();
  kv.kv_width = kv_width;
  kv.ring_pages = 0;
  kv.page_tables = table_ptrs.get();
  SDM_RETURN_IF_ERROR(Cuda(kc::AttentionDecode(q.get(), q_width, 1, positions.get(), ctx, kv, dims,
                                               {scratch.get(), counters.get()}, out.get(), stream),
                           "AttentionDecode"));
  SDM_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream), "AttentionDecode"));
  std::vector<float> got(q_width);
  SDM_RETURN_IF_ERROR(
      Cuda(cudaMemcpy(got.data(), out.get(), q_width * sizeof(float), cudaMemcpyDeviceToHost),
           "reading the attention output back"));
  std::vector<float> k(ctx * kv_width), v(ctx * kv_width);
  std::vector<bf16> page(kernels::KvPageElements(kv_width));
  for (int64_t p = 0; p < pages_per_seq; ++p) {
    const int32_t id = ids[p];  // sequence 0's table is the first pages_per_seq ids
    SDM_RETURN_IF_ERROR(
        Cuda(cudaMemcpy(page.data(), pool.get() + id * kernels::KvPageElements(kv_width),
                        page.size() * sizeof(bf16), cudaMemcpyDeviceToHost),
             "reading a KV page back"));
    for (int64_t pos = p * kernels::kKvPageTokens;
         pos < std::min<int64_t>(ctx, (p + 1) * kernels::kKvPageTokens); ++pos) {
      for (const bool value : {false, true}) {
        const bf16* row = page.data() + kernels::KvRowOffset(0, pos, kv_width, value);
        float* dst = (value ? v.data() : k.data()) + pos * kv_width;
        for (int64_t c = 0; c < kv_width; ++c) dst[c] = __bfloat162float(row[c]);
      }
    }
  }
  const kernels::cpu::AttentionShape shape{kAttnHeads, kAttnKvHeads, kAttnHeadDim, 0, kv_width};
  const kernels::cpu::KvSpan span{k.data(), v.data(), 0, ctx};
  std::vector<float> want(q_width);
  int64_t off = 0;
  double worst = 0;
  for (int64_t h = 0; h < kAttnHeads; ++h) {
    kernels::cpu::AttendDecodeHead(&q_host[h * kAttnHeadDim], h, ctx - 1, {&span, 1}, shape,
                                   &want[h * kAttnHeadDim]);
  }
  for (int64_t i = 0; i < q_width; ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    worst = std::max(worst, err);
    off += !(err <= 1e-3 * (1.0 + std::abs(want[i])));  // NaN counts as off
  }
  if (off != 0) {
    return absl::InternalError(absl::StrFormat(
        "AttentionDecode at context %d differs from the CPU twin in %d of %d outputs (largest "
        "difference %g)",
        ctx, off, q_width, worst));
  }
  std::printf(
      "# attention decode at context %lld: the CPU twin's output (largest difference %.2g)\n",
      static_cast<long long>(ctx), worst);
  return absl::OkStatus();
}

// ---- Park and resume ----

absl::Status BenchPark(const KernelBenchOptions& opt, double copy_gbps, cudaStream_t stream,
                       std::vector<Row>& rows) {
  const int64_t bytes = kSdmLayers * kSdmHeads * kSdmSlots * kSdmWidth * 2;  // 1.61 GB
  kc::DeviceBuffer<unsigned char> dev;
  kc::PinnedBuffer<unsigned char> host;
  SDM_RETURN_IF_ERROR(Alloc(dev, bytes, "the device state"));
  SDM_RETURN_IF_ERROR(
      Cuda(host.Allocate(bytes), absl::StrFormat("cudaMallocHost of %.2f GB", bytes / 1e9)));
  // Touch both (first-touch costs are not what is measured).
  std::memset(host.get(), 0x5a, bytes);
  SDM_RETURN_IF_ERROR(Cuda(cudaMemset(dev.get(), 0x3c, bytes), "memset"));
  const int reps = std::min(opt.reps, 10);  // ~60 ms each at 25 GB/s
  const std::string shape = "sdm_flagship state: 6 x 2 x 65536 x 1024 bf16";
  absl::StatusOr<Timing> park = Time(
      stream, std::min(opt.warmup, 2), reps,
      [&](int) {
        return cudaMemcpyAsync(host.get(), dev.get(), bytes, cudaMemcpyDeviceToHost, stream);
      },
      "device -> pinned host copy");
  if (!park.ok()) return park.status();
  rows.push_back({"park (D2H, pinned)", shape, 0, static_cast<double>(bytes), *park, copy_gbps, 0,
                  kParkTargetGbps});
  Print(rows.back());
  absl::StatusOr<Timing> resume = Time(
      stream, std::min(opt.warmup, 2), reps,
      [&](int) {
        return cudaMemcpyAsync(dev.get(), host.get(), bytes, cudaMemcpyHostToDevice, stream);
      },
      "pinned host -> device copy");
  if (!resume.ok()) return resume.status();
  rows.push_back({"resume (H2D, pinned)", shape, 0, static_cast<double>(bytes), *resume, copy_gbps,
                  0, kParkTargetGbps});
  Print(rows.back());
  return absl::OkStatus();
}

// ---- Stacked projections ----

// Dense layers that read one input, as separate GEMMs and as the one GEMM over their stacked
// weights that the engine runs (engine/stacked_projection.h), at sdm_flagship's shapes: a
// sliding-window layer's q, k, v (3 x [2048, 2048]) and the FFN's w1, w3 (2 x [5632, 2048]),
// bf16 weights, fp32 out, per batch. Both read the same weight bytes (the figure's bytes); the
// difference is launches and how well small GEMMs fill the device. Repetitions cycle through
// kStackCopies copies of the weights (at least 190 MB per cycle), so that no figure is an L2
// figure (q, k and v alone are 25 MB). What was timed is checked:
// the stacked output holds each part's output (the GEMMs may order their sums differently, so
// within 1e-3 of the largest value, not bit for bit).
absl::Status BenchStackedGemm(const KernelBenchOptions& opt, double copy_gbps, cudaStream_t stream,
                              std::mt19937_64& rng, std::vector<Row>& rows) {
  kc::BlasLtGemm gemm;
  if (!gemm.Init()) return absl::InternalError("cuBLASLt: " + gemm.error());
  const int64_t max_batch = *std::max_element(opt.batches.begin(), opt.batches.end());
  kc::DeviceBuffer<bf16> x;
  SDM_RETURN_IF_ERROR(Alloc(x, max_batch * kDim, "GEMM inputs"));
  SDM_RETURN_IF_ERROR(FillBf16(x.get(), x.size(), 1.0f, rng));
  struct Group {
    const char* name;
    int parts;
    int64_t part_rows;
  };
  for (const Group& g : {Group{"q,k,v", 3, kDim}, Group{"w1,w3", 2, kFfnHidden}}) {
    const int64_t stacked_rows = g.parts * g.part_rows;
    const int64_t copy_elems = stacked_rows * kDim;
    kc::DeviceBuffer<bf16> w;
    kc::DeviceBuffer<float> apart, stacked;
    SDM_RETURN_IF_ERROR(Alloc(w, kStackCopies * copy_elems, "GEMM weights"));
    SDM_RETURN_IF_ERROR(FillBf16(w.get(), w.size(), 0.02f, rng));
    SDM_RETURN_IF_ERROR(Alloc(apart, max_batch * stacked_rows, "GEMM outputs"));
    SDM_RETURN_IF_ERROR(Alloc(stacked, max_batch * stacked_rows, "GEMM outputs"));
    const std::string shape =
        absl::StrFormat("%d x [%d, %d] bf16, sdm_flagship", g.parts, g.part_rows, kDim);
    const double bytes = static_cast<double>(stacked_rows) * kDim * sizeof(bf16);
    for (const int64_t b : opt.batches) {
      std::string gemm_error;  // cuBLASLt's own message, when a call fails
      // The GEMMs of repetition `rep` over its copy of the weights, as `parts` parts.
      auto run = [&](int rep, int64_t parts, int64_t part_rows, float* y) -> cudaError_t {
        const bf16* weights = w.get() + (rep % kStackCopies) * copy_elems;
        for (int64_t p = 0; p < parts; ++p) {
          if (!gemm.Linear(x.get(), b, weights + p * part_rows * kDim, part_rows, kDim, nullptr,
                           y + p * b * part_rows, stream)) {
            gemm_error = gemm.error();
            return cudaErrorUnknown;
          }
        }
        return cudaGetLastError();
      };
      absl::StatusOr<Timing> t_apart = Time(
          stream, opt.warmup, opt.reps,
          [&](int r) { return run(r, g.parts, g.part_rows, apart.get()); }, "separate GEMMs");
      if (!gemm_error.empty()) return absl::InternalError("cuBLASLt: " + gemm_error);
      if (!t_apart.ok()) return t_apart.status();
      rows.push_back(
          {absl::StrCat("gemm ", g.name, " apart"), shape, b, bytes, *t_apart, copy_gbps, 0, 0});
      Print(rows.back());
      absl::StatusOr<Timing> t_stacked = Time(
          stream, opt.warmup, opt.reps,
          [&](int r) { return run(r, 1, stacked_rows, stacked.get()); }, "the stacked GEMM");
      if (!gemm_error.empty()) return absl::InternalError("cuBLASLt: " + gemm_error);
      if (!t_stacked.ok()) return t_stacked.status();
      rows.push_back({absl::StrCat("gemm ", g.name, " stacked"), shape, b, bytes, *t_stacked,
                      copy_gbps, 0, 0});
      Print(rows.back());
      // Both from the same copy of the weights. Part p of row r: apart[p][r][c] (each part's
      // output [b, part_rows] in turn), stacked[r][p * part_rows + c].
      const cudaError_t checked_apart = run(0, g.parts, g.part_rows, apart.get());
      const cudaError_t checked_stacked = run(0, 1, stacked_rows, stacked.get());
      if (!gemm_error.empty()) return absl::InternalError("cuBLASLt: " + gemm_error);
      SDM_RETURN_IF_ERROR(Cuda(checked_apart, "separate GEMMs"));
      SDM_RETURN_IF_ERROR(Cuda(checked_stacked, "the stacked GEMM"));
      SDM_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream), "the stacked GEMM"));
      std::vector<float> got_apart(b * stacked_rows), got_stacked(b * stacked_rows);
      SDM_RETURN_IF_ERROR(Cuda(cudaMemcpy(got_apart.data(), apart.get(),
                                          got_apart.size() * sizeof(float), cudaMemcpyDeviceToHost),
                               "downloading GEMM outputs"));
      SDM_RETURN_IF_ERROR(
          Cuda(cudaMemcpy(got_stacked.data(), stacked.get(), got_stacked.size() * sizeof(float),
                          cudaMemcpyDeviceToHost),
               "downloading GEMM outputs"));
      double largest = 0, worst = 0;
      for (int64_t p = 0; p < g.parts; ++p) {
        for (int64_t r = 0; r < b; ++r) {
          for (int64_t c = 0; c < g.part_rows; ++c) {
            const double want = got_apart[(p * b + r) * g.part_rows + c];
            const double have = got_stacked[r * stacked_rows + p * g.part_rows + c];
            largest = std::max(largest, std::fabs(want));
            worst = std::max(worst, std::fabs(have - want));
          }
        }
      }
      if (!(worst <= 1e-3 * largest)) {
        return absl::InternalError(absl::StrFormat(
            "the stacked GEMM of %s at batch %d differs from the separate ones by %.3g (largest "
            "value %.3g)",
            g.name, b, worst, largest));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunKernelBenchmark(const KernelBenchOptions& opt) {
  if (kc::DeviceCount() == 0) {
    return absl::UnavailableError(
        absl::StrCat("kernels: no CUDA device (", kc::DescribeDevice(), ")"));
  }
  if (opt.batches.empty() || opt.reps < 1 || opt.warmup < 0 || opt.context < 1 || opt.copy_mb < 1) {
    return absl::InvalidArgumentError("kernels: bad batches, reps, warmup or context");
  }
  const std::string device = kc::DescribeDevice();
  json doc;
  doc["tool"] = "sdm-bench kernels";
  doc["started_utc"] = UtcNow();
  doc["command_line"] = opt.command_line;
  doc["device"] = device;
  doc["machine"] = MachineInfo();
  doc["build"] = BuildInfo();
  doc["parameters"] = {{"batches", opt.batches}, {"context", opt.context}, {"reps", opt.reps},
                       {"warmup", opt.warmup},   {"copy_mb", opt.copy_mb}, {"seed", opt.seed}};
  std::printf("# sdm-bench kernels: %s\n", device.c_str());
  std::printf("# cudaEvent timing: %d warm-up, median of %d repetitions; targets from issue 6\n",
              opt.warmup, opt.reps);
  std::fflush(stdout);

  absl::StatusOr<DeviceCopyBandwidth> copy =
      MeasureDeviceCopyBandwidth(opt.copy_mb << 20, opt.warmup, opt.reps);
  if (!copy.ok()) return copy.status();
  const double copy_gbps = copy->median_gbps;
  std::vector<Row> rows;
  std::printf("%s\n", TableHeader().c_str());
  rows.push_back({"copy (D2D)", absl::StrFormat("cudaMemcpy, 2 x %d MiB", opt.copy_mb), 0,
                  2.0 * (opt.copy_mb << 20), Timing{copy->median_s, copy->min_s}, copy_gbps, 0, 0});
  Print(rows.back());

  kc::CudaStream stream;
  SDM_RETURN_IF_ERROR(Cuda(stream.Create(), "creating a stream"));
  std::mt19937_64 rng(opt.seed);
  // Each part frees its device memory before the next one allocates.
  for (int64_t b : opt.batches) {
    SDM_RETURN_IF_ERROR(BenchSdm(b, opt, copy_gbps, stream.get(), rng, rows));
  }
  SDM_RETURN_IF_ERROR(BenchAttention(opt, copy_gbps, stream.get(), rng, rows));
  SDM_RETURN_IF_ERROR(BenchPark(opt, copy_gbps, stream.get(), rows));
  // Last, and its failure reported after the JSON of everything before it is written (a new
  // benchmark that fails on its first device must not take the other figures with it).
  const absl::Status stacked = BenchStackedGemm(opt, copy_gbps, stream.get(), rng, rows);
  if (!stacked.ok()) {
    std::fprintf(stderr, "sdm-bench kernels: stacked GEMMs: %s\n", stacked.ToString().c_str());
  }

  int missed = 0;
  for (const Row& r : rows) missed += r.has_target() && !r.meets();
  std::printf(
      "# copy bandwidth %.1f GB/s (read + write); %d of the figures with a target miss "
      "it\n",
      copy_gbps, missed);
  doc["copy"] = {{"buffer_bytes", copy->buffer_bytes},
                 {"reps", copy->reps},
                 {"median_gbps", copy->median_gbps},
                 {"best_gbps", copy->best_gbps}};
  doc["results"] = json::array();
  for (const Row& r : rows) doc["results"].push_back(r.ToJson());
  doc["targets_missed"] = missed;
  if (!stacked.ok()) doc["error"] = stacked.ToString();
  doc["finished_utc"] = UtcNow();
  if (!opt.json_path.empty()) {
    std::ofstream out(opt.json_path);
    out << doc.dump(2) << "\n";
    out.close();
    if (!out) return absl::InternalError(absl::StrCat("could not write ", opt.json_path));
  }
  return stacked;
}

}  // namespace sdm::bench
