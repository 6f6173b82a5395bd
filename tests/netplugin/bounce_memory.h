// Where the test plugin's bounce pages live. Host memory on CPU machines; GPU memory (through the
// dlopen'ed CUDA driver) on the device machine, like GPUDirect-TCPX's devmem page pool.
// TETHER_TESTNET_BOUNCE=host|cuda picks one; TETHER_TESTNET_CUDA_DEVICE (0) the GPU.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace testnet {

class BounceMemory {
 public:
  virtual ~BounceMemory() = default;
  uint8_t* base() const { return base_; }
  size_t size() const { return size_; }
  // True when socket reads may land straight in the pages (host memory).
  virtual bool direct() const = 0;
  // Copies host bytes into the pages (only used when !direct()).
  virtual bool copy_in(size_t offset, const void* src, size_t len) = 0;
  virtual int ptr_kind() const = 0;  // netabi::kPtrHost or kPtrCuda: what the buffer is

 protected:
  uint8_t* base_ = nullptr;
  size_t size_ = 0;
};

// kind: "host" or "cuda". Returns null and sets *error when the kind cannot be had.
std::unique_ptr<BounceMemory> make_bounce_memory(const std::string& kind, size_t bytes, std::string* error);

// Copies `len` bytes of GPU memory to host memory (sends from CUDA buffers: the socket needs host bytes).
bool copy_from_gpu(void* dst, const void* src, size_t len, std::string* error);

}  // namespace testnet
