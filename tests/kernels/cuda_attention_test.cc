// CUDA attention (kernels/cuda/attention.h) against the CPU kernels (kernels/cpu/attention.h)
// over the same bf16-rounded keys and values, on paged caches built on the device: shuffled
// pages, sliding-window rings that wrap several times, sequences of different lengths (one
// longer than several split-K chunks), full and windowed attention, GQA groups of 1, 2, 3, 8 and
// 16. Skips without a device (and on builds without CUDA).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/common/attention_math.h"
#include "kernels/common/device_layout.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/cuda_runtime_info.h"
#include "tests/kernels/strided_rows.h"
#if defined(SDM_HAVE_CUDA)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#endif

namespace sdm::kernels {
namespace {

#define SDM_SKIP_WITHOUT_DEVICE()                                          \
  do {                                                                     \
    if (cuda::DeviceCount() == 0) {                                        \
      GTEST_SKIP() << "no CUDA device (" << cuda::DescribeDevice() << ")"; \
    }                                                                      \
  } while (0)

#if defined(SDM_HAVE_CUDA)

#define ASSERT_CUDA_OK(expr)                                                    \
  do {                                                                          \
    const cudaError_t err_ = (expr);                                            \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cuda::CudaErrorText(err_); \
  } while (0)

// bf16 round to nearest even, as __float2bfloat16_rn does (inputs are finite here).
uint16_t ToBf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float FromBf16Bits(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
cudaError_t Upload(cuda::DeviceBuffer<T>& dst, const std::vector<T>& src) {
  SDM_RETURN_IF_ERROR(dst.Allocate(src.size()));
  return cudaMemcpy(dst.get(), src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice);
}

template <typename T>
cudaError_t Download(std::vector<T>& dst, const T* src, size_t n) {
  dst.resize(n);
  return cudaMemcpy(dst.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost);
}

// AttentionDecode's scratch for `batch` sequences, its counters zeroed once.
struct DecodeScratch {
  cuda::DeviceBuffer<float> partials;
  cuda::DeviceBuffer<unsigned int> counters;

  cudaError_t Allocate(int64_t batch, const cuda::AttentionDims& dims, int64_t max_visible) {
    SDM_RETURN_IF_ERROR(
        partials.Allocate(cuda::AttentionDecodeScratchFloats(batch, dims, max_visible)));
    SDM_RETURN_IF_ERROR(counters.Allocate(cuda::AttentionDecodeCounters(batch, dims)));
    SDM_RETURN_IF_ERROR(cudaMemset(counters.get(), 0, counters.bytes()));
    return cudaDeviceSynchronize();  // before a launch on a non-blocking stream
  }
  cuda::AttentionDecodeScratch View() { return {partials.get(), counters.get()}; }
  // Every call leaves the counters zero (the next call, a graph's replay, relies on it).
  void ExpectCountersZero() {
    std::vector<unsigned int> left;
    ASSERT_EQ(Download(left, counters.get(), counters.size()), cudaSuccess);
    for (size_t i = 0; i < left.size(); ++i) ASSERT_EQ(left[i], 0u) << "counter " << i;
  }
};

struct Config {
  int32_t n_heads;
  int32_t n_kv_heads;
  int32_t head_dim;
  int64_t window;       // 0: full attention
  int64_t ring_tokens;  // window + prefill chunk for rings; unused for full attention
  std::vector<int64_t> lengths;
};

// One attention layer's paged cache for a batch of sequences, filled through KvAppend with
// positions 0 .. length - 1 of each sequence, plus the host copies of what it must hold: the
// keys and values rounded to bf16, as fp32 (what the CPU kernels attend over).
class PagedCache {
 public:
  // bit_values: V[p][i] = +1 where bit (i % 13) of p is set, else -1 (exact in bf16), instead of
  // normal values (CheckDecodeCountsEveryKey).
  PagedCache(const Config& c, uint32_t seed, bool bit_values = false) : c_(c) {
    kv_width_ = static_cast<int64_t>(c.n_kv_heads) * c.head_dim;
    ring_pages_ = c.window > 0 ? KvRingPages(c.ring_tokens) : 0;
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    for (int64_t len : c.lengths) {
      std::vector<float> k(len * kv_width_), v(len * kv_width_);
      for (float& x : k) x = normal(rng);
      for (int64_t i = 0; i < len * kv_width_; ++i) {
        const int64_t p = i / kv_width_, d = i % kv_width_;
        v[i] = bit_values ? (((p >> (d % 13)) & 1) != 0 ? 1.0f : -1.0f) : normal(rng);
      }
      k_raw_.push_back(k);
      v_raw_.push_back(v);
      for (float& x : k) x = FromBf16Bits(ToBf16Bits(x));
      for (float& x : v) x = FromBf16Bits(ToBf16Bits(x));
      k_.push_back(std::move(k));
      v_.push_back(std::move(v));
    }
    // Page tables over a shuffled arena with a few pages nobody owns, so that contiguous or
    // identity page numbering cannot hide an indexing mistake.
    int64_t pages = 3;
    for (int64_t len : c.lengths) pages += TablePages(len);
    std::vector<int32_t> perm(pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    int64_t next = 0;
    for (int64_t len : c.lengths) {
      std::vector<int32_t> table(TablePages(len));
      for (int32_t& p : table) p = perm[next++];
      tables_.push_back(std::move(table));
    }
    num_pages_ = pages;
  }

  // Allocates the device side and appends every position, a page's worth of positions of every
  // sequence per KvAppend call (rows of one call never share a ring slot), with a padding row
  // (position -1, garbage values) in each call that must be skipped.
  cudaError_t Build() {
    SDM_RETURN_IF_ERROR(arena_.Allocate(num_pages_ * KvPageElements(kv_width_)));
    // 0xffff is a bf16 NaN: reading any slot that was never written poisons the result.
    SDM_RETURN_IF_ERROR(cudaMemset(arena_.get(), 0xff, arena_.bytes()));
    std::vector<const int32_t*> table_ptrs;
    d_tables_.resize(tables_.size());
    for (size_t s = 0; s < tables_.size(); ++s) {
      SDM_RETURN_IF_ERROR(Upload(d_tables_[s], tables_[s]));
      table_ptrs.push_back(d_tables_[s].get());
    }
    SDM_RETURN_IF_ERROR(Upload(d_table_ptrs_, table_ptrs));
    const int64_t max_len = *std::max_element(c_.lengths.begin(), c_.lengths.end());
    for (int64_t p0 = 0; p0 < max_len; p0 += kKvPageTokens) {
      std::vector<float> k, v;
      std::vector<int32_t> seq, pos;
      for (size_t s = 0; s < c_.lengths.size(); ++s) {
        for (int64_t p = p0; p < std::min(p0 + kKvPageTokens, c_.lengths[s]); ++p) {
          k.insert(k.end(), &k_raw_[s][p * kv_width_], &k_raw_[s][(p + 1) * kv_width_]);
          v.insert(v.end(), &v_raw_[s][p * kv_width_], &v_raw_[s][(p + 1) * kv_width_]);
          seq.push_back(static_cast<int32_t>(s));
          pos.push_back(static_cast<int32_t>(p));
        }
      }
      k.insert(k.end(), kv_width_, 1e30f);
      v.insert(v.end(), kv_width_, -1e30f);
      seq.push_back(0);
      pos.push_back(-1);
      cuda::DeviceBuffer<float> dk, dv;
      cuda::DeviceBuffer<int32_t> dseq, dpos;
      // Every other call reads k and v out of wider rows (a stacked projection's output), the
      // gaps NaN: a read of a gap would poison the cache.
      const int64_t stride = kv_width_ + (p0 / kKvPageTokens % 2 == 1 ? 4 : 0);
      SDM_RETURN_IF_ERROR(Upload(dk, Strided(k, kv_width_, stride)));
      SDM_RETURN_IF_ERROR(Upload(dv, Strided(v, kv_width_, stride)));
      SDM_RETURN_IF_ERROR(Upload(dseq, seq));
      SDM_RETURN_IF_ERROR(Upload(dpos, pos));
      SDM_RETURN_IF_ERROR(cuda::KvAppend(dk.get(), dv.get(), stride,
                                         static_cast<int64_t>(seq.size()), dseq.get(), dpos.get(),
                                         View(), nullptr));
      SDM_RETURN_IF_ERROR(cudaDeviceSynchronize());  // before the buffers are freed
    }
    return cudaSuccess;
  }

  cuda::KvLayerView View() {
    cuda::KvLayerView view;
    view.pool = arena_.get();
    view.kv_width = kv_width_;
    view.ring_pages = ring_pages_;
    view.page_tables = d_table_ptrs_.get();
    return view;
  }

  // First position still held for sequence s (rings keep the last ring_pages pages' worth).
  int64_t FirstHeld(size_t s) const {
    if (ring_pages_ == 0) return 0;
    return std::max<int64_t>(0, c_.lengths[s] - int64_t{ring_pages_} * kKvPageTokens);
  }

  int64_t TablePages(int64_t len) const {
    return ring_pages_ > 0 ? ring_pages_
                           : std::max<int64_t>(1, (len + kKvPageTokens - 1) / kKvPageTokens);
  }

  cpu::AttentionShape Shape() const {
    return {c_.n_heads, c_.n_kv_heads, c_.head_dim, c_.window, kv_width_};
  }
  cuda::AttentionDims Dims() const { return {c_.n_heads, c_.n_kv_heads, c_.head_dim, c_.window}; }
  // Span of sequence s over positions [first, last].
  cpu::KvSpan Span(size_t s, int64_t first, int64_t last) const {
    return {&k_[s][first * kv_width_], &v_[s][first * kv_width_], first, last - first + 1};
  }

  const Config& config() const { return c_; }
  int64_t kv_width() const { return kv_width_; }
  const std::vector<int32_t>& table(size_t s) const { return tables_[s]; }
  const std::vector<float>& k(size_t s) const { return k_[s]; }
  const std::vector<float>& v(size_t s) const { return v_[s]; }
  const __nv_bfloat16* arena() const { return arena_.get(); }
  int64_t num_pages() const { return num_pages_; }

 private:
  Config c_;
  int64_t kv_width_ = 0;
  int32_t ring_pages_ = 0;
  int64_t num_pages_ = 0;
  std::vector<std::vector<float>> k_raw_, v_raw_, k_, v_;
  std::vector<std::vector<int32_t>> tables_;
  cuda::DeviceBuffer<__nv_bfloat16> arena_;
  std::vector<cuda::DeviceBuffer<int32_t>> d_tables_;
  cuda::DeviceBuffer<const int32_t*> d_table_ptrs_;
};

// Tolerance. Both sides attend over identical bf16-rounded keys and values in fp32, so they
// differ only in summation order (dot products of head_dim terms, softmax sums of up to a few
// thousand terms) and in exp (the device uses exp2 on log2(e)-prescaled scores): a few 1e-7
// relative on each weight, ~1e-5 on outputs of size ~1-4. 1e-4 * (1 + |want|) leaves a wide
// margin and still catches a single key missing or counted twice (~1/visible ~ 4e-4 of the
// output for the longest sequence, far more for shorter ones); wrong pages read NaN.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float tol = 1e-4f * (1.0f + std::abs(want[i]));
    ASSERT_TRUE(std::abs(got[i] - want[i]) <= tol)
        << what << " element " << i << ": got " << got[i] << " want " << want[i];
    worst = std::max(worst, static_cast<double>(std::abs(got[i] - want[i])));
  }
  testing::Test::RecordProperty(std::string(what) + "_max_abs_err", std::to_string(worst));
}

void CheckAppend(PagedCache& cache) {
  std::vector<uint16_t> arena;
  ASSERT_CUDA_OK(Download(arena, reinterpret_cast<const uint16_t*>(cache.arena()),
                          cache.num_pages() * KvPageElements(cache.kv_width())));
  const Config& c = cache.config();
  const int32_t ring = c.window > 0 ? KvRingPages(c.ring_tokens) : 0;
  for (size_t s = 0; s < c.lengths.size(); ++s) {
    for (int64_t p = cache.FirstHeld(s); p < c.lengths[s]; ++p) {
      const int32_t page = cache.table(s)[KvPageTableIndex(p, ring)];
      for (bool value : {false, true}) {
        const int64_t off = KvRowOffset(page, p, cache.kv_width(), value);
        const std::vector<float>& want = value ? cache.v(s) : cache.k(s);
        for (int64_t i = 0; i < cache.kv_width(); ++i) {
          ASSERT_EQ(arena[off + i], ToBf16Bits(want[p * cache.kv_width() + i]))
              << "seq " << s << " pos " << p << (value ? " value " : " key ") << i;
        }
      }
    }
  }
}

// Decode of the last position of every sequence (its key is the last one appended).
// Decoded `repeats` times on one scratch: each launch finds the counters the one before left
// (zero) and computes the same bits.
void CheckDecode(PagedCache& cache, uint32_t seed, int64_t max_visible_override = -1,
                 int repeats = 2) {
  const Config& c = cache.config();
  const int64_t batch = static_cast<int64_t>(c.lengths.size());
  const int64_t width = static_cast<int64_t>(c.n_heads) * c.head_dim;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> q(batch * width);
  for (float& x : q) x = 2.0f * normal(rng);  // sharper softmax than unit queries
  std::vector<int32_t> positions(batch);
  int64_t max_visible = 0;
  for (int64_t b = 0; b < batch; ++b) {
    positions[b] = static_cast<int32_t>(c.lengths[b] - 1);
    max_visible =
        std::max(max_visible, positions[b] - FirstVisiblePosition(positions[b], c.window) + 1);
  }
  if (max_visible_override > 0) max_visible = max_visible_override;

  cuda::DeviceBuffer<float> dq, dout;
  DecodeScratch dscratch;
  cuda::DeviceBuffer<int32_t> dpos;
  // The queries inside wider rows (a stacked projection's output), the gaps NaN.
  const int64_t q_stride = width + 8;
  ASSERT_CUDA_OK(Upload(dq, Strided(q, width, q_stride)));
  ASSERT_CUDA_OK(Upload(dpos, positions));
  ASSERT_CUDA_OK(dout.Allocate(batch * width));
  ASSERT_CUDA_OK(cudaMemset(dout.get(), 0xff, dout.bytes()));  // NaN: every output is written
  ASSERT_CUDA_OK(dscratch.Allocate(batch, cache.Dims(), max_visible));
  cuda::CudaStream stream;
  ASSERT_CUDA_OK(stream.Create());
  std::vector<float> got, again;
  for (int r = 0; r < repeats; ++r) {
    ASSERT_CUDA_OK(cuda::AttentionDecode(dq.get(), q_stride, batch, dpos.get(), max_visible,
                                         cache.View(), cache.Dims(), dscratch.View(), dout.get(),
                                         stream.get()));
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream.get()));
    ASSERT_CUDA_OK(Download(r == 0 ? got : again, dout.get(), batch * width));
    ASSERT_NO_FATAL_FAILURE(dscratch.ExpectCountersZero());
    if (r > 0) {
      ASSERT_EQ(std::memcmp(got.data(), again.data(), got.size() * sizeof(float)), 0)
          << "launch " << r;
    }
  }

