#include "engine/model_config.h"

#include "absl/status/status.h"
#include "engine/weight_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace sdm {
namespace {

using ::testing::HasSubstr;

// Every field of a config, so that a field lost by the JSON round trip shows up.
void ExpectSameConfig(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.dim, b.dim);
  EXPECT_EQ(a.n_layers, b.n_layers);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.n_heads, b.n_heads);
  EXPECT_EQ(a.n_kv_heads, b.n_kv_heads);
  EXPECT_EQ(a.ffn_dim_multiplier, b.ffn_dim_multiplier);
  EXPECT_EQ(a.multiple_of, b.multiple_of);
  EXPECT_EQ(a.norm_eps, b.norm_eps);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.weight_tying, b.weight_tying);
  EXPECT_EQ(a.attn_at, b.attn_at);
  EXPECT_EQ(a.swa_at, b.swa_at);
  EXPECT_EQ(a.sdm_at, b.sdm_at);
  EXPECT_EQ(a.swa_window, b.swa_window);
  EXPECT_EQ(a.swa_n_heads, b.swa_n_heads);
  EXPECT_EQ(a.swa_n_kv_heads, b.swa_n_kv_heads);
  EXPECT_EQ(a.swa_head_dim, b.swa_head_dim);
  EXPECT_EQ(a.attn_gate, b.attn_gate);
  EXPECT_EQ(a.init_base_std, b.init_base_std);
  EXPECT_EQ(a.init_std_factor, b.init_std_factor);
  EXPECT_EQ(a.max_seqlen, b.max_seqlen);
  EXPECT_EQ(a.seed, b.seed);
  EXPECT_EQ(a.layer_types, b.layer_types);
  EXPECT_EQ(a.tokenizer.name, b.tokenizer.name);
  EXPECT_EQ(a.tokenizer.path, b.tokenizer.path);
  const SdmArgs &x = a.sdm, &y = b.sdm;
  EXPECT_EQ(x.num_heads, y.num_heads);
  EXPECT_EQ(x.slots_per_head, y.slots_per_head);
  EXPECT_EQ(x.num_writes, y.num_writes);
  EXPECT_EQ(x.num_reads, y.num_reads);
  EXPECT_EQ(x.read_act, y.read_act);
  EXPECT_EQ(x.write_act, y.write_act);
  EXPECT_EQ(x.read_act_scale, y.read_act_scale);
  EXPECT_EQ(x.write_act_scale, y.write_act_scale);
  EXPECT_EQ(x.normalize_readings, y.normalize_readings);
  EXPECT_EQ(x.norm_eps, y.norm_eps);
  EXPECT_EQ(x.backprop_on_memory, y.backprop_on_memory);
  EXPECT_EQ(x.output_gate, y.output_gate);
  EXPECT_EQ(x.query_batchnorm, y.query_batchnorm);
  EXPECT_EQ(x.key_weighted_decay, y.key_weighted_decay);
  EXPECT_EQ(x.update_rule, y.update_rule);
  EXPECT_EQ(x.memory_block_size, y.memory_block_size);
  EXPECT_EQ(x.dt_bias_init, y.dt_bias_init);
  EXPECT_EQ(x.a_init_min, y.a_init_min);
  EXPECT_EQ(x.a_init_max, y.a_init_max);
  EXPECT_EQ(x.snapshot_quant, y.snapshot_quant);
  EXPECT_EQ(x.log_memory_access_stats, y.log_memory_access_stats);
  EXPECT_EQ(x.log_memory_norms, y.log_memory_norms);
}

ModelConfig Preset(const std::string& name) {
  auto c = PresetConfig(name);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

// A small valid hybrid config; tests break one thing at a time.
constexpr char kBase[] = R"({
  "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 258,
  "swa_at": [0, 1], "attn_at": [2], "sdm_at": [3], "swa_window": 8,
  "sdm_args": {"num_heads": 2, "slots_per_head": 64, "num_writes": 4, "num_reads": 4}
})";

std::string Base(const std::string& key, const std::string& value) {
  // Replaces or adds a top-level field by textual substitution into kBase.
  std::string s = kBase;
  const std::string needle = "\"" + key + "\":";
  const size_t at = s.find(needle);
  if (at == std::string::npos) {
    s.insert(s.find('{') + 1, needle + " " + value + ", ");
    return s;
  }
  // Value ends at the next top-level comma or newline-delimited brace.
  size_t end = at + needle.size();
  int depth = 0;
  for (; end < s.size(); ++end) {
    if (s[end] == '[' || s[end] == '{') ++depth;
    if (s[end] == ']' || s[end] == '}') {
      if (depth == 0) break;
      --depth;
    }
    if (s[end] == ',' && depth == 0) break;
  }
  return s.substr(0, at) + needle + " " + value + s.substr(end);
}

