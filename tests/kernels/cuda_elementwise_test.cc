// The CUDA row-wise and elementwise kernels (kernels/cuda/elementwise.h) against their CPU twins
// on random inputs: one fixed seed and one fresh seed per run (printed on failure). Every test
// skips without a device (and on builds without CUDA).
//
// Tolerances. Kernels evaluate the CPU formula in the same operation order, so the remaining
// differences are (a) reduction order: fp32 block trees on the device, double sums on the CPU,
// (b) device transcendentals (expf, powf, sincosf: within 2 ulp; glibc within 1) and (c) fused
// multiply-adds, which nvcc and gcc may each contract differently (1 rounding, 2^-24 relative).
// Each check states its bound. bf16 outputs are compared in bits: the device's bf16 must be the
// round-to-nearest-even of its own fp32 value exactly, and within 1 bf16 ulp (one step of the
// bit pattern) of the CPU value rounded, since a few fp32 ulps can cross a rounding boundary.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/norm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/vector_math.h"
#include "kernels/cuda/cuda_runtime_info.h"
#include "tests/kernels/strided_rows.h"
#if defined(SDM_HAVE_CUDA)
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#endif

namespace sdm::kernels {
namespace {

#if defined(SDM_HAVE_CUDA)
using cuda::bf16;
using cuda::DeviceBuffer;

// Round-to-nearest-even fp32 -> bf16 bits, independent of the CUDA headers (NaN -> quiet NaN).
uint16_t Bf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float Bf16Value(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Distance in bf16 steps between two finite values of the same sign (or zero).
int Bf16Steps(uint16_t a, uint16_t b) {
  // Map sign-magnitude bits onto a monotonic integer line.
  auto line = [](uint16_t x) { return (x & 0x8000) ? -static_cast<int>(x & 0x7fff) : x & 0x7fff; };
  return std::abs(line(a) - line(b));
}

std::vector<uint32_t> Seeds() { return {12345u, std::random_device{}()}; }

template <typename T>
DeviceBuffer<T> Upload(const std::vector<T>& host) {
  DeviceBuffer<T> d(host.size());
  EXPECT_TRUE(d.ok());
  EXPECT_EQ(cudaMemcpy(d.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return d;
}

// bf16 data travels as its bit patterns (uint16_t on the host).
DeviceBuffer<bf16> UploadBf16(const std::vector<uint16_t>& bits) {
  DeviceBuffer<bf16> d(bits.size());
  EXPECT_TRUE(d.ok());
  EXPECT_EQ(cudaMemcpy(d.get(), bits.data(), bits.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

template <typename T>
std::vector<T> Download(const DeviceBuffer<T>& d) {
  std::vector<T> host(d.size());
  EXPECT_EQ(cudaMemcpy(host.data(), d.get(), d.bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

std::vector<uint16_t> DownloadBf16(const DeviceBuffer<bf16>& d) {
  std::vector<uint16_t> host(d.size());
  EXPECT_EQ(cudaMemcpy(host.data(), d.get(), d.bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

std::vector<float> Normal(std::mt19937& rng, size_t n, float mean, float stddev) {
  std::normal_distribution<float> dist(mean, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}
#endif  // SDM_HAVE_CUDA

class CudaElementwiseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0) {
      GTEST_SKIP() << "no CUDA device (" << cuda::DescribeDevice() << ")";
    }
#if defined(SDM_HAVE_CUDA)
    ASSERT_EQ(stream_.Create(), cudaSuccess);
#endif
  }

#if defined(SDM_HAVE_CUDA)
  // Waits for the stream and checks that nothing failed asynchronously.
  void Sync() { ASSERT_EQ(cudaStreamSynchronize(stream_.get()), cudaSuccess); }
  cudaStream_t stream() const { return stream_.get(); }

 private:
  cuda::CudaStream stream_;
#endif
};

#if defined(SDM_HAVE_CUDA)

// A bf16 table [vocab, dim] of normal values and n tokens drawn from it, the first of them the
// last row (so that it is reachable).
void RandomEmbedding(std::mt19937& rng, int64_t vocab, int64_t dim, int64_t n,
                     std::vector<uint16_t>& table, std::vector<int32_t>& tokens) {
  table.resize(vocab * dim);
  for (uint16_t& b : table) b = Bf16Bits(Normal(rng, 1, 0.0f, 1.0f)[0]);
  tokens.resize(n);
  std::uniform_int_distribution<int32_t> tok(0, vocab - 1);
  for (int32_t& t : tokens) t = tok(rng);
  tokens[0] = vocab - 1;
}

TEST_F(CudaElementwiseTest, EmbeddingLookupCopiesRowsExactly) {
  for (const uint32_t seed : Seeds()) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    const int64_t vocab = 50;
    for (const int64_t dim : {64, 13}) {  // 16-byte vector path, scalar path
      SCOPED_TRACE(testing::Message() << "dim " << dim);
      const int64_t n = 37;
      std::vector<uint16_t> table;
      std::vector<int32_t> tokens;
      RandomEmbedding(rng, vocab, dim, n, table, tokens);
      auto d_table = UploadBf16(table);
      auto d_tokens = Upload(tokens);
      DeviceBuffer<float> d_out(n * dim);
      ASSERT_EQ(cuda::EmbeddingLookup(d_table.get(), d_tokens.get(), n, dim, d_out.get(), stream()),
                cudaSuccess);
      Sync();
      const std::vector<float> out = Download(d_out);
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t c = 0; c < dim; ++c) {
          ASSERT_EQ(out[r * dim + c], Bf16Value(table[tokens[r] * dim + c])) << r << "," << c;
        }
      }
    }
  }
}

// Gather then scatter of equal blocks (a session's KV pages and SDM rows when it parks and
// resumes): every element of every named block lands exactly, the blocks not named stay as they
// were, and block sizes cover the 16-byte vector path, the scalar path, and blocks far larger than
// a thread block (a KV page is up to hundreds of KB).
TEST_F(CudaElementwiseTest, GatherAndScatterBlocksMoveExactlyTheNamedBlocks) {
  for (const uint32_t seed : Seeds()) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    for (const int64_t block_elems : {int64_t{8}, int64_t{13}, int64_t{1024}, int64_t{40000}}) {
      SCOPED_TRACE(testing::Message() << "block_elems " << block_elems);
      const int64_t n_blocks = 29;
      std::vector<uint16_t> blocks(n_blocks * block_elems);
      for (uint16_t& b : blocks) b = static_cast<uint16_t>(rng());
      // A random subset in random order, the last block among them.
      std::vector<int32_t> ids(n_blocks);
      for (int32_t i = 0; i < n_blocks; ++i) ids[i] = i;
      std::shuffle(ids.begin(), ids.end(), rng);
      ids.resize(11);
      if (std::find(ids.begin(), ids.end(), n_blocks - 1) == ids.end()) ids[0] = n_blocks - 1;
      const int64_t count = static_cast<int64_t>(ids.size());
      auto d_blocks = UploadBf16(blocks);
      auto d_ids = Upload(ids);
      DeviceBuffer<bf16> d_packed(count * block_elems);
      ASSERT_EQ(cudaMemset(d_packed.get(), 0xff, d_packed.bytes()), cudaSuccess);
      ASSERT_EQ(cuda::GatherBlocks(d_blocks.get(), block_elems, d_ids.get(), count, d_packed.get(),
                                   stream()),
                cudaSuccess);
      Sync();
      const std::vector<uint16_t> packed = DownloadBf16(d_packed);
      for (int64_t i = 0; i < count; ++i) {
        ASSERT_EQ(0, std::memcmp(&packed[i * block_elems], &blocks[ids[i] * block_elems],
                                 block_elems * 2))
            << "gathered block " << i << " (id " << ids[i] << ")";
      }
      // Scatter fresh contents into the same ids of a poisoned arena.
      std::vector<uint16_t> fresh(count * block_elems);
      for (uint16_t& b : fresh) b = static_cast<uint16_t>(rng());
      auto d_fresh = UploadBf16(fresh);
      ASSERT_EQ(cudaMemset(d_blocks.get(), 0xa5, d_blocks.bytes()), cudaSuccess);
      ASSERT_EQ(cuda::ScatterBlocks(d_fresh.get(), block_elems, d_ids.get(), count, d_blocks.get(),
                                    stream()),
                cudaSuccess);
      Sync();
      const std::vector<uint16_t> arena = DownloadBf16(d_blocks);
      std::vector<int64_t> source(n_blocks, -1);
      for (int64_t i = 0; i < count; ++i) source[ids[i]] = i;
      for (int64_t b = 0; b < n_blocks; ++b) {
        for (int64_t c = 0; c < block_elems; ++c) {
          const uint16_t want = source[b] >= 0 ? fresh[source[b] * block_elems + c] : 0xa5a5;
          ASSERT_EQ(arena[b * block_elems + c], want) << "block " << b << ", element " << c;
        }
      }
    }
  }
}

TEST_F(CudaElementwiseTest, RmsNormMatchesCpu) {
  for (const uint32_t seed : Seeds()) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    for (const int64_t n : {2048, 37}) {  // vector path, scalar path
      SCOPED_TRACE(testing::Message() << "n " << n);
      const int64_t rows = 5;
      const std::vector<float> x = Normal(rng, rows * n, 0.3f, 2.0f);
      const std::vector<float> w = Normal(rng, n, 1.0f, 0.2f);
      std::vector<float> want(rows * n);
      cpu::RmsNorm(x.data(), w.data(), rows, n, 1e-5f, want.data());

      auto d_x = Upload(x);
      auto d_w = Upload(w);
      DeviceBuffer<float> d_out(rows * n);
      DeviceBuffer<bf16> d_bf(rows * n), d_bf_only(rows * n);
      ASSERT_EQ(
          cuda::RmsNorm(d_x.get(), d_w.get(), rows, n, 1e-5f, d_out.get(), d_bf.get(), stream()),
          cudaSuccess);
      ASSERT_EQ(
          cuda::RmsNorm(d_x.get(), d_w.get(), rows, n, 1e-5f, nullptr, d_bf_only.get(), stream()),
          cudaSuccess);
      // In place (out_f32 aliases x), as the CPU twin allows.
      ASSERT_EQ(cuda::RmsNorm(d_x.get(), d_w.get(), rows, n, 1e-5f, d_x.get(), nullptr, stream()),
                cudaSuccess);
      Sync();
      const std::vector<float> got = Download(d_out);
      const std::vector<float> in_place = Download(d_x);
      const std::vector<uint16_t> bf = DownloadBf16(d_bf), bf_only = DownloadBf16(d_bf_only);
      for (int64_t i = 0; i < rows * n; ++i) {
        // out = x * inv * w: all of the difference is in the common factor inv (fp32 tree vs
        // double sum of n squares: ~sqrt(n) * 2^-24 relative, < 1e-5 for these n) plus the two
        // multiplications' roundings. So the bound is relative, element by element.
        ASSERT_NEAR(got[i], want[i], 1e-5f * std::fabs(want[i])) << i;
        ASSERT_EQ(in_place[i], got[i]) << i;
        ASSERT_EQ(bf[i], Bf16Bits(got[i])) << i;
        ASSERT_EQ(bf_only[i], bf[i]) << i;
        ASSERT_LE(Bf16Steps(bf[i], Bf16Bits(want[i])), 1) << i;
      }
    }
  }
}

TEST_F(CudaElementwiseTest, LayerNormMatchesCpu) {
  for (const uint32_t seed : Seeds()) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    for (const int64_t n : {1024, 32, 37}) {
      SCOPED_TRACE(testing::Message() << "n " << n);
      const int64_t rows = 6;
      const std::vector<float> x = Normal(rng, rows * n, 0.5f, 2.0f);
      const std::vector<float> w = Normal(rng, n, 1.0f, 0.2f);
      const std::vector<float> b = Normal(rng, n, 0.0f, 0.5f);
      const std::vector<float> ones(n, 1.0f), zeros(n, 0.0f);
      std::vector<float> want = x, want_plain = x;
      cpu::LayerNorm(want.data(), w.data(), b.data(), rows, n, 1e-6f);
      cpu::LayerNorm(want_plain.data(), ones.data(), zeros.data(), rows, n, 1e-6f);

      auto d_x = Upload(x);
      auto d_plain = Upload(x);
      auto d_w = Upload(w);
      auto d_b = Upload(b);
      ASSERT_EQ(cuda::LayerNorm(d_x.get(), d_w.get(), d_b.get(), rows, n, 1e-6f, stream()),
                cudaSuccess);
      ASSERT_EQ(cuda::LayerNorm(d_plain.get(), nullptr, nullptr, rows, n, 1e-6f, stream()),
                cudaSuccess);
      Sync();
      const std::vector<float> got = Download(d_x), got_plain = Download(d_plain);
      for (int64_t i = 0; i < rows * n; ++i) {
        // Normalised values are O(1); the fp32 mean and variance carry ~1e-7 and ~1e-6 relative
        // error (mean shifts every value alike, variance scales it), hence 1e-5 * (1 + |want|).
        ASSERT_NEAR(got[i], want[i], 1e-5f * (1.0f + std::fabs(want[i]))) << i;
        ASSERT_NEAR(got_plain[i], want_plain[i], 1e-5f * (1.0f + std::fabs(want_plain[i]))) << i;
      }
    }
  }
}

TEST_F(CudaElementwiseTest, BatchNormEvalMatchesCpu) {
  for (const uint32_t seed : Seeds()) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    // Enough elements that several hundred are contraction-sensitive (a fused and an unfused
    // final multiply-add round differently): an exact comparison then tells the two apart.
    const int64_t rows = 64, n = 97;
    const std::vector<float> x = Normal(rng, rows * n, 0.0f, 3.0f);
    const std::vector<float> w = Normal(rng, n, 1.0f, 0.3f);
    const std::vector<float> b = Normal(rng, n, 0.0f, 0.5f);
    const std::vector<float> mean = Normal(rng, n, 0.0f, 1.0f);
    std::vector<float> var = Normal(rng, n, 0.0f, 1.0f);
    for (float& v : var) v = v * v + 0.1f;
    std::vector<float> want = x;
    cpu::BatchNormEval(want.data(), w.data(), b.data(), mean.data(), var.data(), rows, n, 1e-5f);
    auto d_x = Upload(x);
    auto d_w = Upload(w);
    auto d_b = Upload(b);
    auto d_m = Upload(mean);
    auto d_v = Upload(var);
    ASSERT_EQ(cuda::BatchNormEval(d_x.get(), d_w.get(), d_b.get(), d_m.get(), d_v.get(), rows, n,
                                  1e-5f, stream()),
              cudaSuccess);
    Sync();
    const std::vector<float> got = Download(d_x);
    for (int64_t i = 0; i < rows * n; ++i) {
      // Bit for bit: both kernels call BatchNormEvalValue (kernels/common/fp_math.h), explicit
      // rounding on the device, no contraction left to either compiler. The product-key
      // selection that follows must see the same scores on both backends.
      ASSERT_EQ(got[i], want[i]) << i;
    }
  }
}

TEST_F(CudaElementwiseTest, ApplyRopeMatchesCpu) {
  struct Case {
    int64_t n_heads, head_dim;
    float theta;
    int32_t max_pos;
    float tol;  // relative to |x0| + |x1| of the pair
  };
  // Frequencies come from the host (bit-identical to the CPU's), so angles agree exactly and
  // only sincosf (2 ulp) vs glibc (1 ulp) differs: 3 ulp of a value <= 1 times |x0| + |x1|,
  // plus the rotation's roundings. head_dim 7 is odd (last dim untouched, scalar path).
  // head_dim 2048 exceeds the host table (device powf, within 2 ulp), so there each ulp of
  // frequency costs pos ulps of angle: positions stay small and the bound is looser.
  const Case cases[] = {{4, 64, 10000.0f, 200000, 2e-6f},
                        {3, 6, 500000.0f, 100000, 2e-6f},
                        {2, 7, 10000.0f, 1000, 2e-6f},
                        {1, 2048, 10000.0f, 40, 2e-5f}};
  for (const uint32_t seed : Seeds()) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    for (const Case& c : cases) {
      SCOPED_TRACE(testing::Message() << "head_dim " << c.head_dim);
      const int64_t rows = 9, width = c.n_heads * c.head_dim;
      const std::vector<float> x = Normal(rng, rows * width, 0.0f, 1.0f);
      std::vector<int32_t> pos(rows);
      std::uniform_int_distribution<int32_t> pd(0, c.max_pos);
      for (int32_t& p : pos) p = pd(rng);
      pos[0] = 0;
      pos[1] = c.max_pos;
      std::vector<float> want = x;
      for (int64_t r = 0; r < rows; ++r) {
        cpu::ApplyRope(&want[r * width], c.n_heads, c.head_dim, pos[r], c.theta);
      }
      auto d_x = Upload(x);
      auto d_pos = Upload(pos);
      ASSERT_EQ(cuda::ApplyRope(d_x.get(), rows, width, c.n_heads, c.head_dim, d_pos.get(), c.theta,
                                stream()),
                cudaSuccess);
      Sync();
      const std::vector<float> got = Download(d_x);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t h = 0; h < c.n_heads; ++h) {
          for (int64_t d = 0; d < c.head_dim; ++d) {
            const int64_t i = r * width + h * c.head_dim + d;
            const int64_t p0 = r * width + h * c.head_dim + (d & ~int64_t{1});
            if (d == c.head_dim - 1 && c.head_dim % 2 == 1) {
              ASSERT_EQ(got[i], x[i]);  // the unpaired last dim of an odd head
              continue;
            }
            const float scale = std::fabs(x[p0]) + std::fabs(x[p0 + 1]);
            ASSERT_NEAR(got[i], want[i], c.tol * scale)
                << "row " << r << " pos " << pos[r] << " head " << h << " dim " << d;
          }
        }
      }
    }
  }
}

// The fused residual add and norm (the backend's per-layer launch) leaves x and writes the
// outputs exactly as AddInPlace followed by RmsNorm, on the vector and the scalar path, and with a
// delta that is not 16-byte aligned (x's path is the norm's, delta read a value at a time).
TEST_F(CudaElementwiseTest, AddRmsNormIsTheAddThenTheNormBitForBit) {
  for (const uint32_t seed : Seeds()) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    for (const auto& [n, delta_offset] :
         {std::pair<int64_t, int64_t>{1024, 0}, {1024, 1}, {37, 0}}) {
      SCOPED_TRACE(testing::Message() << "n " << n << " delta offset " << delta_offset);
      const int64_t rows = 3;
      const std::vector<float> x = Normal(rng, rows * n, 0.1f, 1.5f);
      const std::vector<float> delta = Normal(rng, rows * n, -0.2f, 0.7f);
      const std::vector<float> w = Normal(rng, n, 1.0f, 0.2f);
      std::vector<float> padded(delta_offset, 0.0f);
      padded.insert(padded.end(), delta.begin(), delta.end());
      auto d_padded = Upload(padded);
      const float* d_delta = d_padded.get() + delta_offset;
      auto d_w = Upload(w);
      auto d_x_two = Upload(x);
      auto d_x_fused = Upload(x);
      auto d_x_add_only = Upload(x);
      DeviceBuffer<float> d_out_two(rows * n), d_out_fused(rows * n);
      DeviceBuffer<bf16> d_bf_two(rows * n), d_bf_fused(rows * n);
      ASSERT_EQ(cuda::AddInPlace(d_delta, d_x_two.get(), rows * n, stream()), cudaSuccess);
      ASSERT_EQ(cuda::RmsNorm(d_x_two.get(), d_w.get(), rows, n, 1e-5f, d_out_two.get(),
                              d_bf_two.get(), stream()),
                cudaSuccess);
      ASSERT_EQ(cuda::AddRmsNorm(d_delta, d_x_fused.get(), d_w.get(), rows, n, 1e-5f,
                                 d_out_fused.get(), d_bf_fused.get(), stream()),
                cudaSuccess);
      ASSERT_EQ(cuda::AddRmsNorm(d_delta, d_x_add_only.get(), d_w.get(), rows, n, 1e-5f, nullptr,
                                 nullptr, stream()),
                cudaSuccess);
      Sync();
      std::vector<float> want_x = x;
      cpu::AddInPlace(delta.data(), want_x.data(), rows * n);
      const std::vector<float> x_two = Download(d_x_two), x_fused = Download(d_x_fused);
      const std::vector<float> out_two = Download(d_out_two), out_fused = Download(d_out_fused);
      const std::vector<uint16_t> bf_two = DownloadBf16(d_bf_two);
      const std::vector<uint16_t> bf_fused = DownloadBf16(d_bf_fused);
      const std::vector<float> x_add_only = Download(d_x_add_only);
      for (int64_t i = 0; i < rows * n; ++i) {
        ASSERT_EQ(x_fused[i], want_x[i]) << i;
        ASSERT_EQ(x_two[i], want_x[i]) << i;
        ASSERT_EQ(x_add_only[i], want_x[i]) << i;
        ASSERT_EQ(out_fused[i], out_two[i]) << i;
        ASSERT_EQ(bf_fused[i], bf_two[i]) << i;
      }
    }
  }
}

// The embedding and the first layer's norm in one launch write x and the outputs exactly as
// EmbeddingLookup followed by RmsNorm, on the vector and the scalar path, with out_f32 aliasing x
// as well; with no output it is the lookup alone.
TEST_F(CudaElementwiseTest, EmbeddingRmsNormIsTheLookupThenTheNormBitForBit) {
  for (const uint32_t seed : Seeds()) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    const int64_t vocab = 40;
    // The vector path, the same with a table not 8-byte aligned (x's path is the norm's, the
    // table read a value at a time), the scalar path.
    for (const auto& [n, table_offset] :
         {std::pair<int64_t, int64_t>{1024, 0}, {1024, 1}, {37, 0}}) {
      SCOPED_TRACE(testing::Message() << "n " << n << " table offset " << table_offset);
      const int64_t rows = 5;
      std::vector<uint16_t> table;
      std::vector<int32_t> tokens;
      RandomEmbedding(rng, vocab, n, rows, table, tokens);
      const std::vector<float> w = Normal(rng, n, 1.0f, 0.2f);
      std::vector<uint16_t> padded(table_offset, 0);
      padded.insert(padded.end(), table.begin(), table.end());
      auto d_padded = UploadBf16(padded);
      const bf16* d_table = d_padded.get() + table_offset;
      auto d_tokens = Upload(tokens);
      auto d_w = Upload(w);
      DeviceBuffer<float> d_x_two(rows * n), d_x_fused(rows * n), d_x_lookup(rows * n);
      DeviceBuffer<float> d_x_aliased(rows * n);
      DeviceBuffer<float> d_out_two(rows * n), d_out_fused(rows * n);
      DeviceBuffer<bf16> d_bf_two(rows * n), d_bf_fused(rows * n);
      ASSERT_EQ(cuda::EmbeddingLookup(d_table, d_tokens.get(), rows, n, d_x_two.get(), stream()),
                cudaSuccess);
      ASSERT_EQ(cuda::RmsNorm(d_x_two.get(), d_w.get(), rows, n, 1e-5f, d_out_two.get(),
                              d_bf_two.get(), stream()),
                cudaSuccess);
      ASSERT_EQ(cuda::EmbeddingRmsNorm(d_table, d_tokens.get(), d_x_fused.get(), d_w.get(), rows, n,
                                       1e-5f, d_out_fused.get(), d_bf_fused.get(), stream()),
                cudaSuccess);
      ASSERT_EQ(cuda::EmbeddingRmsNorm(d_table, d_tokens.get(), d_x_lookup.get(), d_w.get(), rows,
                                       n, 1e-5f, nullptr, nullptr, stream()),
                cudaSuccess);
      ASSERT_EQ(cuda::EmbeddingRmsNorm(d_table, d_tokens.get(), d_x_aliased.get(), d_w.get(), rows,
                                       n, 1e-5f, d_x_aliased.get(), nullptr, stream()),
                cudaSuccess);
      Sync();
      const std::vector<float> x_two = Download(d_x_two), x_fused = Download(d_x_fused);
      const std::vector<float> x_lookup = Download(d_x_lookup);
      const std::vector<float> x_aliased = Download(d_x_aliased);
      const std::vector<float> out_two = Download(d_out_two), out_fused = Download(d_out_fused);
      const std::vector<uint16_t> bf_two = DownloadBf16(d_bf_two);
      const std::vector<uint16_t> bf_fused = DownloadBf16(d_bf_fused);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < n; ++c) {
          const int64_t i = r * n + c;
          const float embedded = Bf16Value(table[tokens[r] * n + c]);
          ASSERT_EQ(x_two[i], embedded) << r << "," << c;
          ASSERT_EQ(x_fused[i], embedded) << r << "," << c;
          ASSERT_EQ(x_lookup[i], embedded) << r << "," << c;
          ASSERT_EQ(out_fused[i], out_two[i]) << r << "," << c;
          ASSERT_EQ(x_aliased[i], out_two[i]) << r << "," << c;
          ASSERT_EQ(bf_fused[i], bf_two[i]) << r << "," << c;
        }
      }
    }
  }
}

