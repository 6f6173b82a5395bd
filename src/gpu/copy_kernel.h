// The fragment copy kernel (kernels.cu), loaded per device on first use, and launches of it over
// (src, dst, len) triples. Shared by the staging ring (tcp), the net-plugin unpacker and the ipc
// transport (peer pointers of another process's GPU memory).
#pragma once
#include <cstdint>
#include <string>

#include "gpu/cuda_api.h"
#include "tether/status.h"

namespace tether::gpu {

// Most triples one launch carries (the largest wide parameter block); launch_copy splits beyond.
constexpr uint32_t kCopyFragsPerLaunch = 1344;

// How the triples travel: kAuto picks the compact form (12 bytes a fragment) when every source and
// every destination lies within a 4 GiB window, else the wide one (24); kWide forces it (benchmarks).
enum class CopyForm { kAuto, kWide };

// Status of the kernels on device `device`: ok, or kUnavailable (no nvcc at build time, or a GPU
// architecture missing from the fatbin). Loads them on first use.
Status copy_kernel(int device);

// Copies `n` (src, dst, len) triples read from host memory `triples` (any unified addresses the
// device can reach: its memory, peer GPU memory, mapped pinned host memory) on `stream` of device
// `device`, whose context the caller made current. The triples travel as kernel parameters, so
// `triples` may be reused as soon as this returns. Asynchronous: record an event after it.
Status launch_copy(int device, CUstream stream, const uint64_t* triples, uint32_t n, CopyForm form = CopyForm::kAuto);

// The same for fragments given as 32-bit offsets from two bases (a bounce buffer and a receive
// buffer: the net-plugin unpacker's case), copied straight into the compact parameter block.
struct CopyPiece {
  uint32_t src_off, dst_off, len;
};
Status launch_copy_pieces(int device, CUstream stream, uint64_t src_base, uint64_t dst_base, const CopyPiece* pieces,
                          uint32_t n);

// The same for `n` (src, dst, len) triples the kernel reads itself from `table` (memory the device can
// read: mapped pinned host memory, or its own), each at most `longest` bytes. The launch carries a
// pointer, not the triples: it costs the host what a small launch costs, and `table` must stay as it is
// until the copy has finished. The ipc transport's one-sided batches go this way.
Status launch_copy_table(int device, CUstream stream, CUdeviceptr table, uint32_t n, uint64_t longest);

}  // namespace tether::gpu
