// The /metrics page: a prometheus-cpp registry (or any prometheus::Collectable) in the Prometheus
// text exposition format 0.0.4, written by prometheus-cpp's TextSerializer.
//
// The metrics themselves are prometheus-cpp's (prometheus::Registry, Family, Counter, Gauge,
// Histogram; server/metrics/server_metrics.h declares the server's). What this file adds is a
// stable page: prometheus-cpp collects families grouped by type and the series of a family in
// hash order, so RenderPrometheusText sorts families by name and the series of each family by
// their labels before serializing. A family shows up once it has a series: unlabelled metrics
// from registration on, labelled ones from the first label values used.
//
// Thread-safety: RenderPrometheusText may run on any thread, concurrently with updates and other
// renders (prometheus-cpp's metrics are thread-safe; a histogram is collected under its lock, so
// its +Inf bucket always equals its _count).
#ifndef SDMSERVE_SERVER_METRICS_EXPOSITION_H_
#define SDMSERVE_SERVER_METRICS_EXPOSITION_H_

#include <string>

#include "prometheus/collectable.h"

namespace sdm {

// The Content-Type of a page in this format.
inline constexpr char kPrometheusContentType[] = "text/plain; version=0.0.4; charset=utf-8";

// Collects `collectable` and renders the page: families sorted by name, each family's series
// sorted by label values, HELP and TYPE lines before the samples.
std::string RenderPrometheusText(const prometheus::Collectable& collectable);

}  // namespace sdm

#endif  // SDMSERVE_SERVER_METRICS_EXPOSITION_H_
