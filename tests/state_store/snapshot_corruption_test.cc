// Corruption detection in session snapshots (state_store/state_codec.h, session_store.h).
//
// Decoder: every single-byte change, every truncation, appended bytes, another format version,
// another model, sections in the wrong order and self-consistent but wrong contents are each
// refused with DATA_LOSS or FAILED_PRECONDITION, never accepted and never a crash.
//
// Store: a snapshot whose header or record is damaged is found by Open(), moved to
// dir/quarantine/ (not deleted) and named in open_errors(); damage further in is found by the
// session's Acquire(), which quarantines it then. Either way that session's Acquire() answers
// with the reason, and every other session in the directory restores exactly.
#include <sys/resource.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/engine.h"
#include "gtest/gtest.h"
#include "state_store/session_store.h"
#include "state_store/state_codec.h"
#include "state_store/state_files.h"
#include "state_store/state_log.h"
#include "tests/engine/test_model_util.h"
#include "tests/state_store/fault_injection_files.h"
#include "tests/state_store/snapshot_test_util.h"

namespace sdm {
namespace {

// The files quarantine/<id><suffix>.* in `dir` (suffix ".sdmstate": snapshots, ".sdmlog": logs).
std::vector<std::filesystem::path> QuarantinedCopies(const std::filesystem::path& dir,
                                                     absl::string_view id,
                                                     absl::string_view suffix = ".sdmstate") {
  std::vector<std::filesystem::path> found;
  const std::string prefix = absl::StrCat(id, suffix, ".");
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir / "quarantine", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0) found.push_back(e.path());
  }
  return found;
}

// The one such file (the last listed if several), or an empty path.
std::filesystem::path QuarantinedCopy(const std::filesystem::path& dir, absl::string_view id,
                                      absl::string_view suffix = ".sdmstate") {
  std::vector<std::filesystem::path> found = QuarantinedCopies(dir, id, suffix);
  return found.empty() ? std::filesystem::path() : found.back();
}

using testing::BlobSection;
using testing::FixChecksums;
using testing::LoadAt;
using testing::ParseSections;
using testing::StoreAt;

constexpr int32_t kProbe = 7;

bool IsRefusal(const absl::Status& s) {
  return s.code() == absl::StatusCode::kDataLoss ||
         s.code() == absl::StatusCode::kFailedPrecondition;
}

// ---- The decoder, on the snapshot of a short session of the tiny model ----

class SnapshotCodecCorruptionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = testing::TinyEngine();
    auto session = engine_->NewSession();
    ASSERT_TRUE(engine_->Prefill(*session, testing::RandomTokens(3, 5), false, nullptr).ok());
    session->sampler_seed = 99;
    session->sampler_draws = 3;
    session->pending_token = 65;
    good_ = EncodeSessionState(*session, SessionRecord{"victim", R"({"owner":"t"})", 60000, 1234},
                               fp());
    sections_ = ParseSections(good_);
    ASSERT_EQ(sections_.size(), 5u);  // record, 3 x KV (swa), SDM
    ASSERT_EQ(sections_.back().end(), good_.size());
    ASSERT_TRUE(Decode(good_).ok());
  }

  uint64_t fp() const { return engine_->fingerprint(); }
  absl::Status Decode(const std::string& blob, uint64_t fingerprint) const {
    return DecodeSessionState(blob, engine_->state_layout(), fingerprint).status();
  }
  absl::Status Decode(const std::string& blob) const { return Decode(blob, fp()); }
  // What Open() runs: the record from a prefix of the file.
  absl::Status DecodeRecord(const std::string& blob) const {
    auto size =
        RecordPrefixSize(absl::string_view(blob).substr(0, kRecordPrefixBytes), blob.size(), fp());
    if (!size.ok()) return size.status();
    return DecodeSessionRecord(absl::string_view(blob).substr(0, *size), blob.size(), fp())
        .status();
  }
  // Payload offset of field `offset` of section `i` (0 = record).
  size_t At(size_t i, size_t offset) const { return sections_[i].payload() + offset; }

  std::unique_ptr<Engine> engine_;
  std::string good_;
  std::vector<BlobSection> sections_;
};

TEST_F(SnapshotCodecCorruptionTest, GoodSnapshotRoundTrips) {
  auto decoded = DecodeSessionState(good_, engine_->state_layout(), fp());
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->record.id, "victim");
  EXPECT_EQ(decoded->record.metadata, R"({"owner":"t"})");
  EXPECT_EQ(decoded->record.ttl_ms, 60000);
  EXPECT_EQ(decoded->record.last_used_unix_ms, 1234);
  EXPECT_EQ(decoded->state->position(), 3);
  EXPECT_EQ(decoded->state->sampler_seed, 99u);
  EXPECT_EQ(decoded->state->sampler_draws, 3u);
  EXPECT_EQ(decoded->state->pending_token, 65);
  EXPECT_EQ(EncodeSessionState(*decoded->state, decoded->record, fp()), good_);
  EXPECT_TRUE(DecodeRecord(good_).ok());
}

// The encoder writes each section's header after its payload (in place): every size and
// checksum is still the documented one — recomputing them from the bytes changes nothing.
TEST_F(SnapshotCodecCorruptionTest, SizesAndChecksumsAreTheDocumentedOnes) {
  std::string recomputed = good_;
  FixChecksums(recomputed);
  EXPECT_EQ(recomputed, good_);
  EXPECT_EQ(LoadAt<uint64_t>(good_, testing::kSectionCountOffset), sections_.size());
  EXPECT_EQ(LoadAt<uint64_t>(good_, testing::kSectionCountOffset + 8), good_.size());
}