  std::vector<float> want(batch * width);
  const cpu::AttentionShape shape = cache.Shape();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t pos = positions[b];
    const cpu::KvSpan span = cache.Span(b, FirstVisiblePosition(pos, c.window), pos);
    for (int64_t h = 0; h < c.n_heads; ++h) {
      cpu::AttendDecodeHead(&q[b * width + h * c.head_dim], h, pos, {&span, 1}, shape,
                            &want[b * width + h * c.head_dim]);
    }
  }
  ExpectClose(got, want, "decode");
}

// Prefill of the last `num_tokens` positions of sequence `seq` (the ring holds window + chunk).
void CheckPrefill(PagedCache& cache, int32_t seq, int64_t num_tokens, uint32_t seed) {
  const Config& c = cache.config();
  const int64_t width = static_cast<int64_t>(c.n_heads) * c.head_dim;
  const int64_t pos0 = c.lengths[seq] - num_tokens;
  ASSERT_GE(pos0, 0);
  ASSERT_GE(FirstVisiblePosition(pos0, c.window), cache.FirstHeld(seq)) << "ring too small";
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> q(num_tokens * width);
  for (float& x : q) x = 2.0f * normal(rng);

  cuda::DeviceBuffer<float> dq, dout;
  // The queries inside wider rows (a stacked projection's output), the gaps NaN.
  const int64_t q_stride = width + 4;
  ASSERT_CUDA_OK(Upload(dq, Strided(q, width, q_stride)));
  ASSERT_CUDA_OK(dout.Allocate(num_tokens * width));
  ASSERT_CUDA_OK(cudaMemset(dout.get(), 0xff, dout.bytes()));
  cuda::CudaStream stream;
  ASSERT_CUDA_OK(stream.Create());
  ASSERT_CUDA_OK(cuda::AttentionPrefill(dq.get(), q_stride, num_tokens, pos0, seq, cache.View(),
                                        cache.Dims(), dout.get(), stream.get()));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream.get()));
  std::vector<float> got;
  ASSERT_CUDA_OK(Download(got, dout.get(), num_tokens * width));

  std::vector<float> want(num_tokens * width);
  const cpu::KvSpan span =
      cache.Span(seq, FirstVisiblePosition(pos0, c.window), pos0 + num_tokens - 1);
  cpu::AttendPrefill(q.data(), num_tokens, pos0, {&span, 1}, cache.Shape(), want.data());
  ExpectClose(got, want, "prefill");
}

