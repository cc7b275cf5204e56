// Causal (optionally sliding-window) multi-head attention with grouped KV heads over cached
// key/value rows (docs/model-spec.md §4): a query at position p sees keys j with j <= p and, for a
// window W > 0, p - j < W. Scores are scaled by 1/sqrt(head_dim). RoPE is applied by the caller.
#ifndef SDMSERVE_KERNELS_CPU_ATTENTION_H_
#define SDMSERVE_KERNELS_CPU_ATTENTION_H_

#include <cstdint>
#include <span>

#include "kernels/common/attention_math.h"
#include "kernels/cpu/parallel.h"

namespace sdm::kernels::cpu {

// Cached rows at consecutive positions [first_pos, first_pos + count). Row r of the span is at
// k + r * row_stride (and v likewise); kv head g occupies values [g * head_dim, (g+1) * head_dim).
// T: float, or uint16_t for bf16 rows (base/bf16.h; only AttendDecodeBatch reads those).
template <typename T>
struct KvSpanOf {
  const T* k;
  const T* v;
  int64_t first_pos;
  int64_t count;
};
using KvSpan = KvSpanOf<float>;
using KvSpanBf16 = KvSpanOf<uint16_t>;

struct AttentionShape {
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t window = 0;      // 0 = full causal attention
  int64_t row_stride = 0;  // values between consecutive cached rows (n_kv_heads * head_dim)
};

// First position a query at `pos` may see (shared with the CUDA kernels).
using ::sdm::kernels::FirstVisiblePosition;

// One query head of one decode token at `pos`: q_head [head_dim] -> out_head [head_dim]. `spans`
// cover exactly the visible positions, in increasing order. Safe to call concurrently for
// different heads or sessions.
void AttendDecodeHead(const float* q_head, int64_t head, int64_t pos, std::span<const KvSpan> spans,
                      const AttentionShape& shape, float* out_head);

// Queries per task of AttendPrefill.
inline constexpr int64_t kPrefillQueryTile = 128;

// All heads of `num_tokens` consecutive queries at positions pos0.. (prefill). q and out are
// [num_tokens, n_heads * head_dim]. `spans` cover [FirstVisiblePosition(pos0), pos0 + num_tokens)
// in increasing order. The work is split into tasks of one head and kPrefillQueryTile queries,
// each reading only the keys its queries can see (a window's band, the causal triangle's rows);
// with `pool` they run on it, without it on the calling thread, with the same bits either way.
// Each task makes OpenBLAS GEMM calls on its own thread: callers that pass a pool should run
// OpenBLAS single-threaded (SetBlasThreads(1), kernels/cpu/linear.h) so that its threads do not
// compete with the pool's. Safe to call concurrently (OpenBLAS's pthread build is thread-safe).
// Each thread keeps its largest scores buffer (kPrefillQueryTile x the keys a tile sees, floats)
// for the next call: fresh pages cost more than the GEMMs here.
void AttendPrefill(const float* q, int64_t num_tokens, int64_t pos0, std::span<const KvSpan> spans,
                   const AttentionShape& shape, float* out, ThreadPool* pool = nullptr);

}  // namespace sdm::kernels::cpu

#endif  // SDMSERVE_KERNELS_CPU_ATTENTION_H_
