#include "client/bench_serve.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/flags.h"

namespace sdm::client {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

absl::Status FromGrpc(const grpc::Status& status, absl::string_view what) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(what, ": ", status.error_message()));
}

// What the benchmark needs to know about the served model.
struct ModelFacts {
  int64_t id_limit = 256;  // prompt ids are drawn from [0, id_limit) minus bos and eos
  int32_t bos_id = -1;
  int32_t eos_id = -1;
  int64_t max_prompt_tokens = 0;  // 0: no known limit
  int64_t max_tokens_limit = 0;
};

// The sessions that reused requests continue; each runs one call at a time.
class SessionPool {
 public:
  explicit SessionPool(std::vector<std::string> ids)
      : ids_(std::move(ids)), busy_(ids_.size(), false) {}

  // Blocks until a session is free and takes one of the free ones at random.
  size_t Acquire(std::mt19937_64& rng) {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &SessionPool::AnyFree));
    std::vector<size_t> free;
    for (size_t i = 0; i < busy_.size(); ++i) {
      if (!busy_[i]) free.push_back(i);
    }
    const size_t pick = free[std::uniform_int_distribution<size_t>(0, free.size() - 1)(rng)];
    busy_[pick] = true;
    return pick;
  }

  void Release(size_t index) {
    absl::MutexLock lock(&mu_);
    busy_[index] = false;
  }

  const std::string& id(size_t index) const { return ids_[index]; }

 private:
  bool AnyFree() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return std::find(busy_.begin(), busy_.end(), false) != busy_.end();
  }

  const std::vector<std::string> ids_;
  absl::Mutex mu_;
  std::vector<bool> busy_ ABSL_GUARDED_BY(mu_);
};

// What request `index` of a phase sends; a pure function of (seed, phase, index).
struct Plan {
  std::vector<int32_t> prompt;
  int64_t max_tokens = 1;
  bool reuse = false;
  std::mt19937_64 rng;
};

Plan MakePlan(const BenchServeOptions& options, const ModelFacts& facts, uint64_t phase,
              int64_t index) {
  std::seed_seq seq{static_cast<uint32_t>(options.seed), static_cast<uint32_t>(options.seed >> 32),
                    static_cast<uint32_t>(phase), static_cast<uint32_t>(index),
                    static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32)};
  Plan plan;
  plan.rng.seed(seq);
  int64_t prompt_len = options.prompt_tokens.Sample(plan.rng);
  if (facts.max_prompt_tokens > 1) prompt_len = std::min(prompt_len, facts.max_prompt_tokens - 1);
  plan.max_tokens = options.max_tokens.Sample(plan.rng);
  if (facts.max_tokens_limit > 0)
    plan.max_tokens = std::min(plan.max_tokens, facts.max_tokens_limit);
  plan.reuse =
      options.session_reuse > 0 && std::bernoulli_distribution(options.session_reuse)(plan.rng);
  std::uniform_int_distribution<int32_t> id_dist(0, static_cast<int32_t>(facts.id_limit - 1));
  plan.prompt.reserve(prompt_len);
  for (int64_t t = 0; t < prompt_len; ++t) {
    int32_t id = id_dist(plan.rng);
    for (int tries = 0; (id == facts.bos_id || id == facts.eos_id) && tries < 64; ++tries) {
      id = id_dist(plan.rng);
    }
    plan.prompt.push_back(id);
  }
  return plan;
}

struct WorkerOutput {
  std::vector<RequestRecord> records;
  std::vector<double> itl;
};

// The Generate request of `plan` (one-shot; the caller adds a session). Draws the sampling seed
// from plan.rng: the first draw of the plan's generator after MakePlan.
sdm::v1::GenerateRequest RequestOf(const BenchServeOptions& options, Plan& plan) {
  sdm::v1::GenerateRequest request;
  request.mutable_token_ids()->mutable_ids()->Add(plan.prompt.begin(), plan.prompt.end());
  request.mutable_sampling()->set_max_tokens(plan.max_tokens);
  request.mutable_sampling()->set_temperature(options.temperature);
  request.mutable_sampling()->set_ignore_eos(options.ignore_eos);
  request.mutable_sampling()->set_seed(plan.rng());
  return request;
}

