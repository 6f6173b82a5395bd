// ipc transport: two processes on one host (same boot, same network namespace, same user).
// Lanes are unix-domain SOCK_SEQPACKET sockets carrying the FrameHeader plus where the initiator's
// local bytes are; the TARGET validates every request against its registry and then moves the bytes
// itself with a Mover (host_mover.h). Small chunks of a descriptor the target has validated once are
// moved by the initiator itself (one_sided.h).
//
// Each lane has one thread blocked in recv() on its socket: it serves the peer's requests and
// takes the answers to ours. Requests are sent by whichever thread takes the chunk (the posting
// thread for the first window, the lane thread as answers free room), so nothing needs waking.
#pragma once
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/transport.h"

namespace tether::core {
struct RegionState;
}

namespace tether::transport {

class Host;

namespace ipc {
struct Lane;
struct IpcPeer;
struct Rendezvous;
class GpuCompleter;

// What this endpoint's ipc lanes did (IpcTransport::counters: "ipc_" and the field's name).
struct Counters {
  std::atomic<uint64_t> cma_chunks{0}, shm_chunks{0}, inline_chunks{0};  // chunks served as a target, by mover
  std::atomic<uint64_t> one_sided_chunks{0};  // chunks this side moved itself, as an initiator
  std::atomic<uint64_t> cuda_chunks{0};       // chunks whose GPU side this side copied with CUDA (either side)
  std::atomic<uint64_t> cuda_opens{0};        // CUDA IPC handles of a peer's allocations opened (once each)
};
}  // namespace ipc

class IpcTransport final : public Transport {
 public:
  explicit IpcTransport(Host* host);
  ~IpcTransport() override;
  const char* name() const override { return "ipc"; }
  Caps caps() const override;
  int priority() const override { return 10; }
  std::string unavailable_reason() const override { return unavailable_; }
  std::string offer(uint64_t session) override;
  Result<std::string> connector_offer(uint64_t session, std::string_view remote_offer) override;
  void abandon(uint64_t session) override;
  void tick(int64_t now_ms) override;
  uint32_t lanes_for(std::string_view remote_offer) const override;
  Status register_region(core::RegionState& region, std::string* desc_ext) override;
  void deregister_region(core::RegionState& region) override;
  void region_stalled(core::RegionState& region, bool force) override;
  Status attach(const std::shared_ptr<Link>& peer, const std::vector<int>& tcp_fds,
                std::string_view remote_offer, bool initiator, int64_t deadline_ms) override;
  void wake(Link* peer, uint64_t chunks, int device) override;
  void finish_here(Link* peer) override;
  void detach(Link& peer) override;
  void stop() override;
  void counters(std::vector<std::pair<std::string, uint64_t>>& out) const override;

 private:
  Status attach_connector(const std::shared_ptr<Link>& peer, std::string_view remote_offer, int64_t deadline);
  Status attach_listener(const std::shared_ptr<Link>& peer, std::string_view remote_offer, int64_t deadline);
  Status start_lanes(const std::shared_ptr<Link>& peer, const std::shared_ptr<ipc::IpcPeer>& ip, bool listener);
  void reap_finished();  // joins lane threads that ended (mu_ held)

  Host* host_;
  ipc::Counters counters_;
  std::string unavailable_;
  int host_mode_ = 0;  // 0 auto, 1 cma only, 2 shm only (Config::ipc_host)

  std::unique_ptr<ipc::Rendezvous> rendezvous_;  // where connectors open their lanes to us (control thread)
  std::unique_ptr<ipc::GpuCompleter> completer_;  // one-sided GPU copies finished off the posting thread
  std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<ipc::IpcPeer>> prepared_;  // session -> our lanes, opened by
                                                                           // connector_offer(), not yet attached
  bool stopped_ = false;
  std::vector<std::shared_ptr<ipc::Lane>> lanes_;        // every lane thread not yet joined
};

}  // namespace tether::transport
