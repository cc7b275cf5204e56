#include "server/http/openai_server.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <regex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/random/random.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
#include "engine/logprobs.h"
#include "engine/tokenizer.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "server/http/completion_choices.h"
#include "server/http/connection_pool.h"
#include "server/http/console_page.h"
#include "server/http/http_status.h"
#include "server/http/listen_socket.h"
#include "server/http/openai_json.h"
#include "server/http/openai_prompt.h"
#include "server/scheduler.h"
#include "server/tenant_limits.h"

namespace sdm {
namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// Every JSON response's type, with its charset. Not for show: httplib compresses a chunked
// response typed exactly "application/json" for a client that accepts gzip or br (the official
// SDKs do), and its compressor holds back the non-streaming heartbeats, so a client that left
// would never be noticed (the heartbeats: server/http/openai_server.h). Event streams are never
// compressed.
constexpr char kJsonContentType[] = "application/json; charset=utf-8";

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

void SendError(httplib::Response& res, const absl::Status& status, absl::string_view code = "",
               absl::string_view param = "") {
  const HttpError e = ToHttpError(status, code, param);
  res.status = e.status;
  if (e.retry_after_seconds.has_value()) {
    res.set_header("Retry-After", absl::StrCat(*e.retry_after_seconds));
  }
  res.set_content(e.body, kJsonContentType);
}

void SendJson(httplib::Response& res, const Json& body) {
  res.status = 200;
  res.set_content(Dump(body), kJsonContentType);
}

// Whether `origin` is one CORS origin: "*", or "scheme://host[:port]" with nothing after.
bool IsCorsOrigin(absl::string_view origin) {
  if (origin == "*") return true;
  const size_t scheme_end = origin.find("://");
  if (scheme_end == absl::string_view::npos || scheme_end == 0) return false;
  const absl::string_view host = origin.substr(scheme_end + 3);
  return !host.empty() && host.find_first_of("/?#*, ") == absl::string_view::npos;
}

// What Access-Control-Allow-Origin says to a request from `origin` (its Origin header): that
// origin, or "*" where any is allowed; empty when it is not allowed (or there is none).
std::string AllowedOrigin(const std::vector<std::string>& allowed, const std::string& origin) {
  if (origin.empty()) return "";
  for (const std::string& a : allowed) {
    if (a == "*") return a;
    if (a == origin) return origin;
  }
  return "";
}

std::string RandomId(absl::string_view prefix) {
  thread_local absl::BitGen gen;
  return absl::StrFormat("%s%016x%08x", prefix, absl::Uniform<uint64_t>(gen),
                         absl::Uniform<uint32_t>(gen));
}

// The OpenAI finish reason of a job that ended normally.
const char* FinishReasonOf(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStop:
    case FinishReason::kEos:
      return "stop";
    default:
      return "cancelled";
  }
}

// A duration in whole seconds as the session endpoints take it ("ttl_seconds").
absl::Status ParseTtl(const Json& body, google::protobuf::Duration& out, bool& has) {
  const auto it = body.find("ttl_seconds");
  if (it == body.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number()) return absl::InvalidArgumentError("'ttl_seconds' must be a number");
  const double s = it->get<double>();
  if (!(s >= 0)) {
    return absl::InvalidArgumentError(
        "'ttl_seconds' must be a non-negative number of seconds (0: the server's default)");
  }
  // Past kMaxSessionTtl: the service's message, naming the value as sent (one past what a
  // Duration holds, 1e20 say, could not reach the service's check).
  if (s > absl::ToDoubleSeconds(kMaxSessionTtl)) {
    return TtlTooLongError("'ttl_seconds'", it->dump());
  }
  out.set_seconds(static_cast<int64_t>(s));
  out.set_nanos(static_cast<int32_t>((s - static_cast<double>(out.seconds())) * 1e9));
  has = true;
  return absl::OkStatus();
}

absl::Status ParseLabels(const Json& body, google::protobuf::Map<std::string, std::string>& out) {
  const auto it = body.find("labels");
  if (it == body.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_object()) return absl::InvalidArgumentError("'labels' must be an object of strings");
  for (const auto& [k, v] : it->items()) {
    if (!v.is_string()) return absl::InvalidArgumentError("'labels' must be an object of strings");
    out[k] = v.get<std::string>();
  }
  return absl::OkStatus();
}

// Whether `req` carries a body: a Content-Length other than 0, or chunks (RFC 9112 §6.3).
bool HasBody(const httplib::Request& req) {
  if (req.has_header("Transfer-Encoding")) return true;
  const std::string length = req.get_header_value("Content-Length");
  return !length.empty() && length != "0";
}

// Whether httplib 0.11 reads a request's body before its route runs (POST routes read their own,
// Handlers::Post): for POST, PUT and PATCH, and DELETE only with a Content-Length. Any other
// body is left on the connection.
bool BodyIsRead(const httplib::Request& req) {
  return req.method == "POST" || req.method == "PUT" || req.method == "PATCH" ||
         (req.method == "DELETE" && req.has_header("Content-Length"));
}

// Ends the connection once `res` is written. httplib 0.11 keeps every connection open that the
// client did not ask to close, and reads whatever follows a response as the next request: after
// a request whose body was left unread (or could not be read), the rest of that body, a run of
// 400s and 414s with the client's next real request lost among them. It ends a connection only
// when a response fails to be written, so the body goes out through a provider that writes all
// of it, then reports a failure. For the post-routing handler: the body is written as it is
// (httplib has cut and compressed it, and set its length). A response without a body (HEAD) is
// not ended.
void EndConnectionAfter(httplib::Response& res) {
  if (res.body.empty()) return;
  auto body = std::make_shared<const std::string>(std::move(res.body));
  res.body.clear();
  const std::string type = res.get_header_value("Content-Type");
  res.headers.erase("Content-Type");  // set again by set_content_provider
  res.set_content_provider(body->size(), type, [body](size_t, size_t, httplib::DataSink& sink) {
    sink.write(body->data(), body->size());
    return false;
  });
}

