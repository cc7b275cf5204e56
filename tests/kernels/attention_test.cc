#include "kernels/cpu/attention.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace sdm::kernels::cpu {
namespace {

// Naive attention in double: query at `pos`, keys/values rows for positions 0..pos.
std::vector<double> Naive(const std::vector<float>& q_head, int64_t head, int64_t pos,
                          const std::vector<float>& k, const std::vector<float>& v,
                          const AttentionShape& s) {
  const int64_t kv = head / (s.n_heads / s.n_kv_heads);
  const int64_t lo = FirstVisiblePosition(pos, s.window);
  std::vector<double> w;
  double mx = -1e300;
  for (int64_t j = lo; j <= pos; ++j) {
    double d = 0;
    for (int64_t c = 0; c < s.head_dim; ++c) {
      d += static_cast<double>(q_head[c]) * k[j * s.row_stride + kv * s.head_dim + c];
    }
    d /= std::sqrt(static_cast<double>(s.head_dim));
    w.push_back(d);
    mx = std::max(mx, d);
  }
  double z = 0;
  for (double& x : w) z += (x = std::exp(x - mx));
  std::vector<double> out(s.head_dim, 0.0);
  for (int64_t j = lo; j <= pos; ++j) {
    for (int64_t c = 0; c < s.head_dim; ++c) {
      out[c] += w[j - lo] / z * v[j * s.row_stride + kv * s.head_dim + c];
    }
  }
  return out;
}

struct Fixture {
  AttentionShape shape;
  int64_t len;
  std::vector<float> k, v, q;  // q: [len, n_heads * head_dim]
  Fixture(int64_t n_heads, int64_t n_kv, int64_t hd, int64_t window, int64_t len_, uint32_t seed)
      : shape{n_heads, n_kv, hd, window, n_kv * hd}, len(len_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    k.resize(len * shape.row_stride);
    v.resize(len * shape.row_stride);
    q.resize(len * n_heads * hd);
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    for (float& x : q) x = normal(rng);
  }
  // Spans of `chunk` rows each, as a paged cache would give them.
  std::vector<KvSpan> Spans(int64_t begin, int64_t end, int64_t chunk) const {
    std::vector<KvSpan> spans;
    for (int64_t p = begin; p < end; p += chunk) {
      const int64_t n = std::min(chunk, end - p);
      spans.push_back({&k[p * shape.row_stride], &v[p * shape.row_stride], p, n});
    }
    return spans;
  }
};

void CheckDecode(const Fixture& f) {
  const int64_t hd = f.shape.head_dim;
  for (int64_t pos = 0; pos < f.len; ++pos) {
    auto spans = f.Spans(FirstVisiblePosition(pos, f.shape.window), pos + 1, 3);
    for (int64_t h = 0; h < f.shape.n_heads; ++h) {
      std::vector<float> qh(&f.q[(pos * f.shape.n_heads + h) * hd],
                            &f.q[(pos * f.shape.n_heads + h + 1) * hd]);
      std::vector<float> out(hd);
      AttendDecodeHead(qh.data(), h, pos, spans, f.shape, out.data());
      auto want = Naive(qh, h, pos, f.k, f.v, f.shape);
      for (int64_t c = 0; c < hd; ++c) ASSERT_NEAR(out[c], want[c], 1e-5) << pos << " " << h;
    }
  }
}

void CheckPrefill(const Fixture& f, int64_t pos0, int64_t span_rows = 5) {
  const int64_t hd = f.shape.head_dim, width = f.shape.n_heads * hd;
  const int64_t t = f.len - pos0;
  auto spans = f.Spans(FirstVisiblePosition(pos0, f.shape.window), f.len, span_rows);
  std::vector<float> out(t * width);
  AttendPrefill(&f.q[pos0 * width], t, pos0, spans, f.shape, out.data());
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t h = 0; h < f.shape.n_heads; ++h) {
      std::vector<float> qh(&f.q[(pos0 + i) * width + h * hd],
                            &f.q[(pos0 + i) * width + (h + 1) * hd]);
      auto want = Naive(qh, h, pos0 + i, f.k, f.v, f.shape);
      for (int64_t c = 0; c < hd; ++c) {
        ASSERT_NEAR(out[i * width + h * hd + c], want[c], 1e-5) << i << " " << h;
      }
    }
  }
}

