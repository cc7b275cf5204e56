#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/check.h"
#include "engine/engine_backend.h"
#include "engine/weight_spec.h"
#include "kernels/common/sdm_math.h"
#include "kernels/cpu/attention.h"
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
// recurrence of a head is split into tiles that run on different threads.
constexpr int64_t kSdmColumnTile = 128;

using cpu::PackedMatrix;

struct AttentionWeights {
  const PackedMatrix* wq = nullptr;
  const PackedMatrix* wk = nullptr;
  const PackedMatrix* wv = nullptr;
  const PackedMatrix* wo = nullptr;
  const PackedMatrix* w_gate = nullptr;  // null unless attn_gate
  AttentionGeometry geom;
};

struct SdmWeights {
  const PackedMatrix *wq_read, *wk_write, *wv_write, *a_proj, *b_proj, *wo;
  const float *bq_read, *bk_write, *bv_write, *a_bias, *b_bias, *a_log, *dt_bias, *bo;
  const PackedMatrix* wog = nullptr;  // output gate (optional)
  const float* bog = nullptr;
  const float* norm_w = nullptr;  // readings LayerNorm (optional)
  const float* norm_b = nullptr;
  // Eval-mode BatchNorm of the read (query) and write (key) scores (optional).
  const float *qbn_w = nullptr, *qbn_b = nullptr, *qbn_mean = nullptr, *qbn_var = nullptr;
  const float *kbn_w = nullptr, *kbn_b = nullptr, *kbn_mean = nullptr, *kbn_var = nullptr;
};

struct LayerWeights {
  LayerType type;
  const float* attention_norm;
  const float* ffn_norm;
  const PackedMatrix *w1, *w2, *w3;
  AttentionWeights attn;
  SdmWeights sdm;
};

}  // namespace

// The CPU forward pass: fp32 weights repacked for the batch-invariant GEMM (kernels/cpu/gemm.h),
// per-session work on the engine's thread pool.
class CpuBackend : public EngineBackend {
 public:
  explicit CpuBackend(const EngineContext& context)
      : model_(context.model),
        cfg_(model_->config),
        options_(context.options),
        pool_(context.options.num_threads),
        hidden_(FfnHiddenDim(cfg_)),
        sdm_geom_(SdmGeometryOf(cfg_)) {
    const ModelWeights& w = *model_->weights;
    tok_embeddings_ = w.Get("tok_embeddings.weight").data();
    final_norm_ = w.Get("norm.weight").data();
    output_ = Pack(cfg_.weight_tying ? "tok_embeddings.weight" : "output.weight");
    for (int64_t i = 0; i < cfg_.n_layers; ++i) {
      const std::string p = absl::StrCat("layers.", i, ".");
      auto get = [&](const std::string& name) { return w.Get(p + name).data(); };
      auto opt = [&](const std::string& name) {
        return w.Has(p + name) ? w.Get(p + name).data() : nullptr;
      };
      auto pack = [&](const std::string& name) { return Pack(p + name); };
      auto opt_pack = [&](const std::string& name) {
        return w.Has(p + name) ? Pack(p + name) : nullptr;
      };
      LayerWeights l{};
      l.type = cfg_.layer_types[i];
      l.attention_norm = get("attention_norm.weight");
      l.ffn_norm = get("ffn_norm.weight");
      l.w1 = pack("feed_forward.w1.weight");
      l.w2 = pack("feed_forward.w2.weight");
      l.w3 = pack("feed_forward.w3.weight");
      if (l.type == LayerType::kSdm) {
        SdmWeights& s = l.sdm;
        s.wq_read = pack("attention.Wq_read.weight");
        s.bq_read = get("attention.Wq_read.bias");
        s.wk_write = pack("attention.Wk_write.weight");
        s.bk_write = get("attention.Wk_write.bias");
        s.wv_write = pack("attention.Wv_write.weight");
        s.bv_write = get("attention.Wv_write.bias");
        s.a_proj = pack("attention.a_proj.weight");
        s.a_bias = get("attention.a_proj.bias");
        s.b_proj = pack("attention.b_proj.weight");
        s.b_bias = get("attention.b_proj.bias");
        s.a_log = get("attention.A_log");
        s.dt_bias = get("attention.dt_bias");
        s.wo = pack("attention.Wo.weight");
        s.bo = get("attention.Wo.bias");
        s.wog = opt_pack("attention.Wog.weight");
        s.bog = opt("attention.Wog.bias");
        s.norm_w = opt("attention.readings_norm.weight");
        s.norm_b = opt("attention.readings_norm.bias");
        s.qbn_w = opt("attention.query_bn.weight");
        s.qbn_b = opt("attention.query_bn.bias");
        s.qbn_mean = opt("attention.query_bn.running_mean");
        s.qbn_var = opt("attention.query_bn.running_var");
        s.kbn_w = opt("attention.key_bn.weight");
        s.kbn_b = opt("attention.key_bn.bias");
        s.kbn_mean = opt("attention.key_bn.running_mean");
        s.kbn_var = opt("attention.key_bn.running_var");
      } else {
        AttentionWeights& a = l.attn;
        a.geom = AttentionGeometryOf(cfg_, i);
        a.wq = pack("attention.wq.weight");
        a.wk = pack("attention.wk.weight");
        a.wv = pack("attention.wv.weight");
        a.wo = pack("attention.wo.weight");
        a.w_gate = opt_pack("attention.w_gate.weight");
      }
      layers_.push_back(l);
    }
  }

