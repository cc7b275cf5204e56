// libFuzzer target for the tokenizer (engine/tokenizer.h), which sees every prompt's text and
// turns every generated id back into text: any input must give ids or text, never a crash or
// undefined behaviour (built with ASan and UBSan; see scripts/fuzz.sh).
//
// Only the byte tokenizer is fuzzed: the SentencePiece tokenizer is reached through a shim that is
// dlopen'ed with RTLD_DEEPBIND (engine/sentencepiece_shim/sentencepiece_shim.h), which the
// sanitizer runtime refuses to load.
//
// Input: one mode byte, then the bytes. Mode bit 0 clear: the bytes are text. Mode bit 0 set: the
// bytes are token ids (4 bytes each, little-endian, any value including invalid ids).
//
// Properties. Text: Encode gives one id per byte (plus BOS), all valid; Decode(Encode(text)) is
// the text with ill-formed sequences replaced (SanitizeUtf8), which is the text itself when it is
// valid UTF-8; SanitizeUtf8 in two parts (an incomplete tail carried over) equals it in one.
// Ids: Decode gives valid UTF-8, and so does every delta of an IncrementalDetokenizer fed the
// ids one at a time, whose concatenation (with Flush) is Decode(ids).
//
// `tokenizer_fuzzer --write-seeds=DIR` writes a seed corpus to DIR and exits.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using namespace sdm::fuzz;  // NOLINT: the fuzzers' shared helpers

const sdm::Tokenizer& Bytes() {
  static const std::unique_ptr<sdm::Tokenizer> tokenizer = sdm::Tokenizer::CreateByteTokenizer();
  return *tokenizer;
}

bool IsValidUtf8(const std::string& s) {
  std::string tail;
  return sdm::SanitizeUtf8(s, /*final=*/true, nullptr) == s;
}

void CheckText(const std::string& text) {
  const sdm::Tokenizer& t = Bytes();
  for (const bool bos : {false, true}) {
    const std::vector<int32_t> ids = t.Encode(text, bos);
    if (ids.size() != text.size() + (bos && t.bos_id() >= 0 ? 1 : 0)) Fail("one id per byte");
    for (const int32_t id : ids) {
      if (!t.IsValid(id)) Fail("Encode gave an invalid id");
    }
    const std::string decoded = t.Decode(ids);
    const std::string sanitized = sdm::SanitizeUtf8(text, /*final=*/true, nullptr);
    if (decoded != sanitized) Fail("Decode(Encode(text)) is not the sanitized text");
    if (!IsValidUtf8(decoded)) Fail("Decode gave invalid UTF-8");
  }
  if (IsValidUtf8(text) && Bytes().Decode(Bytes().Encode(text, false)) != text) {
    Fail("valid UTF-8 does not round-trip");
  }
  // Two parts, the incomplete tail of the first carried into the second.
  for (const size_t cut : {text.size() / 2, text.size() / 3}) {
    std::string tail;
    std::string first = sdm::SanitizeUtf8(text.substr(0, cut), /*final=*/false, &tail);
    if (tail.size() > 3) Fail("an incomplete tail longer than 3 bytes");
    first += sdm::SanitizeUtf8(tail + text.substr(cut), /*final=*/true, nullptr);
    if (first != sdm::SanitizeUtf8(text, /*final=*/true, nullptr)) {
      Fail("SanitizeUtf8 in two parts differs from one");
    }
  }
}

void CheckIds(const std::string& bytes) {
  std::vector<int32_t> ids(bytes.size() / 4);
  if (!ids.empty()) std::memcpy(ids.data(), bytes.data(), ids.size() * 4);
  const sdm::Tokenizer& t = Bytes();
  const std::string decoded = t.Decode(std::span<const int32_t>(ids));
  if (!IsValidUtf8(decoded)) Fail("Decode gave invalid UTF-8");
  sdm::IncrementalDetokenizer stream(t);
  std::string streamed;
  for (const int32_t id : ids) {
    const std::string delta = stream.Add(id);
    if (!IsValidUtf8(delta)) Fail("a streamed delta is not valid UTF-8");
    streamed += delta;
  }
  const std::string rest = stream.Flush();
  if (!IsValidUtf8(rest)) Fail("the flushed rest is not valid UTF-8");
  streamed += rest;
  if (streamed != decoded) Fail("the streamed text differs from Decode");
}

void Run(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 1) {
    CheckIds(bytes);
  } else {
    CheckText(bytes);
  }
}

std::string IdBytes(const std::vector<int32_t>& ids) {
  std::string out(ids.size() * 4, '\0');
  if (!ids.empty()) std::memcpy(out.data(), ids.data(), out.size());
  return out;
}

int WriteSeeds(const std::filesystem::path& dir) {
  SeedWriter seeds(dir);
  const std::string texts[] = {"hello world",
                               "caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80",
                               "cut \xE6\x97", "bad \xC0\xAF \xED\xA0\x80 \xFF", ""};
  for (const std::string& text : texts) {
    CheckText(text);  // the seeds themselves must pass
    seeds.Add('\0' + text);
    std::vector<int32_t> ids = Bytes().Encode(text, /*add_bos=*/true);
    ids.push_back(Bytes().eos_id());
    ids.push_back(-1);
    ids.push_back(1 << 20);
    CheckIds(IdBytes(ids));
    seeds.Add('\1' + IdBytes(ids));
  }
  return seeds.Finish();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  return sdm::fuzz::InitializeFuzzer(argc, argv, WriteSeeds);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Run(data, size);
  return 0;
}
