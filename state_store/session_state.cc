#include "state_store/session_state.h"

namespace sdm {

SessionState::SessionState(const StateLayout& layout) {
  layers_.reserve(layout.layers.size());
  for (const LayerStateLayout& l : layout.layers) {
    if (l.kind == LayerStateLayout::Kind::kSdm) {
      layers_.emplace_back(std::in_place_type<SdmTable>, l);
    } else {
      layers_.emplace_back(std::in_place_type<KvCache>, l.kv_row_width, l.ring_capacity);
    }
  }
}

std::unique_ptr<SessionState> SessionState::Copy(bool share_rows) const {
  auto copy = std::make_unique<SessionState>(StateLayout{});
  copy->position_ = position_;
  copy->sampler_seed = sampler_seed;
  copy->sampler_draws = sampler_draws;
  copy->pending_token = pending_token;
  copy->layers_.reserve(layers_.size());
  for (const auto& layer : layers_) {
    if (const auto* t = std::get_if<SdmTable>(&layer)) {
      copy->layers_.emplace_back(share_rows ? t->Fork() : t->Clone());
    } else {
      copy->layers_.emplace_back(std::get<KvCache>(layer).Clone());
    }
  }
  return copy;
}

std::unique_ptr<SessionState> SessionState::Clone() const { return Copy(/*share_rows=*/false); }
std::unique_ptr<SessionState> SessionState::Fork() const { return Copy(/*share_rows=*/true); }

int64_t SessionState::ResidentBytes() const {
  int64_t bytes = 0;
  for (const auto& layer : layers_) {
    bytes += std::visit([](const auto& l) { return l.ResidentBytes(); }, layer);
  }
  return bytes;
}

}  // namespace sdm
