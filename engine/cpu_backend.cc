#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/bf16.h"
#include "base/check.h"
#include "engine/engine_backend.h"
#include "engine/layer_tensors.h"
#include "engine/weight_spec.h"
#include "kernels/common/sdm_math.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/decode_attention.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/norm.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/sdm_addressing.h"
#include "kernels/cpu/sdm_update.h"
#include "kernels/cpu/vector_math.h"

namespace sdm {
namespace {

namespace cpu = kernels::cpu;

// Columns of an SDM row handled by one task: rows are independent across columns, so the
// recurrence of a head is split into tiles that run on different threads (the tiling a journaled
// write's replay uses too, cpu::SdmWriteRows).
constexpr int64_t kSdmColumnTile = cpu::kSdmWriteColumnTile;

using cpu::PackedMatrix;

// A layer's weights as the CPU binds them: matrices repacked for the batch-invariant GEMM,
// vectors straight from the model's host tensors.
using CpuLayer = LayerTensors<const PackedMatrix*, const float*>;

}  // namespace

// The CPU forward pass: weights repacked for the batch-invariant GEMM (kernels/cpu/gemm.h), as
// fp32 or bf16 (EngineOptions::cpu_dtype, which also sets the KV caches' element type in the
// state layout), per-session work on the engine's thread pool.
class CpuBackend : public EngineBackend {
 public:
  explicit CpuBackend(const EngineContext& context)
      : model_(context.model),
        cfg_(model_->config),
        pool_(context.options.num_threads, context.options.decode_nice),
        decode_attention_(context.options.cpu_decode_attention),
        fault_(context.options.inject_forward_fault),
        observe_sdm_readings_(context.options.observe_sdm_readings),
        dtype_(context.options.cpu_dtype),
        hidden_(FfnHiddenDim(cfg_)),
        sdm_geom_(SdmGeometryOf(cfg_)) {
    // Prefill attention's GEMMs, the engine's only OpenBLAS calls, run as tasks on pool_. OpenBLAS
    // threads of its own would only compete with the pool's, and they spin in sched_yield after
    // every call: the server used 12% less CPU per token without them, at no cost to prefill
    // (docs/benchmarks.md, "OpenBLAS's own threads"). A process-wide setting.
    cpu::SetBlasThreads(1);
    const ModelWeights& w = *model_->weights;
    const WeightSpec spec = BuildWeightSpec(cfg_);
    auto vector = [&](TensorRef ref) -> const float* {
      const TensorSpec* t = spec.Find(ref);
      return t != nullptr ? w.Get(t->name).data() : nullptr;
    };
    auto pack = [&](TensorRef ref) -> const PackedMatrix* {
      const TensorSpec* t = spec.Find(ref);
      if (t == nullptr || t->is_sdm_memory) return nullptr;  // M0 lives in the state layout
      packed_.emplace_back(w.Get(t->name).data(), t->shape[0], t->shape[1], dtype_);
      packed_bytes_ += packed_.back().bytes();
      return &packed_.back();
    };
    // The embedding table is read by row, so it is packed only when it is also the output.
    tok_embeddings_ = vector(spec.roles.tok_embeddings);
    final_norm_ = vector(spec.roles.norm);
    output_ = pack(spec.roles.output);
    for (int64_t i = 0; i < cfg_.n_layers; ++i) {
      layers_.push_back(spec.roles.layers[i].Map(pack, vector));
      attention_geom_.push_back(cfg_.layer_types[i] == LayerType::kSdm
                                    ? AttentionGeometry{}
                                    : AttentionGeometryOf(cfg_, i));
    }
  }

  EngineDevice device() const override { return EngineDevice::kCpu; }
  std::string Describe() const override {
    return absl::StrCat("cpu, ", pool_.num_threads(), " threads",
                        dtype_ == DType::kBf16 ? ", bf16 weights and KV" : "", ", GEMM ",
                        cpu::GemmIsaName());
  }
  int64_t PackedWeightBytes() const override { return packed_bytes_; }

