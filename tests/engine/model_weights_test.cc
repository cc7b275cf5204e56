#include "engine/model_weights.h"

#include <cmath>
#include <cstring>

#include "absl/status/status.h"
#include "engine/model_writer.h"
#include "engine/safetensors.h"
#include "engine/weight_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/test_model_util.h"

namespace sdm {
namespace {

using ::sdm::testing::SafetensorsBytes;
using ::sdm::testing::ScopedTempDir;
using ::sdm::testing::TinyConfig;
using ::sdm::testing::WriteFile;
using ::testing::HasSubstr;

// Writes `decls` with values taken from `weights` where it has the tensor (else i * 0.5).
void WriteTensors(const std::filesystem::path& path, const std::vector<TensorDecl>& decls,
                  const ModelWeights& weights) {
  auto writer = SafetensorsWriter::Create(path, decls);
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (const TensorDecl& d : decls) {
    int64_t n = 1;
    for (int64_t x : d.shape) n *= x;
    std::vector<float> values(n);
    if (weights.Has(d.name) && static_cast<int64_t>(weights.Get(d.name).size()) == n) {
      std::copy_n(weights.Get(d.name).begin(), n, values.begin());
    } else {
      for (int64_t i = 0; i < n; ++i) values[i] = 0.5f * i;
    }
    ASSERT_TRUE((*writer)->Append(values).ok());
  }
  ASSERT_TRUE((*writer)->Finish().ok());
}

std::vector<TensorDecl> Decls(const ModelConfig& c, TensorDtype dtype) {
  std::vector<TensorDecl> out;
  for (const TensorSpec& s : ExpectedTensors(c)) out.push_back({s.name, dtype, s.shape});
  return out;
}

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

TEST(ModelWeightsTest, RandomFollowsTheSpecAndTheSeed) {
  const ModelConfig c = TinyConfig();
  auto w1 = ModelWeights::Random(c, 1);
  auto w1b = ModelWeights::Random(c, 1);
  auto w2 = ModelWeights::Random(c, 2);
  for (const TensorSpec& s : ExpectedTensors(c)) {
    SCOPED_TRACE(s.name);
    ASSERT_TRUE(w1->Has(s.name));
    const auto v1 = w1->Get(s.name);
    ASSERT_EQ(static_cast<int64_t>(v1.size()), NumElements(s));
    const auto v1b = w1b->Get(s.name);
    const auto v2 = w2->Get(s.name);
    EXPECT_TRUE(std::equal(v1.begin(), v1.end(), v1b.begin()));
    switch (s.init) {
      case WeightInit::kZeros:
        EXPECT_TRUE(std::all_of(v1.begin(), v1.end(), [](float x) { return x == 0.0f; }));
        break;
      case WeightInit::kOnes:
        EXPECT_TRUE(std::all_of(v1.begin(), v1.end(), [](float x) { return x == 1.0f; }));
        break;
      default: {
        size_t equal = 0;
        for (size_t i = 0; i < v1.size(); ++i) equal += v1[i] == v2[i];
        EXPECT_EQ(equal, 0u);
      }
    }
  }
  EXPECT_FALSE(w1->Has("no.such.tensor"));
  // Norms and embeddings exist under the reference's names.
  EXPECT_TRUE(w1->Has("tok_embeddings.weight"));
  EXPECT_TRUE(w1->Has("layers.3.attention.memory"));
}

TEST(ModelWeightsDeathTest, GetOfAnUnknownTensorAborts) {
  auto w = ModelWeights::Random(TinyConfig(), 1);
  EXPECT_DEATH(w->Get("layers.9.attention.wq.weight"), "layers.9.attention.wq.weight");
}

TEST(ModelWeightsTest, ShareKeepsTheStorageAlive) {
  auto w = ModelWeights::Random(TinyConfig(), 3);
  const std::string name = "layers.3.attention.memory";
  const std::vector<float> copy(w->Get(name).begin(), w->Get(name).end());
  std::shared_ptr<const float> shared = w->Share(name);
  EXPECT_EQ(shared.get(), w->Get(name).data());
  w.reset();
  for (size_t i = 0; i < copy.size(); ++i) ASSERT_EQ(shared.get()[i], copy[i]);
}

TEST(ModelWeightsTest, LoadFp32ServesTheFileValuesInPlace) {
  ScopedTempDir dir;
  const ModelConfig c = TinyConfig();
  auto random = ModelWeights::Random(c, 5);
  const auto path = dir.path() / "model.safetensors";
  WriteTensors(path, Decls(c, TensorDtype::kF32), *random);
  auto loaded = ModelWeights::Load(c, path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto index = ReadSafetensorsIndex(path);
  ASSERT_TRUE(index.ok());
  const float* base = nullptr;
  int64_t base_offset = 0;
  for (const TensorSpec& s : ExpectedTensors(c)) {
    const auto got = (*loaded)->Get(s.name);
    const auto want = random->Get(s.name);
    ASSERT_EQ(got.size(), want.size()) << s.name;
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(Bits(got[i]), Bits(want[i])) << s.name;
    // In place: every tensor sits at its file offset from the first one, in one mapping.
    const SafetensorsEntry* e = index->Find(s.name);
    if (base == nullptr) {
      base = got.data();
      base_offset = e->begin;
    } else {
      EXPECT_EQ((got.data() - base) * 4, e->begin - base_offset) << s.name;
    }
  }
}

TEST(ModelWeightsTest, LoadBf16WidensTheRoundedValues) {
  ScopedTempDir dir;
  const ModelConfig c = TinyConfig();
  auto random = ModelWeights::Random(c, 6);
  const auto path = dir.path() / "model.safetensors";
  WriteTensors(path, Decls(c, TensorDtype::kBF16), *random);
  auto loaded = ModelWeights::Load(c, path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  int64_t changed = 0;
  for (const TensorSpec& s : ExpectedTensors(c)) {
    const auto got = (*loaded)->Get(s.name);
    const auto want = random->Get(s.name);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(Bits(got[i]), Bits(Bf16ToFloat(FloatToBf16(want[i])))) << s.name;
      changed += got[i] != want[i];
    }
  }
  EXPECT_GT(changed, 0);  // the rounding happened
}

TEST(ModelWeightsTest, LoadCopiesMisalignedFp32Tensors) {
  // A header padded so that the data region starts at an offset = 1 (mod 4): fp32 tensors are
  // misaligned in the (page-aligned) mapping and must be copied.
  ModelConfig c = TinyConfig();
  auto random = ModelWeights::Random(c, 1);
  std::string header = "{";
  std::string data;
  int64_t offset = 0;
  bool first = true;
  for (const TensorSpec& s : ExpectedTensors(c)) {
    const auto v = random->Get(s.name);
    std::string shape;
    for (size_t i = 0; i < s.shape.size(); ++i)
      shape += (i ? "," : "") + std::to_string(s.shape[i]);
    header += (first ? "" : ",") + ("\"" + s.name + "\":{\"dtype\":\"F32\",\"shape\":[" + shape +
                                    "],\"data_offsets\":[" + std::to_string(offset) + "," +
                                    std::to_string(offset + 4 * v.size()) + "]}");
    data.append(reinterpret_cast<const char*>(v.data()), 4 * v.size());
    offset += 4 * v.size();
    first = false;
  }
  header += "}";
  while ((8 + header.size()) % 4 != 1) header += ' ';
  ScopedTempDir dir;
  const auto path = dir.path() / "model.safetensors";
  WriteFile(path, SafetensorsBytes(header, data));
  auto loaded = ModelWeights::Load(c, path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  for (const TensorSpec& s : ExpectedTensors(c)) {
    const auto got = (*loaded)->Get(s.name);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(got.data()) % alignof(float), 0u);
    const auto want = random->Get(s.name);
    ASSERT_TRUE(std::equal(got.begin(), got.end(), want.begin(), want.end())) << s.name;
  }
}

TEST(ModelWeightsTest, LoadRejectsAMissingTensorByName) {
  ScopedTempDir dir;
  const ModelConfig c = TinyConfig();
  auto decls = Decls(c, TensorDtype::kF32);
  std::erase_if(decls, [](const TensorDecl& d) { return d.name == "layers.2.ffn_norm.weight"; });
  const auto path = dir.path() / "model.safetensors";
  WriteTensors(path, decls, *ModelWeights::Random(c, 1));
  auto loaded = ModelWeights::Load(c, path);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(loaded.status().message(), HasSubstr(path.string()));
  EXPECT_THAT(loaded.status().message(), HasSubstr("missing tensor 'layers.2.ffn_norm.weight'"));
}

TEST(ModelWeightsTest, LoadRejectsAnUnexpectedTensorByName) {
  ScopedTempDir dir;
  const ModelConfig c = TinyConfig();
  auto decls = Decls(c, TensorDtype::kF32);
  decls.push_back({"layers.1.attention.extra", TensorDtype::kF32, {3}});
  const auto path = dir.path() / "model.safetensors";
  WriteTensors(path, decls, *ModelWeights::Random(c, 1));
  auto loaded = ModelWeights::Load(c, path);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(loaded.status().message(), HasSubstr("unexpected tensor 'layers.1.attention.extra'"));
}

TEST(ModelWeightsTest, LoadRejectsAWrongShapeNamingBoth) {
  ScopedTempDir dir;
  const ModelConfig c = TinyConfig();
  auto decls = Decls(c, TensorDtype::kF32);
  for (TensorDecl& d : decls) {
    if (d.name == "layers.0.attention.wk.weight") d.shape = {c.dim, 32};  // transposed
  }
  const auto path = dir.path() / "model.safetensors";
  WriteTensors(path, decls, *ModelWeights::Random(c, 1));
  auto loaded = ModelWeights::Load(c, path);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(loaded.status().message(),
              HasSubstr("tensor 'layers.0.attention.wk.weight' has shape [64, 32], expected "
                        "[32, 64]"));
}

TEST(ModelWeightsTest, LoadReportsAMalformedFileWithItsPath) {
  ScopedTempDir dir;
  const ModelConfig c = TinyConfig();
  const auto path = dir.path() / "model.safetensors";
  WriteTensors(path, Decls(c, TensorDtype::kF32), *ModelWeights::Random(c, 1));
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 4);
  auto loaded = ModelWeights::Load(c, path);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(loaded.status().message(), HasSubstr(path.string()));
  EXPECT_THAT(loaded.status().message(), HasSubstr("out of range"));
  EXPECT_THAT(loaded.status().message(), HasSubstr("output.weight"));  // the last tensor
  EXPECT_EQ(ModelWeights::Load(c, dir.path() / "none").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(ModelWeightsTest, FromArraysValidatesNamesAndSizes) {
  const ModelConfig c = TinyConfig();
  auto random = ModelWeights::Random(c, 2);
  std::map<std::string, std::vector<float>> arrays;
  for (const TensorSpec& s : ExpectedTensors(c)) {
    arrays[s.name].assign(random->Get(s.name).begin(), random->Get(s.name).end());
  }
  auto ok = ModelWeights::FromArrays(c, arrays);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->Get("norm.weight")[0], 1.0f);
  EXPECT_EQ((*ok)->Get("output.weight")[7], random->Get("output.weight")[7]);

  auto missing = arrays;
  missing.erase("norm.weight");
  EXPECT_THAT(ModelWeights::FromArrays(c, missing).status().message(),
              HasSubstr("missing tensor 'norm.weight'"));
  auto short_array = arrays;
  short_array["layers.0.attention.wq.weight"].pop_back();
  EXPECT_THAT(ModelWeights::FromArrays(c, short_array).status().message(),
              HasSubstr("'layers.0.attention.wq.weight' has 4095 values, expected 4096"));
  auto extra = arrays;
  extra["bogus"] = {1.0f};
  auto s = ModelWeights::FromArrays(c, extra).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("unexpected tensor 'bogus'"));
}

TEST(ModelWeightsTest, WriteRandomModelWritesRandomsValues) {
  // The streamed writer (small chunks, several threads) reproduces Random() exactly.
  ScopedTempDir dir;
  const ModelConfig c = TinyConfig();
  RandomModelOptions options;
  options.seed = 17;
  options.chunk_elements = 1000;
  options.threads = 3;
  int64_t last = -1, total = 0;
  options.progress = [&](int64_t written, int64_t all) {
    EXPECT_GT(written, last);
    last = written;
    total = all;
  };
  ASSERT_TRUE(WriteRandomModel(c, dir.path(), options).ok());
  EXPECT_EQ(last, total);
  EXPECT_EQ(total, CountParameters(c).total * 4);
  auto loaded = ModelWeights::Load(c, dir.path() / "model.safetensors");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto random = ModelWeights::Random(c, 17);
  for (const TensorSpec& s : ExpectedTensors(c)) {
    const auto got = (*loaded)->Get(s.name);
    const auto want = random->Get(s.name);
    ASSERT_TRUE(std::equal(got.begin(), got.end(), want.begin(), want.end())) << s.name;
  }
}

}  // namespace
}  // namespace sdm
