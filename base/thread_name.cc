#include "base/thread_name.h"

#include <pthread.h>

#include <string>

namespace sdm {

void SetCurrentThreadName(absl::string_view name) {
#if defined(__linux__)
  // pthread_setname_np refuses (ERANGE) a name of more than 15 bytes instead of cutting it.
  const std::string cut(name.substr(0, 15));
  pthread_setname_np(pthread_self(), cut.c_str());
#else
  (void)name;
#endif
}

}  // namespace sdm
