#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/linear.h"
#include "kernels/cpu/vector_math.h"

namespace sdm::kernels::cpu {

void AttendDecodeHead(const float* q_head, int64_t head, int64_t pos, std::span<const KvSpan> spans,
                      const AttentionShape& shape, float* out_head) {
  const int64_t hd = shape.head_dim;
  const int64_t kv_off = (head / (shape.n_heads / shape.n_kv_heads)) * hd;
  int64_t total = 0;
  for (const KvSpan& s : spans) total += s.count;
  std::vector<float> scores(total);
  int64_t j = 0;
  for (const KvSpan& s : spans) {
    for (int64_t r = 0; r < s.count; ++r) {
      scores[j++] = Dot(q_head, s.k + r * shape.row_stride + kv_off, hd);
    }
  }
  Softmax(scores.data(), total, 1.0f / std::sqrt(static_cast<float>(hd)));
  for (int64_t d = 0; d < hd; ++d) out_head[d] = 0.0f;
  j = 0;
  for (const KvSpan& s : spans) {
    for (int64_t r = 0; r < s.count; ++r) {
      Axpy(scores[j++], s.v + r * shape.row_stride + kv_off, out_head, hd);
    }
  }
}

void AttendPrefill(const float* q, int64_t num_tokens, int64_t pos0, std::span<const KvSpan> spans,
                   const AttentionShape& shape, float* out, ThreadPool* pool) {
  const int64_t hd = shape.head_dim;
  const int64_t q_stride = shape.n_heads * hd;
  const int64_t group = shape.n_heads / shape.n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t tiles = (num_tokens + kPrefillQueryTile - 1) / kPrefillQueryTile;
  // One task: head h, queries [t0, t1). It reads only the keys some query of the tile sees,
  // [FirstVisiblePosition(pos0 + t0), pos0 + t1), and writes only its own slice of `out`.
  auto task = [&](int64_t index) {
    const int64_t h = index / tiles;
    const int64_t t0 = (index % tiles) * kPrefillQueryTile;
    const int64_t t1 = std::min(num_tokens, t0 + kPrefillQueryTile);
    const int64_t rows = t1 - t0;
    const int64_t lo = FirstVisiblePosition(pos0 + t0, shape.window);
    const int64_t hi = pos0 + t1;  // exclusive
    const int64_t width = hi - lo;
    const int64_t kv_off = (h / group) * hd;
    // Reused across calls: a fresh buffer of this size costs more in page faults than the GEMMs.
    thread_local std::vector<float> scores;
    scores.resize(rows * width);
    const float* q_tile = q + t0 * q_stride + h * hd;
    float* out_tile = out + t0 * q_stride + h * hd;
    // Each span's part inside [lo, hi): fn(its first position b, its count, its k and v rows).
    auto for_each_visible = [&](auto fn) {
      for (const KvSpan& s : spans) {
        const int64_t b = std::max(lo, s.first_pos), e = std::min(hi, s.first_pos + s.count);
        if (b >= e) continue;
        const int64_t at = (b - s.first_pos) * shape.row_stride + kv_off;
        fn(b, e - b, s.k + at, s.v + at);
      }
    };
    // scores[t, j - lo] = q_t . k_j for j in [lo, hi), span by span.
    for_each_visible([&](int64_t b, int64_t count, const float* k, const float*) {
      GemmNT(rows, count, hd, 1.0f, q_tile, q_stride, k, shape.row_stride, 0.0f,
             scores.data() + (b - lo), width);
    });
    for (int64_t t = 0; t < rows; ++t) {
      float* row = scores.data() + t * width;
      const int64_t p = pos0 + t0 + t;
      const int64_t first = FirstVisiblePosition(p, shape.window) - lo;
      const int64_t last = p - lo;  // inclusive
      for (int64_t c = 0; c < width; ++c) {
        if (c < first || c > last) row[c] = -std::numeric_limits<float>::infinity();
      }
      Softmax(row, width, scale);
    }
    // out_h[t] = sum_j p[t, j] v_j
    bool first_span = true;
    for_each_visible([&](int64_t b, int64_t count, const float*, const float* v) {
      GemmNN(rows, hd, count, 1.0f, scores.data() + (b - lo), width, v, shape.row_stride,
             first_span ? 0.0f : 1.0f, out_tile, q_stride);
      first_span = false;
    });
  };
  const int64_t num_tasks = shape.n_heads * tiles;
  if (pool != nullptr) {
    pool->ParallelFor(num_tasks, task);
  } else {
    for (int64_t i = 0; i < num_tasks; ++i) task(i);
  }
}

}  // namespace sdm::kernels::cpu
