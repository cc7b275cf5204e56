// libFuzzer target for the session-state decoder (state_store/state_codec.h): any byte string
// fed to DecodeSessionState, RecordPrefixSize and DecodeSessionRecord must give an error or a
// valid session, never a crash, an out-of-bounds access, undefined behaviour or a huge
// allocation (built with ASan and UBSan; see scripts/fuzz.sh).
//
// Input: one mode byte, then the blob. Mode bit 0 set: before decoding, the blob's total-size
// field, every section checksum and the header checksum are recomputed, so that mutations reach
// the checks behind the checksums (sizes, layer order, shapes, slot indices) instead of all being
// stopped by the first checksum.
//
// Memory: the bytes allocated while decoding must stay within a constant plus a small multiple
// of the blob's size (counted with the sanitizer allocator's malloc hook): a blob claiming a
// huge history must be refused from its sizes, not after reserving memory for the claim.
//
// Properties checked on every blob that decodes: the record read from the prefix (as Open()
// does) agrees with the full decode; the blob is refused under another model's fingerprint; and
// re-encoding the decoded session gives a blob that decodes and re-encodes to itself.
//
// The layout is fixed and small (tests/fuzz/fuzz_state_util.h).
//
// `state_codec_fuzzer --write-seeds=DIR` writes a seed corpus of valid blobs to DIR and exits.
#include <sanitizer/allocator_interface.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>

#include "absl/strings/string_view.h"
#include "state_store/session_state.h"
#include "state_store/state_codec.h"
#include "state_store/state_layout.h"
#include "tests/fuzz/fuzz_state_util.h"
#include "xxhash.h"

