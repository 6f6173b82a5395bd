// GPU memory over ipc: CUDA IPC handles, the other side's allocations opened once and cached, and
// each lane's CUDA streams. A GPU chunk names the initiator's bytes as (allocation handle, offset);
// the side that copies opens that allocation once per peer and copies with cuMemcpyAsync (copy
// engines, over NVLink between GPUs) or, for a batch of small blocks, one copy-kernel launch over
// peer pointers. See docs/ARCHITECTURE.md, "Same host: the ipc transport".
#pragma once
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "core/region.h"
#include "gpu/cuda_api.h"
#include "transport/ipc/vmm.h"
#include "tether/status.h"

namespace tether::transport::ipc {

#pragma pack(push, 1)
// One allocation of the process that sends it, as another process can open it.
struct CudaRef {
  uint8_t handle[64];  // CUipcMemHandle of the allocation (kVmm: VmmName)
  uint64_t base;       // its address in the sender: the cache key
  uint64_t size;       // its size: every offset and length is checked against the opened mapping
  int32_t device;      // the sender's ordinal of its GPU (a hint for where to open it)
  uint32_t kind;       // kIpcHandle, or kVmm: VMM memory (vmm.h), every piece behind the span
};
// A VMM region's pieces, as a CudaRef's handle names them: where the sender's table of VmmPiece lies
// and how many; `identity` changes when any piece is another allocation (the cache reopens).
struct VmmName {
  uint64_t table;
  uint32_t count, pad;
  uint64_t identity;
  uint8_t zero[40];
};
#pragma pack(pop)
static_assert(sizeof(CudaRef) == 88 && sizeof(VmmName) == 64);
constexpr uint32_t kIpcHandle = 0, kVmm = 1;

// Exports a GPU region at registration: the handle of the allocation it lies in, or for VMM memory
// its pieces (vmm.h); once per region.
Status export_region(core::RegionState& region);
// The region's export as a CudaRef; false when it has none (host memory, or the export failed).
bool region_ref(const core::RegionState& region, CudaRef* out);

// One allocation of the other process, opened in this process; closed when its last user lets go.
struct Mapping {
  uint8_t handle[64];
  uint64_t remote_base = 0, size = 0;
  gpu::CUdeviceptr ptr = 0;
  int device = -1;  // the context it was opened in; copies touching it run on this GPU's streams
  bool opened = false;  // false: the other side is this very process (two endpoints), ptr is its own
  std::unique_ptr<VmmImport> vmm;  // VMM memory: the mapped pieces (ptr is theirs), unmapped with it
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping();
};

// The other side's allocations (VMM: regions' spans) this side opened, by their base there. Each is
// opened once and kept until the other side deregisters it (forget), the peer goes (this object is
// destroyed), or the same base arrives with a different handle (the allocation was freed and another
// took its place): then the old mapping is closed once the copies still using it are done.
class CudaImports {
 public:
  CudaImports(pid_t pid, std::atomic<uint64_t>* opens) : pid_(pid), opens_(opens) {}
  // The mapping of `ref`'s allocation. `prefer`: the GPU the copy would best run on (used when the
  // first allocation of that GPU of the other process is opened; later ones follow it).
  Result<std::shared_ptr<Mapping>> get(const CudaRef& ref, int prefer);
  // The other side deregistered the memory `ref` names: drop our mapping of it (if it is that one).
  void forget(const CudaRef& ref);

 private:
  pid_t pid_;
  std::atomic<uint64_t>* opens_;
  std::mutex mu_;  // held for the lookup only, never across a CUDA call
  // Keyed by base (legacy handles: one allocation per base at a time, a new handle replaces the old)
  // and, for VMM memory, also by size: regions that start in the same piece are different spans.
  using Key = std::pair<uint64_t, uint64_t>;
  static Key key(const CudaRef& ref) { return {ref.base, ref.kind == kVmm ? ref.size : 0}; }
  // Whether `m` is the mapping of what `ref` names (same size, kind and handle): else it was freed there.
  static bool names(const Mapping& m, const CudaRef& ref);
  std::map<Key, std::shared_ptr<Mapping>> by_base_;
  // Forgotten mappings a copy may still hold: CUDA refuses to open a handle twice in one context, so
  // a chunk for the same allocation arriving meanwhile takes the live mapping back instead.
  std::map<Key, std::weak_ptr<Mapping>> forgotten_;
};

// One lane's CUDA resources, used by its thread only: a stream and event per GPU (created on first
// use), a pinned bounce buffer for host bytes on their way to or from a GPU.
class CudaLane {
 public:
  CudaLane() = default;
  CudaLane(const CudaLane&) = delete;
  CudaLane& operator=(const CudaLane&) = delete;
  ~CudaLane();
  // Copies `len` bytes (unified addresses: any direction) on `device`'s stream and waits for them.
  Status copy(int device, gpu::CUdeviceptr dst, gpu::CUdeviceptr src, uint64_t len);
  // The same copy, not waited for: done() says when it has finished, wait() waits for it (one copy in
  // flight per device).
  Status start(int device, gpu::CUdeviceptr dst, gpu::CUdeviceptr src, uint64_t len);
  Result<bool> done(int device);
  Status wait(int device);
  // `n` (src, dst, len) triples: one kernel launch when `kernel`, else one async copy each; waits.
  Status copy_many(int device, const uint64_t* triples, uint32_t n, bool kernel);
  // Pinned host memory for kMaxBatch (src, dst, len) triples that the GPUs read themselves, made on
  // first use: write it only while none of this lane's copies is in flight.
  Result<uint64_t*> table();
  // The first `n` triples of table(), each at most `longest` bytes, in one kernel launch that reads them
  // (gpu::launch_copy_table), not waited for (done() and wait() as for start()).
  Status start_table(int device, uint32_t n, uint64_t longest);
  // Pinned host memory of at least `bytes` (allocated on first use, grown rarely).
  Result<uint8_t*> bounce(uint64_t bytes);

 private:
  struct Dev {
    gpu::CUstream stream = nullptr;
    gpu::CUevent event = nullptr;
  };
  Result<Dev*> ready(int device);
  Status finish(Dev& d, const char* what);

  std::vector<Dev> devs_;
  uint8_t* bounce_ = nullptr;
  uint64_t bounce_size_ = 0;
  uint64_t* table_ = nullptr;
};

// Fragments in one ipc kWriteBatch, copied by one kernel launch: 4,096 blocks of 16 KiB go as four
// batches on four lanes (with tcp's 128, as 32 launches each waited for: docs/PERFORMANCE.md, "Same host: ipc, GPU memory").
constexpr uint32_t kMaxBatch = 1024;

}  // namespace tether::transport::ipc