TEST_F(SnapshotCodecCorruptionTest, EveryByteChangeIsDetected) {
  std::mt19937 rng(20240601);
  const size_t record_end = sections_[0].end();
  int tried = 0;
  for (size_t at = 0; at < good_.size(); ++at) {
    // Every byte inverted, and one random single-bit flip per byte.
    for (uint8_t mask : {uint8_t{0xFF}, static_cast<uint8_t>(1u << (rng() % 8))}) {
      std::string bad = good_;
      bad[at] = static_cast<char>(bad[at] ^ mask);
      const absl::Status s = Decode(bad);
      ASSERT_TRUE(IsRefusal(s)) << "byte " << at << " ^ " << int{mask} << ": " << s;
      EXPECT_FALSE(s.message().empty());
      // Open() reads only the header and the record: damage there is found at Open, damage
      // beyond it only when the session is restored.
      const absl::Status r = DecodeRecord(bad);
      if (at < record_end) {
        ASSERT_TRUE(IsRefusal(r)) << "record byte " << at << ": " << r;
      } else {
        ASSERT_TRUE(r.ok()) << "byte " << at << ": " << r;
      }
      ++tried;
    }
  }
  EXPECT_EQ(tried, 2 * static_cast<int>(good_.size()));
}

TEST_F(SnapshotCodecCorruptionTest, EveryTruncationIsDetected) {
  for (size_t n = 0; n < good_.size(); ++n) {
    const std::string bad = good_.substr(0, n);
    const absl::Status s = Decode(bad);
    ASSERT_EQ(s.code(), absl::StatusCode::kDataLoss) << "truncated to " << n << ": " << s;
    ASSERT_EQ(DecodeRecord(bad).code(), absl::StatusCode::kDataLoss) << "truncated to " << n;
  }
}

TEST_F(SnapshotCodecCorruptionTest, AppendedBytesAreDetected) {
  const BlobSection& last = sections_.back();
  const std::string last_section = good_.substr(last.offset);
  for (const std::string& extra : {std::string(1, '\0'), std::string(8, 'x'), std::string(24, '\0'),
                                   std::string(4096, '\7'), last_section}) {
    SCOPED_TRACE(absl::StrCat(extra.size(), " bytes appended"));
    std::string bad = good_ + extra;
    EXPECT_EQ(Decode(bad).code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(DecodeRecord(bad).code(), absl::StatusCode::kDataLoss);
    // Even with the header's total size updated (and its checksum): trailing bytes.
    StoreAt<uint64_t>(bad, testing::kTotalOffset, bad.size());
    FixChecksums(bad);
    EXPECT_EQ(Decode(bad).code(), absl::StatusCode::kDataLoss);
  }
  // A whole extra section, declared in the header: more sections than the model has layers.
  std::string bad = good_ + last_section;
  StoreAt<uint64_t>(bad, testing::kTotalOffset, bad.size());
  StoreAt<uint64_t>(bad, testing::kSectionCountOffset, sections_.size() + 1);
  FixChecksums(bad);
  EXPECT_TRUE(IsRefusal(Decode(bad))) << Decode(bad);
}

TEST_F(SnapshotCodecCorruptionTest, OtherFormatVersionIsRefused) {
  for (uint32_t version : {0u, kStateFormatVersion + 1, 0xFFFFFFFFu}) {
    std::string bad = good_;
    StoreAt<uint32_t>(bad, testing::kVersionOffset, version);
    // Without a matching header checksum it is plain damage...
    EXPECT_EQ(Decode(bad).code(), absl::StatusCode::kDataLoss);
    // ...with one, a version this build does not read.
    FixChecksums(bad);
    const absl::Status s = Decode(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), absl::StrCat("version ", version))) << s;
    EXPECT_EQ(DecodeRecord(bad).code(), absl::StatusCode::kFailedPrecondition);
  }
}

