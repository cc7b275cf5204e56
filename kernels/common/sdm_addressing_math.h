// Product-key addressing of an SDM head (docs/model-spec.md §5.2), SDM_HOST_DEVICE helpers for
// the CPU kernels (kernels/cpu/sdm_addressing.h) and the CUDA kernels (kernels/cuda/sdm.h).
//
// A head's 2s scores split into half A (first s) and half B (next s); slot (a, b) = a * s + b
// scores A[a] + B[b]. Selection: the top k_sub = min(K, s) of each half, the k_sub^2 pairwise
// sums, the top min(K, k_sub^2) of those; chosen slots sorted ascending.
//
// Order. Every comparison uses one total order: larger value first, ties toward the lower index
// (index within the half, or slot among sums), NaN ranked as -inf (so with -inf, after every
// number), -0 equal to +0. It is encoded as an unsigned "rank key" that is larger for an element
// that ranks earlier and distinct for distinct indices:
//   rank key = OrderKey(value) << (8 * index_bytes) | (2^(8 * index_bytes) - 1 - index).
// Top-k selection is then "keys >= the k-th largest key", found by a most-significant-digit radix
// select (8-bit digits): exact, and split into a histogram pass (serial with compaction on the
// CPU, parallel over elements on the GPU) and a digit choice (RadixSelectDigit) per pass. Because
// the selected set depends only on the keys, the result does not depend on the order in which a
// thread or block visits elements.
#ifndef SDMSERVE_KERNELS_COMMON_SDM_ADDRESSING_MATH_H_
#define SDMSERVE_KERNELS_COMMON_SDM_ADDRESSING_MATH_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/common/host_device.h"
#include "kernels/common/sdm_math.h"

namespace sdm::kernels {

// Activation of the selected sums (the reference's read_act / write_act).
enum class AddressAct { kSoftmax, kL2Normalize, kIdentity, kSigmoid, kRelu };

// Entries selected from each half: min(k, s).
SDM_HOST_DEVICE int64_t AddressSubCount(int64_t k, int64_t side) { return k < side ? k : side; }

// Number of slots the addressing selects: min(k, min(k, s)^2).
SDM_HOST_DEVICE int64_t AddressCount(int64_t k, int64_t side) {
  const int64_t k_sub = AddressSubCount(k, side);
  return k < k_sub * k_sub ? k : k_sub * k_sub;
}

// Bytes needed to hold every index in [0, n) (at least 1, at most 4).
SDM_HOST_DEVICE int AddressIndexBytes(int64_t n) {
  int bytes = 1;
  while (bytes < 4 && (n - 1) >> (8 * bytes) != 0) ++bytes;
  return bytes;
}

// Width in bits of a rank key with `index_bytes` index bytes: a multiple of 8, at most 64.
SDM_HOST_DEVICE int AddressRankKeyBits(int index_bytes) { return 32 + 8 * index_bytes; }

// Unsigned key, larger for a value that ranks earlier: NaN as -inf, -0 as +0.
SDM_HOST_DEVICE uint32_t AddressOrderKey(float v) {
  uint32_t bits;
#if defined(__CUDA_ARCH__)
  bits = __float_as_uint(v);
#else
  std::memcpy(&bits, &v, sizeof(bits));
#endif
  // On the bits, so that no compiler flag can fold the NaN and signed-zero cases away.
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) bits = 0xff800000u;  // NaN -> -inf
  if (magnitude == 0) bits = 0;                     // -0 -> +0
  return (bits & 0x80000000u) != 0 ? ~bits : (bits | 0x80000000u);
}

// Rank key of `value` at `index` (< 2^(8 * index_bytes)); see the file comment.
SDM_HOST_DEVICE uint64_t AddressRankKey(float value, int64_t index, int index_bytes) {
  const int shift = 8 * index_bytes;
  const uint64_t index_max = (uint64_t{1} << shift) - 1;
  return (static_cast<uint64_t>(AddressOrderKey(value)) << shift) |
         (index_max - static_cast<uint64_t>(index));
}

