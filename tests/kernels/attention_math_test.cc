// The host/device math of kernels/common/attention_math.h (split-K softmax merge, the causal
// window, decode chunking) and the index math of kernels/common/device_layout.h, on the CPU.
#include "kernels/common/attention_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/common/device_layout.h"

namespace sdm::kernels {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// A partial state with its accumulator row.
struct Partial {
  SoftmaxState st = EmptySoftmaxState();
  std::vector<float> acc;
};

// The state of keys [begin, end) (scores in log2 units), built the way the decode kernel builds
// it: tiles of `tile` keys, each rescaling the state to the tile's maximum, then adding weights.
Partial Reduce(const std::vector<float>& s, const std::vector<float>& v, int64_t dim, int64_t begin,
               int64_t end, int64_t tile) {
  Partial p;
  p.acc.assign(dim, 0.0f);
  for (int64_t t = begin; t < end; t += tile) {
    const int64_t te = std::min(end, t + tile);
    float m_new = p.st.m;
    for (int64_t j = t; j < te; ++j) m_new = std::max(m_new, s[j]);
    const float scale = SoftmaxRescale(p.st.m, m_new);
    p.st = {m_new, p.st.l * scale};
    for (float& a : p.acc) a *= scale;
    for (int64_t j = t; j < te; ++j) {
      const float w = SoftmaxWeight(s[j], m_new);
      p.st.l += w;
      for (int64_t d = 0; d < dim; ++d) p.acc[d] += w * v[j * dim + d];
    }
  }
  return p;
}

Partial Merge(const Partial& a, const Partial& b) {
  const SoftmaxMerge mg = MergeSoftmaxStates(a.st, b.st);
  Partial r;
  r.st = mg.state;
  r.acc.resize(a.acc.size());
  for (size_t d = 0; d < a.acc.size(); ++d) {
    r.acc[d] = a.acc[d] * mg.scale_a + b.acc[d] * mg.scale_b;
  }
  return r;
}

// softmax(s) . v in double, with s in log2 units; -inf scores are masked. Empty: zeros.
std::vector<double> Reference(const std::vector<float>& s, const std::vector<float>& v,
                              int64_t dim) {
  double mx = -std::numeric_limits<double>::infinity();
  for (float x : s) mx = std::max(mx, static_cast<double>(x));
  std::vector<double> out(dim, 0.0);
  if (mx == -std::numeric_limits<double>::infinity()) return out;
  double z = 0;
  for (size_t j = 0; j < s.size(); ++j) {
    const double w = std::exp2(s[j] - mx);
    z += w;
    for (int64_t d = 0; d < dim; ++d) out[d] += w * v[j * dim + d];
  }
  for (double& o : out) o /= z;
  return out;
}

// The merged result must equal the unsplit softmax-weighted sum. fp32 states against a double
// reference: weights carry ~1e-7 relative error per operation, sums of <= 300 terms ~1e-5 at
// worst, outputs are convex combinations of values of size ~1-3.
void ExpectMatches(const Partial& p, const std::vector<double>& want) {
  for (size_t d = 0; d < want.size(); ++d) {
    const float got = SoftmaxFinish(p.acc[d], p.st.l);
    ASSERT_FALSE(std::isnan(got));
    ASSERT_NEAR(got, want[d], 2e-5 * (1 + std::abs(want[d]))) << "dim " << d;
  }
}

void CheckSplits(uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const int64_t dim = 5;
  for (int64_t n : {1, 2, 7, 64, 300}) {
    std::vector<float> s(n), v(n * dim);
    for (float& x : s) x = 4 * normal(rng);  // peaky: a wrong rescale shows at once
    for (float& x : v) x = normal(rng);
    // Mask some keys the way the kernels do (outside the window, past the chunk).
    for (int64_t j = 0; j < n; j += 5) s[j] = -kInf;
    const std::vector<double> want = Reference(s, v, dim);
    // The unsplit reduction, key by key and in tiles.
    ExpectMatches(Reduce(s, v, dim, 0, n, 1), want);
    ExpectMatches(Reduce(s, v, dim, 0, n, 4), want);
    // Every two-way split point, including the empty halves at 0 and n.
    for (int64_t cut = 0; cut <= n; ++cut) {
      const Partial a = Reduce(s, v, dim, 0, cut, 3);
      const Partial b = Reduce(s, v, dim, cut, n, 3);
      ExpectMatches(Merge(a, b), want);
      ExpectMatches(Merge(b, a), want);  // order does not matter
    }
    // Random multi-way splits folded left to right from the empty state, as the merge kernel
    // does; some chunks empty.
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<int64_t> cuts = {0, n};
      std::uniform_int_distribution<int64_t> pick(0, n);
      for (int c = 0; c < 5; ++c) cuts.push_back(pick(rng));
      std::sort(cuts.begin(), cuts.end());
      Partial acc;
      acc.acc.assign(dim, 0.0f);
      for (size_t c = 0; c + 1 < cuts.size(); ++c) {
        acc = Merge(acc, Reduce(s, v, dim, cuts[c], cuts[c + 1], 2));
      }
      ExpectMatches(acc, want);
    }
  }
}

