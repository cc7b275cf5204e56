#include "engine/tokenizer.h"

#include <string_view>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/check.h"
#include "engine/sentencepiece_tokenizer.h"

namespace sdm {
namespace {

constexpr absl::string_view kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD

// Length of the well-formed sequence a lead byte starts (0: not a lead byte), and the range its
// second byte must lie in (Unicode Table 3-7: this excludes overlong forms, surrogates and code
// points above U+10FFFF; later bytes are always 80..BF).
struct LeadByte {
  int length;
  uint8_t second_lo;
  uint8_t second_hi;
};

LeadByte ClassifyLead(uint8_t b) {
  if (b < 0x80) return {1, 0, 0};
  if (b < 0xC2) return {0, 0, 0};  // continuation byte or overlong 2-byte lead
  if (b < 0xE0) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b < 0xF0) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b < 0xF4) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};  // F5..FF never occur in UTF-8
}

class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int32_t kBos = 256;
  static constexpr int32_t kEos = 257;
  static constexpr int64_t kVocab = 258;

  absl::string_view name() const override { return "bytes"; }

  std::vector<int32_t> Encode(absl::string_view text, bool add_bos) const override {
    std::vector<int32_t> ids;
    ids.reserve(text.size() + (add_bos ? 1 : 0));
    if (add_bos) ids.push_back(kBos);
    for (const char c : text) ids.push_back(static_cast<uint8_t>(c));
    return ids;
  }

  std::string Decode(std::span<const int32_t> ids) const override {
    std::string bytes;
    bytes.reserve(ids.size());
    for (const int32_t id : ids) AppendTokenBytes(id, bytes);
    return SanitizeUtf8(bytes, /*final=*/true, nullptr);
  }

  int32_t bos_id() const override { return kBos; }
  int32_t eos_id() const override { return kEos; }
  int64_t vocab_size() const override { return kVocab; }

 private:
  bool byte_level() const override { return true; }
  void AppendTokenBytes(int32_t id, std::string& out) const override {
    if (id >= 0 && id < 256) out.push_back(static_cast<char>(id));
  }
};

class SpTokenizer final : public Tokenizer {
 public:
  explicit SpTokenizer(std::unique_ptr<internal::SentencePieceTokenizer> sp) : sp_(std::move(sp)) {}

  absl::string_view name() const override { return "sp"; }

  std::vector<int32_t> Encode(absl::string_view text, bool add_bos) const override {
    std::vector<int32_t> pieces = sp_->Encode(std::string_view(text.data(), text.size()));
    if (!add_bos || bos_id() < 0) return pieces;
    std::vector<int32_t> ids;
    ids.reserve(pieces.size() + 1);
    ids.push_back(bos_id());
    ids.insert(ids.end(), pieces.begin(), pieces.end());
    return ids;
  }

  std::string Decode(std::span<const int32_t> ids) const override {
    return DecodeGroup(ids, /*at_start=*/true);
  }

  int32_t bos_id() const override { return sp_->bos_id(); }
  int32_t eos_id() const override { return sp_->eos_id(); }
  int64_t vocab_size() const override { return sp_->piece_size(); }

 private:
  bool byte_level() const override { return false; }

  std::string DecodeGroup(std::span<const int32_t> ids, bool at_start) const override {
    // SentencePiece rejects the whole call on one out-of-range id; we skip such ids instead.
    std::vector<int32_t> valid;
    valid.reserve(ids.size());
    for (const int32_t id : ids) {
      if (IsValid(id)) valid.push_back(id);
    }
    return at_start ? sp_->Decode(valid) : sp_->DecodeContinuation(valid);
  }

  std::unique_ptr<internal::SentencePieceTokenizer> sp_;
};

absl::StatusOr<std::unique_ptr<Tokenizer>> CreateSentencePiece(
    const ModelConfig& config, const std::filesystem::path& model_dir) {
  if (config.tokenizer.path.empty()) {
    return absl::InvalidArgumentError(
        "tokenizer.path is empty: a \"sp\" tokenizer needs its SentencePiece model file, "
        "relative to the model directory");
  }
  const std::filesystem::path path = model_dir / config.tokenizer.path;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return absl::NotFoundError(absl::StrCat("SentencePiece model file ", path.string(),
                                            " (tokenizer.path) does not exist or is not a file"));
  }
  internal::SentencePieceTokenizer::LoadError kind =
      internal::SentencePieceTokenizer::LoadError::kInvalidModel;
  std::string error;
  std::unique_ptr<internal::SentencePieceTokenizer> sp =
      internal::SentencePieceTokenizer::Load(path.string(), &kind, &error);
  if (sp == nullptr && kind == internal::SentencePieceTokenizer::LoadError::kShimUnavailable) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot load SentencePiece model file ", path.string(), ": ", error));
  }
  if (sp == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot load SentencePiece model file ",
                                                   path.string(), " (corrupt?): ", error));
  }
  return std::make_unique<SpTokenizer>(std::move(sp));
}

}  // namespace

