// The byte model of `sdm-bench decode` (tools/sdm_bench/byte_model.h): the bytes of a decode step
// checked against figures computed another way from the config (parameter counts, the
// full-attention KV size per token, the attention geometry), and its shape: linear in the batch,
// growing with the context for full attention, capped at the window for sliding-window attention.
#include "tools/sdm_bench/byte_model.h"

#include <algorithm>
#include <cstdint>

#include "engine/model_config.h"
#include "engine/weight_spec.h"
#include "gtest/gtest.h"

namespace sdm::bench {
namespace {

ModelConfig Preset(const char* name) {
  absl::StatusOr<ModelConfig> c = PresetConfig(name);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

TEST(ByteModelTest, ElementSizeFollowsTheEngine) {
  EXPECT_EQ(ElemBytes(EngineDevice::kCpu), 4.0);
  EXPECT_EQ(ElemBytes(EngineDevice::kCuda), 2.0);
  // The CPU's bf16 mode halves matrices and KV rows; SDM rows and the embedding row stay fp32.
  EXPECT_EQ(ElemBytes(EngineDevice::kCpu, DType::kBf16), 2.0);
  EXPECT_EQ(RowElemBytes(EngineDevice::kCpu), 4.0);
  EXPECT_EQ(RowElemBytes(EngineDevice::kCuda), 2.0);
}

// At fp32 every weight read costs 4 bytes, so the step's weight bytes are 4 x the parameter
// count without M0, less the embedding table when only its gathered rows are read.
TEST(ByteModelTest, Fp32WeightBytesAreTheParameterCountWithoutM0AndTheUntiedEmbedding) {
  for (const char* name : {"tiny", "debug", "debug_sdm", "debug_hybrid", "sdm_flagship"}) {
    SCOPED_TRACE(name);
    const ModelConfig c = Preset(name);
    const ParameterCounts p = CountParameters(c);
    const int64_t gathered = c.weight_tying ? 0 : c.vocab_size * c.dim;
    const WeightBytes w = WeightBytesPerStep(c, 4.0);
    EXPECT_DOUBLE_EQ(w.total(), 4.0 * static_cast<double>(p.without_m0 - gathered));
    // At bf16 only the matrices halve: the difference is 2 bytes per matrix value.
    double matrix_values = 0;
    for (const TensorSpec& t : ExpectedTensors(c)) {
      if (t.shape.size() == 2 && !t.is_sdm_memory &&
          (t.name != "tok_embeddings.weight" || c.weight_tying)) {
        matrix_values += static_cast<double>(NumElements(t));
      }
    }
    EXPECT_DOUBLE_EQ(w.total() - WeightBytesPerStep(c, 2.0).total(), 2.0 * matrix_values);
  }
}

TEST(ByteModelTest, MixerWeightsGoToTheirLayerKind) {
  const ModelConfig twin = Preset("debug");     // full attention only
  const ModelConfig sdm = Preset("debug_sdm");  // half of its layers are SDM
  const WeightBytes a = WeightBytesPerStep(twin, 4.0);
  const WeightBytes s = WeightBytesPerStep(sdm, 4.0);
  EXPECT_GT(a.attn, 0);
  EXPECT_EQ(a.sdm, 0);
  EXPECT_EQ(a.swa, 0);
  EXPECT_GT(s.sdm, 0);
  EXPECT_GT(s.attn, 0);
  // The layers outside the mixers (norms, FFNs, embeddings, output) are the same in both.
  EXPECT_DOUBLE_EQ(a.other, s.other);
}

// A full-attention model's session reads every cached position's K and V and writes the new
// ones: (ctx + 1 visible + 1 new) rows of the per-token KV size.
TEST(ByteModelTest, FullAttentionSessionBytesAreTheKvCacheOfTheVisiblePositions) {
  const ModelConfig c = Preset("debug");
  const double per_token = 4.0 * static_cast<double>(FullAttentionKvElementsPerToken(c));
  EXPECT_DOUBLE_EQ(KvBytesPerToken(c, 4.0), per_token);
  EXPECT_DOUBLE_EQ(KvBytesPerToken(c, 2.0), per_token / 2);
  for (int64_t ctx : {0, 1, 100, 4096}) {
    const SessionStepBytes b = SessionBytesPerStep(c, ctx, 4.0);
    EXPECT_DOUBLE_EQ(b.kv, per_token * static_cast<double>(ctx + 2)) << ctx;
    EXPECT_EQ(b.swa, 0);
    EXPECT_EQ(b.sdm, 0);
    EXPECT_DOUBLE_EQ(b.other, 4.0 * c.dim);  // the token's embedding row
  }
}

// tiny: 3 SWA layers (window 8) and one SDM layer; its sessions' bytes stop growing once the
// window is full.
TEST(ByteModelTest, SlidingWindowBytesAreCappedAtTheWindow) {
  const ModelConfig c = Preset("tiny");
  const AttentionGeometry g = AttentionGeometryOf(c, c.swa_at.front());
  ASSERT_GT(g.window, 0);
  const double row_pair = 4.0 * 2 * g.n_kv_heads * g.head_dim;  // one position's K and V
  const double layers = static_cast<double>(c.swa_at.size());
  for (int64_t ctx = 0; ctx < 3 * g.window; ++ctx) {
    const double visible = static_cast<double>(std::min(ctx + 1, g.window));
    EXPECT_DOUBLE_EQ(SessionBytesPerStep(c, ctx, 4.0).swa, layers * row_pair * (visible + 1))
        << ctx;
  }
  EXPECT_LT(SessionBytesPerStep(c, 0, 4.0).total(),
            SessionBytesPerStep(c, g.window - 1, 4.0).total());
  EXPECT_DOUBLE_EQ(SessionBytesPerStep(c, g.window - 1, 4.0).total(),
                   SessionBytesPerStep(c, 1'000'000, 4.0).total());
}

// Per SDM layer and head: W rows read and written back and R rows read, of hd values each.
TEST(ByteModelTest, SdmBytesAreTwoWPlusRRowsPerHeadAndIndependentOfContext) {
  const ModelConfig c = Preset("debug_sdm");
  const SdmGeometry g = SdmGeometryOf(c);
  const double expected = static_cast<double>(c.sdm_at.size()) * g.heads * 2.0 *
                          (2 * c.sdm.num_writes + c.sdm.num_reads) * g.head_width;
  EXPECT_DOUBLE_EQ(SessionBytesPerStep(c, 0, 2.0).sdm, expected);
  EXPECT_DOUBLE_EQ(SessionBytesPerStep(c, 100'000, 2.0).sdm, expected);
}

TEST(ByteModelTest, StepBytesAreTheWeightsOnceAndEachSessionsRows) {
  for (const char* name : {"tiny", "debug", "debug_sdm", "baseline_1.4B"}) {
    SCOPED_TRACE(name);
    const ModelConfig c = Preset(name);
    for (int64_t ctx : {16, 2048}) {
      const double weights = WeightBytesPerStep(c, 2.0).total();
      const double session = SessionBytesPerStep(c, ctx, 2.0).total();
      EXPECT_DOUBLE_EQ(StepBytes(c, ctx, 1, 2.0), weights + session);
      for (int64_t b = 1; b < 64; b *= 2) {
        EXPECT_DOUBLE_EQ(StepBytes(c, ctx, 2 * b, 2.0) - StepBytes(c, ctx, b, 2.0),
                         static_cast<double>(b) * session);
      }
      // Never decreasing in the context; strictly increasing with a full-attention layer.
      const bool grows = std::find(c.layer_types.begin(), c.layer_types.end(), LayerType::kAttn) !=
                         c.layer_types.end();
      if (grows) {
        EXPECT_GT(StepBytes(c, ctx + 1, 4, 2.0), StepBytes(c, ctx, 4, 2.0));
      } else {
        EXPECT_GE(StepBytes(c, ctx + 1, 4, 2.0), StepBytes(c, ctx, 4, 2.0));
      }
    }
  }
}

// The SDM model's step moves less than its full-attention twin's once the context is long: the
// point of the benchmark's bandwidth-floor ratio.
TEST(ByteModelTest, AtLongContextTheSdmStepMovesLessThanItsTwin) {
  const ModelConfig sdm = Preset("debug_sdm");
  const ModelConfig twin = Preset("debug");
  EXPECT_LT(StepBytes(sdm, 32768, 16, 2.0), StepBytes(twin, 32768, 16, 2.0));
}

TEST(ByteModelTest, FlopsCountEveryDecodeGemmAndGrowWithAttentionContext) {
  const ModelConfig c = Preset("debug");  // no SDM layer: FLOPs are GEMMs plus attention
  double gemm = 0;
  for (const TensorSpec& t : ExpectedTensors(c)) {
    if (IsDecodeGemm(c, t)) gemm += 2.0 * static_cast<double>(NumElements(t));
  }
  EXPECT_DOUBLE_EQ(DecodeFlopsPerToken(c, 0), gemm);
  const AttentionGeometry g = AttentionGeometryOf(c, 0);
  EXPECT_DOUBLE_EQ(DecodeFlopsPerToken(c, 10) - DecodeFlopsPerToken(c, 0),
                   4.0 * 10 * g.n_heads * g.head_dim * c.n_layers);
}

}  // namespace
}  // namespace sdm::bench
