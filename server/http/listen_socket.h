// The listening side of the server's HTTP ports (the OpenAI API and the metrics endpoint), in one
// place: the socket's options and the accept loop's start.
#ifndef SDMSERVE_SERVER_HTTP_LISTEN_SOCKET_H_
#define SDMSERVE_SERVER_HTTP_LISTEN_SOCKET_H_

#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "httplib.h"

namespace sdm {

// For httplib::Server::set_socket_options. httplib's default sets SO_REUSEPORT, which lets a
// second server of the same user bind a port in use without error; the kernel then splits the
// connections between the two (a draining old server, or one with other API keys, answering half
// of them). This sets SO_REUSEADDR only, which allows a quick restart over connections left in
// TIME_WAIT: binding a port another socket listens on fails.
void SetExclusiveListenOptions(int socket);

// Runs the accept loop of `server` (bound already) on a new thread named `thread_name` (its
// connection threads inherit the name), and returns the thread once the loop runs: httplib's
// stop() does nothing before, so a server stopped right after its start (a later part of the
// start failing) would wait for ever when joined. UNAVAILABLE when the loop ended at once.
absl::StatusOr<std::thread> StartAcceptLoop(httplib::Server& server, std::string thread_name);

}  // namespace sdm

#endif  // SDMSERVE_SERVER_HTTP_LISTEN_SOCKET_H_
