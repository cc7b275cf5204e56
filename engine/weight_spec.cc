#include "engine/weight_spec.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace sdm {
namespace {

// Depth factor of the reference's InitStdFactor (divides the output-projection std).
double DepthFactor(const ModelConfig& c, int64_t depth) {
  if (c.init_std_factor == "current_depth") return std::sqrt(2.0 * static_cast<double>(depth + 1));
  if (c.init_std_factor == "global_depth")
    return std::sqrt(2.0 * static_cast<double>(c.n_layers + 1));
  if (c.init_std_factor == "dim_ratio") return static_cast<double>(c.dim) / 4096.0;
  return 1.0;
}

TensorSpec Normal(std::string name, std::vector<int64_t> shape, double std, double bound,
                  std::string meaning) {
  TensorSpec t;
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.init = WeightInit::kTruncNormal;
  t.init_std = std;
  t.init_bound = bound;
  t.meaning = std::move(meaning);
  return t;
}

TensorSpec Fill(std::string name, std::vector<int64_t> shape, WeightInit init,
                std::string meaning) {
  TensorSpec t;
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.init = init;
  t.meaning = std::move(meaning);
  return t;
}

// Appends `spec` to `out` and returns its place.
TensorRef Push(TensorSpec spec, std::vector<TensorSpec>& out) {
  out.push_back(std::move(spec));
  return TensorRef{static_cast<int32_t>(out.size() - 1)};
}

AttentionTensors<TensorRef, TensorRef> AddAttention(const ModelConfig& c, int64_t i,
                                                    double base_std, double factor,
                                                    std::vector<TensorSpec>& out) {
  const AttentionGeometry g = AttentionGeometryOf(c, i);
  const std::string p = absl::StrCat("layers.", i, ".attention.");
  const double s = base_std;
  AttentionTensors<TensorRef, TensorRef> t;
  t.wq = Push(Normal(p + "wq.weight", {g.n_heads * g.head_dim, c.dim}, s, 3 * s,
                     "query projection (heads x head_dim, dim)"),
              out);
  t.wk = Push(Normal(p + "wk.weight", {g.n_kv_heads * g.head_dim, c.dim}, s, 3 * s,
                     "key projection (kv_heads x head_dim, dim)"),
              out);
  t.wv = Push(Normal(p + "wv.weight", {g.n_kv_heads * g.head_dim, c.dim}, s, 3 * s,
                     "value projection (kv_heads x head_dim, dim)"),
              out);
  t.wo = Push(Normal(p + "wo.weight", {c.dim, g.n_heads * g.head_dim}, s / factor, 3 * s,
                     "output projection"),
              out);
  if (c.attn_gate) {
    t.w_gate = Push(Normal(p + "w_gate.weight", {g.n_heads * g.head_dim, c.dim}, s, 3 * s,
                           "attention output gate: out *= sigmoid(w_gate x)"),
                    out);
  }
  return t;
}

SdmTensors<TensorRef, TensorRef> AddSdm(const ModelConfig& c, int64_t i, double base_std,
                                        double factor, std::vector<TensorSpec>& out) {
  const SdmGeometry g = SdmGeometryOf(c);
  const std::string p = absl::StrCat("layers.", i, ".attention.");
  const double s = base_std / factor;  // SDM divides every std by the factor
  SdmTensors<TensorRef, TensorRef> t;
  auto linear = [&](const std::string& name, int64_t rows, const std::string& meaning,
                    TensorRef& weight, TensorRef& bias) {
    weight = Push(Normal(p + name + ".weight", {rows, c.dim}, s, 3 * s, meaning), out);
    bias = Push(Fill(p + name + ".bias", {rows}, WeightInit::kZeros, "bias of " + name), out);
  };
  linear("Wq_read", g.key_size, "read product-key scores (H x 2s: half A then half B per head)",
         t.wq_read, t.bq_read);
  linear("Wk_write", g.key_size, "write product-key scores (H x 2s)", t.wk_write, t.bk_write);
  linear("Wv_write", c.dim, "written value v (head h: columns h*hd..(h+1)*hd)", t.wv_write,
         t.bv_write);
  linear("a_proj", g.heads, "forget-gate input: g = -exp(A_log) softplus(a_proj x + dt_bias)",
         t.a_proj, t.a_bias);
  linear("b_proj", g.heads, "input gate: beta = sigmoid(b_proj x)", t.b_proj, t.b_bias);
  t.a_log =
      Push(Fill(p + "A_log", {g.heads}, WeightInit::kSdmALog, "log decay rate A per head"), out);
  t.dt_bias = Push(
      Fill(p + "dt_bias", {g.heads}, WeightInit::kSdmDtBias, "forget-gate bias per head"), out);
  linear("Wo", c.dim, "output projection", t.wo, t.bo);
  if (c.sdm.output_gate) {
    linear("Wog", c.dim, "output gate: readings *= sigmoid(Wog x)", t.wog, t.bog);
  }
  if (c.sdm.backprop_on_memory) {
    TensorSpec m = Normal(p + "memory", {g.heads * g.slots_per_head, g.head_width}, s, 3 * s,
                          "learned initial memory M0 (H x s^2 rows of hd)");
    m.is_sdm_memory = true;
    t.m0 = Push(std::move(m), out);
  }
  if (c.sdm.normalize_readings) {
    t.norm_w = Push(Fill(p + "readings_norm.weight", {g.head_width}, WeightInit::kOnes,
                         "per-head LayerNorm of the readings: weight"),
                    out);
    t.norm_b = Push(Fill(p + "readings_norm.bias", {g.head_width}, WeightInit::kZeros,
                         "per-head LayerNorm of the readings: bias"),
                    out);
  }
  if (c.sdm.query_batchnorm) {
    struct BatchNorm {
      const char* name;
      TensorRef *weight, *bias, *mean, *var;
    };
    for (const BatchNorm& bn : {BatchNorm{"query_bn", &t.qbn_w, &t.qbn_b, &t.qbn_mean, &t.qbn_var},
                                BatchNorm{"key_bn", &t.kbn_w, &t.kbn_b, &t.kbn_mean, &t.kbn_var}}) {
      const std::string b = p + bn.name + ".";
      const std::string what = std::string(bn.name) + " (eval-mode BatchNorm1d of the " +
                               (bn.name[0] == 'q' ? "read" : "write") + " scores): ";
      *bn.weight = Push(Fill(b + "weight", {g.key_size}, WeightInit::kOnes, what + "weight"), out);
      *bn.bias = Push(Fill(b + "bias", {g.key_size}, WeightInit::kZeros, what + "bias"), out);
      *bn.mean = Push(
          Fill(b + "running_mean", {g.key_size}, WeightInit::kZeros, what + "running mean"), out);
      *bn.var = Push(
          Fill(b + "running_var", {g.key_size}, WeightInit::kOnes, what + "running variance"), out);
    }
  }
  return t;
}

}  // namespace

