// Options for the listening sockets of the server's HTTP ports (the OpenAI API and the metrics
// endpoint), in one place.
#ifndef SDMSERVE_SERVER_HTTP_LISTEN_SOCKET_H_
#define SDMSERVE_SERVER_HTTP_LISTEN_SOCKET_H_

namespace sdm {

// For httplib::Server::set_socket_options. httplib's default sets SO_REUSEPORT, which lets a
// second server of the same user bind a port in use without error; the kernel then splits the
// connections between the two (a draining old server, or one with other API keys, answering half
// of them). This sets SO_REUSEADDR only, which allows a quick restart over connections left in
// TIME_WAIT: binding a port another socket listens on fails.
void SetExclusiveListenOptions(int socket);

}  // namespace sdm

#endif  // SDMSERVE_SERVER_HTTP_LISTEN_SOCKET_H_
