#include "server/scheduler.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/thread_name.h"
#include "base/thread_priority.h"
#include "server/tenant_limits.h"

namespace sdm {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Marks Submit's refusal of a job prepared from a stale read of its session.
constexpr absl::string_view kSessionChangedPayload = "sdmserve/session-changed";

}  // namespace

absl::Status SessionChangedError(absl::string_view session_id, int64_t expected_history,
                                 int64_t history) {
  absl::Status changed = absl::AbortedError(
      absl::StrCat("session '", session_id, "' changed while the request was prepared (",
                   expected_history, " tokens of history then, ", history, " now); retry"));
  changed.SetPayload(kSessionChangedPayload, absl::Cord("1"));
  return changed;
}

bool IsSessionChanged(const absl::Status& status) {
  return status.code() == absl::StatusCode::kAborted &&
         status.GetPayload(kSessionChangedPayload).has_value();
}

struct Scheduler::Job {
  // Why the job must end before its next step, if it must: cancelled, or past its deadline.
  std::optional<FinishReason> EndReason(absl::Time now) const {
    if (observer->IsCancelled()) return FinishReason::kCancelled;
    if (now > spec.deadline) return FinishReason::kDeadline;
    return std::nullopt;
  }

  Job(GenerateJob s, std::shared_ptr<JobObserver> o, const Tokenizer& tokenizer)
      : spec(std::move(s)),
        observer(std::move(o)),
        policy(tokenizer, spec.stop_strings, spec.sampling) {}

  const std::string& tenant() const { return spec.session.tenant; }

  GenerateJob spec;
  std::shared_ptr<JobObserver> observer;
  SessionLease lease;  // the job's session, or its one-shot session
  SessionState* state = nullptr;
  std::vector<int32_t> to_feed;  // the pending token (if any) then the prompt
  size_t fed = 0;
  int32_t next_input = -1;  // sampled, to be fed by the next decode
  Usage usage;
  GenerationPolicy policy;  // EOS, stop ids and strings, max_tokens; the text deltas
  Clock::time_point submitted = Clock::now();
  Clock::time_point last_token;
  bool had_pending = false;  // to_feed starts with the session's pending token
  bool done = false;
  bool running = false;   // counted in running_count_ (moved to the running set, not finished)
  bool deferred = false;  // its step did not fit: back to the queue (Loop)
};

Scheduler::Scheduler(Engine& engine, SessionStateStore& store, const Tokenizer& tokenizer,
                     const SchedulerOptions& options, SchedulerListener* listener)
    : engine_(engine),
      store_(store),
      tokenizer_(tokenizer),
      options_(options),
      listener_(listener),
      thread_([this] { Loop(); }) {}

Scheduler::~Scheduler() { Shutdown(/*cancel=*/true); }

int Scheduler::running() const {
  absl::MutexLock lock(&mu_);
  return running_count_;
}

int Scheduler::waiting() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(waiting_.size());
}

std::map<std::string, int64_t> Scheduler::TenantRequests() const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, int64_t> requests;
  for (const auto& [tenant, jobs] : tenants_) requests.emplace(tenant, jobs.in_flight);
  return requests;
}

int64_t Scheduler::deferred_jobs() const {
  absl::MutexLock lock(&mu_);
  return deferred_jobs_;
}

