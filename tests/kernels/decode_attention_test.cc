// AttendDecodeBatch: equal to a double-precision reference and to the per-head kernel
// (AttendDecodeHead) within float rounding, over windows, GQA groups, odd head dims, ring wrap and
// many split-K blocks; and bit for bit the same output for a query whatever its batch, the thread
// count and the cut of its rows into spans. Over bf16 rows: bit for bit the fp32 kernel over the
// rounded rows, with the same invariance.
#include "kernels/cpu/decode_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <memory>
#include <random>
#include <vector>

#include "base/bf16.h"
#include "gtest/gtest.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/gemm_isa.h"
#include "kernels/cpu/parallel.h"

namespace sdm::kernels::cpu {
namespace {

// A session's cache: positions [0, len) stored in `capacity` ring slots (capacity == 0: no ring,
// every position kept), rows of n_kv_heads * head_dim floats; queries of every position.
struct Cache {
  AttentionShape shape;
  int64_t len;
  int64_t capacity;
  std::vector<float> k, v, q;

  Cache(int64_t n_heads, int64_t n_kv, int64_t hd, int64_t window, int64_t len_, int64_t capacity_,
        uint32_t seed, float q_scale = 1.0f)
      : shape{n_heads, n_kv, hd, window, n_kv * hd}, len(len_), capacity(capacity_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    const int64_t slots = capacity > 0 ? capacity : len;
    k.assign(slots * shape.row_stride, 0.0f);
    v.assign(slots * shape.row_stride, 0.0f);
    q.resize(len * n_heads * hd);
    for (float& x : q) x = q_scale * normal(rng);
    // Written in position order, so a ring keeps the last `capacity` positions.
    for (int64_t p = 0; p < len; ++p) {
      for (int64_t c = 0; c < shape.row_stride; ++c) {
        k[Slot(p) * shape.row_stride + c] = normal(rng);
        v[Slot(p) * shape.row_stride + c] = normal(rng);
      }
    }
  }
  int64_t Slot(int64_t p) const { return capacity > 0 ? p % capacity : p; }
  const float* K(int64_t p) const { return &k[Slot(p) * shape.row_stride]; }
  const float* V(int64_t p) const { return &v[Slot(p) * shape.row_stride]; }
  const float* Q(int64_t p) const { return &q[p * shape.n_heads * shape.head_dim]; }

  // Spans over [FirstVisiblePosition(pos), pos], at most `chunk` rows each and cut at the ring's
  // wrap, as KvCache::ForEachSpan gives them.
  std::vector<KvSpan> Spans(int64_t pos, int64_t chunk) const {
    std::vector<KvSpan> spans;
    int64_t p = FirstVisiblePosition(pos, shape.window);
    while (p <= pos) {
      int64_t n = std::min(chunk, pos + 1 - p);
      if (capacity > 0) n = std::min(n, capacity - Slot(p));
      spans.push_back({K(p), V(p), p, n});
      p += n;
    }
    return spans;
  }

  // Attention of every head of the query at `pos` in double.
  std::vector<double> Reference(int64_t pos) const {
    const int64_t hd = shape.head_dim, group = shape.n_heads / shape.n_kv_heads;
    const int64_t lo = FirstVisiblePosition(pos, shape.window);
    std::vector<double> out(shape.n_heads * hd, 0.0);
    for (int64_t h = 0; h < shape.n_heads; ++h) {
      const int64_t off = (h / group) * hd;
      std::vector<double> s;
      double mx = -1e300;
      for (int64_t j = lo; j <= pos; ++j) {
        double d = 0;
        for (int64_t c = 0; c < hd; ++c) d += double{Q(pos)[h * hd + c]} * K(j)[off + c];
        s.push_back(d / std::sqrt(static_cast<double>(hd)));
        mx = std::max(mx, s.back());
      }
      double z = 0;
      for (double& x : s) z += (x = std::exp(x - mx));
      for (int64_t j = lo; j <= pos; ++j) {
        for (int64_t c = 0; c < hd; ++c) out[h * hd + c] += s[j - lo] / z * V(j)[off + c];
      }
    }
    return out;
  }

