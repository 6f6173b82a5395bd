// Staging for the fabric transport, where libfabric cannot touch a region itself: device memory
// on a provider without FI_HMEM (and host memory under the TETHER_FABRIC_STAGE_HOST test knob).
// Bytes go through registered bounce memory, and the copies in and out of it are generic: memcpy
// for host memory (done at once), cuMemcpyAsync plus a CUDA event for device memory, so the same
// code runs on a machine without a GPU (tests) and with one. Owned by one thread; nothing
// allocates after first use.
#pragma once
#include <cstdint>
#include <vector>

#include "gpu/cuda_api.h"
#include "tether/status.h"
#include "transport/fabric/rail.h"

namespace tether::transport::fabric {

// Up to `ids` copies in flight, one per id (a staging slot, a bounce buffer).
class Copier {
 public:
  explicit Copier(uint32_t ids) : ids_(ids), device_(ids, -1) {}
  ~Copier() { wait_all(); }
  Copier(const Copier&) = delete;
  Copier& operator=(const Copier&) = delete;
  // device < 0: both ends are host memory, copied before this returns. Else one end is memory of
  // GPU `device`: queued on this owner's stream for that GPU, finished when done(id) says so.
  Status start(uint32_t id, void* dst, const void* src, uint64_t n, int device);
  // True once id's copy has finished; an error if CUDA reported one (the bytes are not in place).
  Result<bool> done(uint32_t id);
  void wait_all();  // before memory a copy touches goes away

 private:
  uint32_t ids_;
  std::vector<int> device_;              // GPU of id's last copy, -1 none
  std::vector<gpu::CUstream> streams_;   // per GPU, created on first use
  std::vector<gpu::CUevent> events_;     // [gpu * ids + id], created on first use
};

// `slots` buffers of `bytes`, registered on one rail once. Pinned (page-locked, portable) when
// allocated for a GPU, so cuMemcpyAsync is a DMA; plain page-aligned memory otherwise.
class StageMem {
 public:
  StageMem() = default;
  ~StageMem() { release(); }
  StageMem(const StageMem&) = delete;
  StageMem& operator=(const StageMem&) = delete;
  bool ready() const { return base_ != nullptr; }
  // First use: allocate and register. `device` >= 0: pin it (CUDA context of that GPU).
  Status allocate(Rail& rail, uint32_t slots, uint64_t bytes, int device);
  // Deregisters (while the rail lives) and frees. Copies into it must have finished.
  void release();
  uint8_t* at(uint32_t slot) const { return base_ + uint64_t(slot) * bytes_; }
  void* desc() const { return mr_.desc; }
  uint64_t bytes() const { return bytes_; }
  // A free slot, or -1. Slots are handed out in turn so their copies overlap.
  int acquire() {
    for (uint32_t i = 0; i < slots_; ++i) {
      const uint32_t s = (next_ + i) % slots_;
      if (!busy_[s]) {
        busy_[s] = 1;
        next_ = s + 1;
        return int(s);
      }
    }
    return -1;
  }
  void free_slot(int s) { if (s >= 0) busy_[size_t(s)] = 0; }

 private:
  Rail* rail_ = nullptr;
  RailMr mr_;
  uint8_t* base_ = nullptr;
  bool pinned_ = false;
  uint32_t slots_ = 0, next_ = 0;
  uint64_t bytes_ = 0;
  std::vector<uint8_t> busy_;
};

}  // namespace tether::transport::fabric
