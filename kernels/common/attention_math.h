// Attention math shared by the CPU kernels, the CUDA kernels and their tests (docs/model-spec.md
// §4, §6): the causal/sliding window, and the partial softmax state that lets attention over a long
// context be split into chunks reduced independently (split-K, "flash decoding") and merged.
//
// Partial softmax state. For scores s_j (in log2 units: s_j = log2(e) * q.k_j / sqrt(head_dim), so
// that the device can use exp2) over a set J of keys, a partial state is
//   m = max_j s_j,   l = sum_j 2^(s_j - m),   acc = sum_j 2^(s_j - m) * v_j.
// The empty set is m = -inf, l = 0, acc = 0. The softmax-weighted sum over J is acc / l. Two
// states over disjoint sets A and B merge into the state over A u B:
//   m = max(m_a, m_b), l = l_a * 2^(m_a - m) + l_b * 2^(m_b - m), acc likewise,
// with the factor of an empty side taken as 0 (so that -inf - -inf never produces NaN). Adding one
// key is merging with {m = s, l = 1, acc = v}; adding a tile of keys is rescaling the old state to
// the tile's new maximum and adding 2^(s_j - m) per key (SoftmaxRescale / SoftmaxWeight).
#ifndef SDMSERVE_KERNELS_COMMON_ATTENTION_MATH_H_
#define SDMSERVE_KERNELS_COMMON_ATTENTION_MATH_H_

#include <cmath>
#include <cstdint>

#include "kernels/common/host_device.h"

namespace sdm::kernels {

// log2(e): converts natural-log scores to the log2 units of the partial states.
inline constexpr float kLog2e = 1.4426950408889634f;

// First position a query at `pos` may see: keys j with j <= pos and, for window > 0,
// pos - j < window.
SDM_HOST_DEVICE int64_t FirstVisiblePosition(int64_t pos, int64_t window) {
  return (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
}

// (m, l) of a partial softmax state; the accumulators live beside it, scaled by the same factors.
struct SoftmaxState {
  float m;
  float l;
};

SDM_HOST_DEVICE SoftmaxState EmptySoftmaxState() { return {-INFINITY, 0.0f}; }

// The factor that rescales a state whose maximum was m_old to the new maximum m_new >= m_old.
// When both are -inf (nothing seen yet) the state is empty and any finite factor will do; 0 keeps
// the empty state's l and acc at exactly 0.
SDM_HOST_DEVICE float SoftmaxRescale(float m_old, float m_new) {
  return m_new == -INFINITY ? 0.0f : exp2f(m_old - m_new);
}

// The weight 2^(s - m) of a score s under maximum m >= s; 0 for a masked score (s = -inf).
SDM_HOST_DEVICE float SoftmaxWeight(float s, float m) {
  return m == -INFINITY ? 0.0f : exp2f(s - m);
}

// Merging two partial states: the merged (m, l) and the factors for each side's accumulators,
// acc = acc_a * scale_a + acc_b * scale_b.
struct SoftmaxMerge {
  SoftmaxState state;
  float scale_a;
  float scale_b;
};

SDM_HOST_DEVICE SoftmaxMerge MergeSoftmaxStates(SoftmaxState a, SoftmaxState b) {
  const float m = a.m > b.m ? a.m : b.m;
  const float scale_a = SoftmaxRescale(a.m, m);
  const float scale_b = SoftmaxRescale(b.m, m);
  return {{m, a.l * scale_a + b.l * scale_b}, scale_a, scale_b};
}

// The softmax-weighted sum from a state's accumulator: acc / l, or 0 when no key was visible.
SDM_HOST_DEVICE float SoftmaxFinish(float acc, float l) { return l > 0.0f ? acc / l : 0.0f; }

// Split-K decode (kernels/cuda/attention.h): a query sees `visible` consecutive positions; they
// are cut into chunks of `split` positions, at most `max_chunks` (the grid's size along chunks;
// the last chunk takes whatever remains, so a sequence longer than the grid was sized for is
// still attended correctly, only more slowly). 0 chunks when nothing is visible.
SDM_HOST_DEVICE int64_t DecodeChunkCount(int64_t visible, int64_t split, int64_t max_chunks) {
  if (visible <= 0) return 0;
  const int64_t n = (visible + split - 1) / split;
  return n < max_chunks ? n : max_chunks;
}

// The decode grid's size along chunks for queries that see at most `max_visible` positions
// (positions below max_visible) with `window` (0: full attention): a sliding-window query sees at
// most `window` keys whatever its position, so the grid is sized from min(max_visible, window),
// never from the unclamped context. Exactly the largest DecodeChunkCount any such query needs
// (so none is truncated and no block of the grid is empty for all of them); at least 1.
SDM_HOST_DEVICE int64_t DecodeGridChunkCount(int64_t max_visible, int64_t window, int64_t split) {
  const int64_t visible = window > 0 && window < max_visible ? window : max_visible;
  const int64_t n = (visible + split - 1) / split;
  return n > 1 ? n : 1;
}

// The bound a decode step run as a CUDA graph sizes its attention grid from (engine/cuda/
// decode_graph_cache.h): max_visible rounded up so that steps whose context grows share a graph.
// Up to one chunk: `split` (the grid stays one chunk); beyond: a power of two of chunks. A query
// computes its own chunks from its own visible positions, capped by the grid (DecodeChunkCount),
// so a grid at least as large changes nothing for it but the blocks that are empty for it: the
// results are bit for bit those of the exact bound, whatever the window.
SDM_HOST_DEVICE int64_t DecodeGraphVisible(int64_t max_visible, int64_t split) {
  const int64_t chunks = (max_visible + split - 1) / split;
  int64_t rounded = 1;
  while (rounded < chunks) rounded *= 2;
  return rounded * split;
}

// Positions [begin, end) of chunk c < DecodeChunkCount(...) for a query whose first visible
// position is `first` and whose last is `last` (inclusive). The chunks tile [first, last] in order.
struct PositionRange {
  int64_t begin;
  int64_t end;
};

SDM_HOST_DEVICE PositionRange DecodeChunkRange(int64_t first, int64_t last, int64_t c,
                                               int64_t chunks, int64_t split) {
  const int64_t begin = first + c * split;
  return {begin, c + 1 == chunks ? last + 1 : begin + split};
}

}  // namespace sdm::kernels

#endif  // SDMSERVE_KERNELS_COMMON_ATTENTION_MATH_H_
