#include "engine/engine.h"

#include <algorithm>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/thread_priority.h"
#include "engine/engine_backend.h"
#include "engine/weight_spec.h"
#include "kernels/cpu/sdm_update.h"
#include "kernels/cuda/cuda_runtime_info.h"
#include "xxhash.h"

namespace sdm {
namespace {

// The host format of a session's state for this model (docs/model-spec.md §7).
// `kv_element`: how the caches store their rows (the CPU backend's cpu_dtype; fp32 for CUDA,
// which keeps its own bf16 copy on the device).
StateLayout BuildStateLayout(const ModelConfig& cfg, const ModelWeights& w,
                             const EngineOptions& options, DType kv_element) {
  const SdmGeometry sdm = SdmGeometryOf(cfg);
  const WeightSpec spec = BuildWeightSpec(cfg);
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
      if (const TensorSpec* m0 = spec.Find(spec.roles.layers[i].sdm.m0); m0 != nullptr) {
        state.m0 = w.Share(m0->name);
      }
      state.row_pool = row_pool;
      // Deltas may carry the writes instead of the rows; replaying one runs the CPU engine's
      // own write (state_store/state_layout.h, SdmWriteSpec). A write has as many slots as the
      // backends select (fewer than num_writes when that exceeds the head's slots).
      state.sdm_write.apply = &kernels::cpu::SdmWriteRows;
      state.sdm_write.writes = sdm.writes;
      state.sdm_write.alphas = cfg.sdm.key_weighted_decay ? sdm.writes : 1;
      state.sdm_write.rule = static_cast<uint32_t>(cfg.sdm.update_rule == UpdateRule::kSlotResidual
                                                       ? kernels::cpu::SdmRule::kSlotResidual
                                                       : kernels::cpu::SdmRule::kSharedResidual);
    } else {
      const AttentionGeometry g = AttentionGeometryOf(cfg, i);
      state.kind = LayerStateLayout::Kind::kKv;
      state.kv_row_width = g.n_kv_heads * g.head_dim;
      // The ring holds the window plus one prefill chunk, so the first query of a chunk still
      // sees its whole window after the chunk's own keys were appended.
      state.ring_capacity = g.window > 0 ? g.window + options.prefill_chunk : 0;
      state.kv_element = kv_element;
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

// Why `s` does not have the shape `layout` gives a session, or "" when it has: the layer kinds;
// per KV cache its row width, ring capacity and element type; per SDM table its heads, slots and
// row width and how its writes are journaled. Its row pool and whether it journals may differ (a
// state store gives the sessions it makes its own pool, and turns journaling on). Sessions do not
// keep their layout, so the comparison is field by field: a few per layer, cheap next to a step.
std::string LayoutMismatch(const SessionState& s, const StateLayout& layout) {
  if (s.num_layers() != static_cast<int64_t>(layout.layers.size())) {
    return absl::StrCat("it has ", s.num_layers(), " layers, this engine's model ",
                        layout.layers.size());
  }
  for (int64_t l = 0; l < s.num_layers(); ++l) {
    const LayerStateLayout& want = layout.layers[l];
    if (s.is_sdm(l) != (want.kind == LayerStateLayout::Kind::kSdm)) {
      return absl::StrCat("its layer ", l, " is of another kind");
    }
    if (s.is_sdm(l)) {
      const SdmTable& t = s.sdm(l);
      if (t.heads() != want.sdm_heads || t.slots_per_head() != want.slots_per_head ||
          t.row_width() != want.row_width) {
        return absl::StrCat("its layer ", l, " has ", t.heads(), " SDM heads of ",
                            t.slots_per_head(), " slots of ", t.row_width(),
                            " values, this engine's ", want.sdm_heads, " of ", want.slots_per_head,
                            " of ", want.row_width);
      }
      const SdmWriteSpec& w = t.write_spec();
      if (w.apply != want.sdm_write.apply || w.writes != want.sdm_write.writes ||
          w.alphas != want.sdm_write.alphas || w.rule != want.sdm_write.rule) {
        return absl::StrCat("its layer ", l, " journals SDM writes of another form");
      }
    } else {
      const KvCache& kv = s.kv(l);
      if (kv.row_width() != want.kv_row_width || kv.ring_capacity() != want.ring_capacity ||
          kv.element() != want.kv_element) {
        return absl::StrCat("its layer ", l, "'s KV cache holds ", kv.row_width(), " ",
                            CpuDtypeName(kv.element()), " values per token, ring ",
                            kv.ring_capacity(), "; this engine's ", want.kv_row_width, " ",
                            CpuDtypeName(want.kv_element), ", ring ", want.ring_capacity,
                            " (a ring holds the window plus prefill_chunk; 0: none)");
      }
    }
  }
  return "";
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

absl::Status ForwardCommit::Fail(absl::Status cause) const {
  if (cause.ok()) cause = absl::InternalError("forward pass failed");
  if (!begun_) return cause;
  const absl::Status marked(
      cause.code(),
      absl::StrCat("a failed step left this session half-updated: ", cause.message()));
  for (const Segment& s : segments_) s.session->MarkFailed(marked);
  SDM_LOG(ERROR) << "engine: a forward pass failed after it began writing session state; "
                 << segments_.size() << " session(s) marked failed: " << cause;
  return absl::Status(
      cause.code(),
      absl::StrCat(cause.message(), " (after the step began writing state: its ", segments_.size(),
                   " session(s) are marked failed and refused until deleted)"));
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

const char* CpuDtypeName(DType dtype) { return dtype == DType::kBf16 ? "bf16" : "fp32"; }

absl::StatusOr<DType> ParseCpuDtype(std::string_view name) {
  for (DType d : {DType::kF32, DType::kBf16}) {
    if (name == CpuDtypeName(d)) return d;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown cpu dtype '",
                                                 absl::string_view(name.data(), name.size()),
                                                 "': expected fp32 or bf16"));
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
        layout_(BuildStateLayout(model_->config, *model_->weights, options, DType::kF32)),
        fingerprint_(ComputeFingerprint(*model_)) {}

  absl::Status Init() {
    if (absl::Status nice = CheckNiceIncrement(options_.decode_nice); !nice.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("decode_nice: ", nice.message()));
    }
    const EngineDevice asked = options_.device;
    EngineDevice device = asked;
    if (device == EngineDevice::kAuto) {
      // A CPU storage type (cpu_dtype other than fp32) asks for the CPU backend: auto honours it
      // rather than refusing it on a machine that happens to have a GPU.
      device = kernels::cuda::DeviceCount() > 0 && options_.cpu_dtype == DType::kF32
                   ? EngineDevice::kCuda
                   : EngineDevice::kCpu;
    }
    options_.device = device;
    if (device == EngineDevice::kCuda && options_.cpu_dtype != DType::kF32) {
      return absl::InvalidArgumentError(
          "cpu_dtype applies to the CPU backend only (the CUDA backend stores bf16 already)");
    }
    SetLayoutFor(device);
    const EngineContext context{model_, options_, &layout_};
    absl::StatusOr<std::unique_ptr<EngineBackend>> backend =
        device == EngineDevice::kCuda ? CreateCudaBackend(context) : CreateCpuBackend(context);
    if (!backend.ok() && device == EngineDevice::kCuda && asked == EngineDevice::kAuto) {
      // auto means "the GPU if it works": say why not, and run on the CPU.
      SDM_LOG(WARNING) << "sdm engine: CUDA backend unavailable (" << backend.status().message()
                       << "); using the CPU";
      options_.device = EngineDevice::kCpu;
      SetLayoutFor(EngineDevice::kCpu);
      const EngineContext cpu_context{model_, options_, &layout_};
      backend = CreateCpuBackend(cpu_context);
    }
    if (!backend.ok()) return backend.status();
    backend_ = *std::move(backend);
    return absl::OkStatus();
  }

  // The state layout for the backend on `device` (before any session exists).
  void SetLayoutFor(EngineDevice device) {
    layout_ = BuildStateLayout(model_->config, *model_->weights, options_,
                               device == EngineDevice::kCpu ? options_.cpu_dtype : DType::kF32);
  }

  const Model& model() const { return *model_; }
  const ModelConfig& config() const { return model_->config; }
  const EngineOptions& options() const { return options_; }
  const StateLayout& layout() const { return layout_; }
  uint64_t fingerprint() const { return fingerprint_; }

  // INVALID_ARGUMENT unless `s` has this engine's state layout (LayoutMismatch).
  absl::Status CheckLayout(const SessionState& s) const {
    const std::string mismatch = LayoutMismatch(s, layout_);
    if (mismatch.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "session state was made for a different model or engine configuration: ", mismatch));
  }

  EngineBackend& backend() const { return *backend_; }

  const EngineProfile& profile() const { return profile_; }
  void ResetProfile() { profile_ = EngineProfile{}; }

  absl::Status Step(const StepBatch& batch, std::span<float> logits, std::span<int32_t> sampled) {
    if (auto s = Validate(batch, logits, sampled); !s.ok()) return s;
    if (options_.testing_refuse_step && options_.testing_refuse_step(batch)) {
      return absl::ResourceExhaustedError(
          "injected (EngineOptions::testing_refuse_step): the step's sessions do not fit");
    }
    const int64_t chunk = options_.prefill_chunk;
    const int64_t vocab = config().vocab_size;
    const std::span<const StepSegment> segs(batch.segments);
    // Where each segment's logits start in `logits` (rows) and its draw goes in `sampled`, and
    // how many passes the step takes.
    std::vector<int64_t> out_row(segs.size(), -1);
    std::vector<int64_t> draw_slot(segs.size(), -1);
    int64_t rows_so_far = 0;
    int64_t draws_so_far = 0;
    int64_t passes = 0;
    for (size_t i = 0; i < segs.size(); ++i) {
      const int64_t len = static_cast<int64_t>(segs[i].tokens.size());
      passes = std::max(passes, (len + chunk - 1) / chunk);
      if (segs[i].sampling != nullptr) draw_slot[i] = draws_so_far++;
      if (segs[i].logits == StepLogits::kNone) continue;
      out_row[i] = rows_so_far;
      rows_so_far += segs[i].logits == StepLogits::kAll ? len : 1;
    }
    const bool device_draws = backend_->DrawsOnDevice();
    std::set<SessionState*> advanced;  // by the passes completed so far
    for (int64_t pass = 0; pass < passes; ++pass) {
      std::vector<int32_t> tokens;
      std::vector<Segment> pieces;
      std::vector<int64_t> logit_rows;  // rows of this pass whose logits are wanted ...
      std::vector<int64_t> dest_rows;   // ... and where they go in `logits`
      std::vector<ForwardDraw> draws;   // rows of this pass to draw a token from ...
      std::vector<int64_t> draw_dest;   // ... and where it goes in `sampled`
      // Single-token pieces first (the backend contract), each group in batch order.
      for (const bool singles : {true, false}) {
        for (size_t i = 0; i < segs.size(); ++i) {
          const StepSegment& seg = segs[i];
          const int64_t len = static_cast<int64_t>(seg.tokens.size());
          const int64_t start = pass * chunk;
          if (start >= len) continue;
          const int64_t n = std::min(chunk, len - start);
          if ((n == 1) != singles) continue;
          const int64_t first_row = static_cast<int64_t>(tokens.size());
          pieces.push_back({seg.session, first_row, n, seg.session->position()});
          tokens.insert(tokens.end(), seg.tokens.begin() + start, seg.tokens.begin() + start + n);
          const bool last_piece = start + n == len;
          if (seg.logits == StepLogits::kAll) {
            for (int64_t t = 0; t < n; ++t) {
              logit_rows.push_back(first_row + t);
              dest_rows.push_back(out_row[i] + start + t);
            }
          } else if (seg.logits == StepLogits::kLast && last_piece) {
            logit_rows.push_back(first_row + n - 1);
            dest_rows.push_back(out_row[i]);
          }
          if (seg.sampling != nullptr && last_piece) {
            draws.push_back({first_row + n - 1, seg.sampling, seg.draw_index});
            draw_dest.push_back(draw_slot[i]);
          }
        }
      }
      // A backend that cannot draw returns the drawn rows' logits after the wanted ones, and
      // the tokens are drawn here.
      const bool host_draws = !draws.empty() && !device_draws;
      if (host_draws) {
        for (const ForwardDraw& d : draws) logit_rows.push_back(d.row);
      }
      // The backend writes rows contiguously: straight into `logits` when they are all wanted
      // and their destinations consecutive (a plain decode batch, one prefill), else through
      // scratch.
      bool direct = !host_draws;
      for (size_t r = 1; direct && r < dest_rows.size(); ++r) {
        direct = dest_rows[r] == dest_rows[0] + static_cast<int64_t>(r);
      }
      ForwardOutputs out;
      out.logit_rows = logit_rows;
      if (!logit_rows.empty()) {
        if (direct) {
          out.logits = logits.data() + dest_rows[0] * vocab;
        } else {
          scratch_logits_.resize(logit_rows.size() * vocab);
          out.logits = scratch_logits_.data();
        }
      }
      if (!draws.empty() && device_draws) {
        scratch_sampled_.resize(draws.size());
        out.draws = draws;
        out.sampled = scratch_sampled_.data();
      }
      ForwardProfiler profiler(options_.profile ? &profile_ : nullptr);
      if (auto s = backend_->Forward(tokens, pieces, out, profiler); !s.ok()) {
        return FailLaterPass(s, advanced);
      }
      for (const Segment& p : pieces) {
        for (int64_t t = 0; t < p.length; ++t) p.session->AdvancePosition();
        advanced.insert(p.session);
      }
      if (!direct) {
        for (size_t r = 0; r < dest_rows.size(); ++r) {
          std::copy_n(scratch_logits_.data() + r * vocab, vocab,
                      logits.data() + dest_rows[r] * vocab);
        }
      }
      for (size_t j = 0; j < draws.size(); ++j) {
        sampled[draw_dest[j]] =
            host_draws
                ? SampleToken(std::span<const float>(
                                  scratch_logits_.data() + (dest_rows.size() + j) * vocab, vocab),
                              *draws[j].params, draws[j].draw_index)
                : scratch_sampled_[j];
      }
    }
    return absl::OkStatus();
  }

 private:
  // A pass failed after earlier passes of the step advanced `advanced`: they consumed part of
  // their segment's tokens, which no caller can tell from the error, so they are marked failed
  // too (ForwardCommit marked the failing pass's own sessions if it had begun writing).
  static absl::Status FailLaterPass(const absl::Status& s,
                                    const std::set<SessionState*>& advanced) {
    int64_t marked = 0;
    for (SessionState* session : advanced) {
      if (session->failed()) continue;
      session->MarkFailed(absl::Status(
          s.code(), absl::StrCat("a failed step left this session half-updated (an earlier pass "
                                 "of the step consumed part of its tokens): ",
                                 s.message())));
      ++marked;
    }
    if (marked == 0) return s;
    return absl::Status(s.code(), absl::StrCat(s.message(), "; ", marked,
                                               " session(s) advanced by earlier passes of the "
                                               "step are marked failed too"));
  }

  absl::Status Validate(const StepBatch& batch, std::span<float> logits,
                        std::span<int32_t> sampled) const {
    std::set<const SessionState*> seen;
    for (const StepSegment& seg : batch.segments) {
      if (seg.session == nullptr)
        return absl::InvalidArgumentError("a step segment has no session");
      if (seg.tokens.empty()) {
        return absl::InvalidArgumentError("a step segment needs at least one token");
      }
      if (seg.logits != StepLogits::kNone && seg.logits != StepLogits::kLast &&
          seg.logits != StepLogits::kAll) {
        return absl::InvalidArgumentError(
            absl::StrCat("unknown logits request ", static_cast<int>(seg.logits)));
      }
      if (seg.sampling != nullptr) {
        if (auto s = ValidateSamplingParams(*seg.sampling, config().vocab_size); !s.ok()) return s;
      }
      if (auto s = CheckTokens(seg.tokens); !s.ok()) return s;
      if (auto s = CheckSession(*seg.session); !s.ok()) return s;
      if (!seen.insert(seg.session).second) {
        return absl::InvalidArgumentError("a session appears twice in one step");
      }
    }
    const int64_t want = batch.LogitRows() * config().vocab_size;
    if (static_cast<int64_t>(logits.size()) != want) {
      return absl::InvalidArgumentError(
          absl::StrCat("step logits buffer holds ", logits.size(), " floats, needs ", want));
    }
    if (static_cast<int64_t>(sampled.size()) != batch.Draws()) {
      return absl::InvalidArgumentError(absl::StrCat("step sampled buffer holds ", sampled.size(),
                                                     " tokens, needs ", batch.Draws()));
    }
    return absl::OkStatus();
  }

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
    if (auto layout = CheckLayout(s); !layout.ok()) return layout;
    if (s.failed()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session state is refused until the session is deleted: ", s.failure().message()));
    }
    return absl::OkStatus();
  }