TEST_F(CudaElementwiseTest, AddInPlaceAndAddBiasAreExact) {
  for (const uint32_t seed : Seeds()) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    const int64_t n = 1003;  // vectors plus a tail
    const std::vector<float> x = Normal(rng, n + 1, 0.0f, 1.0f);
    const std::vector<float> y = Normal(rng, n + 1, 0.0f, 1.0f);
    for (const int64_t offset : {0, 1}) {  // aligned (vector) and misaligned (scalar)
      std::vector<float> want = y;
      cpu::AddInPlace(x.data() + offset, want.data() + offset, n);
      auto d_x = Upload(x);
      auto d_y = Upload(y);
      ASSERT_EQ(cuda::AddInPlace(d_x.get() + offset, d_y.get() + offset, n, stream()), cudaSuccess);
      Sync();
      EXPECT_EQ(Download(d_y), want) << "offset " << offset;
    }
    for (const int64_t cols : {64, 13}) {
      const int64_t rows = 5;
      const std::vector<float> m = Normal(rng, rows * cols, 0.0f, 1.0f);
      const std::vector<float> bias = Normal(rng, cols, 0.0f, 1.0f);
      std::vector<float> want = m;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) want[r * cols + c] += bias[c];
      }
      auto d_m = Upload(m);
      auto d_b = Upload(bias);
      ASSERT_EQ(cuda::AddBias(d_m.get(), d_b.get(), rows, cols, stream()), cudaSuccess);
      Sync();
      EXPECT_EQ(Download(d_m), want) << "cols " << cols;
    }
  }
}

