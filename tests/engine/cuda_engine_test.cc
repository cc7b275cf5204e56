// The CUDA backend against the CPU backend (docs/model-spec.md §11: CPU vs CUDA logits), and
// the exactness of a session parked to the host and resumed on the device. The CPU model gets
// the same bf16-rounded matrices the device holds, so the remaining differences are bf16
// activations at GEMM inputs and bf16 SDM rows and KV rows: a few bf16 ulps per layer.
//
// Every test but the first needs a device and skips without one (CI has none).
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/model_weights.h"
#include "engine/weight_spec.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_runtime_info.h"

#if defined(SDM_HAVE_CUDA)
#include <cuda_bf16.h>
#endif

namespace sdm {
namespace {

#define SKIP_WITHOUT_DEVICE()                                                     \
  if (kernels::cuda::DeviceCount() == 0) {                                        \
    GTEST_SKIP() << "no CUDA device (" << kernels::cuda::DescribeDevice() << ")"; \
  }

TEST(CudaEngineTest, AskingForCudaWithoutADeviceIsAClearError) {
  if (kernels::cuda::DeviceCount() > 0) GTEST_SKIP() << "a device is present";
  absl::StatusOr<ModelConfig> c = PresetConfig("tiny");
  ASSERT_TRUE(c.ok());
  EngineOptions o;
  o.device = EngineDevice::kCuda;
  absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(RandomModel(*c, 1), o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kUnavailable) << e.status();
  // kAuto falls back to the CPU.
  o.device = EngineDevice::kAuto;
  e = Engine::Create(RandomModel(*c, 1), o);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ((*e)->device(), EngineDevice::kCpu);
}

TEST(CudaEngineTest, ParsesDeviceNames) {
  EXPECT_EQ(*ParseEngineDevice("cuda"), EngineDevice::kCuda);
  EXPECT_EQ(*ParseEngineDevice("cpu"), EngineDevice::kCpu);
  EXPECT_EQ(*ParseEngineDevice("auto"), EngineDevice::kAuto);
  EXPECT_FALSE(ParseEngineDevice("gpu").ok());
}

#if defined(SDM_HAVE_CUDA)

// A random model whose matrices are exactly representable in bf16 (what the device stores).
std::shared_ptr<const Model> Bf16Model(const ModelConfig& config, uint64_t seed) {
  std::shared_ptr<const ModelWeights> random = ModelWeights::Random(config, seed);
  std::map<std::string, std::vector<float>> arrays;
  for (const TensorSpec& t : ExpectedTensors(config)) {
    std::span<const float> v = random->Get(t.name);
    std::vector<float> out(v.begin(), v.end());
    if (t.shape.size() == 2) {
      for (float& x : out) x = __bfloat162float(__float2bfloat16_rn(x));
    }
    arrays[t.name] = std::move(out);
  }
  absl::StatusOr<std::shared_ptr<const ModelWeights>> w =
      ModelWeights::FromArrays(config, std::move(arrays));
  EXPECT_TRUE(w.ok()) << w.status();
  auto model = std::make_shared<Model>();
  model->config = config;
  model->weights = *w;
  return model;
}

// ||a - b|| / ||b|| over a whole logits array.
double RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

std::vector<int32_t> RandomTokens(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = d(rng);
  return t;
}

struct Engines {
  std::unique_ptr<Engine> cpu, cuda;
};

Engines MakeEngines(const std::string& preset, int64_t prefill_chunk) {
  absl::StatusOr<ModelConfig> c = PresetConfig(preset);
  EXPECT_TRUE(c.ok()) << c.status();
  std::shared_ptr<const Model> model = Bf16Model(*c, 7);
  EngineOptions o;
  o.prefill_chunk = prefill_chunk;
  o.device = EngineDevice::kCpu;
  auto cpu = Engine::Create(model, o);
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  o.device = EngineDevice::kCuda;
  o.device_state_bytes = int64_t{2} << 30;
  // The arenas must hold one session at max_context: debug_sdm's four full-attention layers
  // need 2 GiB of KV at the default 131072, more than the 2 GiB above. The sessions here are
  // short.
  o.max_context = 4096;
  auto cuda = Engine::Create(model, o);
  EXPECT_TRUE(cuda.ok()) << cuda.status();
  // A failed engine is null (the callers ASSERT on it), not a crash of the whole test binary.
  return {cpu.ok() ? *std::move(cpu) : nullptr, cuda.ok() ? *std::move(cuda) : nullptr};
}

// bf16 at GEMM inputs and in the state: logits agree to ~1e-2 relative (a float32-only error
// would be ~1e-6; a wrong kernel gives O(1)).
constexpr double kLogitTolerance = 3e-2;
// tiny addresses 8 of 64 slots per head: a near-tie in the top-k that bf16 rounding flips moves
// 1/8 of a head's write or read, so isolated positions differ by 5-17% and whole arrays by up
// to ~5% (measured under a CPU emulation of the kernels, round-to-nearest and stochastic
// rounding alike). Still far below the O(1) of a wrong kernel.
constexpr double kTinyLogitTolerance = 8e-2;

class CudaVsCpuTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaVsCpuTest, PrefillThenBatchedDecodeMatchCpu) {
  SKIP_WITHOUT_DEVICE();
  Engines e = MakeEngines(GetParam(), /*prefill_chunk=*/16);
  ASSERT_NE(e.cuda, nullptr);
  EXPECT_EQ(e.cuda->device(), EngineDevice::kCuda);
  const double tolerance = GetParam() == "tiny" ? kTinyLogitTolerance : kLogitTolerance;
  const int64_t vocab = e.cpu->vocab_size();
  constexpr int kSessions = 3;
  std::vector<std::unique_ptr<SessionState>> cpu_s, gpu_s;
  for (int i = 0; i < kSessions; ++i) {
    cpu_s.push_back(e.cpu->NewSession());
    gpu_s.push_back(e.cuda->NewSession());
    // Different lengths: several prefill chunks, one partial.
    const std::vector<int32_t> prompt = RandomTokens(20 + 13 * i, vocab, 100 + i);
    std::vector<float> lc, lg;
    ASSERT_TRUE(e.cpu->Prefill(*cpu_s[i], prompt, /*all_positions=*/true, &lc).ok());
    absl::Status st = e.cuda->Prefill(*gpu_s[i], prompt, /*all_positions=*/true, &lg);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_LT(RelativeError(lg, lc), tolerance) << "prefill, session " << i;
  }
  std::vector<SessionState*> cpu_ptr, gpu_ptr;
  for (int i = 0; i < kSessions; ++i) {
    cpu_ptr.push_back(cpu_s[i].get());
    gpu_ptr.push_back(gpu_s[i].get());
  }
  for (int step = 0; step < 6; ++step) {
    const std::vector<int32_t> tokens = RandomTokens(kSessions, vocab, 500 + step);
    std::vector<float> lc(kSessions * vocab), lg(kSessions * vocab);
    ASSERT_TRUE(e.cpu->Decode(cpu_ptr, tokens, lc).ok());
    absl::Status st = e.cuda->Decode(gpu_ptr, tokens, lg);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_LT(RelativeError(lg, lc), tolerance) << "decode step " << step;
    for (int i = 0; i < kSessions; ++i) EXPECT_EQ(gpu_s[i]->position(), cpu_s[i]->position());
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, CudaVsCpuTest,
                         ::testing::Values("tiny", "debug_sdm", "debug_hybrid"));

// Parking moves the device state to the host (bf16 -> fp32, exact) and the next step uploads it
// again (fp32 -> bf16, exact for those values): the continuation is bit-identical.
TEST(CudaEngineTest, ResumeAfterOffloadIsBitIdentical) {
  SKIP_WITHOUT_DEVICE();
  for (const std::string preset : {"tiny", "debug_hybrid"}) {
    Engines e = MakeEngines(preset, 16);
    ASSERT_NE(e.cuda, nullptr);
    const int64_t vocab = e.cuda->vocab_size();
    auto parked = e.cuda->NewSession();
    auto stayed = e.cuda->NewSession();
    const std::vector<int32_t> prompt = RandomTokens(70, vocab, 9);
    ASSERT_TRUE(e.cuda->Prefill(*parked, prompt, false, nullptr).ok());
    ASSERT_TRUE(e.cuda->Prefill(*stayed, prompt, false, nullptr).ok());
    ASSERT_TRUE(parked->on_device());
    for (int step = 0; step < 8; ++step) {
      if (step % 3 == 1) {
        ASSERT_TRUE(parked->SyncToHost().ok());
        ASSERT_FALSE(parked->on_device());
      }
      const int32_t token = RandomTokens(1, vocab, 40 + step)[0];
      std::vector<float> a(vocab), b(vocab);
      SessionState* pa = parked.get();
      SessionState* pb = stayed.get();
      ASSERT_TRUE(e.cuda
                      ->Decode(std::span<SessionState* const>(&pa, 1),
                               std::span<const int32_t>(&token, 1), a)
                      .ok());
      ASSERT_TRUE(e.cuda
                      ->Decode(std::span<SessionState* const>(&pb, 1),
                               std::span<const int32_t>(&token, 1), b)
                      .ok());
      EXPECT_EQ(a, b) << preset << ", step " << step;
    }
  }
}

// A session synced to the host holds what the device computed: the CPU engine continues it
// within bf16 tolerance of the device's own continuation.
TEST(CudaEngineTest, HostCopyContinuesOnTheCpu) {
  SKIP_WITHOUT_DEVICE();
  Engines e = MakeEngines("debug_hybrid", 16);
  ASSERT_NE(e.cuda, nullptr);
  const int64_t vocab = e.cuda->vocab_size();
  auto s = e.cuda->NewSession();
  ASSERT_TRUE(e.cuda->Prefill(*s, RandomTokens(50, vocab, 3), false, nullptr).ok());
  ASSERT_TRUE(s->SyncToHost().ok());
  auto copy = s->Clone();
  const std::vector<int32_t> next = RandomTokens(5, vocab, 4);
  std::vector<float> on_gpu, on_cpu;
  ASSERT_TRUE(e.cuda->Prefill(*s, next, true, &on_gpu).ok());
  ASSERT_TRUE(e.cpu->Prefill(*copy, next, true, &on_cpu).ok());
  EXPECT_LT(RelativeError(on_gpu, on_cpu), kLogitTolerance);
}

TEST(CudaEngineTest, FullDeviceStateIsResourceExhausted) {
  SKIP_WITHOUT_DEVICE();
  absl::StatusOr<ModelConfig> c = PresetConfig("debug_sdm");
  ASSERT_TRUE(c.ok());
  EngineOptions o;
  o.device = EngineDevice::kCuda;
  o.max_context = 1024;
  // One session of debug_sdm needs 32 MiB of SDM rows (4 layers x 4096 slots x 2 KiB) plus
  // 16 MiB of KV at max_context: room for about 1.3 such sessions.
  o.device_state_bytes = int64_t{64} << 20;
  {
    EngineOptions tiny = o;
    tiny.device_state_bytes = int64_t{1} << 20;
    auto none = Engine::Create(Bf16Model(*c, 1), tiny);
    ASSERT_FALSE(none.ok());
    EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted) << none.status();
  }
  auto e = Engine::Create(Bf16Model(*c, 1), o);
  ASSERT_TRUE(e.ok()) << e.status();
  std::vector<std::unique_ptr<SessionState>> sessions;
  absl::Status last;
  for (int i = 0; i < 64 && last.ok(); ++i) {
    sessions.push_back((*e)->NewSession());
    last = (*e)->Prefill(*sessions.back(), RandomTokens(64, (*e)->vocab_size(), i), false, nullptr);
  }
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted) << last;
}

