#include "engine/model_writer.h"

#include <algorithm>
#include <fstream>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/weight_init.h"
#include "engine/weight_spec.h"

namespace sdm {

TensorDtype DefaultModelDtype(const ModelConfig& config) {
  return CountParameters(config).total < 1'000'000'000 ? TensorDtype::kF32 : TensorDtype::kBF16;
}

absl::Status WriteModelConfig(const ModelConfig& config, const std::filesystem::path& dir) {
  const std::filesystem::path path = dir / "config.json";
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << ModelConfigToJson(config);
    out.flush();
    if (!out) {
      std::error_code ignored;
      std::filesystem::remove(tmp, ignored);
      return absl::UnavailableError(absl::StrCat(tmp.string(), ": cannot write"));
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    return absl::UnavailableError(
        absl::StrCat(path.string(), ": cannot rename ", tmp.string(), " onto it"));
  }
  return absl::OkStatus();
}

absl::Status WriteRandomModel(const ModelConfig& config, const std::filesystem::path& dir,
                              const RandomModelOptions& options) {
  const std::vector<TensorSpec> specs = ExpectedTensors(config);
  std::vector<TensorDecl> decls;
  for (const TensorSpec& s : specs) decls.push_back({s.name, options.dtype, s.shape});
  std::map<std::string, std::string> metadata = options.metadata;
  metadata.emplace("format", "pt");
  metadata.emplace("seed", absl::StrCat(options.seed));
  auto writer = SafetensorsWriter::Create(dir / "model.safetensors", std::move(decls), metadata);
  if (!writer.ok()) return writer.status();

  const int64_t chunk = std::max<int64_t>(1, options.chunk_elements);
  std::vector<float> buffer;
  for (const TensorSpec& spec : specs) {
    const int64_t n = NumElements(spec);
    for (int64_t first = 0; first < n; first += chunk) {
      buffer.resize(static_cast<size_t>(std::min(chunk, n - first)));
      FillTensorParallel(config, spec, options.seed, first, buffer, options.threads);
      if (auto s = (*writer)->Append(buffer); !s.ok()) return s;
      if (options.progress) {
        options.progress((*writer)->data_bytes_written(), (*writer)->data_bytes_total());
      }
    }
  }
  if (auto s = (*writer)->Finish(); !s.ok()) return s;
  return WriteModelConfig(config, dir);
}

}  // namespace sdm