  std::vector<float> Blocked(int64_t pos, int64_t chunk, ThreadPool* pool) const {
    std::vector<float> out(shape.n_heads * shape.head_dim, -1.0f);
    auto spans = Spans(pos, chunk);
    const DecodeQuery query{Q(pos), pos, spans, out.data()};
    AttendDecodeBatch({&query, 1}, shape, pool);
    return out;
  }

  // The same cache stored as bf16 (k16, v16) and as the fp32 values bf16 holds (k_round,
  // v_round).
  void MakeBf16() {
    k16.resize(k.size());
    v16.resize(v.size());
    FloatsToBf16(k.data(), static_cast<int64_t>(k.size()), k16.data());
    FloatsToBf16(v.data(), static_cast<int64_t>(v.size()), v16.data());
    k_round.resize(k.size());
    v_round.resize(v.size());
    Bf16ToFloats(k16.data(), static_cast<int64_t>(k.size()), k_round.data());
    Bf16ToFloats(v16.data(), static_cast<int64_t>(v.size()), v_round.data());
  }
  std::vector<uint16_t> k16, v16;
  std::vector<float> k_round, v_round;

  // The blocked kernel over the bf16 copy, and over the rounded fp32 copy.
  std::vector<float> BlockedBf16(int64_t pos, int64_t chunk, ThreadPool* pool) const {
    std::vector<float> out(shape.n_heads * shape.head_dim, -1.0f);
    std::vector<KvSpanBf16> spans;
    for (const KvSpan& s : Spans(pos, chunk)) {
      const int64_t off = s.k - k.data();
      spans.push_back({&k16[off], &v16[off], s.first_pos, s.count});
    }
    const DecodeQueryBf16 query{Q(pos), pos, spans, out.data()};
    AttendDecodeBatch({&query, 1}, shape, pool);
    return out;
  }
  std::vector<float> BlockedRounded(int64_t pos, int64_t chunk, ThreadPool* pool) const {
    std::vector<float> out(shape.n_heads * shape.head_dim, -1.0f);
    std::vector<KvSpan> spans;
    for (const KvSpan& s : Spans(pos, chunk)) {
      const int64_t off = s.k - k.data();
      spans.push_back({&k_round[off], &v_round[off], s.first_pos, s.count});
    }
    const DecodeQuery query{Q(pos), pos, spans, out.data()};
    AttendDecodeBatch({&query, 1}, shape, pool);
    return out;
  }

  std::vector<float> PerHead(int64_t pos) const {
    const int64_t hd = shape.head_dim;
    std::vector<float> out(shape.n_heads * hd);
    auto spans = Spans(pos, KvCacheLikeChunk());
    for (int64_t h = 0; h < shape.n_heads; ++h) {
      AttendDecodeHead(Q(pos) + h * hd, h, pos, spans, shape, &out[h * hd]);
    }
    return out;
  }
  static int64_t KvCacheLikeChunk() { return 256; }
};

// Blocked output against the double reference and the per-head kernel at the given positions.
void CheckAgainstReferences(const Cache& c, const std::vector<int64_t>& positions, int64_t chunk) {
  ThreadPool pool(2);
  for (int64_t pos : positions) {
    SCOPED_TRACE(::testing::Message() << "pos " << pos << " chunk " << chunk);
    const std::vector<float> got = c.Blocked(pos, chunk, &pool);
    const std::vector<double> want = c.Reference(pos);
    const std::vector<float> per_head = c.PerHead(pos);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 2e-5 * (1.0 + std::abs(want[i]))) << "element " << i;
      ASSERT_NEAR(got[i], per_head[i], 2e-5 * (1.0 + std::abs(want[i]))) << "element " << i;
    }
  }
}

