#include "server/cluster/etcd_ownership.h"

#include <algorithm>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/thread_name.h"
#include "nlohmann/json.hpp"
#include "server/grpc_status.h"
#include "state_store/session_key.h"

namespace sdm {
namespace {

using nlohmann::json;

std::string B64(const std::string& s) { return absl::Base64Escape(s); }

// etcd's gateway writes int64 fields as JSON strings, and leaves out zero values.
int64_t Int(const json& j, const char* field) {
  if (!j.contains(field)) return 0;
  const json& v = j[field];
  if (v.is_number_integer()) return v.get<int64_t>();
  int64_t out = 0;
  if (v.is_string() && absl::SimpleAtoi(v.get<std::string>(), &out)) return out;
  return 0;
}

// j[k1][k2]..., or null when a step is missing: the gateway leaves out empty fields (a range that
// found nothing has no "kvs"), and a const json's operator[] must never be given a missing key.
const json& At(const json& j, std::initializer_list<const char*> path) {
  static const json* const kNull = new json();
  const json* at = &j;
  for (const char* key : path) {
    if (!at->is_object()) return *kNull;
    auto it = at->find(key);
    if (it == at->end()) return *kNull;
    at = &*it;
  }
  return *at;
}

// The value of the one key a range response holds, unescaped; "" when it holds none.
std::string RangeValue(const json& response) {
  const json& kvs = At(response, {"response_range", "kvs"});
  if (!kvs.is_array() || kvs.empty()) return "";
  std::string out;
  absl::Base64Unescape(kvs[0].value("value", ""), &out);
  return out;
}

}  // namespace

EtcdOwnership::EtcdOwnership(PassKey, const EtcdOwnershipOptions& options) : options_(options) {}

absl::Status ValidateEtcdKeyPrefix(const std::string& prefix) {
  if (prefix.size() < 2 || prefix.front() != '/' || prefix.back() != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "the etcd key prefix must start and end with '/' (e.g. /sdmserve/), got '", prefix, "'"));
  }
  return absl::OkStatus();
}

