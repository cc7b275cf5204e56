#include "state_store/state_log.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/check.h"
#include "base/status_macros.h"
#include "state_store/byte_io.h"
#include "xxhash.h"

namespace sdm {
namespace {

using internal_state::PieceWriter;
using internal_state::Reader;
using internal_state::Writer;

constexpr char kLogMagic[8] = {'S', 'D', 'M', 'D', 'E', 'L', 'T', '2'};
// Version 1's (state_log.h): another magic, so that a reader of version 1 only finds a version-2
// log damaged (and quarantines it, files kept) instead of stale (removed, with its turns).
constexpr char kLogMagicV1[8] = {'S', 'D', 'M', 'D', 'E', 'L', 'T', 'A'};
enum DeltaKind : uint32_t { kKvDelta = 2, kSdmDelta = 3, kSdmJournalDelta = 4 };
// The body of a journal section before its records: u64 records | u32 W | u32 alphas | u32 rule
// | u32 zero.
constexpr uint64_t kJournalHeadBytes = 24;

uint64_t Checksum(absl::string_view data) { return XXH64(data.data(), data.size(), 0); }

absl::Status Damaged(absl::string_view what) {
  return absl::DataLossError(absl::StrCat("session delta log is damaged: ", what));
}

// The checksum of a record's size in a version-2 frame: of its 8 bytes as written.
uint64_t SizeChecksum(uint64_t payload_bytes) {
  Writer w;
  w.U64(payload_bytes);
  return Checksum(w.out());
}

// The header's checks; `version` receives the log's format version.
absl::Status CheckHeader(absl::string_view header, uint64_t fingerprint, uint64_t base_id,
                         uint32_t& version) {
  // A log's first write is its header and first record at once, acknowledged only when whole:
  // a header cut short (a crash or a failed write during that first append) or never written
  // (zeros, where a power loss left the file's size without its data) held no acknowledged
  // record. It is a torn first append, stale like one that names another snapshot: the
  // snapshot holds everything, and the store removes it.
  if (header.size() < kLogHeaderBytes || header.find_first_not_of('\0', 0) >= kLogHeaderBytes) {
    return absl::FailedPreconditionError(
        "session delta log's first append was cut short (it holds no record)");
  }
  uint32_t magic_version = 0;
  if (std::memcmp(header.data(), kLogMagic, 8) == 0) {
    magic_version = kStateLogVersion;
  } else if (std::memcmp(header.data(), kLogMagicV1, 8) == 0) {
    magic_version = 1;
  } else {
    return Damaged("bad magic");
  }
  Reader r(header.substr(8, kLogHeaderBytes - 8), "log header");
  uint32_t header_bytes = 0;
  uint64_t file_fingerprint = 0, file_base = 0, checksum = 0;
  r.U32(version);
  r.U32(header_bytes);
  r.U64(file_fingerprint);
  r.U64(file_base);
  r.U64(checksum);
  if (checksum != Checksum(header.substr(0, 32))) return Damaged("header checksum mismatch");
  if (version != magic_version || header_bytes != kLogHeaderBytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("session delta log format version ", version, " is not supported"));
  }
  if (file_fingerprint != fingerprint) {
    return absl::FailedPreconditionError("session delta log belongs to another model");
  }
  if (file_base != base_id) {
    return absl::FailedPreconditionError(
        "session delta log extends another snapshot (stale: the snapshot holds its records)");
  }
  return absl::OkStatus();
}

struct Frame {
  uint64_t offset = 0;  // of the frame header
  uint64_t bytes = 0;   // payload
  uint64_t checksum = 0;
};

// The record at the start of a payload; `r` is left after it.
absl::StatusOr<RecordSection> ReadPayloadRecord(Reader& r) {
  uint64_t record_bytes = 0;
  absl::string_view record;
  if (!r.U64(record_bytes) || !r.Span(record_bytes, record)) return Damaged("truncated record");
  absl::StatusOr<RecordSection> parsed = ParseRecordSection(record);
  if (!parsed.ok()) return Damaged(parsed.status().message());
  return parsed;
}

absl::StatusOr<RecordSection> PayloadRecord(absl::string_view payload) {
  Reader r(payload, "delta");
  return ReadPayloadRecord(r);
}

// Applies one checked payload.
// Row `index` of a delta's keys and values as fp32 into k and v; zeros for a negative index (a
// position older than the writer's first row, outside every window).
void RowsAt(absl::string_view keys, absl::string_view values, int64_t index, uint64_t row_bytes,
            std::vector<float>& k, std::vector<float>& v) {
  if (index < 0) {
    std::fill(k.begin(), k.end(), 0.0f);
    std::fill(v.begin(), v.end(), 0.0f);
    return;
  }
  std::memcpy(k.data(), keys.data() + index * row_bytes, row_bytes);
  std::memcpy(v.data(), values.data() + index * row_bytes, row_bytes);
}

absl::Status ApplyDelta(absl::string_view payload, SessionState& state, RecordSection& out) {
  Reader r(payload, "delta");
  absl::StatusOr<RecordSection> parsed = ReadPayloadRecord(r);
  if (!parsed.ok()) return parsed.status();
  const int64_t position = parsed->record.position;
  uint32_t layers = 0;
  if (!r.U32(layers) || layers != static_cast<uint32_t>(state.num_layers()) ||
      parsed->layers != layers) {
    return Damaged("layer count does not match the model");
  }
  if (position < state.position()) return Damaged("a record goes back in position");
  for (uint32_t li = 0; li < layers; ++li) {
    uint32_t layer = 0, kind = 0;
    if (!r.U32(layer) || !r.U32(kind) || layer != li) return Damaged("layers out of order");
    if (state.is_sdm(li) && kind == kSdmJournalDelta) {
      SdmTable& t = state.sdm(li);
      const SdmWriteSpec& spec = t.write_spec();
      uint64_t records = 0;
      uint32_t writes = 0, alphas = 0, rule = 0, zero = 0;
      if (!r.U64(records) || !r.U32(writes) || !r.U32(alphas) || !r.U32(rule) || !r.U32(zero)) {
        return Damaged(absl::StrCat("layer ", li, ": truncated"));
      }
      if (writes != spec.writes || alphas != spec.alphas || rule != spec.rule || zero != 0) {
        return Damaged(absl::StrCat("layer ", li, ": SDM writes of another shape or rule"));
      }
      const uint64_t record_bytes = static_cast<uint64_t>(t.JournalRecordBytes());
      absl::string_view body;
      if (records > r.remaining() / record_bytes || !r.Span(records * record_bytes, body)) {
        return Damaged(absl::StrCat("layer ", li, ": SDM writes do not fit"));
      }
      if (absl::Status s = t.ApplyJournal(body, static_cast<int64_t>(records)); !s.ok()) {
        if (absl::IsDataLoss(s)) return Damaged(absl::StrCat("layer ", li, ": ", s.message()));
        return s;
      }
    } else if (state.is_sdm(li)) {
      if (kind != kSdmDelta) return Damaged(absl::StrCat("layer ", li, " is not SDM"));
      SdmTable& t = state.sdm(li);
      uint64_t rows = 0;
      const uint64_t width = static_cast<uint64_t>(t.row_width());
      const uint64_t slots = static_cast<uint64_t>(t.heads() * t.slots_per_head());
      if (!r.U64(rows) || rows > slots || rows * (4 + width * sizeof(float)) > r.remaining()) {
        return Damaged(absl::StrCat("layer ", li, ": SDM rows do not fit"));
      }
      std::vector<uint32_t> index(rows);
      for (uint64_t i = 0; i < rows; ++i) r.U32(index[i]);
      for (uint64_t i = 0; i < rows; ++i) {
        if (index[i] >= slots) return Damaged(absl::StrCat("layer ", li, ": slot out of range"));
        float* row = t.MutableRow(index[i] / t.slots_per_head(), index[i] % t.slots_per_head());
        if (row == nullptr) return absl::ResourceExhaustedError("the SDM row pool is exhausted");
        r.Raw(row, width * sizeof(float));
      }
    } else {
      if (kind != kKvDelta) return Damaged(absl::StrCat("layer ", li, " is not KV"));
      KvCache& kv = state.kv(li);
      uint64_t width = 0;
      int64_t from = 0, to = 0, first = 0;
      if (!r.U64(width) || !r.I64(from) || !r.I64(to) || !r.I64(first)) {
        return Damaged(absl::StrCat("layer ", li, ": truncated"));
      }
      const uint64_t row_bytes = width * sizeof(float);
      // Counted by division: (to - first) * 2 * row_bytes can wrap to anything (a record
      // claiming 2^55 rows of 64 floats once passed as 0 bytes and crashed the replay).
      if (static_cast<int64_t>(width) != kv.row_width() || row_bytes == 0 || from != kv.length() ||
          to != position || first < from || first > to ||
          (first > from && kv.ring_capacity() == 0) ||
          static_cast<uint64_t>(to - first) > r.remaining() / (2 * row_bytes)) {
        return Damaged(absl::StrCat("layer ", li, ": KV rows do not continue the session"));
      }
      absl::string_view keys, values;
      if (!r.Span(static_cast<uint64_t>(to - first) * row_bytes, keys) ||
          !r.Span(static_cast<uint64_t>(to - first) * row_bytes, values)) {
        return Damaged(absl::StrCat("layer ", li, ": KV rows do not fit"));
      }
      std::vector<float> k(width), v(width);
      const int64_t ring = kv.ring_capacity();
      if (ring > 0 && to - from >= ring) {
        // Nothing the ring held survives: reset it to `to` and fill what it holds now (rows
        // older than the writer's ring, if this one is larger, are outside the window: zeros).
        // Also bounds the work by the ring, whatever `to` claims.
        kv.ResetForRestore(to);
        for (int64_t p = to - ring; p < to; ++p) {
          RowsAt(keys, values, p - first, row_bytes, k, v);
          kv.StoreRow(p, /*value=*/false, k.data());
          kv.StoreRow(p, /*value=*/true, v.data());
        }
        continue;
      }
      // Appended in order; rows before `first` (fewer than the ring) are overwritten within
      // this record as the ring wraps.
      for (int64_t p = from; p < to; ++p) {
        RowsAt(keys, values, p - first, row_bytes, k, v);
        kv.AppendRow(k.data(), v.data());
      }
    }
  }
  if (r.remaining() != 0) return Damaged("trailing bytes in a record");
  state.set_position(position);
  state.sampler_seed = parsed->sampler_seed;
  state.sampler_draws = parsed->sampler_draws;
  state.pending_token = parsed->record.pending_token;
  out = *std::move(parsed);
  return absl::OkStatus();
}

uint64_t FrameBytes(uint32_t version) {
  return version == 1 ? kLogRecordHeaderBytesV1 : kLogRecordHeaderBytes;
}

// Splits the log after its header into complete frames; `truncated` is set when bytes follow the
// last of them (a frame header cut short, or a record whose size runs past the end: a torn
// tail). Version 2: a complete frame header whose size fails its checksum is damage, wherever it
// is (a torn append leaves a prefix of right bytes; the size's own check tells a size damaged in
// place from a record cut short, which a size taken on trust did not: a flipped bit in a middle
// record's size read as a torn tail there, and the records after it were dropped).
absl::StatusOr<std::vector<Frame>> Frames(const LogReader& read, uint64_t size, uint32_t version,
                                          bool& truncated) {
  const uint64_t frame_bytes = FrameBytes(version);
  std::vector<Frame> frames;
  truncated = false;
  uint64_t at = kLogHeaderBytes;
  while (at < size) {
    if (size - at < frame_bytes) {
      truncated = true;
      break;
    }
    absl::StatusOr<std::string> head = read(at, frame_bytes);
    if (!head.ok()) return head.status();  // an I/O error is no torn tail
    if (head->size() < frame_bytes) {
      truncated = true;
      break;
    }
    Frame f;
    f.offset = at;
    std::memcpy(&f.bytes, head->data(), 8);
    std::memcpy(&f.checksum, head->data() + 8, 8);
    if (version != 1) {
      uint64_t size_checksum = 0;
      std::memcpy(&size_checksum, head->data() + 16, 8);
      if (size_checksum != SizeChecksum(f.bytes)) {
        return Damaged(absl::StrCat("the size of record ", frames.size(), " failed its checksum"));
      }
    }
    if (f.bytes > size - at - frame_bytes) {
      truncated = true;
      break;
    }
    frames.push_back(f);
    at += frame_bytes + f.bytes;
  }
  return frames;
}

// Whether record i of `frames`, failing its checksum, is damage rather than a torn tail: records
// follow it, or (version 2, whose sizes are checked) any bytes do: a torn append is the log's
// last record and ends the log. Version 1 took a failing last frame for torn whatever followed.
bool FailedRecordIsDamage(size_t i, size_t frames, bool truncated, uint32_t version) {
  return i + 1 < frames || (version != 1 && truncated);
}

}  // namespace