absl::Status Scheduler::Submit(GenerateJob spec, std::shared_ptr<JobObserver> observer) {
  if (spec.prompt.empty()) return absl::InvalidArgumentError("the prompt is empty");
  // The engine's step refuses a whole batch over one bad draw: refuse the job here instead.
  if (absl::Status s = ValidateSamplingParams(spec.sampling, engine_.vocab_size()); !s.ok()) {
    return s;
  }
  if (spec.logprobs.has_value()) {
    if (absl::Status s = CheckTopLogprobs(*spec.logprobs, "logprobs"); !s.ok()) return s;
  }
  if (spec.prompt_logprobs.has_value()) {
    if (absl::Status s = CheckTopLogprobs(*spec.prompt_logprobs, "prompt_logprobs"); !s.ok()) {
      return s;
    }
  }
  for (const auto& [id, bias] : spec.logit_bias) {
    if (id < 0 || id >= engine_.vocab_size() || !std::isfinite(bias)) {
      return absl::InvalidArgumentError(absl::StrCat("logit_bias: token ", id, " with bias ", bias,
                                                     " (ids in [0, ", engine_.vocab_size(),
                                                     "), finite biases)"));
    }
  }
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status admitted = AdmissionLocked(spec); !admitted.ok()) return admitted;
  }
  auto job = std::make_unique<Job>(std::move(spec), std::move(observer), tokenizer_);
  // Taking the lease here refuses a busy or unknown session before anything is streamed, and
  // restores a parked session on the caller's thread rather than the step thread.
  if (!job->spec.session.id.empty()) {
    auto lease = store_.Acquire(job->spec.session);
    if (!lease.ok()) return lease.status();
    job->lease = *std::move(lease);
  } else {
    job->lease = store_.NewSession();
  }
  job->state = &job->lease.state();
  SessionState& st = *job->state;
  if (const int64_t history = st.position() + (st.pending_token >= 0 ? 1 : 0);
      job->spec.expected_history >= 0 && history != job->spec.expected_history) {
    // The lease goes back, the session untouched: not a turn (no write, its last use kept).
    job->lease.ReleaseUnchanged();
    return SessionChangedError(job->spec.session.id, job->spec.expected_history, history);
  }
  job->usage.history_tokens = st.position();
  if (st.pending_token >= 0) {
    job->to_feed.push_back(st.pending_token);
    st.pending_token = -1;
    job->had_pending = true;
  }
  job->to_feed.insert(job->to_feed.end(), job->spec.prompt.begin(), job->spec.prompt.end());
  // A session that is not on the device is converted for it here, on the caller's thread, not
  // inside the step that resumes it, where every other session would wait (Engine::StageResume;
  // nothing to do on the CPU). Step reports any error of the session's.
  if (absl::Status staged = engine_.StageResume(st); !staged.ok()) {
    absl::MutexLock lock(&staging_log_mu_);
    if (staging_failures_.Failed(staged.ToString())) {
      SDM_LOG(WARNING) << "sdm scheduler: staging a resume: " << staged
                       << " (further failures of this cause are not logged until one succeeds)";
    }
  } else {
    absl::MutexLock lock(&staging_log_mu_);
    if (int64_t unlogged = 0; staging_failures_.Succeeded(&unlogged)) {
      SDM_LOG(INFO) << "sdm scheduler: staging resumes succeed again (" << unlogged
                    << " more failed meanwhile, not logged)";
    }
  }
  absl::Status refused;
  {
    absl::MutexLock lock(&mu_);
    refused = AdmissionLocked(job->spec);
    if (refused.ok()) {
      st.sampler_seed = job->spec.sampling.seed;
      ++tenants_[job->tenant()].in_flight;
      waiting_.push_back(std::move(job));  // wakes the step thread (HasWorkLocked) on unlock
      return absl::OkStatus();
    }
  }
  // Refused: the lease goes back with the job. Outside the lock: dropping a staged image frees
  // page-locked memory, which may wait for the device.
  if (job->had_pending) st.pending_token = job->to_feed[0];  // the session is unchanged
  st.DropStaged();  // its page-locked memory goes back now, not when the session is parked
  job->lease.ReleaseUnchanged();  // not a turn: no write, its last use kept
  return refused;
}

absl::Status Scheduler::AdmissionLocked(const GenerateJob& job) const {
  if (!accepting_) return absl::UnavailableError("the server is shutting down");
  if (job.tenant_max_requests.has_value()) {
    const auto tenant = tenants_.find(job.session.tenant);
    const int64_t in_flight = tenant == tenants_.end() ? 0 : tenant->second.in_flight;
    if (*job.tenant_max_requests == 0) {  // forbidden: no retry would succeed
      return RefusedByTenantLimit(
          absl::PermissionDeniedError(absl::StrCat(
              "tenant '", job.session.tenant, "' may not run requests (its max_requests is 0)")),
          "max_requests");
    }
    if (in_flight >= *job.tenant_max_requests) {
      return RefusedByTenantLimit(absl::ResourceExhaustedError(absl::StrCat(
                                      "tenant '", job.session.tenant, "' has ", in_flight,
                                      " requests waiting or running, its limit (max_requests ",
                                      *job.tenant_max_requests, "); retry when one has finished")),
                                  "max_requests");
    }
  }
  if (!QueueFullLocked()) return absl::OkStatus();
  if (options_.max_waiting == 0) {
    // No queue to be full ("the queue is full (0 requests waiting)" said): the batch is.
    return absl::ResourceExhaustedError(
        "every place in the batch is taken and this server keeps no queue (max_waiting 0); retry "
        "later");
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("the queue is full (", options_.max_waiting, " requests waiting); retry later"));
}

