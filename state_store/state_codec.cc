#include "state_store/state_codec.h"

#include <cstring>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/check.h"
#include "base/status_macros.h"
#include "state_store/byte_io.h"
#include "xxhash.h"

namespace sdm {
namespace {

// Layout (all little-endian; docs/state-format.md):
//   header: magic "SDMSTATE" | u32 version | u32 header bytes (48) | u64 fingerprint |
//           u64 section count | u64 total bytes | u64 checksum of the preceding 40 bytes
//   section: u32 type | u32 reserved (0) | u64 payload bytes | u64 payload checksum | payload
constexpr char kMagic[8] = {'S', 'D', 'M', 'S', 'T', 'A', 'T', 'E'};
constexpr uint64_t kHeaderBytes = 48;
constexpr uint64_t kSectionHeaderBytes = 24;
enum SectionType : uint32_t { kRecord = 1, kKv = 2, kSdm = 3 };

uint64_t Checksum(const void* data, size_t n) { return XXH64(data, n, 0); }
using internal_state::PieceWriter;
using internal_state::Reader;
using internal_state::Writer;

struct Header {
  uint32_t version = 0;
  uint64_t fingerprint = 0;
  uint64_t sections = 0;
  uint64_t total = 0;
};

absl::StatusOr<Header> ReadHeader(absl::string_view blob, uint64_t fingerprint,
                                  uint64_t total_bytes) {
  if (blob.size() < kHeaderBytes) {
    return absl::DataLossError(absl::StrCat("session state is truncated: ", blob.size(),
                                            " bytes, the header alone has ", kHeaderBytes));
  }
  if (std::memcmp(blob.data(), kMagic, 8) != 0) {
    return absl::DataLossError("not a session state (bad magic)");
  }
  Reader r(blob.substr(8), "header");
  Header h;
  uint32_t header_bytes = 0;
  uint64_t checksum = 0;
  r.U32(h.version);
  r.U32(header_bytes);
  r.U64(h.fingerprint);
  r.U64(h.sections);
  r.U64(h.total);
  r.U64(checksum);
  if (checksum != Checksum(blob.data(), 40)) {
    return absl::DataLossError("session state header checksum mismatch");
  }
  if (h.version != kStateFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat("session state format version ", h.version,
                                                      " is not supported (this build reads ",
                                                      kStateFormatVersion, ")"));
  }
  if (header_bytes != kHeaderBytes) {
    return absl::DataLossError("session state header has an unexpected size");
  }
  if (h.total != total_bytes) {
    return absl::DataLossError(absl::StrCat("session state is ", total_bytes,
                                            " bytes but its header says ", h.total,
                                            " (truncated or padded)"));
  }
  if (h.fingerprint != fingerprint) {
    return absl::FailedPreconditionError(
        absl::StrCat("session state belongs to a different model (fingerprint ",
                     absl::Hex(h.fingerprint), ", this model is ", absl::Hex(fingerprint), ")"));
  }
  return h;
}

struct Section {
  uint32_t type = 0;
  absl::string_view payload;
};

// Splits the blob after the header into checked sections.
absl::StatusOr<std::vector<Section>> ReadSections(absl::string_view blob, const Header& h) {
  Reader r(blob.substr(kHeaderBytes), "section table");
  std::vector<Section> out;
  if (h.sections > blob.size() / kSectionHeaderBytes) {
    return absl::DataLossError("session state declares more sections than it can hold");
  }
  for (uint64_t i = 0; i < h.sections; ++i) {
    Section s;
    uint32_t reserved = 0;
    uint64_t bytes = 0, checksum = 0;
    if (!r.U32(s.type) || !r.U32(reserved) || !r.U64(bytes) || !r.U64(checksum) ||
        !r.Span(bytes, s.payload)) {
      return absl::DataLossError(absl::StrCat("session state is truncated in section ", i));
    }
    if (reserved != 0) {
      return absl::DataLossError(
          absl::StrCat("session state section ", i, " has a non-zero reserved field (corrupted)"));
    }
    if (Checksum(s.payload.data(), s.payload.size()) != checksum) {
      return absl::DataLossError(
          absl::StrCat("session state section ", i, " failed its checksum (corrupted)"));
    }
    out.push_back(s);
  }
  if (r.remaining() != 0) return absl::DataLossError("session state has trailing bytes");
  return out;
}

absl::Status Corrupt(absl::string_view what) {
  return absl::DataLossError(absl::StrCat("session state is inconsistent: ", what));
}

absl::StatusOr<SessionRecord> ParseRecord(absl::string_view payload, int64_t& position,
                                          uint64_t& seed, uint64_t& draws, int32_t& pending,
                                          uint32_t& layers) {
  Reader r(payload, "record");
  SessionRecord rec;
  if (!r.Str(rec.id) || !r.Str(rec.metadata) || !r.I64(rec.ttl_ms) ||
      !r.I64(rec.last_used_unix_ms) || !r.I64(position) || !r.U64(seed) || !r.U64(draws) ||
      !r.I32(pending) || !r.U32(layers) || r.remaining() != 0) {
    return Corrupt("record section has the wrong size");
  }
  if (position < 0) return Corrupt("negative position");
  if (position > kMaxSessionPosition) {
    return Corrupt(
        absl::StrCat("position ", position, " is past the limit of ", kMaxSessionPosition));
  }
  return rec;
}

}  // namespace