TEST_F(SnapshotCodecCorruptionTest, OtherModelIsRefused) {
  // Another fingerprint.
  absl::Status s = Decode(good_, fp() ^ 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "different model")) << s;
  // The same config with other weights has another fingerprint.
  auto other = testing::TinyEngine(/*weight_seed=*/12);
  ASSERT_NE(other->fingerprint(), fp());
  s = DecodeSessionState(good_, other->state_layout(), other->fingerprint()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(DecodeSessionRecord(good_, good_.size(), other->fingerprint()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // The fingerprint field rewritten (checksum updated): refused as another model's.
  std::string bad = good_;
  StoreAt<uint64_t>(bad, testing::kFingerprintOffset, fp() + 1);
  FixChecksums(bad);
  EXPECT_EQ(Decode(bad).code(), absl::StatusCode::kFailedPrecondition);
  // A model with another layout (more layers).
  auto config = PresetConfig("tiny");
  ASSERT_TRUE(config.ok());
  config->n_layers = 5;
  config->swa_at = {0, 1, 2, 3};
  config->sdm_at = {4};
  ASSERT_TRUE(FinalizeModelConfig(*config).ok());
  auto bigger = Engine::Create(RandomModel(*config, 11));
  ASSERT_TRUE(bigger.ok()) << bigger.status();
  s = DecodeSessionState(good_, (*bigger)->state_layout(), fp()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
}

TEST_F(SnapshotCodecCorruptionTest, SwappedSectionsAreDetected) {
  for (size_t i = 0; i < sections_.size(); ++i) {
    for (size_t j = i + 1; j < sections_.size(); ++j) {
      const std::string bad = testing::SwapSections(good_, i, j);
      ASSERT_EQ(bad.size(), good_.size());
      const absl::Status s = Decode(bad);
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss)
          << "sections " << i << ", " << j << ": " << s;
      // Open() sees the record moved away from the front.
      EXPECT_EQ(DecodeRecord(bad).ok(), i != 0) << "sections " << i << ", " << j;
    }
  }
}

// Edits that keep every checksum valid: the decoder's own consistency checks must catch them.
TEST_F(SnapshotCodecCorruptionTest, ConsistentChecksumsWrongContentsAreDetected) {
  const size_t rec = 0, kv0 = 1, kv1 = 2, sdm = 4;
  // Record payload: id (8 + 6), metadata (8 + 13), ttl, last used, then these fields.
  const size_t position = 8 + 6 + 8 + 13 + 16;
  const size_t num_layers = position + 8 + 8 + 8 + 4;
  // KV payload: u32 layer | u64 width | u64 ring | i64 length | i64 first.
  // SDM payload: u32 layer | u64 heads | u64 slots | u64 width | u64 rows | u32 index[rows].
  const uint64_t sdm_rows = LoadAt<uint64_t>(good_, At(sdm, 28));
  ASSERT_GE(sdm_rows, 2u);
  struct Edit {
    const char* what;
    std::function<void(std::string&)> apply;
    absl::StatusCode code;
  };
  const std::vector<Edit> edits = {
      {"magic", [](std::string& b) { b[0] = 'X'; }, absl::StatusCode::kDataLoss},
      {"header size", [](std::string& b) { StoreAt<uint32_t>(b, 12, 56); },
       absl::StatusCode::kDataLoss},
      {"no sections", [](std::string& b) { StoreAt<uint64_t>(b, testing::kSectionCountOffset, 0); },
       absl::StatusCode::kDataLoss},
      {"huge section count",
       [](std::string& b) { StoreAt<uint64_t>(b, testing::kSectionCountOffset, ~uint64_t{0}); },
       absl::StatusCode::kDataLoss},
      {"unknown section type",
       [&](std::string& b) { StoreAt<uint32_t>(b, sections_[kv1].offset, 7); },
       absl::StatusCode::kDataLoss},
      {"record section type",
       [&](std::string& b) { StoreAt<uint32_t>(b, sections_[rec].offset, testing::kKvSection); },
       absl::StatusCode::kDataLoss},
      {"reserved field of a section",
       [&](std::string& b) { StoreAt<uint32_t>(b, sections_[kv0].offset + 4, 1); },
       absl::StatusCode::kDataLoss},
      {"reserved field of the record",
       [&](std::string& b) { StoreAt<uint32_t>(b, sections_[rec].offset + 4, 0x100); },
       absl::StatusCode::kDataLoss},
      {"record id length", [&](std::string& b) { StoreAt<uint64_t>(b, At(rec, 0), 1u << 30); },
       absl::StatusCode::kDataLoss},
      {"position", [&](std::string& b) { StoreAt<int64_t>(b, At(rec, position), 4); },
       absl::StatusCode::kDataLoss},
      {"negative position", [&](std::string& b) { StoreAt<int64_t>(b, At(rec, position), -1); },
       absl::StatusCode::kDataLoss},
      {"layer count", [&](std::string& b) { StoreAt<uint32_t>(b, At(rec, num_layers), 5); },
       absl::StatusCode::kFailedPrecondition},
      {"KV layer index", [&](std::string& b) { StoreAt<uint32_t>(b, At(kv1, 0), 0); },
       absl::StatusCode::kDataLoss},
      {"KV row width", [&](std::string& b) { StoreAt<uint64_t>(b, At(kv0, 4), 16); },
       absl::StatusCode::kFailedPrecondition},
      {"KV ring capacity", [&](std::string& b) { StoreAt<uint64_t>(b, At(kv0, 12), 0); },
       absl::StatusCode::kFailedPrecondition},
      // A ring past int64 once overflowed the held-rows computation (undefined behaviour found
      // by tests/fuzz/state_codec_fuzzer.cc under UBSan; the regression input is one of its
      // seeds).
      {"KV ring capacity past int64",
       [&](std::string& b) { StoreAt<uint64_t>(b, At(kv0, 12), (uint64_t{1} << 63) + 3); },
       absl::StatusCode::kDataLoss},
      {"KV length", [&](std::string& b) { StoreAt<int64_t>(b, At(kv0, 20), 2); },
       absl::StatusCode::kDataLoss},
      {"KV first position", [&](std::string& b) { StoreAt<int64_t>(b, At(kv0, 28), 1); },
       absl::StatusCode::kDataLoss},
      {"SDM heads", [&](std::string& b) { StoreAt<uint64_t>(b, At(sdm, 4), 1); },
       absl::StatusCode::kFailedPrecondition},
      {"SDM slots", [&](std::string& b) { StoreAt<uint64_t>(b, At(sdm, 12), 65); },
       absl::StatusCode::kFailedPrecondition},
      {"SDM row width", [&](std::string& b) { StoreAt<uint64_t>(b, At(sdm, 20), 31); },
       absl::StatusCode::kFailedPrecondition},
      {"SDM row count + 1",
       [&](std::string& b) { StoreAt<uint64_t>(b, At(sdm, 28), sdm_rows + 1); },
       absl::StatusCode::kDataLoss},
      {"SDM row count > slots",
       [&](std::string& b) { StoreAt<uint64_t>(b, At(sdm, 28), 2 * 64 + 1); },
       absl::StatusCode::kDataLoss},
      {"SDM slot index out of range",
       [&](std::string& b) { StoreAt<uint32_t>(b, At(sdm, 36), 2 * 64); },
       absl::StatusCode::kDataLoss},
      {"SDM slot index repeated",
       [&](std::string& b) { StoreAt<uint32_t>(b, At(sdm, 40), LoadAt<uint32_t>(b, At(sdm, 36))); },
       absl::StatusCode::kDataLoss},
  };
  for (const Edit& edit : edits) {
    std::string bad = good_;
    edit.apply(bad);
    FixChecksums(bad);
    const absl::Status s = Decode(bad);
    EXPECT_EQ(s.code(), edit.code) << edit.what << ": " << s;
  }
}

// Caps this process's address space at its current size plus `extra` bytes.
void LimitAddressSpace(int64_t extra) {
  std::ifstream status("/proc/self/status");
  int64_t vm_kb = 0;
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmSize:", 0) == 0) vm_kb = std::stoll(line.substr(7));
  }
  const rlim_t limit = static_cast<rlim_t>(vm_kb * 1024 + extra);
  const struct rlimit rl = {limit, limit};
  setrlimit(RLIMIT_AS, &rl);
}

// A self-consistent snapshot claiming an enormous history for a full-attention layer must be
// refused from its sizes, before any memory is reserved for that history.
TEST(SnapshotCodecHugeClaimTest, HugePositionIsRefusedWithoutAllocating) {
  const StateLayout layout = testing::OneKvLayerLayout(64);
  SessionState state(layout);
  for (int i = 0; i < 3; ++i) testing::AppendKvPosition(state);
  const std::string good = EncodeSessionState(state, SessionRecord{"s", ""}, 5);
  ASSERT_TRUE(DecodeSessionState(good, layout, 5).ok());
  auto sections = ParseSections(good);
  ASSERT_EQ(sections.size(), 2u);
  // 2^40 tokens of 64-float rows would be 512 TiB of pages.
  const int64_t huge = int64_t{1} << 40;
  std::string bad = good;
  StoreAt<int64_t>(bad, sections[0].payload() + 8 + 1 + 8 + 0 + 16,
                   huge);  // id "s", empty metadata
  StoreAt<int64_t>(bad, sections[1].payload() + 20, huge);
  FixChecksums(bad);
  // Decoded in a child process with a capped address space, so that a decoder that reserved
  // memory for the claimed history fails there (bad_alloc) instead of exhausting the machine.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        LimitAddressSpace(int64_t{512} << 20);
        const absl::Status s = DecodeSessionState(bad, layout, 5).status();
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        std::_Exit(s.code() == absl::StatusCode::kDataLoss ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "DATA_LOSS");
}

// A record claiming a position past kMaxSessionPosition is damage whatever its layers say (a
// sliding-window or SDM-only state has no KV length to bound it, and the server's position + 1
// would wrap): refused by the record's own parse, which snapshots, deltas and listings share.
TEST(SnapshotCodecHugeClaimTest, APositionPastTheLimitIsDataLoss) {
  SessionState state(testing::OneKvLayerLayout(64));
  const std::string good = EncodeRecordSection(state, SessionRecord{"s", ""});
  ASSERT_TRUE(ParseRecordSection(good).ok());
  const size_t position_at = 8 + 1 + 8 + 0 + 16;  // id "s", empty metadata, TTL, last use
  for (const int64_t claim : {kMaxSessionPosition + 1, std::numeric_limits<int64_t>::max(),
                              std::numeric_limits<int64_t>::min(), int64_t{-1}}) {
    std::string bad = good;
    StoreAt<int64_t>(bad, position_at, claim);
    const absl::StatusOr<RecordSection> parsed = ParseRecordSection(bad);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kDataLoss) << claim;
  }
  std::string edge = good;
  StoreAt<int64_t>(edge, position_at, kMaxSessionPosition);
  const absl::StatusOr<RecordSection> parsed = ParseRecordSection(edge);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->record.position, kMaxSessionPosition);
}

