// Scheduler: iteration-level continuous batching over the engine (docs/model-spec.md §10).
//
// One thread runs engine steps. Each step (1) ends waiting jobs that were cancelled or passed their
// deadline (they never run) and admits waiting jobs while fewer than max_running are running,
// (2) ends running jobs that were cancelled or passed their deadline, (3) plans one
// engine step (Engine::Step): prompt tokens within prefill_token_budget, a chunk at a time to
// the tenant fed least recently and within a tenant oldest job first, so a long prompt never
// stalls running streams for more than its budget nor one tenant's prompts another tenant's first
// token, plus one decode token for every job past its prompt, and (4) runs that plan as one forward
// pass (a job feeds at most one of the engine's prefill chunks per step; a budget above a chunk
// feeds several jobs' prompts at once), in which the engine draws each job's next token
// (StepBatch::AddDraw; on the device with CUDA, the logits never leave it). Prompts are cut at
// multiples of the engine's prefill chunk and a step is batch-invariant, so a job's tokens are bit
// for bit those it would get alone. A job whose prompt ends in a step gets its first token from
// that step and decodes from the next one. Tokens are sampled per job (engine/sampler.h) from the
// session's stream (the scheduler passes the session's draw count and advances it) and handed to
// the job's observer with their UTF-8 text delta; stop ids, the tokenizer's EOS, stop strings and
// max_tokens end a job, by the rules of engine/generation.h.
//
// Sessions: a job with a session id takes the session's lease from the SessionStateStore when it
// is submitted — so a busy session (ABORTED), an unknown one (NOT_FOUND) or a broken snapshot
// (DATA_LOSS) is refused before anything is streamed, as is a job prepared from a read of the
// session that is stale by then (GenerateJob::expected_history), a parked session is restored off
// the step thread, and a session not on the device is converted for its upload there too
// (Engine::StageResume) — and holds it until it finishes. The last sampled token of a job is left
// in the session as its pending token (not yet fed); the next job on the session feeds it first, so
// a conversation's history is exactly the tokens it saw. A job without a session runs on a one-shot
// session of the store (SessionStateStore::NewSession(), counted in its resident bytes) that is
// dropped at the end.
//
// A step that does not fit (the engine answers RESOURCE_EXHAUSTED having changed nothing: a
// device's memory cannot hold its sessions' state) no longer fails every job in it: of the jobs
// the step planned (not one whose prefill waited for the step's token budget), the one admitted
// last of the tenant holding the most places goes back to the front of the queue, its session as it
// was, and fewer jobs run at once (the batch is capped at what still runs, and grows by one place
// for each job that ends and every 64 steps that fit) until the step fits; a step of one job that
// does not fit fails that job (RESOURCE_EXHAUSTED, or ABORTED for a session that read part of the
// request: it keeps that part; a one-shot job keeps nothing, so it is RESOURCE_EXHAUSTED even after
// tokens were streamed). A deferred job's client sees nothing of it but the wait.
//
// Admission control: Submit() refuses with RESOURCE_EXHAUSTED when max_waiting jobs would wait
// ahead of it for a place in the batch (so max_waiting 0: no queue, only free places), or when
// its tenant (the session key's, set for one-shot jobs too) already has
// GenerateJob::tenant_max_requests jobs waiting or running, before the job has produced
// anything, so a client may retry.
//
// Fairness between tenants: a free place in the batch goes to the waiting job, oldest first, of
// the tenant with the fewest jobs running, and among those the tenant given a place least
// recently (a tenant with nothing waiting or running starts afresh). So one tenant's burst of
// requests cannot hold every place while another tenant waits: each tenant with work waiting
// gets a place in turn as places free, and with one tenant the queue is first come, first
// served. The step thread runs
// EngineOptions::decode_nice below the thread that made the scheduler (engine/engine.h), as the
// engine's kernel threads do, so that on busy cores Submit's callers are served first.
//
// Thread-safety: Submit/Shutdown/counters from any thread. Observers are called on the step
// thread and must not block.
#ifndef SDMSERVE_SERVER_SCHEDULER_H_
#define SDMSERVE_SERVER_SCHEDULER_H_

#include <algorithm>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/failure_episode.h"
#include "engine/engine.h"
#include "engine/generation.h"
#include "engine/logprobs.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"
#include "state_store/session_store.h"