absl::Status ParseError(const std::string& text) { return ParseModelConfig(text).status(); }

void ExpectInvalid(const std::string& text, const std::vector<std::string>& parts) {
  SCOPED_TRACE(text);
  const absl::Status s = ParseError(text);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (const std::string& p : parts) EXPECT_THAT(s.message(), HasSubstr(p));
}

TEST(ModelConfigTest, BaseIsValid) {
  auto c = ParseModelConfig(kBase);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layer_types, (std::vector<LayerType>{LayerType::kSwa, LayerType::kSwa,
                                                    LayerType::kAttn, LayerType::kSdm}));
  EXPECT_EQ(SdmGeometryOf(*c).side, 8);
  EXPECT_EQ(SdmGeometryOf(*c).head_width, 32);
  EXPECT_EQ(SdmGeometryOf(*c).key_size, 2 * 2 * 8);
  EXPECT_EQ(AttentionGeometryOf(*c, 2).head_dim, 16);
  EXPECT_EQ(AttentionGeometryOf(*c, 2).n_kv_heads, 2);
}

TEST(ModelConfigTest, RejectsBadJson) {
  ExpectInvalid("{\"dim\": 64,", {"not valid JSON"});
  ExpectInvalid("[1, 2]", {"JSON object"});
}

// A key given twice in one object: nlohmann keeps the last silently, so a hand-edited duplicate
// of a field that changes no shape (rope_theta here) changed the model's output with no message.
TEST(ModelConfigTest, RejectsAKeyGivenTwice) {
  std::string text = kBase;
  text.insert(text.find('{') + 1, "\"rope_theta\": 500000.0, \"rope_theta\": 10000.0, ");
  ExpectInvalid(text, {"'rope_theta'", "appears twice"});
  text = kBase;
  text.replace(text.find("\"num_heads\": 2"), 14, "\"num_heads\": 2, \"num_heads\": 2");
  ExpectInvalid(text, {"'num_heads'", "appears twice", "nested"});
}

TEST(ModelConfigTest, RejectsUnknownFieldsByName) {
  ExpectInvalid(Base("dimm", "64"), {"'dimm'", "unknown field"});
  std::string text = kBase;
  text.replace(text.find("\"num_heads\": 2"), 14, "\"num_headz\": 2");
  ExpectInvalid(text, {"sdm_args.num_headz", "unknown field"});
  ExpectInvalid(Base("tokenizer", R"({"name": "bytes", "file": "x"})"), {"tokenizer.file"});
}

TEST(ModelConfigTest, LayerListsMustPartitionTheLayers) {
  ExpectInvalid(Base("attn_at", "[1, 2]"), {"layers [1]", "more than one list"});
  ExpectInvalid(Base("attn_at", "[]"), {"layers [2]", "none of the lists"});
  ExpectInvalid(Base("attn_at", "[2, 4]"), {"attn_at", "layer index 4 out of range"});
  ExpectInvalid(Base("attn_at", "[-1, 2]"), {"attn_at", "out of range"});
  ExpectInvalid(Base("attn_at", "[2, 2]"), {"attn_at", "duplicate layer index 2"});
  // "all" and comma-separated strings are accepted spellings.
  auto all = ParseModelConfig(
      R"({"dim": 64, "n_layers": 3, "n_heads": 4, "vocab_size": 258, "attn_at": "all"})");
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->attn_at, (std::vector<int64_t>{0, 1, 2}));
  auto csv = ParseModelConfig(Base("swa_at", "\"0, 1\""));
  ASSERT_TRUE(csv.ok()) << csv.status();
  EXPECT_EQ(csv->swa_at, (std::vector<int64_t>{0, 1}));
}

TEST(ModelConfigTest, RejectsBadSdmGeometry) {
  std::string square = kBase;
  square.replace(square.find("\"slots_per_head\": 64"), 20, "\"slots_per_head\": 60");
  ExpectInvalid(square, {"sdm_args.slots_per_head", "60 is not a perfect square"});
  // 2 heads x 2^30 slots: slot indices would not fit in 32 bits.
  std::string wide = kBase;
  wide.replace(wide.find("\"slots_per_head\": 64"), 20, "\"slots_per_head\": 1073741824");
  ExpectInvalid(wide, {"sdm_args.slots_per_head", "reach 2^31 slots per layer"});
  std::string heads = kBase;
  heads.replace(heads.find("\"num_heads\": 2"), 14, "\"num_heads\": 3");
  ExpectInvalid(heads, {"sdm_args.num_heads", "not divisible by num_heads=3"});
}

