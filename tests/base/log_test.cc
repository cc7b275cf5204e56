#include "base/log.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace sdm {
namespace {

using ::testing::EndsWith;
using ::testing::MatchesRegex;
using ::testing::SizeIs;

class CapturingSink : public LogSink {
 public:
  struct Entry {
    LogSeverity severity;
    std::string message;
    std::string line;
  };

  void Send(LogSeverity severity, absl::string_view message, absl::string_view line) override {
    absl::MutexLock lock(&mu_);
    entries_.push_back({severity, std::string(message), std::string(line)});
  }
  std::vector<Entry> entries() const {
    absl::MutexLock lock(&mu_);
    return entries_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
};

// Installs a sink for one test and restores the previous one.
class ScopedSink {
 public:
  explicit ScopedSink(LogSink* sink) : previous_(SetLogSink(sink)) {}
  ~ScopedSink() { SetLogSink(previous_); }

 private:
  LogSink* previous_;
};

TEST(LogTest, FormatsOneLineWithSeverityTimeAndPlace) {
  CapturingSink sink;
  ScopedSink scoped(&sink);
  SDM_LOG(WARNING) << "budget " << 42 << " bytes";
  const int line = __LINE__ - 1;
  const std::vector<CapturingSink::Entry> entries = sink.entries();
  ASSERT_THAT(entries, SizeIs(1));
  EXPECT_EQ(entries[0].severity, LogSeverity::kWarning);
  EXPECT_EQ(entries[0].message, "budget 42 bytes");
  EXPECT_THAT(entries[0].line,
              MatchesRegex("W [0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{6} UTC "
                           "log_test\\.cc:" +
                           std::to_string(line) + "\\] budget 42 bytes\n"));
}

TEST(LogTest, SeverityLetters) {
  CapturingSink sink;
  ScopedSink scoped(&sink);
  SDM_LOG(INFO) << "i";
  SDM_LOG(ERROR) << "e";
  const std::vector<CapturingSink::Entry> entries = sink.entries();
  ASSERT_THAT(entries, SizeIs(2));
  EXPECT_EQ(entries[0].severity, LogSeverity::kInfo);
  EXPECT_EQ(entries[0].line[0], 'I');
  EXPECT_EQ(entries[1].severity, LogSeverity::kError);
  EXPECT_EQ(entries[1].line[0], 'E');
}

TEST(LogTest, SetLogSinkReturnsThePreviousSink) {
  CapturingSink first, second;
  LogSink* original = SetLogSink(&first);
  EXPECT_EQ(SetLogSink(&second), &first);
  SDM_LOG(INFO) << "to second";
  EXPECT_EQ(SetLogSink(original), &second);
  EXPECT_THAT(first.entries(), SizeIs(0));
  EXPECT_THAT(second.entries(), SizeIs(1));
}

// Messages from many threads arrive whole: each sink call carries exactly one complete line.
TEST(LogTest, ConcurrentMessagesStayWhole) {
  CapturingSink sink;
  ScopedSink scoped(&sink);
  constexpr int kThreads = 4, kMessages = 200;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < kMessages; ++i) SDM_LOG(INFO) << "thread " << t << " message " << i;
    });
  }
  for (std::thread& t : threads) t.join();
  const std::vector<CapturingSink::Entry> entries = sink.entries();
  ASSERT_THAT(entries, SizeIs(kThreads * kMessages));
  for (const CapturingSink::Entry& e : entries) {
    EXPECT_THAT(e.line, MatchesRegex(".*\\] thread [0-9] message [0-9]+\n"));
    EXPECT_THAT(e.line, EndsWith(e.message + "\n"));
  }
}

TEST(LogDeathTest, FatalAbortsAfterWritingToStderr) {
  EXPECT_DEATH(SDM_LOG(FATAL) << "cannot go on", "F .* log_test\\.cc:[0-9]+\\] cannot go on");
}

}  // namespace
}  // namespace sdm
