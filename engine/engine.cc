#include "engine/engine.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/engine_backend.h"
#include "engine/weight_spec.h"
#include "kernels/cuda/cuda_runtime_info.h"
#include "xxhash.h"

namespace sdm {
namespace {

// The host format of a session's state for this model (design brief §5).
StateLayout BuildStateLayout(const ModelConfig& cfg, const ModelWeights& w,
                             const EngineOptions& options) {
  const SdmGeometry sdm = SdmGeometryOf(cfg);
  // One row pool for every SDM layer and session made by Engine::NewSession() (tools, tests; forks
  // share rows across sessions). A SessionStateStore gives the sessions it makes its own pool
  // instead, so that it counts them all. The cap (2^28 rows) is far beyond memory: budgets are
  // the state store's job.
  std::shared_ptr<RowPool> row_pool;
  if (sdm.heads > 0 &&
      std::count(cfg.layer_types.begin(), cfg.layer_types.end(), LayerType::kSdm) > 0) {
    row_pool = std::make_shared<RowPool>(sdm.head_width);
  }
  StateLayout layout;
  for (int64_t i = 0; i < cfg.n_layers; ++i) {
    LayerStateLayout state;
    if (cfg.layer_types[i] == LayerType::kSdm) {
      state.kind = LayerStateLayout::Kind::kSdm;
      state.sdm_heads = sdm.heads;
      state.slots_per_head = sdm.slots_per_head;
      state.row_width = sdm.head_width;
      if (cfg.sdm.backprop_on_memory) {
        state.m0 = w.Share(absl::StrCat("layers.", i, ".attention.memory"));
      }
      state.row_pool = row_pool;
    } else {
      const AttentionGeometry g = AttentionGeometryOf(cfg, i);
      state.kind = LayerStateLayout::Kind::kKv;
      state.kv_row_width = g.n_kv_heads * g.head_dim;
      // The ring holds the window plus one prefill chunk, so the first query of a chunk still
      // sees its whole window after the chunk's own keys were appended.
      state.ring_capacity = g.window > 0 ? g.window + options.prefill_chunk : 0;
    }
    layout.layers.push_back(std::move(state));
  }
  return layout;
}

// A hash of the config and of every tensor's name, shape and a strided sample of its values.
uint64_t ComputeFingerprint(const Model& model) {
  std::unique_ptr<XXH64_state_t, decltype(&XXH64_freeState)> state(XXH64_createState(),
                                                                   &XXH64_freeState);
  XXH64_state_t* h = state.get();
  XXH64_reset(h, 0x5d3f);
  const std::string config = ModelConfigToJson(model.config);
  XXH64_update(h, config.data(), config.size());
  for (const TensorSpec& t : ExpectedTensors(model.config)) {
    XXH64_update(h, t.name.data(), t.name.size());
    XXH64_update(h, t.shape.data(), t.shape.size() * sizeof(int64_t));
    std::span<const float> v = model.weights->Get(t.name);
    const size_t stride = std::max<size_t>(1, v.size() / 256);
    for (size_t i = 0; i < v.size(); i += stride) XXH64_update(h, &v[i], sizeof(float));
    if (!v.empty()) XXH64_update(h, &v.back(), sizeof(float));
  }
  return XXH64_digest(h);
}

}  // namespace

kernels::AddressAct ToAddressAct(AddressActivation a) {
  switch (a) {
    case AddressActivation::kSoftmax:
      return kernels::AddressAct::kSoftmax;
    case AddressActivation::kL2Normalize:
      return kernels::AddressAct::kL2Normalize;
    case AddressActivation::kIdentity:
      return kernels::AddressAct::kIdentity;
    case AddressActivation::kSigmoid:
      return kernels::AddressAct::kSigmoid;
    case AddressActivation::kRelu:
      return kernels::AddressAct::kRelu;
  }
  return kernels::AddressAct::kSoftmax;
}

const char* EngineDeviceName(EngineDevice device) {
  switch (device) {
    case EngineDevice::kAuto:
      return "auto";
    case EngineDevice::kCpu:
      return "cpu";
    case EngineDevice::kCuda:
      return "cuda";
  }
  return "?";
}

absl::StatusOr<EngineDevice> ParseEngineDevice(std::string_view name) {
  for (EngineDevice d : {EngineDevice::kAuto, EngineDevice::kCpu, EngineDevice::kCuda}) {
    if (name == EngineDeviceName(d)) return d;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown device '",
                                                 absl::string_view(name.data(), name.size()),
                                                 "': expected auto, cpu or cuda"));
}

class Engine::Impl {
 public:
  Impl(std::shared_ptr<const Model> model, const EngineOptions& options)
      : model_(std::move(model)),
        options_(options),
        layout_(BuildStateLayout(model_->config, *model_->weights, options)),
        fingerprint_(ComputeFingerprint(*model_)) {}

