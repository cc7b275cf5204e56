// The delta log (state_store/state_log.h): a snapshot plus the deltas of later turns restores the
// live session bit-exactly (next-token logits), through ring wrap and SDM row writes; a torn tail
// is dropped at any cut, leaving exactly the previous turn; damage before the tail is DataLoss, and
// so is a damaged record size wherever it is; a version-1 log is still read; a log of another
// snapshot is refused as stale; a delta costs the rows its turn touched; deltas of journaled
// writes restore the same bits as deltas of rows.
#include "state_store/state_log.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "engine/engine.h"
#include "engine/model_config.h"
#include "gtest/gtest.h"
#include "state_store/state_codec.h"
#include "tests/engine/test_model_util.h"
#include "tests/state_store/snapshot_test_util.h"
#include "xxhash.h"

namespace sdm {
namespace {

constexpr int32_t kProbe = 42;

class StateLogTest : public ::testing::Test {
 protected:
  void SetUp() override { engine_ = testing::TinyEngine(); }

  uint64_t IdOf(const std::string& snapshot) {
    auto prefix = RecordPrefixSize(snapshot, snapshot.size(), engine_->fingerprint());
    EXPECT_TRUE(prefix.ok()) << prefix.status();
    return SnapshotId(absl::string_view(snapshot).substr(0, *prefix));
  }

  // The snapshot's state with the log replayed onto it.
  absl::StatusOr<std::unique_ptr<SessionState>> Restore(const std::string& snapshot,
                                                        const std::string& log,
                                                        LogReplay* replay = nullptr) {
    auto decoded = DecodeSessionState(snapshot, engine_->state_layout(), engine_->fingerprint());
    if (!decoded.ok()) return decoded.status();
    auto r = ReplayLog(log, engine_->fingerprint(), IdOf(snapshot), *decoded->state);
    if (!r.ok()) return r.status();
    if (replay != nullptr) *replay = *r;
    return std::move(decoded->state);
  }

  std::vector<float> Probe(const SessionState& state) {
    auto copy = state.Clone();
    return testing::ProbeLogits(*engine_, *copy, kProbe);
  }

  // A session with `history` tokens, snapshotted; then `turns` turns of random lengths, each
  // appended to the log as a delta. `after[i]` is the probe after turn i (`after[0]`: the
  // snapshot), `ends[i]` the log's size after it.
  void Build(uint32_t seed, int history, int turns) {
    std::mt19937 rng(seed);
    live_ = engine_->NewSession();
    testing::DecodeEach(*engine_, *live_, testing::RandomTokens(history, rng()));
    snapshot_ = EncodeSessionState(*live_, SessionRecord{"s", "meta"}, engine_->fingerprint());
    live_->ClearDirty();
    log_ = EncodeLogHeader(engine_->fingerprint(), IdOf(snapshot_));
    after_ = {Probe(*live_)};
    ends_ = {log_.size()};
    positions_ = {live_->position()};
    for (int t = 0; t < turns; ++t) {
      const int64_t from = live_->position();
      // Some turns longer than the 16-row sliding-window ring: the delta holds only its tail.
      const int n = 1 + static_cast<int>(rng() % 24);
      testing::DecodeEach(*engine_, *live_, testing::RandomTokens(n, rng()));
      log_ += EncodeSessionDelta(*live_, SessionRecord{"s", "meta", -1, 1000 + t}, from);
      live_->ClearDirty();
      after_.push_back(Probe(*live_));
      ends_.push_back(log_.size());
      positions_.push_back(live_->position());
    }
  }

