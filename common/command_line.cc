#include "common/command_line.h"

#include <algorithm>
#include <cstdio>

#include "absl/flags/reflection.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace sdm::cli {

bool AbslParseFlag(absl::string_view text, RepeatedFlag* flag, std::string* error) {
  flag->values.clear();
  if (text.empty()) return true;
  for (absl::string_view entry : absl::StrSplit(text, '\n')) {
    std::string value;
    if (!absl::ConsumePrefix(&entry, "=") || !absl::CUnescape(entry, &value)) {
      *error = "a repeated flag's text form is lines of '=' + the C-escaped value";
      return false;
    }
    flag->values.push_back(std::move(value));
  }
  return true;
}

std::string AbslUnparseFlag(const RepeatedFlag& flag) {
  std::vector<std::string> entries;
  for (const std::string& v : flag.values) entries.push_back(absl::StrCat("=", absl::CEscape(v)));
  return absl::StrJoin(entries, "\n");
}

std::string Wrap(absl::string_view text, int indent) {
  std::string out;
  int column = 0;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (column > indent && column + 1 + static_cast<int>(word.size()) > 100) {
      out += "\n";
      column = 0;
    }
    if (column == 0) {
      out.append(indent, ' ');
      column = indent;
    } else {
      out += ' ';
      ++column;
    }
    absl::StrAppend(&out, word);
    column += static_cast<int>(word.size());
  }
  return out + "\n";
}

std::string FlagHelp(const absl::CommandLineFlag& flag) {
  std::string default_value = flag.DefaultValue();
  if (default_value.empty()) default_value = "\"\"";
  return absl::StrCat("  --", flag.Name(), " (default: ", default_value, ")\n",
                      Wrap(flag.Help(), 6));
}

namespace {

void PrintProgramHelp(const Program& program, FILE* out) {
  std::string text = absl::StrCat("usage: ", program.name, " SUBCOMMAND [flags]\n\nsubcommands:\n");
  for (const Subcommand& sub : program.subcommands) {
    absl::StrAppend(&text, Wrap(sub.synopsis, 2), Wrap(sub.description, 6));
  }
  absl::StrAppend(&text, "\n'", program.name,
                  " SUBCOMMAND --help' lists the subcommand's flags.\n"
                  "Exit status: 0 ok, 1 runtime error, 2 usage error.\n");
  if (!program.footer.empty()) absl::StrAppend(&text, "\n", program.footer, "\n");
  std::fwrite(text.data(), 1, text.size(), out);
}

void PrintSubcommandHelp(const Subcommand& sub, FILE* out) {
  std::string text =
      absl::StrCat("usage:\n", Wrap(sub.synopsis, 2), "\n", Wrap(sub.description, 0), "\nflags:\n");
  for (const std::string& name : sub.flags) {
    if (const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name); flag != nullptr) {
      absl::StrAppend(&text, FlagHelp(*flag));
    }
  }
  std::fwrite(text.data(), 1, text.size(), out);
}

}  // namespace

