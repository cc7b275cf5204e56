#include "kernels/cpu/decode_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SDM_DECODE_ATTENTION_AVX2 1
#endif

#include "base/check.h"
#include "kernels/common/attention_math.h"
#include "kernels/cpu/decode_attention_wide.h"
#include "kernels/cpu/exp2.h"
#include "kernels/cpu/gemm_isa.h"
#include "kernels/cpu/sum_lanes.h"
#include "kernels/cpu/widen.h"

namespace sdm::kernels::cpu {
namespace {

// Rows taken together by the register-blocked value loop (kDecodeRowGroup,
// decode_attention_wide.h). Each element's chain over the rows is the same whatever group a row
// falls in, so the bits of a block never depend on where spans or groups cut it. Eight: the loop
// loads and stores each accumulator vector once per eight rows, not per four.
constexpr int kRowGroup = kDecodeRowGroup;

// q . k: eight lanes of fused multiply-adds over head_dim in order, a fixed tree over the lanes,
// then the head_dim % 8 tail in order.
#ifdef SDM_DECODE_ATTENTION_AVX2
template <typename T>
float DotRow(const float* q, const T* k, int64_t hd) {
  __m256 a = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= hd; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), Widen8(k + c), a);
  float out = SumLanes(a);
  for (; c < hd; ++c) out = std::fma(q[c], Widen(k[c]), out);
  return out;
}
#else
template <typename T>
float DotRow(const float* q, const T* k, int64_t hd) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t c = 0;
  for (; c + 8 <= hd; c += 8) {
    for (int l = 0; l < 8; ++l) lane[l] = std::fma(q[c + l], Widen(k[c + l]), lane[l]);
  }
  float s[4];
  for (int l = 0; l < 4; ++l) s[l] = lane[l] + lane[l + 4];
  s[0] += s[2];
  s[1] += s[3];
  float out = s[0] + s[1];
  for (; c < hd; ++c) out = std::fma(q[c], Widen(k[c]), out);
  return out;
}
#endif

// scores[h * score_stride + i] = q(h) . k[i][kv(h) * hd ...] for every head and row i < n, row by
// row and head by head: the keys are read in address order, one stream the hardware prefetchers
// follow, and each (row, head) chain is independent of the next, so the processor overlaps them
// (the earlier order, eight rows' slices at once, measured 4-36% slower: docs/benchmarks.md, "Keys
// in address order").
template <typename T>
void DotBlock(const float* q, int64_t heads, int64_t group, const T* const* k, int n, int64_t hd,
              float* scores, int64_t score_stride) {
  for (int i = 0; i < n; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      scores[h * score_stride + i] = DotRow(q + h * hd, k[i] + (h / group) * hd, hd);
    }
  }
}

// acc[d] = fma(w[i], v[i][d], acc[d]) for i = 0, 1, ... n-1 (n <= kRowGroup) in order: one chain
// of fused multiply-adds per element, the same however the rows are grouped.
template <typename T>
void AccumulateRows(const float* w, const T* const* v, int n, int64_t hd, float* acc) {
  int64_t d = 0;
#ifdef SDM_DECODE_ATTENTION_AVX2
  __m256 wv[kRowGroup];
  for (int i = 0; i < n; ++i) wv[i] = _mm256_set1_ps(w[i]);
  if (n == kRowGroup) {
    for (; d + 8 <= hd; d += 8) {
      __m256 a = _mm256_loadu_ps(acc + d);
#pragma GCC unroll 8
      for (int i = 0; i < kRowGroup; ++i) a = _mm256_fmadd_ps(wv[i], Widen8(v[i] + d), a);
      _mm256_storeu_ps(acc + d, a);
    }
  } else {
    for (; d + 8 <= hd; d += 8) {
      __m256 a = _mm256_loadu_ps(acc + d);
      for (int i = 0; i < n; ++i) a = _mm256_fmadd_ps(wv[i], Widen8(v[i] + d), a);
      _mm256_storeu_ps(acc + d, a);
    }
  }
#endif
  for (; d < hd; ++d) {
    float a = acc[d];
    for (int i = 0; i < n; ++i) a = std::fma(w[i], Widen(v[i][d]), a);
    acc[d] = a;
  }
}