// A finished call's record (its e2e set) with its status, timings and usage, added to `out`.
void FinishRecord(const grpc::Status& status, absl::Span<const std::pair<double, int64_t>> chunks,
                  const sdm::v1::Usage& usage, RequestRecord record, WorkerOutput& out) {
  record.code = status.error_code();
  if (status.ok()) {
    StreamTiming timing = TimeStream(chunks);
    record.ttft = timing.ttft;
    record.prompt_tokens = usage.prompt_tokens();
    record.history_tokens = usage.history_tokens();
    record.generated_tokens = usage.generated_tokens();
    out.itl.insert(out.itl.end(), timing.itl.begin(), timing.itl.end());
  }
  out.records.push_back(record);
}

// One Generate call on gRPC's callback API (BenchServeOptions::async_calls): started by the
// phase's thread, completed on gRPC's threads, which hand the finished call to `*done` (owned by
// the phase, so that freeing the call never destroys the function still running).
class AsyncCall final : public grpc::ClientReadReactor<sdm::v1::GenerateResponse> {
 public:
  AsyncCall(const ConnectionOptions& connection, const BenchServeOptions& options, Plan plan,
            const std::function<void(AsyncCall&)>* done)
      : done_(done), request_(RequestOf(options, plan)) {
    record_.prompt_tokens = static_cast<int64_t>(plan.prompt.size());
    PrepareContext(connection, context_);
  }

  void Start(sdm::v1::SdmService::StubInterface::async_interface& async) {
    start_ = Clock::now();
    async.Generate(&context_, &request_, this);
    StartRead(&chunk_);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows
    chunks_.emplace_back(SecondsBetween(start_, Clock::now()), chunk_.token_ids_size());
    if (chunk_.has_usage()) usage_ = chunk_.usage();
    StartRead(&chunk_);
  }

  void OnDone(const grpc::Status& status) override {
    record_.e2e = SecondsBetween(start_, Clock::now());
    status_ = status;
    (*done_)(*this);  // the phase may free this call from now on
  }

  void Finish(WorkerOutput& out) const { FinishRecord(status_, chunks_, usage_, record_, out); }

 private:
  const std::function<void(AsyncCall&)>* done_;
  grpc::ClientContext context_;
  sdm::v1::GenerateRequest request_;
  sdm::v1::GenerateResponse chunk_;
  sdm::v1::Usage usage_;
  std::vector<std::pair<double, int64_t>> chunks_;
  RequestRecord record_;
  grpc::Status status_;
  Clock::time_point start_;
};

void RunRequest(sdm::v1::SdmService::StubInterface& stub, const ConnectionOptions& connection,
                const BenchServeOptions& options, SessionPool* pool, Plan plan, WorkerOutput& out) {
  sdm::v1::GenerateRequest request = RequestOf(options, plan);
  std::optional<size_t> session;
  if (plan.reuse && pool != nullptr) {
    session = pool->Acquire(plan.rng);
    request.set_session_id(pool->id(*session));
  }

  RequestRecord record;
  record.reused_session = session.has_value();
  record.prompt_tokens = static_cast<int64_t>(plan.prompt.size());
  std::vector<std::pair<double, int64_t>> chunks;
  grpc::ClientContext context;
  PrepareContext(connection, context);
  AddSessionRouting(request.session_id(), context);  // a router keeps a session on one replica
  const Clock::time_point start = Clock::now();
  std::unique_ptr<grpc::ClientReaderInterface<sdm::v1::GenerateResponse>> reader =
      stub.Generate(&context, request);
  sdm::v1::GenerateResponse chunk;
  sdm::v1::Usage usage;
  while (reader->Read(&chunk)) {
    chunks.emplace_back(SecondsBetween(start, Clock::now()), chunk.token_ids_size());
    if (chunk.has_usage()) usage = chunk.usage();
  }
  const grpc::Status status = reader->Finish();
  record.e2e = SecondsBetween(start, Clock::now());
  if (session.has_value()) pool->Release(*session);
  FinishRecord(status, chunks, usage, record, out);
}

