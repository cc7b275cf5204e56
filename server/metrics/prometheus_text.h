// Pieces of the Prometheus text exposition format 0.0.4
// (https://prometheus.io/docs/instrumenting/exposition_formats/): name rules, escaping and
// number formatting. The registry (metrics.cc) assembles pages from them.
//
// Thread-safety: all functions are pure.
#ifndef SDMSERVE_SERVER_METRICS_PROMETHEUS_TEXT_H_
#define SDMSERVE_SERVER_METRICS_PROMETHEUS_TEXT_H_

#include <string>

#include "absl/strings/string_view.h"

namespace sdm {

// The Content-Type of a page in this format.
inline constexpr char kPrometheusContentType[] = "text/plain; version=0.0.4; charset=utf-8";

// [a-zA-Z_:][a-zA-Z0-9_:]*
bool IsValidMetricName(absl::string_view name);

// [a-zA-Z_][a-zA-Z0-9_]*, and not starting with "__" (reserved for Prometheus itself).
bool IsValidLabelName(absl::string_view name);

// A label value inside double quotes: backslash, double quote and line feed escaped as \\, \"
// and \n.
std::string EscapeLabelValue(absl::string_view value);

// HELP text: backslash and line feed escaped as \\ and \n.
std::string EscapeHelp(absl::string_view help);

// A sample value: "NaN", "+Inf", "-Inf", or the shortest decimal that reads back as the same
// double ("3", "0.25", "1e+21").
std::string FormatSampleValue(double value);

}  // namespace sdm

#endif  // SDMSERVE_SERVER_METRICS_PROMETHEUS_TEXT_H_
