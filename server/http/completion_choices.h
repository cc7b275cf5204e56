// The output of one OpenAI request's choices, each a scheduler job of its own (several prompts,
// or `n` above 1), from the step thread (each choice's JobObserver) to the connection's thread,
// which takes what arrived and renders it (server/http/openai_server.cc).
//
// Thread-safety: every method may be called from any thread; one mutex guards all choices, so the
// connection's thread waits on one condition whichever choice moves.
#ifndef SDMSERVE_SERVER_HTTP_COMPLETION_CHOICES_H_
#define SDMSERVE_SERVER_HTTP_COMPLETION_CHOICES_H_

#include <atomic>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/logprobs.h"
#include "engine/tokenizer.h"
#include "server/http/openai_json.h"
#include "server/metrics/server_metrics.h"
#include "server/scheduler.h"

namespace sdm {

class CompletionChoices : public std::enable_shared_from_this<CompletionChoices> {
 public:
  // What a Take hands over of one choice: the output since the previous Take, and its end the
  // first time a Take sees it.
  struct Choice {
    std::string text;
    std::vector<LogprobEntry> logprobs;  // of the tokens whose text is in `text` or before it
    bool ended = false;                  // it ended, and no earlier Take said so
    FinishReason reason = FinishReason::kStop;
    Usage usage;
    absl::Status error;  // not OK iff reason is kError
  };
  struct Taken {
    std::vector<Choice> choices;  // one per choice, by index
    bool done = false;            // every choice has ended
  };

  // `metrics` count each job's tokens when it ends, whether or not the response was written (a
  // client that went away still had its prompt read and tokens generated, as over gRPC).
  // `tokenizer` gives the tokens' strings in log-probabilities. Both outlive the jobs.
  static std::shared_ptr<CompletionChoices> Create(int count, ServerMetrics& metrics,
                                                   const Tokenizer& tokenizer);

  // The observer of choice `index`'s job (it keeps this object alive).
  std::shared_ptr<JobObserver> Observer(int index);

  // /v1/completions' echo: `prompt` leads choice `index`'s text. With the prompt's
  // log-probabilities it is released with the last of them, so that a stream's chunk holds the
  // prompt's text with its tokens; otherwise at once. Before the job is submitted.
  void Echo(int index, std::string prompt, bool with_prompt_logprobs);

  // Every job ends as cancelled within one step (the client went away, a refusal, or one
  // choice's error: Finish cancels the others itself).
  void Cancel() { cancelled_.store(true, std::memory_order_relaxed); }

  // Waits up to `timeout` for output or an end, and takes what is there.
  Taken Take(absl::Duration timeout);
  // Waits up to `timeout` for every choice to end, and takes what is there.
  Taken TakeEnd(absl::Duration timeout);

 private:
  class ChoiceObserver;
  struct Slot {
    std::string text;
    std::string echo;  // an echoed prompt not released yet (Echo)
    std::vector<LogprobEntry> logprobs;
    bool done = false;
    bool end_taken = false;  // a Take reported the end
    FinishReason reason = FinishReason::kStop;
    Usage usage;
    absl::Status error;
  };

  CompletionChoices(int count, ServerMetrics& metrics, const Tokenizer& tokenizer);

  void Append(int index, absl::string_view text, const TokenLogprobs* logprobs);
  void AppendPrompt(int index, std::span<const PromptTokenLogprobs> tokens, bool prompt_done);
  void Finish(int index, FinishReason reason, const Usage& usage, const absl::Status& error);
  bool HasNewsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool AllDoneLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Taken TakeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void ReleaseEcho(Slot& slot);
  LogprobEntry Entry(const TokenLogprobs& logprobs) const;
  LogprobToken Token(const TokenLogprob& t) const;

  ServerMetrics& metrics_;
  const Tokenizer& tokenizer_;
  std::atomic<bool> cancelled_{false};
  mutable absl::Mutex mu_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);  // sized at construction, never resized
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_HTTP_COMPLETION_CHOICES_H_