// Runs one phase: `count` requests (or until `duration` has passed, when positive) on
// options.concurrency workers. Returns its wall time.
double RunPhase(sdm::v1::SdmService::StubInterface& stub, const ConnectionOptions& connection,
                const BenchServeOptions& options, const ModelFacts& facts, SessionPool* pool,
                uint64_t phase, int64_t count, absl::Duration duration, WorkerOutput& merged) {
  std::atomic<int64_t> next{0};
  const Clock::time_point start = Clock::now();
  const Clock::time_point end =
      duration > absl::ZeroDuration()
          ? start + std::chrono::duration_cast<Clock::duration>(absl::ToChronoNanoseconds(duration))
          : Clock::time_point::max();
  std::vector<WorkerOutput> outputs(options.concurrency);
  {
    std::vector<std::thread> workers;
    workers.reserve(options.concurrency);
    for (int64_t w = 0; w < options.concurrency; ++w) {
      workers.emplace_back([&, w] {
        // With a duration, a worker's first call is made whatever the time: the run starts
        // with options.concurrency calls even when a worker thread starts late (a loaded
        // machine), so it always measures at least that many.
        for (bool first = true;; first = false) {
          if (duration > absl::ZeroDuration() && !first && Clock::now() >= end) break;
          const int64_t i = next.fetch_add(1);
          if (duration <= absl::ZeroDuration() && i >= count) break;
          RunRequest(stub, connection, options, pool, MakePlan(options, facts, phase, i),
                     outputs[w]);
        }
      });
    }
    for (std::thread& t : workers) t.join();
  }
  const double wall = SecondsBetween(start, Clock::now());
  for (WorkerOutput& o : outputs) {
    merged.records.insert(merged.records.end(), o.records.begin(), o.records.end());
    merged.itl.insert(merged.itl.end(), o.itl.begin(), o.itl.end());
  }
  return wall;
}

// RunPhase with options.async_calls: this thread keeps options.concurrency calls in flight on
// gRPC's callback API (no thread per call, so a burst of hundreds of calls is not also hundreds
// of client threads competing for the CPU). No session reuse (ValidateOptions).
double RunPhaseAsync(sdm::v1::SdmService::StubInterface::async_interface& async,
                     const ConnectionOptions& connection, const BenchServeOptions& options,
                     const ModelFacts& facts, uint64_t phase, int64_t count,
                     absl::Duration duration, WorkerOutput& merged) {
  absl::Mutex mu;
  int64_t in_flight = 0;                         // guarded by mu
  std::vector<std::unique_ptr<AsyncCall>> done;  // guarded by mu: finished, to record and free
  const std::function<void(AsyncCall&)> on_done = [&](AsyncCall& call) {
    absl::MutexLock lock(&mu);
    --in_flight;
    done.emplace_back(&call);
  };
  const Clock::time_point start = Clock::now();
  const Clock::time_point end =
      duration > absl::ZeroDuration()
          ? start + std::chrono::duration_cast<Clock::duration>(absl::ToChronoNanoseconds(duration))
          : Clock::time_point::max();
  int64_t started = 0;
  // With a duration, the first options.concurrency calls are started whatever the time (as
  // RunPhase's workers each make a first call).
  const auto more = [&] {
    return duration > absl::ZeroDuration() ? started < options.concurrency || Clock::now() < end
                                           : started < count;
  };
  // All of a burst is started before any finished call is recorded.
  while (true) {
    std::vector<std::unique_ptr<AsyncCall>> finished;
    int64_t free_slots = 0;
    {
      absl::MutexLock lock(&mu);
      const auto can_go = [&] {
        return !done.empty() || (in_flight < options.concurrency && more()) ||
               (in_flight == 0 && !more());
      };
      mu.Await(absl::Condition(&can_go));
      finished.swap(done);
      free_slots = options.concurrency - in_flight;
      if (in_flight == 0 && finished.empty() && !more()) break;
    }
    std::vector<AsyncCall*> batch;
    while (free_slots > 0 && more()) {
      auto call = std::make_unique<AsyncCall>(connection, options,
                                              MakePlan(options, facts, phase, started), &on_done);
      batch.push_back(call.release());  // owned by the phase once it is done
      ++started;
      --free_slots;
    }
    {
      absl::MutexLock lock(&mu);
      in_flight += static_cast<int64_t>(batch.size());
    }
    for (AsyncCall* call : batch) call->Start(async);
    for (const auto& call : finished) call->Finish(merged);
  }
  return SecondsBetween(start, Clock::now());
}

