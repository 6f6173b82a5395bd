// TCP transport: kernel sockets driven by progress threads (internals: tcp_lane.h). Each lane takes
// chunks only when its socket has drained what it had, so a slow socket carries proportionally less.
// Payload is received straight into the destination region; headers and small frames go through a
// per-lane buffer.
#pragma once
#include <atomic>
#include <memory>
#include <vector>

#include "transport/transport.h"

namespace tether::transport {

class Host;
namespace tcp {
class ProgressThread;
}

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(Host* host);
  ~TcpTransport() override;
  const char* name() const override { return "tcp"; }
  Caps caps() const override;
  uint32_t lanes_for(std::string_view remote_offer) const override;
  Status attach(const std::shared_ptr<Link>& peer, const std::vector<int>& tcp_fds,
                std::string_view remote_offer, bool initiator, int64_t deadline_ms) override;
  // GPU memory registered: lanes prepare their staging for that GPU ahead of its first transfer.
  Status register_region(core::RegionState& region, std::string* desc_ext) override;
  void wake(Link* peer, uint64_t chunks, int device) override;
  void progress_lane(Link* peer, uint32_t lane) override;
  void detach(Link& peer) override;
  void stop() override;

 private:
  Host* host_;
  std::vector<std::unique_ptr<tcp::ProgressThread>> threads_;
  std::atomic<bool> stopped_{false};
  std::atomic<uint32_t> next_wake_{0};
  std::atomic<uint64_t> gpus_{0};  // devices whose memory was registered (a bit each)
};

}  // namespace tether::transport
