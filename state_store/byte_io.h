// Little-endian byte writer and bounds-checked reader shared by the session state's encodings
// (state_store/state_codec.cc, state_store/state_log.cc; docs/state-format.md). Internal to
// state_store.
#ifndef SDMSERVE_STATE_STORE_BYTE_IO_H_
#define SDMSERVE_STATE_STORE_BYTE_IO_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/check.h"
#include "state_store/byte_source.h"
#include "xxhash.h"

namespace sdm::internal_state {

class Writer {
 public:
  void U32(uint32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void I64(int64_t v) { Raw(&v, 8); }
  void I32(int32_t v) { Raw(&v, 4); }
  void Str(absl::string_view s) {
    U64(s.size());
    Raw(s.data(), s.size());
  }
  void Floats(const float* p, int64_t n) { Raw(p, n * sizeof(float)); }
  // Appends (one copy, no zero-fill; Reserve() first to avoid regrowing a large buffer).
  void Raw(const void* p, size_t n) {
    if (n) out_.append(static_cast<const char*>(p), n);
  }
  void Reserve(size_t n) { out_.reserve(n); }
  size_t size() const { return out_.size(); }
  // Overwrites n bytes at `at` (< size()): a placeholder written before its value was known.
  void Patch(size_t at, const void* p, size_t n) { std::memcpy(out_.data() + at, p, n); }
  std::string& out() { return out_; }

 private:
  std::string out_;
};

// Feeds a ByteSource::Sink (state_store/byte_source.h): small fields are gathered in a local
// buffer, large spans (rows) are passed as they are, so that encoding copies nothing of the
// state's size. After the sink's first error everything else is dropped; Finish() returns it.
class PieceWriter {
 public:
  explicit PieceWriter(ByteSource::Sink sink) : sink_(sink) {}
  PieceWriter(const PieceWriter&) = delete;
  PieceWriter& operator=(const PieceWriter&) = delete;

  void U32(uint32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void I64(int64_t v) { Raw(&v, 8); }
  // Copied into the local buffer (or passed on when larger than it).
  void Raw(const void* p, size_t n) {
    if (n > sizeof(buffer_) - used_) {
      Flush();
      if (n > sizeof(buffer_)) return Give(p, n);
    }
    std::memcpy(buffer_ + used_, p, n);
    used_ += n;
  }
  // Passed on as it is: `p` is read before the call returns.
  void Span(const void* p, size_t n) {
    if (n <= kCopyBelow) return Raw(p, n);
    Flush();
    Give(p, n);
  }
  void Floats(const float* p, int64_t n) { Span(p, static_cast<size_t>(n) * sizeof(float)); }
  absl::Status Finish() {
    Flush();
    return status_;
  }

 private:
  // Spans shorter than this are gathered too (a tiny model's 128-byte rows): fewer sink calls.
  static constexpr size_t kCopyBelow = 1024;

  void Flush() {
    if (used_ > 0) Give(buffer_, used_);
    used_ = 0;
  }
  void Give(const void* p, size_t n) {
    if (status_.ok()) status_ = sink_(absl::string_view(static_cast<const char*>(p), n));
  }

  ByteSource::Sink sink_;
  absl::Status status_;
  size_t used_ = 0;
  char buffer_[8192];
};

// The size and XXH64 checksum (seed 0, as the formats use) of what `emit` passes to its sink,
// streamed. With `forward`, each piece is also passed on to it right after it is hashed (while
// it is in the cache): a source's one pass (ByteSource::EmitOnePass) reads each row once for its
// checksum and its copy. Without, the checksum alone: Emit()'s first pass over a section whose
// checksum precedes it on disk. `emit` must not fail on its own; a forward sink's error stops it
// and is returned.
struct HashedBytes {
  uint64_t bytes = 0;
  uint64_t checksum = 0;
};
inline absl::Status EmitHashed(absl::FunctionRef<absl::Status(ByteSource::Sink)> emit,
                               const ByteSource::Sink* forward, HashedBytes& out) {
  XXH64_state_t* hash = XXH64_createState();
  SDM_CHECK(hash != nullptr);
  XXH64_reset(hash, 0);
  out = HashedBytes();
  const absl::Status s = emit([&](absl::string_view piece) {
    XXH64_update(hash, piece.data(), piece.size());
    out.bytes += piece.size();
    return forward != nullptr ? (*forward)(piece) : absl::OkStatus();
  });
  out.checksum = XXH64_digest(hash);
  XXH64_freeState(hash);
  return s;
}
inline HashedBytes HashEmitted(absl::FunctionRef<absl::Status(ByteSource::Sink)> emit) {
  HashedBytes out;
  const absl::Status s = EmitHashed(emit, nullptr, out);
  SDM_CHECK(s.ok()) << s;
  return out;
}

class Reader {
 public:
  Reader(absl::string_view data, std::string what) : data_(data), what_(std::move(what)) {}
  bool U32(uint32_t& v) { return Raw(&v, 4); }
  bool U64(uint64_t& v) { return Raw(&v, 8); }
  bool I64(int64_t& v) { return Raw(&v, 8); }
  bool I32(int32_t& v) { return Raw(&v, 4); }
  bool Str(std::string& s) {
    uint64_t n = 0;
    if (!U64(n) || n > remaining()) return false;
    s.assign(data_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  // A view of n floats (copied out by the caller; the blob may be unaligned).
  bool Span(uint64_t bytes, absl::string_view& out) {
    if (bytes > remaining()) return false;
    out = data_.substr(pos_, bytes);
    pos_ += bytes;
    return true;
  }
  bool Raw(void* p, size_t n) {
    if (n > remaining()) return false;
    std::memcpy(p, data_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  uint64_t remaining() const { return data_.size() - pos_; }
  absl::Status Truncated() const {
    return absl::DataLossError(absl::StrCat("session state ", what_, " is truncated"));
  }

 private:
  absl::string_view data_;
  size_t pos_ = 0;
  std::string what_;
};

}  // namespace sdm::internal_state

#endif  // SDMSERVE_STATE_STORE_BYTE_IO_H_
