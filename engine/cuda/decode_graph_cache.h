// The CUDA backend's decode-step graphs (engine/cuda/cuda_backend.cc): one instantiated graph per
// step shape, replayed instead of the step's few hundred launches. A graph bakes in every launch
// parameter of the step it was captured from, so a step may replay it only when everything the
// host passes to a launch is the same: the shape below, and the workspace's buffers (a grown
// workspace moves them: the backend then Clear()s the cache). What changes from step to step
// (tokens, positions, page and slot tables, sampling parameters) is read by the kernels from the
// step arrays, which the graph's first node copies from a pinned buffer at a fixed address.
//
// Header-only and free of CUDA: the backend instantiates it with its owner of a cudaGraphExec_t,
// the tests (tests/engine/decode_graph_cache_test.cc) with a stand-in that counts destructions.
// Not thread-safe: the backend uses it from Forward, which runs one pass at a time.
#ifndef SDMSERVE_ENGINE_CUDA_DECODE_GRAPH_CACHE_H_
#define SDMSERVE_ENGINE_CUDA_DECODE_GRAPH_CACHE_H_

#include <compare>
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <set>
#include <utility>

namespace sdm {

// What a decode step passes to its launches besides device pointers and the step arrays' content.
struct DecodeGraphKey {
  int64_t sessions = 0;    // rows of the step: one token per session
  int64_t logit_rows = 0;  // rows whose logits come back to the host
  int64_t draws = 0;       // rows whose next token is drawn on the device
  bool gathered = false;   // the logit rows are not simply rows 0 .. logit_rows + draws - 1
  int64_t visible = 0;     // decode attention's grid bound (kernels/common/attention_math.h,
                           // DecodeGraphVisible)

  auto operator<=>(const DecodeGraphKey&) const = default;
};

// Up to `capacity` graphs, the least recently used dropped first (destroying its Exec), and the
// keys whose capture failed (they run launch by launch; not captured again until Clear()).
template <typename Exec>
class DecodeGraphCache {
 public:
  explicit DecodeGraphCache(size_t capacity) : capacity_(capacity > 0 ? capacity : 1) {}

  // The graph for `key`, now the most recently used; null if there is none.
  Exec* Find(const DecodeGraphKey& key) {
    auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    entries_.splice(entries_.begin(), entries_, it->second);
    return &it->second->second;
  }

  // Adds the graph for `key` (which has none) as the most recently used, dropping the least
  // recently used beyond capacity. Returns where it is held (valid until it is dropped).
  Exec* Insert(const DecodeGraphKey& key, Exec exec) {
    entries_.emplace_front(key, std::move(exec));
    index_[key] = entries_.begin();
    while (entries_.size() > capacity_) {
      index_.erase(entries_.back().first);
      entries_.pop_back();
    }
    return &entries_.front().second;
  }

  bool Refused(const DecodeGraphKey& key) const { return refused_.contains(key); }
  void Refuse(const DecodeGraphKey& key) { refused_.insert(key); }

  // Drops every graph and every refusal.
  void Clear() {
    index_.clear();
    entries_.clear();
    refused_.clear();
  }

  size_t size() const { return entries_.size(); }

 private:
  size_t capacity_;
  std::list<std::pair<DecodeGraphKey, Exec>> entries_;  // most recently used first
  std::map<DecodeGraphKey, typename std::list<std::pair<DecodeGraphKey, Exec>>::iterator> index_;
  std::set<DecodeGraphKey> refused_;
};

}  // namespace sdm

#endif  // SDMSERVE_ENGINE_CUDA_DECODE_GRAPH_CACHE_H_
