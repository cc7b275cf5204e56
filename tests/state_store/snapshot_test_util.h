// Helpers shared by the snapshot tests: a tiny random model, reference continuations computed
// without the store, and byte-level access to encoded session states (docs/state-format.md) for
// crafting damaged ones.
#ifndef SDMSERVE_TESTS_STATE_STORE_SNAPSHOT_TEST_UTIL_H_
#define SDMSERVE_TESTS_STATE_STORE_SNAPSHOT_TEST_UTIL_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "gtest/gtest.h"
#include "state_store/session_state.h"
#include "xxhash.h"

namespace sdm::testing {

// The "tiny" preset (3 sliding-window layers, 1 SDM layer) with a prefill chunk of 8, so the
// sliding-window rings hold 16 rows and wrap within a short prompt.
inline std::unique_ptr<Engine> TinyEngine(uint64_t weight_seed = 11) {
  auto config = PresetConfig("tiny");
  EXPECT_TRUE(config.ok()) << config.status();
  EngineOptions options;
  options.num_threads = 1;
  options.prefill_chunk = 8;
  auto engine = Engine::Create(RandomModel(*config, weight_seed), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return *std::move(engine);
}

inline std::vector<int32_t> RandomTokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> token(0, 255);
  std::vector<int32_t> out(n);
  for (int32_t& t : out) t = token(rng);
  return out;
}

// Feeds `tokens` one at a time as batches of one (the store tests step sessions this way).
inline void DecodeEach(Engine& engine, SessionState& session, const std::vector<int32_t>& tokens) {
  std::vector<float> logits(engine.vocab_size());
  for (int32_t t : tokens) {
    SessionState* batch[] = {&session};
    ASSERT_TRUE(engine.Decode(batch, {&t, 1}, logits).ok());
  }
}

// The logits of feeding `probe` to `session` (which advances it).
inline std::vector<float> ProbeLogits(Engine& engine, SessionState& session, int32_t probe) {
  std::vector<float> logits(engine.vocab_size());
  SessionState* batch[] = {&session};
  EXPECT_TRUE(engine.Decode(batch, {&probe, 1}, logits).ok());
  return logits;
}

// A layout of one full-attention KV layer of `width` floats per row (the huge-claim tests' state:
// hand-made blobs are easy to navigate with a single small section).
inline StateLayout OneKvLayerLayout(int64_t width) {
  StateLayout layout;
  LayerStateLayout kv;
  kv.kind = LayerStateLayout::Kind::kKv;
  kv.kv_row_width = width;
  layout.layers.push_back(kv);
  return layout;
}

// Appends one position to a OneKvLayerLayout state (key row starting 1, value row 2).
inline void AppendKvPosition(SessionState& state) {
  state.kv(0).NextKeyRow()[0] = 1.0f;
  state.kv(0).NextValueRow()[0] = 2.0f;
  state.kv(0).Commit();
  state.AdvancePosition();
}

inline bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---- Byte-level access to an encoded session state ----

inline constexpr size_t kHeaderBytes = 48;
inline constexpr size_t kSectionHeaderBytes = 24;
inline constexpr size_t kVersionOffset = 8;
inline constexpr size_t kFingerprintOffset = 16;
inline constexpr size_t kSectionCountOffset = 24;
inline constexpr size_t kTotalOffset = 32;
inline constexpr size_t kHeaderChecksumOffset = 40;
inline constexpr uint32_t kRecordSection = 1, kKvSection = 2, kSdmSection = 3;

template <typename T>
T LoadAt(const std::string& blob, size_t offset) {
  T v;
  std::memcpy(&v, blob.data() + offset, sizeof(T));
  return v;
}
template <typename T>
void StoreAt(std::string& blob, size_t offset, T v) {
  std::memcpy(blob.data() + offset, &v, sizeof(T));
}

struct BlobSection {
  size_t offset = 0;  // of the section header
  uint32_t type = 0;
  uint64_t size = 0;  // payload bytes
  size_t payload() const { return offset + kSectionHeaderBytes; }
  size_t end() const { return payload() + size; }
};

// The sections of a well-formed blob (as many as fit, for a damaged one).
inline std::vector<BlobSection> ParseSections(const std::string& blob) {
  std::vector<BlobSection> out;
  size_t at = kHeaderBytes;
  while (at + kSectionHeaderBytes <= blob.size()) {
    BlobSection s;
    s.offset = at;
    s.type = LoadAt<uint32_t>(blob, at);
    s.size = LoadAt<uint64_t>(blob, at + 8);
    if (s.size > blob.size() - s.payload()) break;
    out.push_back(s);
    at = s.end();
  }
  return out;
}

// Recomputes every section's checksum and the header's, so that a deliberate edit is caught by
// the decoder's consistency checks rather than by a checksum.
inline void FixChecksums(std::string& blob) {
  for (const BlobSection& s : ParseSections(blob)) {
    StoreAt<uint64_t>(blob, s.offset + 16, XXH64(blob.data() + s.payload(), s.size, 0));
  }
  if (blob.size() >= kHeaderBytes) {
    StoreAt<uint64_t>(blob, kHeaderChecksumOffset, XXH64(blob.data(), 40, 0));
  }
}

// The blob with sections i and j (0 = the record) exchanged, checksums intact.
inline std::string SwapSections(const std::string& blob, size_t i, size_t j) {
  std::vector<BlobSection> sections = ParseSections(blob);
  std::string out = blob.substr(0, kHeaderBytes);
  for (size_t k = 0; k < sections.size(); ++k) {
    const BlobSection& s = sections[k == i ? j : k == j ? i : k];
    out += blob.substr(s.offset, kSectionHeaderBytes + s.size);
  }
  return out;
}

// ---- Byte-level access to a delta log (docs/state-format.md, "Delta log") ----

inline constexpr size_t kLogHeaderSize = 40;
inline constexpr size_t kLogFrameSize = 24;  // version 2: size, payload checksum, size checksum

// The offsets of the records (their frames) of a well-formed log (version 1's frames: 16 bytes).
inline std::vector<size_t> LogRecordOffsets(const std::string& log) {
  std::vector<size_t> out;
  if (log.size() < kLogHeaderSize) return out;
  const size_t frame = LoadAt<uint32_t>(log, 8) == 1 ? 16 : kLogFrameSize;
  for (size_t at = kLogHeaderSize; at + frame <= log.size();) {
    out.push_back(at);
    at += frame + LoadAt<uint64_t>(log, at);
  }
  return out;
}

// A version-2 log as version 1 wrote it: magic "SDMDELTA", version 1, each record framed by its
// size and payload checksum only.
inline std::string ToVersion1Log(const std::string& log) {
  std::string out = log.substr(0, kLogHeaderSize);
  std::memcpy(out.data(), "SDMDELTA", 8);
  StoreAt<uint32_t>(out, 8, 1);
  StoreAt<uint64_t>(out, 32, XXH64(out.data(), 32, 0));
  for (size_t at : LogRecordOffsets(log)) {
    out += log.substr(at, 16);
    out += log.substr(at + kLogFrameSize, LoadAt<uint64_t>(log, at));
  }
  return out;
}

}  // namespace sdm::testing

#endif  // SDMSERVE_TESTS_STATE_STORE_SNAPSHOT_TEST_UTIL_H_
