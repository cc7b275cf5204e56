#include "server/cluster/etcd_client.h"

#include <pthread.h>
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/log.h"
#include "httplib.h"
#include "nlohmann/json.hpp"

#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
#include <openssl/x509.h>
#endif

namespace sdm {
namespace {

using nlohmann::json;

constexpr char kAuthenticate[] = "/v3/auth/authenticate";
// Idle connections kept per endpoint; more requests at once open more, closed when answered.
constexpr size_t kMaxIdle = 8;

#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
constexpr bool kHaveTls = true;
#else
constexpr bool kHaveTls = false;
#endif

bool IsHttps(absl::string_view url) { return absl::StartsWith(url, "https://"); }

// `url` as a message may show it: user information (user:password@) replaced by "***@", so that
// a password written into the URL by mistake does not reach the logs.
std::string RedactedUrl(absl::string_view url) {
  const size_t scheme = url.find("://");
  const size_t start = scheme == absl::string_view::npos ? 0 : scheme + 3;
  const size_t end = std::min(url.size(), url.find_first_of("/?#", start));
  const size_t at = url.substr(start, end - start).rfind('@');
  if (at == absl::string_view::npos) return std::string(url);
  return absl::StrCat(url.substr(0, start), "***@", url.substr(start + at + 1));
}

// OK when `url` is http(s)://host[:port] (no path, no user); else why not.
absl::Status ValidateEndpoint(absl::string_view url) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("etcd endpoint '", RedactedUrl(url), "': ", why));
  };
  if (url.empty()) return absl::InvalidArgumentError("an etcd endpoint is empty");
  absl::string_view rest = url;
  if (absl::ConsumePrefix(&rest, "https://")) {
    if (!kHaveTls) {
      return bad("https:// needs cpp-httplib built with OpenSSL (CPPHTTPLIB_OPENSSL_SUPPORT)");
    }
  } else if (!absl::ConsumePrefix(&rest, "http://")) {
    return bad("no scheme: write http://host:port or https://host:port");
  }
  if (rest.empty()) return bad("no host");
  for (char c : rest) {
    if (c == '/' || c == '?' || c == '#') return bad("a path after host:port");
    if (c == '@') return bad("user information in the URL (use the etcd user options)");
    if (absl::ascii_isspace(static_cast<unsigned char>(c))) return bad("a blank in the URL");
  }
  absl::string_view port;
  if (rest.front() == '[') {  // [IPv6]:port
    const size_t close = rest.find(']');
    if (close == absl::string_view::npos || close == 1) return bad("a bad [IPv6] host");
    // cpp-httplib 0.11 parses only digits and ':' in brackets: [2001:db8::1] would never connect.
    for (char c : rest.substr(1, close - 1)) {
      if (!absl::ascii_isdigit(static_cast<unsigned char>(c)) && c != ':') {
        return bad(
            "an IPv6 address with hex letters (cpp-httplib cannot connect to it): use a "
            "host name");
      }
    }
    absl::string_view after = rest.substr(close + 1);
    if (!after.empty() && !absl::ConsumePrefix(&after, ":")) return bad("a bad [IPv6] host");
    port = after;
  } else {
    const size_t colon = rest.rfind(':');
    if (colon == 0) return bad("no host");
    if (colon != absl::string_view::npos) {
      if (rest.substr(0, colon).find(':') != absl::string_view::npos) {
        return bad("an IPv6 host must be in brackets");
      }
      port = rest.substr(colon + 1);
      if (port.empty()) return bad("no port after ':'");
    }
  }
  int number = 0;
  if (!port.empty() && (!absl::SimpleAtoi(port, &number) || number < 1 || number > 65535)) {
    return bad("a bad port");
  }
  return absl::OkStatus();
}

absl::Status Readable(const char* what, const std::string& path) {
  if (path.empty()) return absl::OkStatus();
  std::ifstream in(path);
  if (!in.good()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the etcd ", what, " '", path, "' cannot be read"));
  }
  return absl::OkStatus();
}

