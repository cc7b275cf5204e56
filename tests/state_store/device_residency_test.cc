// The state store honours device residency (state_store/device_residency.h): a session whose
// layers live "on the device" is synced back to the host before anything reads or copies them.
//
// The device is faked on the CPU. FakeResidency keeps its own copy of the session (decoded from
// the session's encoding into the engine's row pool, so it never counts in the store's pool),
// "device steps" run the CPU engine on that copy, and attaching overwrites the host layers with
// NaN, so any path that reads stale host layers shows up as a wrong encoding or NaN logits.
// Controls are plain host sessions fed the same tokens; comparisons are bit for bit. The probe
// records the thread of every copy and destruction: with a step thread registered, the store
// must do both there and nowhere else.
#include "state_store/device_residency.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "base/check.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "state_store/session_state.h"
#include "state_store/session_store.h"
#include "state_store/state_codec.h"
#include "tests/engine/test_model_util.h"

namespace sdm {
namespace {

using ::testing::HasSubstr;

// Large next to a tiny session's host bytes, so budgets in these tests are decided by it.
constexpr int64_t kDeviceBytes = int64_t{4} << 20;

// The fake device's identity (DeviceResidency::owner()).
const char kFakeDevice = 0;

// What a test observes of a residency, surviving its destruction. Written by whichever thread
// copies or destroys, read by the test after it synchronised with that thread.
struct Probe {
  int copies = 0;         // successful CopyToHost calls
  int failed_copies = 0;  // CopyToHost calls answered with the injected error
  bool fail = false;      // CopyToHost fails while set
  // CopyChangesToHost: implemented (CopiesChanges) while set; its successful calls and where the
  // last one ran. `fail` fails it too.
  bool copies_changes = false;
  int change_copies = 0;
  std::thread::id change_thread;
  bool destroyed = false;  // the residency was destroyed (its "device memory" freed)
  std::thread::id copy_thread, destroy_thread;  // where the last copy and the destruction ran
};

class FakeResidency : public DeviceResidency {
 public:
  FakeResidency(std::unique_ptr<SessionState> device_copy, std::shared_ptr<Probe> probe)
      : DeviceResidency(&kFakeDevice), copy_(std::move(device_copy)), probe_(std::move(probe)) {}
  ~FakeResidency() override {
    probe_->destroyed = true;
    probe_->destroy_thread = std::this_thread::get_id();
  }

  SessionState& copy() { return *copy_; }

  absl::Status CopyToHost(SessionState& host) override {
    probe_->copy_thread = std::this_thread::get_id();
    if (probe_->fail) {
      ++probe_->failed_copies;
      return absl::InternalError("injected device copy failure");
    }
    if (host.position() != copy_->position() || host.num_layers() != copy_->num_layers()) {
      return absl::InternalError("host and device disagree on the position");
    }
    for (int64_t l = 0; l < copy_->num_layers(); ++l) {
      if (copy_->is_sdm(l)) {
        // The device's rows are a superset of the host's (it only ever writes more slots).
        if (absl::Status s = CopyRows(copy_->sdm(l), /*dirty_only=*/false, host.sdm(l)); !s.ok()) {
          return s;
        }
      } else {
        const KvCache& src = copy_->kv(l);
        KvCache& dst = host.kv(l);
        dst.ResetForRestore(src.length());
        for (int64_t p = src.first_position(); p < src.length(); ++p) {
          std::memcpy(dst.MutableKeyRow(p), src.KeyRow(p), src.row_width() * sizeof(float));
          std::memcpy(dst.MutableValueRow(p), src.ValueRow(p), src.row_width() * sizeof(float));
        }
      }
    }
    ++probe_->copies;
    return absl::OkStatus();
  }

  // What changed on the fake device since the attach or the last call: the rows the engine
  // marked dirty on the device copy (through MutableRow, so the host marks them dirty too) and
  // the positions the host lacks, as the CUDA residency copies them.
  absl::Status CopyChangesToHost(SessionState& host) override {
    if (!probe_->copies_changes) return DeviceResidency::CopyChangesToHost(host);
    probe_->change_thread = std::this_thread::get_id();
    if (probe_->fail) {
      ++probe_->failed_copies;
      return absl::InternalError("injected device copy failure");
    }
    for (int64_t l = 0; l < copy_->num_layers(); ++l) {
      if (copy_->is_sdm(l)) {
        if (absl::Status s = CopyRows(copy_->sdm(l), /*dirty_only=*/true, host.sdm(l)); !s.ok()) {
          return s;
        }
        continue;
      }
      const KvCache& src = copy_->kv(l);
      KvCache& dst = host.kv(l);
      if (dst.length() < src.first_position()) {  // went round the ring since: all of it
        dst.ResetForRestore(src.length());
        for (int64_t p = src.first_position(); p < src.length(); ++p) {
          dst.StoreRow(p, /*value=*/false, src.KeyRow(p));
          dst.StoreRow(p, /*value=*/true, src.ValueRow(p));
        }
      } else {
        for (int64_t p = dst.length(); p < src.length(); ++p) {
          dst.AppendRow(src.KeyRow(p), src.ValueRow(p));
        }
      }
    }
    copy_->ClearDirty();
    ++probe_->change_copies;
    return absl::OkStatus();
  }
  bool CopiesChanges() const override { return probe_->copies_changes; }

  int64_t DeviceBytes() const override { return kDeviceBytes; }

 private:
  // Copies src's private rows (dirty_only: its dirty rows) into dst, through MutableRow.
  static absl::Status CopyRows(const SdmTable& src, bool dirty_only, SdmTable& dst) {
    absl::Status status;
    auto copy = [&](int64_t head, int64_t slot, const float* row) {
      float* out = status.ok() ? dst.MutableRow(head, slot) : nullptr;
      if (out == nullptr) {
        if (status.ok()) status = absl::ResourceExhaustedError("host row pool is full");
        return;
      }
      std::memcpy(out, row, dst.row_width() * sizeof(float));
    };
    if (dirty_only) {
      src.ForEachDirtyRow(copy);
    } else {
      src.ForEachPrivateRow(copy);
    }
    return status;
  }

