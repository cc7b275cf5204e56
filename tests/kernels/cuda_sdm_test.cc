// The CUDA SDM kernels (kernels/cuda/sdm.h) against their CPU twins: addressing against
// cpu::SelectSlots + cpu::ActivateAddress, copy-on-write preparation against a host walk of the
// same tables, the fused step against cpu::SdmWriteColumns / cpu::SdmReadColumns over an fp32
// copy of the rows, and the row moves (release, gather, scatter, free-list init) for exact
// accounting. Skips without a device (and on builds without CUDA).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/common/device_layout.h"
#include "kernels/common/sdm_decode_plan.h"
#include "kernels/cpu/norm.h"
#include "kernels/cpu/sdm_addressing.h"
#include "kernels/cpu/sdm_update.h"
#include "kernels/cuda/cuda_runtime_info.h"
#include "tests/kernels/strided_rows.h"
#if defined(SDM_HAVE_CUDA)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/sdm.h"
#endif

namespace sdm::kernels {
namespace {

#define SDM_SKIP_WITHOUT_DEVICE()                                        \
  if (cuda::DeviceCount() == 0) {                                        \
    GTEST_SKIP() << "no CUDA device (" << cuda::DescribeDevice() << ")"; \
  }

#if defined(SDM_HAVE_CUDA)

uint32_t FreshSeed() {
  std::random_device rd;
  return rd();
}

template <typename T>
cuda::DeviceBuffer<T> Upload(const std::vector<T>& host) {
  cuda::DeviceBuffer<T> dev(host.size());
  EXPECT_TRUE(dev.ok());
  if (!host.empty()) {
    EXPECT_EQ(cudaMemcpy(dev.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  return dev;
}

template <typename T>
std::vector<T> Download(const T* dev, size_t n) {
  std::vector<T> host(n);
  if (n > 0) {
    EXPECT_EQ(cudaMemcpy(host.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return host;
}

int32_t DownloadScalar(const int32_t* dev) { return Download(dev, 1)[0]; }

// Two addressings wrote the same slots and the same weight bits (NaN-safe).
void ExpectSameAddressing(const cuda::DeviceBuffer<int32_t>& slots,
                          const cuda::DeviceBuffer<float>& weights,
                          const cuda::DeviceBuffer<int32_t>& want_slots,
                          const cuda::DeviceBuffer<float>& want_weights) {
  EXPECT_EQ(Download(slots.get(), slots.size()), Download(want_slots.get(), want_slots.size()));
  const std::vector<float> a = Download(weights.get(), weights.size());
  const std::vector<float> b = Download(want_weights.get(), want_weights.size());
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}

float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__nv_bfloat16 ToBf16(float x) { return __float2bfloat16_rn(x); }
uint16_t BitsOf(__nv_bfloat16 x) {
  uint16_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

// ---------------------------------------------------------------------------------------------
// Addressing. Slots must equal the CPU's exactly (same integer selection). Weights are fp32 on
// both sides; they differ only by expf's last-ulp differences (CUDA's expf is within 2 ulp) and
// the order of the softmax/L2 reductions, so a relative bound of 1e-5 is ample.

std::vector<float> Scores(std::mt19937& rng, int64_t n, bool nasty) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> kind(0, 9);
  std::vector<float> out(n);
  for (float& x : out) {
    x = normal(rng);
    if (!nasty) continue;
    const int c = kind(rng);
    if (c == 0) x = std::nanf("");
    if (c == 1 || c == 2) x = 0.5f;  // ties
    if (c == 3) x = -0.0f;
    if (c == 4) x = 0.0f;
  }
  return out;
}

void CheckAddress(uint32_t seed, int64_t side, int64_t k, AddressAct act, float scale, bool nasty) {
  SCOPED_TRACE(testing::Message() << "seed " << seed << " side " << side << " k " << k << " act "
                                  << static_cast<int>(act) << " nasty " << nasty);
  std::mt19937 rng(seed);
  const int64_t rows = 19, heads = 2;
  const int64_t count = AddressCount(k, side);
  std::vector<float> scores = Scores(rng, rows * heads * 2 * side, nasty);
  auto d_scores = Upload(scores);
  cuda::DeviceBuffer<int32_t> d_slots(rows * heads * count);
  cuda::DeviceBuffer<float> d_weights(rows * heads * count);
  ASSERT_EQ(cuda::SdmAddress(d_scores.get(), rows, heads, side, k, act, scale, d_slots.get(),
                             d_weights.get(), nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<int32_t> slots = Download(d_slots.get(), d_slots.size());
  const std::vector<float> weights = Download(d_weights.get(), d_weights.size());

  cpu::AddressScratch scratch;
  std::vector<int32_t> want_slots(count);
  std::vector<float> want(count);
  for (int64_t rh = 0; rh < rows * heads; ++rh) {
    cpu::SelectSlots(&scores[rh * 2 * side], side, k, want_slots, want, scratch);
    cpu::ActivateAddress(act, scale, want);
    for (int64_t i = 0; i < count; ++i) {
      ASSERT_EQ(slots[rh * count + i], want_slots[i]) << "rh " << rh << " i " << i;
      const float got = weights[rh * count + i];
      if (std::isnan(want[i])) {
        EXPECT_TRUE(std::isnan(got)) << "rh " << rh << " i " << i;
      } else {
        EXPECT_NEAR(got, want[i], 1e-5f * std::abs(want[i]) + 1e-7f) << "rh " << rh << " i " << i;
      }
    }
  }
}

#endif  // SDM_HAVE_CUDA

TEST(CudaSdmTest, AddressMatchesCpu) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  // Presets (tiny s=8 k=8, debug_sdm s=64 k=32, flagship s=256 k=128) plus edge shapes: every
  // candidate selected (k >= k_sub^2), k = s, k > 256 with a small side, a side needing 3
  // slot-key bytes.
  CheckAddress(1, 8, 8, AddressAct::kSoftmax, 1.0f, false);
  CheckAddress(2, 64, 32, AddressAct::kSoftmax, 0.5f, false);
  CheckAddress(3, 256, 128, AddressAct::kSoftmax, 1.0f, false);
  CheckAddress(4, 256, 256, AddressAct::kSoftmax, 2.0f, false);
  CheckAddress(5, 16, 300, AddressAct::kIdentity, 1.0f, false);
  CheckAddress(6, 5, 3, AddressAct::kL2Normalize, 1.0f, false);
  CheckAddress(7, 300, 17, AddressAct::kSigmoid, 1.0f, false);
  CheckAddress(8, 64, 64, AddressAct::kRelu, 1.0f, false);
  CheckAddress(9, 2, 1, AddressAct::kSoftmax, 1.0f, false);
#endif
}

TEST(CudaSdmTest, AddressMatchesCpuWithTiesAndNan) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  CheckAddress(11, 8, 8, AddressAct::kSoftmax, 1.0f, true);
  CheckAddress(12, 64, 32, AddressAct::kL2Normalize, 1.0f, true);
  CheckAddress(13, 256, 128, AddressAct::kIdentity, 1.0f, true);
  CheckAddress(14, 16, 256, AddressAct::kRelu, 1.0f, true);
  // k_sub = 17 (pruned rows of uneven lengths, not a divisor of the block size) and 3-byte slot
  // keys, with tied sums.
  CheckAddress(15, 300, 17, AddressAct::kSoftmax, 1.0f, true);
#endif
}

// Every sum tied (all scores 0): every row's first pair beyond the pruned candidates ties the
// threshold, so the kernel takes the full k_sub^2 fallback; ties go to the lower slot, so the
// selection is slots 0 .. count - 1 (a = 0, b = 0 .. count - 1 when count <= side).
TEST(CudaSdmTest, AddressAllTiedTakesTheLowestSlots) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  for (const int64_t side : {8, 64, 256}) {
    const int64_t k = side / 2, rows = 3, heads = 2;
    const int64_t count = AddressCount(k, side);
    std::vector<float> scores(rows * heads * 2 * side, 0.0f);
    auto d_scores = Upload(scores);
    cuda::DeviceBuffer<int32_t> d_slots(rows * heads * count);
    cuda::DeviceBuffer<float> d_weights(rows * heads * count);
    ASSERT_EQ(cuda::SdmAddress(d_scores.get(), rows, heads, side, k, AddressAct::kIdentity, 1.0f,
                               d_slots.get(), d_weights.get(), nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<int32_t> slots = Download(d_slots.get(), d_slots.size());
    for (int64_t rh = 0; rh < rows * heads; ++rh) {
      for (int64_t i = 0; i < count; ++i) {
        ASSERT_EQ(slots[rh * count + i], i) << "side " << side << " rh " << rh;
      }
    }
  }
#endif
}

TEST(CudaSdmTest, AddressMatchesCpuFreshSeed) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  const uint32_t seed = FreshSeed();
  CheckAddress(seed, 256, 128, AddressAct::kSoftmax, 1.0f, seed % 2 == 0);
  CheckAddress(seed + 1, 64, 32, AddressAct::kSoftmax, 1.0f, seed % 2 == 1);
#endif
}

// A step's write and read addressing in one launch (SdmAddressJobs) write exactly what two
// SdmAddress calls write: different k, activations and score arrays per job, nasty scores (ties,
// NaN, signed zeros); a job that selects nothing (k = 0) launches nothing and leaves its outputs
// alone. A fixed seed and a fresh one.
TEST(CudaSdmTest, AddressJobsInOneLaunchMatchSeparateCalls) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  for (const uint32_t seed : {20261204u, FreshSeed()}) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    const int64_t rows = 13, heads = 2, side = 64;
    struct Case {
      int64_t k;
      AddressAct act;
      float scale;
    };
    const Case cases[2] = {{8, AddressAct::kSoftmax, 0.5f}, {32, AddressAct::kL2Normalize, 1.0f}};
    std::vector<cuda::DeviceBuffer<float>> scores, strided_scores, weights, weights_alone;
    std::vector<cuda::DeviceBuffer<int32_t>> slots, slots_alone;
    std::vector<cuda::SdmAddressJob> jobs;
    // The jobs read their scores inside wider rows (a stacked projection's output, the gaps
    // NaN), the separate calls back to back.
    const int64_t score_width = heads * 2 * side;
    const int64_t strides[2] = {score_width + 4, score_width + 24};
    for (const Case& c : cases) {
      const int64_t n = rows * heads * AddressCount(c.k, side);
      const std::vector<float> host = Scores(rng, rows * heads * 2 * side, /*nasty=*/true);
      scores.push_back(Upload(host));
      strided_scores.push_back(Upload(Strided(host, score_width, strides[scores.size() - 1])));
      slots.emplace_back(n);
      weights.emplace_back(n);
      slots_alone.emplace_back(n);
      weights_alone.emplace_back(n);
    }
    for (size_t j = 0; j < 2; ++j) {
      jobs.push_back({.scores = strided_scores[j].get(),
                      .k = cases[j].k,
                      .act = cases[j].act,
                      .scale = cases[j].scale,
                      .slots = slots[j].get(),
                      .weights = weights[j].get(),
                      .norm = {},
                      .scores_stride = strides[j]});
      ASSERT_EQ(
          cuda::SdmAddress(scores[j].get(), rows, heads, side, cases[j].k, cases[j].act,
                           cases[j].scale, slots_alone[j].get(), weights_alone[j].get(), nullptr),
          cudaSuccess);
    }
    ASSERT_EQ(cuda::SdmAddressJobs(jobs, rows, heads, side, nullptr), cudaSuccess);
    // A job with k = 0 beside a real one: nothing written for it (its outputs stay poisoned).
    cuda::DeviceBuffer<int32_t> untouched(4);
    ASSERT_EQ(cudaMemset(untouched.get(), 0x5a, untouched.bytes()), cudaSuccess);
    const cuda::SdmAddressJob with_empty[2] = {
        {scores[0].get(), 0, AddressAct::kSoftmax, 1.0f, untouched.get(), nullptr, {}}, jobs[1]};
    ASSERT_EQ(cuda::SdmAddressJobs(with_empty, rows, heads, side, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t j = 0; j < 2; ++j) {
      SCOPED_TRACE(testing::Message() << "job " << j);
      ExpectSameAddressing(slots[j], weights[j], slots_alone[j], weights_alone[j]);
    }
    for (const int32_t v : Download(untouched.get(), untouched.size())) EXPECT_EQ(v, 0x5a5a5a5a);
  }
  // More than two jobs is refused.
  const cuda::SdmAddressJob three[3] = {};
  EXPECT_EQ(cuda::SdmAddressJobs(three, 1, 1, 64, nullptr), cudaErrorInvalidValue);
#endif
}

// The decay and beta gates computed in the addressing launch (SdmAddressJobs with a gate job)
// are SdmGates's, bit for bit: a and b inside wider rows (the gaps NaN), beside one job and
// beside two; with no job selecting anything SdmGates runs instead. The addressing itself is
// unchanged by the gates. A gate stride below the heads is refused.
TEST(CudaSdmTest, GatesInTheAddressingLaunchAreSdmGatesBitForBit) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  for (const uint32_t seed : {20261206u, FreshSeed()}) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    const int64_t rows = 11, heads = 3, side = 32, k = 8, stride = heads + 5;
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<float> a(rows * heads), b(rows * heads), a_log(heads), dt_bias(heads);
    for (float& x : a) x = normal(rng);
    for (float& x : b) x = normal(rng);
    for (float& x : a_log) x = 0.3f * normal(rng);
    for (float& x : dt_bias) x = 0.3f * normal(rng);
    a[2] = 25.0f;  // above Softplus's threshold
    auto d_a = Upload(a), d_b = Upload(b), d_a_log = Upload(a_log), d_dt = Upload(dt_bias);
    auto d_a_s = Upload(Strided(a, heads, stride)), d_b_s = Upload(Strided(b, heads, stride));
    cuda::DeviceBuffer<float> want_g(rows * heads), want_beta(rows * heads);
    ASSERT_EQ(cuda::SdmGates(d_a.get(), d_b.get(), heads, d_a_log.get(), d_dt.get(), rows, heads,
                             want_g.get(), want_beta.get(), nullptr),
              cudaSuccess);
    const std::vector<float> scores = Scores(rng, rows * heads * 2 * side, /*nasty=*/false);
    auto d_scores = Upload(scores);
    const int64_t n = rows * heads * AddressCount(k, side);
    cuda::DeviceBuffer<int32_t> slots_alone(n), slots(n);
    cuda::DeviceBuffer<float> weights_alone(n), weights(n);
    ASSERT_EQ(cuda::SdmAddress(d_scores.get(), rows, heads, side, k, AddressAct::kSoftmax, 1.0f,
                               slots_alone.get(), weights_alone.get(), nullptr),
              cudaSuccess);
    const cuda::SdmAddressJob job = {.scores = d_scores.get(),
                                     .k = k,
                                     .act = AddressAct::kSoftmax,
                                     .scale = 1.0f,
                                     .slots = slots.get(),
                                     .weights = weights.get(),
                                     .norm = {},
                                     .scores_stride = 0};
    cuda::SdmAddressJob nothing = job;
    nothing.k = 0;
    const std::vector<std::vector<cuda::SdmAddressJob>> job_sets = {
        {job}, {job, job}, {nothing}, {nothing, nothing}};
    for (size_t set = 0; set < job_sets.size(); ++set) {
      SCOPED_TRACE(testing::Message() << "job set " << set);
      cuda::DeviceBuffer<float> got_g(rows * heads), got_beta(rows * heads);
      ASSERT_EQ(cudaMemset(got_g.get(), 0xff, got_g.bytes()), cudaSuccess);  // NaN
      ASSERT_EQ(cudaMemset(got_beta.get(), 0xff, got_beta.bytes()), cudaSuccess);
      const cuda::SdmGateJob gates = {.a = d_a_s.get(),
                                      .b = d_b_s.get(),
                                      .in_stride = stride,
                                      .a_log = d_a_log.get(),
                                      .dt_bias = d_dt.get(),
                                      .log_decay = got_g.get(),
                                      .beta = got_beta.get()};
      ASSERT_EQ(cuda::SdmAddressJobs(job_sets[set], rows, heads, side, nullptr, gates),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto bits = [](const std::vector<float>& v) {
        std::vector<uint32_t> u(v.size());
        std::memcpy(u.data(), v.data(), v.size() * sizeof(float));
        return u;
      };
      ASSERT_EQ(bits(Download(got_g.get(), got_g.size())),
                bits(Download(want_g.get(), want_g.size())));
      ASSERT_EQ(bits(Download(got_beta.get(), got_beta.size())),
                bits(Download(want_beta.get(), want_beta.size())));
      if (job_sets[set][0].k > 0) ExpectSameAddressing(slots, weights, slots_alone, weights_alone);
    }
    const cuda::SdmGateJob narrow = {.a = d_a.get(),
                                     .b = d_b.get(),
                                     .in_stride = heads - 1,
                                     .a_log = d_a_log.get(),
                                     .dt_bias = d_dt.get(),
                                     .log_decay = want_g.get(),
                                     .beta = want_beta.get()};
    EXPECT_EQ(cuda::SdmAddressJobs(job_sets[0], rows, heads, side, nullptr, narrow),
              cudaErrorInvalidValue);
  }
#endif
}

// Product-key selection from the same projections on both backends (issue 16, item 4): eval
// BatchNorm (each backend's kernel) then addressing (each backend's kernel). The BatchNorm
// kernels share kernels/common/fp_math.h's explicitly rounded BatchNormEvalValue, so the scores
// are bit-identical and so must be every selected slot: the count of differing slots is printed
// ("[selection]", collected by scripts/device-check.sh) and must be 0. The raw scores are coarse
// (multiples of 1/64) so that pair sums tie or nearly tie often after BatchNorm: a one-ulp
// difference in a score would flip some of them.
#if defined(SDM_HAVE_CUDA)
void CheckBatchNormThenAddress(int64_t rows, int64_t heads, int64_t side, int64_t k,
                               uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "seed " << seed << " side " << side << " k " << k);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const int64_t key_size = heads * 2 * side;
  const int64_t count = AddressCount(k, side);
  std::vector<float> raw(rows * key_size);
  for (float& x : raw) x = std::round(64.0f * normal(rng)) / 64.0f;
  std::vector<float> w(key_size), b(key_size), mean(key_size), var(key_size);
  for (int64_t j = 0; j < key_size; ++j) {
    w[j] = 1.0f + 0.3f * normal(rng);
    b[j] = 0.2f * normal(rng);
    mean[j] = 0.1f * normal(rng);
    const float z = normal(rng);
    var[j] = 0.05f + z * z;
  }
  std::vector<float> cpu_scores = raw;
  cpu::BatchNormEval(cpu_scores.data(), w.data(), b.data(), mean.data(), var.data(), rows, key_size,
                     1e-5f);
  auto d_scores = Upload(raw);
  auto d_w = Upload(w);
  auto d_b = Upload(b);
  auto d_mean = Upload(mean);
  auto d_var = Upload(var);
  cuda::DeviceBuffer<int32_t> d_slots(rows * heads * count);
  cuda::DeviceBuffer<float> d_weights(rows * heads * count);
  ASSERT_EQ(cuda::BatchNormEval(d_scores.get(), d_w.get(), d_b.get(), d_mean.get(), d_var.get(),
                                rows, key_size, 1e-5f, nullptr),
            cudaSuccess);
  ASSERT_EQ(cuda::SdmAddress(d_scores.get(), rows, heads, side, k, AddressAct::kSoftmax, 1.0f,
                             d_slots.get(), d_weights.get(), nullptr),
            cudaSuccess);
  // The engine's path: the same BatchNorm applied by the addressing as it reads the raw scores.
  auto d_raw = Upload(raw);
  cuda::DeviceBuffer<int32_t> d_fused_slots(rows * heads * count);
  cuda::DeviceBuffer<float> d_fused_weights(rows * heads * count);
  const cuda::SdmAddressJob fused{d_raw.get(),
                                  k,
                                  AddressAct::kSoftmax,
                                  1.0f,
                                  d_fused_slots.get(),
                                  d_fused_weights.get(),
                                  {d_w.get(), d_b.get(), d_mean.get(), d_var.get(), 1e-5f}};
  ASSERT_EQ(cuda::SdmAddressJobs(std::span<const cuda::SdmAddressJob>(&fused, 1), rows, heads, side,
                                 nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> gpu_scores = Download(d_scores.get(), raw.size());
  const std::vector<int32_t> slots = Download(d_slots.get(), d_slots.size());
  ExpectSameAddressing(d_fused_slots, d_fused_weights, d_slots, d_weights);
  const std::vector<float> raw_after = Download(d_raw.get(), raw.size());
  EXPECT_EQ(0, std::memcmp(raw_after.data(), raw.data(), raw.size() * sizeof(float)))
      << "the addressing wrote its normalised scores back";
  int64_t score_diffs = 0;
  for (size_t i = 0; i < raw.size(); ++i) {
    score_diffs += std::memcmp(&gpu_scores[i], &cpu_scores[i], sizeof(float)) != 0 ? 1 : 0;
  }
  cpu::AddressScratch scratch;
  std::vector<int32_t> want_slots(count);
  std::vector<float> want(count);
  int64_t slot_diffs = 0;
  for (int64_t rh = 0; rh < rows * heads; ++rh) {
    cpu::SelectSlots(&cpu_scores[rh * 2 * side], side, k, want_slots, want, scratch);
    std::vector<int32_t> got(slots.begin() + rh * count, slots.begin() + (rh + 1) * count);
    std::vector<int32_t> only_cpu;
    std::set_difference(want_slots.begin(), want_slots.end(), got.begin(), got.end(),
                        std::back_inserter(only_cpu));
    slot_diffs += static_cast<int64_t>(only_cpu.size());
  }
  std::printf(
      "[selection] kernels: BatchNorm + addressing, side %lld k %lld: %lld of %lld "
      "selected slots differ from the CPU's (%lld of %lld scores differ)\n",
      static_cast<long long>(side), static_cast<long long>(k), static_cast<long long>(slot_diffs),
      static_cast<long long>(rows * heads * count), static_cast<long long>(score_diffs),
      static_cast<long long>(raw.size()));
  EXPECT_EQ(score_diffs, 0);
  EXPECT_EQ(slot_diffs, 0);
}
#endif  // SDM_HAVE_CUDA

TEST(CudaSdmTest, BatchNormThenAddressSelectsTheCpuSlots) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  CheckBatchNormThenAddress(/*rows=*/128, /*heads=*/2, /*side=*/8, /*k=*/8, 31);     // tiny
  CheckBatchNormThenAddress(/*rows=*/128, /*heads=*/1, /*side=*/64, /*k=*/32, 32);   // debug
  CheckBatchNormThenAddress(/*rows=*/32, /*heads=*/2, /*side=*/256, /*k=*/128, 33);  // flagship
#endif
}

// Two jobs in one launch, each with its own BatchNorm applied as its scores are read (the write
// key's and the read query's, as the engine launches them) or none, write exactly what
// BatchNormEval then SdmAddressJobs without BatchNorm write. A fixed seed and a fresh one.
TEST(CudaSdmTest, AddressJobsApplyEachJobsOwnBatchNorm) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  for (const uint32_t seed : {20261205u, FreshSeed()}) {
    for (const bool second_has_norm : {true, false}) {
      SCOPED_TRACE(testing::Message()
                   << "seed " << seed << " second job normalised " << second_has_norm);
      std::mt19937 rng(seed);
      std::normal_distribution<float> normal;
      const int64_t rows = 11, heads = 3, side = 32, key_size = heads * 2 * side;
      const int64_t ks[2] = {8, 16};
      std::vector<std::vector<float>> raw(2), stats(8);
      for (auto& r : raw) {
        r.resize(rows * key_size);
        for (float& x : r) x = std::round(64.0f * normal(rng)) / 64.0f;
      }
      for (int64_t t = 0; t < 8; ++t) {  // w, b, mean, var of each job
        stats[t].resize(key_size);
        for (float& x : stats[t]) {
          const float z = normal(rng);
          x = t % 4 == 0 ? 1.0f + 0.3f * z : t % 4 == 3 ? 0.05f + z * z : 0.2f * z;
        }
      }
      std::vector<cuda::DeviceBuffer<float>> d_stats;
      for (const auto& st : stats) d_stats.push_back(Upload(st));
      std::vector<cuda::DeviceBuffer<float>> d_raw, d_normed, weights, weights_want;
      std::vector<cuda::DeviceBuffer<int32_t>> slots, slots_want;
      cuda::SdmAddressJob fused[2], plain[2];
      for (int j = 0; j < 2; ++j) {
        const bool norm = j == 0 || second_has_norm;
        const int64_t n = rows * heads * AddressCount(ks[j], side);
        d_raw.push_back(Upload(raw[j]));
        d_normed.push_back(Upload(raw[j]));
        if (norm) {
          ASSERT_EQ(cuda::BatchNormEval(d_normed[j].get(), d_stats[4 * j].get(),
                                        d_stats[4 * j + 1].get(), d_stats[4 * j + 2].get(),
                                        d_stats[4 * j + 3].get(), rows, key_size, 1e-5f, nullptr),
                    cudaSuccess);
        }
        slots.emplace_back(n);
        weights.emplace_back(n);
        slots_want.emplace_back(n);
        weights_want.emplace_back(n);
        const AddressAct act = j == 0 ? AddressAct::kSoftmax : AddressAct::kL2Normalize;
        fused[j] = {d_raw[j].get(), ks[j], act, 1.0f, slots[j].get(), weights[j].get(), {}};
        if (norm) {
          fused[j].norm = {d_stats[4 * j].get(), d_stats[4 * j + 1].get(), d_stats[4 * j + 2].get(),
                           d_stats[4 * j + 3].get(), 1e-5f};
        }
        plain[j] = {d_normed[j].get(),     ks[j], act, 1.0f, slots_want[j].get(),
                    weights_want[j].get(), {}};
      }
      ASSERT_EQ(cuda::SdmAddressJobs(fused, rows, heads, side, nullptr), cudaSuccess);
      ASSERT_EQ(cuda::SdmAddressJobs(plain, rows, heads, side, nullptr), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      for (int j = 0; j < 2; ++j) {
        SCOPED_TRACE(testing::Message() << "job " << j);
        ExpectSameAddressing(slots[j], weights[j], slots_want[j], weights_want[j]);
        EXPECT_EQ(Download(d_raw[j].get(), raw[j].size()), raw[j]);  // read, never written
      }
    }
  }
#endif
}

#if defined(SDM_HAVE_CUDA)

// ---------------------------------------------------------------------------------------------
// Preparation + step + row moves on one batch.
struct Scenario {
  int64_t heads = 2, side = 4, width = 96;
  std::vector<int32_t> lengths;  // tokens per segment (one session each)
  int64_t k_w = 8, k_r = 8;
  bool m0 = true;
  bool key_weighted_decay = false;
  bool slot_residual = false;
  double prepopulated = 0.3;  // fraction of slots holding a private row before the batch
  uint32_t seed = 1;
};

// Written marks (SdmSegments::written) of `num` segments of `n_slots` entries each: about one
// in eight preset (the kernels never clear a mark), and none kept for every third segment (a null
// entry).
struct WrittenMarks {
  std::vector<std::vector<uint8_t>> before;  // per segment; empty: none kept
  std::vector<cuda::DeviceBuffer<uint8_t>> device;
  cuda::DeviceBuffer<uint8_t*> ptrs;
};

WrittenMarks MakeWrittenMarks(uint32_t seed, int64_t num, int64_t n_slots) {
  std::mt19937 rng(seed);
  WrittenMarks m;
  std::vector<uint8_t*> ptrs;
  for (int64_t s = 0; s < num; ++s) {
    m.before.emplace_back();
    m.device.emplace_back();
    if (s % 3 == 2) {
      ptrs.push_back(nullptr);
      continue;
    }
    for (int64_t e = 0; e < n_slots; ++e) m.before[s].push_back(rng() % 8 == 0 ? 1 : 0);
    m.device[s] = Upload(m.before[s]);
    ptrs.push_back(m.device[s].get());
  }
  m.ptrs = Upload(ptrs);
  return m;
}

// After a step: each kept segment's marks are what they were plus every slot its tokens wrote.
// w_slots [rows, heads, n_w], segment s's tokens rows first[s] .. first[s] + lengths[s] - 1.
void ExpectWrittenMarks(const WrittenMarks& m, const std::vector<int32_t>& w_slots, int64_t n_w,
                        int64_t heads, int64_t slots_per_head, const std::vector<int32_t>& first,
                        const std::vector<int32_t>& lengths) {
  for (size_t s = 0; s < m.before.size(); ++s) {
    if (m.before[s].empty()) continue;
    std::vector<uint8_t> want = m.before[s];
    for (int64_t t = 0; t < lengths[s]; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = 0; i < n_w; ++i) {
          want[h * slots_per_head + w_slots[((first[s] + t) * heads + h) * n_w + i]] = 1;
        }
      }
    }
    EXPECT_EQ(Download(m.device[s].get(), want.size()), want) << "written marks, segment " << s;
  }
}

// A batch's host inputs, drawn from `rng` in a fixed order: slot tables in which a fraction of
// the slots hold private rows, an arena of random rows (the rows not handed out shuffled into
// the free list, `slack` more than the step's reserve of rows * heads * n_w), M0 (random, or
// none), the addressing of every (token, head) from the CPU twin (distinct slots, sorted), and
// the gates and v.
struct HostBatch {
  int64_t n_w = 0, n_r = 0, rows = 0, capacity = 0;
  std::vector<int32_t> first;                // [segments] first token row
  std::vector<std::vector<int32_t>> tables;  // [segments][heads * s * s]
  std::vector<int32_t> pre_count;            // [segments] private rows before the step
  int64_t pre_total = 0;
  std::vector<int32_t> perm;       // every row, shuffled: [0, pre_total) are in tables
  std::vector<int32_t> free_list;  // perm[pre_total, capacity)
  std::vector<__nv_bfloat16> arena, m0;
  std::vector<int32_t> w_slots, r_slots;
  std::vector<float> w_weights, r_weights, log_decay, beta, v;
};

HostBatch MakeHostBatch(std::mt19937& rng, int64_t heads, int64_t side, int64_t width,
                        const std::vector<int32_t>& lengths, int64_t k_w, int64_t k_r, bool with_m0,
                        double prepopulated, int64_t slack) {
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  HostBatch b;
  const int64_t n_slots = heads * side * side;
  const int64_t num = static_cast<int64_t>(lengths.size());
  b.n_w = AddressCount(k_w, side);
  b.n_r = AddressCount(k_r, side);
  b.first.resize(num);
  for (int64_t s = 0; s < num; ++s) {
    b.first[s] = static_cast<int32_t>(b.rows);
    b.rows += lengths[s];
  }
  b.tables.assign(num, std::vector<int32_t>(n_slots, kSdmNoRow));
  b.pre_count.assign(num, 0);
  for (int64_t s = 0; s < num; ++s) {
    for (int32_t& e : b.tables[s]) {
      if (uni(rng) < prepopulated) {
        e = 0;  // numbered below
        ++b.pre_count[s];
        ++b.pre_total;
      }
    }
  }
  b.capacity = b.pre_total + b.rows * heads * b.n_w + slack;
  b.perm.resize(b.capacity);
  std::iota(b.perm.begin(), b.perm.end(), 0);
  std::shuffle(b.perm.begin(), b.perm.end(), rng);
  int64_t next = 0;
  for (auto& table : b.tables) {
    for (int32_t& e : table) {
      if (e == 0) e = b.perm[next++];
    }
  }
  b.free_list.assign(b.perm.begin() + b.pre_total, b.perm.end());
  b.arena.resize(b.capacity * width);
  for (auto& x : b.arena) x = ToBf16(0.5f * normal(rng));
  if (with_m0) {
    b.m0.resize(n_slots * width);
    for (auto& x : b.m0) x = ToBf16(0.5f * normal(rng));
  }
  b.w_slots.resize(b.rows * heads * b.n_w);
  b.r_slots.resize(b.rows * heads * b.n_r);
  b.w_weights.resize(b.w_slots.size());
  b.r_weights.resize(b.r_slots.size());
  cpu::AddressScratch scratch;
  for (int64_t rh = 0; rh < b.rows * heads; ++rh) {
    std::vector<float> wsc = Scores(rng, 2 * side, false), rsc = Scores(rng, 2 * side, false);
    std::span<int32_t> ws(&b.w_slots[rh * b.n_w], b.n_w), rs(&b.r_slots[rh * b.n_r], b.n_r);
    std::span<float> wv(&b.w_weights[rh * b.n_w], b.n_w), rv(&b.r_weights[rh * b.n_r], b.n_r);
    cpu::SelectSlots(wsc.data(), side, k_w, ws, wv, scratch);
    cpu::ActivateAddress(AddressAct::kSoftmax, 2.0f, wv);
    cpu::SelectSlots(rsc.data(), side, k_r, rs, rv, scratch);
    cpu::ActivateAddress(AddressAct::kSoftmax, 2.0f, rv);
  }
  b.log_decay.resize(b.rows * heads);
  b.beta.resize(b.rows * heads);
  b.v.resize(b.rows * heads * width);
  for (float& g : b.log_decay) g = -0.05f - 0.95f * uni(rng);  // alpha in [0.37, 0.95]
  for (float& x : b.beta) x = 0.1f + 0.8f * uni(rng);
  for (float& x : b.v) x = normal(rng);
  return b;
}

void RunScenario(const Scenario& sc) {
  SCOPED_TRACE(testing::Message() << "seed " << sc.seed << " heads " << sc.heads << " side "
                                  << sc.side << " width " << sc.width << " segments "
                                  << sc.lengths.size());
  std::mt19937 rng(sc.seed);
  const int64_t heads = sc.heads, side = sc.side, width = sc.width;
  const int64_t ss = side * side, n_slots = heads * ss;
  const int64_t num = static_cast<int64_t>(sc.lengths.size());
  const int64_t max_length = *std::max_element(sc.lengths.begin(), sc.lengths.end());
  HostBatch batch = MakeHostBatch(rng, heads, side, width, sc.lengths, sc.k_w, sc.k_r, sc.m0,
                                  sc.prepopulated, /*slack=*/7);
  const int64_t n_w = batch.n_w, n_r = batch.n_r, rows = batch.rows, capacity = batch.capacity;
  const std::vector<int32_t>& first = batch.first;
  const std::vector<std::vector<int32_t>>& tables = batch.tables;
  const std::vector<int32_t>& pre_count = batch.pre_count;
  const std::vector<int32_t>& perm = batch.perm;
  const std::vector<int32_t>& free_list = batch.free_list;
  const int32_t free_before = static_cast<int32_t>(free_list.size());
  const std::vector<__nv_bfloat16>& arena = batch.arena;
  const std::vector<__nv_bfloat16>& m0 = batch.m0;
  const std::vector<int32_t>&w_slots = batch.w_slots, &r_slots = batch.r_slots;
  const std::vector<float>&w_weights = batch.w_weights, &r_weights = batch.r_weights;
  const std::vector<float>&log_decay = batch.log_decay, &beta = batch.beta, &v = batch.v;

  // Device state.
  cuda::DeviceBuffer<__nv_bfloat16> d_rows = Upload(arena);
  // The device free list has room for every row of the arena (SdmRowArena::free_list is
  // [capacity]): releasing every table at the end pushes all `capacity` rows back. Entries past
  // *free_count are garbage.
  std::vector<int32_t> free_storage(capacity, -7);
  std::copy(free_list.begin(), free_list.end(), free_storage.begin());
  auto d_free = Upload(free_storage);
  auto d_free_count = Upload(std::vector<int32_t>{free_before});
  std::vector<cuda::DeviceBuffer<int32_t>> d_tables;
  std::vector<int32_t*> table_ptrs;
  for (int64_t s = 0; s < num; ++s) {
    d_tables.push_back(Upload(tables[s]));
    table_ptrs.push_back(d_tables.back().get());
  }
  auto d_row_counts = Upload(pre_count);
  std::vector<int32_t*> count_ptrs;
  for (int64_t s = 0; s < num; ++s) count_ptrs.push_back(d_row_counts.get() + s);
  auto d_table_ptrs = Upload(table_ptrs);
  auto d_count_ptrs = Upload(count_ptrs);
  auto d_first = Upload(first);
  auto d_lengths = Upload(sc.lengths);
  auto d_m0 = Upload(m0);
  auto d_w_slots = Upload(w_slots);
  auto d_r_slots = Upload(r_slots);
  auto d_w_weights = Upload(w_weights);
  auto d_r_weights = Upload(r_weights);
  auto d_log_decay = Upload(log_decay);
  auto d_beta = Upload(beta);
  // v inside wider rows (a stacked projection's output), the gaps NaN.
  const int64_t v_stride = heads * width + 4;
  auto d_v = Upload(Strided(v, heads * width, v_stride));
  cuda::DeviceBuffer<int32_t> d_w_rows(w_slots.size()), d_r_refs(r_slots.size());
  cuda::DeviceBuffer<float> d_readings(rows * heads * width);

  cuda::SdmRowArena arena_desc;
  arena_desc.rows = d_rows.get();
  arena_desc.free_list = d_free.get();
  arena_desc.free_count = d_free_count.get();
  arena_desc.row_width = width;
  arena_desc.capacity = capacity;
  cuda::SdmDims dims;
  dims.heads = heads;
  dims.side = side;
  dims.row_width = width;
  cuda::SdmSegments segs;
  segs.first_row = d_first.get();
  segs.length = d_lengths.get();
  segs.tables = d_table_ptrs.get();
  segs.row_counts = d_count_ptrs.get();
  const WrittenMarks marks = MakeWrittenMarks(sc.seed + 1, num, n_slots);
  segs.written = marks.ptrs.get();
  segs.num = num;
  segs.max_length = max_length;
  const __nv_bfloat16* m0_ptr = sc.m0 ? d_m0.get() : nullptr;

  ASSERT_EQ(cuda::SdmPrepareRows(d_w_slots.get(), n_w, d_r_slots.get(), n_r, segs, dims, m0_ptr,
                                 arena_desc, d_w_rows.get(), d_r_refs.get(), nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  // --- Preparation: tables, references, accounting and row contents. ---
  const std::vector<int32_t> w_rows = Download(d_w_rows.get(), w_slots.size());
  const std::vector<int32_t> r_refs = Download(d_r_refs.get(), r_slots.size());
  std::vector<std::vector<int32_t>> after(num);
  for (int64_t s = 0; s < num; ++s) after[s] = Download(d_tables[s].get(), n_slots);
  const int32_t free_after = DownloadScalar(d_free_count.get());
  const std::vector<int32_t> free_list_after = Download(d_free.get(), capacity);
  const std::vector<int32_t> row_counts = Download(d_row_counts.get(), num);
  const std::vector<__nv_bfloat16> prepared = Download(d_rows.get(), arena.size());
  ExpectWrittenMarks(marks, w_slots, n_w, heads, ss, first, sc.lengths);

  int64_t total_new = 0;
  std::vector<int32_t> new_rows;
  for (int64_t s = 0; s < num; ++s) {
    std::vector<bool> written(n_slots, false);
    for (int64_t t = 0; t < sc.lengths[s]; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = 0; i < n_w; ++i) {
          written[h * ss + w_slots[((first[s] + t) * heads + h) * n_w + i]] = true;
        }
      }
    }
    int64_t seg_new = 0;
    for (int64_t e = 0; e < n_slots; ++e) {
      if (tables[s][e] >= 0) {
        ASSERT_EQ(after[s][e], tables[s][e]) << "existing rows are kept";
      } else if (written[e]) {
        ASSERT_GE(after[s][e], 0) << "a written slot gets a row";
        new_rows.push_back(after[s][e]);
        ++seg_new;
        // The new row starts as M0's row (or zeros), bit for bit.
        for (int64_t c = 0; c < width; ++c) {
          const uint16_t want = sc.m0 ? BitsOf(m0[e * width + c]) : BitsOf(ToBf16(0.0f));
          ASSERT_EQ(BitsOf(prepared[after[s][e] * width + c]), want) << "slot " << e;
        }
      } else {
        ASSERT_EQ(after[s][e], kSdmNoRow) << "an unwritten slot stays at M0";
      }
    }
    EXPECT_EQ(row_counts[s], pre_count[s] + seg_new) << "segment " << s;
    total_new += seg_new;
  }
  // Exactly the rows popped from the top of the free list, each once.
  EXPECT_EQ(free_after, free_before - total_new);
  ASSERT_GE(free_after, 0);
  for (int32_t i = 0; i < free_after; ++i) ASSERT_EQ(free_list_after[i], free_list[i]);
  std::vector<int32_t> popped(free_list.begin() + free_after, free_list.begin() + free_before);
  std::sort(popped.begin(), popped.end());
  std::sort(new_rows.begin(), new_rows.end());
  EXPECT_EQ(new_rows, popped);
  // Rows not handed out are untouched by the preparation.
  std::set<int32_t> new_set(new_rows.begin(), new_rows.end());
  for (int64_t r = 0; r < capacity; ++r) {
    if (new_set.count(static_cast<int32_t>(r)) != 0) continue;
    for (int64_t c = 0; c < width; ++c) {
      ASSERT_EQ(BitsOf(prepared[r * width + c]), BitsOf(arena[r * width + c])) << "row " << r;
    }
  }
  // References.
  for (int64_t s = 0; s < num; ++s) {
    for (int64_t t = 0; t < sc.lengths[s]; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t rh = (first[s] + t) * heads + h;
        for (int64_t i = 0; i < n_w; ++i) {
          ASSERT_EQ(w_rows[rh * n_w + i], after[s][h * ss + w_slots[rh * n_w + i]]);
        }
        for (int64_t j = 0; j < n_r; ++j) {
          const int32_t slot = r_slots[rh * n_r + j];
          const int32_t entry = after[s][h * ss + slot];
          ASSERT_EQ(r_refs[rh * n_r + j], entry >= 0 ? entry : SdmM0Ref(h, slot, ss));
        }
      }
    }
  }

  // --- The step. ---
  cuda::SdmStepArgs args;
  args.w_rows = d_w_rows.get();
  args.w_weights = d_w_weights.get();
  args.n_w = n_w;
  args.r_refs = d_r_refs.get();
  args.r_weights = d_r_weights.get();
  args.n_r = n_r;
  args.log_decay = d_log_decay.get();
  args.beta = d_beta.get();
  args.v = d_v.get();
  args.v_stride = v_stride;
  args.key_weighted_decay = sc.key_weighted_decay;
  args.slot_residual = sc.slot_residual;
  args.m0 = m0_ptr;
  args.readings = d_readings.get();
  ASSERT_EQ(cuda::SdmStep(args, segs, dims, arena_desc, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<__nv_bfloat16> stepped = Download(d_rows.get(), arena.size());
  const std::vector<float> readings = Download(d_readings.get(), rows * heads * width);

  // CPU twin over an fp32 copy of the prepared rows. After each token's write the written rows
  // are rounded to bf16, as the GPU stores them, so both sides read the same values and differ
  // only by fp32 summation order and expf ulps (~1e-7 relative) -- except where such a tiny
  // difference crosses a bf16 rounding boundary (one bf16 ulp, 2^-8 relative), which can then
  // propagate through later tokens of that column. Hence: almost every written element must be
  // bit-identical, and every element within a few bf16 ulps of the arena's largest magnitude.
  std::vector<float> ref(prepared.size());
  for (size_t i = 0; i < ref.size(); ++i) ref[i] = ToFloat(prepared[i]);
  std::vector<float> m0f(m0.size()), zeros(width, 0.0f);
  for (size_t i = 0; i < m0.size(); ++i) m0f[i] = ToFloat(m0[i]);
  std::vector<float> want_readings(readings.size(), 0.0f);
  std::vector<float> read_scale(readings.size(), 0.0f);  // sum_j |q_j M_j[c]|
  const cpu::SdmRule rule =
      sc.slot_residual ? cpu::SdmRule::kSlotResidual : cpu::SdmRule::kSharedResidual;
  std::set<int32_t> written_rows;
  for (int64_t s = 0; s < num; ++s) {
    for (int64_t t = 0; t < sc.lengths[s]; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t rh = (first[s] + t) * heads + h;
        std::vector<float*> wp(n_w);
        std::vector<float> alpha;
        for (int64_t i = 0; i < n_w; ++i) {
          wp[i] = &ref[static_cast<int64_t>(w_rows[rh * n_w + i]) * width];
          written_rows.insert(w_rows[rh * n_w + i]);
          if (sc.key_weighted_decay)
            alpha.push_back(std::exp(log_decay[rh] * w_weights[rh * n_w + i]));
        }
        if (!sc.key_weighted_decay) alpha.push_back(std::exp(log_decay[rh]));
        cpu::SdmWriteColumns(wp, std::span<const float>(&w_weights[rh * n_w], n_w), alpha, beta[rh],
                             &v[rh * width], rule, 0, width);
        for (float* p : wp) {
          for (int64_t c = 0; c < width; ++c) p[c] = ToFloat(ToBf16(p[c]));
        }
        std::vector<const float*> rp(n_r);
        for (int64_t j = 0; j < n_r; ++j) {
          const int32_t r = r_refs[rh * n_r + j];
          rp[j] = r >= 0 ? &ref[static_cast<int64_t>(r) * width]
                         : (sc.m0 ? &m0f[SdmM0RowOf(r) * width] : zeros.data());
          for (int64_t c = 0; c < width; ++c) {
            read_scale[rh * width + c] += std::abs(r_weights[rh * n_r + j] * rp[j][c]);
          }
        }
        cpu::SdmReadColumns(rp, std::span<const float>(&r_weights[rh * n_r], n_r),
                            &want_readings[rh * width], 0, width);
      }
    }
  }
  float max_abs = 0.0f;
  for (float x : ref) max_abs = std::max(max_abs, std::abs(x));
  const float row_tol = 4.0f * std::ldexp(1.0f, -8) * max_abs;
  int64_t checked = 0, exact = 0;
  for (int64_t r = 0; r < capacity; ++r) {
    const bool was_written = written_rows.count(static_cast<int32_t>(r)) != 0;
    for (int64_t c = 0; c < width; ++c) {
      const int64_t i = r * width + c;
      if (!was_written) {
        ASSERT_EQ(BitsOf(stepped[i]), BitsOf(prepared[i])) << "unwritten row " << r << " changed";
        continue;
      }
      ++checked;
      exact += BitsOf(stepped[i]) == BitsOf(ToBf16(ref[i])) ? 1 : 0;
      ASSERT_NEAR(ToFloat(stepped[i]), ref[i], row_tol) << "row " << r << " col " << c;
    }
  }
  EXPECT_GE(exact, checked * 95 / 100) << exact << " of " << checked << " bit-identical";
  int64_t close = 0;
  for (size_t i = 0; i < readings.size(); ++i) {
    const float s = read_scale[i];
    ASSERT_NEAR(readings[i], want_readings[i], std::ldexp(1.0f, -6) * s + 1e-6f) << "reading " << i;
    close += std::abs(readings[i] - want_readings[i]) <= 1e-5f * s + 1e-6f ? 1 : 0;
  }
  EXPECT_GE(close, static_cast<int64_t>(readings.size()) * 90 / 100);

  // --- Gather / scatter round trip of segment 0's private rows. ---
  std::vector<int32_t> slot_ids, row_ids;
  for (int64_t e = 0; e < n_slots; ++e) {
    if (after[0][e] >= 0) {
      slot_ids.push_back(static_cast<int32_t>(e));
      row_ids.push_back(after[0][e]);
    }
  }
  const int64_t count = static_cast<int64_t>(row_ids.size());
  auto d_row_ids = Upload(row_ids);
  auto d_slot_ids = Upload(slot_ids);
  cuda::DeviceBuffer<__nv_bfloat16> d_gathered(count * width), d_regathered(count * width);
  ASSERT_EQ(cuda::SdmGatherRows(arena_desc, d_row_ids.get(), count, d_gathered.get(), nullptr),
            cudaSuccess);
  // Release segment 0's table first so the scatter has rows to pop (fork-free: rows return).
  ASSERT_EQ(cuda::SdmReleaseRows(d_tables[0].get(), n_slots, arena_desc, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(DownloadScalar(d_free_count.get()), free_after + count);
  for (int32_t e : Download(d_tables[0].get(), n_slots)) ASSERT_EQ(e, kSdmNoRow);
  const std::vector<__nv_bfloat16> gathered = Download(d_gathered.get(), count * width);
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t c = 0; c < width; ++c) {
      ASSERT_EQ(BitsOf(gathered[i * width + c]), BitsOf(stepped[row_ids[i] * width + c]));
    }
  }
  ASSERT_EQ(cuda::SdmScatterRows(d_gathered.get(), d_slot_ids.get(), count, d_tables[0].get(),
                                 arena_desc, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(DownloadScalar(d_free_count.get()), free_after);
  const std::vector<int32_t> restored = Download(d_tables[0].get(), n_slots);
  std::vector<int32_t> restored_rows;
  for (int64_t e = 0; e < n_slots; ++e) {
    if (after[0][e] >= 0) {
      ASSERT_GE(restored[e], 0);
      restored_rows.push_back(restored[e]);
    } else {
      ASSERT_EQ(restored[e], kSdmNoRow);
    }
  }
  auto d_restored_rows = Upload(restored_rows);
  ASSERT_EQ(
      cuda::SdmGatherRows(arena_desc, d_restored_rows.get(), count, d_regathered.get(), nullptr),
      cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<__nv_bfloat16> regathered = Download(d_regathered.get(), count * width);
  for (int64_t i = 0; i < count * width; ++i) {
    ASSERT_EQ(BitsOf(regathered[i]), BitsOf(gathered[i])) << i;
  }

  // --- Release every table: every row handed out comes back exactly once. ---
  for (int64_t s = 0; s < num; ++s) {
    ASSERT_EQ(cuda::SdmReleaseRows(d_tables[s].get(), n_slots, arena_desc, nullptr), cudaSuccess);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(DownloadScalar(d_free_count.get()), capacity);
  std::vector<int32_t> all = Download(d_free.get(), capacity);
  std::sort(all.begin(), all.end());
  std::vector<int32_t> want_all(perm.begin(), perm.begin() + capacity);
  std::sort(want_all.begin(), want_all.end());
  EXPECT_EQ(all, want_all);
}

#endif  // SDM_HAVE_CUDA

TEST(CudaSdmTest, MultiTokenSegmentsWithM0) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  // 16 slots, 8 written per token: slots are rewritten across tokens of a segment, so the
  // sequential recurrence and copy-on-write deduplication matter. width 96: 4-byte tiles.
  Scenario sc;
  sc.lengths = {5, 1, 7};
  sc.seed = 21;
  RunScenario(sc);
#endif
}

TEST(CudaSdmTest, ZeroM0KeyWeightedDecayWideRows) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  Scenario sc;
  sc.heads = 1;
  sc.side = 8;
  sc.width = 1024;
  sc.k_w = 32;
  sc.k_r = 16;
  sc.lengths = {6, 3};
  sc.m0 = false;
  sc.key_weighted_decay = true;
  sc.seed = 22;
  RunScenario(sc);
#endif
}

TEST(CudaSdmTest, SlotResidualOddWidth) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  Scenario sc;  // width 33: the scalar path
  sc.width = 33;
  sc.lengths = {4, 4, 2};
  sc.slot_residual = true;
  sc.seed = 23;
  RunScenario(sc);
#endif
}

TEST(CudaSdmTest, DecodeBatchWideGrid) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  // 140 single-token segments x 2 heads x 2 tiles: the 16-byte tile path.
  Scenario sc;
  sc.side = 8;
  sc.width = 512;
  sc.lengths.assign(140, 1);
  sc.seed = 24;
  RunScenario(sc);
#endif
}

TEST(CudaSdmTest, FlagshipShapes) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  Scenario sc;  // sdm_flagship: H=2, s=256, hd=1024, W=R=128
  sc.side = 256;
  sc.width = 1024;
  sc.k_w = sc.k_r = 128;
  sc.lengths = {1, 3, 1, 2};
  sc.prepopulated = 0.01;
  sc.seed = 25;
  RunScenario(sc);
#endif
}

// The 16-byte tile path at the flagship's shapes (hd 1024, 128 rows written and read per head)
// with a decode batch of 64 sessions: 64 segments x 2 heads x 4 tiles = 512 blocks >= the wide-grid
// threshold of SdmStep (kernels/cuda/sdm.cu), which a batch of 33 or more reaches at these shapes.
TEST(CudaSdmTest, FlagshipDecodeBatch64SixteenByteTiles) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  Scenario sc;
  sc.side = 256;
  sc.width = 1024;
  sc.k_w = sc.k_r = 128;
  sc.lengths.assign(64, 1);
  sc.prepopulated = 0.002;
  sc.seed = 26;
  RunScenario(sc);
#endif
}

TEST(CudaSdmTest, FreshSeeds) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  const uint32_t seed = FreshSeed();
  Scenario a;
  a.lengths = {3, 9, 1};
  a.key_weighted_decay = seed % 2 == 0;
  a.m0 = seed % 3 != 0;
  a.seed = seed;
  RunScenario(a);
  Scenario b;
  b.side = 8;
  b.width = 256;
  b.lengths.assign(150, 1);
  b.lengths[7] = 4;
  b.slot_residual = seed % 2 == 1;
  b.seed = seed + 1;
  RunScenario(b);
#endif
}

#if defined(SDM_HAVE_CUDA)

// ---------------------------------------------------------------------------------------------
// The decode step (SdmDecodeStep) against SdmPrepareRows + SdmStep on a copy of the same state:
// the same slots get rows, every slot's row holds the same bits, the readings are the same bits,
// the same rows leave the free list and the row counts agree; rows outside the tables are left
// alone. (RunScenario checks the two-stage path against the CPU twins.)
struct DecodeCase {
  int64_t heads = 2, side = 4, width = 32;
  int64_t batch = 5;
  int64_t k_w = 8, k_r = 8;
  bool m0 = true;
  bool key_weighted_decay = false;
  bool slot_residual = false;
  double prepopulated = 0.3;
  int64_t reserve_short = 0;  // > 0: the free list holds this many rows fewer than the reserve
  uint32_t seed = 1;
  // Where the rows are allocated at these shapes (PlanSdmDecode): checked against the plan and
  // against the scratch the separate allocation launch writes and the others leave alone.
  SdmDecodeAlloc expect_alloc = SdmDecodeAlloc::kInBlock;
  int64_t max_cluster_blocks = kSdmMaxClusterBlocks;  // 1: no clusters (the two launches)
};

// One copy of a batch's mutable device state.
struct DecodeState {
  cuda::DeviceBuffer<__nv_bfloat16> rows;
  cuda::DeviceBuffer<int32_t> free_list, free_count, row_counts;
  std::vector<cuda::DeviceBuffer<int32_t>> tables;
  cuda::DeviceBuffer<int32_t*> table_ptrs, count_ptrs;
  cuda::DeviceBuffer<float> readings;
  WrittenMarks marks;
};

void RunDecodeCase(const DecodeCase& dc) {
  SCOPED_TRACE(testing::Message() << "seed " << dc.seed << " heads " << dc.heads << " side "
                                  << dc.side << " width " << dc.width << " batch " << dc.batch
                                  << " k_w " << dc.k_w << " k_r " << dc.k_r);
  std::mt19937 rng(dc.seed);
  const int64_t heads = dc.heads, side = dc.side, width = dc.width, num = dc.batch;
  const int64_t n_slots = heads * side * side;
  const std::vector<int32_t> lengths(num, 1);
  const HostBatch batch = MakeHostBatch(rng, heads, side, width, lengths, dc.k_w, dc.k_r, dc.m0,
                                        dc.prepopulated, /*slack=*/5 - dc.reserve_short);
  const int64_t n_w = batch.n_w, n_r = batch.n_r, capacity = batch.capacity;
  const std::vector<std::vector<int32_t>>& tables = batch.tables;
  const std::vector<__nv_bfloat16>& arena = batch.arena;
  // The device's free list has room for every row; entries past the count are garbage.
  std::vector<int32_t> free_storage = batch.free_list;
  free_storage.resize(capacity, -7);
  const int32_t free_before = static_cast<int32_t>(batch.free_list.size());

  const std::vector<int32_t>& first = batch.first;
  const std::vector<int32_t>& pre_count = batch.pre_count;
  const std::vector<int32_t>&w_slots = batch.w_slots, &r_slots = batch.r_slots;
  auto d_first = Upload(first);
  auto d_lengths = Upload(lengths);
  auto d_m0 = Upload(batch.m0);
  auto d_w_slots = Upload(w_slots);
  auto d_r_slots = Upload(r_slots);
  auto d_w_weights = Upload(batch.w_weights);
  auto d_r_weights = Upload(batch.r_weights);
  auto d_log_decay = Upload(batch.log_decay);
  auto d_beta = Upload(batch.beta);
  auto d_v = Upload(batch.v);
  // The decode step reads v inside wider rows (a stacked projection's output, the gaps NaN); the
  // two-stage path it is compared with reads it back to back.
  const int64_t v_stride = heads * width + 8;
  auto d_v_strided = Upload(Strided(batch.v, heads * width, v_stride));
  const __nv_bfloat16* m0_ptr = dc.m0 ? d_m0.get() : nullptr;
  cuda::SdmDims dims{heads, side, width};

  auto make_state = [&](DecodeState& st) {
    st.rows = Upload(arena);
    st.free_list = Upload(free_storage);
    st.free_count = Upload(std::vector<int32_t>{free_before});
    st.row_counts = Upload(pre_count);
    std::vector<int32_t*> tp, cp;
    for (int64_t s = 0; s < num; ++s) {
      st.tables.push_back(Upload(tables[s]));
      tp.push_back(st.tables.back().get());
      cp.push_back(st.row_counts.get() + s);
    }
    st.table_ptrs = Upload(tp);
    st.count_ptrs = Upload(cp);
    st.readings = cuda::DeviceBuffer<float>(num * heads * width);
    st.marks = MakeWrittenMarks(dc.seed + 1, num, n_slots);
  };
  auto arena_of = [&](DecodeState& st) {
    return cuda::SdmRowArena{st.rows.get(), st.free_list.get(), st.free_count.get(), width,
                             capacity};
  };
  auto segs_of = [&](DecodeState& st) {
    cuda::SdmSegments segs;
    segs.first_row = d_first.get();
    segs.length = d_lengths.get();
    segs.tables = st.table_ptrs.get();
    segs.row_counts = st.count_ptrs.get();
    segs.written = st.marks.ptrs.get();
    segs.num = num;
    segs.max_length = 1;
    return segs;
  };

  // A: the two-stage path.
  DecodeState a;
  make_state(a);
  cuda::DeviceBuffer<int32_t> d_w_rows(w_slots.size()), d_r_refs(r_slots.size());
  ASSERT_EQ(cuda::SdmPrepareRows(d_w_slots.get(), n_w, d_r_slots.get(), n_r, segs_of(a), dims,
                                 m0_ptr, arena_of(a), d_w_rows.get(), d_r_refs.get(), nullptr),
            cudaSuccess);
  cuda::SdmStepArgs step;
  step.w_rows = d_w_rows.get();
  step.w_weights = d_w_weights.get();
  step.n_w = n_w;
  step.r_refs = d_r_refs.get();
  step.r_weights = d_r_weights.get();
  step.n_r = n_r;
  step.log_decay = d_log_decay.get();
  step.beta = d_beta.get();
  step.v = d_v.get();
  step.key_weighted_decay = dc.key_weighted_decay;
  step.slot_residual = dc.slot_residual;
  step.m0 = m0_ptr;
  step.readings = a.readings.get();
  ASSERT_EQ(cuda::SdmStep(step, segs_of(a), dims, arena_of(a), nullptr), cudaSuccess);

  // B: the decode step.
  DecodeState b;
  make_state(b);
  // INT32_MIN is no allocation mark (-2 - row would need row 2^31 - 2).
  constexpr int32_t kUntouched = std::numeric_limits<int32_t>::min();
  auto d_scratch_rows = Upload(std::vector<int32_t>(w_slots.size(), kUntouched));
  SdmDecodeShape shape;
  shape.width = width;
  shape.n_w = n_w;
  shape.segments = num;
  shape.heads = heads;
  shape.rows_aligned_16 = shape.rows_aligned_4 = true;  // cudaMalloc'd: 256-byte aligned
  const SdmDecodePlan plan = PlanSdmDecode(shape, dc.max_cluster_blocks);
  EXPECT_EQ(static_cast<int>(plan.alloc), static_cast<int>(dc.expect_alloc))
      << "vec " << plan.vec << " tiles " << plan.tiles;
  cuda::SdmDecodeArgs dec;
  dec.w_slots = d_w_slots.get();
  dec.w_weights = d_w_weights.get();
  dec.n_w = n_w;
  dec.r_slots = d_r_slots.get();
  dec.r_weights = d_r_weights.get();
  dec.n_r = n_r;
  dec.log_decay = d_log_decay.get();
  dec.beta = d_beta.get();
  dec.v = d_v_strided.get();
  dec.v_stride = v_stride;
  dec.key_weighted_decay = dc.key_weighted_decay;
  dec.slot_residual = dc.slot_residual;
  dec.m0 = m0_ptr;
  dec.readings = b.readings.get();
  dec.w_rows = d_scratch_rows.get();
  // What the step launches on this device: the shapes' plan (every device the build targets
  // launches clusters and grants the non-portable opt-in).
  const SdmDecodePlan launched =
      cuda::SdmDecodeStepPlan(dec, segs_of(b), dims, arena_of(b), dc.max_cluster_blocks);
  EXPECT_EQ(launched.vec, plan.vec);
  EXPECT_EQ(launched.tiles, plan.tiles);
  EXPECT_EQ(static_cast<int>(launched.alloc), static_cast<int>(plan.alloc));
  EXPECT_EQ(launched.cluster_blocks, plan.cluster_blocks);
  ASSERT_EQ(cuda::SdmDecodeStep(dec, segs_of(b), dims, arena_of(b), nullptr, dc.max_cluster_blocks),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<int32_t> scratch = Download(d_scratch_rows.get(), w_slots.size());
  const auto untouched = std::count(scratch.begin(), scratch.end(), kUntouched);
  if (launched.alloc == SdmDecodeAlloc::kSeparate) {
    EXPECT_EQ(untouched, 0) << "the allocation launch writes every entry's row";
  } else {
    EXPECT_EQ(untouched, static_cast<int64_t>(scratch.size())) << "allocated within the step";
  }

  const std::vector<__nv_bfloat16> rows_a = Download(a.rows.get(), arena.size());
  const std::vector<__nv_bfloat16> rows_b = Download(b.rows.get(), arena.size());
  {
    SCOPED_TRACE("two-stage path");
    ExpectWrittenMarks(a.marks, w_slots, n_w, heads, side * side, first, lengths);
  }
  {
    SCOPED_TRACE("decode step");
    ExpectWrittenMarks(b.marks, w_slots, n_w, heads, side * side, first, lengths);
  }
  const int32_t free_a = DownloadScalar(a.free_count.get());
  const int32_t free_b = DownloadScalar(b.free_count.get());
  EXPECT_EQ(free_b, free_a);
  EXPECT_EQ(Download(b.row_counts.get(), num), Download(a.row_counts.get(), num));
  std::set<int32_t> in_tables;
  int64_t new_rows = 0;
  for (int64_t s = 0; s < num; ++s) {
    const std::vector<int32_t> ta = Download(a.tables[s].get(), n_slots);
    const std::vector<int32_t> tb = Download(b.tables[s].get(), n_slots);
    for (int64_t e = 0; e < n_slots; ++e) {
      ASSERT_EQ(ta[e] >= 0, tb[e] >= 0) << "segment " << s << " slot " << e;
      if (tb[e] < 0) continue;
      if (tables[s][e] >= 0) {
        ASSERT_EQ(tb[e], tables[s][e]) << "an existing row is kept";
      } else {
        ++new_rows;
      }
      in_tables.insert(tb[e]);
      for (int64_t c = 0; c < width; ++c) {
        ASSERT_EQ(BitsOf(rows_b[tb[e] * width + c]), BitsOf(rows_a[ta[e] * width + c]))
            << "segment " << s << " slot " << e << " column " << c;
      }
    }
  }
  // The rows handed out are the ones popped from the top of the free list (both paths).
  const int32_t popped = free_before - std::max(free_b, 0);
  EXPECT_EQ(new_rows, popped);
  for (int64_t i = std::max(free_b, 0); i < free_before; ++i) {
    EXPECT_EQ(in_tables.count(free_storage[i]), 1u) << "free list entry " << i;
  }
  for (int64_t r = 0; r < capacity; ++r) {
    if (in_tables.count(static_cast<int32_t>(r)) != 0) continue;
    for (int64_t c = 0; c < width; ++c) {
      ASSERT_EQ(BitsOf(rows_b[r * width + c]), BitsOf(arena[r * width + c])) << "free row " << r;
    }
  }
  const std::vector<float> read_a = Download(a.readings.get(), num * heads * width);
  const std::vector<float> read_b = Download(b.readings.get(), num * heads * width);
  ASSERT_EQ(read_a.size(), read_b.size());
  EXPECT_EQ(0, std::memcmp(read_a.data(), read_b.data(), read_a.size() * sizeof(float)))
      << "readings differ";
  if (dc.reserve_short > 0) {
    EXPECT_LT(free_b, 0) << "the free list ran out";
  }
}

// Runs `dc` as it is and, where it takes a cluster, again without clusters (the two-launch path
// at the same shapes): each against the two-stage path, so the two agree bit for bit.
void RunDecodeCaseWithAndWithoutClusters(DecodeCase dc) {
  RunDecodeCase(dc);
  if (dc.expect_alloc != SdmDecodeAlloc::kCluster) return;
  SCOPED_TRACE("without clusters");
  dc.max_cluster_blocks = 1;
  dc.expect_alloc = SdmDecodeAlloc::kSeparate;
  RunDecodeCase(dc);
}

#endif  // SDM_HAVE_CUDA

// Width 32: one block covers a row, so allocation runs in the step's own launch (one kernel).
// 16 slots with 8 written and 8 read per token: many reads of a slot the token just wrote.
TEST(CudaSdmTest, DecodeStepInOneLaunchMatchesPrepareAndStep) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  DecodeCase dc;
  dc.seed = 31;
  RunDecodeCase(dc);
  dc.width = 64;  // 4-byte tiles, one tile
  dc.slot_residual = true;
  dc.seed = 32;
  RunDecodeCase(dc);
  dc.width = 200;  // 16-byte tiles, one tile, lanes past the row idle
  dc.slot_residual = false;
  dc.m0 = false;
  dc.key_weighted_decay = true;
  dc.seed = 33;
  RunDecodeCase(dc);
#endif
}

// Rows wider than a tile: the row's tiles run as one thread-block cluster whose rank 0
// allocates (one launch); and the same cases without clusters (two launches).
TEST(CudaSdmTest, DecodeStepOverSeveralTilesMatchesPrepareAndStep) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  DecodeCase dc;
  dc.expect_alloc = SdmDecodeAlloc::kCluster;
  dc.width = 33;  // odd: scalar tiles of 32 columns, two of them
  dc.seed = 34;
  RunDecodeCaseWithAndWithoutClusters(dc);
  dc.side = 8;
  dc.width = 512;  // 140 x 2 heads x 2 tiles: 16-byte tiles
  dc.batch = 140;
  dc.k_w = 16;
  dc.seed = 35;
  RunDecodeCaseWithAndWithoutClusters(dc);
  dc.batch = 3;  // a narrow grid: 4-byte tiles, 8 per row (the largest portable cluster)
  dc.slot_residual = true;
  dc.seed = 36;
  RunDecodeCaseWithAndWithoutClusters(dc);
#endif
}