// etcd's gateway refuses a request without a valid token with 401 "invalid auth token", or, when
// no token was sent, 400 "user name is empty".
bool TokenRefused(int status, const std::string& body) {
  return (status == 401 && absl::StrContains(body, "invalid auth token")) ||
         (status == 400 && absl::StrContains(body, "user name is empty")) ||
         // A JWT made before any change of users or roles (etcd refuses it until it expires, by
         // default 5 minutes; a simple token in a race): authenticate again, as etcd's own client
         // does.
         (status == 400 && absl::StrContains(body, "revision of auth store is old"));
}

// Whether an etcd answer says that this member cannot serve requests now, whatever they are: no
// leader (it is cut off from the cluster), a leader change or a dropped proposal, a learner,
// too many requests. Another member may serve the request.
bool MemberCannotServe(int status, const std::string& body) {
  if (status == 200) return false;
  for (const char* says :
       {"etcdserver: no leader", "etcdserver: leader changed", "raft proposal dropped",
        "not supported for learner", "etcdserver: too many requests"}) {
    if (absl::StrContains(body, says)) return true;
  }
  return false;
}

// Blocks SIGPIPE in this thread while it lives, and discards one raised meanwhile. OpenSSL writes
// to its socket with write(), without MSG_NOSIGNAL: a TLS connection that etcd closed (a
// handshake it refused, a restart while the connection was idle in the pool) would otherwise
// kill the process with SIGPIPE. SIGPIPE from a write is sent to the writing thread, so blocking
// it here leaves it pending for this thread alone. (cpp-httplib's plain sockets use MSG_NOSIGNAL.)
class ScopedSigpipeBlock {
 public:
  ScopedSigpipeBlock() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
  }
  ~ScopedSigpipeBlock() {
    sigset_t pending;
    sigpending(&pending);
    if (!was_pending_ && sigismember(&pending, SIGPIPE) == 1) {
      const timespec zero = {0, 0};
      sigtimedwait(&pipe_, nullptr, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  ScopedSigpipeBlock(const ScopedSigpipeBlock&) = delete;
  ScopedSigpipeBlock& operator=(const ScopedSigpipeBlock&) = delete;

 private:
  sigset_t pipe_;
  sigset_t old_;
  bool was_pending_ = false;
};

}  // namespace

struct EtcdClient::Endpoint {
  std::string url;
  absl::Mutex mu;
  std::vector<std::unique_ptr<httplib::Client>> idle ABSL_GUARDED_BY(mu);
};

struct EtcdClient::Attempt {
  enum class Kind {
    kAnswered,    // etcd answered: `status` and `body`
    kNotSent,     // nothing reached etcd (no connection): `body` says why
    kUnanswered,  // sent, no answer (it may have been applied): `body` says why
  };
  Kind kind = Kind::kNotSent;
  int status = 0;
  std::string body;
};

absl::StatusOr<std::vector<std::string>> ParseEtcdEndpoints(absl::string_view list) {
  if (absl::StripAsciiWhitespace(list).empty()) {
    return absl::InvalidArgumentError("no etcd endpoint given");
  }
  std::vector<std::string> out;
  for (absl::string_view entry : absl::StrSplit(list, ',')) {
    entry = absl::StripAsciiWhitespace(entry);
    if (entry.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("an empty entry in the etcd endpoint list '", list, "'"));
    }
    out.emplace_back(entry);
  }
  return out;
}

