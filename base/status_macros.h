// The one set of status-propagation macros of the project.
//
//   SDM_RETURN_IF_ERROR(store.Put(key, state));            // returns the error, if any
//   SDM_ASSIGN_OR_RETURN(std::vector<int> ids, tokenizer.Encode(text));
//   SDM_ASSIGN_OR_RETURN(auto model, Model::Load(dir));
//
// SDM_RETURN_IF_ERROR(expr) returns expr's value from the enclosing function unless it is a
// success. It works for any error type that sdm::base_internal::IsOk accepts: absl::Status (or
// anything else with an ok() member) here, and cudaError_t through the overload in
// kernels/cuda/cuda_util.h (for the kernels' cudaError_t-returning launch functions). A CUDA call
// inside a function that returns absl::Status goes through a conversion function first:
// SDM_RETURN_IF_ERROR(CudaStatus(cudaMemcpy(...), "what")) (engine/cuda/device_state.h).
//
// SDM_ASSIGN_OR_RETURN(lhs, expr) evaluates expr (an absl::StatusOr<T>), returns its status from
// the enclosing function unless it is OK, and otherwise move-assigns its value to lhs, which may
// be a declaration. lhs must not contain unparenthesised commas.
//
// This header includes no Abseil, so CUDA translation units can use it.
#ifndef SDMSERVE_BASE_STATUS_MACROS_H_
#define SDMSERVE_BASE_STATUS_MACROS_H_

#include <utility>

namespace sdm::base_internal {

template <typename StatusLike>
constexpr bool IsOk(const StatusLike& status) {
  return status.ok();
}

}  // namespace sdm::base_internal

#define SDM_RETURN_IF_ERROR(expr)                                              \
  do {                                                                         \
    if (auto sdm_status_ = (expr); !::sdm::base_internal::IsOk(sdm_status_)) { \
      return sdm_status_;                                                      \
    }                                                                          \
  } while (0)

#define SDM_ASSIGN_OR_RETURN(lhs, expr) \
  SDM_ASSIGN_OR_RETURN_IMPL_(SDM_STATUS_MACROS_CONCAT_(sdm_status_or_, __LINE__), lhs, expr)

#define SDM_ASSIGN_OR_RETURN_IMPL_(var, lhs, expr) \
  auto var = (expr);                               \
  if (!var.ok()) return std::move(var).status();   \
  lhs = *std::move(var)

#define SDM_STATUS_MACROS_CONCAT_INNER_(a, b) a##b
#define SDM_STATUS_MACROS_CONCAT_(a, b) SDM_STATUS_MACROS_CONCAT_INNER_(a, b)

#endif  // SDMSERVE_BASE_STATUS_MACROS_H_
