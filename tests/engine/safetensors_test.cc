#include "engine/safetensors.h"

#include <cmath>
#include <limits>
#include <random>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/test_model_util.h"

namespace sdm {
namespace {

using ::sdm::testing::FloatBytes;
using ::sdm::testing::ReadFile;
using ::sdm::testing::SafetensorsBytes;
using ::sdm::testing::ScopedTempDir;
using ::sdm::testing::WriteFile;
using ::testing::HasSubstr;

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

TEST(Bf16Test, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
  // 1 + 2^-8 lies halfway between bf16 1.0 (0x3f80, even) and 1 + 2^-7 (0x3f81): ties to even.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808000)), 0x3f80);
  // 1 + 3 * 2^-8 lies halfway between 0x3f81 (odd) and 0x3f82 (even): ties to even, up.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f818000)), 0x3f82);
  // Just above and below the halfway point round to the nearer neighbour.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808001)), 0x3f81);
  EXPECT_EQ(FloatToBf16(FromBits(0x3f807fff)), 0x3f80);
  // Overflow rounds to infinity; infinities and NaN survive.
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
  // A NaN whose payload sits in the low 16 bits would become infinity if truncated naively.
  const uint16_t nan = FloatToBf16(FromBits(0x7f800001));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(nan))) << std::hex << nan;
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(FromBits(0xffffffff)))));
  EXPECT_TRUE(std::signbit(Bf16ToFloat(FloatToBf16(FromBits(0xff800001)))));
  EXPECT_EQ(Bits(Bf16ToFloat(0x3f81)), 0x3f810000u);
}

TEST(Bf16Test, RoundTripIsExactForBf16Values) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBf16(f), b);
  }
}

TEST(Bf16Test, ErrorIsAtMostHalfAnUlp) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-100.0f, 100.0f);
  for (int i = 0; i < 100000; ++i) {
    const float f = dist(rng);
    const float r = Bf16ToFloat(FloatToBf16(f));
    const float ulp = std::ldexp(1.0f, std::ilogb(r) - 7);
    ASSERT_LE(std::abs(r - f), 0.5f * ulp) << f;
  }
}

struct Written {
  std::vector<float> a, b, c;
};

// Writes a (F32 [2,3]), e (F32, no elements), b (BF16 [5]), s (F32 scalar) in small chunks.
Written WriteSample(const std::filesystem::path& path) {
  Written w;
  w.a = {1.5f, -2.25f, 3.0f, 1e-30f, -0.0f, 7.0f};
  w.b = {1.0f, FromBits(0x3f808000), FromBits(0x3f818000), -3.0f, 65504.0f};
  w.c = {42.0f};
  auto writer = SafetensorsWriter::Create(path,
                                          {{"a", TensorDtype::kF32, {2, 3}},
                                           {"e", TensorDtype::kF32, {0, 4}},
                                           {"b", TensorDtype::kBF16, {5}},
                                           {"s", TensorDtype::kF32, {}}},
                                          {{"format", "pt"}, {"note", "hello"}});
  EXPECT_TRUE(writer.ok()) << writer.status();
  SafetensorsWriter& wr = **writer;
  EXPECT_EQ(wr.current_tensor()->name, "a");
  EXPECT_TRUE(wr.Append(std::span(w.a).subspan(0, 4)).ok());
  EXPECT_TRUE(wr.Append(std::span(w.a).subspan(4)).ok());
  EXPECT_EQ(wr.current_tensor()->name, "b");  // the empty tensor is skipped
  EXPECT_TRUE(wr.Append(std::span(w.b).subspan(0, 1)).ok());
  EXPECT_TRUE(wr.Append(std::span(w.b).subspan(1)).ok());
  EXPECT_TRUE(wr.Append(w.c).ok());
  EXPECT_EQ(wr.current_tensor(), nullptr);
  EXPECT_EQ(wr.data_bytes_written(), 6 * 4 + 5 * 2 + 4);
  EXPECT_EQ(wr.data_bytes_total(), wr.data_bytes_written());
  EXPECT_TRUE(wr.Finish().ok());
  return w;
}

