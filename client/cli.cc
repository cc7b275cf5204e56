#include "client/cli.h"

#include <algorithm>

#include "absl/types/span.h"
#include "client/command.h"

namespace sdm::client {
namespace {

constexpr char kUsage[] = R"(usage: sdm-client COMMAND [flags]

commands:
  generate --prompt TEXT [--session ID] [sampling flags] [--json]
                           stream a completion to stdout (usage and finish reason to stderr)
  chat --session ID [--create]
                           an interactive conversation on a session, resumable later by id
  sessions list|get ID|create [ID]|delete ID...|fork SRC [DST]
                           manage sessions
  tokenize TEXT            text to token ids
  detokenize ID,ID,...     token ids to text
  info                     the served model and the server's limits

connection (every command): --host HOST:PORT (env SDM_HOST, default 127.0.0.1:50051),
  --api_key KEY (env SDM_API_KEY) or --api_key_file FILE, --tls (env SDM_TLS),
  --tls_ca FILE (env SDM_TLS_CA), --timeout SECONDS, before or after the command.
  Flags win over the environment.
'sdm-client COMMAND --help' documents a command's flags. Exit status: 0 ok, 1 a call failed
(the gRPC status code and message are printed), 2 usage error.
)";

// Moves connection flags written before the command ("sdm-client --host H:P info") to just
// after it (after "sessions SUB" for sessions), where the command's parser reads them. Returns
// false, with `error` set, for anything else before the command.
bool HoistLeadingFlags(std::vector<std::string>& args, std::string& error) {
  std::vector<std::string> leading;
  size_t i = 0;
  while (i < args.size() && args[i].size() > 1 && args[i][0] == '-' && args[i] != "--") {
    const std::string& arg = args[i];
    if (arg == "--help" || arg == "-h" || arg == "-help") break;
    std::string name = arg.substr(arg[1] == '-' ? 2 : 1);
    const bool has_value = name.find('=') != std::string::npos;
    name = name.substr(0, name.find('='));
    if (name == "host" || name == "api_key" || name == "api_key_file" || name == "tls_ca" ||
        name == "timeout") {
      leading.push_back(arg);
      if (!has_value) {
        if (i + 1 >= args.size()) {
          error = "--" + name + " needs a value";
          return false;
        }
        leading.push_back(args[++i]);
      }
    } else if (name == "tls" || name == "notls") {
      leading.push_back(arg);
    } else {
      error = "unknown flag --" + name + " before the command (only connection flags go there)";
      return false;
    }
    ++i;
  }
  if (leading.empty()) return true;
  args.erase(args.begin(), args.begin() + i);
  size_t insert_at = std::min<size_t>(1, args.size());
  if (!args.empty() && args[0] == "sessions" && args.size() > 1) insert_at = 2;
  args.insert(args.begin() + insert_at, leading.begin(), leading.end());
  return true;
}

int RunCommand(const std::vector<std::string>& original_args, const ClientIo& io);

}  // namespace

// The command's exit code, unless its output could not be written (a full disk, a closed pipe
// that does not raise SIGPIPE): then a failure, said on stderr. Before, `sdm-client generate >
// out.txt` on a full disk left a truncated file and exited 0.
int RunSdmClient(const std::vector<std::string>& original_args, const ClientIo& io) {
  const int exit = RunCommand(original_args, io);
  io.out->flush();
  if (io.out->fail()) {
    *io.err << "sdm-client: cannot write to standard output\n";
    return exit == kExitOk ? kExitFailure : exit;
  }
  return exit;
}

namespace {

int RunCommand(const std::vector<std::string>& original_args, const ClientIo& io) {
  std::vector<std::string> args = original_args;
  if (std::string error; !HoistLeadingFlags(args, error)) {
    *io.err << "sdm-client: " << error << "\n" << kUsage;
    return kExitUsage;
  }
  if (args.empty()) {
    *io.err << kUsage;
    return kExitUsage;
  }
  const std::string& name = args[0];
  const absl::Span<const std::string> rest = absl::MakeConstSpan(args).subspan(1);
  if (name == "generate") return RunGenerate(rest, io);
  if (name == "chat") return RunChat(rest, io);
  if (name == "sessions") return RunSessions(rest, io);
  if (name == "tokenize") return RunTokenize(rest, io);
  if (name == "detokenize") return RunDetokenize(rest, io);
  if (name == "info") return RunInfo(rest, io);
  if (name == "help" || name == "--help" || name == "-h") {
    *io.out << kUsage;
    return kExitOk;
  }
  *io.err << "sdm-client: unknown command '" << name << "'\n" << kUsage;
  return kExitUsage;
}

}  // namespace
}  // namespace sdm::client