TEST(ModelConfigTest, RejectsBadAttentionGeometry) {
  ExpectInvalid(Base("n_kv_heads", "3"), {"n_kv_heads", "not divisible by n_kv_heads=3"});
  ExpectInvalid(Base("head_dim", "15"), {"head_dim", "must be even"});
  ExpectInvalid(Base("swa_head_dim", "7"), {"swa_head_dim", "must be even"});
  ExpectInvalid(Base("swa_window", "null"), {"swa_window"});
}

// Sizes whose derived quantities would overflow (found by tests/fuzz/model_config_fuzzer.cc:
// FfnHiddenDim computed 4 * dim in int64, and ffn_dim_multiplier * hidden was cast to int64 out
// of range, both undefined behaviour).
TEST(ModelConfigTest, RejectsSizesWhoseDerivedCountsWouldOverflow) {
  ExpectInvalid(Base("dim", "4611686018427387904"), {"'dim'", "at most 131072"});
  ExpectInvalid(Base("ffn_dim_multiplier", "1e300"), {"'ffn_dim_multiplier'", "at most 16"});
  ExpectInvalid(Base("vocab_size", "4294967296"), {"'vocab_size'", "at most 2147483647"});
  ExpectInvalid(Base("head_dim", "262144"), {"'head_dim'"});
  ExpectInvalid(Base("swa_window", "1099511627776"), {"'swa_window'"});
  ExpectInvalid(Base("max_seqlen", "1099511627776"), {"'max_seqlen'"});
  // Every width in bounds, but 100,000 layers of that width: more than 2^50 parameters.
  ExpectInvalid(R"({"dim": 131072, "n_layers": 100000, "n_heads": 512, "vocab_size": 258,)"
                R"( "attn_at": "all"})",
                {"'n_layers'", "parameters"});
  // The same width with a few layers is accepted, and its counts are exact.
  auto wide = ParseModelConfig(
      R"({"dim": 131072, "n_layers": 2, "n_heads": 512, "vocab_size": 258, "attn_at": "all"})");
  ASSERT_TRUE(wide.ok()) << wide.status();
  EXPECT_GT(CountParameters(*wide).total, 0);
}

TEST(ModelConfigTest, RejectsUnknownActivationAndTokenizer) {
  std::string act = kBase;
  act.replace(act.find("\"num_reads\": 4"), 14, "\"num_reads\": 4, \"read_act\": \"Tanh\"");
  ExpectInvalid(act, {"sdm_args.read_act", "'Tanh'"});
  ExpectInvalid(Base("tokenizer", R"({"name": "wordpiece"})"), {"tokenizer.name", "'wordpiece'"});
  ExpectInvalid(Base("vocab_size", "100"), {"vocab_size", "258"});
  ExpectInvalid(Base("dim", "\"64\""), {"'dim'", "expected an integer"});
}

// nlohmann parses nesting iteratively but dumps it recursively: an error message that quoted a
// deeply nested value whole overflowed the stack. Each typed getter is reached with one.
TEST(ModelConfigTest, RejectsDeeplyNestedValuesWithoutRecursion) {
  const std::string deep = std::string(1'000'000, '[') + std::string(1'000'000, ']');
  for (const std::string field :
       {"dim", "norm_eps", "weight_tying", "init_std_factor", "swa_window", "attn_at"}) {
    SCOPED_TRACE(field);
    const absl::Status s = ParseError(Base(field, deep));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("'" + field + "'"));
    EXPECT_LT(s.message().size(), 300u) << s;
  }
  ExpectInvalid("{\"dim\": " + deep + "}", {"'dim'", "expected an integer"});
  ExpectInvalid(Base("sdm_args", "{\"num_heads\": " + deep + "}"), {"'sdm_args.num_heads'"});
  ExpectInvalid(Base("sdm_args", deep), {"'sdm_args'", "expected an object"});
}

// A multiplier small enough to round the FFN's hidden size down to 0 was accepted (it is
// positive), and the FFN's GEMMs with an inner size of 0 never wrote their output: the block
// added stale memory to the residual.
TEST(ModelConfigTest, RejectsAnFfnMultiplierThatLeavesNoHiddenUnits) {
  // dim 64: h = int(8 * 64 / 3) = 170; int(0.005 * 170) = 0.
  ExpectInvalid(Base("ffn_dim_multiplier", "0.005"), {"'ffn_dim_multiplier'", "hidden size"});
  // int(0.006 * 170) = 1, rounded up to multiple_of: the smallest multiplier that leaves a unit.
  auto one = ParseModelConfig(Base("ffn_dim_multiplier", "0.006"));
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(FfnHiddenDim(*one), one->multiple_of);
}

