// Environment knobs read once, at first use (a static initialised from these).
#pragma once

#include <cstdlib>
#include <cstring>

namespace tether::sys {

// Whether the environment variable `name` is set to exactly `value`.
inline bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v && std::strcmp(v, value) == 0;
}

}  // namespace tether::sys
