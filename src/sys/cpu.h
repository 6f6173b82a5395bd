// A spin-wait hint: tells the core this thread is polling (lets its sibling hyperthread run, saves power).
#pragma once

namespace tether::sys {

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace tether::sys
