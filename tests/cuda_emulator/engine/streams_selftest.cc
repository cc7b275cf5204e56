// Self-test of the engine dialect's stream model (emu.cc) in the mode EMU_STREAMS names: eager,
// deferred (unset), others-first or shuffle:SEED. Each scenario is a race or its fix, built from
// copies and memsets, whose outcome the mode determines:
//   late source   a pinned buffer rewritten after the copy that reads it was enqueued: eager
//                 copies the old value, deferred and others-first the new one (the copy ran at
//                 the host's wait), shuffle either;
//   missing wait  stream A sets a device byte, stream B downloads it without waiting for A, the
//                 host waits for A first: eager and deferred always see A's value, others-first
//                 never (B's work runs before the A the host waits for), shuffle sees both
//                 outcomes over the repetitions;
//   with the wait the same, B waiting for an event recorded after A's memset: every mode, every
//                 repetition sees A's value (no mode breaks the order a wait imposes).
// Prints one line per scenario and exits 1 when one outcome is not what the mode allows.
//
// With an argument, one scenario of the page-locked race check (every mode):
//   race          stream A's upload from a page-locked buffer, then stream B's download into it,
//                 no wait between them: must abort with "EMU HOST FAILURE ... race" (the script
//                 checks), whichever order the mode runs them in;
//   race-ordered  the same with B waiting for an event recorded after A's upload: no race.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda_runtime.h"

namespace {

int failures = 0;

void Check(bool ok, const char* scenario, const std::string& detail) {
  std::printf("%s %-13s %s\n", ok ? "ok  " : "FAIL", scenario, detail.c_str());
  if (!ok) ++failures;
}

void Must(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::printf("FAIL %s returned %d\n", what, static_cast<int>(e));
    std::exit(1);
  }
}

}  // namespace

// The race-check scenarios (file comment).
int RaceScenario(bool ordered) {
  cudaStream_t a = nullptr, b = nullptr;
  Must(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  Must(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  unsigned char *device = nullptr, *other = nullptr, *pinned = nullptr;
  Must(cudaMalloc(&device, 64), "cudaMalloc");
  Must(cudaMalloc(&other, 64), "cudaMalloc");
  Must(cudaMallocHost(&pinned, 64), "cudaMallocHost");
  cudaEvent_t uploaded = nullptr;
  Must(cudaEventCreateWithFlags(&uploaded, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  Must(cudaMemcpyAsync(device, pinned, 64, cudaMemcpyHostToDevice, a), "cudaMemcpyAsync");
  if (ordered) {
    Must(cudaEventRecord(uploaded, a), "cudaEventRecord");
    Must(cudaStreamWaitEvent(b, uploaded, 0), "cudaStreamWaitEvent");
  }
  Must(cudaMemcpyAsync(pinned + 16, other, 16, cudaMemcpyDeviceToHost, b), "cudaMemcpyAsync");
  Must(cudaStreamSynchronize(ordered ? b : a), "cudaStreamSynchronize");
  Must(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  std::printf("%s: no race reported\n", ordered ? "race-ordered" : "race");
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1) return RaceScenario(std::string(argv[1]) == "race-ordered");
  const char* env = std::getenv("EMU_STREAMS");
  const std::string mode = env == nullptr ? "deferred" : env;
  const bool eager = mode == "eager", shuffle = mode.rfind("shuffle:", 0) == 0,
             others_first = mode == "others-first";
  std::printf("EMU_STREAMS=%s\n", mode.c_str());

  cudaStream_t a = nullptr, b = nullptr;
  Must(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  Must(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  unsigned char* device = nullptr;
  unsigned char* pinned = nullptr;
  Must(cudaMalloc(&device, 1), "cudaMalloc");
  Must(cudaMallocHost(&pinned, 1), "cudaMallocHost");

  {  // late source
    *pinned = 1;
    Must(cudaMemcpyAsync(device, pinned, 1, cudaMemcpyHostToDevice, a), "cudaMemcpyAsync");
    *pinned = 2;  // the race: the copy may not have run yet
    Must(cudaStreamSynchronize(a), "cudaStreamSynchronize");
    unsigned char got = 0;
    Must(cudaMemcpy(&got, device, 1, cudaMemcpyDeviceToHost), "cudaMemcpy");
    if (shuffle) {  // the copy may have run at its enqueue or at the wait
      Check(got == 1 || got == 2, "late source", "copied " + std::to_string(got) + ", want 1 or 2");
    } else {
      const int want = eager ? 1 : 2;
      Check(got == want, "late source",
            "copied " + std::to_string(got) + ", want " + std::to_string(want));
    }
  }

  cudaEvent_t set = nullptr;
  Must(cudaEventCreateWithFlags(&set, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  for (const bool with_wait : {false, true}) {
    constexpr int kRepetitions = 64;
    int saw_set = 0;
    for (int i = 0; i < kRepetitions; ++i) {
      Must(cudaMemset(device, 0, 1), "cudaMemset");
      *pinned = 9;
      Must(cudaMemsetAsync(device, 7, 1, a), "cudaMemsetAsync");
      if (with_wait) {
        Must(cudaEventRecord(set, a), "cudaEventRecord");
        Must(cudaStreamWaitEvent(b, set, 0), "cudaStreamWaitEvent");
      }
      Must(cudaMemcpyAsync(pinned, device, 1, cudaMemcpyDeviceToHost, b), "cudaMemcpyAsync");
      Must(cudaStreamSynchronize(a), "cudaStreamSynchronize");
      Must(cudaStreamSynchronize(b), "cudaStreamSynchronize");
      if (*pinned != 7 && *pinned != 0) {
        Check(false, with_wait ? "with the wait" : "missing wait",
              "downloaded " + std::to_string(*pinned) + ": neither 0 nor 7");
      }
      saw_set += *pinned == 7;
    }
    const std::string counts = std::to_string(saw_set) + "/" + std::to_string(kRepetitions) +
                               " downloads saw stream A's memset";
    if (with_wait) {
      Check(saw_set == kRepetitions, "with the wait", counts);
    } else if (shuffle) {
      Check(saw_set > 0 && saw_set < kRepetitions, "missing wait", counts + ", want some");
    } else if (others_first) {
      Check(saw_set == 0, "missing wait", counts + ", want none");
    } else {
      Check(saw_set == kRepetitions, "missing wait", counts);
    }
  }

  Must(cudaEventDestroy(set), "cudaEventDestroy");
  Must(cudaFreeHost(pinned), "cudaFreeHost");
  Must(cudaFree(device), "cudaFree");
  Must(cudaStreamDestroy(a), "cudaStreamDestroy");
  Must(cudaStreamDestroy(b), "cudaStreamDestroy");
  std::printf("%s\n", failures == 0 ? "PASSED" : "FAILED");
  return failures == 0 ? 0 : 1;
}
