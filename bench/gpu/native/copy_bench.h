// A probe of how GPU bytes cross between two GPUs (bench/gpu/ipc_probe.py): on `device`'s streams,
// copy `bytes` from `src` to `dst` (unified addresses: this process's memory or another process's,
// opened through CUDA IPC) either with the copy engines (one cuMemcpyAsync per stream's share) or
// with the shared copy kernel over `frag_bytes` fragments whose destinations are shuffled, in
// launches of at most `batch` fragments dealt round-robin over the streams. Wall-clock timing of
// `iters` operations, each submitted and waited for (what a transport's lane pays); every
// destination byte checked after the last.
#pragma once
#include <cstdint>
#include <string>

#include "tether/status.h"

namespace tether::gpu {

struct CopyBenchResult {
  double gbps = 0;          // bytes * iters / wall time
  double us_per_op = 0;     // wall time of one operation, submit to last event
  double submit_us = 0;     // host time to submit one operation
  uint64_t mismatches = 0;  // destination bytes that differ from the expected copy
};

Result<CopyBenchResult> bench_copy(int device, uint64_t src, uint64_t dst, uint64_t bytes, uint64_t frag_bytes,
                                   uint32_t streams, uint32_t batch, uint32_t iters, bool kernel, uint64_t seed);

}  // namespace tether::gpu