std::vector<float> AsFloats(const TensorView& v) {
  std::vector<float> out(v.entry->num_elements);
  if (v.entry->dtype == TensorDtype::kF32) {
    std::memcpy(out.data(), v.bytes.data(), v.bytes.size());
  } else {
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t b;
      std::memcpy(&b, v.bytes.data() + 2 * i, 2);
      out[i] = Bf16ToFloat(b);
    }
  }
  return out;
}

TEST(SafetensorsTest, WriterReaderRoundTrip) {
  ScopedTempDir dir;
  const auto path = dir.path() / "m.safetensors";
  const Written w = WriteSample(path);
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "m.safetensors.tmp"));

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const SafetensorsIndex& index = (*file)->index();
  EXPECT_EQ(index.data_offset % 8, 0);
  EXPECT_EQ(index.file_size, static_cast<int64_t>(std::filesystem::file_size(path)));
  EXPECT_EQ(index.metadata,
            (std::map<std::string, std::string>{{"format", "pt"}, {"note", "hello"}}));
  ASSERT_EQ(index.tensors.size(), 4u);

  const TensorView a = (*file)->Find("a");
  ASSERT_NE(a.entry, nullptr);
  EXPECT_EQ(a.entry->dtype, TensorDtype::kF32);
  EXPECT_EQ(a.entry->shape, (std::vector<int64_t>{2, 3}));
  const std::vector<float> a_values = AsFloats(a);
  ASSERT_EQ(a_values.size(), w.a.size());
  for (size_t i = 0; i < w.a.size(); ++i) EXPECT_EQ(Bits(a_values[i]), Bits(w.a[i])) << i;

  const TensorView e = (*file)->Find("e");
  ASSERT_NE(e.entry, nullptr);
  EXPECT_EQ(e.entry->shape, (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(e.bytes.size(), 0u);

  const TensorView b = (*file)->Find("b");
  ASSERT_NE(b.entry, nullptr);
  EXPECT_EQ(b.entry->dtype, TensorDtype::kBF16);
  EXPECT_EQ(b.bytes.size(), 10u);
  EXPECT_THAT(AsFloats(b), ::testing::ElementsAre(1.0f, 1.0f, FromBits(0x3f820000), -3.0f,
                                                  65536.0f));  // 65504 rounds to 2^16 in bf16

  const TensorView s = (*file)->Find("s");
  ASSERT_NE(s.entry, nullptr);
  EXPECT_TRUE(s.entry->shape.empty());
  EXPECT_THAT(AsFloats(s), ::testing::ElementsAre(42.0f));

  EXPECT_EQ((*file)->Find("missing").entry, nullptr);

  // The header-only reader sees the same index.
  auto header = ReadSafetensorsIndex(path);
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->data_offset, index.data_offset);
  ASSERT_EQ(header->tensors.size(), index.tensors.size());
  for (size_t i = 0; i < index.tensors.size(); ++i) {
    EXPECT_EQ(header->tensors[i].name, index.tensors[i].name);
    EXPECT_EQ(header->tensors[i].begin, index.tensors[i].begin);
    EXPECT_EQ(header->tensors[i].end, index.tensors[i].end);
  }
}

TEST(SafetensorsTest, ChunkingDoesNotChangeTheFile) {
  ScopedTempDir dir;
  std::vector<float> values(10000);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (float& v : values) v = normal(rng);
  std::string contents[2];
  for (int variant = 0; variant < 2; ++variant) {
    const auto path = dir.path() / ("v" + std::to_string(variant));
    auto writer = SafetensorsWriter::Create(
        path, {{"x", TensorDtype::kBF16, {100, 100}}, {"y", TensorDtype::kF32, {10000}}});
    ASSERT_TRUE(writer.ok());
    for (int t = 0; t < 2; ++t) {
      if (variant == 0) {
        ASSERT_TRUE((*writer)->Append(values).ok());
      } else {
        for (size_t i = 0; i < values.size(); i += 777) {
          ASSERT_TRUE(
              (*writer)
                  ->Append(std::span(values).subspan(i, std::min<size_t>(777, values.size() - i)))
                  .ok());
        }
      }
    }
    ASSERT_TRUE((*writer)->Finish().ok());
    contents[variant] = ReadFile(path);
  }
  EXPECT_EQ(contents[0], contents[1]);
}