// Every position of a short sequence, and positions around block edges of a long one.
std::vector<int64_t> AllPositions(int64_t len) {
  std::vector<int64_t> p;
  for (int64_t i = 0; i < len; ++i) p.push_back(i);
  return p;
}
std::vector<int64_t> EdgePositions(int64_t len) {
  std::vector<int64_t> p;
  for (int64_t b = kDecodeBlock; b < len; b += 3 * kDecodeBlock) {
    for (int64_t i : {b - 2, b - 1, b, b + 1, b + 5}) {
      if (i < len) p.push_back(i);
    }
  }
  p.push_back(len - 1);
  return p;
}

TEST(DecodeAttentionTest, FullCausalMultiHead) {
  CheckAgainstReferences(Cache(4, 4, 8, 0, 21, 0, 1), AllPositions(21), 3);
}

TEST(DecodeAttentionTest, GroupedQueryHeads) {
  CheckAgainstReferences(Cache(6, 2, 16, 0, 300, 0, 2), EdgePositions(300), 7);
  CheckAgainstReferences(Cache(8, 1, 8, 0, 140, 0, 3), EdgePositions(140), 256);
}

TEST(DecodeAttentionTest, OddHeadDims) {
  for (int64_t hd : {int64_t{1}, int64_t{5}, int64_t{13}, int64_t{20}, int64_t{67}}) {
    SCOPED_TRACE(::testing::Message() << "head_dim " << hd);
    CheckAgainstReferences(Cache(4, 2, hd, 0, 270, 0, 4 + static_cast<uint32_t>(hd)),
                           EdgePositions(270), 5);
  }
}

TEST(DecodeAttentionTest, SlidingWindow) {
  // Windows shorter than, equal to and not a multiple of the block; full cache (no ring).
  for (int64_t w : {int64_t{1}, int64_t{4}, kDecodeBlock, kDecodeBlock + 37, 3 * kDecodeBlock}) {
    SCOPED_TRACE(::testing::Message() << "window " << w);
    CheckAgainstReferences(Cache(4, 2, 8, w, 700, 0, 11), EdgePositions(700), 64);
  }
}

// Positions whose whole window a ring still holds: [len - capacity + window - 1, len).
std::vector<int64_t> HeldPositions(const Cache& c) {
  std::vector<int64_t> p;
  const int64_t lo = std::max<int64_t>(0, c.len - c.capacity + c.shape.window - 1);
  for (int64_t i = c.len - 1; i >= lo; i -= 7) p.push_back(i);
  return p;
}

TEST(DecodeAttentionTest, RingWrap) {
  // A ring of window + 50 slots (not a multiple of the block), so spans break at the wrap inside
  // blocks; lengths put the wrap at different places.
  const int64_t w = 200;
  for (int64_t len : {230, 251, 260, 333, 1024, 1500}) {
    SCOPED_TRACE(::testing::Message() << "len " << len);
    Cache c(4, 2, 12, w, len, w + 50, 12);
    CheckAgainstReferences(c, HeldPositions(c), 256);
  }
}

TEST(DecodeAttentionTest, ManySplitKBlocks) {
  // 40 blocks merged; queries scaled up so each block's maximum differs widely from the others'
  // and most weights underflow against the global maximum.
  const int64_t len = 40 * kDecodeBlock + 17;
  CheckAgainstReferences(Cache(2, 1, 32, 0, len, 0, 13), {len - 1, len - 18}, 256);
  CheckAgainstReferences(Cache(2, 1, 32, 0, len, 0, 14, /*q_scale=*/8.0f), {len - 1}, 256);
}

