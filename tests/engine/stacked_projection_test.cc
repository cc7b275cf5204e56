// PlanStackedProjection and the part lists (engine/stacked_projection.h): every present part
// sits whole at an aligned offset, in stacking order, without overlap and with no more padding
// than the alignment needs, on every preset and on configs with every optional part; random
// part lists (fixed and fresh seeds) keep the same invariants; malformed stacks are refused.
#include "engine/stacked_projection.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine/model_config.h"
#include "engine/weight_spec.h"
#include "gtest/gtest.h"
#include "tests/engine/test_model_util.h"

namespace sdm {
namespace {

// Checks `layout` against the contract for `parts` of `spec`.
void CheckLayout(const WeightSpec& spec, const std::vector<StackedPart>& parts,
                 const StackedLayout& layout) {
  ASSERT_EQ(layout.offsets.size(), parts.size());
  ASSERT_EQ(layout.rows.size(), parts.size());
  EXPECT_EQ(layout.width % kStackedPartAlign, 0);
  int64_t end = 0;  // where the previous present part ended
  bool any_bias = false;
  for (size_t i = 0; i < parts.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "part " << i);
    const TensorSpec* m = spec.Find(parts[i].matrix);
    EXPECT_EQ(layout.offsets[i] % kStackedPartAlign, 0);
    EXPECT_GE(layout.offsets[i], end) << "parts overlap or are out of order";
    EXPECT_LT(layout.offsets[i] - end, kStackedPartAlign) << "more padding than alignment needs";
    if (m == nullptr) {
      EXPECT_EQ(layout.rows[i], 0);
      continue;
    }
    EXPECT_EQ(layout.rows[i], m->shape[0]);
    EXPECT_EQ(layout.in, m->shape[1]);
    end = layout.offsets[i] + layout.rows[i];
    any_bias = any_bias || parts[i].bias.present();
  }
  EXPECT_GE(layout.width, end);
  EXPECT_LT(layout.width - end, kStackedPartAlign);
  EXPECT_EQ(layout.has_bias, any_bias);
}

void CheckConfig(const ModelConfig& config) {
  const WeightSpec spec = BuildWeightSpec(config);
  for (int64_t l = 0; l < config.n_layers; ++l) {
    SCOPED_TRACE(::testing::Message() << "layer " << l);
    const LayerTensors<TensorRef, TensorRef>& roles = spec.roles.layers[l];
    for (const std::vector<StackedPart>& parts : {MixerInputParts(roles), FfnInputParts(roles)}) {
      absl::StatusOr<StackedLayout> layout = PlanStackedProjection(spec, parts);
      ASSERT_TRUE(layout.ok()) << layout.status();
      EXPECT_EQ(layout->in, config.dim);  // every stacked projection reads the layer's input
      CheckLayout(spec, parts, *layout);
    }
    // The parts are the roles the backend reads them as.
    const std::vector<StackedPart> mixer = MixerInputParts(roles);
    auto expect_part = [](const StackedPart& part, TensorRef matrix, TensorRef bias) {
      EXPECT_EQ(part.matrix.index, matrix.index);
      EXPECT_EQ(part.bias.index, bias.index);
    };
    if (roles.type == LayerType::kSdm) {
      const SdmTensors<TensorRef, TensorRef>& t = roles.sdm;
      ASSERT_EQ(mixer.size(), static_cast<size_t>(kSdmInputParts));
      expect_part(mixer[kSdmReadQuery], t.wq_read, t.bq_read);
      expect_part(mixer[kSdmWriteKey], t.wk_write, t.bk_write);
      expect_part(mixer[kSdmValue], t.wv_write, t.bv_write);
      expect_part(mixer[kSdmOutputGate], t.wog, t.bog);
      expect_part(mixer[kSdmDecayInput], t.a_proj, t.a_bias);
      expect_part(mixer[kSdmBetaInput], t.b_proj, t.b_bias);
    } else {
      const AttentionTensors<TensorRef, TensorRef>& t = roles.attention;
      ASSERT_EQ(mixer.size(), static_cast<size_t>(kAttnInputParts));
      expect_part(mixer[kAttnQuery], t.wq, {});
      expect_part(mixer[kAttnKey], t.wk, {});
      expect_part(mixer[kAttnValue], t.wv, {});
      expect_part(mixer[kAttnGate], t.w_gate, {});
    }
    const std::vector<StackedPart> ffn = FfnInputParts(roles);
    ASSERT_EQ(ffn.size(), static_cast<size_t>(kFfnInputParts));
    expect_part(ffn[kFfnGate], roles.w1, {});
    expect_part(ffn[kFfnUp], roles.w3, {});
  }
}

TEST(StackedProjectionTest, EveryPresetStacksItsProjections) {
  for (const std::string& name : PresetNames()) {
    SCOPED_TRACE(name);
    absl::StatusOr<ModelConfig> config = PresetConfig(name);
    ASSERT_TRUE(config.ok()) << config.status();
    CheckConfig(*config);
  }
}

TEST(StackedProjectionTest, OptionalPartsAreStackedWhenPresent) {
  ModelConfig config = testing::MiniHybridConfig();  // attention gates, BatchNorms
  config.sdm.output_gate = true;
  ASSERT_TRUE(FinalizeModelConfig(config).ok());
  CheckConfig(config);
  const WeightSpec spec = BuildWeightSpec(config);
  const std::vector<StackedPart> sdm = MixerInputParts(spec.roles.layers[1]);
  ASSERT_TRUE(sdm[kSdmOutputGate].matrix.present());
  const std::vector<StackedPart> attn = MixerInputParts(spec.roles.layers[0]);
  ASSERT_TRUE(attn[kAttnGate].matrix.present());
}

// A spec of matrices [rows_i, in] (rows 0: absent) with a bias where `bias` says.
WeightSpec SyntheticSpec(const std::vector<int64_t>& rows, const std::vector<bool>& bias,
                         int64_t in, std::vector<StackedPart>* parts) {
  WeightSpec spec;
  parts->clear();
  for (size_t i = 0; i < rows.size(); ++i) {
    StackedPart part;
    if (rows[i] > 0) {
      part.matrix.index = static_cast<int32_t>(spec.tensors.size());
      TensorSpec m;
      m.name = "m" + std::to_string(i);
      m.shape = {rows[i], in};
      spec.tensors.push_back(m);
      if (bias[i]) {
        part.bias.index = static_cast<int32_t>(spec.tensors.size());
        TensorSpec b;
        b.name = "b" + std::to_string(i);
        b.shape = {rows[i]};
        spec.tensors.push_back(b);
      }
    }
    parts->push_back(part);
  }
  return spec;
}

TEST(StackedProjectionTest, RandomPartListsKeepTheInvariants) {
  for (const uint32_t seed : {20261206u, std::random_device{}()}) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    for (int trial = 0; trial < 500; ++trial) {
      const int n = std::uniform_int_distribution<int>(1, 7)(rng);
      std::vector<int64_t> rows(n);
      std::vector<bool> bias(n);
      bool any = false;
      for (int i = 0; i < n; ++i) {
        // Absent parts, odd widths, widths just off the alignment.
        rows[i] = std::uniform_int_distribution<int>(0, 3)(rng) == 0
                      ? 0
                      : std::uniform_int_distribution<int64_t>(1, 40)(rng);
        bias[i] = std::uniform_int_distribution<int>(0, 1)(rng) == 1;
        any = any || rows[i] > 0;
      }
      if (!any) rows[0] = 3;
      const int64_t in = std::uniform_int_distribution<int64_t>(1, 64)(rng);
      std::vector<StackedPart> parts;
      const WeightSpec spec = SyntheticSpec(rows, bias, in, &parts);
      absl::StatusOr<StackedLayout> layout = PlanStackedProjection(spec, parts);
      ASSERT_TRUE(layout.ok()) << layout.status();
      CheckLayout(spec, parts, *layout);
    }
  }
}

TEST(StackedProjectionTest, MalformedStacksAreRefused) {
  std::vector<StackedPart> parts;
  WeightSpec spec = SyntheticSpec({16, 8}, {true, false}, 32, &parts);
  ASSERT_TRUE(PlanStackedProjection(spec, parts).ok());
  // Parts reading different inputs.
  spec.tensors[parts[1].matrix.index].shape = {8, 31};
  EXPECT_EQ(PlanStackedProjection(spec, parts).status().code(), absl::StatusCode::kInvalidArgument);
  spec.tensors[parts[1].matrix.index].shape = {8, 32};
  // A bias of the wrong length.
  spec.tensors[parts[0].bias.index].shape = {15};
  EXPECT_EQ(PlanStackedProjection(spec, parts).status().code(), absl::StatusCode::kInvalidArgument);
  spec.tensors[parts[0].bias.index].shape = {16};
  // A bias without its matrix.
  std::vector<StackedPart> orphan = parts;
  orphan[0].matrix = {};
  EXPECT_EQ(PlanStackedProjection(spec, orphan).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Nothing to stack.
  const std::vector<StackedPart> none(3);
  EXPECT_EQ(PlanStackedProjection(spec, none).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace sdm
