// SDM_CHECK: aborts with a message when a programming invariant is broken (never for bad input,
// which is reported through absl::Status). Always on, in every build type.
//
//   SDM_CHECK(row >= 0);
//   SDM_CHECK(rc == 0) << "pthread_create: " << rc;   // optional detail
//
// The failure is logged as a FATAL message through base/log.h ("check failed: <condition>" and
// the detail) before the process aborts; it stands in for absl/log/check.h, which Debian 12's
// Abseil predates. Host code only: device code (CUDA kernels) has no SDM_CHECK.
#ifndef SDMSERVE_BASE_CHECK_H_
#define SDMSERVE_BASE_CHECK_H_

#include "absl/base/optimization.h"
#include "base/log.h"

// The switch keeps `if (a) SDM_CHECK(b); else ...` binding the else to the caller's if.
#define SDM_CHECK(cond)            \
  switch (0)                       \
  case 0:                          \
  default:                         \
    if (ABSL_PREDICT_TRUE(cond)) { \
    } else /* NOLINT */            \
      SDM_LOG(FATAL) << "check failed: " #cond " "

#endif  // SDMSERVE_BASE_CHECK_H_