// More tiles per row than a cluster holds (16): a separate allocation launch first, then the
// step over the tiles.
TEST(CudaSdmTest, DecodeStepOverMoreTilesThanAClusterHolds) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  DecodeCase dc;
  dc.expect_alloc = SdmDecodeAlloc::kSeparate;
  dc.width = 1090;  // even, not a multiple of 8: 4-byte tiles, 18 per row
  dc.batch = 3;
  dc.seed = 41;
  RunDecodeCase(dc);
  dc.width = 545;  // odd: scalar tiles, 18 per row
  dc.slot_residual = true;
  dc.m0 = false;
  dc.seed = 42;
  RunDecodeCase(dc);
  dc.heads = 1;  // and the free list running out, as DecodeStepWhenTheFreeListRunsOut
  dc.batch = 1;
  dc.prepopulated = 0.1;
  dc.reserve_short = 9;
  dc.seed = 43;
  RunDecodeCase(dc);
#endif
}

// sdm_flagship's shapes (2 heads, s = 256, hd 1024, 128 rows written and read) at batch 64: the
// 16-byte tiles with 64 KiB of staged rows (the opt-in to large shared memory), clusters of 4;
// and 256 rows written per head, too many to stage 16-byte tiles, on 4-byte tiles instead:
// clusters of 16 (the non-portable opt-in).
TEST(CudaSdmTest, DecodeStepAtFlagshipShapes) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  DecodeCase dc;
  dc.expect_alloc = SdmDecodeAlloc::kCluster;
  dc.side = 256;
  dc.width = 1024;
  dc.k_w = dc.k_r = 128;
  dc.batch = 64;
  dc.prepopulated = 0.002;
  dc.seed = 37;
  RunDecodeCaseWithAndWithoutClusters(dc);
  dc.batch = 2;
  dc.k_w = 256;
  dc.seed = 38;
  RunDecodeCaseWithAndWithoutClusters(dc);
