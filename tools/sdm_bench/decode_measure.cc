#include "tools/sdm_bench/decode_measure.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine/weight_spec.h"
#include "kernels/cpu/linear.h"
#include "tools/sdm_bench/byte_model.h"
#include "tools/sdm_bench/progress.h"

namespace sdm::bench {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::vector<int32_t> RandomTokens(int64_t n, std::mt19937& rng, int64_t vocab) {
  std::uniform_int_distribution<int32_t> tok(
      0, static_cast<int32_t>(std::min<int64_t>(vocab, 256)) - 1);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = tok(rng);
  return t;
}

// Brings `session` to `ctx` tokens by real prefill of random tokens, in slices of 1024 (the
// engine chunks them further); `bar` counts tokens done over all the sessions of one phase.
absl::Status PrefillSession(ModelRun& run, SessionState& session, int64_t ctx, Progress& bar,
                            int64_t& done_total) {
  const int64_t slice = 1024;
  while (session.position() < ctx) {
    const int64_t n = std::min(slice, ctx - session.position());
    const auto toks = RandomTokens(n, run.rng, run.spec->config.vocab_size);
    if (auto s = run.engine->Prefill(session, toks, false, nullptr); !s.ok()) return s;
    done_total += n;
    bar.Update(done_total);
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<GemmShape> DecodeGemms(const Model& model) {
  std::vector<GemmShape> gemms;
  for (const TensorSpec& t : ExpectedTensors(model.config)) {
    if (!IsDecodeGemm(model.config, t)) continue;
    gemms.push_back({model.weights->Get(t.name).data(), t.shape[0], t.shape[1]});
  }
  return gemms;
}

double MeasureSgemmRate(const std::vector<GemmShape>& gemms, int64_t b, int threads) {
  const int engine_setting = kernels::cpu::BlasThreads();
  kernels::cpu::SetBlasThreads(threads);
  int64_t max_k = 0, max_n = 0;
  for (const GemmShape& g : gemms) {
    max_k = std::max(max_k, g.k);
    max_n = std::max(max_n, g.n);
  }
  std::vector<float> x(b * max_k, 0.01f), y(b * max_n);
  double flops_per_round = 0;
  for (const GemmShape& g : gemms) flops_per_round += 2.0 * b * g.n * g.k;
  auto round = [&] {
    for (const GemmShape& g : gemms) {
      kernels::cpu::Linear(x.data(), b, g.k, g.w, g.n, nullptr, y.data());
    }
  };
  round();  // warm up
  int rounds = 0;
  const Clock::time_point start = Clock::now();
  double elapsed = 0;
  while (rounds < 3 || (rounds < 30 && elapsed < 0.5)) {
    round();
    ++rounds;
    elapsed = Seconds(start, Clock::now());
  }
  kernels::cpu::SetBlasThreads(engine_setting);
  return flops_per_round * rounds / elapsed / 1e9;
}

int64_t MaxBatch(double budget_gb, double state_bytes) {
  if (state_bytes <= 0) return std::numeric_limits<int32_t>::max();
  return static_cast<int64_t>(std::floor(budget_gb * 1e9 / state_bytes));
}

absl::Status PrefillBase(ModelRun& run, int64_t ctx, json& prefill_log) {
  const int64_t todo = ctx - run.base->position();
  if (todo <= 0) return absl::OkStatus();
  const Clock::time_point t0 = Clock::now();
  Progress bar(absl::StrFormat("%s: prefill to %d", run.spec->name, ctx), todo, "tok");
  int64_t done = 0;
  if (auto s = PrefillSession(run, *run.base, ctx, bar, done); !s.ok()) return s;
  const double seconds = Seconds(t0, Clock::now());
  bar.Finish(absl::StrFormat("%s: prefill %d -> %d tokens in %.1f s (%.0f tok/s)", run.spec->name,
                             ctx - todo, ctx, seconds, todo / seconds),
             /*keep=*/true);
  prefill_log.push_back({{"model", run.spec->name},
                         {"sessions", 1},
                         {"from", ctx - todo},
                         {"to", ctx},
                         {"seconds", seconds},
                         {"tokens_per_s", todo / seconds}});
  return absl::OkStatus();
}

absl::Status FillPool(ModelRun& run, int64_t ctx, int64_t target, json& prefill_log) {
  if (run.pool_limited) target = std::min<int64_t>(target, run.pool.size());
  int64_t todo = 0, from = ctx;
  for (int64_t i = 0; i < target; ++i) {
    const int64_t pos = i < static_cast<int64_t>(run.pool.size()) ? run.pool[i]->position() : 0;
    todo += std::max<int64_t>(0, ctx - pos);
    from = std::min(from, pos);
  }
  if (todo <= 0) return absl::OkStatus();
  const Clock::time_point t0 = Clock::now();
  Progress bar(absl::StrFormat("%s: prefill %d sessions to %d", run.spec->name, target, ctx), todo,
               "tok");
  int64_t done = 0;
  for (int64_t i = 0; i < target; ++i) {
    if (i == static_cast<int64_t>(run.pool.size())) run.pool.push_back(run.engine->NewSession());
    absl::Status s = PrefillSession(run, *run.pool[i], ctx, bar, done);
    if (s.ok()) continue;
    if (!absl::IsResourceExhausted(s)) return s;
    // Destroying a session frees its device state (its residency).
    run.pool.resize(i);
    if (run.pool.size() > 1) run.pool.pop_back();
    run.pool_limited = true;
    run.pool_limit = absl::StrFormat(
        "the device's session memory held %d sessions at %d tokens (one more is kept free for "
        "the decode steps): %s",
        i, ctx, s.message());
    std::printf("# %s: %s\n", run.spec->name.c_str(), run.pool_limit.c_str());
    break;
  }
  const double seconds = Seconds(t0, Clock::now());
  bar.Finish(
      absl::StrFormat("%s: prefill of %d sessions %d -> %d tokens: %d tokens in %.1f s "
                      "(%.0f tok/s)",
                      run.spec->name, run.pool.size(), from, ctx, done, seconds, done / seconds),
      /*keep=*/true);
  prefill_log.push_back({{"model", run.spec->name},
                         {"sessions", run.pool.size()},
                         {"from", from},
                         {"to", ctx},
                         {"seconds", seconds},
                         {"tokens_per_s", done / seconds}});
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PointTiming>> MeasureTogether(const std::vector<Point>& points,
                                                         int64_t ctx, int warmup, int steps,
                                                         bool cuda, int sgemm_threads) {
  std::vector<std::string> names;
  for (const Point& p : points) {
    names.push_back(absl::StrFormat("%s x%d", p.run->spec->name, p.batch));
    // OpenBLAS on the host says nothing about a device's GEMMs.
    if (!cuda && !p.run->sgemm_gflops.count(p.batch)) {
      Progress bar(absl::StrFormat("%s: sgemm at batch %d", p.run->spec->name, p.batch), 1, "");
      p.run->sgemm_gflops[p.batch] = MeasureSgemmRate(p.run->gemms, p.batch, sgemm_threads);
      bar.Finish("", /*keep=*/false);
    }
  }
  struct Trial {
    Point point;
    std::vector<std::unique_ptr<SessionState>> sessions;
    std::vector<SessionState*> ptrs;
    std::vector<float> logits;
    std::vector<double> step_s;
  };
  std::vector<Trial> trials;
  for (const Point& p : points) {
    ModelRun* run = p.run;
    const int64_t b = p.batch;
    Trial t{p, {}, {}, std::vector<float>(b * run->spec->config.vocab_size), {}};
    if (cuda) {
      for (int64_t i = 0; i < b; ++i) t.ptrs.push_back(run->pool[i].get());
    } else {
      Progress bar(absl::StrFormat("%s: %d clones at %d tokens", run->spec->name, b, ctx), 1, "");
      for (int64_t i = 0; i < b; ++i) {
        t.sessions.push_back(run->base->Clone());
        t.ptrs.push_back(t.sessions.back().get());
      }
      bar.Finish("", false);
    }
    trials.push_back(std::move(t));
  }
  Progress bar(absl::StrFormat("ctx %d: %s", ctx, absl::StrJoin(names, " + ")), warmup + steps,
               "steps");
  for (int s = 0; s < warmup + steps; ++s) {
    for (Trial& t : trials) {
      ModelRun& run = *t.point.run;
      const auto toks = RandomTokens(t.point.batch, run.rng, run.spec->config.vocab_size);
      if (s == warmup) run.engine->ResetProfile();
      const Clock::time_point t0 = Clock::now();
      if (auto st = run.engine->Decode(t.ptrs, toks, t.logits); !st.ok()) return st;
      if (s >= warmup) t.step_s.push_back(Seconds(t0, Clock::now()));
    }
    bar.Update(s + 1);
  }
  bar.Finish("", /*keep=*/false);
  std::vector<PointTiming> timings;
  for (Trial& t : trials) {
    timings.push_back({t.point, std::move(t.step_s), t.point.run->engine->profile()});
  }
  return timings;
}

}  // namespace sdm::bench
