// PlanTransferChunks (engine/transfer_plan.h): the chunks a park or resume moves through cover
// every block exactly once, in image order, whole, within the chunk size, packed as full as whole
// blocks allow. Random runs with a fixed and a fresh seed (printed on failure).
#include "engine/transfer_plan.h"

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace sdm {
namespace {

// Checks the plan against its contract.
void CheckPlan(const std::vector<TransferRun>& runs, const std::vector<TransferChunk>& chunks,
               int64_t chunk_elems) {
  std::vector<std::vector<int64_t>> where(runs.size());
  for (size_t r = 0; r < runs.size(); ++r) where[r].assign(runs[r].count, -1);
  int64_t image = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const TransferChunk& chunk = chunks[c];
    SCOPED_TRACE(testing::Message() << "chunk " << c);
    EXPECT_EQ(chunk.image_offset, image) << "chunks are contiguous in the image";
    EXPECT_GT(chunk.elems, 0);
    EXPECT_LE(chunk.elems, chunk_elems);
    int64_t fill = 0;
    for (const TransferPiece& p : chunk.pieces) {
      EXPECT_EQ(p.chunk_offset, fill) << "pieces are back to back";
      EXPECT_GT(p.count, 0);
      for (int64_t b = 0; b < p.count; ++b) {
        ASSERT_LT(p.first + b, runs[p.run].count);
        EXPECT_EQ(where[p.run][p.first + b], -1) << "block moved twice";
        where[p.run][p.first + b] = chunk.image_offset + fill + b * runs[p.run].block_elems;
      }
      fill += p.count * runs[p.run].block_elems;
    }
    EXPECT_EQ(fill, chunk.elems);
    image += chunk.elems;
  }
  // Image order: runs one after the other (at TransferRunOffsets), each run's blocks back to
  // back; the last offset is the image's size.
  const std::vector<int64_t> offsets = TransferRunOffsets(runs);
  ASSERT_EQ(offsets.size(), runs.size() + 1);
  EXPECT_EQ(image, offsets.back());
  int64_t expected = 0;
  for (size_t r = 0; r < runs.size(); ++r) {
    EXPECT_EQ(offsets[r], expected) << "run " << r;
    for (int64_t b = 0; b < runs[r].count; ++b) {
      EXPECT_EQ(where[r][b], expected) << "run " << r << ", block " << b;
      expected += runs[r].block_elems;
    }
  }
  // Packed: a chunk is closed only when the next block does not fit.
  for (size_t c = 0; c + 1 < chunks.size(); ++c) {
    const TransferPiece& next = chunks[c + 1].pieces.front();
    EXPECT_GT(chunks[c].elems + runs[next.run].block_elems, chunk_elems) << "chunk " << c;
  }
}

TEST(TransferPlanTest, OneChunkWhenEverythingFits) {
  const std::vector<TransferRun> runs = {{1024, 40}, {8192, 3}, {8192, 0}, {512, 7}};
  absl::StatusOr<std::vector<TransferChunk>> plan = PlanTransferChunks(runs, int64_t{1} << 20);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->size(), 1u);
  EXPECT_EQ((*plan)[0].pieces.size(), 3u);  // the empty run has no piece
  CheckPlan(runs, *plan, int64_t{1} << 20);
}

TEST(TransferPlanTest, LargeTransfersSplitIntoFullChunks) {
  // 10 blocks of 3 in chunks of 7: two blocks a chunk (6 of 7 elements), five chunks.
  const std::vector<TransferRun> runs = {{3, 10}};
  absl::StatusOr<std::vector<TransferChunk>> plan = PlanTransferChunks(runs, 7);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->size(), 5u);
  CheckPlan(runs, *plan, 7);
}

TEST(TransferPlanTest, RandomRunsAreCoveredExactlyOnce) {
  for (const uint32_t seed : {20261204u, std::random_device{}()}) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    for (int trial = 0; trial < 200; ++trial) {
      const int64_t chunk_elems = std::uniform_int_distribution<int64_t>(1, 5000)(rng);
      std::vector<TransferRun> runs(std::uniform_int_distribution<int>(0, 8)(rng));
      for (TransferRun& run : runs) {
        run.block_elems = std::uniform_int_distribution<int64_t>(1, chunk_elems)(rng);
        run.count = std::uniform_int_distribution<int64_t>(0, 30)(rng);
      }
      absl::StatusOr<std::vector<TransferChunk>> plan = PlanTransferChunks(runs, chunk_elems);
      ASSERT_TRUE(plan.ok()) << plan.status();
      CheckPlan(runs, *plan, chunk_elems);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(TransferPlanTest, RejectsBlocksLargerThanAChunkAndBadSizes) {
  const std::vector<TransferRun> too_large = {{100, 1}};
  EXPECT_EQ(PlanTransferChunks(too_large, 99).status().code(), absl::StatusCode::kInvalidArgument);
  // A run with no blocks may have any positive block size.
  const std::vector<TransferRun> empty_large = {{100, 0}};
  EXPECT_TRUE(PlanTransferChunks(empty_large, 99).ok());
  const std::vector<TransferRun> zero_block = {{0, 3}};
  EXPECT_EQ(PlanTransferChunks(zero_block, 99).status().code(), absl::StatusCode::kInvalidArgument);
  const std::vector<TransferRun> negative = {{4, -1}};
  EXPECT_EQ(PlanTransferChunks(negative, 99).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanTransferChunks({}, 0).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::vector<TransferChunk>> none = PlanTransferChunks({}, 8);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

}  // namespace
}  // namespace sdm
