// Test helper: a registry's /metrics page rendered by server/metrics/exposition.h and read back
// with the independent test parser.
#ifndef SDMSERVE_TESTS_SERVER_METRICS_TEST_UTIL_H_
#define SDMSERVE_TESTS_SERVER_METRICS_TEST_UTIL_H_

#include <string>

#include "gtest/gtest.h"
#include "prometheus/collectable.h"
#include "server/metrics/exposition.h"
#include "tests/server/prometheus_text_parser.h"

namespace sdm::testing {

// The page of `collectable`, parsed; a page that does not parse fails the test (and is printed).
inline ParsedPage RenderAndParse(const prometheus::Collectable& collectable) {
  const std::string text = RenderPrometheusText(collectable);
  ParsedPage page;
  std::string error;
  EXPECT_TRUE(ParsePrometheusText(text, &page, &error)) << error << "\n" << text;
  return page;
}

}  // namespace sdm::testing

#endif  // SDMSERVE_TESTS_SERVER_METRICS_TEST_UTIL_H_
