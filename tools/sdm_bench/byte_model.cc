#include "tools/sdm_bench/byte_model.h"

#include <algorithm>
#include <cstdio>
#include <string>

namespace sdm::bench {

double ElemBytes(EngineDevice device, DType cpu_dtype) {
  return device == EngineDevice::kCuda || cpu_dtype == DType::kBf16 ? 2.0 : 4.0;
}

double RowElemBytes(EngineDevice device) { return device == EngineDevice::kCuda ? 2.0 : 4.0; }

bool IsDecodeGemm(const ModelConfig& c, const TensorSpec& t) {
  if (t.shape.size() != 2 || t.is_sdm_memory) return false;
  return t.name != "tok_embeddings.weight" || c.weight_tying;
}

WeightBytes WeightBytesPerStep(const ModelConfig& c, double elem) {
  WeightBytes w;
  for (const TensorSpec& t : ExpectedTensors(c)) {
    if (t.is_sdm_memory) continue;
    if (t.name == "tok_embeddings.weight" && !c.weight_tying) continue;
    const double bytes = (t.shape.size() == 2 ? elem : 4.0) * static_cast<double>(NumElements(t));
    int64_t layer = -1;
    if (std::sscanf(t.name.c_str(), "layers.%ld.attention.", &layer) == 1 &&
        t.name.find(".attention.") != std::string::npos && layer >= 0 && layer < c.n_layers) {
      switch (c.layer_types[layer]) {
        case LayerType::kAttn:
          w.attn += bytes;
          break;
        case LayerType::kSwa:
          w.swa += bytes;
          break;
        case LayerType::kSdm:
          w.sdm += bytes;
          break;
      }
    } else {
      w.other += bytes;
    }
  }
  return w;
}

SessionStepBytes SessionBytesPerStep(const ModelConfig& c, int64_t ctx, double elem,
                                     double row_elem) {
  if (row_elem <= 0) row_elem = elem;
  SessionStepBytes b;
  b.other = row_elem * c.dim;  // the embedding row
  const SdmGeometry sg = SdmGeometryOf(c);
  for (int64_t i = 0; i < c.n_layers; ++i) {
    if (c.layer_types[i] == LayerType::kSdm) {
      const int64_t w = std::min(c.sdm.num_writes, sg.slots_per_head);
      const int64_t r = std::min(c.sdm.num_reads, sg.slots_per_head);
      b.sdm += row_elem * sg.heads * (2 * w + r) * sg.head_width;
    } else {
      const AttentionGeometry g = AttentionGeometryOf(c, i);
      const int64_t visible = g.window > 0 ? std::min(ctx + 1, g.window) : ctx + 1;
      // K and V rows read for every visible position, plus the new K and V rows written.
      const double bytes = elem * 2 * g.n_kv_heads * g.head_dim * (visible + 1);
      (g.window > 0 ? b.swa : b.kv) += bytes;
    }
  }
  return b;
}

double StepBytes(const ModelConfig& c, int64_t ctx, int64_t batch, double elem, double row_elem) {
  return WeightBytesPerStep(c, elem).total() +
         static_cast<double>(batch) * SessionBytesPerStep(c, ctx, elem, row_elem).total();
}

double KvBytesPerToken(const ModelConfig& c, double elem) {
  double bytes = 0;
  for (int64_t i = 0; i < c.n_layers; ++i) {
    if (c.layer_types[i] != LayerType::kAttn) continue;
    const AttentionGeometry g = AttentionGeometryOf(c, i);
    bytes += elem * 2 * g.n_kv_heads * g.head_dim;
  }
  return bytes;
}

double DecodeFlopsPerToken(const ModelConfig& c, int64_t ctx) {
  double flops = 0;
  for (const TensorSpec& t : ExpectedTensors(c)) {
    if (IsDecodeGemm(c, t)) flops += 2.0 * t.shape[0] * t.shape[1];
  }
  const SdmGeometry sg = SdmGeometryOf(c);
  for (int64_t i = 0; i < c.n_layers; ++i) {
    if (c.layer_types[i] == LayerType::kSdm) {
      flops += static_cast<double>(sg.heads) * sg.head_width *
               (5.0 * c.sdm.num_writes + 2.0 * c.sdm.num_reads);
    } else {
      const AttentionGeometry g = AttentionGeometryOf(c, i);
      const int64_t visible = g.window > 0 ? std::min(ctx, g.window) : ctx;
      flops += 4.0 * visible * g.n_heads * g.head_dim;
    }
  }
  return flops;
}

}  // namespace sdm::bench
