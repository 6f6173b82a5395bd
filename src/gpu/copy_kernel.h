// The fragment copy kernel (kernels.cu: tether_copy_frags), loaded per device on first use, and one
// launch over a descriptor block of (src, dst, len) triples. Shared by the staging ring (tcp), the
// net-plugin unpacker and the ipc transport (peer pointers of another process's GPU memory).
#pragma once
#include <cstdint>
#include <string>

#include "gpu/cuda_api.h"
#include "tether/status.h"

namespace tether::gpu {

// The kernel in device `device`'s primary context, or kUnavailable (no nvcc at build time, or a GPU
// architecture missing from the fatbin).
Result<CUfunction> copy_kernel(int device);

// Launches the kernel on `stream` (device `device`, whose context the caller made current) over `n`
// triples at `table` (device memory, or memory the device can read); `longest`: the longest length,
// which sizes the grid. Asynchronous: record an event after it.
Status launch_copy(int device, CUstream stream, CUdeviceptr table, uint32_t n, uint64_t longest);

}  // namespace tether::gpu
