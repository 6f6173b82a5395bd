// tether's own declarations of NIXL's backend-plugin ABI: what libnixl (from NIXL's PyPI wheels, which
// ship no C++ headers) and a backend plugin share. With them the plugin builds from any clone; a NIXL
// source tree can still be used instead (-DTETHER_NIXL_SRC, see nixl/backend_api.h).
//
// The ABI is what the compiled library does, so that is what this file reproduces: the names NIXL gives
// these classes (its type names appear in RTTI), their data members in order, the order of their virtual
// functions, the enum values, and the plugin descriptor that nixl_plugin_init() returns. Nothing here is
// NIXL's text; inline helpers NIXL offers that tether does not use are left out (they are not ABI).
//
// Matches: NIXL 1.4.1 and 1.5.1 (the nixl-cu13 wheels on PyPI) and the headers of NIXL main at 8770b655
// (2026-08-21). Checked (2026-11-28) by
//  - the virtual table of nixlBackendEngine in each wheel's libplugin_UCX.so (readelf relocations + nm):
//    the same 27 slots, in the order below, in both;
//  - libnixl.so's code in both wheels: nixlAgent::createBackend fills nixlBackendInitParams at offsets
//    0/0x20/0x40/0x48/0x50/0x58/0x5c, reads initErr at 0xa0 of the engine and calls supportsRemote at
//    vtable+0x10 and getConnInfo at vtable+0x98; nixlBackendPluginHandle reads the descriptor's
//    functions at 0x08..0x30; the backend loader accepts api_version 1 only;
//  - nixl/abi/checks.h: sizes and offsets, asserted at compile time against this file and against a
//    real NIXL tree; tests/cpp/nixl_abi_test.cc: every virtual's slot; tests/python/test_nixl_abi.py:
//    each installed wheel's slot order, and the plugin's object code built from this file against the
//    same built from a NIXL tree (identical); tests/python/test_nixl.py: transfers through both wheels.
// Requires GCC's libstdc++ with the new std::string ABI (_GLIBCXX_USE_CXX11_ABI=1), as the wheels use.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

// ------------------------------------------------------------------ plain types and enums

// Memory kinds, transfer directions and statuses: int-sized enums with these values.
enum nixl_mem_t { DRAM_SEG = 0, VRAM_SEG = 1, BLK_SEG = 2, OBJ_SEG = 3, FILE_SEG = 4 };
enum nixl_xfer_op_t { NIXL_READ = 0, NIXL_WRITE = 1 };
enum nixl_status_t {
  NIXL_IN_PROG = 1,
  NIXL_SUCCESS = 0,
  NIXL_ERR_NOT_POSTED = -1,
  NIXL_ERR_INVALID_PARAM = -2,
  NIXL_ERR_BACKEND = -3,
  NIXL_ERR_NOT_FOUND = -4,
  NIXL_ERR_MISMATCH = -5,
  NIXL_ERR_NOT_ALLOWED = -6,
  NIXL_ERR_REPOST_ACTIVE = -7,
  NIXL_ERR_UNKNOWN = -8,
  NIXL_ERR_NOT_SUPPORTED = -9,
  NIXL_ERR_REMOTE_DISCONNECT = -10,
  NIXL_ERR_CANCELED = -11,
  NIXL_ERR_NO_TELEMETRY = -12,
};
enum class nixl_thread_sync_t { NIXL_THREAD_SYNC_NONE = 0, NIXL_THREAD_SYNC_STRICT = 1, NIXL_THREAD_SYNC_RW = 2 };
enum class nixl_cost_t { ANALYTICAL_BACKEND = 0 };

using nixl_backend_t = std::string;
using nixl_blob_t = std::string;
using nixl_mem_list_t = std::vector<nixl_mem_t>;
using nixl_b_params_t = std::unordered_map<std::string, std::string>;
using nixl_query_resp_t = std::optional<nixl_b_params_t>;
using nixlMemViewH = void*;
using notif_list_t = std::vector<std::pair<std::string, std::string>>;  // (sending agent, message)

// Only ever passed by pointer across the ABI (estimateXferCost): its layout is not needed here.
struct nixlAgentOptionalArgs;
using nixl_opt_args_t = nixlAgentOptionalArgs;

// ------------------------------------------------------------------ descriptors

// A span of memory: start, length, device (or block/file) id. No virtual functions.
class nixlBasicDesc {
 public:
  uintptr_t addr;
  size_t len;
  uint64_t devId;
};

// A span plus the opaque metadata its backend published (registerMem's input, loadRemoteMD's input).
class nixlBlobDesc : public nixlBasicDesc {
 public:
  nixl_blob_t metaInfo;
};

class nixlBackendMD;