// sc[i] = 2^(sc[i] - m) for i < n, m >= every sc[i] (Exp2NonPositive, kernels/cpu/exp2.h: the same
// bits 8 lanes at a time as one at a time); all 0 when m = -inf (every score masked).
void Exp2Weights(float* sc, int n, float m) {
  if (m == -INFINITY) {
    std::fill(sc, sc + n, 0.0f);
    return;
  }
  int i = 0;
#ifdef SDM_DECODE_ATTENTION_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(sc + i, Exp2NonPositive8(_mm256_sub_ps(_mm256_loadu_ps(sc + i), mv)));
  }
#endif
  for (; i < n; ++i) sc[i] = Exp2NonPositive(sc[i] - m);
}

// Whether head h + 1 exists and shares head h's KV head (the wide loops then take both).
bool SameGroupNext(int64_t h, int64_t heads, int64_t group) {
  return h + 1 < heads && (h + 1) / group == h / group;
}

// One split-K task: positions [begin, end) of one query, inside one kDecodeBlock.
struct BlockTask {
  int64_t query;
  int64_t begin;
  int64_t end;
};

// Floats of one head's partial state in a task's output: m, l, then acc[head_dim].
int64_t PartialFloats(const AttentionShape& s) { return 2 + s.head_dim; }

// A query prepared once for all its blocks: scaled into log2 units (attention_math.h) by
// log2(e) / sqrt(head_dim), [n_heads * head_dim], and, where the wide loops take every head in
// pairs, each pair's scaled queries joined as DecodeWideLoopsOf::dot_block_pairs reads them
// (empty otherwise).
struct PreparedQuery {
  std::vector<float> scaled;
  std::vector<float> joined;
};

PreparedQuery PrepareQuery(const float* q, const AttentionShape& shape, bool pairs) {
  const int64_t hd = shape.head_dim;
  const int64_t heads = shape.n_heads;
  PreparedQuery out;
  out.scaled.resize(heads * hd);
  const float scale = kLog2e / std::sqrt(static_cast<float>(hd));
  for (int64_t i = 0; i < heads * hd; ++i) out.scaled[i] = q[i] * scale;
  if (!pairs) return out;
  const int64_t chunks = hd / 8;
  out.joined.resize(heads / 2 * chunks * 16);
  for (int64_t p = 0; p < heads / 2; ++p) {
    for (int64_t c = 0; c < chunks; ++c) {
      float* dst = &out.joined[(p * chunks + c) * 16];
      std::copy_n(&out.scaled[(2 * p) * hd + c * 8], 8, dst);
      std::copy_n(&out.scaled[(2 * p + 1) * hd + c * 8], 8, dst + 8);
    }
  }
  return out;
}

