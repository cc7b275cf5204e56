// sdm-server: serves one model over gRPC (docs/api.md).
//
//   sdm-server --model DIR [flags]
//   sdm-server --flagfile=server.flags      (one --flag=value per line; '#' starts a comment)
//   sdm-server --help                       (every flag, its default and meaning)
//
// Prints "listening on HOST:PORT" on stdout once the gRPC port accepts calls. SIGINT or SIGTERM
// starts a graceful shutdown (server/server.h); a second signal exits at once with status 1, saying
// on stderr that nothing more is saved. SIGHUP reads the key and tenant limits files again
// (SdmServer::ReloadConfig), saying on stderr what it reloaded or why it kept the previous ones.
//
// Exit status: 0 after a clean shutdown; 1 when the server cannot start (the model cannot be
// loaded, a file is invalid, a port cannot be bound: the reason is printed) or when sessions
// could not be persisted at shutdown; 2 on usage errors.
#include <fcntl.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "base/heap.h"
#include "base/thread_name.h"
#include "common/command_line.h"
#include "server/cluster/etcd_client.h"
#include "server/cluster/etcd_ownership.h"
#include "server/server.h"
#include "server/tenant_limits.h"
#include "state_store/state_files.h"

ABSL_FLAG(std::string, model, "",
          "Model directory (config.json, model.safetensors and, for SentencePiece models, the "
          "tokenizer file). Required.");
ABSL_FLAG(std::string, model_name, sdm::ServiceOptions{}.model_name,
          "Name reported by GetModelInfo; empty: the model directory's name.");
ABSL_FLAG(std::string, host, sdm::ServerOptions{}.host,
          "Address of the gRPC port: 127.0.0.1 (this machine only), 0.0.0.0 (every IPv4 "
          "interface), :: (every interface).");
ABSL_FLAG(int, port, sdm::ServerOptions{}.port,
          "gRPC port; 0 picks a free port (printed at start).");
ABSL_FLAG(std::string, metrics_host, sdm::ServerOptions{}.metrics_host,
          "Address of the HTTP /metrics and /healthz port.");
ABSL_FLAG(int, metrics_port, sdm::ServerOptions{}.metrics_port,
          "HTTP port of /metrics (Prometheus text) and /healthz; 0 picks a free port, -1 "
          "disables it.");
ABSL_FLAG(std::string, http_host, sdm::OpenAiServerOptions{}.host,
          "Address of the OpenAI-compatible HTTP API (docs/api.md, HTTP API).");
ABSL_FLAG(int, http_port, sdm::OpenAiServerOptions{}.port,
          "Port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
          "/v1/models, /v1/sessions); 0 picks a free port, -1 disables it.");
ABSL_FLAG(int, http_max_connections, sdm::OpenAiServerOptions{}.max_connections,
          "HTTP API connections served at once, idle keep-alive ones included (each holds a "
          "thread while open; threads are started as connections arrive, and those above "
          "max_running + max_waiting + 16 exit after 60 s idle); past it a new connection waits "
          "at most 1 s for one to close, then is answered 503 with Retry-After: 1. Requests are "
          "limited by --max_running and --max_waiting (429 when full), not by this.");
ABSL_FLAG(std::vector<std::string>, http_cors_origins, sdm::OpenAiServerOptions{}.cors_origins,
          "Browser origins allowed to call the HTTP API from their pages (CORS), comma-separated, "
          "each scheme://host[:port] (e.g. https://app.example.com), or * for any; empty: none.");
ABSL_FLAG(std::string, chat_template, "",
          "JSON chat template file for /v1/chat/completions (docs/api.md); empty: the model "
          "directory's chat_template.json, else the plain-text default.");
ABSL_FLAG(std::string, state_dir, sdm::ServerOptions{}.store.dir.string(),
          "Directory of session snapshots (created if missing; relative to the working "
          "directory). Sessions are written there as --persist says, at shutdown and when memory "
          "budgets are exceeded, and resume after a restart. Empty: no disk tier, sessions are "
          "lost at exit.");
ABSL_FLAG(std::string, persist,
          std::string(sdm::PersistPolicyName(sdm::ServerOptions{}.store.persist)),
          "When sessions are written to --state_dir while they stay in memory: turn (after "
          "every turn, behind the decode path: a kill -9 loses at most the turn in flight), idle "
          "(once a session has been idle for --persist_idle), shutdown (only at shutdown and "
          "eviction). docs/state-format.md, Durability.");
ABSL_FLAG(bool, shared_state_dir, sdm::ServerOptions{}.store.shared_dir,
          "Replicas: other sdm-server processes use --state_dir too (a shared volume). A "
          "session this one does not hold is looked up there, and one another replica wrote "
          "since is re-read from there. docs/replicas.md.");
ABSL_FLAG(std::string, etcd, "",
          "Replicas: etcd's client URLs, comma-separated like etcdctl's --endpoints "
          "(http://host:port or https://host:port, e.g. "
          "https://etcd-0:2379,https://etcd-1:2379,https://etcd-2:2379): a request one member "
          "cannot answer goes to the next. Each session is owned by one replica at a time (a key "
          "bound to this replica's lease) and snapshot writes are fenced by it. Needs "
          "--shared_state_dir. Empty: no ownership, the server runs alone. docs/replicas.md.");
ABSL_FLAG(std::string, etcd_user, "",
          "With --etcd: the etcd user to authenticate as (empty: no authentication). The "
          "password comes from --etcd_password_file or the environment variable "
          "SDM_ETCD_PASSWORD, never from the command line.");
ABSL_FLAG(std::string, etcd_password_file, "",
          "With --etcd_user: a file holding the etcd password (one trailing newline is dropped); "
          "else the environment variable SDM_ETCD_PASSWORD.");
ABSL_FLAG(std::string, etcd_ca_file, "",
          "With https:// etcd endpoints: the PEM CA bundle that signs etcd's certificate "
          "(empty: the system's CAs).");