absl::Status ValidateEtcdLeaseTtl(absl::Duration ttl) {
  if (ttl < absl::Seconds(2) || ttl % absl::Seconds(1) != absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the etcd lease TTL must be whole seconds, at least 2s, got ", absl::FormatDuration(ttl)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<EtcdOwnership>> EtcdOwnership::Start(
    const EtcdOwnershipOptions& options) {
  if (options.replica_id.empty()) return absl::InvalidArgumentError("the replica id is empty");
  if (absl::Status s = ValidateEtcdKeyPrefix(options.key_prefix); !s.ok()) return s;
  if (absl::Status s = ValidateEtcdLeaseTtl(options.lease_ttl); !s.ok()) return s;
  auto etcd = EtcdClient::Create(options.client);
  if (!etcd.ok()) return etcd.status();
  auto self = std::make_unique<EtcdOwnership>(PassKey{}, options);
  self->etcd_ = *std::move(etcd);
  if (absl::Status s = self->Grant(); !s.ok()) return s;
  self->keepalive_ = std::thread([p = self.get()] { p->KeepAliveLoop(); });
  self->handoff_ = std::thread([p = self.get()] { p->HandoffLoop(); });
  return self;
}

EtcdOwnership::~EtcdOwnership() { Stop(); }

void EtcdOwnership::Stop() {
  SetHandoffHandler(nullptr);
  int64_t lease = 0;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    stop_ = true;
    lease = lease_;
  }
  if (keepalive_.joinable()) keepalive_.join();
  if (handoff_.joinable()) handoff_.join();
  if (lease != 0) {
    Post("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}.dump()).IgnoreError();
  }
  absl::MutexLock lock(&mu_);
  owned_.clear();
}

void EtcdOwnership::SetHandoffHandler(std::function<absl::Status(const SessionKey&)> park) {
  absl::MutexLock lock(&handler_mu_);
  handler_ = std::move(park);
}

int64_t EtcdOwnership::handoffs() const {
  absl::MutexLock lock(&mu_);
  return handoffs_;
}

void EtcdOwnership::HandoffLoop() {
  SetCurrentThreadName("sdm-handoff");
  const std::string prefix = HandoffPrefix();
  std::string end = prefix;
  end.back() = static_cast<char>(end.back() + 1);  // the range of every key under the prefix
  const std::string range = json{{"key", B64(prefix)}, {"range_end", B64(end)}}.dump();
  std::vector<std::string> unsure;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      mu_.AwaitWithTimeout(absl::Condition(&stopping), options_.handoff_poll);
      if (stop_) return;
      unsure = std::vector<std::string>(unsure_.begin(), unsure_.end());
      if (owned_.empty() && unsure.empty()) continue;  // nothing to hand over: no need to look
    }
    for (const std::string& name : unsure) SettleUnsure(name);
    {
      absl::MutexLock lock(&mu_);
      if (owned_.empty()) continue;
    }
    auto body = Post("/v3/kv/range", range);
    if (!body.ok()) continue;  // the keepalive logs an unreachable etcd
    const json answer = json::parse(*body, nullptr, false);
    const json& kvs = At(answer, {"kvs"});
    if (!kvs.is_array()) continue;
    for (const json& kv : kvs) {
      std::string name, requester;
      absl::Base64Unescape(kv.value("key", ""), &name);
      absl::Base64Unescape(kv.value("value", ""), &requester);
      if (requester == options_.replica_id || name.size() <= prefix.size()) continue;
      absl::StatusOr<SessionKey> key = ParseSessionRecordId(name.substr(prefix.size()));
      if (!key.ok()) continue;
      {
        absl::MutexLock lock(&mu_);
        if (!owned_.contains(KeyOf(*key))) continue;
      }
      absl::MutexLock lock(&handler_mu_);
      if (!handler_) continue;
      // NOT_FOUND: claimed but not held (a failed create, or one not done yet); the handler
      // released it (through the store, which a create under way then claims again after).
      const absl::Status parked = handler_(*key);
      if (parked.ok()) {
        SDM_LOG(INFO) << "sdm ownership: handed session '" << key->id << "' over (asked by '"
                      << requester << "')";
        absl::MutexLock counted(&mu_);
        ++handoffs_;
      } else if (!absl::IsAborted(parked) && !absl::IsNotFound(parked)) {  // in use: next poll
        SDM_LOG(WARNING) << "sdm ownership: could not hand session '" << key->id
                         << "' over: " << parked;
      }
    }
  }
}

int64_t EtcdOwnership::lease_id() const {
  absl::MutexLock lock(&mu_);
  return lease_;
}

std::string EtcdOwnership::KeyOf(const SessionKey& key) const {
  return options_.key_prefix + "sessions/" + SessionRecordId(key);
}

std::string EtcdOwnership::HandoffPrefix() const { return options_.key_prefix + "handoff/"; }

std::string EtcdOwnership::SnapshotKeyOf(const SessionKey& key) const {
  return options_.key_prefix + "snapshots/" + SessionRecordId(key);
}

class EtcdOwnership::BusyKey {
 public:
  BusyKey(EtcdOwnership* owner, std::string name) : owner_(owner), name_(std::move(name)) {
    absl::MutexLock lock(&owner_->mu_);
    auto free = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(owner_->mu_) {
      return !owner_->busy_keys_.contains(name_);
    };
    owner_->mu_.Await(absl::Condition(&free));
    owner_->busy_keys_.insert(name_);
  }
  ~BusyKey() {
    absl::MutexLock lock(&owner_->mu_);
    owner_->busy_keys_.erase(name_);
  }
  BusyKey(const BusyKey&) = delete;
  BusyKey& operator=(const BusyKey&) = delete;

 private:
  EtcdOwnership* const owner_;
  const std::string name_;
};

absl::StatusOr<std::string> EtcdOwnership::Post(const std::string& path, const std::string& body,
                                                bool* unanswered) const {
  return etcd_->Post(path, body, unanswered);
}

std::string EtcdOwnership::endpoints() const { return etcd_->Describe(); }

