// The safetensors file format (https://github.com/huggingface/safetensors): an 8-byte
// little-endian header length N, N bytes of JSON header, then the data region. The header maps
// each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the
// data region) and may hold "__metadata__": {string: string}.
//
// Reading validates everything before any tensor is used, like the official library: a file too
// short for its header, an absurd header length, JSON that is not an object of well-formed
// entries, an unsupported dtype (only F32 and BF16 are served), shapes with negative dimensions or
// overflowing sizes, offsets that are reversed, out of range, overlapping, leave holes or disagree
// with dtype x shape, and duplicate names. Each error is a Status whose message starts with the
// file name and names the tensor. Truncation (bytes the header promises but the file lacks) is
// DataLoss; every other malformation is InvalidArgument.
//
// Writing streams: the writer is given every (name, dtype, shape) up front, writes the header,
// then takes each tensor's values in declaration order, in fp32 chunks of any size, converting to
// the tensor's dtype on the fly, so a multi-GB model never sits in memory. It writes
// `<path>.tmp` and renames it onto `<path>` in Finish() after fsync; a writer destroyed before
// Finish() removes the temporary file.
#ifndef SDMSERVE_ENGINE_SAFETENSORS_H_
#define SDMSERVE_ENGINE_SAFETENSORS_H_

#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/bf16.h"
#include "engine/mapped_file.h"

namespace sdm {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian and is served in place");

enum class TensorDtype { kF32, kBF16 };

absl::string_view TensorDtypeName(TensorDtype dtype);  // "F32", "BF16"
int64_t TensorDtypeSize(TensorDtype dtype);            // bytes per element

// fp32 <-> bf16 conversions: FloatToBf16 and Bf16ToFloat (base/bf16.h).

// Headers longer than this are rejected as corrupt (the official library's limit).
inline constexpr int64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// One validated header entry.
struct SafetensorsEntry {
  std::string name;
  TensorDtype dtype = TensorDtype::kF32;
  std::vector<int64_t> shape;
  int64_t num_elements = 0;
  int64_t begin = 0;  // byte offsets within the data region, end - begin = num_elements * size
  int64_t end = 0;
};

// A validated header: the entries cover the data region exactly, without overlap.
struct SafetensorsIndex {
  std::vector<SafetensorsEntry> tensors;  // sorted by data offset
  std::map<std::string, std::string> metadata;
  int64_t data_offset = 0;  // 8 + header length: where the data region starts in the file
  int64_t file_size = 0;

  const SafetensorsEntry* Find(absl::string_view name) const;
};

// Validates the header JSON of a file of `file_size` bytes whose header is `header_json`
// (`label`, usually the path, starts every error message).
absl::StatusOr<SafetensorsIndex> ParseSafetensorsHeader(absl::string_view label,
                                                        absl::string_view header_json,
                                                        int64_t file_size);

// Reads and validates only the length field and header of a file; no tensor data is read.
absl::StatusOr<SafetensorsIndex> ReadSafetensorsIndex(const std::filesystem::path& path);

// A tensor of a mapped file: its bytes are the raw little-endian values.
struct TensorView {
  const SafetensorsEntry* entry;
  std::span<const uint8_t> bytes;
};

// A mapped, validated safetensors file.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::filesystem::path& path);

  const SafetensorsIndex& index() const { return index_; }
  const std::filesystem::path& path() const { return file_->path(); }

  // nullopt-like: a view with entry == nullptr when the file has no tensor `name`.
  TensorView Find(absl::string_view name) const;
  TensorView View(const SafetensorsEntry& entry) const;

 private:
  SafetensorsFile(std::unique_ptr<MappedFile> file, SafetensorsIndex index)
      : file_(std::move(file)), index_(std::move(index)) {}

  std::unique_ptr<MappedFile> file_;
  SafetensorsIndex index_;
};

// A tensor to be written.
struct TensorDecl {
  std::string name;
  TensorDtype dtype = TensorDtype::kF32;
  std::vector<int64_t> shape;
};

class SafetensorsWriter {
 public:
  // Creates `<path>.tmp` and writes the header. Names must be unique, non-empty and not
  // "__metadata__"; dimensions non-negative.
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      const std::filesystem::path& path, std::vector<TensorDecl> tensors,
      const std::map<std::string, std::string>& metadata = {});

  ~SafetensorsWriter();  // removes the temporary file unless Finish() succeeded
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // The next values of the current tensor (declaration order; tensors without elements are
  // skipped). A chunk may not run past the end of the current tensor. After an error the writer
  // refuses further calls.
  absl::Status Append(std::span<const float> values);

  // Requires every tensor complete: fsyncs, renames onto the final path, fsyncs the directory.
  absl::Status Finish();

  // The tensor the next Append() continues, or nullptr when all are written.
  const TensorDecl* current_tensor() const;
  int64_t data_bytes_total() const { return data_bytes_total_; }
  int64_t data_bytes_written() const { return data_bytes_written_; }
  int64_t file_size() const { return data_offset_ + data_bytes_total_; }

 private:
  SafetensorsWriter(std::filesystem::path path, std::vector<TensorDecl> tensors);
  absl::Status WriteAll(const uint8_t* data, size_t size);
  void SkipEmptyTensors();

  std::filesystem::path path_;
  std::filesystem::path tmp_path_;
  std::vector<TensorDecl> tensors_;
  std::vector<int64_t> elements_;  // per tensor
  int fd_ = -1;
  size_t current_ = 0;              // index into tensors_
  int64_t written_in_current_ = 0;  // elements
  int64_t data_offset_ = 0;
  int64_t data_bytes_total_ = 0;
  int64_t data_bytes_written_ = 0;
  bool failed_ = false;
  bool finished_ = false;
  std::vector<uint8_t> staging_;  // conversion buffer
};

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_SAFETENSORS_H_