TEST_F(CudaElementwiseTest, SwiGluAndMulSigmoidMatchCpu) {
  for (const uint32_t seed : Seeds()) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    const int64_t n = 1001;
    const std::vector<float> gate = Normal(rng, n + 1, 0.0f, 4.0f);
    const std::vector<float> up = Normal(rng, n + 1, 0.0f, 2.0f);
    for (const int64_t offset : {0, 1}) {
      SCOPED_TRACE(testing::Message() << "offset " << offset);
      std::vector<float> want(n);
      cpu::SwiGlu(gate.data() + offset, up.data() + offset, want.data(), n);
      auto d_g = Upload(gate);
      auto d_u = Upload(up);
      DeviceBuffer<bf16> d_out(n);
      ASSERT_EQ(
          cuda::SwiGlu(d_g.get() + offset, d_u.get() + offset, 1, n, n, d_out.get(), stream()),
          cudaSuccess);
      // MulSigmoid in place on `up`.
      std::vector<float> want_ms(up.begin() + offset, up.begin() + offset + n);
      cpu::MulSigmoid(gate.data() + offset, want_ms.data(), n);
      ASSERT_EQ(cuda::MulSigmoid(d_g.get() + offset, d_u.get() + offset, n, stream()), cudaSuccess);
      Sync();
      const std::vector<uint16_t> got = DownloadBf16(d_out);
      const std::vector<float> got_ms = Download(d_u);
      for (int64_t i = 0; i < n; ++i) {
        // silu through expf (2 ulp) and one division: a few fp32 ulps, so at most one bf16 step
        // after rounding; the bf16 value is within half a bf16 ulp (2^-9 relative) of fp32.
        ASSERT_LE(Bf16Steps(got[i], Bf16Bits(want[i])), 1) << i;
        ASSERT_NEAR(Bf16Value(got[i]), want[i], std::ldexp(std::fabs(want[i]), -8)) << i;
        // sigmoid: expf (2 ulp), 1 + e and 1 / (.) (1 ulp each), the product (1 ulp).
        ASSERT_NEAR(got_ms[offset + i], want_ms[i], 1e-6f * std::fabs(want_ms[i])) << i;
      }
    }
  }
}

