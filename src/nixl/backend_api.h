// NIXL's backend-plugin API as the plugin sees it: tether's own declarations of the ABI
// (nixl/abi/nixl_backend_abi.h, the default), or the headers of a NIXL source tree when CMake was given
// one (-DTETHER_NIXL_SRC=<tree>, which defines TETHER_NIXL_TREE). Either way nixl/abi/checks.h asserts
// the same sizes and offsets, so a tree whose layout differs from the wheels' fails to compile.
#pragma once
#if defined(TETHER_NIXL_TREE)
#include "backend/backend_plugin.h"
#else
#include "nixl/abi/nixl_backend_abi.h"
#endif
#include "nixl/abi/checks.h"