// A step that ran out of KV pages part-way (and of rows) succeeds once other sessions free
// theirs: no half-recorded pages, no stale free-row bound. Sized for two sessions of
// max_context; a long single-chunk prefill must fit without reserving more rows than a session
// can own.
TEST(CudaEngineTest, StepSucceedsAfterExhaustionOnceMemoryIsFreed) {
  SKIP_WITHOUT_DEVICE();
  absl::StatusOr<ModelConfig> c = PresetConfig("tiny");
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(ApplyConfigOverrides(*c, {"swa_at=[]", "attn_at=[0,1,2]"}).ok());
  std::shared_ptr<const Model> model = Bf16Model(*c, 7);
  EngineOptions o;
  auto cpu = Engine::Create(model, o);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  o.device = EngineDevice::kCuda;
  o.max_context = 256;  // 4 pages of 64 positions per layer and session
  // Per session: SDM rows (2 heads x 64 slots x 32 bf16) + 3 layers x 4 pages of 8 KiB.
  o.device_state_bytes = 2 * (8192 + 3 * 4 * 8192);
  auto gpu = Engine::Create(model, o);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const int64_t vocab = (*gpu)->vocab_size();
  auto a = (*gpu)->NewSession();
  auto b = (*gpu)->NewSession();
  auto s = (*gpu)->NewSession();
  absl::Status st = (*gpu)->Prefill(*a, RandomTokens(200, vocab, 1), false, nullptr);
  ASSERT_TRUE(st.ok()) << st;  // 4 pages per layer, every slot
  st = (*gpu)->Prefill(*b, RandomTokens(100, vocab, 2), false, nullptr);
  ASSERT_TRUE(st.ok()) << st;  // 2 pages per layer
  const std::vector<int32_t> prompt = RandomTokens(200, vocab, 3);
  std::vector<float> on_gpu, on_cpu;
  st = (*gpu)->Prefill(*s, prompt, false, &on_gpu);  // needs 4 pages, 2 are left
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  a.reset();  // what the store does when it parks or deletes a session
  st = (*gpu)->Prefill(*s, prompt, false, &on_gpu);
  ASSERT_TRUE(st.ok()) << st;
  auto reference = (*cpu)->NewSession();
  ASSERT_TRUE((*cpu)->Prefill(*reference, prompt, false, &on_cpu).ok());
  EXPECT_LT(RelativeError(on_gpu, on_cpu), kTinyLogitTolerance);
}