  std::unique_ptr<SessionState> copy_;
  std::shared_ptr<Probe> probe_;
};

// Every held host row becomes NaN: from here on only the device copy holds the session.
void Poison(SessionState& s) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t l = 0; l < s.num_layers(); ++l) {
    if (s.is_sdm(l)) {
      SdmTable& t = s.sdm(l);
      std::vector<std::pair<int64_t, int64_t>> slots;
      t.ForEachPrivateRow([&](int64_t h, int64_t slot, const float*) {
        slots.push_back({h, slot});
      });
      for (auto [h, slot] : slots) {
        float* row = t.MutableRow(h, slot);
        SDM_CHECK(row != nullptr);
        std::fill(row, row + t.row_width(), nan);
      }
    } else {
      KvCache& kv = s.kv(l);
      for (int64_t p = kv.first_position(); p < kv.length(); ++p) {
        std::fill(kv.MutableKeyRow(p), kv.MutableKeyRow(p) + kv.row_width(), nan);
        std::fill(kv.MutableValueRow(p), kv.MutableValueRow(p) + kv.row_width(), nan);
      }
    }
  }
}

std::vector<int32_t> Tokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, 255);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = tok(rng);
  return t;
}

bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

bool HasNan(const std::vector<float>& v) {
  for (float x : v) {
    if (std::isnan(x)) return true;
  }
  return false;
}

// A stand-in for the scheduler's step loop: registers itself as the store's step thread and runs
// RunDeviceMoves() whenever the store wakes it or the test asks for a pass.
class FakeStepThread {
 public:
  explicit FakeStepThread(SessionStateStore& store) : store_(store), thread_([this] { Loop(); }) {
    absl::MutexLock lock(&mu_);
    while (!registered_) done_changed_.Wait(&mu_);
  }
  ~FakeStepThread() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      wanted_changed_.Signal();
    }
    thread_.join();
  }

  std::thread::id id() const { return thread_.get_id(); }

  // Returns once a whole RunDeviceMoves() that began after this call has run.
  void Pass() {
    absl::MutexLock lock(&mu_);
    wanted_ = true;
    wanted_changed_.Signal();
    const int64_t target = begun_ + 1;
    while (done_ < target) done_changed_.Wait(&mu_);
  }

 private:
  void Loop() {
    store_.SetStepThread([this] {
      absl::MutexLock lock(&mu_);
      wanted_ = true;
      wanted_changed_.Signal();
    });
    {
      absl::MutexLock lock(&mu_);
      registered_ = true;
      done_changed_.SignalAll();
    }
    while (true) {
      int64_t pass = 0;
      {
        absl::MutexLock lock(&mu_);
        while (!wanted_ && !stop_) wanted_changed_.Wait(&mu_);
        if (stop_) break;
        wanted_ = false;
        pass = ++begun_;
      }
      store_.RunDeviceMoves();
      absl::MutexLock lock(&mu_);
      done_ = pass;
      done_changed_.SignalAll();
    }
    store_.ClearStepThread();
  }

  SessionStateStore& store_;
  absl::Mutex mu_;
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  bool wanted_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t begun_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  absl::CondVar wanted_changed_, done_changed_;
  std::thread thread_;
};

class DeviceResidencyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Every state kind: sliding-window (ring wraps within the prompt), SDM, full attention.
    config_ = *PresetConfig("tiny");
    config_.n_layers = 5;
    config_.swa_at = {0, 2};
    config_.attn_at = {3};
    config_.sdm_at = {1, 4};
    config_.swa_window = 6;
    ASSERT_TRUE(FinalizeModelConfig(config_).ok());
    EngineOptions o;
    o.num_threads = 1;
    o.prefill_chunk = 8;
    auto e = Engine::Create(RandomModel(config_, 5), o);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = *std::move(e);
  }

  std::unique_ptr<SessionStateStore> OpenStore(const std::filesystem::path& dir,
                                               int64_t device_budget = 0, bool background = false,
                                               bool persist_device_turns = true) {
    SessionStoreOptions o;
    o.persist_device_turns = persist_device_turns;
    o.dir = dir;
    o.resident_budget_bytes = int64_t{1} << 30;
    o.host_budget_bytes = int64_t{1} << 30;
    o.device_budget_bytes = device_budget;
    o.background = background;
    auto s = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), o);
    SDM_CHECK(s.ok());
    return *std::move(s);
  }

  // Moves `host` to the fake device: the device copy is host's current content, host's layers
  // become NaN.
  std::shared_ptr<Probe> Attach(SessionState& host) {
    auto probe = std::make_shared<Probe>();
    auto decoded = DecodeSessionState(EncodeSessionState(host, {}, engine_->fingerprint()),
                                      engine_->state_layout(), engine_->fingerprint());
    SDM_CHECK(decoded.ok());
    Poison(host);
    host.AttachDevice(std::make_unique<FakeResidency>(std::move(decoded->state), probe));
    return probe;
  }

  // A decode step "on the device": the engine runs on the device copy; the host keeps the
  // position current (device_residency.h), its layers stay stale.
  void DeviceDecode(SessionState& host, const std::vector<int32_t>& tokens) {
    auto* fake = static_cast<FakeResidency*>(host.device());
    ASSERT_NE(fake, nullptr);
    std::vector<float> logits(engine_->vocab_size());
    for (int32_t t : tokens) {
      SessionState* batch[] = {&fake->copy()};
      ASSERT_TRUE(engine_->Decode(batch, {&t, 1}, logits).ok());
      host.AdvancePosition();
    }
  }

  void HostDecode(SessionState& s, const std::vector<int32_t>& tokens) {
    std::vector<float> logits(engine_->vocab_size());
    for (int32_t t : tokens) {
      SessionState* batch[] = {&s};
      ASSERT_TRUE(engine_->Decode(batch, {&t, 1}, logits).ok());
    }
  }

  // Logits of feeding `tokens` one at a time, all steps concatenated (advances `s`).
  std::vector<float> Continue(SessionState& s, const std::vector<int32_t>& tokens) {
    std::vector<float> all, step(engine_->vocab_size());
    for (int32_t t : tokens) {
      SessionState* batch[] = {&s};
      SDM_CHECK(engine_->Decode(batch, {&t, 1}, step).ok());
      all.insert(all.end(), step.begin(), step.end());
    }
    return all;
  }

  // The encoding of the state alone (same record), for bit-exact content comparisons.
  std::string Content(const SessionState& s) {
    return EncodeSessionState(s, SessionRecord{"x", ""}, engine_->fingerprint());
  }
  // Compared as a bool: a failure must not print megabytes of binary.
  bool SameContent(const SessionState& a, const SessionState& b) {
    return Content(a) == Content(b);
  }

  // A host session that took `prompt` by prefill and then `steps` one by one.
  std::unique_ptr<SessionState> Control(const std::vector<int32_t>& prompt,
                                        const std::vector<int32_t>& steps) {
    auto s = engine_->NewSession();
    SDM_CHECK(engine_->Prefill(*s, prompt, false, nullptr).ok());
    HostDecode(*s, steps);
    return s;
  }

  // Creates `id` in `store`, prefills `prompt` on the host, moves it to the device and runs
  // `steps` there. Returns the residency's probe.
  std::shared_ptr<Probe> CreateOnDevice(SessionStateStore& store, const std::string& id,
                                        const std::vector<int32_t>& prompt,
                                        const std::vector<int32_t>& steps) {
    SDM_CHECK(store.Create(id, "meta").ok());
    auto lease = store.Acquire(id);
    SDM_CHECK(lease.ok());
    SDM_CHECK(engine_->Prefill(lease->state(), prompt, false, nullptr).ok());
    auto probe = Attach(lease->state());
    DeviceDecode(lease->state(), steps);
    return probe;
  }

  // TurnsOnADeviceThatCannotCopyChangesAreWrittenWhenItLeaves, with the residency able to copy
  // changes and the store's switch off, or the other way round.
  void TurnsAreWrittenWhenTheSessionLeaves(bool switched_off);

  ModelConfig config_;
  std::unique_ptr<Engine> engine_;
  const std::vector<int32_t> prompt_ = Tokens(20, 1);  // past the SWA window (ring of 14)
  const std::vector<int32_t> steps_ = Tokens(5, 2);
  const std::vector<int32_t> more_ = Tokens(6, 3);
};