  std::unique_ptr<Engine> engine_;
  std::unique_ptr<SessionState> live_;
  std::string snapshot_, log_;
  std::vector<std::vector<float>> after_;
  std::vector<size_t> ends_;
  std::vector<int64_t> positions_;
};

TEST_F(StateLogTest, SnapshotPlusDeltasIsTheLiveSession) {
  const uint32_t fresh = std::random_device{}();
  for (uint32_t seed : {1u, 2u, 3u, fresh}) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    Build(seed, 5 + static_cast<int>(seed % 30), 6);
    LogReplay replay;
    auto state = Restore(snapshot_, log_, &replay);
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_EQ(replay.records, 6);
    EXPECT_EQ(replay.valid_bytes, log_.size());
    EXPECT_EQ(replay.dropped_bytes, 0u);
    EXPECT_EQ(replay.record.position, live_->position());
    EXPECT_EQ(replay.record.last_used_unix_ms, 1005);
    EXPECT_EQ((*state)->position(), live_->position());
    EXPECT_EQ((*state)->pending_token, live_->pending_token);
    EXPECT_TRUE(testing::BitwiseEqual(Probe(**state), after_.back()));
    // Replayed rows are not dirty: the restored state equals what the disk holds.
    for (int64_t l = 0; l < (*state)->num_layers(); ++l) {
      if ((*state)->is_sdm(l)) {
        EXPECT_EQ((*state)->sdm(l).dirty_rows(), 0);
      }
    }
  }
}

TEST_F(StateLogTest, ATornTailIsDroppedAtAnyCut) {
  Build(7, 20, 3);
  const size_t last_start = ends_[2];
  for (size_t cut = last_start; cut < log_.size(); ++cut) {
    SCOPED_TRACE(::testing::Message() << "cut at " << cut << " of " << log_.size());
    const std::string torn = log_.substr(0, cut);
    LogReplay replay;
    auto state = Restore(snapshot_, torn, &replay);
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_EQ(replay.records, 2);
    EXPECT_EQ(replay.valid_bytes, last_start);
    EXPECT_EQ(replay.dropped_bytes, cut - last_start);
    EXPECT_EQ((*state)->position(), positions_[2]);
    if (cut == last_start || cut % 97 == 0) {  // logits for a sample of cuts (they are slow)
      EXPECT_TRUE(testing::BitwiseEqual(Probe(**state), after_[2]));
    }
    // The scan at start-up agrees, reading only frames and the last good record.
    auto scanned = ScanLog(
        [&](uint64_t offset, uint64_t n) -> absl::StatusOr<std::string> {
          return torn.substr(std::min<size_t>(offset, torn.size()), n);
        },
        torn.size(), engine_->fingerprint(), IdOf(snapshot_));
    ASSERT_TRUE(scanned.ok()) << scanned.status();
    EXPECT_EQ(scanned->valid_bytes, last_start);
    EXPECT_EQ(scanned->record.position, positions_[2]);
  }
  // A tail of garbage after a complete record (a torn write of a frame that looks whole).
  std::string garbled = log_;
  garbled[garbled.size() - 3] ^= 0x5a;
  LogReplay replay;
  auto state = Restore(snapshot_, garbled, &replay);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(replay.records, 2);
  EXPECT_EQ((*state)->position(), positions_[2]);
}

TEST_F(StateLogTest, DamageBeforeTheTailIsDataLoss) {
  Build(8, 20, 3);
  std::string damaged = log_;
  damaged[ends_[1] - 5] ^= 0x01;  // inside the first record
  EXPECT_EQ(Restore(snapshot_, damaged).status().code(), absl::StatusCode::kDataLoss);
  std::string header = log_;
  header[3] ^= 0x01;
  EXPECT_EQ(Restore(snapshot_, header).status().code(), absl::StatusCode::kDataLoss);
}

// A record's size is covered by a checksum of its own: a flipped bit in it is damage (DataLoss,
// at replay and at the start-up scan alike), wherever the record is. Unchecked, a size that
// claimed more than the log held made that record look cut short, a torn tail: it and every
// record after it (acknowledged turns) were dropped silently; one that claimed less failed its
// checksum with no frame after it that parsed, a torn tail too. The size's checksum is checked
// the same way (a flip in it is damage). And a record failing its checksum is torn only when it
// ends the log: bytes after it (of a next record) make it damage.
TEST_F(StateLogTest, ADamagedRecordSizeIsDamageNotATornTail) {
  Build(14, 20, 3);
  const std::vector<size_t> records = testing::LogRecordOffsets(log_);
  ASSERT_EQ(records.size(), 3u);
  const auto scan = [&](const std::string& log) {
    return ScanLog(
        [&](uint64_t offset, uint64_t n) -> absl::StatusOr<std::string> {
          return log.substr(std::min<size_t>(offset, log.size()), n);
        },
        log.size(), engine_->fingerprint(), IdOf(snapshot_));
  };
  for (size_t r = 0; r < records.size(); ++r) {
    for (size_t field : {size_t{0}, size_t{16}}) {  // the size, its checksum
      for (int bit = 0; bit < 64; ++bit) {
        SCOPED_TRACE(::testing::Message()
                     << "record " << r << ", field " << field << ", bit " << bit);
        std::string damaged = log_;
        damaged[records[r] + field + bit / 8] ^= static_cast<char>(1 << (bit % 8));
        const absl::Status replayed = Restore(snapshot_, damaged).status();
        EXPECT_EQ(replayed.code(), absl::StatusCode::kDataLoss) << replayed;
        EXPECT_EQ(scan(damaged).status().code(), absl::StatusCode::kDataLoss);
      }
    }
  }
  // The last record failing its checksum with bytes after it (a next record's first ones).
  std::string followed = log_;
  followed[followed.size() - 3] ^= 0x5a;
  followed += log_.substr(records[1], 30);
  EXPECT_EQ(Restore(snapshot_, followed).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(scan(followed).status().code(), absl::StatusCode::kDataLoss);
}

// A log of version 1 (frames without the size's checksum; docs/state-format.md, "Delta log") is
// read as before: its records restore the session bit-exactly, and a torn tail is dropped at any
// cut. The replay reports its version (the store writes a full snapshot rather than append to it).
TEST_F(StateLogTest, AVersionOneLogIsReadAsBefore) {
  Build(15, 20, 3);
  const std::string v1 = testing::ToVersion1Log(log_);
  ASSERT_EQ(v1.size(), log_.size() - 3 * (kLogRecordHeaderBytes - kLogRecordHeaderBytesV1));
  LogReplay replay;
  auto state = Restore(snapshot_, v1, &replay);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(replay.version, 1u);
  EXPECT_EQ(replay.records, 3);
  EXPECT_EQ(replay.valid_bytes, v1.size());
  EXPECT_TRUE(testing::BitwiseEqual(Probe(**state), after_.back()));
  const size_t last_start = ends_[2] - 2 * (kLogRecordHeaderBytes - kLogRecordHeaderBytesV1);
  for (size_t cut = last_start; cut < v1.size(); cut += 7) {
    SCOPED_TRACE(::testing::Message() << "cut at " << cut << " of " << v1.size());
    auto torn = Restore(snapshot_, v1.substr(0, cut), &replay);
    ASSERT_TRUE(torn.ok()) << torn.status();
    EXPECT_EQ(replay.records, 2);
    EXPECT_EQ(replay.valid_bytes, last_start);
    EXPECT_EQ((*torn)->position(), positions_[2]);
  }
  // The current version, for comparison.
  ASSERT_TRUE(Restore(snapshot_, log_, &replay).ok());
  EXPECT_EQ(replay.version, kStateLogVersion);
}

TEST_F(StateLogTest, ALogOfAnotherSnapshotIsStale) {
  Build(9, 20, 2);
  auto other = live_->Clone();
  const std::string newer =
      EncodeSessionState(*other, SessionRecord{"s", "meta"}, engine_->fingerprint());
  EXPECT_EQ(Restore(newer, log_).status().code(), absl::StatusCode::kFailedPrecondition);
}

// What a turn writes grows with the rows it touched, not with the session's history.
TEST_F(StateLogTest, ADeltaCostsTheRowsItsTurnTouched) {
  Build(10, 400, 0);
  const int64_t from = live_->position();
  testing::DecodeEach(*engine_, *live_, testing::RandomTokens(1, 11));
  const std::string one = EncodeSessionDelta(*live_, SessionRecord{"s", "meta"}, from);
  int64_t dirty = 0, sdm_width = 0, kv_width = 0;
  for (int64_t l = 0; l < live_->num_layers(); ++l) {
    if (live_->is_sdm(l)) {
      dirty += live_->sdm(l).dirty_rows();
      sdm_width = live_->sdm(l).row_width();
    } else {
      kv_width += live_->kv(l).row_width();
    }
  }
  EXPECT_GT(dirty, 0);
  // Exactly: the dirty rows with their indices, one KV row pair per attention layer, and small
  // fixed parts (record, per-layer headers, framing).
  const int64_t rows_bytes = dirty * (4 + sdm_width * 4) + 2 * kv_width * 4;
  EXPECT_GE(static_cast<int64_t>(one.size()), rows_bytes);
  EXPECT_LT(static_cast<int64_t>(one.size()), rows_bytes + 512);
  const std::string full =
      EncodeSessionState(*live_, SessionRecord{"s", "meta"}, engine_->fingerprint());
  EXPECT_LT(one.size() * 5, full.size()) << "delta " << one.size() << ", snapshot " << full.size();
}

// The store appends a delta to the log's header in place, sized before it is built: the same
// bytes as a delta encoded alone, of exactly the size announced, and it replays bit-exactly.
TEST_F(StateLogTest, ADeltaAppendedInPlaceIsTheRecordOfItsAnnouncedSize) {
  Build(12, 30, 0);
  const int64_t from = live_->position();
  testing::DecodeEach(*engine_, *live_, testing::RandomTokens(20, 13));  // past the ring
  const SessionRecord record{"s", "meta", -1, 77};
  const std::string alone = EncodeSessionDelta(*live_, record, from);
  EXPECT_EQ(SessionDeltaBytes(*live_, record, from), alone.size());
  const std::string header = EncodeLogHeader(engine_->fingerprint(), IdOf(snapshot_));
  std::string log = header;
  AppendSessionDelta(*live_, record, from, log);
  EXPECT_EQ(log, header + alone);
  LogReplay replay;
  auto state = Restore(snapshot_, log, &replay);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(replay.records, 1);
  EXPECT_EQ(replay.record.last_used_unix_ms, 77);
  EXPECT_TRUE(testing::BitwiseEqual(Probe(**state), Probe(*live_)));
}

// A snapshot or a delta produced in one pass (what the store writes: placeholders, then each
// checksum patched over its own) is byte for byte the two-pass emission, which computes each
// checksum before the bytes it covers; the placeholders are exactly the checksum fields.
TEST_F(StateLogTest, OnePassEmissionsAreTheTwoPassBytes) {
  const uint32_t fresh = std::random_device{}();
  for (uint32_t seed : {21u, 22u, fresh}) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    Build(seed, 3 + static_cast<int>(seed % 40), 2);
    const int64_t from = live_->position();
    testing::DecodeEach(*engine_, *live_, testing::RandomTokens(1 + seed % 20, seed));
    const SessionRecord record{"s", "meta", -1, 5};
    const SessionStateSource snapshot(*live_, record, engine_->fingerprint());
    const SessionDeltaSource first(*live_, record, from,
                                   EncodeLogHeader(engine_->fingerprint(), IdOf(snapshot_)));
    const SessionDeltaSource later(*live_, record, from);
    const std::vector<std::pair<const ByteSource*, size_t>> sources = {
        {&snapshot, static_cast<size_t>(live_->num_layers())}, {&first, 1}, {&later, 1}};
    for (const auto& [source, fields] : sources) {
      const std::string two_pass = SourceBytes(*source);
      ASSERT_EQ(two_pass.size(), source->size());
      EXPECT_EQ(SourceBytesOnePass(*source), two_pass);
      // The raw pass: zeros at the patched fields, everything else already final.
      std::string raw;
      std::vector<ByteSource::Patch> patches;
      ASSERT_TRUE(source
                      ->EmitOnePass(
                          [&](absl::string_view piece) {
                            raw.append(piece.data(), piece.size());
                            return absl::OkStatus();
                          },
                          patches)
                      .ok());
      ASSERT_EQ(patches.size(), fields);
      std::string patched = raw;
      for (const ByteSource::Patch& p : patches) {
        EXPECT_EQ(raw.substr(p.offset, 8), std::string(8, '\0'));
        std::memcpy(patched.data() + p.offset, &p.value, 8);
      }
      EXPECT_EQ(patched, two_pass);
    }
    // And what they encode restores the live session: the new snapshot alone, or the old one
    // with its log and the new delta.
    const std::string one_pass = SourceBytesOnePass(snapshot);
    const std::vector<float> live = Probe(*live_);
    auto alone = Restore(one_pass, EncodeLogHeader(engine_->fingerprint(), IdOf(one_pass)));
    ASSERT_TRUE(alone.ok()) << alone.status();
    EXPECT_TRUE(testing::BitwiseEqual(Probe(**alone), live));
    LogReplay replay;
    auto logged = Restore(snapshot_, log_ + SourceBytesOnePass(later), &replay);
    ASSERT_TRUE(logged.ok()) << logged.status();
    EXPECT_EQ(replay.records, 3);
    EXPECT_TRUE(testing::BitwiseEqual(Probe(**logged), live));
  }
}

// A KV delta claiming so many rows that their size wraps around 2^64 (2^55 rows of 64 floats:
// 2^55 x 2 x 256 bytes) with none present: damage, found before any row is read (the size was
// once multiplied out, wrapped to 0, passed, and the replay read rows from nowhere).
TEST(StateLogHugeClaimTest, AKvDeltaWhoseSizeWrapsIsDamage) {
  const StateLayout layout = testing::OneKvLayerLayout(64);
  constexpr uint64_t kFingerprint = 5;
  SessionState state(layout);
  for (int i = 0; i < 3; ++i) testing::AppendKvPosition(state);
  const std::string snapshot = EncodeSessionState(state, SessionRecord{"s", ""}, kFingerprint);
  state.ClearDirty();
  const int64_t from = state.position();
  testing::AppendKvPosition(state);
  std::string delta = EncodeSessionDelta(state, SessionRecord{"s", ""}, from);
  // The frame: bytes, checksum, then the payload: the record section's size and bytes (its
  // position 33 bytes in: id "s", empty metadata, TTL, last use), the layer count, then layer 0:
  // index, kind, width, from, to, first, rows.
  const size_t payload = kLogRecordHeaderBytes;
  const size_t record = payload + 8;
  const size_t layer = record + static_cast<size_t>(testing::LoadAt<uint64_t>(delta, payload)) + 4;
  ASSERT_EQ(testing::LoadAt<int64_t>(delta, record + 33), from + 1);
  ASSERT_EQ(testing::LoadAt<uint64_t>(delta, layer + 8), 64u);
  ASSERT_EQ(testing::LoadAt<int64_t>(delta, layer + 16), from);
  ASSERT_EQ(testing::LoadAt<int64_t>(delta, layer + 24), from + 1);
  const int64_t claim = from + (int64_t{1} << 55);
  testing::StoreAt<int64_t>(delta, record + 33, claim);
  testing::StoreAt<int64_t>(delta, layer + 24, claim);
  testing::StoreAt<uint64_t>(delta, 8, XXH64(delta.data() + payload, delta.size() - payload, 0));

  auto prefix = RecordPrefixSize(snapshot, snapshot.size(), kFingerprint);
  ASSERT_TRUE(prefix.ok()) << prefix.status();
  const uint64_t id = SnapshotId(absl::string_view(snapshot).substr(0, *prefix));
  auto decoded = DecodeSessionState(snapshot, layout, kFingerprint);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  const absl::StatusOr<LogReplay> replay =
      ReplayLog(EncodeLogHeader(kFingerprint, id) + delta, kFingerprint, id, *decoded->state);
  EXPECT_EQ(replay.status().code(), absl::StatusCode::kDataLoss) << replay.status();
  EXPECT_NE(replay.status().message().find("KV rows"), std::string::npos) << replay.status();
}

// Deltas that carry an SDM layer's writes (the write journal, state_store/sdm_table.h) restore
// the same bits as deltas that carry its rows: for both update rules and both decay forms,
// through prefill and decode turns. They are the smaller; a turn whose journal would outgrow its
// rows carries the rows (the same bytes as without a journal), and the next turn journals again.
TEST(StateLogJournalTest, JournaledDeltasRestoreWhatRowDeltasRestore) {
  ModelConfig slot_residual = testing::TinyConfig();
  slot_residual.sdm.update_rule = UpdateRule::kSlotResidual;
  ASSERT_TRUE(FinalizeModelConfig(slot_residual).ok());
  const std::vector<std::pair<const char*, ModelConfig>> configs = {
      {"tiny", testing::TinyConfig()},
      {"slot residual", slot_residual},
      {"key-weighted decay, 2 SDM layers", testing::MiniHybridConfig()}};
  const uint32_t fresh = std::random_device{}();
  for (const auto& [name, config] : configs) {
    for (uint32_t seed : {1u, 2u, fresh}) {
      SCOPED_TRACE(::testing::Message() << name << ", seed " << seed);
      EngineOptions options;
      options.num_threads = 1;
      options.prefill_chunk = 8;
      auto engine = Engine::Create(RandomModel(config, seed), options);
      ASSERT_TRUE(engine.ok()) << engine.status();
      const uint64_t fp = (*engine)->fingerprint();
      StateLayout recording = (*engine)->state_layout();
      for (LayerStateLayout& l : recording.layers) l.sdm_write.record = true;
      auto journaled = std::make_unique<SessionState>(recording);
      auto plain = (*engine)->NewSession();
      std::mt19937 rng(seed);
      const std::vector<int32_t> history = testing::RandomTokens(3 + rng() % 20, rng());
      testing::DecodeEach(**engine, *journaled, history);
      testing::DecodeEach(**engine, *plain, history);
      const std::string snapshot = EncodeSessionState(*plain, SessionRecord{"s", "m"}, fp);
      ASSERT_EQ(EncodeSessionState(*journaled, SessionRecord{"s", "m"}, fp), snapshot);
      journaled->ClearDirty();
      plain->ClearDirty();
      auto prefix = RecordPrefixSize(snapshot, snapshot.size(), fp);
      ASSERT_TRUE(prefix.ok()) << prefix.status();
      const uint64_t base = SnapshotId(absl::string_view(snapshot).substr(0, *prefix));
      std::string log_j = EncodeLogHeader(fp, base), log_p = log_j;
      int journal_turns = 0, row_turns = 0;
      for (int turn = 0; turn < 8; ++turn) {
        const int64_t from = plain->position();
        // Turn 5 is long enough that every row of the small tables is written several times.
        const int n = turn == 5 ? 90 : 1 + static_cast<int>(rng() % 24);
        const std::vector<int32_t> tokens = testing::RandomTokens(n, rng());
        if (turn % 2 == 0) {  // a prefill: segments of several tokens
          std::vector<float> logits;
          ASSERT_TRUE((*engine)->Prefill(*journaled, tokens, false, &logits).ok());
          ASSERT_TRUE((*engine)->Prefill(*plain, tokens, false, &logits).ok());
        } else {
          testing::DecodeEach(**engine, *journaled, tokens);
          testing::DecodeEach(**engine, *plain, tokens);
        }
        bool complete = true;
        for (int64_t l = 0; l < journaled->num_layers(); ++l) {
          if (journaled->is_sdm(l)) complete = complete && journaled->sdm(l).journal_complete();
        }
        const SessionRecord record{"s", "m", -1, turn};
        const std::string dj = EncodeSessionDelta(*journaled, record, from);
        const std::string dp = EncodeSessionDelta(*plain, record, from);
        EXPECT_EQ(SessionDeltaBytes(*journaled, record, from), dj.size());
        if (complete) {
          ++journal_turns;
          EXPECT_LT(dj.size(), dp.size()) << "turn " << turn;
        } else {
          ++row_turns;
          EXPECT_EQ(dj, dp) << "turn " << turn;
        }
        log_j += dj;
        log_p += dp;
        journaled->ClearDirty();
        plain->ClearDirty();
      }
      EXPECT_GT(journal_turns, 0);
      EXPECT_GT(row_turns, 0);  // turn 5
      for (const std::string* log : {&log_j, &log_p}) {
        auto decoded = DecodeSessionState(snapshot, recording, fp);
        ASSERT_TRUE(decoded.ok()) << decoded.status();
        SessionState& restored = *decoded->state;
        auto replay = ReplayLog(*log, fp, base, restored);
        ASSERT_TRUE(replay.ok()) << replay.status();
        EXPECT_EQ(replay->records, 8);
        ASSERT_EQ(restored.position(), plain->position());
        for (int64_t l = 0; l < restored.num_layers(); ++l) {
          if (!restored.is_sdm(l)) continue;
          const SdmTable& got = restored.sdm(l);
          const SdmTable& want = plain->sdm(l);
          EXPECT_EQ(got.private_rows(), want.private_rows());
          EXPECT_TRUE(got.journal_complete());  // replayed: clean, an empty journal
          for (int64_t h = 0; h < want.heads(); ++h) {
            for (int64_t s = 0; s < want.slots_per_head(); ++s) {
              ASSERT_EQ(std::memcmp(got.Row(h, s), want.Row(h, s), want.row_width() * 4), 0)
                  << "layer " << l << " head " << h << " slot " << s;
              ASSERT_EQ(
                  std::memcmp(journaled->sdm(l).Row(h, s), want.Row(h, s), want.row_width() * 4),
                  0);
            }
          }
        }
        auto copy = plain->Clone();
        EXPECT_TRUE(testing::BitwiseEqual(testing::ProbeLogits(**engine, restored, kProbe),
                                          testing::ProbeLogits(**engine, *copy, kProbe)));
      }
    }
  }
}

}  // namespace
}  // namespace sdm
