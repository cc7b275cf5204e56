// sdm-client: the command-line client of an sdmserve server (docs/api.md, "Client").
//
//   sdm-client generate --prompt TEXT [--session ID] [sampling flags] [--json]
//   sdm-client chat --session ID [--create] [sampling flags]
//   sdm-client sessions list|get ID|create [ID]|delete ID|fork SRC [DST]
//   sdm-client tokenize TEXT [--add_bos] [--json]
//   sdm-client detokenize ID,ID,...
//   sdm-client info [--json]
//
// Every subcommand takes the connection flags of client/connection.h (--host, --api_key,
// --api_key_file, --tls, --tls_ca, --timeout; environment SDM_HOST, SDM_API_KEY, SDM_TLS,
// SDM_TLS_CA), after the command or before it (`sdm-client --host H:P info`), and documents its
// own flags with --help.
//
// Exit status: 0 on success; 1 when a call fails (the gRPC status code's name and message go to
// stderr: "sdm-client: NOT_FOUND: ..."); 2 on usage errors (unknown subcommand or flag, a
// missing or malformed argument, an unreadable CA or API key file).
//
// Thread-compatible: RunSdmClient runs one command on the calling thread.
#ifndef SDMSERVE_CLIENT_CLI_H_
#define SDMSERVE_CLIENT_CLI_H_

#include <iostream>
#include <string>
#include <vector>

#include "client/connection.h"

namespace sdm::client {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// Where a command reads and writes. The defaults are the process's.
struct ClientIo {
  std::istream* in = &std::cin;
  std::ostream* out = &std::cout;  // streamed text and results
  std::ostream* err = &std::cerr;  // usage lines, summaries, errors
  EnvLookup env = ProcessEnv();
  // Streamed text that does not end with a newline gets one when stdout is a terminal (so the
  // shell prompt stays off it); pipes get the text verbatim.
  bool out_is_terminal = false;
  // chat prints a "> " prompt before reading each line.
  bool in_is_terminal = false;
  // chat takes SIGINT (Ctrl-C) while it runs (client/interrupt.h): the first one while a turn
  // streams cancels that turn and the chat goes on; otherwise the process ends as without the
  // handler. sdm-client's main sets it; left false, chat leaves SIGINT's action alone.
  bool route_sigint = false;
};

// Runs `sdm-client ARGS...` (args excludes the program name) and returns the exit status.
int RunSdmClient(const std::vector<std::string>& args, const ClientIo& io);

}  // namespace sdm::client

#endif  // SDMSERVE_CLIENT_CLI_H_