// Decode with q = 0 over V[p] = the bits of p as +-1 (PagedCache bit_values): every visible key
// weighs exactly 1 (exp2(0)), every partial sum is an integer, so the output is the mean of the
// visible values, exact but for the final division. One key dropped or counted twice moves some
// dimension by at least ~2/(3n) (bit 0 alternates, so its mean is within 1/3 of 0 and the key's
// own value is +-1): 1.6e-4 at n = 4100 visible keys, against a tolerance of 1e-6. The test
// checks that margin on the data too, by dropping each sequence's middle key from the reference.
void CheckDecodeCountsEveryKey(const Config& c, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "seed " << seed << " window " << c.window);
  PagedCache cache(c, seed, /*bit_values=*/true);
  ASSERT_CUDA_OK(cache.Build());
  const int64_t batch = static_cast<int64_t>(c.lengths.size());
  const int64_t width = static_cast<int64_t>(c.n_heads) * c.head_dim;
  const int64_t group = c.n_heads / c.n_kv_heads;
  std::vector<int32_t> positions(batch);
  int64_t max_visible = 0;
  for (int64_t b = 0; b < batch; ++b) {
    positions[b] = static_cast<int32_t>(c.lengths[b] - 1);
    max_visible = std::max<int64_t>(max_visible, positions[b] + 1);  // unclamped, as the engine
  }
  cuda::DeviceBuffer<float> dq, dout;
  DecodeScratch dscratch;
  cuda::DeviceBuffer<int32_t> dpos;
  ASSERT_CUDA_OK(Upload(dq, std::vector<float>(batch * width, 0.0f)));
  ASSERT_CUDA_OK(Upload(dpos, positions));
  ASSERT_CUDA_OK(dout.Allocate(batch * width));
  ASSERT_CUDA_OK(cudaMemset(dout.get(), 0xff, dout.bytes()));
  ASSERT_CUDA_OK(dscratch.Allocate(batch, cache.Dims(), max_visible));
  ASSERT_CUDA_OK(cuda::AttentionDecode(dq.get(), width, batch, dpos.get(), max_visible,
                                       cache.View(), cache.Dims(), dscratch.View(), dout.get(),
                                       nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> got;
  ASSERT_CUDA_OK(Download(got, dout.get(), batch * width));
  constexpr double kTol = 1e-6;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t pos = positions[b];
    const int64_t first = FirstVisiblePosition(pos, c.window);
    const int64_t n = pos - first + 1;
    const int64_t dropped = first + n / 2;
    double worst_drop = 0;  // how far the reference without one key moves
    for (int64_t h = 0; h < c.n_heads; ++h) {
      const int64_t kvh = h / group;
      for (int64_t d = 0; d < c.head_dim; ++d) {
        const int64_t col = kvh * c.head_dim + d;
        double sum = 0;
        for (int64_t p = first; p <= pos; ++p) sum += cache.v(b)[p * cache.kv_width() + col];
        const double want = sum / static_cast<double>(n);
        ASSERT_NEAR(got[b * width + h * c.head_dim + d], want, kTol)
            << "seq " << b << " head " << h << " dim " << d << " visible " << n;
        if (n > 1) {
          const double without =
              (sum - cache.v(b)[dropped * cache.kv_width() + col]) / static_cast<double>(n - 1);
          worst_drop = std::max(worst_drop, std::abs(without - want));
        }
      }
    }
    if (n > 1) {
      EXPECT_GT(worst_drop, 100 * kTol) << "seq " << b << ": the check would miss it";
    }
  }
}

