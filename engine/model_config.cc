#include "engine/model_config.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/json_parse.h"
#include "common/json_snippet.h"
#include "engine/tokenizer.h"
#include "engine/weight_spec.h"
#include "kernels/common/sdm_addressing_math.h"
#include "nlohmann/json.hpp"

namespace sdm {
namespace {

using json = nlohmann::json;

absl::Status Invalid(absl::string_view field, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat("config field '", field, "': ", message));
}

// Bounds on a config's sizes (FinalizeModelConfig): widths (dim, heads, head dims, their
// products), the vocabulary (token ids are int32), windows and the parameter total.
constexpr int64_t kMaxConfigWidth = int64_t{1} << 17;
constexpr int64_t kMaxConfigVocab = (int64_t{1} << 31) - 1;
constexpr int64_t kMaxConfigWindow = int64_t{1} << 24;
constexpr int64_t kMaxConfigParameters = int64_t{1} << 50;

std::string TooLarge(int64_t limit) { return absl::StrCat("must be at most ", limit); }

// ---- Typed getters: each rejects a value of the wrong JSON type by field name. ----
// A rejected value is quoted by JsonSnippet, never dump(): a config may nest a value a million
// levels deep, which dump() would recurse through until the stack overflows.

absl::Status GetInt(const json& j, absl::string_view field, int64_t& out) {
  if (j.is_number_integer()) {
    out = j.get<int64_t>();
    return absl::OkStatus();
  }
  if (j.is_number_float()) {
    double d = j.get<double>();
    if (std::floor(d) == d && std::abs(d) < 9e15) {
      out = static_cast<int64_t>(d);
      return absl::OkStatus();
    }
  }
  return Invalid(field, absl::StrCat("expected an integer, got ", JsonSnippet(j)));
}

absl::Status GetOptInt(const json& j, absl::string_view field, std::optional<int64_t>& out) {
  if (j.is_null()) {
    out.reset();
    return absl::OkStatus();
  }
  int64_t v = 0;
  if (auto s = GetInt(j, field, v); !s.ok()) return s;
  out = v;
  return absl::OkStatus();
}

absl::Status GetDouble(const json& j, absl::string_view field, double& out) {
  if (!j.is_number()) {
    return Invalid(field, absl::StrCat("expected a number, got ", JsonSnippet(j)));
  }
  out = j.get<double>();
  if (!std::isfinite(out)) return Invalid(field, "must be finite");
  return absl::OkStatus();
}

absl::Status GetOptDouble(const json& j, absl::string_view field, std::optional<double>& out) {
  if (j.is_null()) {
    out.reset();
    return absl::OkStatus();
  }
  double v = 0;
  if (auto s = GetDouble(j, field, v); !s.ok()) return s;
  out = v;
  return absl::OkStatus();
}

absl::Status GetBool(const json& j, absl::string_view field, bool& out) {
  if (!j.is_boolean()) {
    return Invalid(field, absl::StrCat("expected true/false, got ", JsonSnippet(j)));
  }
  out = j.get<bool>();
  return absl::OkStatus();
}

absl::Status GetString(const json& j, absl::string_view field, std::string& out) {
  if (!j.is_string()) {
    return Invalid(field, absl::StrCat("expected a string, got ", JsonSnippet(j)));
  }
  out = j.get<std::string>();
  return absl::OkStatus();
}

// A layer spec: "all", a list of indices, a comma-separated string, one integer, or null/empty.
// Bounds and duplicates are checked here; the partition is checked in FinalizeModelConfig.
absl::Status GetLayerSpec(const json& j, absl::string_view field, int64_t n_layers,
                          std::vector<int64_t>& out) {
  out.clear();
  std::vector<int64_t> idx;
  if (j.is_null()) return absl::OkStatus();
  if (j.is_boolean()) return Invalid(field, "a boolean is not a layer spec");
  if (j.is_string()) {
    std::string s(absl::StripAsciiWhitespace(j.get<std::string>()));
    if (s.empty()) return absl::OkStatus();
    if (absl::AsciiStrToLower(s) == "all") {
      for (int64_t i = 0; i < n_layers; ++i) out.push_back(i);
      return absl::OkStatus();
    }
    for (absl::string_view part : absl::StrSplit(s, ',')) {
      int64_t v = 0;
      if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &v)) {
        return Invalid(field, absl::StrCat("invalid layer index '", part, "'"));
      }
      idx.push_back(v);
    }
  } else if (j.is_number()) {
    int64_t v = 0;
    if (auto s = GetInt(j, field, v); !s.ok()) return s;
    idx.push_back(v);
  } else if (j.is_array()) {
    for (const json& e : j) {
      int64_t v = 0;
      if (e.is_boolean()) return Invalid(field, "a boolean is not a layer index");
      if (auto s = GetInt(e, field, v); !s.ok()) return s;
      idx.push_back(v);
    }
  } else {
    return Invalid(
        field, absl::StrCat("expected \"all\" or a list of layer indices, got ", JsonSnippet(j)));
  }
  std::set<int64_t> seen;
  for (int64_t i : idx) {
    if (i < 0 || i >= n_layers) {
      return Invalid(field,
                     absl::StrCat("layer index ", i, " out of range for n_layers=", n_layers));
    }
    if (!seen.insert(i).second) return Invalid(field, absl::StrCat("duplicate layer index ", i));
  }
  out.assign(seen.begin(), seen.end());
  return absl::OkStatus();
}

