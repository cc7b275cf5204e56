// The weights of one model, as fp32 arrays addressed by the reference's tensor names
// (engine/weight_spec.h). Immutable once built and shared by every session and thread.
//
// Load() maps `model.safetensors` read-only and checks it against the config's expected tensors
// before anything is used: a malformed file (truncated, absurd header length, bad JSON, unknown
// dtype, wrong shape, overlapping or out-of-range offsets, missing or unexpected tensor) is an
// InvalidArgument/DataLoss error naming the file and the tensor, never a crash. fp32 tensors are
// served straight from the mapping; bf16 tensors are widened to fp32 once, at load.
#ifndef SDMSERVE_ENGINE_MODEL_WEIGHTS_H_
#define SDMSERVE_ENGINE_MODEL_WEIGHTS_H_

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/model_config.h"

namespace sdm {

class ModelWeights {
 public:
  // Maps and validates `file` (a safetensors file) against ExpectedTensors(config).
  static absl::StatusOr<std::shared_ptr<const ModelWeights>> Load(
      const ModelConfig& config, const std::filesystem::path& file);

  // Randomly initialised weights following the reference's init (engine/weight_init.h), built
  // in memory: the same values `sdm-model init` writes for the same config and seed.
  static std::shared_ptr<const ModelWeights> Random(const ModelConfig& config, uint64_t seed);

  // Weights from explicit arrays (tests). Fails unless they match ExpectedTensors(config).
  static absl::StatusOr<std::shared_ptr<const ModelWeights>> FromArrays(
      const ModelConfig& config, std::map<std::string, std::vector<float>> arrays);

  ~ModelWeights();
  ModelWeights(const ModelWeights&) = delete;
  ModelWeights& operator=(const ModelWeights&) = delete;

  // The fp32 values of a tensor the config requires (CHECK-fails for a name it does not).
  std::span<const float> Get(absl::string_view name) const;
  bool Has(absl::string_view name) const;

  // The same storage as Get(name), kept alive by the returned pointer (the SDM memory M0 is
  // shared with every session's state this way).
  std::shared_ptr<const float> Share(absl::string_view name) const;

  class Storage;  // owns mappings and converted buffers

 private:
  ModelWeights();
  std::shared_ptr<Storage> storage_;
  std::map<std::string, std::span<const float>, std::less<>> tensors_;
};

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_MODEL_WEIGHTS_H_