std::string EncodeLogHeader(uint64_t fingerprint, uint64_t base_id) {
  Writer w;
  w.Raw(kLogMagic, 8);  // version 2's
  w.U32(kStateLogVersion);
  w.U32(static_cast<uint32_t>(kLogHeaderBytes));
  w.U64(fingerprint);
  w.U64(base_id);
  w.U64(Checksum(w.out()));
  return std::move(w.out());
}

uint64_t SessionDeltaBytes(const SessionState& state, const SessionRecord& record, int64_t from) {
  uint64_t payload = 8 + EncodeRecordSection(state, record).size() + 4;
  for (int64_t li = 0; li < state.num_layers(); ++li) {
    payload += 8;
    if (state.is_sdm(li) && state.sdm(li).journal_complete()) {
      payload += kJournalHeadBytes + state.sdm(li).journal().size();
    } else if (state.is_sdm(li)) {
      payload += 8 + static_cast<uint64_t>(state.sdm(li).DirtyRowBytes());
    } else {
      const KvCache& kv = state.kv(li);
      const int64_t first = std::max(from, kv.first_position());
      payload += 32 + 2 * static_cast<uint64_t>(std::max<int64_t>(kv.length() - first, 0)) *
                          static_cast<uint64_t>(kv.row_width()) * sizeof(float);
    }
  }
  return kLogRecordHeaderBytes + payload;
}

