#include "server/scheduler.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"

namespace sdm {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Length of the longest prefix of `text` that can be emitted while keeping `hold` bytes back,
// moved back to a UTF-8 character boundary.
size_t EmittableLength(const std::string& text, size_t hold) {
  if (text.size() <= hold) return 0;
  size_t n = text.size() - hold;
  while (n > 0 && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) --n;
  return n;
}

}  // namespace

absl::string_view FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kDeadline:
      return "deadline";
    case FinishReason::kError:
      return "error";
  }
  return "?";
}

struct Scheduler::Job {
  Job(GenerateJob s, std::shared_ptr<JobObserver> o, const Tokenizer& tokenizer)
      : spec(std::move(s)), observer(std::move(o)), detok(tokenizer) {}

  GenerateJob spec;
  std::shared_ptr<JobObserver> observer;
  SessionLease lease;  // the job's session, or its one-shot session
  SessionState* state = nullptr;
  std::vector<int32_t> to_feed;  // the pending token (if any) then the prompt
  size_t fed = 0;
  int32_t next_input = -1;  // sampled, to be fed by the next decode
  Usage usage;
  IncrementalDetokenizer detok;
  std::string held;  // text held back: it may be the start of a stop string
  size_t max_stop = 0;
  Clock::time_point submitted = Clock::now();
  Clock::time_point last_token;
  bool had_pending = false;  // to_feed starts with the session's pending token
  bool done = false;
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
  std::lock_guard<std::mutex> lock(mu_);
  return running_count_;
}

int Scheduler::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(waiting_.size());
}

absl::Status Scheduler::Submit(GenerateJob spec, std::shared_ptr<JobObserver> observer) {
  if (spec.prompt.empty()) return absl::InvalidArgumentError("the prompt is empty");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!accepting_) return absl::UnavailableError("the server is shutting down");
    if (static_cast<int>(waiting_.size()) >= options_.max_waiting) {
      return absl::ResourceExhaustedError(absl::StrCat("the queue is full (", options_.max_waiting,
                                                       " requests waiting); retry later"));
    }
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
  job->usage.history_tokens = st.position();
  if (st.pending_token >= 0) {
    job->to_feed.push_back(st.pending_token);
    st.pending_token = -1;
    job->had_pending = true;
  }
  job->to_feed.insert(job->to_feed.end(), job->spec.prompt.begin(), job->spec.prompt.end());
  job->usage.prompt_tokens = static_cast<int64_t>(job->to_feed.size());
  st.sampler_seed = job->spec.sampling.seed;
  for (const std::string& s : job->spec.stop_strings) {
    job->max_stop = std::max(job->max_stop, s.size());
  }
  std::lock_guard<std::mutex> lock(mu_);
  absl::Status refused;
  if (!accepting_) {
    refused = absl::UnavailableError("the server is shutting down");
  } else if (static_cast<int>(waiting_.size()) >= options_.max_waiting) {
    refused = absl::ResourceExhaustedError(absl::StrCat("the queue is full (", options_.max_waiting,
                                                        " requests waiting); retry later"));
  }
  if (!refused.ok()) {
    if (job->had_pending) st.pending_token = job->to_feed[0];  // the session is unchanged
    return refused;
  }
  waiting_.push_back(std::move(job));
  wake_.notify_all();
  return absl::OkStatus();
}

void Scheduler::Shutdown(bool cancel) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    accepting_ = false;
    if (cancel) cancel_all_ = true;
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable() && std::this_thread::get_id() != thread_.get_id()) thread_.join();
}

void Scheduler::Loop() {
  std::vector<std::unique_ptr<Job>> running;
  while (true) {
    std::vector<std::unique_ptr<Job>> cancelled;
    bool cancel_all = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || !waiting_.empty() || !running.empty(); });
      if (stop_ && waiting_.empty() && running.empty()) break;
      cancel_all = cancel_all_;
      if (cancel_all) {
        while (!waiting_.empty()) {
          cancelled.push_back(std::move(waiting_.front()));
          waiting_.pop_front();
        }
      }
      while (!waiting_.empty() && static_cast<int>(running.size()) < options_.max_running) {
        running.push_back(std::move(waiting_.front()));
        waiting_.pop_front();
      }
      running_count_ = static_cast<int>(running.size());
    }
    for (auto& job : cancelled) Finish(*job, FinishReason::kCancelled);
    if (cancel_all) {
      for (auto& job : running) Finish(*job, FinishReason::kCancelled);
    }
    Step(running);
    running.erase(std::remove_if(running.begin(), running.end(),
                                 [](const std::unique_ptr<Job>& j) { return j->done; }),
                  running.end());
    std::lock_guard<std::mutex> lock(mu_);
    running_count_ = static_cast<int>(running.size());
  }
}