  absl::Status Init() {
    const EngineDevice asked = options_.device;
    EngineDevice device = asked;
    if (device == EngineDevice::kAuto) {
      device = kernels::cuda::DeviceCount() > 0 ? EngineDevice::kCuda : EngineDevice::kCpu;
    }
    options_.device = device;
    const EngineContext context{model_, options_, &layout_};
    absl::StatusOr<std::unique_ptr<EngineBackend>> backend =
        device == EngineDevice::kCuda ? CreateCudaBackend(context) : CreateCpuBackend(context);
    if (!backend.ok() && device == EngineDevice::kCuda && asked == EngineDevice::kAuto) {
      // auto means "the GPU if it works": say why not, and run on the CPU.
      std::fprintf(stderr, "sdm engine: CUDA backend unavailable (%s); using the CPU\n",
                   std::string(backend.status().message()).c_str());
      options_.device = EngineDevice::kCpu;
      const EngineContext cpu_context{model_, options_, &layout_};
      backend = CreateCpuBackend(cpu_context);
    }
    if (!backend.ok()) return backend.status();
    backend_ = *std::move(backend);
    return absl::OkStatus();
  }

  const Model& model() const { return *model_; }
  const ModelConfig& config() const { return model_->config; }
  const EngineOptions& options() const { return options_; }
  const StateLayout& layout() const { return layout_; }
  uint64_t fingerprint() const { return fingerprint_; }
  EngineBackend& backend() const { return *backend_; }

  absl::Status Prefill(SessionState& session, std::span<const int32_t> tokens, bool all_positions,
                       std::vector<float>* logits) {
    if (tokens.empty()) return absl::InvalidArgumentError("prefill needs at least one token");
    if (auto s = CheckTokens(tokens); !s.ok()) return s;
    if (auto s = CheckSession(session); !s.ok()) return s;
    return backend_->Prefill(session, tokens, all_positions, logits);
  }

  absl::Status Decode(std::span<SessionState* const> sessions, std::span<const int32_t> tokens,
                      std::span<float> logits) {
    const int64_t b = static_cast<int64_t>(sessions.size());
    if (static_cast<int64_t>(tokens.size()) != b) {
      return absl::InvalidArgumentError(
          absl::StrCat("decode got ", b, " sessions but ", tokens.size(), " tokens"));
    }
    if (static_cast<int64_t>(logits.size()) != b * config().vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("decode logits buffer holds ", logits.size(),
                                                     " floats, needs ", b * config().vocab_size));
    }
    if (b == 0) return absl::OkStatus();
    if (auto s = CheckTokens(tokens); !s.ok()) return s;
    std::set<const SessionState*> seen;
    for (SessionState* s : sessions) {
      if (s == nullptr) return absl::InvalidArgumentError("decode got a null session");
      if (!seen.insert(s).second) {
        return absl::InvalidArgumentError("a session appears twice in one decode batch");
      }
      if (auto st = CheckSession(*s); !st.ok()) return st;
    }
    return backend_->Decode(sessions, tokens, logits);
  }

 private:
  absl::Status CheckTokens(std::span<const int32_t> tokens) const {
    for (int32_t t : tokens) {
      if (t < 0 || t >= config().vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "token id ", t, " is outside the vocabulary [0, ", config().vocab_size, ")"));
      }
    }
    return absl::OkStatus();
  }

  absl::Status CheckSession(const SessionState& s) const {
    if (s.num_layers() != config().n_layers) {
      return absl::InvalidArgumentError("session state was made for a different model");
    }
    return absl::OkStatus();
  }

  std::shared_ptr<const Model> model_;
  EngineOptions options_;
  StateLayout layout_;
  uint64_t fingerprint_;
  std::unique_ptr<EngineBackend> backend_;
};

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(std::shared_ptr<const Model> model,
                                                       const EngineOptions& options) {
  if (model == nullptr || model->weights == nullptr) {
    return absl::InvalidArgumentError("engine needs a loaded model");
  }
  if (options.prefill_chunk < 1) {
    return absl::InvalidArgumentError("prefill_chunk must be at least 1");
  }
  auto impl = std::make_unique<Impl>(std::move(model), options);
  if (auto s = impl->Init(); !s.ok()) return s;
  return std::make_unique<Engine>(std::move(impl));
}

#if !defined(SDM_HAVE_CUDA)
absl::StatusOr<std::unique_ptr<EngineBackend>> CreateCudaBackend(const EngineContext&) {
  return absl::UnavailableError(
      "this build has no CUDA backend (nvcc was not found at configure time, or -DSDM_CUDA=OFF)");
}
#endif

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

const ModelConfig& Engine::config() const { return impl_->config(); }
const EngineOptions& Engine::options() const { return impl_->options(); }
const Model& Engine::model() const { return impl_->model(); }
int64_t Engine::vocab_size() const { return impl_->config().vocab_size; }
const StateLayout& Engine::state_layout() const { return impl_->layout(); }
const EngineProfile& Engine::profile() const { return impl_->backend().profile(); }
uint64_t Engine::fingerprint() const { return impl_->fingerprint(); }
void Engine::ResetProfile() { impl_->backend().ResetProfile(); }
EngineDevice Engine::device() const { return impl_->backend().device(); }
std::string Engine::DescribeDevice() const { return impl_->backend().Describe(); }
int64_t Engine::device_state_capacity_bytes() const {
  return impl_->backend().StateCapacityBytes();
}

std::unique_ptr<SessionState> Engine::NewSession() const {
  return std::make_unique<SessionState>(impl_->layout());
}

absl::Status Engine::Prefill(SessionState& session, std::span<const int32_t> tokens,
                             bool all_positions, std::vector<float>* logits) {
  return impl_->Prefill(session, tokens, all_positions, logits);
}

absl::Status Engine::Decode(std::span<SessionState* const> sessions,
                            std::span<const int32_t> tokens, std::span<float> logits) {
  return impl_->Decode(sessions, tokens, logits);
}

}  // namespace sdm