SessionDeltaSource::SessionDeltaSource(const SessionState& state, const SessionRecord& record,
                                       int64_t from, std::string log_header)
    : state_(state),
      from_(from),
      log_header_(std::move(log_header)),
      record_(EncodeRecordSection(state, record)) {
  SDM_CHECK(state.host_current());
  SDM_CHECK(from <= state.position());
  // Each emission checks that it produced this many bytes.
  payload_bytes_ = SessionDeltaBytes(state, record, from) - kLogRecordHeaderBytes;
}

absl::Status SessionDeltaSource::EmitPayload(Sink sink) const {
  PieceWriter w(sink);
  w.U64(record_.size());
  w.Raw(record_.data(), record_.size());
  w.U32(static_cast<uint32_t>(state_.num_layers()));
  for (int64_t li = 0; li < state_.num_layers(); ++li) {
    w.U32(static_cast<uint32_t>(li));
    if (state_.is_sdm(li) && state_.sdm(li).journal_complete()) {
      // The writes rather than the rows they left: the smaller (the journal is dropped once it
      // would outgrow the rows, state_store/sdm_table.h).
      const SdmTable& t = state_.sdm(li);
      w.U32(kSdmJournalDelta);
      w.U64(static_cast<uint64_t>(t.journal_records()));
      w.U32(static_cast<uint32_t>(t.write_spec().writes));
      w.U32(static_cast<uint32_t>(t.write_spec().alphas));
      w.U32(t.write_spec().rule);
      w.U32(0);
      w.Span(t.journal().data(), t.journal().size());
    } else if (state_.is_sdm(li)) {
      const SdmTable& t = state_.sdm(li);
      w.U32(kSdmDelta);
      w.U64(static_cast<uint64_t>(t.dirty_rows()));
      t.ForEachDirtyRow([&](int64_t head, int64_t slot, const float*) {
        w.U32(static_cast<uint32_t>(head * t.slots_per_head() + slot));
      });
      t.ForEachDirtyRow([&](int64_t, int64_t, const float* row) { w.Floats(row, t.row_width()); });
    } else {
      const KvCache& kv = state_.kv(li);
      const int64_t first = std::max(from_, kv.first_position());
      w.U32(kKvDelta);
      w.U64(static_cast<uint64_t>(kv.row_width()));
      w.I64(from_);
      w.I64(kv.length());
      w.I64(first);
      for (bool value : {false, true}) {
        kv.ForEachSpanAsFloat(first, kv.length(), value, [&](const float* rows, int64_t n) {
          w.Floats(rows, n * kv.row_width());
        });
      }
    }
  }
  return w.Finish();
}

