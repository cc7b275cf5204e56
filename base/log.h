// SDM_LOG: leveled logging for library code, one line per message.
//
//   SDM_LOG(INFO) << "loaded " << n << " tensors";
//   SDM_LOG(WARNING) << "CUDA backend unavailable (" << status << "); using the CPU";
//
// This stands in for absl/log (ABSL_LOG / LOG), which Debian 12's Abseil (20220623) does not
// have; once Debian's Abseil ships absl/log, SDM_LOG(X) maps onto LOG(X) and this file goes away.
//
// Each message is formatted as one line,
//   "W 2026-12-02 16:37:55.123456 UTC engine.cc:134] text\n"
// (severity letter, UTC time, file basename and line), and handed to the current sink in one
// call. The default sink writes the line to stderr with a single write, so concurrent messages
// never interleave. SDM_LOG(FATAL) sends its message and aborts.
//
// Thread-safety: SDM_LOG may be used from any thread. SetLogSink may be called at any time; a
// message is sent to exactly one sink, and SetLogSink returns only after every message already
// handed to the old sink has been delivered.
#ifndef SDMSERVE_BASE_LOG_H_
#define SDMSERVE_BASE_LOG_H_

#include <sstream>
#include <string>

#include "absl/base/attributes.h"
#include "absl/strings/string_view.h"

namespace sdm {

enum class LogSeverity { kInfo, kWarning, kError, kFatal };

// 'I', 'W', 'E' or 'F'.
char LogSeverityLetter(LogSeverity severity);

// Where complete messages go.
class LogSink {
 public:
  virtual ~LogSink() = default;
  // `line` is the formatted line including its trailing '\n'; `message` is the text the caller
  // streamed, without any prefix. Called concurrently from many threads; must not log itself.
  virtual void Send(LogSeverity severity, absl::string_view message, absl::string_view line) = 0;
};

// Makes `sink` receive every message from now on (nullptr: the default stderr sink) and returns
// the previous sink (nullptr for the default). The caller keeps ownership; a sink must outlive its
// time as the current sink.
LogSink* SetLogSink(LogSink* sink);

namespace log_internal {

// One message under construction; sends it when destroyed.
class LogMessage {
 public:
  LogMessage(const char* file, int line, LogSeverity severity);
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  ~LogMessage();

  std::ostream& stream() { return stream_; }

 protected:
  void Send();

 private:
  const char* file_;
  int line_;
  LogSeverity severity_;
  std::ostringstream stream_;
};

// A FATAL message: sends itself and aborts, so code after it is known to be unreachable.
class LogMessageFatal : public LogMessage {
 public:
  LogMessageFatal(const char* file, int line) : LogMessage(file, line, LogSeverity::kFatal) {}
  ABSL_ATTRIBUTE_NORETURN ~LogMessageFatal();
};

}  // namespace log_internal
}  // namespace sdm

#define SDM_LOG_INTERNAL_INFO \
  ::sdm::log_internal::LogMessage(__FILE__, __LINE__, ::sdm::LogSeverity::kInfo)
#define SDM_LOG_INTERNAL_WARNING \
  ::sdm::log_internal::LogMessage(__FILE__, __LINE__, ::sdm::LogSeverity::kWarning)
#define SDM_LOG_INTERNAL_ERROR \
  ::sdm::log_internal::LogMessage(__FILE__, __LINE__, ::sdm::LogSeverity::kError)
#define SDM_LOG_INTERNAL_FATAL ::sdm::log_internal::LogMessageFatal(__FILE__, __LINE__)

// SDM_LOG(INFO | WARNING | ERROR | FATAL) << ...;
#define SDM_LOG(severity) SDM_LOG_INTERNAL_##severity.stream()

#endif  // SDMSERVE_BASE_LOG_H_
