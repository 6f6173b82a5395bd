// GPU memory from CUDA's VMM API (cuMemCreate + cuMemMap: torch's expandable segments, most KV-cache
// pools) over ipc. Legacy CUDA IPC handles cannot name it; each physical allocation behind a region is
// exported once, at registration, as a POSIX file descriptor kept open in the exporting process. The
// importer reads the region's table of pieces from the exporter (process_vm_readv), takes each fd with
// pidfd_getfd (both need the same permission as cross-memory attach), and maps every piece at its
// offset into one reserved range of its own: one pointer for the whole region, as with a legacy handle.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "gpu/cuda_api.h"
#include "tether/status.h"

namespace tether::transport::ipc {

#pragma pack(push, 1)
// One physical allocation of an exported region, as the importer reads it from the exporter.
struct VmmPiece {
  uint64_t offset;    // from the span's base
  uint64_t size;      // mapped bytes
  int32_t fd;         // the exporter's fd of it (POSIX shareable handle)
  uint32_t pad;
  uint64_t block_id;  // CUDA's process-wide id of the allocation
};
#pragma pack(pop)
static_assert(sizeof(VmmPiece) == 32);

constexpr uint32_t kMaxVmmPieces = 1 << 16;

// A region's exported pieces; closes their fds when the region goes.
struct VmmExport {
  uint64_t base = 0, size = 0;  // the span of the mappings that cover the region
  std::vector<VmmPiece> pieces;
  uint64_t identity = 0;        // changes when any piece is another allocation
  VmmExport() = default;
  VmmExport(const VmmExport&) = delete;
  VmmExport& operator=(const VmmExport&) = delete;
  ~VmmExport();
};

// Exports the VMM mappings covering [base, base + size): kUnavailable when the memory is not VMM
// memory, was not created shareable as a POSIX fd, or has holes.
Result<std::shared_ptr<VmmExport>> export_vmm(uint64_t base, uint64_t size);

// Another process's region mapped into this one; unmapped and its range freed when destroyed.
struct VmmImport {
  gpu::CUdeviceptr ptr = 0;
  uint64_t size = 0;
  std::vector<VmmPiece> pieces;  // offset and size of each mapping (fds are the exporter's)
  size_t mapped = 0;             // pieces mapped so far
  VmmImport() = default;
  VmmImport(const VmmImport&) = delete;
  VmmImport& operator=(const VmmImport&) = delete;
  ~VmmImport();
};

// Maps `count` pieces described at `table` in process `pid` (a span of `size` bytes) into this process,
// readable and writable by GPU `device`, at one pointer.
Result<std::unique_ptr<VmmImport>> import_vmm(pid_t pid, uint64_t table, uint32_t count, uint64_t size, int device);

}  // namespace tether::transport::ipc