absl::Status SessionDeltaSource::Emit(Sink sink) const {
  const auto emit_payload = [&](Sink to) { return EmitPayload(to); };
  // The checksum first: one read of the rows, the second passes them on.
  const internal_state::HashedBytes payload = internal_state::HashEmitted(emit_payload);
  SDM_CHECK(payload.bytes == payload_bytes_) << payload.bytes << " != " << payload_bytes_;
  SDM_RETURN_IF_ERROR(sink(log_header_));
  Writer frame;
  frame.U64(payload_bytes_);
  frame.U64(payload.checksum);
  frame.U64(SizeChecksum(payload_bytes_));
  SDM_RETURN_IF_ERROR(sink(frame.out()));
  return EmitPayload(sink);
}

absl::Status SessionDeltaSource::EmitOnePass(Sink sink, std::vector<Patch>& patches) const {
  SDM_RETURN_IF_ERROR(sink(log_header_));
  Writer frame;
  frame.U64(payload_bytes_);
  frame.U64(0);  // the checksum: patched once the payload is out
  // The size's checksum is known now: the frame header goes out whole, with the size it checks.
  frame.U64(SizeChecksum(payload_bytes_));
  SDM_RETURN_IF_ERROR(sink(frame.out()));
  internal_state::HashedBytes payload;
  SDM_RETURN_IF_ERROR(
      internal_state::EmitHashed([&](Sink to) { return EmitPayload(to); }, &sink, payload));
  SDM_CHECK(payload.bytes == payload_bytes_) << payload.bytes << " != " << payload_bytes_;
  patches.push_back({log_header_.size() + 8, payload.checksum});
  return absl::OkStatus();
}