// Position of values[i] in the order of values[0..n): how many elements rank before it.
// O(n); one GPU thread per element ranks a small array without any synchronisation.
SDM_HOST_DEVICE int64_t AddressRankOf(const float* values, int64_t n, int64_t i) {
  const int b = AddressIndexBytes(n);
  const uint64_t key = AddressRankKey(values[i], i, b);
  int64_t rank = 0;
  for (int64_t j = 0; j < n; ++j) rank += AddressRankKey(values[j], j, b) > key ? 1 : 0;
  return rank;
}

// One step of the radix select. `hist` counts, per 8-bit digit value, the keys that still match
// the prefix chosen so far; the wanted key is the `*remaining`-th largest of them (1-based).
// Returns the wanted key's digit and subtracts from *remaining the keys in larger digits.
SDM_HOST_DEVICE int RadixSelectDigit(const int32_t* hist, int64_t* remaining) {
  int64_t above = 0;
  int d = 255;
  for (; d > 0; --d) {
    if (above + hist[d] >= *remaining) break;
    above += hist[d];
  }
  *remaining -= above;
  return d;
}

// The k-th largest (1 <= k <= n) of the n distinct keys[0..n), each `key_bits` wide. Serial MSD
// radix select that compacts the keys matching the chosen prefix after each pass, so later
// passes see few keys; keys[] is overwritten. hist: caller's scratch of 256 int32.
SDM_HOST_DEVICE uint64_t KthLargestKey(uint64_t* keys, int64_t n, int64_t k, int key_bits,
                                       int32_t* hist) {
  uint64_t prefix = 0;
  int64_t remaining = k;
  for (int shift = key_bits - 8; shift >= 0; shift -= 8) {
    for (int d = 0; d < 256; ++d) hist[d] = 0;
    for (int64_t e = 0; e < n; ++e) ++hist[(keys[e] >> shift) & 0xff];
    const uint64_t d = static_cast<uint64_t>(RadixSelectDigit(hist, &remaining));
    prefix |= d << shift;
    if (hist[d] == n) continue;  // every key shares this digit: nothing to drop
    int64_t m = 0;
    for (int64_t e = 0; e < n; ++e) {  // branch-free compaction
      keys[m] = keys[e];
      m += ((keys[e] >> shift) & 0xff) == d ? 1 : 0;
    }
    n = m;
  }
  return prefix;
}

// A candidate of a head with scores [2 * side]: its sum, slot and rank key.
struct AddressCandidate {
  uint64_t key;
  float sum;
  int32_t slot;
};
// Candidate of half-A index a and half-B index b.
SDM_HOST_DEVICE AddressCandidate AddressCandidateOf(const float* scores, int64_t side, int32_t a,
                                                    int32_t b, int slot_bytes) {
  AddressCandidate c;
  c.sum = scores[a] + scores[side + b];
  c.slot = static_cast<int32_t>(a * side + b);
  c.key = AddressRankKey(c.sum, c.slot, slot_bytes);
  return c;
}
// Indices of the top k (1 <= k <= n) of values[0..n), ascending, into out[k].
// Scratch: keys of n uint64, hist of 256 int32.
SDM_HOST_DEVICE void AddressTopIndices(const float* values, int64_t n, int64_t k, int32_t* out,
                                       uint64_t* keys, int32_t* hist) {
  const int b = AddressIndexBytes(n);
  uint64_t threshold = 0;  // k == n: every key qualifies
  if (k < n) {
    for (int64_t e = 0; e < n; ++e) keys[e] = AddressRankKey(values[e], e, b);
    threshold = KthLargestKey(keys, n, k, AddressRankKeyBits(b), hist);
  }
  int64_t m = 0;
  for (int64_t e = 0; e < n; ++e) {
    if (AddressRankKey(values[e], e, b) >= threshold) out[m++] = static_cast<int32_t>(e);
  }
}