// The prefill path's twin of CheckDecodeCountsEveryKey: the last `num_tokens` positions of
// sequence `seq` as one chunk, q = 0 over V = position bits, so row t (position pos0 + t) must be
// exactly the mean of the values at its visible positions: a key dropped or counted twice for
// any row (at a tile edge, the causal diagonal, the window's edge, a ring wrap) moves some
// dimension by far more than the tolerance (checked on the data as in the decode test).
void CheckPrefillCountsEveryKey(const Config& c, int32_t seq, int64_t num_tokens, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "seed " << seed << " window " << c.window << " seq " << seq
                                  << " tokens " << num_tokens);
  PagedCache cache(c, seed, /*bit_values=*/true);
  ASSERT_CUDA_OK(cache.Build());
  const int64_t width = static_cast<int64_t>(c.n_heads) * c.head_dim;
  const int64_t group = c.n_heads / c.n_kv_heads;
  const int64_t pos0 = c.lengths[seq] - num_tokens;
  ASSERT_GE(pos0, 0);
  ASSERT_GE(FirstVisiblePosition(pos0, c.window), cache.FirstHeld(seq)) << "ring too small";
  cuda::DeviceBuffer<float> dq, dout;
  ASSERT_CUDA_OK(Upload(dq, std::vector<float>(num_tokens * width, 0.0f)));
  ASSERT_CUDA_OK(dout.Allocate(num_tokens * width));
  ASSERT_CUDA_OK(cudaMemset(dout.get(), 0xff, dout.bytes()));
  ASSERT_CUDA_OK(cuda::AttentionPrefill(dq.get(), width, num_tokens, pos0, seq, cache.View(),
                                        cache.Dims(), dout.get(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> got;
  ASSERT_CUDA_OK(Download(got, dout.get(), num_tokens * width));
  constexpr double kTol = 1e-6;
  const std::vector<float>& v = cache.v(seq);
  const int64_t kvw = cache.kv_width();
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t pos = pos0 + t;
    const int64_t first = FirstVisiblePosition(pos, c.window);
    const int64_t n = pos - first + 1;
    const int64_t dropped = first + n / 2;
    double worst_drop = 0;
    for (int64_t h = 0; h < c.n_heads; ++h) {
      const int64_t col0 = (h / group) * c.head_dim;
      for (int64_t d = 0; d < c.head_dim; ++d) {
        double sum = 0;
        for (int64_t p = first; p <= pos; ++p) sum += v[p * kvw + col0 + d];
        const double want = sum / static_cast<double>(n);
        ASSERT_NEAR(got[t * width + h * c.head_dim + d], want, kTol)
            << "row " << t << " (position " << pos << ") head " << h << " dim " << d << " visible "
            << n;
        if (n > 1) {
          const double without = (sum - v[dropped * kvw + col0 + d]) / static_cast<double>(n - 1);
          worst_drop = std::max(worst_drop, std::abs(without - want));
        }
      }
    }
    if (n > 1) {
      ASSERT_GT(worst_drop, 100 * kTol) << "row " << t << ": the check would miss it";
    }
  }
}

// Builds the cache for `c` with `seed` and runs the append, decode and prefill checks.
void RunConfig(const Config& c, uint32_t seed,
               const std::vector<std::pair<int32_t, int64_t>>& prefills) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  PagedCache cache(c, seed);
  ASSERT_CUDA_OK(cache.Build());
  ASSERT_NO_FATAL_FAILURE(CheckAppend(cache));
  ASSERT_NO_FATAL_FAILURE(CheckDecode(cache, seed + 1));
  for (const auto& [seq, tokens] : prefills) {
    SCOPED_TRACE(testing::Message() << "prefill seq " << seq << " tokens " << tokens);
    ASSERT_NO_FATAL_FAILURE(CheckPrefill(cache, seq, tokens, seed + 2));
  }
}

// baseline_1.4B's full attention (16 q heads, 8 kv heads, head_dim 128); lengths around page and
// chunk (512) boundaries and one of 5+ chunks.
Config BaselineFull() { return {16, 8, 128, 0, 0, {1, 37, 64, 65, 512, 513, 1337, 2600}}; }
// Windowed GQA with a group of 3; the window spans 3 chunks; the longest sequence wraps its
// ring (window 1100 + chunk 300 -> 22 pages, 1408 positions) about three times.
Config WindowedGroup3() { return {6, 2, 64, 1100, 1100 + 300, {5, 1099, 1100, 1101, 2000, 4100}}; }
// The tiny preset's SWA layers: 4 q heads, 2 kv heads, head_dim 16, window 8.
Config TinySwa() { return {4, 2, 16, 8, 8 + 64, {1, 3, 8, 9, 200}}; }
// head_dim 256, one kv head for 8 query heads (the widest decode block).
Config WideGroup8() { return {8, 1, 256, 0, 0, {100, 1030}}; }
// A group of 16 (split over two decode blocks) and head_dim 24 (not a power of two).
Config Group16Hd24() { return {16, 1, 24, 0, 0, {50, 700}}; }

uint32_t FreshSeed() { return std::random_device{}(); }

#endif  // SDM_HAVE_CUDA

TEST(CudaAttentionTest, BaselineFullAttention) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  const std::vector<std::pair<int32_t, int64_t>> prefills = {{3, 65}, {6, 200}, {7, 2600}};
  RunConfig(BaselineFull(), 11, prefills);
  RunConfig(BaselineFull(), FreshSeed(), prefills);
#endif
}

TEST(CudaAttentionTest, SlidingWindowRingGroup3) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  const std::vector<std::pair<int32_t, int64_t>> prefills = {{0, 5}, {4, 300}, {5, 300}};
  RunConfig(WindowedGroup3(), 12, prefills);
  RunConfig(WindowedGroup3(), FreshSeed(), prefills);
#endif
}

TEST(CudaAttentionTest, TinySlidingWindow) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  const std::vector<std::pair<int32_t, int64_t>> prefills = {{2, 8}, {3, 1}, {4, 64}};
  RunConfig(TinySwa(), 13, prefills);
  RunConfig(TinySwa(), FreshSeed(), prefills);