#endif
}

// The free list holding fewer rows than the reserve (a broken precondition): one (segment,
// head), so both paths hand the rows out in the same order, and leave the same count.
TEST(CudaSdmTest, DecodeStepWhenTheFreeListRunsOut) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  DecodeCase dc;
  dc.heads = 1;
  dc.batch = 1;
  dc.prepopulated = 0.1;
  dc.reserve_short = 9;  // the reserve's slack is 5: 4 writes find no row
  dc.seed = 39;
  RunDecodeCase(dc);
  dc.width = 300;  // and with the allocation by rank 0 of a cluster of 5
  dc.expect_alloc = SdmDecodeAlloc::kCluster;
  dc.seed = 40;
  RunDecodeCase(dc);
#endif
}

TEST(CudaSdmTest, DecodeStepFreshSeeds) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  const uint32_t seed = FreshSeed();
  DecodeCase dc;
  dc.width = seed % 2 == 0 ? 96 : 320;  // one tile, or a cluster of 5 four-byte tiles
  dc.expect_alloc = seed % 2 == 0 ? SdmDecodeAlloc::kInBlock : SdmDecodeAlloc::kCluster;
  dc.batch = 1 + seed % 9;
  dc.m0 = seed % 3 != 0;
  dc.key_weighted_decay = seed % 5 < 2;
  dc.slot_residual = seed % 7 < 3;
  dc.seed = seed;
  RunDecodeCaseWithAndWithoutClusters(dc);
