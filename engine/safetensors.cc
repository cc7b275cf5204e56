#include "engine/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/json_parse.h"
#include "common/json_snippet.h"
#include "nlohmann/json.hpp"

namespace sdm {
namespace {

using json = nlohmann::json;

absl::Status Bad(absl::string_view label, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(label, ": ", message));
}

absl::Status Truncated(absl::string_view label, absl::string_view message) {
  return absl::DataLossError(absl::StrCat(label, ": ", message));
}

// A JSON integer in [0, 2^62] (so sums and products of two never overflow int64 checks below).
bool GetCount(const json& j, int64_t& out) {
  constexpr uint64_t kMax = uint64_t{1} << 62;
  if (j.is_number_unsigned()) {
    const uint64_t v = j.get<uint64_t>();
    if (v > kMax) return false;
    out = static_cast<int64_t>(v);
    return true;
  }
  if (j.is_number_integer()) {
    const int64_t v = j.get<int64_t>();
    if (v < 0) return false;
    out = v;
    return true;
  }
  return false;
}

absl::StatusOr<TensorDtype> ParseDtype(absl::string_view label, const std::string& name,
                                       const json& j) {
  if (j.is_string()) {
    const std::string s = j.get<std::string>();
    if (s == "F32") return TensorDtype::kF32;
    if (s == "BF16") return TensorDtype::kBF16;
  }
  return Bad(label, absl::StrCat("tensor '", name, "': unsupported dtype ", JsonSnippet(j),
                                 " (supported: F32, BF16)"));
}

absl::Status ParseEntry(absl::string_view label, const std::string& name, const json& j,
                        SafetensorsEntry& e) {
  const std::string what = absl::StrCat("tensor '", name, "'");
  if (!j.is_object()) {
    return Bad(label, absl::StrCat(what, ": entry is not an object: ", JsonSnippet(j)));
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!j.contains(field)) return Bad(label, absl::StrCat(what, ": missing field '", field, "'"));
  }
  for (const auto& [key, unused] : j.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return Bad(label, absl::StrCat(what, ": unknown field '", key, "'"));
    }
  }
  e.name = name;
  auto dtype = ParseDtype(label, name, j["dtype"]);
  if (!dtype.ok()) return dtype.status();
  e.dtype = *dtype;

  const json& shape = j["shape"];
  if (!shape.is_array()) {
    return Bad(label, absl::StrCat(what, ": shape must be a list of non-negative integers, got ",
                                   JsonSnippet(shape)));
  }
  int64_t numel = 1;
  for (const json& d : shape) {
    int64_t dim = 0;
    if (!GetCount(d, dim)) {
      return Bad(label, absl::StrCat(what, ": shape must be a list of non-negative integers, got ",
                                     JsonSnippet(shape)));
    }
    e.shape.push_back(dim);
    if (__builtin_mul_overflow(numel, dim, &numel) || numel > (int64_t{1} << 60)) {
      return Bad(label, absl::StrCat(what, ": shape ", JsonSnippet(shape), " overflows"));
    }
  }
  e.num_elements = numel;

  const json& offsets = j["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !GetCount(offsets[0], e.begin) ||
      !GetCount(offsets[1], e.end)) {
    return Bad(label, absl::StrCat(what, ": data_offsets must be two integers in [0, 2^62], got ",
                                   JsonSnippet(offsets)));
  }
  if (e.begin > e.end) {
    return Bad(label,
               absl::StrCat(what, ": data_offsets [", e.begin, ", ", e.end, "] have begin > end"));
  }
  const int64_t expected = numel * TensorDtypeSize(e.dtype);
  if (e.end - e.begin != expected) {
    return Bad(label, absl::StrCat(what, ": data_offsets [", e.begin, ", ", e.end, "] hold ",
                                   e.end - e.begin, " bytes but dtype ", TensorDtypeName(e.dtype),
                                   " with shape ", JsonSnippet(shape), " needs ", expected));
  }
  return absl::OkStatus();
}

