#include "tools/sdm_bench/decode_summary.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

namespace sdm::bench {

using nlohmann::json;

void SummarisePair(json& group, const json& rows) {
  std::string sdm, attn;
  for (const json& m : group["models"]) {
    if (m["role"] == "sdm") sdm = m["name"];
    if (m["role"] == "attention") attn = m["name"];
  }
  if (sdm.empty() || attn.empty()) return;
  std::map<std::pair<int64_t, int64_t>, json> by_sdm, by_attn;  // (context, batch) -> row
  std::map<int64_t, json> fit_sdm, fit_attn;                    // context -> row
  for (const json& r : rows) {
    if (r["group"] != group["name"]) continue;
    const auto key = std::make_pair(r["context"].get<int64_t>(), r["batch"].get<int64_t>());
    if (r["model"] == sdm) {
      by_sdm[key] = r;
      if (r["fit_batch"]) fit_sdm[key.first] = r;
    } else if (r["model"] == attn) {
      by_attn[key] = r;
      if (r["fit_batch"]) fit_attn[key.first] = r;
    }
  }
  json ratios = json::array();
  int64_t longest = -1;
  for (const auto& [key, s] : by_sdm) {
    auto it = by_attn.find(key);
    if (it == by_attn.end()) continue;
    const json& a = it->second;
    ratios.push_back(
        {{"context", key.first},
         {"batch", key.second},
         {"sdm_tokens_per_s", s["tokens_per_s"]},
         {"attention_tokens_per_s", a["tokens_per_s"]},
         {"sdm_ms_per_step", s["ms_per_step_median"]},
         {"attention_ms_per_step", a["ms_per_step_median"]},
         {"ratio", s["tokens_per_s"].get<double>() / a["tokens_per_s"].get<double>()},
         // The ratio if both steps ran at the same bandwidth: bytes per step, twin over SDM.
         {"bandwidth_floor_ratio",
          a["bytes_per_step"].get<double>() / s["bytes_per_step"].get<double>()},
         {"attention_layers_gbps", a.value("attn_layers_gbps", 0.0)},
         {"sdm_layers_gbps", s.value("sdm_layers_gbps", 0.0)}});
    longest = std::max(longest, key.first);
  }
  group["ratios"] = ratios;
  json fit = json::array();
  for (const auto& [ctx, s] : fit_sdm) {
    auto it = fit_attn.find(ctx);
    if (it == fit_attn.end()) continue;
    fit.push_back(
        {{"context", ctx},
         {"sdm_batch", s["batch"]},
         {"attention_batch", it->second["batch"]},
         {"sdm_tokens_per_s", s["tokens_per_s"]},
         {"attention_tokens_per_s", it->second["tokens_per_s"]},
         {"ratio", s["tokens_per_s"].get<double>() / it->second["tokens_per_s"].get<double>()},
         {"bandwidth_floor_ratio",
          (s["batch"].get<double>() / s["bytes_per_step"].get<double>()) /
              (it->second["batch"].get<double>() / it->second["bytes_per_step"].get<double>())}});
  }
  group["fit_ratios"] = fit;
  // Step-time growth from the shortest to the longest context, per model and batch measured at
  // both.
  json growth = json::array();
  for (const auto* table : {&by_sdm, &by_attn}) {
    if (table->empty()) continue;
    int64_t lo = table->begin()->first.first, hi = lo;
    for (const auto& [key, r] : *table) hi = std::max(hi, key.first);
    for (const auto& [key, r] : *table) {
      if (key.first != lo || lo == hi) continue;
      auto it = table->find({hi, key.second});
      if (it == table->end()) continue;
      const double a = r["ms_per_step_median"], z = it->second["ms_per_step_median"];
      growth.push_back(
          {{"model", r["model"]},
           {"batch", key.second},
           {"shortest_context", lo},
           {"longest_context", hi},
           {"ms_shortest", a},
           {"ms_longest", z},
           {"growth", z / a},
           {"global_layer_ms_shortest",
            r["role"] == "sdm" ? r["sdm_ms_per_step"] : r["attn_ms_per_step"]},
           {"global_layer_ms_longest",
            r["role"] == "sdm" ? it->second["sdm_ms_per_step"] : it->second["attn_ms_per_step"]}});
    }
  }
  group["growth"] = growth;
  json headline;
  headline["longest_common_context"] = longest;
  json at_longest = json::array();
  for (const json& r : ratios) {
    if (r["context"] == longest) at_longest.push_back(r);
  }
  headline["ratios_at_longest_context"] = at_longest;
  for (const json& f : fit) {
    if (f["context"] == longest) headline["fit_ratio_at_longest_context"] = f;
  }
  group["headline"] = headline;
}

}  // namespace sdm::bench
