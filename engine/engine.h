// The inference engine: the forward pass of docs/model-spec.md over sessions' states, on CPU or
// on a CUDA device (EngineOptions::device; engine/engine_backend.h). The contract below is the
// CPU backend's; the CUDA backend (docs/model-spec.md §6) runs the same model with bf16 weights and
// state and fp32 accumulation, so it matches the CPU within bf16 tolerance, not bit for bit, and
// its batches are not guaranteed batch-invariant (cuBLASLt may pick another kernel per batch size).
//
// Weights are immutable and shared; each session's state (state_store/session_state.h) is read
// and written only inside Step (and its wrappers Prefill/Decode), which advances its position.
// A step runs any mix of prefill chunks and decode tokens of many sessions as one forward pass:
// the projections and FFNs are GEMMs over all rows (kernels/cpu/gemm.h, on weights repacked once
// at creation), the per-session work (attention over a session's cache, the SDM write/read) runs
// on the engine's threads. A step gives every session exactly the logits it would get alone (bit
// for bit): the GEMMs are batch-invariant (kernels/cpu/gemm.h), the per-session work never
// depends on the batch, and a session's tokens are cut into the same chunks wherever they run.
// Prefill and token-by-token decode agree to fp32 rounding (prefill attention reduces in a
// different order): a segment of one token takes the decode path, a longer one the prefill path.
//
// Thread-safety: one Step/Prefill/Decode call at a time per Engine (the scheduler's step loop); a
// session must not appear twice in one step.
#ifndef SDMSERVE_ENGINE_ENGINE_H_
#define SDMSERVE_ENGINE_ENGINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/bf16.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "state_store/session_state.h"
#include "state_store/state_layout.h"

