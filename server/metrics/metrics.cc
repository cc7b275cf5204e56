#include "server/metrics/metrics.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "base/check.h"
#include "server/metrics/prometheus_text.h"

namespace sdm {
namespace {

// Registration errors are programming errors in a constant table: abort, naming the metric.
void CheckRegistration(bool ok, absl::string_view name, const char* problem) {
  SDM_CHECK(ok) << "metric \"" << name << "\": " << problem;
}

class AtomicCounter final : public Counter {
 public:
  void Increment(double delta) override {
    SDM_CHECK(delta >= 0 && std::isfinite(delta));
    value_.fetch_add(delta, std::memory_order_relaxed);
  }
  double Value() const override { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class AtomicGauge final : public Gauge {
 public:
  void Set(double value) override { value_.store(value, std::memory_order_relaxed); }
  void Add(double delta) override { value_.fetch_add(delta, std::memory_order_relaxed); }
  double Value() const override { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class AtomicHistogram final : public Histogram {
 public:
  // `bounds` (owned by the family) must outlive the histogram.
  explicit AtomicHistogram(const std::vector<double>& bounds)
      : bounds_(bounds), buckets_(bounds.size() + 1) {}

  void Observe(double value) override {
    if (std::isnan(value)) return;
    // The first bucket whose bound is >= value (the last one, +Inf, if none).
    const size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
    buckets_[bucket].fetch_add(1, std::memory_order_relaxed);
    sum_.fetch_add(value, std::memory_order_relaxed);
  }

  uint64_t Count() const override {
    uint64_t count = 0;
    for (const std::atomic<uint64_t>& bucket : buckets_) {
      count += bucket.load(std::memory_order_relaxed);
    }
    return count;
  }

  double Sum() const override { return sum_.load(std::memory_order_relaxed); }

  // Observations per bucket (not cumulative); the last entry is the +Inf bucket.
  std::vector<uint64_t> BucketCounts() const {
    std::vector<uint64_t> counts;
    counts.reserve(buckets_.size());
    for (const std::atomic<uint64_t>& bucket : buckets_) {
      counts.push_back(bucket.load(std::memory_order_relaxed));
    }
    return counts;
  }

  const std::vector<double>& bounds() const { return bounds_; }

 private:
  const std::vector<double>& bounds_;
  std::vector<std::atomic<uint64_t>> buckets_;
  std::atomic<double> sum_{0.0};
};

// `{a="x",b="y"}` for the given names and values plus an optional extra label (le); empty when
// there are no labels at all.
std::string LabelSet(const std::vector<std::string>& names, const std::vector<std::string>& values,
                     absl::string_view extra_name = {}, absl::string_view extra_value = {}) {
  if (names.empty() && extra_name.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += ',';
    out += names[i];
    out += "=\"";
    out += EscapeLabelValue(values[i]);
    out += '"';
  }
  if (!extra_name.empty()) {
    if (!names.empty()) out += ',';
    out.append(extra_name.data(), extra_name.size());
    out += "=\"";
    out += EscapeLabelValue(extra_value);
    out += '"';
  }
  out += '}';
  return out;
}

void AppendSample(std::string& out, absl::string_view name, const std::string& labels,
                  double value) {
  out.append(name.data(), name.size());
  out += labels;
  out += ' ';
  out += FormatSampleValue(value);
  out += '\n';
}

void RenderMetric(const std::string& name, const std::vector<std::string>& label_names,
                  const std::vector<std::string>& values, const AtomicCounter& counter,
                  std::string& out) {
  AppendSample(out, name, LabelSet(label_names, values), counter.Value());
}

void RenderMetric(const std::string& name, const std::vector<std::string>& label_names,
                  const std::vector<std::string>& values, const AtomicGauge& gauge,
                  std::string& out) {
  AppendSample(out, name, LabelSet(label_names, values), gauge.Value());
}

void RenderMetric(const std::string& name, const std::vector<std::string>& label_names,
                  const std::vector<std::string>& values, const AtomicHistogram& histogram,
                  std::string& out) {
  // Count and +Inf come from the same snapshot of the buckets, so they always agree.
  const std::vector<uint64_t> counts = histogram.BucketCounts();
  const std::vector<double>& bounds = histogram.bounds();
  const std::string bucket_name = name + "_bucket";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    cumulative += counts[i];
    const std::string le = i < bounds.size() ? FormatSampleValue(bounds[i]) : "+Inf";
    AppendSample(out, bucket_name, LabelSet(label_names, values, "le", le),
                 static_cast<double>(cumulative));
  }
  const std::string labels = LabelSet(label_names, values);
  AppendSample(out, name + "_sum", labels, histogram.Sum());
  AppendSample(out, name + "_count", labels, static_cast<double>(cumulative));
}

// What the registry needs of every family, whatever its metric type.
class RenderableFamily {
 public:
  virtual ~RenderableFamily() = default;
  virtual void Render(std::string& out) const = 0;
};

template <typename Metric, typename Impl>
class FamilyImpl final : public Family<Metric>, public RenderableFamily {
 public:
  FamilyImpl(std::string name, std::string help, const char* type,
             std::vector<std::string> label_names, std::vector<double> bounds = {})
      : name_(std::move(name)),
        help_(std::move(help)),
        type_(type),
        label_names_(std::move(label_names)),
        bounds_(std::move(bounds)) {
    // A family without labels has its one metric from the start, so it is exported at 0.
    if (label_names_.empty()) WithLabelValues({});
  }

  Metric& WithLabelValues(std::span<const absl::string_view> values) override {
    CheckRegistration(values.size() == label_names_.size(), name_,
                      "WithLabels got a different number of values than the family has labels");
    std::vector<std::string> key(values.begin(), values.end());
    absl::MutexLock lock(&mu_);
    std::unique_ptr<Impl>& metric = metrics_[std::move(key)];
    if (metric == nullptr) metric = MakeMetric();
    return *metric;
  }

  const std::string& name() const override { return name_; }
  const std::vector<std::string>& label_names() const override { return label_names_; }

  void Render(std::string& out) const override {
    out += "# HELP " + name_ + " " + EscapeHelp(help_) + "\n";
    out += "# TYPE " + name_ + " " + type_ + "\n";
    absl::MutexLock lock(&mu_);
    for (const auto& [values, metric] : metrics_) {
      RenderMetric(name_, label_names_, values, *metric, out);
    }
  }

 private:
  std::unique_ptr<Impl> MakeMetric() const {
    if constexpr (std::is_same_v<Impl, AtomicHistogram>) {
      return std::make_unique<Impl>(bounds_);
    } else {
      return std::make_unique<Impl>();
    }
  }

  const std::string name_;
  const std::string help_;
  const char* const type_;
  const std::vector<std::string> label_names_;
  const std::vector<double> bounds_;  // histograms only
  mutable absl::Mutex mu_;
  // Sorted by label values: the rendering order.
  std::map<std::vector<std::string>, std::unique_ptr<Impl>> metrics_ ABSL_GUARDED_BY(mu_);
};

void CheckLabelNames(absl::string_view name, const std::vector<std::string>& label_names) {
  std::set<absl::string_view> seen;
  for (const std::string& label : label_names) {
    CheckRegistration(IsValidLabelName(label), name,
                      "label names must match [a-zA-Z_][a-zA-Z0-9_]* and not start with __");
    CheckRegistration(seen.insert(label).second, name, "duplicate label name");
  }
}

class InMemoryRegistry final : public MetricsRegistry {
 public:
  Family<Counter>& AddCounter(absl::string_view name, absl::string_view help,
                              std::vector<std::string> label_names) override {
    CheckRegistration(absl::EndsWith(name, "_total"), name, "counter names end in _total");
    return Add<Counter, AtomicCounter>(name, help, "counter", std::move(label_names));
  }

  Family<Gauge>& AddGauge(absl::string_view name, absl::string_view help,
                          std::vector<std::string> label_names) override {
    CheckRegistration(!absl::EndsWith(name, "_total"), name, "only counters end in _total");
    return Add<Gauge, AtomicGauge>(name, help, "gauge", std::move(label_names));
  }

  Family<Histogram>& AddHistogram(absl::string_view name, absl::string_view help,
                                  std::vector<double> bucket_bounds,
                                  std::vector<std::string> label_names) override {
    CheckRegistration(!absl::EndsWith(name, "_total"), name, "only counters end in _total");
    for (const std::string& label : label_names) {
      CheckRegistration(label != "le", name, "\"le\" is the histogram's bucket label");
    }
    for (size_t i = 0; i < bucket_bounds.size(); ++i) {
      CheckRegistration(std::isfinite(bucket_bounds[i]), name, "bucket bounds must be finite");
      CheckRegistration(i == 0 || bucket_bounds[i - 1] < bucket_bounds[i], name,
                        "bucket bounds must increase strictly");
    }
    return Add<Histogram, AtomicHistogram>(name, help, "histogram", std::move(label_names),
                                           std::move(bucket_bounds));
  }

  void AddCollectHook(std::function<void()> hook) override {
    absl::MutexLock lock(&mu_);
    hooks_.push_back(std::move(hook));
  }

  std::string RenderPrometheusText() const override {
    std::vector<std::function<void()>> hooks;
    {
      absl::MutexLock lock(&mu_);
      hooks = hooks_;
    }
    for (const std::function<void()>& hook : hooks) hook();
    std::string out;
    absl::MutexLock lock(&mu_);
    for (const auto& [name, family] : families_) family->Render(out);
    return out;
  }

 private:
  template <typename Metric, typename Impl>
  Family<Metric>& Add(absl::string_view name, absl::string_view help, const char* type,
                      std::vector<std::string> label_names, std::vector<double> bounds = {}) {
    CheckRegistration(IsValidMetricName(name), name,
                      "metric names must match [a-zA-Z_:][a-zA-Z0-9_:]*");
    CheckLabelNames(name, label_names);
    auto family = std::make_unique<FamilyImpl<Metric, Impl>>(
        std::string(name), std::string(help), type, std::move(label_names), std::move(bounds));
    FamilyImpl<Metric, Impl>& result = *family;
    absl::MutexLock lock(&mu_);
    const bool inserted = families_.emplace(std::string(name), std::move(family)).second;
    CheckRegistration(inserted, name, "registered twice");
    return result;
  }

  mutable absl::Mutex mu_;
  // Sorted by name: the rendering order.
  std::map<std::string, std::unique_ptr<RenderableFamily>> families_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> hooks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<MetricsRegistry> CreateMetricsRegistry() {
  return std::make_unique<InMemoryRegistry>();
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  SDM_CHECK(start > 0 && factor > 1 && count >= 0);
  std::vector<double> bounds;
  bounds.reserve(count);
  double bound = start;
  for (int i = 0; i < count; ++i) {
    bounds.push_back(bound);
    bound *= factor;
  }
  return bounds;
}

}  // namespace sdm
