// A temporary directory for tests, with no dependency beyond the standard library and GoogleTest
// (tests/engine/test_model_util.h re-exports it for the engine and store tests).
#ifndef SDMSERVE_TESTS_BASE_SCOPED_TEMP_DIR_H_
#define SDMSERVE_TESTS_BASE_SCOPED_TEMP_DIR_H_

#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "gtest/gtest.h"

namespace sdm::testing {

// A fresh directory under $TEST_TMPDIR (or /tmp), removed with its contents by the destructor.
class ScopedTempDir {
 public:
  ScopedTempDir() {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string pattern = std::string(base != nullptr ? base : "/tmp") + "/sdm_test_XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed";
    path_ = pattern;
  }
  ~ScopedTempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace sdm::testing

#endif  // SDMSERVE_TESTS_BASE_SCOPED_TEMP_DIR_H_
