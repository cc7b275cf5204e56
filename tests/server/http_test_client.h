// An HTTP client for tests, for calls that are expected to succeed.
#ifndef SDMSERVE_TESTS_SERVER_HTTP_TEST_CLIENT_H_
#define SDMSERVE_TESTS_SERVER_HTTP_TEST_CLIENT_H_

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

}  // namespace sdm::testing

#endif  // SDMSERVE_TESTS_SERVER_HTTP_TEST_CLIENT_H_