void AppendSessionDelta(const SessionState& state, const SessionRecord& record, int64_t from,
                        std::string& out) {
  AppendOnePass(SessionDeltaSource(state, record, from), out);
}

std::string EncodeSessionDelta(const SessionState& state, const SessionRecord& record,
                               int64_t from) {
  std::string out;
  AppendSessionDelta(state, record, from, out);
  return out;
}

absl::StatusOr<LogReplay> ReplayLog(absl::string_view log, uint64_t fingerprint, uint64_t base_id,
                                    SessionState& state) {
  uint32_t version = 0;
  SDM_RETURN_IF_ERROR(CheckHeader(log, fingerprint, base_id, version));
  const uint64_t frame_bytes = FrameBytes(version);
  bool truncated = false;
  SDM_ASSIGN_OR_RETURN(const std::vector<Frame> frames,
                       Frames(
                           [&](uint64_t offset, uint64_t n) -> absl::StatusOr<std::string> {
                             return std::string(log.substr(offset, n));
                           },
                           log.size(), version, truncated));
  LogReplay out;
  out.version = version;
  out.valid_bytes = kLogHeaderBytes;
  for (size_t i = 0; i < frames.size(); ++i) {
    const absl::string_view payload = log.substr(frames[i].offset + frame_bytes, frames[i].bytes);
    if (Checksum(payload) != frames[i].checksum) {
      if (FailedRecordIsDamage(i, frames.size(), truncated, version)) {
        return Damaged(absl::StrCat("record ", i, " of ", frames.size(), " failed its checksum"));
      }
      break;  // the torn tail
    }
    RecordSection applied;
    SDM_RETURN_IF_ERROR(ApplyDelta(payload, state, applied));
    out.record = std::move(applied.record);
    out.has_record = true;
    ++out.records;
    out.valid_bytes = frames[i].offset + frame_bytes + frames[i].bytes;
  }
  out.dropped_bytes = log.size() - out.valid_bytes;
  state.ClearDirty();  // it now equals what the disk holds
  return out;
}

absl::StatusOr<LogReplay> ScanLog(const LogReader& read, uint64_t size, uint64_t fingerprint,
                                  uint64_t base_id) {
  absl::StatusOr<std::string> header = read(0, kLogHeaderBytes);
  if (!header.ok()) return header.status();
  uint32_t version = 0;
  SDM_RETURN_IF_ERROR(CheckHeader(*header, fingerprint, base_id, version));
  const uint64_t frame_bytes = FrameBytes(version);
  bool truncated = false;
  SDM_ASSIGN_OR_RETURN(const std::vector<Frame> frames, Frames(read, size, version, truncated));
  LogReplay out;
  out.version = version;
  out.valid_bytes = kLogHeaderBytes;
  // The last frame may be torn; the one before it was complete before the last append began.
  for (int i = static_cast<int>(frames.size()) - 1;
       i >= 0 && i + 2 >= static_cast<int>(frames.size()); --i) {
    const Frame& f = frames[i];
    absl::StatusOr<std::string> payload = read(f.offset + frame_bytes, f.bytes);
    if (!payload.ok()) return payload.status();
    if (payload->size() != f.bytes || Checksum(*payload) != f.checksum) {
      if (FailedRecordIsDamage(static_cast<size_t>(i), frames.size(), truncated, version)) {
        return Damaged(absl::StrCat("record ", i, " of ", frames.size(), " failed its checksum"));
      }
      continue;
    }
    absl::StatusOr<RecordSection> record = PayloadRecord(*payload);
    if (!record.ok()) return record.status();
    out.record = std::move(record->record);
    out.has_record = true;
    out.records = i + 1;
    out.valid_bytes = f.offset + frame_bytes + f.bytes;
    break;
  }
  out.dropped_bytes = size - out.valid_bytes;
  return out;
}

}  // namespace sdm
