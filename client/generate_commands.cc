// sdm-client generate and sdm-client chat.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/command.h"
#include "client/interrupt.h"
#include "nlohmann/json.hpp"

namespace sdm::client {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// What one Generate call streamed.
struct StreamOutcome {
  grpc::Status status;
  std::string text;
  std::vector<int32_t> token_ids;
  std::vector<sdm::v1::TokenLogprobs> logprobs;  // when asked for: one per token id
  std::vector<sdm::v1::PromptTokenLogprobs>
      prompt_logprobs;  // when asked for: one per prompt token
  sdm::v1::FinishReason finish_reason = sdm::v1::FINISH_REASON_UNSPECIFIED;
  sdm::v1::Usage usage;
  double ttft_seconds = -1;    // until the first chunk with tokens; -1: none came
  double seconds = 0;          // the whole call
  std::string retry_after_ms;  // the server's retry hint (grpc-retry-pushback-ms); empty: none
  // Whether the status came with a retry hint, even one not passed on in retry_after_ms: the
  // server sends one with every UNAVAILABLE, so an UNAVAILABLE without one is the connection's.
  bool server_hinted = false;
  bool interrupted = false;  // `interrupter` cancelled the call (Ctrl-C)
};

// Runs one Generate call, writing each chunk's text to `echo` (when not null) as it arrives.
// While it runs, `interrupter` (when not null) may cancel it.
StreamOutcome StreamGenerate(Command& command, const sdm::v1::GenerateRequest& request,
                             std::ostream* echo, TurnInterrupter* interrupter = nullptr) {
  StreamOutcome outcome;
  grpc::ClientContext context;
  command.Prepare(context);
  AddSessionRouting(request.session_id(), context);
  if (interrupter != nullptr) interrupter->BeginTurn(&context);
  const Clock::time_point start = Clock::now();
  std::unique_ptr<grpc::ClientReader<sdm::v1::GenerateResponse>> reader =
      command.stub().Generate(&context, request);
  sdm::v1::GenerateResponse chunk;
  while (reader->Read(&chunk)) {
    if (chunk.token_ids_size() > 0 && outcome.ttft_seconds < 0) {
      outcome.ttft_seconds = SecondsBetween(start, Clock::now());
    }
    outcome.token_ids.insert(outcome.token_ids.end(), chunk.token_ids().begin(),
                             chunk.token_ids().end());
    outcome.logprobs.insert(outcome.logprobs.end(), chunk.logprobs().begin(),
                            chunk.logprobs().end());
    outcome.prompt_logprobs.insert(outcome.prompt_logprobs.end(), chunk.prompt_logprobs().begin(),
                                   chunk.prompt_logprobs().end());
    outcome.text += chunk.text();
    if (echo != nullptr && !chunk.text().empty()) {
      *echo << chunk.text() << std::flush;
    }
    if (chunk.finish_reason() != sdm::v1::FINISH_REASON_UNSPECIFIED) {
      outcome.finish_reason = chunk.finish_reason();
    }
    if (chunk.has_usage()) outcome.usage = chunk.usage();
  }
  outcome.status = reader->Finish();
  if (interrupter != nullptr) outcome.interrupted = interrupter->EndTurn();
  outcome.seconds = SecondsBetween(start, Clock::now());
  outcome.retry_after_ms = RetryAfterMs(context);
  outcome.server_hinted = !outcome.retry_after_ms.empty();
  // A turn that ran and ended UNAVAILABLE was not saved but is in the session: not to be sent
  // again (docs/api.md, Errors), though the server hints a retry on every UNAVAILABLE.
  if (outcome.status.error_code() == grpc::StatusCode::UNAVAILABLE && !outcome.token_ids.empty()) {
    outcome.retry_after_ms.clear();
  }
  return outcome;
}

// "finish_reason=length prompt_tokens=5 history_tokens=0 generated_tokens=16 ttft_ms=3.1
// seconds=0.052 tokens_per_s=307.7"
std::string SummaryLine(const StreamOutcome& o) {
  std::string line =
      absl::StrFormat("finish_reason=%s prompt_tokens=%d history_tokens=%d generated_tokens=%d",
                      FinishReasonName(o.finish_reason), o.usage.prompt_tokens(),
                      o.usage.history_tokens(), o.usage.generated_tokens());
  if (o.ttft_seconds >= 0) absl::StrAppendFormat(&line, " ttft_ms=%.1f", o.ttft_seconds * 1e3);
  absl::StrAppendFormat(&line, " seconds=%.3f", o.seconds);
  if (o.seconds > 0) {
    absl::StrAppendFormat(&line, " tokens_per_s=%.1f", o.usage.generated_tokens() / o.seconds);
  }
  return line;
}

// Whether a Generate that failed left its turn in the session, as docs/api.md (Generate, Errors)
// says of each ending: "yes" (it ran: an UNAVAILABLE from the server after the tokens, a turn
// not yet written), "partly" (cancelled or past its deadline: what it read and generated until
// then, maybe nothing), "no" (a one-shot request; a rejection, which comes before any token; a
// turn not saved, DATA_LOSS), or "unknown" (ABORTED, which is both a rejection and a turn cut
// short or not saved; INTERNAL; a connection lost after the tokens; any other code after them).
absl::string_view TurnInSession(const StreamOutcome& o, bool on_session) {
  if (!on_session) return "no";
  const bool streamed = !o.token_ids.empty();
  switch (o.status.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
      if (!streamed) return "no";
      return o.server_hinted ? "yes" : "unknown";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::CANCELLED:
      return "partly";
    case grpc::StatusCode::DATA_LOSS:
      return "no";
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::INTERNAL:
    case grpc::StatusCode::UNKNOWN:
      return "unknown";
    default:
      return streamed ? "unknown" : "no";
  }
}

// generate --json's one object: what streamed, then how the call ended (finish_reason and usage,
// or the error).
nlohmann::json GenerateJson(const std::string& session, const StreamOutcome& o) {
  nlohmann::json j;
  j["session_id"] = session;
  j["text"] = o.text;
  j["token_ids"] = o.token_ids;
  // As the proto's JSON mapping writes them, but for -inf: null (JSON has no infinity).
  const auto number = [](double logprob) {
    return std::isinf(logprob) ? nlohmann::json(nullptr) : nlohmann::json(logprob);
  };
  const auto entry_json = [&number](const sdm::v1::TokenLogprobs& entry) {
    nlohmann::json top = nlohmann::json::array();
    for (const sdm::v1::TokenLogprob& t : entry.top()) {
      top.push_back({{"token_id", t.token_id()}, {"logprob", number(t.logprob())}});
    }
    return nlohmann::json{{"logprob", number(entry.logprob())}, {"top", std::move(top)}};
  };
  if (!o.logprobs.empty()) {
    nlohmann::json& logprobs = j["logprobs"] = nlohmann::json::array();
    for (const sdm::v1::TokenLogprobs& entry : o.logprobs) logprobs.push_back(entry_json(entry));
  }
  if (!o.prompt_logprobs.empty()) {
    // A token with nothing read before it has a null logprob and no alternatives.
    nlohmann::json& prompt = j["prompt_logprobs"] = nlohmann::json::array();
    for (const sdm::v1::PromptTokenLogprobs& entry : o.prompt_logprobs) {
      nlohmann::json e = entry.has_logprobs() ? entry_json(entry.logprobs())
                                              : nlohmann::json{{"logprob", nullptr},
                                                               {"top", nlohmann::json::array()}};
      e["token_id"] = entry.token_id();
      prompt.push_back(std::move(e));
    }
  }
  if (!o.status.ok()) {
    j["error"] = {{"code", StatusCodeName(o.status.error_code())},
                  {"message", o.status.error_message()},
                  {"turn_in_session", TurnInSession(o, !session.empty())}};
    return j;
  }
  j["finish_reason"] = FinishReasonName(o.finish_reason);
  j["usage"] = {{"prompt_tokens", o.usage.prompt_tokens()},
                {"history_tokens", o.usage.history_tokens()},
                {"generated_tokens", o.usage.generated_tokens()}};
  return j;
}

// The codes after which a chat turn can simply be retried: the session is still there.
bool TurnErrorIsRecoverable(grpc::StatusCode code) {
  return code == grpc::StatusCode::INVALID_ARGUMENT || code == grpc::StatusCode::ABORTED ||
         code == grpc::StatusCode::RESOURCE_EXHAUSTED ||
         code == grpc::StatusCode::DEADLINE_EXCEEDED || code == grpc::StatusCode::CANCELLED;
}

// GetSession of `id` (routed by it); a failure's retry hint in `*retry_after_ms` when not null.
grpc::Status ReadSession(Command& command, const std::string& id, sdm::v1::Session* out,
                         std::string* retry_after_ms = nullptr) {
  grpc::ClientContext context;
  command.Prepare(context);
  AddSessionRouting(id, context);
  sdm::v1::GetSessionRequest request;
  request.set_session_id(id);
  const grpc::Status status = command.stub().GetSession(&context, request, out);
  if (retry_after_ms != nullptr) *retry_after_ms = RetryAfterMs(context);
  return status;
}

}  // namespace