TEST(SafetensorsWriterTest, RejectsAppendPastTheTensorAndStaysFailed) {
  ScopedTempDir dir;
  const auto path = dir.path() / "m.safetensors";
  auto writer = SafetensorsWriter::Create(path, {{"a", TensorDtype::kF32, {2}}});
  ASSERT_TRUE(writer.ok());
  const std::vector<float> three = {1, 2, 3};
  absl::Status s = (*writer)->Append(three);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("'a'"));
  EXPECT_FALSE((*writer)->Append(std::span(three).subspan(0, 2)).ok());
  EXPECT_FALSE((*writer)->Finish().ok());
  writer->reset();
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "m.safetensors.tmp"));
}

TEST(SafetensorsWriterTest, FinishRequiresEveryTensor) {
  ScopedTempDir dir;
  const auto path = dir.path() / "m.safetensors";
  auto writer = SafetensorsWriter::Create(
      path, {{"a", TensorDtype::kF32, {2}}, {"b", TensorDtype::kBF16, {3}}});
  ASSERT_TRUE(writer.ok());
  const std::vector<float> two = {1, 2};
  ASSERT_TRUE((*writer)->Append(two).ok());
  ASSERT_TRUE((*writer)->Append(std::span(two).subspan(0, 1)).ok());
  absl::Status s = (*writer)->Finish();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("tensor 'b' has 1 of 3 values"));
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "m.safetensors.tmp"));
  writer->reset();  // abandoned: the temporary file goes away, nothing reaches the final name
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "m.safetensors.tmp"));
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(SafetensorsWriterTest, RejectsBadDeclarations) {
  ScopedTempDir dir;
  const auto path = dir.path() / "m.safetensors";
  auto dup = SafetensorsWriter::Create(
      path, {{"a", TensorDtype::kF32, {2}}, {"a", TensorDtype::kF32, {2}}});
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(dup.status().message(), HasSubstr("duplicate tensor name 'a'"));
  auto negative = SafetensorsWriter::Create(path, {{"n", TensorDtype::kF32, {2, -1}}});
  EXPECT_THAT(negative.status().message(), HasSubstr("'n'"));
  auto reserved = SafetensorsWriter::Create(path, {{"__metadata__", TensorDtype::kF32, {1}}});
  EXPECT_FALSE(reserved.ok());
  auto no_dir = SafetensorsWriter::Create(dir.path() / "nope" / "m", {});
  EXPECT_FALSE(no_dir.ok());
  EXPECT_THAT(no_dir.status().message(), HasSubstr("nope"));
}

TEST(SafetensorsTest, FinishReplacesAnExistingFile) {
  ScopedTempDir dir;
  const auto path = dir.path() / "m.safetensors";
  WriteFile(path, "old contents");
  WriteSample(path);
  EXPECT_TRUE(SafetensorsFile::Open(path).ok());
}

// ---- Malformed files: each case names its problem. ----

struct Malformed {
  const char* name;
  std::string bytes;
  absl::StatusCode code;
  std::vector<std::string> message_parts;
};

std::string Header(const std::string& json, const std::string& data) {
  return SafetensorsBytes(json, data);
}

