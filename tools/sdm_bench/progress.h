// A one-line progress bar on stderr for long benchmark phases (prefill, timed steps).
//
// On a terminal the line is redrawn in place (at most ~10 times a second) and cleared when the
// phase finishes; Finish(summary, keep=true) then leaves a summary line. When stderr is not a
// terminal (logs, tests) only the kept summary lines are written. Single-threaded use.
#ifndef SDMSERVE_TOOLS_SDM_BENCH_PROGRESS_H_
#define SDMSERVE_TOOLS_SDM_BENCH_PROGRESS_H_

#include <chrono>
#include <cstdint>
#include <string>

namespace sdm::bench {

class Progress {
 public:
  // `total` units of work (`unit` names them; empty: a phase without a count, shown as "...").
  Progress(std::string label, int64_t total, std::string unit);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // `done` units of `total` are finished.
  void Update(int64_t done);
  // Ends the phase: clears the bar, then writes `summary` as a line if `keep` and it is non-empty.
  void Finish(const std::string& summary, bool keep);

 private:
  void Draw(int64_t done);

  std::string label_;
  int64_t total_;
  std::string unit_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
  bool finished_ = false;
};

// Clears a progress line drawn on the terminal (before writing a table row on stdout).
void ClearProgressLine();

}  // namespace sdm::bench

#endif  // SDMSERVE_TOOLS_SDM_BENCH_PROGRESS_H_
