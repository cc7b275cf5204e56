// The serialised form of one session's state: what the host tier holds and what a snapshot file
// contains (docs/state-format.md). Only what the session owns is written — position, sampler
// stream, pending token, the KV rows still held, and the SDM rows it has written (with their slot
// indices) — never the shared M0.
//
// Decoding checks everything before it builds anything: magic, version, sizes, every section's
// checksum, the model fingerprint (a session cannot be resumed on a different model), and that
// each section fits the engine's StateLayout. A bad blob is an error naming the problem:
// DataLoss for damage (truncation, checksum), FailedPrecondition for a wrong version or model.
#ifndef SDMSERVE_STATE_STORE_STATE_CODEC_H_
#define SDMSERVE_STATE_STORE_STATE_CODEC_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "state_store/byte_source.h"
#include "state_store/session_state.h"
#include "state_store/state_layout.h"

namespace sdm {

inline constexpr uint32_t kStateFormatVersion = 1;

// The largest position a decoded state may claim (2^62 tokens): beyond any history, and far enough
// from int64's end that position arithmetic (position + 1, a prefill's end) cannot wrap. A
// record claiming more is DataLoss.
inline constexpr int64_t kMaxSessionPosition = int64_t{1} << 62;

// What the store keeps beside the state: the session's id and an opaque metadata string (the
// server's owner, labels and TTL, as JSON).
struct SessionRecord {
  std::string id;
  std::string metadata;
  int64_t ttl_ms = -1;            // -1: never expires
  int64_t last_used_unix_ms = 0;  // for TTL expiry after a restart
  // Filled by decoding (encoding writes the state's own): where the session stands, readable
  // from the record alone without decoding its layers.
  int64_t position = 0;
  int32_t pending_token = -1;
};

// The serialised session. FailedPrecondition while `state`'s host layers are stale (on device and
// not copied back since its last step: state_store/device_residency.h), so the caller must
// SyncToHost() or CopyChangesToHost() first.
absl::StatusOr<std::string> TryEncodeSessionState(const SessionState& state,
                                                  const SessionRecord& record,
                                                  uint64_t model_fingerprint);
// The same for a state known to be current on the host (tests, tools). Precondition:
// state.host_current() (SDM_CHECK: encoding stale layers would silently lose the session's
// recent tokens).
std::string EncodeSessionState(const SessionState& state, const SessionRecord& record,
                               uint64_t model_fingerprint);

// The same bytes as a ByteSource (state_store/byte_source.h), produced straight from the state's
// rows: what the store writes a snapshot from, with no buffer of the snapshot's size. The
// constructor only sizes the sections. A layer section's checksum precedes its rows, so Emit()
// reads each layer's rows twice (hash, then pass on; a prefix up to the record section reads
// none); EmitOnePass() reads them once and gives each layer's checksum as a Patch (what the
// store's writes use). The state must not change while the source is in use (the store keeps
// the session busy), and must outlive it. Precondition: state.host_current() (SDM_CHECK).
class SessionStateSource final : public ByteSource {
 public:
  SessionStateSource(const SessionState& state, const SessionRecord& record,
                     uint64_t model_fingerprint);

  uint64_t size() const override { return total_; }
  absl::Status Emit(Sink sink) const override;
  absl::Status EmitOnePass(Sink sink, std::vector<Patch>& patches) const override;

 private:
  struct Section {
    uint32_t type = 0;
    uint64_t bytes = 0;  // of the payload
  };
  // Both emissions: with `patches`, each layer's checksum is deferred (one read of its rows).
  absl::Status EmitSections(Sink sink, std::vector<Patch>* patches) const;
  // Layer li's section payload.
  absl::Status EmitLayer(int64_t li, Sink sink) const;

  const SessionState& state_;
  std::string record_;  // the record section's payload
  uint64_t record_checksum_ = 0;
  std::string header_;  // the file header, complete
  std::vector<Section> sections_;
  uint64_t total_ = 0;
};

struct DecodedSession {
  SessionRecord record;
  std::unique_ptr<SessionState> state;
};

absl::StatusOr<DecodedSession> DecodeSessionState(absl::string_view blob, const StateLayout& layout,
                                                  uint64_t model_fingerprint);

// Reads only the header and the record section, from a prefix of the blob (listing snapshots
// without reading them whole). Checks the header, the record's checksum and the fingerprint;
// `total_bytes` must be the size of the whole blob. Damage further on is found by
// DecodeSessionState. kRecordPrefixBytes covers the header and the record section's header.
inline constexpr uint64_t kRecordPrefixBytes = 48 + 24;
// Size of the prefix holding the record (header + record section), from kRecordPrefixBytes.
absl::StatusOr<uint64_t> RecordPrefixSize(absl::string_view first_bytes, uint64_t total_bytes,
                                          uint64_t model_fingerprint);
absl::StatusOr<SessionRecord> DecodeSessionRecord(absl::string_view prefix, uint64_t total_bytes,
                                                  uint64_t model_fingerprint);

// The record section's payload (docs/state-format.md, Record), shared by snapshots and the
// deltas of state_store/state_log.h: the record plus where the session stands.
std::string EncodeRecordSection(const SessionState& state, const SessionRecord& record);
struct RecordSection {
  SessionRecord record;  // with position and pending_token
  uint64_t sampler_seed = 0;
  uint64_t sampler_draws = 0;
  uint32_t layers = 0;
};
// DataLoss when the payload does not have the record's size or its position is outside
// [0, kMaxSessionPosition].
absl::StatusOr<RecordSection> ParseRecordSection(absl::string_view payload);

// A snapshot's identity, for the delta log that extends it (state_store/state_log.h): a hash of
// its first RecordPrefixSize() bytes (header and record section: they differ between any two
// snapshots of a session, since the record holds the position and the time of last use).
uint64_t SnapshotId(absl::string_view record_prefix);

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_STATE_CODEC_H_
