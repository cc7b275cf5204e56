// sdm-client sessions, tokenize, detokenize and info.
#include <algorithm>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "client/command.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/time_util.h"

namespace sdm::client {
namespace {

using google::protobuf::util::TimeUtil;

// The message as JSON with the .proto field names, every field printed.
std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  options.add_whitespace = true;
  std::string out;
  if (!google::protobuf::util::MessageToJsonString(message, &out, options).ok()) {
    out = "{}\n";
  }
  if (out.empty() || out.back() != '\n') out += "\n";
  return out;
}

// 1536 -> "1.5 KiB".
std::string HumanBytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrCat(bytes, " B") : absl::StrFormat("%.1f %s", v, units[u]);
}

// The short names of config.json ("attn", "swa", "sdm").
std::string LayerTypeName(sdm::v1::LayerType type) {
  switch (type) {
    case sdm::v1::LAYER_TYPE_ATTENTION:
      return "attn";
    case sdm::v1::LAYER_TYPE_SLIDING_WINDOW:
      return "swa";
    case sdm::v1::LAYER_TYPE_SPARSE_DELTA_MEMORY:
      return "sdm";
    default:
      return "unspecified";
  }
}

std::string TimeText(const google::protobuf::Timestamp& t) {
  if (t.seconds() == 0 && t.nanos() == 0) return "-";
  return TimeUtil::ToString(t);
}

void PrintSession(const sdm::v1::Session& s, std::ostream& out) {
  out << "id: " << s.id() << "\n"
      << "position: " << s.position() << "\n"
      << "state_bytes: " << s.state_bytes() << " (" << HumanBytes(s.state_bytes()) << ")\n"
      << "tier: " << TierName(s.tier()) << "\n"
      << "generating: " << (s.generating() ? "true" : "false") << "\n"
      << "create_time: " << TimeText(s.create_time()) << "\n"
      << "last_used_time: " << TimeText(s.last_used_time()) << "\n";
  if (s.has_ttl()) {
    out << "ttl: " << TimeUtil::ToString(s.ttl()) << "\n"
        << "expire_time: " << TimeText(s.expire_time()) << "\n";
  }
  if (!s.labels().empty()) {
    const std::map<std::string, std::string> labels(s.labels().begin(), s.labels().end());
    out << "labels: " << absl::StrJoin(labels, ", ", absl::PairFormatter("=")) << "\n";
  }
  if (!s.error().empty()) out << "error: " << s.error() << "\n";
}

// Sessions as an aligned table, one row each.
void PrintSessionTable(const std::vector<sdm::v1::Session>& sessions, std::ostream& out) {
  std::vector<std::vector<std::string>> rows = {
      {"ID", "POSITION", "STATE", "TIER", "GENERATING", "LAST_USED"}};
  for (const sdm::v1::Session& s : sessions) {
    rows.push_back({s.id(), absl::StrCat(s.position()), HumanBytes(s.state_bytes()),
                    s.error().empty() ? TierName(s.tier()) : "quarantined",
                    s.generating() ? "yes" : "no", TimeText(s.last_used_time())});
  }
  std::vector<size_t> widths(rows[0].size(), 0);
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      absl::StrAppend(&line, row[c]);
      if (c + 1 < row.size()) line.append(widths[c] - row[c].size() + 2, ' ');
    }
    out << line << "\n";
  }
}

// "KEY=VALUE" flags into a label map.
absl::Status ParseLabels(const std::vector<std::string>& specs,
                         google::protobuf::Map<std::string, std::string>& labels) {
  for (const std::string& spec : specs) {
    const size_t eq = spec.find('=');
    if (eq == std::string::npos || eq == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--label: expected KEY=VALUE, got '", spec, "'"));
    }
    labels[spec.substr(0, eq)] = spec.substr(eq + 1);
  }
  return absl::OkStatus();
}

// "3600", "90s", "1h30m" -> a Duration.
absl::Status ParseTtl(const std::string& text, google::protobuf::Duration& ttl) {
  absl::Duration d;
  double seconds = 0;
  if (absl::SimpleAtod(text, &seconds)) {
    d = absl::Seconds(seconds);
  } else if (!absl::ParseDuration(text, &d)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ttl: '", text, "' is not a duration (e.g. 3600, 90s, 1h30m)"));
  }
  if (d <= absl::ZeroDuration() || d == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ttl must be positive and finite, got '", text, "'"));
  }
  if (d > absl::Hours(24 * 36525)) {  // the server's limit (100 years), which nanoseconds fit
    return absl::InvalidArgumentError(
        absl::StrCat("--ttl must be at most 100 years, got '", text, "'"));
  }
  const int64_t nanos = absl::ToInt64Nanoseconds(d);
  ttl.set_seconds(nanos / 1000000000);
  ttl.set_nanos(static_cast<int32_t>(nanos % 1000000000));
  return absl::OkStatus();
}

