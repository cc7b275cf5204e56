#include "state_store/session_state.h"

#include <utility>

#include "base/check.h"

namespace sdm {

SessionState::SessionState(const StateLayout& layout) {
  layers_.reserve(layout.layers.size());
  for (const LayerStateLayout& l : layout.layers) {
    if (l.kind == LayerStateLayout::Kind::kSdm) {
      layers_.emplace_back(std::in_place_type<SdmTable>, l);
    } else {
      layers_.emplace_back(std::in_place_type<KvCache>, l.kv_row_width, l.ring_capacity,
                           l.kv_element);
    }
  }
}

std::unique_ptr<SessionState> SessionState::Copy(bool share_rows) const {
  // The host layers are stale while on device; copying them would fork an old state.
  SDM_CHECK(device_ == nullptr);
  auto copy = std::make_unique<SessionState>(StateLayout{});
  copy->position_ = position_;
  copy->sampler_seed = sampler_seed;
  copy->sampler_draws = sampler_draws;
  copy->pending_token = pending_token;
  copy->failure_ = failure_;  // a copy of damaged layers is damaged
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

void SessionState::AttachDevice(std::unique_ptr<DeviceResidency> residency) {
  SDM_CHECK(residency != nullptr);
  SDM_CHECK(device_ == nullptr);  // two device copies: which one is the truth?
  staged_.reset();                // the device copy is the truth from now on
  device_ = std::move(residency);
  // Not current until a copy back says so: only a backend that copies the host layers
  // unchanged to the device (what CopyChangesToHost relies on) leaves them equal to its copy, so
  // nothing encodes them on the strength of the attach alone.
  host_current_ = false;
}

void SessionState::AttachStaged(std::unique_ptr<StagedUpload> staged) {
  SDM_CHECK(staged != nullptr);
  SDM_CHECK(device_ == nullptr);  // the host layers it copies are stale
  staged_ = std::move(staged);
}

absl::Status SessionState::SyncToHost() {
  if (device_ == nullptr) return absl::OkStatus();
  if (!host_current_) {
    if (absl::Status s = device_->CopyToHost(*this); !s.ok()) return s;
  }
  device_.reset();
  return absl::OkStatus();
}

absl::Status SessionState::CopyChangesToHost() {
  if (host_current()) return absl::OkStatus();
  if (absl::Status s = device_->CopyChangesToHost(*this); !s.ok()) return s;
  host_current_ = true;
  return absl::OkStatus();
}

int64_t SessionState::ResidentBytes() const {
  int64_t bytes = 0;
  for (const auto& layer : layers_) {
    bytes += std::visit([](const auto& l) { return l.ResidentBytes(); }, layer);
  }
  return bytes;
}

}  // namespace sdm
