#include "gpu/cuda_api.h"

#include <dlfcn.h>

#include <cctype>
#include <cstdlib>
#include <mutex>
#include <type_traits>
#include <vector>

#include "sys/env.h"

namespace tether::gpu {
namespace {

struct Loaded {
  CudaApi api{};
  bool ok = false;
  std::string why;
  int devices = 0;
  std::vector<CUcontext> contexts;  // primary context per device, retained for the process
};

template <typename F>
bool bind(void* lib, const char* name, F*& fn, std::string* why) {
  fn = reinterpret_cast<F*>(dlsym(lib, name));
  if (!fn && why->empty()) *why = std::string("libcuda lacks ") + name;
  return fn != nullptr;
}

Loaded& loaded() {
  // Never destroyed: progress threads of an endpoint nobody closed (a NIXL agent leaked at exit) may
  // still use it while the process's statics are torn down.
  static Loaded& l = *new Loaded;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string env = sys::env_text("TETHER_LIBCUDA_SO");
    const char* path = env.empty() ? "libcuda.so.1" : env.c_str();
    void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      l.why = std::string("no CUDA driver (") + path + ": " + dlerror() + ")";
      return;
    }
    CudaApi& a = l.api;
    std::string& w = l.why;
    bind(lib, "cuInit", a.cuInit, &w);
    bind(lib, "cuDriverGetVersion", a.cuDriverGetVersion, &w);
    bind(lib, "cuDeviceGetCount", a.cuDeviceGetCount, &w);
    bind(lib, "cuDeviceGet", a.cuDeviceGet, &w);
    bind(lib, "cuDeviceGetPCIBusId", a.cuDeviceGetPCIBusId, &w);
    bind(lib, "cuDevicePrimaryCtxRetain", a.cuDevicePrimaryCtxRetain, &w);
    bind(lib, "cuCtxSetCurrent", a.cuCtxSetCurrent, &w);
    bind(lib, "cuCtxGetCurrent", a.cuCtxGetCurrent, &w);
    bind(lib, "cuPointerGetAttribute", a.cuPointerGetAttribute, &w);
    bind(lib, "cuMemGetAddressRange_v2", a.cuMemGetAddressRange, &w);
    bind(lib, "cuMemHostAlloc", a.cuMemHostAlloc, &w);
    bind(lib, "cuMemFreeHost", a.cuMemFreeHost, &w);
    bind(lib, "cuMemAlloc_v2", a.cuMemAlloc, &w);
    bind(lib, "cuMemFree_v2", a.cuMemFree, &w);
    bind(lib, "cuStreamCreate", a.cuStreamCreate, &w);
    bind(lib, "cuStreamDestroy_v2", a.cuStreamDestroy, &w);
    bind(lib, "cuStreamSynchronize", a.cuStreamSynchronize, &w);
    bind(lib, "cuEventCreate", a.cuEventCreate, &w);
    bind(lib, "cuEventRecord", a.cuEventRecord, &w);
    bind(lib, "cuEventQuery", a.cuEventQuery, &w);
    bind(lib, "cuEventSynchronize", a.cuEventSynchronize, &w);
    bind(lib, "cuEventDestroy_v2", a.cuEventDestroy, &w);
    bind(lib, "cuMemcpyAsync", a.cuMemcpyAsync, &w);
    bind(lib, "cuMemcpy", a.cuMemcpy, &w);
    bind(lib, "cuModuleLoadData", a.cuModuleLoadData, &w);
    bind(lib, "cuModuleGetFunction", a.cuModuleGetFunction, &w);
    bind(lib, "cuLaunchKernel", a.cuLaunchKernel, &w);
    bind(lib, "cuGetErrorString", a.cuGetErrorString, &w);
    bind(lib, "cuIpcGetMemHandle", a.cuIpcGetMemHandle, &w);
    bind(lib, "cuIpcOpenMemHandle_v2", a.cuIpcOpenMemHandle, &w);
    bind(lib, "cuIpcCloseMemHandle", a.cuIpcCloseMemHandle, &w);
    // Optional (benchmarks only): CUDA 13 names it _v2; older drivers only have the plain one.
    a.cuEventElapsedTime = reinterpret_cast<decltype(a.cuEventElapsedTime)>(dlsym(lib, "cuEventElapsedTime_v2"));
    if (!a.cuEventElapsedTime) a.cuEventElapsedTime = reinterpret_cast<decltype(a.cuEventElapsedTime)>(dlsym(lib, "cuEventElapsedTime"));
    // Optional: the VMM API (sharing memory from cuMemCreate; CudaApi::has_vmm).
    auto maybe = [lib](const char* name, auto& fn) { fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name)); };
    maybe("cuMemRetainAllocationHandle", a.cuMemRetainAllocationHandle);
    maybe("cuMemExportToShareableHandle", a.cuMemExportToShareableHandle);
    maybe("cuMemImportFromShareableHandle", a.cuMemImportFromShareableHandle);
    maybe("cuMemRelease", a.cuMemRelease);
    maybe("cuMemAddressReserve", a.cuMemAddressReserve);
    maybe("cuMemAddressFree", a.cuMemAddressFree);
    maybe("cuMemMap", a.cuMemMap);
    maybe("cuMemUnmap", a.cuMemUnmap);
    maybe("cuMemSetAccess", a.cuMemSetAccess);
    if (!w.empty()) return;  // the library stays loaded: harmless, and unloading CUDA is not
    if (CUresult r = a.cuInit(0); r != kCudaSuccess) {
      w = cuda_error("cuInit", r);
      return;
    }
    if (CUresult r = a.cuDeviceGetCount(&l.devices); r != kCudaSuccess || l.devices == 0) {
      w = r != kCudaSuccess ? cuda_error("cuDeviceGetCount", r) : "the CUDA driver sees no GPU";
      return;
    }
    l.contexts.assign(size_t(l.devices), nullptr);
    for (int d = 0; d < l.devices; ++d) {
      CUdevice dev;
      CUresult r = a.cuDeviceGet(&dev, d);
      if (r == kCudaSuccess) r = a.cuDevicePrimaryCtxRetain(&l.contexts[size_t(d)], dev);
      if (r != kCudaSuccess) {
        w = cuda_error("cuDevicePrimaryCtxRetain", r);
        return;
      }
    }
    l.ok = true;
  });
  return l;
}