TEST(ModelConfigTest, FfnHiddenDimFollowsTheReference) {
  ModelConfig c;
  c.dim = 1024;
  EXPECT_EQ(FfnHiddenDim(c), 2816);
  c.dim = 2048;
  EXPECT_EQ(FfnHiddenDim(c), 5632);
  c.dim = 4096;
  EXPECT_EQ(FfnHiddenDim(c), 11008);
  c.ffn_dim_multiplier = 1.3;  // int(1.3 * 10922) = 14198 -> 14336
  EXPECT_EQ(FfnHiddenDim(c), 14336);
}

TEST(ModelConfigTest, PresetSizesMatchTheDesignTable) {
  const ModelConfig tiny = Preset("tiny");
  EXPECT_EQ(tiny.dim, 64);
  EXPECT_EQ(SdmStateElements(tiny), 4096);
  EXPECT_EQ(FullAttentionKvElementsPerToken(tiny), 0);

  const ModelConfig debug_sdm = Preset("debug_sdm");
  EXPECT_EQ(SdmStateElements(debug_sdm), 4 * 4096 * 1024);
  EXPECT_EQ(FullAttentionKvElementsPerToken(debug_sdm) * 2, 16384);  // 16 KB bf16

  const ModelConfig flagship = Preset("sdm_flagship");
  EXPECT_EQ(SdmStateElements(flagship), int64_t{805306368});
  EXPECT_EQ(SdmGeometryOf(flagship).side, 256);
  EXPECT_EQ(SdmGeometryOf(flagship).head_width, 1024);
  EXPECT_EQ(FullAttentionKvElementsPerToken(flagship), 0);
  int swa = 0;
  for (LayerType t : flagship.layer_types) swa += t == LayerType::kSwa;
  EXPECT_EQ(swa, 18);

  EXPECT_EQ(FullAttentionKvElementsPerToken(Preset("baseline_1.4B")) * 2, 24576);  // 24.6 KB
  EXPECT_EQ(FullAttentionKvElementsPerToken(Preset("baseline_7B")) * 2, 65536);    // 65.5 KB
  EXPECT_EQ(SdmStateElements(Preset("sdm_7B")), int64_t{2147483648});
  EXPECT_TRUE(Preset("sdm_7B").attn_gate);

  EXPECT_EQ(PresetConfig("huge").status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(PresetConfig("huge").status().message(), HasSubstr("sdm_flagship"));
}

TEST(ModelConfigTest, FlagshipParameterCountsSeparateM0) {
  const ParameterCounts p = CountParameters(Preset("sdm_flagship"));
  EXPECT_EQ(p.m0, 6 * 2 * 65536 * int64_t{1024});
  EXPECT_EQ(p.total, p.without_m0 + p.m0);
  EXPECT_GT(p.without_m0, int64_t{1'000'000'000});
  EXPECT_LT(p.without_m0, int64_t{1'600'000'000});
}

TEST(ModelConfigTest, JsonRoundTripOfEveryPreset) {
  for (const std::string& name : PresetNames()) {
    SCOPED_TRACE(name);
    const ModelConfig c = Preset(name);
    auto back = ParseModelConfig(ModelConfigToJson(c));
    ASSERT_TRUE(back.ok()) << back.status();
    ExpectSameConfig(c, *back);
  }
}

TEST(ModelConfigTest, JsonRoundTripOfNonDefaultFields) {
  ModelConfig c = Preset("tiny");
  c.head_dim = 16;
  c.ffn_dim_multiplier = 1.5;
  c.multiple_of = 64;
  c.norm_eps = 1e-6;
  c.rope_theta = 500000;
  c.weight_tying = true;
  c.swa_n_heads = 2;
  c.swa_n_kv_heads = 1;
  c.swa_head_dim = 8;
  c.attn_gate = true;
  c.init_base_std = 0.01;
  c.init_std_factor = "current_depth";
  c.max_seqlen = 4096;
  c.seed = 7;
  c.tokenizer = {"sp", "spm/tok.model"};
  SdmArgs& a = c.sdm;
  a.read_act = AddressActivation::kL2Normalize;
  a.write_act = AddressActivation::kRelu;
  a.read_act_scale = 2.5;
  a.write_act_scale = 0.5;
  a.normalize_readings = false;
  a.norm_eps = 1e-5;
  a.backprop_on_memory = false;
  a.output_gate = false;
  a.query_batchnorm = true;
  a.key_weighted_decay = true;
  a.update_rule = UpdateRule::kSlotResidual;
  a.memory_block_size = 32;
  a.dt_bias_init = 0.25;
  a.a_init_min = 1;
  a.a_init_max = 8;
  a.snapshot_quant = "int8";
  a.log_memory_access_stats = true;
  a.log_memory_norms = true;
  ASSERT_TRUE(FinalizeModelConfig(c).ok());
  auto back = ParseModelConfig(ModelConfigToJson(c));
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSameConfig(c, *back);
}

TEST(ModelConfigTest, ReferenceSpellingsAreAccepted) {
  // Fields the reference writes into params.json / the yaml `model` section.
  auto c = ParseModelConfig(Base("sdm_args", R"({"dim": 64, "num_heads": 2, "slots_per_head": 64,
      "A_init_range": [1, 4], "read_act": "Softmax", "update_rule": "slot_residual"})"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sdm.a_init_min, 1);
  EXPECT_EQ(c->sdm.a_init_max, 4);
  EXPECT_EQ(c->sdm.update_rule, UpdateRule::kSlotResidual);
}

TEST(ApplyConfigOverrideTest, SetsFieldsAndRefinalizes) {
  ModelConfig c = Preset("tiny");
  ASSERT_TRUE(ApplyConfigOverride(c, "sdm_args.num_writes=16").ok());
  EXPECT_EQ(c.sdm.num_writes, 16);
  ASSERT_TRUE(ApplyConfigOverride(c, "sdm_args.read_act=Identity").ok());  // bare string
  EXPECT_EQ(c.sdm.read_act, AddressActivation::kIdentity);
  ASSERT_TRUE(ApplyConfigOverride(c, "swa_window=128").ok());
  EXPECT_EQ(AttentionGeometryOf(c, 0).window, 128);
  ASSERT_TRUE(ApplyConfigOverride(c, "attn_gate=true").ok());
  EXPECT_TRUE(c.attn_gate);
}

TEST(ApplyConfigOverrideTest, RejectsBadKeysAndValues) {
  ModelConfig c = Preset("tiny");
  const std::string before = ModelConfigToJson(c);
  auto expect_error = [&](const std::string& assignment, const std::string& part) {
    SCOPED_TRACE(assignment);
    const absl::Status s = ApplyConfigOverride(c, assignment);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr(part));
    EXPECT_EQ(ModelConfigToJson(c), before);  // unchanged
  };
  expect_error("dimm=3", "'dimm'");
  expect_error("sdm_args.bogus=1", "'sdm_args.bogus'");
  expect_error("bogus.num_heads=1", "no section 'bogus'");
  expect_error("no_equals", "key=value");
  expect_error("=3", "key=value");
  expect_error("sdm_args.slots_per_head=1000", "perfect square");
  expect_error("n_kv_heads=3", "n_kv_heads");
  expect_error("sdm_at=[2,3]", "more than one list");
  // A bare string that is not UTF-8 (found by tests/fuzz/model_config_fuzzer.cc: writing the
  // config threw nlohmann's type_error 316 and aborted the process).
  expect_error("tokenizer.name=\x9e\x86", "not valid UTF-8");
  expect_error("sdm_args.read_act=ab\xff", "not valid UTF-8");
}

TEST(ApplyConfigOverrideTest, SeveralOverridesMoveLayersTogether) {
  ModelConfig c = Preset("tiny");
  // Each alone is invalid (a layer in no list, then in two); together they are a partition.
  EXPECT_FALSE(ApplyConfigOverride(c, "swa_at=[0,1]").ok());
  ASSERT_TRUE(ApplyConfigOverrides(c, {"swa_at=[0,1]", "sdm_at=[2,3]"}).ok());
  EXPECT_EQ(c.layer_types, (std::vector<LayerType>{LayerType::kSwa, LayerType::kSwa,
                                                   LayerType::kSdm, LayerType::kSdm}));
  ASSERT_TRUE(ApplyConfigOverrides(c, {"n_layers=2", "swa_at=[0]", "sdm_at=[1]"}).ok());
  EXPECT_EQ(c.n_layers, 2);
  const absl::Status s = ApplyConfigOverrides(c, {"n_layers=3", "swa_at=[0]"});
  EXPECT_THAT(s.message(), HasSubstr("overrides 'n_layers=3', 'swa_at=[0]'"));
  EXPECT_EQ(c.n_layers, 2);
  ASSERT_TRUE(ApplyConfigOverrides(c, {"tokenizer.name=sp", "tokenizer.path=t/sp.model"}).ok());
  EXPECT_EQ(c.tokenizer.path, "t/sp.model");
}

}  // namespace
}  // namespace sdm