absl::Status ValidateEtcdClientOptions(const EtcdClientOptions& options) {
  if (options.endpoints.empty()) return absl::InvalidArgumentError("no etcd endpoint given");
  bool https = false;
  for (const std::string& url : options.endpoints) {
    if (absl::Status s = ValidateEndpoint(url); !s.ok()) return s;
    https = https || IsHttps(url);
  }
  if (!https &&
      !(options.ca_file.empty() && options.cert_file.empty() && options.key_file.empty())) {
    return absl::InvalidArgumentError(
        "an etcd CA, certificate or key file is given but no etcd endpoint is https://");
  }
  if (options.cert_file.empty() != options.key_file.empty()) {
    return absl::InvalidArgumentError(
        "an etcd client certificate needs its key, and a key its certificate");
  }
  for (const auto& [what, path] :
       {std::pair{"CA file", &options.ca_file}, std::pair{"client certificate", &options.cert_file},
        std::pair{"client key", &options.key_file}}) {
    if (absl::Status s = Readable(what, *path); !s.ok()) return s;
  }
  if (options.username.empty() != options.password.empty()) {
    return absl::InvalidArgumentError(options.username.empty()
                                          ? "an etcd password is given without a user name"
                                          : "the etcd user needs a password");
  }
  // They go in a JSON body, which must be UTF-8 (the encoder would throw, and print a byte of the
  // password in its message). The values are never named here.
  for (const auto& [what, value] :
       {std::pair{"user name", &options.username}, std::pair{"password", &options.password}}) {
    try {
      (void)nlohmann::json(*value).dump();
    } catch (const nlohmann::json::exception&) {
      return absl::InvalidArgumentError(absl::StrCat("the etcd ", what, " is not valid UTF-8"));
    }
  }
  return absl::OkStatus();
}

EtcdClient::EtcdClient(EtcdClientOptions options) : options_(std::move(options)) {
  for (const std::string& url : options_.endpoints) {
    endpoints_.push_back(std::make_unique<Endpoint>());
    endpoints_.back()->url = url;
  }
}

EtcdClient::~EtcdClient() {
  ScopedSigpipeBlock no_sigpipe;  // the pooled TLS connections' shutdown writes
  endpoints_.clear();
}

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(EtcdClientOptions options) {
  if (absl::Status s = ValidateEtcdClientOptions(options); !s.ok()) return s;
  std::unique_ptr<EtcdClient> client(new EtcdClient(std::move(options)));
  if (client->options_.username.empty()) return client;
  std::vector<std::string> failures;
  for (size_t e = 0; e < client->endpoints_.size(); ++e) {
    Attempt a = client->Authenticate(e);
    const std::string& url = client->endpoints_[e]->url;
    if (a.kind != Attempt::Kind::kAnswered) {
      failures.push_back(absl::StrCat(url, ": ", a.body));
      continue;
    }
    if (a.status == 200) {
      client->preferred_.store(e);
      return client;
    }
    if (absl::StrContains(a.body, "authentication is not enabled")) {
      client->preferred_.store(e);
      SDM_LOG(WARNING) << "sdm etcd: user '" << client->options_.username
                       << "' given but etcd has authentication disabled; requests go without";
      return client;
    }
    if (absl::StrContains(a.body, "authentication failed")) {
      return absl::UnauthenticatedError(
          absl::StrCat("etcd at ", url, " refused to authenticate user '",
                       client->options_.username, "': ", a.body.substr(0, 200)));
    }
    // Another answer is this member's state, not the credentials' (a leader election, a
    // learner, too many requests): the next member may authenticate.
    failures.push_back(absl::StrCat(url, ": answered ", a.status, " ", a.body.substr(0, 200)));
  }
  return absl::UnavailableError(
      absl::StrCat("no etcd member authenticated (", absl::StrJoin(failures, "; "), ")"));
}

std::string EtcdClient::Describe() const { return absl::StrJoin(options_.endpoints, ","); }

int64_t EtcdClient::authentications() const {
  absl::MutexLock lock(&token_mu_);
  return authentications_;
}

