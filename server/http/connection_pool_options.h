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

  // Testing: the time the pool reads; empty: absl::Now(). With a clock here the pool acts on time
  // only when ConnectionPool::ClockAdvancedForTesting() is called, never on its own, so a test
  // decides exactly when a timeout has passed.
  std::function<absl::Time()> clock;
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_HTTP_CONNECTION_POOL_OPTIONS_H_
