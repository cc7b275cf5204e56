#include "engine/transfer_plan.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace sdm {

absl::StatusOr<std::vector<TransferChunk>> PlanTransferChunks(std::span<const TransferRun> runs,
                                                              int64_t chunk_elems) {
  if (chunk_elems <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a transfer chunk must hold at least one element, not ", chunk_elems));
  }
  std::vector<TransferChunk> chunks;
  TransferChunk open;  // the chunk being filled
  int64_t image_offset = 0;
  auto close = [&] {
    if (open.elems == 0) return;
    image_offset += open.elems;
    chunks.push_back(std::move(open));
    open = TransferChunk{};
    open.image_offset = image_offset;
  };
  for (int64_t r = 0; r < static_cast<int64_t>(runs.size()); ++r) {
    const TransferRun& run = runs[r];
    if (run.block_elems <= 0 || run.count < 0) {
      return absl::InvalidArgumentError(absl::StrCat("transfer run ", r, " has ", run.count,
                                                     " blocks of ", run.block_elems, " elements"));
    }
    if (run.count > 0 && run.block_elems > chunk_elems) {
      return absl::InvalidArgumentError(
          absl::StrCat("transfer run ", r, " has blocks of ", run.block_elems,
                       " elements, more than the transfer chunk's ", chunk_elems));
    }
    int64_t first = 0;
    while (first < run.count) {
      const int64_t room = (chunk_elems - open.elems) / run.block_elems;
      if (room == 0) {
        close();
        continue;
      }
      const int64_t n = std::min(room, run.count - first);
      open.pieces.push_back({r, first, n, open.elems});
      open.elems += n * run.block_elems;
      first += n;
    }
  }
  close();
  return chunks;
}

std::vector<int64_t> TransferRunOffsets(std::span<const TransferRun> runs) {
  std::vector<int64_t> offsets(runs.size() + 1, 0);
  for (size_t r = 0; r < runs.size(); ++r) {
    offsets[r + 1] = offsets[r] + runs[r].block_elems * runs[r].count;
  }
  return offsets;
}

}  // namespace sdm
