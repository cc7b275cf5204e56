#include "server/generate_stream.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/grpc_status.h"

namespace sdm {
namespace {

// How far before the call's deadline a cancellation still counts as the deadline passing (see
// OnFinish). Far below any deadline a client sets on purpose, far above clock disagreement.
constexpr absl::Duration kDeadlineClockSlack = absl::Milliseconds(100);

}  // namespace

v1::FinishReason ToProtoFinishReason(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case FinishReason::kEos:
      return v1::FINISH_REASON_EOS;
    case FinishReason::kCancelled:
      return v1::FINISH_REASON_CANCELLED;
    case FinishReason::kDeadline:
    case FinishReason::kError:
      break;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

GenerateStream::GenerateStream(Writer* writer, grpc::CallbackServerContext* context,
                               FinishCallback on_finish)
    : writer_(writer), context_(context), on_finish_(std::move(on_finish)) {}

void GenerateStream::Reject(const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    job_done_ = true;
    final_status_ = status;
    has_pending_ = false;
  }
  Pump();
}

namespace {

void ToProto(const TokenLogprobs& logprobs, v1::TokenLogprobs& out) {
  out.set_logprob(logprobs.chosen.logprob);
  for (const TokenLogprob& alternative : logprobs.top) {
    v1::TokenLogprob& top = *out.add_top();
    top.set_token_id(alternative.token);
    top.set_logprob(alternative.logprob);
  }
}

}  // namespace

void GenerateStream::OnToken(int32_t token, absl::string_view text, const TokenLogprobs* logprobs) {
  {
    absl::MutexLock lock(&mu_);
    if (broken_) return;
    pending_.add_token_ids(token);
    if (logprobs != nullptr) ToProto(*logprobs, *pending_.add_logprobs());
    pending_.mutable_text()->append(text.data(), text.size());
    has_pending_ = true;
  }
  Pump();
}

void GenerateStream::OnPromptLogprobs(std::span<const PromptTokenLogprobs> tokens,
                                      bool prompt_done) {
  if (tokens.empty()) return;  // a last chunk of one token scores nothing: no empty chunk
  {
    absl::MutexLock lock(&mu_);
    if (broken_) return;
    for (const PromptTokenLogprobs& token : tokens) {
      v1::PromptTokenLogprobs& entry = *pending_.add_prompt_logprobs();
      entry.set_token_id(token.token);
      if (token.logprobs.has_value()) ToProto(*token.logprobs, *entry.mutable_logprobs());
    }
    has_pending_ = true;
  }
  Pump();
}

void GenerateStream::OnEndToken(int32_t token, absl::string_view text,
                                const TokenLogprobs* logprobs) {
  // The EOS or stop id is part of the output's token ids; the text is what was held back.
  OnToken(token, text, logprobs);
}

void GenerateStream::OnHeldText(absl::string_view text) {
  {
    absl::MutexLock lock(&mu_);
    if (broken_) return;
    pending_.mutable_text()->append(text.data(), text.size());  // no token: its ids were sent
    has_pending_ = true;
  }
  Pump();
}

void GenerateStream::OnFinish(FinishReason reason, const Usage& usage, const absl::Status& error) {
  {
    absl::MutexLock lock(&mu_);
    usage_.set_prompt_tokens(usage.prompt_tokens);
    usage_.set_history_tokens(usage.history_tokens);
    usage_.set_generated_tokens(usage.generated_tokens);
    job_done_ = true;
    const bool client_cancelled = cancelled_.load() || broken_;
    switch (reason) {
      case FinishReason::kLength:
      case FinishReason::kStop:
      case FinishReason::kEos:
        final_status_ = absl::OkStatus();
        break;
      case FinishReason::kCancelled:
        if (!client_cancelled) {
          final_status_ = absl::OkStatus();  // the server stopped it (shutting down)
          break;
        }
        // gRPC's deadline timer runs on its own clock and can fire a little before deadline_
        // as absl::Now() reads it: a cancellation that close to the deadline is the deadline.
        if (absl::Now() + kDeadlineClockSlack < deadline_) {
          final_status_ = absl::CancelledError("the client cancelled the call");
          break;
        }
        [[fallthrough]];  // gRPC cancelled the call at its deadline
      case FinishReason::kDeadline:
        final_status_ = absl::DeadlineExceededError(
            absl::StrCat("the call's deadline passed after ", usage.generated_tokens,
                         " generated tokens; the session keeps what was read and generated"));
        break;
      case FinishReason::kError:
        final_status_ = error.ok() ? absl::InternalError("the generation failed") : error;
        break;
    }
    if (final_status_.ok()) {
      pending_.set_finish_reason(ToProtoFinishReason(reason));
      *pending_.mutable_usage() = usage_;
      has_pending_ = true;
    }
  }
  Pump();
}

void GenerateStream::OnCancel() { cancelled_.store(true); }

void GenerateStream::OnWriteDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      // The client is gone or cancelled: stop the job and drop what it has not received.
      broken_ = true;
      cancelled_.store(true);
      pending_.Clear();
      has_pending_ = false;
    }
  }
  Pump();
}

void GenerateStream::Pump() {
  bool finish = false;
  absl::Status status;
  v1::Usage usage;
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || writing_) return;
    if (has_pending_ && !broken_) {
      in_flight_.Clear();
      in_flight_.Swap(&pending_);
      has_pending_ = false;
      writing_ = true;
    } else if (job_done_) {
      finished_ = true;
      finish = true;
      status = final_status_;
      if (broken_ && status.ok()) status = absl::CancelledError("the client stopped reading");
      usage = usage_;
    } else {
      return;
    }
  }
  // Outside the lock: gRPC may run reactions inline. in_flight_ is not touched again until
  // OnWriteDone clears writing_.
  if (!finish) {
    writer_->StartWrite(&in_flight_);
    return;
  }
  on_finish_(status, usage);
  writer_->Finish(ToGrpcStatus(status, *context_));
}

void GenerateReactor::OnDone() {
  on_done_();
  delete this;  // gRPC hands ownership back here (callback API)
}

}  // namespace sdm
