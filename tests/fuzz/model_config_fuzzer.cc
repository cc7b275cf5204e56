// libFuzzer target for config.json (engine/model_config.h) and what loading a model computes from
// it before any weight is read: any text must give an error or a finalized config, never a crash,
// undefined behaviour (an overflowing size computation above all) or a huge allocation (built
// with ASan and UBSan; see scripts/fuzz.sh).
//
// Input: one mode byte, then the text. Mode bit 0 clear: the text is config.json. Mode bit 0 set:
// the text is one `key=value` override (sdm-model's --set) applied to the "tiny" preset.
//
// Properties of every config that parses: ModelConfigToJson gives text that parses to the same
// JSON again (a round trip), and the derived sizes the loader and server compute (the tensors a
// weight file must hold, parameter counts, attention and SDM geometry, state sizes) are computed
// without overflow. Parsing allocates at most a constant (the layer lists of up to 100,000
// layers) plus a small multiple of the input.
//
// `model_config_fuzzer --write-seeds=DIR` writes a seed corpus of valid configs to DIR and exits.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

#include "absl/status/status.h"
#include "engine/model_config.h"
#include "engine/weight_spec.h"
#include "nlohmann/json.hpp"
#include "tests/fuzz/fuzz_util.h"

namespace {

using namespace sdm::fuzz;  // NOLINT: the fuzzers' shared helpers

// What the loader and the server compute from a finalized config (engine/model_weights.cc,
// engine/engine.cc, server/service.cc's ModelInfo).
void CheckDerived(const sdm::ModelConfig& c) {
  if (static_cast<int64_t>(c.layer_types.size()) != c.n_layers) Fail("layer_types size");
  for (int64_t l = 0; l < c.n_layers; ++l) {
    if (c.layer_types[l] == sdm::LayerType::kSdm) continue;
    const sdm::AttentionGeometry g = sdm::AttentionGeometryOf(c, l);
    if (g.n_heads <= 0 || g.n_kv_heads <= 0 || g.head_dim <= 0) Fail("bad attention geometry");
  }
  (void)sdm::SdmGeometryOf(c);
  (void)sdm::FfnHiddenDim(c);
  (void)sdm::SdmStateElements(c);
  (void)sdm::FullAttentionKvElementsPerToken(c);
  const sdm::ParameterCounts counts = sdm::CountParameters(c);
  if (counts.total < 0 || counts.without_m0 < 0 || counts.m0 < 0) Fail("negative parameter count");
  for (const sdm::TensorSpec& spec : sdm::ExpectedTensors(c)) {
    for (const int64_t d : spec.shape) {
      if (d <= 0) Fail("a tensor with a dimension <= 0");
    }
    (void)sdm::NumElements(spec);
  }
}

void CheckConfig(const sdm::ModelConfig& c) {
  CheckDerived(c);
  const std::string text = sdm::ModelConfigToJson(c);
  absl::StatusOr<sdm::ModelConfig> again = sdm::ParseModelConfig(text);
  if (!again.ok()) {
    std::fprintf(stderr, "%s\n%s\n", text.c_str(), again.status().ToString().c_str());
    Fail("a parsed config's JSON does not parse");
  }
  if (sdm::ModelConfigToJson(*again) != text) Fail("config JSON does not round-trip");
}

void CheckText(const std::string& text) {
  absl::StatusOr<sdm::ModelConfig> config;
  const size_t bytes = CountAllocations([&] { config = sdm::ParseModelConfig(text); });
  // n_layers (at most 100,000) sizes the layer lists whatever the text's length.
  if (bytes > 16 * kAllocationSlack + 64 * text.size()) {
    Fail("parsing allocated far more memory than the text's size");
  }
  if (!config.ok()) {
    if (config.status().code() != absl::StatusCode::kInvalidArgument) {
      Fail("error is not INVALID_ARGUMENT");
    }
    return;
  }
  CheckConfig(*config);
}

void CheckOverride(const std::string& assignment) {
  static const sdm::ModelConfig tiny = *sdm::PresetConfig("tiny");
  sdm::ModelConfig c = tiny;
  const absl::Status s = sdm::ApplyConfigOverride(c, assignment);
  if (!s.ok()) {
    if (sdm::ModelConfigToJson(c) != sdm::ModelConfigToJson(tiny)) {
      Fail("a refused override changed the config");
    }
    return;
  }
  CheckConfig(c);
}

void Run(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 1) {
    CheckOverride(text);
  } else {
    CheckText(text);
  }
}

int WriteSeeds(const std::filesystem::path& dir) {
  SeedWriter seeds(dir);
  for (const std::string& preset : sdm::PresetNames()) {
    absl::StatusOr<sdm::ModelConfig> c = sdm::PresetConfig(preset);
    if (!c.ok()) Fail("a preset does not load");
    const std::string text = sdm::ModelConfigToJson(*c);
    CheckText(text);  // the seeds themselves must pass
    seeds.Add('\0' + text);
  }
  for (const char* assignment :
       {"dim=64", "n_layers=3", "swa_at=[0]", "sdm_args.num_writes=4", "sdm_args.slots_per_head=16",
        "tokenizer={\"name\":\"bytes\"}", "ffn_dim_multiplier=1.5", "head_dim=16"}) {
    seeds.Add(std::string("\1") + assignment);
  }
  return seeds.Finish();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  return sdm::fuzz::InitializeFuzzer(argc, argv, WriteSeeds);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Run(data, size);
  return 0;
}
