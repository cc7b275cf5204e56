#include "base/log.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace sdm {
namespace {

// Writes the whole line with as few write(2) calls as the kernel allows: one for any line that
// fits a pipe buffer, which keeps lines from different processes sharing stderr whole too.
class StderrSink : public LogSink {
 public:
  void Send(LogSeverity, absl::string_view, absl::string_view line) override {
    while (!line.empty()) {
      const ssize_t n = ::write(STDERR_FILENO, line.data(), line.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;  // nowhere to report a failing stderr
      line.remove_prefix(static_cast<size_t>(n));
    }
  }
};

// The sink pointer is read under a shared lock for the whole Send, so SetLogSink (exclusive)
// waits until no message is in flight to the old sink.
struct SinkSlot {
  absl::Mutex mu;
  LogSink* sink ABSL_GUARDED_BY(mu) = nullptr;  // null: the stderr sink
};

SinkSlot& Slot() {
  static SinkSlot* slot = new SinkSlot;  // never destroyed: logging works during shutdown
  return *slot;
}

StderrSink& DefaultSink() {
  static StderrSink* sink = new StderrSink;
  return *sink;
}

absl::string_view Basename(absl::string_view path) {
  const size_t slash = path.rfind('/');
  return slash == absl::string_view::npos ? path : path.substr(slash + 1);
}

}  // namespace

char LogSeverityLetter(LogSeverity severity) {
  switch (severity) {
    case LogSeverity::kInfo:
      return 'I';
    case LogSeverity::kWarning:
      return 'W';
    case LogSeverity::kError:
      return 'E';
    case LogSeverity::kFatal:
      return 'F';
  }
  return '?';
}

LogSink* SetLogSink(LogSink* sink) {
  SinkSlot& slot = Slot();
  absl::MutexLock lock(&slot.mu);
  LogSink* previous = slot.sink;
  slot.sink = sink;
  return previous;
}

namespace log_internal {

LogMessage::LogMessage(const char* file, int line, LogSeverity severity)
    : file_(file), line_(line), severity_(severity) {}

LogMessage::~LogMessage() { Send(); }

void LogMessage::Send() {
  const std::string message = stream_.str();
  const char letter[2] = {LogSeverityLetter(severity_), '\0'};
  const std::string line = absl::StrCat(
      letter, " ", absl::FormatTime("%Y-%m-%d %H:%M:%E6S UTC", absl::Now(), absl::UTCTimeZone()),
      " ", Basename(file_), ":", line_, "] ", message, "\n");
  SinkSlot& slot = Slot();
  absl::ReaderMutexLock lock(&slot.mu);
  LogSink* sink = slot.sink != nullptr ? slot.sink : &DefaultSink();
  sink->Send(severity_, message, line);
}

LogMessageFatal::~LogMessageFatal() {
  Send();
  std::abort();
}

}  // namespace log_internal
}  // namespace sdm
