// Writes a model directory (config.json + model.safetensors, docs/model-format.md) with randomly
// initialised weights: the work of `sdm-model init`, here so tests exercise the same code.
// Weights are generated and written chunk by chunk (engine/weight_init.h streams any range), so
// memory stays bounded by the chunk size whatever the model size; the values are exactly
// ModelWeights::Random(config, seed)'s (rounded to bf16 for a BF16 file).
#ifndef SDMSERVE_ENGINE_MODEL_WRITER_H_
#define SDMSERVE_ENGINE_MODEL_WRITER_H_

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "engine/model_config.h"
#include "engine/safetensors.h"

namespace sdm {

struct RandomModelOptions {
  uint64_t seed = 0;
  TensorDtype dtype = TensorDtype::kF32;
  int64_t chunk_elements = int64_t{1} << 22;  // values generated per step
  int threads = 0;                            // 0: all hardware threads
  // Called after every chunk with the data bytes written so far and in total.
  std::function<void(int64_t written, int64_t total)> progress;
  // Extra "__metadata__" entries of the safetensors header.
  std::map<std::string, std::string> metadata;
};

// fp32 below 1e9 parameters, bf16 from there on (what `sdm-model init` writes by default).
TensorDtype DefaultModelDtype(const ModelConfig& config);

// Writes `dir`/model.safetensors, then `dir`/config.json (each to a temporary name, then
// renamed), into an existing directory. Overwrites existing files of those names.
absl::Status WriteRandomModel(const ModelConfig& config, const std::filesystem::path& dir,
                              const RandomModelOptions& options);

// Writes `dir`/config.json (ModelConfigToJson) through a temporary file and a rename.
absl::Status WriteModelConfig(const ModelConfig& config, const std::filesystem::path& dir);

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_MODEL_WRITER_H_
