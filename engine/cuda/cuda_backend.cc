// The CUDA backend (docs/architecture.md, "CUDA backend"; docs/model-spec.md, "6. Numerics and
// backends"): the forward pass of engine/cpu_backend.cc with bf16 weights and state on the
// device, fp32 activations and accumulation, cuBLASLt for every dense layer and kernels/cuda/ for
// the rest. Sessions become device-resident on their first step
// (engine/cuda/device_state.h) and stay so until the state store parks them.
//
// A step: (1) upload sessions that are not resident (from the image StageResume converted ahead
// of the step, when there is one, scattered from its device copy when that was made ahead too)
// and give their attention layers the pages
// the step's positions need; (2) reserve the SDM rows the step may allocate (copy-on-write can
// take at most rows * heads * writes per SDM layer); (3) copy the step's small integer arrays
// (tokens, positions, segments, per-layer table pointers) to the device in one transfer; (4) run
// the layers on the compute stream (the pass's single-token segments, which the front puts
// first, as one decode-attention batch; longer segments through the prefill kernel); (5) copy the
// logits back into pinned memory with the free-row count and the row counters, and synchronise
// once. Every copy is asynchronous (a copy into the caller's pageable buffer would block the host
// in the middle of the pass); the logits move to the caller's buffer after the synchronisation.
//
// Failure part-way (engine/engine_backend.h, ForwardCommit). Everything that can fail without a
// launch failing happens before step (3): residency, pages, row reservation, workspace, and the
// plan of every cuBLASLt GEMM of the pass (BlasLtGemm::Plan: descriptors and checked algorithms,
// cached per batch size); such a failure (say RESOURCE_EXHAUSTED: no free page) detaches again
// the sessions the pass uploaded, so that they hold no device memory while they wait (sessions
// resident before keep the pages the pass added for them). From step (3) on, any error still
// synchronises the stream before the pass returns (the pinned step arrays and logits outlive their
// copies), and an error after the first write to session state (the first KV append or SDM row
// preparation) marks the pass's sessions failed: their device state may hold some layers of the
// pass and not others. They are refused until deleted; nothing retries them into a double write.
//
// Decode steps as graphs (EngineOptions::cuda_graphs). A step whose segments are all single
// tokens enqueues steps (3) to (5) as one CUDA graph, captured the first time its shape is seen
// (engine/cuda/decode_graph_cache.h says what a shape is and when graphs are dropped) and
// replayed after: the host fills the pinned step arrays and launches once. Capturing runs
// nothing, so a capture that fails (say, a launch CUDA refuses in a graph) changes no session:
// the shape is then run launch by launch, as every step is when profiling or injecting faults.
// Its decode attention is sized from DecodeGraphVisible (kernels/common/attention_math.h), so
// steps of a growing context share a graph with results unchanged.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "base/failure_episode.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "engine/cuda/decode_graph_cache.h"
#include "engine/cuda/device_state.h"
#include "engine/engine_backend.h"
#include "engine/layer_tensors.h"
#include "engine/stacked_projection.h"
#include "engine/weight_spec.h"
#include "kernels/common/attention_math.h"
#include "kernels/common/device_layout.h"
#include "kernels/common/sdm_addressing_math.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/sampling.h"
#include "kernels/cuda/sdm.h"

namespace sdm {
namespace {

namespace kc = kernels::cuda;
using bf16 = __nv_bfloat16;

// A dense layer's weight on the device: [out, in] bf16.
struct DeviceMatrix {
  const bf16* w = nullptr;
  int64_t out = 0, in = 0;
};

// A layer's weights on the device: matrices (and M0) in bf16, vectors in fp32. The matrices of
// its stacked projections point into those stacks.
using DeviceLayer = LayerTensors<DeviceMatrix, const float*>;

// Projections that read the same input, as one GEMM (engine/stacked_projection.h): the stacked
// weight, its stacked bias (null when no part has one) and where each part's columns start in
// a row of the output (whose rows are layout.width apart).
struct DeviceStack {
  DeviceMatrix w;
  const float* bias = nullptr;
  StackedLayout layout;
  // Part `part`'s columns of row 0 of an output `y` of this stack.
  float* Part(float* y, int part) const { return y + layout.offsets[part]; }
  int64_t stride() const { return layout.width; }
};

// A layer's stacks: the mixer's inputs and the feed-forward's.
struct LayerStacks {
  DeviceStack mixer_in, ffn_in;
};

// Owns an instantiated graph: cudaGraphExecDestroy exactly once.
class GraphExec {
 public:
  explicit GraphExec(cudaGraphExec_t exec) : exec_(exec) {}
  ~GraphExec() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  }
  GraphExec(GraphExec&& o) noexcept : exec_(std::exchange(o.exec_, nullptr)) {}
  GraphExec& operator=(GraphExec&& o) noexcept {
    if (this != &o) {
      if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
      exec_ = std::exchange(o.exec_, nullptr);
    }
    return *this;
  }
  cudaGraphExec_t get() const { return exec_; }

 private:
  cudaGraphExec_t exec_ = nullptr;
};

// The decode graphs kept at once: shapes differ by batch size (and, at long full-attention
// context, by a handful of grid bounds), so a server's steady mix fits.
constexpr size_t kDecodeGraphCapacity = 64;

// Device activations for up to `rows` rows; grown on demand.
struct Workspace {
  int64_t rows = 0;
  kc::DeviceBuffer<float> x, tmp, logits;
  // The outputs of a layer's stacked projections (LayerStacks), rows `stride()` apart.
  kc::DeviceBuffer<float> mixer_in, ffn_in;
  kc::DeviceBuffer<bf16> xb, ob, hb, final_b;
  // SDM
  kc::DeviceBuffer<float> log_decay, beta, w_weights, r_weights, readings;
  kc::DeviceBuffer<int32_t> w_slots, r_slots, w_rows, r_refs;
  kc::DeviceBuffer<float> attn_scratch;
  kc::DeviceBuffer<unsigned int> attn_counters;
  // The step's integers and pointers (one upload) and their pinned host image.
  kc::DeviceBuffer<unsigned char> step;
  kc::PinnedBuffer<unsigned char> step_host;
  // Where the logits are downloaded to (pinned: the copy stays asynchronous); grown on demand.
  kc::PinnedBuffer<float> logits_host;
  // Tokens drawn on the device (ForwardOutputs::draws), the sampling kernel's scratch, and the
  // tokens' pinned host image; grown on demand.
  kc::DeviceBuffer<int32_t> sampled;
  kc::DeviceBuffer<unsigned char> sample_scratch;
  kc::PinnedBuffer<int32_t> sampled_host;
};

class CudaBackend : public EngineBackend {
 public:
  explicit CudaBackend(const EngineContext& context)
      : model_(context.model),
        cfg_(model_->config),
        options_(context.options),
        layout_(*context.layout),
        hidden_(FfnHiddenDim(cfg_)),
        sdm_geom_(SdmGeometryOf(cfg_)),
        fault_(context.options.inject_forward_fault),
        graphs_(kDecodeGraphCapacity) {}

  absl::Status Init() {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      cudaGetLastError();
      return absl::UnavailableError("no CUDA device is present");
    }
    cudaDeviceProp prop{};
    SDM_RETURN_IF_ERROR(CudaStatus(cudaGetDeviceProperties(&prop, 0), "querying the device"));
    device_name_ = prop.name;
    if (!gemm_.Init()) return absl::InternalError("cuBLASLt: " + gemm_.error());
    SDM_RETURN_IF_ERROR(UploadWeights());