std::vector<Malformed> MalformedCases() {
  const std::string d8 = FloatBytes({1, 2});
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  const auto kDataLoss = absl::StatusCode::kDataLoss;
  return {
      {"too_short", std::string(5, '\0'), kDataLoss, {"5 bytes", "8-byte header length"}},
      {"empty", "", kDataLoss, {"0 bytes"}},
      {"absurd_length",
       SafetensorsBytes("{}", "", 200'000'000),
       kInvalid,
       {"absurd header length 200000000"}},
      {"length_beyond_file",
       SafetensorsBytes("{}", "", 50),
       kDataLoss,
       {"header length 50 exceeds the 2 bytes"}},
      {"not_json", Header("{\"a\": ", ""), kInvalid, {"not valid JSON"}},
      {"not_object", Header("[1, 2]", ""), kInvalid, {"must be a JSON object"}},
      {"entry_not_object", Header(R"({"w": 3})", ""), kInvalid, {"tensor 'w'", "not an object"}},
      {"missing_dtype",
       Header(R"({"w": {"shape": [2], "data_offsets": [0, 8]}})", d8),
       kInvalid,
       {"tensor 'w'", "missing field 'dtype'"}},
      {"missing_shape",
       Header(R"({"w": {"dtype": "F32", "data_offsets": [0, 8]}})", d8),
       kInvalid,
       {"tensor 'w'", "missing field 'shape'"}},
      {"missing_offsets",
       Header(R"({"w": {"dtype": "F32", "shape": [2]}})", d8),
       kInvalid,
       {"tensor 'w'", "missing field 'data_offsets'"}},
      {"unknown_field",
       Header(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}})", d8),
       kInvalid,
       {"tensor 'w'", "unknown field 'x'"}},
      {"unsupported_dtype",
       Header(R"({"w": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}})", d8),
       kInvalid,
       {"tensor 'w'", "unsupported dtype \"F16\"", "supported: F32, BF16"}},
      {"dtype_not_string",
       Header(R"({"w": {"dtype": 4, "shape": [2], "data_offsets": [0, 8]}})", d8),
       kInvalid,
       {"tensor 'w'", "unsupported dtype 4"}},
      {"negative_dim",
       Header(R"({"w": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}})", d8),
       kInvalid,
       {"tensor 'w'", "shape must be a list of non-negative integers", "[2,-1]"}},
      {"fractional_dim",
       Header(R"({"w": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})", d8),
       kInvalid,
       {"tensor 'w'", "shape must be"}},
      {"shape_not_list",
       Header(R"({"w": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}})", d8),
       kInvalid,
       {"tensor 'w'", "shape must be"}},
      {"shape_overflow",
       Header(
           R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}})",
           d8),
       kInvalid,
       {"tensor 'w'", "overflows"}},
      {"offsets_one_int",
       Header(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})", d8),
       kInvalid,
       {"tensor 'w'", "data_offsets must be two integers in [0, 2^62]"}},
      {"offsets_float",
       Header(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8.5]}})", d8),
       kInvalid,
       {"tensor 'w'", "data_offsets must be two"}},
      {"offsets_negative",
       Header(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}})", d8),
       kInvalid,
       {"tensor 'w'", "data_offsets must be two"}},
      {"begin_after_end",
       Header(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", d8),
       kInvalid,
       {"tensor 'w'", "[8, 0]", "begin > end"}},
      {"end_out_of_range",
       Header(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", d8),
       kDataLoss,
       {"tensor 'w'", "out of range", "8 bytes"}},
      {"size_mismatch",
       Header(R"({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 8]}})", d8),
       kInvalid,
       {"tensor 'w'", "hold 8 bytes", "BF16", "needs 4"}},
      {"overlap",
       Header(R"({"p": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                  "q": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
              d8),
       kInvalid,
       {"'p'", "'q'", "overlap"}},
      {"same_range",
       Header(R"({"p": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                  "q": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
              d8),
       kInvalid,
       {"overlap"}},
      {"hole_before",
       Header(R"({"p": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", d8),
       kInvalid,
       {"hole of 4 unused bytes before tensor 'p'"}},
      {"hole_between",
       Header(R"({"p": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                  "q": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
              FloatBytes({1, 2, 3})),
       kInvalid,
       {"hole of 4 unused bytes before tensor 'q'"}},
      {"trailing_bytes",
       Header(R"({"p": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", d8),
       kInvalid,
       {"hole of 4 unused bytes after the last tensor"}},
      {"duplicate_name",
       Header(R"({"p": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                  "p": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
              d8),
       kInvalid,
       {"duplicate tensor name 'p'"}},
      {"metadata_not_object", Header(R"({"__metadata__": [1]})", ""), kInvalid, {"__metadata__"}},
      {"metadata_not_strings",
       Header(R"({"__metadata__": {"k": 1}})", ""),
       kInvalid,
       {"__metadata__", "'k'"}},
  };
}