int64_t EtcdOwnership::authentications() const { return etcd_->authentications(); }

absl::Status EtcdOwnership::Grant() {
  auto body =
      Post("/v3/lease/grant", json{{"TTL", absl::ToInt64Seconds(options_.lease_ttl)}}.dump());
  if (!body.ok()) return body.status();
  const json answer = json::parse(*body, nullptr, false);
  const int64_t id = answer.is_object() ? Int(answer, "ID") : 0;
  if (id == 0) return absl::UnavailableError(absl::StrCat("etcd granted no lease: ", *body));
  absl::MutexLock lock(&mu_);
  lease_ = id;
  // Keys of an earlier lease are gone with it (testing_keep_stale_claims: etcd says so instead).
  if (!options_.testing_keep_stale_claims) owned_.clear();
  unsure_.clear();
  return absl::OkStatus();
}

void EtcdOwnership::KeepAliveLoop() {
  SetCurrentThreadName("sdm-etcd-lease");
  const absl::Duration period = options_.lease_ttl / 3;
  absl::Duration wait = period;
  while (true) {
    int64_t lease = 0;
    {
      absl::MutexLock lock(&mu_);
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      mu_.AwaitWithTimeout(absl::Condition(&stopping), wait);
      if (stop_) return;
      lease = lease_;
    }
    auto body = Post("/v3/lease/keepalive", json{{"ID", std::to_string(lease)}}.dump());
    if (!body.ok()) {
      SDM_LOG(WARNING) << "sdm ownership: lease keepalive failed: " << body.status();
      wait = std::min(period, options_.keepalive_retry);
      continue;
    }
    wait = period;
    const json answer = json::parse(*body, nullptr, false);
    const bool alive =
        answer.is_object() && answer.contains("result") && Int(answer["result"], "TTL") > 0;
    if (!alive) {
      // Expired (this process was paused or cut off longer than the TTL): every session it
      // owned may be another replica's now. A new lease; sessions are claimed afresh.
      SDM_LOG(ERROR) << "sdm ownership: lease " << lease << " expired; granting a new one";
      if (absl::Status s = Grant(); !s.ok()) {
        SDM_LOG(ERROR) << "sdm ownership: " << s;
      }
    }
  }
}

absl::Status EtcdOwnership::Claim(const SessionKey& key) {
  bool elsewhere = false;
  absl::Status claimed = TryClaim(key, &elsewhere);
  if (!elsewhere || options_.handoff_wait <= absl::ZeroDuration()) {
    return absl::IsUnavailable(claimed) ? WithRetryAfter(claimed, absl::Seconds(1)) : claimed;
  }
  // Ask the owner to hand it over (a request bound to this replica's lease), and wait for it.
  const std::string request = B64(HandoffPrefix() + SessionRecordId(key));
  int64_t lease = 0;
  {
    absl::MutexLock lock(&mu_);
    lease = lease_;
  }
  Post("/v3/kv/put",
       json{{"key", request}, {"value", B64(options_.replica_id)}, {"lease", std::to_string(lease)}}
           .dump())
      .IgnoreError();
  const absl::Time deadline = absl::Now() + options_.handoff_wait;
  while (elsewhere && absl::Now() < deadline) {
    {
      absl::MutexLock lock(&mu_);
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping), absl::Milliseconds(50))) break;
    }
    elsewhere = false;
    claimed = TryClaim(key, &elsewhere);
  }
  Post("/v3/kv/deleterange", json{{"key", request}}.dump()).IgnoreError();
  return absl::IsUnavailable(claimed) ? WithRetryAfter(claimed, absl::Seconds(1)) : claimed;
}

