// The seam between the engine's front (engine/engine.h: validation, chunking, positions,
// profiling, state layout, fingerprint) and the code that runs the forward pass on a device.
// A backend implements one forward pass over a batch of segments; everything around it is the
// front's, so the CPU and CUDA backends differ only in the math.
//
// Backends: the CPU one (engine/cpu_backend.cc), always built, and the CUDA one
// (engine/cuda/cuda_backend.cc), built when the build has CUDA (SDM_HAVE_CUDA). Both bind their
// weights from the typed roles of engine/weight_spec.h (engine/layer_tensors.h).
#ifndef SDMSERVE_ENGINE_ENGINE_BACKEND_H_
#define SDMSERVE_ENGINE_ENGINE_BACKEND_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/sampler.h"
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

// A run of consecutive tokens of one session inside a forward pass: a decode token is a segment
// of length 1, a prefill chunk a segment of up to EngineOptions::prefill_chunk tokens.
struct Segment {
  SessionState* session;
  int64_t first_row;  // row of the segment's first token in the activations
  int64_t length;
  int64_t pos0;  // position of its first token: session->position() when the pass starts
};

// Wall time per part of a forward pass, added to the front's EngineProfile. A backend calls
// Lap(&EngineProfile::part) at the end of each part; the time since the previous lap (or since
// construction) goes to that part. Disabled (null profile): no clock reads. A backend whose
// work is asynchronous synchronises before a lap, and only when enabled().
class ForwardProfiler {
 public:
  explicit ForwardProfiler(EngineProfile* profile) : profile_(profile) {
    if (profile_ != nullptr) mark_ = Clock::now();
  }
  bool enabled() const { return profile_ != nullptr; }
  void Lap(double EngineProfile::*part) {
    if (profile_ == nullptr) return;
    const Clock::time_point now = Clock::now();
    profile_->*part += std::chrono::duration<double>(now - mark_).count();
    mark_ = now;
  }

 private:
  using Clock = std::chrono::steady_clock;
  EngineProfile* profile_;
  Clock::time_point mark_{};
};

// A forward pass's point of no return, shared by the backends. Before Begin() nothing of the
// pass's sessions has changed, and a failure is returned as is (the pass can be retried). After
// Begin() (called just before the first operation that may write a session's layers: a KV append,
// an SDM row write), a failure leaves the layers half-updated, so Fail() marks every segment's
// session failed (SessionState::MarkFailed) and says so in the status it returns. A backend
// with asynchronous work waits for what it enqueued before calling Fail (its staging buffers
// must outlive their copies; the state it reports must be final).
class ForwardCommit {
 public:
  explicit ForwardCommit(std::span<const Segment> segments) : segments_(segments) {}
  void Begin() { begun_ = true; }
  bool begun() const { return begun_; }
  // `cause` (not OK) as the pass's result; see the class comment.
  absl::Status Fail(absl::Status cause) const;

 private:
  std::span<const Segment> segments_;
  bool begun_ = false;
};

// Testing seam (EngineOptions::inject_forward_fault): a backend calls Fire() at each point where
// a forward pass may fail after it began changing sessions (the end of each layer on the CPU;
// each launch on CUDA once the pass began writing state); the call numbered `fail_at` (0-based,
// counted over the backend's life) returns true, once. Negative: never.
class ForwardFaultInjector {
 public:
  explicit ForwardFaultInjector(int64_t fail_at) : fail_at_(fail_at) {}
  bool Fire() { return calls_++ == fail_at_; }  // a negative fail_at_ is never reached
  int64_t calls() const { return calls_; }      // fault points passed so far

 private:
  int64_t fail_at_;
  int64_t calls_ = 0;
};

// A token a pass draws on the device from one of its rows (EngineBackend::DrawsOnDevice):
// SampleToken(that row's logits, *params, draw_index), engine/sampler.h.
struct ForwardDraw {
  int64_t row = 0;
  const SamplingParams* params = nullptr;
  uint64_t draw_index = 0;
};

// What a forward pass hands back: the logits of `logit_rows`, in that order, to `logits`
// ([rows, vocab]; null iff logit_rows is empty), and the token drawn for each of `draws` to
// `sampled` ([draws.size()]; null iff draws is empty; only for a backend that DrawsOnDevice()).
// A row may be in both lists.
struct ForwardOutputs {
  std::span<const int64_t> logit_rows;
  float* logits = nullptr;
  std::span<const ForwardDraw> draws;
  int32_t* sampled = nullptr;
};

class EngineBackend {
 public:
  virtual ~EngineBackend() = default;

  // One forward pass: row r of the activations is tokens[r]; `segments` tile the rows
  // [0, tokens.size()) in order, at most one per session, each no longer than the engine's
  // prefill_chunk, with every single-token segment before the longer ones (a device backend
  // may run them as one decode batch); pos0 is each session's position. Tokens are inside the
  // vocabulary and sessions belong to this model (the front checked). Appends every segment's
  // tokens to its session's layers but does not advance positions (the front does, on OK).
  // On error either no session was changed (the status as is) or every segment's session is
  // marked failed (SessionState::MarkFailed; ForwardCommit) and the status says so; never a
  // silently half-updated session.
  // Writes `out` (ForwardOutputs). Single-token segments take the decode attention path and
  // longer ones the prefill path, whatever else is in the pass.
  virtual absl::Status Forward(std::span<const int32_t> tokens, std::span<const Segment> segments,
                               const ForwardOutputs& out, ForwardProfiler& profiler) = 0;

  // Whether Forward draws tokens itself (ForwardOutputs::draws). If not, the front asks for the
  // rows' logits and draws on the host; the tokens are the same either way (the CUDA sampling
  // kernel's contract, kernels/cuda/sampling.h).
  virtual bool DrawsOnDevice() const { return false; }

  virtual EngineDevice device() const = 0;
  // One line for logs and model info, e.g. "cpu, 2 threads".
  virtual std::string Describe() const = 0;

  // Bytes of session state the device can hold whatever its mix (0: bounded only by host RAM).
  virtual int64_t StateCapacityBytes() const { return 0; }

  // Bytes of the matrices a step streams, as the backend stores them (0: not counted).
  virtual int64_t PackedWeightBytes() const { return 0; }
  // The CUDA backend's decode graphs so far (EngineOptions::cuda_graphs); zeros elsewhere.
  virtual DecodeGraphStats decode_graph_stats() const { return {}; }

  // Engine::StageResume for a session of this model, not failed and not on a device. Called from
  // any thread, also while Forward runs on other sessions. Default: nothing to stage.
  virtual absl::Status StageResume(SessionState& session) { return absl::OkStatus(); }
  virtual ResumeStagingStats resume_staging_stats() const { return {}; }
};

absl::StatusOr<std::unique_ptr<EngineBackend>> CreateCpuBackend(const EngineContext& context);

// Unavailable on builds without CUDA or machines without a device.
absl::StatusOr<std::unique_ptr<EngineBackend>> CreateCudaBackend(const EngineContext& context);

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_ENGINE_BACKEND_H_
