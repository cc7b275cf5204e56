#include "kernels/cpu/attention.h"

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
                   const AttentionShape& shape, float* out) {
  const int64_t hd = shape.head_dim;
  const int64_t q_stride = shape.n_heads * hd;
  const int64_t group = shape.n_heads / shape.n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  int64_t total = 0;
  for (const KvSpan& s : spans) total += s.count;
  const int64_t first = spans.empty() ? pos0 : spans.front().first_pos;
  std::vector<float> scores(num_tokens * total);
  for (int64_t h = 0; h < shape.n_heads; ++h) {
    const int64_t kv_off = (h / group) * hd;
    // scores[t, j] = q_t . k_j for every cached position j, span by span.
    int64_t col = 0;
    for (const KvSpan& s : spans) {
      GemmNT(num_tokens, s.count, hd, 1.0f, q + h * hd, q_stride, s.k + kv_off, shape.row_stride,
             0.0f, scores.data() + col, total);
      col += s.count;
    }
    for (int64_t t = 0; t < num_tokens; ++t) {
      float* row = scores.data() + t * total;
      const int64_t p = pos0 + t;
      const int64_t lo = FirstVisiblePosition(p, shape.window) - first;
      const int64_t hi = p - first;  // inclusive
      for (int64_t c = 0; c < total; ++c) {
        if (c < lo || c > hi) row[c] = -std::numeric_limits<float>::infinity();
      }
      Softmax(row, total, scale);
    }
    // out_h[t] = sum_j p[t, j] v_j
    col = 0;
    for (const KvSpan& s : spans) {
      GemmNN(num_tokens, hd, s.count, 1.0f, scores.data() + col, total, s.v + kv_off,
             shape.row_stride, col == 0 ? 0.0f : 1.0f, out + h * hd, q_stride);
      col += s.count;
    }
  }
}

}  // namespace sdm::kernels::cpu