std::string SanitizeUtf8(absl::string_view bytes, bool final, std::string* incomplete_tail) {
  SDM_CHECK(final || incomplete_tail != nullptr);
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    const LeadByte lead = ClassifyLead(static_cast<uint8_t>(bytes[i]));
    if (lead.length == 1) {
      out.push_back(bytes[i++]);
      continue;
    }
    if (lead.length == 0) {
      out.append(kReplacementCharacter.data(), kReplacementCharacter.size());
      ++i;
      continue;
    }
    // `valid` counts the bytes of the sequence that are well-formed so far (the lead first).
    int valid = 1;
    while (valid < lead.length && i + valid < bytes.size()) {
      const uint8_t b = static_cast<uint8_t>(bytes[i + valid]);
      const uint8_t lo = valid == 1 ? lead.second_lo : 0x80;
      const uint8_t hi = valid == 1 ? lead.second_hi : 0xBF;
      if (b < lo || b > hi) break;
      ++valid;
    }
    if (valid == lead.length) {
      out.append(bytes.data() + i, valid);
    } else if (i + valid == bytes.size() && !final) {
      // Well-formed so far and cut by the end of the input: more bytes may complete it.
      incomplete_tail->assign(bytes.data() + i, valid);
      return out;
    } else {
      // One U+FFFD for the maximal subpart; the byte that broke it starts the next sequence.
      out.append(kReplacementCharacter.data(), kReplacementCharacter.size());
    }
    i += valid;
  }
  if (incomplete_tail != nullptr) incomplete_tail->clear();
  return out;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Create(
    const ModelConfig& config, const std::filesystem::path& model_dir) {
  std::unique_ptr<Tokenizer> tokenizer;
  if (config.tokenizer.name == "bytes") {
    tokenizer = CreateByteTokenizer();
  } else if (config.tokenizer.name == "sp") {
    absl::StatusOr<std::unique_ptr<Tokenizer>> sp = CreateSentencePiece(config, model_dir);
    if (!sp.ok()) return sp.status();
    tokenizer = *std::move(sp);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown tokenizer.name \"", config.tokenizer.name, "\": expected \"bytes\" or \"sp\""));
  }
  if (config.vocab_size < tokenizer->vocab_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the model's vocab_size ", config.vocab_size, " is smaller than the ",
                     tokenizer->name(), " tokenizer's ", tokenizer->vocab_size(),
                     ": the model has no embedding for some of the tokenizer's ids"));
  }
  return tokenizer;
}

std::unique_ptr<Tokenizer> Tokenizer::CreateByteTokenizer() {
  return std::make_unique<ByteTokenizer>();
}

std::string Tokenizer::TokenBytes(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return "";
  const int32_t ids[] = {id};
  if (!byte_level()) return DecodeGroup(ids, /*at_start=*/false);
  std::string bytes;
  AppendTokenBytes(id, bytes);
  return bytes;
}

std::string IncrementalDetokenizer::Add(int32_t id) {
  if (tokenizer_.byte_level()) {
    tokenizer_.AppendTokenBytes(id, pending_bytes_);
    std::string tail;
    std::string text = SanitizeUtf8(pending_bytes_, /*final=*/false, &tail);
    pending_bytes_ = std::move(tail);
    return text;
  }
  // Decode every id since the last emitted delta as one group: a piece's text may depend on its
  // neighbours (byte-fallback pieces form characters together; leading whitespace of the whole
  // text is dropped), and a group that ends on a complete character decodes independently of
  // what follows.
  pending_ids_.push_back(id);
  std::string text = tokenizer_.DecodeGroup(pending_ids_, /*at_start=*/!emitted_text_);
  if (text.empty() || absl::EndsWith(text, kReplacementCharacter)) return {};
  pending_ids_.clear();
  emitted_text_ = true;
  return text;
}

std::string IncrementalDetokenizer::Flush() {
  std::string text;
  if (tokenizer_.byte_level()) {
    text = SanitizeUtf8(pending_bytes_, /*final=*/true, nullptr);
    pending_bytes_.clear();
  } else if (!pending_ids_.empty()) {
    text = tokenizer_.DecodeGroup(pending_ids_, /*at_start=*/!emitted_text_);
    pending_ids_.clear();
  }
  emitted_text_ = false;
  return text;
}

}  // namespace sdm
