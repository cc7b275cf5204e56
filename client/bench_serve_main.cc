// sdm-bench-serve: the `sdm-bench serve` load generator (client/bench_serve.h), a binary of its
// own so that the engine-level sdm-bench does not depend on gRPC; `sdm-bench serve ARGS` runs
// this binary with ARGS. A leading `serve` argument is accepted and ignored.
#include <unistd.h>

#include <string>
#include <vector>

#include "client/bench_serve.h"

int main(int argc, char** argv) {
  sdm::client::ClientIo io;
  io.out_is_terminal = isatty(STDOUT_FILENO) == 1;
  return sdm::client::RunBenchServeCommand(std::vector<std::string>(argv + 1, argv + argc), io);
}
