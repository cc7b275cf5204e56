// The delta log of one session (docs/state-format.md, "Delta log"): what each persisted turn
// changed, appended to `<stem>.sdmlog` beside the session's snapshot `<stem>.sdmstate`, so that a
// turn costs the bytes it touched rather than a full snapshot. Recovery is the snapshot plus the
// log's records in order; the store compacts (writes a full snapshot, removes the log) once the
// log grows past a fraction of the snapshot.
//
//   header: magic "SDMDELT2" | u32 version (2) | u32 header bytes (40) | u64 model fingerprint |
//           u64 base snapshot id (SnapshotId of the snapshot it extends) | u64 checksum of the
//           preceding 32 bytes
//   record: u64 payload bytes | u64 payload checksum | u64 checksum of the 8 size bytes | payload
//   payload: u64 record-section bytes | record section (state_codec.h) | u32 layer count |
//            per layer: u32 layer | u32 kind (2 KV, 3 SDM) | kind's body
//     KV:  u64 row width | i64 from | i64 to | i64 first | key rows [first, to) | value rows
//          (from: the length before; first > from only for a ring, whose older rows are gone)
//     SDM: u64 rows | u32 slot index (head * slots + slot) per row | the rows
//     SDM writes (kind 4): u64 records | u32 W | u32 alphas | u32 rule | u32 0 | the records of
//          the layer's write journal (state_store/sdm_table.h), replayed in order through the
//          engine's own write (SdmWriteSpec::apply): the same bits as the rows. A layer is
//          written in this form when its journal is complete (the smaller form then).
//
// A crash can leave a torn tail (the last record cut short, or ending the log and failing its
// checksum): replay stops there and drops it; the store then writes its next record at the end
// of the last good one (StateFiles::WriteAt cuts the file there first, so a crash leaves only a
// prefix of the record being appended). Anything else that fails a check is damage (DataLoss):
// a record failing its checksum with bytes after it, a record's size failing its own checksum
// wherever it is (an append writes the size and its checksum whole before the payload; without
// that check a flipped bit in a middle record's size made it, and every record after it, look
// like a torn tail, dropped silently). A log whose header names another snapshot (a crash
// between a compaction's rename and the log's removal: the snapshot already holds everything),
// or whose header is cut short or zeros (a crash during its first append, which writes the
// header with the first record), is stale and ignored.
//
// Version 1 (magic "SDMDELTA", read, never written): records framed by their size and payload
// checksum only (16 bytes), read as before (a record whose size runs past the end is a torn
// tail; the last complete one failing its checksum too). The store writes a full snapshot rather
// than append to one. Version 2 changed the magic too, so that a build that reads only version 1
// finds a version-2 log damaged (it quarantines the session, files kept) rather than stale
// (which would remove the log, and its turns).
//
// Thread-safety: pure functions.
#ifndef SDMSERVE_STATE_STORE_STATE_LOG_H_
#define SDMSERVE_STATE_STORE_STATE_LOG_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "state_store/byte_source.h"
#include "state_store/session_state.h"
#include "state_store/state_codec.h"

namespace sdm {

// The version written; version 1 is read too.
inline constexpr uint32_t kStateLogVersion = 2;
inline constexpr uint64_t kLogHeaderBytes = 40;
// A record's frame: payload bytes, payload checksum, checksum of the size.
inline constexpr uint64_t kLogRecordHeaderBytes = 24;
// Version 1's frame: payload bytes, payload checksum.
inline constexpr uint64_t kLogRecordHeaderBytesV1 = 16;

std::string EncodeLogHeader(uint64_t model_fingerprint, uint64_t base_snapshot_id);

// One framed record: `record` (with the state's position, sampler stream and pending token), the
// KV rows of positions [from_position, position) still held, and per SDM layer what was written
// since the last SessionState::ClearDirty(): its write journal when complete, else the rows.
// Preconditions: state.host_current(), from_position <= state.position().
std::string EncodeSessionDelta(const SessionState& state, const SessionRecord& record,
                               int64_t from_position);
// The same record appended to `out` (after a log header, when the log starts), encoded in place:
// no copy of the payload. SessionDeltaBytes() is its exact size.
void AppendSessionDelta(const SessionState& state, const SessionRecord& record,
                        int64_t from_position, std::string& out);
uint64_t SessionDeltaBytes(const SessionState& state, const SessionRecord& record,
                           int64_t from_position);

// The same record as a ByteSource (state_store/byte_source.h), after `log_header` (the log's
// header when this record starts the log, else empty), produced straight from the state's rows:
// what the store appends to a log, with no buffer of the record's size. The frame's checksum
// comes before the payload, so Emit() reads the rows twice (hash, then pass on); EmitOnePass()
// reads them once and gives the checksum as a Patch (what the store's appends use). The state
// must not change while the source is in use, and must outlive it. Preconditions as
// EncodeSessionDelta's.
class SessionDeltaSource final : public ByteSource {
 public:
  SessionDeltaSource(const SessionState& state, const SessionRecord& record, int64_t from_position,
                     std::string log_header = "");

  uint64_t size() const override {
    return log_header_.size() + kLogRecordHeaderBytes + payload_bytes_;
  }
  absl::Status Emit(Sink sink) const override;
  absl::Status EmitOnePass(Sink sink, std::vector<Patch>& patches) const override;

 private:
  absl::Status EmitPayload(Sink sink) const;

  const SessionState& state_;
  int64_t from_;
  std::string log_header_;
  std::string record_;  // the record section's payload
  uint64_t payload_bytes_ = 0;
};

struct LogReplay {
  int64_t records = 0;         // records applied (or, for ScanLog, found good)
  uint64_t valid_bytes = 0;    // header plus the good records: where the next record goes
  uint64_t dropped_bytes = 0;  // a torn tail after them
  bool has_record = false;     // records > 0: `record` is the last one's
  SessionRecord record;        // with position and pending_token
  // The log's format version: a record appended to it must be of the same (the store appends
  // only to a log of kStateLogVersion, and writes a full snapshot instead of appending to an
  // older one).
  uint32_t version = kStateLogVersion;
};

// Applies the log's good records, in order, to `state` (decoded from the snapshot the log
// extends), and clears its dirty marks (it then equals what the disk holds). Errors:
// FailedPrecondition for a stale log (another base snapshot, model or version; a header cut
// short or zeros) — ignore it;
// DataLoss for a damaged header, damage before the torn tail (see the file comment) or a good
// record that does not fit the state (then `state` may be partly updated: discard it);
// Unimplemented for journaled SDM writes the state's layout cannot apply (no
// SdmWriteSpec::apply), ResourceExhausted when the row pool runs out (both: discard `state`, keep
// the log).
absl::StatusOr<LogReplay> ReplayLog(absl::string_view log, uint64_t model_fingerprint,
                                    uint64_t base_snapshot_id, SessionState& state);

// The same checks without a state, reading only the header, each record's frame (its size
// checked) and the last good record (for listing sessions at start-up): a record before the last
// two that fails its checksum is found by ReplayLog. `read(offset, n)` returns up to n bytes.
using LogReader = std::function<absl::StatusOr<std::string>(uint64_t offset, uint64_t n)>;
absl::StatusOr<LogReplay> ScanLog(const LogReader& read, uint64_t size, uint64_t model_fingerprint,
                                  uint64_t base_snapshot_id);

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_STATE_LOG_H_
