// sdm-cli: runs a model on the CPU engine from the command line.
//
//   sdm-cli generate --model DIR --prompt TEXT [sampling flags] [--json]
//       Streams a completion of BOS + the prompt's tokens to stdout. It ends at EOS, a stop id or
//       stop string, or max_tokens, by the rules the server applies (engine/generation.h).
//   sdm-cli logits --model DIR --tokens 1,2,3 [--all]
//       Prints the logits of exactly those tokens as one JSON object, for comparisons with other
//       implementations (the reference tests read it): {"tokens": [...], "logits": [[...], ...]},
//       one row per position with --all, else the last position's; floats as %.9g, which
//       round-trips float32 (non-finite values as NaN / Infinity / -Infinity, as Python's json
//       reads them).
//   sdm-cli SUBCOMMAND --help documents every flag.
//
// Exit status: 0 on success; 2 on usage errors (unknown subcommand or flag, missing or bad flag
// values, token ids outside the model's vocabulary), with a hint to --help; 1 on runtime failures
// (a model that cannot be loaded, an engine error), with the error's message.
//
// Flags are Abseil flags, dispatched by subcommand by common/command_line.h (each subcommand
// accepts only its own flags; a bad flag exits with status 2).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/command_line.h"
#include "engine/engine.h"
#include "engine/generation.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"
#include "nlohmann/json.hpp"
#include "state_store/session_state.h"

ABSL_FLAG(std::string, model, "",
          "Model directory (config.json, model.safetensors, tokenizer file). Required.");
ABSL_FLAG(int, threads, 0, "Engine threads; 0 = one per hardware thread.");
ABSL_FLAG(std::string, device, "auto",
          "Where the engine runs: auto (CUDA when a device is present, else the CPU), cpu or "
          "cuda.");
// generate
ABSL_FLAG(std::string, prompt, "", "Prompt text; the completion continues BOS + its tokens.");
ABSL_FLAG(bool, no_bos, false, "Do not put BOS before the prompt's tokens.");
ABSL_FLAG(int64_t, max_tokens, 64,
          "Generate at most this many tokens (EOS and stop ids included). >= 1.");
ABSL_FLAG(double, temperature, 0.0, "Sampling temperature; 0 = greedy (argmax). >= 0.");
ABSL_FLAG(int, top_k, 0, "Sample among the k most probable tokens only; 0 = no limit.");
ABSL_FLAG(double, top_p, 1.0,
          "Sample from the smallest set of most probable tokens whose probability reaches top_p "
          "(after top_k); in (0, 1], 1 = no limit.");
ABSL_FLAG(uint64_t, seed, 0,
          "Sampling seed: the same seed, prompt and flags give the same completion.");
ABSL_FLAG(std::string, stop_ids, "",
          "Comma-separated token ids that end the completion (besides the tokenizer's EOS); "
          "the stop token's text is not printed.");
ABSL_FLAG(sdm::cli::RepeatedFlag, stop, {},
          "A string that ends the completion when its text contains it; the text stops right "
          "before it. Repeatable (--stop A --stop B); each value is taken verbatim, commas "
          "included. Must not be empty.");
ABSL_FLAG(bool, ignore_eos, false,
          "Generate past EOS: stop at --max_tokens, a stop id or a stop string only.");
ABSL_FLAG(bool, json, false,
          "Instead of streaming text, print one JSON object at the end: prompt_tokens, tokens "
          "(generated ids), text, finish_reason.");
// logits
ABSL_FLAG(std::string, tokens, "",
          "Comma-separated token ids to feed, exactly (no BOS is added). Required, non-empty.");
ABSL_FLAG(bool, all, false, "Print the logits of every position, not only the last.");

namespace sdm {
namespace {

using cli::kExitFailure;
using cli::kExitOk;

int UsageError(absl::string_view subcommand, absl::string_view message) {
  return cli::UsageError("sdm-cli", subcommand, message);
}

int Failure(const absl::Status& status) {
  absl::FPrintF(stderr, "sdm-cli: %s\n", status.ToString());
  return kExitFailure;
}

// "1,2,3" -> ids. Empty text gives no ids.
absl::StatusOr<std::vector<int32_t>> ParseIds(absl::string_view text, absl::string_view flag) {
  std::vector<int32_t> ids;
  if (text.empty()) return ids;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(part, &id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": '", part, "' is not a token id (an integer)"));
    }
    ids.push_back(id);
  }
  return ids;
}

struct LoadedEngine {
  std::shared_ptr<const Model> model;
  std::unique_ptr<Engine> engine;
};