// The fused gate and conversion (a gated mixer output into wo's input) gives the bits of
// MulSigmoid then FloatToBf16 and leaves x alone, on the vector path and the scalar one.
TEST_F(CudaElementwiseTest, MulSigmoidToBf16IsTheGateThenTheConversionBitForBit) {
  for (const uint32_t seed : Seeds()) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    const int64_t n = 1003;
    const std::vector<float> gate = Normal(rng, n + 1, 0.0f, 4.0f);
    const std::vector<float> x = Normal(rng, n + 1, 0.0f, 2.0f);
    for (const int64_t offset : {0, 1}) {  // vector path, scalar path
      SCOPED_TRACE(testing::Message() << "offset " << offset);
      auto d_g = Upload(gate);
      auto d_x_two = Upload(x);
      auto d_x_fused = Upload(x);
      DeviceBuffer<bf16> d_two(n), d_fused(n);
      ASSERT_EQ(cuda::MulSigmoid(d_g.get() + offset, d_x_two.get() + offset, n, stream()),
                cudaSuccess);
      ASSERT_EQ(cuda::FloatToBf16(d_x_two.get() + offset, n, d_two.get(), stream()), cudaSuccess);
      ASSERT_EQ(cuda::MulSigmoidToBf16(d_g.get() + offset, n, d_x_fused.get() + offset, 1, n,
                                       d_fused.get(), stream()),
                cudaSuccess);
      Sync();
      const std::vector<uint16_t> two = DownloadBf16(d_two), fused = DownloadBf16(d_fused);
      const std::vector<float> x_after = Download(d_x_fused);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(fused[i], two[i]) << i;
      ASSERT_EQ(x_after, x);
    }
  }
}