// The partial states of every head over one block, written to `partial`
// ([n_heads][2 + head_dim]).
// `wide`: the AVX-512 loops (same bits), or nullptr for this file's; the key pass takes them
// when `prepared` holds joined pairs.
template <typename T>
void AttendBlock(const DecodeQueryOf<T>& query, const PreparedQuery& prepared, int64_t begin,
                 int64_t end, const AttentionShape& shape, const DecodeWideLoopsOf<T>* wide,
                 float* partial) {
  const int64_t hd = shape.head_dim;
  const int64_t heads = shape.n_heads;
  const int64_t group = shape.n_heads / shape.n_kv_heads;
  const int n = static_cast<int>(end - begin);
  // The block's rows, whichever spans they come from.
  const T* krow[kDecodeBlock];
  const T* vrow[kDecodeBlock];
  for (const KvSpanOf<T>& s : query.spans) {
    const int64_t lo = std::max(begin, s.first_pos);
    const int64_t hi = std::min(end, s.first_pos + s.count);
    for (int64_t p = lo; p < hi; ++p) {
      krow[p - begin] = s.k + (p - s.first_pos) * shape.row_stride;
      vrow[p - begin] = s.v + (p - s.first_pos) * shape.row_stride;
    }
  }
  thread_local std::vector<float> scores;
  scores.resize(heads * kDecodeBlock);
  // Keys: every head against each row, the rows read once, front to back. With the wide loops and
  // every head paired, two heads of a KV group at once.
  if (!prepared.joined.empty()) {
    wide->dot_block_pairs(prepared.joined.data(), prepared.scaled.data(), heads / 2, group / 2,
                          krow, n, hd, scores.data(), kDecodeBlock);
  } else {
    DotBlock<T>(prepared.scaled.data(), heads, group, krow, n, hd, scores.data(), kDecodeBlock);
  }
  // Softmax weights under the block's maximum, per head.
  for (int64_t h = 0; h < heads; ++h) {
    float* sc = &scores[h * kDecodeBlock];
    float m = sc[0];
    for (int i = 1; i < n; ++i) m = std::max(m, sc[i]);
    Exp2Weights(sc, n, m);
    float l = 0.0f;
    for (int i = 0; i < n; ++i) l += sc[i];
    float* out = partial + h * PartialFloats(shape);
    out[0] = m;
    out[1] = l;
    std::fill(out + 2, out + 2 + hd, 0.0f);
  }
  // Values: the same walk, every head accumulating its weighted rows.
  const int64_t stride = PartialFloats(shape);
  for (int r = 0; r < n; r += kRowGroup) {
    const int take = std::min(kRowGroup, n - r);
    for (int64_t h = 0; h < heads;) {
      const int64_t off = (h / group) * hd;
      const T* v[kRowGroup];
      for (int i = 0; i < take; ++i) v[i] = vrow[r + i] + off;
      const float* w = &scores[h * kDecodeBlock + r];
      float* acc = partial + h * stride + 2;
      if (wide != nullptr && SameGroupNext(h, heads, group)) {
        wide->accumulate_rows_pair(w, w + kDecodeBlock, v, take, hd, acc, acc + stride);
        h += 2;
      } else {
        AccumulateRows<T>(w, v, take, hd, acc);
        ++h;
      }
    }
  }
}