  EngineDevice device() const override { return EngineDevice::kCpu; }
  std::string Describe() const override {
    return absl::StrCat("cpu, ", pool_.num_threads(), " threads");
  }
  const EngineProfile& profile() const override { return profile_; }
  void ResetProfile() override { profile_ = EngineProfile{}; }

  absl::Status Prefill(SessionState& session, std::span<const int32_t> tokens, bool all_positions,
                       std::vector<float>* logits) override {
    const int64_t vocab = cfg_.vocab_size;
    if (logits != nullptr) {
      logits->assign((all_positions ? static_cast<int64_t>(tokens.size()) : 1) * vocab, 0.0f);
    }
    const int64_t n = static_cast<int64_t>(tokens.size());
    for (int64_t start = 0; start < n; start += options_.prefill_chunk) {
      const int64_t len = std::min(options_.prefill_chunk, n - start);
      std::vector<Segment> segs = {{&session, 0, len, session.position()}};
      const bool last_chunk = start + len == n;
      std::vector<int64_t> rows;
      float* out = nullptr;
      if (logits != nullptr && all_positions) {
        for (int64_t r = 0; r < len; ++r) rows.push_back(r);
        out = logits->data() + start * vocab;
      } else if (logits != nullptr && last_chunk) {
        rows.push_back(len - 1);
        out = logits->data();
      }
      Forward(tokens.subspan(start, len), segs, rows, out);
    }
    return absl::OkStatus();
  }