// A size as a message states it: FormatByteSize's "4MiB" as "4 MiB"; "100000 bytes" where no
// binary unit divides it.
std::string SizeText(size_t bytes) {
  std::string text = FormatByteSize(static_cast<int64_t>(bytes));
  const size_t unit = text.find_first_not_of("0123456789");
  if (unit == std::string::npos) return absl::StrCat(text, " bytes");
  text.insert(unit, " ");
  return text;
}

// A request naming a model this server does not serve (OpenAI's model_not_found).
absl::Status UnknownModelError(absl::string_view asked, absl::string_view served) {
  return absl::NotFoundError(absl::StrCat("the model '", asked,
                                          "' does not exist; this server serves '", served,
                                          "' (GET /v1/models)"));
}

// A session endpoint's optional JSON object body.
absl::StatusOr<Json> ParseObjectBody(const std::string& body) {
  if (body.empty()) return Json::object();
  Json j = ParseJsonBody(body);
  if (j.is_discarded()) return absl::InvalidArgumentError("the request body is not valid JSON");
  if (!j.is_object()) return absl::InvalidArgumentError("the request body must be a JSON object");
  return j;
}

absl::Status GetStringField(const Json& j, const char* name, std::string& out) {
  const auto it = j.find(name);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_string())
    return absl::InvalidArgumentError(absl::StrCat("'", name, "' must be a string"));
  out = it->get<std::string>();
  return absl::OkStatus();
}

// The session a request names: the body's field `body_id` (its "session_id"; empty: none) or the
// X-Session-Id header, which the multi-replica router hashes on (deploy/nginx/nginx.conf), so
// that a client behind it may name the session by the header alone. Both given must agree.
absl::StatusOr<std::string> SessionIdOf(const httplib::Request& req, absl::string_view body_id) {
  const std::string header = req.get_header_value("X-Session-Id");
  if (header.empty()) return std::string(body_id);
  if (!body_id.empty() && body_id != header) {
    return absl::InvalidArgumentError(absl::StrCat("'session_id' ('", body_id,
                                                   "') and the X-Session-Id header ('", header,
                                                   "') name different sessions"));
  }
  return header;
}

}  // namespace

class OpenAiServer::Handlers {
 public:
  Handlers(OpenAiServer& owner, const OpenAiServerOptions& options, SdmServiceImpl& service,
           const Reloadable<ApiKeyAuthenticator>& auth, ServerMetrics& metrics,
           ChatTemplate chat_template, int scheduler_slots)
      : owner_(owner),
        options_(options),
        service_(service),
        auth_(auth),
        metrics_(metrics),
        chat_template_(std::move(chat_template)),
        model_name_(service.model_info().name()),
        created_(absl::ToUnixSeconds(absl::Now())),
        scheduler_slots_(scheduler_slots) {}

  void Install(httplib::Server& http);

 private:
  absl::StatusOr<std::string> Tenant(const httplib::Request& req) const {
    return auth_.Get()->TenantFor(req.get_header_value("Authorization"), KeyCarrier::kHttpHeader);
  }
  Json ModelJson() const {
    return Json{
        {"id", model_name_}, {"object", "model"}, {"created", created_}, {"owned_by", "sdmserve"}};
  }
  // Runs a non-generating endpoint: authenticates, runs `body` and records its metrics. An error
  // body's code is `*error_code` where `body` set it (e.g. "model_not_found"), else the status's.
  template <typename Body>
  void Unary(const httplib::Request& req, httplib::Response& res, absl::string_view method,
             Body&& body, const std::string* error_code = nullptr);
  void Generate(const httplib::Request& req, const std::string& body, httplib::Response& res,
                OpenAiEndpoint endpoint);
  // Routes POSTs to `pattern` to `handler(req, body, res)`, the body read here (see Install).
  void Post(
      httplib::Server& http, const std::string& pattern,
      std::function<void(const httplib::Request&, const std::string&, httplib::Response&)> handler);
  // A body's `model`: absent, or the served model's name; another is NOT_FOUND, with
  // `error_code` set to OpenAI's model_not_found.
  absl::Status CheckModelField(const Json& body, std::string& error_code) const;
  // Routes GETs (and HEADs) or DELETEs to `pattern`.
  void Get(httplib::Server& http, const std::string& pattern, httplib::Server::Handler handler);
  void Delete(httplib::Server& http, const std::string& pattern, httplib::Server::Handler handler);
  // The methods routed for `path` (a GET route takes HEAD too, as httplib serves it), in the
  // order of their routes.
  std::vector<std::string> MethodsFor(const std::string& path) const;
  // Answers a request that no route takes: 405 with an Allow header when its path takes other
  // methods, else 404. Its body is not read.
  void RefuseUnrouted(const httplib::Request& req, httplib::Response& res) const;

  OpenAiServer& owner_;
  const OpenAiServerOptions options_;
  SdmServiceImpl& service_;
  const Reloadable<ApiKeyAuthenticator>& auth_;
  ServerMetrics& metrics_;
  const ChatTemplate chat_template_;
  const std::string model_name_;
  const int64_t created_;
  const int scheduler_slots_;  // max_running + max_waiting: the most jobs admitted at once
  // Every route, as httplib matches it (the whole path against the pattern); set by Install,
  // read-only while serving.
  struct Route {
    std::string method;
    std::regex pattern;
  };
  std::vector<Route> routes_;
};

template <typename Body>
void OpenAiServer::Handlers::Unary(const httplib::Request& req, httplib::Response& res,
                                   absl::string_view method, Body&& body,
                                   const std::string* error_code) {
  const Clock::time_point start = Clock::now();
  absl::StatusOr<std::string> tenant = Tenant(req);
  absl::StatusOr<Json> out = tenant.ok() ? body(*tenant) : absl::StatusOr<Json>(tenant.status());
  service_.RecordRequest(method, out.status().code(), start);
  if (!out.ok()) {
    SendError(res, out.status(), error_code != nullptr ? *error_code : "");
    return;
  }
  SendJson(res, *out);
}

absl::Status OpenAiServer::Handlers::CheckModelField(const Json& body,
                                                     std::string& error_code) const {
  const auto it = body.find("model");
  if (it == body.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_string()) return absl::InvalidArgumentError("'model' must be a string");
  if (*it == model_name_) return absl::OkStatus();
  error_code = "model_not_found";
  return UnknownModelError(it->get<std::string>(), model_name_);
}