  // Draws happen in the front (DrawsOnDevice() is false): `out.draws` is always empty here.
  absl::Status Forward(std::span<const int32_t> tokens, std::span<const Segment> segs,
                       const ForwardOutputs& out, ForwardProfiler& profiler) override {
    const std::span<const int64_t> logit_rows = out.logit_rows;
    const int64_t n = static_cast<int64_t>(tokens.size());
    const int64_t dim = cfg_.dim;
    std::vector<float> x(n * dim), xn(n * dim), tmp(n * dim);
    for (int64_t r = 0; r < n; ++r) {
      std::memcpy(&x[r * dim], tok_embeddings_ + static_cast<int64_t>(tokens[r]) * dim,
                  dim * sizeof(float));
    }
    const float eps = static_cast<float>(cfg_.norm_eps);
    profiler.Lap(&EngineProfile::head_seconds);
    // Nothing here fails on its own once the layers start (allocation failure aborts); the
    // commit exists for the fault-injection seam, which fails a pass after a layer wrote state.
    ForwardCommit commit(segs);
    for (int64_t li = 0; li < cfg_.n_layers; ++li) {
      const CpuLayer& l = layers_[li];
      cpu::RmsNorm(x.data(), l.attention_norm, n, dim, eps, xn.data());
      profiler.Lap(&EngineProfile::ffn_seconds);
      commit.Begin();
      if (l.type == LayerType::kSdm) {
        SdmMixer(li, l.sdm, xn.data(), n, segs, tmp.data());
        profiler.Lap(&EngineProfile::sdm_seconds);
      } else {
        AttentionMixer(li, l.attention, xn.data(), n, segs, tmp.data());
        profiler.Lap(l.type == LayerType::kSwa ? &EngineProfile::swa_seconds
                                               : &EngineProfile::attn_seconds);
      }
      cpu::AddInPlace(tmp.data(), x.data(), n * dim);
      cpu::RmsNorm(x.data(), l.ffn_norm, n, dim, eps, xn.data());
      FeedForward(l, xn.data(), n, tmp.data());
      cpu::AddInPlace(tmp.data(), x.data(), n * dim);
      profiler.Lap(&EngineProfile::ffn_seconds);
      if (fault_.Fire()) {
        return commit.Fail(absl::InternalError(absl::StrCat("injected fault after layer ", li)));
      }
    }
    if (logit_rows.empty()) return absl::OkStatus();
    const int64_t m = static_cast<int64_t>(logit_rows.size());
    std::vector<float> h(m * dim);
    for (int64_t i = 0; i < m; ++i) {
      cpu::RmsNorm(&x[logit_rows[i] * dim], final_norm_, 1, dim, eps, &h[i * dim]);
    }
    Linear(h.data(), m, output_, nullptr, out.logits);
    profiler.Lap(&EngineProfile::head_seconds);
    return absl::OkStatus();
  }

 private:
  void FeedForward(const CpuLayer& l, const float* xn, int64_t n, float* out) {
    std::vector<float> h1(n * hidden_), h3(n * hidden_);
    Linear(xn, n, l.w1, nullptr, h1.data());
    Linear(xn, n, l.w3, nullptr, h3.data());
    cpu::SwiGlu(h1.data(), h3.data(), h1.data(), n * hidden_);
    Linear(h1.data(), n, l.w2, nullptr, out);
  }

  void AttentionMixer(int64_t li, const AttentionTensors<const PackedMatrix*, const float*>& a,
                      const float* xn, int64_t n, std::span<const Segment> segs, float* out) {
    const AttentionGeometry& g = attention_geom_[li];
    const int64_t q_width = g.n_heads * g.head_dim;
    const int64_t kv_width = g.n_kv_heads * g.head_dim;
    std::vector<float> q(n * q_width), k(n * kv_width), v(n * kv_width), o(n * q_width);
    Linear(xn, n, a.wq, nullptr, q.data());
    Linear(xn, n, a.wk, nullptr, k.data());
    Linear(xn, n, a.wv, nullptr, v.data());
    const float theta = static_cast<float>(cfg_.rope_theta);
    const cpu::AttentionShape shape{g.n_heads, g.n_kv_heads, g.head_dim, g.window, kv_width};
    for (const Segment& s : segs) {
      KvCache& cache = s.session->kv(li);
      for (int64_t t = 0; t < s.length; ++t) {
        const int64_t r = s.first_row + t;
        const int64_t pos = s.pos0 + t;
        cpu::ApplyRope(&q[r * q_width], g.n_heads, g.head_dim, pos, theta);
        cpu::ApplyRope(&k[r * kv_width], g.n_kv_heads, g.head_dim, pos, theta);
        SDM_CHECK(cache.length() == pos);
        cache.AppendRow(&k[r * kv_width], &v[r * kv_width]);  // rounded in a bf16 cache
      }
    }
    if (dtype_ == DType::kBf16) {
      AttendBf16(li, q.data(), q_width, segs, shape, o.data());
    } else {
      AttendF32(li, q.data(), q_width, segs, shape, o.data());
    }
    if (a.w_gate != nullptr) {
      std::vector<float> gate(n * q_width);
      Linear(xn, n, a.w_gate, nullptr, gate.data());
      cpu::MulSigmoid(gate.data(), o.data(), n * q_width);
    }
    Linear(o.data(), n, a.wo, nullptr, out);
  }