  std::shared_ptr<const Model> model_;
  EngineOptions options_;
  StateLayout layout_;
  uint64_t fingerprint_;
  std::unique_ptr<EngineBackend> backend_;
  EngineProfile profile_;
  std::vector<float> scratch_logits_;     // logits of a pass whose rows are scattered
  std::vector<int32_t> scratch_sampled_;  // tokens a backend drew on its device
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
const EngineProfile& Engine::profile() const { return impl_->profile(); }
uint64_t Engine::fingerprint() const { return impl_->fingerprint(); }
void Engine::ResetProfile() { impl_->ResetProfile(); }
EngineDevice Engine::device() const { return impl_->backend().device(); }
std::string Engine::DescribeDevice() const { return impl_->backend().Describe(); }
DecodeGraphStats Engine::decode_graph_stats() const {
  return impl_->backend().decode_graph_stats();
}
ResumeStagingStats Engine::resume_staging_stats() const {
  return impl_->backend().resume_staging_stats();
}
absl::Status Engine::StageResume(SessionState& session) {
  if (auto s = impl_->CheckLayout(session); !s.ok()) return s;
  if (session.failed() || session.on_device()) return absl::OkStatus();
  return impl_->backend().StageResume(session);
}
int64_t Engine::device_state_capacity_bytes() const {
  return impl_->backend().StateCapacityBytes();
}
int64_t Engine::packed_weight_bytes() const { return impl_->backend().PackedWeightBytes(); }
int64_t Engine::host_kv_value_bytes() const {
  for (const LayerStateLayout& l : impl_->layout().layers) {
    if (l.kind == LayerStateLayout::Kind::kKv) return DTypeBytes(l.kv_element);
  }
  return static_cast<int64_t>(sizeof(float));
}

int64_t Engine::max_session_positions() const {
  if (device() != EngineDevice::kCuda) return 0;
  for (const LayerStateLayout& l : impl_->layout().layers) {
    if (l.kind == LayerStateLayout::Kind::kKv && l.ring_capacity == 0) {
      return impl_->options().max_context;
    }
  }
  return 0;
}

std::unique_ptr<SessionState> Engine::NewSession() const {
  return std::make_unique<SessionState>(impl_->layout());
}

int64_t StepBatch::Add(SessionState& session, std::span<const int32_t> tokens, StepLogits logits) {
  const int64_t row = logits == StepLogits::kNone ? -1 : LogitRows();
  segments.push_back({&session, tokens, logits});
  return row;
}

int64_t StepBatch::AddDraw(SessionState& session, std::span<const int32_t> tokens,
                           StepLogits logits, const SamplingParams& sampling, uint64_t draw_index) {
  const int64_t draw = Draws();
  Add(session, tokens, logits);
  segments.back().sampling = &sampling;
  segments.back().draw_index = draw_index;
  return draw;
}

int64_t StepBatch::Draws() const {
  return std::count_if(segments.begin(), segments.end(),
                       [](const StepSegment& s) { return s.sampling != nullptr; });
}

int64_t StepBatch::LogitRows() const {
  int64_t rows = 0;
  for (const StepSegment& s : segments) {
    if (s.logits == StepLogits::kLast) rows += 1;
    if (s.logits == StepLogits::kAll) rows += static_cast<int64_t>(s.tokens.size());
  }
  return rows;
}

int64_t StepBatch::TokenCount() const {
  int64_t n = 0;
  for (const StepSegment& s : segments) n += static_cast<int64_t>(s.tokens.size());
  return n;
}

absl::Status Engine::Step(const StepBatch& batch, std::span<float> logits,
                          std::span<int32_t> sampled) {
  return impl_->Step(batch, logits, sampled);
}

absl::Status Engine::Prefill(SessionState& session, std::span<const int32_t> tokens,
                             bool all_positions, std::vector<float>* logits) {
  if (tokens.empty()) return absl::InvalidArgumentError("prefill needs at least one token");
  StepBatch batch;
  batch.Add(session, tokens,
            logits == nullptr ? StepLogits::kNone
                              : (all_positions ? StepLogits::kAll : StepLogits::kLast));
  if (logits == nullptr) return Step(batch, {});
  // Sized only once the call is valid, so a rejected call leaves `logits` alone.
  std::vector<float> out(batch.LogitRows() * vocab_size());
  if (absl::Status s = Step(batch, out); !s.ok()) return s;
  *logits = std::move(out);
  return absl::OkStatus();
}

absl::Status Engine::Decode(std::span<SessionState* const> sessions,
                            std::span<const int32_t> tokens, std::span<float> logits) {
  if (tokens.size() != sessions.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode got ", sessions.size(), " sessions but ", tokens.size(), " tokens"));
  }
  StepBatch batch;
  for (size_t b = 0; b < sessions.size(); ++b) {
    if (sessions[b] == nullptr) return absl::InvalidArgumentError("decode got a null session");
    batch.Add(*sessions[b], tokens.subspan(b, 1), StepLogits::kLast);
  }
  return Step(batch, logits);
}

}  // namespace sdm