namespace {

using namespace sdm::fuzz;  // NOLINT: the fuzzers' shared fixture

template <typename T>
T LoadAt(const std::string& b, size_t at) {
  T v;
  std::memcpy(&v, b.data() + at, sizeof(T));
  return v;
}
template <typename T>
void StoreAt(std::string& b, size_t at, T v) {
  std::memcpy(b.data() + at, &v, sizeof(T));
}

// Recomputes what mode bit 0 promises (docs/state-format.md has the layout).
void FixUp(std::string& b) {
  if (b.size() < 48) return;
  StoreAt<uint64_t>(b, 32, b.size());
  size_t at = 48;
  while (at + 24 <= b.size()) {
    const uint64_t n = LoadAt<uint64_t>(b, at + 8);
    if (n > b.size() - at - 24) break;
    StoreAt<uint64_t>(b, at + 16, XXH64(b.data() + at + 24, n, 0));
    at += 24 + n;
  }
  StoreAt<uint64_t>(b, 40, XXH64(b.data(), 40, 0));
}

void CheckBlob(const std::string& blob) {
  const sdm::StateLayout& layout = Layout();
  allocated = 0;
  counting = true;
  auto decoded = sdm::DecodeSessionState(blob, layout, kFingerprint);
  counting = false;
  if (allocated > kAllocationSlack + kAllocationPerBlobByte * blob.size()) {
    std::fprintf(stderr, "decoding %zu bytes allocated %zu bytes (%s)\n", blob.size(), allocated,
                 decoded.ok() ? "OK" : decoded.status().ToString().c_str());
    Fail("decoding allocated far more memory than the blob's size");
  }

  // What Open() does: the record from a prefix of the file.
  const absl::string_view view(blob);
  auto prefix =
      sdm::RecordPrefixSize(view.substr(0, sdm::kRecordPrefixBytes), blob.size(), kFingerprint);
  absl::StatusOr<sdm::SessionRecord> record =
      prefix.ok() ? sdm::DecodeSessionRecord(view.substr(0, *prefix), blob.size(), kFingerprint)
                  : absl::StatusOr<sdm::SessionRecord>(prefix.status());
  if (prefix.ok() && *prefix > blob.size()) Fail("record prefix larger than the blob");
  // The whole blob as the prefix works too.
  auto whole_record = sdm::DecodeSessionRecord(view, blob.size(), kFingerprint);
  if (whole_record.ok() != record.ok()) Fail("record decodes from the whole blob but not a prefix");

  if (!decoded.ok()) {
    const absl::StatusCode code = decoded.status().code();
    if (code != absl::StatusCode::kDataLoss && code != absl::StatusCode::kFailedPrecondition &&
        code != absl::StatusCode::kResourceExhausted) {
      Fail("decode error is neither DATA_LOSS nor FAILED_PRECONDITION");
    }
    return;
  }
  if (!record.ok()) Fail("blob decodes but its record does not");
  if (record->id != decoded->record.id || record->metadata != decoded->record.metadata ||
      record->ttl_ms != decoded->record.ttl_ms ||
      record->last_used_unix_ms != decoded->record.last_used_unix_ms) {
    Fail("record from the prefix differs from the full decode");
  }
  if (sdm::DecodeSessionState(blob, layout, kFingerprint ^ 1).ok()) {
    Fail("blob decodes under another model's fingerprint");
  }
  // Encoding is canonical after one round (slot order may differ from a crafted blob's).
  const std::string once = sdm::EncodeSessionState(*decoded->state, decoded->record, kFingerprint);
  auto again = sdm::DecodeSessionState(once, layout, kFingerprint);
  if (!again.ok()) Fail("re-encoded session does not decode");
  if (again->state->position() != decoded->state->position()) Fail("position changed");
  if (sdm::EncodeSessionState(*again->state, again->record, kFingerprint) != once) {
    Fail("encoding is not stable");
  }
}

// A valid session of `tokens` tokens with a recognisable fill.
std::string ValidBlob(int tokens, const std::string& id, const std::string& metadata) {
  sdm::SessionState state(Layout());
  FillState(state, tokens);
  return sdm::EncodeSessionState(state, sdm::SessionRecord{id, metadata, 1000, 42}, kFingerprint);
}

int WriteSeeds(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  int n = 0;
  for (int tokens : {0, 1, 2, 3, 4, 7}) {
    const std::string blob = ValidBlob(tokens, "s" + std::to_string(tokens), R"({"k":"v"})");
    CheckBlob(blob);  // the seeds themselves must pass
    for (char mode : {'\0', '\1'}) {
      std::ofstream out(dir / ("seed_" + std::to_string(n++)), std::ios::binary);
      out << mode << blob;
      if (!out) return 1;
    }
  }
  // Regression: a checksum-consistent blob claiming 2^20 tokens for the full-attention layer
  // (the decoder once reserved pages for the claim before checking the section's size).
  const std::string id = "s7", metadata = "m";
  std::string huge = ValidBlob(7, id, metadata);
  const size_t record = 48 + 24;
  const size_t position = record + 8 + id.size() + 8 + metadata.size() + 16;
  const size_t kv_length = record + LoadAt<uint64_t>(huge, 48 + 8) + 24 + 20;
  StoreAt<int64_t>(huge, position, int64_t{1} << 20);
  StoreAt<int64_t>(huge, kv_length, int64_t{1} << 20);
  FixUp(huge);
  CheckBlob(huge);
  std::ofstream out(dir / ("seed_" + std::to_string(n++)), std::ios::binary);
  out << '\1' << huge;
  if (!out) return 1;
  // Regression: a checksum-consistent blob whose sliding-window layer (section 3) claims a ring
  // past int64 (the decoder once computed the rows it holds with a signed overflow).
  std::string ring = ValidBlob(7, id, metadata);
  size_t at = 48;
  for (int section = 0; section < 3; ++section) at += 24 + LoadAt<uint64_t>(ring, at + 8);
  StoreAt<uint64_t>(ring, at + 24 + 12, (uint64_t{1} << 63) + 3);
  FixUp(ring);
  CheckBlob(ring);
  std::ofstream ring_out(dir / ("seed_" + std::to_string(n++)), std::ios::binary);
  ring_out << '\1' << ring;
  if (!ring_out) return 1;
  std::printf("wrote %d seeds to %s\n", n, dir.c_str());
  return 0;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  return sdm::fuzz::InitializeFuzzer(argc, argv, WriteSeeds);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return sdm::fuzz::RunInput(data, size, FixUp, CheckBlob);
}
