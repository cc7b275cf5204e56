// What every sdm-client subcommand does the same way: parse its flags (plus the connection
// flags), print its help, report usage errors and failed calls, and connect.
//
// Used only by the subcommands' implementations (client/*_commands.cc).
#ifndef SDMSERVE_CLIENT_COMMAND_H_
#define SDMSERVE_CLIENT_COMMAND_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "client/cli.h"
#include "client/connection.h"
#include "client/flags.h"
#include "grpcpp/client_context.h"
#include "sdm/v1/sdm.grpc.pb.h"

namespace sdm::client {

class Command {
 public:
  // `name` as typed ("generate", "sessions list"); `synopsis` and `description` for --help.
  Command(const ClientIo& io, std::string name, std::string synopsis, std::string description);
  Command(const Command&) = delete;
  Command& operator=(const Command&) = delete;

  // Register the subcommand's own flags here before Parse().
  FlagSet& flags() { return flags_; }
  const ClientIo& io() const { return io_; }

  // Parses args. Returns an exit status to return at once (help printed: 0; usage error: 2),
  // or nullopt to go on. Then positional() holds the positional arguments.
  std::optional<int> Parse(absl::Span<const std::string> args);
  const std::vector<std::string>& positional() const { return positional_; }

  // Resolves the connection options and creates the channel and stub. Returns an exit status
  // (usage error: 2) or nullopt to go on.
  std::optional<int> Connect();
  sdm::v1::SdmService::Stub& stub() { return *stub_; }
  const ConnectionOptions& connection() const { return connection_; }

  // Adds the API key and deadline to a call's context.
  void Prepare(grpc::ClientContext& context) const { PrepareContext(connection_, context); }

  // Prints "sdm-client NAME: MESSAGE (sdm-client NAME --help)" to stderr; returns 2.
  int UsageError(absl::string_view message) const;
  // Prints a failed call to stderr: "sdm-client: CODE: message" and FailureHint's hint, if any,
  // then "sdm-client: retry after N ms" when the server's answer carried a retry hint
  // (`retry_after_ms`, RetryAfterMs(); empty: none). Every command reports its failed calls
  // through here or Failure().
  void ReportFailure(const grpc::Status& status, absl::string_view retry_after_ms) const;
  // ReportFailure(); returns 1.
  int Failure(const grpc::Status& status, absl::string_view retry_after_ms) const;
  // The same for a unary call, its hint read from its finished `context`.
  int Failure(const grpc::Status& status, const grpc::ClientContext& context) const;

 private:
  const ClientIo& io_;
  std::string name_;
  std::string synopsis_;
  std::string description_;
  FlagSet flags_;
  ConnectionFlags connection_flags_;
  ConnectionOptions connection_;
  std::vector<std::string> positional_;
  std::unique_ptr<sdm::v1::SdmService::Stub> stub_;
};

// The server's retry hint in a finished call's trailing metadata (grpc-retry-pushback-ms, in
// milliseconds: server/grpc_status.h); empty: none.
std::string RetryAfterMs(const grpc::ClientContext& context);

// The sampling flags shared by generate and chat: --max_tokens, --temperature, --top_k, --top_p,
// --seed, --stop (repeatable), --stop_ids (comma-separated), --logit_bias (ID:BIAS,...),
// --add_bos / --noadd_bos.
struct SamplingFlags {
  int64_t max_tokens = 0;
  double temperature = 0;
  int64_t top_k = 0;
  double top_p = 1;
  std::string seed = "0";
  std::vector<std::string> stop;
  std::string stop_ids;
  std::string logit_bias;
  bool ignore_eos = false;
  bool add_bos = false;
};
void AddSamplingFlags(FlagSet& flags, SamplingFlags* values);

// Fills request.sampling and request.add_bos from the flags; a flag left unset leaves the field
// unset (the server's default). INVALID_ARGUMENT for a malformed --seed, --stop_ids or
// --logit_bias (ranges are the server's to check).
absl::Status ApplySamplingFlags(const FlagSet& flags, const SamplingFlags& values,
                                sdm::v1::GenerateRequest& request);

// Parses "1,2,3" (spaces allowed around ids). INVALID_ARGUMENT names `what`.
absl::StatusOr<std::vector<int32_t>> ParseTokenIds(absl::string_view text, absl::string_view what);

// "resident", "host", "disk", or "-".
std::string TierName(sdm::v1::Tier tier);

// "length", "stop", "eos", "cancelled", or "unspecified".
absl::string_view FinishReasonName(sdm::v1::FinishReason reason);

// The subcommands: each takes the arguments after its name and returns the exit status.
int RunGenerate(absl::Span<const std::string> args, const ClientIo& io);  // generate_commands.cc
int RunChat(absl::Span<const std::string> args, const ClientIo& io);      // generate_commands.cc
int RunSessions(absl::Span<const std::string> args, const ClientIo& io);  // admin_commands.cc
int RunTokenize(absl::Span<const std::string> args, const ClientIo& io);  // admin_commands.cc
int RunDetokenize(absl::Span<const std::string> args, const ClientIo& io);
int RunInfo(absl::Span<const std::string> args, const ClientIo& io);  // admin_commands.cc

}  // namespace sdm::client

#endif  // SDMSERVE_CLIENT_COMMAND_H_
