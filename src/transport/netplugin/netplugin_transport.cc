#include "transport/netplugin/netplugin_transport.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "sys/crypto.h"
#include "core/region.h"
#include "sys/cpu.h"
#include "sys/net.h"
#include "sys/thread_name.h"
#include "sys/env.h"
#include "sys/topology.h"

namespace tether::transport {

namespace {

constexpr uint32_t kOfferMagic = 0x32504e54;  // "TNP2": with a nonce (v1, "TNPO", had none)
constexpr uint32_t kMaxLanes = 64;
constexpr int64_t kOfferLifetimeMs = 60000;   // listens offered to a connector that picked another transport

struct OfferHeader {
  uint32_t magic;
  uint32_t lanes;
  uint64_t session;
  uint64_t nonce;  // tells our offer from the other side's when both are ours (a self-connect)
};

bool parse_offer(std::string_view bytes, OfferHeader* h) {
  if (bytes.size() < sizeof(OfferHeader)) return false;
  std::memcpy(h, bytes.data(), sizeof *h);
  return h->magic == kOfferMagic && h->lanes > 0 && h->lanes <= kMaxLanes &&
         bytes.size() == sizeof(OfferHeader) + size_t(h->lanes) * netabi::kHandleMaxSize;
}

}  // namespace

// Drives its lanes: plugins progress inside test(), so a thread with work in flight polls; an idle
// one backs off to sleeping (up to 1 ms) and is woken by wake() when chunks are queued.
class NetProgressThread {
 public:
  NetProgressThread(std::vector<int> cpus) : cpus_(std::move(cpus)) {
    evfd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    thread_ = std::thread([this] { run(); });
  }
  ~NetProgressThread() {
    stop();
    ::close(evfd_);
  }
  void adopt(std::shared_ptr<NetLane> lane) {
    {
      std::lock_guard lock(mu_);
      incoming_.push_back(std::move(lane));
    }
    wake();
  }
  void wake() {
    hint_.store(true, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst)) {
      uint64_t one = 1;
      ssize_t rc = ::write(evfd_, &one, sizeof one);
      (void)rc;
    }
  }
  void stop() {
    if (stop_.exchange(true)) return;
    wake();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    sys::name_this_thread("net");
    (void)sys::pin_current_thread(cpus_);  // best effort: a bad set was refused at startup
    uint32_t idle = 0;
    while (!stop_.load(std::memory_order_acquire)) {
      {
        std::lock_guard lock(mu_);
        for (auto& l : incoming_) lanes_.push_back(std::move(l));
        incoming_.clear();
      }
      bool moved = false;
      for (size_t i = 0; i < lanes_.size();) {
        NetLane& l = *lanes_[i];
        moved |= l.step();
        if (l.dead()) {
          l.retire();
          lanes_[i] = std::move(lanes_.back());
          lanes_.pop_back();
          moved = true;
        } else {
          ++i;
        }
      }
      if (moved || hint_.exchange(false, std::memory_order_acq_rel)) {
        idle = 0;
        continue;
      }
      // Nothing moved: spin a little (an answer is usually microseconds away), then sleep longer
      // and longer; wake() cuts the sleep short when new chunks are queued.
      if (++idle < 200) {
        sys::cpu_relax();
        continue;
      }
      const int timeout_ms = idle < 400 ? 0 : 1;
      sleeping_.store(true, std::memory_order_seq_cst);
      if (!hint_.load(std::memory_order_seq_cst)) {
        pollfd p{evfd_, POLLIN, 0};
        if (timeout_ms == 0) {
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        } else if (::poll(&p, 1, timeout_ms) > 0) {
          uint64_t v;
          ssize_t rc = ::read(evfd_, &v, sizeof v);
          (void)rc;
        }
      }
      sleeping_.store(false, std::memory_order_relaxed);
    }
    {
      std::lock_guard lock(mu_);
      for (auto& l : incoming_) lanes_.push_back(std::move(l));
      incoming_.clear();
    }
    for (auto& l : lanes_) {
      l->kill(Status(Code::kCancelled, "endpoint closed"));
      l->retire();
    }
    lanes_.clear();
  }

  std::vector<int> cpus_;
  int evfd_ = -1;
  std::thread thread_;
  std::atomic<bool> stop_{false}, sleeping_{false}, hint_{false};
  std::mutex mu_;
  std::vector<std::shared_ptr<NetLane>> incoming_;
  std::vector<std::shared_ptr<NetLane>> lanes_;  // this thread only
};

