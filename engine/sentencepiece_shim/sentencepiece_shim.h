/* The C interface of libsdm_sentencepiece_shim.so, the only code in sdmserve that links
 * SentencePiece.
 *
 * Why a shim: Debian 12's libsentencepiece.so.0 (0.1.97) bundles protobuf-lite 3.14 and exports
 * its symbols. A process that also loads libprotobuf.so 3.21 (the gRPC server, anything linking
 * sdm_proto) dies at start-up, whichever loads first: a segfault in descriptor registration or
 * protobuf's version-check abort. So nothing links libsentencepiece directly; the engine
 * (engine/sentencepiece_tokenizer.cc) opens this library at run time with
 * dlopen(RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND | RTLD_NODELETE): RTLD_LOCAL keeps the bundled
 * protobuf out of the global symbol scope, RTLD_DEEPBIND makes libsentencepiece bind to its own
 * protobuf copy before the process's, and RTLD_NODELETE keeps the code mapped after dlclose()
 * (protobuf registers shutdown callbacks in a process-wide list the two copies share).
 *
 * Where the engine looks for the library, first match wins:
 *   1. $SDM_SENTENCEPIECE_SHIM, when set and non-empty: the path of the library. It is then the
 *      only candidate (a wrong override is an error, never silently replaced).
 *   2. libsdm_sentencepiece_shim.so in the directory of the running executable
 *      (/proc/self/exe): how a deployment ships it, next to the binaries.
 *   3. The path CMake built it at ($<TARGET_FILE:sdm_sentencepiece_shim>, compiled into the
 *      engine as SDM_SENTENCEPIECE_SHIM_BUILD_PATH): how every executable of a build tree (tools,
 *      tests, server) finds it without copies. sdm_engine depends on the shim target, so building
 *      any executable builds the shim too.
 * cmake --install puts the shim next to the installed binaries (<prefix>/bin), so an installed
 * binary finds it by rule 2. If no candidate loads, creating an "sp" tokenizer fails with
 * FailedPrecondition naming every path tried; the "bytes" tokenizer never loads the shim.
 *
 * Interface rules: every symbol name carries the interface version (sdm_sp_v1_...), so a shim
 * of another version fails symbol lookup with a message naming the symbol instead of being
 * called with the wrong signature. Nothing allocated on one side is freed on the other: buffers
 * and error strings the shim returns are malloc()ed by the shim and released with
 * sdm_sp_v1_free(); processors with sdm_sp_v1_destroy(). No C++ exception crosses the boundary.
 * A loaded processor is immutable: every function taking a const processor may run
 * concurrently. */
#ifndef SDMSERVE_ENGINE_SENTENCEPIECE_SHIM_SENTENCEPIECE_SHIM_H_
#define SDMSERVE_ENGINE_SENTENCEPIECE_SHIM_SENTENCEPIECE_SHIM_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* File name of the library (CMake's OUTPUT_NAME plus prefix and suffix). */
#define SDM_SP_SHIM_FILE_NAME "libsdm_sentencepiece_shim.so"
/* Environment variable that overrides the library's path. */
#define SDM_SP_SHIM_ENV_VAR "SDM_SENTENCEPIECE_SHIM"

#if defined(SDM_SP_SHIM_BUILDING)
#define SDM_SP_SHIM_EXPORT __attribute__((visibility("default")))
#else
#define SDM_SP_SHIM_EXPORT
#endif

/* A loaded SentencePiece model. */
typedef struct SdmSpProcessor SdmSpProcessor;

/* Bits of sdm_sp_v1_piece_flags(). */
#define SDM_SP_PIECE_CONTROL 1 /* BOS, EOS, ...: decodes to nothing */
#define SDM_SP_PIECE_UNKNOWN 2
#define SDM_SP_PIECE_UNUSED 4
#define SDM_SP_PIECE_BYTE 8 /* a byte-fallback piece <0xNN> */

/* Loads the serialized model at `path` (NUL-terminated). Returns null on failure and sets
 * `*error` to SentencePiece's reason (free it with sdm_sp_v1_free). */
typedef SdmSpProcessor* (*SdmSpLoadFn)(const char* path, char** error);
/* Frees a processor from sdm_sp_v1_load (null is a no-op). */
typedef void (*SdmSpDestroyFn)(SdmSpProcessor* processor);
/* Frees a buffer or error string the shim returned (null is a no-op). */
typedef void (*SdmSpFreeFn)(void* buffer);
/* Number of pieces: ids are exactly [0, piece_size). */
typedef int32_t (*SdmSpPieceSizeFn)(const SdmSpProcessor* processor);
/* Special ids; -1 when the model has none. */
typedef int32_t (*SdmSpSpecialIdFn)(const SdmSpProcessor* processor);
/* SDM_SP_PIECE_* bits of `id`; 0 for an id out of range. */
typedef int32_t (*SdmSpPieceFlagsFn)(const SdmSpProcessor* processor, int32_t id);
/* The piece text of `id` (not NUL-terminated; valid while the processor lives, do not free);
 * size 0 for an id out of range. */