void OpenAiServer::Handlers::Get(httplib::Server& http, const std::string& pattern,
                                 httplib::Server::Handler handler) {
  routes_.push_back({"GET", std::regex(pattern)});
  http.Get(pattern, std::move(handler));
}

void OpenAiServer::Handlers::Delete(httplib::Server& http, const std::string& pattern,
                                    httplib::Server::Handler handler) {
  routes_.push_back({"DELETE", std::regex(pattern)});
  http.Delete(pattern, std::move(handler));
}

std::vector<std::string> OpenAiServer::Handlers::MethodsFor(const std::string& path) const {
  std::vector<std::string> methods;
  for (const Route& route : routes_) {
    if (!std::regex_match(path, route.pattern)) continue;
    if (std::find(methods.begin(), methods.end(), route.method) != methods.end()) continue;
    methods.push_back(route.method);
    if (route.method == "GET") methods.push_back("HEAD");
  }
  return methods;
}

void OpenAiServer::Handlers::RefuseUnrouted(const httplib::Request& req,
                                            httplib::Response& res) const {
  const std::string endpoint = absl::StrCat("no endpoint ", req.method, " ", req.path);
  const std::vector<std::string> methods = MethodsFor(req.path);
  if (methods.empty()) {
    SendError(res, absl::NotFoundError(endpoint));
    return;
  }
  const std::string allow = absl::StrJoin(methods, ", ");
  res.status = 405;
  res.set_header("Allow", allow);
  res.set_content(ErrorBody(405, absl::StrCat(endpoint, "; ", req.path, " takes ", allow),
                            "method_not_allowed"),
                  kJsonContentType);
}

void OpenAiServer::Handlers::Post(
    httplib::Server& http, const std::string& pattern,
    std::function<void(const httplib::Request&, const std::string&, httplib::Response&)> handler) {
  routes_.push_back({"POST", std::regex(pattern)});
  // httplib's own read of a body refuses one sent as application/x-www-form-urlencoded (what
  // `curl -d` sends without a Content-Type) past 8 KiB (CPPHTTPLIB_FORM_URL_ENCODED_PAYLOAD_MAX_
  // LENGTH, compiled into the library) whatever the server's limit; read here, every content
  // type has the one limit, max_body_bytes (past it: 413). httplib applies it to a body with a
  // Content-Length (and skips the body, so the connection stays usable); the check below covers
  // a chunked one, which is not read past the limit: its connection is closed after the 413.
  const size_t limit = options_.max_body_bytes;
  http.Post(pattern, [handler = std::move(handler), limit](const httplib::Request& req,
                                                           httplib::Response& res,
                                                           const httplib::ContentReader& read) {
    std::string body;
    // A request with neither a length nor chunks has no body (RFC 9112 §6.3): httplib would read
    // one until the connection closes, holding `curl -X POST` for the read timeout, then 400.
    if (!req.has_header("Content-Length") && !req.has_header("Transfer-Encoding")) {
      handler(req, body, res);
      return;
    }
    bool too_large = false;
    const auto receive = [&](const char* data, size_t size) {
      too_large = body.size() + size > limit;
      if (!too_large) body.append(data, size);
      return !too_large;
    };
    // multipart/form-data is read through httplib's multipart parser (the one-receiver read
    // would throw), then refused.
    const bool multipart = req.is_multipart_form_data();
    const bool complete =
        multipart ? read([](const httplib::MultipartFormData&) { return true; }, receive)
                  : read(receive);
    if (too_large) res.status = 413;
    if (!complete || too_large) {
      // The rest of the body is still on the connection (past the limit, or not readable), and
      // would be read as the next requests: the connection ends with the answer. Only httplib's
      // own 413, for a Content-Length past the limit, read (and dropped) the whole body.
      if (too_large || res.status != 413) res.set_header("Connection", "close");
      return;  // res.status says why; the error handler writes it
    }
    if (multipart) {
      SendError(res, absl::InvalidArgumentError(
                         "the request body must be JSON, not multipart/form-data"));
      return;
    }
    handler(req, body, res);
  });
}

