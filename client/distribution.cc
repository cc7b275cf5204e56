#include "client/distribution.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace sdm::client {
namespace {

absl::Status Bad(absl::string_view text, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(
      "'", text, "': ", why, " (expected N, fixed:N, uniform:A:B or normal:MEAN:STD, N >= 1)"));
}

}  // namespace

absl::StatusOr<Distribution> Distribution::Parse(absl::string_view text) {
  const std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  int64_t n = 0;
  if (parts.size() == 1 || (parts.size() == 2 && parts[0] == "fixed")) {
    if (!absl::SimpleAtoi(parts.back(), &n)) return Bad(text, "not an integer");
    if (n < 1) return Bad(text, "the value must be >= 1");
    return Fixed(n);
  }
  if (parts.size() != 3) return Bad(text, "wrong number of parameters");
  if (parts[0] == "uniform") {
    int64_t lo = 0, hi = 0;
    if (!absl::SimpleAtoi(parts[1], &lo) || !absl::SimpleAtoi(parts[2], &hi)) {
      return Bad(text, "bounds must be integers");
    }
    if (lo < 1) return Bad(text, "the lower bound must be >= 1");
    if (lo > hi) return Bad(text, "the lower bound exceeds the upper bound");
    return Distribution(Kind::kUniform, static_cast<double>(lo), static_cast<double>(hi));
  }
  if (parts[0] == "normal") {
    double mean = 0, stddev = 0;
    if (!absl::SimpleAtod(parts[1], &mean) || !absl::SimpleAtod(parts[2], &stddev) ||
        !std::isfinite(mean) || !std::isfinite(stddev)) {
      return Bad(text, "mean and standard deviation must be finite numbers");
    }
    if (mean < 1) return Bad(text, "the mean must be >= 1");
    if (stddev < 0) return Bad(text, "the standard deviation must be >= 0");
    return Distribution(Kind::kNormal, mean, stddev);
  }
  return Bad(text, absl::StrCat("unknown distribution '", parts[0], "'"));
}

int64_t Distribution::Sample(std::mt19937_64& rng) const {
  switch (kind_) {
    case Kind::kFixed:
      return static_cast<int64_t>(a_);
    case Kind::kUniform:
      return std::uniform_int_distribution<int64_t>(static_cast<int64_t>(a_),
                                                    static_cast<int64_t>(b_))(rng);
    case Kind::kNormal: {
      if (b_ == 0) return std::max<int64_t>(1, std::llround(a_));
      const double v = std::normal_distribution<double>(a_, b_)(rng);
      return std::max<int64_t>(1, std::llround(v));
    }
  }
  return 1;
}

double Distribution::Mean() const { return kind_ == Kind::kUniform ? (a_ + b_) / 2 : a_; }

std::string Distribution::ToString() const {
  switch (kind_) {
    case Kind::kFixed:
      return absl::StrCat(static_cast<int64_t>(a_));
    case Kind::kUniform:
      return absl::StrCat("uniform:", static_cast<int64_t>(a_), ":", static_cast<int64_t>(b_));
    case Kind::kNormal:
      return absl::StrFormat("normal:%g:%g", a_, b_);
  }
  return "";
}

}  // namespace sdm::client
