#include "base/check.h"

#include "gtest/gtest.h"

namespace sdm {
namespace {

TEST(CheckTest, PassingCheckEvaluatesItsConditionOnceAndContinues) {
  int evaluations = 0;
  SDM_CHECK(++evaluations == 1);
  EXPECT_EQ(evaluations, 1);
}

TEST(CheckTest, DetailIsNotEvaluatedWhenTheCheckPasses) {
  int detail_evaluations = 0;
  SDM_CHECK(true) << ++detail_evaluations;
  EXPECT_EQ(detail_evaluations, 0);
}

// An unbraced if/else around SDM_CHECK keeps its else.
TEST(CheckTest, DanglingElseBindsToTheCallersIf) {
  bool took_else = false;
  if (false)
    SDM_CHECK(false);
  else
    took_else = true;
  EXPECT_TRUE(took_else);
}

TEST(CheckDeathTest, FailingCheckAbortsNamingTheConditionAndDetail) {
  const int rows = -1;
  EXPECT_DEATH(SDM_CHECK(rows >= 0) << "rows=" << rows,
               "F .* check_test\\.cc:[0-9]+\\] check failed: rows >= 0 rows=-1");
}

}  // namespace
}  // namespace sdm