namespace sdm {

// Where the forward pass runs. kAuto: CUDA when the build has it and a device is present, else
// the CPU.
enum class EngineDevice { kAuto, kCpu, kCuda };

// "auto", "cpu", "cuda" (what --device flags accept).
const char* EngineDeviceName(EngineDevice device);
absl::StatusOr<EngineDevice> ParseEngineDevice(std::string_view name);

// The CPU backend's decode attention kernel (single-token segments).
enum class CpuDecodeAttention {
  kBlocked,  // all heads against blocks of whole cache rows, split-K
             // (kernels/cpu/decode_attention.h)
  kPerHead,  // one task per (session, head) over strided row slices (AttendDecodeHead); the
             // earlier kernel, kept so benchmarks can compare the two in one run
};

// How the CPU backend stores its matrices and KV caches (sliding-window rings included):
// kF32, the default, is the exact engine the contract above describes; kBf16 rounds every
// matrix (not the embedding table read by row, not the norms and biases) and every cached key
// and value row to bf16 and widens them back to fp32 inside the kernels, accumulating in fp32:
// half the bytes streamed per decode step, batch-invariant like fp32 (the same reductions on
// the rounded values) but not equal to it (logit error and greedy agreement in
// docs/benchmarks.md, "16-bit weights and caches on the CPU"). SDM rows stay fp32 in both modes.
// Snapshots hold fp32 rows in both modes, so a session moves between them (a bf16 engine rounds
// what it restores). The CUDA backend always stores bf16 and rejects kBf16 here (only the CPU's
// format is chosen by this option).
// "fp32", "bf16" (what --cpu_dtype flags accept).
const char* CpuDtypeName(DType dtype);
absl::StatusOr<DType> ParseCpuDtype(std::string_view name);

// Testing only (EngineOptions::observe_sdm_readings): an SDM layer's readings before their norm.
using SdmReadingsObserver = std::function<void(int64_t layer, std::span<const float> readings)>;

struct StepBatch;

struct EngineOptions {
  EngineDevice device = EngineDevice::kCpu;
  int num_threads = 0;  // 0: one per hardware thread (CPU backend; the CUDA backend's host side)
  // How much nicer (Linux nice increment, 0 to 19; base/thread_priority.h) the threads that run
  // decode steps are than the rest of the process: the CPU backend's kernel threads, and the
  // thread that calls Step(), which lowers itself (the server's scheduler does, with this value).
  // On cores the decode fills, this lets a front end answer (refuse, cancel, report health)
  // ahead of the next step; docs/benchmarks.md, "Overload rejection latency", measures both it
  // and what it costs in decode throughput.
  int decode_nice = 0;
  // Prefill processes prompts in chunks of this many tokens (bounds activation memory).
  int64_t prefill_chunk = 256;
  // Accumulate wall time per part of the forward pass (benchmarks); off: no clock reads.
  bool profile = false;
  // CUDA backend: the longest context a full-attention layer can hold (sizes its page tables).
  int64_t max_context = 131072;
  // CUDA backend: bytes of device memory for sessions' state (KV pages and SDM rows); 0: this
  // share of the memory left free once weights and workspaces are allocated.
  int64_t device_state_bytes = 0;
  double device_state_fraction = 0.85;
  // CUDA backend: the most device memory a park or resume moves its state through at once
  // (engine/cuda/device_state.h, TransferStaging); 0: the default, kTransferChunkBytes there.
  // Tests set it small to make transfers take many chunks.
  int64_t device_transfer_chunk_bytes = 0;
  // CUDA backend: the most page-locked host memory that resumes staged ahead of their step
  // hold at once (Engine::StageResume), the pool of their buffers included: host memory on top
  // of the state store's budgets. 0: none staged.
  int64_t resume_staging_bytes = int64_t{4} << 30;
  // CUDA backend: the most device memory that staged resumes copied to the device ahead of their
  // step hold at once (on a stream of their own, as they are staged; the step then only scatters
  // them), the pool of their buffers included. Kept out of the memory left free once weights are
  // loaded before device_state_fraction's share is taken; with device_state_bytes set, it comes
  // from the memory beside that, as the activations do. Nothing is kept, or copied ahead, when
  // resume_staging_bytes is 0. A staged image that does not fit waits in page-locked memory and
  // its step copies it, as with 0 (none copied ahead).
  int64_t resume_prefetch_bytes = int64_t{2} << 30;
  // CPU backend: the decode attention kernel.
  CpuDecodeAttention cpu_decode_attention = CpuDecodeAttention::kBlocked;
  // Testing only: make a forward pass fail part-way, after it began writing session state
  // (engine/engine_backend.h, ForwardFaultInjector: the fault point numbered this, counted over
  // the engine's life, fails once). Fault points: on the CPU backend the end of each layer of
  // every pass; on the CUDA backend each launch of a pass once it began writing state.
  // Negative: never.
  int64_t inject_forward_fault = -1;
  // Testing only: called with every step's batch once it is valid; true makes the step return
  // RESOURCE_EXHAUSTED having changed nothing, as a device does when the step's sessions do not
  // fit its memory (server/scheduler.h: the scheduler then runs fewer at once). Null: never.
  std::function<bool(const StepBatch&)> testing_refuse_step = nullptr;
  // Testing only (CUDA backend): make a park or resume fail part-way: the transfer chunk
  // numbered this (each chunk of every park and resume, counted over the engine's life) fails
  // once, after its copies were enqueued (engine/cuda/device_state.h, TransferStaging). Negative:
  // never.
  int64_t inject_transfer_fault = -1;
  // Testing only (CUDA backend): the most (slot, row) pairs a copy of a turn's changes lists per
  // SDM layer (engine/cuda/device_state.h CudaSessionState::ListWrittenRows); a longer list falls
  // back to reading the SDM tables and marks. Negative: the layer's private-row count.
  int64_t written_list_capacity = -1;
  // Testing only: called after each SDM layer of a pass with that layer's readings before their
  // norm ([pass rows, dim] floats, rows in the pass's order), so that tests compare backends
  // layer by layer. The CUDA backend copies them to the host, synchronising inside the pass, and
  // runs decode steps without graphs while it is set. Empty: never.
  SdmReadingsObserver observe_sdm_readings = nullptr;
  // CPU backend: the storage of matrices and KV rows (see DType above; kBf16 needs the blocked
  // decode kernel). Other than kF32 it makes device kAuto choose the CPU; kCuda refuses it.
  DType cpu_dtype = DType::kF32;
  // CUDA backend: run each decode step (every segment one token) as a CUDA graph captured once
  // per step shape (engine/cuda/decode_graph_cache.h), one launch instead of a few hundred. The
  // results are bit for bit those of the step launched kernel by kernel, which is what runs
  // when this is off, when profiling, when injecting faults, and for a shape whose capture
  // failed.
  bool cuda_graphs = true;
};

// How the CUDA backend ran its decode steps (EngineOptions::cuda_graphs); zeros elsewhere.
struct DecodeGraphStats {
  int64_t captures = 0;  // graphs captured and instantiated (one per new step shape)
  int64_t replays = 0;   // steps run as one graph launch (a capture's own step included)
  int64_t refusals = 0;  // step shapes whose capture failed (they run launch by launch)
};

// What Engine::StageResume did so far (the CUDA backend; zeros elsewhere).
struct ResumeStagingStats {
  int64_t staged = 0;      // sessions staged
  int64_t used = 0;        // resumes that uploaded from a staged image instead of converting
  int64_t refused = 0;     // sessions left unstaged: resume_staging_bytes was in use (or 0)
  int64_t held_bytes = 0;  // page-locked bytes held now by staged images and their pool
  int64_t prefetched = 0;  // staged images also copied to the device ahead (resume_prefetch_bytes)
  int64_t prefetch_held_bytes = 0;  // device bytes held now by those copies and their pool
};

// Seconds spent in each part of the forward pass since the last ResetProfile().
struct EngineProfile {
  double attn_seconds = 0;  // full-attention mixers (projections, attention, output)
  double swa_seconds = 0;   // sliding-window attention mixers
  double sdm_seconds = 0;   // SDM mixers (projections, addressing, write/read, output)
  double ffn_seconds = 0;   // norms and feed-forward blocks
  double head_seconds = 0;  // embeddings, final norm and logits
};

// What a step segment asks logits for: none, its last token's, or every token's.
enum class StepLogits { kNone, kLast, kAll };

// Tokens fed to one session in a step. The tokens are the caller's; they must outlive Step().
struct StepSegment {
  SessionState* session = nullptr;
  std::span<const int32_t> tokens;  // at least one
  StepLogits logits = StepLogits::kNone;
  // Non-null: the step also draws the token that follows the segment's last one, exactly
  // SampleToken(last token's logits, *sampling, draw_index) (engine/sampler.h), into Step's
  // `sampled`. The caller owns the params (they outlive Step()) and the session's draw count:
  // Step reads neither SessionState::sampler_draws nor changes it. On CUDA the draw runs on the
  // device and the row's logits stay there unless `logits` asks for them too.
  const SamplingParams* sampling = nullptr;
  uint64_t draw_index = 0;
};

// One engine step: any mix of prefill chunks and decode tokens of distinct sessions.
struct StepBatch {
  std::vector<StepSegment> segments;

