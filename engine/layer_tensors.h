// The tensors of a model by role: one typed struct per mixer, per layer and for the model,
// templated on what a tensor is bound to (M for a matrix [out, in], V for a vector).
//
// engine/weight_spec.cc, the one place that spells tensor names, fills a ModelTensors<TensorRef,
// TensorRef> (indices into ExpectedTensors()); each backend maps it to its own handles with Map()
// (the CPU: packed matrices and host pointers; CUDA: device pointers), so no backend names a
// tensor. A tensor the config does not have (an optional gate, BatchNorm, M0, ...) is an absent
// TensorRef; a backend's map function turns it into its null handle.
//
// Header-only and dependency-free beyond the layer types; a plain value type, no thread-safety
// concerns.
#ifndef SDMSERVE_ENGINE_LAYER_TENSORS_H_
#define SDMSERVE_ENGINE_LAYER_TENSORS_H_

#include <cstdint>
#include <type_traits>
#include <vector>

#include "engine/model_config.h"

namespace sdm {

// A full-attention or sliding-window mixer.
template <typename M, typename V>
struct AttentionTensors {
  M wq, wk, wv, wo;
  M w_gate;  // absent unless attn_gate

  template <typename FM, typename FV>
  auto Map(FM&& fm, FV&&) const {
    using M2 = std::invoke_result_t<FM&, const M&>;
    using V2 = std::invoke_result_t<FV&, const V&>;
    return AttentionTensors<M2, V2>{
        .wq = fm(wq), .wk = fm(wk), .wv = fm(wv), .wo = fm(wo), .w_gate = fm(w_gate)};
  }
};

// The epsilon of the SDM scores' eval-mode BatchNorms (PyTorch's BatchNorm1d default, which the
// reference model uses), for every backend.
inline constexpr float kSdmBatchNormEps = 1e-5f;

// An SDM mixer (docs/architecture.md): the projections with their biases, the gates, and the
// optional output gate, readings LayerNorm, eval-mode BatchNorms and learned M0.
template <typename M, typename V>
struct SdmTensors {
  M wq_read, wk_write, wv_write, a_proj, b_proj, wo;
  V bq_read, bk_write, bv_write, a_bias, b_bias, bo;
  V a_log, dt_bias;
  M wog;  // output gate (absent unless output_gate)
  V bog;
  V norm_w, norm_b;  // readings LayerNorm (absent unless normalize_readings)
  // BatchNorm of the read (query) and write (key) scores (absent unless query_batchnorm).
  V qbn_w, qbn_b, qbn_mean, qbn_var;
  V kbn_w, kbn_b, kbn_mean, kbn_var;
  M m0;  // learned initial memory (absent unless backprop_on_memory)

  template <typename FM, typename FV>
  auto Map(FM&& fm, FV&& fv) const {
    using M2 = std::invoke_result_t<FM&, const M&>;
    using V2 = std::invoke_result_t<FV&, const V&>;
    return SdmTensors<M2, V2>{.wq_read = fm(wq_read),
                              .wk_write = fm(wk_write),
                              .wv_write = fm(wv_write),
                              .a_proj = fm(a_proj),
                              .b_proj = fm(b_proj),
                              .wo = fm(wo),
                              .bq_read = fv(bq_read),
                              .bk_write = fv(bk_write),
                              .bv_write = fv(bv_write),
                              .a_bias = fv(a_bias),
                              .b_bias = fv(b_bias),
                              .bo = fv(bo),
                              .a_log = fv(a_log),
                              .dt_bias = fv(dt_bias),
                              .wog = fm(wog),
                              .bog = fv(bog),
                              .norm_w = fv(norm_w),
                              .norm_b = fv(norm_b),
                              .qbn_w = fv(qbn_w),
                              .qbn_b = fv(qbn_b),
                              .qbn_mean = fv(qbn_mean),
                              .qbn_var = fv(qbn_var),
                              .kbn_w = fv(kbn_w),
                              .kbn_b = fv(kbn_b),
                              .kbn_mean = fv(kbn_mean),
                              .kbn_var = fv(kbn_var),
                              .m0 = fm(m0)};
  }
};

// One layer: norm, mixer (attention for attn/swa layers, SDM for sdm layers; the other mixer's
// tensors are all absent), norm, SwiGLU feed-forward.
template <typename M, typename V>
struct LayerTensors {
  LayerType type = LayerType::kAttn;
  V attention_norm, ffn_norm;
  M w1, w2, w3;  // SwiGLU gate, down and up projections
  AttentionTensors<M, V> attention;
  SdmTensors<M, V> sdm;

  template <typename FM, typename FV>
  auto Map(FM&& fm, FV&& fv) const {
    using M2 = std::invoke_result_t<FM&, const M&>;
    using V2 = std::invoke_result_t<FV&, const V&>;
    return LayerTensors<M2, V2>{.type = type,
                                .attention_norm = fv(attention_norm),
                                .ffn_norm = fv(ffn_norm),
                                .w1 = fm(w1),
                                .w2 = fm(w2),
                                .w3 = fm(w3),
                                .attention = attention.Map(fm, fv),
                                .sdm = sdm.Map(fm, fv)};
  }
};

template <typename M, typename V>
struct ModelTensors {
  M tok_embeddings;
  V norm;    // final RMSNorm
  M output;  // the logits projection: tok_embeddings' tensor when the weights are tied
  std::vector<LayerTensors<M, V>> layers;

  template <typename FM, typename FV>
  auto Map(FM&& fm, FV&& fv) const {
    using M2 = std::invoke_result_t<FM&, const M&>;
    using V2 = std::invoke_result_t<FV&, const V&>;
    ModelTensors<M2, V2> out{
        .tok_embeddings = fm(tok_embeddings), .norm = fv(norm), .output = fm(output), .layers = {}};
    out.layers.reserve(layers.size());
    for (const LayerTensors<M, V>& l : layers) out.layers.push_back(l.Map(fm, fv));
    return out;
  }
};

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_LAYER_TENSORS_H_
