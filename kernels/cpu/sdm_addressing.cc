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
  AddressSelectSerial(scores, side, k, slots.data(), sums.data(), s.idx_a.data(), s.idx_b.data(),
                      s.keys.data(), s.hist.data());
}

void ActivateAddress(AddressAct act, float scale, std::span<float> v) {
  ActivateAddressSerial(act, scale, v.data(), static_cast<int64_t>(v.size()));
}

}  // namespace sdm::kernels::cpu