// Scratch keys AddressSelectSerial needs: max(s, k_sub^2).
SDM_HOST_DEVICE int64_t AddressSelectKeyScratch(int64_t k, int64_t side) {
  const int64_t k_sub = AddressSubCount(k, side);
  return side > k_sub * k_sub ? side : k_sub * k_sub;
}

// Selection of one head by one thread: AddressCount(k, side) slots, ascending, into slots and
// their sums into sums. Scratch: idx_a and idx_b of AddressSubCount(k, side) int32 each, keys of
// AddressSelectKeyScratch(k, side) uint64, hist of 256 int32. With the halves' selections
// ascending, candidates visited row-major come in ascending slot order, so the final scan emits
// the slots already sorted.
SDM_HOST_DEVICE void AddressSelectSerial(const float* scores, int64_t side, int64_t k,
                                         int32_t* slots, float* sums, int32_t* idx_a,
                                         int32_t* idx_b, uint64_t* keys, int32_t* hist) {
  const int64_t k_sub = AddressSubCount(k, side);
  const int64_t count = AddressCount(k, side);
  if (count <= 0) return;
  AddressTopIndices(scores, side, k_sub, idx_a, keys, hist);
  AddressTopIndices(scores + side, side, k_sub, idx_b, keys, hist);
  const int64_t n = k_sub * k_sub;
  const int slot_bytes = AddressIndexBytes(side * side);
  uint64_t threshold = 0;
  if (count < n) {
    for (int64_t i = 0; i < k_sub; ++i) {
      for (int64_t j = 0; j < k_sub; ++j) {
        keys[i * k_sub + j] = AddressCandidateOf(scores, side, idx_a[i], idx_b[j], slot_bytes).key;
      }
    }
    threshold = KthLargestKey(keys, n, count, AddressRankKeyBits(slot_bytes), hist);
  }
  int64_t m = 0;
  for (int64_t i = 0; i < k_sub; ++i) {
    for (int64_t j = 0; j < k_sub; ++j) {
      const AddressCandidate c = AddressCandidateOf(scores, side, idx_a[i], idx_b[j], slot_bytes);
      if (c.key >= threshold) {
        slots[m] = c.slot;
        sums[m] = c.sum;
        ++m;
      }
    }
  }
}

// ---- Candidate pruning ----------------------------------------------------------------------
// With each half's top k_sub in rank order (best first: a_0, a_1, ... and b_0, b_1, ...), the
// pair of ranks (i, j) is dominated by the (i + 1)(j + 1) - 1 other pairs (i' <= i, j' <= j):
// float addition is monotone, so each of their sums is >= its sum (in the order of
// AddressOrderKey, NaN and -0 included). A pair with (i + 1)(j + 1) > count thus has at least
// `count` sums >= its own: it can be selected only through an exact tie at the threshold value
// (the tie-break is by slot, which domination does not order). The pruned candidates are the
// pairs with (i + 1)(j + 1) <= count, row i holding j < AddressPrunedRowLength(i): about
// count * ln(count) of them (695 for count 128) instead of k_sub^2 (16,384).
//
// Exactness. Let T be the count-th largest rank key among the pruned candidates and t its value
// part (AddressOrderKey of its sum). Every pair of the true top count has a sum >= t (the pruned
// set is a subset, so its count-th largest value is at most the full set's). Along a row the
// sums are non-increasing in j, so a true top pair outside the pruned set makes the row's first
// pair outside it have a value >= t. Hence: if no row's first pair beyond the pruned ones has a
// value >= t, the pruned top count is the full top count (same keys, same order); otherwise the
// selection falls back to all k_sub^2 pairs (exact ties at the threshold only).

// Pairs of rank-row i (0 <= i < k_sub) among the pruned candidates: min(k_sub, count / (i + 1)),
// at least 1 (k_sub <= count).
SDM_HOST_DEVICE int64_t AddressPrunedRowLength(int64_t i, int64_t count, int64_t k_sub) {
  const int64_t len = count / (i + 1);
  return len < k_sub ? len : k_sub;
}

