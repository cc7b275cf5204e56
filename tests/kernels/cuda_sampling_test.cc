// The CUDA sampler (kernels/cuda/sampling.h) against the CPU sampler (engine/sampler.h): the same
// token, exactly, for every row, since the server may sample on either side. Rows cover random
// logits, heavy ties, -0/+0, NaN, +inf and -inf, all-NaN and all--inf rows, huge magnitudes and
// greedy / temperature / top_k / top_p combinations, at vocabularies 258 (bytes tokenizer), 32000
// and 128000 (SentencePiece; several shared-memory sort tiles), plus 1 and a non-power of two.
// Skips without a device (and on builds without CUDA).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_runtime_info.h"
#if defined(SDM_HAVE_CUDA)
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/sampling.h"
#endif

namespace sdm::kernels::cuda {
namespace {

#if defined(SDM_HAVE_CUDA)

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int kLogitKinds = 11;

// One row of logits of the given kind (see the file comment).
std::vector<float> MakeLogits(int64_t vocab, int kind, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> l(vocab);
  for (int64_t i = 0; i < vocab; ++i) {
    const uint64_t r = rng();
    switch (kind) {
      case 0:
        l[i] = normal(rng);
        break;
      case 1:
        l[i] = static_cast<float>(static_cast<int>(r % 7) - 3) * 0.5f;
        break;  // ties
      case 2:
        l[i] = r % 10 == 0 ? kNan : normal(rng);
        break;
      case 3:
        l[i] = r % 10 == 0 ? kNan : r % 97 == 1 ? kInf : normal(rng);
        break;
      case 4:
        l[i] = r % 2 == 0 ? -kInf : normal(rng);
        break;
      case 5:
        l[i] = r % 2 == 0 ? 0.0f : -0.0f;
        break;  // all equal
      case 6:
        l[i] = kNan;
        break;
      case 7:
        l[i] = r % 3 == 0 ? kNan : -kInf;
        break;
      case 8:
        l[i] = normal(rng) * 0.02f;
        break;  // nearly flat
      case 9:
        l[i] = (r % 2 ? 1e30f : -1e30f) * static_cast<float>(r % 5);
        break;
      default:
        l[i] = normal(rng) * 0.3f + (r % 50 == 0 ? 12.0f : 0.0f);
        break;
    }
  }
  if (kind == 3 && vocab > 2) l[vocab / 2] = kInf;  // at least one +inf
  return l;
}

SamplingParams MakeParams(int64_t vocab, std::mt19937_64& rng) {
  const double temperatures[] = {0.0, 1e-30, 0.05, 0.7, 1.0, 3.0, 100.0};
  const int64_t top_ks[] = {0, 0, 0, 1, 2, 5, 50, vocab - 1, vocab, vocab + 7};
  const double top_ps[] = {1.0, 1.0, 1.0, 1e-9, 0.0, 0.3, 0.5, 0.9, 0.999};
  SamplingParams p;
  p.temperature = temperatures[rng() % std::size(temperatures)];
  p.top_k = static_cast<int>(std::max<int64_t>(0, top_ks[rng() % std::size(top_ks)]));
  p.top_p = top_ps[rng() % std::size(top_ps)];
  p.seed = rng();
  return p;
}

std::string Describe(int kind, const SamplingParams& p, uint64_t draw) {
  return "kind " + std::to_string(kind) + " temperature " + std::to_string(p.temperature) +
         " top_k " + std::to_string(p.top_k) + " top_p " + std::to_string(p.top_p) + " seed " +
         std::to_string(p.seed) + " draw " + std::to_string(draw);
}

// Samples every row on the device (on its own stream) and compares it with SampleToken.
void ExpectDeviceMatchesCpu(int64_t vocab, int64_t batch, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "vocab " << vocab << " batch " << batch << " seed " << seed);
  std::mt19937_64 rng(seed);
  std::vector<float> logits;
  logits.reserve(batch * vocab);
  std::vector<int> kinds(batch);
  std::vector<SamplingParams> params(batch);
  std::vector<RowSampling> rows(batch);
  std::vector<uint64_t> draws(batch);
  for (int64_t b = 0; b < batch; ++b) {
    kinds[b] = static_cast<int>(b % kLogitKinds);
    const std::vector<float> row = MakeLogits(vocab, kinds[b], rng);
    logits.insert(logits.end(), row.begin(), row.end());
    params[b] = MakeParams(vocab, rng);
    draws[b] = rng() % 4 == 0 ? rng() : rng() % 1000;
    rows[b] = RowSampling{params[b].temperature, params[b].top_k, params[b].top_p, params[b].seed,
                          draws[b]};
  }

