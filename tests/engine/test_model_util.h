// Helpers shared by the engine tests: temporary directories (tests/base/scoped_temp_dir.h),
// crafted safetensors files and small model configs.
#ifndef SDMSERVE_TESTS_ENGINE_TEST_MODEL_UTIL_H_
#define SDMSERVE_TESTS_ENGINE_TEST_MODEL_UTIL_H_

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "engine/model_config.h"
#include "gtest/gtest.h"
#include "tests/base/scoped_temp_dir.h"  // ScopedTempDir

namespace sdm::testing {

inline void WriteFile(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

inline std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The bytes of a safetensors file with the given header text and data region; the length field
// is the header's size unless `length` overrides it.
inline std::string SafetensorsBytes(const std::string& header, const std::string& data,
                                    int64_t length = -1) {
  const uint64_t n = length >= 0 ? static_cast<uint64_t>(length) : header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

// Little-endian bytes of fp32 values.
inline std::string FloatBytes(std::initializer_list<float> values) {
  std::string out(values.size() * 4, '\0');
  std::memcpy(out.data(), values.begin(), out.size());
  return out;
}

inline ModelConfig TinyConfig() {
  auto c = PresetConfig("tiny");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

// All three layer types: swa (GQA, window 6), full attention, sdm with every option on.
inline ModelConfig MiniHybridConfig() {
  ModelConfig c = TinyConfig();
  c.n_layers = 5;
  c.swa_at = {0, 2};
  c.attn_at = {3};
  c.sdm_at = {1, 4};
  c.swa_window = 6;
  c.attn_gate = true;
  c.sdm.query_batchnorm = true;
  c.sdm.key_weighted_decay = true;
  c.sdm.num_writes = 5;
  c.sdm.num_reads = 11;
  EXPECT_TRUE(FinalizeModelConfig(c).ok());
  return c;
}

}  // namespace sdm::testing

#endif  // SDMSERVE_TESTS_ENGINE_TEST_MODEL_UTIL_H_