// Number of pruned candidates for (k, side): the sum of the row lengths.
SDM_HOST_DEVICE int64_t AddressPrunedCount(int64_t k, int64_t side) {
  const int64_t k_sub = AddressSubCount(k, side);
  const int64_t count = AddressCount(k, side);
  int64_t n = 0;
  for (int64_t i = 0; i < k_sub; ++i) n += AddressPrunedRowLength(i, count, k_sub);
  return n;
}

// Whether a row's first pair beyond the pruned ones ties or beats the threshold key's value
// (then the pruned selection may differ from the full one; see above). rank_a, rank_b: each
// half's top k_sub indices in rank order.
SDM_HOST_DEVICE bool AddressPrunedRowReachesThreshold(const float* scores, int64_t side,
                                                      const int32_t* rank_a, const int32_t* rank_b,
                                                      int64_t i, int64_t count, int64_t k_sub,
                                                      uint64_t threshold, int slot_bytes) {
  const int64_t len = AddressPrunedRowLength(i, count, k_sub);
  if (len >= k_sub) return false;
  const int shift = 8 * slot_bytes;
  const uint64_t key = AddressCandidateOf(scores, side, rank_a[i], rank_b[len], slot_bytes).key;
  return (key >> shift) >= (threshold >> shift);
}

// Sorts the first n slots ascending, carrying their sums (insertion sort: n <= a few hundred).
SDM_HOST_DEVICE void AddressSortBySlot(int32_t* slots, float* sums, int64_t n) {
  for (int64_t a = 1; a < n; ++a) {
    const int32_t slot = slots[a];
    const float sum = sums[a];
    int64_t b = a;
    for (; b > 0 && slots[b - 1] > slot; --b) {
      slots[b] = slots[b - 1];
      sums[b] = sums[b - 1];
    }
    slots[b] = slot;
    sums[b] = sum;
  }
}

// AddressSelectSerial's selection, bit for bit (same slots ascending, same sums), from the
// pruned candidates (falling back to all k_sub^2 on a tie at the threshold; see above).
// rank_a, rank_b: each half's top AddressSubCount(k, side) indices (within the half) in rank
// order, best first. Scratch: keys of AddressSelectKeyScratch(k, side) uint64, hist of 256
// int32. `*pruned_out` (if non-null) says whether the pruned set sufficed.
SDM_HOST_DEVICE void AddressSelectPrunedSerial(const float* scores, int64_t side, int64_t k,
                                               const int32_t* rank_a, const int32_t* rank_b,
                                               int32_t* slots, float* sums, uint64_t* keys,
                                               int32_t* hist, bool* pruned_out) {
  const int64_t k_sub = AddressSubCount(k, side);
  const int64_t count = AddressCount(k, side);
  if (pruned_out != nullptr) *pruned_out = false;
  if (count <= 0) return;
  const int slot_bytes = AddressIndexBytes(side * side);
  const int key_bits = AddressRankKeyBits(slot_bytes);
  bool pruned = count < k_sub * k_sub;  // else every pair is selected
  uint64_t threshold = 0;
  if (pruned) {
    int64_t m = 0;
    for (int64_t i = 0; i < k_sub; ++i) {
      const int64_t len = AddressPrunedRowLength(i, count, k_sub);
      for (int64_t j = 0; j < len; ++j) {
        keys[m++] = AddressCandidateOf(scores, side, rank_a[i], rank_b[j], slot_bytes).key;
      }
    }
    // m >= count always (row 0 alone holds min(k_sub, count) and every row at least one);
    // guarded anyway.
    if (m < count) {
      pruned = false;
    } else {
      threshold = KthLargestKey(keys, m, count, key_bits, hist);
      for (int64_t i = 0; pruned && i < k_sub; ++i) {
        if (AddressPrunedRowReachesThreshold(scores, side, rank_a, rank_b, i, count, k_sub,
                                             threshold, slot_bytes)) {
          pruned = false;
        }
      }
    }
    if (!pruned) {
      const int64_t n = k_sub * k_sub;
      for (int64_t e = 0; e < n; ++e) {
        keys[e] =
            AddressCandidateOf(scores, side, rank_a[e / k_sub], rank_b[e % k_sub], slot_bytes).key;
      }
      threshold = KthLargestKey(keys, n, count, key_bits, hist);
    }
  }
  int64_t out = 0;
  for (int64_t i = 0; i < k_sub; ++i) {
    const int64_t len = pruned ? AddressPrunedRowLength(i, count, k_sub) : k_sub;
    for (int64_t j = 0; j < len; ++j) {
      const AddressCandidate c = AddressCandidateOf(scores, side, rank_a[i], rank_b[j], slot_bytes);
      if (c.key >= threshold && out < count) {
        slots[out] = c.slot;
        sums[out] = c.sum;
        ++out;
      }
    }
  }
  AddressSortBySlot(slots, sums, out);
  if (pruned_out != nullptr) *pruned_out = pruned;
}