// Deletes `ids` (best effort: every id is tried), logging each deletion that fails.
void DeleteSessions(sdm::v1::SdmService::StubInterface& stub, const ConnectionOptions& connection,
                    absl::Span<const std::string> ids, std::ostream& log) {
  for (const std::string& id : ids) {
    sdm::v1::DeleteSessionRequest request;
    request.set_session_id(id);
    grpc::ClientContext context;
    PrepareContext(connection, context);
    AddSessionRouting(request.session_id(), context);
    sdm::v1::DeleteSessionResponse response;
    if (grpc::Status s = stub.DeleteSession(&context, request, &response); !s.ok()) {
      log << "could not delete session " << id << ": " << FormatStatus(s) << "\n";
    }
  }
}

std::string RandomPrefix() {
  std::random_device rd;
  return absl::StrFormat("bench-%08x", rd());
}

nlohmann::json SummaryJson(const LatencySummary& s) {
  const auto v = [](double x) -> nlohmann::json {
    if (std::isnan(x)) return nullptr;
    return x;
  };
  return {{"count", s.count}, {"mean", v(s.mean)}, {"min", v(s.min)}, {"p50", v(s.p50)},
          {"p90", v(s.p90)},  {"p99", v(s.p99)},   {"max", v(s.max)}};
}

std::string Ms(double v) { return std::isnan(v) ? "-" : absl::StrFormat("%.2f", v); }

}  // namespace

StreamTiming TimeStream(absl::Span<const std::pair<double, int64_t>> chunks) {
  StreamTiming timing;
  double last = 0;
  for (const auto& [t, n] : chunks) {
    if (n <= 0) continue;
    if (timing.ttft < 0) {
      timing.ttft = t;
    } else {
      const double per_token = (t - last) / static_cast<double>(n);
      timing.itl.insert(timing.itl.end(), n, per_token);
    }
    last = t;
  }
  return timing;
}

BenchServeResult Aggregate(absl::Span<const RequestRecord> records, std::vector<double> itl_seconds,
                           double wall_seconds) {
  BenchServeResult r;
  r.wall_seconds = wall_seconds;
  r.requests = static_cast<int64_t>(records.size());
  std::vector<double> ttft, e2e, failed_e2e;
  for (const RequestRecord& rec : records) {
    if (rec.code != grpc::StatusCode::OK) {
      ++r.errors_by_code[std::string(StatusCodeName(rec.code))];
      failed_e2e.push_back(rec.e2e * 1e3);
      continue;
    }
    ++r.ok;
    if (rec.reused_session) ++r.reused;
    r.output_tokens += rec.generated_tokens;
    r.prompt_tokens += rec.prompt_tokens;
    r.history_tokens += rec.history_tokens;
    if (rec.ttft >= 0) ttft.push_back(rec.ttft * 1e3);
    e2e.push_back(rec.e2e * 1e3);
  }
  for (double& v : itl_seconds) v *= 1e3;
  if (wall_seconds > 0) {
    r.output_tokens_per_s = r.output_tokens / wall_seconds;
    r.requests_per_s = r.ok / wall_seconds;
    r.prompt_tokens_per_s = r.prompt_tokens / wall_seconds;
  }
  r.ttft_ms = Summarize(std::move(ttft));
  r.itl_ms = Summarize(std::move(itl_seconds));
  r.e2e_ms = Summarize(std::move(e2e));
  r.failed_e2e_ms = Summarize(std::move(failed_e2e));
  return r;
}