// ---- SessionState on its own ----

TEST_F(DeviceResidencyTest, SyncToHostCopiesBackAndDetaches) {
  auto control = Control(prompt_, steps_);
  auto s = engine_->NewSession();
  ASSERT_TRUE(engine_->Prefill(*s, prompt_, false, nullptr).ok());
  const int64_t host_bytes = s->ResidentBytes();
  EXPECT_FALSE(s->on_device());
  EXPECT_TRUE(s->SyncToHost().ok());  // host-only: nothing to do

  auto probe = Attach(*s);
  EXPECT_TRUE(s->on_device());
  // Host and device memory are counted apart: the stale host copy is still host memory.
  EXPECT_EQ(s->ResidentBytes(), host_bytes);
  EXPECT_EQ(s->DeviceBytes(), kDeviceBytes);
  DeviceDecode(*s, steps_);

  probe->fail = true;
  const absl::Status failed = s->SyncToHost();
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal) << failed;
  EXPECT_TRUE(s->on_device());  // still attached: the device copy is the truth
  EXPECT_FALSE(probe->destroyed);

  probe->fail = false;
  ASSERT_TRUE(s->SyncToHost().ok());
  EXPECT_FALSE(s->on_device());
  EXPECT_EQ(s->device(), nullptr);
  EXPECT_EQ(s->DeviceBytes(), 0);
  EXPECT_TRUE(probe->destroyed);
  EXPECT_EQ(probe->copies, 1);
  EXPECT_TRUE(SameContent(*s, *control));
  EXPECT_TRUE(BitwiseEqual(Continue(*s, more_), Continue(*control, more_)));
}

TEST_F(DeviceResidencyTest, DetachDeviceDropsWithoutCopying) {
  auto s = engine_->NewSession();
  auto probe = Attach(*s);
  s->DetachDevice();
  EXPECT_FALSE(s->on_device());
  EXPECT_TRUE(probe->destroyed);
  EXPECT_EQ(probe->copies, 0);
}

TEST_F(DeviceResidencyTest, DestroyingTheSessionDestroysItsResidency) {
  auto s = engine_->NewSession();
  auto probe = Attach(*s);
  s.reset();
  EXPECT_TRUE(probe->destroyed);
  EXPECT_EQ(probe->copies, 0);
}

TEST_F(DeviceResidencyTest, EncodingAnOnDeviceSessionIsRefused) {
  auto control = Control(prompt_, steps_);
  auto s = engine_->NewSession();
  ASSERT_TRUE(engine_->Prefill(*s, prompt_, false, nullptr).ok());
  auto probe = Attach(*s);
  DeviceDecode(*s, steps_);
  absl::StatusOr<std::string> refused =
      TryEncodeSessionState(*s, SessionRecord{"x", ""}, engine_->fingerprint());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("device"));
  EXPECT_EQ(probe->copies, 0);  // the codec never syncs on its own

  ASSERT_TRUE(s->SyncToHost().ok());
  absl::StatusOr<std::string> blob =
      TryEncodeSessionState(*s, SessionRecord{"x", ""}, engine_->fingerprint());
  ASSERT_TRUE(blob.ok()) << blob.status();
  EXPECT_TRUE(*blob == Content(*control)) << "encodings differ";
}

