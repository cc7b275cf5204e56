// Command lines of the project's binaries (sdm-model, sdm-cli, sdm-bench, sdm-server): Abseil
// flags (typed values, defaults and help text declared once, with ABSL_FLAG), dispatched by
// subcommand, with one help layout and one set of exit codes.
//
// Why not absl::ParseCommandLine for the subcommand tools: each subcommand accepts only its own
// flags, and a bad flag must exit with status 2 (usage error), where Abseil's parser exits with
// 1. RunProgram parses argv itself and sets the flags through Abseil's reflection API.
//
// Accepted forms: `--name=value`, `--name value`, for booleans also `--name` and `--noname`; a
// single leading dash works as well. `--` ends the flags. A flag of type RepeatedFlag collects
// every occurrence whole (commas included): `--set swa_at=[0,1] --set n_layers=4`.
//
// Thread-compatible: flags are process-wide state; parse them once, from main().
#ifndef SDMSERVE_COMMON_COMMAND_LINE_H_
#define SDMSERVE_COMMON_COMMAND_LINE_H_

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/strings/string_view.h"

namespace sdm::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;  // a runtime failure
inline constexpr int kExitUsage = 2;    // bad flags, arguments or values

// The value of a repeatable flag: one entry per occurrence, in order, each kept verbatim (commas,
// line breaks and empty values included). Its text form (what AbslParseFlag reads and
// AbslUnparseFlag writes) is one line per value: '=' followed by the C-escaped value.
struct RepeatedFlag {
  std::vector<std::string> values;
};
bool AbslParseFlag(absl::string_view text, RepeatedFlag* flag, std::string* error);
std::string AbslUnparseFlag(const RepeatedFlag& flag);

// `text` broken into lines of at most 100 columns (longer words stay whole), each indented by
// `indent` spaces; ends with a newline.
std::string Wrap(absl::string_view text, int indent);

// A flag's help entry: "  --name (default: D)\n" and its help text wrapped at indent 6.
std::string FlagHelp(const absl::CommandLineFlag& flag);

// What the parser found besides flag values.
struct ParsedArgs {
  std::vector<std::string> positional;
  std::set<std::string> given;  // names of the flags that appeared (even with default values)
};

struct Subcommand {
  std::string name;
  std::string synopsis;     // e.g. "sdm-model info DIR | --preset NAME [--set key=value ...]"
  std::string description;  // a paragraph
  std::vector<std::string> flags;  // the Abseil flags (by name) it accepts
  size_t max_positional = 0;       // more positional arguments are a usage error
  // Runs the subcommand once its flags are set; returns the exit status.
  std::function<int(const ParsedArgs&)> run;
};

struct Program {
  std::string name;    // the binary, prefixes every message: "sdm-model"
  std::string footer;  // printed after the list of subcommands in the main help
  std::vector<Subcommand> subcommands;
  // Subcommands the binary runs itself before RunProgram (sdm-bench's serve), named after the
  // others when an unknown one is refused; the footer describes them.
  std::vector<std::string> other_subcommands;
};

// Sets `sub`'s flags from `args` (the arguments after the subcommand). A non-empty error message
// (naming the flag or argument) on a usage error.
std::string SetSubcommandFlags(const Subcommand& sub, const std::vector<std::string>& args,
                               ParsedArgs* parsed);

// Dispatches argv[1] as a subcommand: "help", "--help" or "-h" print the program's help to
// stdout (exit 0), no argument prints it to stderr (exit 2); "SUB ... --help" prints SUB's help
// with every flag it accepts (exit 0); an unknown subcommand, unknown flag, bad value or too many
// positional arguments is a usage error (exit 2); otherwise it returns SUB's run().
int RunProgram(const Program& program, int argc, char** argv);

// Prints "PROGRAM: message" and a hint to the help to stderr; returns kExitUsage. `subcommand`
// may be empty.
int UsageError(absl::string_view program, absl::string_view subcommand, absl::string_view message);

}  // namespace sdm::cli

#endif  // SDMSERVE_COMMON_COMMAND_LINE_H_
