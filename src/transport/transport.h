// The transport interface. A transport moves frames over its channels (lanes) and nothing else:
// it pulls chunks from PeerState::next_chunk() when a lane has room, validates incoming requests
// through the endpoint's RegionRegistry, places payload, and reports answers back to PeerState.
// Chunking, windows, scheduling across lanes, notifications and completion accounting live once
// in the core (src/core/peer.*). Adding a transport is one folder and one line in endpoint.cc.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "tether/status.h"

namespace tether::core {
class PeerState;
}

namespace tether::transport {

struct Caps {
  bool host_memory = false;   // reads/writes host memory directly
  bool cuda_memory = false;   // reads/writes GPU memory directly
  bool one_sided = false;     // target CPU not involved (RDMA)
  bool same_host_only = false;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  virtual Caps caps() const = 0;
  // Takes ownership of a peer's connected, handshaken lane sockets (lane i = fds[i]).
  virtual void attach(const std::shared_ptr<core::PeerState>& peer, const std::vector<int>& fds) = 0;
  // `chunks` new chunks are queued on `peer`; up to that many lanes with room should pull them.
  virtual void wake(core::PeerState* peer, uint64_t chunks) = 0;
  // Called by a thread spinning on a small transfer: read lane `lane` of `peer` now, from the calling
  // thread, if no other thread is reading it (saves waking a progress thread for the answer).
  virtual void poll(core::PeerState* peer, uint32_t lane) = 0;
  // Stops every progress thread; lanes answer what they had in flight with kCancelled.
  virtual void stop() = 0;
};

}  // namespace tether::transport