// A span plus the backend's own metadata object for it (what prepXfer/postXfer receive).
class nixlMetaDesc : public nixlBasicDesc {
 public:
  nixlBackendMD* metadataP;
};

// The same with the agent that owns the memory (only named by the memory-view calls).
class nixlRemoteMetaDesc : public nixlMetaDesc {
 public:
  std::string remoteAgent;
};

// A list of descriptors of one memory kind. NIXL's class has three more virtual functions after its
// destructor (resize, addDesc, getIndex), defined inside libnixl; a plugin only reads lists libnixl made,
// so it needs the layout (vtable pointer, kind, vector) and the inline readers, and never makes one.
template <class Desc>
class nixlDescList {
 public:
  nixlDescList(const nixlDescList&) = delete;
  nixlDescList& operator=(const nixlDescList&) = delete;
  virtual ~nixlDescList() = default;

  nixl_mem_t getType() const { return type; }
  int descCount() const { return int(descs.size()); }
  bool isEmpty() const noexcept { return descs.empty(); }
  const Desc& operator[](size_t i) const { return descs[i]; }
  typename std::vector<Desc>::const_iterator begin() const { return descs.begin(); }
  typename std::vector<Desc>::const_iterator end() const { return descs.end(); }

 protected:
  nixl_mem_t type;
  std::vector<Desc> descs;
};

using nixl_meta_dlist_t = nixlDescList<nixlMetaDesc>;
using nixl_remote_meta_dlist_t = nixlDescList<nixlRemoteMetaDesc>;
using nixl_reg_dlist_t = nixlDescList<nixlBlobDesc>;

// ------------------------------------------------------------------ what a backend receives and returns

// postXfer's options: the notification to deliver with the transfer, if any.
struct nixlBackendOptionalArgs {
  nixl_blob_t notifMsg;
  bool hasNotif = false;
  nixl_blob_t customParam;
};
using nixl_opt_b_args_t = nixlBackendOptionalArgs;

// What libnixl hands create_engine.
class nixlBackendInitParams {
 public:
  std::string localAgent;
  nixl_backend_t type;
  nixl_b_params_t* customParams = nullptr;
  bool enableProgTh = false;
  uint64_t pthrDelay = 0;  // microseconds
  nixl_thread_sync_t syncMode;
  bool enableTelemetry_ = false;
};

// Base of a backend's prepared-request handle; libnixl holds it by this type.
class nixlBackendReqH {
 public:
  nixlBackendReqH() = default;
  virtual ~nixlBackendReqH() = default;
};

// Base of a backend's metadata object for a registration (local) or a loaded remote one.
class nixlBackendMD {
 public:
  explicit nixlBackendMD(bool is_private) : isPrivateMD(is_private) {}
  virtual ~nixlBackendMD() = default;

 protected:
  bool isPrivateMD;
};

// One event a backend may queue for NIXL's telemetry (tether queues none).
struct nixlTelemetryEvent {
  uint32_t eventType_;
  uint64_t value_;
};

// ------------------------------------------------------------------ the engine

// The class every backend engine derives from. libnixl reads the data members through inline
// accessors compiled into it (initErr right after create_engine; the type and parameters; the
// telemetry queue under its mutex), and calls the virtual functions by slot: their order below is the
// ABI (slot numbers after the two destructor slots). Defaults of the optional ones are NIXL's answers.
class nixlBackendEngine {
 public:
  explicit nixlBackendEngine(const nixlBackendInitParams* init)
      : backendType(init->type), customParams(*init->customParams), localAgent(init->localAgent),
        enableTelemetry_(init->enableTelemetry_) {}
  nixlBackendEngine(const nixlBackendEngine&) = delete;
  nixlBackendEngine& operator=(const nixlBackendEngine&) = delete;
  virtual ~nixlBackendEngine() = default;  // slots 0, 1

  bool getInitErr() const noexcept { return initErr; }
  const nixl_backend_t& getType() const noexcept { return backendType; }
  const nixl_b_params_t& getCustomParams() const noexcept { return customParams; }

  virtual bool supportsRemote() const = 0;              // 2
  virtual bool supportsLocal() const = 0;               // 3
  virtual bool supportsNotif() const = 0;               // 4
  virtual nixl_mem_list_t getSupportedMems() const = 0;  // 5