absl::Status ValidateOptions(const BenchServeOptions& o) {
  if (o.concurrency < 1 || o.concurrency > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("--concurrency must be in [1, 4096], got ", o.concurrency));
  }
  if (o.duration <= absl::ZeroDuration() && o.requests < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--requests must be >= 1, got ", o.requests));
  }
  if (!(o.session_reuse >= 0 && o.session_reuse <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--session_reuse must be in [0, 1], got ", o.session_reuse));
  }
  if (o.session_reuse > 0 && o.sessions < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--sessions must be >= 1 with --session_reuse, got ", o.sessions));
  }
  if (o.warmup < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--warmup must be >= 0, got ", o.warmup));
  }
  if (o.async_calls && o.session_reuse > 0) {
    return absl::InvalidArgumentError("--async makes one-shot calls only (no --session_reuse)");
  }
  if (o.temperature < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--temperature must be >= 0, got ", o.temperature));
  }
  return absl::OkStatus();
}

absl::StatusOr<BenchServeResult> RunBenchServe(sdm::v1::SdmService::StubInterface& stub,
                                               const ConnectionOptions& connection,
                                               const BenchServeOptions& options,
                                               std::ostream& log) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  sdm::v1::SdmService::StubInterface::async_interface* async = nullptr;
  if (options.async_calls) {
    async = stub.async();
    if (async == nullptr) return absl::InvalidArgumentError("--async needs a stub with async()");
  }
  sdm::v1::ModelInfo info;
  {
    grpc::ClientContext context;
    PrepareContext(connection, context);
    if (grpc::Status s = stub.GetModelInfo(&context, sdm::v1::GetModelInfoRequest(), &info);
        !s.ok()) {
      return FromGrpc(s, "GetModelInfo");
    }
  }
  ModelFacts facts;
  facts.id_limit = info.tokenizer().vocab_size() > 0
                       ? std::min(info.tokenizer().vocab_size(), info.vocab_size())
                       : info.vocab_size();
  if (facts.id_limit < 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("the server reports vocab_size ", info.vocab_size()));
  }
  facts.bos_id = info.tokenizer().bos_id();
  facts.eos_id = info.tokenizer().eos_id();
  facts.max_prompt_tokens = info.max_prompt_tokens();
  facts.max_tokens_limit = info.max_tokens_limit();

  // Sessions for reused requests.
  std::vector<std::string> session_ids;
  const bool reuse = options.session_reuse > 0;
  if (reuse) {
    const std::string prefix =
        options.session_prefix.empty() ? RandomPrefix() : options.session_prefix;
    for (int64_t k = 0; k < options.sessions; ++k) {
      sdm::v1::CreateSessionRequest request;
      request.set_session_id(absl::StrCat(prefix, "-", k));
      (*request.mutable_labels())["sdm-bench"] = "serve";
      grpc::ClientContext context;
      PrepareContext(connection, context);
      AddSessionRouting(request.session_id(), context);
      sdm::v1::Session session;
      if (grpc::Status s = stub.CreateSession(&context, request, &session); !s.ok()) {
        // The run ends here: the sessions it made would stay on the server, counting against
        // the tenant's limits, and a run again with the same --session_prefix would meet them
        // (ALREADY_EXISTS). Deleted whatever --keep_sessions says: it keeps a run's sessions.
        if (!session_ids.empty()) {
          log << "deleting the " << session_ids.size()
              << " sessions created before CreateSession failed\n";
          DeleteSessions(stub, connection, session_ids, log);
        }
        return FromGrpc(s, absl::StrCat("CreateSession ", request.session_id()));
      }
      session_ids.push_back(session.id());
    }
    log << "created " << session_ids.size() << " sessions " << prefix << "-0.."
        << options.sessions - 1 << "\n";
  }
  SessionPool pool(session_ids);
  SessionPool* pool_ptr = reuse ? &pool : nullptr;
  // A phase on a thread per call, or with --async on gRPC's callback API.
  const auto run_phase = [&](uint64_t phase, int64_t count, absl::Duration duration,
                             WorkerOutput& out) {
    return async != nullptr
               ? RunPhaseAsync(*async, connection, options, facts, phase, count, duration, out)
               : RunPhase(stub, connection, options, facts, pool_ptr, phase, count, duration, out);
  };

  if (options.warmup > 0) {
    log << "warmup: " << options.warmup << " requests\n";
    WorkerOutput discarded;
    run_phase(/*phase=*/1, options.warmup, absl::ZeroDuration(), discarded);
  }
  log << "measuring: concurrency " << options.concurrency << ", "
      << (options.duration > absl::ZeroDuration()
              ? absl::StrCat(absl::FormatDuration(options.duration))
              : absl::StrCat(options.requests, " requests"))
      << "\n";
  WorkerOutput measured;
  const double wall = run_phase(/*phase=*/0, options.requests, options.duration, measured);

  if (reuse && !options.keep_sessions) DeleteSessions(stub, connection, session_ids, log);

  BenchServeResult result = Aggregate(measured.records, std::move(measured.itl), wall);
  result.host = connection.host;
  result.model = info.name();
  result.model_summary = info.summary();
  result.options = options;
  return result;
}