ABSL_FLAG(std::string, etcd_cert_file, "",
          "With https:// etcd endpoints: a PEM client certificate (etcd's --client-cert-auth); "
          "needs --etcd_key_file.");
ABSL_FLAG(std::string, etcd_key_file, "",
          "With --etcd_cert_file: the client certificate's PEM private key.");
ABSL_FLAG(std::string, replica_id, "",
          "With --etcd: this replica's unique name (empty: the host name).");
ABSL_FLAG(std::string, etcd_prefix, sdm::EtcdOwnershipOptions{}.key_prefix,
          "With --etcd: the prefix of every key this deployment keeps in etcd (sessions/, "
          "snapshots/, handoff/ under it); deployments sharing one etcd need their own.");
ABSL_FLAG(absl::Duration, etcd_lease_ttl, sdm::EtcdOwnershipOptions{}.lease_ttl,
          "With --etcd: the TTL of this replica's lease (whole seconds, at least 2 s). A replica "
          "stopped or cut off this long loses its sessions to the others.");
ABSL_FLAG(absl::Duration, etcd_request_timeout, sdm::EtcdClientOptions{}.request_timeout,
          "With --etcd: how long one attempt of a request to an etcd member (the connect, each "
          "write, each read) may take before the next member is tried; when none answers in "
          "time the request fails (UNAVAILABLE). Positive and finite.");
ABSL_FLAG(bool, testing_etcd_keep_stale_claims, false,
          "Testing only (deploy.etcd_fencing): with --etcd, a replica that finds its lease "
          "expired keeps its claims, so that its stale writes are refused by etcd's transaction "
          "rather than by its own bookkeeping. Never set it in production.");
ABSL_FLAG(absl::Duration, persist_idle, sdm::ServerOptions{}.store.persist_idle,
          "With --persist=idle: how long a changed session stays idle before it is written.");
ABSL_FLAG(
    int, persist_writers, sdm::ServerOptions{}.store.persist_writers,
    "Threads writing changed sessions to --state_dir at once, each a different session (so "
    "that one session's write and fsync do not delay the acknowledgement of another's turn).");
ABSL_FLAG(std::string, persist_sync,
          std::string(sdm::PersistSyncName(sdm::ServerOptions{}.store.persist_sync)),
          "When a session's write counts as done (and its turn is acknowledged): write (handed "
          "to the kernel, fsynced in the background at most every --persist_sync_interval: a "
          "kill -9 loses at most the turn in flight, a power loss or kernel crash at most the "
          "writes since the last background fsync), fsync (fsynced first: a power loss too loses "
          "at most the turn in flight, each turn waits for its fsync). docs/state-format.md, "
          "Durability.");
ABSL_FLAG(double, persist_compact_ratio, sdm::ServerOptions{}.store.log_compact_ratio,
          "A session's delta log is compacted into a full snapshot once the next turn's delta "
          "would take it past this many times the snapshot (or 256 records): higher writes fewer "
          "full snapshots per turn (a turn costs its delta plus about 1/ratio of it), and lets a "
          "restore read up to (1 + ratio) x the snapshot. 0: every write is a full snapshot. "
          "docs/state-format.md, Durability.");
ABSL_FLAG(bool, persist_journal, sdm::ServerOptions{}.store.journal_writes,
          "A turn's delta carries each SDM layer's writes (slot ids, weights, decays and value "
          "per token: a few KB) instead of the rows they changed, whichever is smaller; restoring "
          "applies them with the engine's own write, bit for bit. false: always the rows. "
          "docs/state-format.md, Delta log.");
ABSL_FLAG(bool, persist_device_turns, sdm::ServerOptions{}.store.persist_device_turns,
          "On a GPU: sessions held on the device are written after every turn as others are, "
          "their changes copied back between steps while they stay there; the host then keeps a "
          "current copy of each (counted in --resident_budget). false: written only when they "
          "leave the device. docs/state-format.md, Durability.");
ABSL_FLAG(std::string, persist_io, "direct",
          "How sessions' data is written to --state_dir: direct (O_DIRECT, whole blocks straight "
          "to the disk, without the page-cache copy that cost decode most of its CPU on a small "
          "machine; falls back to buffered where the file system refuses it) or buffered. The "
          "bytes and the guarantees of --persist_sync are the same. docs/state-format.md, "
          "Durability.");
ABSL_FLAG(absl::Duration, persist_sync_interval, sdm::ServerOptions{}.store.persist_sync_interval,
          "With --persist_sync=write: how often at most the background syncer fsyncs the files "
          "written since its last round (one fsync per file per round).");
ABSL_FLAG(std::string, resident_budget,
          sdm::FormatByteSize(sdm::ServerOptions{}.store.resident_budget_bytes),
          "Bytes of host memory held by resident sessions (ready to step) before the least "
          "recently used idle ones are parked in serialised form (units B, KB, MB, GB, KiB, MiB, "
          "GiB, ...).");
ABSL_FLAG(std::string, device_budget,
          sdm::FormatByteSize(sdm::ServerOptions{}.store.device_budget_bytes),
          "On a GPU: bytes of device memory held by sessions before the least recently used idle "
          "ones are copied back to host memory between steps; 0: the device's session-state "
          "capacity (the engine's arenas).");
ABSL_FLAG(std::string, resume_staging,
          sdm::FormatByteSize(sdm::ServerOptions{}.engine.resume_staging_bytes),
          "On a GPU: page-locked host memory for sessions converted for their upload when their "
          "request is submitted, so that the step resuming them only copies; a session that "
          "does not fit is converted inside its step; 0: never ahead.");
ABSL_FLAG(std::string, resume_prefetch,
          sdm::FormatByteSize(sdm::ServerOptions{}.engine.resume_prefetch_bytes),
          "On a GPU: device memory for those sessions' images copied to the device as they are "
          "staged (on a stream of their own, beside the steps), so that the step resuming them "
          "only scatters; kept out of the memory the session-state arenas are sized from (none "
          "with --resume_staging=0); an image that does not fit is copied inside its step; 0: "
          "never ahead.");
