// OpenAiServer: the OpenAI-compatible HTTP API of sdm-server (docs/api.md, "HTTP API"), on its
// own port, in front of the same SdmServiceImpl as gRPC: the same scheduler (one continuous batch
// serves both), authentication (`Authorization: Bearer KEY`, the same key file and tenants),
// tenant limits, session store and metrics. Every request is validated and executed by the
// service's transport-independent methods (SdmServiceImpl::PrepareGenerate, DoCreateSession,
// ...), so both APIs accept and refuse exactly the same things; errors become HTTP statuses and
// OpenAI's error JSON in one place (server/http/http_status.h).
//
// Endpoints: GET /v1/models, GET /v1/models/{id}, POST /v1/completions,
// POST /v1/chat/completions, and the session extension POST/GET /v1/sessions,
// GET/DELETE /v1/sessions/{id}, POST /v1/sessions/{id}/fork; and the web console at GET /
// (server/http/console_page.h). Another method on one of these paths is 405 with Allow; any
// other path 404.
//
// Generation: the response is sent with chunked transfer encoding once the job has been
// accepted by the scheduler (refusals before that get their own status), or for a non-streaming
// request once it has run `status_wait` (one that ends sooner is answered whole, with its
// status: an error's too). Tokens reach the
// connection's thread through a queue the step thread never waits on: text not yet written is
// merged, so a slow reader gets fewer, larger chunks. While there is nothing to send, a stream
// writes an SSE comment (": keep-alive") and a non-streaming response a space (JSON allows
// leading whitespace) every `heartbeat`: a write that fails means the client went away, and its
// job is cancelled within one scheduler step (for that, no response is compressed: a
// compressor would hold the heartbeats back). An engine error after the response started is
// reported in the body (an `error` event, or the error JSON) since the status line is out.
//
// Request bodies: at most `max_body_bytes` whatever their Content-Type (413 past it), read as
// JSON whatever it says (`curl -d` sends application/x-www-form-urlencoded). A response to a
// request whose body was left unread (a chunked one past the limit, a GET's, a refused one's)
// or could not be read ends its connection, so that the rest is not read as further requests.
//
// Shutdown (SdmServer): the service stops admitting (503 from then on), streams in flight finish
// or are cancelled by the scheduler (finish_reason "cancelled"), then Stop() closes the port.
//
// Connections: each holds a thread of the server's ConnectionPool while it is open; the pool
// grows with the connections (up to max_connections), so idle keep-alive connections do not
// keep a new client waiting, and shrinks back to `threads` once the threads above it have been
// idle for pool.idle_timeout. A connection that no thread has taken within pool.max_wait
// (max_connections open, or the system refuses a thread) is answered 503 with Retry-After and
// `Connection: close`, and closed.
//
// Thread-safety: requests run on the HTTP server's connection threads; active_generations() and
// Stop() may be called from any thread.
#ifndef SDMSERVE_SERVER_HTTP_OPENAI_SERVER_H_
#define SDMSERVE_SERVER_HTTP_OPENAI_SERVER_H_

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/reloadable.h"
#include "server/auth.h"
#include "server/http/chat_template.h"
#include "server/http/connection_pool_options.h"
#include "server/metrics/server_metrics.h"
#include "server/service.h"

namespace httplib {
class Server;
}

namespace sdm {

struct OpenAiServerOptions {
  // Address of the HTTP API. Port 0: a free port (see port()); -1: no HTTP API.
  std::string host = "127.0.0.1";
  int port = -1;
  // A chat template file (server/http/chat_template.h); empty: the model directory's
  // chat_template.json if there is one, else the plain-text default.
  std::filesystem::path chat_template_file;
  // Largest request body; larger ones get 413.
  size_t max_body_bytes = 4 << 20;
  // Socket read and write timeouts, and how long an idle keep-alive connection stays open.
  absl::Duration read_timeout = absl::Seconds(30);
  absl::Duration write_timeout = absl::Seconds(30);
  absl::Duration keep_alive_timeout = absl::Seconds(5);
  // Threads kept to serve connections: each open connection holds one, from its accept to its
  // close (idle keep-alive connections included); 0: max_running + max_waiting + 16. Another is
  // started whenever a connection arrives while none is idle, up to max_connections, and exits
  // once idle for pool.idle_timeout (server/http/connection_pool.h).
  int threads = 0;
  // Connections served at once (>= 1; threads above it are not started); past it a new
  // connection waits until one closes, at most pool.max_wait, then is answered 503. Requests are
  // limited by the scheduler (max_running, max_waiting: 429 when full), not by this.
  int max_connections = 1024;
  // The connection threads' timeouts (server/http/connection_pool_options.h).
  ConnectionPoolOptions pool;
  // Browser origins allowed to call the API from their pages (CORS), each as
  // "scheme://host[:port]" (what a browser sends in Origin), or "*" for any. A preflight
  // (OPTIONS) from one is answered 204 naming the path's methods and the headers a client sends
  // (Authorization, Content-Type, X-Session-Id), and every response to one carries
  // Access-Control-Allow-Origin (exposing X-Session-Id and Retry-After). Empty: none, and
  // browsers refuse cross-origin calls (the web console at / is same-origin). Start refuses
  // anything else (INVALID_ARGUMENT).
  std::vector<std::string> cors_origins;
  // How often an idle response is written to, to notice a client that went away.
  absl::Duration heartbeat = absl::Milliseconds(250);
  // How long a non-streaming response waits for its job to end before it starts (status line
  // and heartbeats): one that ends within it is answered whole, with its own status, an error's
  // included. A client that leaves meanwhile is noticed once it is over.
  absl::Duration status_wait = absl::Seconds(2);
};

class OpenAiServer {
 public:
  // Binds the port and starts serving. `scheduler_slots`: max_running + max_waiting (sizes the
  // threads kept when options.threads is 0). Errors: the chat template file, or an address that
  // cannot be bound (Unavailable).
  static absl::StatusOr<std::unique_ptr<OpenAiServer>> Start(
      const OpenAiServerOptions& options, SdmServiceImpl& service,
      const Reloadable<ApiKeyAuthenticator>& auth, ServerMetrics& metrics,
      const std::filesystem::path& model_dir, int scheduler_slots);
  ~OpenAiServer();  // Stop()
  OpenAiServer(const OpenAiServer&) = delete;
  OpenAiServer& operator=(const OpenAiServer&) = delete;

  int port() const { return port_; }
  // Generation responses not finished yet (running, queued, or writing their last bytes).
  int active_generations() const { return active_generations_.load(); }

  // Stops listening, ends open connections and joins the server's threads. Idempotent.
  void Stop();

  // The drain of a replica (server/server.cc): the port closes, so that a router's new
  // connections are refused and go to another replica, while the requests and streams in flight
  // go on; every response from then on ends its connection (Connection: close), so that a
  // router's kept-alive connections close too. Stop() ends the rest. Errors: the port could not
  // be closed (it stays open; the drain goes on as it would without). Idempotent.
  absl::Status CloseListener();
  // CloseListener() was called.
  bool closing() const { return closing_.load(); }

  class Handlers;

 private:
  OpenAiServer() = default;

  std::unique_ptr<httplib::Server> http_;
  std::unique_ptr<Handlers> handlers_;
  std::thread thread_;
  int port_ = 0;
  std::atomic<int> active_generations_{0};
  // The listening socket httplib holds (recorded as it is made; -1: none, or closed already).
  std::atomic<int> listen_fd_{-1};
  std::atomic<bool> closing_{false};
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_HTTP_OPENAI_SERVER_H_