absl::Status EtcdOwnership::TryClaim(const SessionKey& key, bool* elsewhere) {
  const std::string name = KeyOf(key);
  BusyKey busy(this, name);
  const std::string k = B64(name);
  const std::string snapshot = B64(SnapshotKeyOf(key));
  const std::string me = B64(options_.replica_id);
  int64_t lease = 0;
  {
    absl::MutexLock lock(&mu_);
    lease = lease_;
  }
  // Both branches read the committed snapshot's name too (what the store reads the session from).
  const json txn = {
      {"compare",
       json::array(
           {{{"key", k}, {"target", "CREATE"}, {"create_revision", "0"}, {"result", "EQUAL"}}})},
      {"success", json::array({{{"request_put",
                                 {{"key", k}, {"value", me}, {"lease", std::to_string(lease)}}}},
                               {{"request_range", {{"key", snapshot}}}}})},
      {"failure",
       json::array({{{"request_range", {{"key", k}}}}, {{"request_range", {{"key", snapshot}}}}})}};
  auto body = Post("/v3/kv/txn", txn.dump());
  const json answer = body.ok() ? json::parse(*body, nullptr, false) : json();
  const json& responses = At(answer, {"responses"});
  if (!body.ok() || !answer.is_object() || !responses.is_array() || responses.size() != 2) {
    // Applied or not: the key may be this replica's now (settled by the handoff thread).
    absl::MutexLock lock(&mu_);
    if (!owned_.contains(name)) unsure_.insert(name);
    if (!body.ok()) return body.status();
    return absl::UnavailableError("etcd: unreadable answer to a claim");
  }
  {
    absl::MutexLock lock(&mu_);
    committed_[KeyOf(key)] = RangeValue(responses[1]);
  }
  int64_t revision = 0;
  if (answer.value("succeeded", false)) {
    revision = Int(At(answer, {"header"}), "revision");  // the put's
  } else {
    const json& kvs = At(responses[0], {"response_range", "kvs"});
    if (!kvs.is_array() || kvs.empty()) {
      return absl::UnavailableError("session ownership changed meanwhile; retry");
    }
    const json& kv = kvs[0];
    if (kv.value("value", "") != me || Int(kv, "lease") != lease) {
      *elsewhere = true;
      std::string owner;
      absl::Base64Unescape(kv.value("value", ""), &owner);
      return absl::UnavailableError(absl::StrCat("session '", key.id, "' is served by replica '",
                                                 owner, "'; retry (it is being handed over)"));
    }
    revision = Int(kv, "mod_revision");
  }
  absl::MutexLock lock(&mu_);
  if (lease_ != lease) return absl::UnavailableError("the replica's lease changed; retry");
  owned_[name] = revision;
  unsure_.erase(name);
  return absl::OkStatus();
}

absl::Status EtcdOwnership::CheckWrite(const SessionKey& key) {
  const int64_t revision = ClaimEpoch(key);
  if (revision == 0)
    return absl::FailedPreconditionError("this replica has not claimed the session");
  return VerifyClaim(key, revision);
}

int64_t EtcdOwnership::ClaimEpoch(const SessionKey& key) const {
  absl::MutexLock lock(&mu_);
  auto it = owned_.find(KeyOf(key));
  return it == owned_.end() ? 0 : it->second;
}

absl::Status EtcdOwnership::VerifyClaim(const SessionKey& key, int64_t revision) {
  if (revision == 0) return absl::FailedPreconditionError("no claim");
  const std::string name = KeyOf(key);
  const std::string k = B64(name);
  const json txn = {{"compare", json::array({{{"key", k},
                                              {"target", "MOD"},
                                              {"mod_revision", std::to_string(revision)},
                                              {"result", "EQUAL"}}})}};
  auto body = Post("/v3/kv/txn", txn.dump());
  if (!body.ok()) return body.status();
  const json answer = json::parse(*body, nullptr, false);
  if (!answer.is_object()) return absl::UnavailableError("etcd: unreadable answer");
  if (answer.value("succeeded", false)) return absl::OkStatus();
  {
    absl::MutexLock lock(&mu_);
    if (auto it = owned_.find(name); it != owned_.end() && it->second == revision) owned_.erase(it);
  }
  return absl::FailedPreconditionError(
      absl::StrCat("ownership lost (its etcd key no longer has mod revision ", revision, ")"));
}