    // What is left becomes session state: KV pages and SDM rows.
    size_t free_bytes = 0, total_bytes = 0;
    SDM_RETURN_IF_ERROR(
        CudaStatus(cudaMemGetInfo(&free_bytes, &total_bytes), "querying device memory"));
    // Keep room for activations of a large step (and cuBLASLt's workspace).
    const int64_t activation_reserve = int64_t{2} << 30;
    if (options_.resume_prefetch_bytes < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("resume_prefetch_bytes must be >= 0, not ", options_.resume_prefetch_bytes));
    }
    // Copies ahead need staged images: without staging none is made, and none is kept room for.
    const int64_t prefetch_bytes =
        options_.resume_staging_bytes > 0 ? options_.resume_prefetch_bytes : 0;
    int64_t state_bytes = options_.device_state_bytes;
    if (state_bytes <= 0) {
      state_bytes = static_cast<int64_t>(
          (static_cast<double>(free_bytes) - activation_reserve - prefetch_bytes) *
          options_.device_state_fraction);
    }
    if (state_bytes <= 0) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "the weights leave no device memory for session state (%.2f GiB free, of which %.2f "
          "GiB are kept for activations and %.2f GiB for resumes copied ahead: "
          "resume_prefetch_bytes, --resume_prefetch)",
          free_bytes / double(1 << 30), activation_reserve / double(1 << 30),
          prefetch_bytes / double(1 << 30)));
    }
    if (options_.device_transfer_chunk_bytes < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device_transfer_chunk_bytes must be >= 0, not ", options_.device_transfer_chunk_bytes));
    }
    // A transfer moves whole blocks through its chunk (engine/transfer_plan.h): a chunk size set
    // here must hold the largest, an SDM row or a KV page.
    if (const int64_t chunk = options_.device_transfer_chunk_bytes;
        chunk > 0 && chunk < LargestTransferBlockBytes(layout_)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device_transfer_chunk_bytes (", chunk,
          ") must hold the largest block a park or resume moves (an SDM row or a KV page): ",
          LargestTransferBlockBytes(layout_), " bytes"));
    }
    if (options_.resume_staging_bytes < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("resume_staging_bytes must be >= 0, not ", options_.resume_staging_bytes));
    }
    DeviceStateSizes sizes;
    sizes.max_context = options_.max_context;
    sizes.staged_bytes = options_.resume_staging_bytes;
    sizes.prefetch_bytes = prefetch_bytes;
    sizes.transfer_chunk_bytes = options_.device_transfer_chunk_bytes;
    sizes.inject_transfer_fault = options_.inject_transfer_fault;
    sizes.written_list_capacity = options_.written_list_capacity;
    // Arenas in proportion to what one session needs at most: its SDM table fully written, its
    // sliding-window rings full, its full-attention caches at max_context. Session state of
    // `sessions` such sessions then fits exactly, and shorter sessions fit more.
    sizes.kv_pages.assign(cfg_.n_layers, 0);
    const int64_t row_bytes = sdm_geom_.head_width * static_cast<int64_t>(sizeof(bf16));
    int64_t need = 0;
    int64_t sdm_rows_per_session = 0;
    std::vector<int64_t> pages_per_session(cfg_.n_layers, 0);
    for (int64_t l = 0; l < cfg_.n_layers; ++l) {
      const LayerStateLayout& ls = layout_.layers[l];
      if (ls.kind == LayerStateLayout::Kind::kSdm) {
        sdm_rows_per_session += ls.sdm_heads * ls.slots_per_head;
        need += ls.sdm_heads * ls.slots_per_head * row_bytes;
      } else {
        const int64_t page_bytes = kernels::KvPageElements(ls.kv_row_width) * sizeof(bf16);
        pages_per_session[l] =
            ls.ring_capacity > 0
                ? kernels::KvRingPages(ls.ring_capacity)
                : (options_.max_context + kernels::kKvPageTokens - 1) / kernels::kKvPageTokens;
        need += pages_per_session[l] * page_bytes;
      }
    }
    const double sessions = need > 0 ? static_cast<double>(state_bytes) / need : 0;
    if (sessions < 1) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%.2f GiB of device memory for session state cannot hold one session (%.2f GiB at "
          "max_context %d); lower --max_context or free device memory",
          state_bytes / double(1 << 30), need / double(1 << 30), options_.max_context));
    }
    sizes.sdm_rows =
        std::min<int64_t>(static_cast<int64_t>(sessions * sdm_rows_per_session), INT32_MAX - 1);
    for (int64_t l = 0; l < cfg_.n_layers; ++l) {
      sizes.kv_pages[l] =
          std::min<int64_t>(static_cast<int64_t>(sessions * pages_per_session[l]), INT32_MAX - 1);
    }
    std::vector<const bf16*> m0(cfg_.n_layers, nullptr);
    for (int64_t l = 0; l < cfg_.n_layers; ++l) {
      if (layers_[l].type == LayerType::kSdm) m0[l] = layers_[l].sdm.m0.w;
    }
    absl::StatusOr<std::shared_ptr<CudaDeviceContext>> ctx =
        CudaDeviceContext::Create(layout_, sizes, std::move(m0));
    if (!ctx.ok()) return ctx.status();
    ctx_ = *std::move(ctx);
    state_bytes_ = state_bytes;
    // Sessions of a different mix than the sizing assumed (say, many short ones) can fill one
    // arena before the bytes add up to this; then a step fails with RESOURCE_EXHAUSTED and
    // the state store parks sessions.
    state_capacity_bytes_ = state_bytes;
    sessions_at_max_ = sessions;
    return absl::OkStatus();
  }

  EngineDevice device() const override { return EngineDevice::kCuda; }
  std::string Describe() const override {
    return absl::StrFormat(
        "cuda, %s, weights %.2f GiB, session state %.2f GiB (%.0f sessions at full state)",
        device_name_, weight_bytes_ / double(1 << 30), state_bytes_ / double(1 << 30),
        sessions_at_max_);
  }
  int64_t StateCapacityBytes() const override { return state_capacity_bytes_; }
  DecodeGraphStats decode_graph_stats() const override { return graph_stats_; }

  // Off the step thread: reads the host session and the context's pool (thread-safe), never the
  // streams.
  absl::Status StageResume(SessionState& session) override {
    if (session.staged() != nullptr && session.staged()->owner() == ctx_.get()) {
      return absl::OkStatus();  // staged already (and still current: stale ones are dropped)
    }
    if (session.position() == 0) return absl::OkStatus();  // a new session: nothing to convert
    if (ctx_->sizes().staged_bytes == 0) {
      staged_refused_.fetch_add(1, std::memory_order_relaxed);
      return absl::OkStatus();
    }
    absl::StatusOr<std::unique_ptr<CudaStagedUpload>> staged =
        CudaStagedUpload::Stage(ctx_, session);
    if (absl::IsResourceExhausted(staged.status())) {
      staged_refused_.fetch_add(1, std::memory_order_relaxed);
      return absl::OkStatus();  // the step converts, as without staging
    }
    // Anything else (a position past max_context) is the step's to report, as without staging.
    if (!staged.ok()) {
      if (!absl::IsOutOfRange(staged.status())) {
        absl::MutexLock lock(&staging_log_mu_);
        if (staging_failures_.Failed(staged.status().ToString())) {
          SDM_LOG(WARNING) << "sdm cuda: staging a resume failed: " << staged.status()
                           << " (the step converts the session instead; further failures of "
                              "this cause are not logged until a staging succeeds)";
        }
      }
      return absl::OkStatus();
    }
    {
      absl::MutexLock lock(&staging_log_mu_);
      if (int64_t unlogged = 0; staging_failures_.Succeeded(&unlogged)) {
        SDM_LOG(INFO) << "sdm cuda: staging resumes succeed again (" << unlogged
                      << " more failed meanwhile, not logged)";
      }
    }
    if (*staged == nullptr) return absl::OkStatus();  // nothing to convert
    if ((*staged)->device_image() != nullptr) {
      prefetched_.fetch_add(1, std::memory_order_relaxed);
    }
    session.AttachStaged(*std::move(staged));
    staged_count_.fetch_add(1, std::memory_order_relaxed);
    return absl::OkStatus();
  }
  ResumeStagingStats resume_staging_stats() const override {
    ResumeStagingStats stats;
    stats.staged = staged_count_.load(std::memory_order_relaxed);
    stats.used = staged_used_.load(std::memory_order_relaxed);
    stats.refused = staged_refused_.load(std::memory_order_relaxed);
    stats.held_bytes = ctx_->staged_image_stats().held_bytes;
    stats.prefetched = prefetched_.load(std::memory_order_relaxed);
    stats.prefetch_held_bytes = ctx_->prefetch_image_stats().held_bytes;
    return stats;
  }

 private:
  // ---- weights ---------------------------------------------------------------------------------

  // Where UploadWeights puts a tensor that is part of a stack (null: a buffer of its own).
  struct StackSlot {
    bf16* matrix = nullptr;   // its first row in the stacked weight
    float* vector = nullptr;  // its first element in the stacked bias
  };

  // Allocates the stack of `parts` (zeros where no part is: the alignment gaps and a bias's
  // parts without one) and says where each part's tensors go. A tensor that another role also
  // uses cannot move into a stack (`uses`: roles per tensor).
  absl::Status AllocateStack(const WeightSpec& spec, std::span<const StackedPart> parts,
                             const std::vector<int>& uses, DeviceStack* stack,
                             std::vector<StackSlot>* slots) {
    for (const StackedPart& part : parts) {
      for (const TensorRef ref : {part.matrix, part.bias}) {
        if (!ref.present()) continue;
        const auto t = static_cast<size_t>(ref.index);
        if (uses[t] != 1) {
          return absl::InternalError(absl::StrCat(spec.tensors[t].name,
                                                  " serves more than one role; it cannot be "
                                                  "stacked with the projections beside it"));
        }
      }
    }
    absl::StatusOr<StackedLayout> layout = PlanStackedProjection(spec, parts);
    if (!layout.ok()) return layout.status();
    stack->layout = *std::move(layout);
    const StackedLayout& l = stack->layout;
    kc::DeviceBuffer<bf16> w;
    SDM_RETURN_IF_ERROR(CudaStatus(w.Allocate(l.width * l.in), "allocating weights"));
    SDM_RETURN_IF_ERROR(CudaStatus(cudaMemset(w.get(), 0, w.bytes()), "clearing weights"));
    stack->w = {w.get(), l.width, l.in};
    weight_bytes_ += static_cast<int64_t>(w.bytes());
    float* bias = nullptr;
    if (l.has_bias) {
      kc::DeviceBuffer<float> b;
      SDM_RETURN_IF_ERROR(CudaStatus(b.Allocate(l.width), "allocating weights"));
      SDM_RETURN_IF_ERROR(CudaStatus(cudaMemset(b.get(), 0, b.bytes()), "clearing weights"));
      bias = b.get();
      stack->bias = bias;
      weight_bytes_ += static_cast<int64_t>(b.bytes());
      f32_buffers_.push_back(std::move(b));
    }
    for (size_t i = 0; i < parts.size(); ++i) {
      if (parts[i].matrix.present()) {
        (*slots)[static_cast<size_t>(parts[i].matrix.index)].matrix = w.get() + l.offsets[i] * l.in;
      }
      if (parts[i].bias.present()) {
        (*slots)[static_cast<size_t>(parts[i].bias.index)].vector = bias + l.offsets[i];
      }
    }
    bf16_buffers_.push_back(std::move(w));
    return absl::OkStatus();
  }

  // Copies `host` to `dst` (its place in a stack), or to a buffer of its own added to `owned`
  // when `dst` is null; returns where it went.
  template <typename T>
  absl::StatusOr<T*> UploadTensor(std::span<const T> host, T* dst,
                                  std::vector<kc::DeviceBuffer<T>>& owned) {
    if (dst == nullptr) {
      kc::DeviceBuffer<T> buf;
      SDM_RETURN_IF_ERROR(CudaStatus(buf.Allocate(host.size()), "allocating weights"));
      weight_bytes_ += static_cast<int64_t>(buf.bytes());
      dst = buf.get();
      owned.push_back(std::move(buf));
    }
    SDM_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpy(dst, host.data(), host.size_bytes(), cudaMemcpyHostToDevice),
                   "uploading weights"));
    return dst;
  }

  absl::Status UploadWeights() {
    const ModelWeights& w = *model_->weights;
    const WeightSpec spec = BuildWeightSpec(cfg_);
    // The stacks first (engine/stacked_projection.h): their parts are uploaded into them.
    std::vector<int> uses(spec.tensors.size(), 0);
    auto count = [&](TensorRef ref) {
      if (ref.present()) ++uses[static_cast<size_t>(ref.index)];
      return 0;
    };
    (void)spec.roles.Map(count, count);
    std::vector<StackSlot> slots(spec.tensors.size());
    stacks_.resize(cfg_.n_layers);
    for (int64_t i = 0; i < cfg_.n_layers; ++i) {
      const LayerTensors<TensorRef, TensorRef>& roles = spec.roles.layers[i];
      SDM_RETURN_IF_ERROR(
          AllocateStack(spec, MixerInputParts(roles), uses, &stacks_[i].mixer_in, &slots));
      SDM_RETURN_IF_ERROR(
          AllocateStack(spec, FfnInputParts(roles), uses, &stacks_[i].ffn_in, &slots));
    }
    // Every tensor once, in spec order; roles below refer to them by index.
    std::vector<DeviceMatrix> matrices(spec.tensors.size());
    std::vector<const float*> vectors(spec.tensors.size(), nullptr);
    std::vector<bf16> staging;
    for (size_t i = 0; i < spec.tensors.size(); ++i) {
      const TensorSpec& t = spec.tensors[i];
      std::span<const float> v = w.Get(t.name);
      // Matrices (and M0, and the embedding table) in bf16; vectors stay fp32.
      if (t.shape.size() == 2) {
        staging.resize(v.size());
        for (size_t j = 0; j < v.size(); ++j) staging[j] = __float2bfloat16_rn(v[j]);
        absl::StatusOr<bf16*> dst = UploadTensor<bf16>(staging, slots[i].matrix, bf16_buffers_);
        if (!dst.ok()) return dst.status();
        matrices[i] = {*dst, t.shape[0], t.shape[1]};
      } else {
        absl::StatusOr<float*> dst = UploadTensor<float>(v, slots[i].vector, f32_buffers_);
        if (!dst.ok()) return dst.status();
        vectors[i] = *dst;
      }
    }
    auto matrix = [&](TensorRef ref) {
      return ref.present() ? matrices[static_cast<size_t>(ref.index)] : DeviceMatrix{};
    };
    auto vector = [&](TensorRef ref) -> const float* {
      return ref.present() ? vectors[static_cast<size_t>(ref.index)] : nullptr;
    };
    tok_embeddings_ = matrix(spec.roles.tok_embeddings).w;
    final_norm_ = vector(spec.roles.norm);
    output_ = matrix(spec.roles.output);
    for (int64_t i = 0; i < cfg_.n_layers; ++i) {
      layers_.push_back(spec.roles.layers[i].Map(matrix, vector));
      attention_geom_.push_back(cfg_.layer_types[i] == LayerType::kSdm
                                    ? AttentionGeometry{}
                                    : AttentionGeometryOf(cfg_, i));
    }
    return absl::OkStatus();
  }

  // ---- the step --------------------------------------------------------------------------------

  int64_t AddressCount(int64_t k) const { return kernels::AddressCount(k, sdm_geom_.side); }

  absl::Status EnsureWorkspace(int64_t rows, int64_t max_visible) {
    Workspace& ws = ws_;
    if (rows > ws.rows) {
      int64_t r = 64;  // capacity grows in powers of two
      while (r < rows) r *= 2;
      // Every buffer is replaced (each Allocate frees the old one first): the decode graphs that
      // point into them go now, and until all are in place the workspace holds no row, so that
      // a step after an allocation that failed part-way grows it again (it kept the old size
      // over buffers that were gone or too small).
      graphs_.Clear();
      ws.rows = 0;
      const int64_t dim = cfg_.dim;
      int64_t q_width = dim, mixer_in = 0, ffn_in = 0;
      for (int64_t li = 0; li < cfg_.n_layers; ++li) {
        mixer_in = std::max(mixer_in, stacks_[li].mixer_in.stride());
        ffn_in = std::max(ffn_in, stacks_[li].ffn_in.stride());
        if (layers_[li].type == LayerType::kSdm) continue;
        const AttentionGeometry& g = attention_geom_[li];
        q_width = std::max(q_width, g.n_heads * g.head_dim);
      }
      const int64_t heads = sdm_geom_.heads;
      const int64_t n_w = heads > 0 ? sdm_geom_.writes : 0;
      const int64_t n_r = heads > 0 ? AddressCount(cfg_.sdm.num_reads) : 0;
      struct F {
        kc::DeviceBuffer<float>* b;
        int64_t n;
      };
      for (F f :
           {F{&ws.x, r * dim}, F{&ws.tmp, r * dim}, F{&ws.mixer_in, r * mixer_in},
            F{&ws.ffn_in, r * ffn_in}, F{&ws.logits, r * cfg_.vocab_size},
            F{&ws.log_decay, r * heads}, F{&ws.beta, r * heads}, F{&ws.w_weights, r * heads * n_w},
            F{&ws.r_weights, r * heads * n_r}, F{&ws.readings, heads > 0 ? r * dim : 0}}) {
        SDM_RETURN_IF_ERROR(CudaStatus(f.b->Allocate(f.n), "allocating activations"));
      }
      struct B {
        kc::DeviceBuffer<bf16>* b;
        int64_t n;
      };
      for (B b : {B{&ws.xb, r * std::max(dim, q_width)}, B{&ws.ob, r * std::max(dim, q_width)},
                  B{&ws.hb, r * hidden_}, B{&ws.final_b, r * dim}}) {
        SDM_RETURN_IF_ERROR(CudaStatus(b.b->Allocate(b.n), "allocating activations"));
      }
      struct I {
        kc::DeviceBuffer<int32_t>* b;
        int64_t n;
      };
      for (I i : {I{&ws.w_slots, r * heads * n_w}, I{&ws.r_slots, r * heads * n_r},
                  I{&ws.w_rows, r * heads * n_w}, I{&ws.r_refs, r * heads * n_r}}) {
        SDM_RETURN_IF_ERROR(CudaStatus(i.b->Allocate(i.n), "allocating activations"));
      }
      ws.rows = r;
    }
    int64_t scratch = 0, counters = 0;
    for (int64_t li = 0; li < cfg_.n_layers; ++li) {
      if (layers_[li].type == LayerType::kSdm) continue;
      const kc::AttentionDims dims = Dims(attention_geom_[li]);
      scratch = std::max(scratch, kc::AttentionDecodeScratchFloats(rows, dims, max_visible));
      counters = std::max(counters, kc::AttentionDecodeCounters(rows, dims));
    }
    if (scratch > static_cast<int64_t>(ws.attn_scratch.size())) {
      graphs_.Clear();
      SDM_RETURN_IF_ERROR(
          CudaStatus(ws.attn_scratch.Allocate(scratch), "allocating attention scratch"));
    }
    if (scratch > 0 && counters > static_cast<int64_t>(ws.attn_counters.size())) {
      graphs_.Clear();
      SDM_RETURN_IF_ERROR(
          CudaStatus(ws.attn_counters.Allocate(counters), "allocating attention counters"));
      // Zero once: every decode attention launch leaves them zero (kc::AttentionDecodeScratch).
      // Not kept unless zeroed, so that a later step allocates and zeroes them again.
      const cudaError_t zeroed =
          cudaMemsetAsync(ws.attn_counters.get(), 0, ws.attn_counters.bytes(), ctx_->compute());
      if (zeroed != cudaSuccess) ws.attn_counters.Reset();
      SDM_RETURN_IF_ERROR(CudaStatus(zeroed, "zeroing attention counters"));
    }
    return absl::OkStatus();
  }

  // Pinned room for the logits of `rows` rows, and room for `draws` tokens drawn on the device,
  // in powers of two from 64 rows; before the pass's first enqueue (cudaMallocHost may
  // synchronise the device, and an allocation failure then changes nothing).
  absl::Status EnsureOutputs(int64_t rows, int64_t draws) {
    auto grown = [](int64_t need) {
      int64_t r = 64;
      while (r < need) r *= 2;
      return r;
    };
    const int64_t vocab = cfg_.vocab_size;
    Workspace& ws = ws_;
    if (rows * vocab > static_cast<int64_t>(ws.logits_host.size())) {
      graphs_.Clear();
      SDM_RETURN_IF_ERROR(
          CudaStatus(ws.logits_host.Allocate(grown(rows) * vocab), "allocating pinned logits"));
    }
    // All three: an allocation that failed part-way leaves the others as they were.
    if (draws > static_cast<int64_t>(ws.sampled.size()) ||
        draws > static_cast<int64_t>(ws.sampled_host.size()) ||
        kc::SampleTokensScratchBytes(draws, vocab) >
            static_cast<int64_t>(ws.sample_scratch.size())) {
      graphs_.Clear();
      const int64_t r = grown(draws);
      SDM_RETURN_IF_ERROR(CudaStatus(ws.sampled.Allocate(r), "allocating sampled tokens"));
      SDM_RETURN_IF_ERROR(CudaStatus(ws.sampled_host.Allocate(r), "allocating sampled tokens"));
      SDM_RETURN_IF_ERROR(
          CudaStatus(ws.sample_scratch.Allocate(kc::SampleTokensScratchBytes(r, vocab)),
                     "allocating sampling scratch"));
    }
    return absl::OkStatus();
  }

  static kc::AttentionDims Dims(const AttentionGeometry& g) {
    kc::AttentionDims d;
    d.n_heads = static_cast<int32_t>(g.n_heads);
    d.n_kv_heads = static_cast<int32_t>(g.n_kv_heads);
    d.head_dim = static_cast<int32_t>(g.head_dim);
    d.window = g.window;
    return d;
  }

  // Device pointers into the step's upload (see Forward).
  struct StepArrays {
    const int32_t* tokens;
    const int32_t* positions;  // [n] per row
    const int32_t* row_seq;    // [n] segment of each row
    const int32_t* seg_first;  // [S]
    const int32_t* seg_len;    // [S]
    const int32_t* seg_pos;    // [S] position of each segment's last token (decode queries)
    // [m + d] rows whose logits the pass computes: the m it returns, then the d it draws from.
    const int32_t* logit_rows;
    const kc::RowSampling* draws;  // [d] how to draw each of the last d rows' tokens
    // Per layer [S] device pointers: page tables (attention) or slot tables (SDM); row counters
    // and written marks (SDM).
    std::vector<int32_t* const*> tables;
    std::vector<int32_t* const*> counters;
    std::vector<uint8_t* const*> written;
  };

  bool DrawsOnDevice() const override { return true; }

  absl::Status Forward(std::span<const int32_t> tokens, std::span<const Segment> segs,
                       const ForwardOutputs& out, ForwardProfiler& profiler) override {
    const int64_t n = static_cast<int64_t>(tokens.size());
    const int64_t m = static_cast<int64_t>(out.logit_rows.size());
    const int64_t d = static_cast<int64_t>(out.draws.size());
    const int64_t num_segs = static_cast<int64_t>(segs.size());
    cudaStream_t stream = ctx_->compute();

    // (1) Residency and pages. A failure before the first enqueue changes no session: the
    // sessions this pass attached go back to the host (their layers are what was uploaded), with
    // their staged images, so that a step that does not fit (RESOURCE_EXHAUSTED) holds no device
    // memory for sessions that then wait (server/scheduler.h defers one and retries without it).
    AttachedThisPass attached;
    absl::Status prepared = Prepare(segs, attached);
    if (!prepared.ok()) {
      attached.Undo();
      return prepared;
    }
    int64_t max_visible = 1;
    for (const Segment& s : segs) max_visible = std::max(max_visible, s.pos0 + s.length);
    const int64_t n_w = sdm_geom_.heads > 0 ? sdm_geom_.writes : 0;
    const int64_t n_r = sdm_geom_.heads > 0 ? AddressCount(cfg_.sdm.num_reads) : 0;
    // A decode step may run as a graph (file comment), its attention grid from a rounded bound.
    bool decode_only = num_segs > 0;
    for (const Segment& s : segs) decode_only = decode_only && s.length == 1;
    std::optional<DecodeGraphKey> graph;
    if (options_.cuda_graphs && decode_only && !profiler.enabled() &&
        !options_.observe_sdm_readings && options_.inject_forward_fault < 0) {
      max_visible = kernels::DecodeGraphVisible(max_visible, kc::kAttentionSplitTokens);
      graph = DecodeGraphKey{.sessions = num_segs,
                             .logit_rows = m,
                             .draws = d,
                             .gathered = !LogitRowsInPlace(out, n),
                             .visible = max_visible};
    }
    const StepLayout layout = StepLayoutOf(n, num_segs, m, d);
    // A row both returned and drawn from is computed twice (m + d <= 2n rows of logits).
    // Every GEMM of the pass planned (descriptors, algorithms) before anything is enqueued: past
    // this point only a launch itself can fail.
    prepared = EnsureWorkspace(std::max(n, m + d), max_visible);
    if (prepared.ok()) prepared = EnsureOutputs(m, d);
    if (prepared.ok()) prepared = EnsureStepArrays(layout.bytes);
    if (prepared.ok()) prepared = PlanGemms(n, m + d);
    if (!prepared.ok()) {
      attached.Undo();
      return prepared;
    }
    // Counted once the pass keeps them (an undone upload's image is used again by its retry).
    staged_used_.fetch_add(attached.staged_uploads(), std::memory_order_relaxed);

    // (3)-(5) enqueued; whatever happens, the stream is synchronised before returning (the
    // pinned step arrays and logits outlive their copies), and a failure
    // after the first write to session state marks the step's sessions failed (ForwardCommit).
    ForwardCommit commit(segs);
    commit_ = &commit;
    absl::Status status =
        Enqueue(tokens, segs, out, profiler, n_w, n_r, layout, max_visible, graph);
    commit_ = nullptr;
    if (status.ok()) status = ctx_->StartRefresh();
    const absl::Status synced = CudaStatus(cudaStreamSynchronize(stream), "forward pass");
    if (status.ok() && synced.ok()) status = ctx_->FinishRefresh();
    if (status.ok() && synced.ok()) {
      if (m > 0) {
        std::memcpy(out.logits, ws_.logits_host.get(), m * cfg_.vocab_size * sizeof(float));
      }
      if (d > 0) std::memcpy(out.sampled, ws_.sampled_host.get(), d * sizeof(int32_t));
      profiler.Lap(&EngineProfile::head_seconds);  // the stream is synchronised already
      return absl::OkStatus();
    }
    if (status.ok()) {
      status = synced;
    } else if (!synced.ok()) {
      status =
          absl::Status(status.code(), absl::StrCat(status.message(), "; then ", synced.message()));
    }
    return commit.Fail(status);
  }

  // The sessions a pass attached to the device (uploaded) before its first enqueue, with the
  // staged images their uploads used. Undo() detaches them again and gives the images back: their
  // host layers are still the truth (an upload copies them unchanged, and nothing of the pass ran
  // yet), so the session is as it was before the pass.
  class AttachedThisPass {
   public:
    void Add(SessionState* session, std::unique_ptr<StagedUpload> staged) {
      sessions_.push_back({session, std::move(staged)});
    }
    // Uploads that came from a staged image of ours.
    int64_t staged_uploads() const {
      return std::count_if(sessions_.begin(), sessions_.end(),
                           [](const Attached& a) { return a.staged != nullptr; });
    }
    void Undo() {
      for (Attached& a : sessions_) {
        a.session->DetachDevice();  // stream-ordered frees: nothing of it is pending but them
        if (a.staged != nullptr) a.session->AttachStaged(std::move(a.staged));
      }
      sessions_.clear();
    }

   private:
    struct Attached {
      SessionState* session;
      std::unique_ptr<StagedUpload> staged;  // the image its upload used, if any
    };
    std::vector<Attached> sessions_;
  };

  // Steps (1) and (2) of Forward (file comment): every segment's session on this device (uploaded
  // when it is not; those are recorded in `attached`), pages for the positions the pass writes,
  // and room for the rows its copy-on-write may take. Enqueues nothing that changes a session.
  absl::Status Prepare(std::span<const Segment> segs, AttachedThisPass& attached) {
    for (const Segment& seg : segs) {
      SessionState& session = *seg.session;
      if (!session.on_device()) {
        // From the image staged ahead (StageResume) when there is one of ours; another
        // backend's is of no use here and goes when the session is attached.
        std::unique_ptr<StagedUpload> staged = session.TakeStaged();
        const CudaStagedUpload* ours = staged != nullptr && staged->owner() == ctx_.get()
                                           ? static_cast<const CudaStagedUpload*>(staged.get())
                                           : nullptr;
        absl::StatusOr<std::unique_ptr<CudaSessionState>> up =
            CudaSessionState::Upload(ctx_, session, ours);
        if (!up.ok()) {
          // Nothing of the session changed: a retry may still use the staged image.
          if (staged != nullptr) session.AttachStaged(std::move(staged));
          return up.status();
        }
        session.AttachDevice(*std::move(up));
        attached.Add(&session, ours != nullptr ? std::move(staged) : nullptr);
      }
      // Another engine's residency has tables into that engine's arenas (and may be of another
      // type): only ours, made with our context as owner, is a CudaSessionState we may step.
      if (session.device()->owner() != ctx_.get()) {
        return absl::FailedPreconditionError(
            "session is resident on another backend's device; sync it to the host first");
      }
      SDM_RETURN_IF_ERROR(
          static_cast<CudaSessionState*>(session.device())->EnsurePages(seg.pos0 + seg.length));
    }
    const int64_t n_sdm = ctx_->num_sdm_layers();
    if (n_sdm == 0) return absl::OkStatus();
    const int64_t n_w = sdm_geom_.heads > 0 ? sdm_geom_.writes : 0;
    // A segment takes at most `writes` rows per token and head, never more than a table has
    // slots (without that cap a long prefill chunk reserves many sessions' worth of rows: 256
    // tokens x 32 writes = 2x debug_sdm's 4096 slots, and fails on an arena that can hold the
    // session), and never more than its table's slots that are not private yet (a row is taken
    // only for a slot that has none: copy-on-write), which the row counters say exactly between
    // steps (CudaDeviceContext::row_count): a session whose table is full reserves nothing.
    const int64_t table_rows = sdm_geom_.slots_per_head * sdm_geom_.heads;
    int64_t rows = 0;
    for (const Segment& s : segs) {
      const int64_t per_layer =
          std::min(s.length * n_w, sdm_geom_.slots_per_head) * sdm_geom_.heads;
      const int32_t counter = static_cast<CudaSessionState*>(s.session->device())->counter_slot();
      for (int64_t i = 0; i < n_sdm; ++i) {
        rows += std::clamp<int64_t>(table_rows - ctx_->row_count(counter, i), 0, per_layer);
      }
    }
    return ctx_->ReserveRows(rows);
  }

  // Whether the pass's logit rows (the returned, then the drawn) are its n rows in order: then
  // the final norm reads the rows in place, else one launch gathers them first.
  static bool LogitRowsInPlace(const ForwardOutputs& out, int64_t n) {
    const int64_t m = static_cast<int64_t>(out.logit_rows.size());
    if (m + static_cast<int64_t>(out.draws.size()) != n) return false;
    for (int64_t i = 0; i < m; ++i) {
      if (out.logit_rows[i] != i) return false;
    }
    for (size_t i = 0; i < out.draws.size(); ++i) {
      if (out.draws[i].row != m + static_cast<int64_t>(i)) return false;
    }
    return true;
  }

  // The step's upload: pointers, then the draws' params (8-byte aligned after the pointers), then
  // integers.
  struct StepLayout {
    size_t ptr_count = 0;
    size_t draws_bytes = 0;
    size_t int_count = 0;
    size_t bytes = 0;
  };
  StepLayout StepLayoutOf(int64_t n, int64_t num_segs, int64_t m, int64_t d) const {
    static_assert(sizeof(kc::RowSampling) % alignof(int32_t) == 0);
    static_assert(alignof(kc::RowSampling) <= sizeof(void*));
    StepLayout l;
    l.int_count = 3 * n + 3 * num_segs + m + d;
    l.ptr_count = 3 * cfg_.n_layers * num_segs;
    l.draws_bytes = d * sizeof(kc::RowSampling);
    l.bytes = l.ptr_count * sizeof(void*) + l.draws_bytes + l.int_count * sizeof(int32_t);
    return l;
  }

  // Room for the step's upload, device and pinned host, before the pass's first enqueue (and
  // outside any capture: allocations are not allowed in one). Twice what this step needs, so a
  // batch that grows by a few sessions does not reallocate (which drops every decode graph).
  // One buffer, not two alternating: a pass synchronises before it returns, so the next pass
  // never writes the image while a copy of it is pending.
  absl::Status EnsureStepArrays(size_t bytes) {
    Workspace& ws = ws_;
    // Both: a failed pinned allocation leaves the device half grown and the host half empty.
    if (ws.step.size() >= bytes && ws.step_host.size() >= bytes) return absl::OkStatus();
    graphs_.Clear();
    SDM_RETURN_IF_ERROR(CudaStatus(ws.step.Allocate(bytes * 2), "allocating step arrays"));
    return CudaStatus(ws.step_host.Allocate(bytes * 2), "allocating step arrays");
  }

  // The sessions' device state is about to change (the pass's first KV append or SDM row
  // preparation): a failure from here marks them failed. Nothing changes while capturing.
  void BeginStateWrites() {
    if (commit_ != nullptr) commit_->Begin();
  }

  // Steps (3) to (5) of Forward (file comment) up to the final synchronisation, enqueued on the
  // compute stream: launch by launch, or as the decode graph for `graph` (captured if new).
  // `decode_visible` bounds the decode batch's visible positions (its attention grid).
  absl::Status Enqueue(std::span<const int32_t> tokens, std::span<const Segment> segs,
                       const ForwardOutputs& out, ForwardProfiler& profiler, int64_t n_w,
                       int64_t n_r, const StepLayout& layout, int64_t decode_visible,
                       const std::optional<DecodeGraphKey>& graph) {
    const int64_t n = static_cast<int64_t>(tokens.size());
    const int64_t num_segs = static_cast<int64_t>(segs.size());
    const int64_t dim = cfg_.dim;
    cudaStream_t stream = ctx_->compute();
    std::vector<CudaSessionState*> dev(num_segs);
    for (int64_t s = 0; s < num_segs; ++s) {
      dev[s] = static_cast<CudaSessionState*>(segs[s].session->device());
    }

    // (3) One upload of the step's integers and pointers.
    Workspace& ws = ws_;
    const int64_t n_layers = cfg_.n_layers;
    const int64_t m = static_cast<int64_t>(out.logit_rows.size());
    const int64_t d = static_cast<int64_t>(out.draws.size());
    const int64_t ml = m + d;  // rows whose logits are computed: the returned, then the drawn
    const bool logits_in_place = LogitRowsInPlace(out, n);  // ml == n, row i's logits in row i
    const size_t ptr_count = layout.ptr_count;
    const size_t draws_bytes = layout.draws_bytes;
    const size_t bytes = layout.bytes;
    unsigned char* h = ws.step_host.get();
    auto** hp = reinterpret_cast<int32_t**>(h);
    auto* hd = reinterpret_cast<kc::RowSampling*>(h + ptr_count * sizeof(void*));
    for (int64_t i = 0; i < d; ++i) {
      const SamplingParams& p = *out.draws[i].params;
      hd[i] = kc::RowSampling{p.temperature, static_cast<int32_t>(p.top_k), p.top_p, p.seed,
                              out.draws[i].draw_index};
    }
    auto* hi = reinterpret_cast<int32_t*>(h + ptr_count * sizeof(void*) + draws_bytes);
    for (int64_t l = 0; l < n_layers; ++l) {
      const int64_t si = ctx_->sdm_index(l);
      for (int64_t s = 0; s < num_segs; ++s) {
        hp[(3 * l) * num_segs + s] = si >= 0 ? dev[s]->sdm_table(l) : dev[s]->page_table(l);
        hp[(3 * l + 1) * num_segs + s] =
            si >= 0 ? ctx_->row_counter(dev[s]->counter_slot(), si) : nullptr;
        hp[(3 * l + 2) * num_segs + s] =
            si >= 0 ? reinterpret_cast<int32_t*>(dev[s]->written_marks(l)) : nullptr;
      }
    }
    int32_t* h_tokens = hi;
    int32_t* h_pos = h_tokens + n;
    int32_t* h_seq = h_pos + n;
    int32_t* h_first = h_seq + n;
    int32_t* h_len = h_first + num_segs;
    int32_t* h_segpos = h_len + num_segs;
    int32_t* h_logit_rows = h_segpos + num_segs;
    for (int64_t i = 0; i < m; ++i) h_logit_rows[i] = static_cast<int32_t>(out.logit_rows[i]);
    for (int64_t i = 0; i < d; ++i) h_logit_rows[m + i] = static_cast<int32_t>(out.draws[i].row);
    for (int64_t r = 0; r < n; ++r) h_tokens[r] = tokens[r];
    for (int64_t s = 0; s < num_segs; ++s) {
      h_first[s] = static_cast<int32_t>(segs[s].first_row);
      h_len[s] = static_cast<int32_t>(segs[s].length);
      h_segpos[s] = static_cast<int32_t>(segs[s].pos0 + segs[s].length - 1);
      for (int64_t t = 0; t < segs[s].length; ++t) {
        h_pos[segs[s].first_row + t] = static_cast<int32_t>(segs[s].pos0 + t);
        h_seq[segs[s].first_row + t] = static_cast<int32_t>(s);
      }
    }
    StepArrays arr;
    int32_t* const* dp = reinterpret_cast<int32_t* const*>(ws.step.get());
    arr.draws = reinterpret_cast<const kc::RowSampling*>(ws.step.get() + ptr_count * sizeof(void*));
    auto* di =
        reinterpret_cast<const int32_t*>(ws.step.get() + ptr_count * sizeof(void*) + draws_bytes);
    arr.tokens = di;
    arr.positions = di + n;
    arr.row_seq = di + 2 * n;
    arr.seg_first = di + 3 * n;
    arr.seg_len = arr.seg_first + num_segs;
    arr.seg_pos = arr.seg_len + num_segs;
    arr.logit_rows = arr.seg_pos + num_segs;
    for (int64_t l = 0; l < n_layers; ++l) {
      arr.tables.push_back(dp + (3 * l) * num_segs);
      arr.counters.push_back(dp + (3 * l + 1) * num_segs);
      arr.written.push_back(reinterpret_cast<uint8_t* const*>(dp + (3 * l + 2) * num_segs));
    }

    auto enqueue_device = [&]() -> absl::Status {
      SDM_RETURN_IF_ERROR(
          Launched(cudaMemcpyAsync(ws.step.get(), h, bytes, cudaMemcpyHostToDevice, stream),
                   "uploading step arrays"));

      // (4) The layers.
      // The kernels run asynchronously: a lap waits for the stream, and only when profiling.
      auto lap = [&](double EngineProfile::*part) -> absl::Status {
        if (!profiler.enabled()) return absl::OkStatus();
        SDM_RETURN_IF_ERROR(Launched(cudaStreamSynchronize(stream), "profiling"));
        profiler.Lap(part);
        return absl::OkStatus();
      };
      const float eps = static_cast<float>(cfg_.norm_eps);
      // The embedding and the first layer's attention norm in one launch.
      SDM_RETURN_IF_ERROR(Launched(
          kc::EmbeddingRmsNorm(tok_embeddings_, arr.tokens, ws.x.get(), layers_[0].attention_norm,
                               n, dim, eps, nullptr, ws.xb.get(), stream),
          "embedding and attention norm"));
      SDM_RETURN_IF_ERROR(lap(&EngineProfile::head_seconds));
      // The single-token segments come first (engine_backend.h): they form one decode batch.
      int64_t singles = 0;
      int64_t singles_visible = 1;
      while (singles < num_segs && segs[singles].length == 1) {
        singles_visible = std::max(singles_visible, segs[singles].pos0 + 1);
        ++singles;
      }
      if (graph.has_value()) singles_visible = decode_visible;  // every segment is a single
      for (int64_t li = 0; li < n_layers; ++li) {
        const DeviceLayer& l = layers_[li];
        // The previous layer's FFN residual (in ws.tmp) is added by the same launch as this norm
        // (the first layer's norm came with the embedding).
        if (li > 0) {
          SDM_RETURN_IF_ERROR(Launched(kc::AddRmsNorm(ws.tmp.get(), ws.x.get(), l.attention_norm, n,
                                                      dim, eps, nullptr, ws.xb.get(), stream),
                                       "attention norm"));
        }
        if (l.type == LayerType::kSdm) {
          SDM_RETURN_IF_ERROR(SdmMixer(li, l.sdm, n, n_w, n_r, segs, arr));
          SDM_RETURN_IF_ERROR(lap(&EngineProfile::sdm_seconds));
        } else {
          SDM_RETURN_IF_ERROR(
              AttentionMixer(li, l.attention, n, singles, singles_visible, segs, arr));
          SDM_RETURN_IF_ERROR(lap(l.type == LayerType::kSwa ? &EngineProfile::swa_seconds
                                                            : &EngineProfile::attn_seconds));
        }
        SDM_RETURN_IF_ERROR(Launched(kc::AddRmsNorm(ws.tmp.get(), ws.x.get(), l.ffn_norm, n, dim,
                                                    eps, nullptr, ws.xb.get(), stream),
                                     "residual and ffn norm"));
        // w1 and w3 as one GEMM (engine/stacked_projection.h), then SwiGLU of their parts.
        const DeviceStack& ffn = stacks_[li].ffn_in;
        SDM_RETURN_IF_ERROR(Linear(ws.xb.get(), n, ffn.w, ffn.bias, ws.ffn_in.get()));
        SDM_RETURN_IF_ERROR(Launched(
            kc::SwiGlu(ffn.Part(ws.ffn_in.get(), kFfnGate), ffn.Part(ws.ffn_in.get(), kFfnUp), n,
                       hidden_, ffn.stride(), ws.hb.get(), stream),
            "swiglu"));
        SDM_RETURN_IF_ERROR(Linear(ws.hb.get(), n, l.w2, nullptr, ws.tmp.get()));
        // The residual is added by the next layer's norm; the last layer's by the final norm
        // where the logit rows are the step's rows in order, else here (before the gather).
        if (li + 1 == n_layers && ml > 0 && !logits_in_place) {
          SDM_RETURN_IF_ERROR(
              Launched(kc::AddInPlace(ws.tmp.get(), ws.x.get(), n * dim, stream), "residual"));
        }
        SDM_RETURN_IF_ERROR(lap(&EngineProfile::ffn_seconds));
      }

      // (5) Logits and draws, counters, one synchronisation.
      if (ml > 0) {
        if (logits_in_place) {
          SDM_RETURN_IF_ERROR(Launched(kc::AddRmsNorm(ws.tmp.get(), ws.x.get(), final_norm_, ml,
                                                      dim, eps, nullptr, ws.final_b.get(), stream),
                                       "residual and final norm"));
        } else {
          // One launch gathers the rows (not one copy per row): an fp32 row of `dim` values is
          // moved as a block of 2 * dim 16-bit halves, bit for bit.
          SDM_RETURN_IF_ERROR(Launched(
              kc::GatherBlocks(reinterpret_cast<const bf16*>(ws.x.get()), 2 * dim, arr.logit_rows,
                               ml, reinterpret_cast<bf16*>(ws.tmp.get()), stream),
              "gathering logit rows"));
          SDM_RETURN_IF_ERROR(Launched(kc::RmsNorm(ws.tmp.get(), final_norm_, ml, dim, eps, nullptr,
                                                   ws.final_b.get(), stream),
                                       "final norm"));
        }
        SDM_RETURN_IF_ERROR(Linear(ws.final_b.get(), ml, output_, nullptr, ws.logits.get()));
      }
      if (m > 0) {
        SDM_RETURN_IF_ERROR(Launched(
            cudaMemcpyAsync(ws.logits_host.get(), ws.logits.get(),
                            m * cfg_.vocab_size * sizeof(float), cudaMemcpyDeviceToHost, stream),
            "downloading logits"));
      }
      if (d > 0) {
        // The drawn rows' logits never leave the device: only their tokens come down.
        SDM_RETURN_IF_ERROR(
            Launched(kc::SampleTokens(ws.logits.get() + m * cfg_.vocab_size, d, cfg_.vocab_size,
                                      arr.draws, ws.sample_scratch.get(), ws.sampled.get(), stream),
                     "sampling"));
        SDM_RETURN_IF_ERROR(
            Launched(cudaMemcpyAsync(ws.sampled_host.get(), ws.sampled.get(), d * sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, stream),
                     "downloading sampled tokens"));
      }
      return absl::OkStatus();
    };
    if (!graph.has_value()) return enqueue_device();
    return EnqueueAsGraph(*graph, enqueue_device);
  }

  // Runs `enqueue_device` (steps (3) to (5)) as the graph for `key`: captured the first time,
  // replayed after. A shape whose capture failed runs launch by launch from then on.
  template <typename EnqueueFn>
  absl::Status EnqueueAsGraph(const DecodeGraphKey& key, EnqueueFn& enqueue_device) {
    GraphExec* exec = graphs_.Find(key);
    if (exec == nullptr && !graphs_.Refused(key)) {
      absl::StatusOr<GraphExec> captured = Capture(enqueue_device);
      if (captured.ok()) {
        exec = graphs_.Insert(key, *std::move(captured));
        ++graph_stats_.captures;
      } else {
        graphs_.Refuse(key);
        ++graph_stats_.refusals;
        SDM_LOG(WARNING) << "sdm cuda: decode steps of " << key.sessions
                         << " sessions run launch by launch (their graph: " << captured.status()
                         << ")";
      }
    }
    if (exec == nullptr) return enqueue_device();
    BeginStateWrites();
    ++graph_stats_.replays;
    return Launched(cudaGraphLaunch(exec->get(), ctx_->compute()), "launching the decode graph");
  }

  // Captures what `enqueue_device` enqueues on the compute stream (nothing runs) and instantiates
  // it. The stream leaves capture mode whatever happens.
  template <typename EnqueueFn>
  absl::StatusOr<GraphExec> Capture(EnqueueFn& enqueue_device) {
    cudaStream_t stream = ctx_->compute();
    SDM_RETURN_IF_ERROR(CudaStatus(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
                                   "beginning the decode graph's capture"));
    ForwardCommit* pass = std::exchange(commit_, nullptr);  // capturing changes no session
    const absl::Status enqueued = enqueue_device();
    commit_ = pass;
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
    cudaGetLastError();  // a launch refused while capturing leaves its error here
    cudaGraphExec_t exec = nullptr;
    cudaError_t instantiated = cudaSuccess;
    if (graph != nullptr) {
      if (enqueued.ok() && ended == cudaSuccess) {
        instantiated = cudaGraphInstantiate(&exec, graph, 0);
      }
      cudaGraphDestroy(graph);  // the instance does not need it
    }
    SDM_RETURN_IF_ERROR(enqueued);
    SDM_RETURN_IF_ERROR(CudaStatus(ended, "capturing the decode step"));
    SDM_RETURN_IF_ERROR(CudaStatus(instantiated, "instantiating the decode graph"));
    return GraphExec(exec);
  }

  // An SDM mixer's readings without their norm: `mixed` [n, width] times sigmoid(gate) when the
  // layer has a gate (`gate`: the gate projection's output, rows gate_stride apart; the gate and
  // the conversion to wo's bf16 input in one launch), else only converted; then wo into ws.tmp.
  // (Attention kernels and LayerNormToBf16 write wo's input themselves.)
  absl::Status GatedOutput(int64_t n, const float* mixed, int64_t width, const float* gate,
                           int64_t gate_stride, const DeviceMatrix& wo, const float* wo_bias) {
    Workspace& ws = ws_;
    cudaStream_t stream = ctx_->compute();
    if (gate != nullptr) {
      SDM_RETURN_IF_ERROR(Launched(
          kc::MulSigmoidToBf16(gate, gate_stride, mixed, n, width, ws.ob.get(), stream), "gate"));
    } else {
      SDM_RETURN_IF_ERROR(
          Launched(kc::FloatToBf16(mixed, n * width, ws.ob.get(), stream), "convert"));
    }
    return Linear(ws.ob.get(), n, wo, wo_bias, ws.tmp.get());
  }

  // A launch's result inside the pass: the fault-injection seam (EngineOptions::
  // inject_forward_fault) fires here once the pass began writing session state.
  absl::Status Launched(cudaError_t err, const char* what) {
    if (err == cudaSuccess && commit_ != nullptr && commit_->begun() && fault_.Fire()) {
      return absl::InternalError(absl::StrCat("injected fault at ", what));
    }
    return CudaStatus(err, what);
  }

  // Plans every GEMM a pass of n rows and m logit rows runs (the same operands, in any order):
  // Linear below refuses an unplanned one.
  absl::Status PlanGemms(int64_t n, int64_t m) {
    Workspace& ws = ws_;
    auto plan = [&](const bf16* x, int64_t rows, const DeviceMatrix& w, const float* bias,
                    float* y) -> absl::Status {
      if (w.w == nullptr) return absl::OkStatus();  // an absent optional matrix
      if (!gemm_.Plan(x, rows, w.w, w.out, w.in, bias, y)) {
        return absl::InternalError("cuBLASLt planning: " + gemm_.error());
      }
      return absl::OkStatus();
    };
    for (size_t li = 0; li < layers_.size(); ++li) {
      const DeviceLayer& l = layers_[li];
      const LayerStacks& stacks = stacks_[li];
      SDM_RETURN_IF_ERROR(
          plan(ws.xb.get(), n, stacks.mixer_in.w, stacks.mixer_in.bias, ws.mixer_in.get()));
      if (l.type == LayerType::kSdm) {
        SDM_RETURN_IF_ERROR(plan(ws.ob.get(), n, l.sdm.wo, l.sdm.bo, ws.tmp.get()));
      } else {
        SDM_RETURN_IF_ERROR(plan(ws.ob.get(), n, l.attention.wo, nullptr, ws.tmp.get()));
      }
      SDM_RETURN_IF_ERROR(
          plan(ws.xb.get(), n, stacks.ffn_in.w, stacks.ffn_in.bias, ws.ffn_in.get()));
      SDM_RETURN_IF_ERROR(plan(ws.hb.get(), n, l.w2, nullptr, ws.tmp.get()));
    }
    if (m > 0) SDM_RETURN_IF_ERROR(plan(ws.final_b.get(), m, output_, nullptr, ws.logits.get()));
    return absl::OkStatus();
  }

  absl::Status Linear(const bf16* x, int64_t m, const DeviceMatrix& w, const float* bias,
                      float* y) {
    if (!gemm_.LinearPlanned(x, m, w.w, w.out, w.in, bias, y, ctx_->compute())) {
      return absl::InternalError("cuBLASLt: " + gemm_.error());
    }
    if (commit_ != nullptr && commit_->begun() && fault_.Fire()) {
      return absl::InternalError("injected fault after a GEMM");
    }
    return absl::OkStatus();
  }

  // Segments [0, singles) are single tokens at rows 0 .. singles - 1 (one decode batch whose
  // positions are below singles_visible); the others run the prefill kernel one by one.
  absl::Status AttentionMixer(int64_t li, const AttentionTensors<DeviceMatrix, const float*>& a,
                              int64_t n, int64_t singles, int64_t singles_visible,
                              std::span<const Segment> segs, const StepArrays& arr) {
    Workspace& ws = ws_;
    cudaStream_t stream = ctx_->compute();
    const AttentionGeometry& g = attention_geom_[li];
    const int64_t q_width = g.n_heads * g.head_dim;
    const float theta = static_cast<float>(cfg_.rope_theta);
    // q, k, v and the gate as one GEMM (engine/stacked_projection.h); each kernel reads its
    // part of the output's rows.
    const DeviceStack& in = stacks_[li].mixer_in;
    SDM_RETURN_IF_ERROR(Linear(ws.xb.get(), n, in.w, in.bias, ws.mixer_in.get()));
    const int64_t stride = in.stride();
    float* q = in.Part(ws.mixer_in.get(), kAttnQuery);
    const float* k = in.Part(ws.mixer_in.get(), kAttnKey);
    const float* v = in.Part(ws.mixer_in.get(), kAttnValue);
    kc::KvLayerView view = ctx_->kv_arena(li);
    view.page_tables = arr.tables[li];
    const kc::AttentionDims dims = Dims(g);
    BeginStateWrites();  // the KV append writes the sessions' caches
    // RoPE of q (in place) and of k, and the append of k and v, in one launch.
    SDM_RETURN_IF_ERROR(Launched(
        kc::RopeKvAppend(q, k, v, stride, n, arr.row_seq, arr.positions, theta, dims, view, stream),
        "rope and kv append"));
    // The attention kernels write wo's bf16 input themselves, gated when the layer has a gate
    // (kc::AttentionOutput: what GatedOutput would make of their fp32 output).
    const float* gate = a.w_gate.w != nullptr ? in.Part(ws.mixer_in.get(), kAttnGate) : nullptr;
    const auto output_from = [&](int64_t row) {
      return kc::AttentionOutput{.f32 = nullptr,
                                 .bf16 = ws.ob.get() + row * q_width,
                                 .gate = gate != nullptr ? gate + row * stride : nullptr,
                                 .gate_stride = stride};
    };
    if (singles > 0) {
      // Segment s < singles has its query at row s and its page table at index s.
      SDM_RETURN_IF_ERROR(
          Launched(kc::AttentionDecode(q, stride, singles, arr.seg_pos, singles_visible, view, dims,
                                       {ws.attn_scratch.get(), ws.attn_counters.get()},
                                       output_from(0), stream),
                   "decode attention"));
    }
    for (int64_t s = singles; s < static_cast<int64_t>(segs.size()); ++s) {
      const int64_t row = segs[s].first_row;
      SDM_RETURN_IF_ERROR(Launched(
          kc::AttentionPrefill(q + row * stride, stride, segs[s].length, segs[s].pos0,
                               static_cast<int32_t>(s), view, dims, output_from(row), stream),
          "prefill attention"));
    }
    return Linear(ws.ob.get(), n, a.wo, nullptr, ws.tmp.get());
  }

  // The inputs both SDM step paths take (kc::SdmStepArgs, kc::SdmDecodeArgs): the activated
  // write and read weights, the gates, v, the update rule, M0 and where the readings go.
  template <typename StepArgs>
  void SetSdmUpdateInputs(const __nv_bfloat16* m0, int64_t n_w, int64_t n_r, const float* v,
                          int64_t v_stride, StepArgs& a) {
    const Workspace& ws = ws_;
    a.w_weights = ws.w_weights.get();
    a.n_w = n_w;
    a.r_weights = ws.r_weights.get();
    a.n_r = n_r;
    a.log_decay = ws.log_decay.get();
    a.beta = ws.beta.get();
    a.v = v;
    a.v_stride = v_stride;
    a.key_weighted_decay = cfg_.sdm.key_weighted_decay;
    a.slot_residual = cfg_.sdm.update_rule == UpdateRule::kSlotResidual;
    a.m0 = m0;
    a.readings = ws.readings.get();
  }

  // The general SDM step (multi-token segments): rows prepared, then the fused write and read.
  absl::Status SdmPrefillStep(const SdmTensors<DeviceMatrix, const float*>& w, int64_t n_w,
                              int64_t n_r, const float* v, int64_t v_stride,
                              const kc::SdmSegments& sg, const kc::SdmDims& dims) {
    Workspace& ws = ws_;
    cudaStream_t stream = ctx_->compute();
    SDM_RETURN_IF_ERROR(
        Launched(kc::SdmPrepareRows(ws.w_slots.get(), n_w, ws.r_slots.get(), n_r, sg, dims, w.m0.w,
                                    ctx_->row_arena(), ws.w_rows.get(), ws.r_refs.get(), stream),
                 "sdm row preparation"));
    kc::SdmStepArgs step;
    SetSdmUpdateInputs(w.m0.w, n_w, n_r, v, v_stride, step);
    step.w_rows = ws.w_rows.get();
    step.r_refs = ws.r_refs.get();
    SDM_RETURN_IF_ERROR(
        Launched(kc::SdmStep(step, sg, dims, ctx_->row_arena(), stream), "sdm step"));
    return absl::OkStatus();
  }

  absl::Status SdmMixer(int64_t li, const SdmTensors<DeviceMatrix, const float*>& w, int64_t n,
                        int64_t n_w, int64_t n_r, std::span<const Segment> segs,
                        const StepArrays& arr) {
    Workspace& ws = ws_;
    cudaStream_t stream = ctx_->compute();
    const SdmArgs& args = cfg_.sdm;
    const int64_t dim = cfg_.dim;
    const int64_t heads = sdm_geom_.heads;
    // The read query, write key, value, output gate and the gates' inputs as one GEMM
    // (engine/stacked_projection.h, with their biases); each kernel reads its part of the rows.
    const DeviceStack& in = stacks_[li].mixer_in;
    SDM_RETURN_IF_ERROR(Linear(ws.xb.get(), n, in.w, in.bias, ws.mixer_in.get()));
    const int64_t stride = in.stride();
    float* const out = ws.mixer_in.get();
    // Write and read addressing in one launch, each key's BatchNorm (when the layer has one)
    // applied as the addressing reads the key.
    const kc::SdmAddressJob addressing[2] = {
        {.scores = in.Part(out, kSdmWriteKey),
         .k = args.num_writes,
         .act = ToAddressAct(args.write_act),
         .scale = static_cast<float>(args.write_act_scale),
         .slots = ws.w_slots.get(),
         .weights = ws.w_weights.get(),
         .norm = {w.kbn_w, w.kbn_b, w.kbn_mean, w.kbn_var, kSdmBatchNormEps},
         .scores_stride = stride},
        {.scores = in.Part(out, kSdmReadQuery),
         .k = args.num_reads,
         .act = ToAddressAct(args.read_act),
         .scale = static_cast<float>(args.read_act_scale),
         .slots = ws.r_slots.get(),
         .weights = ws.r_weights.get(),
         .norm = {w.qbn_w, w.qbn_b, w.qbn_mean, w.qbn_var, kSdmBatchNormEps},
         .scores_stride = stride}};
    // The decay and beta gates in the same launch.
    const kc::SdmGateJob gates = {.a = in.Part(out, kSdmDecayInput),
                                  .b = in.Part(out, kSdmBetaInput),
                                  .in_stride = stride,
                                  .a_log = w.a_log,
                                  .dt_bias = w.dt_bias,
                                  .log_decay = ws.log_decay.get(),
                                  .beta = ws.beta.get()};
    SDM_RETURN_IF_ERROR(Launched(
        kc::SdmAddressJobs(addressing, n, heads, sdm_geom_.side, stream, gates), "addressing"));
    const float* v = in.Part(out, kSdmValue);
    kc::SdmSegments sg;
    sg.first_row = arr.seg_first;
    sg.length = arr.seg_len;
    sg.tables = arr.tables[li];
    sg.row_counts = arr.counters[li];
    sg.written = arr.written[li];
    sg.num = static_cast<int64_t>(segs.size());
    sg.max_length = 0;
    for (const Segment& s : segs) sg.max_length = std::max(sg.max_length, s.length);
    kc::SdmDims dims;
    dims.heads = heads;
    dims.side = sdm_geom_.side;
    dims.row_width = sdm_geom_.head_width;
    BeginStateWrites();  // from here the step allocates and writes the sessions' rows
    if (sg.max_length == 1) {
      // A decode batch: allocation, the write and the read in one launch (two for rows of more
      // than 16 tiles: kernels/cuda/sdm.h SdmDecodeStep), bit for bit what the general path
      // below computes.
      kc::SdmDecodeArgs dec;
      SetSdmUpdateInputs(w.m0.w, n_w, n_r, v, stride, dec);
      dec.w_slots = ws.w_slots.get();
      dec.r_slots = ws.r_slots.get();
      dec.w_rows = ws.w_rows.get();
      SDM_RETURN_IF_ERROR(
          Launched(kc::SdmDecodeStep(dec, sg, dims, ctx_->row_arena(), stream), "sdm decode step"));
    } else {
      SDM_RETURN_IF_ERROR(SdmPrefillStep(w, n_w, n_r, v, stride, sg, dims));
    }
    if (options_.observe_sdm_readings) {  // testing: the readings, to the host
      std::vector<float> readings(static_cast<size_t>(n * dim));
      SDM_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "observing readings"));
      SDM_RETURN_IF_ERROR(
          CudaStatus(cudaMemcpy(readings.data(), ws.readings.get(), readings.size() * sizeof(float),
                                cudaMemcpyDeviceToHost),
                     "observing readings"));
      options_.observe_sdm_readings(li, readings);
    }
    const float* gate = w.wog.w != nullptr ? in.Part(out, kSdmOutputGate) : nullptr;
    if (w.norm_w != nullptr) {
      // The readings' LayerNorm, the gate and the conversion to wo's input in one launch.
      SDM_RETURN_IF_ERROR(
          Launched(kc::LayerNormToBf16(ws.readings.get(), w.norm_w, w.norm_b, n * heads,
                                       sdm_geom_.head_width, static_cast<float>(args.norm_eps),
                                       gate, dim, stride, ws.ob.get(), stream),
                   "readings norm"));
      return Linear(ws.ob.get(), n, w.wo, w.bo, ws.tmp.get());
    }
    return GatedOutput(n, ws.readings.get(), dim, gate, stride, w.wo, w.bo);
  }

  std::shared_ptr<const Model> model_;
  const ModelConfig& cfg_;
  EngineOptions options_;
  const StateLayout& layout_;
  int64_t hidden_;
  SdmGeometry sdm_geom_;
  std::string device_name_;
  kc::BlasLtGemm gemm_;
  std::vector<kc::DeviceBuffer<bf16>> bf16_buffers_;
  std::vector<kc::DeviceBuffer<float>> f32_buffers_;
  int64_t weight_bytes_ = 0;
  int64_t state_bytes_ = 0;
  int64_t state_capacity_bytes_ = 0;
  double sessions_at_max_ = 0;  // sessions of max_context the arenas are sized for
  const bf16* tok_embeddings_ = nullptr;
  const float* final_norm_ = nullptr;
  DeviceMatrix output_;
  std::vector<DeviceLayer> layers_;
  std::vector<LayerStacks> stacks_;                // per layer
  std::vector<AttentionGeometry> attention_geom_;  // per layer (unused for sdm layers)
  std::shared_ptr<CudaDeviceContext> ctx_;
  Workspace ws_;
  ForwardFaultInjector fault_;
  // StageResume's counts (ResumeStagingStats): staging runs on other threads than the step.
  std::atomic<int64_t> staged_count_{0}, staged_used_{0}, staged_refused_{0}, prefetched_{0};
  // StageResume's failures, for its log (once per cause and episode; from any thread).
  absl::Mutex staging_log_mu_;
  FailureEpisode staging_failures_ ABSL_GUARDED_BY(staging_log_mu_);
  ForwardCommit* commit_ = nullptr;     // the pass in progress (Forward), else null
  DecodeGraphCache<GraphExec> graphs_;  // after ws_: destroyed before the buffers they name
  DecodeGraphStats graph_stats_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<EngineBackend>> CreateCudaBackend(const EngineContext& context) {
  auto backend = std::make_unique<CudaBackend>(context);
  if (absl::Status s = backend->Init(); !s.ok()) return s;
  return backend;
}

}  // namespace sdm
