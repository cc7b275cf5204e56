// PlanSdmDecode and SdmMultiTileVec (kernels/common/sdm_decode_plan.h): how the CUDA decode step
// (and SdmStep) split a row over thread blocks, and where the decode step's write rows are
// allocated. Tested here, on the CPU, because the
// CUDA launch follows the plan exactly and CI has no GPU.
#include "kernels/common/sdm_decode_plan.h"

#include <algorithm>
#include <cstdint>
#include <random>

#include "gtest/gtest.h"

namespace sdm::kernels {
namespace {

SdmDecodeShape Shape(int64_t width, int64_t n_w, int64_t segments, int64_t heads = 2) {
  SdmDecodeShape shape;
  shape.width = width;
  shape.n_w = n_w;
  shape.segments = segments;
  shape.heads = heads;
  shape.rows_aligned_16 = shape.rows_aligned_4 = true;
  return shape;
}

// Widths min_width..min_width + 4095, 0-256 writes, 1-300 segments, 1-8 heads; rows 16-byte
// aligned 3 times in 4, else 4-byte aligned half the time.
SdmDecodeShape RandomShape(std::mt19937& rng, int64_t min_width) {
  // One draw per statement: the order of a call's arguments is unspecified, and a seed must
  // name the same shapes under every compiler.
  const int64_t width = min_width + rng() % 4096;
  const int64_t n_w = rng() % 257;
  const int64_t segments = 1 + rng() % 300;
  const int64_t heads = 1 + rng() % 8;
  SdmDecodeShape shape = Shape(width, n_w, segments, heads);
  shape.rows_aligned_16 = rng() % 4 != 0;
  shape.rows_aligned_4 = shape.rows_aligned_16 || rng() % 2 == 0;
  return shape;
}

TEST(SdmDecodePlanTest, OneTileCoversNarrowRows) {
  for (int64_t width : {1, 17, 32, 64, 96, 200, 256}) {
    const SdmDecodePlan plan = PlanSdmDecode(Shape(width, 128, 1));
    EXPECT_EQ(plan.tiles, 1) << width;
    EXPECT_EQ(plan.alloc, SdmDecodeAlloc::kInBlock) << width;
    EXPECT_EQ(plan.cluster_blocks, 1) << width;
    EXPECT_GE(32 * plan.vec, width) << width;
  }
}

// The flagship (hd 1024, 128 writes): 16-byte tiles in clusters of 4 once the grid fills the GPU
// (64 x 2 x 4 blocks), 4-byte tiles in clusters of 16 below that; 256 writes cannot stage
// 16-byte tiles (128 KiB) and take 4-byte tiles at every batch.
TEST(SdmDecodePlanTest, FlagshipRowsRunAsClusters) {
  SdmDecodePlan plan = PlanSdmDecode(Shape(1024, 128, 64));
  EXPECT_EQ(plan.vec, 8);
  EXPECT_EQ(plan.tiles, 4);
  EXPECT_EQ(plan.alloc, SdmDecodeAlloc::kCluster);
  EXPECT_EQ(plan.cluster_blocks, 4);
  EXPECT_EQ(plan.staged_bytes, 128 * 256 * 2);
  plan = PlanSdmDecode(Shape(1024, 128, 1));
  EXPECT_EQ(plan.vec, 2);
  EXPECT_EQ(plan.tiles, 16);
  EXPECT_EQ(plan.alloc, SdmDecodeAlloc::kCluster);
  EXPECT_EQ(plan.cluster_blocks, 16);
  EXPECT_EQ(plan.staged_bytes, 128 * 64 * 2);
  plan = PlanSdmDecode(Shape(1024, 256, 64));
  EXPECT_EQ(plan.vec, 2);
  EXPECT_EQ(plan.cluster_blocks, 16);
}

// Where the non-portable opt-in is refused, clusters stop at 8 blocks and wider rows allocate in
// a launch of their own; without clusters at all, every multi-tile row does.
TEST(SdmDecodePlanTest, ClusterLimitDecidesBetweenClusterAndSeparateLaunch) {
  EXPECT_EQ(PlanSdmDecode(Shape(1024, 128, 1), kSdmPortableClusterBlocks).alloc,
            SdmDecodeAlloc::kSeparate);
  EXPECT_EQ(PlanSdmDecode(Shape(512, 128, 1), kSdmPortableClusterBlocks).cluster_blocks, 8);
  EXPECT_EQ(PlanSdmDecode(Shape(512, 128, 1), 1).alloc, SdmDecodeAlloc::kSeparate);
  EXPECT_EQ(PlanSdmDecode(Shape(200, 128, 1), 1).alloc, SdmDecodeAlloc::kInBlock);
  // A limit above the hardware's is clamped to it.
  EXPECT_EQ(PlanSdmDecode(Shape(1090, 128, 1), 64).alloc, SdmDecodeAlloc::kSeparate);
}

TEST(SdmDecodePlanTest, AlignmentAndOddWidthsNarrowTheTile) {
  SdmDecodeShape shape = Shape(545, 8, 1);  // odd: one column per lane
  EXPECT_EQ(PlanSdmDecode(shape).vec, 1);
  EXPECT_EQ(PlanSdmDecode(shape).tiles, 18);
  EXPECT_EQ(PlanSdmDecode(shape).alloc, SdmDecodeAlloc::kSeparate);
  shape = Shape(1024, 8, 512);
  shape.rows_aligned_16 = false;  // 4-byte accesses only
  EXPECT_EQ(PlanSdmDecode(shape).vec, 2);
  shape.rows_aligned_4 = false;
  EXPECT_EQ(PlanSdmDecode(shape).vec, 1);
  EXPECT_EQ(PlanSdmDecode(shape).alloc, SdmDecodeAlloc::kSeparate);  // 32 tiles
}

// SdmStep's tiles (SdmMultiTileVec): 16-byte tiles for a decode batch that fills the GPU,
// 4-byte tiles (4x the blocks) for prefill's few long segments, narrower where the alignment or
// the width rules the wider out.
TEST(SdmDecodePlanTest, StepTilesFollowTheGridWidth) {
  EXPECT_EQ(SdmMultiTileVec(Shape(1024, 0, 64)), 8);  // 64 x 2 x 4 = 512 blocks
  EXPECT_EQ(SdmMultiTileVec(Shape(1024, 0, 33)), 8);  // 264: exactly kSdmWideGridBlocks
  EXPECT_EQ(SdmMultiTileVec(Shape(1024, 0, 32)), 2);  // 256 blocks: too few
  EXPECT_EQ(SdmMultiTileVec(Shape(1024, 0, 1)), 2);   // one prefill segment
  EXPECT_EQ(SdmMultiTileVec(Shape(1025, 0, 64)), 1);  // odd width
  EXPECT_EQ(SdmMultiTileVec(Shape(1028, 0, 64)), 2);  // not a multiple of 8
  EXPECT_EQ(SdmMultiTileVec(Shape(1024, 0, 64), /*vec8_allowed=*/false), 2);
  SdmDecodeShape shape = Shape(1024, 0, 64);
  shape.rows_aligned_16 = false;  // M0 or the arena only 4-byte aligned
  EXPECT_EQ(SdmMultiTileVec(shape), 2);
  shape.rows_aligned_4 = false;
  EXPECT_EQ(SdmMultiTileVec(shape), 1);
}

// For rows wider than one 16-byte tile the decode step's tile is SdmStep's, less 16-byte tiles
// where they would stage too much: one rule, stated once.
TEST(SdmDecodePlanTest, WideRowsTakeTheStepsTile) {
  for (uint32_t seed : {7u, std::random_device{}()}) {
    SCOPED_TRACE(seed);
    std::mt19937 rng(seed);
    for (int i = 0; i < 2000; ++i) {
      const SdmDecodeShape shape = RandomShape(rng, /*min_width=*/257);
      const bool fits = shape.n_w * 512 <= kSdmDecodeMaxStagedBytes;
      ASSERT_EQ(PlanSdmDecode(shape).vec, SdmMultiTileVec(shape, fits))
          << shape.width << " " << shape.n_w << " " << shape.segments << " " << shape.heads;
    }
  }
}

// Invariants over random shapes (fixed seeds and a fresh one): the tiles cover the row and no
// more than one tile's worth past it; a cluster is exactly the row's tiles and within the limit;
// the 16-byte tile is used only when its staged rows fit; vec 8/2 only where the accesses allow.
TEST(SdmDecodePlanTest, PlansCoverTheRowWithinTheLimits) {
  for (uint32_t seed : {1u, 2u, 3u, std::random_device{}()}) {
    SCOPED_TRACE(seed);
    std::mt19937 rng(seed);
    for (int i = 0; i < 2000; ++i) {
      const SdmDecodeShape shape = RandomShape(rng, /*min_width=*/1);
      const int64_t limit = 1 + rng() % 20;
      const SdmDecodePlan plan = PlanSdmDecode(shape, limit);
      const int64_t tile = 32 * plan.vec;
      ASSERT_TRUE(plan.vec == 1 || plan.vec == 2 || plan.vec == 8);
      ASSERT_GE(plan.tiles * tile, shape.width);
      ASSERT_LT((plan.tiles - 1) * tile, shape.width);
      ASSERT_EQ(plan.staged_bytes, shape.n_w * tile * 2);
      if (plan.vec == 8) {
        ASSERT_EQ(shape.width % 8, 0);
        ASSERT_TRUE(shape.rows_aligned_16);
        ASSERT_LE(plan.staged_bytes, kSdmDecodeMaxStagedBytes);
      }
      if (plan.vec == 2) {
        ASSERT_EQ(shape.width % 2, 0);
        ASSERT_TRUE(shape.rows_aligned_4);
      }
      switch (plan.alloc) {
        case SdmDecodeAlloc::kInBlock:
          ASSERT_EQ(plan.tiles, 1);
          ASSERT_EQ(plan.cluster_blocks, 1);
          break;
        case SdmDecodeAlloc::kCluster:
          ASSERT_GT(plan.tiles, 1);
          ASSERT_EQ(plan.cluster_blocks, plan.tiles);
          ASSERT_LE(plan.cluster_blocks, std::min(limit, kSdmMaxClusterBlocks));
          break;
        case SdmDecodeAlloc::kSeparate:
          ASSERT_GT(plan.tiles, std::min(limit, kSdmMaxClusterBlocks));
          ASSERT_EQ(plan.cluster_blocks, 1);
          break;
      }
    }
  }
}

}  // namespace
}  // namespace sdm::kernels