absl::StatusOr<std::string> EtcdClient::Post(const std::string& path, const std::string& body,
                                             bool* unanswered) {
  if (unanswered != nullptr) *unanswered = false;
  const size_t n = endpoints_.size();
  const size_t first = preferred_.load() % n;
  std::vector<std::string> failures;
  for (size_t i = 0; i < n; ++i) {
    const size_t e = (first + i) % n;
    Attempt a = Send(e, path, body);
    if (a.kind == Attempt::Kind::kAnswered && MemberCannotServe(a.status, a.body)) {
      // This member's state, not the request's: the next member may serve it. (Counted as
      // unanswered: a proposal dropped in a leader change may have been applied.)
      if (unanswered != nullptr) *unanswered = true;
      failures.push_back(
          absl::StrCat(endpoints_[e]->url, ": answered ", a.status, " ", a.body.substr(0, 200)));
      continue;
    }
    if (a.kind == Attempt::Kind::kAnswered) {
      preferred_.store(e);
      if (a.status != 200) {
        return absl::UnavailableError(
            absl::StrCat("etcd ", path, " answered ", a.status, ": ", a.body.substr(0, 200)));
      }
      return std::move(a.body);
    }
    if (a.kind == Attempt::Kind::kUnanswered && unanswered != nullptr) *unanswered = true;
    failures.push_back(absl::StrCat(endpoints_[e]->url, ": ", a.body));
  }
  return absl::UnavailableError(
      absl::StrCat("etcd unreachable (", absl::StrJoin(failures, "; "), ")"));
}

EtcdClient::Attempt EtcdClient::Send(size_t e, const std::string& path, const std::string& body) {
  std::string token;
  {
    absl::MutexLock lock(&token_mu_);
    token = token_;
  }
  Attempt a = Exchange(e, path, body, token);
  if (options_.username.empty() || a.kind != Attempt::Kind::kAnswered ||
      !TokenRefused(a.status, a.body)) {
    return a;
  }
  // Refused before it was applied: authenticate again (unless another request did meanwhile)
  // and send it once more to the same endpoint.
  {
    absl::MutexLock lock(&token_mu_);
    token = token_ != token ? token_ : std::string();  // empty: authenticate
  }
  if (token.empty()) {
    Attempt auth = Authenticate(e);
    if (auth.kind != Attempt::Kind::kAnswered || auth.status != 200) {
      auth.body =
          absl::StrCat("the token was refused and authenticating again failed: ", auth.body);
      return auth;
    }
    absl::MutexLock lock(&token_mu_);
    token = token_;
  }
  return Exchange(e, path, body, token);
}

EtcdClient::Attempt EtcdClient::Authenticate(size_t e) {
  const std::string request =
      json{{"name", options_.username}, {"password", options_.password}}.dump();
  Attempt a = Exchange(e, kAuthenticate, request, "");
  if (a.kind != Attempt::Kind::kAnswered || a.status != 200) return a;
  const json answer = json::parse(a.body, nullptr, false);
  std::string token;
  if (answer.is_object() && answer.contains("token") && answer["token"].is_string()) {
    token = answer["token"].get<std::string>();
  }
  if (token.empty()) {
    a.status = 500;
    a.body = "no token in etcd's answer to the authentication";
    return a;
  }
  absl::MutexLock lock(&token_mu_);
  token_ = std::move(token);
  ++authentications_;
  return a;
}

std::unique_ptr<httplib::Client> EtcdClient::NewClient(const Endpoint& endpoint) const {
  std::unique_ptr<httplib::Client> client =
      options_.cert_file.empty()
          ? std::make_unique<httplib::Client>(endpoint.url)
          : std::make_unique<httplib::Client>(endpoint.url, options_.cert_file, options_.key_file);
  client->set_keep_alive(true);
  const auto timeout = absl::ToChronoMicroseconds(options_.request_timeout);
  client->set_connection_timeout(timeout);
  client->set_read_timeout(timeout);
  client->set_write_timeout(timeout);
#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
  if (IsHttps(endpoint.url)) {
    if (!options_.ca_file.empty()) client->set_ca_cert_path(options_.ca_file);
    client->enable_server_certificate_verification(true);
  }
#endif
  return client;
}