std::string FormatReport(const BenchServeResult& r) {
  const BenchServeOptions& o = r.options;
  std::string out = absl::StrFormat("sdm-bench serve: %s, model %s\n", r.host, r.model);
  if (!r.model_summary.empty()) absl::StrAppend(&out, "  ", r.model_summary, "\n");
  absl::StrAppendFormat(&out,
                        "  concurrency %d, %d requests in %.2f s (warmup %d), prompt_tokens %s, "
                        "max_tokens %s%s, temperature %g, seed %d\n",
                        o.concurrency, r.requests, r.wall_seconds, o.warmup,
                        o.prompt_tokens.ToString(), o.max_tokens.ToString(),
                        o.ignore_eos ? "" : " (EOS may end a call sooner)", o.temperature, o.seed);
  if (o.session_reuse > 0) {
    absl::StrAppendFormat(&out,
                          "  session_reuse %.2f over %d sessions: %d requests continued a session "
                          "(mean history %.0f tokens)\n",
                          o.session_reuse, o.sessions, r.reused,
                          r.reused > 0 ? static_cast<double>(r.history_tokens) / r.reused : 0.0);
  }
  std::string errors = "none";
  if (!r.errors_by_code.empty()) {
    errors = absl::StrJoin(r.errors_by_code, ", ", absl::PairFormatter(" "));
  }
  absl::StrAppendFormat(&out, "  ok %d, errors: %s\n\n", r.ok, errors);
  absl::StrAppendFormat(&out,
                        "throughput: %.1f output tokens/s, %.2f requests/s, %.1f prompt tokens/s "
                        "(%d output, %d prompt tokens)\n\n",
                        r.output_tokens_per_s, r.requests_per_s, r.prompt_tokens_per_s,
                        r.output_tokens, r.prompt_tokens);
  absl::StrAppendFormat(&out, "%-14s %10s %10s %10s %10s %10s %8s\n", "latency (ms)", "mean", "p50",
                        "p90", "p99", "max", "count");
  const auto row = [&](const char* name, const LatencySummary& s) {
    absl::StrAppendFormat(&out, "%-14s %10s %10s %10s %10s %10s %8d\n", name, Ms(s.mean), Ms(s.p50),
                          Ms(s.p90), Ms(s.p99), Ms(s.max), s.count);
  };
  row("TTFT", r.ttft_ms);
  row("ITL", r.itl_ms);
  row("E2E", r.e2e_ms);
  if (r.failed_e2e_ms.count > 0) row("failed E2E", r.failed_e2e_ms);
  return out;
}