void Scheduler::Shutdown(bool cancel) {
  {
    absl::MutexLock lock(&mu_);
    accepting_ = false;
    if (cancel) cancel_all_ = true;
    stop_ = true;
  }
  absl::MutexLock lock(&join_mu_);  // one joins, the others wait for that
  if (thread_.joinable() && std::this_thread::get_id() != thread_.get_id()) thread_.join();
}

void Scheduler::Loop() {
  SetCurrentThreadName("sdm-step");
  // The decode runs below the front end (EngineOptions::decode_nice), the kernel threads too.
  if (absl::Status lowered = LowerCurrentThreadPriority(engine_.options().decode_nice);
      !lowered.ok()) {
    SDM_LOG(WARNING) << "sdm step thread: " << lowered.message();
  }
  // This is the store's step thread: device-host moves of sessions run here, between steps.
  store_.SetStepThread([this] {
    absl::MutexLock lock(&mu_);
    device_work_ = true;
  });
  std::vector<std::unique_ptr<Job>> running;
  while (true) {
    struct Ended {
      std::unique_ptr<Job> job;
      FinishReason reason;
      absl::Status error;
    };
    std::vector<Ended> ended;  // waiting jobs that end
    bool cancel_all = false;
    {
      absl::MutexLock lock(&mu_);
      if (running.empty()) mu_.Await(absl::Condition(this, &Scheduler::HasWorkLocked));
      if (stop_ && waiting_.empty() && running.empty()) break;
      device_work_ = false;  // RunDeviceMoves() below serves what was queued until now
      cancel_all = cancel_all_;
      if (cancel_all) {
        // A job that never ran (still queued, or deferred before its first step fitted) is
        // refused rather than cancelled: nothing of it happened, so the client retries it
        // (elsewhere, with replicas) instead of reading an empty completion as the answer.
        while (!waiting_.empty()) {
          std::unique_ptr<Job> job = std::move(waiting_.front());
          waiting_.pop_front();
          const bool ran = job->fed > 0 || job->usage.generated_tokens > 0;
          absl::Status error;
          if (!ran) {
            error = absl::UnavailableError(
                "the server shut down before this request started (it waited for a place in the "
                "batch until the shutdown's grace ran out); nothing of it ran: retry it, on "
                "another replica if there is one");
          }
          ended.push_back({std::move(job), ran ? FinishReason::kCancelled : FinishReason::kError,
                           std::move(error)});
        }
      }
      // A waiting job that was cancelled or passed its deadline ends now, without running: it
      // frees its queue place at once, and a session's turn cancelled while queued never
      // reaches the engine, however long the jobs ahead of it run.
      const absl::Time now = absl::Now();
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        if (const std::optional<FinishReason> reason = (*it)->EndReason(now)) {
          ended.push_back({std::move(*it), *reason, absl::OkStatus()});
          it = waiting_.erase(it);
        } else {
          ++it;
        }
      }
      AdmitLocked(running);
      running_count_ = static_cast<int>(running.size());
    }
    for (Ended& e : ended) Finish(*e.job, e.reason, e.error);
    if (cancel_all) {
      for (auto& job : running) Finish(*job, FinishReason::kCancelled);
    }
    store_.RunDeviceMoves();
    Step(running);
    running.erase(std::remove_if(running.begin(), running.end(),
                                 [](const std::unique_ptr<Job>& j) { return j->done; }),
                  running.end());
    std::vector<std::unique_ptr<Job>> deferred;
    for (auto it = running.begin(); it != running.end();) {
      if ((*it)->deferred) {
        deferred.push_back(std::move(*it));
        it = running.erase(it);
      } else {
        ++it;
      }
    }
    absl::MutexLock lock(&mu_);
    // Nothing runs: what kept the batch small is gone (or is tried afresh).
    if (running.empty() && deferred.empty()) batch_cap_ = std::numeric_limits<int>::max();
    if (!deferred.empty()) {
      // Back to the front of the queue, in their order; fewer at once from now on.
      batch_cap_ = std::max(1, static_cast<int>(running.size()));
      deferred_jobs_ += static_cast<int64_t>(deferred.size());
      for (auto it = deferred.rbegin(); it != deferred.rend(); ++it) {
        (*it)->deferred = false;
        (*it)->running = false;
        waiting_.push_front(std::move(*it));
      }
    }
    running_count_ = static_cast<int>(running.size());
  }
  store_.ClearStepThread();
}

