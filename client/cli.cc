#include "client/cli.h"

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
  --api_key KEY (env SDM_API_KEY), --tls (env SDM_TLS), --tls_ca FILE (env SDM_TLS_CA),
  --timeout SECONDS. Flags win over the environment.
'sdm-client COMMAND --help' documents a command's flags. Exit status: 0 ok, 1 a call failed
(the gRPC status code and message are printed), 2 usage error.
)";

}  // namespace

int RunSdmClient(const std::vector<std::string>& args, const ClientIo& io) {
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

}  // namespace sdm::client