nlohmann::json ToJson(const BenchServeResult& r) {
  const BenchServeOptions& o = r.options;
  nlohmann::json j;
  j["host"] = r.host;
  j["model"] = r.model;
  j["model_summary"] = r.model_summary;
  j["config"] = {{"concurrency", o.concurrency},
                 {"requests", o.duration > absl::ZeroDuration() ? nlohmann::json(nullptr)
                                                                : nlohmann::json(o.requests)},
                 {"duration_s", absl::ToDoubleSeconds(o.duration)},
                 {"prompt_tokens", o.prompt_tokens.ToString()},
                 {"max_tokens", o.max_tokens.ToString()},
                 {"session_reuse", o.session_reuse},
                 {"sessions", o.sessions},
                 {"seed", o.seed},
                 {"warmup", o.warmup},
                 {"temperature", o.temperature},
                 {"ignore_eos", o.ignore_eos}};
  j["wall_seconds"] = r.wall_seconds;
  j["requests"] = {{"total", r.requests},
                   {"ok", r.ok},
                   {"errors", r.errors_by_code},
                   {"reused_session", r.reused}};
  j["tokens"] = {
      {"output", r.output_tokens}, {"prompt", r.prompt_tokens}, {"history", r.history_tokens}};
  j["throughput"] = {{"output_tokens_per_s", r.output_tokens_per_s},
                     {"requests_per_s", r.requests_per_s},
                     {"prompt_tokens_per_s", r.prompt_tokens_per_s}};
  j["ttft_ms"] = SummaryJson(r.ttft_ms);
  j["itl_ms"] = SummaryJson(r.itl_ms);
  j["e2e_ms"] = SummaryJson(r.e2e_ms);
  j["failed_e2e_ms"] = SummaryJson(r.failed_e2e_ms);
  return j;
}