int RunGenerate(absl::Span<const std::string> args, const ClientIo& io) {
  Command command(io, "generate",
                  "sdm-client generate --prompt TEXT [--session ID] [--max_tokens N] "
                  "[--temperature T] [--top_k K] [--top_p P] [--seed S] [--stop STR]... "
                  "[--stop_ids ID,...] [--json [--logprobs N] [--prompt_logprobs N]]",
                  "Feeds the prompt to a session (or, without --session, to a one-shot sequence)\n"
                  "and streams the completion to stdout as it is generated. The finish reason and\n"
                  "token usage go to stderr. The prompt may also be the one positional argument;\n"
                  "'-' reads it from stdin.");
  std::string prompt;
  std::string session;
  bool json = false;
  SamplingFlags sampling;
  command.flags().AddString("prompt", &prompt, "the prompt text ('-': read stdin)");
  command.flags().AddString("session", &session,
                            "the session to continue (empty: a one-shot request)");
  command.flags().AddBool("json", &json,
                          "print one JSON object at the end instead of streaming: session_id, "
                          "text, token_ids, finish_reason, usage; for a failed call, what "
                          "streamed and error: code, message, turn_in_session");
  int64_t logprobs = 0;
  command.flags().AddInt("logprobs", &logprobs,
                         "with --json: each token's log-probability and the N most probable "
                         "tokens at its position (0 to 20), as \"logprobs\": [{logprob, top: "
                         "[{token_id, logprob}]}]");
  command.flags().SetDefaultText("logprobs", "unset: none");
  int64_t prompt_logprobs = 0;
  command.flags().AddInt("prompt_logprobs", &prompt_logprobs,
                         "with --json: each prompt token's log-probability given what was read "
                         "before it and the N most probable tokens at its position (0 to 20), as "
                         "\"prompt_logprobs\": [{token_id, logprob, top}] (logprob null for a "
                         "token with nothing before it)");
  command.flags().SetDefaultText("prompt_logprobs", "unset: none");
  AddSamplingFlags(command.flags(), &sampling);
  if (std::optional<int> exit = command.Parse(args)) return *exit;
  if (command.flags().IsSet("logprobs") && !json) {
    return command.UsageError("--logprobs needs --json (the text alone has no place for them)");
  }
  if (command.flags().IsSet("prompt_logprobs") && !json) {
    return command.UsageError(
        "--prompt_logprobs needs --json (the text alone has no place for them)");
  }

  const size_t prompts = command.positional().size() + (command.flags().IsSet("prompt") ? 1 : 0);
  if (prompts == 0) return command.UsageError("--prompt is required");
  if (prompts > 1) return command.UsageError("give the prompt once: --prompt TEXT or one argument");
  if (!command.flags().IsSet("prompt")) prompt = command.positional()[0];
  if (prompt == "-") {
    prompt.assign(std::istreambuf_iterator<char>(*io.in), std::istreambuf_iterator<char>());
  }
  if (prompt.empty()) return command.UsageError("the prompt is empty");

  sdm::v1::GenerateRequest request;
  request.set_session_id(session);
  request.set_text(prompt);
  if (absl::Status s = ApplySamplingFlags(command.flags(), sampling, request); !s.ok()) {
    return command.UsageError(s.message());
  }
  if (command.flags().IsSet("logprobs")) {
    // Out of int32: the server's range message says what is allowed.
    request.set_logprobs(static_cast<int32_t>(std::clamp<int64_t>(logprobs, -1, 1 << 20)));
  }
  if (command.flags().IsSet("prompt_logprobs")) {
    request.set_prompt_logprobs(
        static_cast<int32_t>(std::clamp<int64_t>(prompt_logprobs, -1, 1 << 20)));
  }
  if (std::optional<int> exit = command.Connect()) return *exit;

  const StreamOutcome outcome = StreamGenerate(command, request, json ? nullptr : io.out);
  if (!json && io.out_is_terminal && !outcome.text.empty() && outcome.text.back() != '\n') {
    *io.out << "\n" << std::flush;
  }
  // With --json a failed call prints its object too: a script must learn what streamed before
  // the failure and whether the turn is in the session (not to be sent again), which the text
  // on stderr alone does not say.
  if (json) {
    *io.out << GenerateJson(session, outcome)
                   .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
            << "\n"
            << std::flush;
  }
  if (!outcome.status.ok()) return command.Failure(outcome.status, outcome.retry_after_ms);
  *io.err << SummaryLine(outcome) << "\n";
  return kExitOk;
}