typedef const char* (*SdmSpIdToPieceFn)(const SdmSpProcessor* processor, int32_t id, size_t* size);
/* The id of the piece `piece` (`size` bytes); the unknown id when there is no such piece. */
typedef int32_t (*SdmSpPieceToIdFn)(const SdmSpProcessor* processor, const char* piece,
                                    size_t size);
/* Piece ids of `text` (`size` bytes; no BOS/EOS). On success returns 0 and sets `*ids` (free it
 * with sdm_sp_v1_free; null when `*count` is 0) and `*count`; on failure returns -1 and sets
 * `*error`. */
typedef int (*SdmSpEncodeFn)(const SdmSpProcessor* processor, const char* text, size_t size,
                             int32_t** ids, size_t* count, char** error);
/* Text of `ids` (`count` ids, each in [0, piece_size)). On success returns 0 and sets `*text`
 * (free it with sdm_sp_v1_free; NUL-terminated) and `*size`; on failure returns -1 and sets
 * `*error`. */
typedef int (*SdmSpDecodeFn)(const SdmSpProcessor* processor, const int32_t* ids, size_t count,
                             char** text, size_t* size, char** error);

/* The exported functions; the loader resolves each by the name in its comment. */
SDM_SP_SHIM_EXPORT SdmSpProcessor* sdm_sp_v1_load(const char* path, char** error);
SDM_SP_SHIM_EXPORT void sdm_sp_v1_destroy(SdmSpProcessor* processor);
SDM_SP_SHIM_EXPORT void sdm_sp_v1_free(void* buffer);
SDM_SP_SHIM_EXPORT int32_t sdm_sp_v1_piece_size(const SdmSpProcessor* processor);
SDM_SP_SHIM_EXPORT int32_t sdm_sp_v1_bos_id(const SdmSpProcessor* processor);
SDM_SP_SHIM_EXPORT int32_t sdm_sp_v1_eos_id(const SdmSpProcessor* processor);
SDM_SP_SHIM_EXPORT int32_t sdm_sp_v1_unk_id(const SdmSpProcessor* processor);
SDM_SP_SHIM_EXPORT int32_t sdm_sp_v1_piece_flags(const SdmSpProcessor* processor, int32_t id);
SDM_SP_SHIM_EXPORT const char* sdm_sp_v1_id_to_piece(const SdmSpProcessor* processor, int32_t id,
                                                     size_t* size);
SDM_SP_SHIM_EXPORT int32_t sdm_sp_v1_piece_to_id(const SdmSpProcessor* processor, const char* piece,
                                                 size_t size);
SDM_SP_SHIM_EXPORT int sdm_sp_v1_encode(const SdmSpProcessor* processor, const char* text,
                                        size_t size, int32_t** ids, size_t* count, char** error);
SDM_SP_SHIM_EXPORT int sdm_sp_v1_decode(const SdmSpProcessor* processor, const int32_t* ids,
                                        size_t count, char** text, size_t* size, char** error);

/* The function table the engine fills with dlsym(); see the declarations above. */
typedef struct SdmSpShimApi {
  SdmSpLoadFn load;              /* "sdm_sp_v1_load" */
  SdmSpDestroyFn destroy;        /* "sdm_sp_v1_destroy" */
  SdmSpFreeFn free;              /* "sdm_sp_v1_free" */
  SdmSpPieceSizeFn piece_size;   /* "sdm_sp_v1_piece_size" */
  SdmSpSpecialIdFn bos_id;       /* "sdm_sp_v1_bos_id" */
  SdmSpSpecialIdFn eos_id;       /* "sdm_sp_v1_eos_id" */
  SdmSpSpecialIdFn unk_id;       /* "sdm_sp_v1_unk_id" */
  SdmSpPieceFlagsFn piece_flags; /* "sdm_sp_v1_piece_flags" */
  SdmSpIdToPieceFn id_to_piece;  /* "sdm_sp_v1_id_to_piece" */
  SdmSpPieceToIdFn piece_to_id;  /* "sdm_sp_v1_piece_to_id" */
  SdmSpEncodeFn encode;          /* "sdm_sp_v1_encode" */
  SdmSpDecodeFn decode;          /* "sdm_sp_v1_decode" */
} SdmSpShimApi;

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* SDMSERVE_ENGINE_SENTENCEPIECE_SHIM_SENTENCEPIECE_SHIM_H_ */