TEST(AttentionMathTest, MergedPartialsEqualUnsplitSoftmax) { CheckSplits(7); }

TEST(AttentionMathTest, MergedPartialsEqualUnsplitSoftmaxFreshSeed) {
  CheckSplits(std::random_device{}());
}

TEST(AttentionMathTest, EmptyAndMaskedStatesNeverProduceNan) {
  const SoftmaxState empty = EmptySoftmaxState();
  EXPECT_EQ(empty.m, -kInf);
  EXPECT_EQ(empty.l, 0.0f);
  // Two empty states merge into an empty state with zero factors (no -inf - -inf).
  SoftmaxMerge mg = MergeSoftmaxStates(empty, empty);
  EXPECT_EQ(mg.state.m, -kInf);
  EXPECT_EQ(mg.state.l, 0.0f);
  EXPECT_EQ(mg.scale_a, 0.0f);
  EXPECT_EQ(mg.scale_b, 0.0f);
  EXPECT_EQ(SoftmaxFinish(0.0f, 0.0f), 0.0f);
  // Empty with a real state: the real one passes through unchanged.
  mg = MergeSoftmaxStates(empty, {1.5f, 3.0f});
  EXPECT_EQ(mg.state.m, 1.5f);
  EXPECT_EQ(mg.state.l, 3.0f);
  EXPECT_EQ(mg.scale_a, 0.0f);
  EXPECT_EQ(mg.scale_b, 1.0f);
  // A tile of masked scores on an empty state leaves it empty.
  EXPECT_EQ(SoftmaxRescale(-kInf, -kInf), 0.0f);
  EXPECT_EQ(SoftmaxWeight(-kInf, -kInf), 0.0f);
  EXPECT_EQ(SoftmaxWeight(-kInf, 2.0f), 0.0f);
  // The two-key example by hand: scores 0 and 1 (log2 units) give weights 1/3 and 2/3.
  mg = MergeSoftmaxStates({0.0f, 1.0f}, {1.0f, 1.0f});
  EXPECT_EQ(mg.state.m, 1.0f);
  EXPECT_FLOAT_EQ(mg.state.l, 1.5f);
  EXPECT_FLOAT_EQ(mg.scale_a / mg.state.l, 1.0f / 3.0f);
  EXPECT_FLOAT_EQ(mg.scale_b / mg.state.l, 2.0f / 3.0f);
  // Masked scores inside a chunk: the result over all-masked keys is exactly zero.
  const std::vector<float> s(4, -kInf), v(4, 1.0f);
  const Partial p = Reduce(s, v, 1, 0, 4, 2);
  EXPECT_EQ(p.st.l, 0.0f);
  EXPECT_EQ(SoftmaxFinish(p.acc[0], p.st.l), 0.0f);
}

