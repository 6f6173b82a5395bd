// The unpack microbenchmark (is unpacking fast enough to stay off the netplugin's critical path?): on one GPU, a chunk of shuffled pages in a
// bounce buffer is unpacked to a destination (a) by the shared copy kernel (one launch carrying the
// descriptors: `kernel` as the netplugin unpacker does it, 32-bit offsets from the bounce buffer and
// the destination; `kernel-wide` with 64-bit (src, dst, len) triples; `kernel-table` reading the
// triples from mapped pinned memory itself, nothing copied on the host: the ipc batches' form), (b) by one cuMemcpyAsync per page (d2d), and (c) the same bytes by
// one contiguous cuMemcpyAsync: the device-to-device copy bandwidth it is held to. Each is timed with
// CUDA events twice: back to back (`stream`) and one operation at a time (`alone`); `host_us` is the
// host's time to submit one operation in the back-to-back loop (above the GPU's time per operation,
// the host sets the pace). Every destination byte is checked.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tether/status.h"

namespace tether::gpu {

struct UnpackBenchRow {
  std::string method;     // "kernel", "kernel-wide", "kernel-table", "d2d" or "contiguous"
  double stream_gbps = 0;  // iters back to back, first event to last
  double alone_gbps = 0;   // sum of per-operation event times, each operation waited for
  double host_us = 0;      // host time to submit one operation, back to back
  uint64_t mismatches = 0; // destination bytes that differ from the expected unpack
};

Result<std::vector<UnpackBenchRow>> bench_unpack(int device, uint64_t chunk_bytes, uint64_t frag_bytes, uint32_t iters,
                                                 uint64_t seed);

}  // namespace tether::gpu