ABSL_FLAG(std::string, host_budget,
          sdm::FormatByteSize(sdm::ServerOptions{}.store.host_budget_bytes),
          "Bytes of parked session state kept in host memory before the oldest are written to "
          "the state directory.");
ABSL_FLAG(absl::Duration, session_ttl, sdm::ServerOptions{}.store.default_ttl,
          "Idle sessions created without their own ttl are deleted after this long (e.g. 30m, "
          "24h); inf: never. Not with --shared_state_dir (replicas: sessions never expire).");
ABSL_FLAG(int, max_running, sdm::SchedulerOptions{}.max_running,
          "Sequences decoded together in one engine step (the batch).");
ABSL_FLAG(int, max_waiting, sdm::SchedulerOptions{}.max_waiting,
          "Generate requests queued for a place in the batch; more are refused with "
          "RESOURCE_EXHAUSTED and a retry hint.");
ABSL_FLAG(int64_t, prefill_token_budget, sdm::SchedulerOptions{}.prefill_token_budget,
          "Prompt tokens prefilled per engine step, all requests together (one request feeds at "
          "most --prefill_chunk of them per step), so that long prompts do not stall running "
          "streams.");
ABSL_FLAG(int64_t, prefill_chunk, sdm::ServerOptions{}.engine.prefill_chunk,
          "Prompt tokens per engine prefill call.");
ABSL_FLAG(int64_t, max_prompt_tokens, sdm::ServiceOptions{}.max_prompt_tokens,
          "Longest prompt accepted, in tokens including an added BOS (INVALID_ARGUMENT above).");
ABSL_FLAG(int64_t, max_tokens_limit, sdm::ServiceOptions{}.max_tokens_limit,
          "Largest max_tokens a Generate request may ask for.");
ABSL_FLAG(int64_t, default_max_tokens, sdm::ServiceOptions{}.default_max_tokens,
          "max_tokens of a Generate or /v1/completions request that leaves it unset (cut to "
          "--max_tokens_limit); a chat completion without it runs up to --max_tokens_limit.");
ABSL_FLAG(int64_t, max_session_tokens, sdm::ServiceOptions{}.max_session_tokens,
          "Longest history a session may reach, in tokens (OUT_OF_RANGE past it; max_tokens is "
          "cut to the room left); 0: no limit; -1: the tokens whose full-attention key/value "
          "cache fills --resident_budget (or the device's capacity), none without such layers.");
ABSL_FLAG(bool, cuda_graphs, sdm::ServerOptions{}.engine.cuda_graphs,
          "CUDA: run decode steps as CUDA graphs, one launch per step (false: every kernel "
          "launched; the results are the same bit for bit).");
ABSL_FLAG(int, threads, sdm::ServerOptions{}.engine.num_threads,
          "Engine threads; 0: one per CPU this process may use (its affinity mask, capped by its "
          "cgroup's CPU quota).");
ABSL_FLAG(int, decode_nice, sdm::ServerOptions{}.engine.decode_nice,
          "How much nicer (Linux nice increment, 0 to 19) the decode threads (sdm-step, "
          "sdm-kernel) run than the front end, so that refusals, cancellations and health checks "
          "are answered ahead of the next step on cores the decode fills; 0: the same priority.");
ABSL_FLAG(std::string, device, sdm::EngineDeviceName(sdm::ServerOptions{}.engine.device),
          "Where the engine runs: auto (CUDA when a device is present, else the CPU), cpu or "
          "cuda.");
ABSL_FLAG(std::string, cpu_dtype, sdm::CpuDtypeName(sdm::ServerOptions{}.engine.cpu_dtype),
          "How the CPU engine stores matrices and key/value caches: fp32 (exact) or bf16 (half "
          "the bytes per decode step, fp32 accumulation; SDM rows stay fp32). CPU only: bf16 "
          "makes --device auto choose the CPU.");
ABSL_FLAG(std::string, api_keys, "",
          "File of API keys, one 'KEY TENANT' pair per line (docs/api.md). With it, every call "
          "needs 'authorization: Bearer KEY'; without it, every caller is the tenant 'default'.");
ABSL_FLAG(std::string, tenant_limits, "",
          "JSON file of per-tenant limits on sessions and state bytes (docs/api.md); empty: the "
          "default limits (docs/api.md: a cap on each tenant's state bytes, not on sessions).");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain for TLS on the gRPC port (with --tls_key); empty: plaintext. "
          "The HTTP API (--http_port) and metrics ports are always plaintext: with API keys, "
          "keep them on a trusted network or behind a TLS-terminating proxy (docs/api.md).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(absl::Duration, persist_stall_timeout, sdm::ServerOptions{}.persist_stall_timeout,
          "Health is degraded (/healthz 503) while a write to --state_dir, or a turn waiting for "
          "its write, has gone on this long: a stalled volume blocks writes rather than failing "
          "them. 0: not checked.");
ABSL_FLAG(absl::Duration, shutdown_grace, sdm::ServerOptions{}.shutdown_grace,
          "On SIGINT/SIGTERM, how long requests in flight may finish before they are cancelled "
          "(their sessions are kept and persisted).");
ABSL_FLAG(int64_t, malloc_mmap_threshold, 0,
          "Heap blocks of at least this many bytes are mapped on their own and returned to the "
          "system when freed (glibc M_MMAP_THRESHOLD, fixed; docs/robustness.md, Soak test); 0: "
          "glibc's default (a threshold that rises with the largest block freed). The soak test "
          "measured 65536 (steadier RSS, but CPU decode at batch 8 ran at 0.72-0.81x: its "
          "per-step temporaries are then mapped and unmapped every step; hence not the default). "
          "MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES in the environment win.");
