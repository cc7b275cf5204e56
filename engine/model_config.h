// The model's configuration: the reference implementation's `model` arguments (Lingua's
// LMTransformerArgs with SparseDeltaMemoryArgs), plus the tokenizer. This is the one config
// struct of the project; every shape is derived from it here (docs/model-format.md lists the
// fields and docs/model-spec.md the semantics).
//
// ParseModelConfig() validates everything a model needs before any weight is read: layer lists
// that partition the layers, head counts that divide, slots_per_head a perfect square, known
// activation names. Unknown fields are rejected by name (a typo must not silently fall back to
// a default). Derived per-layer values follow the reference's fallbacks exactly.
#ifndef SDMSERVE_ENGINE_MODEL_CONFIG_H_
#define SDMSERVE_ENGINE_MODEL_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace sdm {

enum class LayerType { kAttn, kSwa, kSdm };
absl::string_view LayerTypeName(LayerType type);

// Activation applied to the K selected product-key scores (reference `read_act`/`write_act`).
enum class AddressActivation { kSoftmax, kL2Normalize, kIdentity, kSigmoid, kRelu };

// Opt-in alternative to the reference's shared-residual delta rule (docs/model-spec.md §5.4).
enum class UpdateRule { kSharedResidual, kSlotResidual };

struct SdmArgs {
  int64_t num_heads = 1;
  int64_t slots_per_head = 10000;
  int64_t num_writes = 1;  // W
  int64_t num_reads = 1;   // R
  AddressActivation read_act = AddressActivation::kSoftmax;
  AddressActivation write_act = AddressActivation::kSoftmax;
  double read_act_scale = 1.0;
  double write_act_scale = 1.0;
  bool normalize_readings = false;
  double norm_eps = 1e-6;
  bool backprop_on_memory = true;  // learned M0 (`memory` tensor); else M0 = 0
  bool output_gate = false;
  bool query_batchnorm = false;
  bool key_weighted_decay = false;
  UpdateRule update_rule = UpdateRule::kSharedResidual;
  // Training-only fields, kept so a config round-trips and init follows the reference.
  int64_t memory_block_size = 256;
  double dt_bias_init = 0.0;
  double a_init_min = 0.0;
  double a_init_max = 16.0;
  std::string snapshot_quant = "none";
  bool log_memory_access_stats = false;
  bool log_memory_norms = false;
};

struct TokenizerConfig {
  std::string name = "bytes";  // "bytes" or "sp" (SentencePiece)
  std::string path;            // SentencePiece model file, relative to the model directory
};

struct ModelConfig {
  int64_t dim = 512;
  int64_t n_layers = 8;
  std::optional<int64_t> head_dim;
  std::optional<int64_t> n_heads;
  std::optional<int64_t> n_kv_heads;
  std::optional<double> ffn_dim_multiplier;
  int64_t multiple_of = 256;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  int64_t vocab_size = -1;
  bool weight_tying = false;
  // Each is "all", a list of layer indices, or empty; together they partition the layers.
  std::vector<int64_t> attn_at, swa_at, sdm_at;
  std::optional<int64_t> swa_window;
  std::optional<int64_t> swa_n_heads;
  std::optional<int64_t> swa_n_kv_heads;
  std::optional<int64_t> swa_head_dim;
  bool attn_gate = false;
  SdmArgs sdm;
  TokenizerConfig tokenizer;
  // Training-only fields (initialisation, RoPE table length); kept for round-trips.
  std::optional<double> init_base_std;
  std::string init_std_factor = "disabled";
  int64_t max_seqlen = 1024;
  int64_t seed = 42;

  // ---- Derived (filled by ParseModelConfig / Finalize) ----
  std::vector<LayerType> layer_types;
};

// Attention geometry of one attention (attn or swa) layer, after the reference's fallbacks.
struct AttentionGeometry {
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t window = 0;  // 0 = full causal attention
};

// SDM geometry shared by all SDM layers.
struct SdmGeometry {
  int64_t heads = 0;           // H
  int64_t side = 0;            // s, with s * s = slots_per_head
  int64_t slots_per_head = 0;  // s^2
  int64_t head_width = 0;      // hd = dim / H (row width)
  int64_t key_size = 0;        // H * 2s columns of Wq_read / Wk_write
  // Slots one token writes per head: min(num_writes, s^2), the addressing's AddressCount
  // (docs/model-spec.md §5.2). What the backends select and a journaled write records.
  int64_t writes = 0;
};

// Resolves layer types and validates `config` in place. Every error names the field.
absl::Status FinalizeModelConfig(ModelConfig& config);

// Parses config.json text (the reference's `model` section plus "tokenizer") and finalizes it.
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text);

// Serialises a config to config.json text (inverse of ParseModelConfig for every field).
std::string ModelConfigToJson(const ModelConfig& config);

// FFN hidden size: multiple_of * ceil(h / multiple_of), h = int(2 * 4 * dim / 3) (times
// ffn_dim_multiplier when set), as the reference's FeedForward computes it.
int64_t FfnHiddenDim(const ModelConfig& config);

// Requires a finalized config and an attn or swa layer.
AttentionGeometry AttentionGeometryOf(const ModelConfig& config, int64_t layer);

SdmGeometry SdmGeometryOf(const ModelConfig& config);

// Names of the presets `sdm-model init --preset` knows (docs/model-spec.md §8).
std::vector<std::string> PresetNames();

// A preset's config (finalized). Unknown names are an error listing the known ones.
absl::StatusOr<ModelConfig> PresetConfig(absl::string_view name);

// Applies one `key=value` override (dotted keys reach sdm_args, e.g. sdm_args.num_writes=8;
// values are JSON, e.g. swa_at=[0,1]) and re-finalizes.
absl::Status ApplyConfigOverride(ModelConfig& config, absl::string_view assignment);

// Applies several overrides in order and finalizes once, after the last: moving layers between
// lists takes several assignments whose intermediate states are not valid configs
// (--set swa_at=[0,1] --set sdm_at=[2,3]). On error `config` is unchanged.
absl::Status ApplyConfigOverrides(ModelConfig& config, const std::vector<std::string>& assignments);

// Bytes of one session's SDM state if every row were materialised (H * s^2 * hd per SDM layer),
// and of full-attention KV per cached token, for the given element size.
int64_t SdmStateElements(const ModelConfig& config);
int64_t FullAttentionKvElementsPerToken(const ModelConfig& config);

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_MODEL_CONFIG_H_
