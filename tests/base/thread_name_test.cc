#include "base/thread_name.h"

#include <pthread.h>

#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace sdm {
namespace {

std::string NameOfThisThread() {
  char name[64] = {};
  EXPECT_EQ(pthread_getname_np(pthread_self(), name, sizeof(name)), 0);
  return name;
}

TEST(ThreadNameTest, NamesTheCallingThreadOnly) {
  const std::string before = NameOfThisThread();
  std::string inside;
  std::thread t([&] {
    SetCurrentThreadName("sdm-writer");
    inside = NameOfThisThread();
  });
  t.join();
  EXPECT_EQ(inside, "sdm-writer");
  EXPECT_EQ(NameOfThisThread(), before);
}

TEST(ThreadNameTest, ALongNameIsCutToFifteenBytes) {
  std::string inside;
  std::thread t([&] {
    SetCurrentThreadName("sdm-a-name-longer-than-fifteen");
    inside = NameOfThisThread();
  });
  t.join();
  EXPECT_EQ(inside, "sdm-a-name-long");
}

}  // namespace
}  // namespace sdm
