// Unpack: moving a receive's bytes from the plugin's bounce pages to their destination, fragment by
// fragment, as the plugin's unpack metadata describes them. The receive's pages may be handed back
// (irecvConsumed) only once done(ticket) says the copy has completed: the plugin reuses them at once.
//
// Modes (TETHER_UNPACK): host (a memcpy per fragment, CPU bounce buffers), and the GPU modes that
// src/gpu provides (issue 4): kernel (one launch per chunk with a descriptor block, done = its CUDA
// event) and d2d (one copy call per fragment). make_unpacker() is the one place that picks.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "tether/endpoint.h"
#include "tether/status.h"
#include "transport/netplugin/net_abi.h"

namespace tether::transport {

class Unpacker {
 public:
  virtual ~Unpacker() = default;
  virtual const char* name() const = 0;
  // Starts copying `n` fragments bounce[src_off, +len) -> dest[dst_off, +len). The fragments were
  // checked by check_fragments(). Fills *ticket; never blocks on the copy.
  virtual Status start(const netabi::UnpackEntry* frags, uint64_t n, const uint8_t* bounce, uint8_t* dest,
                       uint64_t* ticket) = 0;
  // True once the copy of `ticket` has completed (then and only then may the pages be consumed).
  virtual bool done(uint64_t ticket) = 0;
};

// The fragments of a receive of `length` bytes must lie inside [0, length) of the destination and
// add up to `length`: a plugin bug must not write outside the checked destination.
Code check_fragments(const netabi::UnpackEntry* frags, uint64_t n, uint64_t length);

// mode: TETHER_UNPACK ("kernel", "d2d", "host" or ""). Host bounce buffers always get the host copy;
// GPU bounce buffers the GPU modes (kUnavailable until src/gpu provides them here).
Result<std::unique_ptr<Unpacker>> make_unpacker(const std::string& mode, bool bounce_on_gpu);

}  // namespace tether::transport