WeightSpec BuildWeightSpec(const ModelConfig& c) {
  WeightSpec spec;
  std::vector<TensorSpec>& out = spec.tensors;
  ModelTensors<TensorRef, TensorRef>& roles = spec.roles;
  const double dim_std = c.init_base_std.value_or(std::pow(static_cast<double>(c.dim), -0.5));
  roles.tok_embeddings = Push(Normal("tok_embeddings.weight", {c.vocab_size, c.dim}, dim_std,
                                     3 * dim_std, "token embeddings"),
                              out);
  const int64_t hidden = FfnHiddenDim(c);
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const double factor = DepthFactor(c, i);
    const std::string p = absl::StrCat("layers.", i, ".");
    LayerTensors<TensorRef, TensorRef> l;
    l.type = c.layer_types[i];
    l.attention_norm = Push(
        Fill(p + "attention_norm.weight", {c.dim}, WeightInit::kOnes, "RMSNorm before the mixer"),
        out);
    if (l.type == LayerType::kSdm) {
      l.sdm = AddSdm(c, i, dim_std, factor, out);
    } else {
      l.attention = AddAttention(c, i, dim_std, factor, out);
    }
    l.ffn_norm = Push(
        Fill(p + "ffn_norm.weight", {c.dim}, WeightInit::kOnes, "RMSNorm before the FFN"), out);
    const double in_std = dim_std;
    const double out_std =
        c.init_base_std.value_or(std::pow(static_cast<double>(hidden), -0.5)) / factor;
    l.w1 = Push(Normal(p + "feed_forward.w1.weight", {hidden, c.dim}, in_std, 3 * in_std,
                       "SwiGLU gate projection"),
                out);
    l.w3 = Push(Normal(p + "feed_forward.w3.weight", {hidden, c.dim}, in_std, 3 * in_std,
                       "SwiGLU up projection"),
                out);
    l.w2 = Push(Normal(p + "feed_forward.w2.weight", {c.dim, hidden}, out_std, 3 * out_std,
                       "SwiGLU down projection"),
                out);
    roles.layers.push_back(l);
  }
  roles.norm = Push(Fill("norm.weight", {c.dim}, WeightInit::kOnes, "final RMSNorm"), out);
  roles.output = roles.tok_embeddings;
  if (!c.weight_tying) {
    roles.output = Push(Normal("output.weight", {c.vocab_size, c.dim}, dim_std, 3 * dim_std,
                               "output projection to logits"),
                        out);
  }
  return spec;
}

std::vector<TensorSpec> ExpectedTensors(const ModelConfig& c) { return BuildWeightSpec(c).tensors; }

int64_t NumElements(const TensorSpec& spec) {
  int64_t n = 1;
  for (int64_t d : spec.shape) n *= d;
  return n;
}

ParameterCounts CountParameters(const ModelConfig& config) {
  ParameterCounts counts;
  for (const TensorSpec& t : ExpectedTensors(config)) {
    const int64_t n = NumElements(t);
    counts.total += n;
    if (t.is_sdm_memory) counts.m0 += n;
  }
  counts.without_m0 = counts.total - counts.m0;
  return counts;
}

}  // namespace sdm