int SessionsList(absl::Span<const std::string> args, const ClientIo& io) {
  Command command(io, "sessions list",
                  "sdm-client sessions list [--label KEY=VALUE]... [--page_size N] [--json]",
                  "Lists the tenant's sessions, ordered by id (every page).");
  std::vector<std::string> labels;
  int64_t page_size = 0;
  bool json = false;
  command.flags().AddStringList("label", &labels, "only sessions with this label (KEY=VALUE)");
  command.flags().AddInt("page_size", &page_size, "sessions per call (0: the server's default)");
  command.flags().AddBool("json", &json, "print {\"sessions\": [...]} as JSON");
  if (std::optional<int> exit = command.Parse(args)) return *exit;
  if (!command.positional().empty()) {
    return command.UsageError(absl::StrCat("unexpected argument '", command.positional()[0], "'"));
  }
  sdm::v1::ListSessionsRequest request;
  request.set_page_size(static_cast<int32_t>(page_size));
  if (absl::Status s = ParseLabels(labels, *request.mutable_label_selector()); !s.ok()) {
    return command.UsageError(s.message());
  }
  if (std::optional<int> exit = command.Connect()) return *exit;
  sdm::v1::ListSessionsResponse all;
  while (true) {
    grpc::ClientContext context;
    command.Prepare(context);
    sdm::v1::ListSessionsResponse page;
    if (grpc::Status s = command.stub().ListSessions(&context, request, &page); !s.ok()) {
      return command.Failure(s, context);
    }
    for (sdm::v1::Session& session : *page.mutable_sessions()) {
      *all.add_sessions() = std::move(session);
    }
    if (page.next_page_token().empty()) break;
    request.set_page_token(page.next_page_token());
  }
  if (json) {
    *io.out << ToJson(all);
  } else {
    PrintSessionTable({all.sessions().begin(), all.sessions().end()}, *io.out);
  }
  return kExitOk;
}

int SessionsGet(absl::Span<const std::string> args, const ClientIo& io) {
  Command command(io, "sessions get", "sdm-client sessions get ID [--json]", "Shows one session.");
  bool json = false;
  command.flags().AddBool("json", &json, "print the Session message as JSON");
  if (std::optional<int> exit = command.Parse(args)) return *exit;
  if (command.positional().size() != 1) return command.UsageError("expected one session id");
  if (std::optional<int> exit = command.Connect()) return *exit;
  grpc::ClientContext context;
  command.Prepare(context);
  AddSessionRouting(command.positional()[0], context);
  sdm::v1::GetSessionRequest request;
  request.set_session_id(command.positional()[0]);
  sdm::v1::Session session;
  if (grpc::Status s = command.stub().GetSession(&context, request, &session); !s.ok()) {
    return command.Failure(s, context);
  }
  if (json) {
    *io.out << ToJson(session);
  } else {
    PrintSession(session, *io.out);
  }
  return kExitOk;
}

int SessionsCreateOrFork(absl::Span<const std::string> args, const ClientIo& io, bool fork) {
  Command command(
      io, fork ? "sessions fork" : "sessions create",
      fork ? "sdm-client sessions fork SRC [DST] [--ttl DURATION] [--label KEY=VALUE]... [--json]"
           : "sdm-client sessions create [ID] [--ttl DURATION] [--label KEY=VALUE]... [--json]",
      fork ? "Copies session SRC into a new session DST (the server picks the id when DST is\n"
             "omitted): both continue independently from the same history."
           : "Creates an empty session (the server picks the id when ID is omitted).");
  std::string ttl;
  std::vector<std::string> labels;
  bool json = false;
  command.flags().AddString("ttl", &ttl,
                            "delete the session after it is idle this long "
                            "(seconds, or 90s, 1h30m)");
  command.flags().AddStringList("label", &labels, "a label KEY=VALUE of the new session");
  command.flags().AddBool("json", &json, "print the new Session message as JSON");
  if (std::optional<int> exit = command.Parse(args)) return *exit;
  const std::vector<std::string>& pos = command.positional();
  if (fork ? (pos.empty() || pos.size() > 2) : pos.size() > 1) {
    return command.UsageError(fork ? "expected SRC [DST]" : "expected at most one session id");
  }
  google::protobuf::Duration ttl_proto;
  google::protobuf::Map<std::string, std::string> label_map;
  if (!ttl.empty()) {
    if (absl::Status s = ParseTtl(ttl, ttl_proto); !s.ok()) return command.UsageError(s.message());
  }
  if (absl::Status s = ParseLabels(labels, label_map); !s.ok()) {
    return command.UsageError(s.message());
  }
  if (std::optional<int> exit = command.Connect()) return *exit;
  grpc::ClientContext context;
  command.Prepare(context);
  // A fork is routed by its source: the replica holding the source makes the copy.
  if (!pos.empty()) AddSessionRouting(pos[0], context);
  sdm::v1::Session session;
  grpc::Status status;
  if (fork) {
    sdm::v1::ForkSessionRequest request;
    request.set_session_id(pos[0]);
    if (pos.size() > 1) request.set_new_session_id(pos[1]);
    if (!ttl.empty()) *request.mutable_ttl() = ttl_proto;
    *request.mutable_labels() = label_map;
    status = command.stub().ForkSession(&context, request, &session);
  } else {
    sdm::v1::CreateSessionRequest request;
    if (!pos.empty()) request.set_session_id(pos[0]);
    if (!ttl.empty()) *request.mutable_ttl() = ttl_proto;
    *request.mutable_labels() = label_map;
    status = command.stub().CreateSession(&context, request, &session);
  }
  if (!status.ok()) return command.Failure(status, context);
  if (json) {
    *io.out << ToJson(session);
  } else {
    PrintSession(session, *io.out);
  }
  return kExitOk;
}

