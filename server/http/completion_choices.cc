#include "server/http/completion_choices.h"

#include <iterator>
#include <optional>
#include <utility>

namespace sdm {

class CompletionChoices::ChoiceObserver final : public JobObserver {
 public:
  ChoiceObserver(std::shared_ptr<CompletionChoices> choices, int index)
      : choices_(std::move(choices)), index_(index) {}

  void OnToken(int32_t, absl::string_view text, const TokenLogprobs* logprobs) override {
    choices_->Append(index_, text, logprobs);
  }
  // An end token (EOS, a stop id) is a generated token too (usage counts it): its entry has an
  // empty string, so the entries' strings still concatenate to the text.
  void OnEndToken(int32_t, absl::string_view text, const TokenLogprobs* logprobs) override {
    choices_->Append(index_, text, logprobs);
  }
  void OnPromptLogprobs(std::span<const PromptTokenLogprobs> tokens, bool prompt_done) override {
    choices_->AppendPrompt(index_, tokens, prompt_done);
  }
  void OnHeldText(absl::string_view text) override { choices_->Append(index_, text, nullptr); }
  void OnFinish(FinishReason reason, const Usage& usage, const absl::Status& error) override {
    choices_->Finish(index_, reason, usage, error);
  }
  bool IsCancelled() const override { return choices_->cancelled_.load(std::memory_order_relaxed); }

 private:
  const std::shared_ptr<CompletionChoices> choices_;
  const int index_;
};

std::shared_ptr<CompletionChoices> CompletionChoices::Create(int count, ServerMetrics& metrics,
                                                             const Tokenizer& tokenizer) {
  return std::shared_ptr<CompletionChoices>(new CompletionChoices(count, metrics, tokenizer));
}

CompletionChoices::CompletionChoices(int count, ServerMetrics& metrics, const Tokenizer& tokenizer)
    : metrics_(metrics), tokenizer_(tokenizer), slots_(static_cast<size_t>(count)) {}

std::shared_ptr<JobObserver> CompletionChoices::Observer(int index) {
  return std::make_shared<ChoiceObserver>(shared_from_this(), index);
}

void CompletionChoices::Echo(int index, std::string prompt, bool with_prompt_logprobs) {
  absl::MutexLock lock(&mu_);
  Slot& slot = slots_[static_cast<size_t>(index)];
  slot.echo = std::move(prompt);
  if (!with_prompt_logprobs) ReleaseEcho(slot);
}

CompletionChoices::Taken CompletionChoices::Take(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(
                           +[](CompletionChoices* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu_) {
                             return c->HasNewsLocked();
                           },
                           this),
                       timeout);
  return TakeLocked();
}

CompletionChoices::Taken CompletionChoices::TakeEnd(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(
                           +[](CompletionChoices* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu_) {
                             return c->AllDoneLocked();
                           },
                           this),
                       timeout);
  return TakeLocked();
}

bool CompletionChoices::HasNewsLocked() const {
  for (const Slot& slot : slots_) {
    if (!slot.text.empty() || !slot.logprobs.empty() || (slot.done && !slot.end_taken)) {
      return true;
    }
  }
  return false;
}

bool CompletionChoices::AllDoneLocked() const {
  for (const Slot& slot : slots_) {
    if (!slot.done) return false;
  }
  return true;
}

CompletionChoices::Taken CompletionChoices::TakeLocked() {
  Taken out;
  out.choices.resize(slots_.size());
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& slot = slots_[i];
    Choice& c = out.choices[i];
    c.text = std::move(slot.text);
    slot.text.clear();
    c.logprobs = std::move(slot.logprobs);
    slot.logprobs.clear();
    c.ended = slot.done && !slot.end_taken;
    slot.end_taken = slot.done;
    c.reason = slot.reason;
    c.usage = slot.usage;
    c.error = slot.error;
  }
  out.done = AllDoneLocked();
  return out;
}

void CompletionChoices::ReleaseEcho(Slot& slot) {
  slot.text.insert(0, slot.echo);  // nothing was generated before it
  slot.echo.clear();
}

LogprobToken CompletionChoices::Token(const TokenLogprob& t) const {
  return LogprobToken{.bytes = tokenizer_.TokenBytes(t.token), .logprob = t.logprob};
}

LogprobEntry CompletionChoices::Entry(const TokenLogprobs& logprobs) const {
  LogprobEntry entry{.chosen = Token(logprobs.chosen), .top = {}, .unscored = false};
  for (const TokenLogprob& t : logprobs.top) entry.top.push_back(Token(t));
  return entry;
}

void CompletionChoices::Append(int index, absl::string_view text, const TokenLogprobs* logprobs) {
  std::optional<LogprobEntry> entry;
  if (logprobs != nullptr) entry = Entry(*logprobs);
  if (text.empty() && !entry.has_value()) return;
  absl::MutexLock lock(&mu_);
  Slot& slot = slots_[static_cast<size_t>(index)];
  slot.text.append(text.data(), text.size());
  if (entry.has_value()) slot.logprobs.push_back(*std::move(entry));
}

void CompletionChoices::AppendPrompt(int index, std::span<const PromptTokenLogprobs> tokens,
                                     bool prompt_done) {
  std::vector<LogprobEntry> entries;
  entries.reserve(tokens.size());
  for (const PromptTokenLogprobs& token : tokens) {
    if (token.logprobs.has_value()) {
      entries.push_back(Entry(*token.logprobs));
    } else {
      entries.push_back(LogprobEntry{
          .chosen = Token({.token = token.token, .logprob = 0}), .top = {}, .unscored = true});
    }
  }
  absl::MutexLock lock(&mu_);
  Slot& slot = slots_[static_cast<size_t>(index)];
  std::move(entries.begin(), entries.end(), std::back_inserter(slot.logprobs));
  if (prompt_done) ReleaseEcho(slot);
}

void CompletionChoices::Finish(int index, FinishReason reason, const Usage& usage,
                               const absl::Status& error) {
  metrics_.prompt_tokens.Increment(static_cast<double>(usage.prompt_tokens));
  metrics_.history_tokens.Increment(static_cast<double>(usage.history_tokens));
  metrics_.generated_tokens.Increment(static_cast<double>(usage.generated_tokens));
  // The response is an error once one choice failed: the others stop within a step, whichever
  // path (whole, streamed, or waiting for the status) reads the end.
  if (reason == FinishReason::kError) Cancel();
  absl::MutexLock lock(&mu_);
  Slot& slot = slots_[static_cast<size_t>(index)];
  ReleaseEcho(slot);  // a job that ended before reading its whole prompt
  slot.done = true;
  slot.reason = reason;
  slot.usage = usage;
  slot.error = error;
}

}  // namespace sdm