TEST_F(DeviceResidencyTest, CopiesOfAnOnDeviceSessionAreProgrammingErrors) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto s = engine_->NewSession();
  auto probe = Attach(*s);
  EXPECT_DEATH(s->Clone(), "check failed");
  EXPECT_DEATH(s->Fork(), "check failed");
  EXPECT_DEATH(EncodeSessionState(*s, {}, engine_->fingerprint()), "check failed");
  EXPECT_DEATH(s->AttachDevice(std::make_unique<FakeResidency>(engine_->NewSession(), probe)),
               "check failed");
}

// A staged upload (StagedUpload) that records whether it is still held.
class FakeStaged : public StagedUpload {
 public:
  explicit FakeStaged(std::shared_ptr<bool> destroyed)
      : StagedUpload(&kFakeDevice), destroyed_(std::move(destroyed)) {}
  ~FakeStaged() override { *destroyed_ = true; }

 private:
  std::shared_ptr<bool> destroyed_;
};

// Attaches a FakeStaged to `s`; the flag turns true when the session lets it go.
std::shared_ptr<bool> Stage(SessionState& s) {
  auto destroyed = std::make_shared<bool>(false);
  s.AttachStaged(std::make_unique<FakeStaged>(destroyed));
  return destroyed;
}

// A staged copy of the host layers must never outlive a change to them: every way a layer or
// the position can change drops it, and reading does not.
TEST_F(DeviceResidencyTest, AStagedUploadIsDroppedWhenTheLayersMayChange) {
  auto s = engine_->NewSession();
  ASSERT_TRUE(engine_->Prefill(*s, prompt_, false, nullptr).ok());
  const SessionState& view = *s;

  auto dropped = Stage(*s);
  ASSERT_NE(s->staged(), nullptr);
  EXPECT_EQ(s->staged()->owner(), &kFakeDevice);
  // Reads (const accessors, copies, the codec) keep it.
  for (int64_t l = 0; l < view.num_layers(); ++l) {
    if (view.is_sdm(l)) {
      (void)view.sdm(l);
    } else {
      (void)view.kv(l);
    }
  }
  auto fork = s->Fork();
  auto clone = s->Clone();
  EXPECT_FALSE(EncodeSessionState(*s, {}, engine_->fingerprint()).empty());
  s->ClearDirty();  // what was written is on disk: the rows themselves are unchanged
  EXPECT_FALSE(*dropped);
  EXPECT_EQ(fork->staged(), nullptr);  // a copy is another session: nothing staged for it
  EXPECT_EQ(clone->staged(), nullptr);

  // A step writes the layers (and advances the position).
  HostDecode(*s, {7});
  EXPECT_TRUE(*dropped);
  EXPECT_EQ(s->staged(), nullptr);

  const int64_t kv_layer = config_.swa_at[0];
  const int64_t sdm_layer = config_.sdm_at[0];
  dropped = Stage(*s);
  s->kv(kv_layer);
  EXPECT_TRUE(*dropped) << "a mutable KV cache";
  dropped = Stage(*s);
  s->sdm(sdm_layer);
  EXPECT_TRUE(*dropped) << "a mutable SDM table";
  dropped = Stage(*s);
  s->DropStaged();
  EXPECT_TRUE(*dropped) << "DropStaged";

  // Attaching a residency makes the host layers stale: the staged copy goes too.
  dropped = Stage(*s);
  auto probe = Attach(*s);
  EXPECT_TRUE(*dropped) << "AttachDevice";
  EXPECT_EQ(s->staged(), nullptr);

  // Destroying the session destroys its staged upload; TakeStaged hands it over whole.
  auto other = engine_->NewSession();
  dropped = Stage(*other);
  other->AdvancePosition();
  EXPECT_TRUE(*dropped) << "AdvancePosition";
  dropped = Stage(*other);
  other->set_position(0);
  EXPECT_TRUE(*dropped) << "set_position";
  dropped = Stage(*other);
  std::unique_ptr<StagedUpload> taken = other->TakeStaged();
  EXPECT_EQ(other->staged(), nullptr);
  EXPECT_FALSE(*dropped);
  taken.reset();
  EXPECT_TRUE(*dropped);
  dropped = Stage(*other);
  other.reset();
  EXPECT_TRUE(*dropped) << "destroying the session";
}

TEST_F(DeviceResidencyTest, StagingAnOnDeviceSessionIsAProgrammingError) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto s = engine_->NewSession();
  auto probe = Attach(*s);
  EXPECT_DEATH(Stage(*s), "check failed");
}

// ---- Through the store ----

TEST_F(DeviceResidencyTest, ParkingSyncsAndResumesBitExact) {
  for (Tier tier : {Tier::kHost, Tier::kDisk}) {
    SCOPED_TRACE(TierName(tier));
    testing::ScopedTempDir dir;
    auto store = OpenStore(dir.path());
    auto control = Control(prompt_, steps_);
    auto probe = CreateOnDevice(*store, "s", prompt_, steps_);

    ASSERT_TRUE(store->Park("s", tier).ok());
    EXPECT_EQ(probe->copies, 1);
    EXPECT_TRUE(probe->destroyed);
    EXPECT_EQ(store->Get("s")->tier, tier);
    EXPECT_EQ(store->Get("s")->position, static_cast<int64_t>(prompt_.size() + steps_.size()));

    auto lease = store->Acquire("s");
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_FALSE(lease->state().on_device());
    EXPECT_TRUE(SameContent(lease->state(), *control));
    const std::vector<float> got = Continue(lease->state(), more_);
    EXPECT_FALSE(HasNan(got));
    EXPECT_TRUE(BitwiseEqual(got, Continue(*control, more_)));
  }
}

