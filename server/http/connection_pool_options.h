// ConnectionPoolOptions: the tuning of ConnectionPool (server/http/connection_pool.h), apart from
// its thread counts. A header of its own so that OpenAiServerOptions (server/http/openai_server.h)
// can hold it without including httplib.h; the defaults are stated here only.
#ifndef SDMSERVE_SERVER_HTTP_CONNECTION_POOL_OPTIONS_H_
#define SDMSERVE_SERVER_HTTP_CONNECTION_POOL_OPTIONS_H_

#include <functional>

#include "absl/time/time.h"

namespace sdm {

struct ConnectionPoolOptions {
  // A worker above the pool's base_threads that has waited this long for a job exits (a burst of
  // connections does not leave its threads behind). Zero: as soon as it is idle.
  absl::Duration idle_timeout = absl::Seconds(60);

  // A job (a connection) that no worker has taken this long after enqueue() is refused: it runs
  // on one of `refusal_threads` threads kept for this, where ConnectionPool::Refusing() is true,
  // so that the server answers 503 (Retry-After) and closes it instead of leaving it unanswered
  // until some other connection closes. Zero: at once when no worker is idle and none can start.
  absl::Duration max_wait = absl::Seconds(1);
  // Threads that only answer refused jobs, started with the pool (they run even when the system
  // refuses new threads), on top of its max_threads. 0: no job is refused; it waits for a worker
  // however long, as in httplib's ThreadPool.
  int refusal_threads = 2;

  // Testing: the time the pool reads; empty: absl::Now(). With a clock here the pool acts on time
  // only when ConnectionPool::ClockAdvancedForTesting() is called, never on its own, so a test
  // decides exactly when a timeout has passed.
  std::function<absl::Time()> clock;
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_HTTP_CONNECTION_POOL_OPTIONS_H_
