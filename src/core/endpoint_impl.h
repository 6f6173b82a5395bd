// EndpointImpl: owns the listening socket, the control thread (accepts, handshakes, control
// messages, heartbeats, peer timeouts), the region registry, the transports and the peers.
#pragma once
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/peer.h"
#include "core/region.h"
#include "core/trace.h"
#include "core/wire.h"
#include "sys/topology.h"
#include "tether/endpoint.h"
#include "gpu/staging.h"
#include "transport/host.h"
#include "transport/transport.h"

namespace tether::core {

struct AtomicStats : transport::Traffic {
  std::atomic<uint64_t> transfers_completed{0}, transfers_failed{0};
  std::atomic<uint64_t> reads_pushed{0};  // peers' pulled reads this side sent (wire::kPull)
};

// Owned by the public Endpoint, every PeerState (user-held handles never dangle) and any thread blocked
// in one of its calls; close() (always called by ~Endpoint) drops the peers, so no cycle outlives it.
// The transport::Host overrides say what they do in transport/host.h.
class EndpointImpl final : public std::enable_shared_from_this<EndpointImpl>, public transport::Host {
 public:
  static Result<std::shared_ptr<EndpointImpl>> create(const Config& config);
  ~EndpointImpl();

  const Config& config() const override { return config_; }
  RegionRegistry& registry() override { return registry_; }
  transport::Traffic& traffic() override { return stats_; }
  AtomicStats& stats() { return stats_; }
  const EndpointId& id() const { return id_; }
  const std::string& name() const { return name_; }
  std::string address() const;
  std::string metadata() const;

  Result<Peer> connect(std::string_view target, int64_t timeout_ms);
  // Unpublishes, cancels two-sided operations still waiting on the region, waits for the rest.
  Status deregister(const Region& region);
  std::vector<Notification> notifications(int64_t timeout_ms);
  std::vector<Peer> peers() const;
  void close();

  // `device`: GPU of the chunks' local bytes, -1 host memory (transports rank their NICs by it).
  void wake_lanes(PeerState* peer, uint64_t chunks, int device = -1) {
    gpu::KeepContext keep;  // the poster may send (and copy) here, on the application's thread
    trace::mark(trace::Event::kPost, 0, 0, uint32_t(chunks));
    if (PeerState::Hold h{peer}) peer->transport->wake(peer, chunks, device);  // its lanes may be gone
  }
  // Registers with the registry, then with every usable transport (descriptor extensions).
  Result<Region> register_memory(void* ptr, uint64_t size, MemoryKind kind, int device, bool readonly);
  gpu::Unpack unpack_mode() const override { return unpack_; }
  std::vector<std::pair<std::string, std::string>> transport_status() const;
  void transport_counters(std::vector<std::pair<std::string, uint64_t>>& out) const {
    for (auto& t : transports_) t->counters(out);
  }
  void wake_control();
  // Queues a notification for the application, or refuses it: kInvalidArgument over notify_max_bytes,
  // kResourceExhausted when the peer's or the endpoint's queue of unread ones is full.
  Code push_notification(const PeerInfo& from, const uint8_t* data, size_t length);
  void count_finished(bool ok);
  void peer_failed(PeerState* peer);
  // NICs and threads (src/sys/topology.h): decided once at create().
  const sys::Plan& plan() const { return plan_; }
  const LinkCounters& nic_counters(size_t i) const { return *nic_counters_[i]; }
  void pin_progress_thread(uint32_t index) const override;
  uint32_t thread_for_lane(uint32_t lane, int nic, uint32_t earlier_on_nic) const override {
    return plan_.thread_for_lane(lane, nic, earlier_on_nic);
  }