  virtual nixl_status_t registerMem(const nixlBlobDesc& mem, const nixl_mem_t& nixl_mem,
                                    nixlBackendMD*& out) = 0;                 // 6
  virtual nixl_status_t deregisterMem(nixlBackendMD* meta) = 0;             // 7
  virtual nixl_status_t connect(const std::string& remote_agent) = 0;       // 8
  virtual nixl_status_t disconnect(const std::string& remote_agent) = 0;    // 9
  virtual nixl_status_t unloadMD(nixlBackendMD* input) = 0;                 // 10
  virtual nixl_status_t prepXfer(const nixl_xfer_op_t& operation, const nixl_meta_dlist_t& local,
                                 const nixl_meta_dlist_t& remote, const std::string& remote_agent,
                                 nixlBackendReqH*& handle,
                                 const nixl_opt_b_args_t* opt_args = nullptr) const = 0;  // 11
  virtual nixl_status_t postXfer(const nixl_xfer_op_t& operation, const nixl_meta_dlist_t& local,
                                 const nixl_meta_dlist_t& remote, const std::string& remote_agent,
                                 nixlBackendReqH*& handle,
                                 const nixl_opt_b_args_t* opt_args = nullptr) const = 0;  // 12
  virtual nixl_status_t checkXfer(nixlBackendReqH* handle) const = 0;        // 13
  virtual nixl_status_t releaseReqH(nixlBackendReqH* handle) const = 0;      // 14

  // Memory views (device-initiated transfers): 15 for remote lists, 16 for local ones, 17 releases.
  virtual nixl_status_t prepMemView(const nixl_remote_meta_dlist_t&, nixlMemViewH&,
                                    const nixl_opt_b_args_t* = nullptr) const {
    return NIXL_ERR_NOT_SUPPORTED;
  }
  virtual nixl_status_t prepMemView(const nixl_meta_dlist_t&, nixlMemViewH&, const nixl_opt_b_args_t* = nullptr) const {
    return NIXL_ERR_NOT_SUPPORTED;
  }
  virtual void releaseMemView(nixlMemViewH) const {}

  // Remote transfers (supportsRemote).
  virtual nixl_status_t getPublicData(const nixlBackendMD*, std::string&) const { return NIXL_ERR_BACKEND; }  // 18
  virtual nixl_status_t getConnInfo(std::string&) const { return NIXL_ERR_BACKEND; }                           // 19
  virtual nixl_status_t loadRemoteConnInfo(const std::string&, const std::string&) { return NIXL_ERR_BACKEND; }  // 20
  virtual nixl_status_t loadRemoteMD(const nixlBlobDesc&, const nixl_mem_t&, const std::string&, nixlBackendMD*&) {
    return NIXL_ERR_BACKEND;  // 21
  }
  // Local transfers (supportsLocal).
  virtual nixl_status_t loadLocalMD(nixlBackendMD*, nixlBackendMD*&) { return NIXL_ERR_BACKEND; }  // 22
  // Notifications (supportsNotif).
  virtual nixl_status_t getNotifs(notif_list_t&) { return NIXL_ERR_BACKEND; }                        // 23
  virtual nixl_status_t genNotif(const std::string&, const std::string&) const { return NIXL_ERR_BACKEND; }  // 24
  // Optional.
  virtual nixl_status_t queryMem(const nixl_reg_dlist_t&, std::vector<nixl_query_resp_t>&) const {
    return NIXL_ERR_NOT_SUPPORTED;  // 25
  }
  virtual nixl_status_t estimateXferCost(const nixl_xfer_op_t&, const nixl_meta_dlist_t&, const nixl_meta_dlist_t&,
                                         const std::string&, nixlBackendReqH* const&, std::chrono::microseconds&,
                                         std::chrono::microseconds&, nixl_cost_t&,
                                         const nixl_opt_args_t* = nullptr) const {
    return NIXL_ERR_NOT_SUPPORTED;  // 26
  }

 private:
  nixl_backend_t backendType;
  nixl_b_params_t customParams;
  std::vector<nixlTelemetryEvent> telemetryEvents_;
  std::mutex telemetryEventsMutex_;

 protected:
  bool initErr = false;
  const std::string localAgent;
  const bool enableTelemetry_;
};

// ------------------------------------------------------------------ the plugin descriptor

// The version libnixl's loader requires of nixlBackendPlugin::api_version (1 since NIXL 1.0).
#define NIXL_PLUGIN_API_VERSION 1
#define NIXL_PLUGIN_EXPORT __attribute__((visibility("default")))

// What nixl_plugin_init() returns: a version, then six functions, in this order.
class nixlBackendPlugin {
 public:
  int api_version;
  nixlBackendEngine* (*create_engine)(const nixlBackendInitParams* init);
  void (*destroy_engine)(nixlBackendEngine* engine);
  const char* (*get_plugin_name)();
  const char* (*get_plugin_version)();
  nixl_b_params_t (*get_backend_options)();
  nixl_mem_list_t (*get_backend_mems)();
};

// The two C entry points libnixl looks up with dlsym.
extern "C" {
NIXL_PLUGIN_EXPORT nixlBackendPlugin* nixl_plugin_init();
NIXL_PLUGIN_EXPORT void nixl_plugin_fini();
}