struct NetPeerLanes {
  std::vector<std::weak_ptr<NetLane>> lanes;
  std::vector<NetProgressThread*> threads;  // the thread of each lane
  std::atomic<uint32_t> next{0};
};

// ---------------------------------------------------------------- setup

NetpluginTransport::NetpluginTransport(Host* host) : host_(host) {
  const Config& cfg = host->config();
  // Fault injection for the tests, not a tuning knob: hands receives back before their unpack.
  consume_early_ = sys::env_text("TETHER_NET_FAULT") == "consume_early";
  if (cfg.net_plugin.empty()) {
    unavailable_ = "TETHER_NET_PLUGIN is not set (path of an NCCL net plugin, e.g. libnccl-net.so)";
    return;
  }
  auto loaded = NetPlugin::load(cfg.net_plugin);
  if (!loaded.is_ok()) {
    unavailable_ = loaded.status().message();
    return;
  }
  net_ = loaded.take();
  bool any_gpu_bounce = false;
  for (int d = 0; d < net_->devices(); ++d) {
    auto p = net_->properties(d);
    if (!p.is_ok()) {
      unavailable_ = p.status().message();
      return;
    }
    if (p.value().device_type == netabi::kDeviceUnpack) {
      if (!net_->has_irecv_consumed()) {
        unavailable_ = "net plugin '" + net_->name() + "' is an unpack device without irecvConsumed";
        return;
      }
      // An unpack device that takes CUDA pointers keeps its bounce pages in GPU memory (TCPX devmem).
      any_gpu_bounce |= (p.value().ptr_support & netabi::kPtrCuda) != 0;
    }
    devices_.push_back(p.take());
  }
  // Each lane makes its own unpacker (its streams and descriptors); the mode is checked here once.
  if (Status s = check_unpack_mode(cfg.unpack, any_gpu_bounce); !s.is_ok()) {
    unavailable_ = s.message();
    return;
  }
  if (auto b = sys::parse_cpu_bindings(cfg.net_bindings); !b.is_ok())
    unavailable_ = "TETHER_NET_BINDINGS: " + b.status().message();
}

NetpluginTransport::~NetpluginTransport() { stop(); }

Caps NetpluginTransport::caps() const {
  Caps c;
  return c;
}

uint32_t NetpluginTransport::lane_count() const {
  const uint32_t want = host_->config().net_comms;
  const uint32_t n = want > 0 ? want : std::max<uint32_t>(2, uint32_t(devices_.size()));
  return std::min(n, kMaxLanes);
}

uint32_t NetpluginTransport::lanes_for(std::string_view remote_offer) const {
  OfferHeader h{};
  if (!parse_offer(remote_offer, &h)) return 1;  // attach() refuses the offer with a clear error
  return std::min(lane_count(), h.lanes);
}

void NetpluginTransport::prune_offers(int64_t now) {
  for (auto it = listening_.begin(); it != listening_.end();) {
    if (now - it->second.created_ms < kOfferLifetimeMs) {
      ++it;
      continue;
    }
    for (void* c : it->second.comms) net_->close_listen(c);
    it = listening_.erase(it);
  }
}

std::string NetpluginTransport::offer(uint64_t session) {
  std::lock_guard lock(mu_);
  const int64_t now = sys::now_ms();
  prune_offers(now);
  const uint32_t n = lane_count();
  std::string out(sizeof(OfferHeader) + size_t(n) * netabi::kHandleMaxSize, '\0');
  OfferHeader h{kOfferMagic, n, session, crypto::random_u64()};
  std::memcpy(out.data(), &h, sizeof h);
  Listening l;
  l.created_ms = now;
  for (uint32_t i = 0; i < n; ++i) {
    void* comm = nullptr;
    const int dev = int(i % devices_.size());
    const int rc = net_->listen(dev, out.data() + sizeof h + size_t(i) * netabi::kHandleMaxSize, &comm);
    if (rc != netabi::kSuccess || !comm) {
      for (void* c : l.comms) net_->close_listen(c);
      return {};  // attach() will refuse the empty offer
    }
    l.comms.push_back(comm);
  }
  listening_[OfferKey{session, h.nonce}] = std::move(l);
  return out;
}