// The 8-byte length field: validates it against the file size; returns the header length.
absl::StatusOr<int64_t> CheckLengthField(absl::string_view label, const uint8_t* first8,
                                         int64_t file_size) {
  if (file_size < 8) {
    return Truncated(label, absl::StrCat("file has ", file_size,
                                         " bytes, fewer than the 8-byte header length field "
                                         "(truncated or not a safetensors file)"));
  }
  uint64_t n = 0;
  std::memcpy(&n, first8, sizeof(n));
  if (n > static_cast<uint64_t>(kMaxSafetensorsHeaderBytes)) {
    return Bad(label, absl::StrCat("absurd header length ", n, " (limit ",
                                   kMaxSafetensorsHeaderBytes, " bytes; not a safetensors file?)"));
  }
  if (static_cast<int64_t>(n) > file_size - 8) {
    return Truncated(label, absl::StrCat("header length ", n, " exceeds the ", file_size - 8,
                                         " bytes after the length field (truncated file?)"));
  }
  return static_cast<int64_t>(n);
}

absl::Status ErrnoError(int err, const std::filesystem::path& path, absl::string_view what) {
  return absl::ErrnoToStatus(err, absl::StrCat(path.string(), ": ", what));
}

}  // namespace

absl::string_view TensorDtypeName(TensorDtype dtype) {
  return dtype == TensorDtype::kBF16 ? "BF16" : "F32";
}

int64_t TensorDtypeSize(TensorDtype dtype) { return dtype == TensorDtype::kBF16 ? 2 : 4; }

const SafetensorsEntry* SafetensorsIndex::Find(absl::string_view name) const {
  for (const SafetensorsEntry& e : tensors) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

absl::StatusOr<SafetensorsIndex> ParseSafetensorsHeader(absl::string_view label,
                                                        absl::string_view header_json,
                                                        int64_t file_size) {
  SafetensorsIndex index;
  index.file_size = file_size;
  index.data_offset = 8 + static_cast<int64_t>(header_json.size());
  const int64_t data_size = file_size - index.data_offset;

  // nlohmann keeps the last of duplicate keys silently: a repeated name is refused.
  JsonParse parsed =
      ParseJsonNoticingDuplicateKeys(std::string_view(header_json.data(), header_json.size()));
  json& header = parsed.value;
  if (header.is_discarded()) return Bad(label, "header is not valid JSON");
  if (!header.is_object()) {
    return Bad(label, absl::StrCat("header must be a JSON object, got ", JsonSnippet(header)));
  }
  if (!parsed.duplicate_key.empty()) {
    return Bad(label, absl::StrCat(parsed.duplicate_depth == 1 ? "duplicate tensor name '"
                                                               : "duplicate key '",
                                   parsed.duplicate_key, "'"));
  }

  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) return Bad(label, "__metadata__ must be an object of strings");
      for (const auto& [key, v] : value.items()) {
        if (!v.is_string()) {
          return Bad(label, absl::StrCat("__metadata__ value of '", key, "' is not a string"));
        }
        index.metadata[key] = v.get<std::string>();
      }
      continue;
    }
    SafetensorsEntry e;
    if (auto s = ParseEntry(label, name, value, e); !s.ok()) return s;
    index.tensors.push_back(std::move(e));
  }

  // Out of range first (a truncated file), then overlaps and holes between sorted ranges.
  for (const SafetensorsEntry& e : index.tensors) {
    if (e.end > data_size) {
      return Truncated(label, absl::StrCat("tensor '", e.name, "': data_offsets [", e.begin, ", ",
                                           e.end, "] out of range: the data region has ", data_size,
                                           " bytes (truncated file?)"));
    }
  }
  std::sort(index.tensors.begin(), index.tensors.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  int64_t covered = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const SafetensorsEntry& e : index.tensors) {
    if (e.begin < covered) {
      return Bad(label, absl::StrCat("tensors '", previous->name, "' [", previous->begin, ", ",
                                     previous->end, "] and '", e.name, "' [", e.begin, ", ", e.end,
                                     "] overlap"));
    }
    if (e.begin > covered) {
      return Bad(label, absl::StrCat("hole of ", e.begin - covered, " unused bytes before tensor '",
                                     e.name, "' (data offsets must cover the data region)"));
    }
    covered = e.end;
    previous = &e;
  }
  if (covered != data_size) {
    return Bad(label, absl::StrCat("hole of ", data_size - covered,
                                   " unused bytes after the last tensor (data offsets must cover "
                                   "the data region)"));
  }
  return index;
}

