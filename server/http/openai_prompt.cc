#include "server/http/openai_prompt.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/status_macros.h"

namespace sdm {

absl::StatusOr<OpenAiPrompt> RenderOpenAiPrompt(SdmServiceImpl& service, absl::string_view tenant,
                                                const OpenAiRequest& request,
                                                const ChatTemplate& chat_template) {
  OpenAiPrompt prompt;
  if (request.endpoint != OpenAiEndpoint::kChatCompletions) {
    prompt.text = request.prompts.empty() ? std::string() : request.prompts[0].text;
    return prompt;
  }
  if (!request.session_id.empty()) {
    v1::GetSessionRequest get;
    get.set_session_id(request.session_id);
    v1::Session session;
    SDM_RETURN_IF_ERROR(service.DoGetSession(tenant, get, session));
    prompt.history = session.position();
  }
  prompt.text = chat_template.Render(request.messages, /*continuing=*/prompt.history > 0);
  prompt.stop = chat_template.stop;
  return prompt;
}

absl::Status PrepareOpenAiJob(SdmServiceImpl& service, absl::string_view tenant,
                              const OpenAiRequest& request, const OpenAiPrompt& prompt,
                              GenerateJob& job) {
  // The chat template's stop strings count towards the limit: say so, rather than letting the
  // service count more strings than the request sent.
  if (!prompt.stop.empty() &&
      request.stop.size() + prompt.stop.size() > static_cast<size_t>(kMaxStopStrings)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'stop' has ", request.stop.size(), " strings; with the chat template's ",
                     prompt.stop.size(), " at most ",
                     kMaxStopStrings - static_cast<int>(prompt.stop.size()), " are allowed"));
  }
  v1::GenerateRequest generate = ToGenerateRequest(request, prompt.text, prompt.stop);
  if (request.endpoint == OpenAiEndpoint::kChatCompletions && !request.max_tokens.has_value()) {
    // OpenAI's chat API has no default: a reply runs until it ends by itself, up to this
    // server's limit (cut to the session's room, as every max_tokens is).
    generate.mutable_sampling()->set_max_tokens(service.model_info().max_tokens_limit());
  }
  SDM_RETURN_IF_ERROR(service.PrepareGenerate(tenant, absl::InfiniteFuture(), generate, job));
  if (prompt.history >= 0 && prompt.history != job.expected_history) {
    return SessionChangedError(request.session_id, prompt.history, job.expected_history);
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> SubmitOpenAiRequest(SdmServiceImpl& service, absl::string_view tenant,
                                            const OpenAiRequest& request,
                                            const ChatTemplate& chat_template,
                                            std::shared_ptr<JobObserver> observer,
                                            const std::function<void()>& between_reads) {
  int64_t prompt_tokens = 0;
  SDM_RETURN_IF_ERROR(RetryWhileSessionChanged([&]() -> absl::Status {
    SDM_ASSIGN_OR_RETURN(const OpenAiPrompt prompt,
                         RenderOpenAiPrompt(service, tenant, request, chat_template));
    if (between_reads) between_reads();
    GenerateJob job;
    SDM_RETURN_IF_ERROR(PrepareOpenAiJob(service, tenant, request, prompt, job));
    prompt_tokens = static_cast<int64_t>(job.prompt.size());
    return service.SubmitGenerate(std::move(job), observer);
  }));
  return prompt_tokens;
}

}  // namespace sdm