int RunChat(absl::Span<const std::string> args, const ClientIo& io) {
  Command command(
      io, "chat", "sdm-client chat --session ID [--create] [sampling flags]",
      "An interactive conversation on one session: each line read from stdin is a turn (sent\n"
      "with its newline), and the completion streams to stdout. The session keeps the whole\n"
      "history in its state on the server, so leaving (/quit or end of input) and running\n"
      "'sdm-client chat --session ID' later resumes the conversation where it stopped.\n"
      "--create starts a new session (without --session, the server picks its id).\n"
      "After each turn, stderr shows the tokens fed, the history carried and those generated.\n"
      "Commands: /quit (or /exit) leaves, /session shows the session, /help lists them.\n"
      "Ctrl-C while a turn streams cancels that turn (the session keeps what it did until then)\n"
      "and the chat goes on; Ctrl-C at the prompt, or twice in one turn, leaves.");
  std::string session_id;
  bool create = false;
  SamplingFlags sampling;
  command.flags().AddString("session", &session_id, "the session to talk on");
  command.flags().AddBool("create", &create, "create the session first");
  AddSamplingFlags(command.flags(), &sampling);
  if (std::optional<int> exit = command.Parse(args)) return *exit;
  if (!command.positional().empty()) {
    return command.UsageError(absl::StrCat("unexpected argument '", command.positional()[0], "'"));
  }
  if (session_id.empty() && !create) return command.UsageError("--session is required");
  sdm::v1::GenerateRequest turn;
  if (absl::Status s = ApplySamplingFlags(command.flags(), sampling, turn); !s.ok()) {
    return command.UsageError(s.message());
  }
  if (std::optional<int> exit = command.Connect()) return *exit;

  sdm::v1::Session session;
  {
    grpc::ClientContext context;
    command.Prepare(context);
    AddSessionRouting(session_id, context);
    grpc::Status status;
    if (create) {
      sdm::v1::CreateSessionRequest request;
      request.set_session_id(session_id);
      status = command.stub().CreateSession(&context, request, &session);
    } else {
      sdm::v1::GetSessionRequest request;
      request.set_session_id(session_id);
      status = command.stub().GetSession(&context, request, &session);
    }
    if (!status.ok()) {
      const int exit = command.Failure(status, context);
      if (status.error_code() == grpc::StatusCode::NOT_FOUND && !create) {
        *io.err << "(start a new conversation with --create)\n";
      }
      // The server suggests another id; the user more likely meant to go on with this one.
      if (status.error_code() == grpc::StatusCode::ALREADY_EXISTS && create &&
          !session_id.empty()) {
        *io.err << "(to resume it, drop --create: sdm-client chat --session " << session_id
                << ")\n";
      }
      return exit;
    }
  }
  turn.set_session_id(session.id());
  int64_t position = session.position();
  *io.err << "session " << session.id() << (create ? " created" : " resumed") << ": " << position
          << " tokens of history. One line per turn; /quit leaves.\n";

  // Ctrl-C while a turn streams cancels the turn, not the chat (client/interrupt.h).
  TurnInterrupter interrupter;
  std::unique_ptr<SigintRouter> sigint;
  if (io.route_sigint) {
    absl::StatusOr<std::unique_ptr<SigintRouter>> router = SigintRouter::Install(&interrupter);
    if (router.ok()) {
      sigint = *std::move(router);
    } else {
      *io.err << "sdm-client: Ctrl-C will end the chat, not a turn: " << router.status().message()
              << "\n";
    }
  }

  bool failed = false;
  std::string line;
  while (true) {
    if (io.in_is_terminal) *io.err << "> " << std::flush;
    if (!std::getline(*io.in, line)) break;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const absl::string_view trimmed = absl::StripAsciiWhitespace(line);
    if (trimmed.empty()) continue;
    if (trimmed == "/quit" || trimmed == "/exit") break;
    if (trimmed == "/help") {
      *io.err << "/quit or /exit: leave (the session stays on the server); /session: show it\n";
      continue;
    }
    if (trimmed == "/session") {
      sdm::v1::Session now;
      std::string retry_after_ms;
      if (grpc::Status s = ReadSession(command, session.id(), &now, &retry_after_ms); !s.ok()) {
        command.ReportFailure(s, retry_after_ms);
        failed = true;
        continue;
      }
      *io.err << "session " << now.id() << ": position " << now.position() << ", state_bytes "
              << now.state_bytes() << ", tier " << TierName(now.tier()) << "\n";
      continue;
    }
    if (absl::StartsWith(trimmed, "/")) {
      *io.err << "unknown command " << trimmed << " (/help lists them)\n";
      continue;
    }
    turn.set_text(absl::StrCat(line, "\n"));
    const StreamOutcome outcome = StreamGenerate(command, turn, io.out, &interrupter);
    if (!outcome.text.empty() && outcome.text.back() != '\n') *io.out << "\n";
    *io.out << std::flush;
    if (outcome.interrupted && outcome.status.error_code() == grpc::StatusCode::CANCELLED) {
      // Asked for, so not a failure. The server stops the turn within a step, and what it did
      // until then stays in the session (docs/api.md, Generate: a state is not rolled back).
      *io.err << "[turn cancelled (Ctrl-C) after " << outcome.token_ids.size()
              << " tokens received: the session keeps what the turn read of its prompt and "
                 "generated until the server stopped it; Ctrl-C at the prompt leaves]\n";
      position = -1;  // read again at the end
      continue;
    }
    if (!outcome.status.ok()) {
      command.ReportFailure(outcome.status, outcome.retry_after_ms);
      failed = true;
      // A turn that failed part-way (a deadline, a cancellation) may have left tokens in the
      // session (its state is not rolled back): its position is read again before it is shown.
      position = -1;
      if (!TurnErrorIsRecoverable(outcome.status.error_code())) return kExitFailure;
      continue;
    }
    const sdm::v1::Usage& u = outcome.usage;
    position = u.history_tokens() + u.prompt_tokens() + u.generated_tokens();
    *io.err << absl::StrFormat(
        "[%d prompt tokens + %d history tokens carried, %d generated, finish %s, %.3f s]\n",
        u.prompt_tokens(), u.history_tokens(), u.generated_tokens(),
        FinishReasonName(outcome.finish_reason), outcome.seconds);
  }
  if (sdm::v1::Session now; position < 0 && ReadSession(command, session.id(), &now).ok()) {
    position = now.position();
  }
  *io.err << "session " << session.id() << " kept"
          << (position >= 0 ? absl::StrCat(" at position ", position) : std::string())
          << "; resume with: sdm-client chat --session " << session.id() << "\n";
  return failed ? kExitFailure : kExitOk;
}

}  // namespace sdm::client