TEST(SafetensorsMalformedTest, EveryCaseIsRejectedWithItsReason) {
  ScopedTempDir dir;
  for (const Malformed& m : MalformedCases()) {
    SCOPED_TRACE(m.name);
    const auto path = dir.path() / (std::string(m.name) + ".safetensors");
    WriteFile(path, m.bytes);
    auto file = SafetensorsFile::Open(path);
    ASSERT_FALSE(file.ok());
    EXPECT_EQ(file.status().code(), m.code) << file.status();
    EXPECT_THAT(file.status().message(), HasSubstr(path.string()));
    for (const std::string& part : m.message_parts) {
      EXPECT_THAT(file.status().message(), HasSubstr(part));
    }
    // The header-only reader agrees.
    auto header = ReadSafetensorsIndex(path);
    ASSERT_FALSE(header.ok());
    EXPECT_EQ(header.status(), file.status());
  }
}

TEST(SafetensorsMalformedTest, WellFormedVariantsOfTheCasesAreAccepted) {
  // Guards the cases above: the same shapes of file, made consistent, load.
  ScopedTempDir dir;
  const auto path = dir.path() / "ok.safetensors";
  WriteFile(path, Header(R"({"p": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                             "q": {"dtype": "BF16", "shape": [2], "data_offsets": [4, 8]},
                             "__metadata__": {"k": "v"}})",
                         FloatBytes({1, 2})));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->index().metadata.at("k"), "v");
  WriteFile(path, Header("{}", ""));
  EXPECT_TRUE(SafetensorsFile::Open(path).ok());
}

// nlohmann parses nesting iteratively but dumps it recursively, once per level: an error message
// that quoted a deeply nested value whole overflowed the stack (a header of 1,000,000 '[' then as
// many ']' crashed the loader). Each place that quotes a value is reached with one.
TEST(SafetensorsMalformedTest, DeeplyNestedValuesAreRejectedWithoutRecursion) {
  const std::string deep = std::string(1'000'000, '[') + std::string(1'000'000, ']');
  const std::vector<std::string> headers = {
      deep,
      R"({"w": )" + deep + "}",
      R"({"w": {"dtype": )" + deep + R"(, "shape": [1], "data_offsets": [0, 4]}})",
      R"({"w": {"dtype": "F32", "shape": )" + deep + R"(, "data_offsets": [0, 4]}})",
      R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": )" + deep + "}}",
  };
  for (size_t i = 0; i < headers.size(); ++i) {
    SCOPED_TRACE(i);
    const std::string& header = headers[i];
    auto index = ParseSafetensorsHeader("deep", header, 8 + static_cast<int64_t>(header.size()));
    ASSERT_FALSE(index.ok());
    EXPECT_EQ(index.status().code(), absl::StatusCode::kInvalidArgument) << index.status();
    EXPECT_LT(index.status().message().size(), 300u) << index.status();
  }
}

TEST(SafetensorsMalformedTest, MissingFileIsNotFound) {
  ScopedTempDir dir;
  auto file = SafetensorsFile::Open(dir.path() / "absent.safetensors");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().message(), HasSubstr("absent.safetensors"));
  EXPECT_EQ(ReadSafetensorsIndex(dir.path() / "absent.safetensors").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_FALSE(SafetensorsFile::Open(dir.path()).ok());  // a directory
}

}  // namespace
}  // namespace sdm