std::string SetSubcommandFlags(const Subcommand& sub, const std::vector<std::string>& args,
                               ParsedArgs* parsed) {
  const auto allowed = [&](absl::string_view name) {
    return std::find(sub.flags.begin(), sub.flags.end(), name) != sub.flags.end();
  };
  // Every occurrence of a repeatable flag, by name; set once all arguments are read.
  std::vector<std::pair<absl::CommandLineFlag*, std::vector<std::string>>> repeated;
  bool flags_ended = false;
  for (size_t i = 0; i < args.size(); ++i) {
    absl::string_view arg = args[i];
    if (flags_ended || arg == "-" || !absl::StartsWith(arg, "-")) {
      parsed->positional.push_back(args[i]);
      continue;
    }
    if (arg == "--") {
      flags_ended = true;
      continue;
    }
    if (!absl::ConsumePrefix(&arg, "--")) absl::ConsumePrefix(&arg, "-");
    std::string name(arg);
    std::string value;
    bool has_value = false;
    if (const size_t eq = arg.find('='); eq != absl::string_view::npos) {
      name = std::string(arg.substr(0, eq));
      value = std::string(arg.substr(eq + 1));
      has_value = true;
    }
    absl::CommandLineFlag* flag = allowed(name) ? absl::FindCommandLineFlag(name) : nullptr;
    if (flag == nullptr && !has_value && absl::StartsWith(name, "no") && allowed(name.substr(2))) {
      flag = absl::FindCommandLineFlag(name.substr(2));
      if (flag != nullptr && flag->IsOfType<bool>()) {
        name = name.substr(2);
        value = "false";
        has_value = true;
      } else {
        flag = nullptr;
      }
    }
    if (flag == nullptr) return absl::StrCat("unknown flag --", name, " for '", sub.name, "'");
    if (!has_value) {
      if (flag->IsOfType<bool>()) {
        value = "true";
      } else if (i + 1 < args.size()) {
        value = args[++i];
      } else {
        return absl::StrCat("flag --", name, " needs a value");
      }
    }
    parsed->given.insert(name);
    if (flag->IsOfType<RepeatedFlag>()) {
      auto it = std::find_if(repeated.begin(), repeated.end(),
                             [&](const auto& r) { return r.first == flag; });
      if (it == repeated.end()) it = repeated.insert(repeated.end(), {flag, {}});
      it->second.push_back(value);
      continue;
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return absl::StrCat("bad value '", value, "' for --", name, ": ", error);
    }
  }
  for (const auto& [flag, values] : repeated) {
    std::string error;
    if (!flag->ParseFrom(AbslUnparseFlag(RepeatedFlag{values}), &error)) {
      return absl::StrCat("bad value for --", flag->Name(), ": ", error);
    }
  }
  if (parsed->positional.size() > sub.max_positional) {
    return absl::StrCat("unexpected argument '", parsed->positional[sub.max_positional], "'");
  }
  return "";
}

int UsageError(absl::string_view program, absl::string_view subcommand, absl::string_view message) {
  absl::FPrintF(stderr, "%s: %s\n", program, message);
  if (subcommand.empty()) {
    absl::FPrintF(stderr, "run '%s --help' for usage\n", program);
  } else {
    absl::FPrintF(stderr, "run '%s %s --help' for usage\n", program, subcommand);
  }
  return kExitUsage;
}

int RunProgram(const Program& program, int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  const auto is_help = [](absl::string_view a) {
    return a == "--help" || a == "-h" || a == "-help" || a == "--helpfull";
  };
  if (args.empty()) {
    PrintProgramHelp(program, stderr);
    return kExitUsage;
  }
  if (is_help(args[0]) || args[0] == "help") {
    PrintProgramHelp(program, stdout);
    return kExitOk;
  }
  const auto sub = std::find_if(program.subcommands.begin(), program.subcommands.end(),
                                [&](const Subcommand& s) { return args[0] == s.name; });
  if (sub == program.subcommands.end()) {
    std::vector<std::string> names;
    for (const Subcommand& s : program.subcommands) names.push_back(s.name);
    names.insert(names.end(), program.other_subcommands.begin(), program.other_subcommands.end());
    return UsageError(program.name, "",
                      absl::StrCat("unknown subcommand '", args[0], "' (expected ",
                                   absl::StrJoin(names, ", "), ")"));
  }
  args.erase(args.begin());
  if (std::any_of(args.begin(), args.end(), is_help)) {
    PrintSubcommandHelp(*sub, stdout);
    return kExitOk;
  }
  ParsedArgs parsed;
  if (const std::string error = SetSubcommandFlags(*sub, args, &parsed); !error.empty()) {
    return UsageError(program.name, sub->name, error);
  }
  return sub->run(parsed);
}

}  // namespace sdm::cli