#endif
}

// Multi-token segments are not a decode step; a cluster cap must allow one block.
TEST(CudaSdmTest, DecodeStepRefusesMultiTokenSegments) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  cuda::SdmSegments segs;
  segs.num = 1;
  segs.max_length = 2;
  cuda::SdmRowArena arena;
  arena.row_width = 32;
  cuda::SdmDecodeArgs args;
  EXPECT_EQ(cuda::SdmDecodeStep(args, segs, cuda::SdmDims{1, 4, 32}, arena, nullptr),
            cudaErrorInvalidValue);
  segs.max_length = 1;  // and a cluster cap below one block
  EXPECT_EQ(cuda::SdmDecodeStep(args, segs, cuda::SdmDims{1, 4, 32}, arena, nullptr, 0),
            cudaErrorInvalidValue);
#endif
}

// A part of a stacked projection's rows read with a stride below a row is refused, not read.
TEST(CudaSdmTest, StridesBelowARowAreRefused) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  const int64_t heads = 2, side = 4, width = 32;
  cuda::SdmAddressJob job;
  job.k = 4;
  job.scores_stride = heads * 2 * side - 1;
  EXPECT_EQ(
      cuda::SdmAddressJobs(std::span<const cuda::SdmAddressJob>(&job, 1), 1, heads, side, nullptr),
      cudaErrorInvalidValue);
  const cuda::SdmDims dims{heads, side, width};
  cuda::SdmRowArena arena;
  arena.row_width = width;
  cuda::SdmSegments segs;  // none: only the arguments are checked
  segs.max_length = 1;
  cuda::SdmStepArgs step;
  step.v_stride = heads * width - 1;
  EXPECT_EQ(cuda::SdmStep(step, segs, dims, arena, nullptr), cudaErrorInvalidValue);
  cuda::SdmDecodeArgs dec;
  dec.v_stride = heads * width - 1;
  EXPECT_EQ(cuda::SdmDecodeStep(dec, segs, dims, arena, nullptr), cudaErrorInvalidValue);
  // The same calls with the stride of a row back to back (or 0, the same) do nothing and succeed.
  step.v_stride = heads * width;
  dec.v_stride = 0;
  EXPECT_EQ(cuda::SdmStep(step, segs, dims, arena, nullptr), cudaSuccess);
  EXPECT_EQ(cuda::SdmDecodeStep(dec, segs, dims, arena, nullptr), cudaSuccess);
