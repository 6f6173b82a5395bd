// The unpack microbenchmark (issue 8's performance line): on one GPU, a chunk of shuffled pages in a
// bounce buffer is unpacked to a destination (a) by the shared copy kernel (descriptor upload + one
// launch, as the netplugin unpacker does it), (b) by one cuMemcpyAsync per page (d2d), and (c) the
// same bytes by one contiguous cuMemcpyAsync: the device-to-device copy bandwidth it is held to.
// Each is timed with CUDA events twice: back to back (`stream`: what the host can submit) and one
// operation at a time (`alone`: the GPU's time per operation). Every destination byte is checked.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tether/status.h"

namespace tether::gpu {

struct UnpackBenchRow {
  std::string method;     // "kernel", "d2d" or "contiguous"
  double stream_gbps = 0;  // iters back to back, first event to last
  double alone_gbps = 0;   // sum of per-operation event times, each operation waited for
  uint64_t mismatches = 0; // destination bytes that differ from the expected unpack
};

Result<std::vector<UnpackBenchRow>> bench_unpack(int device, uint64_t chunk_bytes, uint64_t frag_bytes, uint32_t iters,
                                                 uint64_t seed);

}  // namespace tether::gpu
