// The two halves of preparing an OpenAI completion or chat request for the scheduler, split so
// that the window between them can be tested (tests/server/stale_session_read_test.cc):
// RenderOpenAiPrompt reads the session a chat continues and renders the template for it;
// PrepareOpenAiJob prepares the job from that text. PrepareGenerate reads the session again (its
// read decides BOS and the limits, and Submit checks the lease against it); a turn that finished
// between the two reads would leave the template rendered for another history than the job, so
// PrepareOpenAiJob refuses that with SessionChangedError, and SubmitOpenAiRequest (the handler's
// path) renders again (RetryWhileSessionChanged, server/service.h).
//
// Thread-safety: free functions; the service is thread-safe.
#ifndef SDMSERVE_SERVER_HTTP_OPENAI_PROMPT_H_
#define SDMSERVE_SERVER_HTTP_OPENAI_PROMPT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/http/chat_template.h"
#include "server/http/openai_json.h"
#include "server/scheduler.h"
#include "server/service.h"

namespace sdm {

struct OpenAiPrompt {
  std::string text;
  std::vector<std::string> stop;  // the chat template's stop strings (added to the request's)
  // The session's history (tokens, a pending one included) the chat template was rendered for;
  // -1 when no session was read (a completion, or a chat without a session).
  int64_t history = -1;
};

// The prompt text of `request`: a completion's own text; for chat, the template's rendering of
// the new messages, continuing the conversation when the named session already holds one.
// Errors: the session's (NOT_FOUND, PERMISSION_DENIED, ...), as GetSession returns them.
absl::StatusOr<OpenAiPrompt> RenderOpenAiPrompt(SdmServiceImpl& service, absl::string_view tenant,
                                                const OpenAiRequest& request,
                                                const ChatTemplate& chat_template);

// Prepares the job of `request` with `prompt` (SdmServiceImpl::PrepareGenerate). ABORTED marked
// IsSessionChanged when PrepareGenerate read another history than `prompt` was rendered for.
absl::Status PrepareOpenAiJob(SdmServiceImpl& service, absl::string_view tenant,
                              const OpenAiRequest& request, const OpenAiPrompt& prompt,
                              GenerateJob& job);

// What the handler does with a request: renders its prompt, prepares its job and submits it to
// `observer` (the two functions above, then SubmitGenerate), all again while the session changed
// in between (RetryWhileSessionChanged). Returns the prompt's length in tokens, or the last
// refusal. `between_reads`, when set, runs after each render and before its job is prepared: the
// window a test fills with another turn (the handler passes none).
absl::StatusOr<int64_t> SubmitOpenAiRequest(SdmServiceImpl& service, absl::string_view tenant,
                                            const OpenAiRequest& request,
                                            const ChatTemplate& chat_template,
                                            std::shared_ptr<JobObserver> observer,
                                            const std::function<void()>& between_reads = {});

}  // namespace sdm

#endif  // SDMSERVE_SERVER_HTTP_OPENAI_PROMPT_H_