// LayerNormToBf16 against LayerNorm then MulSigmoidToBf16 (or FloatToBf16 without a gate): a
// reading of `heads` heads of `n` per row, its gate part of a wider row (stride cols + 4, the
// gaps NaN), affine or not; the bf16 bits equal, x not written. Heads of n = 64, and of n = 37
// (an odd row width: MulSigmoidToBf16 takes its scalar path).
TEST_F(CudaElementwiseTest, LayerNormToBf16IsTheNormThenTheGateBitForBit) {
  for (const uint32_t seed : Seeds()) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    for (const int64_t n : {64, 37}) {
      const int64_t rows = 3, heads = 2, cols = heads * n, stride = cols + 4;
      const std::vector<float> x = Normal(rng, rows * cols, 0.5f, 2.0f);
      const std::vector<float> w = Normal(rng, n, 1.0f, 0.2f);
      const std::vector<float> b = Normal(rng, n, 0.0f, 0.5f);
      const std::vector<float> gate = Normal(rng, rows * cols, 0.0f, 4.0f);
      auto d_w = Upload(w), d_b = Upload(b);
      auto d_gate = Upload(Strided(gate, cols, stride));
      for (const bool affine : {true, false}) {
        for (const bool gated : {true, false}) {
          SCOPED_TRACE(testing::Message()
                       << "n " << n << " affine " << affine << " gated " << gated);
          const float* nw = affine ? d_w.get() : nullptr;
          const float* nb = affine ? d_b.get() : nullptr;
          const float* g = gated ? d_gate.get() : nullptr;
          auto d_two = Upload(x), d_fused = Upload(x);
          DeviceBuffer<bf16> want(rows * cols), got(rows * cols);
          ASSERT_EQ(cuda::LayerNorm(d_two.get(), nw, nb, rows * heads, n, 1e-5f, stream()),
                    cudaSuccess);
          ASSERT_EQ(gated ? cuda::MulSigmoidToBf16(g, stride, d_two.get(), rows, cols, want.get(),
                                                   stream())
                          : cuda::FloatToBf16(d_two.get(), rows * cols, want.get(), stream()),
                    cudaSuccess);
          ASSERT_EQ(cuda::LayerNormToBf16(d_fused.get(), nw, nb, rows * heads, n, 1e-5f, g, cols,
                                          stride, got.get(), stream()),
                    cudaSuccess);
          Sync();
          const std::vector<uint16_t> two = DownloadBf16(want), fused = DownloadBf16(got);
          for (int64_t i = 0; i < rows * cols; ++i) ASSERT_EQ(fused[i], two[i]) << i;
          ASSERT_EQ(Download(d_fused), x);
          ASSERT_NE(Download(d_two), x);  // the norm did change the values compared
        }
      }
    }
  }
  // A gate stride below the gated row's width, or no output, is refused.
  DeviceBuffer<float> buf(64);
  DeviceBuffer<bf16> out(64);
  EXPECT_EQ(cuda::LayerNormToBf16(buf.get(), nullptr, nullptr, 2, 32, 1e-5f, buf.get(), 64, 60,
                                  out.get(), stream()),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LayerNormToBf16(buf.get(), nullptr, nullptr, 2, 32, 1e-5f, nullptr, 0, 0, nullptr,
                                  stream()),
            cudaErrorInvalidValue);
}

