// The netplugin transport: an NCCL net plugin loaded by path (TETHER_NET_PLUGIN, e.g. Google's
// GPUDirect-TCPX libnccl-net.so) carries the frames of the TCP transport over its comms.
//
// Connecting: offer(session) listens once per lane, spreading lanes over the plugin's devices (NICs),
// and publishes the listen handles; attach() connects to the other side's handles (our send comms)
// and accepts on ours (our recv comms). Lane i = (send comm, recv comm) on device i % devices.
// Progress threads own lanes (a comm is driven by one thread, as NCCL's proxy does); thread t serves
// device t % devices, so TETHER_NET_BINDINGS can pin it to CPUs near that NIC.
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/netplugin/net_lane.h"
#include "transport/netplugin/plugin.h"
#include "transport/netplugin/unpacker.h"
#include "transport/transport.h"

namespace tether::transport {

class Host;
class NetProgressThread;

class NetpluginTransport final : public Transport {
 public:
  explicit NetpluginTransport(Host* host);
  ~NetpluginTransport() override;
  const char* name() const override { return "netplugin"; }
  Caps caps() const override;
  int priority() const override { return 5; }  // configured on purpose: preferred over tcp when both sides have it
  std::string unavailable_reason() const override { return unavailable_; }
  std::string offer(uint64_t session) override;
  uint32_t lanes_for(std::string_view remote_offer) const override;
  Status register_region(core::RegionState& region, std::string* desc_ext) override;
  void deregister_region(core::RegionState& region) override;
  Status attach(const std::shared_ptr<Link>& peer, const std::vector<int>& tcp_fds,
                std::string_view remote_offer, bool initiator, int64_t deadline_ms) override;
  void wake(Link* peer, uint64_t chunks, int device) override;
  void stop() override;

 private:
  struct Listening {
    std::vector<void*> comms;  // one per lane
    int64_t created_ms = 0;
  };
  // (session, nonce of the offer): an endpoint connecting to itself makes two offers in one session.
  using OfferKey = std::pair<uint64_t, uint64_t>;
  uint32_t lane_count() const;
  void start_threads();
  void prune_offers(int64_t now);
  bool take_listening(uint64_t session, uint64_t peer_nonce, Listening* mine);
  Status connect_comms(std::string_view remote_offer, const std::vector<void*>& listens, Link& peer, int64_t deadline,
                       std::vector<NetLane::Comms>& comms);

  Host* const host_;
  std::string unavailable_;
  bool consume_early_ = false;  // TETHER_NET_FAULT=consume_early (tests only)
  std::shared_ptr<NetPlugin> net_;
  std::vector<NetDeviceProps> devices_;
  RegionTable regions_;

  std::mutex mu_;  // offers, lanes, threads (control path only)
  std::map<OfferKey, Listening> listening_;  // our listen comms per offer, until attach
  std::vector<std::weak_ptr<NetLane>> lanes_;
  std::vector<std::unique_ptr<NetProgressThread>> threads_;
  std::atomic<bool> stopped_{false};
};

}  // namespace tether::transport
