#include "server/cluster/etcd_ownership.h"

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
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

}  // namespace

EtcdOwnership::EtcdOwnership(PassKey, const EtcdOwnershipOptions& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<EtcdOwnership>> EtcdOwnership::Start(
    const EtcdOwnershipOptions& options) {
  if (options.replica_id.empty()) return absl::InvalidArgumentError("the replica id is empty");
  auto self = std::make_unique<EtcdOwnership>(PassKey{}, options);
  if (absl::Status s = self->Grant(); !s.ok()) return s;
  self->keepalive_ = std::thread([p = self.get()] { p->KeepAliveLoop(); });
  return self;
}

EtcdOwnership::~EtcdOwnership() {
  int64_t lease = 0;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    lease = lease_;
  }
  if (keepalive_.joinable()) keepalive_.join();
  if (lease != 0) {
    Post("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}.dump()).IgnoreError();
  }
}

int64_t EtcdOwnership::lease_id() const {
  absl::MutexLock lock(&mu_);
  return lease_;
}

std::string EtcdOwnership::KeyOf(const SessionKey& key) const {
  return options_.prefix + SessionRecordId(key);
}

absl::StatusOr<std::string> EtcdOwnership::Post(const std::string& path,
                                                const std::string& body) const {
  httplib::Client client(options_.endpoint);
  const auto timeout = absl::ToChronoMicroseconds(options_.request_timeout);
  client.set_connection_timeout(timeout);
  client.set_read_timeout(timeout);
  client.set_write_timeout(timeout);
  httplib::Result r = client.Post(path, body, "application/json");
  if (!r) {
    return absl::UnavailableError(absl::StrCat("etcd at ", options_.endpoint, " unreachable (",
                                               httplib::to_string(r.error()), ")"));
  }
  if (r->status != 200) {
    return absl::UnavailableError(
        absl::StrCat("etcd ", path, " answered ", r->status, ": ", r->body.substr(0, 200)));
  }
  return r->body;
}

absl::Status EtcdOwnership::Grant() {
  auto body =
      Post("/v3/lease/grant", json{{"TTL", absl::ToInt64Seconds(options_.lease_ttl)}}.dump());
  if (!body.ok()) return body.status();
  const json answer = json::parse(*body, nullptr, false);
  const int64_t id = answer.is_object() ? Int(answer, "ID") : 0;
  if (id == 0) return absl::UnavailableError(absl::StrCat("etcd granted no lease: ", *body));
  absl::MutexLock lock(&mu_);
  lease_ = id;
  owned_.clear();  // keys of an earlier lease are gone with it
  return absl::OkStatus();
}

void EtcdOwnership::KeepAliveLoop() {
  const absl::Duration period = options_.lease_ttl / 3;
  while (true) {
    int64_t lease = 0;
    {
      absl::MutexLock lock(&mu_);
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      mu_.AwaitWithTimeout(absl::Condition(&stopping), period);
      if (stop_) return;
      lease = lease_;
    }
    auto body = Post("/v3/lease/keepalive", json{{"ID", std::to_string(lease)}}.dump());
    if (!body.ok()) {
      SDM_LOG(WARNING) << "sdm ownership: lease keepalive failed: " << body.status();
      continue;
    }
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
  const std::string k = B64(KeyOf(key));
  const std::string me = B64(options_.replica_id);
  int64_t lease = 0;
  {
    absl::MutexLock lock(&mu_);
    lease = lease_;
  }
  const json txn = {
      {"compare",
       json::array(
           {{{"key", k}, {"target", "CREATE"}, {"create_revision", "0"}, {"result", "EQUAL"}}})},
      {"success", json::array({{{"request_put",
                                 {{"key", k}, {"value", me}, {"lease", std::to_string(lease)}}}}})},
      {"failure", json::array({{{"request_range", {{"key", k}}}}})}};
  auto body = Post("/v3/kv/txn", txn.dump());
  if (!body.ok()) return body.status();
  const json answer = json::parse(*body, nullptr, false);
  if (!answer.is_object()) return absl::UnavailableError("etcd: unreadable answer");
  int64_t revision = 0;
  if (answer.value("succeeded", false)) {
    revision = Int(answer["header"], "revision");  // the put's
  } else {
    const json& responses = answer["responses"];
    if (!responses.is_array() || responses.empty()) {
      return absl::UnavailableError("etcd: no answer to the range");
    }
    const json& kvs = responses[0]["response_range"]["kvs"];
    if (!kvs.is_array() || kvs.empty()) {
      return absl::UnavailableError("session ownership changed meanwhile; retry");
    }
    const json& kv = kvs[0];
    if (kv.value("value", "") != me || Int(kv, "lease") != lease) {
      std::string owner;
      absl::Base64Unescape(kv.value("value", ""), &owner);
      return absl::UnavailableError(absl::StrCat("session '", key.id, "' is served by replica '",
                                                 owner,
                                                 "'; retry (it moves when that one releases it)"));
    }
    revision = Int(kv, "mod_revision");
  }
  absl::MutexLock lock(&mu_);
  if (lease_ != lease) return absl::UnavailableError("the replica's lease changed; retry");
  owned_[KeyOf(key)] = revision;
  return absl::OkStatus();
}

absl::Status EtcdOwnership::CheckWrite(const SessionKey& key) {
  const std::string name = KeyOf(key);
  int64_t revision = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = owned_.find(name);
    if (it == owned_.end()) {
      return absl::FailedPreconditionError("this replica has not claimed the session");
    }
    revision = it->second;
  }
  const std::string k = B64(name);
  const json txn = {{"compare", json::array({{{"key", k},
                                              {"target", "MOD"},
                                              {"mod_revision", std::to_string(revision)},
                                              {"result", "EQUAL"}}})}};
  auto body = Post("/v3/kv/txn", txn.dump());
  if (!body.ok()) return body.status();
  const json answer = json::parse(*body, nullptr, false);
  if (answer.is_object() && answer.value("succeeded", false)) return absl::OkStatus();
  {
    absl::MutexLock lock(&mu_);
    owned_.erase(name);
  }
  return absl::FailedPreconditionError(
      absl::StrCat("ownership lost (its etcd key no longer has mod revision ", revision, ")"));
}

void EtcdOwnership::Release(const SessionKey& key) {
  const std::string name = KeyOf(key);
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
    SDM_LOG(WARNING) << "sdm ownership: release of '" << key.id << "': " << body.status();
  }
}

}  // namespace sdm
