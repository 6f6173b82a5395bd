// Unpack: moving a receive's bytes from where the plugin put them (its bounce pages, or the lane's
// landing area for ordinary plugins) to their destination, fragment by fragment, as the plugin's
// unpack metadata describes them. The receive's pages may be handed back (irecvConsumed) only once
// done() says the copy has completed: the plugin reuses them at once. How each TETHER_UNPACK mode
// copies from host or GPU bounce pages: docs/NETPLUGIN.md, "Receive (unpack)". One unpacker per
// lane, used by the lane's progress thread only; one copy in flight at a time.
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
  // Starts copying `n` fragments bounce[src_off, +len) -> dest[dst_off, +len); dest is memory of GPU
  // `dest_device`, or host memory (-1). The fragments were checked by check_fragments(). Never blocks
  // on the copy (except in host mode); a copy still in flight from the last start() is waited for.
  virtual Status start(const netabi::UnpackEntry* frags, uint64_t n, const uint8_t* bounce, uint8_t* dest,
                       int dest_device) = 0;
  // True once the last start()'s copy has completed (then and only then may its pages be consumed).
  virtual Result<bool> done() = 0;
  // Copies a small message (a frame header) out of the bounce pages into host memory; returns when done.
  virtual Status read(const netabi::UnpackEntry* frags, uint64_t n, const uint8_t* bounce, void* out) = 0;
  // Blocks until the copy in flight (if any) has finished: before the bounce pages or the destination go away.
  virtual void wait() = 0;
};

// The fragments of a receive of `length` bytes must lie inside [0, length) of the destination and
// add up to `length`: a plugin bug must not write outside the checked destination.
Code check_fragments(const netabi::UnpackEntry* frags, uint64_t n, uint64_t length);

// Whether TETHER_UNPACK=`mode` can serve a plugin whose bounce pages are GPU memory (or not):
// kInvalidArgument for a mode that does not exist, kUnavailable for one this machine cannot run.
Status check_unpack_mode(const std::string& mode, bool bounce_on_gpu);

// One lane's unpacker. `bounce` is where its receives land (bounce buffer or landing area): CUDA
// says whether that is GPU memory and of which GPU.
Result<std::unique_ptr<Unpacker>> make_unpacker(const std::string& mode, const void* bounce);

}  // namespace tether::transport