ABSL_FLAG(int32_t, malloc_arena_max, 1,
          "The most malloc arenas (glibc M_ARENA_MAX; docs/robustness.md, Soak test); 0: glibc's "
          "default (8 per core). Each arena keeps its used part at the peak of the threads that "
          "allocate from it: in a 20-minute soak four secondary arenas grew 2.2 MB after warm-up "
          "(RSS +1.64%), against a flat heap and RSS +0.51% with one arena. MALLOC_ARENA_MAX or "
          "GLIBC_TUNABLES in the environment win.");
ABSL_FLAG(int32_t, malloc_tcache_count, 0,
          "Chunks of each size malloc's per-thread cache keeps (glibc.malloc.tcache_count; "
          "docs/robustness.md, Soak test); -1: glibc's default (7). Blocks built on one thread "
          "and freed on another (requests, responses) fill the freeing threads' caches: the bytes "
          "in use rose ~150 bytes a turn with the default, flat with 0, at the same throughput "
          "and CPU per token. glibc reads it only at start, so sdm-server executes itself again "
          "once with GLIBC_TUNABLES extended (same pid and arguments); a tcache_count already in "
          "GLIBC_TUNABLES wins.");
ABSL_FLAG(absl::Duration, malloc_trim_interval, sdm::ServerOptions{}.malloc_trim_interval,
          "The heap's free pages go back to the system (malloc_trim) at most this often, and only "
          "when the bytes in use are near their highest of the last such span "
          "(base/heap.h, HeapTrimSchedule): bursts less than this far apart are not trimmed "
          "between them; 0: never.");

namespace {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// ---- Signals --------------------------------------------------------------------------------
// SIGINT and SIGTERM run OnShutdownSignal on whichever thread the kernel picks (threads started
// before main, such as a BLAS library's, do not have them blocked; with sigwait, a second signal
// could land on one of those and kill the process by the default action, silently). The first
// is passed to main through a pipe; a later one exits at once, saying so. One arriving within
// kRepeatedSignalWindow of the first is the same request delivered twice, not a second request:
// GNU timeout signals its child and then the child's process group, and a script's EXIT trap
// forwards a SIGTERM after the terminal's Ctrl-C reached the whole group; taking those for a
// second request threw away every unsaved session. It is ignored, saying so.
constexpr int64_t kRepeatedSignalWindowNs = 1'000'000'000;  // 1 s; docs/api.md, Shutdown
int shutdown_pipe[2] = {-1, -1};
// Set once the server has started. A signal before then exits at once: nothing was served yet,
// and a start can take minutes (a large model loading) that a stop should not wait for.
std::atomic<bool> started{false};
std::atomic<int64_t> first_shutdown_signal_ns{0};  // CLOCK_MONOTONIC; 0: none yet
static_assert(std::atomic<int64_t>::is_always_lock_free, "used in a signal handler");

// Writes "sdm-server: " `before` SIGINT|SIGTERM `after` to stderr in one write(2), so that the
// line does not interleave with other threads' output. Async-signal-safe: no allocation, no
// locale, no stdio.
void SaySignal(int signal_number, const char* before, const char* after) {
  char line[512];
  size_t n = 0;
  const auto add = [&](const char* part) {
    while (*part != '\0' && n < sizeof(line)) line[n++] = *part++;
  };
  add("sdm-server: ");
  add(before);
  add(signal_number == SIGINT ? "SIGINT" : "SIGTERM");
  add(after);
  [[maybe_unused]] const ssize_t written = write(STDERR_FILENO, line, n);
}

// A signal handler's errno as it found it: the interrupted code may be reading errno (the
// handler's write(2) can set it).
class SavedErrno {
 public:
  SavedErrno() : saved_(errno) {}
  ~SavedErrno() { errno = saved_; }
  SavedErrno(const SavedErrno&) = delete;
  SavedErrno& operator=(const SavedErrno&) = delete;