void Scheduler::AdmitLocked(std::vector<std::unique_ptr<Job>>& running) {
  if (waiting_.empty() || static_cast<int>(running.size()) >= BatchLimitLocked()) return;
  // Places each tenant holds now (the keys view the jobs' own strings, which outlive this).
  std::map<absl::string_view, int> running_by_tenant;
  for (const auto& job : running) ++running_by_tenant[job->tenant()];
  while (!waiting_.empty() && static_cast<int>(running.size()) < BatchLimitLocked()) {
    // The first waiting job of the tenant with the fewest places, then the least recent place;
    // a tenant's jobs share its key, so the scan keeps the queue's order within a tenant.
    auto next = waiting_.end();
    std::pair<int, int64_t> best;
    for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
      const absl::string_view tenant = (*it)->tenant();
      const auto places = running_by_tenant.find(tenant);
      const std::pair<int, int64_t> key(places == running_by_tenant.end() ? 0 : places->second,
                                        tenants_.find(tenant)->second.last_admission);
      if (next == waiting_.end() || key < best) {
        next = it;
        best = key;
      }
    }
    std::unique_ptr<Job> job = std::move(*next);
    waiting_.erase(next);
    ++running_by_tenant[job->tenant()];
    tenants_.find(job->tenant())->second.last_admission = ++admissions_;
    job->running = true;
    running.push_back(std::move(job));
  }
}

