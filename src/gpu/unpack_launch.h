// The one copy kernel (kernels.cu: tether_copy_frags), loaded from the embedded fatbin and launched
// from here by everything that uses it: staging's gather/unpack, the netplugin GPU unpack and the
// unpack benchmark. A launch copies n fragments described by a device-resident descriptor block of
// (source, destination, length) u64 triples; one launch per chunk.
#pragma once
#include <cstdint>
#include <string>

#include "gpu/cuda_api.h"
#include "tether/status.h"

namespace tether::gpu {

// The kernel in device `device`'s primary context (loaded on first use), or kUnavailable with why.
Result<CUfunction> copy_kernel(int device);

// Launches tether_copy_frags on `stream` (device `device`'s context must be current) for `n`
// descriptors at `table` (device memory, or pinned mapped host memory); `longest` is the largest
// fragment length, which sizes the grid.
Status launch_copy_frags(int device, CUstream stream, CUdeviceptr table, uint32_t n, uint64_t longest);

}  // namespace tether::gpu
