// An HTTP client for tests, for calls that are expected to succeed; and raw TCP connections, for
// clients httplib would not be (one that drips bytes, one that keeps a connection open idle).
#ifndef SDMSERVE_TESTS_SERVER_HTTP_TEST_CLIENT_H_
#define SDMSERVE_TESTS_SERVER_HTTP_TEST_CLIENT_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include "httplib.h"

namespace sdm::testing {

// A client of host:port whose connection, read and write timeouts are 60 s: httplib's default
// read and write timeouts (5 s) would turn a stall of a loaded CI machine into a failed call. A
// test that expects a call to time out sets its own timeout on the client.
inline httplib::Client TestHttpClient(int port, const std::string& host = "127.0.0.1") {
  httplib::Client client(host, port);
  client.set_connection_timeout(60, 0);
  client.set_read_timeout(60, 0);
  client.set_write_timeout(60, 0);
  return client;
}

// A raw TCP connection to 127.0.0.1:port (-1 on failure).
inline int ConnectRaw(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

inline bool SendAll(int fd, const std::string& bytes) {
  return send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

}  // namespace sdm::testing

#endif  // SDMSERVE_TESTS_SERVER_HTTP_TEST_CLIENT_H_
