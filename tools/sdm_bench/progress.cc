#include "tools/sdm_bench/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

namespace sdm::bench {
namespace {

using Clock = std::chrono::steady_clock;

bool StderrIsTerminal() {
  static const bool tty = ::isatty(STDERR_FILENO) == 1;
  return tty;
}

}  // namespace

Progress::Progress(std::string label, int64_t total, std::string unit)
    : label_(std::move(label)),
      total_(std::max<int64_t>(total, 1)),
      unit_(std::move(unit)),
      start_(Clock::now()),
      last_draw_(start_) {
  Draw(0);
}

Progress::~Progress() {
  if (!finished_) Finish("", false);
}

void Progress::Update(int64_t done) {
  const Clock::time_point now = Clock::now();
  if (done < total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  Draw(done);
}

void Progress::Draw(int64_t done) {
  if (!StderrIsTerminal()) return;
  const double seconds = std::chrono::duration<double>(Clock::now() - start_).count();
  std::string line = "\r\033[K" + label_;
  if (unit_.empty()) {
    line += " ...";
  } else {
    constexpr int kWidth = 30;
    const double frac = std::clamp(static_cast<double>(done) / total_, 0.0, 1.0);
    const int filled = static_cast<int>(frac * kWidth);
    line += " [" + std::string(filled, '#') + std::string(kWidth - filled, '-') + "]";
    char buf[96];
    std::snprintf(buf, sizeof(buf), " %3.0f%% %lld/%lld %s %.1f s", 100 * frac,
                  static_cast<long long>(done), static_cast<long long>(total_), unit_.c_str(),
                  seconds);
    line += buf;
  }
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
}

void Progress::Finish(const std::string& summary, bool keep) {
  finished_ = true;
  ClearProgressLine();
  if (keep && !summary.empty()) {
    std::fprintf(stderr, "%s\n", summary.c_str());
    std::fflush(stderr);
  }
}

void ClearProgressLine() {
  if (!StderrIsTerminal()) return;
  std::fputs("\r\033[K", stderr);
  std::fflush(stderr);
}

}  // namespace sdm::bench