TEST_F(DeviceResidencyTest, DeviceBudgetCopiesTheLeastRecentlyUsedBack) {
  auto control = Control(prompt_, steps_);
  // Room for one session on device, not two: releasing the second copies the first back to
  // the host (it stays resident, host-only).
  auto store = OpenStore({}, kDeviceBytes + kDeviceBytes / 2);
  auto a = CreateOnDevice(*store, "a", prompt_, steps_);
  EXPECT_EQ(store->Get("a")->device_bytes, kDeviceBytes);
  auto b = CreateOnDevice(*store, "b", prompt_, steps_);
  EXPECT_EQ(store->Get("a")->tier, Tier::kResident);
  EXPECT_EQ(store->Get("a")->device_bytes, 0);
  EXPECT_EQ(store->Get("b")->device_bytes, kDeviceBytes);
  EXPECT_EQ(a->copies, 1);
  EXPECT_TRUE(a->destroyed);
  EXPECT_EQ(b->copies, 0);
  const StoreStats stats = store->Stats();
  EXPECT_EQ(stats.device_sessions, 1);
  EXPECT_EQ(stats.device_bytes, kDeviceBytes);
  EXPECT_EQ(stats.device_evictions, 1);
  auto lease = store->Acquire("a");
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_FALSE(lease->state().on_device());
  EXPECT_TRUE(SameContent(lease->state(), *control));
}

TEST_F(DeviceResidencyTest, PersistAllSyncsEverySession) {
  testing::ScopedTempDir dir;
  auto control = Control(prompt_, steps_);
  std::shared_ptr<Probe> probes[2];
  {
    auto store = OpenStore(dir.path());
    probes[0] = CreateOnDevice(*store, "a", prompt_, steps_);
    probes[1] = CreateOnDevice(*store, "b", prompt_, steps_);
    ASSERT_TRUE(store->PersistAll().ok());
    for (const auto& p : probes) {
      EXPECT_EQ(p->copies, 1);
      EXPECT_TRUE(p->destroyed);
    }
    EXPECT_EQ(store->Stats().sessions[static_cast<int>(Tier::kDisk)], 2);
  }
  auto store = OpenStore(dir.path());  // a restart reads what was persisted
  for (const char* id : {"a", "b"}) {
    auto lease = store->Acquire(id);
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_TRUE(SameContent(lease->state(), *control)) << id;
  }
}

// Where the residency copies back changes (as the CUDA backend's does), every turn of a session
// on the device is written like a host session's turn, and the session stays on the device: the
// step thread copies what the turn changed, the writer appends it as a delta, and the turn is
// acknowledged (WhenPersisted) only then. A crash copy of the directory, taken after each turn
// with the session still on the device, restores it bit for bit. Parking it then copies nothing.
TEST_F(DeviceResidencyTest, TurnsOnTheDeviceAreWrittenWhileTheSessionStaysThere) {
  testing::ScopedTempDir dir, crashes;
  std::unique_ptr<SessionStateStore> store = OpenStore(dir.path(), 0, /*background=*/true);
  FakeStepThread step(*store);
  ASSERT_TRUE(store->Create("s", "meta").ok());
  auto control = engine_->NewSession();
  std::shared_ptr<Probe> probe;
  int crash = 0;
  for (const std::vector<int32_t>& turn : {prompt_, steps_, more_, Tokens(30, 4)}) {
    {
      auto lease = store->Acquire("s");
      ASSERT_TRUE(lease.ok()) << lease.status();
      if (probe == nullptr) {
        // (Attach poisons the host layers; the session is empty yet, so nothing is lost: the
        // host holds what the device copy was made from, as CopyChangesToHost requires.)
        probe = Attach(lease->state());
        probe->copies_changes = true;
      }
      ASSERT_TRUE(lease->state().on_device());
      DeviceDecode(lease->state(), turn);
    }
    HostDecode(*control, turn);
    absl::Notification acked;
    store->WhenPersisted("s", [&](const absl::Status& saved) {
      EXPECT_TRUE(saved.ok()) << saved;
      acked.Notify();
    });
    acked.WaitForNotification();
    EXPECT_TRUE(store->PersistHealth().ok());
    EXPECT_EQ(probe->change_copies, crash + 1);
    EXPECT_EQ(probe->change_thread, step.id());
    EXPECT_EQ(probe->copies, 0) << "never copied back whole";
    EXPECT_FALSE(probe->destroyed) << "still on the device";

    const std::filesystem::path copy = crashes.path() / std::to_string(++crash);
    std::filesystem::copy(dir.path(), copy, std::filesystem::copy_options::recursive);
    auto restarted = OpenStore(copy);
    auto lease = restarted->Acquire("s");
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(lease->state().position(), control->position());
    EXPECT_TRUE(SameContent(lease->state(), *control)) << "after turn " << crash;
  }
  // The turns after the first were deltas: what they changed, not the session.
  const int64_t deltas = store->Stats().persist_deltas;
  EXPECT_GE(deltas, 2);

  // Parked now, the session is only detached (its host layers were copied back after its last
  // step), and its next turn, on the host, is still a delta.
  ASSERT_TRUE(store->Park("s", Tier::kHost).ok());
  EXPECT_EQ(probe->copies, 0);
  EXPECT_TRUE(probe->destroyed);
  {
    auto lease = store->Acquire("s");
    ASSERT_TRUE(lease.ok()) << lease.status();
    ASSERT_FALSE(lease->state().on_device());
    EXPECT_TRUE(SameContent(lease->state(), *control));
    HostDecode(lease->state(), steps_);
  }
  HostDecode(*control, steps_);
  absl::Notification acked;
  store->WhenPersisted("s", [&](const absl::Status& saved) {
    EXPECT_TRUE(saved.ok()) << saved;
    acked.Notify();
  });
  acked.WaitForNotification();
  EXPECT_EQ(store->Stats().persist_deltas, deltas + 1);
  const std::filesystem::path copy = crashes.path() / "parked";
  std::filesystem::copy(dir.path(), copy, std::filesystem::copy_options::recursive);
  auto restarted = OpenStore(copy);
  auto lease = restarted->Acquire("s");
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE(SameContent(lease->state(), *control));
}

// Without it (the default of a residency), or with SessionStoreOptions::persist_device_turns
// off, a session on the device is written only when it leaves, and nobody waits for its turns:
// the crash copy holds the session as created.
TEST_F(DeviceResidencyTest, TurnsOnADeviceThatCannotCopyChangesAreWrittenWhenItLeaves) {
  for (const bool switched_off : {false, true}) {
    SCOPED_TRACE(switched_off ? "persist_device_turns off" : "a residency without it");
    TurnsAreWrittenWhenTheSessionLeaves(switched_off);
  }
}

