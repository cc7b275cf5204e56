// The content of a file to write, produced on demand in pieces rather than held in one buffer.
//
// A session's snapshot or delta is tens of MB to GB; encoding it into a buffer of its size before
// writing it made per-turn persistence pay for that buffer's memory on every write (a buffer
// allocated afresh is faulted in page by page, which on the VM this was measured on cost ten times
// the copy itself; docs/benchmarks.md, "Per-turn persistence", 2026-12-05). A ByteSource instead
// hands the bytes to the writer a piece at a time (StateFiles copies them into one reused chunk
// buffer per thread), straight from the session's rows.
//
// Emit() may be called more than once (a prefix is read before the whole is written); each call
// produces the same bytes. A checksum that precedes the bytes it covers (the state formats put
// them in section and record headers) costs Emit() a read of those bytes before it can pass them
// on; EmitOnePass() instead passes zeros in its place and gives the value afterwards, as a Patch,
// so that a writer that can go back (a file) reads the rows once. Thread-safety: both are const
// and safe to call from several threads when the data behind the source does not change meanwhile
// (the caller's contract).
#ifndef SDMSERVE_STATE_STORE_BYTE_SOURCE_H_
#define SDMSERVE_STATE_STORE_BYTE_SOURCE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace sdm {

class ByteSource {
 public:
  // Takes the next piece; a non-OK status stops Emit(), which returns it.
  using Sink = absl::FunctionRef<absl::Status(absl::string_view piece)>;

  virtual ~ByteSource() = default;

  // Bytes Emit() produces in all.
  virtual uint64_t size() const = 0;
  // Passes the content to `sink` in consecutive pieces (any split, empty pieces allowed) whose
  // concatenation is size() bytes; stops at the sink's first error and returns it.
  virtual absl::Status Emit(Sink sink) const = 0;
  // The whole content as one view when the source holds it so (no copy needed), else empty.
  virtual const char* contiguous() const { return nullptr; }

  // An 8-byte little-endian field of the content whose value EmitOnePass() learns only after
  // passing on the bytes it covers.
  struct Patch {
    uint64_t offset = 0;  // from the start of the content
    uint64_t value = 0;
  };
  // The content in one pass over the data behind it: Emit()'s pieces, except that each deferred
  // field is passed as zeros and appended to `patches` (in content order) with its value. The
  // pieces with every patch written over them are Emit()'s bytes. The default has none: Emit().
  virtual absl::Status EmitOnePass(Sink sink, std::vector<Patch>& patches) const {
    (void)patches;
    return Emit(sink);
  }
};

// The content as EmitOnePass() produces it, patches applied (it equals SourceBytes()), appended
// to `out` in place; SDM_CHECK-fails if the source fails (a source that cannot: an encoder).
void AppendOnePass(const ByteSource& source, std::string& out);
std::string SourceBytesOnePass(const ByteSource& source);

// A view of bytes held elsewhere (which must outlive the source).
class StringSource final : public ByteSource {
 public:
  explicit StringSource(absl::string_view data) : data_(data) {}
  uint64_t size() const override { return data_.size(); }
  absl::Status Emit(Sink sink) const override { return sink(data_); }
  const char* contiguous() const override { return data_.data(); }

 private:
  absl::string_view data_;
};

// The first min(n, source.size()) bytes of `source` (Emit stops once they are in hand).
std::string SourcePrefix(const ByteSource& source, uint64_t n);
// All of it.
std::string SourceBytes(const ByteSource& source);

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_BYTE_SOURCE_H_
