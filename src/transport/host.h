// Host: what a transport may ask of the endpoint that owns it — the only view of the core a transport
// has besides the peers it is given (transport::Link). core::EndpointImpl implements it.
#pragma once
#include <atomic>
#include <cstdint>

#include "gpu/staging.h"
#include "tether/config.h"

namespace tether::core {
class RegionRegistry;
}

namespace tether::transport {

// The endpoint's totals, bumped by every transport (EndpointStats).
struct Traffic {
  std::atomic<uint64_t> bytes_sent{0}, bytes_received{0}, chunks_sent{0}, chunks_received{0};
  std::atomic<uint64_t> rejected_requests{0};  // requests refused: unknown region, wrong key, out of range
};

class Host {
 public:
  virtual const Config& config() const = 0;
  // Checks every incoming request against the registered regions (core/region.h).
  virtual core::RegionRegistry& registry() = 0;
  virtual Traffic& traffic() = 0;
  // How staged payloads reach GPU memory (Config::unpack, resolved once).
  virtual gpu::Unpack unpack_mode() const = 0;
  // Progress threads: which one serves a lane (by its NIC), and pinning the calling one to its CPUs.
  virtual uint32_t thread_for_lane(uint32_t lane, int nic, uint32_t earlier_on_nic) const = 0;
  virtual void pin_progress_thread(uint32_t index) const = 0;

 protected:
  ~Host() = default;
};

}  // namespace tether::transport
