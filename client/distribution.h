// Integer distributions of the load generator's prompt and generation lengths.
//
//   N                  always N
//   fixed:N            the same
//   uniform:A:B        uniform over the integers [A, B]
//   normal:MEAN:STD    a normal draw rounded to the nearest integer, clamped to >= 1
//
// Every value is >= 1 (a prompt or a generation has at least one token).
//
// Thread-compatible: a Distribution is an immutable value; Sample() uses the caller's generator.
#ifndef SDMSERVE_CLIENT_DISTRIBUTION_H_
#define SDMSERVE_CLIENT_DISTRIBUTION_H_

#include <cstdint>
#include <random>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace sdm::client {

class Distribution {
 public:
  enum class Kind { kFixed, kUniform, kNormal };

  // INVALID_ARGUMENT names the text and the forms above: an unknown kind, a missing or
  // non-numeric parameter, a value below 1, A > B, a negative or non-finite STD.
  static absl::StatusOr<Distribution> Parse(absl::string_view text);
  static Distribution Fixed(int64_t n) { return Distribution(Kind::kFixed, n, n); }

  Kind kind() const { return kind_; }
  // kFixed: N, N. kUniform: A, B. kNormal: MEAN, STD.
  double a() const { return a_; }
  double b() const { return b_; }

  // One draw (>= 1).
  int64_t Sample(std::mt19937_64& rng) const;
  // The expected value (for kNormal, of the unclamped draw).
  double Mean() const;
  // The canonical text ("64", "uniform:16:64", "normal:128:32"), which Parse() reads back.
  std::string ToString() const;

 private:
  Distribution(Kind kind, double a, double b) : kind_(kind), a_(a), b_(b) {}

  Kind kind_;
  double a_;
  double b_;
};

}  // namespace sdm::client

#endif  // SDMSERVE_CLIENT_DISTRIBUTION_H_
