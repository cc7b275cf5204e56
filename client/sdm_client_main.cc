// sdm-client: the command-line client of an sdmserve server. client/cli.h documents the
// commands; docs/api.md ("Client") has examples.
#include <unistd.h>

#include <string>
#include <vector>

#include "client/cli.h"

int main(int argc, char** argv) {
  sdm::client::ClientIo io;
  io.out_is_terminal = isatty(STDOUT_FILENO) == 1;
  io.in_is_terminal = isatty(STDIN_FILENO) == 1;
  io.route_sigint = true;
  std::ios::sync_with_stdio(false);
  return sdm::client::RunSdmClient(std::vector<std::string>(argv + 1, argv + argc), io);
}
