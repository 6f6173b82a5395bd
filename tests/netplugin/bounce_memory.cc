#include "bounce_memory.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>

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

// The CUDA runtime is loaded at run time so the plugin builds and runs on machines without it.
class CudaBounce final : public BounceMemory {
 public:
  CudaBounce(size_t bytes, std::string* error) {
    for (const char* name : {"libcudart.so", "libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0"})
      if ((lib_ = ::dlopen(name, RTLD_NOW | RTLD_LOCAL))) break;
    if (!lib_) { *error = "libcudart not found"; return; }
    malloc_ = reinterpret_cast<int (*)(void**, size_t)>(::dlsym(lib_, "cudaMalloc"));
    free_ = reinterpret_cast<int (*)(void*)>(::dlsym(lib_, "cudaFree"));
    memcpy_ = reinterpret_cast<int (*)(void*, const void*, size_t, int)>(::dlsym(lib_, "cudaMemcpy"));
    if (!malloc_ || !free_ || !memcpy_) { *error = "libcudart lacks cudaMalloc/cudaMemcpy"; return; }
    void* p = nullptr;
    if (malloc_(&p, bytes) != 0) { *error = "cudaMalloc of the bounce buffer failed"; return; }
    base_ = static_cast<uint8_t*>(p), size_ = bytes;
  }
  ~CudaBounce() override {
    if (base_ && free_) free_(base_);
  }
  bool direct() const override { return false; }
  bool copy_in(size_t offset, const void* src, size_t len) override {
    return memcpy_(base_ + offset, src, len, /*cudaMemcpyHostToDevice*/ 1) == 0;
  }
  int ptr_kind() const override { return tether::netabi::kPtrCuda; }

 private:
  void* lib_ = nullptr;
  int (*malloc_)(void**, size_t) = nullptr;
  int (*free_)(void*) = nullptr;
  int (*memcpy_)(void*, const void*, size_t, int) = nullptr;
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

}  // namespace testnet