std::string EncodeRecordSection(const SessionState& state, const SessionRecord& record) {
  Writer w;
  w.Str(record.id);
  w.Str(record.metadata);
  w.I64(record.ttl_ms);
  w.I64(record.last_used_unix_ms);
  w.I64(state.position());
  w.U64(state.sampler_seed);
  w.U64(state.sampler_draws);
  w.I32(state.pending_token);
  w.U32(static_cast<uint32_t>(state.num_layers()));
  return std::move(w.out());
}

absl::StatusOr<RecordSection> ParseRecordSection(absl::string_view payload) {
  RecordSection out;
  int64_t position = 0;
  int32_t pending = -1;
  absl::StatusOr<SessionRecord> record =
      ParseRecord(payload, position, out.sampler_seed, out.sampler_draws, pending, out.layers);
  if (!record.ok()) return record.status();
  out.record = *std::move(record);
  out.record.position = position;
  out.record.pending_token = pending;
  return out;
}

uint64_t SnapshotId(absl::string_view record_prefix) {
  return Checksum(record_prefix.data(), record_prefix.size());
}

absl::StatusOr<std::string> TryEncodeSessionState(const SessionState& state,
                                                  const SessionRecord& record,
                                                  uint64_t fingerprint) {
  if (!state.host_current()) {
    return absl::FailedPreconditionError(
        absl::StrCat("session '", record.id,
                     "' is on the device: its host state is stale (sync it to the host first)"));
  }
  return EncodeSessionState(state, record, fingerprint);
}

std::string EncodeSessionState(const SessionState& state, const SessionRecord& record,
                               uint64_t fingerprint) {
  const SessionStateSource source(state, record, fingerprint);
  std::string out = SourceBytesOnePass(source);
  SDM_CHECK(out.size() == source.size());
  return out;
}