TEST(AttentionTest, DecodeFullCausal) { CheckDecode(Fixture(4, 4, 8, 0, 13, 1)); }
TEST(AttentionTest, DecodeGroupedQuery) { CheckDecode(Fixture(6, 2, 8, 0, 11, 2)); }
TEST(AttentionTest, DecodeSlidingWindow) { CheckDecode(Fixture(4, 2, 8, 4, 17, 3)); }
TEST(AttentionTest, PrefillFromStart) { CheckPrefill(Fixture(4, 2, 8, 0, 19, 4), 0); }
TEST(AttentionTest, PrefillAfterCachedTokens) { CheckPrefill(Fixture(4, 4, 8, 0, 23, 5), 9); }
TEST(AttentionTest, PrefillSlidingWindow) { CheckPrefill(Fixture(2, 1, 8, 5, 21, 6), 7); }

// Prompts longer than one query tile: tiles past the first start their keys where their first
// query's window does, and spans of 37 rows straddle the tiles' edges.
TEST(AttentionTest, PrefillAcrossQueryTilesFullCausal) {
  CheckPrefill(Fixture(2, 1, 8, 0, kPrefillQueryTile * 2 + 40, 7), 0, 37);
}
TEST(AttentionTest, PrefillAcrossQueryTilesSlidingWindow) {
  CheckPrefill(Fixture(3, 1, 8, 50, kPrefillQueryTile * 3 + 5, 8), 60, 37);
}
TEST(AttentionTest, PrefillWindowWiderThanATile) {
  CheckPrefill(Fixture(2, 2, 8, kPrefillQueryTile + 9, kPrefillQueryTile * 3, 9), 11, 37);
}

// The pool only changes which thread runs a (head, tile) task: the same bits, for a fixed and a
// fresh seed, at several pool sizes.
TEST(AttentionTest, PrefillOnAPoolGivesTheSameBits) {
  for (uint32_t seed : {10u, std::random_device{}()}) {
    SCOPED_TRACE(seed);
    std::mt19937 rng(seed);
    const int64_t window = std::uniform_int_distribution<int64_t>(0, 200)(rng);
    const int64_t len = std::uniform_int_distribution<int64_t>(2, 3 * kPrefillQueryTile + 50)(rng);
    const int64_t pos0 = std::uniform_int_distribution<int64_t>(0, len - 2)(rng);
    const Fixture f(4, 2, 16, window, len, seed);
    const int64_t width = f.shape.n_heads * f.shape.head_dim;
    const int64_t t = len - pos0;
    auto spans = f.Spans(FirstVisiblePosition(pos0, window), len, 29);
    std::vector<float> serial(t * width);
    AttendPrefill(&f.q[pos0 * width], t, pos0, spans, f.shape, serial.data());
    for (int threads : {2, 3}) {
      ThreadPool pool(threads);
      std::vector<float> pooled(t * width, -1.0f);
      AttendPrefill(&f.q[pos0 * width], t, pos0, spans, f.shape, pooled.data(), &pool);
      for (int64_t i = 0; i < t * width; ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(pooled[i]), std::bit_cast<uint32_t>(serial[i]))
            << threads << " threads, value " << i;
      }
    }
  }
}

TEST(AttentionTest, WindowEdgeIsExact) {
  // A window of 3: the query at position 5 sees 3, 4, 5 and not 2. Make key 2 dominate: if it
  // leaked in, the output would be its value.
  AttentionShape s{1, 1, 2, 3, 2};
  std::vector<float> k(6 * 2, 0.0f), v(6 * 2, 0.0f);
  k[2 * 2] = 100.0f;  // key of position 2 matches the query strongly
  v[2 * 2] = 1000.0f;
  for (int p = 3; p < 6; ++p) v[p * 2] = 1.0f;
  std::vector<float> q = {1.0f, 0.0f}, out(2);
  std::vector<KvSpan> spans = {{&k[3 * 2], &v[3 * 2], 3, 3}};
  AttendDecodeHead(q.data(), 0, 5, spans, s, out.data());
  EXPECT_FLOAT_EQ(out[0], 1.0f);
  EXPECT_EQ(FirstVisiblePosition(5, 3), 3);
  EXPECT_EQ(FirstVisiblePosition(2, 3), 0);
  EXPECT_EQ(FirstVisiblePosition(5, 0), 0);
  // Prefill over positions 2..5 (first query at 2 sees 0..2 but spans start at 0).
  std::vector<float> q4(4 * 2, 0.0f), out4(4 * 2);
  for (int i = 0; i < 4; ++i) q4[i * 2] = 1.0f;
  std::vector<KvSpan> all = {{&k[0], &v[0], 0, 6}};
  AttendPrefill(q4.data(), 4, 2, all, s, out4.data());
  EXPECT_NEAR(out4[0 * 2], 1000.0f, 1e-2);  // position 2 sees itself
  EXPECT_NEAR(out4[3 * 2], 1.0f, 1e-5);     // position 5 no longer sees position 2
}

}  // namespace
}  // namespace sdm::kernels::cpu
