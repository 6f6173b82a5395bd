// The layout libnixl expects of what it shares with a backend plugin, as numbers read from the NIXL
// 1.4.1 and 1.5.1 wheels (nixl_backend_abi.h says how). Compiled with whichever declarations the
// plugin builds against — tether's own or a NIXL source tree's — so either one that drifts from what
// the wheels do fails the build here instead of corrupting memory inside NIXL. Virtual-function order
// cannot be asserted at compile time: tests/cpp/nixl_abi_test.cc checks it.
#pragma once
#include <cstddef>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#if !defined(__GLIBCXX__) || !_GLIBCXX_USE_CXX11_ABI
#error "the NIXL plugin needs libstdc++ with the new std::string ABI (_GLIBCXX_USE_CXX11_ABI=1), as NIXL's wheels use"
#endif

namespace tether::nixl::abi {

// The std types inside NIXL's classes, as libstdc++ lays them out on x86-64 and aarch64.
static_assert(sizeof(void*) == 8, "the NIXL plugin is built for 64-bit targets only");
static_assert(sizeof(std::string) == 32 && sizeof(std::vector<int>) == 24 && sizeof(std::mutex) == 40 &&
              sizeof(std::unordered_map<std::string, std::string>) == 56);

static_assert(sizeof(nixl_mem_t) == 4 && sizeof(nixl_xfer_op_t) == 4 && sizeof(nixl_status_t) == 4);
static_assert(DRAM_SEG == 0 && VRAM_SEG == 1 && BLK_SEG == 2 && OBJ_SEG == 3 && FILE_SEG == 4);
static_assert(NIXL_READ == 0 && NIXL_WRITE == 1);
static_assert(NIXL_IN_PROG == 1 && NIXL_SUCCESS == 0 && NIXL_ERR_NOT_POSTED == -1 && NIXL_ERR_INVALID_PARAM == -2 &&
              NIXL_ERR_BACKEND == -3 && NIXL_ERR_NOT_FOUND == -4 && NIXL_ERR_MISMATCH == -5 &&
              NIXL_ERR_NOT_ALLOWED == -6 && NIXL_ERR_REPOST_ACTIVE == -7 && NIXL_ERR_UNKNOWN == -8 &&
              NIXL_ERR_NOT_SUPPORTED == -9 && NIXL_ERR_REMOTE_DISCONNECT == -10 && NIXL_ERR_CANCELED == -11);
static_assert(NIXL_PLUGIN_API_VERSION == 1, "libnixl 1.4.1 and 1.5.1 load plugins of API version 1 only");

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"  // classes with virtual functions: GCC's layout is the ABI

// Descriptors.
static_assert(sizeof(nixlBasicDesc) == 24 && offsetof(nixlBasicDesc, addr) == 0 && offsetof(nixlBasicDesc, len) == 8 &&
              offsetof(nixlBasicDesc, devId) == 16);
static_assert(sizeof(nixlBlobDesc) == 56 && offsetof(nixlBlobDesc, metaInfo) == 24);
static_assert(sizeof(nixlMetaDesc) == 32 && offsetof(nixlMetaDesc, metadataP) == 24);

struct MetaListLayout : nixl_meta_dlist_t {
  static constexpr size_t type_at() { return offsetof(MetaListLayout, type); }
  static constexpr size_t descs_at() { return offsetof(MetaListLayout, descs); }
};
static_assert(sizeof(nixl_meta_dlist_t) == 40 && MetaListLayout::type_at() == 8 && MetaListLayout::descs_at() == 16);

// What create_engine and postXfer receive.
static_assert(sizeof(nixlBackendInitParams) == 96 && offsetof(nixlBackendInitParams, localAgent) == 0 &&
              offsetof(nixlBackendInitParams, type) == 32 && offsetof(nixlBackendInitParams, customParams) == 64 &&
              offsetof(nixlBackendInitParams, enableProgTh) == 72 && offsetof(nixlBackendInitParams, pthrDelay) == 80 &&
              offsetof(nixlBackendInitParams, syncMode) == 88 && offsetof(nixlBackendInitParams, enableTelemetry_) == 92);
static_assert(sizeof(nixl_opt_b_args_t) == 72 && offsetof(nixl_opt_b_args_t, notifMsg) == 0 &&
              offsetof(nixl_opt_b_args_t, hasNotif) == 32 && offsetof(nixl_opt_b_args_t, customParam) == 40);

// Base classes of what a backend hands back.
static_assert(sizeof(nixlBackendReqH) == 8 && sizeof(nixlBackendMD) == 16);

// The engine: libnixl reads initErr at 0xa0 right after create_engine.
struct EngineLayout : nixlBackendEngine {
  static constexpr size_t init_err_at() { return offsetof(EngineLayout, initErr); }
  static constexpr size_t local_agent_at() { return offsetof(EngineLayout, localAgent); }
  static constexpr size_t telemetry_at() { return offsetof(EngineLayout, enableTelemetry_); }
};
static_assert(sizeof(nixlBackendEngine) == 208 && EngineLayout::init_err_at() == 0xa0 &&
              EngineLayout::local_agent_at() == 0xa8 && EngineLayout::telemetry_at() == 0xc8);

// The descriptor nixl_plugin_init() returns.
static_assert(sizeof(nixlBackendPlugin) == 56 && offsetof(nixlBackendPlugin, api_version) == 0 &&
              offsetof(nixlBackendPlugin, create_engine) == 8 && offsetof(nixlBackendPlugin, destroy_engine) == 16 &&
              offsetof(nixlBackendPlugin, get_plugin_name) == 24 && offsetof(nixlBackendPlugin, get_plugin_version) == 32 &&
              offsetof(nixlBackendPlugin, get_backend_options) == 40 && offsetof(nixlBackendPlugin, get_backend_mems) == 48);

#pragma GCC diagnostic pop

}  // namespace tether::nixl::abi