void Scheduler::Step(std::vector<std::unique_ptr<Job>>& running) {
  const Clock::time_point step_start = Clock::now();
  const absl::Time now = absl::Now();
  for (auto& job : running) {
    if (job->done) continue;
    if (const std::optional<FinishReason> reason = job->EndReason(now)) Finish(*job, *reason);
  }
  // The plan: prompt tokens within the step's token budget, a chunk at a time to the tenant fed
  // least recently (its oldest job first), then one decode token for every job past its
  // prompt. A prompt is always cut at multiples of the engine's
  // prefill chunk (a chunk is never split to fit the budget), so its numerics are those of
  // Prefill() calls whatever else runs. A job feeds at most one chunk per step: every step is
  // then one forward pass of the engine, so a step that does not fit changes nothing (a second
  // pass failing after the first advanced its sessions would leave them half fed and failed,
  // engine/engine.h), and other jobs' decode tokens come between a long prompt's chunks.
  struct Planned {
    Job* job;
    size_t prefill = 0;          // prompt tokens fed (0: a decode token)
    int64_t draw = -1;           // index of the token the engine draws for it (-1: none)
    int64_t host_draw_row = -1;  // a biased job's draw: the logits row it is drawn from here
    int64_t logit_row = -1;      // row of the step's logits for the draw's log-probabilities
    int64_t prompt_row = -1;     // first of the chunk's rows when the job scores its prompt
  };
  // A prompt chunk's or decode token's segment: with every row's logits for a job that scores its
  // prompt (a prompt chunk), the last row's for one that asked for its tokens' log-probabilities
  // or whose draw is biased (drawn here from that row, not by the engine).
  const auto add_segment = [](StepBatch& batch, Planned& planned, std::span<const int32_t> tokens,
                              bool draw) {
    Job& job = *planned.job;
    const bool host_draw = draw && !job.spec.logit_bias.empty();
    StepLogits logits = StepLogits::kNone;
    int64_t last_row = -1;  // the row of the segment's last token, when it has logits
    if (planned.prefill > 0 && job.spec.prompt_logprobs.has_value()) {
      logits = StepLogits::kAll;
      planned.prompt_row = batch.LogitRows();
      last_row = planned.prompt_row + static_cast<int64_t>(tokens.size()) - 1;
    } else if (draw && (job.spec.logprobs.has_value() || host_draw)) {
      logits = StepLogits::kLast;
      last_row = batch.LogitRows();
    }
    if (draw && job.spec.logprobs.has_value()) planned.logit_row = last_row;
    if (host_draw) planned.host_draw_row = last_row;
    if (draw && !host_draw) {
      planned.draw =
          batch.AddDraw(*job.state, tokens, logits, job.spec.sampling, job.state->sampler_draws);
    } else {
      batch.Add(*job.state, tokens, logits);
    }
  };
  std::vector<Planned> plan;
  StepBatch batch;
  int64_t budget = options_.prefill_token_budget;
  int64_t prefilled = 0;
  const size_t chunk = static_cast<size_t>(engine_.options().prefill_chunk);
  // Jobs with prompt left, oldest first. Tenants take chunks in turn (the class comment), so one
  // tenant's long prompts do not hold back another tenant's first token.
  std::vector<Job*> prompted;
  for (auto& job : running) {
    if (!job->done && job->fed < job->to_feed.size()) prompted.push_back(job.get());
  }
  if (last_fed_.size() > 2 * running.size()) {
    // Forget the tenants that hold no place now (a tenant not in the map was never fed: first).
    std::erase_if(last_fed_, [&running](const auto& entry) {
      return std::none_of(running.begin(), running.end(), [&](const std::unique_ptr<Job>& job) {
        return job->tenant() == entry.first;
      });
    });
  }
  const auto last_fed = [this](const Job& job) {
    const auto it = last_fed_.find(job.tenant());
    return it == last_fed_.end() ? int64_t{0} : it->second;
  };
  while (!prompted.empty() && budget > 0) {
    auto next = prompted.begin();
    for (auto it = prompted.begin(); it != prompted.end(); ++it) {
      if (last_fed(**it) < last_fed(**next)) next = it;  // the first such: its oldest job
    }
    Job* const job = *next;
    prompted.erase(next);
    const size_t take = std::min(chunk, job->to_feed.size() - job->fed);
    // Over budget: wait for the next step, unless nothing was prefilled yet (progress).
    if (static_cast<int64_t>(take) > budget && prefilled > 0) continue;
    budget -= static_cast<int64_t>(take);
    prefilled += static_cast<int64_t>(take);
    last_fed_.insert_or_assign(job->tenant(), ++feeds_);
    const std::span<const int32_t> tokens =
        std::span<const int32_t>(job->to_feed).subspan(job->fed, take);
    // The prompt's last chunk draws the first token, unless the job generates none.
    add_segment(
        batch, plan.emplace_back(Planned{.job = job, .prefill = take}), tokens,
        /*draw=*/job->fed + take == job->to_feed.size() && job->spec.sampling.max_tokens > 0);
  }
  int decodes = 0;
  for (auto& job : running) {
    if (job->done || job->next_input < 0) continue;
    add_segment(batch, plan.emplace_back(Planned{.job = job.get()}),
                std::span<const int32_t>(&job->next_input, 1), /*draw=*/true);
    ++decodes;
  }
  if (plan.empty()) return;

  // The engine draws the tokens (on the device where the backend can): the logits stay there,
  // but for the rows of jobs that asked for log-probabilities.
  std::vector<int32_t> sampled(batch.Draws());
  step_logits_.resize(static_cast<size_t>(batch.LogitRows() * engine_.vocab_size()));
  const absl::Status status = engine_.Step(batch, step_logits_, sampled);
  if (absl::IsResourceExhausted(status) &&
      std::none_of(plan.begin(), plan.end(),
                   [](const Planned& p) { return p.job->state->failed(); })) {
    // The step did not fit and changed nothing (Engine::Step's contract): of the step's jobs,
    // the one admitted last of the tenant holding the most places waits again, and the others
    // step without it (the class comment). One job alone fails.
    std::map<absl::string_view, int> places;
    int live = 0;
    for (auto& job : running) {
      if (job->done) continue;
      ++live;
      ++places[job->tenant()];
    }
    Job* last = nullptr;
    for (auto& job : running) {
      if (job->done || std::none_of(plan.begin(), plan.end(),
                                    [&](const Planned& p) { return p.job == job.get(); })) {
        continue;
      }
      if (last == nullptr || places[job->tenant()] >= places[last->tenant()]) last = job.get();
    }
    if (live > 1 && last != nullptr) {
      last->deferred = true;
      fitting_steps_ = 0;
      return;
    }
  }
  // A job alone whose step does not fit fails. RESOURCE_EXHAUSTED tells a client to retry: right
  // while its session holds nothing of the request, wrong once the session read part of it (a
  // retry would feed the whole prompt again after that part, or repeat a turn half generated).
  absl::Status failed_alone;
  if (absl::IsResourceExhausted(status) && plan.size() == 1) {
    const Job& job = *plan[0].job;
    const size_t carried = job.had_pending ? 1 : 0;
    if (!job.spec.session.id.empty() && (job.fed > carried || job.usage.generated_tokens > 0)) {
      failed_alone = absl::AbortedError(absl::StrCat(
          "the session's next step did not fit (", status.message(), "); the session keeps what ",
          "this request did before it: ", job.fed - std::min(job.fed, carried), " of its ",
          job.to_feed.size() - carried, " prompt tokens read, ", job.usage.generated_tokens,
          " tokens generated. Continue from there rather than sending the request again"));
    }
  }
  if (!status.ok()) {
    if (listener_ != nullptr) listener_->OnStepFailed(status);
    // An operator learns why a batch failed (a device error, an internal one) from the log, not
    // only from the requests' codes; a failure that repeats every step is logged once.
    if (step_failures_.Failed(status.ToString())) {
      SDM_LOG(ERROR) << "sdm scheduler: an engine step of " << plan.size() << " requests ("
                     << decodes << " decoding, " << prefilled
                     << " prompt tokens) failed: " << status
                     << "; its requests end with this error (logged once until a step "
                     << "succeeds)";
    }
  } else if (step_failures_.Succeeded()) {
    SDM_LOG(INFO) << "sdm scheduler: engine steps succeed again";
  }
  if (status.ok() && ++fitting_steps_ >= kCapProbeSteps) {
    fitting_steps_ = 0;
    absl::MutexLock lock(&mu_);
    if (batch_cap_ < options_.max_running) ++batch_cap_;  // try one more (the class comment)
  }
  for (const Planned& p : plan) {
    Job& job = *p.job;
    if (!status.ok()) {
      Finish(job, FinishReason::kError, failed_alone.ok() ? status : failed_alone);
      continue;
    }
    if (p.prefill > 0) {
      if (p.prompt_row >= 0) ScorePrompt(job, p.prompt_row, p.prefill);
      job.fed += p.prefill;
      if (job.fed == job.to_feed.size() && job.spec.sampling.max_tokens == 0) {
        Finish(job, FinishReason::kLength);  // read its prompt: all it was to do
        continue;
      }
    } else {
      job.next_input = -1;  // fed
    }
    if (p.draw < 0 && p.host_draw_row < 0) continue;
    const int32_t token = p.host_draw_row >= 0 ? DrawBiased(job, p.host_draw_row) : sampled[p.draw];
    ++job.state->sampler_draws;  // the draw's index was the count before it
    const Clock::time_point t = Clock::now();
    if (listener_ != nullptr) {
      if (p.prefill > 0) {
        listener_->OnFirstToken(Seconds(job.submitted, t));
      } else {
        listener_->OnInterToken(Seconds(job.last_token, t));
      }
    }
    job.last_token = t;
    if (p.logit_row < 0) {
      Emit(job, token, nullptr);
      continue;
    }
    const int64_t vocab = engine_.vocab_size();
    const TokenLogprobs logprobs = ComputeLogprobs(
        std::span<const float>(step_logits_)
            .subspan(static_cast<size_t>(p.logit_row * vocab), static_cast<size_t>(vocab)),
        token, *job.spec.logprobs);
    Emit(job, token, &logprobs);
  }
  if (listener_ != nullptr) {
    listener_->OnStep(decodes, prefilled, Seconds(step_start, Clock::now()));
  }
}