 private:
  struct Pending;     // a socket whose handshake is under way (listener side; core/handshake.h)
  struct Connecting;  // one connect() under way (connect.cc)
  // epoll tags of the control thread's event loop; any other value is a peer id (its control socket).
  static constexpr uint64_t kListenTag = 1ull << 62, kEventTag = 2ull << 62, kPendingTag = 3ull << 62;
  static constexpr uint64_t kTagMask = 3ull << 62;
  EndpointImpl(const Config& config, const EndpointId& id);
  template <class Hello>
  PeerInfo describe_peer(const Hello& h);  // core/handshake.h
  // ---- connector side (connect.cc)
  Status resolve_target(std::string_view target, Connecting& c) const;
  wire::ClientHello client_hello() const;
  Status open_sockets(Connecting& c);
  Status choose_offer(Connecting& c, std::string_view offers, wire::ClientProof* cp, std::string* offer);
  Status choose_nic_pairs(Connecting& c, int control_fd) const;
  Result<int> connect_data(Connecting& c, uint32_t lane, const sys::NicPair** pair) const;
  Result<Peer> attach_connected(Connecting& c);
  // ---- listener side (listener.cc)
  void accept_all();
  void listen_paused(bool paused);  // takes the listening socket out of the event loop, or puts it back
  void resume_listening(int64_t now);
  bool shed_oldest_pending(int64_t now, int64_t* retry_at);
  void advance_handshake(int fd);
  bool answer_hello(Pending& p);
  std::string offers_for(const wire::ClientHello& h);
  void accept_control(Pending& p);
  void join_data_socket(Pending& p);
  // ---- control thread (control_loop.cc)
  void control_loop();
  void adopt_peer(const std::shared_ptr<PeerState>& peer);
  void control_readable(PeerState& peer);
  bool parse_control(PeerState& peer);
  void flush_control(PeerState& peer);
  void tick(const std::vector<std::shared_ptr<PeerState>>& peers);
  uint32_t heartbeat_for(uint32_t remote_timeout_ms) const;
  uint64_t chunk_for(uint64_t remote_chunk_bytes) const;
  Result<std::pair<transport::Transport*, std::string>> choose_transport(const wire::Offers& theirs, bool same_host) const;
  void reap();
  // Which NIC a connected data socket uses on this side (getsockname), and where it goes.
  LanePath describe_lane(int fd, const sys::NicPair* pair);
  std::string advertised_nics() const;   // this side's data NICs, sent to connectors
  std::string control_hint() const;      // where connectors should reach a wildcard listener

  Config config_;
  EndpointId id_{};
  std::string name_;
  std::array<uint8_t, 32> host_id_{};
  gpu::Unpack unpack_ = gpu::Unpack::kD2D;
  RegionRegistry registry_;
  AtomicStats stats_;
  std::vector<std::unique_ptr<transport::Transport>> transports_;
  sys::Plan plan_;
  std::vector<std::unique_ptr<LinkCounters>> nic_counters_;  // per plan_.all entry, then one for "other"

  int listen_fd_ = -1, epoll_fd_ = -1, event_fd_ = -1;
  uint16_t port_ = 0;
  std::thread control_thread_;
  std::atomic<bool> closing_{false};
  // Sockets of connect() calls still in their handshake: close() shuts them down so those connects end at once.
  std::mutex connecting_mu_;
  std::vector<int> connecting_fds_;
  void track_connecting(int fd);
  void untrack_connecting(const std::vector<int>& fds);
  std::atomic<uint64_t> next_peer_id_{1};

  mutable std::mutex peers_mu_;
  std::unordered_map<uint64_t, std::shared_ptr<PeerState>> peers_;
  std::vector<std::shared_ptr<PeerState>> to_adopt_;  // from connect(), for the control thread
  std::vector<uint64_t> to_reap_;

  // Control-thread-only.
  std::unordered_map<int, std::unique_ptr<Pending>> pending_;
  std::unordered_map<uint64_t, std::shared_ptr<PeerState>> accepting_;  // session -> peer awaiting lanes
  int64_t last_tick_ms_ = 0;
  // Bounds against hostile connectors (listener.cc): at most max_pending_ handshakes at once (a quarter
  // of the open-files limit); past it, or out of descriptors, the oldest is shed or the listener pauses.
  static constexpr int64_t kHandshakeGraceMs = 100;
  size_t max_pending_ = 1024;
  uint64_t next_pending_seq_ = 0;
  bool listen_armed_ = true;
  bool paused_for_fds_ = false;      // accept() ran out of descriptors: retried at listen_retry_at_ms_ only
  int64_t listen_retry_at_ms_ = 0;   // a paused listener is tried again then
  bool logged_fds_ = false, logged_pending_ = false;
  int64_t quiet_log_until_ms_ = 0;   // neither is logged again before then (a flood must not spam stderr)

  std::mutex notes_mu_;
  std::condition_variable notes_cv_;
  std::deque<Notification> notes_;
  uint64_t notes_bytes_ = 0;                               // charged against Config::notify_queue_bytes
  std::atomic<bool> trim_due_{false};                      // a large drain freed heap: the next tick trims it
  std::unordered_map<uint64_t, uint64_t> notes_by_peer_;   // peer id -> bytes charged (notify_queue_peer_bytes)
};

}  // namespace tether::core
