#include "bounce_memory.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "transport/netplugin/net_abi.h"

namespace testnet {

namespace {

class HostBounce final : public BounceMemory {
 public:
  explicit HostBounce(size_t bytes) {
    void* p = nullptr;
    if (::posix_memalign(&p, 4096, bytes) == 0) base_ = static_cast<uint8_t*>(p), size_ = bytes;
  }
  ~HostBounce() override { std::free(base_); }
  bool direct() const override { return true; }
  bool copy_in(size_t offset, const void* src, size_t len) override {
    std::memcpy(base_ + offset, src, len);
    return true;
  }
  int ptr_kind() const override { return tether::netabi::kPtrHost; }
};

// The CUDA driver API, loaded at run time (libcuda.so.1 is on the loader path wherever a GPU driver
// is) so the plugin builds and runs on machines without CUDA. Every call first makes the plugin's
// device's primary context current: the caller's thread may have any context, or none.
struct Cuda {
  using Ctx = void*;
  int (*init)(unsigned) = nullptr;
  int (*device_get)(int*, int) = nullptr;
  int (*retain)(Ctx*, int) = nullptr;
  int (*set_current)(Ctx) = nullptr;
  int (*mem_alloc)(uint64_t*, size_t) = nullptr;
  int (*mem_free)(uint64_t) = nullptr;
  int (*htod)(uint64_t, const void*, size_t) = nullptr;
  int (*dtoh)(void*, uint64_t, size_t) = nullptr;
  int (*stream_sync)(void*) = nullptr;
  Ctx ctx = nullptr;
  std::string error;

  Cuda() {
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) { error = "libcuda.so.1 not found"; return; }
    init = reinterpret_cast<decltype(init)>(::dlsym(lib, "cuInit"));
    device_get = reinterpret_cast<decltype(device_get)>(::dlsym(lib, "cuDeviceGet"));
    retain = reinterpret_cast<decltype(retain)>(::dlsym(lib, "cuDevicePrimaryCtxRetain"));
    set_current = reinterpret_cast<decltype(set_current)>(::dlsym(lib, "cuCtxSetCurrent"));
    mem_alloc = reinterpret_cast<decltype(mem_alloc)>(::dlsym(lib, "cuMemAlloc_v2"));
    mem_free = reinterpret_cast<decltype(mem_free)>(::dlsym(lib, "cuMemFree_v2"));
    htod = reinterpret_cast<decltype(htod)>(::dlsym(lib, "cuMemcpyHtoD_v2"));
    dtoh = reinterpret_cast<decltype(dtoh)>(::dlsym(lib, "cuMemcpyDtoH_v2"));
    stream_sync = reinterpret_cast<decltype(stream_sync)>(::dlsym(lib, "cuStreamSynchronize"));
    if (!init || !device_get || !retain || !set_current || !mem_alloc || !mem_free || !htod || !dtoh || !stream_sync) {
      error = "libcuda.so.1 lacks a driver call the plugin needs";
      return;
    }
    const char* d = std::getenv("TETHER_TESTNET_CUDA_DEVICE");
    const int ordinal = d && *d ? std::atoi(d) : 0;
    int dev = 0;
    int rc = init(0);
    if (rc == 0) rc = device_get(&dev, ordinal);
    if (rc == 0) rc = retain(&ctx, dev);
    if (rc != 0) {
      error = "CUDA init of device " + std::to_string(ordinal) + " failed (CUresult " + std::to_string(rc) + ")";
      ctx = nullptr;
    }
  }
  bool ok() const { return ctx != nullptr; }
  bool current() const { return set_current(ctx) == 0; }
};

Cuda& cuda() {
  static Cuda c;  // thread-safe static init; the plugin never unloads CUDA
  return c;
}

class CudaBounce final : public BounceMemory {
 public:
  CudaBounce(size_t bytes, std::string* error) {
    Cuda& c = cuda();
    if (!c.ok()) { *error = c.error; return; }
    uint64_t p = 0;
    if (!c.current() || c.mem_alloc(&p, bytes) != 0) { *error = "cuMemAlloc of the bounce buffer failed"; return; }
    base_ = reinterpret_cast<uint8_t*>(p), size_ = bytes;
  }
  ~CudaBounce() override {
    if (base_ && cuda().current()) cuda().mem_free(reinterpret_cast<uint64_t>(base_));
  }
  bool direct() const override { return false; }
  // A copy from pageable memory may return before its DMA has landed: wait for the default stream,
  // so the pages hold the bytes when test() reports the receive done (as a NIC's devmem write would).
  bool copy_in(size_t offset, const void* src, size_t len) override {
    Cuda& c = cuda();
    return c.current() && c.htod(reinterpret_cast<uint64_t>(base_ + offset), src, len) == 0 && c.stream_sync(nullptr) == 0;
  }
  int ptr_kind() const override { return tether::netabi::kPtrCuda; }
};

}  // namespace

std::unique_ptr<BounceMemory> make_bounce_memory(const std::string& kind, size_t bytes, std::string* error) {
  std::unique_ptr<BounceMemory> m;
  if (kind == "cuda") {
    m = std::make_unique<CudaBounce>(bytes, error);
  } else if (kind.empty() || kind == "host") {
    m = std::make_unique<HostBounce>(bytes);
    if (!m->base()) *error = "bounce buffer allocation failed";
  } else {
    *error = "unknown TETHER_TESTNET_BOUNCE '" + kind + "' (host or cuda)";
    return nullptr;
  }
  if (!m->base()) return nullptr;
  return m;
}

bool copy_from_gpu(void* dst, const void* src, size_t len, std::string* error) {
  Cuda& c = cuda();
  if (!c.ok()) { *error = c.error; return false; }
  if (!c.current() || c.dtoh(dst, reinterpret_cast<uint64_t>(src), len) != 0) {
    *error = "cuMemcpyDtoH from a CUDA send buffer failed";
    return false;
  }
  return true;
}

}  // namespace testnet