namespace sdm {

// What a job read and sampled, as the APIs report it and the metrics count it (OnFinish).
// The scheduler feeds a session's pending token (the previous request's last generated token)
// ahead of the prompt; the caller never sent it, so it counts as history (read or, for a job
// that ended first, kept pending).
struct Usage {
  int64_t prompt_tokens = 0;     // tokens of this request's prompt read by the model (a job that
                                 // ended early: only those read before it ended)
  int64_t history_tokens = 0;    // tokens already carried by the session's state (not re-read)
  int64_t generated_tokens = 0;  // tokens sampled
};

struct GenerateJob {
  SessionKey session;           // empty id: one-shot (the tenant is still the caller's)
  std::vector<int32_t> prompt;  // at least one token (BOS already added by the caller)
  SamplingParams sampling;      // validated by the caller
  std::vector<std::string> stop_strings;
  // Added to the logits of these token ids before each draw (validated by the caller: ids in the
  // vocabulary, biases finite). The job's tokens are then drawn on the host from its logits row
  // (SampleToken of the biased row), whatever the backend; its log-probabilities stay the
  // model's own.
  std::vector<std::pair<int32_t, float>> logit_bias;
  // nullopt: none. N in [0, kMaxTopLogprobs]: each token's log-probability and its position's N
  // most probable tokens (engine/logprobs.h), handed to the observer with the token.
  std::optional<int> logprobs;
  // nullopt: none. N in [0, kMaxTopLogprobs]: each prompt token's log-probability given what the
  // session read before it, and its position's N most probable tokens (PromptTokenLogprobs),
  // handed to the observer as the prompt is read (JobObserver::OnPromptLogprobs). Costs the
  // logits of every prompt position (a vocabulary-wide row each, on the host).
  std::optional<int> prompt_logprobs;
  absl::Time deadline = absl::InfiniteFuture();
  // The most jobs of the session's tenant (session.tenant) waiting or running at once, this one
  // included; nullopt: no limit; 0: none, PERMISSION_DENIED (TenantLimits::max_requests).
  std::optional<int64_t> tenant_max_requests;
  // The session's history (position, plus one for a pending token) that the caller read when it
  // decided on BOS and on the limits; -1: not checked. Submit refuses the job when the leased
  // session holds another history (IsSessionChanged), so a decision made from a stale read (a
  // replica's copy before another replica's turn, or a turn that finished in between) never runs.
  int64_t expected_history = -1;
};

// Submit's refusal of a job whose GenerateJob::expected_history no longer matches its session
// (ABORTED, marked so that IsSessionChanged recognises it; nothing was changed); a front end that
// finds two of its own reads disagreeing answers the same. The caller prepares the job again.
absl::Status SessionChangedError(absl::string_view session_id, int64_t expected_history,
                                 int64_t history);
bool IsSessionChanged(const absl::Status& status);

// A prompt token read by a job that asked for the prompt's log-probabilities
// (GenerateJob::prompt_logprobs), and its log-probability given everything its session read
// before it (engine/logprobs.h). None for a token that nothing was read before: the first of a
// sequence (a one-shot request, a session at position 0), or the first of a turn on a session whose
// previous request left no token to read (one of max_tokens 0, or one that ended before reading
// its whole prompt). A
// session's previous turn otherwise leaves its last generated token pending: it is read first, so
// the prompt's first token is scored too.
struct PromptTokenLogprobs {
  int32_t token = 0;
  std::optional<TokenLogprobs> logprobs;
};

// Receives a job's output on the step thread — except OnFinish for a job on a session, which
// comes once the turn is written to the state directory (SessionLease::ReleaseWhenPersisted: from
// the store's worker or writer threads, from the Submit of the session's next turn when that
// writes it first, from a thread that deletes, parks (an etcd handoff's too) or persists the
// session, or at once on the step thread when nothing is to wait for), never later than
// its own write: not held up by the session's next turn. So an observer must be thread-safe, and
// a client's final chunk means its turn survives a crash (under --persist turn). A turn that was
// not saved ends, after its tokens, with the store's error instead (OnFinish kError): UNAVAILABLE
// when its write failed or writes fail (the session continues with it in memory; it is written
// once writes succeed again, and a crash before then may lose it), DATA_LOSS when the session broke
// before the write, ABORTED when it was deleted first or (replicas) another replica took the
// session over while it ran (it is not in the session's state).
class JobObserver {
 public:
  virtual ~JobObserver() = default;
  // One generated token and the text it completes (may be empty while a character or a possible
  // stop string is incomplete; never text past a stop string). Not called for EOS or stop ids.
  // `logprobs`: the token's (GenerateJob::logprobs), null when the job did not ask for them;
  // valid during the call.
  virtual void OnToken(int32_t token, absl::string_view text, const TokenLogprobs* logprobs) = 0;
  // The token that ended the job, the tokenizer's EOS or a stop id (which OnToken does not
  // report), and the text held back until then (an incomplete character as U+FFFD, or the start
  // of a stop string that can no longer complete); `logprobs` as OnToken's. Called just before
  // OnFinish; default: ignored.
  virtual void OnEndToken(int32_t token, absl::string_view text, const TokenLogprobs* logprobs) {}
  // For a job that asked for them (GenerateJob::prompt_logprobs): the prompt tokens read by a
  // step, in order, each prompt token once, all before the first OnToken; `prompt_done` on the
  // call with the prompt's last token. Valid during the call. Default: ignored.
  virtual void OnPromptLogprobs(std::span<const PromptTokenLogprobs> tokens, bool prompt_done) {}
  // A job that ends for a reason of the scheduler's (cancelled, a deadline, an error) after its
  // tokens' text was held back (a possible stop string's start, an incomplete character): that
  // text, final now (GenerationPolicy::Flush), as the session holds its tokens. Called just
  // before OnFinish, when non-empty.
  virtual void OnHeldText(absl::string_view text) = 0;
  // Exactly once. `error` is OK unless reason is kError.
  virtual void OnFinish(FinishReason reason, const Usage& usage, const absl::Status& error) = 0;
  // Polled every step, also while the job waits for a running place: true ends the job as
  // cancelled within that step (a waiting job then never runs).
  virtual bool IsCancelled() const = 0;
};

// Step-level events for metrics (optional).
class SchedulerListener {
 public:
  virtual ~SchedulerListener() = default;
  virtual void OnStep(int decode_batch, int64_t prefill_tokens, double seconds) {}
  virtual void OnFirstToken(double seconds_since_submit) {}
  virtual void OnInterToken(double seconds) {}
  // An engine step failed (its jobs ended with `error`, or a lone job did not fit).
  virtual void OnStepFailed(const absl::Status& error) {}
};

struct SchedulerOptions {
  int max_running = 32;  // jobs decoded together
  int max_waiting = 64;  // jobs waiting for a place in the batch before RESOURCE_EXHAUSTED
  int64_t prefill_token_budget = 256;  // prompt tokens per step
};

class Scheduler {
 public:
  Scheduler(Engine& engine, SessionStateStore& store, const Tokenizer& tokenizer,
            const SchedulerOptions& options, SchedulerListener* listener = nullptr);
  ~Scheduler();  // Shutdown(/*cancel=*/true)
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a job. Errors (nothing was streamed): RESOURCE_EXHAUSTED (queue full), UNAVAILABLE
  // (shutting down), INVALID_ARGUMENT (empty prompt), and the store's Acquire errors for the
  // session (NOT_FOUND, ABORTED, DATA_LOSS, ...).
  absl::Status Submit(GenerateJob job, std::shared_ptr<JobObserver> observer);