// A launch failing part-way through a pass (engine/engine_backend.h, ForwardCommit; injected
// through EngineOptions::inject_forward_fault after the pass's first write to session state):
// the stream is synchronised, the pass's sessions are marked failed with a clear status and
// refused from then on, their positions unchanged; destroying them returns their memory, and
// the engine then steps new sessions bit for bit like an engine that never failed.
TEST(CudaEngineTest, AFaultPartWayThroughAPassMarksItsSessionsFailed) {
  SKIP_WITHOUT_DEVICE();
  absl::StatusOr<ModelConfig> c = PresetConfig("debug_hybrid");
  ASSERT_TRUE(c.ok());
  std::shared_ptr<const Model> model = Bf16Model(*c, 7);
  EngineOptions o;
  o.device = EngineDevice::kCuda;
  o.device_state_bytes = int64_t{1} << 30;
  o.max_context = 1024;
  o.prefill_chunk = 16;
  auto reference = Engine::Create(model, o);
  ASSERT_TRUE(reference.ok()) << reference.status();
  o.inject_forward_fault = 3;  // the third launch after the first state write
  auto faulty = Engine::Create(model, o);
  ASSERT_TRUE(faulty.ok()) << faulty.status();
  const int64_t vocab = (*faulty)->vocab_size();

  auto a = (*faulty)->NewSession(), b = (*faulty)->NewSession();
  const std::vector<int32_t> ta = RandomTokens(5, vocab, 21), tb = RandomTokens(7, vocab, 22);
  StepBatch batch;
  batch.Add(*a, ta, StepLogits::kLast);
  batch.Add(*b, tb, StepLogits::kLast);
  std::vector<float> logits(batch.LogitRows() * vocab);
  const absl::Status failed = (*faulty)->Step(batch, logits);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal) << failed;
  EXPECT_NE(failed.message().find("injected fault"), std::string::npos) << failed;
  EXPECT_NE(failed.message().find("2 session(s) are marked failed"), std::string::npos) << failed;
  EXPECT_TRUE(a->failed());
  EXPECT_TRUE(b->failed());
  EXPECT_EQ(a->position(), 0);
  EXPECT_EQ(b->position(), 0);
  const absl::Status refused = (*faulty)->Prefill(*a, ta, false, nullptr);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  a.reset();  // what the store's Delete does: the residency returns its rows and pages
  b.reset();

  const std::vector<int32_t> prompt = RandomTokens(40, vocab, 23);
  auto fresh = (*faulty)->NewSession(), ref = (*reference)->NewSession();
  std::vector<float> got, want;
  ASSERT_TRUE((*faulty)->Prefill(*fresh, prompt, false, &got).ok());
  ASSERT_TRUE((*reference)->Prefill(*ref, prompt, false, &want).ok());
  EXPECT_EQ(got, want);
  for (int step = 0; step < 4; ++step) {
    const int32_t token = RandomTokens(1, vocab, 60 + step)[0];
    std::vector<float> x(vocab), y(vocab);
    SessionState* pf = fresh.get();
    SessionState* pr = ref.get();
    ASSERT_TRUE((*faulty)->Decode({&pf, 1}, {&token, 1}, x).ok());
    ASSERT_TRUE((*reference)->Decode({&pr, 1}, {&token, 1}, y).ok());
    EXPECT_EQ(x, y) << "step " << step;
  }
}

#endif  // SDM_HAVE_CUDA

}  // namespace
}  // namespace sdm