void DeviceResidencyTest::TurnsAreWrittenWhenTheSessionLeaves(bool switched_off) {
  testing::ScopedTempDir dir, crashes;
  std::unique_ptr<SessionStateStore> store =
      OpenStore(dir.path(), 0, /*background=*/true, /*persist_device_turns=*/!switched_off);
  FakeStepThread step(*store);
  ASSERT_TRUE(store->Create("s", "meta").ok());
  absl::Notification created;
  store->WhenPersisted("s", [&](const absl::Status& saved) {
    EXPECT_TRUE(saved.ok()) << saved;
    created.Notify();
  });
  created.WaitForNotification();
  std::shared_ptr<Probe> probe;
  {
    auto lease = store->Acquire("s");
    ASSERT_TRUE(lease.ok()) << lease.status();
    probe = Attach(lease->state());
    probe->copies_changes = switched_off;  // the switch alone keeps it from being written
    DeviceDecode(lease->state(), prompt_);
  }
  absl::Notification acked;
  store->WhenPersisted("s", [&](const absl::Status& saved) {
    EXPECT_TRUE(saved.ok()) << saved;
    acked.Notify();
  });
  acked.WaitForNotification();  // at once: nothing to wait for
  EXPECT_EQ(probe->change_copies, 0);
  EXPECT_EQ(store->Stats().unpersisted, 1);
  std::filesystem::copy(dir.path(), crashes.path() / "1", std::filesystem::copy_options::recursive);
  {
    auto restarted = OpenStore(crashes.path() / "1");
    auto lease = restarted->Acquire("s");
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(lease->state().position(), 0);
  }
  // Leaving the device (parked to disk: copied back, then written) writes its turns: a residency
  // that can copy changes copies only them (then the session is only detached: rows a fork
  // shares stay shared), one that cannot copies everything.
  ASSERT_TRUE(store->Park("s", Tier::kDisk).ok());
  EXPECT_EQ(probe->copies, switched_off ? 0 : 1);
  EXPECT_EQ(probe->change_copies, switched_off ? 1 : 0);
  std::filesystem::copy(dir.path(), crashes.path() / "2", std::filesystem::copy_options::recursive);
  auto restarted = OpenStore(crashes.path() / "2");
  auto lease = restarted->Acquire("s");
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->state().position(), static_cast<int64_t>(prompt_.size()));
}

TEST_F(DeviceResidencyTest, ForkSyncsTheSourceFirst) {
  testing::ScopedTempDir dir;
  auto store = OpenStore(dir.path());
  auto control = Control(prompt_, steps_);
  auto probe = CreateOnDevice(*store, "src", prompt_, steps_);
  ASSERT_TRUE(store->Fork("src", "dst", "forked").ok());
  EXPECT_EQ(probe->copies, 1);
  EXPECT_TRUE(probe->destroyed);
  EXPECT_EQ(store->Get("src")->tier, Tier::kResident);  // synced in place, not parked

  for (const char* id : {"src", "dst"}) {
    SCOPED_TRACE(id);
    auto lease = store->Acquire(id);
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_FALSE(lease->state().on_device());
    EXPECT_TRUE(SameContent(lease->state(), *control));
    auto expected = control->Clone();
    const std::vector<float> got = Continue(lease->state(), more_);
    EXPECT_FALSE(HasNan(got));
    EXPECT_TRUE(BitwiseEqual(got, Continue(*expected, more_)));
  }
}

TEST_F(DeviceResidencyTest, FailedSyncKeepsThatSessionResidentAndUsable) {
  testing::ScopedTempDir dir;
  auto control = Control(prompt_, steps_);
  auto store = OpenStore(dir.path());
  auto bad = CreateOnDevice(*store, "bad", prompt_, steps_);
  auto good = CreateOnDevice(*store, "good", prompt_, steps_);
  bad->fail = true;

  // Park: the residency's error, naming the session; it stays resident on its device copy.
  absl::Status parked = store->Park("bad", Tier::kHost);
  EXPECT_EQ(parked.code(), absl::StatusCode::kInternal) << parked;
  EXPECT_THAT(parked.message(), HasSubstr("'bad'"));
  EXPECT_THAT(parked.message(), HasSubstr("injected"));
  EXPECT_EQ(store->Get("bad")->tier, Tier::kResident);
  EXPECT_FALSE(bad->destroyed);
  EXPECT_EQ(store->Stats().sync_errors, 1);
  EXPECT_EQ(store->Get("bad")->device_bytes, kDeviceBytes);

  // Fork: refused the same way, no half-made fork left behind.
  absl::Status forked = store->Fork("bad", "bad2", "");
  EXPECT_EQ(forked.code(), absl::StatusCode::kInternal) << forked;
  EXPECT_EQ(store->Get("bad2").status().code(), absl::StatusCode::kNotFound);

  // PersistAll: everything else still goes to disk; the failure is reported.
  absl::Status persisted = store->PersistAll();
  EXPECT_EQ(persisted.code(), absl::StatusCode::kUnavailable) << persisted;
  EXPECT_THAT(persisted.message(), HasSubstr("bad"));
  EXPECT_THAT(persisted.message(), ::testing::Not(HasSubstr("good")));
  EXPECT_EQ(store->Get("good")->tier, Tier::kDisk);
  EXPECT_EQ(good->copies, 1);
  EXPECT_EQ(store->Get("bad")->tier, Tier::kResident);
  EXPECT_EQ(store->Stats().sync_errors, 3);

  // Still usable: it steps on on the device, and once the device answers it parks exactly.
  {
    auto lease = store->Acquire("bad");
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_TRUE(lease->state().on_device());
    DeviceDecode(lease->state(), more_);
  }
  HostDecode(*control, more_);
  bad->fail = false;
  ASSERT_TRUE(store->Park("bad", Tier::kDisk).ok());
  EXPECT_TRUE(bad->destroyed);
  auto lease = store->Acquire("bad");
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE(SameContent(lease->state(), *control));
}

