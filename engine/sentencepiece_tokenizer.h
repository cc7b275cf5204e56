// Internal to engine/tokenizer.cc: the boundary around SentencePiece.
//
// SentencePiece itself lives in a separate shared library, libsdm_sentencepiece_shim.so
// (engine/sentencepiece_shim/), which Load() opens with dlopen() (the loader maps it once per
// process): Debian 12's libsentencepiece bundles and exports protobuf 3.14, which must not meet
// the libprotobuf 3.21 of the server in one symbol scope. sentencepiece_shim.h documents where the
// library is looked for. This header, the only interface, uses std types only. Nothing outside
// engine/tokenizer.cc should use it.
//
// Thread-safety: a loaded tokenizer is immutable; Encode/Decode may run concurrently.
#ifndef SDMSERVE_ENGINE_SENTENCEPIECE_TOKENIZER_H_
#define SDMSERVE_ENGINE_SENTENCEPIECE_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace sdm::internal {

class SentencePieceTokenizer {
 public:
  enum class LoadError {
    // libsdm_sentencepiece_shim.so could not be loaded; the error names every path tried.
    kShimUnavailable,
    // The shim loaded but the model did not; the error is SentencePiece's reason.
    kInvalidModel,
  };

  // Loads a serialized SentencePiece model through the shim library. On failure returns null and
  // sets `*kind` and `*error` (the caller adds the model's file name).
  static std::unique_ptr<SentencePieceTokenizer> Load(const std::string& path, LoadError* kind,
                                                      std::string* error);

  ~SentencePieceTokenizer();
  SentencePieceTokenizer(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer& operator=(const SentencePieceTokenizer&) = delete;

  // Piece ids of `text` (no BOS/EOS).
  std::vector<int32_t> Encode(std::string_view text) const;
  // Text of `ids`; every id must be in [0, piece_size()). Control pieces (BOS, EOS) decode to
  // nothing; byte pieces that do not form valid UTF-8 decode to U+FFFD, one per byte.
  std::string Decode(const std::vector<int32_t>& ids) const;
  // Text of `ids` as they decode in the middle of a text: Decode() strips the whitespace that
  // leads a text (SentencePiece's dummy prefix), this does not. Decode(a) followed by
  // DecodeContinuation(b) is Decode(a + b) whenever a ends on a complete character.
  std::string DecodeContinuation(const std::vector<int32_t>& ids) const;

  int32_t piece_size() const;
  int32_t bos_id() const;  // -1 if the model has none
  int32_t eos_id() const;  // -1 if the model has none

 private:
  // The open shim library and the model loaded through it (sentencepiece_tokenizer.cc).
  struct Model;

  explicit SentencePieceTokenizer(std::unique_ptr<const Model> model);

  std::unique_ptr<const Model> model_;
  // A piece whose text is non-empty and starts with no whitespace, and that text: decoding
  // [anchor] + ids and removing the anchor's text decodes ids as a continuation. -1 if the
  // vocabulary has no such piece (then continuations decode like Decode()).
  int32_t anchor_id_ = -1;
  std::string anchor_text_;
};

}  // namespace sdm::internal

#endif  // SDMSERVE_ENGINE_SENTENCEPIECE_TOKENIZER_H_