// Orders idx[0..n) (indices into values) by rank, best first (insertion sort on rank keys;
// n <= k_sub). index_bytes: AddressIndexBytes of the half's length.
SDM_HOST_DEVICE void AddressSortByRank(const float* values, int32_t* idx, int64_t n,
                                       int index_bytes) {
  for (int64_t a = 1; a < n; ++a) {
    const int32_t v = idx[a];
    const uint64_t key = AddressRankKey(values[v], v, index_bytes);
    int64_t b = a;
    for (; b > 0 && AddressRankKey(values[idx[b - 1]], idx[b - 1], index_bytes) < key; --b) {
      idx[b] = idx[b - 1];
    }
    idx[b] = v;
  }
}

// Activations. Softmax(scale * x): max-subtracted, exponentials summed in double (as torch's
// fp32 softmax accumulates wider); L2: x / (sqrt(sum x^2 in double) + 1e-12); identity, sigmoid,
// relu are pointwise (scale applies to softmax only, as in the reference). The pieces below let
// a GPU block compute the reductions in parallel with the same final formulas.
SDM_HOST_DEVICE bool AddressActIsPointwise(AddressAct act) {
  return act != AddressAct::kSoftmax && act != AddressAct::kL2Normalize;
}
SDM_HOST_DEVICE float AddressActPointwise(AddressAct act, float x) {
  switch (act) {
    case AddressAct::kSigmoid:
      return Sigmoid(x);
    case AddressAct::kRelu:
      return x > 0.0f ? x : 0.0f;
    default:
      return x;
  }
}
// Running max that skips NaN (a NaN never becomes the max).
SDM_HOST_DEVICE float AddressMaxStep(float max_v, float x) { return max_v < x ? x : max_v; }
SDM_HOST_DEVICE float AddressSoftmaxInv(double sum) { return static_cast<float>(1.0 / sum); }
SDM_HOST_DEVICE float AddressL2Denominator(double sum_sq) {
  return static_cast<float>(sqrt(sum_sq)) + 1e-12f;
}

// In-place activation of v[0..n) by one thread.
SDM_HOST_DEVICE void ActivateAddressSerial(AddressAct act, float scale, float* v, int64_t n) {
  if (act == AddressAct::kSoftmax) {
    float max_v = -INFINITY;
    for (int64_t i = 0; i < n; ++i) {
      v[i] *= scale;
      max_v = AddressMaxStep(max_v, v[i]);
    }
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      v[i] = expf(v[i] - max_v);
      sum += v[i];
    }
    const float inv = AddressSoftmaxInv(sum);
    for (int64_t i = 0; i < n; ++i) v[i] *= inv;
  } else if (act == AddressAct::kL2Normalize) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(v[i]) * v[i];
    const float denom = AddressL2Denominator(ss);
    for (int64_t i = 0; i < n; ++i) v[i] /= denom;
  } else {
    for (int64_t i = 0; i < n; ++i) v[i] = AddressActPointwise(act, v[i]);
  }
}

}  // namespace sdm::kernels

#endif  // SDMSERVE_KERNELS_COMMON_SDM_ADDRESSING_MATH_H_
