// Runs a built binary for the tool tests and collects what it prints.
#ifndef SDMSERVE_TESTS_TOOLS_RUN_TOOL_H_
#define SDMSERVE_TESTS_TOOLS_RUN_TOOL_H_

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace sdm::testing {

struct ToolResult {
  int code = -1;       // the exit status; -1 when it could not run or did not exit
  std::string output;  // stdout and stderr
};

// Runs `binary args` through the shell (args are shell words, quoted by the caller).
inline ToolResult RunTool(const std::string& binary, const std::string& args) {
  ToolResult r;
  FILE* pipe = ::popen((binary + " " + args + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buffer;
  size_t n;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0) {
    r.output.append(buffer.data(), n);
  }
  const int status = ::pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace sdm::testing

#endif  // SDMSERVE_TESTS_TOOLS_RUN_TOOL_H_
