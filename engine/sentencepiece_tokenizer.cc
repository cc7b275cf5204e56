// SentencePiece through libsdm_sentencepiece_shim.so, opened with dlopen(); see
// engine/sentencepiece_shim/sentencepiece_shim.h for why and where the library is looked for.
#include "engine/sentencepiece_tokenizer.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <system_error>
#include <type_traits>
#include <utility>

#include "base/check.h"
#include "engine/sentencepiece_shim/sentencepiece_shim.h"

namespace sdm::internal {
namespace {

// Sanitizer runtimes refuse RTLD_DEEPBIND (ASan aborts the process). Without it the shim still
// loads, but its libsentencepiece then binds protobuf symbols to the process's libprotobuf first:
// in a sanitized binary that also loads libprotobuf, loading a model fails (protobuf's version
// check) or crashes.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

// RTLD_LOCAL: the shim's libsentencepiece and its protobuf 3.14 stay out of the global scope.
// RTLD_DEEPBIND: they bind to their own symbols before the process's libprotobuf 3.21.
// RTLD_NODELETE: dlclose() leaves the code mapped; the bundled protobuf registers shutdown
// callbacks in a list it shares with libprotobuf (a GNU unique symbol), which must not dangle.
constexpr int kDlopenFlags =
    RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE | (kSanitized ? 0 : RTLD_DEEPBIND);

struct DlCloser {
  void operator()(void* handle) const { dlclose(handle); }
};
using DlHandle = std::unique_ptr<void, DlCloser>;

// The text of the last dl* error, or `fallback` if there is none.
std::string DlError(const char* fallback) {
  const char* error = dlerror();
  return error != nullptr ? error : fallback;
}

// Sets `*fn` to the function `name` of `handle`; false and `*error` naming it if it is missing.
template <typename Fn>
bool Resolve(void* handle, const char* name, Fn* fn, std::string* error) {
  dlerror();  // clear
  void* symbol = dlsym(handle, name);
  if (symbol == nullptr) {
    *error = std::string("missing symbol ") + name + " (" + DlError("null symbol") +
             "): not a libsdm_sentencepiece_shim.so of this build";
    return false;
  }
  *fn = reinterpret_cast<Fn>(symbol);
  return true;
}

// Opens the shim at `path` and resolves every function of `*api`; false and `*error` on failure.
bool OpenShim(const std::string& path, DlHandle* handle, SdmSpShimApi* api, std::string* error) {
  DlHandle opened(dlopen(path.c_str(), kDlopenFlags));
  if (opened == nullptr) {
    *error = DlError("dlopen failed");
    return false;
  }
  SdmSpShimApi resolved = {};
  bool ok = true;
  // The field's type must be the declared function's: a renamed or retyped function in the
  // header breaks the build here rather than a call at run time.
#define SDM_SP_RESOLVE(field, function)                                         \
  static_assert(std::is_same_v<decltype(&function), decltype(resolved.field)>); \
  ok = ok && Resolve(opened.get(), #function, &resolved.field, error)
  SDM_SP_RESOLVE(load, sdm_sp_v1_load);
  SDM_SP_RESOLVE(destroy, sdm_sp_v1_destroy);
  SDM_SP_RESOLVE(free, sdm_sp_v1_free);
  SDM_SP_RESOLVE(piece_size, sdm_sp_v1_piece_size);
  SDM_SP_RESOLVE(bos_id, sdm_sp_v1_bos_id);
  SDM_SP_RESOLVE(eos_id, sdm_sp_v1_eos_id);
  SDM_SP_RESOLVE(unk_id, sdm_sp_v1_unk_id);
  SDM_SP_RESOLVE(piece_flags, sdm_sp_v1_piece_flags);
  SDM_SP_RESOLVE(id_to_piece, sdm_sp_v1_id_to_piece);
  SDM_SP_RESOLVE(piece_to_id, sdm_sp_v1_piece_to_id);
  SDM_SP_RESOLVE(encode, sdm_sp_v1_encode);
  SDM_SP_RESOLVE(decode, sdm_sp_v1_decode);
#undef SDM_SP_RESOLVE
  if (!ok) return false;
  *handle = std::move(opened);
  *api = resolved;
  return true;
}

// Where the shim is looked for, in order (sentencepiece_shim.h).
std::vector<std::string> ShimCandidates() {
  const char* override_path = std::getenv(SDM_SP_SHIM_ENV_VAR);
  if (override_path != nullptr && override_path[0] != '\0') return {override_path};
  std::vector<std::string> paths;
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) paths.push_back((exe.parent_path() / SDM_SP_SHIM_FILE_NAME).string());
#ifdef SDM_SENTENCEPIECE_SHIM_BUILD_PATH
  const std::string build_path = SDM_SENTENCEPIECE_SHIM_BUILD_PATH;
  if (paths.empty() || paths.front() != build_path) paths.push_back(build_path);
#endif
  return paths;
}

// Opens the first candidate that loads; false and `*error` naming every path tried otherwise.
bool FindShim(DlHandle* handle, SdmSpShimApi* api, std::string* error) {
  std::string tried;
  for (const std::string& path : ShimCandidates()) {
    std::string reason;
    if (OpenShim(path, handle, api, &reason)) return true;
    // dlerror() texts usually start with the path already.
    if (reason.rfind(path + ": ", 0) == 0) reason.erase(0, path.size() + 2);
    tried += "\n  " + path + ": " + reason;
  }
  *error = std::string("cannot load the SentencePiece shim library " SDM_SP_SHIM_FILE_NAME
                       " (set " SDM_SP_SHIM_ENV_VAR " to its path); tried:") +
           tried;
  return false;
}

// Aborts, printing the shim's reason, when a call that cannot fail on a loaded model failed.
void CheckShimCall(int rc, const char* error, const char* what) {
  SDM_CHECK(rc == 0) << "SentencePiece " << what
                     << " failed: " << (error != nullptr ? error : "(no reason given)");
}

}  // namespace

struct SentencePieceTokenizer::Model {
  // Destroys the processor before the handle closes (members die in reverse order).
  DlHandle handle;
  SdmSpShimApi api = {};
  std::unique_ptr<SdmSpProcessor, SdmSpDestroyFn> processor{nullptr, nullptr};

