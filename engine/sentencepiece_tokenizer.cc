// The only translation unit that includes SentencePiece's header; see
// engine/sentencepiece_tokenizer.h for why it must include no Abseil header.
#include "engine/sentencepiece_tokenizer.h"

#include <sentencepiece_processor.h>

#include <utility>

#include "kernels/common/check.h"

namespace sdm::internal {

std::unique_ptr<SentencePieceTokenizer> SentencePieceTokenizer::Load(const std::string& path,
                                                                     std::string* error) {
  auto sp = std::make_unique<sentencepiece::SentencePieceProcessor>();
  const sentencepiece::util::Status status = sp->Load(path);
  if (!status.ok()) {
    *error = status.ToString();
    return nullptr;
  }
  // The reference asserts this too: ids are exactly [0, GetPieceSize()).
  if (sp->GetPieceSize() <= 0) {
    *error = "the model has no pieces";
    return nullptr;
  }
  return std::unique_ptr<SentencePieceTokenizer>(new SentencePieceTokenizer(std::move(sp)));
}

SentencePieceTokenizer::SentencePieceTokenizer(
    std::unique_ptr<sentencepiece::SentencePieceProcessor> sp)
    : sp_(std::move(sp)) {
  // SentencePiece marks word starts with U+2581; such a piece would itself be stripped.
  constexpr std::string_view kSpaceSymbol = "\xe2\x96\x81";
  for (int id = 0; id < sp_->GetPieceSize(); ++id) {
    if (sp_->IsControl(id) || sp_->IsUnknown(id) || sp_->IsUnused(id) || sp_->IsByte(id)) continue;
    const std::string& piece = sp_->IdToPiece(id);
    if (piece.empty() || std::string_view(piece).substr(0, kSpaceSymbol.size()) == kSpaceSymbol) {
      continue;
    }
    std::string text = Decode({id});
    if (text.empty() || text[0] == ' ') continue;
    anchor_id_ = id;
    anchor_text_ = std::move(text);
    break;
  }
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

std::vector<int32_t> SentencePieceTokenizer::Encode(std::string_view text) const {
  std::vector<int> ids;
  // Encoding fails only on an unloaded model, which Load() rules out.
  const sentencepiece::util::Status status = sp_->Encode(text, &ids);
  SDM_CHECK(status.ok());
  return std::vector<int32_t>(ids.begin(), ids.end());
}

std::string SentencePieceTokenizer::Decode(const std::vector<int32_t>& ids) const {
  std::string text;
  // Decoding fails only on an out-of-range id, which the caller filters out.
  const sentencepiece::util::Status status =
      sp_->Decode(std::vector<int>(ids.begin(), ids.end()), &text);
  SDM_CHECK(status.ok());
  return text;
}

std::string SentencePieceTokenizer::DecodeContinuation(const std::vector<int32_t>& ids) const {
  if (anchor_id_ < 0) return Decode(ids);
  std::vector<int32_t> anchored;
  anchored.reserve(ids.size() + 1);
  anchored.push_back(anchor_id_);
  anchored.insert(anchored.end(), ids.begin(), ids.end());
  std::string text = Decode(anchored);
  // The anchor is a whole character sequence of its own, so its text is a prefix.
  SDM_CHECK(text.compare(0, anchor_text_.size(), anchor_text_) == 0);
  return text.substr(anchor_text_.size());
}

int32_t SentencePieceTokenizer::piece_size() const { return sp_->GetPieceSize(); }
int32_t SentencePieceTokenizer::bos_id() const { return sp_->bos_id(); }
int32_t SentencePieceTokenizer::eos_id() const { return sp_->eos_id(); }

}  // namespace sdm::internal
