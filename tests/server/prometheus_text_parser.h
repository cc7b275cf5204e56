// A strict parser of the Prometheus text exposition format 0.0.4, written independently of the
// renderer (prometheus-cpp's TextSerializer, through server/metrics/exposition.h) so that tests
// check pages against the format. Stricter than Prometheus itself where our pages must be:
//   - the page is empty or ends with a line feed; no empty lines, no comments other than
//     "# HELP name text" and "# TYPE name type";
//   - every family has HELP, then TYPE, then its samples, contiguously; names are unique;
//   - sample lines are `name{label="value",...} value` (no timestamps); names and label names
//     follow the format's character rules; escapes are only \\, \" and \n (\\ and \n in HELP);
//   - each sample belongs to the family before it: counters and gauges by the same name,
//     histograms by name_bucket (with le), name_sum and name_count (without);
//   - no series appears twice;
//   - histograms: per label set, le values increase and end with "+Inf", bucket counts never
//     decrease, the +Inf bucket equals _count, and _sum and _count are present.
#ifndef SDMSERVE_TESTS_SERVER_PROMETHEUS_TEXT_PARSER_H_
#define SDMSERVE_TESTS_SERVER_PROMETHEUS_TEXT_PARSER_H_

#include <cmath>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace sdm::testing {

struct ParsedSample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct ParsedFamily {
  std::string name;
  std::string help;  // unescaped
  std::string type;
  std::vector<ParsedSample> samples;
};

struct ParsedPage {
  std::vector<ParsedFamily> families;

  const ParsedFamily* Family(const std::string& name) const {
    for (const ParsedFamily& family : families) {
      if (family.name == name) return &family;
    }
    return nullptr;
  }

  // The value of the sample with exactly this name and these labels.
  std::optional<double> Value(const std::string& name,
                              const std::map<std::string, std::string>& labels = {}) const {
    for (const ParsedFamily& family : families) {
      for (const ParsedSample& sample : family.samples) {
        if (sample.name == name && sample.labels == labels) return sample.value;
      }
    }
    return std::nullopt;
  }
};

namespace internal {

inline bool IsMetricNameChar(char c, bool first) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
         (!first && c >= '0' && c <= '9');
}

inline bool IsLabelNameChar(char c, bool first) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
         (!first && c >= '0' && c <= '9');
}

inline bool ValidMetricName(const std::string& name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    if (!IsMetricNameChar(name[i], i == 0)) return false;
  }
  return true;
}

inline bool ParseValue(const std::string& text, double* value) {
  if (text == "NaN") {
    *value = std::nan("");
    return true;
  }
  if (text == "+Inf") {
    *value = INFINITY;
    return true;
  }
  if (text == "-Inf") {
    *value = -INFINITY;
    return true;
  }
  if (text.empty()) return false;
  char* end = nullptr;
  *value = std::strtod(text.c_str(), &end);
  // strtod also reads "inf", "nan" and hex floats, which the format does not use.
  const bool plain = text.find_first_not_of("0123456789.eE+-") == std::string::npos;
  return plain && end == text.c_str() + text.size();
}

// Unescapes `text` allowing the escapes in `allowed` (characters after the backslash).
inline bool Unescape(const std::string& text, const std::string& allowed, std::string* out) {
  out->clear();
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\\') {
      *out += text[i];
      continue;
    }
    if (i + 1 == text.size() || allowed.find(text[i + 1]) == std::string::npos) return false;
    const char c = text[++i];
    *out += c == 'n' ? '\n' : c;
  }
  return true;
}

// Parses `name{a="x",b="y"} value`.
inline bool ParseSampleLine(const std::string& line, ParsedSample* sample, std::string* error) {
  size_t i = 0;
  while (i < line.size() && IsMetricNameChar(line[i], i == 0)) ++i;
  sample->name = line.substr(0, i);
  if (sample->name.empty()) {
    *error = "bad metric name";
    return false;
  }
  if (i < line.size() && line[i] == '{') {
    ++i;
    while (true) {
      // A label must follow '{' and ',': "{}" and trailing commas are rejected here.
      const size_t name_start = i;
      while (i < line.size() && IsLabelNameChar(line[i], i == name_start)) ++i;
      const std::string label = line.substr(name_start, i - name_start);
      if (label.empty() || label.rfind("__", 0) == 0) {
        *error = "bad or missing label name";
        return false;
      }
      if (i + 1 >= line.size() || line[i] != '=' || line[i + 1] != '"') {
        *error = "expected =\" after label name";
        return false;
      }
      i += 2;
      std::string raw;
      while (i < line.size() && line[i] != '"') {
        if (line[i] == '\\' && i + 1 < line.size()) raw += line[i++];
        raw += line[i++];
      }
      if (i == line.size()) {
        *error = "unterminated label value";
        return false;
      }
      ++i;  // closing quote
      std::string value;
      if (!Unescape(raw, "\\\"n", &value)) {
        *error = "bad escape in label value";
        return false;
      }
      if (!sample->labels.emplace(label, value).second) {
        *error = "duplicate label " + label;
        return false;
      }
      if (i < line.size() && line[i] == ',') {
        ++i;
        continue;
      }
      if (i < line.size() && line[i] == '}') {
        ++i;
        break;
      }
      *error = "expected , or } after label value";
      return false;
    }
  }
  if (i >= line.size() || line[i] != ' ') {
    *error = "expected one space before the value";
    return false;
  }
  const std::string value = line.substr(i + 1);
  if (value.find(' ') != std::string::npos) {
    *error = "unexpected timestamp or trailing text";
    return false;
  }
  if (!ParseValue(value, &sample->value)) {
    *error = "bad value '" + value + "'";
    return false;
  }
  return true;
}

