// GenerationPolicy on the byte tokenizer, whose ids are bytes, so each test feeds an exact byte
// sequence: one test per rule of engine/generation.h, then a randomized check of the whole
// contract against Tokenizer::Decode.
#include "engine/generation.h"

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace sdm {
namespace {

using ::testing::ElementsAre;

constexpr char kFffd[] = "\xEF\xBF\xBD";  // U+FFFD
constexpr int32_t kBos = 256;
constexpr int32_t kEos = 257;

std::vector<int32_t> BytesOf(const std::string& s) {
  std::vector<int32_t> ids;
  for (const char c : s) ids.push_back(static_cast<uint8_t>(c));
  return ids;
}

bool IsValidUtf8(const std::string& s) { return SanitizeUtf8(s, /*final=*/true, nullptr) == s; }

// What a policy produced for a token sequence.
struct Outcome {
  std::vector<std::string> deltas;  // one per accepted token
  std::vector<bool> end_tokens;     // one per accepted token
  std::optional<FinishReason> finish;
  size_t accepted = 0;  // tokens accepted before the policy finished (or all of them)
  std::string text() const { return absl::StrJoin(deltas, ""); }
};

class GenerationPolicyTest : public ::testing::Test {
 protected:
  // Feeds `tokens` until the policy finishes.
  Outcome Feed(const std::vector<int32_t>& tokens, const std::vector<std::string>& stop_strings,
               const std::vector<int32_t>& stop_ids, int64_t max_tokens, bool ignore_eos = false) {
    SamplingParams sampling;
    sampling.stop_token_ids = stop_ids;
    sampling.max_tokens = max_tokens;
    sampling.ignore_eos = ignore_eos;
    GenerationPolicy policy(*tokenizer_, stop_strings, sampling);
    Outcome run;
    for (const int32_t token : tokens) {
      GenerationPolicy::TokenOutput out = policy.Accept(token);
      ++run.accepted;
      run.deltas.push_back(std::move(out.text));
      run.end_tokens.push_back(out.end_token);
      if (out.finish.has_value()) {
        run.finish = out.finish;
        break;
      }
    }
    return run;
  }

  std::unique_ptr<Tokenizer> tokenizer_ = Tokenizer::CreateByteTokenizer();
};

TEST_F(GenerationPolicyTest, WithoutStopStringsEachCharacterIsEmittedByItsLastByte) {
  const Outcome run = Feed(BytesOf("ab\xC3\xA9"
                                   "c"),
                           {}, {}, /*max_tokens=*/100);
  EXPECT_THAT(run.deltas, ElementsAre("a", "b", "", "\xC3\xA9", "c"));
  EXPECT_THAT(run.end_tokens, ElementsAre(false, false, false, false, false));
  EXPECT_EQ(run.finish, std::nullopt);
}

TEST_F(GenerationPolicyTest, EosEndsAsAnEndTokenWithTheHeldTextFlushed) {
  // The incomplete character before EOS is final: U+FFFD, carried by the end token.
  const Outcome run = Feed({'h', 'i', 0xE2, 0x82, kEos, 'x'}, {}, {}, 100);
  EXPECT_THAT(run.deltas, ElementsAre("h", "i", "", "", kFffd));
  EXPECT_THAT(run.end_tokens, ElementsAre(false, false, false, false, true));
  EXPECT_EQ(run.finish, FinishReason::kEos);
  EXPECT_EQ(run.accepted, 5u);
}

TEST_F(GenerationPolicyTest, IgnoreEosGeneratesPastEosToMaxTokens) {
  // EOS is a token like any other then: no text, no end; a stop id still ends.
  const Outcome run = Feed({'a', kEos, 'b', kEos}, {}, {}, /*max_tokens=*/4, /*ignore_eos=*/true);
  EXPECT_THAT(run.deltas, ElementsAre("a", "", "b", ""));
  EXPECT_THAT(run.end_tokens, ElementsAre(false, false, false, false));
  EXPECT_EQ(run.finish, FinishReason::kLength);
  const Outcome stop_id = Feed({'a', kEos, 'b'}, {}, {kEos}, 100, /*ignore_eos=*/true);
  EXPECT_EQ(stop_id.finish, FinishReason::kStop);
  EXPECT_EQ(stop_id.accepted, 2u);
}

TEST_F(GenerationPolicyTest, FlushReleasesTheHeldTextOnceAndNothingAfterAnEnd) {
  SamplingParams sampling;
  sampling.max_tokens = 100;
  const std::vector<std::string> stops = {"xyz"};
  GenerationPolicy policy(*tokenizer_, stops, sampling);
  std::string emitted;
  for (const int32_t token :
       {int32_t{'a'}, int32_t{'b'}, int32_t{'c'}, int32_t{'x'}, int32_t{0xC3}}) {
    emitted += policy.Accept(token).text;
  }
  EXPECT_EQ(emitted, "ab");  // the last 2 bytes may start "xyz", and half a character
  EXPECT_EQ(policy.Flush(), std::string("cx") + kFffd);
  EXPECT_EQ(policy.Flush(), "");
  // After the policy ended the completion, everything was emitted already.
  GenerationPolicy stopped(*tokenizer_, stops, sampling);
  stopped.Accept('x');
  stopped.Accept('y');
  ASSERT_EQ(stopped.Accept('z').finish, FinishReason::kStop);
  EXPECT_EQ(stopped.Flush(), "");
}

TEST_F(GenerationPolicyTest, StopIdEndsAsAnEndTokenWithoutItsText) {
  // 'c' is a stop id: its byte is not part of the text.
  const Outcome run = Feed(BytesOf("abcd"), {}, {'z', 'c'}, 100);
  EXPECT_THAT(run.deltas, ElementsAre("a", "b", ""));
  EXPECT_THAT(run.end_tokens, ElementsAre(false, false, true));
  EXPECT_EQ(run.finish, FinishReason::kStop);
}

TEST_F(GenerationPolicyTest, EndTokensCountTowardsMaxTokensAndWinOverLength) {
  const Outcome eos_last = Feed({'a', 'b', kEos}, {}, {}, /*max_tokens=*/3);
  EXPECT_EQ(eos_last.finish, FinishReason::kEos);
  EXPECT_TRUE(eos_last.end_tokens.back());
  const Outcome stop_last = Feed({'a', 'b', 'c'}, {}, {'c'}, /*max_tokens=*/3);
  EXPECT_EQ(stop_last.finish, FinishReason::kStop);
  EXPECT_EQ(stop_last.text(), "ab");
}

TEST_F(GenerationPolicyTest, MaxTokensFlushesEverythingHeldBack) {
  // The stop string's possible start "x" and an incomplete character are both final at
  // max_tokens: the text is flushed, the character as U+FFFD.
  const Outcome run = Feed({'a', 'x', 0xC3, 'b'}, {"xy"}, {}, /*max_tokens=*/3);
  EXPECT_THAT(run.deltas, ElementsAre("", "a", absl::StrCat("x", kFffd)));
  EXPECT_EQ(run.finish, FinishReason::kLength);
  EXPECT_EQ(run.accepted, 3u);
  EXPECT_THAT(run.end_tokens, ElementsAre(false, false, false));
}

TEST_F(GenerationPolicyTest, StopStringAcrossTokensEndsTheTextRightBeforeIt) {
  const Outcome run = Feed(BytesOf("abcdef"), {"cd"}, {}, 100);
  // One byte ("cd" minus one) is held back: it may start the stop string.
  EXPECT_THAT(run.deltas, ElementsAre("", "a", "b", ""));
  EXPECT_EQ(run.finish, FinishReason::kStop);
  EXPECT_FALSE(run.end_tokens.back());  // the token that completes the string is a normal token
  EXPECT_EQ(run.text(), "ab");
}

TEST_F(GenerationPolicyTest, StopStringEndsTextEmittedInTheSameDelta) {
  // With a long stop string held back, the completing token releases the text before the
  // shorter one.
  const Outcome run = Feed(BytesOf("abcdz"), {"long stop", "cd"}, {}, 100);
  EXPECT_EQ(run.finish, FinishReason::kStop);
  EXPECT_EQ(run.accepted, 4u);
  EXPECT_THAT(run.deltas, ElementsAre("", "", "", "ab"));
}

TEST_F(GenerationPolicyTest, TheEarliestStopStringWinsWhateverTheirOrder) {
  for (const std::vector<std::string>& stops :
       {std::vector<std::string>{"cde", "bcd"}, std::vector<std::string>{"bcd", "cde"}}) {
    const Outcome run = Feed(BytesOf("abcdefg"), stops, {}, 100);
    EXPECT_EQ(run.finish, FinishReason::kStop);
    EXPECT_EQ(run.accepted, 4u);  // "bcd" completes first
    EXPECT_EQ(run.text(), "a");
  }
}

TEST_F(GenerationPolicyTest, StopStringThatNeverCompletesIsReleased) {
  // "abx" starts like "abc" but is not it: the held bytes come out once they cannot start it.
  const Outcome run = Feed(BytesOf("abxab"), {"abc"}, {}, /*max_tokens=*/5);
  EXPECT_THAT(run.deltas, ElementsAre("", "", "a", "b", "xab"));
  EXPECT_EQ(run.finish, FinishReason::kLength);

  // Ended by EOS: the held start of the stop string goes with the end token.
  const Outcome eos = Feed({'q', 'a', 'b', kEos}, {"abc"}, {}, 100);
  EXPECT_THAT(eos.deltas, ElementsAre("", "", "q", "ab"));
  EXPECT_EQ(eos.finish, FinishReason::kEos);
}

TEST_F(GenerationPolicyTest, HoldBackNeverSplitsACharacter) {
  // Holding back one byte would cut "é" (2 bytes) and "€" (3 bytes): the whole character waits.
  const Outcome run = Feed(BytesOf("a\xC3\xA9\xE2\x82\xAC"
                                   "b"),
                           {"zz"}, {}, 100);
  EXPECT_THAT(run.deltas, ElementsAre("", "", "a", "", "", "\xC3\xA9", "\xE2\x82\xAC"));
  for (const std::string& d : run.deltas) EXPECT_TRUE(IsValidUtf8(d)) << d;
}

TEST_F(GenerationPolicyTest, MultiByteStopStringSplitAcrossTokens) {
  const Outcome run = Feed(BytesOf("x\xE2\x82\xAC"
                                   "y"),
                           {"\xE2\x82\xAC"}, {}, 100);
  EXPECT_EQ(run.finish, FinishReason::kStop);
  EXPECT_EQ(run.accepted, 4u);
  EXPECT_EQ(run.text(), "x");
}

TEST_F(GenerationPolicyTest, EndTokenCutsTheFlushedTextAtAStopString) {
  // The U+FFFD that EOS makes of the incomplete character completes the stop string "x\uFFFD".
  const std::string stop = absl::StrCat("x", kFffd);
  const Outcome eos = Feed({'a', 'x', 0xC3, kEos}, {stop}, {}, 100);
  EXPECT_EQ(eos.finish, FinishReason::kEos);
  EXPECT_TRUE(eos.end_tokens.back());
  EXPECT_EQ(eos.text(), "a");
  // Same at max_tokens, which then ends the text as a stop.
  const Outcome length = Feed({'a', 'x', 0xC3}, {stop}, {}, /*max_tokens=*/3);
  EXPECT_EQ(length.finish, FinishReason::kStop);
  EXPECT_EQ(length.text(), "a");
}

TEST_F(GenerationPolicyTest, EmptyStopStringsAreIgnored) {
  const Outcome run = Feed(BytesOf("abc"), {"", ""}, {}, /*max_tokens=*/3);
  EXPECT_THAT(run.deltas, ElementsAre("a", "b", "c"));  // nothing held back, nothing stops
  EXPECT_EQ(run.finish, FinishReason::kLength);
}

TEST_F(GenerationPolicyTest, ControlIdsHaveNoText) {
  // BOS is not an end token: it contributes no text and does not stop the completion.
  const Outcome run = Feed({'a', kBos, 'b'}, {}, {}, /*max_tokens=*/3);
  EXPECT_THAT(run.deltas, ElementsAre("a", "", "b"));
  EXPECT_EQ(run.finish, FinishReason::kLength);
}

TEST(FinishReasonNameTest, NamesEveryReason) {
  EXPECT_EQ(FinishReasonName(FinishReason::kLength), "length");
  EXPECT_EQ(FinishReasonName(FinishReason::kStop), "stop");
  EXPECT_EQ(FinishReasonName(FinishReason::kEos), "eos");
  EXPECT_EQ(FinishReasonName(FinishReason::kCancelled), "cancelled");
  EXPECT_EQ(FinishReasonName(FinishReason::kDeadline), "deadline");
  EXPECT_EQ(FinishReasonName(FinishReason::kError), "error");
}

// ---- the contract, on random token sequences ----------------------------------------------

// Offset of the earliest occurrence of any of `stops` in `text`, or npos.
size_t FirstStop(const std::string& text, const std::vector<std::string>& stops) {
  size_t first = std::string::npos;
  for (const std::string& s : stops) {
    if (!s.empty()) first = std::min(first, text.find(s));
  }
  return first;
}

// One random completion: checks every delta and the end against Tokenizer::Decode.
void CheckRandomCompletion(uint64_t seed, const Tokenizer& tokenizer) {
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  const auto uniform = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  // Pieces of text the tokens spell, byte by byte: ASCII, 2- and 3-byte characters, and bytes
  // that form no character (a lone continuation byte, 0xFF, a truncated "€").
  const std::vector<std::string> pieces = {
      "a", "b", "c", " ", "\xC3\xA9", "\xE2\x82\xAC", "\x80", "\xFF", "\xE2\x82"};
  // Stop strings: short valid strings over the same alphabet (no U+FFFD: see generation.h).
  const std::vector<std::string> alphabet = {"a", "b", "c", " ", "\xC3\xA9", "\xE2\x82\xAC"};
  std::vector<std::string> stops(uniform(4));
  for (std::string& s : stops) {
    const size_t length = uniform(4);  // 0: an empty stop string, ignored
    for (size_t i = 0; i < length; ++i) s += alphabet[uniform(alphabet.size())];
  }
  std::vector<int32_t> stop_ids;
  if (uniform(3) == 0) stop_ids.push_back('c');
  std::vector<int32_t> tokens;
  while (tokens.size() < 60) {
    if (uniform(40) == 0) tokens.push_back(kEos);
    for (const char byte : pieces[uniform(pieces.size())]) {
      tokens.push_back(static_cast<uint8_t>(byte));
    }
  }
  const int64_t max_tokens = 1 + static_cast<int64_t>(uniform(50));
  const bool ignore_eos = uniform(4) == 0;  // last: the draws above are those of earlier versions
  SCOPED_TRACE(absl::StrCat("tokens ", absl::StrJoin(tokens, ","), " stops \"",
                            absl::StrJoin(stops, "\", \""), "\" stop ids ",
                            absl::StrJoin(stop_ids, ","), " max_tokens ", max_tokens,
                            " ignore_eos ", ignore_eos));

  SamplingParams sampling;
  sampling.stop_token_ids = stop_ids;
  sampling.max_tokens = max_tokens;
  sampling.ignore_eos = ignore_eos;
  GenerationPolicy policy(tokenizer, stops, sampling);
  const auto ends = [&](int32_t token) {
    return (token == kEos && !ignore_eos) || (!stop_ids.empty() && token == stop_ids[0]);
  };
  std::string text;
  std::optional<FinishReason> finish;
  size_t accepted = 0;
  while (!finish.has_value()) {
    ASSERT_LT(accepted, tokens.size()) << "the policy never finished";
    const int32_t token = tokens[accepted++];
    const GenerationPolicy::TokenOutput out = policy.Accept(token);
    EXPECT_TRUE(IsValidUtf8(out.text)) << "delta " << accepted;
    EXPECT_EQ(out.end_token, ends(token));
    text += out.text;
    finish = out.finish;
  }
  const std::vector<int32_t> seen(tokens.begin(), tokens.begin() + accepted);
  const int32_t last = seen.back();
  const bool end_token = ends(last);
  const std::vector<int32_t> before(seen.begin(), seen.end() - 1);
  // The text is the decoding of every accepted token but an end token, cut before the first
  // stop string.
  const std::string decoded = tokenizer.Decode(end_token ? before : seen);
  const size_t stop_at = FirstStop(decoded, stops);
  EXPECT_EQ(text, decoded.substr(0, stop_at));
  // And it ended at the first token that called for it.
  EXPECT_EQ(FirstStop(tokenizer.Decode(before), stops), std::string::npos);
  if (last == kEos && !ignore_eos) {
    EXPECT_EQ(*finish, FinishReason::kEos);
  } else if (end_token) {
    EXPECT_EQ(*finish, FinishReason::kStop);
  } else if (stop_at != std::string::npos) {
    EXPECT_EQ(*finish, FinishReason::kStop);
  } else {
    EXPECT_EQ(*finish, FinishReason::kLength);
    EXPECT_EQ(static_cast<int64_t>(accepted), max_tokens);
  }
  EXPECT_LE(static_cast<int64_t>(accepted), max_tokens);
}

TEST_F(GenerationPolicyTest, TextIsTheDecodingCutAtTheFirstStopStringFixedSeeds) {
  for (uint64_t seed = 1; seed <= 2000; ++seed) {
    CheckRandomCompletion(seed, *tokenizer_);
    if (HasFailure()) break;
  }
}

TEST_F(GenerationPolicyTest, TextIsTheDecodingCutAtTheFirstStopStringFreshSeeds) {
  const uint64_t base = std::random_device()();
  std::cout << "fresh seeds from " << base << " (rerun with them to reproduce a failure)\n";
  for (uint64_t seed = base; seed < base + 200; ++seed) {
    CheckRandomCompletion(seed, *tokenizer_);
    if (HasFailure()) break;
  }
}

}  // namespace
}  // namespace sdm