TEST_F(DeviceResidencyTest, DeviceBudgetSkipsASessionThatFailsToSyncAndCopiesOthers) {
  auto control = Control(prompt_, steps_);
  // Room for one session on device, not two.
  auto store = OpenStore({}, kDeviceBytes + kDeviceBytes / 2);
  auto bad = CreateOnDevice(*store, "bad", prompt_, steps_);
  bad->fail = true;
  // Releasing "good" puts the device tier over budget: "bad" is least recently used but cannot
  // be synced, so the store logs it and copies "good" back instead.
  auto good = CreateOnDevice(*store, "good", prompt_, steps_);
  EXPECT_GE(bad->failed_copies, 1);
  EXPECT_EQ(store->Get("bad")->device_bytes, kDeviceBytes);
  EXPECT_EQ(store->Get("good")->device_bytes, 0);
  EXPECT_EQ(good->copies, 1);
  EXPECT_TRUE(good->destroyed);
  EXPECT_FALSE(bad->destroyed);
  EXPECT_GE(store->Stats().sync_errors, 1);
  EXPECT_LE(store->Stats().device_bytes, kDeviceBytes + kDeviceBytes / 2);

  auto lease = store->Acquire("good");
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE(SameContent(lease->state(), *control));
}

TEST_F(DeviceResidencyTest, DeviceBytesCountInTheDeviceTierOnly) {
  auto store = OpenStore({});
  ASSERT_TRUE(store->Create("s", "").ok());
  int64_t host_info = 0, host_stats = 0;
  {
    auto lease = store->Acquire("s");
    ASSERT_TRUE(lease.ok());
    ASSERT_TRUE(engine_->Prefill(lease->state(), prompt_, false, nullptr).ok());
  }
  host_info = store->Get("s")->bytes;
  host_stats = store->Stats().bytes[static_cast<int>(Tier::kResident)];
  ASSERT_GT(host_info, 0);
  {
    auto lease = store->Acquire("s");
    ASSERT_TRUE(lease.ok());
    const int64_t before = lease->state().ResidentBytes();
    Attach(lease->state());
    EXPECT_EQ(lease->state().ResidentBytes(), before);
  }
  // The stale host copy stays in the resident (host memory) tier; the device copy counts in the
  // device tier, once.
  EXPECT_EQ(store->Get("s")->bytes, host_info);
  EXPECT_EQ(store->Get("s")->device_bytes, kDeviceBytes);
  StoreStats stats = store->Stats();
  EXPECT_EQ(stats.bytes[static_cast<int>(Tier::kResident)], host_stats);
  EXPECT_EQ(stats.device_bytes, kDeviceBytes);
  EXPECT_EQ(stats.device_sessions, 1);
  EXPECT_EQ(store->Usage("").state_bytes, host_info);  // tenants: host bytes, on any backend
  {
    auto lease = store->Acquire("s");
    ASSERT_TRUE(lease.ok());
    ASSERT_TRUE(lease->state().SyncToHost().ok());
  }
  EXPECT_EQ(store->Get("s")->bytes, host_info);
  EXPECT_EQ(store->Get("s")->device_bytes, 0);
  stats = store->Stats();
  EXPECT_EQ(stats.bytes[static_cast<int>(Tier::kResident)], host_stats);
  EXPECT_EQ(stats.device_bytes, 0);
  EXPECT_EQ(stats.device_sessions, 0);
}

TEST_F(DeviceResidencyTest, DeletingOrExpiringASessionDestroysItsResidency) {
  auto store = OpenStore({});
  auto deleted = CreateOnDevice(*store, "deleted", prompt_, steps_);
  ASSERT_TRUE(store->Delete("deleted").ok());
  EXPECT_TRUE(deleted->destroyed);
  EXPECT_EQ(deleted->copies, 0);  // nothing is copied back for a session that is gone

  ASSERT_TRUE(store->Create("expiring", "", absl::Seconds(1)).ok());
  std::shared_ptr<Probe> expiring;
  {
    auto lease = store->Acquire("expiring");
    ASSERT_TRUE(lease.ok());
    expiring = Attach(lease->state());
  }
  EXPECT_EQ(store->ExpireIdle(absl::Now() + absl::Hours(1)), 1);
  EXPECT_TRUE(expiring->destroyed);
  EXPECT_EQ(expiring->copies, 0);
  EXPECT_EQ(store->Stats().bytes[static_cast<int>(Tier::kResident)], 0);
}

// ---- The step thread ----

TEST_F(DeviceResidencyTest, DeviceMovesRunOnTheStepThreadOnly) {
  testing::ScopedTempDir dir;
  auto control = Control(prompt_, steps_);
  auto store = OpenStore(dir.path());
  auto parked = CreateOnDevice(*store, "parked", prompt_, steps_);
  auto forked = CreateOnDevice(*store, "forked", prompt_, steps_);
  auto deleted = CreateOnDevice(*store, "deleted", prompt_, steps_);
  auto persisted = CreateOnDevice(*store, "persisted", prompt_, steps_);
  ASSERT_TRUE(store->Create("expiring", "", absl::Seconds(1)).ok());
  std::shared_ptr<Probe> expiring;
  {
    auto lease = store->Acquire("expiring");
    ASSERT_TRUE(lease.ok());
    expiring = Attach(lease->state());
  }
  FakeStepThread step(*store);
  ASSERT_NE(step.id(), std::this_thread::get_id());

  // Park and Fork wait for the copy, which the step thread makes.
  ASSERT_TRUE(store->Park("parked", Tier::kHost).ok());
  EXPECT_EQ(parked->copies, 1);
  EXPECT_EQ(parked->copy_thread, step.id());
  EXPECT_EQ(parked->destroy_thread, step.id());
  ASSERT_TRUE(store->Fork("forked", "fork2", "").ok());
  EXPECT_EQ(forked->copy_thread, step.id());

  // Delete and expiry return at once; the step thread frees the device memory at its next pass.
  ASSERT_TRUE(store->Delete("deleted").ok());
  EXPECT_EQ(store->ExpireIdle(absl::Now() + absl::Hours(1)), 1);
  step.Pass();
  EXPECT_TRUE(deleted->destroyed);
  EXPECT_EQ(deleted->destroy_thread, step.id());
  EXPECT_EQ(deleted->copies, 0);
  EXPECT_TRUE(expiring->destroyed);
  EXPECT_EQ(expiring->destroy_thread, step.id());

  // PersistAll (graceful shutdown) as well.
  ASSERT_TRUE(store->PersistAll().ok());
  EXPECT_EQ(persisted->copy_thread, step.id());

  for (const char* id : {"parked", "forked", "fork2", "persisted"}) {
    SCOPED_TRACE(id);
    auto lease = store->Acquire(id);
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_TRUE(SameContent(lease->state(), *control));
  }
}

