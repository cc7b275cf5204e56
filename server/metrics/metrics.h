// Metrics: counters, gauges and histograms in labelled families, rendered in the Prometheus text
// exposition format 0.0.4 (the /metrics page).
//
// Code that records metrics sees only the interfaces below (Counter, Gauge, Histogram, Family,
// MetricsRegistry); CreateMetricsRegistry() returns the in-memory implementation. Usage:
//
//   std::unique_ptr<MetricsRegistry> registry = CreateMetricsRegistry();
//   Family<Counter>& requests = registry->AddCounter("sdm_requests_total", "Requests.",
//                                                    {"method", "code"});
//   Counter& ok = requests.WithLabels({"Generate", "OK"});  // keep the reference
//   ok.Increment();
//   std::string page = registry->RenderPrometheusText();
//
// Families are registered at start-up with constant names: a malformed name, a duplicate, a
// counter whose name does not end in "_total", a label named "le" on a histogram or bucket bounds
// that do not increase are programming errors (SDM_CHECK). So is calling WithLabels with the
// wrong number of values. Label values are any UTF-8 text; the renderer escapes them.
//
// Rendering: families sorted by name, then each family's metrics sorted by label values; HELP
// and TYPE lines before the samples; a histogram as cumulative _bucket{le="..."} samples ending
// with le="+Inf" (equal to _count), then _sum and _count. A family without labels has its one
// metric (at 0) from registration on; a labelled family shows the label values used so far.
//
// Thread-safety: everything is thread-safe. Increment/Set/Add/Observe are lock-free atomics;
// WithLabels takes the family's lock (look a metric up once and keep the reference: references
// stay valid for the registry's lifetime). A render running alongside updates sees each value
// atomically but not one instant across values: a histogram's _sum may lag its buckets by the
// observations in flight (its +Inf bucket always equals its _count).
#ifndef SDMSERVE_SERVER_METRICS_METRICS_H_
#define SDMSERVE_SERVER_METRICS_METRICS_H_

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace sdm {

// A value that only goes up (requests, tokens), exported as a Prometheus counter.
class Counter {
 public:
  virtual ~Counter() = default;
  // Adds `delta`, which must be finite and >= 0.
  virtual void Increment(double delta = 1) = 0;
  virtual double Value() const = 0;
};

// A value that goes up and down (requests running, bytes held).
class Gauge {
 public:
  virtual ~Gauge() = default;
  virtual void Set(double value) = 0;
  virtual void Add(double delta) = 0;
  void Increment() { Add(1); }
  void Decrement() { Add(-1); }
  virtual double Value() const = 0;
};

// Counts observations into buckets (value <= bound) and sums them (latencies, batch sizes).
class Histogram {
 public:
  virtual ~Histogram() = default;
  // NaN observations are ignored.
  virtual void Observe(double value) = 0;
  virtual uint64_t Count() const = 0;
  virtual double Sum() const = 0;
};

// The metrics of one name, one per combination of label values.
template <typename Metric>
class Family {
 public:
  virtual ~Family() = default;

  // The metric with these label values, one per label name in registration order; created at
  // 0 on first use.
  Metric& WithLabels(std::initializer_list<absl::string_view> values) {
    return WithLabelValues(std::span<const absl::string_view>(values.begin(), values.size()));
  }
  virtual Metric& WithLabelValues(std::span<const absl::string_view> values) = 0;

  virtual const std::string& name() const = 0;
  virtual const std::vector<std::string>& label_names() const = 0;
};

class MetricsRegistry {
 public:
  virtual ~MetricsRegistry() = default;

  // `name` follows Prometheus conventions: [a-zA-Z_:][a-zA-Z0-9_:]*, base units in the name
  // (_seconds, _bytes), counters ending in _total. `help` is one line of text (escaped when
  // rendered). Label names: [a-zA-Z_][a-zA-Z0-9_]*, not starting with "__", no duplicates.
  // The family lives as long as the registry.
  virtual Family<Counter>& AddCounter(absl::string_view name, absl::string_view help,
                                      std::vector<std::string> label_names = {}) = 0;
  virtual Family<Gauge>& AddGauge(absl::string_view name, absl::string_view help,
                                  std::vector<std::string> label_names = {}) = 0;
  // `bucket_bounds`: finite upper bounds, strictly increasing; the +Inf bucket is implicit.
  virtual Family<Histogram>& AddHistogram(absl::string_view name, absl::string_view help,
                                          std::vector<double> bucket_bounds,
                                          std::vector<std::string> label_names = {}) = 0;

  // `hook` runs at the start of every RenderPrometheusText(), outside the registry's locks, to
  // refresh values that live elsewhere (e.g. gauges read from the session store at scrape time).
  virtual void AddCollectHook(std::function<void()> hook) = 0;

  // The exposition page (text format 0.0.4, served as "text/plain; version=0.0.4").
  virtual std::string RenderPrometheusText() const = 0;
};

// The in-memory registry.
std::unique_ptr<MetricsRegistry> CreateMetricsRegistry();

// Bucket bounds start, start*factor, ... (`count` of them). Requires start > 0, factor > 1.
std::vector<double> ExponentialBuckets(double start, double factor, int count);

}  // namespace sdm

#endif  // SDMSERVE_SERVER_METRICS_METRICS_H_
