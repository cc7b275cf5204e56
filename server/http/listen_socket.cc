#include "server/http/listen_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/scoped_fd.h"
#include "base/thread_name.h"

namespace sdm {

void SetExclusiveListenOptions(int socket) {
  const int yes = 1;
  setsockopt(socket, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
}

absl::Status CheckPortFree(const std::string& what, const std::string& host, int port) {
  if (port <= 0) return absl::OkStatus();
  std::string name = host;
  if (name.size() >= 2 && name.front() == '[' && name.back() == ']') {
    name = name.substr(1, name.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (::getaddrinfo(name.empty() ? nullptr : name.c_str(), service.c_str(), &hints, &found) != 0) {
    return absl::OkStatus();
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> addresses(found, &::freeaddrinfo);
  for (const addrinfo* a = addresses.get(); a != nullptr; a = a->ai_next) {
    const ScopedFd socket(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (socket.get() < 0) continue;
    SetExclusiveListenOptions(socket.get());
    if (::bind(socket.get(), a->ai_addr, a->ai_addrlen) != 0 && errno == EADDRINUSE) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", host, ":", port, " for ", what, " (in use)"));
    }
  }
  return absl::OkStatus();
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

namespace {

absl::Status SystemError(const char* what) {
  return absl::InternalError(
      absl::StrCat("cannot close the HTTP port: ", what, ": ", std::strerror(errno)));
}

}  // namespace

absl::Status CloseListeningPort(int fd) {
  // A second reference to the port's socket: its address, and the wake-up below.
  const ScopedFd port(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (port.get() < 0) return SystemError("dup");
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (::getsockname(port.get(), reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    return SystemError("getsockname");
  }
  {
    const ScopedFd unreachable(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (unreachable.get() < 0) return SystemError("socket");
    // Bound to an address of the family alone: the kernel picks an abstract name.
    const sa_family_t family = AF_UNIX;
    if (::bind(unreachable.get(), reinterpret_cast<const sockaddr*>(&family), sizeof(family)) !=
        0) {
      return SystemError("bind");
    }
    if (::listen(unreachable.get(), 1) != 0) return SystemError("listen");
    if (::dup3(unreachable.get(), fd, O_CLOEXEC) < 0) return SystemError("dup3");
  }
  // An accept() blocked on the port's socket holds it until it returns: woken by a connection to
  // the port (its wildcard address through loopback).
  if (address.ss_family == AF_INET) {
    auto& in = reinterpret_cast<sockaddr_in&>(address);
    if (in.sin_addr.s_addr == htonl(INADDR_ANY)) in.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  } else if (address.ss_family == AF_INET6) {
    auto& in6 = reinterpret_cast<sockaddr_in6&>(address);
    if (IN6_IS_ADDR_UNSPECIFIED(&in6.sin6_addr)) in6.sin6_addr = in6addr_loopback;
  }
  const ScopedFd waker(::socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (waker.get() >= 0) {
    // A listening socket completes the connection from its backlog: no wait. Should it fail,
    // the blocked accept() takes the next client's connection instead, and the port closes then.
    ::connect(waker.get(), reinterpret_cast<const sockaddr*>(&address), length);
  }
  return absl::OkStatus();  // `port` closes here: the port's socket with it, once unblocked
}

}  // namespace sdm
