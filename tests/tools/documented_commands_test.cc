// Every command of the project's binaries written in README.md, docs/, scripts/ and deploy/ uses
// only flags its (sub)command accepts, as the binary's own --help lists them. A documented
// command that exits "unknown flag" is a broken promise, and in scripts/device-check.sh a lease
// spent (sdm-bench decode once refused its own --cuda_graphs there).
#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/engine/test_model_util.h"
#include "tests/tools/run_tool.h"

namespace sdm {
namespace {

using ::sdm::testing::ReadFile;
using ::sdm::testing::RunTool;

struct Tool {
  std::string name;                      // as written in commands
  std::string binary;                    // under the build directory
  std::vector<std::string> subcommands;  // empty: flags follow the name; longest first
  std::vector<std::string> aliases;      // shell variables the scripts run it through
  std::vector<std::string> more_flags;   // accepted but not listed one per line in --help
  // Subcommands run by another binary, skipped where it is not built (-DSDM_SERVER=OFF).
  std::map<std::string, std::string> subcommand_binaries = {};
};

const std::vector<Tool>& Tools() {
  static const std::vector<Tool> tools = {
      {"sdm-bench",
       "tools/sdm_bench/sdm-bench",
       {"decode", "report", "state", "cpu-attention", "cpu-gemm", "kernels", "serve"},
       {"$BENCH"},
       {},
       {{"serve", "tools/sdm_bench/sdm-bench-serve"}}},
      {"sdm-cli", "tools/sdm_cli/sdm-cli", {"generate", "logits"}, {}, {}},
      {"sdm-model", "tools/sdm_model/sdm-model", {"init", "info"}, {}, {}},
      {"sdm-client",
       "client/sdm-client",
       {"generate", "chat", "sessions list", "sessions get", "sessions create", "sessions delete",
        "sessions fork", "sessions", "tokenize", "detokenize", "info"},
       {"${CLIENT[@]}"},
       {}},
      // --flagfile: Abseil's, named in the help's text.
      {"sdm-server", "server/sdm-server", {}, {"$SERVER"}, {"flagfile"}},
  };
  return tools;
}

// The flags `binary [subcommand] --help` lists, one per line as "  --name (...".
std::set<std::string> AcceptedFlags(const Tool& tool, const std::string& binary,
                                    const std::string& subcommand) {
  std::set<std::string> flags(tool.more_flags.begin(), tool.more_flags.end());
  flags.insert("help");
  const testing::ToolResult help = RunTool(binary, subcommand + " --help");
  EXPECT_EQ(help.code, 0) << binary << " " << subcommand << ": " << help.output;
  static const std::regex kFlagLine(R"(^\s+--([a-z0-9_]+) \()");
  std::istringstream in(help.output);
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (std::regex_search(line, m, kFlagLine)) flags.insert(m[1]);
  }
  return flags;
}

// The lines of a file as commands are written in it: backslash continuations joined; in
// markdown, each paragraph outside code fences joined into one line (a code span may wrap).
std::vector<std::string> LogicalLines(const std::filesystem::path& file) {
  const std::string text = std::regex_replace(ReadFile(file), std::regex(R"(\\\n\s*)"), " ");
  std::vector<std::string> lines;
  std::istringstream in(text);
  const bool markdown = file.extension() == ".md";
  bool in_fence = false;
  std::string paragraph;
  for (std::string line; std::getline(in, line);) {
    if (!markdown || line.starts_with("```") || in_fence) {
      if (line.starts_with("```")) in_fence = !in_fence;
      lines.push_back(line);
    } else if (line.find_first_not_of(" \t") == std::string::npos) {
      lines.push_back(paragraph);
      paragraph.clear();
    } else {
      paragraph += " " + line;
    }
  }
  lines.push_back(paragraph);
  return lines;
}

// Each documented file and its logical lines, read once.
std::vector<std::pair<std::filesystem::path, std::vector<std::string>>> DocumentedFiles() {
  const std::filesystem::path root(SDM_SOURCE_DIR);
  std::vector<std::filesystem::path> paths = {root / "README.md"};
  for (const char* dir : {"docs", "scripts", "deploy"}) {
    for (const auto& entry : std::filesystem::recursive_directory_iterator(root / dir)) {
      const std::string ext = entry.path().extension().string();
      if (entry.is_regular_file() && (ext == ".md" || ext == ".sh" || ext == ".service")) {
        paths.push_back(entry.path());
      }
    }
  }
  std::vector<std::pair<std::filesystem::path, std::vector<std::string>>> files;
  for (const std::filesystem::path& path : paths) files.emplace_back(path, LogicalLines(path));
  return files;
}

std::string RegexEscape(const std::string& s) {
  return std::regex_replace(s, std::regex(R"([.^$|()\[\]{}*+?\\])"), R"(\$&)");
}

// Whether a match of a tool's name after `before` runs the tool: not when the name is a flag's
// value (`--server build/server/sdm-server`, the binary handed to a driver) or a Kubernetes
// object's name (`kubectl scale statefulset sdm-server --replicas=4`).
bool RunsTheTool(std::string_view head) {         // the line up to the character before the name
  const size_t blank = head.find_last_of(" \t");  // the name's word starts after it
  if (blank == std::string_view::npos) return true;
  std::string_view before = head.substr(0, blank);
  while (!before.empty() && (before.back() == ' ' || before.back() == '\t')) {
    before.remove_suffix(1);
  }
  const size_t start = before.find_last_of(" \t`(");
  const std::string_view word = start == std::string_view::npos ? before : before.substr(start + 1);
  static const std::set<std::string_view> kObjectKinds = {"statefulset", "deployment", "service",
                                                          "pod"};
  return !word.starts_with("--") && !kObjectKinds.contains(word);
}

TEST(DocumentedCommandsTest, UseOnlyFlagsTheirCommandAccepts) {
  const auto files = DocumentedFiles();
  int checked = 0;
  for (const Tool& tool : Tools()) {
    SCOPED_TRACE(tool.name);
    const std::string binary = std::string(SDM_BINARY_DIR) + "/" + tool.binary;
    if (!std::filesystem::exists(binary)) continue;  // not built here (e.g. -DSDM_SERVER=OFF)
    std::vector<std::string> names = {RegexEscape(tool.name)};
    for (const std::string& alias : tool.aliases) names.push_back(RegexEscape(alias));
    // The tool's name (or alias), its subcommand if it has any, and what follows on the line up
    // to the end of the code span, table cell, pipe, redirection or command.
    const std::string sub =
        tool.subcommands.empty() ? "()" : "\\s+(" + absl::StrJoin(tool.subcommands, "|") + ")\\b";
    const std::regex command("(?:^|[\\s/\"`(])(?:" + absl::StrJoin(names, "|") + ")\"?" + sub +
                             "([^`|;>)#]*)");
    static const std::regex kFlag(R"((?:^|\s)--([a-z0-9_]+))");
    std::map<std::string, std::set<std::string>> accepted;  // by subcommand
    for (const auto& [file, lines] : files) {
      for (const std::string& line : lines) {
        for (std::sregex_iterator c(line.begin(), line.end(), command), end; c != end; ++c) {
          if (!RunsTheTool(std::string_view(line).substr(0, c->position() + 1))) continue;
          const std::string subcommand = (*c)[1];
          if (const auto it = tool.subcommand_binaries.find(subcommand);
              it != tool.subcommand_binaries.end() &&
              !std::filesystem::exists(std::string(SDM_BINARY_DIR) + "/" + it->second)) {
            continue;
          }
          const std::string rest = (*c)[2];
          if (!accepted.contains(subcommand)) {
            accepted[subcommand] = AcceptedFlags(tool, binary, subcommand);
          }
          const std::set<std::string>& flags = accepted[subcommand];
          ++checked;
          for (std::sregex_iterator f(rest.begin(), rest.end(), kFlag); f != end; ++f) {
            const std::string flag = (*f)[1];
            const bool negated_bool = flag.starts_with("no") && flags.contains(flag.substr(2));
            EXPECT_TRUE(flags.contains(flag) || negated_bool)
                << file.lexically_relative(SDM_SOURCE_DIR) << ": '" << tool.name << " "
                << subcommand << "' has no --" << flag << " (in: " << (*c)[0] << ")";
          }
        }
      }
    }
  }
  // The README's and the docs' commands number in the dozens: if none were seen the patterns no
  // longer match how commands are written.
  EXPECT_GT(checked, 40);
}

// docs/api.md's table of sdm-server's flags ("Running the server") lists every flag that
// `sdm-server --help` lists, each with the default --help shows (a row may name several flags,
// their defaults in the same order). It had left eight flags out and written --device_budget's 0
// as 0B.
TEST(DocumentedCommandsTest, TheServerFlagTableMatchesTheServersHelp) {
  const std::string binary = std::string(SDM_BINARY_DIR) + "/server/sdm-server";
  if (!std::filesystem::exists(binary)) GTEST_SKIP() << "sdm-server is not built here";
  const testing::ToolResult help = RunTool(binary, "--help");
  ASSERT_EQ(help.code, 0) << help.output;
  std::map<std::string, std::string> help_defaults;
  static const std::regex kHelpLine(R"(^  --([a-z0-9_]+) \(default: (.*)\)$)");
  std::istringstream help_lines(help.output);
  for (std::string line; std::getline(help_lines, line);) {
    std::smatch m;
    if (std::regex_match(line, m, kHelpLine)) help_defaults[m[1]] = m[2];
  }
  ASSERT_GT(help_defaults.size(), 40u) << help.output;

  const std::string api = ReadFile(std::filesystem::path(SDM_SOURCE_DIR) / "docs" / "api.md");
  const size_t start = api.find("\n## Running the server\n");
  ASSERT_NE(start, std::string::npos);
  const std::string section = api.substr(start, api.find("\n## ", start + 1) - start);
  std::map<std::string, std::string> table_defaults;
  static const std::regex kName(R"(`--([a-z0-9_]+)`)");
  static const std::regex kDefault(R"(^`([^`]*)`$)");
  std::istringstream table_lines(section);
  for (std::string line; std::getline(table_lines, line);) {
    if (!line.starts_with("| `--")) continue;
    const std::vector<std::string> cells = absl::StrSplit(line.substr(2), " | ");
    ASSERT_GE(cells.size(), 3u) << line;
    std::vector<std::string> names;
    for (std::sregex_iterator n(cells[0].begin(), cells[0].end(), kName), end; n != end; ++n) {
      names.push_back((*n)[1]);
    }
    const std::vector<std::string> values = absl::StrSplit(cells[1], ", ");
    if (names.size() != values.size()) {
      ADD_FAILURE() << "not one default per flag: " << line.substr(0, 200);
      continue;
    }
    for (size_t i = 0; i < names.size(); ++i) {
      std::smatch m;
      EXPECT_TRUE(std::regex_match(values[i], m, kDefault))
          << "--" << names[i] << "'s default is not one code span: " << values[i];
      EXPECT_TRUE(table_defaults.emplace(names[i], m.empty() ? values[i] : m[1].str()).second)
          << "--" << names[i] << " is in the table twice";
    }
  }
  for (const auto& [name, value] : help_defaults) {
    const auto it = table_defaults.find(name);
    if (it == table_defaults.end()) {
      ADD_FAILURE() << "docs/api.md's flag table has no --" << name << " (default " << value << ")";
    } else {
      EXPECT_EQ(it->second, value) << "--" << name << "'s default";
    }
  }
  for (const auto& [name, value] : table_defaults) {
    EXPECT_TRUE(help_defaults.contains(name)) << "sdm-server --help has no --" << name;
  }
}

}  // namespace
}  // namespace sdm
