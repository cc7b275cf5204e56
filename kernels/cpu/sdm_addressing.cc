#include "kernels/cpu/sdm_addressing.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kernels/common/check.h"
#include "kernels/common/sdm_math.h"
#include "kernels/cpu/vector_math.h"

namespace sdm::kernels::cpu {
namespace {

// Sort key: NaN ranks below every number.
inline float Key(float v) { return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v; }

// Indices of the top `k` of values[0..n), ordered by (value desc, index asc).
void TopIndices(const float* values, int64_t n, int64_t k, std::vector<int32_t>& out) {
  out.resize(n);
  std::iota(out.begin(), out.end(), 0);
  auto better = [values](int32_t x, int32_t y) {
    const float vx = Key(values[x]), vy = Key(values[y]);
    return vx > vy || (vx == vy && x < y);
  };
  std::partial_sort(out.begin(), out.begin() + k, out.end(), better);
  out.resize(k);
}

}  // namespace

int64_t AddressCount(int64_t k, int64_t side) {
  const int64_t k_sub = std::min(k, side);
  return std::min(k, k_sub * k_sub);
}

void SelectSlots(const float* scores, int64_t side, int64_t k, std::span<int32_t> slots,
                 std::span<float> sums, AddressScratch& s) {
  const int64_t k_sub = std::min(k, side);
  const int64_t count = AddressCount(k, side);
  SDM_CHECK(static_cast<int64_t>(slots.size()) == count);
  SDM_CHECK(static_cast<int64_t>(sums.size()) == count);
  TopIndices(scores, side, k_sub, s.idx_a);
  TopIndices(scores + side, side, k_sub, s.idx_b);
  const int64_t n = k_sub * k_sub;
  s.cand_sum.resize(n);
  s.cand_slot.resize(n);
  for (int64_t i = 0; i < k_sub; ++i) {
    const float va = scores[s.idx_a[i]];
    for (int64_t j = 0; j < k_sub; ++j) {
      s.cand_sum[i * k_sub + j] = va + scores[side + s.idx_b[j]];
      s.cand_slot[i * k_sub + j] = static_cast<int32_t>(s.idx_a[i] * side + s.idx_b[j]);
    }
  }
  s.order.resize(n);
  std::iota(s.order.begin(), s.order.end(), 0);
  auto better = [&s](int32_t x, int32_t y) {
    const float vx = Key(s.cand_sum[x]), vy = Key(s.cand_sum[y]);
    return vx > vy || (vx == vy && s.cand_slot[x] < s.cand_slot[y]);
  };
  if (count < n) {
    std::nth_element(s.order.begin(), s.order.begin() + count, s.order.end(), better);
  }
  s.order.resize(count);
  std::sort(s.order.begin(), s.order.end(),
            [&s](int32_t x, int32_t y) { return s.cand_slot[x] < s.cand_slot[y]; });
  for (int64_t i = 0; i < count; ++i) {
    slots[i] = s.cand_slot[s.order[i]];
    sums[i] = s.cand_sum[s.order[i]];
  }
}

void ActivateAddress(AddressAct act, float scale, std::span<float> v) {
  switch (act) {
    case AddressAct::kSoftmax:
      Softmax(v.data(), static_cast<int64_t>(v.size()), scale);
      return;
    case AddressAct::kL2Normalize: {
      double ss = 0.0;
      for (float x : v) ss += static_cast<double>(x) * x;
      const float denom = static_cast<float>(std::sqrt(ss)) + 1e-12f;
      for (float& x : v) x /= denom;
      return;
    }
    case AddressAct::kIdentity:
      return;
    case AddressAct::kSigmoid:
      for (float& x : v) x = Sigmoid(x);
      return;
    case AddressAct::kRelu:
      for (float& x : v) x = x > 0.0f ? x : 0.0f;
      return;
  }
}

}  // namespace sdm::kernels::cpu
