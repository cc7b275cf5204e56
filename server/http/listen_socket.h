// The listening side of the server's HTTP ports (the OpenAI API and the metrics endpoint), in one
// place: the socket's options and the accept loop's start.
#ifndef SDMSERVE_SERVER_HTTP_LISTEN_SOCKET_H_
#define SDMSERVE_SERVER_HTTP_LISTEN_SOCKET_H_

#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "httplib.h"

namespace sdm {

// For httplib::Server::set_socket_options. httplib's default sets SO_REUSEPORT, which lets a
// second server of the same user bind a port in use without error; the kernel then splits the
// connections between the two (a draining old server, or one with other API keys, answering half
// of them). This sets SO_REUSEADDR only, which allows a quick restart over connections left in
// TIME_WAIT: binding a port another socket listens on fails.
void SetExclusiveListenOptions(int socket);

// Whether a TCP port `port` of `host` (an address or name; "[::1]" brackets allowed) could be
// bound now with the listening options above: UNAVAILABLE naming `what` (e.g. "the HTTP API")
// and the address when another socket holds it. Anything else (a host that does not resolve,
// port 0: any port) is OK here, left to the real bind. A check, not a reservation: the port may
// be taken between this and the bind, which then fails as it did before.
absl::Status CheckPortFree(const std::string& what, const std::string& host, int port);

// Runs the accept loop of `server` (bound already) on a new thread named `thread_name` (its
// connection threads inherit the name), and returns the thread once the loop runs: httplib's
// stop() does nothing before, so a server stopped right after its start (a later part of the
// start failing) would wait for ever when joined. UNAVAILABLE when the loop ended at once.
absl::StatusOr<std::thread> StartAcceptLoop(httplib::Server& server, std::string thread_name);

// Closes the port that the listening socket `fd` (an httplib server's, accept loop running)
// listens on, while the server goes on: the descriptor number is made to refer to a listening
// socket nobody can reach (AF_UNIX, autobound), so httplib's loop keeps waiting on it rather
// than ending, and its connections in flight and their streams go on (httplib ends streams as
// soon as its listening descriptor is invalid: stop()). New connections to the port are refused
// once an accept() already blocked on it has returned: a connection of this function's own
// wakes it (closed at once; its worker reads nothing), and until then a client's connection
// may still be taken and answered as any other. httplib's stop() later closes the stand-in.
// Errors: a system call failed (the port then stays open).
absl::Status CloseListeningPort(int fd);

}  // namespace sdm

#endif  // SDMSERVE_SERVER_HTTP_LISTEN_SOCKET_H_