void EtcdOwnership::Release(const SessionKey& key) {
  const std::string name = KeyOf(key);
  BusyKey busy(this, name);
  int64_t revision = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = owned_.find(name);
    if (it == owned_.end()) return;
    revision = it->second;
    owned_.erase(it);
  }
  const std::string k = B64(name);
  const json txn = {{"compare", json::array({{{"key", k},
                                              {"target", "MOD"},
                                              {"mod_revision", std::to_string(revision)},
                                              {"result", "EQUAL"}}})},
                    {"success", json::array({{{"request_delete_range", {{"key", k}}}}})}};
  if (auto body = Post("/v3/kv/txn", txn.dump()); !body.ok()) {
    SDM_LOG(WARNING) << "sdm ownership: release of '" << key.id << "': " << body.status()
                     << " (retried by the handoff thread)";
    absl::MutexLock lock(&mu_);
    unsure_.insert(name);
  }
}

void EtcdOwnership::SettleUnsure(const std::string& name) {
  BusyKey busy(this, name);
  int64_t lease = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!unsure_.contains(name)) return;
    if (owned_.contains(name)) {  // claimed here since: it is this replica's, knowingly
      unsure_.erase(name);
      return;
    }
    lease = lease_;
  }
  const std::string k = B64(name);
  auto body = Post("/v3/kv/range", json{{"key", k}}.dump());
  if (!body.ok()) return;  // the next poll asks again
  const json answer = json::parse(*body, nullptr, false);
  if (!answer.is_object()) return;
  const json& kvs = At(answer, {"kvs"});
  if (kvs.is_array() && !kvs.empty() && kvs[0].value("value", "") == B64(options_.replica_id) &&
      Int(kvs[0], "lease") == lease) {
    // This replica's, unknowingly: released, unless it changed since it was read.
    const json txn = {
        {"compare", json::array({{{"key", k},
                                  {"target", "MOD"},
                                  {"mod_revision", std::to_string(Int(kvs[0], "mod_revision"))},
                                  {"result", "EQUAL"}}})},
        {"success", json::array({{{"request_delete_range", {{"key", k}}}}})}};
    if (!Post("/v3/kv/txn", txn.dump()).ok()) return;
    SDM_LOG(INFO) << "sdm ownership: released '" << name
                  << "', which an unanswered claim or release had left to this replica";
  }
  absl::MutexLock lock(&mu_);
  unsure_.erase(name);
}

absl::StatusOr<std::string> EtcdOwnership::Observe(const SessionKey& key) {
  auto body = Post("/v3/kv/range", json{{"key", B64(SnapshotKeyOf(key))}}.dump());
  if (!body.ok()) return body.status();
  const json answer = json::parse(*body, nullptr, false);
  if (!answer.is_object()) return absl::UnavailableError("etcd: unreadable answer");
  const std::string name = RangeValue(json{{"response_range", answer}});
  absl::MutexLock lock(&mu_);
  committed_[KeyOf(key)] = name;
  return name;
}

std::optional<std::string> EtcdOwnership::Committed(const SessionKey& key) const {
  absl::MutexLock lock(&mu_);
  auto it = committed_.find(KeyOf(key));
  if (it == committed_.end()) return std::nullopt;
  return it->second;
}

absl::Status EtcdOwnership::CommitSnapshot(const SessionKey& key, int64_t claim,
                                           const std::string& base, const std::string& file) {
  if (file.empty()) return absl::InvalidArgumentError("no file name to commit");
  if (claim == 0) {
    return absl::FailedPreconditionError(
        "this replica did not hold a claim on the session when it wrote the snapshot (never "
        "claimed, or its lease expired)");
  }
  return FencedUpdate(key, claim, base, file);
}

absl::Status EtcdOwnership::DeleteCommitted(const SessionKey& key, const std::string& base) {
  return FencedUpdate(key, 0, base, std::nullopt);
}