TEST(DecodeAttentionTest, DominantKeyInALateBlock) {
  // One key matches the query far better than the rest: the merged output is its value.
  Cache c(1, 1, 4, 0, 5 * kDecodeBlock, 0, 15);
  const int64_t pos = c.len - 1, star = 3 * kDecodeBlock + 9;
  for (int64_t i = 0; i < 4; ++i) {
    c.q[pos * 4 + i] = i == 0 ? 1.0f : 0.0f;
    c.k[star * 4 + i] = i == 0 ? 200.0f : 0.0f;
    c.v[star * 4 + i] = 1000.0f + static_cast<float>(i);
  }
  const std::vector<float> got = c.Blocked(pos, 256, nullptr);
  for (int64_t i = 0; i < 4; ++i) EXPECT_FLOAT_EQ(got[i], 1000.0f + static_cast<float>(i));
}

// A query's bits depend on nothing but the query: not the span cut, the thread count or the batch.
void CheckInvariance(uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t w = std::uniform_int_distribution<int64_t>(0, 1)(rng) ? 0 : 150;
  const int64_t len = std::uniform_int_distribution<int64_t>(1, 900)(rng);
  Cache c(4, 2, std::uniform_int_distribution<int64_t>(3, 40)(rng), w, len, w > 0 ? w + 70 : 0,
          seed);
  const int64_t pos = len - 1;
  const std::vector<float> alone = c.Blocked(pos, 256, nullptr);
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    for (int64_t chunk : {1, 3, 128, 1000}) {
      EXPECT_EQ(c.Blocked(pos, chunk, &pool), alone) << threads << " threads, chunk " << chunk;
    }
  }
  // In a batch with other sessions' queries (earlier positions of the same cache), in either order.
  ThreadPool pool(2);
  const int64_t others = std::min<int64_t>(pos, 5);
  std::vector<std::vector<KvSpan>> spans;
  std::vector<std::vector<float>> outs;
  for (int64_t i = 0; i <= others; ++i) {
    spans.push_back(c.Spans(pos - i, 64));
    outs.emplace_back(c.shape.n_heads * c.shape.head_dim);
  }
  std::vector<DecodeQuery> batch;
  for (int64_t i = others; i >= 0; --i) {
    batch.push_back({c.Q(pos - i), pos - i, spans[i], outs[i].data()});
  }
  AttendDecodeBatch(batch, c.shape, &pool);
  EXPECT_EQ(outs[0], alone);
  for (int64_t i = 1; i <= others; ++i) EXPECT_EQ(outs[i], c.Blocked(pos - i, 256, nullptr));
}

TEST(DecodeAttentionTest, BatchThreadAndSpanInvarianceFixedSeeds) {
  for (uint32_t seed : {1u, 2u, 3u, 4u, 5u, 6u}) CheckInvariance(seed);
}

TEST(DecodeAttentionTest, BatchThreadAndSpanInvarianceFreshSeeds) {
  const uint32_t fresh = std::random_device{}();
  for (uint32_t i = 0; i < 4; ++i) CheckInvariance(fresh + i);
}

TEST(DecodeAttentionTest, ReferencesFreshSeeds) {
  const uint32_t fresh = std::random_device{}();
  std::mt19937 rng(fresh);
  SCOPED_TRACE(::testing::Message() << "seed " << fresh);
  const int64_t kv = std::uniform_int_distribution<int64_t>(1, 3)(rng);
  const int64_t heads = kv * std::uniform_int_distribution<int64_t>(1, 3)(rng);
  const int64_t hd = std::uniform_int_distribution<int64_t>(1, 48)(rng);
  const int64_t w = std::uniform_int_distribution<int64_t>(0, 1)(rng)
                        ? 0
                        : std::uniform_int_distribution<int64_t>(1, 400)(rng);
  const int64_t len = std::uniform_int_distribution<int64_t>(1, 1200)(rng);
  const int64_t ring = w > 0 ? w + std::uniform_int_distribution<int64_t>(0, 100)(rng) : 0;
  Cache c(heads, kv, hd, w, len, ring, fresh);
  CheckAgainstReferences(c, ring > 0 ? HeldPositions(c) : EdgePositions(len),
                         std::uniform_int_distribution<int64_t>(1, 300)(rng));
}

