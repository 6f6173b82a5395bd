// Names the calling thread ("tether-tcp3"), so top -H, perf and /proc/PID/task/TID/comm tell tether's
// threads apart (bench/tools/thread_cpu.py sums CPU time by these names).
#pragma once

#include <pthread.h>

#include <cstdio>

namespace tether::sys {

inline void name_this_thread(const char* role, int index = -1) {
  char name[32];
  if (index >= 0) std::snprintf(name, sizeof name, "tether-%s%d", role, index);
  else std::snprintf(name, sizeof name, "tether-%s", role);
  name[15] = '\0';  // the kernel keeps 15 characters
  pthread_setname_np(pthread_self(), name);
}

}  // namespace tether::sys