// ---- Through the store: quarantine, errors, other sessions unaffected ----

class SnapshotStoreCorruptionTest : public ::testing::Test {
 protected:
  struct Ref {
    std::vector<int32_t> prompt;
    std::vector<float> logits;
  };

  void SetUp() override {
    engine_ = testing::TinyEngine();
    refs_["victim"].prompt = testing::RandomTokens(3, 5);
    refs_["alpha"].prompt = testing::RandomTokens(20, 6);
    refs_["omega"].prompt = testing::RandomTokens(9, 7);
    auto store = Open();
    ASSERT_NE(store, nullptr);
    for (auto& [id, ref] : refs_) {
      auto session = engine_->NewSession();
      ASSERT_TRUE(engine_->Prefill(*session, ref.prompt, false, nullptr).ok());
      ref.logits = testing::ProbeLogits(*engine_, *session, kProbe);
      ASSERT_TRUE(store->Create(id, absl::StrCat("meta of ", id)).ok());
      {
        auto lease = store->Acquire(id);
        ASSERT_TRUE(lease.ok());
        ASSERT_TRUE(engine_->Prefill(lease->state(), ref.prompt, false, nullptr).ok());
      }
      ASSERT_TRUE(store->Park(id, Tier::kDisk).ok());
    }
    store.reset();
    good_ = testing::ReadFile(Victim());
    sections_ = ParseSections(good_);
    ASSERT_EQ(sections_.size(), 5u);
  }

  std::filesystem::path Victim() const { return dir_.path() / "victim.sdmstate"; }
  // The quarantined copy: quarantine/victim.sdmstate.<unix ms>[.n] (never overwritten).
  std::filesystem::path Quarantined() const { return QuarantinedCopy(dir_.path(), "victim"); }

  std::unique_ptr<SessionStateStore> Open(uint64_t fingerprint = 0,
                                          StateFiles* files = StateFiles::Default()) {
    SessionStoreOptions options;
    options.dir = dir_.path();
    options.files = files;
    options.background = false;
    auto store = SessionStateStore::Open(
        engine_->state_layout(), fingerprint != 0 ? fingerprint : engine_->fingerprint(), options);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? *std::move(store) : nullptr;
  }

  // A turn of `tokens` on alpha, written (a delta, to its log) by a store closed after it.
  void TurnOnAlpha(const std::vector<int32_t>& tokens) {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    auto lease = store->Acquire("alpha");
    ASSERT_TRUE(lease.ok()) << lease.status();
    testing::DecodeEach(*engine_, lease->state(), tokens);
  }

  // Alpha restores with its prompt and then `more` (TurnOnAlpha's tokens).
  void ExpectAlphaHas(const std::vector<int32_t>& more) {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    auto lease = store->Acquire("alpha");
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(lease->state().position(),
              static_cast<int64_t>(refs_["alpha"].prompt.size() + more.size()));
  }

