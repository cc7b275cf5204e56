// The outputs of `sdm-bench decode`, all rendered from one JSON document (the run's record):
// the terminal table, the JSON and CSV files, and the report directory (report.md, results.json,
// results.csv and PNG plots made by plot_decode.py with /usr/bin/python3 and matplotlib; without
// matplotlib the report says so and is written without plots).
//
// The document's keys: tool, schema_version, started_utc, finished_utc, wall_seconds,
// command_line, parameters (every option), machine, build, bandwidth, groups (per pair: models
// with parameter counts, prefill log, capacity, sgemm rates, ratios, fit_ratios, growth,
// headline), results (one row per measured (model, context, batch); keys in RowKeys()) and
// skipped.
#ifndef SDMSERVE_TOOLS_SDM_BENCH_DECODE_REPORT_H_
#define SDMSERVE_TOOLS_SDM_BENCH_DECODE_REPORT_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "nlohmann/json.hpp"
#include "tools/sdm_bench/decode_benchmark.h"

namespace sdm::bench {

// The keys of a result row, in CSV column order.
const std::vector<std::string>& RowKeys();

// The terminal table's header and one row.
std::string TableHeader();
std::string TableRow(const nlohmann::json& row);
// A group's ratios and step-time growth, for the terminal.
std::string GroupSummary(const nlohmann::json& group);

// The CSV file: a header of RowKeys() and one line per result row.
std::string CsvText(const nlohmann::json& doc);
// report.md; `plots` are PNG file names in the same directory, `plot_note` says why there are
// none (or is empty).
std::string MarkdownReport(const nlohmann::json& doc, const std::vector<std::string>& plots,
                           const std::string& plot_note);

// Writes --json, --csv and --report outputs as the options ask.
absl::Status WriteOutputs(const nlohmann::json& doc, const DecodeBenchOptions& options);

}  // namespace sdm::bench

#endif  // SDMSERVE_TOOLS_SDM_BENCH_DECODE_REPORT_H_
