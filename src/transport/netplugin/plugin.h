// An NCCL net plugin loaded by path with dlopen. Resolves the highest ABI table the library
// exports (ncclNetPlugin_v9, _v8, _v7) and presents one version-independent call surface: sizes
// are size_t here and checked against the narrower ABI types before they cross.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "tether/status.h"
#include "transport/netplugin/net_abi.h"

namespace tether::transport {

// What tether uses of a device's properties (getProperties).
struct NetDeviceProps {
  std::string name;
  int ptr_support = 0;
  int device_type = netabi::kDeviceHost;
  int device_version = 0;
};

class NetPlugin {
 public:
  // Loads `path` and calls init(). Errors: kUnavailable (missing file, no table, init failed).
  static Result<std::shared_ptr<NetPlugin>> load(const std::string& path);
  ~NetPlugin();
  NetPlugin(const NetPlugin&) = delete;
  NetPlugin& operator=(const NetPlugin&) = delete;

  int abi_version() const { return version_; }   // 7, 8 or 9
  const std::string& name() const { return name_; }
  int devices() const { return ndev_; }
  Result<NetDeviceProps> properties(int dev) const;

  // Thin calls; each returns the plugin's ncclResult_t. Sizes above INT_MAX are refused (kInvalidArgument)
  // for plugins whose ABI carries int.
  int listen(int dev, void* handle, void** listen_comm) const;
  int connect(int dev, void* handle, void** send_comm, netabi::DeviceHandle** dev_comm) const;
  int accept(void* listen_comm, void** recv_comm, netabi::DeviceHandle** dev_comm) const;
  int reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) const;
  int dereg_mr(void* comm, void* mhandle) const;
  int isend(void* send_comm, void* data, size_t size, int tag, void* mhandle, void** request) const;
  // One buffer per receive (maxRecvs grouping is not used by tether).
  int irecv(void* recv_comm, void* data, size_t size, int tag, void* mhandle, void** request) const;
  int test(void* request, int* done, size_t* size) const;
  int irecv_consumed(void* recv_comm, void* request) const;  // no-op when the plugin has none
  bool has_irecv_consumed() const;
  int close_send(void* comm) const;
  int close_recv(void* comm) const;
  int close_listen(void* comm) const;

 private:
  NetPlugin() = default;
  void* lib_ = nullptr;
  int version_ = 0;
  int ndev_ = 0;
  std::string name_;
  const netabi::NetV7* v7_ = nullptr;
  const netabi::NetV8* v8_ = nullptr;
  const netabi::NetV9* v9_ = nullptr;
};

// Human-readable name of an ncclResult_t.
const char* net_result_name(int r);

}  // namespace tether::transport