void OpenAiServer::Handlers::Generate(const httplib::Request& req, const std::string& body,
                                      httplib::Response& res, OpenAiEndpoint endpoint) {
  const Clock::time_point start = Clock::now();
  const absl::string_view method =
      endpoint == OpenAiEndpoint::kCompletions ? "OpenAI.Completions" : "OpenAI.ChatCompletions";
  const auto refuse = [&](const absl::Status& status, absl::string_view code = "") {
    service_.RecordRequest(method, status.code(), start);
    if (code.empty() && IsContextTooLong(status)) {
      // OpenAI's code and field for it, which clients trim their history on.
      return SendError(res, status, "context_length_exceeded",
                       endpoint == OpenAiEndpoint::kCompletions ? "prompt" : "messages");
    }
    SendError(res, status, code);
  };
  absl::StatusOr<std::string> tenant = Tenant(req);
  if (!tenant.ok()) return refuse(tenant.status());
  absl::StatusOr<OpenAiRequest> request = ParseOpenAiRequest(body, endpoint);
  if (!request.ok()) return refuse(request.status());
  if (!request->seed.has_value()) {
    // As OpenAI's API: without a seed, each request samples afresh (a regenerate button, a
    // retry after a bad answer). gRPC's default seed is 0, for reproducible runs.
    thread_local absl::BitGen gen;
    request->seed = absl::Uniform<uint64_t>(gen);
  }
  if (!request->model.empty() && request->model != model_name_) {
    return refuse(UnknownModelError(request->model, model_name_), "model_not_found");
  }
  absl::StatusOr<std::string> named = SessionIdOf(req, request->session_id);
  if (!named.ok()) return refuse(named.status());
  request->session_id = *std::move(named);

  // Several prompts, or n above 1: a one-shot job per choice, choice i = prompt * n + j
  // sampling with seed + j.
  const int prompts =
      endpoint == OpenAiEndpoint::kCompletions ? static_cast<int>(request->prompts.size()) : 1;
  const int count = prompts * request->n;
  if (count > 1 && !request->session_id.empty()) {
    return refuse(absl::InvalidArgumentError(absl::StrCat(
        "a session runs one generation at a time: this request asks for ", count, " choices (",
        prompts, " prompts, n = ", request->n,
        "); send one prompt with n 1, or leave the session out (several choices are one-shot)")));
  }
  if (count > 1) {
    // Choices are admitted one job at a time: more than could ever be admitted together would be
    // refused with a retry hint, and every retry refused again.
    const std::optional<int64_t> tenant_max = service_.TenantMaxRequests(*tenant);
    if (count > scheduler_slots_ || (tenant_max.has_value() && count > *tenant_max)) {
      return refuse(absl::InvalidArgumentError(absl::StrCat(
          "this request asks for ", count, " choices (", prompts, " prompts, n = ", request->n,
          "), each a request of its own; at most ",
          tenant_max.has_value() ? std::min<int64_t>(*tenant_max, scheduler_slots_)
                                 : scheduler_slots_,
          " can be admitted at once (",
          tenant_max.has_value() ? absl::StrCat("the tenant's max_requests ", *tenant_max, ", ")
                                 : "",
          "the server's --max_running plus --max_waiting ", scheduler_slots_,
          "): send fewer per request")));
    }
  }
  const auto choices = CompletionChoices::Create(count, metrics_, service_.tokenizer());
  owner_.active_generations_.fetch_add(1);
  for (int i = 0; i < count; ++i) {
    OpenAiRequest one = *request;
    if (endpoint == OpenAiEndpoint::kCompletions) {
      one.prompts = {request->prompts[static_cast<size_t>(i / request->n)]};
    }
    one.seed = *request->seed + static_cast<uint64_t>(i % request->n);
    if (one.echo) {
      const CompletionPrompt& prompt = one.prompts[0];
      choices->Echo(i, prompt.is_tokens ? service_.tokenizer().Decode(prompt.tokens) : prompt.text,
                    /*with_prompt_logprobs=*/one.logprobs.has_value());
    }
    // The prompt text, rendered again with the job if the session changed before the job took
    // it (server/http/openai_prompt.h).
    const absl::StatusOr<int64_t> submitted =
        SubmitOpenAiRequest(service_, *tenant, one, chat_template_, choices->Observer(i));
    if (!submitted.ok()) {
      choices->Cancel();  // the choices submitted before end within a step
      owner_.active_generations_.fetch_sub(1);
      if (count == 1) return refuse(submitted.status());
      // Which choice, with the refusal's payloads (its error code's, context_length_exceeded's).
      absl::Status status(submitted.status().code(), absl::StrCat("choice ", i, " of ", count, ": ",
                                                                  submitted.status().message()));
      submitted.status().ForEachPayload(
          [&status](absl::string_view url, const absl::Cord& payload) {
            status.SetPayload(url, payload);
          });
      return refuse(status);
    }
  }

  const std::string id = RandomId(endpoint == OpenAiEndpoint::kCompletions ? "cmpl-" : "chatcmpl-");
  const int64_t created = absl::ToUnixSeconds(absl::Now());
  const bool stream = request->stream;
  const bool with_logprobs = request->logprobs.has_value();
  const bool include_usage = request->include_usage;
  const std::string session_id = request->session_id;
  const std::string model = model_name_;
  // A session's history after the request (as GET /v1/sessions/{id} reports it), or null.
  const auto session_json = [session_id](const Usage& u) {
    if (session_id.empty()) return Json(nullptr);
    return Json{{"id", session_id},
                {"position", u.history_tokens + u.prompt_tokens + u.generated_tokens}};
  };
  // A choice's `logprobs`: null unless asked for. `text_offset`: /v1/completions' (see
  // CompletionLogprobsJson), the characters of the tokens before these.
  const auto logprobs_json = [=](const std::vector<LogprobEntry>& entries, int64_t& text_offset) {
    if (!with_logprobs) return Json(nullptr);
    return endpoint == OpenAiEndpoint::kCompletions ? CompletionLogprobsJson(entries, text_offset)
                                                    : ChatLogprobsJson(entries);
  };
  // The request's usage: its choices' together (each read its prompt).
  const auto total_usage = [](const CompletionChoices::Taken& t) {
    Usage u;
    for (const CompletionChoices::Choice& c : t.choices) {
      u.prompt_tokens += c.usage.prompt_tokens;
      u.history_tokens += c.usage.history_tokens;
      u.generated_tokens += c.usage.generated_tokens;
    }
    return u;
  };
  // The first choice's error, if one ended with one.
  const auto first_error = [](const CompletionChoices::Taken& t) {
    for (const CompletionChoices::Choice& c : t.choices) {
      if (c.reason == FinishReason::kError) return c.error;
    }
    return absl::OkStatus();
  };
  // Every choice's output so far, for a response written whole.
  struct ChoiceSoFar {
    std::string text;
    std::vector<LogprobEntry> logprobs;
    int64_t text_offset = 0;  // streaming completions: characters of tokens sent
  };
  // A non-streaming response, whole.
  const auto whole_body = [=](const CompletionChoices::Taken& t,
                              const std::vector<ChoiceSoFar>& so_far) {
    Json body = CompletionHead(endpoint, /*chunk=*/false, id, created, model);
    body["choices"] = Json::array();
    for (size_t i = 0; i < so_far.size(); ++i) {
      int64_t text_offset = 0;
      const ChoiceSoFar& c = so_far[i];
      const char* finish = FinishReasonOf(t.choices[i].reason);
      body["choices"].push_back(
          endpoint == OpenAiEndpoint::kCompletions
              ? Json{{"index", i},
                     {"text", c.text},
                     {"logprobs", logprobs_json(c.logprobs, text_offset)},
                     {"finish_reason", finish}}
              : Json{
                    {"index", i},
                    {"message", {{"role", "assistant"}, {"content", c.text}, {"refusal", nullptr}}},
                    {"logprobs", logprobs_json(c.logprobs, text_offset)},
                    {"finish_reason", finish}});
    }
    const Usage u = total_usage(t);
    body["usage"] = UsageJson(u.prompt_tokens, u.generated_tokens, u.history_tokens);
    if (const Json session = session_json(u); !session.is_null()) body["session"] = session;
    return Dump(body);
  };
  const auto add_output = [](std::vector<ChoiceSoFar>& so_far, CompletionChoices::Taken& t) {
    for (size_t i = 0; i < so_far.size(); ++i) {
      so_far[i].text += t.choices[i].text;
      std::move(t.choices[i].logprobs.begin(), t.choices[i].logprobs.end(),
                std::back_inserter(so_far[i].logprobs));
    }
  };
  // A non-streaming request that ends within status_wait is answered whole, with its own status:
  // an error after admission (a step that did not fit, a turn whose write failed) is then an
  // HTTP error the SDKs raise, not a 200 whose body they take for a completion.
  std::vector<ChoiceSoFar> so_far(static_cast<size_t>(count));
  if (!stream) {
    CompletionChoices::Taken t = choices->TakeEnd(options_.status_wait);
    add_output(so_far, t);
    if (t.done) {
      const absl::Status status = first_error(t);
      service_.RecordRequest(method, status.code(), start);
      owner_.active_generations_.fetch_sub(1);
      if (!status.ok()) return SendError(res, status);
      if (!session_id.empty()) res.set_header("X-Session-Id", session_id);
      res.status = 200;
      res.set_content(whole_body(t, so_far), kJsonContentType);
      return;
    }
  }

  // From here on the status is 200 and the body carries what happens.
  res.status = 200;
  if (!session_id.empty()) res.set_header("X-Session-Id", session_id);
  if (stream) {
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
  }

  struct StreamState {
    bool finished = false;  // everything was written
    bool recorded = false;  // the request's outcome is in the metrics
    bool first_take = true;
    absl::Time last_write = absl::InfinitePast();
    std::vector<ChoiceSoFar> choices;
  };
  auto state = std::make_shared<StreamState>();
  state->choices = std::move(so_far);
  const absl::Duration heartbeat = options_.heartbeat;
  SdmServiceImpl* const service = &service_;
  OpenAiServer* const owner = &owner_;

  const auto chunk = [=](Json choice_or_null, const Json* usage) {
    Json c = CompletionHead(endpoint, /*chunk=*/true, id, created, model);
    c["choices"] = choice_or_null.is_null() ? Json::array() : Json::array({choice_or_null});
    if (usage != nullptr) {
      c["usage"] = *usage;
    } else if (include_usage) {
      c["usage"] = nullptr;
    }
    return c;
  };
  // A stream chunk's choice `index`: `text` and the log-probabilities of its tokens (`logprobs`,
  // or none: nullptr).
  const auto choice = [=](size_t index, const std::string& text,
                          const std::vector<LogprobEntry>* logprobs, const Json& finish_reason,
                          bool first) {
    const Json lp = logprobs == nullptr
                        ? Json(nullptr)
                        : logprobs_json(*logprobs, state->choices[index].text_offset);
    if (endpoint == OpenAiEndpoint::kCompletions) {
      return Json{
          {"index", index}, {"text", text}, {"logprobs", lp}, {"finish_reason", finish_reason}};
    }
    Json delta = Json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || first) delta["content"] = text;
    return Json{
        {"index", index}, {"delta", delta}, {"logprobs", lp}, {"finish_reason", finish_reason}};
  };

  const auto provider = [=](size_t, httplib::DataSink& sink) -> bool {
    const auto write = [&](const std::string& data) {
      if (sink.write(data.data(), data.size())) return true;
      choices->Cancel();  // the client went away: end the jobs within one step
      return false;
    };
    const auto event = [&](const Json& j) {
      return write(absl::StrCat("data: ", Dump(j), "\n\n"));
    };
    CompletionChoices::Taken t = choices->Take(heartbeat);
    const absl::Time now = absl::Now();
    const absl::Status status = t.done ? first_error(t) : absl::OkStatus();
    if (stream) {
      // A chat stream starts each choice with the role, in the first Take's chunk.
      const bool first_take = state->first_take;
      state->first_take = false;
      for (size_t i = 0; i < t.choices.size(); ++i) {
        CompletionChoices::Choice& c = t.choices[i];
        const bool first = endpoint == OpenAiEndpoint::kChatCompletions && first_take;
        if (first || !c.text.empty() || !c.logprobs.empty()) {
          state->last_write = now;
          if (!event(chunk(choice(i, c.text, &c.logprobs, nullptr, first), nullptr))) return false;
        }
        if (c.ended && c.reason != FinishReason::kError && status.ok()) {
          Json last = chunk(choice(i, "", nullptr, FinishReasonOf(c.reason), false), nullptr);
          if (const Json session = session_json(c.usage); !session.is_null()) {
            last["session"] = session;
          }
          if (!event(last)) return false;
        }
      }
    } else {
      add_output(state->choices, t);
    }
    if (!t.done) {
      // Nothing written for a while: probe the connection (see the header).
      if (now - state->last_write < heartbeat) return true;
      state->last_write = now;
      return write(stream ? ": keep-alive\n\n" : " ");
    }

    // The end.
    service->RecordRequest(method, status.code(), start);
    state->recorded = true;
    const Usage u = total_usage(t);  // counted in the metrics by the jobs (CompletionChoices)
    const Json usage = UsageJson(u.prompt_tokens, u.generated_tokens, u.history_tokens);
    if (!status.ok()) {
      const std::string body = ToHttpError(status).body;
      write(stream ? absl::StrCat("data: ", body, "\n\n") : body);
    } else if (stream) {
      if (include_usage && !event(chunk(nullptr, &usage))) return false;
      if (!write("data: [DONE]\n\n")) return false;
    } else {
      if (!write(whole_body(t, state->choices))) return false;
    }
    state->finished = true;
    sink.done();
    return true;
  };
  // Called when the response is over, written or not: a job still running is cancelled.
  const auto release = [choices, state, owner, service, method, start](bool) {
    if (!state->finished) choices->Cancel();
    if (!state->recorded) service->RecordRequest(method, absl::StatusCode::kCancelled, start);
    owner->active_generations_.fetch_sub(1);
  };
  res.set_chunked_content_provider(stream ? "text/event-stream" : kJsonContentType, provider,
                                   release);
}