TEST(AttentionMathTest, FirstVisiblePosition) {
  EXPECT_EQ(FirstVisiblePosition(0, 0), 0);
  EXPECT_EQ(FirstVisiblePosition(12345, 0), 0);  // full attention sees everything
  EXPECT_EQ(FirstVisiblePosition(0, 1), 0);      // a window of 1 sees only itself
  EXPECT_EQ(FirstVisiblePosition(9, 1), 9);
  EXPECT_EQ(FirstVisiblePosition(2, 3), 0);  // window not yet full: clamps at 0
  EXPECT_EQ(FirstVisiblePosition(3, 3), 1);  // first position that drops a key
  EXPECT_EQ(FirstVisiblePosition(5, 3), 3);
  EXPECT_EQ(FirstVisiblePosition(1023, 1024), 0);
  EXPECT_EQ(FirstVisiblePosition(1024, 1024), 1);
  const int64_t big = int64_t{1} << 40;
  EXPECT_EQ(FirstVisiblePosition(big, 1024), big - 1023);
  // The definition: p - j < window for every visible j, and the key before the first is out.
  for (int64_t w = 1; w < 10; ++w) {
    for (int64_t p = 0; p < 30; ++p) {
      const int64_t f = FirstVisiblePosition(p, w);
      EXPECT_LT(p - f, w);
      if (f > 0) {
        EXPECT_EQ(p - (f - 1), w);
      }
    }
  }
}

TEST(AttentionMathTest, DecodeChunksTileTheVisibleRange) {
  const int64_t split = 512;
  EXPECT_EQ(DecodeChunkCount(0, split, 64), 0);
  EXPECT_EQ(DecodeChunkCount(-3, split, 64), 0);
  EXPECT_EQ(DecodeChunkCount(1, split, 64), 1);
  EXPECT_EQ(DecodeChunkCount(512, split, 64), 1);
  EXPECT_EQ(DecodeChunkCount(513, split, 64), 2);
  EXPECT_EQ(DecodeChunkCount(32768, split, 64), 64);  // 32k context: 64 chunks
  EXPECT_EQ(DecodeChunkCount(32769, split, 64), 64);  // capped by the grid
  for (int64_t first : {0, 5, 700}) {
    for (int64_t visible : {1, 2, 511, 512, 513, 1024, 1500, 5000}) {
      for (int64_t max_chunks : {1, 2, 3, 64}) {
        const int64_t last = first + visible - 1;
        const int64_t chunks = DecodeChunkCount(visible, split, max_chunks);
        ASSERT_GE(chunks, 1);
        ASSERT_LE(chunks, max_chunks);
        int64_t next = first;
        for (int64_t c = 0; c < chunks; ++c) {
          const PositionRange r = DecodeChunkRange(first, last, c, chunks, split);
          ASSERT_EQ(r.begin, next);
          ASSERT_GT(r.end, r.begin);
          if (c + 1 < chunks) {
            ASSERT_EQ(r.end - r.begin, split);
          }
          next = r.end;
        }
        ASSERT_EQ(next, last + 1) << first << " " << visible << " " << max_chunks;
      }
    }
  }
}