void Scheduler::Step(std::vector<std::unique_ptr<Job>>& running) {
  const Clock::time_point step_start = Clock::now();
  const absl::Time now = absl::Now();
  for (auto& job : running) {
    if (job->done) continue;
    if (job->observer->IsCancelled()) {
      Finish(*job, FinishReason::kCancelled);
    } else if (now > job->spec.deadline) {
      Finish(*job, FinishReason::kDeadline);
    }
  }
  // Prefill chunks, oldest first, within the step's token budget. A prompt is always cut at
  // multiples of the engine's prefill chunk (a chunk is never split to fit the budget), so its
  // numerics are those of one Prefill() call whatever else is running: batching changes nothing.
  int64_t budget = options_.prefill_token_budget;
  int64_t prefilled = 0;
  const int64_t vocab = engine_.vocab_size();
  const size_t chunk = static_cast<size_t>(engine_.options().prefill_chunk);
  for (auto& job : running) {
    while (!job->done && job->fed < job->to_feed.size()) {
      const size_t n = std::min(chunk, job->to_feed.size() - job->fed);
      // Over budget: wait for the next step, unless nothing was prefilled yet (progress).
      if (static_cast<int64_t>(n) > budget && prefilled > 0) break;
      const bool last = job->fed + n == job->to_feed.size();
      std::vector<float> logits;
      absl::Status s =
          engine_.Prefill(*job->state, std::span<const int32_t>(job->to_feed).subspan(job->fed, n),
                          false, last ? &logits : nullptr);
      if (!s.ok()) {
        Finish(*job, FinishReason::kError, s);
        break;
      }
      job->fed += n;
      budget -= static_cast<int64_t>(n);
      prefilled += static_cast<int64_t>(n);
      if (last) {
        const int32_t token = SampleToken(logits, job->spec.sampling, job->state->sampler_draws++);
        if (listener_ != nullptr) listener_->OnFirstToken(Seconds(job->submitted, Clock::now()));
        job->last_token = Clock::now();
        Emit(*job, token);
      }
    }
    if (budget <= 0) break;
  }
  // One decode step for every job past its prompt.
  std::vector<Job*> batch;
  std::vector<SessionState*> sessions;
  std::vector<int32_t> inputs;
  for (auto& job : running) {
    if (job->done || job->next_input < 0) continue;
    batch.push_back(job.get());
    sessions.push_back(job->state);
    inputs.push_back(job->next_input);
  }
  if (!batch.empty()) {
    std::vector<float> logits(batch.size() * vocab);
    absl::Status s = engine_.Decode(sessions, inputs, logits);
    for (size_t i = 0; i < batch.size(); ++i) {
      Job& job = *batch[i];
      if (!s.ok()) {
        Finish(job, FinishReason::kError, s);
        continue;
      }
      job.next_input = -1;  // fed
      const int32_t token = SampleToken(std::span<const float>(&logits[i * vocab], vocab),
                                        job.spec.sampling, job.state->sampler_draws++);
      const Clock::time_point t = Clock::now();
      if (listener_ != nullptr) listener_->OnInterToken(Seconds(job.last_token, t));
      job.last_token = t;
      Emit(job, token);
    }
  }
  if (listener_ != nullptr && (prefilled > 0 || !batch.empty())) {
    listener_->OnStep(static_cast<int>(batch.size()), prefilled, Seconds(step_start, Clock::now()));
  }
}

void Scheduler::Emit(Job& job, int32_t token) {
  ++job.usage.generated_tokens;
  job.next_input = token;  // fed by the next decode, or left pending when the job ends here
  const SamplingParams& p = job.spec.sampling;
  const bool eos = token == tokenizer_.eos_id();
  if (eos || std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) !=
                 p.stop_token_ids.end()) {
    // The text held back is final now; a stop string still cuts it.
    std::string rest = std::move(job.held) + job.detok.Flush();
    job.held.clear();
    for (const std::string& s : job.spec.stop_strings) {
      if (!s.empty()) rest = rest.substr(0, rest.find(s));
    }
    job.observer->OnEndToken(token, rest);
    Finish(job, eos ? FinishReason::kEos : FinishReason::kStop);
    return;
  }
  const bool last = job.usage.generated_tokens >= p.max_tokens;
  job.held += job.detok.Add(token);
  if (last) job.held += job.detok.Flush();
  // A stop string ends the text right before it.
  size_t stop_at = std::string::npos;
  for (const std::string& s : job.spec.stop_strings) {
    if (s.empty()) continue;
    stop_at = std::min(stop_at, job.held.find(s));
  }
  if (stop_at != std::string::npos) {
    job.observer->OnToken(token, absl::string_view(job.held).substr(0, stop_at));
    job.held.clear();
    Finish(job, FinishReason::kStop);
    return;
  }
  const size_t n =
      last ? job.held.size() : EmittableLength(job.held, job.max_stop > 0 ? job.max_stop - 1 : 0);
  job.observer->OnToken(token, absl::string_view(job.held).substr(0, n));
  job.held.erase(0, n);
  if (last) Finish(job, FinishReason::kLength);
}

void Scheduler::Finish(Job& job, FinishReason reason, const absl::Status& error) {
  if (job.done) return;
  job.done = true;
  // The last sampled token has not been fed: the session keeps it for its next request.
  if (job.next_input >= 0) {
    job.state->pending_token = job.next_input;
  } else if (job.fed == 0 && job.had_pending) {
    job.state->pending_token = job.to_feed[0];  // ended before reading anything: keep it
  }
  job.next_input = -1;
  // Back to the store (which may park it) before the observer hears of the end, so a client
  // that sends its next turn right away finds the session free.
  job.lease = SessionLease();
  job.state = nullptr;
  job.observer->OnFinish(reason, job.usage, error);
  if (listener_ != nullptr) {
    listener_->OnJobFinished(reason, job.usage, Seconds(job.submitted, Clock::now()));
  }
}

}  // namespace sdm