  // Attention of every segment's queries over its cache (fp32 rows). Single-token segments
  // (decode) run on the pool (AttendDecodeBatch: split-K over blocks of whole cache rows), or
  // per head (kPerHead); longer segments (prefill) run as (head, query tile) tasks on the pool.
  void AttendF32(int64_t li, const float* q, int64_t q_width, std::span<const Segment> segs,
                 const cpu::AttentionShape& shape, float* o) {
    const int64_t window = shape.window;
    auto spans_for = [&](const KvCache& cache, int64_t begin, int64_t end) {
      std::vector<cpu::KvSpan> spans;
      cache.ForEachSpan(begin, end,
                        [&](int64_t p, int64_t count, const float* kr, const float* vr) {
                          spans.push_back({kr, vr, p, count});
                        });
      return spans;
    };
    std::vector<const Segment*> singles;
    for (const Segment& s : segs) {
      if (s.length == 1) {
        singles.push_back(&s);
      } else {
        const KvCache& cache = s.session->kv(li);
        auto spans = spans_for(cache, cpu::FirstVisiblePosition(s.pos0, window), s.pos0 + s.length);
        cpu::AttendPrefill(&q[s.first_row * q_width], s.length, s.pos0, spans, shape,
                           &o[s.first_row * q_width], &pool_);
      }
    }
    if (singles.empty()) return;
    std::vector<std::vector<cpu::KvSpan>> spans(singles.size());
    for (size_t i = 0; i < singles.size(); ++i) {
      const Segment& s = *singles[i];
      spans[i] =
          spans_for(s.session->kv(li), cpu::FirstVisiblePosition(s.pos0, window), s.pos0 + 1);
    }
    if (decode_attention_ == CpuDecodeAttention::kBlocked) {
      std::vector<cpu::DecodeQuery> queries;
      for (size_t i = 0; i < singles.size(); ++i) {
        const int64_t r = singles[i]->first_row;
        queries.push_back({&q[r * q_width], singles[i]->pos0, spans[i], &o[r * q_width]});
      }
      cpu::AttendDecodeBatch(queries, shape, &pool_);
    } else {
      const int64_t heads = shape.n_heads, hd = shape.head_dim;
      pool_.ParallelFor(static_cast<int64_t>(singles.size()) * heads, [&](int64_t task) {
        const int64_t i = task / heads;
        const int64_t h = task % heads;
        const int64_t r = singles[i]->first_row;
        cpu::AttendDecodeHead(&q[r * q_width + h * hd], h, singles[i]->pos0, spans[i], shape,
                              &o[r * q_width + h * hd]);
      });
    }
  }

  // The same over bf16 caches: decode reads the bf16 rows (AttendDecodeBatch widens them as it
  // streams); prefill widens the visible rows into fp32 scratch first and runs the fp32 GEMMs, so
  // both paths compute on the same rounded values.
  void AttendBf16(int64_t li, const float* q, int64_t q_width, std::span<const Segment> segs,
                  const cpu::AttentionShape& shape, float* o) {
    const int64_t window = shape.window;
    const int64_t width = shape.row_stride;
    std::vector<const Segment*> singles;
    for (const Segment& s : segs) {
      if (s.length == 1) {
        singles.push_back(&s);
        continue;
      }
      const KvCache& cache = s.session->kv(li);
      const int64_t begin = cpu::FirstVisiblePosition(s.pos0, window);
      const int64_t end = s.pos0 + s.length;
      std::vector<float> k((end - begin) * width), v((end - begin) * width);
      cache.ForEachSpan<uint16_t>(
          begin, end, [&](int64_t p, int64_t count, const uint16_t* kr, const uint16_t* vr) {
            Bf16ToFloats(kr, count * width, &k[(p - begin) * width]);
            Bf16ToFloats(vr, count * width, &v[(p - begin) * width]);
          });
      const cpu::KvSpan span{k.data(), v.data(), begin, end - begin};
      cpu::AttendPrefill(&q[s.first_row * q_width], s.length, s.pos0, {&span, 1}, shape,
                         &o[s.first_row * q_width], &pool_);
    }
    if (singles.empty()) return;
    std::vector<std::vector<cpu::KvSpanBf16>> spans(singles.size());
    std::vector<cpu::DecodeQueryBf16> queries;
    for (size_t i = 0; i < singles.size(); ++i) {
      const Segment& s = *singles[i];
      s.session->kv(li).ForEachSpan<uint16_t>(
          cpu::FirstVisiblePosition(s.pos0, window), s.pos0 + 1,
          [&](int64_t p, int64_t count, const uint16_t* kr, const uint16_t* vr) {
            spans[i].push_back({kr, vr, p, count});
          });
      queries.push_back({&q[s.first_row * q_width], s.pos0, spans[i], &o[s.first_row * q_width]});
    }
    cpu::AttendDecodeBatch(queries, shape, &pool_);
  }