  // The other sessions restore exactly: same probe logits, bit for bit, as never-parked ones.
  void ExpectOthersIntact(SessionStateStore& store) {
    for (const char* id : {"alpha", "omega"}) {
      SCOPED_TRACE(id);
      auto lease = store.Acquire(id);
      ASSERT_TRUE(lease.ok()) << lease.status();
      EXPECT_EQ(lease->state().position(), static_cast<int64_t>(refs_[id].prompt.size()));
      auto copy = lease->state().Clone();
      EXPECT_TRUE(
          testing::BitwiseEqual(testing::ProbeLogits(*engine_, *copy, kProbe), refs_[id].logits));
      auto info = store.Get(id);
      ASSERT_TRUE(info.ok());
      EXPECT_TRUE(info->error.empty());
      EXPECT_EQ(info->metadata, absl::StrCat("meta of ", id));
    }
  }

  // The victim's Acquire() refuses with the reason (and so do Fork and Park), and its file is in
  // quarantine, byte for byte as it was found.
  void ExpectVictimRefused(SessionStateStore& store, const std::string& bad,
                           absl::string_view reason) {
    auto lease = store.Acquire("victim");
    ASSERT_FALSE(lease.ok());
    const absl::Status s = lease.status();
    EXPECT_TRUE(IsRefusal(s)) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "victim")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), reason)) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "quarantine")) << s;
    EXPECT_EQ(store.Acquire("victim").status(), s);  // the same answer every time
    EXPECT_TRUE(IsRefusal(store.Fork("victim", "copy", ""))) << store.Fork("victim", "copy", "");
    auto info = store.Get("victim");
    ASSERT_TRUE(info.ok());
    EXPECT_FALSE(info->error.empty());
    EXPECT_FALSE(std::filesystem::exists(Victim()));
    ASSERT_TRUE(std::filesystem::exists(Quarantined()));
    EXPECT_EQ(testing::ReadFile(Quarantined()), bad);
    EXPECT_EQ(store.Stats().quarantined, 1);
  }

  // Writes `bad` as the victim's snapshot; checks that Open() finds it (when `at_open`) or that
  // only the victim's Acquire() does, and that nothing else is affected.
  void CheckCorruption(const std::string& bad, bool at_open, absl::string_view reason) {
    std::filesystem::remove_all(dir_.path() / "quarantine");
    testing::WriteFile(Victim(), bad);
    auto store = Open();
    ASSERT_NE(store, nullptr);
    const std::vector<std::string> errors = store->open_errors();
    if (at_open) {
      ASSERT_EQ(errors.size(), 1u);
      EXPECT_TRUE(absl::StrContains(errors[0], "victim")) << errors[0];
      EXPECT_TRUE(absl::StrContains(errors[0], reason)) << errors[0];
      EXPECT_TRUE(std::filesystem::exists(Quarantined()));  // moved at Open
    } else {
      EXPECT_TRUE(errors.empty()) << errors[0];
      EXPECT_EQ(store->Stats().quarantined, 0);
      EXPECT_TRUE(std::filesystem::exists(Victim()));  // looks fine until it is read whole
    }
    ASSERT_NO_FATAL_FAILURE(ExpectVictimRefused(*store, bad, reason));
    ExpectOthersIntact(*store);
    store.reset();
    // Reopened (a restart): the session is still there, quarantined, until it is deleted; the
    // quarantined file stays where it is, and nothing else changed.
    const std::filesystem::path copy = Quarantined();
    {
      auto again = Open();
      ASSERT_NE(again, nullptr);
      EXPECT_TRUE(again->open_errors().empty());
      const absl::Status refused = again->Acquire("victim").status();
      EXPECT_EQ(refused.code(), absl::StatusCode::kDataLoss) << refused;
      EXPECT_TRUE(absl::StrContains(refused.message(), "victim")) << refused;
      EXPECT_TRUE(absl::StrContains(refused.message(), copy.string())) << refused;
      auto info = again->Get("victim");
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->error, refused.message());
      EXPECT_EQ(info->position, -1);
      const std::vector<SessionInfo> listed = again->List();
      EXPECT_EQ(listed.size(), 3u);  // victim, alpha, omega
      EXPECT_EQ(testing::ReadFile(copy), bad);
      ExpectOthersIntact(*again);
      // Deleted: its copy is renamed (kept for the operator) and it is gone for good.
      ASSERT_TRUE(again->Delete("victim").ok());
      EXPECT_EQ(again->Get("victim").status().code(), absl::StatusCode::kNotFound);
    }
    EXPECT_FALSE(std::filesystem::exists(copy));
    std::filesystem::path deleted = copy;
    deleted += ".deleted";
    EXPECT_EQ(testing::ReadFile(deleted), bad);
    auto after_delete = Open();
    ASSERT_NE(after_delete, nullptr);
    EXPECT_EQ(after_delete->Acquire("victim").status().code(), absl::StatusCode::kNotFound);
    ExpectOthersIntact(*after_delete);
  }

  // Writes `other` (sound, of another format version or model) as the victim's snapshot: Open()
  // reports it and leaves it where it is (never quarantined, never expired); the session is
  // refused (FAILED_PRECONDITION) across restarts until it is deleted, which removes the file.
  void CheckRefusedInPlace(const std::string& other, absl::string_view reason) {
    testing::WriteFile(Victim(), other);
    for (int open = 0; open < 2; ++open) {  // and again after a restart
      SCOPED_TRACE(absl::StrCat("open ", open));
      auto store = Open();
      ASSERT_NE(store, nullptr);
      const std::vector<std::string> errors = store->open_errors();
      ASSERT_EQ(errors.size(), 1u);
      EXPECT_TRUE(absl::StrContains(errors[0], "victim")) << errors[0];
      EXPECT_TRUE(absl::StrContains(errors[0], reason)) << errors[0];
      EXPECT_TRUE(absl::StrContains(errors[0], "left in place")) << errors[0];
      const absl::Status s = store->Acquire("victim").status();
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), "victim")) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), reason)) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), "serves the session")) << s;
      EXPECT_EQ(store->Acquire("victim").status(), s);  // the same answer every time
      EXPECT_EQ(store->Fork("victim", "copy", "").code(), absl::StatusCode::kFailedPrecondition);
      auto info = store->Get("victim");
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->error, s.message());
      EXPECT_EQ(info->position, -1);
      EXPECT_EQ(store->Stats().quarantined, 0);
      EXPECT_EQ(store->ExpireIdle(absl::Now() + absl::Hours(24 * 365 * 100)), 0);
      ExpectOthersIntact(*store);
      EXPECT_EQ(testing::ReadFile(Victim()), other);
      EXPECT_FALSE(std::filesystem::exists(Quarantined()));
    }
    {
      auto store = Open();
      ASSERT_NE(store, nullptr);
      ASSERT_TRUE(store->Delete("victim").ok());
      EXPECT_EQ(store->Get("victim").status().code(), absl::StatusCode::kNotFound);
    }
    EXPECT_FALSE(std::filesystem::exists(Victim()));
    auto after_delete = Open();
    ASSERT_NE(after_delete, nullptr);
    EXPECT_TRUE(after_delete->open_errors().empty());
    EXPECT_EQ(after_delete->Acquire("victim").status().code(), absl::StatusCode::kNotFound);
    ExpectOthersIntact(*after_delete);
  }

  // Alpha's snapshot with one byte of its record flipped: found damaged at Open.
  void DamageAlphasRecord() {
    const std::filesystem::path path = dir_.path() / "alpha.sdmstate";
    std::string damaged = testing::ReadFile(path);
    damaged[sections_[0].payload() + 3] ^= 0x01;
    testing::WriteFile(path, damaged);
  }

  testing::ScopedTempDir dir_;
  std::unique_ptr<Engine> engine_;
  std::map<std::string, Ref> refs_;
  std::string good_;
  std::vector<BlobSection> sections_;
};

