#include "state_store/byte_source.h"

#include <algorithm>

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

}  // namespace sdm
