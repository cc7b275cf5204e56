// Decode attention that streams the KV cache: a batch of single-token queries (one per session),
// each attended over its visible cached positions by every query head at once, in blocks of whole
// cache rows, split across threads by (query, block) and merged with the shared partial-softmax
// math (kernels/common/attention_math.h).
//
// Why whole rows: a cached row holds every KV head of a position (KvSpan, row_stride floats), so a
// task that takes all heads against a block of rows reads the cache front to back, one contiguous
// stream of keys and one of values per page, instead of one strided slice per head
// (AttendDecodeHead in kernels/cpu/attention.h, kept as the reference and the "per-head" option).
//
// A block's softmax weights 2^(s - m) come from Exp2NonPositive (kernels/cpu/exp2.h), 8 lanes at
// a time, not the C library's exp2f (within 2 ulp of it); the merge of blocks uses the shared
// kernels/common/attention_math.h.
//
// Reduction order, and so the bits of the result, depend only on the query: its position, window
// and cache contents. Blocks are fixed ranges of absolute positions ([b * kDecodeBlock,
// (b + 1) * kDecodeBlock) cut to the visible range), each block's partial state is computed by one
// task in a fixed order whatever the cut of its rows into spans, and the partial states are merged
// in block order. Neither the batch nor the thread count changes a query's output.
#ifndef SDMSERVE_KERNELS_CPU_DECODE_ATTENTION_H_
#define SDMSERVE_KERNELS_CPU_DECODE_ATTENTION_H_

#include <cstdint>
#include <span>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/gemm_isa.h"
#include "kernels/cpu/parallel.h"

namespace sdm::kernels::cpu {

// Positions per split-K block. 128 rows of a 4 KB row are 512 KB of keys and as much of values
// per task: long enough to stream, short enough that one 8k-token session makes 64 tasks.
inline constexpr int64_t kDecodeBlock = 128;

// One decode query: all heads of one token at `pos`. `spans` cover exactly the visible positions
// [FirstVisiblePosition(pos, window), pos], in increasing order; q and out are
// [n_heads * head_dim] (out may not alias q).
// T: the cache's element type, float or uint16_t (bf16 rows, widened to fp32 as they are read;
// the arithmetic is then the fp32 kernel's on the rounded values, bit for bit).
template <typename T>
struct DecodeQueryOf {
  const float* q;
  int64_t pos;
  std::span<const KvSpanOf<T>> spans;
  float* out;
};
using DecodeQuery = DecodeQueryOf<float>;
using DecodeQueryBf16 = DecodeQueryOf<uint16_t>;

// Attends every query (distinct outputs) on `pool` (nullptr: on this thread). Calls
// pool->ParallelFor, so must not run inside another ParallelFor of the same pool.
// Uses the CPU instruction set the GEMM uses (ActiveGemmIsa, kernels/cpu/gemm_isa.h): with
// AVX-512, two query heads of a KV group share each load and multiply-add instruction
// (kernels/cpu/decode_attention_wide.h). Every instruction set gives the same bits.
void AttendDecodeBatch(std::span<const DecodeQuery> queries, const AttentionShape& shape,
                       ThreadPool* pool);
void AttendDecodeBatch(std::span<const DecodeQueryBf16> queries, const AttentionShape& shape,
                       ThreadPool* pool);
// The same with the instruction set named, for tests and benchmarks that compare them: `isa` must
// be available (GemmIsaAvailable). kGeneric and kAvx2 run the same loops (those this library was
// compiled for).
void AttendDecodeBatch(std::span<const DecodeQuery> queries, const AttentionShape& shape,
                       ThreadPool* pool, GemmIsa isa);
void AttendDecodeBatch(std::span<const DecodeQueryBf16> queries, const AttentionShape& shape,
                       ThreadPool* pool, GemmIsa isa);

}  // namespace sdm::kernels::cpu

#endif  // SDMSERVE_KERNELS_CPU_DECODE_ATTENTION_H_