TEST_F(SnapshotStoreCorruptionTest, UndamagedDirectoryRestoresEverySession) {
  auto store = Open();
  ASSERT_NE(store, nullptr);
  EXPECT_TRUE(store->open_errors().empty());
  auto lease = store->Acquire("victim");
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE(testing::BitwiseEqual(testing::ProbeLogits(*engine_, lease->state(), kProbe),
                                    refs_["victim"].logits));
  ExpectOthersIntact(*store);
}

// A quarantined session whose TTL passes expires like any other: its quarantined copy is
// renamed (kept for the operator, as Delete does), so the next Open does not bring it back.
TEST_F(SnapshotStoreCorruptionTest, AnExpiredQuarantinedSessionStaysGone) {
  {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(store->Create("brief", "", absl::Hours(1)).ok());
    {
      auto lease = store->Acquire("brief");
      ASSERT_TRUE(lease.ok());
      ASSERT_TRUE(
          engine_->Prefill(lease->state(), testing::RandomTokens(6, 9), false, nullptr).ok());
    }
    ASSERT_TRUE(store->Park("brief", Tier::kDisk).ok());
  }
  // Damage past the record (found by Acquire, not at Open: its TTL is read).
  std::string bytes = testing::ReadFile(dir_.path() / "brief.sdmstate");
  bytes[bytes.size() - 10] ^= 0x55;
  testing::WriteFile(dir_.path() / "brief.sdmstate", bytes);
  {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    EXPECT_EQ(store->Acquire("brief").status().code(), absl::StatusCode::kDataLoss);
    const std::filesystem::path copy = QuarantinedCopy(dir_.path(), "brief");
    ASSERT_FALSE(copy.empty());
    EXPECT_EQ(store->ExpireIdle(absl::Now() + absl::Hours(2)), 1);
    EXPECT_EQ(store->Get("brief").status().code(), absl::StatusCode::kNotFound);
    EXPECT_FALSE(std::filesystem::exists(copy));
    std::filesystem::path deleted = copy;
    deleted += ".deleted";
    EXPECT_EQ(testing::ReadFile(deleted), bytes);
  }
  auto reopened = Open();
  ASSERT_NE(reopened, nullptr);
  EXPECT_EQ(reopened->Get("brief").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(reopened->Create("brief", "").ok());
}

TEST_F(SnapshotStoreCorruptionTest, TruncatedSnapshotIsQuarantinedAtOpen) {
  for (size_t n : {size_t{0}, size_t{20}, size_t{47}, size_t{60}, sections_[0].end(),
                   good_.size() / 2, good_.size() - 1}) {
    SCOPED_TRACE(absl::StrCat("truncated to ", n));
    CheckCorruption(good_.substr(0, n), /*at_open=*/true, "truncated");
  }
}

TEST_F(SnapshotStoreCorruptionTest, AppendedBytesAreQuarantinedAtOpen) {
  CheckCorruption(good_ + "garbage", /*at_open=*/true, "padded");
}

TEST_F(SnapshotStoreCorruptionTest, DamagedHeaderIsQuarantinedAtOpen) {
  std::string bad = good_;
  bad[30] ^= 0x10;  // inside the total-size field
  CheckCorruption(bad, /*at_open=*/true, "checksum");
}

TEST_F(SnapshotStoreCorruptionTest, DamagedRecordIsQuarantinedAtOpen) {
  std::string bad = good_;
  bad[sections_[0].payload() + 3] ^= 0x01;
  CheckCorruption(bad, /*at_open=*/true, "checksum");
}

TEST_F(SnapshotStoreCorruptionTest, OtherVersionIsRefusedInPlace) {
  std::string other = good_;
  StoreAt<uint32_t>(other, testing::kVersionOffset, kStateFormatVersion + 1);
  FixChecksums(other);
  CheckRefusedInPlace(other, "version");
}

TEST_F(SnapshotStoreCorruptionTest, OtherModelsSnapshotIsRefusedInPlace) {
  std::string other = good_;
  StoreAt<uint64_t>(other, testing::kFingerprintOffset, engine_->fingerprint() ^ 0xFF);
  FixChecksums(other);
  CheckRefusedInPlace(other, "different model");
}

TEST_F(SnapshotStoreCorruptionTest, AnotherSessionsSnapshotUnderTheNameIsQuarantined) {
  CheckCorruption(testing::ReadFile(dir_.path() / "alpha.sdmstate"), /*at_open=*/true,
                  "holds session 'alpha'");
}

// Damage after the record passes Open() and is found by the session's first Acquire().
TEST_F(SnapshotStoreCorruptionTest, DamagedPayloadIsFoundAtAcquire) {
  for (size_t section : {size_t{1}, size_t{3}, size_t{4}}) {  // KV layers 0, 2; the SDM layer
    for (size_t offset : {size_t{0}, size_t{13}, sections_[section].size - 1}) {
      SCOPED_TRACE(absl::StrCat("section ", section, " byte ", offset));
      std::string bad = good_;
      bad[sections_[section].payload() + offset] ^= 0x40;
      CheckCorruption(bad, /*at_open=*/false, "checksum");
    }
  }
  std::string bad = good_;
  bad[sections_[4].offset + 17] ^= 0x01;  // the SDM section's checksum field
  CheckCorruption(bad, /*at_open=*/false, "checksum");
}

TEST_F(SnapshotStoreCorruptionTest, SwappedLayerSectionsAreFoundAtAcquire) {
  CheckCorruption(testing::SwapSections(good_, 1, 2), /*at_open=*/false, "out of order");
  CheckCorruption(testing::SwapSections(good_, 3, 4), /*at_open=*/false, "inconsistent");
}

// Byte flips at a fixed-seed sample of offsets plus a few fresh ones, through the store.
TEST_F(SnapshotStoreCorruptionTest, RandomByteFlipsAreRefusedAndIsolated) {
  std::vector<uint32_t> seeds = {1, 2, 3, 4, 5, 6, 7, 8};
  std::random_device fresh;
  for (int i = 0; i < 3; ++i) seeds.push_back(fresh());
  for (uint32_t seed : seeds) {
    std::mt19937 rng(seed);
    const size_t at = rng() % good_.size();
    const uint8_t mask = static_cast<uint8_t>(1 + rng() % 255);
    SCOPED_TRACE(absl::StrCat("seed ", seed, ": byte ", at, " ^ ", int{mask}));
    std::string bad = good_;
    bad[at] = static_cast<char>(bad[at] ^ mask);
    CheckCorruption(bad, /*at_open=*/at < sections_[0].end(), "");
  }
}

// Opening the directory with another model: every snapshot is refused as another model's, and
// left where it is.
TEST_F(SnapshotStoreCorruptionTest, StoreOfAnotherModelRefusesEverySnapshot) {
  auto other = testing::TinyEngine(/*weight_seed=*/12);
  auto store = Open(other->fingerprint());
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->open_errors().size(), 3u);
  for (const char* id : {"alpha", "omega", "victim"}) {
    const absl::Status s = store->Acquire(id).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "different model")) << s;
    EXPECT_TRUE(QuarantinedCopy(dir_.path(), id).empty()) << id;
    EXPECT_TRUE(std::filesystem::exists(dir_.path() / absl::StrCat(id, ".sdmstate"))) << id;
  }
}

