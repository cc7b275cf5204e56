// How a park or resume moves a session's blocks (SDM rows, KV pages) between device memory and
// the host image through one device chunk of bounded size (engine/cuda/device_state.h,
// TransferStaging). Host logic only, no CUDA: tested on the CPU
// (tests/engine/transfer_plan_test.cc).
//
// The host image holds the runs one after the other, each run's blocks back to back (a run: the
// private rows of the session, or the pages of one attention layer, all blocks of one size). A
// chunk is a contiguous range of the image holding whole blocks, at most `chunk_elems` elements;
// its pieces say which blocks of which runs it holds and where. A park gathers each piece into
// the chunk and copies the chunk to the host; a resume copies the chunk to the device and
// scatters each piece. So a transfer is one copy per chunk (a few for a large session, one for a
// small one) whatever its number of blocks, and the device memory it needs is one chunk.
#ifndef SDMSERVE_ENGINE_TRANSFER_PLAN_H_
#define SDMSERVE_ENGINE_TRANSFER_PLAN_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace sdm {

struct TransferRun {
  int64_t block_elems = 0;  // elements per block (> 0)
  int64_t count = 0;        // blocks (>= 0)
};

struct TransferPiece {
  int64_t run = 0;           // index into the runs
  int64_t first = 0;         // first block of the run in this piece
  int64_t count = 0;         // blocks (> 0)
  int64_t chunk_offset = 0;  // elements from the chunk's start
};

struct TransferChunk {
  int64_t image_offset = 0;  // elements from the image's start
  int64_t elems = 0;         // elements in the chunk (the pieces back to back)
  std::vector<TransferPiece> pieces;
};

// The chunks of a transfer, in image order: every block of every run exactly once, each chunk
// filled with as many whole blocks as fit. InvalidArgument when a run's block is larger than
// `chunk_elems` or a size is not positive (counts may be 0).
absl::StatusOr<std::vector<TransferChunk>> PlanTransferChunks(std::span<const TransferRun> runs,
                                                              int64_t chunk_elems);

// Where each run starts in the image, in elements: runs.size() + 1 offsets, the last one the
// whole image's size.
std::vector<int64_t> TransferRunOffsets(std::span<const TransferRun> runs);

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_TRANSFER_PLAN_H_