// The kernels that read a part of a stacked projection's rows (SwiGlu, MulSigmoidToBf16,
// SdmGates, ApplyRope) give, bit for bit, what they give on the same rows back to back: on the
// vector path (widths and strides multiples of 4) and the scalar one (an odd width or stride);
// reading a gap would put a NaN in the output. ApplyRope leaves the gaps as they were. A stride
// below the width is refused.
TEST_F(CudaElementwiseTest, StridedRowsGiveTheContiguousResultBitForBit) {
  const int64_t rows = 7;
  for (const uint32_t seed : Seeds()) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    for (const int64_t cols : {96, 10}) {
      for (const int64_t pad : {4, 8, 3}) {
        SCOPED_TRACE(testing::Message() << "cols " << cols << " pad " << pad);
        const int64_t stride = cols + pad;
        const std::vector<float> gate = Normal(rng, rows * cols, 0.0f, 4.0f);
        const std::vector<float> up = Normal(rng, rows * cols, 0.0f, 2.0f);
        auto d_gate = Upload(gate), d_up = Upload(up);
        auto d_gate_s = Upload(Strided(gate, cols, stride)),
             d_up_s = Upload(Strided(up, cols, stride));
        DeviceBuffer<bf16> want(rows * cols), got(rows * cols);
        ASSERT_EQ(cuda::SwiGlu(d_gate.get(), d_up.get(), rows, cols, cols, want.get(), stream()),
                  cudaSuccess);
        ASSERT_EQ(
            cuda::SwiGlu(d_gate_s.get(), d_up_s.get(), rows, cols, stride, got.get(), stream()),
            cudaSuccess);
        Sync();
        ASSERT_EQ(DownloadBf16(got), DownloadBf16(want)) << "SwiGlu";
        // The gate strided, x back to back (a mixer's output).
        ASSERT_EQ(cuda::MulSigmoidToBf16(d_gate.get(), cols, d_up.get(), rows, cols, want.get(),
                                         stream()),
                  cudaSuccess);
        ASSERT_EQ(cuda::MulSigmoidToBf16(d_gate_s.get(), stride, d_up.get(), rows, cols, got.get(),
                                         stream()),
                  cudaSuccess);
        Sync();
        ASSERT_EQ(DownloadBf16(got), DownloadBf16(want)) << "MulSigmoidToBf16";
        EXPECT_EQ(cuda::SwiGlu(d_gate.get(), d_up.get(), rows, cols, cols - 1, got.get(), stream()),
                  cudaErrorInvalidValue);
        EXPECT_EQ(cuda::MulSigmoidToBf16(d_gate.get(), cols - 1, d_up.get(), rows, cols, got.get(),
                                         stream()),
                  cudaErrorInvalidValue);
      }
    }
    // SdmGates: a and b [rows, heads] inside wider rows.
    const int64_t heads = 5;
    const std::vector<float> a = Normal(rng, rows * heads, 0.0f, 2.0f);
    const std::vector<float> b = Normal(rng, rows * heads, 0.0f, 2.0f);
    const std::vector<float> a_log = Normal(rng, heads, 0.0f, 1.0f);
    const std::vector<float> dt_bias = Normal(rng, heads, 0.0f, 1.0f);
    auto d_a = Upload(a), d_b = Upload(b), d_log = Upload(a_log), d_dt = Upload(dt_bias);
    DeviceBuffer<float> g_want(rows * heads), beta_want(rows * heads), g_got(rows * heads),
        beta_got(rows * heads);
    ASSERT_EQ(cuda::SdmGates(d_a.get(), d_b.get(), heads, d_log.get(), d_dt.get(), rows, heads,
                             g_want.get(), beta_want.get(), stream()),
              cudaSuccess);
    for (const int64_t pad : {3, 11}) {
      auto d_a_s = Upload(Strided(a, heads, heads + pad));
      auto d_b_s = Upload(Strided(b, heads, heads + pad));
      ASSERT_EQ(cuda::SdmGates(d_a_s.get(), d_b_s.get(), heads + pad, d_log.get(), d_dt.get(), rows,
                               heads, g_got.get(), beta_got.get(), stream()),
                cudaSuccess);
      Sync();
      ASSERT_EQ(Download(g_got), Download(g_want)) << "SdmGates log decay, pad " << pad;
      ASSERT_EQ(Download(beta_got), Download(beta_want)) << "SdmGates beta, pad " << pad;
    }
    EXPECT_EQ(cuda::SdmGates(d_a.get(), d_b.get(), heads - 1, d_log.get(), d_dt.get(), rows, heads,
                             g_got.get(), beta_got.get(), stream()),
              cudaErrorInvalidValue);
    // ApplyRope in place on q or k inside wider rows: 3 heads of 6 (pairs), even and odd strides.
    const int64_t n_heads = 3, head_dim = 6, width = n_heads * head_dim;
    std::vector<int32_t> pos(rows);
    for (int32_t& p : pos) p = std::uniform_int_distribution<int32_t>(0, 5000)(rng);
    auto d_pos = Upload(pos);
    const std::vector<float> x = Normal(rng, rows * width, 0.0f, 1.0f);
    auto d_x = Upload(x);
    ASSERT_EQ(
        cuda::ApplyRope(d_x.get(), rows, width, n_heads, head_dim, d_pos.get(), 1e4f, stream()),
        cudaSuccess);
    Sync();
    const std::vector<float> want_x = Download(d_x);
    for (const int64_t pad : {2, 3, 8}) {
      SCOPED_TRACE(testing::Message() << "rope pad " << pad);
      const int64_t stride = width + pad;
      const std::vector<float> before = Strided(x, width, stride);
      auto d_s = Upload(before);
      ASSERT_EQ(
          cuda::ApplyRope(d_s.get(), rows, stride, n_heads, head_dim, d_pos.get(), 1e4f, stream()),
          cudaSuccess);
      Sync();
      const std::vector<float> after = Download(d_s);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < stride; ++c) {
          const float got_v = after[r * stride + c];
          if (c < width) {
            ASSERT_EQ(std::memcmp(&got_v, &want_x[r * width + c], sizeof(float)), 0)
                << "row " << r << " col " << c;
          } else {
            ASSERT_TRUE(std::isnan(got_v)) << "a gap was written: row " << r << " col " << c;
          }
        }
      }
    }
    EXPECT_EQ(
        cuda::ApplyRope(d_x.get(), rows, width - 1, n_heads, head_dim, d_pos.get(), 1e4f, stream()),
        cudaErrorInvalidValue);
    // q's heads then k's in one row (a stack's adjacent parts): one launch over both rotates
    // each pair as the two launches do, bit for bit.
    const int64_t kv_heads = 2, qk_width = (n_heads + kv_heads) * head_dim,
                  qk_stride = qk_width + 4;
    const std::vector<float> qk =
        Strided(Normal(rng, rows * qk_width, 0.0f, 1.0f), qk_width, qk_stride);
    auto d_one = Upload(qk), d_two = Upload(qk);
    ASSERT_EQ(cuda::ApplyRope(d_one.get(), rows, qk_stride, n_heads + kv_heads, head_dim,
                              d_pos.get(), 1e4f, stream()),
              cudaSuccess);
    ASSERT_EQ(cuda::ApplyRope(d_two.get(), rows, qk_stride, n_heads, head_dim, d_pos.get(), 1e4f,
                              stream()),
              cudaSuccess);
    ASSERT_EQ(cuda::ApplyRope(d_two.get() + n_heads * head_dim, rows, qk_stride, kv_heads, head_dim,
                              d_pos.get(), 1e4f, stream()),
              cudaSuccess);
    Sync();
    const std::vector<float> one = Download(d_one), two = Download(d_two);
    ASSERT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0);
  }
}

