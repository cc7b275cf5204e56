#include "server/http/listen_socket.h"

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "base/thread_name.h"

namespace sdm {

void SetExclusiveListenOptions(int socket) {
  const int yes = 1;
  setsockopt(socket, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
}

absl::StatusOr<std::thread> StartAcceptLoop(httplib::Server& server, std::string thread_name) {
  auto exited = std::make_shared<std::atomic<bool>>(false);
  std::thread loop([&server, exited, name = std::move(thread_name)] {
    SetCurrentThreadName(name);
    server.listen_after_bind();
    exited->store(true);
  });
  while (!server.is_running()) {
    if (exited->load()) {
      loop.join();
      return absl::UnavailableError("its accept loop ended at once");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return loop;
}

}  // namespace sdm
