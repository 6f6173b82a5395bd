#include "transport/netplugin/plugin.h"

#include <dlfcn.h>

#include <climits>
#include <cstdarg>
#include <cstdio>

namespace tether::transport {

namespace {

// The plugin's own log lines: warnings and worse go to stderr, the rest is dropped (the data path
// logs nothing; a plugin that logs per request would cost more than it tells).
void plugin_logger(int level, unsigned long, const char* file, int line, const char* fmt, ...) {
  if (level < 1 || level > 2) return;
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "tether netplugin: %s (%s:%d)\n", buf, file ? file : "?", line);
}

template <typename P>
NetDeviceProps common_props(const P& p) {
  return NetDeviceProps{p.name ? p.name : "", p.ptr_support, p.net_device_type, p.net_device_version};
}

}  // namespace

const char* net_result_name(int r) {
  switch (r) {
    case netabi::kSuccess: return "success";
    case netabi::kUnhandledCudaError: return "unhandled CUDA error";
    case netabi::kSystemError: return "system error";
    case netabi::kInternalError: return "internal error";
    case netabi::kInvalidArgument: return "invalid argument";
    case netabi::kInvalidUsage: return "invalid usage";
    case netabi::kRemoteError: return "remote error";
    case netabi::kInProgress: return "in progress";
  }
  return "unknown result";
}

Result<std::shared_ptr<NetPlugin>> NetPlugin::load(const std::string& path) {
  if (path.empty()) return Status(Code::kUnavailable, "no net plugin configured (set TETHER_NET_PLUGIN)");
  void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = ::dlerror();
    return Status(Code::kUnavailable, std::string("cannot load net plugin: ") + (e ? e : path));
  }
  std::shared_ptr<NetPlugin> p(new NetPlugin());
  p->lib_ = lib;
  if (auto* t = static_cast<const netabi::NetV9*>(::dlsym(lib, "ncclNetPlugin_v9"))) {
    p->v9_ = t, p->version_ = 9, p->name_ = t->name ? t->name : "";
  } else if (auto* t8 = static_cast<const netabi::NetV8*>(::dlsym(lib, "ncclNetPlugin_v8"))) {
    p->v8_ = t8, p->version_ = 8, p->name_ = t8->name ? t8->name : "";
  } else if (auto* t7 = static_cast<const netabi::NetV7*>(::dlsym(lib, "ncclNetPlugin_v7"))) {
    p->v7_ = t7, p->version_ = 7, p->name_ = t7->name ? t7->name : "";
  } else {
    return Status(Code::kUnavailable, path + " exports no ncclNetPlugin_v7/v8/v9 table (older ABIs lack irecvConsumed)");
  }
  int rc = p->v9_ ? p->v9_->init(plugin_logger) : p->v8_ ? p->v8_->init(plugin_logger) : p->v7_->init(plugin_logger);
  if (rc != netabi::kSuccess)
    return Status(Code::kUnavailable, "net plugin '" + p->name_ + "' init failed: " + net_result_name(rc));
  int n = 0;
  rc = p->v9_ ? p->v9_->devices(&n) : p->v8_ ? p->v8_->devices(&n) : p->v7_->devices(&n);
  if (rc != netabi::kSuccess || n <= 0)
    return Status(Code::kUnavailable, "net plugin '" + p->name_ + "' reports no devices");
  p->ndev_ = n;
  return p;
}

NetPlugin::~NetPlugin() {
  // Plugins start threads and keep global state; unloading one that is still referenced by its own
  // threads would crash at exit, so the library stays mapped (NCCL does the same).
}

Result<NetDeviceProps> NetPlugin::properties(int dev) const {
  if (dev < 0 || dev >= ndev_) return Status(Code::kInvalidArgument, "no such net plugin device");
  NetDeviceProps out;
  int rc;
  if (v9_) {
    netabi::PropertiesV9 p{};
    rc = v9_->get_properties(dev, &p);
    out = common_props(p);
  } else if (v8_) {
    netabi::PropertiesV8 p{};
    rc = v8_->get_properties(dev, &p);
    out = common_props(p);
  } else {
    netabi::PropertiesV7 p{};
    rc = v7_->get_properties(dev, &p);
    out = common_props(p);
  }
  if (rc != netabi::kSuccess) return Status(Code::kUnavailable, std::string("getProperties failed: ") + net_result_name(rc));
  return out;
}

#define DISPATCH(call) (v9_ ? v9_->call : v8_ ? v8_->call : v7_->call)

int NetPlugin::listen(int dev, void* handle, void** listen_comm) const { return DISPATCH(listen(dev, handle, listen_comm)); }
int NetPlugin::connect(int dev, void* handle, void** send_comm, netabi::DeviceHandle** dev_comm) const {
  return DISPATCH(connect(dev, handle, send_comm, dev_comm));
}
int NetPlugin::accept(void* listen_comm, void** recv_comm, netabi::DeviceHandle** dev_comm) const {
  return DISPATCH(accept(listen_comm, recv_comm, dev_comm));
}
int NetPlugin::reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) const {
  if (v7_) {
    if (size > size_t(INT_MAX)) return netabi::kInvalidArgument;
    return v7_->reg_mr(comm, data, int(size), type, mhandle);
  }
  return v9_ ? v9_->reg_mr(comm, data, size, type, mhandle) : v8_->reg_mr(comm, data, size, type, mhandle);
}
int NetPlugin::dereg_mr(void* comm, void* mhandle) const { return DISPATCH(dereg_mr(comm, mhandle)); }
int NetPlugin::isend(void* send_comm, void* data, size_t size, int tag, void* mhandle, void** request) const {
  if (v9_) return v9_->isend(send_comm, data, size, tag, mhandle, request);
  if (size > size_t(INT_MAX)) return netabi::kInvalidArgument;
  return v8_ ? v8_->isend(send_comm, data, int(size), tag, mhandle, request)
             : v7_->isend(send_comm, data, int(size), tag, mhandle, request);
}
int NetPlugin::irecv(void* recv_comm, void* data, size_t size, int tag, void* mhandle, void** request) const {
  void* datas[1] = {data};
  int tags[1] = {tag};
  void* mhandles[1] = {mhandle};
  if (v9_) {
    size_t sizes[1] = {size};
    return v9_->irecv(recv_comm, 1, datas, sizes, tags, mhandles, request);
  }
  if (size > size_t(INT_MAX)) return netabi::kInvalidArgument;
  int sizes[1] = {int(size)};
  return v8_ ? v8_->irecv(recv_comm, 1, datas, sizes, tags, mhandles, request)
             : v7_->irecv(recv_comm, 1, datas, sizes, tags, mhandles, request);
}
int NetPlugin::test(void* request, int* done, size_t* size) const {
  int sizes[1] = {0};
  const int rc = DISPATCH(test(request, done, sizes));
  if (size) *size = sizes[0] < 0 ? 0 : size_t(sizes[0]);
  return rc;
}
bool NetPlugin::has_irecv_consumed() const { return DISPATCH(irecv_consumed) != nullptr; }
int NetPlugin::irecv_consumed(void* recv_comm, void* request) const {
  auto fn = DISPATCH(irecv_consumed);
  return fn ? fn(recv_comm, 1, request) : netabi::kSuccess;
}
int NetPlugin::close_send(void* comm) const { return DISPATCH(close_send(comm)); }
int NetPlugin::close_recv(void* comm) const { return DISPATCH(close_recv(comm)); }
int NetPlugin::close_listen(void* comm) const { return DISPATCH(close_listen(comm)); }

#undef DISPATCH

}  // namespace tether::transport
