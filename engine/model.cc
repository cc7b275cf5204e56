#include "engine/model.h"

#include <fstream>
#include <sstream>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace sdm {
namespace {

absl::StatusOr<std::string> ReadTextFile(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    return absl::NotFoundError(absl::StrCat(path.string(), ": not found"));
  }
  if (!std::filesystem::is_regular_file(path, ec)) {
    return absl::FailedPreconditionError(absl::StrCat(path.string(), ": not a regular file"));
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) return absl::UnavailableError(absl::StrCat(path.string(), ": cannot read"));
  return text.str();
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Model>> LoadModel(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat(dir.string(), ": not a model directory"));
  }
  const std::filesystem::path config_path = dir / "config.json";
  auto text = ReadTextFile(config_path);
  if (!text.ok()) return text.status();
  auto config = ParseModelConfig(*text);
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat(config_path.string(), ": ", config.status().message()));
  }
  if (config->tokenizer.name == "sp") {
    const std::filesystem::path tokenizer = dir / config->tokenizer.path;
    if (!std::filesystem::is_regular_file(tokenizer, ec)) {
      return absl::NotFoundError(absl::StrCat(tokenizer.string(), ": SentencePiece model named by ",
                                              config_path.string(), " (tokenizer.path) not found"));
    }
  }
  auto weights = ModelWeights::Load(*config, dir / "model.safetensors");
  if (!weights.ok()) return weights.status();
  auto model = std::make_shared<Model>();
  model->config = *std::move(config);
  model->weights = *std::move(weights);
  model->dir = dir;
  return std::shared_ptr<const Model>(std::move(model));
}

std::shared_ptr<const Model> RandomModel(const ModelConfig& config, uint64_t seed) {
  auto model = std::make_shared<Model>();
  model->config = config;
  model->weights = ModelWeights::Random(config, seed);
  return model;
}

}  // namespace sdm
