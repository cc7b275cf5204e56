#include "engine/weight_file_check.h"

#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace sdm {
namespace {

// "'a', 'b', 'c' (and 7 more)": a config mismatch can leave hundreds of names.
std::string NameList(const std::vector<std::string>& names) {
  constexpr size_t kShown = 5;
  std::vector<std::string> quoted;
  for (size_t i = 0; i < names.size() && i < kShown; ++i) quoted.push_back("'" + names[i] + "'");
  std::string out = absl::StrJoin(quoted, ", ");
  if (names.size() > kShown) absl::StrAppend(&out, " (and ", names.size() - kShown, " more)");
  return out;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

absl::Status CheckTensorsMatchSpec(absl::string_view label, const SafetensorsIndex& index,
                                   const std::vector<TensorSpec>& expected) {
  std::map<std::string, const SafetensorsEntry*, std::less<>> found;
  for (const SafetensorsEntry& e : index.tensors) found[e.name] = &e;
  std::map<std::string, const TensorSpec*, std::less<>> wanted;
  for (const TensorSpec& t : expected) wanted[t.name] = &t;

  std::vector<std::string> missing, unexpected;
  for (const TensorSpec& t : expected) {
    if (!found.contains(t.name)) missing.push_back(t.name);
  }
  for (const SafetensorsEntry& e : index.tensors) {
    if (!wanted.contains(e.name)) unexpected.push_back(e.name);
  }
  if (!missing.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(label, ": missing tensor", missing.size() > 1 ? "s " : " ", NameList(missing),
                     " required by the config", unexpected.empty() ? "" : "; unexpected tensor",
                     unexpected.empty() ? "" : (unexpected.size() > 1 ? "s " : " "),
                     unexpected.empty() ? "" : NameList(unexpected)));
  }
  if (!unexpected.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(label, ": unexpected tensor", unexpected.size() > 1 ? "s " : " ",
                     NameList(unexpected), " (not part of a model with this config)"));
  }
  for (const TensorSpec& t : expected) {
    const SafetensorsEntry& e = *found.find(t.name)->second;
    if (e.shape != t.shape) {
      return absl::InvalidArgumentError(absl::StrCat(label, ": tensor '", t.name, "' has shape ",
                                                     ShapeString(e.shape), ", expected ",
                                                     ShapeString(t.shape)));
    }
  }
  return absl::OkStatus();
}

}  // namespace sdm