 private:
  const int saved_;
};

void OnShutdownSignal(int signal_number) {
  // Async-signal-safe: clock_gettime, atomics, write(2) and _exit only.
  const SavedErrno saved_errno;
  if (!started.load()) {
    SaySignal(signal_number, "",
              " during start-up: exiting now with status 1 (nothing was served yet)\n");
    _exit(kExitFailure);
  }
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  const int64_t now_ns = std::max<int64_t>(1, int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec);
  int64_t first_ns = 0;
  if (first_shutdown_signal_ns.compare_exchange_strong(first_ns, now_ns)) {
    const char c = static_cast<char>(signal_number);
    [[maybe_unused]] const ssize_t n = write(shutdown_pipe[1], &c, 1);
    return;
  }
  if (now_ns - first_ns < kRepeatedSignalWindowNs) {
    SaySignal(signal_number, "",
              " within 1 s of the first signal: taken as the same request (still shutting down "
              "gracefully; signal again to exit at once)\n");
    return;
  }
  SaySignal(signal_number, "second ",
            ": exiting now with status 1, without waiting for requests or saving sessions; "
            "changes since a session's last save are lost\n");
  _exit(kExitFailure);
}

// SIGHUP asks for a reload: the handler writes a byte to reload_pipe (non-blocking: a full pipe
// already holds a request), and the reload thread, started once the server runs, reads it. A
// SIGHUP during the start is answered once the server runs.
int reload_pipe[2] = {-1, -1};
constexpr char kReloadRequest = 'r', kReloadStop = 'q';

void OnReloadSignal(int) {
  const SavedErrno saved_errno;
  const char c = kReloadRequest;
  [[maybe_unused]] const ssize_t n = write(reload_pipe[1], &c, 1);  // async-signal-safe
}

// Runs ReloadConfig for each request on reload_pipe until it reads kReloadStop.
void ReloadLoop(sdm::SdmServer& server) {
  sdm::SetCurrentThreadName("sdm-reload");
  char c = 0;
  while (true) {
    const ssize_t n = ::read(reload_pipe[0], &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n != 1 || c == kReloadStop) return;
    const absl::StatusOr<std::string> reloaded = server.ReloadConfig();
    if (reloaded.ok()) {
      absl::FPrintF(stderr, "sdm-server: SIGHUP: %s\n", *reloaded);
    } else {
      absl::FPrintF(stderr, "sdm-server: SIGHUP: %s\n", reloaded.status().ToString());
    }
  }
}

constexpr char kUsage[] =
    "usage: sdm-server --model DIR [flags]\n"
    "\n"
    "Serves a Sparse Delta Memory model over gRPC (sdm.v1.SdmService, grpc.health.v1, server\n"
    "reflection), with Prometheus metrics and /healthz over HTTP. The defaults serve the model on\n"
    "this machine's GPU when the build has CUDA and a device is present, else on its CPU, at\n"
    "127.0.0.1:50051 (metrics on 127.0.0.1:9090), with sessions saved under ./sdm-state.\n"
    "SIGINT or SIGTERM shuts it down gracefully; SIGHUP reads --api_keys and --tenant_limits\n"
    "again.\n"
    "\n"
    "Flags may also come from a file: --flagfile=PATH reads one --name=value per line (lines\n"
    "starting with '#' are comments); flags after it on the command line override it.\n";

void PrintHelp() {
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::EndsWith(flag->Filename(), "server/main.cc")) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(),
            [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  std::string out = absl::StrCat(kUsage, "\nflags:\n");
  for (const absl::CommandLineFlag* flag : flags) absl::StrAppend(&out, sdm::cli::FlagHelp(*flag));
  absl::StrAppend(&out,
                  "\nExit status: 0 after a clean shutdown, 1 when the server cannot start "
                  "or persist its sessions, 2 on usage errors.\n");
  std::fwrite(out.data(), 1, out.size(), stdout);
}

int UsageError(absl::string_view message) {
  absl::FPrintF(stderr, "sdm-server: %s\nrun 'sdm-server --help' for usage\n", message);
  return kExitUsage;
}

// A flag argument and where it came from, for messages: empty for the command line, else
// " (line N of --flagfile=PATH)".
struct FlagArg {
  std::string text;
  std::string where;
};

// How deep flag files may name flag files: absl follows one that names itself forever (the server
// hung).
constexpr int kMaxFlagfileDepth = 16;

// The flag file `path` as absl reads it (leading blanks stripped, blank and '#' lines skipped,
// every other line one argument) into `args`, or what absl would refuse in it: a file it cannot
// read, a line that is not a flag (absl also refuses "--" and aborts on a lone "-").
std::optional<std::string> ReadFlagfile(const std::string& path, std::vector<FlagArg>* args) {
  const auto unreadable = [&path](int error) {
    return absl::StrCat("cannot read the flag file '", path,
                        "' (--flagfile): ", error != 0 ? std::strerror(error) : "unreadable");
  };
  // std::ifstream opens a directory and reads nothing from it (absl would take it as empty).
  if (std::error_code ec; std::filesystem::is_directory(path, ec)) return unreadable(EISDIR);
  errno = 0;
  std::ifstream in(path);
  if (!in) return unreadable(errno);
  int number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    const absl::string_view arg = absl::StripLeadingAsciiWhitespace(line);
    if (arg.empty() || arg[0] == '#') continue;
    std::string where = absl::StrCat(" (line ", number, " of --flagfile=", path, ")");
    if (arg[0] != '-' || arg == "-" || arg == "--") {
      return absl::StrCat("not a flag: '", arg, "'", where,
                          "; a flag file holds one --name=value per line");
    }
    args->push_back({std::string(arg), std::move(where)});
  }
  if (in.bad()) return unreadable(errno);
  return std::nullopt;
}

// What absl::ParseCommandLine would refuse among `args` (an unknown flag, a value its type cannot
// read, a missing value), as a usage error naming the flag and, for one read from a flag file,
// the file and line: absl exits with status 1 on its own, where every other usage error exits 2
// (docs/api.md). Flag files are read where --flagfile names them, in absl's order. A flag's value
// is parsed into the flag here (ParseCommandLine sets it again, in the same order).
std::optional<std::string> FlagArgsError(const std::vector<FlagArg>& args, int depth) {
  for (size_t i = 0; i < args.size(); ++i) {
    absl::string_view arg = args[i].text;
    const std::string& where = args[i].where;
    if (arg == "--") break;  // the rest is positional (only on the command line)
    if (!absl::ConsumePrefix(&arg, "--") && !absl::ConsumePrefix(&arg, "-")) continue;
    if (arg.empty()) continue;
    absl::string_view name = arg;
    absl::string_view value;
    bool has_value = false;
    if (const size_t eq = arg.find('='); eq != absl::string_view::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      has_value = true;
    }
    // A value without '=' is the next argument of the same list (the next line of a flag file).
    const auto next_value = [&]() -> std::optional<std::string> {
      if (i + 1 >= args.size()) return absl::StrCat("--", name, " needs a value", where);
      value = args[++i].text;
      return std::nullopt;
    };
    if (name == "flagfile") {
      if (!has_value) {
        if (std::optional<std::string> error = next_value()) return error;
      }
      if (value.empty()) continue;  // absl reads no file
      if (depth >= kMaxFlagfileDepth) {
        return absl::StrCat("flag files nested more than ", kMaxFlagfileDepth,
                            " deep (does one name itself?)", where);
      }
      // A comma-separated list, as absl reads it.
      for (const absl::string_view path : absl::StrSplit(value, ',')) {
        std::vector<FlagArg> file_args;
        if (std::optional<std::string> error = ReadFlagfile(std::string(path), &file_args)) {
          return error;
        }
        if (std::optional<std::string> error = FlagArgsError(file_args, depth + 1)) return error;
      }
      continue;
    }
    if (name == "fromenv" || name == "tryfromenv" || name == "undefok") {
      if (!has_value) ++i;  // absl's own: its value is the next argument
      continue;
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && absl::StartsWith(name, "no")) {
      absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>()) {
        if (has_value) return absl::StrCat("--", name, " takes no value", where);
        continue;
      }
    }
    if (flag == nullptr || flag->IsRetired()) {
      return absl::StrCat("unknown flag --", name, where);
    }
    if (flag->IsOfType<bool>() && !has_value) continue;
    if (!has_value) {
      if (std::optional<std::string> error = next_value()) return error;
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {  // absl's message names the flag and the value
      return absl::StrCat(
          error.empty() ? absl::StrCat("--", name, ": cannot read '", value, "'") : error, where);
    }
  }
  return std::nullopt;
}