int32_t Scheduler::DrawBiased(const Job& job, int64_t row) {
  // What the engine's draw computes (SampleToken, engine/sampler.h), from the biased row.
  const int64_t vocab = engine_.vocab_size();
  const std::span<const float> logits =
      std::span<const float>(step_logits_)
          .subspan(static_cast<size_t>(row * vocab), static_cast<size_t>(vocab));
  biased_row_.assign(logits.begin(), logits.end());
  for (const auto& [id, bias] : job.spec.logit_bias) biased_row_[static_cast<size_t>(id)] += bias;
  return SampleToken(biased_row_, job.spec.sampling, job.state->sampler_draws);
}

void Scheduler::ScorePrompt(Job& job, int64_t first_row, size_t length) {
  // Row k of the chunk holds the logits after to_feed[fed + k]: they score to_feed[fed + k + 1].
  // The session's pending token (to_feed[0] when carried) is history, not the prompt: it is not
  // reported, but its row scores the prompt's first token. Without it, the first token of the
  // prompt has nothing before it in the pass.
  const size_t carried = job.had_pending ? 1 : 0;
  const int64_t vocab = engine_.vocab_size();
  std::vector<PromptTokenLogprobs> scored;
  scored.reserve(length + 1);
  if (job.fed == 0 && carried == 0) {
    scored.push_back({.token = job.to_feed[0], .logprobs = std::nullopt});
  }
  for (size_t k = 0; k < length; ++k) {
    const size_t next = job.fed + k + 1;
    if (next >= job.to_feed.size()) break;  // the last prompt row: it scores the drawn token
    const std::span<const float> row =
        std::span<const float>(step_logits_)
            .subspan(static_cast<size_t>((first_row + static_cast<int64_t>(k)) * vocab),
                     static_cast<size_t>(vocab));
    scored.push_back(
        {.token = job.to_feed[next],
         .logprobs = ComputeLogprobs(row, job.to_feed[next], *job.spec.prompt_logprobs)});
  }
  job.observer->OnPromptLogprobs(scored, /*prompt_done=*/job.fed + length == job.to_feed.size());
}