absl::StatusOr<AddressActivation> ParseActivation(absl::string_view field, const std::string& s) {
  if (s == "Softmax") return AddressActivation::kSoftmax;
  if (s == "l2_normalize") return AddressActivation::kL2Normalize;
  if (s == "Identity") return AddressActivation::kIdentity;
  if (s == "Sigmoid") return AddressActivation::kSigmoid;
  if (s == "ReLU") return AddressActivation::kRelu;
  return Invalid(field, absl::StrCat("unsupported activation '", s,
                                     "' (supported: Softmax, l2_normalize, Identity, Sigmoid, "
                                     "ReLU)"));
}

absl::string_view ActivationName(AddressActivation a) {
  switch (a) {
    case AddressActivation::kSoftmax:
      return "Softmax";
    case AddressActivation::kL2Normalize:
      return "l2_normalize";
    case AddressActivation::kIdentity:
      return "Identity";
    case AddressActivation::kSigmoid:
      return "Sigmoid";
    case AddressActivation::kRelu:
      return "ReLU";
  }
  return "Softmax";
}

absl::Status ParseSdmArgs(const json& j, SdmArgs& a) {
  if (!j.is_object()) return Invalid("sdm_args", "expected an object");
  for (const auto& [key, v] : j.items()) {
    const std::string field = "sdm_args." + key;
    absl::Status s;
    if (key == "dim") {
      // Set by the reference from the model dim; accepted and ignored.
    } else if (key == "num_heads") {
      s = GetInt(v, field, a.num_heads);
    } else if (key == "slots_per_head") {
      s = GetInt(v, field, a.slots_per_head);
    } else if (key == "num_writes") {
      s = GetInt(v, field, a.num_writes);
    } else if (key == "num_reads") {
      s = GetInt(v, field, a.num_reads);
    } else if (key == "read_act" || key == "write_act") {
      std::string name;
      s = GetString(v, field, name);
      if (s.ok()) {
        auto act = ParseActivation(field, name);
        if (!act.ok()) return act.status();
        (key == "read_act" ? a.read_act : a.write_act) = *act;
      }
    } else if (key == "read_act_scale") {
      s = GetDouble(v, field, a.read_act_scale);
    } else if (key == "write_act_scale") {
      s = GetDouble(v, field, a.write_act_scale);
    } else if (key == "normalize_readings") {
      s = GetBool(v, field, a.normalize_readings);
    } else if (key == "norm_eps") {
      s = GetDouble(v, field, a.norm_eps);
    } else if (key == "backprop_on_memory") {
      s = GetBool(v, field, a.backprop_on_memory);
    } else if (key == "output_gate") {
      s = GetBool(v, field, a.output_gate);
    } else if (key == "query_batchnorm") {
      s = GetBool(v, field, a.query_batchnorm);
    } else if (key == "key_weighted_decay") {
      s = GetBool(v, field, a.key_weighted_decay);
    } else if (key == "update_rule") {
      std::string rule;
      s = GetString(v, field, rule);
      if (s.ok()) {
        if (rule == "shared_residual") {
          a.update_rule = UpdateRule::kSharedResidual;
        } else if (rule == "slot_residual") {
          a.update_rule = UpdateRule::kSlotResidual;
        } else {
          return Invalid(field, absl::StrCat("unknown update rule '", rule,
                                             "' (shared_residual or slot_residual)"));
        }
      }
    } else if (key == "memory_block_size") {
      s = GetInt(v, field, a.memory_block_size);
    } else if (key == "dt_bias_init") {
      s = GetDouble(v, field, a.dt_bias_init);
    } else if (key == "A_init_range") {
      if (!v.is_array() || v.size() != 2) return Invalid(field, "expected [min, max]");
      s = GetDouble(v[0], field, a.a_init_min);
      if (s.ok()) s = GetDouble(v[1], field, a.a_init_max);
    } else if (key == "snapshot_quant") {
      s = GetString(v, field, a.snapshot_quant);
    } else if (key == "log_memory_access_stats") {
      s = GetBool(v, field, a.log_memory_access_stats);
    } else if (key == "log_memory_norms") {
      s = GetBool(v, field, a.log_memory_norms);
    } else {
      return Invalid(field, "unknown field");
    }
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ParseTokenizer(const json& j, TokenizerConfig& t) {
  if (!j.is_object()) return Invalid("tokenizer", "expected an object {\"name\": ...}");
  for (const auto& [key, v] : j.items()) {
    absl::Status s;
    if (key == "name") {
      s = GetString(v, "tokenizer.name", t.name);
    } else if (key == "path") {
      if (v.is_null()) {
        t.path.clear();
      } else {
        s = GetString(v, "tokenizer.path", t.path);
      }
    } else {
      return Invalid("tokenizer." + key, "unknown field");
    }
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

json LayerList(const std::vector<int64_t>& v) { return json(v); }

}  // namespace

absl::string_view LayerTypeName(LayerType type) {
  switch (type) {
    case LayerType::kAttn:
      return "attn";
    case LayerType::kSwa:
      return "swa";
    case LayerType::kSdm:
      return "sdm";
  }
  return "?";
}

int64_t FfnHiddenDim(const ModelConfig& c) {
  int64_t hidden = static_cast<int64_t>(2 * (4 * c.dim) / 3);
  if (c.ffn_dim_multiplier.has_value()) {
    hidden = static_cast<int64_t>(*c.ffn_dim_multiplier * static_cast<double>(hidden));
  }
  return c.multiple_of * ((hidden + c.multiple_of - 1) / c.multiple_of);
}

AttentionGeometry AttentionGeometryOf(const ModelConfig& c, int64_t layer) {
  AttentionGeometry g;
  if (c.layer_types[layer] == LayerType::kSwa) {
    // Reference fallbacks: a custom swa_n_heads defaults swa_n_kv_heads to itself (MHA).
    g.n_heads = c.swa_n_heads.has_value()
                    ? *c.swa_n_heads
                    : (c.n_heads.has_value() ? *c.n_heads : c.dim / c.head_dim.value_or(1));
    if (c.swa_n_kv_heads.has_value()) {
      g.n_kv_heads = *c.swa_n_kv_heads;
    } else if (c.swa_n_heads.has_value()) {
      g.n_kv_heads = g.n_heads;
    } else {
      g.n_kv_heads = c.n_kv_heads.value_or(g.n_heads);
    }
    g.head_dim =
        c.swa_head_dim.has_value() ? *c.swa_head_dim : (g.n_heads > 0 ? c.dim / g.n_heads : 0);
    g.window = c.swa_window.value_or(0);
  } else {
    g.head_dim = c.head_dim.has_value() ? *c.head_dim : c.dim / c.n_heads.value_or(1);
    g.n_heads = c.n_heads.has_value() ? *c.n_heads : c.dim / std::max<int64_t>(1, g.head_dim);
    g.n_kv_heads = c.n_kv_heads.value_or(g.n_heads);
    g.window = 0;
  }
  return g;
}

SdmGeometry SdmGeometryOf(const ModelConfig& c) {
  SdmGeometry g;
  g.heads = c.sdm.num_heads;
  g.slots_per_head = c.sdm.slots_per_head;
  g.side = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(g.slots_per_head))));
  g.head_width = g.heads > 0 ? c.dim / g.heads : 0;
  g.key_size = g.heads * 2 * g.side;
  g.writes = kernels::AddressCount(c.sdm.num_writes, g.side);
  return g;
}

