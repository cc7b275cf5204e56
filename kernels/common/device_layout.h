// Where a session's state lives in the CUDA backend's device memory, as index math shared by the
// kernels, the engine that allocates the memory and the CPU tests that check it (docs/model-spec.md
// §7, §6). Pure functions on integers: no CUDA types, so host code and tests include it freely.
//
// KV cache (attn and swa layers). Each attention layer owns an arena of pages; a page holds
// kKvPageTokens consecutive positions of one sequence: first their key rows, then their value
// rows, each row kv_width bf16 values (kv head g at [g * head_dim, (g + 1) * head_dim)). A
// sequence's page table maps its logical page numbers to arena pages:
//   full attention (ring_pages == 0): position p is in logical page p / kKvPageTokens;
//   sliding window (ring_pages > 0): logical page (p / kKvPageTokens) % ring_pages, a ring of
//   ring_pages * kKvPageTokens positions that must hold the window plus one prefill chunk.
//
// SDM rows. Every SDM layer of every device-resident session draws rows of head_width bf16 values
// from one arena. A session's layer has a slot->row table [heads * slots_per_head] of int32:
// a row index >= 0, or kSdmNoRow while the slot still holds M0 (the learned memory, or zeros).
// A row reference (what the read kernels take) is either a row index (>= 0) or
// SdmM0Ref(head, slot) < 0, which names row head * slots_per_head + slot of M0.
#ifndef SDMSERVE_KERNELS_COMMON_DEVICE_LAYOUT_H_
#define SDMSERVE_KERNELS_COMMON_DEVICE_LAYOUT_H_

#include <cstdint>

#include "kernels/common/host_device.h"

namespace sdm::kernels {

inline constexpr int32_t kKvPageTokens = 64;
inline constexpr int32_t kSdmNoRow = -1;

// Pages a ring needs to hold `tokens` positions (the window plus one prefill chunk).
SDM_HOST_DEVICE int32_t KvRingPages(int64_t tokens) {
  return static_cast<int32_t>((tokens + kKvPageTokens - 1) / kKvPageTokens);
}

// Index into a sequence's page table of the page holding position `pos`.
SDM_HOST_DEVICE int64_t KvPageTableIndex(int64_t pos, int32_t ring_pages) {
  const int64_t logical = pos / kKvPageTokens;
  return ring_pages > 0 ? logical % ring_pages : logical;
}

// Elements (bf16 values) in one page of a layer whose rows are kv_width wide.
SDM_HOST_DEVICE int64_t KvPageElements(int64_t kv_width) { return 2 * kKvPageTokens * kv_width; }

// Offset, in elements from the start of the arena, of the key (value = false) or value row of
// position `pos` stored in arena page `page`.
SDM_HOST_DEVICE int64_t KvRowOffset(int32_t page, int64_t pos, int64_t kv_width, bool value) {
  return static_cast<int64_t>(page) * KvPageElements(kv_width) +
         ((value ? kKvPageTokens : 0) + pos % kKvPageTokens) * kv_width;
}

// A read reference to M0's row of (head, slot): always negative.
SDM_HOST_DEVICE int32_t SdmM0Ref(int64_t head, int64_t slot, int64_t slots_per_head) {
  return static_cast<int32_t>(-1 - (head * slots_per_head + slot));
}
// The M0 row index named by a negative reference.
SDM_HOST_DEVICE int64_t SdmM0RowOf(int32_t ref) { return -1 - static_cast<int64_t>(ref); }

}  // namespace sdm::kernels

#endif  // SDMSERVE_KERNELS_COMMON_DEVICE_LAYOUT_H_