int SessionsDelete(absl::Span<const std::string> args, const ClientIo& io) {
  Command command(io, "sessions delete", "sdm-client sessions delete ID...",
                  "Deletes sessions and their state on every tier.");
  if (std::optional<int> exit = command.Parse(args)) return *exit;
  if (command.positional().empty()) return command.UsageError("expected a session id");
  if (std::optional<int> exit = command.Connect()) return *exit;
  // Every id is tried (a cleanup script's list is not cut short by one that is gone); the exit
  // code is the first failure's.
  int exit = kExitOk;
  for (const std::string& id : command.positional()) {
    grpc::ClientContext context;
    command.Prepare(context);
    AddSessionRouting(id, context);
    sdm::v1::DeleteSessionRequest request;
    request.set_session_id(id);
    sdm::v1::DeleteSessionResponse response;
    if (grpc::Status s = command.stub().DeleteSession(&context, request, &response); !s.ok()) {
      const int failed = command.Failure(s, context);
      if (exit == kExitOk) exit = failed;
      continue;
    }
    *io.out << "deleted " << id << "\n";
  }
  return exit;
}

}  // namespace

int RunSessions(absl::Span<const std::string> args, const ClientIo& io) {
  constexpr char kUsage[] =
      "usage: sdm-client sessions list|get ID|create [ID]|delete ID...|fork SRC [DST] [flags]\n";
  if (args.empty()) {
    *io.err << "sdm-client sessions: expected a subcommand\n" << kUsage;
    return kExitUsage;
  }
  const std::string& sub = args[0];
  const absl::Span<const std::string> rest = args.subspan(1);
  if (sub == "list") return SessionsList(rest, io);
  if (sub == "get") return SessionsGet(rest, io);
  if (sub == "create") return SessionsCreateOrFork(rest, io, /*fork=*/false);
  if (sub == "fork") return SessionsCreateOrFork(rest, io, /*fork=*/true);
  if (sub == "delete") return SessionsDelete(rest, io);
  if (sub == "--help" || sub == "-h" || sub == "help") {
    *io.out << kUsage;
    return kExitOk;
  }
  *io.err << "sdm-client sessions: unknown subcommand '" << sub << "'\n" << kUsage;
  return kExitUsage;
}

int RunTokenize(absl::Span<const std::string> args, const ClientIo& io) {
  Command command(io, "tokenize", "sdm-client tokenize TEXT [--add_bos] [--json]",
                  "Prints the token ids Generate would feed for TEXT ('-': read stdin), comma-\n"
                  "separated on one line; their count goes to stderr.");
  bool add_bos = false;
  bool json = false;
  command.flags().AddBool("add_bos", &add_bos, "put the tokenizer's BOS first");
  command.flags().AddBool("json", &json, "print {\"token_ids\": [...]}");
  if (std::optional<int> exit = command.Parse(args)) return *exit;
  if (command.positional().size() != 1) return command.UsageError("expected one TEXT argument");
  std::string text = command.positional()[0];
  if (text == "-") {
    text.assign(std::istreambuf_iterator<char>(*io.in), std::istreambuf_iterator<char>());
  }
  if (std::optional<int> exit = command.Connect()) return *exit;
  grpc::ClientContext context;
  command.Prepare(context);
  sdm::v1::TokenizeRequest request;
  request.set_text(text);
  request.set_add_bos(add_bos);
  sdm::v1::TokenizeResponse response;
  if (grpc::Status s = command.stub().Tokenize(&context, request, &response); !s.ok()) {
    return command.Failure(s, context);
  }
  if (json) {
    *io.out << ToJson(response);
  } else {
    *io.out << absl::StrJoin(response.token_ids(), ",") << "\n";
  }
  *io.err << response.token_ids_size() << " tokens\n";
  return kExitOk;
}