  CudaStream stream;
  ASSERT_EQ(stream.Create(), cudaSuccess);
  DeviceBuffer<float> d_logits(logits.size());
  DeviceBuffer<RowSampling> d_rows(rows.size());
  DeviceBuffer<unsigned char> d_scratch(SampleTokensScratchBytes(batch, vocab));
  DeviceBuffer<int32_t> d_tokens(batch);
  ASSERT_TRUE(d_logits.ok() && d_rows.ok() && d_scratch.ok() && d_tokens.ok());
  ASSERT_EQ(cudaMemcpy(d_logits.get(), logits.data(), d_logits.bytes(), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_rows.get(), rows.data(), d_rows.bytes(), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemset(d_tokens.get(), 0xff, d_tokens.bytes()), cudaSuccess);  // -1: unwritten
  const cudaError_t launched = SampleTokens(d_logits.get(), batch, vocab, d_rows.get(),
                                            d_scratch.get(), d_tokens.get(), stream.get());
  ASSERT_EQ(launched, cudaSuccess) << CudaErrorText(launched);
  const cudaError_t done = cudaStreamSynchronize(stream.get());
  ASSERT_EQ(done, cudaSuccess) << CudaErrorText(done);
  std::vector<int32_t> tokens(batch);
  ASSERT_EQ(cudaMemcpy(tokens.data(), d_tokens.get(), d_tokens.bytes(), cudaMemcpyDeviceToHost),
            cudaSuccess);

  int mismatches = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const std::span<const float> row(&logits[b * vocab], vocab);
    const int32_t want = SampleToken(row, params[b], draws[b]);
    if (tokens[b] != want && ++mismatches <= 10) {
      ADD_FAILURE() << "row " << b << ": device " << tokens[b] << ", cpu " << want << " ("
                    << Describe(kinds[b], params[b], draws[b]) << ")";
    }
  }
  EXPECT_EQ(mismatches, 0);
}

uint64_t FreshSeed() {
  const uint64_t seed = std::random_device{}();
  std::printf("fresh seed %llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

#endif  // SDM_HAVE_CUDA

class CudaSamplingTest : public testing::Test {
 protected:
  void SetUp() override {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device (" << DescribeDevice() << ")";
  }
};

TEST_F(CudaSamplingTest, BytesVocabularyMatchesCpu) {
#if defined(SDM_HAVE_CUDA)
  // More rows than the kernel has blocks, so blocks loop over rows and reuse their scratch.
  ExpectDeviceMatchesCpu(258, 3000, 1);
  ExpectDeviceMatchesCpu(258, 1000, FreshSeed());
#endif
}

TEST_F(CudaSamplingTest, SentencePieceVocabulariesMatchCpu) {
#if defined(SDM_HAVE_CUDA)
  ExpectDeviceMatchesCpu(32000, 400, 2);
  ExpectDeviceMatchesCpu(32000, 200, FreshSeed());
  ExpectDeviceMatchesCpu(128000, 40, 3);
#endif
}

TEST_F(CudaSamplingTest, OddVocabulariesMatchCpu) {
#if defined(SDM_HAVE_CUDA)
  ExpectDeviceMatchesCpu(1, 50, 4);
  ExpectDeviceMatchesCpu(2, 100, 5);
  ExpectDeviceMatchesCpu(4097, 200, 6);  // just over one sort tile
  ExpectDeviceMatchesCpu(1000, 300, FreshSeed());
#endif
}

TEST_F(CudaSamplingTest, UniformRowsHitExactCdfBoundaries) {
#if defined(SDM_HAVE_CUDA)
  // Equal logits: every weight is exactly 1 and every cumulative mass an integer, so u * total
  // often lands exactly on a boundary and top_p * total on a cumulative value; the comparison
  // rules (strict for the draw, >= for the nucleus) must agree to the bit.
  for (const int64_t vocab : {258, 32000}) {
    const int64_t batch = 512;
    std::vector<float> logits(batch * vocab, 1.5f);
    std::vector<SamplingParams> params(batch);
    std::vector<RowSampling> rows(batch);
    for (int64_t b = 0; b < batch; ++b) {
      params[b].temperature = 1.0;
      params[b].top_k = static_cast<int>(b % 3 == 0 ? 0 : b % 3 == 1 ? 4 : vocab / 2);
      params[b].top_p = b % 4 == 0 ? 1.0 : 0.25 * static_cast<double>(b % 4);
      params[b].seed = 9;
      rows[b] = RowSampling{1.0, params[b].top_k, params[b].top_p, 9, static_cast<uint64_t>(b)};
    }
    DeviceBuffer<float> d_logits(logits.size());
    DeviceBuffer<RowSampling> d_rows(batch);
    DeviceBuffer<unsigned char> d_scratch(SampleTokensScratchBytes(batch, vocab));
    DeviceBuffer<int32_t> d_tokens(batch);
    ASSERT_TRUE(d_logits.ok() && d_rows.ok() && d_scratch.ok() && d_tokens.ok());
    ASSERT_EQ(cudaMemcpy(d_logits.get(), logits.data(), d_logits.bytes(), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_rows.get(), rows.data(), d_rows.bytes(), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(SampleTokens(d_logits.get(), batch, vocab, d_rows.get(), d_scratch.get(),
                           d_tokens.get(), nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<int32_t> tokens(batch);
    ASSERT_EQ(cudaMemcpy(tokens.data(), d_tokens.get(), d_tokens.bytes(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int64_t b = 0; b < batch; ++b) {
      ASSERT_EQ(tokens[b], SampleToken(std::span<const float>(&logits[b * vocab], vocab), params[b],
                                       static_cast<uint64_t>(b)))
          << "vocab " << vocab << " row " << b;
    }
  }
#endif
}

#if defined(SDM_HAVE_CUDA)
TEST(CudaSamplingArgsTest, ScratchSizeAndArgumentChecksNeedNoDevice) {
  EXPECT_EQ(SampleTokensScratchBytes(0, 258), 0);
  // At least the sort keys (a power of two >= vocab) for every block the kernel runs.
  EXPECT_GE(SampleTokensScratchBytes(1, 258), 512 * 8);
  EXPECT_GE(SampleTokensScratchBytes(4, 32000), 4 * 32768 * 8);
  EXPECT_EQ(SampleTokens(nullptr, 0, 258, nullptr, nullptr, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(SampleTokens(nullptr, 2, 258, nullptr, nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
}
#endif

}  // namespace
}  // namespace sdm::kernels::cuda