// bf16 rows: the fp32 kernel's bits on the rounded rows, whatever the threads, span cut and
// batch; and within bf16 rounding of the fp32 rows' output.
void CheckBf16(uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t w = std::uniform_int_distribution<int64_t>(0, 1)(rng) ? 0 : 150;
  const int64_t len = std::uniform_int_distribution<int64_t>(1, 900)(rng);
  const int64_t hd = std::uniform_int_distribution<int64_t>(3, 40)(rng);
  Cache c(4, 2, hd, w, len, w > 0 ? w + 70 : 0, seed);
  c.MakeBf16();
  const int64_t pos = len - 1;
  const std::vector<float> want = c.BlockedRounded(pos, 256, nullptr);
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    for (int64_t chunk : {1, 3, 128, 1000}) {
      EXPECT_EQ(c.BlockedBf16(pos, chunk, &pool), want) << threads << " threads, chunk " << chunk;
    }
  }
  // In a batch with other queries, in reverse order.
  ThreadPool pool(2);
  const int64_t others = std::min<int64_t>(pos, 4);
  std::vector<std::vector<KvSpanBf16>> spans(others + 1);
  std::vector<std::vector<float>> outs;
  std::vector<DecodeQueryBf16> batch;
  for (int64_t i = 0; i <= others; ++i) {
    for (const KvSpan& s : c.Spans(pos - i, 64)) {
      const int64_t off = s.k - c.k.data();
      spans[i].push_back({&c.k16[off], &c.v16[off], s.first_pos, s.count});
    }
    outs.emplace_back(c.shape.n_heads * c.shape.head_dim);
  }
  for (int64_t i = others; i >= 0; --i) {
    batch.push_back({c.Q(pos - i), pos - i, spans[i], outs[i].data()});
  }
  AttendDecodeBatch(batch, c.shape, &pool);
  EXPECT_EQ(outs[0], want);
  for (int64_t i = 1; i <= others; ++i) EXPECT_EQ(outs[i], c.BlockedRounded(pos - i, 256, nullptr));
  // Against the exact rows: bf16 keeps 8 significant bits (relative error <= 2^-9 per value).
  const std::vector<double> exact = c.Reference(pos);
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(want[i], exact[i], 0.05 * (1.0 + std::abs(exact[i]))) << "element " << i;
  }
}

TEST(DecodeAttentionTest, Bf16RowsAreTheFp32KernelOnRoundedRows) {
  for (uint32_t seed : {1u, 2u, 3u, 4u}) CheckBf16(seed);
  const uint32_t fresh = std::random_device{}();
  CheckBf16(fresh);
  CheckBf16(fresh + 1);
}