  // Appends a segment; returns the row of Step's logits holding its first requested row
  // (kLast: its only row; kAll: its first token's), or -1 for kNone.
  int64_t Add(SessionState& session, std::span<const int32_t> tokens, StepLogits logits);
  // Appends a segment that also draws its next token (StepSegment::sampling); returns the index
  // of that token in Step's `sampled`. The logits row, if asked for, is as Add's.
  int64_t AddDraw(SessionState& session, std::span<const int32_t> tokens, StepLogits logits,
                  const SamplingParams& sampling, uint64_t draw_index);
  // Rows of logits a Step of this batch writes: one per kLast segment, one per token of a kAll
  // segment, in segment order.
  int64_t LogitRows() const;
  // Tokens a Step of this batch draws: one per segment with sampling, in segment order.
  int64_t Draws() const;
  int64_t TokenCount() const;
};

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(std::shared_ptr<const Model> model,
                                                        const EngineOptions& options = {});
  ~Engine();

  const ModelConfig& config() const;
  const EngineOptions& options() const;
  // The device the forward pass runs on (never kAuto) and a one-line description of it.
  EngineDevice device() const;
  std::string DescribeDevice() const;
  DecodeGraphStats decode_graph_stats() const;
  // Thread-safe (metrics read it while steps run).
  ResumeStagingStats resume_staging_stats() const;
  // Bytes of session state the device holds whatever its mix of KV pages and SDM rows; a state
  // store budget for resident sessions above it can make steps fail with RESOURCE_EXHAUSTED.
  // 0 on the CPU (bounded by host RAM only).
  int64_t device_state_capacity_bytes() const;
  // Bytes of the weights the backend streams per step (the CPU's packed matrices: halved by
  // cpu_dtype kBf16), 0 where the backend does not count them.
  int64_t packed_weight_bytes() const;
  // Bytes per value of a session's host-side key/value rows: 2 with cpu_dtype kBf16 on the CPU,
  // else 4 (what a token's cache costs in a state store's budget).
  int64_t host_kv_value_bytes() const;
  // The longest sequence (positions) a session may reach: on CUDA, options().max_context when
  // the model has a full-attention layer (its page tables end there: a step past it fails);
  // 0, no limit, otherwise.
  int64_t max_session_positions() const;
  const Model& model() const;
  int64_t vocab_size() const;