// A server started once with the wrong model, then with the right one, serves every session as it
// was, the turns in its delta log included, with nothing for an operator to do. Before, the first
// start quarantined every snapshot with its log: each session was refused until someone moved
// both files of each back by hand.
TEST_F(SnapshotStoreCorruptionTest, AStartWithAnotherModelLeavesEverySessionToItsOwn) {
  const std::vector<int32_t> more = testing::RandomTokens(4, 8);
  ASSERT_NO_FATAL_FAILURE(TurnOnAlpha(more));
  const std::filesystem::path log = dir_.path() / "alpha.sdmlog";
  ASSERT_TRUE(std::filesystem::exists(log));  // the turn, a delta
  const std::string snapshot_bytes = testing::ReadFile(dir_.path() / "alpha.sdmstate");
  const std::string log_bytes = testing::ReadFile(log);
  {
    auto other = testing::TinyEngine(/*weight_seed=*/12);
    auto store = Open(other->fingerprint());
    ASSERT_NE(store, nullptr);
    // What to do, said where the operator looks.
    const std::vector<std::string> errors = store->open_errors();
    EXPECT_TRUE(std::any_of(errors.begin(), errors.end(), [](const std::string& e) {
      return absl::StrContains(e, "alpha.sdmstate") && absl::StrContains(e, "intact");
    })) << absl::StrJoin(errors, "\n");
  }
  EXPECT_EQ(testing::ReadFile(dir_.path() / "alpha.sdmstate"), snapshot_bytes);
  EXPECT_EQ(testing::ReadFile(log), log_bytes);
  ExpectAlphaHas(more);
  auto store = Open();
  ASSERT_NE(store, nullptr);
  EXPECT_TRUE(store->open_errors().empty());
  for (const char* id : {"omega", "victim"}) {
    auto lease = store->Acquire(id);
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(lease->state().position(), static_cast<int64_t>(refs_[id].prompt.size()));
  }
}

// A damaged snapshot quarantined at Open takes its delta log with it. Left in the directory, the
// next Open, finding a log without its snapshot, would remove it: an operator who repairs the
// snapshot (from a backup, say) and moves it back would have lost every turn written since.
// Moved back together, the session restores with its turn.
TEST_F(SnapshotStoreCorruptionTest, ALogGoesToQuarantineWithItsSnapshot) {
  const std::vector<int32_t> more = testing::RandomTokens(4, 8);
  ASSERT_NO_FATAL_FAILURE(TurnOnAlpha(more));
  const std::filesystem::path log = dir_.path() / "alpha.sdmlog";
  ASSERT_TRUE(std::filesystem::exists(log));  // the turn, a delta
  const std::string intact = testing::ReadFile(dir_.path() / "alpha.sdmstate");
  DamageAlphasRecord();
  {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    EXPECT_EQ(store->Acquire("alpha").status().code(), absl::StatusCode::kDataLoss);
  }
  EXPECT_FALSE(std::filesystem::exists(log));
  const std::filesystem::path kept_log = QuarantinedCopy(dir_.path(), "alpha", ".sdmlog");
  const std::filesystem::path kept_snapshot = QuarantinedCopy(dir_.path(), "alpha");
  ASSERT_FALSE(kept_log.empty());
  ASSERT_FALSE(kept_snapshot.empty());
  // The operator puts back a sound snapshot and the log: the session is as it was, its last turn
  // included.
  testing::WriteFile(dir_.path() / "alpha.sdmstate", intact);
  std::filesystem::rename(kept_log, log);
  ExpectAlphaHas(more);
}

