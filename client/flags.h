// A small command-line flag parser for the client tools (sdm-client, sdm-bench-serve).
//
// The tools parse their arguments with this rather than with Abseil flags because every
// subcommand accepts only its own flags, a bad flag must exit with status 2, and the tests run
// the tools in-process many times over (Abseil flags are process-wide state).
//
// Accepted forms: `--name=value`, `--name value`, and for booleans `--name`, `--noname`,
// `--name=true|false|1|0`. A single leading dash works as well (`-name`). `--` ends the flags:
// everything after it is positional. Anything else not starting with a dash is positional (a
// lone `-` is positional too). A repeatable flag collects every occurrence in order.
//
// Thread-compatible: a FlagSet is built, parsed and read by one thread.
#ifndef SDMSERVE_CLIENT_FLAGS_H_
#define SDMSERVE_CLIENT_FLAGS_H_

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace sdm::client {

class FlagSet {
 public:
  FlagSet() = default;
  FlagSet(const FlagSet&) = delete;
  FlagSet& operator=(const FlagSet&) = delete;

  // Registers a flag writing into `*out`, which must outlive Parse(); the value `*out` holds
  // now is the default shown by Help(). Names are unique (a repeated name is a programming
  // error and aborts).
  void AddString(std::string name, std::string* out, std::string help);
  void AddInt(std::string name, int64_t* out, std::string help);
  void AddDouble(std::string name, double* out, std::string help);
  void AddBool(std::string name, bool* out, std::string help);
  void AddStringList(std::string name, std::vector<std::string>* out, std::string help);

  // Replaces the default Help() shows for `name` (e.g. "unset: the server's default").
  void SetDefaultText(absl::string_view name, std::string text);

  // Parses `args` (without the program or subcommand name), writing the flags' values, and
  // returns the positional arguments in order. INVALID_ARGUMENT names the offending flag: an
  // unknown flag, a missing value, a value of the wrong type (integers in decimal, finite
  // doubles).
  absl::StatusOr<std::vector<std::string>> Parse(absl::Span<const std::string> args);

  // Whether Parse() saw the flag (even with a value equal to the default).
  bool IsSet(absl::string_view name) const;

  // One line per flag: `  --name=<type> (default: ...)  help`, in registration order.
  std::string Help() const;

 private:
  using Target = std::variant<std::string*, int64_t*, double*, bool*, std::vector<std::string>*>;
  struct Flag {
    std::string name;
    Target target;
    std::string help;
    std::string default_text;
    bool set = false;
  };

  void Add(std::string name, Target target, std::string help);
  Flag* Find(absl::string_view name);
  const Flag* Find(absl::string_view name) const;

  std::vector<Flag> flags_;
};

// True if `args` asks for help: `--help`, `-h` or `-help` anywhere before a `--`.
bool WantsHelp(absl::Span<const std::string> args);

}  // namespace sdm::client

#endif  // SDMSERVE_CLIENT_FLAGS_H_
