// Region registry: what this endpoint exposes, and the check every remote access passes
// before a byte is touched (region, key, bounds).
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <shared_mutex>
#include <string>
#include <unordered_map>

#include "tether/endpoint.h"

namespace tether::core {

// A GPU region's allocation exported for other processes (ipc transport), made once at registration.
struct CudaExport {
  bool ok = false;
  uint8_t handle[64] = {};       // CUipcMemHandle of the allocation; VMM memory: what names its pieces
  uint64_t alloc_base = 0, alloc_size = 0;  // VMM memory: the span of the region's mappings
  bool vmm = false;              // memory from the VMM API (cuMemCreate), shared as POSIX fds
  std::shared_ptr<void> owner;   // what the transport exported for it (VMM: the fds), kept with the region
};

struct RegionState {
  uint32_t id = 0;
  uint8_t* base = nullptr;
  uint64_t size = 0;
  MemoryKind kind = MemoryKind::kHost;
  int32_t device = -1;
  bool readonly = false;
  EndpointId endpoint{};
  uint8_t secret[16];              // keys descriptors; never leaves this process
  std::string desc_ext;            // transports' descriptor extensions (wire::encode_offers format)
  CudaExport cuda_export;          // kCuda regions, when the ipc transport could export them
  std::atomic<bool> live{true};
  std::atomic<int32_t> pins{0};    // in-flight remote accesses; deregister waits for zero

  uint64_t key_for(uint64_t offset, uint64_t length) const;
  void unpin() { pins.fetch_sub(1, std::memory_order_release); }
};

class RegionRegistry {
 public:
  explicit RegionRegistry(const EndpointId& endpoint) : endpoint_(endpoint) {}
  Result<Region> add(void* ptr, uint64_t size, MemoryKind kind, int device, bool readonly);
  // Unpublishes the region: no new remote access resolves to it.
  Status unpublish(const Region& region);
  // Waits until every access in flight (remote chunks, local transfers) has let go of it; calls
  // `stalled(elapsed_ms)` every 10 ms while it waits (EndpointImpl::deregister cuts off stalled peers).
  static void wait_unpinned(const Region& region, const std::function<void(int64_t)>& stalled = {});
  // Validates a remote access and pins the region. On success *out is pinned: call unpin().
  Code resolve(uint32_t id, uint64_t key, uint64_t desc_offset, uint64_t desc_length,
               uint64_t offset, uint64_t length, bool write, RegionState** out) const;
  // Pins `region` if it is still published (under the lock unpublish takes: deregister either sees the pin
  // or the caller sees the region gone). A pushed send's chunks take their pins one at a time so.
  bool pin_published(RegionState& region) const;
  // The same, holding the region for as long as the caller keeps *out (pinned as above).
  Code resolve(uint32_t id, uint64_t key, uint64_t desc_offset, uint64_t desc_length, uint64_t offset,
               uint64_t length, bool write, std::shared_ptr<RegionState>* out) const;
  void clear();

 private:
  const std::shared_ptr<RegionState>* pin_checked(uint32_t id, uint64_t key, uint64_t desc_offset,
                                                  uint64_t desc_length, uint64_t offset, uint64_t length, bool write,
                                                  Code* code) const;
  EndpointId endpoint_;
  mutable std::shared_mutex mu_;
  uint32_t next_id_ = 1;
  std::unordered_map<uint32_t, std::shared_ptr<RegionState>> regions_;
};

// Bounds check shared by every operation: [offset, offset+length) within size. Without a branch (the
// difference wraps when offset > size, and the first test fails then): a post checks thousands of blocks.
inline bool in_bounds(uint64_t offset, uint64_t length, uint64_t size) {
  return (offset <= size) & (length <= size - offset);
}

}  // namespace tether::core