  void SdmMixer(int64_t li, const SdmTensors<const PackedMatrix*, const float*>& w, const float* xn,
                int64_t n, std::span<const Segment> segs, float* out) {
    const SdmArgs& args = cfg_.sdm;
    const int64_t dim = cfg_.dim;
    const int64_t heads = sdm_geom_.heads;
    const int64_t side = sdm_geom_.side;
    const int64_t hd = sdm_geom_.head_width;
    const int64_t key_size = sdm_geom_.key_size;
    const int64_t n_w = sdm_geom_.writes;  // as the state layout journals them
    const int64_t n_r = cpu::AddressCount(args.num_reads, side);

    std::vector<float> rq(n * key_size), wk(n * key_size), v(n * dim), a(n * heads), b(n * heads);
    Linear(xn, n, w.wq_read, w.bq_read, rq.data());
    Linear(xn, n, w.wk_write, w.bk_write, wk.data());
    Linear(xn, n, w.wv_write, w.bv_write, v.data());
    Linear(xn, n, w.a_proj, w.a_bias, a.data());
    Linear(xn, n, w.b_proj, w.b_bias, b.data());
    if (w.qbn_w != nullptr) {
      cpu::BatchNormEval(rq.data(), w.qbn_w, w.qbn_b, w.qbn_mean, w.qbn_var, n, key_size,
                         kSdmBatchNormEps);
      cpu::BatchNormEval(wk.data(), w.kbn_w, w.kbn_b, w.kbn_mean, w.kbn_var, n, key_size,
                         kSdmBatchNormEps);
    }

    // Addressing and gates of every (row, head): independent, so all in parallel.
    std::vector<int32_t> w_slot(n * heads * n_w), r_slot(n * heads * n_r);
    std::vector<float> w_val(n * heads * n_w), r_val(n * heads * n_r);
    const int64_t n_alpha = args.key_weighted_decay ? n_w : 1;
    std::vector<float> alpha(n * heads * n_alpha), beta(n * heads);
    pool_.ParallelFor(n * heads, [&](int64_t task) {
      thread_local cpu::AddressScratch scratch;
      const int64_t r = task / heads;
      const int64_t h = task % heads;
      std::span<int32_t> ws(&w_slot[task * n_w], n_w);
      std::span<float> wv(&w_val[task * n_w], n_w);
      std::span<int32_t> rs(&r_slot[task * n_r], n_r);
      std::span<float> rv(&r_val[task * n_r], n_r);
      cpu::SelectSlots(&wk[r * key_size + h * 2 * side], side, args.num_writes, ws, wv, scratch);
      cpu::ActivateAddress(ToAddressAct(args.write_act), static_cast<float>(args.write_act_scale),
                           wv);
      cpu::SelectSlots(&rq[r * key_size + h * 2 * side], side, args.num_reads, rs, rv, scratch);
      cpu::ActivateAddress(ToAddressAct(args.read_act), static_cast<float>(args.read_act_scale),
                           rv);
      const float g = kernels::SdmLogDecay(w.a_log[h], a[r * heads + h], w.dt_bias[h]);
      beta[task] = kernels::Sigmoid(b[r * heads + h]);
      if (args.key_weighted_decay) {
        for (int64_t i = 0; i < n_w; ++i) alpha[task * n_w + i] = std::exp(g * wv[i]);
      } else {
        alpha[task] = std::exp(g);
      }
    });

    // Row pointers, resolved in token order on this thread (copy-on-write allocation is not
    // thread-safe). Write rows first for every token, read rows after: a read slot whose private
    // row is allocated by a later token of the same segment still holds M0 when the recurrence
    // (sequential in tokens within each column tile) reads it.
    std::vector<float*> w_rows(n * heads * n_w);
    std::vector<const float*> r_rows(n * heads * n_r);
    for (const Segment& s : segs) {
      SdmTable& table = s.session->sdm(li);
      for (int64_t t = 0; t < s.length; ++t) {
        const int64_t r = s.first_row + t;
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t base = (r * heads + h) * n_w;
          for (int64_t i = 0; i < n_w; ++i)
            w_rows[base + i] = table.MutableRow(h, w_slot[base + i]);
          // The write's inputs, for a delta that carries writes rather than rows (no-op unless
          // the state store asked for it: state_store/sdm_table.h, the write journal).
          const int64_t rh = r * heads + h;
          table.JournalWrite(h, std::span<const int32_t>(&w_slot[base], n_w),
                             std::span<const float>(&w_val[base], n_w),
                             std::span<const float>(&alpha[rh * n_alpha], n_alpha), beta[rh],
                             &v[r * dim + h * hd]);
        }
      }
      for (int64_t t = 0; t < s.length; ++t) {
        const int64_t r = s.first_row + t;
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t base = (r * heads + h) * n_r;
          for (int64_t j = 0; j < n_r; ++j) r_rows[base + j] = table.Row(h, r_slot[base + j]);
        }
      }
    }