void OpenAiServer::Handlers::Install(httplib::Server& http) {
  // A connection that waited too long for a thread (server/http/connection_pool.h): its request is
  // answered 503 before its body is read, and the connection is closed.
  http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (ConnectionPool::Refusing()) {
      metrics_.http_connections_refused.Increment();
      SendError(res, absl::UnavailableError("no thread is free to serve this connection (the "
                                            "server has its most connections open); retry"));
      res.set_header("Connection", "close");
      return httplib::Server::HandlerResponse::Handled;
    }
    // A CORS preflight from an allowed origin, for a path the API has (the origin's headers are
    // added below, as to every response to it).
    if (req.method == "OPTIONS" && req.has_header("Access-Control-Request-Method") &&
        !AllowedOrigin(options_.cors_origins, req.get_header_value("Origin")).empty()) {
      if (const std::vector<std::string> methods = MethodsFor(req.path); !methods.empty()) {
        res.status = 204;
        res.set_header("Access-Control-Allow-Methods", absl::StrJoin(methods, ", "));
        res.set_header("Access-Control-Allow-Headers", "Authorization, Content-Type, X-Session-Id");
        res.set_header("Access-Control-Max-Age", "600");
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    // A request that no route takes is answered here, before httplib reads its body: httplib
    // answers 400 ("could not be read") to a method it has no table for, and reads the body of a
    // PUT or PATCH without a length until the client closes. Its body, if any, is left unread.
    const std::vector<std::string> methods = MethodsFor(req.path);
    if (std::find(methods.begin(), methods.end(), req.method) == methods.end()) {
      RefuseUnrouted(req, res);
      if (HasBody(req)) res.set_header("Connection", "close");
      return httplib::Server::HandlerResponse::Handled;
    }
    // A body from a caller without a valid key is refused before it is read: otherwise anyone
    // who can connect makes the server hold up to max_body_bytes per connection first. The
    // route would refuse it the same way (Tenant); the body is left unread: the connection ends.
    if (HasBody(req) && auth_.Get()->enabled()) {
      if (absl::StatusOr<std::string> tenant = Tenant(req); !tenant.ok()) {
        SendError(res, tenant.status());
        res.set_header("Connection", "close");
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    // A body that nothing reads (a GET's) ends its connection after the answer.
    if (HasBody(req) && !BodyIsRead(req)) res.set_header("Connection", "close");
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // Every response that says `Connection: close` ends its connection (EndConnectionAfter), as
  // httplib would not; without the Keep-Alive parameters httplib adds to it.
  http.set_post_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (const std::string origin =
            AllowedOrigin(options_.cors_origins, req.get_header_value("Origin"));
        !origin.empty()) {
      res.set_header("Access-Control-Allow-Origin", origin);
      res.set_header("Access-Control-Expose-Headers", "X-Session-Id, Retry-After");
      if (origin != "*") res.set_header("Vary", "Origin");  // caches keep one answer per origin
    }
    // Closing (a replica's drain): a kept-alive connection ends with this answer, so that a
    // router's next request opens a new one, refused, and goes to another replica.
    if (owner_.closing() && res.get_header_value("Connection") != "close") {
      res.set_header("Connection", "close");
    }
    if (res.get_header_value("Connection") != "close") return;
    res.headers.erase("Keep-Alive");
    EndConnectionAfter(res);
  });
  // The web console (server/http/console_page.h): a static page, no key needed to load it; its
  // calls to /v1 carry the key the user enters.
  Get(http, "/", [](const httplib::Request&, httplib::Response& res) {
    const absl::string_view page = ConsolePageHtml();
    res.set_header("Cache-Control", "no-cache");
    res.set_content(page.data(), page.size(), "text/html; charset=utf-8");
  });
  Get(http, "/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
    Unary(req, res, "OpenAI.ListModels", [&](absl::string_view) -> absl::StatusOr<Json> {
      return Json{{"object", "list"}, {"data", Json::array({ModelJson()})}};
    });
  });
  Get(http, R"(/v1/models/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
    std::string error_code;
    Unary(
        req, res, "OpenAI.GetModel",
        [&](absl::string_view) -> absl::StatusOr<Json> {
          if (req.matches[1] != model_name_) {
            error_code = "model_not_found";  // OpenAI's code, as the completions answer it
            return absl::NotFoundError(
                absl::StrCat("the model '", req.matches[1].str(), "' does not exist"));
          }
          return ModelJson();
        },
        &error_code);
  });
  Post(http, "/v1/completions",
       [this](const httplib::Request& req, const std::string& body, httplib::Response& res) {
         Generate(req, body, res, OpenAiEndpoint::kCompletions);
       });
  Post(http, "/v1/chat/completions",
       [this](const httplib::Request& req, const std::string& body, httplib::Response& res) {
         Generate(req, body, res, OpenAiEndpoint::kChatCompletions);
       });

  // vLLM's tokenizer endpoints: what a client counts tokens with, and aligns a prompt's
  // log-probabilities (echo) with. Text is encoded as a one-shot request's prompt is: with BOS
  // unless add_special_tokens is false.
  Post(http, "/tokenize",
       [this](const httplib::Request& req, const std::string& text, httplib::Response& res) {
         std::string error_code;
         Unary(
             req, res, "OpenAI.Tokenize",
             [&](absl::string_view) -> absl::StatusOr<Json> {
               SDM_ASSIGN_OR_RETURN(const Json body, ParseObjectBody(text));
               SDM_RETURN_IF_ERROR(CheckModelField(body, error_code));
               bool add_bos = true;
               if (const auto it = body.find("add_special_tokens");
                   it != body.end() && !it->is_null()) {
                 if (!it->is_boolean()) {
                   return absl::InvalidArgumentError("'add_special_tokens' must be a boolean");
                 }
                 add_bos = it->get<bool>();
               }
               std::string prompt;
               if (body.contains("messages") && !body["messages"].is_null()) {
                 // A chat request's prompt: the template's rendering of its messages.
                 SDM_ASSIGN_OR_RETURN(const OpenAiRequest chat,
                                      ParseOpenAiRequest(text, OpenAiEndpoint::kChatCompletions));
                 prompt = chat_template_.Render(chat.messages, /*continuing=*/false);
               } else {
                 const auto it = body.find("prompt");
                 if (it == body.end() || !it->is_string()) {
                   return absl::InvalidArgumentError(
                       "'prompt' (a string) or 'messages' is required");
                 }
                 prompt = it->get<std::string>();
               }
               const std::vector<int32_t> tokens = service_.tokenizer().Encode(prompt, add_bos);
               const int64_t max_len = service_.model_info().max_session_tokens();
               return Json{{"count", tokens.size()},
                           {"max_model_len", max_len > 0 ? Json(max_len) : Json(nullptr)},
                           {"tokens", tokens}};
             },
             &error_code);
       });
  Post(http, "/detokenize",
       [this](const httplib::Request& req, const std::string& text, httplib::Response& res) {
         std::string error_code;
         Unary(
             req, res, "OpenAI.Detokenize",
             [&](absl::string_view) -> absl::StatusOr<Json> {
               SDM_ASSIGN_OR_RETURN(const Json body, ParseObjectBody(text));
               SDM_RETURN_IF_ERROR(CheckModelField(body, error_code));
               const auto it = body.find("tokens");
               if (it == body.end() || !it->is_array()) {
                 return absl::InvalidArgumentError("'tokens' (an array of token ids) is required");
               }
               v1::DetokenizeRequest request;
               for (size_t i = 0; i < it->size(); ++i) {
                 const Json& t = (*it)[i];
                 if (!t.is_number_integer() ||
                     t.get<int64_t>() < std::numeric_limits<int32_t>::min() ||
                     t.get<int64_t>() > std::numeric_limits<int32_t>::max() ||
                     (t.is_number_unsigned() &&
                      t.get<uint64_t>() > std::numeric_limits<int32_t>::max())) {
                   return absl::InvalidArgumentError(
                       absl::StrCat("'tokens'[", i, "] = ", t.dump(), " is not a token id"));
                 }
                 request.add_token_ids(static_cast<int32_t>(t.get<int64_t>()));
               }
               v1::DetokenizeResponse out;
               SDM_RETURN_IF_ERROR(service_.DoDetokenize(request, out));
               return Json{{"prompt", out.text()}};
             },
             &error_code);
       });

  // Sessions (our extension), with the semantics of the gRPC session RPCs.
  Post(http, "/v1/sessions",
       [this](const httplib::Request& req, const std::string& text, httplib::Response& res) {
         Unary(req, res, "CreateSession", [&](absl::string_view tenant) -> absl::StatusOr<Json> {
           absl::StatusOr<Json> body = ParseObjectBody(text);
           if (!body.ok()) return body.status();
           v1::CreateSessionRequest create;
           std::string body_id;
           if (absl::Status s = GetStringField(*body, "session_id", body_id); !s.ok()) return s;
           absl::StatusOr<std::string> id = SessionIdOf(req, body_id);
           if (!id.ok()) return id.status();
           create.set_session_id(*std::move(id));
           if (absl::Status s = ParseLabels(*body, *create.mutable_labels()); !s.ok()) return s;
           bool has_ttl = false;
           google::protobuf::Duration ttl;
           if (absl::Status s = ParseTtl(*body, ttl, has_ttl); !s.ok()) return s;
           if (has_ttl) *create.mutable_ttl() = ttl;
           v1::Session session;
           if (absl::Status s = service_.DoCreateSession(tenant, create, session); !s.ok())
             return s;
           return SessionToJson(session);
         });
       });
  Get(http, "/v1/sessions", [this](const httplib::Request& req, httplib::Response& res) {
    Unary(req, res, "ListSessions", [&](absl::string_view tenant) -> absl::StatusOr<Json> {
      v1::ListSessionsRequest list;
      if (req.has_param("limit")) {
        int limit = 0;
        if (!absl::SimpleAtoi(req.get_param_value("limit"), &limit)) {
          return absl::InvalidArgumentError("'limit' must be an integer");
        }
        list.set_page_size(limit);
      }
      list.set_page_token(req.get_param_value("page_token"));
      v1::ListSessionsResponse out;
      if (absl::Status s = service_.DoListSessions(tenant, list, out); !s.ok()) return s;
      Json data = Json::array();
      for (const v1::Session& s : out.sessions()) data.push_back(SessionToJson(s));
      Json j = {{"object", "list"},
                {"data", std::move(data)},
                {"has_more", !out.next_page_token().empty()}};
      j["next_page_token"] =
          out.next_page_token().empty() ? Json(nullptr) : Json(out.next_page_token());
      return j;
    });
  });
  Get(http, R"(/v1/sessions/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
    Unary(req, res, "GetSession", [&](absl::string_view tenant) -> absl::StatusOr<Json> {
      v1::GetSessionRequest get;
      get.set_session_id(req.matches[1].str());
      v1::Session session;
      if (absl::Status s = service_.DoGetSession(tenant, get, session); !s.ok()) return s;
      return SessionToJson(session);
    });
  });
  Delete(
      http, R"(/v1/sessions/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
        Unary(req, res, "DeleteSession", [&](absl::string_view tenant) -> absl::StatusOr<Json> {
          v1::DeleteSessionRequest del;
          del.set_session_id(req.matches[1].str());
          if (absl::Status s = service_.DoDeleteSession(tenant, del); !s.ok()) {
            return s;
          }
          return Json{{"id", del.session_id()}, {"object", "session.deleted"}, {"deleted", true}};
        });
      });
  Post(http, R"(/v1/sessions/([^/]+)/fork)",
       [this](const httplib::Request& req, const std::string& text, httplib::Response& res) {
         Unary(req, res, "ForkSession", [&](absl::string_view tenant) -> absl::StatusOr<Json> {
           absl::StatusOr<Json> body = ParseObjectBody(text);
           if (!body.ok()) return body.status();
           v1::ForkSessionRequest fork;
           fork.set_session_id(req.matches[1].str());
           std::string id;
           if (absl::Status s = GetStringField(*body, "new_session_id", id); !s.ok()) {
             return s;
           }
           fork.set_new_session_id(id);
           if (absl::Status s = ParseLabels(*body, *fork.mutable_labels()); !s.ok()) return s;
           bool has_ttl = false;
           google::protobuf::Duration ttl;
           if (absl::Status s = ParseTtl(*body, ttl, has_ttl); !s.ok()) return s;
           if (has_ttl) *fork.mutable_ttl() = ttl;
           v1::Session session;
           if (absl::Status s = service_.DoForkSession(tenant, fork, session); !s.ok()) {
             return s;
           }
           return SessionToJson(session);
         });
       });

  // Errors decided by the HTTP server itself (a request it cannot read, a body too large, a URI
  // too long) in OpenAI's shape; responses that already carry a body are left alone.
  http.set_error_handler(httplib::Server::HandlerWithResponse(
      [max_body = SizeText(options_.max_body_bytes)](const httplib::Request& req,
                                                     httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        std::string message;
        std::string code;  // as ToHttpError names its codes (server/http/http_status.h)
        switch (res.status) {
          case 400:
            message = "the request could not be read as HTTP/1.1";
            code = "invalid_argument";
            break;
          case 404:  // requests no route takes are answered before routing (RefuseUnrouted)
            message = absl::StrCat("no endpoint ", req.method, " ", req.path);
            code = "not_found";
            break;
          case 413:
            message = absl::StrCat("the request body is larger than the ", max_body,
                                   " this server accepts");
            code = "payload_too_large";
            break;
          case 414:
            message = absl::StrCat("the request line is longer than the ",
                                   CPPHTTPLIB_REQUEST_URI_MAX_LENGTH,
                                   " bytes this server reads: the URI is too long");
            code = "uri_too_long";
            break;
          case 416:
            message = "the Range header could not be read";
            code = "invalid_argument";
            break;
          default:  // none that httplib 0.11 writes
            message = absl::StrCat(res.status < 500 ? "the request was refused" : "internal error",
                                   " (HTTP ", res.status, ")");
            code = res.status < 500 ? "invalid_argument" : "internal";
        }
        // These are decided before the request's body is read, or where its end is not known:
        // what follows is not read as a request. (A body past the limit was read and dropped
        // by httplib, or its route closes the connection: Post.)
        if (res.status != 413) res.set_header("Connection", "close");
        res.set_content(ErrorBody(res.status, message, code), kJsonContentType);
        return httplib::Server::HandlerResponse::Handled;
      }));
  http.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
        res.status = 500;
        res.set_content(ErrorBody(500, "internal error", "internal"), kJsonContentType);
      });
}