absl::StatusOr<LoadedEngine> LoadEngine() {
  absl::StatusOr<std::shared_ptr<const Model>> model = LoadModel(absl::GetFlag(FLAGS_model));
  if (!model.ok()) return model.status();
  EngineOptions options;
  options.num_threads = absl::GetFlag(FLAGS_threads);
  absl::StatusOr<EngineDevice> device = ParseEngineDevice(absl::GetFlag(FLAGS_device));
  if (!device.ok()) return device.status();
  options.device = *device;
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*model, options);
  if (!engine.ok()) return engine.status();
  return LoadedEngine{*std::move(model), *std::move(engine)};
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// ---- generate -------------------------------------------------------------------------------

int RunGenerate() {
  constexpr absl::string_view kSub = "generate";
  if (absl::GetFlag(FLAGS_model).empty()) return UsageError(kSub, "--model is required");
  if (absl::GetFlag(FLAGS_threads) < 0) return UsageError(kSub, "--threads must be >= 0");
  const bool add_bos = !absl::GetFlag(FLAGS_no_bos);
  const std::string prompt = absl::GetFlag(FLAGS_prompt);
  if (prompt.empty() && !add_bos) {
    return UsageError(kSub, "--prompt is empty and --no_bos is set: there is nothing to feed");
  }
  SamplingParams params;
  params.temperature = absl::GetFlag(FLAGS_temperature);
  params.top_k = absl::GetFlag(FLAGS_top_k);
  params.top_p = absl::GetFlag(FLAGS_top_p);
  params.seed = absl::GetFlag(FLAGS_seed);
  params.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  absl::StatusOr<std::vector<int32_t>> stop_ids =
      ParseIds(absl::GetFlag(FLAGS_stop_ids), "stop_ids");
  if (!stop_ids.ok()) return UsageError(kSub, stop_ids.status().message());
  params.stop_token_ids = *std::move(stop_ids);
  params.ignore_eos = absl::GetFlag(FLAGS_ignore_eos);
  const std::vector<std::string> stop_strings = absl::GetFlag(FLAGS_stop).values;
  if (std::find(stop_strings.begin(), stop_strings.end(), "") != stop_strings.end()) {
    return UsageError(kSub, "--stop: a stop string must not be empty");
  }
  // Everything but the stop ids' range can be checked before the (slow) model load.
  if (absl::Status s = ValidateSamplingParams(params, std::numeric_limits<int32_t>::max());
      !s.ok()) {
    return UsageError(kSub, s.message());
  }

  absl::StatusOr<LoadedEngine> loaded = LoadEngine();
  if (!loaded.ok()) return Failure(loaded.status());
  Engine& engine = *loaded->engine;
  if (absl::Status s = ValidateSamplingParams(params, engine.vocab_size()); !s.ok()) {
    return UsageError(kSub, s.message());
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
      Tokenizer::Create(loaded->model->config, loaded->model->dir);
  if (!tokenizer.ok()) return Failure(tokenizer.status());
  const std::vector<int32_t> prompt_ids = (*tokenizer)->Encode(prompt, add_bos);
  if (prompt_ids.empty()) {
    return UsageError(kSub, "the prompt has no tokens (and the tokenizer has no BOS)");
  }

  const bool json = absl::GetFlag(FLAGS_json);
  std::unique_ptr<SessionState> session = engine.NewSession();
  std::vector<float> logits;
  const auto prefill_start = std::chrono::steady_clock::now();
  if (absl::Status s = engine.Prefill(*session, prompt_ids, /*all_positions=*/false, &logits);
      !s.ok()) {
    return Failure(s);
  }
  const double prefill_seconds = SecondsSince(prefill_start);

  GenerationPolicy policy(**tokenizer, stop_strings, params);
  std::string text;  // what was printed (or, with --json, would have been)
  std::vector<int32_t> generated;
  FinishReason finish_reason = FinishReason::kLength;  // set by the policy when the loop ends
  int64_t decode_steps = 0;
  const auto decode_start = std::chrono::steady_clock::now();
  while (true) {
    const int32_t token = SampleToken(logits, params, session->sampler_draws);
    ++session->sampler_draws;
    generated.push_back(token);
    const GenerationPolicy::TokenOutput out = policy.Accept(token);
    text += out.text;
    if (!json && !out.text.empty()) {
      std::fwrite(out.text.data(), 1, out.text.size(), stdout);
      std::fflush(stdout);
    }
    if (out.finish.has_value()) {
      finish_reason = *out.finish;
      break;
    }
    SessionState* sessions[] = {session.get()};
    if (absl::Status s = engine.Decode(sessions, std::span<const int32_t>(&token, 1), logits);
        !s.ok()) {
      return Failure(s);
    }
    ++decode_steps;
  }
  const double decode_seconds = SecondsSince(decode_start);

  if (json) {
    nlohmann::json out;
    out["prompt_tokens"] = prompt_ids;
    out["tokens"] = generated;
    out["text"] = text;
    out["finish_reason"] = FinishReasonName(finish_reason);
    // `text` is valid UTF-8 by construction; replace rather than throw regardless.
    std::printf("%s\n", out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else if (isatty(fileno(stdout))) {
    std::printf("\n");  // keep the shell prompt off the last line; pipes get the text verbatim
  }
  std::fflush(stdout);
  absl::FPrintF(stderr,
                "prompt_tokens=%d generated_tokens=%d prefill_s=%.4f decode_tokens_per_s=%.1f "
                "finish_reason=%s\n",
                prompt_ids.size(), generated.size(), prefill_seconds,
                decode_steps > 0 ? decode_steps / decode_seconds : 0.0,
                FinishReasonName(finish_reason));
  return kExitOk;
}

// ---- logits ---------------------------------------------------------------------------------

void AppendJsonFloat(float v, std::string& out) {
  if (std::isnan(v)) {
    out += "NaN";
  } else if (std::isinf(v)) {
    out += v > 0 ? "Infinity" : "-Infinity";
  } else {
    absl::StrAppendFormat(&out, "%.9g", v);
  }
}

int RunLogits() {
  constexpr absl::string_view kSub = "logits";
  if (absl::GetFlag(FLAGS_model).empty()) return UsageError(kSub, "--model is required");
  if (absl::GetFlag(FLAGS_threads) < 0) return UsageError(kSub, "--threads must be >= 0");
  absl::StatusOr<std::vector<int32_t>> tokens = ParseIds(absl::GetFlag(FLAGS_tokens), "tokens");
  if (!tokens.ok()) return UsageError(kSub, tokens.status().message());
  if (tokens->empty()) return UsageError(kSub, "--tokens is required (at least one token id)");

  absl::StatusOr<LoadedEngine> loaded = LoadEngine();
  if (!loaded.ok()) return Failure(loaded.status());
  Engine& engine = *loaded->engine;
  const int64_t vocab = engine.vocab_size();
  for (const int32_t id : *tokens) {
    if (id < 0 || id >= vocab) {
      return UsageError(kSub, absl::StrCat("--tokens: id ", id,
                                           " is outside the model's vocabulary [0, ", vocab, ")"));
    }
  }
  const bool all = absl::GetFlag(FLAGS_all);
  std::unique_ptr<SessionState> session = engine.NewSession();
  std::vector<float> logits;
  if (absl::Status s = engine.Prefill(*session, *tokens, all, &logits); !s.ok()) return Failure(s);
  const size_t rows = all ? tokens->size() : 1;
  if (logits.size() != rows * static_cast<size_t>(vocab)) {
    return Failure(absl::InternalError(absl::StrCat("the engine returned ", logits.size(),
                                                    " logits, expected ", rows, " x ", vocab)));
  }

  std::string out =
      absl::StrCat("{\"tokens\": [", absl::StrJoin(*tokens, ", "), "], \"logits\": [");
  for (size_t r = 0; r < rows; ++r) {
    out += r == 0 ? "\n[" : ",\n[";
    for (int64_t v = 0; v < vocab; ++v) {
      if (v > 0) out += ", ";
      AppendJsonFloat(logits[r * vocab + v], out);
    }
    out += "]";
  }
  out += "]}\n";
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fflush(stdout);
  return kExitOk;
}

int Main(int argc, char** argv) {
  cli::Program program;
  program.name = "sdm-cli";
  program.subcommands = {
      {"generate",
       "sdm-cli generate --model DIR --prompt TEXT [--max_tokens N] [--temperature T] [flags]",
       "Completes BOS + the prompt's tokens with the model, streaming the text to stdout; a "
       "summary line (prompt_tokens, generated_tokens, prefill_s, decode_tokens_per_s, "
       "finish_reason = eos|stop|length) goes to stderr.",
       {"model", "prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop",
        "stop_ids", "ignore_eos", "no_bos", "json", "threads", "device"},
       /*max_positional=*/0,
       [](const cli::ParsedArgs&) { return RunGenerate(); }},
      {"logits",
       "sdm-cli logits --model DIR --tokens ID,... [--all] [--threads N] [--device D]",
       "Feeds exactly the given token ids and prints one JSON object: {\"tokens\": [...], "
       "\"logits\": [[...], ...]}, one row of vocab_size floats (%.9g) for the last position, "
       "or for every position with --all.",
       {"model", "tokens", "all", "threads", "device"},
       /*max_positional=*/0,
       [](const cli::ParsedArgs&) { return RunLogits(); }},
  };
  return cli::RunProgram(program, argc, argv);
}

}  // namespace
}  // namespace sdm

int main(int argc, char** argv) { return sdm::Main(argc, argv); }