int RunDetokenize(absl::Span<const std::string> args, const ClientIo& io) {
  Command command(io, "detokenize", "sdm-client detokenize ID,ID,...",
                  "Prints the text of the token ids (control ids have no text).");
  if (std::optional<int> exit = command.Parse(args)) return *exit;
  if (command.positional().size() != 1) return command.UsageError("expected one list of ids");
  absl::StatusOr<std::vector<int32_t>> ids = ParseTokenIds(command.positional()[0], "token ids");
  if (!ids.ok()) return command.UsageError(ids.status().message());
  if (std::optional<int> exit = command.Connect()) return *exit;
  grpc::ClientContext context;
  command.Prepare(context);
  sdm::v1::DetokenizeRequest request;
  request.mutable_token_ids()->Add(ids->begin(), ids->end());
  sdm::v1::DetokenizeResponse response;
  if (grpc::Status s = command.stub().Detokenize(&context, request, &response); !s.ok()) {
    return command.Failure(s, context);
  }
  *io.out << response.text();
  if (io.out_is_terminal) *io.out << "\n";
  *io.out << std::flush;
  return kExitOk;
}

int RunInfo(absl::Span<const std::string> args, const ClientIo& io) {
  Command command(io, "info", "sdm-client info [--json]",
                  "Shows the served model (architecture, sizes) and the server's limits.");
  bool json = false;
  command.flags().AddBool("json", &json, "print the ModelInfo message as JSON");
  if (std::optional<int> exit = command.Parse(args)) return *exit;
  if (!command.positional().empty()) {
    return command.UsageError(absl::StrCat("unexpected argument '", command.positional()[0], "'"));
  }
  if (std::optional<int> exit = command.Connect()) return *exit;
  grpc::ClientContext context;
  command.Prepare(context);
  sdm::v1::ModelInfo info;
  if (grpc::Status s = command.stub().GetModelInfo(&context, sdm::v1::GetModelInfoRequest(), &info);
      !s.ok()) {
    return command.Failure(s, context);
  }
  if (json) {
    *io.out << ToJson(info);
    return kExitOk;
  }
  std::ostream& out = *io.out;
  out << "server: " << command.connection().host << (command.connection().tls ? " (tls)" : "")
      << "\n"
      << "model: " << info.name() << "\n"
      << "summary: " << info.summary() << "\n"
      << "dim: " << info.dim() << ", layers: " << info.n_layers() << "\n";
  // In the order the model's layers first use each type ("swa x3, sdm x1" for a 3:1 hybrid),
  // which says what the model is built of first; a name order put sdm first.
  std::vector<std::pair<std::string, int>> layer_counts;
  for (const int t : info.layer_types()) {
    const std::string name = LayerTypeName(static_cast<sdm::v1::LayerType>(t));
    auto it = std::find_if(layer_counts.begin(), layer_counts.end(),
                           [&name](const auto& count) { return count.first == name; });
    if (it == layer_counts.end()) it = layer_counts.insert(layer_counts.end(), {name, 0});
    ++it->second;
  }
  out << "layer types: " << absl::StrJoin(layer_counts, ", ", absl::PairFormatter(" x")) << "\n";
  if (info.swa_window() > 0) out << "sliding window: " << info.swa_window() << "\n";
  if (info.has_sdm()) {
    const sdm::v1::SdmInfo& s = info.sdm();
    out << "sdm: " << s.num_heads() << " heads x " << s.slots_per_head() << " slots x "
        << s.head_width() << " values, " << s.num_writes() << " writes / " << s.num_reads()
        << " reads per token and head\n";
  }
  out << "vocab_size: " << info.vocab_size() << "\n"
      << "tokenizer: " << info.tokenizer().name() << " (bos " << info.tokenizer().bos_id()
      << ", eos " << info.tokenizer().eos_id() << ", " << info.tokenizer().vocab_size() << " ids)\n"
      << "parameters: " << info.parameters() << " (" << info.parameters_without_memory()
      << " without the SDM memory)\n"
      << "max_sdm_state_bytes: " << info.max_sdm_state_bytes() << " ("
      << HumanBytes(info.max_sdm_state_bytes()) << ")\n"
      << "attention_cache_bytes_per_token: " << info.attention_cache_bytes_per_token() << "\n"
      << "max_prompt_tokens: " << info.max_prompt_tokens() << "\n"
      << "max_tokens_limit: " << info.max_tokens_limit() << "\n"
      << "max_session_tokens: "
      << (info.max_session_tokens() > 0 ? absl::StrCat(info.max_session_tokens()) : "no limit")
      << "\n";
  return kExitOk;
}

}  // namespace sdm::client
