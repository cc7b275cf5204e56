// libFuzzer target for the delta log (state_store/state_log.h): any byte string replayed by
// ReplayLog onto a valid snapshot's state, or scanned by ScanLog, must give an error or a valid
// session, never a crash, an out-of-bounds access, undefined behaviour or a huge allocation
// (built with ASan and UBSan; see scripts/fuzz.sh).
//
// Input: one mode byte, then the log. Mode bit 0 set: the header's base id and checksum and every
// record's checksums (of its payload and of its size) are recomputed, so that mutations reach the
// checks behind the checksums (sizes, layer order, positions, slot indices, journaled writes, KV
// continuity).
//
// Properties on every input: errors are DATA_LOSS, FAILED_PRECONDITION or RESOURCE_EXHAUSTED;
// memory allocated stays within a constant plus a small multiple of the input; ScanLog agrees
// with ReplayLog on success (good bytes, last position); and a replayed state encodes to a
// snapshot that decodes to the same position.
//
// `state_log_fuzzer --write-seeds=DIR` writes a seed corpus of valid logs to DIR and exits.
#include <sanitizer/allocator_interface.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "absl/strings/string_view.h"
#include "state_store/session_state.h"
#include "state_store/state_codec.h"
#include "state_store/state_log.h"
#include "tests/fuzz/fuzz_state_util.h"
#include "xxhash.h"

namespace {

using namespace sdm::fuzz;  // NOLINT: the fuzzers' shared fixture

constexpr int kBaseTokens = 4;

// The snapshot every log extends, and its id.
const std::string& Base() {
  static const std::string base = [] {
    sdm::SessionState state(Layout());
    FillState(state, kBaseTokens);
    return sdm::EncodeSessionState(state, sdm::SessionRecord{"s", "m", -1, 1}, kFingerprint);
  }();
  return base;
}
uint64_t BaseId() {
  auto prefix = sdm::RecordPrefixSize(Base(), Base().size(), kFingerprint);
  return sdm::SnapshotId(absl::string_view(Base()).substr(0, *prefix));
}

void FixUp(std::string& log) {
  if (log.size() < sdm::kLogHeaderBytes) return;
  const uint64_t id = BaseId();
  std::memcpy(log.data() + 24, &id, 8);
  const uint64_t header = XXH64(log.data(), 32, 0);
  std::memcpy(log.data() + 32, &header, 8);
  size_t at = sdm::kLogHeaderBytes;
  while (at + sdm::kLogRecordHeaderBytes <= log.size()) {
    uint64_t n = 0;
    std::memcpy(&n, log.data() + at, 8);
    if (n > log.size() - at - sdm::kLogRecordHeaderBytes) break;
    const uint64_t sum = XXH64(log.data() + at + sdm::kLogRecordHeaderBytes, n, 0);
    std::memcpy(log.data() + at + 8, &sum, 8);
    const uint64_t size_sum = XXH64(log.data() + at, 8, 0);  // the size's own checksum
    std::memcpy(log.data() + at + 16, &size_sum, 8);
    at += sdm::kLogRecordHeaderBytes + n;
  }
}

void CheckLog(const std::string& log) {
  auto decoded = sdm::DecodeSessionState(Base(), Layout(), kFingerprint);
  if (!decoded.ok()) Fail("the base snapshot does not decode");
  allocated = 0;
  counting = true;
  auto replay = sdm::ReplayLog(log, kFingerprint, BaseId(), *decoded->state);
  counting = false;
  if (allocated > kAllocationSlack + kAllocationPerBlobByte * log.size()) {
    std::fprintf(stderr, "replaying %zu bytes allocated %zu bytes\n", log.size(), allocated);
    Fail("replay allocated far more memory than the log's size");
  }
  auto scanned = sdm::ScanLog(
      [&](uint64_t offset, uint64_t n) -> absl::StatusOr<std::string> {
        return log.substr(std::min<size_t>(offset, log.size()), n);
      },
      log.size(), kFingerprint, BaseId());
  if (!replay.ok()) {
    const absl::StatusCode code = replay.status().code();
    if (code != absl::StatusCode::kDataLoss && code != absl::StatusCode::kFailedPrecondition &&
        code != absl::StatusCode::kResourceExhausted) {
      Fail("replay error is neither DATA_LOSS, FAILED_PRECONDITION nor RESOURCE_EXHAUSTED");
    }
    return;
  }
  if (replay->valid_bytes + replay->dropped_bytes != log.size()) Fail("bytes do not add up");
  // ScanLog reads only the last records: it may miss damage further back, never the reverse.
  if (scanned.ok() &&
      (scanned->valid_bytes != replay->valid_bytes ||
       (replay->has_record && scanned->record.position != replay->record.position))) {
    Fail("ScanLog disagrees with ReplayLog");
  }
  if (replay->has_record && decoded->state->position() != replay->record.position) {
    Fail("replayed state is not at the last record's position");
  }
  const std::string snapshot =
      sdm::EncodeSessionState(*decoded->state, decoded->record, kFingerprint);
  auto again = sdm::DecodeSessionState(snapshot, Layout(), kFingerprint);
  if (!again.ok() || again->state->position() != decoded->state->position()) {
    Fail("a replayed state does not round-trip through a snapshot");
  }
}

int WriteSeeds(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  auto decoded = sdm::DecodeSessionState(Base(), Layout(), kFingerprint);
  sdm::SessionState& state = *decoded->state;
  std::string log = sdm::EncodeLogHeader(kFingerprint, BaseId());
  int n = 0;
  // Turns of 1, 2 and 5 tokens (5 > the ring of 3: the ring's reset path), then two whose SDM
  // writes are journaled: their deltas carry the writes (kind 4).
  const int turns[][2] = {{1, 0}, {2, 0}, {5, 0}, {3, 1}, {2, 1}};
  for (const auto [turn, journaled] : turns) {
    const int64_t from = state.position();
    if (!journaled) {
      FillState(state, turn);
    } else {
      FillStateJournaled(state, turn);
      if (!state.sdm(1).journal_complete()) {
        std::fprintf(stderr, "turn %d: the journal was dropped; its seed would carry rows\n", turn);
        return 1;
      }
    }
    log += sdm::EncodeSessionDelta(state, sdm::SessionRecord{"s", "m", -1, 2}, from);
    state.ClearDirty();
    CheckLog(log);
    for (char mode : {'\0', '\1'}) {
      std::ofstream out(dir / ("seed_" + std::to_string(n++)), std::ios::binary);
      out << mode << log;
      if (!out) return 1;
    }
  }
  std::printf("wrote %d seeds to %s\n", n, dir.c_str());
  return 0;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  return sdm::fuzz::InitializeFuzzer(argc, argv, WriteSeeds);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return sdm::fuzz::RunInput(data, size, FixUp, CheckLog);
}
