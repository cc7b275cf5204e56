// The seam between the engine's front (engine/engine.h: validation, state layout, fingerprint)
// and the code that runs the forward pass on a device. A backend receives only validated calls:
// tokens inside the vocabulary, sessions of this model, no session twice in one batch.
//
// Backends: the CPU one (engine/cpu_backend.cc), always built, and the CUDA one
// (engine/cuda/cuda_backend.cc), built when the build has CUDA (SDM_HAVE_CUDA).
#ifndef SDMSERVE_ENGINE_ENGINE_BACKEND_H_
#define SDMSERVE_ENGINE_ENGINE_BACKEND_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "kernels/common/sdm_addressing_math.h"
#include "state_store/session_state.h"
#include "state_store/state_layout.h"

namespace sdm {

// What every backend is built from. The layout is the host format of a session's state (what
// the state store keeps and snapshots); a device backend mirrors it in its own memory.
struct EngineContext {
  std::shared_ptr<const Model> model;
  EngineOptions options;
  const StateLayout* layout = nullptr;  // owned by the Engine, outlives the backend
};

// The kernels' name for a config's address activation (both backends share the enum).
kernels::AddressAct ToAddressAct(AddressActivation a);

// A run of consecutive tokens of one session inside a forward call: a decode batch has one
// segment of length 1 per session, a prefill chunk one segment.
struct Segment {
  SessionState* session;
  int64_t first_row;  // row of the segment's first token in the activations
  int64_t length;
  int64_t pos0;  // position of its first token
};

class EngineBackend {
 public:
  virtual ~EngineBackend() = default;

  // See Engine::Prefill / Engine::Decode; arguments are already validated.
  virtual absl::Status Prefill(SessionState& session, std::span<const int32_t> tokens,
                               bool all_positions, std::vector<float>* logits) = 0;
  virtual absl::Status Decode(std::span<SessionState* const> sessions,
                              std::span<const int32_t> tokens, std::span<float> logits) = 0;

  virtual EngineDevice device() const = 0;
  // One line for logs and model info, e.g. "cpu, 2 threads".
  virtual std::string Describe() const = 0;

  // Bytes of session state the device can hold whatever its mix (0: bounded only by host RAM).
  virtual int64_t StateCapacityBytes() const { return 0; }

  virtual const EngineProfile& profile() const = 0;
  virtual void ResetProfile() = 0;
};

absl::StatusOr<std::unique_ptr<EngineBackend>> CreateCpuBackend(const EngineContext& context);

// Unavailable on builds without CUDA or machines without a device.
absl::StatusOr<std::unique_ptr<EngineBackend>> CreateCudaBackend(const EngineContext& context);

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_ENGINE_BACKEND_H_
