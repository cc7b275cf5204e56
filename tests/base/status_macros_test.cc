#include "base/status_macros.h"

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"

namespace sdm {
namespace {

absl::Status ReturnIfError(absl::Status first, int* reached) {
  SDM_RETURN_IF_ERROR(first);
  ++*reached;
  return absl::OkStatus();
}

TEST(StatusMacrosTest, ReturnIfErrorPassesOkThrough) {
  int reached = 0;
  EXPECT_TRUE(ReturnIfError(absl::OkStatus(), &reached).ok());
  EXPECT_EQ(reached, 1);
}

TEST(StatusMacrosTest, ReturnIfErrorReturnsTheError) {
  int reached = 0;
  EXPECT_EQ(ReturnIfError(absl::NotFoundError("gone"), &reached), absl::NotFoundError("gone"));
  EXPECT_EQ(reached, 0);
}

// A non-absl error type plugs in through an IsOk overload, as cudaError_t does.
enum class FakeError { kSuccess, kFailure };

}  // namespace

namespace base_internal {
constexpr bool IsOk(FakeError e) { return e == FakeError::kSuccess; }
}  // namespace base_internal

namespace {

FakeError PropagateFake(FakeError e, int* reached) {
  SDM_RETURN_IF_ERROR(e);
  ++*reached;
  return FakeError::kSuccess;
}

TEST(StatusMacrosTest, ReturnIfErrorWorksForOtherErrorTypes) {
  int reached = 0;
  EXPECT_EQ(PropagateFake(FakeError::kFailure, &reached), FakeError::kFailure);
  EXPECT_EQ(reached, 0);
  EXPECT_EQ(PropagateFake(FakeError::kSuccess, &reached), FakeError::kSuccess);
  EXPECT_EQ(reached, 1);
}

absl::StatusOr<std::unique_ptr<std::string>> MakeString(bool ok) {
  if (!ok) return absl::InvalidArgumentError("no string");
  return std::make_unique<std::string>("made");
}

absl::StatusOr<std::string> AssignOrReturn(bool ok) {
  SDM_ASSIGN_OR_RETURN(std::unique_ptr<std::string> s, MakeString(ok));  // move-only value
  std::string copy;
  SDM_ASSIGN_OR_RETURN(copy, absl::StatusOr<std::string>(*s + "!"));  // existing variable
  return copy;
}

TEST(StatusMacrosTest, AssignOrReturnAssignsTheValue) {
  absl::StatusOr<std::string> s = AssignOrReturn(true);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, "made!");
}

TEST(StatusMacrosTest, AssignOrReturnReturnsTheError) {
  EXPECT_EQ(AssignOrReturn(false).status(), absl::InvalidArgumentError("no string"));
}

}  // namespace
}  // namespace sdm