TEST_F(CudaElementwiseTest, Bf16ConversionsRoundToNearestEven) {
  // Every bf16 bit pattern widens exactly.
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  auto d_all = UploadBf16(all);
  DeviceBuffer<float> d_wide(all.size());
  ASSERT_EQ(cuda::Bf16ToFloat(d_all.get(), all.size(), d_wide.get(), stream()), cudaSuccess);
  Sync();
  const std::vector<float> wide = Download(d_wide);
  for (uint32_t i = 0; i < 65536; ++i) {
    if (std::isnan(Bf16Value(all[i]))) {
      ASSERT_TRUE(std::isnan(wide[i])) << i;
    } else {
      ASSERT_EQ(wide[i], Bf16Value(all[i])) << i;
    }
  }

  const float inf = std::numeric_limits<float>::infinity();
  auto bits_to_float = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  };
  for (const uint32_t seed : Seeds()) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    std::vector<float> x = Normal(rng, 1003, 0.0f, 100.0f);
    // Ties (to even, both directions), signed zeros, infinities, NaN, subnormals, overflow.
    const float specials[] = {0.0f,
                              -0.0f,
                              inf,
                              -inf,
                              std::numeric_limits<float>::quiet_NaN(),
                              bits_to_float(0x3f808000u),  // tie, rounds down to 0x3f80
                              bits_to_float(0x3f818000u),  // tie, rounds up to 0x3f82
                              bits_to_float(0xbf818000u),
                              bits_to_float(0x00000001u),
                              bits_to_float(0x00418000u),
                              std::numeric_limits<float>::max(),
                              1e-3f};
    std::copy(std::begin(specials), std::end(specials), x.begin() + 3);
    std::uniform_int_distribution<uint32_t> bits;
    for (int i = 20; i < 120; ++i) {
      x[i] = bits_to_float(bits(rng));  // arbitrary patterns
    }
    for (const int64_t offset : {0, 1}) {
      SCOPED_TRACE(testing::Message() << "offset " << offset);
      const int64_t n = static_cast<int64_t>(x.size()) - offset;
      auto d_x = Upload(x);
      DeviceBuffer<bf16> d_out(n);
      ASSERT_EQ(cuda::FloatToBf16(d_x.get() + offset, n, d_out.get(), stream()), cudaSuccess);
      Sync();
      const std::vector<uint16_t> got = DownloadBf16(d_out);
      for (int64_t i = 0; i < n; ++i) {
        const float v = x[offset + i];
        if (std::isnan(v)) {
          ASSERT_TRUE(std::isnan(Bf16Value(got[i]))) << i;
        } else {
          ASSERT_EQ(got[i], Bf16Bits(v)) << i << " value " << v;
        }
      }
    }
  }
}