  // Stops admitting; then lets running and waiting jobs finish (cancel=false) or cancels them
  // (cancel=true): a job that ran ends kCancelled, one that never ran (queued) kError with
  // UNAVAILABLE, so its client retries it; returns when the step thread has exited. Idempotent;
  // concurrent calls each return once it has exited.
  void Shutdown(bool cancel);

  int running() const;
  int waiting() const;
  // Each tenant's jobs waiting or running now (tenants with none are absent).
  std::map<std::string, int64_t> TenantRequests() const;
  // Jobs sent back to the queue because a step of theirs did not fit (see the class comment).
  int64_t deferred_jobs() const;

 private:
  struct Job;
  void Loop();
  // The step thread waits for this (or for running jobs, which it holds itself).
  bool HasWorkLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || !waiting_.empty() || device_work_;
  }
  int BatchLimitLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return std::min(options_.max_running, batch_cap_);
  }
  // A job submitted now would wait behind max_waiting others: the waiting jobs beyond the
  // batch's free places (each takes one at the next step) are max_waiting already.
  bool QueueFullLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int free_places = std::max(0, BatchLimitLocked() - running_count_);
    return static_cast<int>(waiting_.size()) >= options_.max_waiting + free_places;
  }
  // Whether `job` submitted now may join the queue: UNAVAILABLE while shutting down,
  // RESOURCE_EXHAUSTED when the queue is full (QueueFullLocked) or its tenant has
  // job.tenant_max_requests in flight, saying which limit was met.
  absl::Status AdmissionLocked(const GenerateJob& job) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves waiting jobs into `running` while the batch has places, in the order of the class
  // comment (fairness between tenants).
  void AdmitLocked(std::vector<std::unique_ptr<Job>>& running) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Step(std::vector<std::unique_ptr<Job>>& running);
  // The token a biased job draws from the step's logits row `row` (GenerateJob::logit_bias).
  int32_t DrawBiased(const Job& job, int64_t row);
  // Hands the observer the log-probabilities of the prompt tokens a chunk of `length` tokens
  // (from job.fed, not yet advanced) scores, from the step's logits rows from `first_row` on.
  void ScorePrompt(Job& job, int64_t first_row, size_t length);
  void Emit(Job& job, int32_t token, const TokenLogprobs* logprobs);
  void Finish(Job& job, FinishReason reason, const absl::Status& error = absl::OkStatus())
      ABSL_LOCKS_EXCLUDED(mu_);

  Engine& engine_;
  SessionStateStore& store_;
  const Tokenizer& tokenizer_;
  const SchedulerOptions options_;
  SchedulerListener* listener_;

  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<Job>> waiting_ ABSL_GUARDED_BY(mu_);
  int running_count_ ABSL_GUARDED_BY(mu_) = 0;
  // The most jobs run at once now: max_running, lowered to what still ran after a step did not
  // fit and raised by one for each job that ends since (see the class comment).
  int batch_cap_ ABSL_GUARDED_BY(mu_) = std::numeric_limits<int>::max();
  // Steps that fit since the last one that did not (step thread only): every kCapProbeSteps of
  // them the cap grows by one, so that a batch capped by a passing shortage (or behind jobs that
  // run long) grows back without waiting for a job to end.
  int64_t fitting_steps_ = 0;
  // The logit rows a step returns (jobs asking for log-probabilities), kept for the next steps
  // so that they are not allocated every step (step thread only).
  std::vector<float> step_logits_;
  std::vector<float> biased_row_;  // DrawBiased's copy of a row (step thread only)
  static constexpr int64_t kCapProbeSteps = 64;
  // Prompt chunks planned so far, and for each tenant the count when it was last given one
  // (step thread only): tenants take prompt chunks in turn (the class comment).
  int64_t feeds_ = 0;
  std::map<std::string, int64_t, std::less<>> last_fed_;
  // Step failures are logged once per cause and episode, not once per step, and the recovery
  // once (step thread only).
  FailureEpisode step_failures_;
  // Submit's StageResume failures, for its log (once per cause and episode; Submit runs on any
  // thread).
  absl::Mutex staging_log_mu_;
  FailureEpisode staging_failures_ ABSL_GUARDED_BY(staging_log_mu_);
  int64_t deferred_jobs_ ABSL_GUARDED_BY(mu_) = 0;
  // Each tenant with jobs waiting or running: how many, and the admission (a count of places
  // given) that last gave it a place in the batch, 0 for none yet. An entry goes with its
  // tenant's last job (Finish).
  struct TenantJobs {
    int64_t in_flight = 0;
    int64_t last_admission = 0;
  };
  std::map<std::string, TenantJobs, std::less<>> tenants_ ABSL_GUARDED_BY(mu_);
  int64_t admissions_ ABSL_GUARDED_BY(mu_) = 0;
  bool accepting_ ABSL_GUARDED_BY(mu_) = true;
  bool cancel_all_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // The store queued device moves (SessionStateStore::SetStepThread): run them before the next
  // step even when no job runs.
  bool device_work_ ABSL_GUARDED_BY(mu_) = false;
  absl::Mutex join_mu_;  // held by Shutdown() while it joins thread_
  std::thread thread_ ABSL_GUARDED_BY(join_mu_);
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_SCHEDULER_H_