SessionStateSource::SessionStateSource(const SessionState& state, const SessionRecord& record,
                                       uint64_t fingerprint)
    : state_(state), record_(EncodeRecordSection(state, record)) {
  SDM_CHECK(state.host_current());
  record_checksum_ = Checksum(record_.data(), record_.size());
  // The sizes the format gives (docs/state-format.md, Sizes); each emission checks them.
  total_ = kHeaderBytes + kSectionHeaderBytes + record_.size();
  sections_.push_back({kRecord, record_.size()});
  for (int64_t li = 0; li < state.num_layers(); ++li) {
    uint64_t bytes = 4;
    if (state.is_sdm(li)) {
      const SdmTable& t = state.sdm(li);
      bytes += 32 + static_cast<uint64_t>(t.private_rows()) *
                        (4 + static_cast<uint64_t>(t.row_width()) * sizeof(float));
    } else {
      const KvCache& kv = state.kv(li);
      bytes += 32 + 2 * static_cast<uint64_t>(kv.length() - kv.first_position()) *
                        static_cast<uint64_t>(kv.row_width()) * sizeof(float);
    }
    sections_.push_back({state.is_sdm(li) ? kSdm : kKv, bytes});
    total_ += kSectionHeaderBytes + bytes;
  }
  Writer w;
  w.Raw(kMagic, 8);
  w.U32(kStateFormatVersion);
  w.U32(kHeaderBytes);
  w.U64(fingerprint);
  w.U64(sections_.size());
  w.U64(total_);
  w.U64(Checksum(w.out().data(), 40));
  header_ = std::move(w.out());
}

absl::Status SessionStateSource::EmitLayer(int64_t li, Sink sink) const {
  PieceWriter w(sink);
  w.U32(static_cast<uint32_t>(li));
  if (state_.is_sdm(li)) {
    const SdmTable& t = state_.sdm(li);
    w.U64(t.heads());
    w.U64(t.slots_per_head());
    w.U64(t.row_width());
    w.U64(t.private_rows());
    t.ForEachPrivateRow([&](int64_t head, int64_t slot, const float*) {
      w.U32(static_cast<uint32_t>(head * t.slots_per_head() + slot));
    });
    t.ForEachPrivateRow([&](int64_t, int64_t, const float* row) { w.Floats(row, t.row_width()); });
  } else {
    const KvCache& kv = state_.kv(li);
    w.U64(kv.row_width());
    w.U64(kv.ring_capacity());
    w.I64(kv.length());
    w.I64(kv.first_position());
    // fp32 on disk whatever the cache stores (a bf16 cache's rows widen exactly).
    for (bool value : {false, true}) {
      kv.ForEachSpanAsFloat(
          kv.first_position(), kv.length(), value,
          [&](const float* rows, int64_t n) { w.Floats(rows, n * kv.row_width()); });
    }
  }
  return w.Finish();
}

absl::Status SessionStateSource::Emit(Sink sink) const { return EmitSections(sink, nullptr); }

absl::Status SessionStateSource::EmitOnePass(Sink sink, std::vector<Patch>& patches) const {
  return EmitSections(sink, &patches);
}