// The decode grid (kernels/cuda/attention.cu sizes it with DecodeGridChunkCount) is exactly the
// largest chunk count any query below max_visible needs: no query truncated (its chunk count
// below the grid is its own ceil(visible / split)), and for a sliding window the grid does not
// grow with the context (a 128k context with a 4k window: 8 chunks, not 256).
TEST(AttentionMathTest, DecodeGridIsClampedToTheWindow) {
  const int64_t split = 512;
  EXPECT_EQ(DecodeGridChunkCount(131072, 0, split), 256);
  EXPECT_EQ(DecodeGridChunkCount(131072, 4096, split), 8);
  EXPECT_EQ(DecodeGridChunkCount(131072, 4097, split), 9);
  EXPECT_EQ(DecodeGridChunkCount(1000, 4096, split), 2);  // the context is the bound
  EXPECT_EQ(DecodeGridChunkCount(1, 64, split), 1);
  EXPECT_EQ(DecodeGridChunkCount(0, 0, split), 1);
  for (int64_t window : {0, 1, 7, 511, 512, 513, 1500}) {
    for (int64_t max_visible : {1, 2, 511, 512, 513, 1024, 2000, 5000}) {
      const int64_t grid = DecodeGridChunkCount(max_visible, window, split);
      int64_t need = 1;
      for (int64_t pos = 0; pos < max_visible; ++pos) {
        const int64_t visible = pos - FirstVisiblePosition(pos, window) + 1;
        const int64_t own = (visible + split - 1) / split;
        ASSERT_EQ(DecodeChunkCount(visible, split, grid), own)
            << "window " << window << " max_visible " << max_visible << " pos " << pos;
        need = std::max(need, own);
      }
      ASSERT_EQ(grid, need) << "window " << window << " max_visible " << max_visible;
    }
  }
}

// A graph's grid bound (DecodeGraphVisible) covers the exact one, grows in few steps (one bound
// per power of two of chunks: a graph serves many steps of a growing context), and gives every
// query below the exact bound the chunk count the exact grid gives it, with the same window.
TEST(AttentionMathTest, DecodeGraphVisibleKeepsEveryQuerysChunks) {
  const int64_t split = 512;
  EXPECT_EQ(DecodeGraphVisible(1, split), split);
  EXPECT_EQ(DecodeGraphVisible(512, split), split);
  EXPECT_EQ(DecodeGraphVisible(513, split), 2 * split);
  EXPECT_EQ(DecodeGraphVisible(1537, split), 4 * split);
  EXPECT_EQ(DecodeGraphVisible(131072, split), 131072);
  std::mt19937 rng(std::random_device{}());
  const uint32_t seed = rng();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int64_t> visible_dist(1, 40000);
  std::uniform_int_distribution<int> window_pick(0, 6);
  const int64_t windows[] = {0, 1, 64, 511, 512, 4096, 10000};
  int64_t bounds = 0, last_bound = 0;
  for (int64_t max_visible = 1; max_visible <= 40000; max_visible += 37) {
    const int64_t bound = DecodeGraphVisible(max_visible, split);
    ASSERT_GE(bound, max_visible);
    ASSERT_GE(bound, last_bound);  // monotone: steps of a growing context only move up
    bounds += bound != last_bound ? 1 : 0;
    last_bound = bound;
  }
  EXPECT_LE(bounds, 8);  // 1, 2, 4, ... 128 chunks: 40000 positions share 8 graphs' bounds
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t max_visible = visible_dist(gen);
    const int64_t window = windows[window_pick(gen)];
    const int64_t exact = DecodeGridChunkCount(max_visible, window, split);
    const int64_t graph =
        DecodeGridChunkCount(DecodeGraphVisible(max_visible, split), window, split);
    ASSERT_GE(graph, exact);
    std::uniform_int_distribution<int64_t> pos_dist(0, max_visible - 1);
    for (int q = 0; q < 8; ++q) {
      const int64_t pos = q == 0 ? max_visible - 1 : pos_dist(gen);
      const int64_t visible = pos - FirstVisiblePosition(pos, window) + 1;
      ASSERT_EQ(DecodeChunkCount(visible, split, graph), DecodeChunkCount(visible, split, exact))
          << "max_visible " << max_visible << " window " << window << " pos " << pos;
    }
  }
}

TEST(DeviceLayoutTest, PageTableIndex) {
  for (int64_t p : {0, 1, 63, 64, 65, 1000, 32767}) {
    EXPECT_EQ(KvPageTableIndex(p, 0), p / kKvPageTokens);
  }
  EXPECT_EQ(KvPageTableIndex(0, 3), 0);
  EXPECT_EQ(KvPageTableIndex(64, 3), 1);
  EXPECT_EQ(KvPageTableIndex(191, 3), 2);
  EXPECT_EQ(KvPageTableIndex(192, 3), 0);  // wraps
  EXPECT_EQ(KvPageTableIndex(64 * 7 + 5, 3), 1);
  for (int64_t p = 0; p < 5000; ++p) {
    const int64_t i = KvPageTableIndex(p, 5);
    ASSERT_GE(i, 0);
    ASSERT_LT(i, 5);
  }
}