absl::StatusOr<SafetensorsIndex> ReadSafetensorsIndex(const std::filesystem::path& path) {
  const std::string label = path.string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, path, "cannot open");
  // Reads exactly `size` bytes at `offset`; false on a short read or error.
  auto read_at = [fd](void* out, size_t size, off_t offset) {
    auto* p = static_cast<uint8_t*>(out);
    while (size > 0) {
      const ssize_t n = ::pread(fd, p, size, offset);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      p += n;
      size -= static_cast<size_t>(n);
      offset += n;
    }
    return true;
  };
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoError(errno, path, "cannot stat");
  if (!S_ISREG(st.st_mode)) return absl::FailedPreconditionError(label + ": not a regular file");
  const int64_t file_size = st.st_size;
  uint8_t first8[8] = {};
  if (file_size >= 8 && !read_at(first8, 8, 0)) return ErrnoError(errno, path, "cannot read");
  auto n = CheckLengthField(label, first8, file_size);
  if (!n.ok()) return n.status();
  std::string header(static_cast<size_t>(*n), '\0');
  if (!read_at(header.data(), header.size(), 8)) return ErrnoError(errno, path, "cannot read");
  return ParseSafetensorsHeader(label, header, file_size);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(
    const std::filesystem::path& path) {
  auto file = MappedFile::Open(path);
  if (!file.ok()) return file.status();
  const std::span<const uint8_t> bytes = (*file)->bytes();
  const int64_t size = static_cast<int64_t>(bytes.size());
  auto n = CheckLengthField(path.string(), bytes.data(), size);
  if (!n.ok()) return n.status();
  const absl::string_view header(reinterpret_cast<const char*>(bytes.data()) + 8,
                                 static_cast<size_t>(*n));
  auto index = ParseSafetensorsHeader(path.string(), header, size);
  if (!index.ok()) return index.status();
  return std::unique_ptr<SafetensorsFile>(new SafetensorsFile(*std::move(file), *std::move(index)));
}

TensorView SafetensorsFile::Find(absl::string_view name) const {
  const SafetensorsEntry* e = index_.Find(name);
  if (e == nullptr) return TensorView{nullptr, {}};
  return View(*e);
}

TensorView SafetensorsFile::View(const SafetensorsEntry& e) const {
  const std::span<const uint8_t> bytes = file_->bytes();
  return TensorView{&e, bytes.subspan(static_cast<size_t>(index_.data_offset + e.begin),
                                      static_cast<size_t>(e.end - e.begin))};
}

// ---- Writer ----