    // The recurrence: sequential over a segment's tokens, parallel over (segment, head, tile).
    const cpu::SdmRule rule = args.update_rule == UpdateRule::kSlotResidual
                                  ? cpu::SdmRule::kSlotResidual
                                  : cpu::SdmRule::kSharedResidual;
    std::vector<float> readings(n * dim);
    const int64_t tiles = (hd + kSdmColumnTile - 1) / kSdmColumnTile;
    // Segments are claimed last first: the longer (prefill) ones come last in a pass, so the
    // pool starts them first and the short decode tasks fill in around them.
    const int64_t num_segs = static_cast<int64_t>(segs.size());
    pool_.ParallelFor(num_segs * heads * tiles, [&](int64_t task) {
      const Segment& s = segs[num_segs - 1 - task / (heads * tiles)];
      const int64_t h = (task / tiles) % heads;
      const int64_t c0 = (task % tiles) * kSdmColumnTile;
      const int64_t c1 = std::min(hd, c0 + kSdmColumnTile);
      for (int64_t t = 0; t < s.length; ++t) {
        const int64_t rh = (s.first_row + t) * heads + h;
        cpu::SdmWriteColumns(std::span<float* const>(&w_rows[rh * n_w], n_w),
                             std::span<const float>(&w_val[rh * n_w], n_w),
                             std::span<const float>(&alpha[rh * n_alpha], n_alpha), beta[rh],
                             &v[(s.first_row + t) * dim + h * hd], rule, c0, c1);
        cpu::SdmReadColumns(std::span<const float* const>(&r_rows[rh * n_r], n_r),
                            std::span<const float>(&r_val[rh * n_r], n_r),
                            &readings[(s.first_row + t) * dim + h * hd], c0, c1);
      }
    });

    if (observe_sdm_readings_) observe_sdm_readings_(li, readings);
    if (w.norm_w != nullptr) {
      cpu::LayerNorm(readings.data(), w.norm_w, w.norm_b, n * heads, hd,
                     static_cast<float>(args.norm_eps));
    }
    if (w.wog != nullptr) {
      std::vector<float> gate(n * dim);
      Linear(xn, n, w.wog, w.bog, gate.data());
      cpu::MulSigmoid(gate.data(), readings.data(), n * dim);
    }
    Linear(readings.data(), n, w.wo, w.bo, out);
  }

  void Linear(const float* x, int64_t m, const PackedMatrix* w, const float* bias, float* y) {
    cpu::LinearInvariant(x, m, *w, bias, y, &pool_);
  }

  std::shared_ptr<const Model> model_;
  const ModelConfig& cfg_;
  cpu::ThreadPool pool_;
  CpuDecodeAttention decode_attention_;
  ForwardFaultInjector fault_;
  // EngineOptions::observe_sdm_readings (testing).
  SdmReadingsObserver observe_sdm_readings_;
  DType dtype_;
  int64_t packed_bytes_ = 0;
  int64_t hidden_;
  SdmGeometry sdm_geom_;
  const float* tok_embeddings_ = nullptr;
  const float* final_norm_ = nullptr;
  const PackedMatrix* output_ = nullptr;
  std::deque<PackedMatrix> packed_;  // stable addresses
  std::vector<CpuLayer> layers_;
  std::vector<AttentionGeometry> attention_geom_;  // per layer (unused for sdm layers)
};

absl::StatusOr<std::unique_ptr<EngineBackend>> CreateCpuBackend(const EngineContext& context) {
  if (context.options.cpu_dtype == DType::kBf16 &&
      context.options.cpu_decode_attention != CpuDecodeAttention::kBlocked) {
    return absl::InvalidArgumentError("cpu_dtype bf16 needs the blocked decode attention kernel");
  }
  return std::make_unique<CpuBackend>(context);
}

}  // namespace sdm
