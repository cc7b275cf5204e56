#include "state_store/byte_source.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "base/check.h"

namespace sdm {

std::string SourcePrefix(const ByteSource& source, uint64_t n) {
  std::string out;
  n = std::min(n, source.size());
  out.reserve(n);
  // A private status that ends the emission once n bytes are in hand (never returned).
  const absl::Status enough = absl::CancelledError("prefix complete");
  absl::Status s = source.Emit([&](absl::string_view piece) {
    const size_t take = std::min<size_t>(piece.size(), n - out.size());
    out.append(piece.data(), take);
    return out.size() == n ? enough : absl::OkStatus();
  });
  (void)s;  // `enough`, or OK when the source ended first
  return out;
}

std::string SourceBytes(const ByteSource& source) { return SourcePrefix(source, source.size()); }

void AppendOnePass(const ByteSource& source, std::string& out) {
  const size_t start = out.size();
  out.reserve(start + source.size());
  std::vector<ByteSource::Patch> patches;
  const absl::Status s = source.EmitOnePass(
      [&](absl::string_view piece) {
        out.append(piece.data(), piece.size());
        return absl::OkStatus();
      },
      patches);
  SDM_CHECK(s.ok()) << s;
  for (const ByteSource::Patch& p : patches) {
    SDM_CHECK(p.offset <= out.size() - start && out.size() - start - p.offset >= 8)
        << "a patch past the content's end";
    std::memcpy(out.data() + start + p.offset, &p.value, 8);
  }
}

std::string SourceBytesOnePass(const ByteSource& source) {
  std::string out;
  AppendOnePass(source, out);
  return out;
}

}  // namespace sdm