#endif
}

TEST(CudaAttentionTest, WideHeadsGroup8) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  RunConfig(WideGroup8(), 14, {{1, 130}});
  RunConfig(WideGroup8(), FreshSeed(), {{0, 100}});
#endif
}

TEST(CudaAttentionTest, Group16OddHeadDim) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  RunConfig(Group16Hd24(), 15, {{1, 97}});
  RunConfig(Group16Hd24(), FreshSeed(), {{0, 50}});
#endif
}

TEST(CudaAttentionTest, DecodeGridSizesDoNotChangeTheResult) {
  // A grid sized for more positions than any sequence has (idle chunk blocks), and one sized
  // for fewer (the last chunk takes the rest): both still attend over exactly the visible keys.
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  PagedCache cache(BaselineFull(), 16);
  ASSERT_CUDA_OK(cache.Build());
  ASSERT_NO_FATAL_FAILURE(CheckDecode(cache, 17, /*max_visible_override=*/5000));
  ASSERT_NO_FATAL_FAILURE(CheckDecode(cache, 18, /*max_visible_override=*/600));
  ASSERT_NO_FATAL_FAILURE(CheckDecode(cache, 19, /*max_visible_override=*/1));
#endif
}

TEST(CudaAttentionTest, WindowEdgeIsExact) {
  // Window 3, query at position 5 sees 3, 4, 5 and not 2. Key 2 matches the query overwhelmingly
  // and carries value 1000; the visible values are all 1, so any leak moves the output far from
  // exactly 1 (decode) and the prefill row of position 2, which sees key 2, is ~1000.
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  const int32_t hd = 8;
  Config c = {1, 1, hd, 3, 3 + 64, {6}};
  PagedCache cache(c, 1);
  // Overwrite the random rows through a second append of hand-made rows.
  std::vector<float> k(6 * hd, 0.0f), v(6 * hd, 0.0f);
  k[2 * hd] = 100.0f;
  for (int d = 0; d < hd; ++d) v[2 * hd + d] = 1000.0f;
  for (int p = 3; p < 6; ++p) {
    for (int d = 0; d < hd; ++d) v[p * hd + d] = 1.0f;
  }
  ASSERT_CUDA_OK(cache.Build());
  cuda::DeviceBuffer<float> dk, dv, dq, dout;
  cuda::DeviceBuffer<int32_t> dseq, dpos;
  ASSERT_CUDA_OK(Upload(dk, k));
  ASSERT_CUDA_OK(Upload(dv, v));
  ASSERT_CUDA_OK(Upload(dseq, std::vector<int32_t>(6, 0)));
  ASSERT_CUDA_OK(Upload(dpos, std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  ASSERT_CUDA_OK(
      cuda::KvAppend(dk.get(), dv.get(), hd, 6, dseq.get(), dpos.get(), cache.View(), nullptr));
  std::vector<float> q(4 * hd, 0.0f);
  for (int t = 0; t < 4; ++t) q[t * hd] = 1.0f;
  ASSERT_CUDA_OK(Upload(dq, q));
  ASSERT_CUDA_OK(dout.Allocate(4 * hd));
  // Decode of the query at position 5 (the last row of q).
  cuda::DeviceBuffer<int32_t> dposition;
  ASSERT_CUDA_OK(Upload(dposition, std::vector<int32_t>{5}));
  ASSERT_CUDA_OK(cuda::AttentionDecode(dq.get() + 3 * hd, hd, 1, dposition.get(), 3, cache.View(),
                                       cache.Dims(), {}, dout.get(), nullptr));
  std::vector<float> got;
  ASSERT_CUDA_OK(Download(got, dout.get(), hd));
  for (int d = 0; d < hd; ++d) EXPECT_EQ(got[d], 1.0f) << d;
  // Prefill of positions 2..5.
  ASSERT_CUDA_OK(cuda::AttentionPrefill(dq.get(), hd, 4, 2, 0, cache.View(), cache.Dims(),
                                        dout.get(), nullptr));
  ASSERT_CUDA_OK(Download(got, dout.get(), 4 * hd));
  EXPECT_NEAR(got[0], 1000.0f, 1e-2);  // position 2 sees itself
  EXPECT_EQ(got[3 * hd], 1.0f);        // position 5 no longer sees position 2
#endif
}

// Many sequences split into many chunks, decoded again and again on one scratch: every launch's
// bits equal the first's, the first agrees with the CPU, and the counters end each launch at
// zero. On a device a sequence's chunk blocks run at once, so the last-block merge
// (MergeDecodeChunks) is raced for real. The CPU emulator runs blocks one after another, which
// cannot race, so the test skips there unless the blocks run as co-resident groups
// (EMU_CORESIDENT with EMU_ORDER=rand: their warps interleave and switch at the atomic, the
// fences and the __ldcg reads), which races the merge's logic though not the memory model.
TEST(CudaAttentionTest, SplitDecodeRepeatedOnOneScratchIsStable) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  // The CPU emulator runs blocks in turn unless they run as co-resident groups; there each
  // launch is one interleaving of them, so a few launches suffice.
  const std::string device = cuda::DescribeDevice();
  const bool emulated = device.find("emulator") != std::string::npos;
  if (emulated && device.find("co-resident") == std::string::npos) {
    GTEST_SKIP() << "blocks do not run at once on " << device;
  }
  const int repeats = emulated ? 6 : 300;
  std::vector<int64_t> long_lengths, short_lengths;
  for (int64_t i = 0; i < 8; ++i) {
    long_lengths.push_back(4096 - 251 * i);   // 8 down to 5 chunks
    short_lengths.push_back(2048 - 131 * i);  // 4 down to 3
  }
  // GQA groups 1 (sdm_flagship's sliding-window layers), 2 (baseline_1.4B) and 8.
  for (const Config& c :
       {Config{16, 16, 128, 0, 0, short_lengths}, Config{16, 8, 128, 0, 0, long_lengths},
        Config{8, 1, 256, 0, 0, long_lengths}}) {
    SCOPED_TRACE(testing::Message() << "group " << c.n_heads / c.n_kv_heads);
    PagedCache cache(c, 71);
    ASSERT_CUDA_OK(cache.Build());
    ASSERT_NO_FATAL_FAILURE(CheckDecode(cache, 72, /*max_visible_override=*/-1, repeats));
  }
#endif
}

// q = 0 and V = position bits (CheckDecodeCountsEveryKey): catches one key dropped or doubled,
// at chunk boundaries (512), across a wrapped ring and at the window's edge; max_visible is the
// unclamped context, so the windowed grids are sized by the window clamp.
TEST(CudaAttentionTest, DecodeCountsEveryVisibleKeyOnce) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  CheckDecodeCountsEveryKey(BaselineFull(), 41);
  CheckDecodeCountsEveryKey(WindowedGroup3(), 42);
  CheckDecodeCountsEveryKey(TinySwa(), 43);
#endif
}

