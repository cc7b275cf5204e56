#include "server/http/listen_socket.h"

#include <sys/socket.h>

namespace sdm {

void SetExclusiveListenOptions(int socket) {
  const int yes = 1;
  setsockopt(socket, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
}

}  // namespace sdm