// Every instruction set's loops (AVX2 and, where this build and CPU have it, AVX-512 with two heads
// of a KV group per register) give the same bits, fp32 and bf16 rows: groups of 1 to 4 heads per
// KV head (odd groups leave a head unpaired), head dims around the 8- and 16-lane widths, windows,
// ring wrap, blocks cut by spans, row groups with a tail. Fixed seeds plus a fresh one.
void CheckIsasAgree(uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const int64_t kv = pick(1, 3);
  const int64_t group = pick(1, 4);
  const std::vector<int64_t> dims = {1, 7, 8, 9, 15, 16, 17, 24, 31, 33, 64, 128};
  const int64_t hd = dims[pick(0, static_cast<int64_t>(dims.size()) - 1)];
  const int64_t w = pick(0, 1) ? 0 : pick(1, 300);
  const int64_t len = pick(1, 700);
  const int64_t ring = w > 0 && pick(0, 1) ? w + pick(0, 90) : 0;
  SCOPED_TRACE(::testing::Message() << kv * group << " heads on " << kv << ", head_dim " << hd
                                    << ", window " << w << ", len " << len << ", ring " << ring);
  Cache c(kv * group, kv, hd, w, len, ring, seed);
  c.MakeBf16();
  const int64_t chunk = pick(1, 300);
  ThreadPool pool(2);
  for (int64_t pos : ring > 0 ? HeldPositions(c) : EdgePositions(len)) {
    const std::vector<KvSpan> spans = c.Spans(pos, chunk);
    std::vector<KvSpanBf16> spans16;
    for (const KvSpan& s : spans) {
      const int64_t off = s.k - c.k.data();
      spans16.push_back({&c.k16[off], &c.v16[off], s.first_pos, s.count});
    }
    const int64_t width = c.shape.n_heads * hd;
    std::vector<float> base(width, -1.0f), base16(width, -1.0f);
    const DecodeQuery q{c.Q(pos), pos, spans, base.data()};
    const DecodeQueryBf16 q16{c.Q(pos), pos, spans16, base16.data()};
    AttendDecodeBatch({&q, 1}, c.shape, &pool, GemmIsa::kAvx2);
    AttendDecodeBatch({&q16, 1}, c.shape, &pool, GemmIsa::kAvx2);
    for (GemmIsa isa : AvailableGemmIsas()) {
      std::vector<float> out(width, -2.0f), out16(width, -2.0f);
      const DecodeQuery qi{c.Q(pos), pos, spans, out.data()};
      const DecodeQueryBf16 qi16{c.Q(pos), pos, spans16, out16.data()};
      AttendDecodeBatch({&qi, 1}, c.shape, &pool, isa);
      AttendDecodeBatch({&qi16, 1}, c.shape, &pool, isa);
      ASSERT_EQ(out, base) << GemmIsaName(isa) << " pos " << pos;
      ASSERT_EQ(out16, base16) << GemmIsaName(isa) << " bf16, pos " << pos;
    }
  }
  // And the wide loops are what they claim: within rounding of the double reference.
  const std::vector<double> want = c.Reference(len - 1);
  const std::vector<float> got = c.Blocked(len - 1, chunk, &pool);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 2e-5 * (1.0 + std::abs(want[i]))) << "element " << i;
  }
}

TEST(DecodeAttentionTest, EveryInstructionSetGivesTheSameBits) {
  std::cout << "active instruction set: " << GemmIsaName() << "\n";
  for (uint32_t seed = 1; seed <= 24; ++seed) CheckIsasAgree(seed);
  const uint32_t fresh = std::random_device{}();
  for (uint32_t i = 0; i < 4; ++i) CheckIsasAgree(fresh + i);
}

// Flagship-like widths through the engine's default entry point (the active instruction set):
// 16 heads on 8 KV heads and plain multi-head at head_dim 128, against the AVX2 loops bit for bit.
TEST(DecodeAttentionTest, FlagshipWidthsMatchTheAvx2Loops) {
  for (int64_t group : {1, 2}) {
    Cache c(8 * group, 8, 128, 0, 2 * kDecodeBlock + 11, 0, 40 + static_cast<uint32_t>(group));
    ThreadPool pool(2);
    const int64_t pos = c.len - 1;
    const std::vector<KvSpan> spans = c.Spans(pos, 256);
    std::vector<float> active(c.shape.n_heads * 128), avx2(c.shape.n_heads * 128);
    const DecodeQuery qa{c.Q(pos), pos, spans, active.data()};
    const DecodeQuery qb{c.Q(pos), pos, spans, avx2.data()};
    AttendDecodeBatch({&qa, 1}, c.shape, &pool);
    AttendDecodeBatch({&qb, 1}, c.shape, &pool, GemmIsa::kAvx2);
    EXPECT_EQ(active, avx2) << "group " << group;
  }
}

}  // namespace
}  // namespace sdm::kernels::cpu