void Scheduler::Emit(Job& job, int32_t token, const TokenLogprobs* logprobs) {
  ++job.usage.generated_tokens;
  job.next_input = token;  // fed by the next decode, or left pending when the job ends here
  const GenerationPolicy::TokenOutput out = job.policy.Accept(token);
  if (out.end_token) {
    job.observer->OnEndToken(token, out.text, logprobs);
  } else {
    job.observer->OnToken(token, out.text, logprobs);
  }
  if (out.finish.has_value()) Finish(job, *out.finish);
}

void Scheduler::Finish(Job& job, FinishReason reason, const absl::Status& error) {
  if (job.done) return;
  job.done = true;
  // Ended here rather than by the policy: the text its tokens have but the client has not seen.
  if (const std::string held = job.policy.Flush(); !held.empty()) {
    job.observer->OnHeldText(held);
  }
  // The last sampled token has not been fed: the session keeps it for its next request.
  if (job.next_input >= 0) {
    job.state->pending_token = job.next_input;
  } else if (job.fed == 0 && job.had_pending) {
    job.state->pending_token = job.to_feed[0];  // ended before reading anything: keep it
  }
  job.next_input = -1;
  // Usage counts what was read (scheduler.h): a job that ended before its whole prompt was fed
  // (cancelled while queued or during its prefill, a deadline, an error) reports only the part
  // read. The pending token is history, read or kept (above): history then matches the session's
  // (GetSession counts a pending token).
  const int64_t carried = job.had_pending ? 1 : 0;
  job.usage.history_tokens += carried;
  job.usage.prompt_tokens = std::max<int64_t>(0, static_cast<int64_t>(job.fed) - carried);
  {
    // Its place in the batch, and among its tenant's requests, is free before the client hears
    // of the end: a next turn sent at once is admitted as if the step had already dropped this
    // job. (After a step that did not fit, the batch grows back one place per job that ends.)
    absl::MutexLock lock(&mu_);
    if (job.running) {
      --running_count_;
      if (batch_cap_ < options_.max_running) ++batch_cap_;
      job.running = false;
    }
    const auto tenant = tenants_.find(job.tenant());
    if (--tenant->second.in_flight == 0) tenants_.erase(tenant);
  }
  job.state->DropStaged();  // a job that never ran: its staged image goes back now
  job.state = nullptr;
  // Back to the store (which may park it) before the observer hears of the end, so a client
  // that sends its next turn right away finds the session free. A turn on a session is
  // acknowledged once it is durable (--persist turn): the store's worker calls back after writing
  // it, off the step thread (at once when there is nothing to wait for, and for a one-shot
  // session). Asked with the release, so that a deletion right after it is not taken for this
  // turn's write. A turn whose write was refused (replicas: another took the session over
  // meanwhile) is not in the session's state: the client is told so (ABORTED), not that it ended
  // well. (Every job holds its lease from Submit on.)
  job.lease.ReleaseWhenPersisted(
      [observer = job.observer, reason, usage = job.usage, error](const absl::Status& saved) {
        if (error.ok() && !saved.ok()) {
          observer->OnFinish(FinishReason::kError, usage, saved);
        } else {
          observer->OnFinish(reason, usage, error);
        }
      });
}

}  // namespace sdm
