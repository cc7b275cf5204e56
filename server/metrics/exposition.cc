#include "server/metrics/exposition.h"

#include <algorithm>
#include <string>
#include <vector>

#include "prometheus/client_metric.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

namespace sdm {

std::string RenderPrometheusText(const prometheus::Collectable& collectable) {
  std::vector<prometheus::MetricFamily> families = collectable.Collect();
  std::sort(families.begin(), families.end(),
            [](const prometheus::MetricFamily& a, const prometheus::MetricFamily& b) {
              return a.name < b.name;
            });
  // A series' labels come sorted by name (prometheus::Labels is a std::map), so comparing the
  // label lists orders the series of a family by their label values.
  for (prometheus::MetricFamily& family : families) {
    std::sort(family.metric.begin(), family.metric.end(),
              [](const prometheus::ClientMetric& a, const prometheus::ClientMetric& b) {
                return a.label < b.label;
              });
  }
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace sdm