absl::Status EtcdOwnership::FencedUpdate(const SessionKey& key, int64_t claim,
                                         const std::string& base,
                                         const std::optional<std::string>& put) {
  const std::string name = KeyOf(key);
  int64_t revision = claim;
  if (revision == 0) {
    absl::MutexLock lock(&mu_);
    auto it = owned_.find(name);
    if (it == owned_.end()) {
      return absl::FailedPreconditionError(
          "this replica does not hold a claim on the session (never claimed, or its lease "
          "expired)");
    }
    revision = it->second;
  }
  const std::string k = B64(name);
  const std::string snapshot = B64(SnapshotKeyOf(key));
  json base_compare =
      base.empty()
          ? json{{"key", snapshot},
                 {"target", "CREATE"},
                 {"create_revision", "0"},
                 {"result", "EQUAL"}}
          : json{{"key", snapshot}, {"target", "VALUE"}, {"value", B64(base)}, {"result", "EQUAL"}};
  const json request = put.has_value()
                           ? json{{"request_put", {{"key", snapshot}, {"value", B64(*put)}}}}
                           : json{{"request_delete_range", {{"key", snapshot}}}};
  const json txn = {{"compare", json::array({{{"key", k},
                                              {"target", "MOD"},
                                              {"mod_revision", std::to_string(revision)},
                                              {"result", "EQUAL"}},
                                             base_compare})},
                    {"success", json::array({request})},
                    {"failure", json::array({{{"request_range", {{"key", k}}}},
                                             {{"request_range", {{"key", snapshot}}}}})}};
  const std::string wanted = put.value_or("");
  bool unanswered = false;  // an attempt on an endpoint that did not answer may have applied it
  auto body = Post("/v3/kv/txn", txn.dump(), &unanswered);
  if (!body.ok()) {
    // Unknown whether etcd applied it: look (the same answer twice is settled).
    absl::StatusOr<std::string> now = Observe(key);
    if (now.ok() && *now == wanted && wanted != base) return absl::OkStatus();
    return absl::UnavailableError(
        absl::StrCat("the commit of session '", key.id, "' is unknown: ", body.status().message()));
  }
  const json answer = json::parse(*body, nullptr, false);
  if (!answer.is_object()) return absl::UnavailableError("etcd: unreadable answer");
  if (answer.value("succeeded", false)) {
    absl::MutexLock lock(&mu_);
    committed_[name] = wanted;
    return absl::OkStatus();
  }
  const json& responses = At(answer, {"responses"});
  std::string owner = "nobody";
  std::string committed;
  bool still_ours = false;
  if (responses.is_array() && responses.size() == 2) {
    const json& kvs = At(responses[0], {"response_range", "kvs"});
    if (kvs.is_array() && !kvs.empty()) {
      absl::Base64Unescape(kvs[0].value("value", ""), &owner);
      still_ours = Int(kvs[0], "mod_revision") == revision;
    }
    committed = RangeValue(responses[1]);
  }
  if (unanswered && committed == wanted && wanted != base) {
    // Refused because an earlier copy of this request, sent to an endpoint that did not answer,
    // was applied: the name is this request's (names are never reused). It is committed even if
    // the claim has ended since (the lease expired between the two copies): answered
    // FAILED_PRECONDITION ("never becomes the state"), the store would remove the committed file.
    absl::MutexLock lock(&mu_);
    committed_[name] = wanted;
    if (auto it = owned_.find(name); !still_ours && it != owned_.end() && it->second == revision) {
      owned_.erase(it);
    }
    return absl::OkStatus();
  }
  {
    absl::MutexLock lock(&mu_);
    committed_[name] = committed;
    if (auto it = owned_.find(name); !still_ours && it != owned_.end() && it->second == revision) {
      owned_.erase(it);
    }
  }
  if (!still_ours) {
    return absl::FailedPreconditionError(
        absl::StrCat("etcd refused the transaction: ownership lost, its etcd key no longer has "
                     "this replica's claim (mod revision ",
                     revision, "; owner now: ", owner, ")"));
  }
  return absl::FailedPreconditionError(
      absl::StrCat("etcd refused the transaction: this copy derives from snapshot '",
                   base.empty() ? "(none)" : base, "' but the committed one is '",
                   committed.empty() ? "(none)" : committed, "'"));
}

}  // namespace sdm
