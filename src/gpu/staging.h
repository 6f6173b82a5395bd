// Staging: pinned host bounce buffers for transports that cannot touch GPU memory, and the copies
// in and out of them. A lane owns one StagingRing for sending and one for receiving; a slot is
// reused only after the copy out of (or into) it has completed — its CUDA event says so (the seeds'
// irecv_consumed rule). A ring's pinned memory is one allocation, made by prepare() (a lane does
// that before its first GPU chunk where it can: pinning costs about a millisecond per MiB) or else at
// the first acquire; nothing here allocates after that, except the ring's stream and the slots'
// events on a new device.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu/cuda_api.h"
#include "gpu/slot_runs.h"
#include "tether/status.h"

namespace tether::gpu {

// How received bytes reach scattered destinations (TETHER_UNPACK / Config::unpack).
enum class Unpack : uint8_t {
  kKernel,  // one kernel launch per chunk over its fragments (descriptors travel in the launch)
  kD2D,     // one async copy per fragment
  kHost,    // synchronous copies through host memory (debugging)
};
Result<Unpack> parse_unpack(const std::string& name);  // "" = the best available
const char* unpack_name(Unpack u);
bool kernels_available(std::string* why = nullptr);   // built with nvcc and loadable on this GPU

// One piece of a staged chunk: `length` bytes at `offset` inside the slot <-> `ptr` elsewhere.
struct Fragment {
  uint64_t offset = 0;
  uint8_t* ptr = nullptr;
  uint64_t length = 0;
};

struct StagingSlot {
  uint8_t* host = nullptr;     // pinned, `capacity` bytes, mapped into every GPU's address space
  uint64_t capacity = 0;
  int device = -1;             // device of the copy in flight
  struct PerDevice {
    CUevent event = nullptr;   // set once the slot is ready on this device (the copies run on the ring's stream)
  };
  std::vector<PerDevice> per_device;
  std::unique_ptr<uint64_t[]> table;  // (src, dst, len) triples of the kernel launch, built here
};

class StagingRing {
 public:
  // `slots` buffers of `capacity` bytes, allocated by prepare(); fragments per chunk at most `max_fragments`.
  StagingRing(uint32_t slots, uint64_t capacity, uint32_t max_fragments);
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  // Pins every slot's buffer (one allocation) and readies the ring's stream and each slot's event on
  // `device`.
  // Idempotent; acquire() calls it, so calling it ahead only moves the cost out of the first transfer.
  Status prepare(int device);
  // A free slot for a copy on `device`, or null when every slot is busy (retry once one is released).
  // With `span` > 1, that many adjacent free slots as one buffer of span_for()'s bytes (the first's
  // event marks it).
  Result<StagingSlot*> acquire(int device, uint32_t span = 1);
  // Adjacent slots a buffer of `bytes` takes (at least 1).
  uint32_t span_for(uint64_t bytes) const { return bytes <= stride() ? 1 : uint32_t((bytes + stride() - 1) / stride()); }
  // Copies GPU fragments (ptr = GPU source) into `slot` (device `device`), asynchronously.
  Status pack(StagingSlot* slot, int device, const Fragment* frags, uint32_t n, Unpack mode);
  // Copies the slot's bytes out to fragments (ptr = destination on `device`), asynchronously.
  Status unpack(StagingSlot* slot, int device, const Fragment* frags, uint32_t n, Unpack mode);
  // True once the copy issued on `slot` has finished (CUDA event); errors are reported as Status.
  Result<bool> done(StagingSlot* slot);
  // Frees the slot (its whole run) once its copy has finished and its bytes are no longer needed.
  void release(StagingSlot* slot) {
    runs_.give(uint32_t(slot - slots_.data()));
    slot->device = -1;
  }
  uint32_t max_fragments() const { return max_fragments_; }
  // Blocks until every copy issued on this ring has finished (before memory they touch goes away).
  void wait_all();
  bool has_free(uint32_t span = 1) const { return runs_.find(span) >= 0; }
  uint32_t peak() const { return runs_.peak(); }  // the most slots held at once so far

 private:
  Status ready(StagingSlot& s, int device);
  uint64_t stride() const { return (capacity_ + 4095) & ~uint64_t(4095); }  // bytes between slots' buffers
  Status copy(StagingSlot& s, int device, const Fragment* frags, uint32_t n, Unpack mode, bool to_slot);
  Result<CUdeviceptr> scratch_for(int device, uint64_t bytes);

  uint32_t max_fragments_;
  uint64_t capacity_;
  std::vector<StagingSlot> slots_;
  SlotRuns runs_;  // which slots are taken (a copy in flight or bytes still needed), in runs
  uint8_t* block_ = nullptr;  // every slot's buffer, one pinned allocation
  // One stream per device for the whole ring: a lane's copies run in the order it issued them, so its
  // first chunk is done first instead of sharing the copy engine with the lane's later ones.
  std::vector<CUstream> streams_;
  // Per device, the scratch buffer of kernel-mode copies (scratch_for).
  struct Scratch {
    CUdeviceptr ptr = 0;
    uint64_t bytes = 0;
    bool refused = false;  // cuMemAlloc found no room: this ring's kernel-mode copies on the device go direct
  };
  std::vector<Scratch> scratch_;
};

}  // namespace tether::gpu