// The prefill kernel with q = 0 and V = position bits (CheckPrefillCountsEveryKey): chunks that
// start mid-page and cross page boundaries, a window whose edge moves with every row, a wrapped
// ring, and the tiny preset's window of 8.
TEST(CudaAttentionTest, PrefillCountsEveryVisibleKeyOnce) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  CheckPrefillCountsEveryKey(BaselineFull(), /*seq=*/5, /*num_tokens=*/131, 44);    // 513 long
  CheckPrefillCountsEveryKey(WindowedGroup3(), /*seq=*/4, /*num_tokens=*/300, 45);  // 2000 long
  CheckPrefillCountsEveryKey(TinySwa(), /*seq=*/4, /*num_tokens=*/64, 46);
#endif
}

#if defined(SDM_HAVE_CUDA)
// RopeKvAppend against ApplyRope (q's heads, then k's) and KvAppend on the same rows, each on its
// own copy of one cache: the rotated queries and the whole arena bit for bit, k and v left as
// they were. Rows: q, k, v and a gap inside a stacked projection's rows (NaN gaps); one row per
// sequence at a held position (the last, and an earlier one for a ring that wrapped), a few
// rows of one sequence as a prefill writes them, and a padding row (position -1, huge values)
// whose key and value must not be stored.
void CheckRopeKvAppend(const Config& c, float theta, uint32_t seed) {
  PagedCache want_cache(c, seed), got_cache(c, seed);  // the same tables
  ASSERT_CUDA_OK(want_cache.Build());
  ASSERT_CUDA_OK(got_cache.Build());
  const int64_t q_width = int64_t{c.n_heads} * c.head_dim;
  const int64_t kv_width = want_cache.kv_width();
  const int64_t stride = q_width + 2 * kv_width + 8;
  std::vector<int32_t> seq, pos;
  for (size_t s = 0; s < c.lengths.size(); ++s) {
    seq.push_back(static_cast<int32_t>(s));
    pos.push_back(static_cast<int32_t>(c.lengths[s] - 1));
  }
  const size_t longest = std::max_element(c.lengths.begin(), c.lengths.end()) - c.lengths.begin();
  for (int64_t p = want_cache.FirstHeld(longest);
       p < std::min<int64_t>(want_cache.FirstHeld(longest) + 5, c.lengths[longest] - 1); ++p) {
    seq.push_back(static_cast<int32_t>(longest));
    pos.push_back(static_cast<int32_t>(p));
  }
  seq.push_back(0);
  pos.push_back(-1);
  const int64_t rows = static_cast<int64_t>(seq.size());
  std::mt19937 rng(seed + 1);
  std::normal_distribution<float> normal;
  std::vector<float> host(rows * stride, std::numeric_limits<float>::quiet_NaN());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < q_width + 2 * kv_width; ++i) {
      host[r * stride + i] = pos[r] < 0 ? 1e30f : 3.0f * normal(rng);
    }
  }
  cuda::DeviceBuffer<float> want_rows, got_rows;
  cuda::DeviceBuffer<int32_t> dseq, dpos;
  ASSERT_CUDA_OK(Upload(want_rows, host));
  ASSERT_CUDA_OK(Upload(got_rows, host));
  ASSERT_CUDA_OK(Upload(dseq, seq));
  ASSERT_CUDA_OK(Upload(dpos, pos));
  float* const wq = want_rows.get();
  ASSERT_CUDA_OK(
      cuda::ApplyRope(wq, rows, stride, c.n_heads, c.head_dim, dpos.get(), theta, nullptr));
  ASSERT_CUDA_OK(cuda::ApplyRope(wq + q_width, rows, stride, c.n_kv_heads, c.head_dim, dpos.get(),
                                 theta, nullptr));
  ASSERT_CUDA_OK(cuda::KvAppend(wq + q_width, wq + q_width + kv_width, stride, rows, dseq.get(),
                                dpos.get(), want_cache.View(), nullptr));
  float* const gq = got_rows.get();
  ASSERT_CUDA_OK(cuda::RopeKvAppend(gq, gq + q_width, gq + q_width + kv_width, stride, rows,
                                    dseq.get(), dpos.get(), theta, got_cache.Dims(),
                                    got_cache.View(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> want_out, got_out;
  ASSERT_CUDA_OK(Download(want_out, wq, host.size()));
  ASSERT_CUDA_OK(Download(got_out, gq, host.size()));
  const auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  };
  int64_t rotated = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < stride; ++i) {
      const int64_t at = r * stride + i;
      if (i < q_width) {
        ASSERT_EQ(bits(got_out[at]), bits(want_out[at])) << "row " << r << " query " << i;
        rotated += bits(got_out[at]) != bits(host[at]) ? 1 : 0;
      } else {
        ASSERT_EQ(bits(got_out[at]), bits(host[at])) << "row " << r << " column " << i;
      }
    }
  }
  EXPECT_GT(rotated, 0);
  const int64_t arena_elems = want_cache.num_pages() * KvPageElements(kv_width);
  std::vector<uint16_t> want_arena, got_arena, before;
  ASSERT_CUDA_OK(
      Download(want_arena, reinterpret_cast<const uint16_t*>(want_cache.arena()), arena_elems));
  ASSERT_CUDA_OK(
      Download(got_arena, reinterpret_cast<const uint16_t*>(got_cache.arena()), arena_elems));
  int64_t differences = 0;
  for (int64_t i = 0; i < arena_elems; ++i) {
    if (got_arena[i] != want_arena[i]) ++differences;
  }
  EXPECT_EQ(differences, 0) << "of " << arena_elems << " cached values";
  // The append changed the cache (else the comparison above proves nothing).
  PagedCache untouched(c, seed);
  ASSERT_CUDA_OK(untouched.Build());
  ASSERT_CUDA_OK(
      Download(before, reinterpret_cast<const uint16_t*>(untouched.arena()), arena_elems));
  EXPECT_NE(before, got_arena);
}
#endif  // SDM_HAVE_CUDA

TEST(CudaAttentionTest, RopeKvAppendIsTheRopeThenTheAppendBitForBit) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  for (const uint32_t seed : {51u, FreshSeed()}) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    ASSERT_NO_FATAL_FAILURE(CheckRopeKvAppend(TinySwa(), 1e4f, seed));
    ASSERT_NO_FATAL_FAILURE(CheckRopeKvAppend(WindowedGroup3(), 5e5f, seed));
    ASSERT_NO_FATAL_FAILURE(CheckRopeKvAppend(Group16Hd24(), 1e4f, seed));
  }
#endif
}