// The step thread's wake belongs to its owner (the scheduler), which is destroyed once
// ClearStepThread returns: a wake another thread copied before the clear must have returned by
// then (it would otherwise run on a freed owner).
TEST_F(DeviceResidencyTest, ClearingTheStepThreadWaitsForAWakeUnderWay) {
  auto store = OpenStore({});
  auto deleted = CreateOnDevice(*store, "deleted", prompt_, steps_);
  absl::Notification registered, waking, release, clear, cleared;
  std::atomic<bool> wake_returned{false};
  std::atomic<bool> returned_before_the_wake{false};
  std::thread step([&] {
    store->SetStepThread([&] {
      waking.Notify();
      release.WaitForNotification();
      wake_returned = true;
    });
    registered.Notify();
    clear.WaitForNotification();
    store->ClearStepThread();
    returned_before_the_wake = !wake_returned.load();
    cleared.Notify();
  });
  registered.WaitForNotification();
  // Delete (another thread than the step thread) queues the device memory's release and wakes
  // the step thread: the wake blocks until released.
  std::thread deleter([&] { EXPECT_TRUE(store->Delete("deleted").ok()); });
  waking.WaitForNotification();
  clear.Notify();
  // The wake is released once the clear has returned, or after a second if it has not (it must
  // not: it waits for the wake). The outcome does not depend on the timing; only how surely a
  // clear that does not wait is caught does.
  cleared.WaitForNotificationWithTimeout(absl::Seconds(1));
  release.Notify();
  step.join();
  deleter.join();
  EXPECT_FALSE(returned_before_the_wake);
  EXPECT_TRUE(deleted->destroyed);  // by the clear's pass or, after it, by the deleter
}

TEST_F(DeviceResidencyTest, BudgetsAreEnforcedByTheStepThread) {
  auto control = Control(prompt_, steps_);
  // The device tier holds one session of two; the background worker notices, the step thread
  // copies back.
  auto store = OpenStore({}, kDeviceBytes + kDeviceBytes / 2, /*background=*/true);
  FakeStepThread step(*store);
  auto a = CreateOnDevice(*store, "a", prompt_, steps_);
  auto b = CreateOnDevice(*store, "b", prompt_, steps_);
  step.Pass();
  EXPECT_EQ(a->copies, 1);
  EXPECT_EQ(a->copy_thread, step.id());
  EXPECT_EQ(a->destroy_thread, step.id());
  EXPECT_EQ(b->copies, 0);
  EXPECT_EQ(store->Get("a")->device_bytes, 0);
  EXPECT_EQ(store->Stats().device_bytes, kDeviceBytes);
  auto lease = store->Acquire("a");
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE(SameContent(lease->state(), *control));
}

TEST_F(DeviceResidencyTest, ResidentBudgetParksThroughTheStepThread) {
  auto control = Control(prompt_, steps_);
  auto probe_store = OpenStore({});
  ASSERT_TRUE(probe_store->Create("p", "").ok());
  {
    auto lease = probe_store->Acquire("p");
    ASSERT_TRUE(engine_->Prefill(lease->state(), prompt_, false, nullptr).ok());
    HostDecode(lease->state(), steps_);
  }
  const int64_t one = probe_store->Stats().bytes[static_cast<int>(Tier::kResident)];
  SessionStoreOptions o;
  o.resident_budget_bytes = one + one / 2;  // host memory for one session, not two
  o.background = false;                     // parking runs inline in the releasing (test) thread...
  auto opened = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), o);
  ASSERT_TRUE(opened.ok()) << opened.status();
  auto store = *std::move(opened);
  FakeStepThread step(*store);
  auto a = CreateOnDevice(*store, "a", prompt_, steps_);
  auto b = CreateOnDevice(*store, "b", prompt_, steps_);
  // ... and waits for the step thread's copy of the device state before encoding it.
  EXPECT_EQ(store->Get("a")->tier, Tier::kHost);
  EXPECT_EQ(a->copy_thread, step.id());
  EXPECT_EQ(b->copies, 0);
  auto lease = store->Acquire("a");
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE(SameContent(lease->state(), *control));
}

TEST_F(DeviceResidencyTest, WithoutAStepThreadMovesRunInline) {
  auto store = OpenStore({});
  auto probe = CreateOnDevice(*store, "s", prompt_, steps_);
  ASSERT_TRUE(store->Park("s", Tier::kHost).ok());
  EXPECT_EQ(probe->copy_thread, std::this_thread::get_id());
  EXPECT_EQ(probe->destroy_thread, std::this_thread::get_id());
  // A step thread that came and went leaves the store inline again.
  { FakeStepThread step(*store); }
  auto again = CreateOnDevice(*store, "t", prompt_, steps_);
  ASSERT_TRUE(store->Delete("t").ok());
  EXPECT_TRUE(again->destroyed);
  EXPECT_EQ(again->destroy_thread, std::this_thread::get_id());
}

}  // namespace
}  // namespace sdm
