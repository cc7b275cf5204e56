// What every fuzzer (tests/fuzz/*_fuzzer.cc) shares: an allocation counter (the sanitizer
// allocator's malloc hook), a loud failure, the --write-seeds flag and seed files.
#ifndef SDMSERVE_TESTS_FUZZ_FUZZ_UTIL_H_
#define SDMSERVE_TESTS_FUZZ_FUZZ_UTIL_H_

#include <sanitizer/allocator_interface.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace sdm::fuzz {

// Bytes malloc'd while `counting` (the code under test runs single-threaded inside the fuzzer).
inline bool counting = false;
inline size_t allocated = 0;
inline void OnMalloc(const volatile void*, size_t bytes) {
  if (counting) allocated += bytes;
}
inline void OnFree(const volatile void*) {}
inline constexpr size_t kAllocationSlack = size_t{1} << 20;
inline constexpr size_t kAllocationPerBlobByte = 8;

[[noreturn]] inline void Fail(const char* what) {
  std::fprintf(stderr, "fuzzer: property violated: %s\n", what);
  std::abort();
}

// Counts the bytes allocated by `f()` (which must not start threads that allocate).
template <typename F>
size_t CountAllocations(F&& f) {
  allocated = 0;
  counting = true;
  f();
  counting = false;
  return allocated;
}

// A fuzzer's LLVMFuzzerInitialize: installs the allocation counter; with --write-seeds=DIR,
// writes the seed corpus there and exits with write_seeds' status.
inline int InitializeFuzzer(int* argc, char*** argv,
                            int (*write_seeds)(const std::filesystem::path& dir)) {
  __sanitizer_install_malloc_and_free_hooks(OnMalloc, OnFree);
  constexpr std::string_view kFlag = "--write-seeds=";
  for (int i = 1; i < *argc; ++i) {
    const std::string_view arg = (*argv)[i];
    if (arg.substr(0, kFlag.size()) == kFlag) std::exit(write_seeds(arg.substr(kFlag.size())));
  }
  return 0;
}

// Writes seed files dir/seed_0, seed_1, ... (the directory is created by the first).
class SeedWriter {
 public:
  explicit SeedWriter(std::filesystem::path dir) : dir_(std::move(dir)) {
    std::filesystem::create_directories(dir_);
  }
  // False when the file could not be written.
  bool Add(const std::string& bytes) {
    std::ofstream out(dir_ / ("seed_" + std::to_string(n_++)), std::ios::binary);
    out << bytes;
    ok_ = ok_ && static_cast<bool>(out);
    return static_cast<bool>(out);
  }
  // 0, or 1 when a seed could not be written; prints how many were written.
  int Finish() const {
    std::printf("wrote %d seeds to %s\n", n_, dir_.c_str());
    return ok_ ? 0 : 1;
  }

 private:
  std::filesystem::path dir_;
  int n_ = 0;
  bool ok_ = true;
};

}  // namespace sdm::fuzz

#endif  // SDMSERVE_TESTS_FUZZ_FUZZ_UTIL_H_