SafetensorsWriter::SafetensorsWriter(std::filesystem::path path, std::vector<TensorDecl> tensors)
    : path_(std::move(path)), tensors_(std::move(tensors)) {
  tmp_path_ = path_;
  tmp_path_ += ".tmp";
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::filesystem::path& path, std::vector<TensorDecl> tensors,
    const std::map<std::string, std::string>& metadata) {
  const std::string label = path.string();
  // Header in declaration order (ordered_json) with offsets in the same order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  std::vector<int64_t> elements;
  int64_t offset = 0;
  for (const TensorDecl& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__") {
      return absl::InvalidArgumentError(
          absl::StrCat(label, ": invalid tensor name '", t.name, "'"));
    }
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(label, ": duplicate tensor name '", t.name, "'"));
    }
    int64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0 || __builtin_mul_overflow(numel, d, &numel) || numel > (int64_t{1} << 60)) {
        return absl::InvalidArgumentError(
            absl::StrCat(label, ": tensor '", t.name, "' has an invalid shape"));
      }
    }
    elements.push_back(numel);
    const int64_t bytes = numel * TensorDtypeSize(t.dtype);
    header[t.name] = {{"dtype", std::string(TensorDtypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  // Pad with spaces (valid JSON whitespace) so the data region starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');

  std::unique_ptr<SafetensorsWriter> w(new SafetensorsWriter(path, std::move(tensors)));
  w->elements_ = std::move(elements);
  w->data_offset_ = 8 + static_cast<int64_t>(text.size());
  w->data_bytes_total_ = offset;
  w->fd_ = ::open(w->tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd_ < 0) return ErrnoError(errno, w->tmp_path_, "cannot create");
  uint8_t length[8];
  const uint64_t n = text.size();
  std::memcpy(length, &n, sizeof(length));
  if (auto s = w->WriteAll(length, sizeof(length)); !s.ok()) return s;
  if (auto s = w->WriteAll(reinterpret_cast<const uint8_t*>(text.data()), text.size()); !s.ok()) {
    return s;
  }
  w->SkipEmptyTensors();
  return w;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_) {
    std::error_code ignored;
    std::filesystem::remove(tmp_path_, ignored);
  }
}

const TensorDecl* SafetensorsWriter::current_tensor() const {
  return current_ < tensors_.size() ? &tensors_[current_] : nullptr;
}

void SafetensorsWriter::SkipEmptyTensors() {
  while (current_ < tensors_.size() && written_in_current_ == elements_[current_]) {
    ++current_;
    written_in_current_ = 0;
  }
}

absl::Status SafetensorsWriter::WriteAll(const uint8_t* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd_, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      failed_ = true;
      return ErrnoError(errno, tmp_path_, "write failed");
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Append(std::span<const float> values) {
  if (failed_ || finished_ || fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_.string(), ": writer is finished or failed"));
  }
  if (values.empty()) return absl::OkStatus();
  if (current_ >= tensors_.size()) {
    failed_ = true;
    return absl::FailedPreconditionError(
        absl::StrCat(path_.string(), ": Append after the last tensor is complete"));
  }
  const TensorDecl& t = tensors_[current_];
  const int64_t remaining = elements_[current_] - written_in_current_;
  if (static_cast<int64_t>(values.size()) > remaining) {
    failed_ = true;
    return absl::FailedPreconditionError(absl::StrCat(path_.string(), ": ", values.size(),
                                                      " values for tensor '", t.name,
                                                      "' which has only ", remaining, " left"));
  }
  // Converts and writes in bounded pieces so the staging buffer stays small.
  constexpr size_t kPiece = size_t{1} << 18;
  for (size_t start = 0; start < values.size(); start += kPiece) {
    const std::span<const float> piece =
        values.subspan(start, std::min(kPiece, values.size() - start));
    if (t.dtype == TensorDtype::kF32) {
      if (auto s = WriteAll(reinterpret_cast<const uint8_t*>(piece.data()), piece.size_bytes());
          !s.ok()) {
        return s;
      }
    } else {
      staging_.resize(piece.size() * 2);
      for (size_t i = 0; i < piece.size(); ++i) {
        const uint16_t b = FloatToBf16(piece[i]);
        std::memcpy(&staging_[2 * i], &b, 2);
      }
      if (auto s = WriteAll(staging_.data(), staging_.size()); !s.ok()) return s;
    }
  }
  written_in_current_ += static_cast<int64_t>(values.size());
  data_bytes_written_ += static_cast<int64_t>(values.size()) * TensorDtypeSize(t.dtype);
  SkipEmptyTensors();
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Finish() {
  if (failed_ || finished_ || fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_.string(), ": writer is finished or failed"));
  }
  if (current_ < tensors_.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_.string(), ": tensor '", tensors_[current_].name, "' has ",
                     written_in_current_, " of ", elements_[current_], " values"));
  }
  if (::fsync(fd_) != 0) {
    failed_ = true;
    return ErrnoError(errno, tmp_path_, "fsync failed");
  }
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    failed_ = true;
    return ErrnoError(errno, tmp_path_, "close failed");
  }
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    failed_ = true;
    return ErrnoError(errno, path_, "cannot rename the temporary file onto it");
  }
  finished_ = true;
  // Makes the rename durable.
  std::filesystem::path dir = path_.parent_path();
  if (dir.empty()) dir = ".";
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    const int rc = ::fsync(dir_fd);
    const int err = errno;
    ::close(dir_fd);
    if (rc != 0) return ErrnoError(err, dir, "fsync of the directory failed");
  }
  return absl::OkStatus();
}

}  // namespace sdm
