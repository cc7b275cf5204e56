// CapturedLog: the SDM_LOG lines sent while it lives (base/log.h), for tests that check what a
// component logs, and how often.
#ifndef SDMSERVE_TESTS_BASE_CAPTURED_LOG_H_
#define SDMSERVE_TESTS_BASE_CAPTURED_LOG_H_

#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "base/log.h"

namespace sdm::testing {

// Installs itself as the log sink; the previous sink is back when it is destroyed. Each line is
// kept as "<severity letter> <message>". Thread-safe.
class CapturedLog : public LogSink {
 public:
  CapturedLog() : previous_(SetLogSink(this)) {}
  ~CapturedLog() override { SetLogSink(previous_); }
  CapturedLog(const CapturedLog&) = delete;
  CapturedLog& operator=(const CapturedLog&) = delete;

  void Send(LogSeverity severity, absl::string_view message, absl::string_view) override {
    absl::MutexLock lock(&mu_);
    lines_.push_back(absl::StrCat(std::string(1, LogSeverityLetter(severity)), " ", message));
  }

  // The lines that contain `part`.
  std::vector<std::string> With(absl::string_view part) const {
    absl::MutexLock lock(&mu_);
    std::vector<std::string> out;
    for (const std::string& line : lines_) {
      if (absl::StrContains(line, part)) out.push_back(line);
    }
    return out;
  }

 private:
  LogSink* previous_;
  mutable absl::Mutex mu_;
  std::vector<std::string> lines_ ABSL_GUARDED_BY(mu_);
};

}  // namespace sdm::testing

#endif  // SDMSERVE_TESTS_BASE_CAPTURED_LOG_H_