template <typename T>
void AttendDecodeBatchOf(std::span<const DecodeQueryOf<T>> queries, const AttentionShape& shape,
                         ThreadPool* pool, const DecodeWideLoopsOf<T>* wide) {
  const int64_t hd = shape.head_dim;
  const int64_t heads = shape.n_heads;
  // Blocks of absolute positions, cut to each query's visible range.
  std::vector<BlockTask> tasks;
  std::vector<int64_t> first_task(queries.size() + 1);
  for (size_t qi = 0; qi < queries.size(); ++qi) {
    first_task[qi] = static_cast<int64_t>(tasks.size());
    const DecodeQueryOf<T>& q = queries[qi];
    if (q.spans.empty()) continue;
    const int64_t first = q.spans.front().first_pos;
    for (int64_t b = first / kDecodeBlock; b <= q.pos / kDecodeBlock; ++b) {
      tasks.push_back({static_cast<int64_t>(qi), std::max(first, b * kDecodeBlock),
                       std::min(q.pos + 1, (b + 1) * kDecodeBlock)});
    }
  }
  first_task[queries.size()] = static_cast<int64_t>(tasks.size());
  const int64_t per_task = heads * PartialFloats(shape);
  std::vector<float> partials(tasks.size() * per_task);
  // Every block of a query starts from the same prepared query.
  const bool pairs = wide != nullptr && hd >= 8 && (heads / shape.n_kv_heads) % 2 == 0;
  std::vector<PreparedQuery> prepared;
  prepared.reserve(queries.size());
  for (const DecodeQueryOf<T>& q : queries) prepared.push_back(PrepareQuery(q.q, shape, pairs));
  auto run_block = [&](int64_t t) {
    const BlockTask& task = tasks[t];
    AttendBlock(queries[task.query], prepared[task.query], task.begin, task.end, shape, wide,
                &partials[t * per_task]);
  };
  // Merge in block order, per (query, head).
  auto merge = [&](int64_t i) {
    const int64_t qi = i / heads;
    const int64_t h = i % heads;
    float* out = queries[qi].out + h * hd;
    const int64_t t0 = first_task[qi];
    const int64_t t1 = first_task[qi + 1];
    if (t0 == t1) {
      std::fill(out, out + hd, 0.0f);
      return;
    }
    const float* p0 = &partials[t0 * per_task + h * PartialFloats(shape)];
    SoftmaxState state{p0[0], p0[1]};
    std::copy(p0 + 2, p0 + 2 + hd, out);
    for (int64_t t = t0 + 1; t < t1; ++t) {
      const float* p = &partials[t * per_task + h * PartialFloats(shape)];
      const SoftmaxMerge m = MergeSoftmaxStates(state, {p[0], p[1]});
      for (int64_t d = 0; d < hd; ++d) out[d] = out[d] * m.scale_a + p[2 + d] * m.scale_b;
      state = m.state;
    }
    for (int64_t d = 0; d < hd; ++d) out[d] = SoftmaxFinish(out[d], state.l);
  };
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t num_merges = static_cast<int64_t>(queries.size()) * heads;
  if (pool == nullptr) {
    for (int64_t t = 0; t < num_tasks; ++t) run_block(t);
    for (int64_t i = 0; i < num_merges; ++i) merge(i);
  } else {
    pool->ParallelFor(num_tasks, run_block);
    pool->ParallelFor(num_merges, merge);
  }
}

const DecodeWideLoops* WideLoopsFor(GemmIsa isa) {
  SDM_CHECK(GemmIsaAvailable(isa)) << GemmIsaName(isa) << " is not available";
  return isa == GemmIsa::kAvx512 ? Avx512DecodeWideLoops() : nullptr;
}

const DecodeWideLoops* ActiveWideLoops() {
  static const DecodeWideLoops* const loops = WideLoopsFor(ActiveGemmIsa());
  return loops;
}

}  // namespace

void AttendDecodeBatch(std::span<const DecodeQuery> queries, const AttentionShape& shape,
                       ThreadPool* pool) {
  const DecodeWideLoops* wide = ActiveWideLoops();
  AttendDecodeBatchOf<float>(queries, shape, pool, wide ? &wide->fp32 : nullptr);
}

void AttendDecodeBatch(std::span<const DecodeQueryBf16> queries, const AttentionShape& shape,
                       ThreadPool* pool) {
  const DecodeWideLoops* wide = ActiveWideLoops();
  AttendDecodeBatchOf<uint16_t>(queries, shape, pool, wide ? &wide->bf16 : nullptr);
}

void AttendDecodeBatch(std::span<const DecodeQuery> queries, const AttentionShape& shape,
                       ThreadPool* pool, GemmIsa isa) {
  const DecodeWideLoops* wide = WideLoopsFor(isa);
  AttendDecodeBatchOf<float>(queries, shape, pool, wide ? &wide->fp32 : nullptr);
}

void AttendDecodeBatch(std::span<const DecodeQueryBf16> queries, const AttentionShape& shape,
                       ThreadPool* pool, GemmIsa isa) {
  const DecodeWideLoops* wide = WideLoopsFor(isa);
  AttendDecodeBatchOf<uint16_t>(queries, shape, pool, wide ? &wide->bf16 : nullptr);
}

}  // namespace sdm::kernels::cpu