absl::StatusOr<std::unique_ptr<OpenAiServer>> OpenAiServer::Start(
    const OpenAiServerOptions& options, SdmServiceImpl& service,
    const Reloadable<ApiKeyAuthenticator>& auth, ServerMetrics& metrics,
    const std::filesystem::path& model_dir, int scheduler_slots) {
  for (const std::string& origin : options.cors_origins) {
    if (!IsCorsOrigin(origin)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "CORS origin '", origin,
          "' is not an origin: expected scheme://host[:port] (e.g. https://app.example.com) or *"));
    }
  }
  absl::StatusOr<ChatTemplate> chat_template =
      ChatTemplate::Resolve(options.chat_template_file, model_dir);
  if (!chat_template.ok()) return chat_template.status();
  std::unique_ptr<OpenAiServer> server(new OpenAiServer());
  server->http_ = std::make_unique<httplib::Server>();
  httplib::Server& http = *server->http_;
  const int max_connections = std::max(1, options.max_connections);
  const int threads =
      std::min(options.threads > 0 ? options.threads : scheduler_slots + 16, max_connections);
  http.new_task_queue = [threads, max_connections, pool = options.pool] {
    return new ConnectionPool(threads, max_connections, "sdm-http", pool);
  };
  const auto seconds = [](absl::Duration d) { return absl::ToInt64Seconds(d); };
  const auto micros = [](absl::Duration d) { return absl::ToInt64Microseconds(d) % 1'000'000; };
  http.set_read_timeout(seconds(options.read_timeout), micros(options.read_timeout));
  http.set_write_timeout(seconds(options.write_timeout), micros(options.write_timeout));
  http.set_keep_alive_timeout(std::max<int64_t>(1, seconds(options.keep_alive_timeout)));
  http.set_keep_alive_max_count(1000);
  http.set_payload_max_length(options.max_body_bytes);
  http.set_socket_options([s = server.get()](socket_t socket) {
    SetExclusiveListenOptions(socket);  // a port in use fails the start
    s->listen_fd_.store(socket);        // the last one made is the one bound (CloseListener)
  });
  server->handlers_ = std::make_unique<Handlers>(*server, options, service, auth, metrics,
                                                 *std::move(chat_template), scheduler_slots);
  server->handlers_->Install(http);

  if (options.port == 0) {
    server->port_ = http.bind_to_any_port(options.host);
  } else if (http.bind_to_port(options.host, options.port)) {
    server->port_ = options.port;
  }
  if (server->port_ <= 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.host, ":", options.port,
                                               " for the HTTP API (in use, or not an address of "
                                               "this host)"));
  }
  absl::StatusOr<std::thread> loop = StartAcceptLoop(http, "sdm-http");
  if (!loop.ok()) {
    return absl::UnavailableError(absl::StrCat("listening on ", options.host, ":", server->port_,
                                               " for the HTTP API: ", loop.status().message()));
  }
  server->thread_ = *std::move(loop);
  return server;
}

OpenAiServer::~OpenAiServer() { Stop(); }

void OpenAiServer::Stop() {
  if (http_ != nullptr) http_->stop();
  if (thread_.joinable()) thread_.join();
}

absl::Status OpenAiServer::CloseListener() {
  closing_.store(true);
  const int fd = listen_fd_.exchange(-1);
  if (fd < 0 || !thread_.joinable()) return absl::OkStatus();
  return CloseListeningPort(fd);
}

}  // namespace sdm
