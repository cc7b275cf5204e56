// The pair summaries of an `sdm-bench decode` run, derived from its result rows alone (so that
// `sdm-bench report` can recompute them from an earlier run's JSON document): the SDM model's
// tokens/s over its full-attention twin's at each (context, batch) measured for both, the same at
// each model's largest batch in the budget, how each model's step time grows from the shortest
// to the longest context, and the headline at the longest context.
//
// Thread-compatible (pure functions of their arguments).
#ifndef SDMSERVE_TOOLS_SDM_BENCH_DECODE_SUMMARY_H_
#define SDMSERVE_TOOLS_SDM_BENCH_DECODE_SUMMARY_H_

#include "nlohmann/json.hpp"

namespace sdm::bench {

// Sets group["ratios"], ["fit_ratios"], ["growth"] and ["headline"] from the `rows` (the run's
// result rows; those of other groups are ignored) when the group is a pair (its models hold one
// of role "sdm" and one of role "attention"); leaves other groups unchanged.
void SummarisePair(nlohmann::json& group, const nlohmann::json& rows);

}  // namespace sdm::bench

#endif  // SDMSERVE_TOOLS_SDM_BENCH_DECODE_SUMMARY_H_