int RunBenchServeCommand(const std::vector<std::string>& args, const ClientIo& io) {
  constexpr char kUsage[] =
      "usage: sdm-bench serve [--concurrency N] [--requests N | --duration 30s]\n"
      "         [--prompt_tokens DIST] [--max_tokens DIST] [--session_reuse F --sessions K]\n"
      "         [--warmup N] [--seed S] [--async] [--json FILE] [connection flags]\n\n"
      "A load generator for a running sdm-server: keeps --concurrency Generate calls in flight\n"
      "and reports throughput, time to first token (TTFT), inter-token latency (ITL) and\n"
      "end-to-end latency percentiles. DIST is N, uniform:A:B or normal:MEAN:STD.\n";
  FlagSet flags;
  BenchServeOptions options;
  std::string duration;
  std::string prompt_tokens = "32";
  std::string max_tokens = "64";
  std::string seed = "1";
  std::string json_file;
  ConnectionFlags connection_flags;
  flags.AddInt("concurrency", &options.concurrency, "Generate calls kept in flight");
  flags.AddInt("requests", &options.requests, "measured calls (unless --duration)");
  flags.AddString("duration", &duration,
                  "measure for this long instead of --requests (seconds, or 30s, 2m; at least "
                  "--concurrency calls, started at once)");
  flags.AddString("prompt_tokens", &prompt_tokens, "prompt length distribution (token ids)");
  flags.AddString("max_tokens", &max_tokens, "max_tokens distribution");
  flags.AddDouble("session_reuse", &options.session_reuse,
                  "fraction of calls that continue one of --sessions sessions (0: all one-shot)");
  flags.AddInt("sessions", &options.sessions, "sessions that reused calls continue");
  flags.AddString("seed", &seed, "seed of the request plan (lengths, ids, reuse)");
  flags.AddInt("warmup", &options.warmup, "unmeasured calls before measuring");
  flags.AddDouble("temperature", &options.temperature, "sampling temperature (0: greedy)");
  flags.AddBool("ignore_eos", &options.ignore_eos,
                "every call generates its planned max_tokens (--noignore_eos: EOS may end it)");
  flags.AddString("json", &json_file,
                  "also write the results as JSON to FILE ('-': stdout, which then holds the JSON "
                  "alone: the report goes to stderr)");
  flags.AddString("session_prefix", &options.session_prefix,
                  "ids of the reused sessions are PREFIX-k (default: bench-<random>)");
  flags.AddBool("keep_sessions", &options.keep_sessions, "do not delete the sessions at the end");
  flags.AddBool("async", &options.async_calls,
                "one client thread keeps the calls in flight (gRPC callback API) instead of a "
                "thread per call: for bursts of many calls; one-shot calls only");
  AddConnectionFlags(flags, &connection_flags);

  if (WantsHelp(args)) {
    *io.out << kUsage << "\nflags:\n" << flags.Help();
    return kExitOk;
  }
  const auto usage_error = [&](absl::string_view message) {
    *io.err << "sdm-bench serve: " << message << " (sdm-bench serve --help)\n";
    return kExitUsage;
  };
  absl::StatusOr<std::vector<std::string>> positional = flags.Parse(args);
  if (!positional.ok()) return usage_error(positional.status().message());
  if (!positional->empty() && (*positional)[0] == "serve") positional->erase(positional->begin());
  if (!positional->empty()) {
    return usage_error(absl::StrCat("unexpected argument '", (*positional)[0], "'"));
  }
  if (!duration.empty()) {
    double seconds = 0;
    if (absl::SimpleAtod(duration, &seconds)) {
      options.duration = absl::Seconds(seconds);
    } else if (!absl::ParseDuration(duration, &options.duration)) {
      return usage_error(absl::StrCat("--duration: '", duration, "' is not a duration"));
    }
    if (options.duration <= absl::ZeroDuration() || options.duration == absl::InfiniteDuration()) {
      return usage_error("--duration must be positive and finite");
    }
  }
  absl::StatusOr<Distribution> prompt_dist = Distribution::Parse(prompt_tokens);
  if (!prompt_dist.ok()) {
    return usage_error(absl::StrCat("--prompt_tokens: ", prompt_dist.status().message()));
  }
  options.prompt_tokens = *prompt_dist;
  absl::StatusOr<Distribution> max_dist = Distribution::Parse(max_tokens);
  if (!max_dist.ok()) {
    return usage_error(absl::StrCat("--max_tokens: ", max_dist.status().message()));
  }
  options.max_tokens = *max_dist;
  if (!absl::SimpleAtoi(seed, &options.seed)) {
    return usage_error(absl::StrCat("--seed: '", seed, "' is not an unsigned 64-bit integer"));
  }
  if (absl::Status s = ValidateOptions(options); !s.ok()) return usage_error(s.message());
  absl::StatusOr<ConnectionOptions> connection =
      ResolveConnectionOptions(flags, connection_flags, io.env);
  if (!connection.ok()) return usage_error(connection.status().message());
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = MakeChannel(*connection);
  if (!channel.ok()) return usage_error(channel.status().message());
  std::unique_ptr<sdm::v1::SdmService::Stub> stub = sdm::v1::SdmService::NewStub(*channel);

  absl::StatusOr<BenchServeResult> result = RunBenchServe(*stub, *connection, options, *io.err);
  if (!result.ok()) {
    const auto code = static_cast<grpc::StatusCode>(result.status().code());
    *io.err << "sdm-bench serve: " << StatusCodeName(code) << ": " << result.status().message();
    if (const std::string hint = FailureHint(code, result.status().message(), *connection);
        !hint.empty()) {
      *io.err << " " << hint;
    }
    *io.err << "\n";
    return kExitFailure;
  }
  // With --json -, stdout carries the JSON document alone, for a parser to read: the report
  // goes to stderr with the progress lines.
  const bool json_to_stdout = json_file == "-";
  *(json_to_stdout ? io.err : io.out) << FormatReport(*result) << std::flush;
  if (!json_file.empty()) {
    const std::string text = ToJson(*result).dump(2) + "\n";
    if (json_to_stdout) {
      *io.out << text << std::flush;
    } else {
      std::ofstream file(json_file);
      file << text;
      file.close();
      if (!file) {
        *io.err << "sdm-bench serve: cannot write " << json_file << "\n";
        return kExitFailure;
      }
    }
  }
  return result->ok == 0 ? kExitFailure : kExitOk;
}

}  // namespace sdm::client