TEST(DeviceLayoutTest, RowOffsetsAreDistinctAndInsideTheirPage) {
  for (int64_t kv_width : {8, 1024, 2048}) {
    const int64_t page_elems = KvPageElements(kv_width);
    EXPECT_EQ(page_elems, 2 * kKvPageTokens * kv_width);
    for (int32_t page : {0, 1, 7}) {
      std::set<int64_t> starts;
      // Every position that lands in this page (several laps of positions for a ring).
      for (int64_t pos = 3 * kKvPageTokens; pos < 4 * kKvPageTokens; ++pos) {
        for (bool value : {false, true}) {
          const int64_t off = KvRowOffset(page, pos, kv_width, value);
          ASSERT_GE(off, page * page_elems);
          ASSERT_LE(off + kv_width, (page + 1) * page_elems);
          ASSERT_EQ(off % kv_width, 0);  // rows never straddle: distinct starts => disjoint
          ASSERT_TRUE(starts.insert(off).second) << pos << " " << value;
          // Positions one page apart share the slot (what lets a ring reuse pages).
          ASSERT_EQ(off, KvRowOffset(page, pos + kKvPageTokens, kv_width, value));
        }
      }
      EXPECT_EQ(static_cast<int64_t>(starts.size()), 2 * kKvPageTokens);
    }
  }
  // 16-byte alignment of every kv head's slice when head_dim % 8 == 0 (bf16): the CUDA kernels
  // load 8 values at a time.
  const int64_t kv_width = 8 * 128;
  for (int64_t pos = 0; pos < kKvPageTokens; ++pos) {
    EXPECT_EQ((KvRowOffset(3, pos, kv_width, true) * 2) % 16, 0);
  }
}

TEST(DeviceLayoutTest, RingHoldsWindowPlusChunk) {
  EXPECT_EQ(KvRingPages(1), 1);
  EXPECT_EQ(KvRingPages(64), 1);
  EXPECT_EQ(KvRingPages(65), 2);
  EXPECT_EQ(KvRingPages(1024 + 512), 24);
  for (int64_t window : {1, 8, 100, 1024}) {
    for (int64_t chunk : {1, 64, 300}) {
      const int32_t ring = KvRingPages(window + chunk);
      ASSERT_GE(static_cast<int64_t>(ring) * kKvPageTokens, window + chunk);
      // Any window + chunk consecutive positions occupy distinct (page, slot) places.
      for (int64_t start : {int64_t{0}, int64_t{37}, 5 * window + 11}) {
        std::set<std::pair<int64_t, int64_t>> places;
        for (int64_t p = start; p < start + window + chunk; ++p) {
          ASSERT_TRUE(places.insert({KvPageTableIndex(p, ring), p % kKvPageTokens}).second)
              << window << " " << chunk << " " << p;
        }
      }
    }
  }
}

TEST(DeviceLayoutTest, M0ReferencesRoundTrip) {
  for (int64_t slots : {1, 64, 65536}) {
    for (int64_t head : {0, 1, 3}) {
      for (int64_t slot : {int64_t{0}, int64_t{1}, slots - 1}) {
        const int32_t ref = SdmM0Ref(head, slot, slots);
        ASSERT_LT(ref, 0);  // never confused with a private row index
        ASSERT_EQ(SdmM0RowOf(ref), head * slots + slot);
      }
    }
  }
  EXPECT_EQ(SdmM0Ref(0, 0, 64), -1);
  EXPECT_EQ(SdmM0RowOf(-1), 0);
  EXPECT_EQ(SdmM0RowOf(SdmM0Ref(1, 5, 64)), 69);
}

}  // namespace
}  // namespace sdm::kernels