// FlagArgsError of the command line.
std::optional<std::string> CommandLineFlagError(int argc, char** argv) {
  std::vector<FlagArg> args;
  for (int i = 1; i < argc; ++i) args.push_back({argv[i], ""});
  return FlagArgsError(args, 0);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-help" || arg == "-h" || arg == "--helpfull" ||
        arg == "--helpshort") {
      PrintHelp();
      return 0;
    }
  }
  absl::SetProgramUsageMessage(kUsage);
  if (const std::optional<std::string> error = CommandLineFlagError(argc, argv)) {
    return UsageError(*error);
  }
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    return UsageError(absl::StrCat("unexpected argument '", positional[1], "'"));
  }

  sdm::ServerOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  if (options.model_dir.empty()) return UsageError("--model is required");
  options.service.model_name = absl::GetFlag(FLAGS_model_name);
  options.host = absl::GetFlag(FLAGS_host);
  options.port = absl::GetFlag(FLAGS_port);
  options.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.http.host = absl::GetFlag(FLAGS_http_host);
  options.http.port = absl::GetFlag(FLAGS_http_port);
  options.http.max_connections = absl::GetFlag(FLAGS_http_max_connections);
  options.http.cors_origins = absl::GetFlag(FLAGS_http_cors_origins);
  options.http.chat_template_file = absl::GetFlag(FLAGS_chat_template);
  // As --etcd's options without --etcd: a configuration whose HTTP options are wrong would only
  // fail the day the HTTP API is turned on.
  if (options.http.port < 0 &&
      (!options.http.cors_origins.empty() || !options.http.chat_template_file.empty())) {
    return UsageError(
        "--chat_template and --http_cors_origins need --http_port (the HTTP API is "
        "off)");
  }
  options.store.dir = absl::GetFlag(FLAGS_state_dir);
  options.store.shared_dir = absl::GetFlag(FLAGS_shared_state_dir);
  if (options.store.shared_dir && options.store.dir.empty()) {
    return UsageError("--shared_state_dir needs --state_dir");
  }
  if (const std::string etcd = absl::GetFlag(FLAGS_etcd); !etcd.empty()) {
    absl::StatusOr<std::vector<std::string>> endpoints = sdm::ParseEtcdEndpoints(etcd);
    if (!endpoints.ok()) return UsageError(absl::StrCat("--etcd: ", endpoints.status().message()));
    options.etcd.client.endpoints = *std::move(endpoints);
  }
  options.etcd.client.username = absl::GetFlag(FLAGS_etcd_user);
  if (const std::string file = absl::GetFlag(FLAGS_etcd_password_file); !file.empty()) {
    if (options.etcd.client.username.empty())
      return UsageError("--etcd_password_file needs --etcd_user");
    std::ifstream in(file, std::ios::binary);
    std::string password((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) {
      return UsageError(absl::StrCat("--etcd_password_file: cannot read '", file, "'"));
    }
    if (absl::EndsWith(password, "\r\n"))
      password.resize(password.size() - 2);
    else if (absl::EndsWith(password, "\n"))
      password.pop_back();
    if (password.empty()) {
      return UsageError(absl::StrCat("--etcd_password_file: '", file, "' is empty or unreadable"));
    }
    options.etcd.client.password = std::move(password);
  } else if (const char* env = std::getenv("SDM_ETCD_PASSWORD");
             env != nullptr && !options.etcd.client.username.empty()) {
    options.etcd.client.password = env;
  }
  if (!options.etcd.client.username.empty() && options.etcd.client.password.empty()) {
    return UsageError("--etcd_user needs --etcd_password_file or SDM_ETCD_PASSWORD");
  }
  options.etcd.client.ca_file = absl::GetFlag(FLAGS_etcd_ca_file);
  options.etcd.client.cert_file = absl::GetFlag(FLAGS_etcd_cert_file);
  options.etcd.client.key_file = absl::GetFlag(FLAGS_etcd_key_file);
  options.etcd.client.request_timeout = absl::GetFlag(FLAGS_etcd_request_timeout);
  options.etcd.replica_id = absl::GetFlag(FLAGS_replica_id);
  options.etcd.lease_ttl = absl::GetFlag(FLAGS_etcd_lease_ttl);
  options.etcd.key_prefix = absl::GetFlag(FLAGS_etcd_prefix);
  options.etcd.testing_keep_stale_claims = absl::GetFlag(FLAGS_testing_etcd_keep_stale_claims);
  if (options.etcd.client.endpoints.empty() &&
      (!options.etcd.client.username.empty() || !options.etcd.client.ca_file.empty() ||
       !options.etcd.client.cert_file.empty() || !options.etcd.client.key_file.empty())) {
    return UsageError("--etcd_user and --etcd_*_file need --etcd");
  }
  if (!options.etcd.client.endpoints.empty()) {
    if (!options.store.shared_dir) return UsageError("--etcd needs --shared_state_dir");
    if (absl::Status s = sdm::ValidateEtcdClientOptions(options.etcd.client); !s.ok()) {
      return UsageError(absl::StrCat("--etcd: ", s.message()));
    }
    if (absl::Status s = sdm::ValidateEtcdKeyPrefix(options.etcd.key_prefix); !s.ok()) {
      return UsageError(absl::StrCat("--etcd_prefix: ", s.message()));
    }
    if (absl::Status s = sdm::ValidateEtcdLeaseTtl(options.etcd.lease_ttl); !s.ok()) {
      return UsageError(absl::StrCat("--etcd_lease_ttl: ", s.message()));
    }
    if (const absl::Duration t = options.etcd.client.request_timeout;
        t <= absl::ZeroDuration() || t == absl::InfiniteDuration()) {
      return UsageError(absl::StrCat("--etcd_request_timeout: must be positive and finite, got ",
                                     absl::FormatDuration(t)));
    }
    if (options.etcd.replica_id.empty()) {
      char host[256] = {};
      if (gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') {
        return UsageError("--etcd: give --replica_id (no host name)");
      }
      options.etcd.replica_id = host;
    }
  }
  for (const auto& [flag, value, out] :
       {std::tuple{"resident_budget", absl::GetFlag(FLAGS_resident_budget),
                   &options.store.resident_budget_bytes},
        std::tuple{"host_budget", absl::GetFlag(FLAGS_host_budget),
                   &options.store.host_budget_bytes},
        std::tuple{"device_budget", absl::GetFlag(FLAGS_device_budget),
                   &options.store.device_budget_bytes},
        std::tuple{"resume_staging", absl::GetFlag(FLAGS_resume_staging),
                   &options.engine.resume_staging_bytes},
        std::tuple{"resume_prefetch", absl::GetFlag(FLAGS_resume_prefetch),
                   &options.engine.resume_prefetch_bytes}}) {
    absl::StatusOr<int64_t> bytes = sdm::ParseByteSize(value);
    if (!bytes.ok()) return UsageError(absl::StrCat("--", flag, ": ", bytes.status().message()));
    *out = *bytes;
  }
  absl::StatusOr<sdm::PersistPolicy> persist =
      sdm::ParsePersistPolicy(absl::GetFlag(FLAGS_persist));
  if (!persist.ok()) return UsageError(absl::StrCat("--persist: ", persist.status().message()));
  options.store.persist = *persist;
  options.store.persist_idle = absl::GetFlag(FLAGS_persist_idle);
  if (options.store.persist_idle <= absl::ZeroDuration()) {
    return UsageError("--persist_idle must be positive");
  }
  absl::StatusOr<sdm::PersistSync> persist_sync =
      sdm::ParsePersistSync(absl::GetFlag(FLAGS_persist_sync));
  if (!persist_sync.ok()) {
    return UsageError(absl::StrCat("--persist_sync: ", persist_sync.status().message()));
  }
  options.store.persist_sync = *persist_sync;
  options.store.persist_sync_interval = absl::GetFlag(FLAGS_persist_sync_interval);
  if (options.store.persist_sync_interval < absl::ZeroDuration()) {
    return UsageError("--persist_sync_interval must not be negative");
  }
  absl::StatusOr<sdm::StateFiles*> persist_io =
      sdm::StateFilesForIo(absl::GetFlag(FLAGS_persist_io));
  if (!persist_io.ok()) {
    return UsageError(absl::StrCat("--persist_io: ", persist_io.status().message()));
  }
  options.store.files = *persist_io;
  options.store.log_compact_ratio = absl::GetFlag(FLAGS_persist_compact_ratio);
  options.store.journal_writes = absl::GetFlag(FLAGS_persist_journal);
  options.store.persist_device_turns = absl::GetFlag(FLAGS_persist_device_turns);
  if (!(options.store.log_compact_ratio >= 0 && options.store.log_compact_ratio <= 1e6)) {
    return UsageError("--persist_compact_ratio must be between 0 and 1e6");
  }
  options.store.persist_writers = absl::GetFlag(FLAGS_persist_writers);
  if (options.store.persist_writers < 1 || options.store.persist_writers > 64) {
    return UsageError("--persist_writers must be between 1 and 64");
  }
  options.store.default_ttl = absl::GetFlag(FLAGS_session_ttl);
  if (options.store.default_ttl <= absl::ZeroDuration()) {
    return UsageError("--session_ttl must be positive (inf: never expire)");
  }
  if (options.store.default_ttl != absl::InfiniteDuration() &&
      options.store.default_ttl > sdm::kMaxSessionTtl) {
    return UsageError("--session_ttl must be at most 100 years (inf: never expire)");
  }
  if (options.store.shared_dir && options.store.default_ttl != absl::InfiniteDuration()) {
    return UsageError(
        "--session_ttl cannot be used with --shared_state_dir: a replica would expire a session "
        "by its own view of its last use while another replica serves it (sessions on a shared "
        "directory never expire; delete them explicitly). docs/replicas.md");
  }
  options.scheduler.max_running = absl::GetFlag(FLAGS_max_running);
  options.scheduler.max_waiting = absl::GetFlag(FLAGS_max_waiting);
  options.scheduler.prefill_token_budget = absl::GetFlag(FLAGS_prefill_token_budget);
  options.engine.prefill_chunk = absl::GetFlag(FLAGS_prefill_chunk);
  options.service.max_prompt_tokens = absl::GetFlag(FLAGS_max_prompt_tokens);
  options.service.max_tokens_limit = absl::GetFlag(FLAGS_max_tokens_limit);
  options.service.default_max_tokens = absl::GetFlag(FLAGS_default_max_tokens);
  options.service.max_session_tokens = absl::GetFlag(FLAGS_max_session_tokens);
  options.engine.num_threads = absl::GetFlag(FLAGS_threads);
  options.engine.decode_nice = absl::GetFlag(FLAGS_decode_nice);
  options.engine.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
  {
    absl::StatusOr<sdm::EngineDevice> device = sdm::ParseEngineDevice(absl::GetFlag(FLAGS_device));
    if (!device.ok()) return UsageError(absl::StrCat("--device: ", device.status().message()));
    options.engine.device = *device;
    absl::StatusOr<sdm::DType> dtype = sdm::ParseCpuDtype(absl::GetFlag(FLAGS_cpu_dtype));
    if (!dtype.ok()) return UsageError(absl::StrCat("--cpu_dtype: ", dtype.status().message()));
    options.engine.cpu_dtype = *dtype;
  }
  options.api_keys_file = absl::GetFlag(FLAGS_api_keys);
  options.tenant_limits_file = absl::GetFlag(FLAGS_tenant_limits);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.persist_stall_timeout = absl::GetFlag(FLAGS_persist_stall_timeout);
  options.shutdown_grace = absl::GetFlag(FLAGS_shutdown_grace);
  options.malloc_trim_interval = absl::GetFlag(FLAGS_malloc_trim_interval);
  const int32_t tcache_count = absl::GetFlag(FLAGS_malloc_tcache_count);
  if (tcache_count < -1 || tcache_count > 65535) {
    return UsageError("--malloc_tcache_count must be between -1 and 65535");
  }
  // First of the heap's settings (the mallopt calls below would be redone after a re-execution),
  // before any thread starts or anything is opened; returns only when no re-execution was needed
  // or it failed (the server then runs with glibc's cache, and says so).
  if (absl::Status s = sdm::ReexecWithTcacheCount(tcache_count); !s.ok()) {
    absl::FPrintF(stderr, "sdm-server: warning: --malloc_tcache_count=%d not applied: %s\n",
                  tcache_count, s.message());
  }
  const int64_t mmap_threshold = absl::GetFlag(FLAGS_malloc_mmap_threshold);
  if (mmap_threshold < 0 || mmap_threshold > (int64_t{1} << 30)) {
    return UsageError("--malloc_mmap_threshold must be between 0 and 1 GiB");
  }
  if (mmap_threshold > 0) sdm::SetMmapThreshold(static_cast<size_t>(mmap_threshold));
  const int32_t arena_max = absl::GetFlag(FLAGS_malloc_arena_max);
  if (arena_max < 0 || arena_max > 1024) {
    return UsageError("--malloc_arena_max must be between 0 and 1024");
  }
  if (arena_max > 0) sdm::SetArenaMax(arena_max);

  // Signals run OnShutdownSignal. They are blocked while the server starts, so that the threads
  // it starts inherit the mask and main takes them once it waits (threads started before main
  // may still take one: the handler is the same); meanwhile the thread started here, which does
  // nothing else, takes them, so that a stop during a long start (a large model loading) exits
  // at once rather than once the start is over.
  if (::pipe(shutdown_pipe) != 0 || ::pipe2(reload_pipe, O_CLOEXEC) != 0 ||
      ::fcntl(reload_pipe[1], F_SETFL, O_NONBLOCK) != 0) {
    absl::FPrintF(stderr, "sdm-server: cannot create a pipe: %s\n", std::strerror(errno));
    return kExitFailure;
  }
  struct sigaction action = {};
  action.sa_handler = OnShutdownSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  struct sigaction reload = {};
  reload.sa_handler = OnReloadSignal;
  sigemptyset(&reload.sa_mask);
  reload.sa_flags = SA_RESTART;
  sigaction(SIGHUP, &reload, nullptr);
  std::thread([] {
    sdm::SetCurrentThreadName("sdm-signals");
    while (true) ::pause();
  }).detach();
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // Values out of range are usage errors (exit 2), found before the model is loaded.
  if (const absl::Status valid = sdm::ValidateServerOptions(options); !valid.ok()) {
    return UsageError(valid.message());
  }
  absl::StatusOr<std::unique_ptr<sdm::SdmServer>> server = sdm::SdmServer::Start(options);
  if (!server.ok()) {
    absl::FPrintF(stderr, "sdm-server: %s\n", server.status().ToString());
    return kExitFailure;
  }
  started.store(true);  // a signal from now on shuts down gracefully
  std::string metrics = "off";
  if ((*server)->metrics_port() > 0) {
    metrics = absl::StrCat(
        "http://", sdm::HostPort(options.metrics_host, (*server)->metrics_port()), "/metrics");
  }
  // The address as bound (0.0.0.0 for every interface), not the loopback one clients would use.
  absl::PrintF("listening on %s (metrics: %s)\n", (*server)->listen_address(), metrics);
  if ((*server)->http_port() > 0) {
    const std::string http = sdm::HostPort(options.http.host, (*server)->http_port());
    absl::PrintF("OpenAI-compatible HTTP API on http://%s/v1 (web console: http://%s/)\n", http,
                 http);
  }
  std::fflush(stdout);
  std::thread reloader([&server] { ReloadLoop(**server); });

  pthread_sigmask(SIG_UNBLOCK, &signals, nullptr);
  char received = 0;
  while (::read(shutdown_pipe[0], &received, 1) < 0 && errno == EINTR) {
  }
  const int signal_number = received;
  absl::FPrintF(
      stderr, "sdm-server: %s: shutting down (grace %s; another signal, 1 s on, exits at once)\n",
      signal_number == SIGINT ? "SIGINT" : "SIGTERM", absl::FormatDuration(options.shutdown_grace));
  const absl::Status persisted = (*server)->Shutdown();
  {
    const char c = kReloadStop;  // the pipe is empty or holds requests: never full here
    while (::write(reload_pipe[1], &c, 1) < 0 && errno == EAGAIN) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    reloader.join();
  }
  if (!persisted.ok()) {
    absl::FPrintF(stderr, "sdm-server: %s\n", persisted.ToString());
    return kExitFailure;
  }
  absl::FPrintF(
      stderr, "sdm-server: stopped; sessions saved in %s\n",
      options.store.dir.empty() ? "(nowhere: no --state_dir)" : options.store.dir.string());
  return 0;
}
