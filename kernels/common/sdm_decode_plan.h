// How the CUDA decode step (SdmDecodeStep, kernels/cuda/sdm.h) splits a layer's rows over thread
// blocks: the tile width, the number of column tiles per row, and where the write rows are
// allocated. Host-only and free of CUDA so that CI tests it on the CPU
// (tests/kernels/sdm_decode_plan_test.cc); the launch in kernels/cuda/sdm.cu follows it exactly.
//
// A block of 256 threads (kStepThreads in kernels/cuda/sdm.cu) owns one (segment, head) and one
// tile of 32 * vec columns.
// The allocation of a (segment, head)'s new rows must be seen by every tile of that row:
//   - one tile covers the row: its block allocates (one launch);
//   - 2..kSdmMaxClusterBlocks tiles: the tiles run as one thread-block cluster; rank 0 allocates
//     into its shared memory and the others read it from there after a cluster barrier (one
//     launch; Hopper and later, which every build targets: CMakeLists.txt);
//   - more tiles: a block per (segment, head) allocates first (two launches).
#ifndef SDMSERVE_KERNELS_COMMON_SDM_DECODE_PLAN_H_
#define SDMSERVE_KERNELS_COMMON_SDM_DECODE_PLAN_H_

#include <cstdint>

namespace sdm::kernels {

// Clusters of up to 8 blocks are portable; up to 16 need the kernel's non-portable opt-in
// (cudaFuncAttributeNonPortableClusterSizeAllowed), which Hopper grants.
inline constexpr int64_t kSdmPortableClusterBlocks = 8;
inline constexpr int64_t kSdmMaxClusterBlocks = 16;
// A grid of at least this many blocks fills the GPU with 16-byte tiles: ~2 blocks per SM on an
// H100/H200 (132 SMs). SdmStep chooses its tiles by it too (SdmMultiTileVec).
inline constexpr int64_t kSdmWideGridBlocks = 264;
// Staged rows of one block: n_w x tile bf16, at most this many bytes for 16-byte tiles.
inline constexpr int64_t kSdmDecodeMaxStagedBytes = 64 * 1024;

enum class SdmDecodeAlloc {
  kInBlock,   // one tile per row: its block allocates
  kCluster,   // the row's tiles are one cluster: rank 0 allocates
  kSeparate,  // a launch of its own allocates first
};

struct SdmDecodeShape {
  int64_t width = 0;     // row width (columns)
  int64_t n_w = 0;       // write slots per (token, head)
  int64_t segments = 0;  // tokens in the step
  int64_t heads = 0;
  bool rows_aligned_16 = false;  // the arena and M0 allow 16-byte accesses
  bool rows_aligned_4 = false;   // ... 4-byte accesses
};

struct SdmDecodePlan {
  int vec = 1;        // columns per lane: a tile is 32 * vec columns (1, 2 or 8)
  int64_t tiles = 1;  // column tiles per row: blocks per (segment, head)
  SdmDecodeAlloc alloc = SdmDecodeAlloc::kInBlock;
  int64_t cluster_blocks = 1;  // blocks per cluster (tiles when alloc is kCluster, else 1)
  int64_t staged_bytes = 0;    // dynamic shared memory per block: n_w x tile bf16
};

// The tile width (columns per lane) for rows of several tiles, the one rule SdmStep
// (kernels/cuda/sdm.h) and the decode step share: 16-byte tiles when the grid they make fills the
// GPU (kSdmWideGridBlocks) or 4-byte accesses are not possible; else 4-byte tiles (4x the blocks,
// for prefill's few long segments); 1 column per lane for odd widths or rows not 4-byte aligned.
// `vec8_allowed`: false where 16-byte tiles are ruled out otherwise (the decode step's staging
// limit). shape.n_w is not used.
inline int SdmMultiTileVec(const SdmDecodeShape& shape, bool vec8_allowed = true) {
  const bool vec8_ok = vec8_allowed && shape.width % 8 == 0 && shape.rows_aligned_16;
  const bool vec2_ok = shape.width % 2 == 0 && shape.rows_aligned_4;
  const int64_t blocks_at_vec8 = shape.segments * shape.heads * ((shape.width + 255) / 256);
  if (vec8_ok && (blocks_at_vec8 >= kSdmWideGridBlocks || !vec2_ok)) return 8;
  return vec2_ok ? 2 : 1;
}

// The narrowest tile that covers the row when one can (one launch); else SdmMultiTileVec, with
// 16-byte tiles ruled out where they would stage n_w x 512 B above kSdmDecodeMaxStagedBytes.
// `max_cluster_blocks`: the largest cluster the launch may use (kSdmMaxClusterBlocks, or
// kSdmPortableClusterBlocks where the non-portable opt-in was refused; 1: no clusters).
inline SdmDecodePlan PlanSdmDecode(const SdmDecodeShape& shape,
                                   int64_t max_cluster_blocks = kSdmMaxClusterBlocks) {
  const int64_t width = shape.width;
  const bool vec2_ok = width % 2 == 0 && shape.rows_aligned_4;
  const bool vec8_stages = shape.n_w * 256 * 2 <= kSdmDecodeMaxStagedBytes;
  const bool vec8_fits = width % 8 == 0 && shape.rows_aligned_16 && vec8_stages;
  SdmDecodePlan plan;
  if (width <= 32) {
    plan.vec = 1;
  } else if (width <= 64 && vec2_ok) {
    plan.vec = 2;
  } else if (width <= 256 && vec8_fits) {
    plan.vec = 8;
  } else {
    plan.vec = SdmMultiTileVec(shape, vec8_stages);
  }
  const int64_t tile = 32 * plan.vec;
  plan.tiles = (width + tile - 1) / tile;
  plan.staged_bytes = shape.n_w * tile * 2;
  if (plan.tiles == 1) {
    plan.alloc = SdmDecodeAlloc::kInBlock;
  } else if (plan.tiles <= max_cluster_blocks && plan.tiles <= kSdmMaxClusterBlocks) {
    plan.alloc = SdmDecodeAlloc::kCluster;
    plan.cluster_blocks = plan.tiles;
  } else {
    plan.alloc = SdmDecodeAlloc::kSeparate;
  }
  return plan;
}

}  // namespace sdm::kernels

#endif  // SDMSERVE_KERNELS_COMMON_SDM_DECODE_PLAN_H_