TEST_F(CudaElementwiseTest, EmptyInputsLaunchNothing) {
  // n = 0 must not launch a zero-block grid (a launch error).
  EXPECT_EQ(cuda::AddInPlace(nullptr, nullptr, 0, stream()), cudaSuccess);
  EXPECT_EQ(cuda::SwiGlu(nullptr, nullptr, 0, 64, 64, nullptr, stream()), cudaSuccess);
  EXPECT_EQ(cuda::RmsNorm(nullptr, nullptr, 0, 64, 1e-5f, nullptr, nullptr, stream()), cudaSuccess);
  EXPECT_EQ(cuda::LayerNorm(nullptr, nullptr, nullptr, 0, 64, 1e-5f, stream()), cudaSuccess);
  EXPECT_EQ(cuda::ApplyRope(nullptr, 0, 256, 4, 64, nullptr, 1e4f, stream()), cudaSuccess);
  EXPECT_EQ(cuda::EmbeddingLookup(nullptr, nullptr, 0, 64, nullptr, stream()), cudaSuccess);
  EXPECT_EQ(cuda::GatherBlocks(nullptr, 64, nullptr, 0, nullptr, stream()), cudaSuccess);
  EXPECT_EQ(cuda::ScatterBlocks(nullptr, 64, nullptr, 0, nullptr, stream()), cudaSuccess);
  Sync();
}

#else

// Keeps the suite visible (as skipped, from SetUp) in builds without CUDA.
TEST_F(CudaElementwiseTest, BuiltWithoutCuda) {}

#endif  // SDM_HAVE_CUDA

}  // namespace
}  // namespace sdm::kernels