inline std::string SeriesKey(const ParsedSample& sample, bool drop_le) {
  std::string key = sample.name;
  for (const auto& [name, value] : sample.labels) {
    if (drop_le && name == "le") continue;
    key += "\x01" + name + "\x02" + value;
  }
  return key;
}

inline bool CheckHistogram(const ParsedFamily& family, std::string* error) {
  struct Series {
    std::vector<std::pair<double, double>> buckets;  // (le, cumulative count)
    std::optional<double> sum, count;
  };
  std::map<std::string, Series> series;  // by label set without le
  for (const ParsedSample& sample : family.samples) {
    ParsedSample base = sample;
    base.name = family.name;
    base.labels.erase("le");
    Series& s = series[SeriesKey(base, false)];
    if (sample.name == family.name + "_bucket") {
      double le = 0;
      if (!ParseValue(sample.labels.at("le"), &le) || std::isnan(le)) {
        *error = family.name + ": bad le";
        return false;
      }
      s.buckets.emplace_back(le, sample.value);
    } else if (sample.name == family.name + "_sum") {
      s.sum = sample.value;
    } else {
      s.count = sample.value;
    }
  }
  for (const auto& [key, s] : series) {
    if (s.buckets.empty() || !s.sum || !s.count) {
      *error = family.name + ": a series lacks buckets, _sum or _count";
      return false;
    }
    for (size_t i = 1; i < s.buckets.size(); ++i) {
      if (!(s.buckets[i - 1].first < s.buckets[i].first)) {
        *error = family.name + ": le values do not increase";
        return false;
      }
      if (s.buckets[i].second < s.buckets[i - 1].second) {
        *error = family.name + ": bucket counts decrease";
        return false;
      }
    }
    if (s.buckets.back().first != INFINITY) {
      *error = family.name + ": the last bucket is not le=\"+Inf\"";
      return false;
    }
    if (s.buckets.back().second != *s.count) {
      *error = family.name + ": the +Inf bucket differs from _count";
      return false;
    }
  }
  return true;
}

}  // namespace internal

// Parses `text`; on failure returns false with `*error` naming the line and the problem.
inline bool ParsePrometheusText(const std::string& text, ParsedPage* page, std::string* error) {
  using namespace internal;
  page->families.clear();
  if (!text.empty() && text.back() != '\n') {
    *error = "the page does not end with a line feed";
    return false;
  }
  std::set<std::string> names, series;
  ParsedFamily* current = nullptr;
  bool expect_type = false;
  size_t start = 0;
  int line_number = 0;
  while (start < text.size()) {
    const size_t end = text.find('\n', start);
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    ++line_number;
    auto fail = [&](const std::string& problem) {
      *error = "line " + std::to_string(line_number) + " '" + line + "': " + problem;
      return false;
    };
    if (line.empty()) return fail("empty line");
    if (line[0] == '#') {
      if (line.rfind("# HELP ", 0) == 0) {
        if (expect_type) return fail("HELP where TYPE was expected");
        const size_t space = line.find(' ', 7);
        if (space == std::string::npos) return fail("HELP without text");
        ParsedFamily family;
        family.name = line.substr(7, space - 7);
        if (!ValidMetricName(family.name)) return fail("bad metric name");
        if (!names.insert(family.name).second) return fail("family given twice");
        if (!Unescape(line.substr(space + 1), "\\n", &family.help)) return fail("bad HELP escape");
        page->families.push_back(std::move(family));
        current = &page->families.back();
        expect_type = true;
        continue;
      }
      if (line.rfind("# TYPE ", 0) == 0) {
        if (!expect_type) return fail("TYPE without HELP just before it");
        const std::string rest = line.substr(7);
        const size_t space = rest.find(' ');
        if (space == std::string::npos || rest.substr(0, space) != current->name) {
          return fail("TYPE for another name than its HELP");
        }
        current->type = rest.substr(space + 1);
        if (current->type != "counter" && current->type != "gauge" &&
            current->type != "histogram") {
          return fail("unknown type");
        }
        expect_type = false;
        continue;
      }
      return fail("comment other than HELP or TYPE");
    }
    if (current == nullptr || expect_type) return fail("sample before its family's HELP and TYPE");
    ParsedSample sample;
    std::string problem;
    if (!ParseSampleLine(line, &sample, &problem)) return fail(problem);
    const bool has_le = sample.labels.count("le") > 0;
    if (current->type == "histogram") {
      if (sample.name == current->name + "_bucket") {
        if (!has_le) return fail("bucket without le");
      } else if (sample.name == current->name + "_sum" || sample.name == current->name + "_count") {
        if (has_le) return fail("le outside a bucket");
      } else {
        return fail("sample outside its histogram family");
      }
    } else if (sample.name != current->name) {
      return fail("sample outside its family");
    }
    if (!series.insert(SeriesKey(sample, false)).second) return fail("series given twice");
    current->samples.push_back(std::move(sample));
  }
  if (expect_type) {
    *error = "the page ends after a HELP line";
    return false;
  }
  for (const ParsedFamily& family : page->families) {
    if (family.type == "histogram" && !CheckHistogram(family, error)) return false;
  }
  return true;
}

}  // namespace sdm::testing

#endif  // SDMSERVE_TESTS_SERVER_PROMETHEUS_TEXT_PARSER_H_
