// The shared counter-based generator (kernels/common/philox.h) that the CPU sampler and the CUDA
// sampling kernel both draw from: Random123's known answers, and the engine's wrappers.
#include "kernels/common/philox.h"

#include <array>
#include <cstdint>
#include <random>

#include "engine/sampler.h"
#include "gtest/gtest.h"

namespace sdm::kernels {
namespace {

std::array<uint32_t, 4> Block(PhiloxBlock x) { return {x.v[0], x.v[1], x.v[2], x.v[3]}; }

TEST(PhiloxTest, MatchesRandom123KnownAnswers) {
  // Random123's kat_vectors for philox4x32_10.
  EXPECT_EQ(Block(Philox4x32_10(PhiloxBlock{{0, 0, 0, 0}}, 0, 0)),
            (std::array<uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(Block(Philox4x32_10(PhiloxBlock{{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}},
                                0xffffffff, 0xffffffff)),
            (std::array<uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(Block(Philox4x32_10(PhiloxBlock{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}},
                                0xa4093822, 0x299f31d0)),
            (std::array<uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(PhiloxTest, EngineWrappersAreTheSharedFunctions) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 1000; ++i) {
    const uint64_t a = rng(), b = rng(), seed = rng(), index = rng();
    const std::array<uint32_t, 4> counter = {
        static_cast<uint32_t>(a), static_cast<uint32_t>(a >> 32), static_cast<uint32_t>(b),
        static_cast<uint32_t>(b >> 32)};
    const std::array<uint32_t, 2> key = {static_cast<uint32_t>(seed),
                                         static_cast<uint32_t>(seed >> 32)};
    ASSERT_EQ(sdm::Philox4x32_10(counter, key),
              Block(Philox4x32_10(PhiloxBlock{{counter[0], counter[1], counter[2], counter[3]}},
                                  key[0], key[1])));
    ASSERT_EQ(sdm::UniformDraw(seed, index), UniformDraw(seed, index));
  }
}

TEST(UniformDrawTest, TakesTheTop53BitsOfTheFirstTwoWords) {
  // Counter {index low, index high, 0, 0}, key {seed low, seed high}.
  const uint64_t seed = 0x299f31d0a4093822, index = 0x85a308d3243f6a88;
  const PhiloxBlock x =
      Philox4x32_10(PhiloxBlock{{0x243f6a88, 0x85a308d3, 0, 0}}, 0xa4093822, 0x299f31d0);
  const uint64_t bits = ((static_cast<uint64_t>(x.v[0]) << 32) | x.v[1]) >> 11;
  EXPECT_EQ(UniformDraw(seed, index), static_cast<double>(bits) * 0x1.0p-53);
  EXPECT_EQ(UniformDraw(0, 0),
            static_cast<double>(((uint64_t{0x6627e8d5} << 32) | 0xe169c58d) >> 11) * 0x1.0p-53);
}

}  // namespace
}  // namespace sdm::kernels