namespace {

// The parameter total and one session's SDM state, with overflow checks: the tensors of one
// layer of each type present (layers of one type have the same shapes) times the number of such
// layers, plus the rest. Precondition: layer types resolved and every width bounded (so that
// each shape is computed without overflow).
absl::Status CheckParameterCount(const ModelConfig& c) {
  ModelConfig one = c;
  one.layer_types.clear();
  int64_t count[3] = {0, 0, 0};
  for (const LayerType t : c.layer_types) {
    if (count[static_cast<int>(t)]++ == 0) one.layer_types.push_back(t);
  }
  one.n_layers = static_cast<int64_t>(one.layer_types.size());
  const WeightSpec spec = BuildWeightSpec(one);
  int64_t total = 0;
  bool overflow = false;
  const auto add = [&](const WeightSpec& s, size_t index, int64_t times) {
    int64_t n = times;
    for (const int64_t d : s.tensors[index].shape) overflow |= __builtin_mul_overflow(n, d, &n);
    overflow |= __builtin_add_overflow(total, n, &total);
  };
  std::vector<bool> in_layer(spec.tensors.size(), false);
  for (size_t l = 0; l < spec.roles.layers.size(); ++l) {
    const int64_t times = count[static_cast<int>(one.layer_types[l])];
    const std::string prefix = absl::StrCat("layers.", l, ".");
    for (size_t i = 0; i < spec.tensors.size(); ++i) {
      if (absl::StartsWith(spec.tensors[i].name, prefix)) {
        in_layer[i] = true;
        add(spec, i, times);
      }
    }
  }
  for (size_t i = 0; i < spec.tensors.size(); ++i) {
    if (!in_layer[i]) add(spec, i, 1);
  }
  int64_t sdm_state = 0;  // SdmStateElements (slots x dim is bounded when there are SDM layers)
  if (const int64_t n_sdm = count[static_cast<int>(LayerType::kSdm)]; n_sdm > 0) {
    overflow |= __builtin_mul_overflow(n_sdm, c.sdm.slots_per_head * c.dim, &sdm_state);
  }
  if (overflow || total > kMaxConfigParameters || sdm_state > kMaxConfigParameters) {
    return Invalid("n_layers", absl::StrCat("the model would have more than ", kMaxConfigParameters,
                                            " parameters or elements of "
                                            "SDM state per session"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status FinalizeModelConfig(ModelConfig& c) {
  if (c.dim <= 0) return Invalid("dim", "must be positive");
  if (c.n_layers <= 0) return Invalid("n_layers", "must be positive");
  if (c.vocab_size <= 0) return Invalid("vocab_size", "must be positive");
  if (c.multiple_of <= 0) return Invalid("multiple_of", "must be positive");
  if (!(c.norm_eps > 0)) return Invalid("norm_eps", "must be positive");
  if (!(c.rope_theta > 0)) return Invalid("rope_theta", "must be positive");
  if (c.ffn_dim_multiplier.has_value() && !(*c.ffn_dim_multiplier > 0)) {
    return Invalid("ffn_dim_multiplier", "must be positive");
  }
  // Bounds far above any model, so that no size derived from a config overflows (FfnHiddenDim,
  // tensor shapes, parameter counts, state sizes; found by tests/fuzz/model_config_fuzzer.cc).
  if (c.dim > kMaxConfigWidth) return Invalid("dim", TooLarge(kMaxConfigWidth));
  if (c.multiple_of > kMaxConfigWidth) return Invalid("multiple_of", TooLarge(kMaxConfigWidth));
  if (c.vocab_size > kMaxConfigVocab) return Invalid("vocab_size", TooLarge(kMaxConfigVocab));
  if (c.ffn_dim_multiplier.has_value() && *c.ffn_dim_multiplier > 16) {
    return Invalid("ffn_dim_multiplier", TooLarge(16));
  }
  // A positive multiplier can still truncate the hidden size to 0 (only it can: without one,
  // int(8 * dim / 3) >= 2), and a projection with no hidden units writes nothing.
  if (const int64_t hidden = FfnHiddenDim(c); hidden < 1) {
    return Invalid(
        "ffn_dim_multiplier",
        absl::StrCat(c.ffn_dim_multiplier.value_or(1.0), " gives an FFN hidden size of ", hidden,
                     " (int(multiplier * int(8 * dim / 3)) must be at least 1)"));
  }
  for (auto [field, v] : {std::pair{"n_heads", c.n_heads},
                          {"n_kv_heads", c.n_kv_heads},
                          {"head_dim", c.head_dim},
                          {"swa_n_heads", c.swa_n_heads},
                          {"swa_n_kv_heads", c.swa_n_kv_heads},
                          {"swa_head_dim", c.swa_head_dim}}) {
    if (v.has_value() && *v > kMaxConfigWidth) return Invalid(field, TooLarge(kMaxConfigWidth));
  }
  if (c.swa_window.has_value() && *c.swa_window > kMaxConfigWindow) {
    return Invalid("swa_window", TooLarge(kMaxConfigWindow));
  }
  if (c.max_seqlen > kMaxConfigWindow) return Invalid("max_seqlen", TooLarge(kMaxConfigWindow));
  if (c.sdm.num_writes > 1024) return Invalid("sdm_args.num_writes", TooLarge(1024));
  if (c.sdm.num_reads > 1024) return Invalid("sdm_args.num_reads", TooLarge(1024));

  // Layer lists must partition range(n_layers) exactly.
  for (auto* list : {&c.attn_at, &c.swa_at, &c.sdm_at}) {
    for (int64_t i : *list) {
      if (i < 0 || i >= c.n_layers) {
        return Invalid("attn_at/swa_at/sdm_at",
                       absl::StrCat("layer index ", i, " out of range for n_layers=", c.n_layers));
      }
    }
  }
  if (c.attn_at.empty() && c.swa_at.empty() && c.sdm_at.empty()) {
    return Invalid("attn_at/swa_at/sdm_at",
                   "no layer types given: every layer must appear in exactly one of attn_at, "
                   "swa_at, sdm_at (or use \"all\")");
  }
  std::vector<int> count(c.n_layers, 0);
  c.layer_types.assign(c.n_layers, LayerType::kAttn);
  const std::pair<std::vector<int64_t>*, LayerType> lists[] = {
      {&c.attn_at, LayerType::kAttn}, {&c.swa_at, LayerType::kSwa}, {&c.sdm_at, LayerType::kSdm}};
  for (const auto& [list, type] : lists) {
    std::sort(list->begin(), list->end());
    for (int64_t i : *list) {
      ++count[i];
      c.layer_types[i] = type;
    }
  }
  std::vector<int64_t> missing, overlap;
  for (int64_t i = 0; i < c.n_layers; ++i) {
    if (count[i] == 0) missing.push_back(i);
    if (count[i] > 1) overlap.push_back(i);
  }
  if (!overlap.empty()) {
    return Invalid("attn_at/swa_at/sdm_at",
                   absl::StrCat("layers [", absl::StrJoin(overlap, ","),
                                "] appear in more than one list; the lists must partition the "
                                "layers"));
  }
  if (!missing.empty()) {
    return Invalid("attn_at/swa_at/sdm_at",
                   absl::StrCat("layers [", absl::StrJoin(missing, ","),
                                "] are in none of the lists; the lists must partition the "
                                "layers"));
  }

  bool has_attn = false, has_swa = false, has_sdm = false;
  for (LayerType t : c.layer_types) {
    has_attn |= t == LayerType::kAttn;
    has_swa |= t == LayerType::kSwa;
    has_sdm |= t == LayerType::kSdm;
  }
  if (has_attn || has_swa) {
    if (!c.head_dim.has_value() && !c.n_heads.has_value()) {
      return Invalid("n_heads", "attention layers need n_heads or head_dim");
    }
    if (c.n_heads.has_value() && *c.n_heads <= 0) return Invalid("n_heads", "must be positive");
    if (c.head_dim.has_value() && *c.head_dim <= 0) return Invalid("head_dim", "must be positive");
    if (c.n_kv_heads.has_value() && *c.n_kv_heads <= 0) {
      return Invalid("n_kv_heads", "must be positive");
    }
  }
  if (has_swa) {
    if (!c.swa_window.has_value() || *c.swa_window <= 0) {
      return Invalid("swa_window", "swa layers need a positive swa_window");
    }
    for (auto [field, v] : {std::pair{"swa_n_heads", c.swa_n_heads},
                            {"swa_n_kv_heads", c.swa_n_kv_heads},
                            {"swa_head_dim", c.swa_head_dim}}) {
      if (v.has_value() && *v <= 0) return Invalid(field, "must be positive");
    }
  }
  for (int64_t i = 0; i < c.n_layers; ++i) {
    if (c.layer_types[i] == LayerType::kSdm) continue;
    AttentionGeometry g = AttentionGeometryOf(c, i);
    const std::string prefix = c.layer_types[i] == LayerType::kSwa ? "swa_" : "";
    if (g.n_heads <= 0 || g.head_dim <= 0 || g.n_kv_heads <= 0) {
      return Invalid(prefix + "n_heads",
                     absl::StrCat("layer ", i, " resolves to n_heads=", g.n_heads,
                                  " head_dim=", g.head_dim, " n_kv_heads=", g.n_kv_heads));
    }
    if (g.n_heads % g.n_kv_heads != 0) {
      return Invalid(prefix + "n_kv_heads",
                     absl::StrCat("layer ", i, ": n_heads=", g.n_heads,
                                  " is not divisible by n_kv_heads=", g.n_kv_heads));
    }
    if (g.head_dim % 2 != 0) {
      return Invalid(prefix + "head_dim", absl::StrCat("layer ", i, ": head_dim=", g.head_dim,
                                                       " must be even for RoPE"));
    }
    if (g.n_heads * g.head_dim > kMaxConfigWidth) {  // each at most kMaxConfigWidth: no overflow
      return Invalid(prefix + "n_heads",
                     absl::StrCat("layer ", i, ": n_heads x head_dim = ", g.n_heads * g.head_dim,
                                  " is ", TooLarge(kMaxConfigWidth)));
    }
  }
  if (has_sdm) {
    const SdmArgs& a = c.sdm;
    if (a.num_heads <= 0) return Invalid("sdm_args.num_heads", "must be positive");
    if (c.dim % a.num_heads != 0) {
      return Invalid("sdm_args.num_heads",
                     absl::StrCat("dim=", c.dim, " is not divisible by num_heads=", a.num_heads));
    }
    if (a.slots_per_head <= 0) return Invalid("sdm_args.slots_per_head", "must be positive");
    SdmGeometry g = SdmGeometryOf(c);
    if (g.side * g.side != a.slots_per_head) {
      return Invalid(
          "sdm_args.slots_per_head",
          absl::StrCat(a.slots_per_head, " is not a perfect square (product keys need s^2 slots)"));
    }
    if (a.slots_per_head > (int64_t{1} << 30)) {
      return Invalid("sdm_args.slots_per_head", "larger than 2^30 slots per head");
    }
    // A layer's slots are indexed head * slots_per_head + slot in 32 bits: the device slot tables
    // (kernels/cuda/sdm.h) and the session state format (docs/state-format.md).
    if (g.heads * a.slots_per_head >= (int64_t{1} << 31)) {
      return Invalid("sdm_args.slots_per_head",
                     absl::StrCat(g.heads, " heads x ", a.slots_per_head,
                                  " slots reach 2^31 slots per layer (indices are 32-bit)"));
    }
    // One layer's M0 (heads x slots x head_width = slots x dim elements), bounded with the rest.
    if (a.slots_per_head * c.dim > (int64_t{1} << 40)) {  // 2^30 x 2^17 at most: no overflow
      return Invalid("sdm_args.slots_per_head",
                     absl::StrCat(a.slots_per_head, " slots per head x dim ", c.dim,
                                  " is more than 2^40 elements of memory per layer"));
    }
    if (a.num_writes <= 0) return Invalid("sdm_args.num_writes", "must be positive");
    if (a.num_reads <= 0) return Invalid("sdm_args.num_reads", "must be positive");
    if (!(a.norm_eps > 0)) return Invalid("sdm_args.norm_eps", "must be positive");
  }
  if (absl::Status s = CheckParameterCount(c); !s.ok()) return s;
  if (c.tokenizer.name == "bytes") {
    if (c.vocab_size < 258) {
      return Invalid("vocab_size", absl::StrCat("the bytes tokenizer needs vocab_size >= 258, got ",
                                                c.vocab_size));
    }
  } else if (c.tokenizer.name == "sp" || c.tokenizer.name == "sentencepiece") {
    c.tokenizer.name = "sp";
    if (c.tokenizer.path.empty()) c.tokenizer.path = "tokenizer.model";
  } else {
    return Invalid("tokenizer.name",
                   absl::StrCat("unknown tokenizer '", c.tokenizer.name, "' (bytes or sp)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view text) {
  JsonParse parsed = ParseJsonNoticingDuplicateKeys(std::string_view(text.data(), text.size()));
  json& j = parsed.value;
  if (j.is_discarded()) return absl::InvalidArgumentError("config.json is not valid JSON");
  if (!j.is_object()) return absl::InvalidArgumentError("config.json must hold a JSON object");
  // nlohmann keeps the last of the two silently: a hand-edited duplicate of a field that changes
  // no shape (rope_theta, norm_eps) would change the model's output with no message.
  if (!parsed.duplicate_key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: the key '", absl::CHexEscape(parsed.duplicate_key.substr(0, 100)),
        "' appears twice in one object", parsed.duplicate_depth > 1 ? " (a nested one)" : "",
        "; keep one"));
  }
  ModelConfig c;
  // n_layers first: the layer specs are checked against it.
  if (j.contains("n_layers")) {
    if (auto s = GetInt(j["n_layers"], "n_layers", c.n_layers); !s.ok()) return s;
  }
  if (c.n_layers <= 0 || c.n_layers > 100000) return Invalid("n_layers", "must be in [1, 100000]");
  for (const auto& [key, v] : j.items()) {
    absl::Status s;
    if (key == "n_layers") {
      continue;
    } else if (key == "dim") {
      s = GetInt(v, key, c.dim);
    } else if (key == "head_dim") {
      s = GetOptInt(v, key, c.head_dim);
    } else if (key == "n_heads") {
      s = GetOptInt(v, key, c.n_heads);
    } else if (key == "n_kv_heads") {
      s = GetOptInt(v, key, c.n_kv_heads);
    } else if (key == "ffn_dim_multiplier") {
      s = GetOptDouble(v, key, c.ffn_dim_multiplier);
    } else if (key == "multiple_of") {
      s = GetInt(v, key, c.multiple_of);
    } else if (key == "norm_eps") {
      s = GetDouble(v, key, c.norm_eps);
    } else if (key == "rope_theta") {
      s = GetDouble(v, key, c.rope_theta);
    } else if (key == "vocab_size") {
      s = GetInt(v, key, c.vocab_size);
    } else if (key == "weight_tying") {
      s = GetBool(v, key, c.weight_tying);
    } else if (key == "attn_at") {
      s = GetLayerSpec(v, key, c.n_layers, c.attn_at);
    } else if (key == "swa_at") {
      s = GetLayerSpec(v, key, c.n_layers, c.swa_at);
    } else if (key == "sdm_at") {
      s = GetLayerSpec(v, key, c.n_layers, c.sdm_at);
    } else if (key == "swa_window") {
      s = GetOptInt(v, key, c.swa_window);
    } else if (key == "swa_n_heads") {
      s = GetOptInt(v, key, c.swa_n_heads);
    } else if (key == "swa_n_kv_heads") {
      s = GetOptInt(v, key, c.swa_n_kv_heads);
    } else if (key == "swa_head_dim") {
      s = GetOptInt(v, key, c.swa_head_dim);
    } else if (key == "attn_gate") {
      s = GetBool(v, key, c.attn_gate);
    } else if (key == "sdm_args") {
      s = ParseSdmArgs(v, c.sdm);
    } else if (key == "tokenizer") {
      s = ParseTokenizer(v, c.tokenizer);
    } else if (key == "init_base_std") {
      s = GetOptDouble(v, key, c.init_base_std);
    } else if (key == "init_std_factor") {
      s = GetString(v, key, c.init_std_factor);
    } else if (key == "max_seqlen") {
      s = GetInt(v, key, c.max_seqlen);
    } else if (key == "seed") {
      s = GetInt(v, key, c.seed);
    } else {
      return Invalid(key, "unknown field");
    }
    if (!s.ok()) return s;
  }
  if (auto s = FinalizeModelConfig(c); !s.ok()) return s;
  return c;
}

namespace {

json ToJson(const ModelConfig& c) {
  auto opt = [](const auto& o) -> json { return o.has_value() ? json(*o) : json(nullptr); };
  json sdm = {
      {"num_heads", c.sdm.num_heads},
      {"slots_per_head", c.sdm.slots_per_head},
      {"num_writes", c.sdm.num_writes},
      {"num_reads", c.sdm.num_reads},
      {"read_act", ActivationName(c.sdm.read_act)},
      {"write_act", ActivationName(c.sdm.write_act)},
      {"read_act_scale", c.sdm.read_act_scale},
      {"write_act_scale", c.sdm.write_act_scale},
      {"normalize_readings", c.sdm.normalize_readings},
      {"norm_eps", c.sdm.norm_eps},
      {"backprop_on_memory", c.sdm.backprop_on_memory},
      {"output_gate", c.sdm.output_gate},
      {"query_batchnorm", c.sdm.query_batchnorm},
      {"key_weighted_decay", c.sdm.key_weighted_decay},
      {"update_rule",
       c.sdm.update_rule == UpdateRule::kSlotResidual ? "slot_residual" : "shared_residual"},
      {"memory_block_size", c.sdm.memory_block_size},
      {"dt_bias_init", c.sdm.dt_bias_init},
      {"A_init_range", {c.sdm.a_init_min, c.sdm.a_init_max}},
      {"snapshot_quant", c.sdm.snapshot_quant},
      {"log_memory_access_stats", c.sdm.log_memory_access_stats},
      {"log_memory_norms", c.sdm.log_memory_norms},
  };
  json tok = {{"name", c.tokenizer.name}};
  if (!c.tokenizer.path.empty()) tok["path"] = c.tokenizer.path;
  return json{
      {"dim", c.dim},
      {"n_layers", c.n_layers},
      {"head_dim", opt(c.head_dim)},
      {"n_heads", opt(c.n_heads)},
      {"n_kv_heads", opt(c.n_kv_heads)},
      {"ffn_dim_multiplier", opt(c.ffn_dim_multiplier)},
      {"multiple_of", c.multiple_of},
      {"norm_eps", c.norm_eps},
      {"rope_theta", c.rope_theta},
      {"vocab_size", c.vocab_size},
      {"weight_tying", c.weight_tying},
      {"attn_at", LayerList(c.attn_at)},
      {"swa_at", LayerList(c.swa_at)},
      {"sdm_at", LayerList(c.sdm_at)},
      {"swa_window", opt(c.swa_window)},
      {"swa_n_heads", opt(c.swa_n_heads)},
      {"swa_n_kv_heads", opt(c.swa_n_kv_heads)},
      {"swa_head_dim", opt(c.swa_head_dim)},
      {"attn_gate", c.attn_gate},
      {"sdm_args", sdm},
      {"tokenizer", tok},
      {"init_base_std", opt(c.init_base_std)},
      {"init_std_factor", c.init_std_factor},
      {"max_seqlen", c.max_seqlen},
      {"seed", c.seed},
  };
}

}  // namespace

std::string ModelConfigToJson(const ModelConfig& c) { return ToJson(c).dump(2) + "\n"; }

absl::Status ApplyConfigOverride(ModelConfig& c, absl::string_view assignment) {
  return ApplyConfigOverrides(c, {std::string(assignment)});
}

absl::Status ApplyConfigOverrides(ModelConfig& c, const std::vector<std::string>& assignments) {
  json j = ToJson(c);
  for (absl::string_view assignment : assignments) {
    size_t eq = assignment.find('=');
    if (eq == absl::string_view::npos || eq == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("override '", assignment, "' is not of the form key=value"));
    }
    std::string key(assignment.substr(0, eq));
    absl::string_view raw = assignment.substr(eq + 1);
    json value = json::parse(raw.begin(), raw.end(), nullptr, /*allow_exceptions=*/false);
    if (value.is_discarded()) {
      // A bare string (needs no quotes). JSON text must be UTF-8: the config could not be
      // written (nlohmann's dump() throws on other bytes).
      if (SanitizeUtf8(raw, /*final=*/true, nullptr) != raw) {
        return absl::InvalidArgumentError(absl::StrCat("override '", absl::CHexEscape(assignment),
                                                       "': the value is not valid UTF-8"));
      }
      value = std::string(raw);
    }
    json* node = &j;
    std::vector<std::string> parts = absl::StrSplit(key, '.');
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      if (!node->contains(parts[i]) || !(*node)[parts[i]].is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat("override key '", key, "': no section '", parts[i], "'"));
      }
      node = &(*node)[parts[i]];
    }
    // tokenizer.path is omitted from the JSON while empty, yet settable.
    if (!node->contains(parts.back()) && key != "tokenizer.path") {
      return absl::InvalidArgumentError(absl::StrCat("override key '", key, "': unknown field"));
    }
    (*node)[parts.back()] = value;
  }
  // Finalized once, after every assignment: layer lists are re-derived from the new values.
  auto parsed = ParseModelConfig(j.dump());
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(assignments.size() == 1 ? "override '" : "overrides '",
                     absl::StrJoin(assignments, "', '"), "': ", parsed.status().message()));
  }
  c = *std::move(parsed);
  return absl::OkStatus();
}

int64_t SdmStateElements(const ModelConfig& c) {
  int64_t n_sdm = 0;
  for (LayerType t : c.layer_types) n_sdm += t == LayerType::kSdm;
  if (n_sdm == 0) return 0;
  SdmGeometry g = SdmGeometryOf(c);
  return n_sdm * g.heads * g.slots_per_head * g.head_width;
}

int64_t FullAttentionKvElementsPerToken(const ModelConfig& c) {
  int64_t total = 0;
  for (int64_t i = 0; i < c.n_layers; ++i) {
    if (c.layer_types[i] != LayerType::kAttn) continue;
    AttentionGeometry g = AttentionGeometryOf(c, i);
    total += 2 * g.n_kv_heads * g.head_dim;
  }
  return total;
}

// ---- Presets (docs/model-spec.md §8; the reference's apps/main/configs) ----

namespace {

std::vector<int64_t> Range(int64_t n) {
  std::vector<int64_t> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(i);
  return v;
}

// Every fourth layer (3, 7, 11, ...) is global; the rest are SWA.
void ThreeToOne(ModelConfig& c, bool sdm_global) {
  std::vector<int64_t> global, local;
  for (int64_t i = 0; i < c.n_layers; ++i) (i % 4 == 3 ? global : local).push_back(i);
  c.swa_at = local;
  (sdm_global ? c.sdm_at : c.attn_at) = global;
}

ModelConfig Debug(bool sdm) {
  ModelConfig c;
  c.dim = 1024;
  c.n_layers = 8;
  c.n_heads = 8;
  c.vocab_size = 258;
  if (sdm) {
    c.attn_at = {0, 2, 4, 6};
    c.sdm_at = {1, 3, 5, 7};
  } else {
    c.attn_at = Range(8);
  }
  c.sdm.slots_per_head = 4096;
  c.sdm.num_heads = 1;
  c.sdm.num_reads = 32;
  c.sdm.num_writes = 32;
  c.sdm.memory_block_size = 64;
  c.sdm.output_gate = true;
  c.sdm.backprop_on_memory = false;
  return c;
}

ModelConfig Scale(int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads, bool sdm,
                  int64_t sdm_heads, bool gate) {
  ModelConfig c;
  c.dim = dim;
  c.n_layers = layers;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  c.rope_theta = 100000.0;
  c.vocab_size = 258;
  c.attn_gate = gate;
  ThreeToOne(c, sdm);
  c.swa_window = 1024;
  c.swa_n_heads = heads;
  c.swa_n_kv_heads = heads;
  c.sdm.num_heads = sdm_heads;
  c.sdm.slots_per_head = 65536;
  c.sdm.backprop_on_memory = true;
  c.sdm.num_reads = 128;
  c.sdm.num_writes = 128;
  c.sdm.output_gate = true;
  c.sdm.normalize_readings = true;
  return c;
}

}  // namespace

std::vector<std::string> PresetNames() {
  return {"tiny",         "debug",         "debug_sdm", "debug_hybrid",
          "sdm_flagship", "baseline_1.4B", "sdm_7B",    "baseline_7B"};
}

absl::StatusOr<ModelConfig> PresetConfig(absl::string_view name) {
  ModelConfig c;
  if (name == "tiny") {
    // Test-sized: 3 SWA layers (GQA) and 1 SDM layer with 2 heads of 8^2 slots of width 32.
    c.dim = 64;
    c.n_layers = 4;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.vocab_size = 258;
    c.swa_at = {0, 1, 2};
    c.sdm_at = {3};
    c.swa_window = 8;
    c.sdm.num_heads = 2;
    c.sdm.slots_per_head = 64;
    c.sdm.num_writes = 8;
    c.sdm.num_reads = 8;
    c.sdm.output_gate = true;
    c.sdm.normalize_readings = true;
    c.sdm.backprop_on_memory = true;
    c.sdm.memory_block_size = 16;
  } else if (name == "debug") {
    c = Debug(/*sdm=*/false);  // debug_sdm's full-attention twin (reference configs/debug.yaml)
  } else if (name == "debug_sdm") {
    c = Debug(/*sdm=*/true);
  } else if (name == "debug_hybrid") {
    c = Debug(/*sdm=*/true);
    c.attn_at = {4, 6};
    c.swa_at = {0, 2};
    c.swa_window = 256;
    c.swa_n_heads = 4;
    c.swa_n_kv_heads = 2;
    c.swa_head_dim = 64;
  } else if (name == "sdm_flagship") {
    c = Scale(2048, 24, 16, 8, /*sdm=*/true, /*sdm_heads=*/2, /*gate=*/false);
  } else if (name == "baseline_1.4B") {
    c = Scale(2048, 24, 16, 8, /*sdm=*/false, 2, /*gate=*/false);
  } else if (name == "sdm_7B") {
    c = Scale(4096, 32, 32, 16, /*sdm=*/true, /*sdm_heads=*/4, /*gate=*/true);
  } else if (name == "baseline_7B") {
    c = Scale(4096, 32, 32, 16, /*sdm=*/false, 4, /*gate=*/true);
  } else {
    return absl::NotFoundError(absl::StrCat("unknown preset '", name,
                                            "' (known: ", absl::StrJoin(PresetNames(), ", "), ")"));
  }
  if (auto s = FinalizeModelConfig(c); !s.ok()) return s;
  return c;
}

}  // namespace sdm
