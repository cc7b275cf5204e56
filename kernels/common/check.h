// SDM_CHECK: aborts with a message when a programming invariant is broken (never for bad input,
// which is reported through absl::Status). The Abseil of Debian 12 predates absl/log/check.h.
#ifndef SDMSERVE_KERNELS_COMMON_CHECK_H_
#define SDMSERVE_KERNELS_COMMON_CHECK_H_

#include <cstdio>
#include <cstdlib>

#define SDM_CHECK(cond)                                                             \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                 \
    }                                                                               \
  } while (0)

#endif  // SDMSERVE_KERNELS_COMMON_CHECK_H_