#if defined(SDM_HAVE_CUDA)
// Attention writing wo's bf16 input itself (AttentionOutput) against the fp32 output then
// FloatToBf16, or MulSigmoidToBf16 with a gate inside wider rows: decode of every sequence's
// last position (several split-K chunks merged for the longer ones, one chunk written by the
// decode kernel for the shorter) plus a sequence at position -1 (nothing visible: zeros), and a
// prefill of 40 positions of the longest sequence; bit for bit.
void CheckBf16Output(PagedCache& cache, uint32_t seed) {
  const Config& c = cache.config();
  const int64_t width = static_cast<int64_t>(c.n_heads) * c.head_dim;
  const int64_t q_stride = width + 8, gate_stride = width + 4;
  const int64_t batch = static_cast<int64_t>(c.lengths.size()) + 1;
  const int64_t tokens = 40;  // of the prefill
  const int64_t rows = std::max(batch, tokens);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> q(rows * width), gate(rows * width);
  for (float& x : q) x = 2.0f * normal(rng);
  for (float& x : gate) x = 3.0f * normal(rng);
  std::vector<int32_t> positions;
  int64_t max_visible = 1;
  for (int64_t len : c.lengths) {
    positions.push_back(static_cast<int32_t>(len - 1));
    max_visible = std::max(max_visible, len - FirstVisiblePosition(len - 1, c.window));
  }
  positions.push_back(-1);
  cuda::DeviceBuffer<float> dq, dgate, dout;
  DecodeScratch dscratch;
  cuda::DeviceBuffer<int32_t> dpos;
  ASSERT_CUDA_OK(Upload(dq, Strided(q, width, q_stride)));
  ASSERT_CUDA_OK(Upload(dgate, Strided(gate, width, gate_stride)));
  ASSERT_CUDA_OK(Upload(dpos, positions));
  ASSERT_CUDA_OK(dout.Allocate(rows * width));
  ASSERT_CUDA_OK(dscratch.Allocate(batch, cache.Dims(), max_visible));
  cuda::DeviceBuffer<__nv_bfloat16> want_plain, want_gated, got_plain, got_gated;
  for (auto* b : {&want_plain, &want_gated, &got_plain, &got_gated}) {
    ASSERT_CUDA_OK(b->Allocate(rows * width));
    ASSERT_CUDA_OK(cudaMemset(b->get(), 0xff, b->bytes()));  // NaN: every output is written
  }
  const auto bf16_bits = [](const cuda::DeviceBuffer<__nv_bfloat16>& b, int64_t n) {
    std::vector<uint16_t> bits;
    EXPECT_EQ(Download(bits, reinterpret_cast<const uint16_t*>(b.get()), n), cudaSuccess);
    return bits;
  };
  // `attend` runs one attention call into the output it is given, over `out_rows` rows: fp32
  // (then converted, plain and gated), bf16 plain, bf16 gated.
  const auto check = [&](int64_t out_rows, const auto& attend) {
    const int64_t n = out_rows * width;
    ASSERT_CUDA_OK(attend(cuda::AttentionOutput{.f32 = dout.get()}));
    ASSERT_CUDA_OK(cuda::FloatToBf16(dout.get(), n, want_plain.get(), nullptr));
    ASSERT_CUDA_OK(cuda::MulSigmoidToBf16(dgate.get(), gate_stride, dout.get(), out_rows, width,
                                          want_gated.get(), nullptr));
    ASSERT_CUDA_OK(attend(cuda::AttentionOutput{.bf16 = got_plain.get()}));
    ASSERT_CUDA_OK(attend(cuda::AttentionOutput{
        .bf16 = got_gated.get(), .gate = dgate.get(), .gate_stride = gate_stride}));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(bf16_bits(got_plain, n), bf16_bits(want_plain, n));
    EXPECT_EQ(bf16_bits(got_gated, n), bf16_bits(want_gated, n));
    EXPECT_NE(bf16_bits(got_gated, n), bf16_bits(got_plain, n));
  };
  // Decode.
  ASSERT_NO_FATAL_FAILURE(check(batch, [&](const cuda::AttentionOutput& out) {
    return cuda::AttentionDecode(dq.get(), q_stride, batch, dpos.get(), max_visible, cache.View(),
                                 cache.Dims(), dscratch.View(), out, nullptr);
  }));
  // Prefill of 40 positions of the longest sequence.
  const int32_t seq = static_cast<int32_t>(std::max_element(c.lengths.begin(), c.lengths.end()) -
                                           c.lengths.begin());
  const int64_t pos0 = c.lengths[seq] - tokens;
  ASSERT_NO_FATAL_FAILURE(check(tokens, [&](const cuda::AttentionOutput& out) {
    return cuda::AttentionPrefill(dq.get(), q_stride, tokens, pos0, seq, cache.View(), cache.Dims(),
                                  out, nullptr);
  }));
}
#endif  // SDM_HAVE_CUDA

TEST(CudaAttentionTest, Bf16OutputIsTheConversionOfTheFp32OutputBitForBit) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  for (const uint32_t seed : {61u, FreshSeed()}) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    // head_dim 16, 64, 24 (the prefill's padded tile) and 256 (eight heads per decode block).
    for (const Config& c : {TinySwa(), WindowedGroup3(), Group16Hd24(), WideGroup8()}) {
      PagedCache cache(c, seed);
      ASSERT_CUDA_OK(cache.Build());
      ASSERT_NO_FATAL_FAILURE(CheckBf16Output(cache, seed + 1));
    }
  }
#endif
}

