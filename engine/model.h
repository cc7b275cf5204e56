// A loaded model: config, weights and the directory it came from.
//
// A model directory holds config.json (engine/model_config.h), model.safetensors
// (engine/model_weights.h) and, for SentencePiece models, the tokenizer file named in the config.
// docs/model-format.md describes the format.
#ifndef SDMSERVE_ENGINE_MODEL_H_
#define SDMSERVE_ENGINE_MODEL_H_

#include <filesystem>
#include <memory>

#include "absl/status/statusor.h"
#include "engine/model_config.h"
#include "engine/model_weights.h"

namespace sdm {

struct Model {
  ModelConfig config;
  std::shared_ptr<const ModelWeights> weights;
  std::filesystem::path dir;  // empty for in-memory models
};

// Reads config.json and maps model.safetensors from `dir`; every error names the file.
absl::StatusOr<std::shared_ptr<const Model>> LoadModel(const std::filesystem::path& dir);

// An in-memory model with random weights (benchmarks, tests).
std::shared_ptr<const Model> RandomModel(const ModelConfig& config, uint64_t seed);

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_MODEL_H_