// The VMM mapping (cuMemMap) GPU address `p` lies in: false where it has none.
bool mapping_at(const CudaApi* a, CUdeviceptr p, uint64_t* base, uint64_t* len) {
  return a->cuPointerGetAttribute(base, kPointerAttrMappingBase, p) == kCudaSuccess &&
         a->cuPointerGetAttribute(len, kPointerAttrMappingSize, p) == kCudaSuccess;
}

}  // namespace

const CudaApi* cuda(std::string* why) {
  Loaded& l = loaded();
  if (!l.ok && why) *why = l.why;
  return l.ok ? &l.api : nullptr;
}

int device_count() { return cuda() ? loaded().devices : 0; }

std::string cuda_error(const char* call, CUresult r) {
  const char* s = nullptr;
  const CudaApi& a = loaded().api;
  if (a.cuGetErrorString) a.cuGetErrorString(r, &s);
  return std::string(call) + ": " + (s ? s : "CUDA error") + " (" + std::to_string(r) + ")";
}

namespace {
// The calling thread's KeepContext scopes, and the context it had before tether's first switch in them.
thread_local int t_keep_depth = 0;
thread_local bool t_switched = false;
thread_local CUcontext t_before = nullptr;
}  // namespace

Status use_device(int device) {
  // Set every time: the application (torch) may have switched this thread's context meanwhile.
  const CudaApi* a = cuda();
  Loaded& l = loaded();
  if (!a) return Status(Code::kUnavailable, l.why);
  if (device < 0 || device >= l.devices)
    return Status(Code::kInvalidArgument, "GPU " + std::to_string(device) + " does not exist (" +
                                              std::to_string(l.devices) + " visible)");
  if (t_keep_depth > 0 && !t_switched) {  // an application's thread: remember what to hand back
    if (CUresult r = a->cuCtxGetCurrent(&t_before); r != kCudaSuccess)
      return Status(Code::kInternal, cuda_error("cuCtxGetCurrent", r));
    t_switched = true;
  }
  if (CUresult r = a->cuCtxSetCurrent(l.contexts[size_t(device)]); r != kCudaSuccess)
    return Status(Code::kInternal, cuda_error("cuCtxSetCurrent", r));
  return Status::ok();
}

KeepContext::KeepContext() { ++t_keep_depth; }

KeepContext::~KeepContext() {
  if (--t_keep_depth > 0 || !t_switched) return;
  t_switched = false;
  // Only use_device set t_switched, so CUDA is loaded; a failure leaves tether's context current,
  // which is all that could be done anyway.
  (void)loaded().api.cuCtxSetCurrent(t_before);
}

std::string pci_bus_id(int device) {
  const CudaApi* a = cuda();
  CUdevice dev = 0;
  char bus[32] = {};
  if (!a || device < 0 || device >= loaded().devices || a->cuDeviceGet(&dev, device) != kCudaSuccess ||
      a->cuDeviceGetPCIBusId(bus, sizeof bus, dev) != kCudaSuccess)
    return "";
  std::string id = bus;
  for (char& c : id) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (id.find(':') == 8) id = id.substr(4);  // CUDA's 00000000:18:00.0 -> sysfs's 0000:18:00.0
  return id;
}

Result<PointerInfo> pointer_info(const void* ptr) {
  PointerInfo info;
  std::string why;
  const CudaApi* a = cuda(&why);
  if (!a) return info;  // without CUDA every pointer is host memory
  const auto p = reinterpret_cast<CUdeviceptr>(ptr);
  unsigned type = 0;
  if (a->cuPointerGetAttribute(&type, kPointerAttrMemoryType, p) != kCudaSuccess) return info;  // unknown to CUDA: host
  if (type != kMemoryTypeDevice) return info;  // pinned or managed host memory
  info.is_device = true;
  if (CUresult r = a->cuPointerGetAttribute(&info.device, kPointerAttrDeviceOrdinal, p); r != kCudaSuccess)
    return Status(Code::kInternal, cuda_error("cuPointerGetAttribute(DEVICE_ORDINAL)", r));
  size_t size = 0;
  if (Status s = use_device(info.device); !s.is_ok()) return s;
  if (CUresult r = a->cuMemGetAddressRange(&info.alloc_base, &size, p); r != kCudaSuccess) {
    uint64_t len = 0;  // VMM memory: the mapping the pointer lies in
    if (!mapping_at(a, p, &info.alloc_base, &len)) return Status(Code::kInternal, cuda_error("cuMemGetAddressRange", r));
    size = len;
  }
  info.alloc_size = size;
  return info;
}

bool mapped_through(uint64_t at, uint64_t size) {
  const CudaApi* a = cuda();
  if (!a) return false;
  for (uint64_t p = at; p < at + size;) {
    uint64_t base = 0, len = 0;
    if (!mapping_at(a, p, &base, &len) || base > p || base + len <= p) return false;
    p = base + len;
  }
  return true;
}

}  // namespace tether::gpu
