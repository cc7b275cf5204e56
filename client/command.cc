#include "client/command.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace sdm::client {

Command::Command(const ClientIo& io, std::string name, std::string synopsis,
                 std::string description)
    : io_(io),
      name_(std::move(name)),
      synopsis_(std::move(synopsis)),
      description_(std::move(description)) {}

std::optional<int> Command::Parse(absl::Span<const std::string> args) {
  AddConnectionFlags(flags_, &connection_flags_);
  if (WantsHelp(args)) {
    *io_.out << "usage: " << synopsis_ << "\n\n" << description_ << "\n\nflags:\n" << flags_.Help();
    return kExitOk;
  }
  absl::StatusOr<std::vector<std::string>> positional = flags_.Parse(args);
  if (!positional.ok()) return UsageError(positional.status().message());
  positional_ = *std::move(positional);
  return std::nullopt;
}

std::optional<int> Command::Connect() {
  absl::StatusOr<ConnectionOptions> options =
      ResolveConnectionOptions(flags_, connection_flags_, io_.env);
  if (!options.ok()) return UsageError(options.status().message());
  connection_ = *std::move(options);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = MakeChannel(connection_);
  if (!channel.ok()) return UsageError(channel.status().message());
  stub_ = sdm::v1::SdmService::NewStub(*channel);
  return std::nullopt;
}

int Command::UsageError(absl::string_view message) const {
  *io_.err << "sdm-client " << name_ << ": " << message << " (sdm-client " << name_ << " --help)\n";
  return kExitUsage;
}

void Command::ReportFailure(const grpc::Status& status, absl::string_view retry_after_ms) const {
  *io_.err << "sdm-client: " << FormatStatus(status);
  if (const std::string hint =
          FailureHint(status.error_code(), status.error_message(), connection_);
      !hint.empty()) {
    *io_.err << " " << hint;
  }
  *io_.err << "\n";
  if (!retry_after_ms.empty()) *io_.err << "sdm-client: retry after " << retry_after_ms << " ms\n";
}

int Command::Failure(const grpc::Status& status, absl::string_view retry_after_ms) const {
  ReportFailure(status, retry_after_ms);
  return kExitFailure;
}

int Command::Failure(const grpc::Status& status, const grpc::ClientContext& context) const {
  return Failure(status, RetryAfterMs(context));
}

std::string RetryAfterMs(const grpc::ClientContext& context) {
  const auto& trailers = context.GetServerTrailingMetadata();
  const auto hint = trailers.find("grpc-retry-pushback-ms");
  if (hint == trailers.end()) return "";
  return std::string(hint->second.data(), hint->second.size());
}

void AddSamplingFlags(FlagSet& flags, SamplingFlags* values) {
  flags.AddInt("max_tokens", &values->max_tokens, "generate at most this many tokens");
  flags.SetDefaultText("max_tokens", "unset: the server's, 256");
  flags.AddDouble("temperature", &values->temperature, "0: greedy; otherwise softmax temperature");
  flags.AddInt("top_k", &values->top_k, "sample among the k most probable tokens; 0: no limit");
  flags.AddDouble("top_p", &values->top_p,
                  "nucleus sampling threshold in [0, 1] (0: the most probable token)");
  flags.AddString("seed", &values->seed, "sampler seed (unsigned 64-bit)");
  flags.AddStringList("stop", &values->stop, "stop when the text contains this string");
  flags.AddString("stop_ids", &values->stop_ids,
                  "comma-separated token ids that stop generation (besides EOS)");
  flags.AddString("logit_bias", &values->logit_bias,
                  "comma-separated ID:BIAS pairs added to those tokens' logits before each draw "
                  "(-100 bans a token, 100 forces it)");
  flags.AddBool("ignore_eos", &values->ignore_eos,
                "generate past EOS: stop at max_tokens, a stop id or a stop string only");
  flags.AddBool("add_bos", &values->add_bos, "put the tokenizer's BOS before the prompt");
  flags.SetDefaultText("add_bos", "unset: exactly when the sequence starts here");
}

absl::Status ApplySamplingFlags(const FlagSet& flags, const SamplingFlags& values,
                                sdm::v1::GenerateRequest& request) {
  sdm::v1::SamplingParams& s = *request.mutable_sampling();
  if (flags.IsSet("max_tokens")) s.set_max_tokens(values.max_tokens);
  s.set_temperature(values.temperature);
  s.set_top_k(static_cast<int32_t>(values.top_k));
  if (values.top_k != s.top_k()) {
    return absl::InvalidArgumentError(absl::StrCat("--top_k: ", values.top_k, " is too large"));
  }
  if (flags.IsSet("top_p")) s.set_top_p(values.top_p);
  uint64_t seed = 0;
  if (!absl::SimpleAtoi(values.seed, &seed)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--seed: '", values.seed, "' is not an unsigned 64-bit integer"));
  }
  s.set_seed(seed);
  for (const std::string& stop : values.stop) s.add_stop(stop);
  absl::StatusOr<std::vector<int32_t>> ids = ParseTokenIds(values.stop_ids, "--stop_ids");
  if (!ids.ok()) return ids.status();
  for (const int32_t id : *ids) s.add_stop_token_ids(id);
  if (!absl::StripAsciiWhitespace(values.logit_bias).empty()) {
    for (absl::string_view pair : absl::StrSplit(values.logit_bias, ',')) {
      const std::vector<absl::string_view> parts = absl::StrSplit(pair, ':');
      int32_t id = 0;
      float bias = 0;
      if (parts.size() != 2 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(parts[0]), &id) ||
          !absl::SimpleAtof(absl::StripAsciiWhitespace(parts[1]), &bias)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--logit_bias: '", pair, "' is not ID:BIAS (expected e.g. 65:100,66:-100)"));
      }
      (*s.mutable_logit_bias())[id] = bias;
    }
  }
  s.set_ignore_eos(values.ignore_eos);
  if (flags.IsSet("add_bos")) request.set_add_bos(values.add_bos);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> ParseTokenIds(absl::string_view text, absl::string_view what) {
  std::vector<int32_t> ids;
  if (absl::StripAsciiWhitespace(text).empty()) return ids;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &id)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": '", part, "' is not a token id (expected e.g. 1,2,3)"));
    }
    ids.push_back(id);
  }
  return ids;
}

std::string TierName(sdm::v1::Tier tier) {
  switch (tier) {
    case sdm::v1::TIER_RESIDENT:
      return "resident";
    case sdm::v1::TIER_HOST:
      return "host";
    case sdm::v1::TIER_DISK:
      return "disk";
    default:
      return "-";
  }
}

absl::string_view FinishReasonName(sdm::v1::FinishReason reason) {
  switch (reason) {
    case sdm::v1::FINISH_REASON_LENGTH:
      return "length";
    case sdm::v1::FINISH_REASON_STOP:
      return "stop";
    case sdm::v1::FINISH_REASON_EOS:
      return "eos";
    case sdm::v1::FINISH_REASON_CANCELLED:
      return "cancelled";
    default:
      return "unspecified";
  }
}

}  // namespace sdm::client
