// A read-only memory mapping of a whole file (RAII: the mapping and descriptor are released by
// the destructor). Pages are faulted in lazily, so mapping a multi-GB file is cheap and reading
// only its first bytes touches only those pages.
#ifndef SDMSERVE_ENGINE_MAPPED_FILE_H_
#define SDMSERVE_ENGINE_MAPPED_FILE_H_

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>

#include "absl/status/statusor.h"

namespace sdm {

class MappedFile {
 public:
  // Errors (missing file, a directory, permission) name the path; an empty file maps to an
  // empty span.
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::filesystem::path& path);

  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const uint8_t> bytes() const { return {data_, size_}; }
  const std::filesystem::path& path() const { return path_; }

 private:
  MappedFile(std::filesystem::path path, const uint8_t* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}

  std::filesystem::path path_;
  const uint8_t* data_;  // nullptr when size_ == 0
  size_t size_;
};

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_MAPPED_FILE_H_
