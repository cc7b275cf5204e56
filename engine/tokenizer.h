// Text <-> token ids, as the reference's lingua/tokenizer.py defines them for a model's
// `tokenizer` config (engine/model_config.h):
//   - "bytes": ids 0-255 are the UTF-8 bytes of the text, BOS 256, EOS 257, 258 ids in all.
//   - "sp": a SentencePiece model file, `tokenizer.path` relative to the model directory; ids,
//     BOS and EOS are the SentencePiece model's.
//
// Decode() always returns valid UTF-8: bytes that do not form a character become U+FFFD, one per
// maximal ill-formed subsequence (the Unicode recommendation, and what Python's
// errors="replace" does). The reference's byte tokenizer writes them as "\xNN" escapes instead;
// we do not, because decoded text goes into protobuf strings, which must be valid UTF-8.
//
// IncrementalDetokenizer streams the text of ids as they are generated.
//
// Thread-safety: a Tokenizer is immutable after Create(); all its methods may run concurrently.
// An IncrementalDetokenizer belongs to one stream (one thread at a time).
#ifndef SDMSERVE_ENGINE_TOKENIZER_H_
#define SDMSERVE_ENGINE_TOKENIZER_H_

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/model_config.h"

namespace sdm {

class Tokenizer {
 public:
  // The tokenizer `config` names, its file (if any) read from `model_dir`. Errors: an unknown
  // tokenizer name (InvalidArgument); a missing or unreadable SentencePiece file (NotFound,
  // InvalidArgument), naming the file; for "sp", libsdm_sentencepiece_shim.so cannot be loaded
  // (FailedPrecondition, naming the paths tried; engine/sentencepiece_shim/sentencepiece_shim.h);
  // a model whose vocab_size is smaller than the tokenizer's (InvalidArgument: the model could
  // not embed every id the tokenizer produces).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Create(const ModelConfig& config,
                                                           const std::filesystem::path& model_dir);

  // The byte tokenizer, which needs no file.
  static std::unique_ptr<Tokenizer> CreateByteTokenizer();

  virtual ~Tokenizer() = default;
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // "bytes" or "sp".
  virtual absl::string_view name() const = 0;

  // The ids of `text`, after BOS if `add_bos` (and the tokenizer has a BOS). Never adds EOS.
  virtual std::vector<int32_t> Encode(absl::string_view text, bool add_bos) const = 0;

  // The text of `ids`. Ids that stand for no text (BOS, EOS, other control ids) and ids outside
  // [0, vocab_size()) contribute nothing, as the reference's byte tokenizer skips ids >= 256.
  virtual std::string Decode(std::span<const int32_t> ids) const = 0;

  // The bytes one id stands for where it follows other text (a piece's leading space kept):
  // byte-level, its byte, which may be part of a character; otherwise its text. Empty for ids
  // that stand for no text (as Decode). For a token's own entry in log-probabilities; a text's
  // ids decode with Decode or IncrementalDetokenizer.
  std::string TokenBytes(int32_t id) const;

  // -1 when the tokenizer has no such id (a SentencePiece model trained without it).
  virtual int32_t bos_id() const = 0;
  virtual int32_t eos_id() const = 0;

  // Number of ids the tokenizer uses, [0, vocab_size()). A model may have more (padding).
  virtual int64_t vocab_size() const = 0;

  bool IsValid(int32_t id) const { return id >= 0 && id < vocab_size(); }

 protected:
  Tokenizer() = default;

 private:
  friend class IncrementalDetokenizer;

  // What IncrementalDetokenizer needs. A byte-level tokenizer maps every id to a fixed byte
  // string, so the stream can be cut between any two bytes. Other tokenizers decode a group of
  // ids differently at the start of a text (leading whitespace is dropped) than after text.
  virtual bool byte_level() const = 0;
  // Byte-level only: appends the bytes `id` stands for (none for special or invalid ids).
  virtual void AppendTokenBytes(int32_t id, std::string& out) const {}
  // Not byte-level: the text of `ids` at the start of a text or following text that ended on a
  // complete character.
  virtual std::string DecodeGroup(std::span<const int32_t> ids, bool at_start) const { return {}; }
};

// Turns ids, fed one at a time as they are generated, into text deltas that are each complete,
// valid UTF-8, and whose concatenation (with Flush()) is tokenizer.Decode(all ids fed).
//
// Bytes of a character that is not complete yet are held back until it is; bytes that can no
// longer become a character are emitted as U+FFFD as soon as that is certain (for the byte
// tokenizer, at the first byte that breaks the sequence). For SentencePiece, a delta that would
// end in U+FFFD (a byte-fallback character cut short) is held until the next id or Flush().
//
// `tokenizer` must outlive the detokenizer.
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}

  // Feeds one id; returns the text that became certain (possibly empty).
  std::string Add(int32_t id);

  // Ends the stream: returns the text held back, an incomplete character as U+FFFD. The
  // detokenizer is then ready for a new stream.
  std::string Flush();

 private:
  const Tokenizer& tokenizer_;
  // Byte-level: bytes of an incomplete (so far valid) character, at most 3.
  std::string pending_bytes_;
  // Otherwise: ids fed since the last emitted delta, and whether any text was emitted.
  std::vector<int32_t> pending_ids_;
  bool emitted_text_ = false;
};

// Replaces every maximal ill-formed subsequence of `bytes` by U+FFFD. If `final` is false, an
// incomplete but so far well-formed character at the end is not replaced: it is left in
// `*incomplete_tail` (which must be non-null then) and not appended to the result.
std::string SanitizeUtf8(absl::string_view bytes, bool final, std::string* incomplete_tail);

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_TOKENIZER_H_
