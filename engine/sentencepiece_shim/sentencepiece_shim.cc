// libsdm_sentencepiece_shim.so: the C interface of sentencepiece_shim.h over SentencePiece.
//
// The only translation unit that includes SentencePiece's header. That header declares
// `namespace absl { using std::string_view; }`, so this file includes no Abseil header (and
// nothing from the rest of sdmserve): it links libsentencepiece and the C and C++ runtimes only,
// never libprotobuf. Every exported function catches all exceptions.
#include "engine/sentencepiece_shim/sentencepiece_shim.h"

#include <sentencepiece_processor.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

// The processor type the C interface hands out.
struct SdmSpProcessor {
  sentencepiece::SentencePieceProcessor sp;
};

namespace {

// The typedefs the loader uses must match the exported functions.
static_assert(std::is_same_v<decltype(&sdm_sp_v1_load), SdmSpLoadFn>);
static_assert(std::is_same_v<decltype(&sdm_sp_v1_destroy), SdmSpDestroyFn>);
static_assert(std::is_same_v<decltype(&sdm_sp_v1_free), SdmSpFreeFn>);
static_assert(std::is_same_v<decltype(&sdm_sp_v1_piece_size), SdmSpPieceSizeFn>);
static_assert(std::is_same_v<decltype(&sdm_sp_v1_bos_id), SdmSpSpecialIdFn>);
static_assert(std::is_same_v<decltype(&sdm_sp_v1_eos_id), SdmSpSpecialIdFn>);
static_assert(std::is_same_v<decltype(&sdm_sp_v1_unk_id), SdmSpSpecialIdFn>);
static_assert(std::is_same_v<decltype(&sdm_sp_v1_piece_flags), SdmSpPieceFlagsFn>);
static_assert(std::is_same_v<decltype(&sdm_sp_v1_id_to_piece), SdmSpIdToPieceFn>);
static_assert(std::is_same_v<decltype(&sdm_sp_v1_piece_to_id), SdmSpPieceToIdFn>);
static_assert(std::is_same_v<decltype(&sdm_sp_v1_encode), SdmSpEncodeFn>);
static_assert(std::is_same_v<decltype(&sdm_sp_v1_decode), SdmSpDecodeFn>);

// A malloc()ed NUL-terminated copy of `text` (null if out of memory), for sdm_sp_v1_free().
char* CopyToMalloc(std::string_view text) {
  char* copy = static_cast<char*>(std::malloc(text.size() + 1));
  if (copy == nullptr) return nullptr;
  std::memcpy(copy, text.data(), text.size());
  copy[text.size()] = '\0';
  return copy;
}

void SetError(char** error, std::string_view text) {
  if (error != nullptr) *error = CopyToMalloc(text);
}

// The reason of the exception being handled, for the catch-all blocks.
std::string CurrentExceptionText() {
  try {
    throw;
  } catch (const std::exception& e) {
    return std::string("exception in SentencePiece: ") + e.what();
  } catch (...) {
    return "unknown exception in SentencePiece";
  }
}

bool InRange(const SdmSpProcessor* processor, int32_t id) {
  return id >= 0 && id < processor->sp.GetPieceSize();
}

}  // namespace

extern "C" {

SdmSpProcessor* sdm_sp_v1_load(const char* path, char** error) {
  try {
    auto processor = std::make_unique<SdmSpProcessor>();
    const sentencepiece::util::Status status = processor->sp.Load(path);
    if (!status.ok()) {
      SetError(error, status.ToString());
      return nullptr;
    }
    return processor.release();
  } catch (...) {
    SetError(error, CurrentExceptionText());
    return nullptr;
  }
}

void sdm_sp_v1_destroy(SdmSpProcessor* processor) {
  // Owned by the caller since sdm_sp_v1_load released it.
  std::unique_ptr<SdmSpProcessor> owned(processor);
}

void sdm_sp_v1_free(void* buffer) { std::free(buffer); }

int32_t sdm_sp_v1_piece_size(const SdmSpProcessor* processor) {
  return processor->sp.GetPieceSize();
}

int32_t sdm_sp_v1_bos_id(const SdmSpProcessor* processor) { return processor->sp.bos_id(); }

int32_t sdm_sp_v1_eos_id(const SdmSpProcessor* processor) { return processor->sp.eos_id(); }

int32_t sdm_sp_v1_unk_id(const SdmSpProcessor* processor) { return processor->sp.unk_id(); }

int32_t sdm_sp_v1_piece_flags(const SdmSpProcessor* processor, int32_t id) {
  if (!InRange(processor, id)) return 0;
  const sentencepiece::SentencePieceProcessor& sp = processor->sp;
  return (sp.IsControl(id) ? SDM_SP_PIECE_CONTROL : 0) |
         (sp.IsUnknown(id) ? SDM_SP_PIECE_UNKNOWN : 0) |
         (sp.IsUnused(id) ? SDM_SP_PIECE_UNUSED : 0) | (sp.IsByte(id) ? SDM_SP_PIECE_BYTE : 0);
}

const char* sdm_sp_v1_id_to_piece(const SdmSpProcessor* processor, int32_t id, size_t* size) {
  if (!InRange(processor, id)) {
    *size = 0;
    return "";
  }
  // A reference into the model, which lives as long as the processor.
  const std::string& piece = processor->sp.IdToPiece(id);
  *size = piece.size();
  return piece.data();
}

int32_t sdm_sp_v1_piece_to_id(const SdmSpProcessor* processor, const char* piece, size_t size) {
  try {
    return processor->sp.PieceToId(std::string_view(piece, size));
  } catch (...) {
    return processor->sp.unk_id();
  }
}

int sdm_sp_v1_encode(const SdmSpProcessor* processor, const char* text, size_t size, int32_t** ids,
                     size_t* count, char** error) {
  try {
    std::vector<int> pieces;
    const sentencepiece::util::Status status =
        processor->sp.Encode(std::string_view(text, size), &pieces);
    if (!status.ok()) {
      SetError(error, status.ToString());
      return -1;
    }
    *ids = nullptr;
    *count = pieces.size();
    if (pieces.empty()) return 0;
    *ids = static_cast<int32_t*>(std::malloc(pieces.size() * sizeof(int32_t)));
    if (*ids == nullptr) throw std::bad_alloc();
    for (size_t i = 0; i < pieces.size(); ++i) (*ids)[i] = pieces[i];
    return 0;
  } catch (...) {
    SetError(error, CurrentExceptionText());
    return -1;
  }
}

int sdm_sp_v1_decode(const SdmSpProcessor* processor, const int32_t* ids, size_t count, char** text,
                     size_t* size, char** error) {
  try {
    const std::vector<int> pieces(ids, ids + count);
    std::string decoded;
    const sentencepiece::util::Status status = processor->sp.Decode(pieces, &decoded);
    if (!status.ok()) {
      SetError(error, status.ToString());
      return -1;
    }
    *text = CopyToMalloc(decoded);
    if (*text == nullptr) throw std::bad_alloc();
    *size = decoded.size();
    return 0;
  } catch (...) {
    SetError(error, CurrentExceptionText());
    return -1;
  }
}

}  // extern "C"