absl::Status SessionStateSource::EmitSections(Sink sink, std::vector<Patch>* patches) const {
  SDM_RETURN_IF_ERROR(sink(header_));
  uint64_t at = header_.size();  // where the next section header starts
  for (size_t i = 0; i < sections_.size(); ++i) {
    const Section& section = sections_[i];
    const auto emit_payload = [&](Sink to) {
      return i == 0 ? to(record_) : EmitLayer(static_cast<int64_t>(i) - 1, to);
    };
    // The record's checksum is known; a layer's is a pass over its rows, made here (Emit) or
    // while they are passed on (EmitOnePass: zeros now, the value as a patch).
    uint64_t checksum = 0;
    if (i == 0) {
      checksum = record_checksum_;
    } else if (patches == nullptr) {
      const internal_state::HashedBytes hashed = internal_state::HashEmitted(emit_payload);
      SDM_CHECK(hashed.bytes == section.bytes) << hashed.bytes << " != " << section.bytes;
      checksum = hashed.checksum;
    }
    Writer h;
    h.U32(section.type);
    h.U32(0);
    h.U64(section.bytes);
    h.U64(checksum);
    SDM_RETURN_IF_ERROR(sink(h.out()));
    if (i > 0 && patches != nullptr) {
      internal_state::HashedBytes hashed;
      SDM_RETURN_IF_ERROR(internal_state::EmitHashed(emit_payload, &sink, hashed));
      SDM_CHECK(hashed.bytes == section.bytes) << hashed.bytes << " != " << section.bytes;
      patches->push_back({at + 16, hashed.checksum});
    } else {
      SDM_RETURN_IF_ERROR(emit_payload(sink));
    }
    at += kSectionHeaderBytes + section.bytes;
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> RecordPrefixSize(absl::string_view first, uint64_t total_bytes,
                                          uint64_t fingerprint) {
  auto header = ReadHeader(first, fingerprint, total_bytes);
  if (!header.ok()) return header.status();
  if (first.size() < kRecordPrefixBytes || header->sections == 0) {
    return absl::DataLossError("session state is truncated before its record");
  }
  uint32_t type = 0;
  uint64_t bytes = 0;
  std::memcpy(&type, first.data() + kHeaderBytes, 4);
  std::memcpy(&bytes, first.data() + kHeaderBytes + 8, 8);
  if (type != kRecord) return Corrupt("the first section is not the record");
  if (bytes > total_bytes - kRecordPrefixBytes) {
    return absl::DataLossError("session state is truncated in its record");
  }
  return kRecordPrefixBytes + bytes;
}

absl::StatusOr<SessionRecord> DecodeSessionRecord(absl::string_view prefix, uint64_t total_bytes,
                                                  uint64_t fingerprint) {
  auto size = RecordPrefixSize(prefix, total_bytes, fingerprint);
  if (!size.ok()) return size.status();
  if (prefix.size() < *size) return absl::DataLossError("session state is truncated in its record");
  Header one_section;
  one_section.sections = 1;
  auto sections = ReadSections(prefix.substr(0, *size), one_section);
  if (!sections.ok()) return sections.status();
  int64_t position;
  uint64_t seed, draws;
  int32_t pending;
  uint32_t layers;
  absl::StatusOr<SessionRecord> record =
      ParseRecord((*sections)[0].payload, position, seed, draws, pending, layers);
  if (record.ok()) {
    record->position = position;
    record->pending_token = pending;
  }
  return record;
}

absl::StatusOr<DecodedSession> DecodeSessionState(absl::string_view blob, const StateLayout& layout,
                                                  uint64_t fingerprint) {
  auto header = ReadHeader(blob, fingerprint, blob.size());
  if (!header.ok()) return header.status();
  auto sections_or = ReadSections(blob, *header);
  if (!sections_or.ok()) return sections_or.status();
  const std::vector<Section>& sections = *sections_or;
  if (sections.empty() || sections[0].type != kRecord) {
    return Corrupt("the first section is not the record");
  }
  int64_t position = 0;
  uint64_t seed = 0, draws = 0;
  int32_t pending = -1;
  uint32_t num_layers = 0;
  auto record = ParseRecord(sections[0].payload, position, seed, draws, pending, num_layers);
  if (!record.ok()) return record.status();
  if (num_layers != layout.layers.size() || sections.size() != num_layers + 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session state has ", num_layers, " layers, the model has ", layout.layers.size()));
  }

  DecodedSession out;
  out.record = *std::move(record);
  out.record.position = position;
  out.record.pending_token = pending;
  out.state = std::make_unique<SessionState>(layout);
  SessionState& st = *out.state;
  st.set_position(position);
  st.sampler_seed = seed;
  st.sampler_draws = draws;
  st.pending_token = pending;
  for (uint32_t li = 0; li < num_layers; ++li) {
    const Section& sec = sections[li + 1];
    const LayerStateLayout& l = layout.layers[li];
    Reader r(sec.payload, absl::StrCat("layer ", li));
    uint32_t layer = 0;
    if (!r.U32(layer) || layer != li) return Corrupt(absl::StrCat("layer ", li, " out of order"));
    if (l.kind == LayerStateLayout::Kind::kSdm) {
      if (sec.type != kSdm) return Corrupt(absl::StrCat("layer ", li, " is not an SDM section"));
      uint64_t heads = 0, slots = 0, width = 0, rows = 0;
      if (!r.U64(heads) || !r.U64(slots) || !r.U64(width) || !r.U64(rows)) return r.Truncated();
      if (static_cast<int64_t>(heads) != l.sdm_heads ||
          static_cast<int64_t>(slots) != l.slots_per_head ||
          static_cast<int64_t>(width) != l.row_width) {
        return absl::FailedPreconditionError(
            absl::StrCat("layer ", li, ": SDM shape does not match the model"));
      }
      if (rows > heads * slots || r.remaining() != rows * (4 + width * sizeof(float))) {
        return Corrupt(absl::StrCat("layer ", li, ": SDM section has the wrong size"));
      }
      std::vector<uint32_t> index(rows);
      for (uint64_t i = 0; i < rows; ++i) r.U32(index[i]);
      std::vector<float> row(width);
      SdmTable& t = st.sdm(li);
      for (uint64_t i = 0; i < rows; ++i) {
        r.Raw(row.data(), width * sizeof(float));
        if (index[i] >= heads * slots) {
          return Corrupt(absl::StrCat("layer ", li, ": slot index out of range"));
        }
        if (auto s = t.RestoreRow(index[i] / slots, index[i] % slots, row); !s.ok()) {
          if (s.code() == absl::StatusCode::kResourceExhausted) return s;
          return Corrupt(absl::StrCat("layer ", li, ": ", s.message()));
        }
      }
    } else {
      if (sec.type != kKv) return Corrupt(absl::StrCat("layer ", li, " is not a KV section"));
      uint64_t width = 0, ring = 0;
      int64_t length = 0, first = 0;
      if (!r.U64(width) || !r.U64(ring) || !r.I64(length) || !r.I64(first)) return r.Truncated();
      // A sliding-window ring may have been sized for another prefill chunk: any ring restores
      // into any ring (the engine reads only the window, which both hold); full attention
      // (ring 0) must stay full.
      if (static_cast<int64_t>(width) != l.kv_row_width || (ring == 0) != (l.ring_capacity == 0)) {
        return absl::FailedPreconditionError(
            absl::StrCat("layer ", li, ": KV shape does not match the model"));
      }
      KvCache& kv = st.kv(li);
      if (length != position || length < 0) {
        return Corrupt(absl::StrCat("layer ", li, ": KV length differs from the position"));
      }
      // Sizes are checked before any page is allocated: a huge length must not reserve memory.
      if (ring > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Corrupt(absl::StrCat("layer ", li, ": KV ring capacity out of range"));
      }
      const int64_t held_from = (ring > 0 && length > static_cast<int64_t>(ring))
                                    ? length - static_cast<int64_t>(ring)
                                    : 0;
      const uint64_t held = static_cast<uint64_t>(length - held_from);
      const uint64_t row_pair_bytes = 2 * width * sizeof(float);  // width > 0: it matched
      if (first != held_from || held > r.remaining() / row_pair_bytes ||
          r.remaining() != held * row_pair_bytes) {
        return Corrupt(absl::StrCat("layer ", li, ": KV section has the wrong size"));
      }
      kv.ResetForRestore(length);
      std::vector<float> row(width);
      for (int pass = 0; pass < 2; ++pass) {
        for (int64_t p = first; p < length; ++p) {
          r.Raw(row.data(), width * sizeof(float));
          // Rows before the ring's reach are skipped; a bf16 cache rounds what it stores.
          if (p >= kv.first_position()) kv.StoreRow(p, /*value=*/pass == 1, row.data());
        }
      }
    }
  }
  // The restored rows are the baseline: nothing dirty, an empty (complete) write journal.
  st.ClearDirty();
  return out;
}

}  // namespace sdm
