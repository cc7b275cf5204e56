// The part of CUDA's cooperative_groups.h the kernels use (testing only): this_cluster() and the
// cluster_group's barrier, ranks and distributed shared memory, run by the dialect's scheduler
// (emu::Cluster* in emu_cuda_common.h).
#pragma once
#include "cuda_runtime.h"

namespace cooperative_groups {

class cluster_group {
 public:
  struct arrival_token {};

  // barrier.cluster.arrive then wait: every non-exited thread of the cluster arrives.
  static void sync() {
    emu::ClusterArrive();
    emu::ClusterWait();
  }
  static arrival_token barrier_arrive() {
    emu::ClusterArrive();
    return {};
  }
  static void barrier_wait() { emu::ClusterWait(); }
  static void barrier_wait(arrival_token&&) { emu::ClusterWait(); }
  // The same shared variable (or dynamic shared memory offset) in block `rank` of the cluster.
  template <typename T>
  static T* map_shared_rank(T* addr, int rank) {
    return static_cast<T*>(emu::MapSharedRank(addr, static_cast<unsigned>(rank)));
  }
  static unsigned query_shared_rank(const void* addr) { return emu::QuerySharedRank(addr); }
  static unsigned block_rank() { return emu::ClusterBlockRank(); }
  static dim3 block_index() { return emu::ClusterBlockIndex(); }
  static dim3 dim_blocks() { return emu::ClusterDim(); }
  static unsigned num_blocks() {
    const dim3 d = emu::ClusterDim();
    return d.x * d.y * d.z;
  }

 private:
  friend cluster_group this_cluster();
  cluster_group() = default;
};

inline cluster_group this_cluster() { return cluster_group(); }

}  // namespace cooperative_groups