  // Identifies the model (config and weights) a session's state belongs to: a hash of the config
  // and of every tensor's name, shape and a strided sample of its values.
  uint64_t fingerprint() const;

  // The per-layer shape of a session's state for this model.
  const StateLayout& state_layout() const;
  std::unique_ptr<SessionState> NewSession() const;

  // Feeds every segment's tokens to its session and writes the logits asked for to `logits`
  // ([batch.LogitRows(), vocab], rows in segment order; see StepBatch::Add), and the tokens the
  // segments draw to `sampled` ([batch.Draws()], in segment order; StepSegment::sampling).
  //
  // Chunking: a segment longer than options().prefill_chunk is cut into chunks of that many
  // tokens (the last may be shorter), counted from the segment's first token, and the step runs
  // one forward pass per chunk index: pass k holds chunk k of every segment that has one, so
  // decode tokens and first chunks share pass 0. A session's numerics depend only on how its
  // own tokens are cut, never on the other segments.
  //
  // Errors (INVALID_ARGUMENT, nothing consumed): an empty or null segment, a token outside the
  // vocabulary, a session of another model (one whose state does not have this engine's
  // state_layout(): made for other widths, or by an engine with another prefill_chunk, whose
  // sliding-window rings differ, or another cpu_dtype), a session twice, an unknown StepLogits,
  // sampling params out of range (ValidateSamplingParams), a logits or sampled buffer of the wrong
  // size. A backend error (say RESOURCE_EXHAUSTED on a device) is returned as is when no session
  // was changed. A pass that fails after it began writing state marks its sessions failed
  // (SessionState::MarkFailed; the status says so), and so are the sessions that passes completed
  // before it advanced (they consumed part of their tokens): Step refuses them from then on
  // (FAILED_PRECONDITION) and the state store neither persists nor leases them. Sessions of a
  // failed step that are not marked are as they were before it.
  absl::Status Step(const StepBatch& batch, std::span<float> logits,
                    std::span<int32_t> sampled = {});

  // Prepares a session that is not on the device so that the step resuming it only copies, or
  // only scatters: on the CUDA backend, converts its layers to the device's bf16 image in
  // page-locked memory (host work on the calling thread: about 0.6 s on one core for a full
  // sdm_flagship table, split by layer over up to 8 threads for large sessions) and attaches it
  // to the session (SessionState::staged()) until the step that uploads the session takes it, or
  // the layers change and the session drops it; where resume_prefetch_bytes has room, also starts
  // copying that image to the device (on a stream of its own), so the step only scatters it.
  // Without it that conversion (and the copy) runs inside the step, and every session of the step
  // waits for it. Nothing is done (OK) on the CPU, for a session on the device, already staged,
  // failed or holding nothing to convert, and when resume_staging_bytes is in use (counted in
  // ResumeStagingStats::refused; the step then converts as without this call). Errors:
  // INVALID_ARGUMENT for a session of another model (as Step). Thread-safety: for a session no step
  // or other thread uses meanwhile; may run while Step() runs other sessions, and alongside other
  // StageResume calls (the scheduler stages a job's session on the thread that submits it).
  absl::Status StageResume(SessionState& session);

  // Convenience wrappers over Step.
  // Feeds `tokens` (at least one) to `session`. If `logits` is non-null it receives the logits
  // of the last token ([vocab]) or, with all_positions, of every token ([tokens, vocab]).
  absl::Status Prefill(SessionState& session, std::span<const int32_t> tokens, bool all_positions,
                       std::vector<float>* logits);
  // Feeds tokens[b] to sessions[b] for every b, as one pass; logits is [B, vocab].
  absl::Status Decode(std::span<SessionState* const> sessions, std::span<const int32_t> tokens,
                      std::span<float> logits);

  const EngineProfile& profile() const;
  void ResetProfile();

  // Use Create(); Impl is private to engine.cc.
  class Impl;
  explicit Engine(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_ENGINE_H_