// When the snapshot cannot be moved to quarantine (the rename fails), its log stays with it:
// moved alone, the next Open would load the snapshot without the turns the log holds.
TEST_F(SnapshotStoreCorruptionTest, ALogStaysWhenItsSnapshotCannotBeQuarantined) {
  const std::vector<int32_t> more = testing::RandomTokens(3, 9);
  ASSERT_NO_FATAL_FAILURE(TurnOnAlpha(more));
  ASSERT_TRUE(std::filesystem::exists(dir_.path() / "alpha.sdmlog"));
  const std::string intact = testing::ReadFile(dir_.path() / "alpha.sdmstate");
  DamageAlphasRecord();
  {
    testing::FaultInjectionFiles files;
    files.FailRename();  // the first: alpha's snapshot (sorted first; its log is skipped)
    ASSERT_NE(Open(0, &files), nullptr);
    EXPECT_EQ(files.faults_fired(), 1);
  }
  EXPECT_TRUE(std::filesystem::exists(dir_.path() / "alpha.sdmstate"));
  EXPECT_TRUE(std::filesystem::exists(dir_.path() / "alpha.sdmlog"));
  testing::WriteFile(dir_.path() / "alpha.sdmstate", intact);  // repaired where it is
  ExpectAlphaHas(more);
}

// A damaged log quarantines its session; when the snapshot cannot be moved, the log stays with
// it. Before, the log was moved first, on its own: with the snapshot's move failing, the next
// Open loaded the snapshot without the turns the log held, and said nothing.
TEST_F(SnapshotStoreCorruptionTest, ADamagedLogStaysWhenItsSnapshotCannotBeQuarantined) {
  ASSERT_NO_FATAL_FAILURE(TurnOnAlpha(testing::RandomTokens(3, 11)));
  ASSERT_NO_FATAL_FAILURE(TurnOnAlpha(testing::RandomTokens(3, 12)));  // a second record
  const std::filesystem::path log = dir_.path() / "alpha.sdmlog";
  std::string damaged = testing::ReadFile(log);
  damaged[kLogHeaderBytes] ^= 0x20;  // the first record's size: damage, found at Open
  testing::WriteFile(log, damaged);
  {
    testing::FaultInjectionFiles files;
    files.FailRename();  // the first
    auto store = Open(0, &files);
    ASSERT_NE(store, nullptr);
    EXPECT_EQ(files.faults_fired(), 1);  // at Open
    EXPECT_EQ(store->Acquire("alpha").status().code(), absl::StatusCode::kDataLoss);
  }
  EXPECT_TRUE(std::filesystem::exists(dir_.path() / "alpha.sdmstate"));
  EXPECT_EQ(testing::ReadFile(log), damaged);
}

// A crash between the two moves of a quarantine (the snapshot's, then its log's) leaves the log
// without its snapshot: the next Open moves it beside the quarantined snapshot. Before, it was
// taken for the log of a deleted session and removed, with every turn it held.
TEST_F(SnapshotStoreCorruptionTest, ACrashBetweenTheTwoMovesOfAQuarantineKeepsTheLog) {
  ASSERT_NO_FATAL_FAILURE(TurnOnAlpha(testing::RandomTokens(4, 13)));
  const std::filesystem::path log = dir_.path() / "alpha.sdmlog";
  const std::string log_bytes = testing::ReadFile(log);
  DamageAlphasRecord();
  {
    testing::FaultInjectionFiles files;
    files.set_crash_at_fault(true);
    files.FailNext(testing::FaultInjectionFiles::Op::kRename,
                   {absl::InternalError("injected: killed"), /*skip=*/1});
    ASSERT_NE(Open(0, &files), nullptr);
    ASSERT_TRUE(files.crashed());
  }
  ASSERT_TRUE(std::filesystem::exists(log));  // what the crash left
  auto store = Open();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->Acquire("alpha").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_FALSE(std::filesystem::exists(log));
  const std::vector<std::filesystem::path> kept =
      QuarantinedCopies(dir_.path(), "alpha", ".sdmlog");
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_EQ(testing::ReadFile(kept[0]), log_bytes);
}

// Damage found at Acquire (a layer's payload): the snapshot goes to quarantine with its log, or,
// when it cannot be moved, neither does. Before, the log was moved whatever became of the
// snapshot.
TEST_F(SnapshotStoreCorruptionTest, ALogStaysWhenItsSnapshotCannotBeQuarantinedAtAcquire) {
  ASSERT_NO_FATAL_FAILURE(TurnOnAlpha(testing::RandomTokens(3, 14)));
  const std::filesystem::path snapshot = dir_.path() / "alpha.sdmstate";
  const std::filesystem::path log = dir_.path() / "alpha.sdmlog";
  std::string damaged = testing::ReadFile(snapshot);
  const std::vector<BlobSection> sections = ParseSections(damaged);
  damaged[sections[1].payload() + 5] ^= 0x40;  // the first layer's payload: found at Acquire
  testing::WriteFile(snapshot, damaged);
  testing::FaultInjectionFiles files;
  auto store = Open(0, &files);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->open_errors().empty());
  files.FailRename();
  EXPECT_EQ(store->Acquire("alpha").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(files.faults_fired(), 1);
  EXPECT_TRUE(std::filesystem::exists(snapshot));
  EXPECT_TRUE(std::filesystem::exists(log));
}

}  // namespace
}  // namespace sdm