Status NetpluginTransport::register_region(core::RegionState& region, std::string*) {
  regions_.add(&region);  // lanes register it with their comms on first use
  return Status::ok();
}

void NetpluginTransport::deregister_region(core::RegionState& region) {
  regions_.remove(&region);
  // Each lane deregisters on its own thread (the comm's owner); wait until all have.
  std::vector<std::pair<std::shared_ptr<NetLane>, uint64_t>> waits;
  {
    std::lock_guard lock(mu_);
    for (auto& w : lanes_)
      if (auto l = w.lock(); l && !l->dead()) waits.emplace_back(l, l->request_dereg(&region));
  }
  for (auto& t : threads_) t->wake();
  const int64_t deadline = sys::now_ms() + 5000;
  for (auto& [lane, ticket] : waits)
    while (!lane->dereg_done(ticket) && !lane->dead() && sys::now_ms() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
}

void NetpluginTransport::start_threads() {
  if (!threads_.empty()) return;
  const size_t ndev = devices_.size();
  // Thread t serves device t % ndev: a multiple of the device count, at least one per device.
  size_t n = std::max<size_t>(ndev, host_->config().channels / ndev * ndev);
  auto parsed = sys::parse_cpu_bindings(host_->config().net_bindings);  // checked in the constructor
  std::map<std::string, std::vector<int>> bindings;  // plugin device name -> CPUs
  for (auto& b : parsed.value()) bindings[b.nic].insert(bindings[b.nic].end(), b.cpus.begin(), b.cpus.end());
  for (size_t t = 0; t < n; ++t) {
    auto it = bindings.find(devices_[t % ndev].name);
    threads_.push_back(std::make_unique<NetProgressThread>(it == bindings.end() ? std::vector<int>{} : it->second));
  }
}

// Ours is the newest offer of the session that is not the peer's (`peer_nonce`); older ones of ours
// were for handshakes retried since, and are closed now. False: no offer of ours for this session.
bool NetpluginTransport::take_listening(uint64_t session, uint64_t peer_nonce, Listening* mine) {
  std::lock_guard lock(mu_);
  auto mine_it = listening_.end();
  for (auto it = listening_.lower_bound(OfferKey{session, 0}); it != listening_.end() && it->first.first == session; ++it)
    if (it->first.second != peer_nonce && (mine_it == listening_.end() || it->second.created_ms >= mine_it->second.created_ms))
      mine_it = it;
  if (mine_it == listening_.end()) return false;
  *mine = std::move(mine_it->second);
  listening_.erase(mine_it);
  for (auto it = listening_.lower_bound(OfferKey{session, 0}); it != listening_.end() && it->first.first == session;) {
    if (it->first.second == peer_nonce) {
      ++it;
      continue;
    }
    for (void* c : it->second.comms) net_->close_listen(c);
    it = listening_.erase(it);
  }
  return true;
}

// Both sides connect to the other's handles (in `remote_offer`) and accept on their own `listens`,
// without blocking, until every lane has both comms (the other side runs the same loop at the same time).
Status NetpluginTransport::connect_comms(std::string_view remote_offer, const std::vector<void*>& listens, Link& peer,
                                         int64_t deadline, std::vector<NetLane::Comms>& comms) {
  const uint32_t n = uint32_t(comms.size());
  std::vector<std::string> handles(n);
  for (uint32_t i = 0; i < n; ++i)
    handles[i].assign(remote_offer.data() + sizeof(OfferHeader) + size_t(i) * netabi::kHandleMaxSize, netabi::kHandleMaxSize);
  for (;;) {
    bool complete = true;
    for (uint32_t i = 0; i < n; ++i) {
      NetLane::Comms& c = comms[i];
      c.dev = int(i % devices_.size());
      if (!c.send) {
        netabi::DeviceHandle* sdev = nullptr;
        const int rc = net_->connect(c.dev, handles[i].data(), &c.send, &sdev);
        if (rc != netabi::kSuccess)
          return Status(Code::kConnectionLost, "netplugin: connect on device " + std::to_string(c.dev) + ": " + net_result_name(rc));
      }
      if (!c.recv) {
        const int rc = net_->accept(listens[i], &c.recv, &c.recv_dev);
        if (rc != netabi::kSuccess)
          return Status(Code::kConnectionLost, "netplugin: accept on device " + std::to_string(c.dev) + ": " + net_result_name(rc));
      }
      complete &= c.send && c.recv;
    }
    if (complete) return Status::ok();
    if (sys::now_ms() > deadline || peer.failed()) return Status(Code::kTimeout, "netplugin: the peer's comms did not connect in time");
    std::this_thread::yield();
  }
}

Status NetpluginTransport::attach(const std::shared_ptr<Link>& peer, const std::vector<int>&,
                                  std::string_view remote_offer, bool, int64_t deadline) {
  OfferHeader rh{};
  if (!parse_offer(remote_offer, &rh)) return Status(Code::kProtocolError, "netplugin: malformed offer from the peer");
  Listening mine;
  if (!take_listening(rh.session, rh.nonce, &mine))
    return Status(Code::kProtocolError, "netplugin: no offer of ours for this session");
  const uint32_t n = peer->lanes();
  auto close_all = [&](std::vector<NetLane::Comms>& comms) {
    for (auto& c : comms) {
      if (c.send) net_->close_send(c.send);
      if (c.recv) net_->close_recv(c.recv);
    }
    for (void* c : mine.comms) net_->close_listen(c);
  };
  std::vector<NetLane::Comms> comms(n);
  if (n > rh.lanes || n > mine.comms.size()) {
    close_all(comms);
    return Status(Code::kProtocolError, "netplugin: the peer asked for more lanes than were offered");
  }
  if (Status s = connect_comms(remote_offer, mine.comms, *peer, deadline, comms); !s.is_ok()) {
    close_all(comms);
    return s;
  }
  for (void* c : mine.comms) net_->close_listen(c);
  mine.comms.clear();

  std::vector<std::shared_ptr<NetLane>> lanes;
  for (uint32_t i = 0; i < n; ++i) {
    NetLane::Options opts;
    opts.unpack = host_->config().unpack;
    opts.cuda_send = (devices_[size_t(comms[i].dev)].ptr_support & netabi::kPtrCuda) != 0;
    opts.consume_early = consume_early_;
    auto lane = std::make_shared<NetLane>(net_, host_, peer, i, comms[i], &regions_, std::move(opts));
    comms[i] = NetLane::Comms{};  // the lane owns and closes them now
    Status s = lane->init();
    if (!s.is_ok()) {
      close_all(comms);  // the lanes made so far close theirs as they go
      return s;
    }
    lanes.push_back(std::move(lane));
  }
  auto state = std::make_shared<NetPeerLanes>();
  std::lock_guard lock(mu_);
  if (stopped_.load()) return Status(Code::kCancelled, "endpoint closed");
  start_threads();
  for (auto& l : lanes) {
    NetProgressThread* t = threads_[size_t(l->index()) % threads_.size()].get();
    state->lanes.push_back(l);
    state->threads.push_back(t);
    lanes_.push_back(l);
  }
  peer->transport_state = state;  // weak references: lanes own the peer, not the other way round
  for (size_t i = 0; i < lanes.size(); ++i) state->threads[i]->adopt(std::move(lanes[i]));
  // Forget lanes that have gone (a long-lived endpoint sees many peers).
  lanes_.erase(std::remove_if(lanes_.begin(), lanes_.end(), [](auto& w) { return w.expired(); }), lanes_.end());
  return Status::ok();
}

void NetpluginTransport::wake(Link* peer, uint64_t chunks, int) {
  auto* state = static_cast<NetPeerLanes*>(peer->transport_state.get());
  if (!state || state->threads.empty()) return;
  const size_t n = state->threads.size();
  const size_t k = size_t(std::min<uint64_t>(std::max<uint64_t>(chunks, 1), n));
  const uint32_t first = state->next.fetch_add(1, std::memory_order_relaxed);
  for (size_t i = 0; i < k; ++i) state->threads[(first + i) % n]->wake();
}

void NetpluginTransport::stop() {
  if (stopped_.exchange(true)) return;
  std::vector<std::unique_ptr<NetProgressThread>> threads;
  {
    std::lock_guard lock(mu_);
    threads.swap(threads_);
    if (net_) {
      for (auto& [session, l] : listening_)
        for (void* c : l.comms) net_->close_listen(c);
    }
    listening_.clear();
  }
  for (auto& t : threads) t->stop();
}

}  // namespace tether::transport