  absl::Status Decode(std::span<SessionState* const> sessions, std::span<const int32_t> tokens,
                      std::span<float> logits) override {
    const int64_t n = static_cast<int64_t>(sessions.size());
    std::vector<Segment> segs;
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < n; ++i) {
      segs.push_back({sessions[i], i, 1, sessions[i]->position()});
      rows.push_back(i);
    }
    Forward(tokens, segs, rows, logits.data());
    return absl::OkStatus();
  }

 private:
  // Runs the model over `tokens` (one row each, grouped into `segs`), advancing every session,
  // and writes the logits of `logit_rows` (in that order) to `logits_out`.
  void Forward(std::span<const int32_t> tokens, std::span<const Segment> segs,
               std::span<const int64_t> logit_rows, float* logits_out) {
    const int64_t n = static_cast<int64_t>(tokens.size());
    const int64_t dim = cfg_.dim;
    // Profiling: the clock is read only when enabled.
    using Clock = std::chrono::steady_clock;
    Clock::time_point mark = options_.profile ? Clock::now() : Clock::time_point{};
    auto lap = [&](double& bucket) {
      if (!options_.profile) return;
      const Clock::time_point now = Clock::now();
      bucket += std::chrono::duration<double>(now - mark).count();
      mark = now;
    };
    std::vector<float> x(n * dim), xn(n * dim), tmp(n * dim);
    for (int64_t r = 0; r < n; ++r) {
      std::memcpy(&x[r * dim], tok_embeddings_ + static_cast<int64_t>(tokens[r]) * dim,
                  dim * sizeof(float));
    }
    const float eps = static_cast<float>(cfg_.norm_eps);
    lap(profile_.head_seconds);
    for (int64_t li = 0; li < cfg_.n_layers; ++li) {
      const LayerWeights& l = layers_[li];
      cpu::RmsNorm(x.data(), l.attention_norm, n, dim, eps, xn.data());
      lap(profile_.ffn_seconds);
      if (l.type == LayerType::kSdm) {
        SdmMixer(li, l.sdm, xn.data(), n, segs, tmp.data());
        lap(profile_.sdm_seconds);
      } else {
        AttentionMixer(li, l.attn, xn.data(), n, segs, tmp.data());
        lap(l.type == LayerType::kSwa ? profile_.swa_seconds : profile_.attn_seconds);
      }
      cpu::AddInPlace(tmp.data(), x.data(), n * dim);
      cpu::RmsNorm(x.data(), l.ffn_norm, n, dim, eps, xn.data());
      FeedForward(l, xn.data(), n, tmp.data());
      cpu::AddInPlace(tmp.data(), x.data(), n * dim);
      lap(profile_.ffn_seconds);
    }
    for (const Segment& s : segs) {
      for (int64_t t = 0; t < s.length; ++t) s.session->AdvancePosition();
    }
    if (logit_rows.empty() || logits_out == nullptr) return;
    const int64_t m = static_cast<int64_t>(logit_rows.size());
    std::vector<float> h(m * dim);
    for (int64_t i = 0; i < m; ++i) {
      cpu::RmsNorm(&x[logit_rows[i] * dim], final_norm_, 1, dim, eps, &h[i * dim]);
    }
    Linear(h.data(), m, output_, nullptr, logits_out);
    lap(profile_.head_seconds);
  }

  void FeedForward(const LayerWeights& l, const float* xn, int64_t n, float* out) {
    std::vector<float> h1(n * hidden_), h3(n * hidden_);
    Linear(xn, n, l.w1, nullptr, h1.data());
    Linear(xn, n, l.w3, nullptr, h3.data());
    cpu::SwiGlu(h1.data(), h3.data(), h1.data(), n * hidden_);
    Linear(h1.data(), n, l.w2, nullptr, out);
  }

  void AttentionMixer(int64_t li, const AttentionWeights& a, const float* xn, int64_t n,
                      std::span<const Segment> segs, float* out) {
    const AttentionGeometry& g = a.geom;
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
        std::memcpy(cache.NextKeyRow(), &k[r * kv_width], kv_width * sizeof(float));
        std::memcpy(cache.NextValueRow(), &v[r * kv_width], kv_width * sizeof(float));
        cache.Commit();
      }
    }
    auto spans_for = [&](const KvCache& cache, int64_t begin, int64_t end) {
      std::vector<cpu::KvSpan> spans;
      cache.ForEachSpan(begin, end,
                        [&](int64_t p, int64_t count, const float* kr, const float* vr) {
                          spans.push_back({kr, vr, p, count});
                        });
      return spans;
    };
    // Single-token segments (decode) run per (segment, head) on the pool; longer segments
    // (prefill) use GEMMs on this thread.
    std::vector<const Segment*> singles;
    for (const Segment& s : segs) {
      if (s.length == 1) {
        singles.push_back(&s);
      } else {
        const KvCache& cache = s.session->kv(li);
        auto spans =
            spans_for(cache, cpu::FirstVisiblePosition(s.pos0, g.window), s.pos0 + s.length);
        cpu::AttendPrefill(&q[s.first_row * q_width], s.length, s.pos0, spans, shape,
                           &o[s.first_row * q_width]);
      }
    }
    if (!singles.empty()) {
      std::vector<std::vector<cpu::KvSpan>> spans(singles.size());
      for (size_t i = 0; i < singles.size(); ++i) {
        const Segment& s = *singles[i];
        spans[i] =
            spans_for(s.session->kv(li), cpu::FirstVisiblePosition(s.pos0, g.window), s.pos0 + 1);
      }
      pool_.ParallelFor(static_cast<int64_t>(singles.size()) * g.n_heads, [&](int64_t task) {
        const int64_t i = task / g.n_heads;
        const int64_t h = task % g.n_heads;
        const int64_t r = singles[i]->first_row;
        cpu::AttendDecodeHead(&q[r * q_width + h * g.head_dim], h, singles[i]->pos0, spans[i],
                              shape, &o[r * q_width + h * g.head_dim]);
      });
    }
    if (a.w_gate != nullptr) {
      std::vector<float> gate(n * q_width);
      Linear(xn, n, a.w_gate, nullptr, gate.data());
      cpu::MulSigmoid(gate.data(), o.data(), n * q_width);
    }
    Linear(o.data(), n, a.wo, nullptr, out);
  }

  void SdmMixer(int64_t li, const SdmWeights& w, const float* xn, int64_t n,
                std::span<const Segment> segs, float* out) {
    const SdmArgs& args = cfg_.sdm;
    const int64_t dim = cfg_.dim;
    const int64_t heads = sdm_geom_.heads;
    const int64_t side = sdm_geom_.side;
    const int64_t hd = sdm_geom_.head_width;
    const int64_t key_size = sdm_geom_.key_size;
    const int64_t n_w = cpu::AddressCount(args.num_writes, side);
    const int64_t n_r = cpu::AddressCount(args.num_reads, side);

    std::vector<float> rq(n * key_size), wk(n * key_size), v(n * dim), a(n * heads), b(n * heads);
    Linear(xn, n, w.wq_read, w.bq_read, rq.data());
    Linear(xn, n, w.wk_write, w.bk_write, wk.data());
    Linear(xn, n, w.wv_write, w.bv_write, v.data());
    Linear(xn, n, w.a_proj, w.a_bias, a.data());
    Linear(xn, n, w.b_proj, w.b_bias, b.data());
    if (w.qbn_w != nullptr) {
      cpu::BatchNormEval(rq.data(), w.qbn_w, w.qbn_b, w.qbn_mean, w.qbn_var, n, key_size, 1e-5f);
      cpu::BatchNormEval(wk.data(), w.kbn_w, w.kbn_b, w.kbn_mean, w.kbn_var, n, key_size, 1e-5f);
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
    pool_.ParallelFor(static_cast<int64_t>(segs.size()) * heads * tiles, [&](int64_t task) {
      const Segment& s = segs[task / (heads * tiles)];
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

  // Repacks a [out, in] weight for the batch-invariant GEMM (kernels/cpu/gemm.h), once.
  const PackedMatrix* Pack(const std::string& name) {
    const TensorSpecShape shape = ShapeOf(name);
    packed_.emplace_back(model_->weights->Get(name).data(), shape.rows, shape.cols);
    return &packed_.back();
  }
  struct TensorSpecShape {
    int64_t rows, cols;
  };
  TensorSpecShape ShapeOf(const std::string& name) const {
    for (const TensorSpec& t : specs_) {
      if (t.name == name) return {t.shape[0], t.shape[1]};
    }
    SDM_CHECK(false);
    return {0, 0};
  }
  void Linear(const float* x, int64_t m, const PackedMatrix* w, const float* bias, float* y) {
    cpu::LinearInvariant(x, m, *w, bias, y, &pool_);
  }

  std::shared_ptr<const Model> model_;
  const ModelConfig& cfg_;
  EngineOptions options_;
  cpu::ThreadPool pool_;
  int64_t hidden_;
  SdmGeometry sdm_geom_;
  const float* tok_embeddings_ = nullptr;
  const float* final_norm_ = nullptr;
  const PackedMatrix* output_ = nullptr;
  std::vector<TensorSpec> specs_ = ExpectedTensors(cfg_);
  std::deque<PackedMatrix> packed_;  // stable addresses
  std::vector<LayerWeights> layers_;
  EngineProfile profile_;
};

absl::StatusOr<std::unique_ptr<EngineBackend>> CreateCpuBackend(const EngineContext& context) {
  return std::make_unique<CpuBackend>(context);
}

}  // namespace sdm
