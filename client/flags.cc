#include "client/flags.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace sdm::client {
namespace {

// Prints a short default value (the help line's "(default: ...)").
struct DefaultText {
  std::string operator()(std::string* v) const {
    return v->empty() ? "" : absl::StrCat("\"", *v, "\"");
  }
  std::string operator()(int64_t* v) const { return absl::StrCat(*v); }
  std::string operator()(double* v) const { return absl::StrFormat("%g", *v); }
  std::string operator()(bool* v) const { return *v ? "true" : "false"; }
  std::string operator()(std::vector<std::string>* v) const {
    return v->empty() ? "" : absl::StrJoin(*v, ",");
  }
};

struct TypeName {
  const char* operator()(std::string*) const { return "string"; }
  const char* operator()(int64_t*) const { return "int"; }
  const char* operator()(double*) const { return "double"; }
  const char* operator()(bool*) const { return "bool"; }
  const char* operator()(std::vector<std::string>*) const { return "string, repeatable"; }
};

absl::StatusOr<bool> ParseBoolValue(absl::string_view name, absl::string_view value) {
  if (value == "true" || value == "1" || value == "yes") return true;
  if (value == "false" || value == "0" || value == "no") return false;
  return absl::InvalidArgumentError(
      absl::StrCat("--", name, ": expected true or false, got '", value, "'"));
}

}  // namespace

void FlagSet::Add(std::string name, Target target, std::string help) {
  if (Find(name) != nullptr) {
    std::fprintf(stderr, "FlagSet: flag --%s registered twice\n", name.c_str());
    std::abort();
  }
  Flag flag{std::move(name), target, std::move(help), std::visit(DefaultText{}, target)};
  flags_.push_back(std::move(flag));
}

void FlagSet::AddString(std::string name, std::string* out, std::string help) {
  Add(std::move(name), out, std::move(help));
}
void FlagSet::AddInt(std::string name, int64_t* out, std::string help) {
  Add(std::move(name), out, std::move(help));
}
void FlagSet::AddDouble(std::string name, double* out, std::string help) {
  Add(std::move(name), out, std::move(help));
}
void FlagSet::AddBool(std::string name, bool* out, std::string help) {
  Add(std::move(name), out, std::move(help));
}
void FlagSet::AddStringList(std::string name, std::vector<std::string>* out, std::string help) {
  Add(std::move(name), out, std::move(help));
}

FlagSet::Flag* FlagSet::Find(absl::string_view name) {
  for (Flag& f : flags_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

const FlagSet::Flag* FlagSet::Find(absl::string_view name) const {
  for (const Flag& f : flags_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

void FlagSet::SetDefaultText(absl::string_view name, std::string text) {
  if (Flag* f = Find(name)) f->default_text = std::move(text);
}

bool FlagSet::IsSet(absl::string_view name) const {
  const Flag* f = Find(name);
  return f != nullptr && f->set;
}

absl::StatusOr<std::vector<std::string>> FlagSet::Parse(absl::Span<const std::string> args) {
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      positional.insert(positional.end(), args.begin() + i + 1, args.end());
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') {
      positional.push_back(arg);
      continue;
    }
    absl::string_view body = arg;
    body.remove_prefix(absl::StartsWith(body, "--") ? 2 : 1);
    absl::string_view name = body;
    std::optional<std::string> value;
    if (const size_t eq = body.find('='); eq != absl::string_view::npos) {
      name = body.substr(0, eq);
      value = std::string(body.substr(eq + 1));
    }
    Flag* flag = Find(name);
    bool negated = false;
    if (flag == nullptr && absl::StartsWith(name, "no")) {
      Flag* positive = Find(name.substr(2));
      if (positive != nullptr && std::holds_alternative<bool*>(positive->target)) {
        flag = positive;
        negated = true;
      }
    }
    if (flag == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
    if (negated && value.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " takes no value"));
    }
    if (std::holds_alternative<bool*>(flag->target)) {
      bool v = !negated;
      if (value.has_value()) {
        absl::StatusOr<bool> parsed = ParseBoolValue(flag->name, *value);
        if (!parsed.ok()) return parsed.status();
        v = *parsed;
      }
      *std::get<bool*>(flag->target) = v;
      flag->set = true;
      continue;
    }
    if (!value.has_value()) {
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(absl::StrCat("--", flag->name, " needs a value"));
      }
      value = args[++i];
    }
    if (auto* s = std::get_if<std::string*>(&flag->target)) {
      **s = *value;
    } else if (auto* n = std::get_if<int64_t*>(&flag->target)) {
      if (!absl::SimpleAtoi(*value, *n)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", flag->name, ": '", *value, "' is not an integer"));
      }
    } else if (auto* d = std::get_if<double*>(&flag->target)) {
      if (!absl::SimpleAtod(*value, *d) || !std::isfinite(**d)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", flag->name, ": '", *value, "' is not a finite number"));
      }
    } else if (auto* list = std::get_if<std::vector<std::string>*>(&flag->target)) {
      // Given on the command line, a repeatable flag replaces its default.
      if (!flag->set) (*list)->clear();
      (*list)->push_back(*value);
    }
    flag->set = true;
  }
  return positional;
}

std::string FlagSet::Help() const {
  std::string out;
  for (const Flag& f : flags_) {
    absl::StrAppend(&out, "  --", f.name, " (", std::visit(TypeName{}, f.target));
    if (!f.default_text.empty()) absl::StrAppend(&out, ", default ", f.default_text);
    absl::StrAppend(&out, ")\n      ", f.help, "\n");
  }
  return out;
}

bool WantsHelp(absl::Span<const std::string> args) {
  for (const std::string& a : args) {
    if (a == "--") return false;
    if (a == "--help" || a == "-h" || a == "-help") return true;
  }
  return false;
}

}  // namespace sdm::client
