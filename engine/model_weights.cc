#include "engine/model_weights.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/available_cpus.h"
#include "base/check.h"
#include "engine/safetensors.h"
#include "engine/weight_file_check.h"
#include "engine/weight_init.h"
#include "engine/weight_spec.h"

namespace sdm {

// Owns everything the tensor spans point into: the file mapping (fp32 tensors served in place)
// and fp32 buffers (converted bf16 tensors, misaligned fp32 ones, random or explicit arrays).
class ModelWeights::Storage {
 public:
  std::unique_ptr<SafetensorsFile> file;
  std::vector<std::vector<float>> buffers;
};

namespace {

// Converts a tensor's raw little-endian bytes to fp32, in parallel for large tensors.
void ToFloat(TensorDtype dtype, std::span<const uint8_t> bytes, std::span<float> out) {
  auto convert = [&](size_t begin, size_t end) {
    if (dtype == TensorDtype::kF32) {
      std::memcpy(out.data() + begin, bytes.data() + 4 * begin, 4 * (end - begin));
      return;
    }
    for (size_t i = begin; i < end; ++i) {
      uint16_t b;
      std::memcpy(&b, bytes.data() + 2 * i, 2);
      out[i] = Bf16ToFloat(b);
    }
  };
  constexpr size_t kMinPerThread = size_t{1} << 20;
  const size_t parts =
      std::clamp<size_t>(out.size() / kMinPerThread, 1, static_cast<size_t>(AvailableCpus()));
  const size_t per = (out.size() + parts - 1) / parts;
  std::vector<std::thread> workers;
  for (size_t p = 1; p < parts; ++p) {
    workers.emplace_back(convert, std::min(out.size(), p * per),
                         std::min(out.size(), (p + 1) * per));
  }
  convert(0, std::min(out.size(), per));
  for (std::thread& t : workers) t.join();
}

}  // namespace

ModelWeights::ModelWeights() = default;
ModelWeights::~ModelWeights() = default;

absl::StatusOr<std::shared_ptr<const ModelWeights>> ModelWeights::Load(
    const ModelConfig& config, const std::filesystem::path& file) {
  auto opened = SafetensorsFile::Open(file);
  if (!opened.ok()) return opened.status();
  const std::vector<TensorSpec> expected = ExpectedTensors(config);
  if (auto s = CheckTensorsMatchSpec(file.string(), (*opened)->index(), expected); !s.ok()) {
    return s;
  }
  // The constructor is private, so make_shared cannot reach it; the pointer is owned at once.
  std::shared_ptr<ModelWeights> weights(new ModelWeights());
  weights->storage_ = std::make_shared<Storage>();
  Storage& storage = *weights->storage_;
  storage.file = *std::move(opened);
  for (const TensorSpec& spec : expected) {
    const TensorView view = storage.file->Find(spec.name);
    SDM_CHECK(view.entry != nullptr);
    const size_t n = static_cast<size_t>(view.entry->num_elements);
    if (view.entry->dtype == TensorDtype::kF32 &&
        reinterpret_cast<uintptr_t>(view.bytes.data()) % alignof(float) == 0) {
      weights->tensors_[spec.name] = {reinterpret_cast<const float*>(view.bytes.data()), n};
      continue;
    }
    std::vector<float>& buffer = storage.buffers.emplace_back(n);
    ToFloat(view.entry->dtype, view.bytes, buffer);
    weights->tensors_[spec.name] = {buffer.data(), n};
  }
  return std::shared_ptr<const ModelWeights>(std::move(weights));
}

std::shared_ptr<const ModelWeights> ModelWeights::Random(const ModelConfig& config, uint64_t seed) {
  std::shared_ptr<ModelWeights> weights(new ModelWeights());
  weights->storage_ = std::make_shared<Storage>();
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    std::vector<float>& buffer =
        weights->storage_->buffers.emplace_back(static_cast<size_t>(NumElements(spec)));
    FillTensorParallel(config, spec, seed, 0, buffer);
    weights->tensors_[spec.name] = {buffer.data(), buffer.size()};
  }
  return weights;
}

absl::StatusOr<std::shared_ptr<const ModelWeights>> ModelWeights::FromArrays(
    const ModelConfig& config, std::map<std::string, std::vector<float>> arrays) {
  const std::vector<TensorSpec> expected = ExpectedTensors(config);
  for (const TensorSpec& spec : expected) {
    auto it = arrays.find(spec.name);
    if (it == arrays.end()) {
      return absl::InvalidArgumentError(absl::StrCat("missing tensor '", spec.name, "'"));
    }
    if (static_cast<int64_t>(it->second.size()) != NumElements(spec)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", spec.name, "' has ",
                                                     it->second.size(), " values, expected ",
                                                     NumElements(spec)));
    }
  }
  if (arrays.size() != expected.size()) {
    for (const auto& entry : arrays) {
      const std::string& name = entry.first;  // clang 14 cannot capture a structured binding
      const bool known = std::any_of(expected.begin(), expected.end(),
                                     [&](const TensorSpec& s) { return s.name == name; });
      if (!known) {
        return absl::InvalidArgumentError(
            absl::StrCat("unexpected tensor '", name, "' (not part of a model with this config)"));
      }
    }
  }
  std::shared_ptr<ModelWeights> weights(new ModelWeights());
  weights->storage_ = std::make_shared<Storage>();
  for (auto& [name, values] : arrays) {
    std::vector<float>& buffer = weights->storage_->buffers.emplace_back(std::move(values));
    weights->tensors_[name] = {buffer.data(), buffer.size()};
  }
  return std::shared_ptr<const ModelWeights>(std::move(weights));
}

std::span<const float> ModelWeights::Get(absl::string_view name) const {
  auto it = tensors_.find(name);
  SDM_CHECK(it != tensors_.end()) << "ModelWeights::Get: no tensor '" << name << "'";
  return it->second;
}

bool ModelWeights::Has(absl::string_view name) const {
  return tensors_.find(name) != tensors_.end();
}

std::shared_ptr<const float> ModelWeights::Share(absl::string_view name) const {
  return std::shared_ptr<const float>(storage_, Get(name).data());
}

}  // namespace sdm