TEST(CudaAttentionTest, RejectsUnsupportedShapes) {
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  PagedCache cache(TinySwa(), 2);
  ASSERT_CUDA_OK(cache.Build());
  cuda::AttentionDims dims = cache.Dims();
  dims.n_kv_heads = 3;  // 4 heads do not group over 3 kv heads (and kv_width disagrees)
  EXPECT_EQ(cuda::AttentionPrefill(nullptr, 1024, 1, 0, 0, cache.View(), dims, nullptr, nullptr),
            cudaErrorInvalidValue);
  dims = cache.Dims();
  dims.head_dim = 12;  // not a multiple of 8
  EXPECT_EQ(
      cuda::AttentionDecode(nullptr, 1024, 1, nullptr, 1, cache.View(), dims, {}, nullptr, nullptr),
      cudaErrorInvalidValue);
  // Nothing to do is not an error.
  const int64_t q_width = int64_t{cache.Dims().n_heads} * cache.Dims().head_dim;
  EXPECT_EQ(cuda::AttentionPrefill(nullptr, q_width, 0, 0, 0, cache.View(), cache.Dims(), nullptr,
                                   nullptr),
            cudaSuccess);
  EXPECT_EQ(cuda::KvAppend(nullptr, nullptr, cache.View().kv_width, 0, nullptr, nullptr,
                           cache.View(), nullptr),
            cudaSuccess);
  // A query stride below a row of heads, or not a multiple of 4 floats; a KV stride below kv_width.
  EXPECT_EQ(cuda::AttentionPrefill(nullptr, q_width - 8, 1, 0, 0, cache.View(), cache.Dims(),
                                   nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::AttentionDecode(nullptr, q_width + 2, 1, nullptr, 1, cache.View(), cache.Dims(),
                                  {}, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::KvAppend(nullptr, nullptr, cache.View().kv_width - 8, 1, nullptr, nullptr,
                           cache.View(), nullptr),
            cudaErrorInvalidValue);
  // An output with both or neither of f32 and bf16, or a gate stride not a multiple of 4.
  cuda::DeviceBuffer<float> out_f32;
  cuda::DeviceBuffer<__nv_bfloat16> out_bf16;
  ASSERT_CUDA_OK(out_f32.Allocate(2 * q_width));
  ASSERT_CUDA_OK(out_bf16.Allocate(2 * q_width));
  for (const cuda::AttentionOutput& bad :
       {cuda::AttentionOutput{},
        cuda::AttentionOutput{.f32 = out_f32.get(), .bf16 = out_bf16.get()},
        cuda::AttentionOutput{.f32 = out_f32.get(), .gate = out_f32.get(), .gate_stride = q_width},
        cuda::AttentionOutput{
            .bf16 = out_bf16.get(), .gate = out_f32.get(), .gate_stride = q_width + 2}}) {
    EXPECT_EQ(cuda::AttentionPrefill(out_f32.get(), q_width, 1, 0, 0, cache.View(), cache.Dims(),
                                     bad, nullptr),
              cudaErrorInvalidValue);
  }
  // The same call with a valid output runs (the refusals above are the output's).
  ASSERT_CUDA_OK(cudaMemset(out_f32.get(), 0, out_f32.bytes()));
  EXPECT_EQ(cuda::AttentionPrefill(out_f32.get(), q_width, 1, 0, 0, cache.View(), cache.Dims(),
                                   cuda::AttentionOutput{.bf16 = out_bf16.get()}, nullptr),
            cudaSuccess);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  // RopeKvAppend: a stride below a row of query heads, rows not 16-byte aligned.
  cuda::DeviceBuffer<float> rows;
  ASSERT_CUDA_OK(rows.Allocate(4 * q_width));
  float* const q = rows.get();
  EXPECT_EQ(cuda::RopeKvAppend(q, q, q, q_width - 4, 1, nullptr, nullptr, 1e4f, cache.Dims(),
                               cache.View(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::RopeKvAppend(q, q + 2, q, q_width, 1, nullptr, nullptr, 1e4f, cache.Dims(),
                               cache.View(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::RopeKvAppend(q, q, q, q_width, 0, nullptr, nullptr, 1e4f, cache.Dims(),
                               cache.View(), nullptr),
            cudaSuccess);
#endif
}

TEST(CudaAttentionTest, DecodeBandwidth32kBatch64) {
  // The comparison point of docs/model-spec.md §9: baseline_1.4B full attention, batch 64 at 32k
  // context. Reports the KV bytes read per second (no assertion: a measurement for the lead).
  SDM_SKIP_WITHOUT_DEVICE();
#if defined(SDM_HAVE_CUDA)
  const int64_t batch = 64, context = 32768;
  const cuda::AttentionDims dims = {16, 8, 128, 0};
  const int64_t kv_width = 8 * 128;
  const int64_t pages_per_seq = context / kKvPageTokens;
  cuda::DeviceBuffer<__nv_bfloat16> arena;
  if (arena.Allocate(batch * pages_per_seq * KvPageElements(kv_width)) != cudaSuccess) {
    GTEST_SKIP() << "not enough device memory for the 8.6 GB cache";
  }
  ASSERT_CUDA_OK(cudaMemset(arena.get(), 0, arena.bytes()));
  std::vector<cuda::DeviceBuffer<int32_t>> tables(batch);
  std::vector<const int32_t*> ptrs;
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<int32_t> t(pages_per_seq);
    for (int64_t i = 0; i < pages_per_seq; ++i) t[i] = static_cast<int32_t>(i * batch + b);
    ASSERT_CUDA_OK(Upload(tables[b], t));
    ptrs.push_back(tables[b].get());
  }
  cuda::DeviceBuffer<const int32_t*> dptrs;
  ASSERT_CUDA_OK(Upload(dptrs, ptrs));
  cuda::KvLayerView view;
  view.pool = arena.get();
  view.kv_width = kv_width;
  view.page_tables = dptrs.get();
  cuda::DeviceBuffer<float> dq, dout;
  DecodeScratch dscratch;
  cuda::DeviceBuffer<int32_t> dpos;
  ASSERT_CUDA_OK(Upload(dq, std::vector<float>(batch * 16 * 128, 0.5f)));
  ASSERT_CUDA_OK(Upload(dpos, std::vector<int32_t>(batch, static_cast<int32_t>(context - 1))));
  ASSERT_CUDA_OK(dout.Allocate(batch * 16 * 128));
  ASSERT_CUDA_OK(dscratch.Allocate(batch, dims, context));
  cuda::CudaStream stream;
  cuda::CudaEvent start, stop;
  ASSERT_CUDA_OK(stream.Create());
  ASSERT_CUDA_OK(start.Create(/*timing=*/true));
  ASSERT_CUDA_OK(stop.Create(/*timing=*/true));
  auto run = [&] {
    return cuda::AttentionDecode(dq.get(), 16 * 128, batch, dpos.get(), context, view, dims,
                                 dscratch.View(), dout.get(), stream.get());
  };
  ASSERT_CUDA_OK(run());  // warm-up
  const int iters = 10;
  ASSERT_CUDA_OK(cudaEventRecord(start.get(), stream.get()));
  for (int i = 0; i < iters; ++i) ASSERT_CUDA_OK(run());
  ASSERT_CUDA_OK(cudaEventRecord(stop.get(), stream.get()));
  ASSERT_CUDA_OK(cudaEventSynchronize(stop.get()));
  float ms = 0;
  ASSERT_CUDA_OK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
  const double per_call_ms = ms / iters;
  const double bytes = static_cast<double>(arena.bytes());
  const double gbps = bytes / (per_call_ms * 1e-3) / 1e9;
  std::printf("decode 32k x 64 (one layer, %.2f GB of KV): %.3f ms, %.0f GB/s\n", bytes / 1e9,
              per_call_ms, gbps);
  RecordProperty("decode_ms", std::to_string(per_call_ms));
  RecordProperty("decode_gbps", std::to_string(gbps));
  std::vector<float> out;
  ASSERT_CUDA_OK(Download(out, dout.get(), 16 * 128));
  for (float x : out) ASSERT_EQ(x, 0.0f);  // zero values: the output is exactly zero
#endif
}

}  // namespace
}  // namespace sdm::kernels