EtcdClient::Attempt EtcdClient::Exchange(size_t e, const std::string& path, const std::string& body,
                                         const std::string& token) {
  using Fault = EtcdRequestFault;
  const Fault fault =
      options_.testing_request_fault ? options_.testing_request_fault(path, body) : Fault::kNone;
  if (fault == Fault::kDropped) {
    return {Attempt::Kind::kNotSent, 0, "injected: request dropped"};
  }
  // Before `client`: covers its TLS shutdown when it is closed on the way out.
  ScopedSigpipeBlock no_sigpipe;
  Endpoint& endpoint = *endpoints_[e];
  std::unique_ptr<httplib::Client> client;
  {
    absl::MutexLock lock(&endpoint.mu);
    if (!endpoint.idle.empty()) {
      client = std::move(endpoint.idle.back());
      endpoint.idle.pop_back();
    }
  }
  if (client == nullptr) client = NewClient(endpoint);
  if (!client->is_valid()) {
    return {Attempt::Kind::kNotSent, 0,
            "the TLS client cannot be set up (the client certificate or key)"};
  }
  // Sent with a receiver rather than Client::Post: etcd's gateway ends an error answer with an
  // HTTP trailer (Grpc-Trailer-Content-Type), which cpp-httplib 0.11 cannot read (Error::Read);
  // the status line and the body came, so etcd answered.
  httplib::Request request;
  request.method = "POST";
  request.path = path;
  request.body = body;
  request.headers.emplace("Content-Type", "application/json");
  // gRPC metadata "hasleader": a member cut off from the cluster's leader answers "no leader" at
  // once (Post then tries the next member) instead of holding the request until it times out.
  request.headers.emplace("Grpc-Metadata-Hasleader", "true");
  if (!token.empty()) request.headers.emplace("Authorization", token);
  int status = 0;
  std::string answer;
  request.response_handler = [&status](const httplib::Response& response) {
    status = response.status;
    return true;
  };
  request.content_receiver = [&answer](const char* data, size_t size, uint64_t, uint64_t) {
    answer.append(data, size);
    return true;
  };
  httplib::Response response;
  httplib::Error error = httplib::Error::Success;
  if (!client->send(request, response, error)) {  // the client (its connection) is dropped
    if (status != 0 && status != 200) {
      if (fault == Fault::kAnswerLost) {
        return {Attempt::Kind::kUnanswered, 0, "injected: answer lost"};
      }
      return {Attempt::Kind::kAnswered, status, std::move(answer)};
    }
    std::string why = httplib::to_string(error);
    switch (error) {
      case httplib::Error::Connection:
      case httplib::Error::ConnectionTimeout:
      case httplib::Error::BindIPAddress:
      case httplib::Error::SSLConnection:
      case httplib::Error::SSLLoadingCerts:
        return {Attempt::Kind::kNotSent, 0, why};
      case httplib::Error::SSLServerVerification:
#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
        why = absl::StrCat("etcd's TLS certificate was not accepted: ",
                           X509_verify_cert_error_string(client->get_openssl_verify_result()),
                           options_.ca_file.empty()
                               ? " (no etcd CA file given: the system's CAs were used)"
                               : absl::StrCat(" (CA file ", options_.ca_file, ")"));
#endif
        return {Attempt::Kind::kNotSent, 0, why};
      case httplib::Error::Read:
      case httplib::Error::Write:
        // httplib's word alone ("Read") left an operator guessing.
        return {Attempt::Kind::kUnanswered, 0,
                absl::StrCat("no answer within ", absl::FormatDuration(options_.request_timeout),
                             " (--etcd_request_timeout), or the connection broke (", why, ")")};
      default:  // a 200 whose body did not all come counts as unanswered too
        return {Attempt::Kind::kUnanswered, 0, why};
    }
  }
  {
    absl::MutexLock lock(&endpoint.mu);
    if (endpoint.idle.size() < kMaxIdle) endpoint.idle.push_back(std::move(client));
  }
  if (fault == Fault::kAnswerLost) return {Attempt::Kind::kUnanswered, 0, "injected: answer lost"};
  return {Attempt::Kind::kAnswered, status, std::move(answer)};
}

}  // namespace sdm
