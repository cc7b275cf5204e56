#include "kernels/cpu/sdm_addressing.h"

#include "base/check.h"

namespace sdm::kernels::cpu {

void SelectSlots(const float* scores, int64_t side, int64_t k, std::span<int32_t> slots,
                 std::span<float> sums, AddressScratch& s) {
  const int64_t count = AddressCount(k, side);
  SDM_CHECK(static_cast<int64_t>(slots.size()) == count);
  SDM_CHECK(static_cast<int64_t>(sums.size()) == count);
  const int64_t k_sub = AddressSubCount(k, side);
  s.idx_a.resize(k_sub);
  s.idx_b.resize(k_sub);
  s.keys.resize(AddressSelectKeyScratch(k, side));
  s.hist.resize(256);
  // Each half's top k_sub, then in rank order for the pruned pair selection (the CUDA kernel's
  // selection too; equal to AddressSelectSerial's over all k_sub^2 pairs, bit for bit).
  AddressTopIndices(scores, side, k_sub, s.idx_a.data(), s.keys.data(), s.hist.data());
  AddressTopIndices(scores + side, side, k_sub, s.idx_b.data(), s.keys.data(), s.hist.data());
  const int half_bytes = AddressIndexBytes(side);
  AddressSortByRank(scores, s.idx_a.data(), k_sub, half_bytes);
  AddressSortByRank(scores + side, s.idx_b.data(), k_sub, half_bytes);
  AddressSelectPrunedSerial(scores, side, k, s.idx_a.data(), s.idx_b.data(), slots.data(),
                            sums.data(), s.keys.data(), s.hist.data(), nullptr);
}

void ActivateAddress(AddressAct act, float scale, std::span<float> v) {
  ActivateAddressSerial(act, scale, v.data(), static_cast<int64_t>(v.size()));
}

}  // namespace sdm::kernels::cpu