#endif
}

// A release when the count is already out of range (a broken precondition) must not write
// outside the free list: the guard drops the entries, the table is still cleared, and the count
// stays out of range for the engine's refresh to report (CudaDeviceContext::CheckFreeCount).
TEST(CudaSdmTest, ReleaseNeverWritesOutsideTheFreeList) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  const int64_t capacity = 64;
  // The list sits inside a larger buffer whose margins must stay untouched.
  const int64_t margin = 64;
  std::vector<int32_t> storage(capacity + 2 * margin, -7);
  auto d_storage = Upload(storage);
  for (int32_t broken : {-5, static_cast<int32_t>(capacity) - 2}) {
    auto d_count = Upload(std::vector<int32_t>{broken});
    // 10 slots holding rows 0..9: the release pushes 10 rows from `broken` on.
    std::vector<int32_t> table(10);
    for (int32_t i = 0; i < 10; ++i) table[i] = i;
    auto d_table = Upload(table);
    cuda::SdmRowArena arena;
    arena.free_list = d_storage.get() + margin;
    arena.free_count = d_count.get();
    arena.row_width = 8;
    arena.capacity = capacity;
    ASSERT_EQ(cuda::SdmReleaseRows(d_table.get(), 10, arena, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<int32_t> after = Download(d_storage.get(), capacity + 2 * margin);
    for (int64_t i = 0; i < margin; ++i) {
      ASSERT_EQ(after[i], -7) << "wrote before the list at " << i - margin;
      ASSERT_EQ(after[margin + capacity + i], -7) << "wrote past the list at " << capacity + i;
    }
    EXPECT_EQ(DownloadScalar(d_count.get()), broken + 10);
    for (int32_t entry : Download(d_table.get(), 10)) EXPECT_EQ(entry, kSdmNoRow);
  }
#endif
}

// Pops when the count is out of range above (more returns than rows: a broken precondition) or
// the list holds an entry outside the arena: a scatter's pops at positions past the list, or of
// such an entry, take no row (the slot stays empty, nothing outside the list is read, no row
// outside the arena is written), the others take their rows as usual, and the count still
// drops by one per pop, out of range for the engine's refresh to report.
TEST(CudaSdmTest, PopsNeverReadOutsideTheFreeList) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  const int64_t capacity = 16, width = 8, margin = 32, over = 5;
  // The arena's rows sit inside a larger buffer whose margins must stay as they were; the list's
  // margins hold row 1, so a pop that read past the list would take row 1 a second time.
  std::vector<__nv_bfloat16> row_storage((capacity + 2 * margin) * width,
                                         __float2bfloat16_rn(-1.0f));
  auto d_row_storage = Upload(row_storage);
  std::vector<int32_t> list_storage(capacity + 2 * margin, 1);
  for (int64_t i = 0; i < capacity; ++i) list_storage[margin + i] = static_cast<int32_t>(i);
  list_storage[margin + 3] = static_cast<int32_t>(capacity + 2);  // an entry outside the arena
  auto d_list_storage = Upload(list_storage);
  auto d_count = Upload(std::vector<int32_t>{static_cast<int32_t>(capacity + over)});
  cuda::SdmRowArena arena;
  arena.rows = d_row_storage.get() + margin * width;
  arena.free_list = d_list_storage.get() + margin;
  arena.free_count = d_count.get();
  arena.row_width = width;
  arena.capacity = capacity;
  // capacity + over pops: positions capacity + over - 1 down to 0.
  const int64_t pops = capacity + over;
  std::vector<int32_t> slot_ids(pops);
  std::vector<__nv_bfloat16> src(pops * width);
  for (int64_t i = 0; i < pops; ++i) {
    slot_ids[i] = static_cast<int32_t>(i);
    for (int64_t c = 0; c < width; ++c) src[i * width + c] = __float2bfloat16_rn(float(i));
  }
  auto d_src = Upload(src);
  auto d_slots = Upload(slot_ids);
  auto d_table = Upload(std::vector<int32_t>(pops, kSdmNoRow));
  ASSERT_EQ(cuda::SdmScatterRows(d_src.get(), d_slots.get(), pops, d_table.get(), arena, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(DownloadScalar(d_count.get()), 0);
  const std::vector<int32_t> table = Download(d_table.get(), pops);
  const std::vector<__nv_bfloat16> rows =
      Download(d_row_storage.get(), (capacity + 2 * margin) * width);
  std::vector<int> taken(capacity, 0);
  int64_t empty = 0;
  for (int64_t i = 0; i < pops; ++i) {
    if (table[i] == kSdmNoRow) {
      ++empty;
      continue;
    }
    ASSERT_GE(table[i], 0);
    ASSERT_LT(table[i], capacity);
    ++taken[table[i]];
    EXPECT_EQ(__bfloat162float(rows[(margin + table[i]) * width]), static_cast<float>(i));
  }
  // The `over` positions past the list and the entry outside the arena gave no row; every
  // other row was taken once, row 3 (whose entry was replaced) never.
  EXPECT_EQ(empty, over + 1);
  for (int64_t r = 0; r < capacity; ++r) EXPECT_EQ(taken[r], r == 3 ? 0 : 1) << "row " << r;
  for (int64_t i = 0; i < margin * width; ++i) {
    ASSERT_EQ(__bfloat162float(rows[i]), -1.0f) << "wrote before the arena at " << i;
    ASSERT_EQ(__bfloat162float(rows[(margin + capacity) * width + i]), -1.0f)
        << "wrote past the arena at " << i;
  }
#endif
}

// The free list drained to empty by pops, then a release: the count comes back to the capacity,
// the list holds every row exactly once, nothing outside it is written, and the rows can be
// popped again (distinct, in range, holding what was scattered into them).
TEST(CudaSdmTest, ReleaseIntoAnEmptyFreeList) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  const int64_t capacity = 16, width = 8, margin = 32;
  cuda::DeviceBuffer<__nv_bfloat16> rows(capacity * width);
  std::vector<int32_t> storage(capacity + 2 * margin, -7);
  auto d_storage = Upload(storage);
  cuda::DeviceBuffer<int32_t> count(1);
  cuda::SdmRowArena arena;
  arena.rows = rows.get();
  arena.free_list = d_storage.get() + margin;
  arena.free_count = count.get();
  arena.row_width = width;
  arena.capacity = capacity;
  ASSERT_EQ(cuda::SdmInitFreeList(arena, capacity, nullptr), cudaSuccess);
  // A table of 2 * capacity slots; the even ones get every row of the arena.
  auto d_table = Upload(std::vector<int32_t>(2 * capacity, kSdmNoRow));
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(testing::Message() << "round " << round);
    std::vector<int32_t> slot_ids(capacity);
    std::vector<__nv_bfloat16> src(capacity * width);
    for (int64_t i = 0; i < capacity; ++i) {
      slot_ids[i] = static_cast<int32_t>(2 * i);
      for (int64_t c = 0; c < width; ++c) {
        src[i * width + c] = __float2bfloat16_rn(static_cast<float>(100 * round + i));
      }
    }
    auto d_src = Upload(src);
    auto d_slots = Upload(slot_ids);
    ASSERT_EQ(
        cuda::SdmScatterRows(d_src.get(), d_slots.get(), capacity, d_table.get(), arena, nullptr),
        cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(DownloadScalar(count.get()), 0);  // empty
    const std::vector<int32_t> table = Download(d_table.get(), 2 * capacity);
    const std::vector<__nv_bfloat16> held = Download(rows.get(), capacity * width);
    std::vector<int> seen(capacity, 0);
    for (int64_t i = 0; i < capacity; ++i) {
      const int32_t row = table[2 * i];
      ASSERT_GE(row, 0);
      ASSERT_LT(row, capacity);
      ++seen[row];
      EXPECT_EQ(__bfloat162float(held[row * width]), static_cast<float>(100 * round + i));
      EXPECT_EQ(table[2 * i + 1], kSdmNoRow);
    }
    for (int64_t r = 0; r < capacity; ++r) ASSERT_EQ(seen[r], 1) << "row " << r;

    ASSERT_EQ(cuda::SdmReleaseRows(d_table.get(), 2 * capacity, arena, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(DownloadScalar(count.get()), capacity);
    const std::vector<int32_t> after = Download(d_storage.get(), capacity + 2 * margin);
    for (int64_t i = 0; i < margin; ++i) {
      ASSERT_EQ(after[i], -7) << "wrote before the list at " << i - margin;
      ASSERT_EQ(after[margin + capacity + i], -7) << "wrote past the list at " << capacity + i;
    }
    std::vector<int32_t> listed(after.begin() + margin, after.begin() + margin + capacity);
    std::sort(listed.begin(), listed.end());
    for (int64_t r = 0; r < capacity; ++r) ASSERT_EQ(listed[r], r);
    for (int32_t entry : Download(d_table.get(), 2 * capacity)) EXPECT_EQ(entry, kSdmNoRow);
  }
#endif
}

TEST(CudaSdmTest, InitFreeListHoldsEveryRow) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  const int64_t capacity = 100003;
  cuda::DeviceBuffer<int32_t> list(capacity), count(1);
  cuda::SdmRowArena arena;
  arena.free_list = list.get();
  arena.free_count = count.get();
  arena.row_width = 8;
  arena.capacity = capacity;
  ASSERT_EQ(cuda::SdmInitFreeList(arena, capacity, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(DownloadScalar(count.get()), capacity);
  const std::vector<int32_t> got = Download(list.get(), capacity);
  for (int64_t i = 0; i < capacity; ++i) ASSERT_EQ(got[i], i);
#endif
}

// The written slots with a row, as (slot, row) pairs: exactly the entries whose mark is set and
// whose table entry is a row (a marked slot at M0 is not listed), each once, whatever the order;
// with too small a capacity the count still counts them all and the pairs written are some of
// them, distinct; marks and table unchanged. Fixed and fresh seeds; sizes around a warp and a
// block, and (one seed) past what one pass of the capped grid covers (4096 blocks of 256).
TEST(CudaSdmTest, CollectWrittenListsTheMarkedSlotsWithRows) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  for (const uint32_t seed : {1u, 2u, FreshSeed()}) {
    std::vector<int64_t> sizes = {1, 31, 257, 70001};
    if (seed == 1) sizes.push_back(int64_t{4096} * 256 + 70001);
    for (const int64_t entries : sizes) {
      SCOPED_TRACE(testing::Message() << "seed " << seed << " entries " << entries);
      std::mt19937 rng(seed);
      std::vector<int32_t> table(entries);
      std::vector<uint8_t> marks(entries);
      std::map<int32_t, int32_t> want;  // slot -> row
      for (int64_t e = 0; e < entries; ++e) {
        table[e] = rng() % 3 == 0 ? kSdmNoRow : static_cast<int32_t>(rng() % 1000000);
        marks[e] = rng() % 4 == 0 ? static_cast<uint8_t>(1 + rng() % 255) : 0;
        if (marks[e] != 0 && table[e] >= 0) want[static_cast<int32_t>(e)] = table[e];
      }
      const int64_t total = static_cast<int64_t>(want.size());
      auto d_table = Upload(table);
      auto d_marks = Upload(marks);
      for (const int64_t capacity : {total, total / 2}) {
        SCOPED_TRACE(testing::Message() << "capacity " << capacity);
        cuda::DeviceBuffer<int32_t> pairs(2 * capacity + 2), count(1);
        ASSERT_EQ(cudaMemset(count.get(), 0, sizeof(int32_t)), cudaSuccess);
        ASSERT_EQ(cudaMemset(pairs.get(), 0xff, pairs.bytes()), cudaSuccess);
        ASSERT_EQ(cuda::SdmCollectWritten(d_table.get(), d_marks.get(), entries, pairs.get(),
                                          capacity, count.get(), nullptr),
                  cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_EQ(DownloadScalar(count.get()), total);
        const std::vector<int32_t> got = Download(pairs.get(), 2 * capacity + 2);
        std::set<int32_t> seen;
        for (int64_t k = 0; k < capacity; ++k) {
          auto it = want.find(got[2 * k]);
          ASSERT_TRUE(it != want.end()) << "pair " << k << " names slot " << got[2 * k];
          EXPECT_EQ(got[2 * k + 1], it->second) << "slot " << got[2 * k];
          EXPECT_TRUE(seen.insert(got[2 * k]).second) << "slot " << got[2 * k] << " twice";
        }
        EXPECT_EQ(got[2 * capacity], -1) << "a pair written past the capacity";
        EXPECT_EQ(Download(d_table.get(), entries), table);
        EXPECT_EQ(Download(d_marks.get(), entries), marks);
      }
    }
  }
  EXPECT_EQ(cuda::SdmCollectWritten(nullptr, nullptr, -1, nullptr, 0, nullptr, nullptr),
            cudaErrorInvalidValue);
#endif
}

}  // namespace
}  // namespace sdm::kernels