  // A buffer the shim allocated, released by the shim.
  template <typename T>
  std::unique_ptr<T, SdmSpFreeFn> Own(T* buffer) const {
    return std::unique_ptr<T, SdmSpFreeFn>(buffer, api.free);
  }
};

std::unique_ptr<SentencePieceTokenizer> SentencePieceTokenizer::Load(const std::string& path,
                                                                     LoadError* kind,
                                                                     std::string* error) {
  auto model = std::make_unique<Model>();
  if (!FindShim(&model->handle, &model->api, error)) {
    *kind = LoadError::kShimUnavailable;
    return nullptr;
  }
  char* load_error = nullptr;
  SdmSpProcessor* processor = model->api.load(path.c_str(), &load_error);
  const auto owned_error = model->Own(load_error);
  if (processor == nullptr) {
    *kind = LoadError::kInvalidModel;
    *error = load_error != nullptr ? load_error : "unknown error";
    return nullptr;
  }
  model->processor = {processor, model->api.destroy};
  // The reference asserts this too: ids are exactly [0, GetPieceSize()).
  if (model->api.piece_size(processor) <= 0) {
    *kind = LoadError::kInvalidModel;
    *error = "the model has no pieces";
    return nullptr;
  }
  return std::unique_ptr<SentencePieceTokenizer>(new SentencePieceTokenizer(std::move(model)));
}

SentencePieceTokenizer::SentencePieceTokenizer(std::unique_ptr<const Model> model)
    : model_(std::move(model)) {
  // SentencePiece marks word starts with U+2581; such a piece would itself be stripped.
  constexpr std::string_view kSpaceSymbol = "\xe2\x96\x81";
  constexpr int32_t kSkipped =
      SDM_SP_PIECE_CONTROL | SDM_SP_PIECE_UNKNOWN | SDM_SP_PIECE_UNUSED | SDM_SP_PIECE_BYTE;
  const SdmSpShimApi& api = model_->api;
  const SdmSpProcessor* sp = model_->processor.get();
  for (int32_t id = 0; id < piece_size(); ++id) {
    if ((api.piece_flags(sp, id) & kSkipped) != 0) continue;
    size_t size = 0;
    const char* data = api.id_to_piece(sp, id, &size);
    const std::string_view piece(data, size);
    if (piece.empty() || piece.substr(0, kSpaceSymbol.size()) == kSpaceSymbol) continue;
    std::string text = Decode({id});
    if (text.empty() || text[0] == ' ') continue;
    anchor_id_ = id;
    anchor_text_ = std::move(text);
    break;
  }
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

std::vector<int32_t> SentencePieceTokenizer::Encode(std::string_view text) const {
  int32_t* ids = nullptr;
  size_t count = 0;
  char* error = nullptr;
  // Encoding fails only on an unloaded model, which Load() rules out.
  const int rc =
      model_->api.encode(model_->processor.get(), text.data(), text.size(), &ids, &count, &error);
  const auto owned_ids = model_->Own(ids);
  const auto owned_error = model_->Own(error);
  CheckShimCall(rc, error, "Encode");
  return std::vector<int32_t>(ids, ids + count);
}

std::string SentencePieceTokenizer::Decode(const std::vector<int32_t>& ids) const {
  char* text = nullptr;
  size_t size = 0;
  char* error = nullptr;
  // Decoding fails only on an out-of-range id, which the caller filters out.
  const int rc =
      model_->api.decode(model_->processor.get(), ids.data(), ids.size(), &text, &size, &error);
  const auto owned_text = model_->Own(text);
  const auto owned_error = model_->Own(error);
  CheckShimCall(rc, error, "Decode");
  return std::string(text, size);
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

int32_t SentencePieceTokenizer::piece_size() const {
  return model_->api.piece_size(model_->processor.get());
}
int32_t SentencePieceTokenizer::bos_id() const {
  return model_->api.bos_id(model_->processor.get());
}
int32_t SentencePieceTokenizer::eos_id() const {
  return model_->api.eos_id(model_->processor.get());
}

}  // namespace sdm::internal
