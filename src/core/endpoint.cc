// EndpointImpl: creating and closing an endpoint, what it tells connectors about itself, its queue of
// notifications, memory registration; and the public Endpoint, which forwards to it. Connections are in
// connect.cc (connector) and listener.cc (listener), the control thread in control_loop.cc.
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "core/handshake.h"
#include "core/trace.h"
#include "sys/net.h"
#include "transport/registry.h"

namespace tether::core {

EndpointImpl::EndpointImpl(const Config& config, const EndpointId& id) : config_(config), id_(id), registry_(id) {}

Result<std::shared_ptr<EndpointImpl>> EndpointImpl::create(const Config& config) {
  if (Status s = Config::check_process_env(); !s.is_ok()) return s;
  if (config.chunk_bytes == 0 || config.window == 0 || config.channels == 0)
    return Status(Code::kInvalidArgument, "chunk_bytes, window and channels must be positive");
  if (config.channels > kMaxLanes) return Status(Code::kInvalidArgument, "channels must be at most 256");
  // The unpack mode: a typo is an error everywhere; a mode this machine cannot run only where GPUs exist.
  gpu::Unpack unpack = gpu::Unpack::kD2D;
  if (auto u = gpu::parse_unpack(config.unpack); u.is_ok()) {
    unpack = u.value();
  } else if (u.status().code() == Code::kInvalidArgument || gpu::device_count() > 0) {
    return u.status();
  }
  if (config.ipc_host != "auto" && config.ipc_host != "cma" && config.ipc_host != "shm")
    return Status(Code::kInvalidArgument, "ipc_host must be auto, cma or shm (got \"" + config.ipc_host + "\")");
  if (config.notify_max_bytes == 0 || config.notify_max_bytes > wire::kMaxNotify)
    return Status(Code::kInvalidArgument, "notify_max_bytes must be between 1 and 1048576 (got " +
                                              std::to_string(config.notify_max_bytes) + ")");
  if (config.notify_queue_peer_bytes < config.notify_max_bytes || config.notify_queue_bytes < config.notify_queue_peer_bytes)
    return Status(Code::kInvalidArgument, "notify_queue_bytes >= notify_queue_peer_bytes >= notify_max_bytes must hold");
  if (config.transport != "auto" && wire::transport_bit(config.transport) == 0)
    return Status(Code::kInvalidArgument, "transport (TETHER_TRANSPORT) must be auto, tcp, ipc, fabric or netplugin (got \"" +
                                              config.transport + "\")");
  EndpointId id;
  crypto::random_bytes(id.data(), id.size());
  std::shared_ptr<EndpointImpl> ep(new EndpointImpl(config, id));
  ep->unpack_ = unpack;
  auto plan = sys::make_plan(config);
  if (!plan.is_ok()) return plan.status();
  ep->plan_ = plan.take();
  for (size_t i = 0; i <= ep->plan_.all.size(); ++i) ep->nic_counters_.push_back(std::make_unique<LinkCounters>());
  ep->host_id_ = sys::host_id();
  ep->name_ = config.name.empty() ? sys::hostname() + ":" + std::to_string(::getpid()) : config.name;

  auto lfd = sys::listen_tcp(config.host, config.port, config.socket_buffer);
  if (!lfd.is_ok()) return lfd.status();
  ep->listen_fd_ = lfd.value();
  ep->port_ = sys::local_port(ep->listen_fd_);
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY)
    ep->max_pending_ = std::clamp<size_t>(size_t(files.rlim_cur / 4), 8, 1024);
  ep->epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  ep->event_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kListenTag;
  ::epoll_ctl(ep->epoll_fd_, EPOLL_CTL_ADD, ep->listen_fd_, &ev);
  ev.data.u64 = kEventTag;
  ::epoll_ctl(ep->epoll_fd_, EPOLL_CTL_ADD, ep->event_fd_, &ev);
  ep->transports_ = transport::make_transports(ep.get());
  // A transport asked for by name must work here: say why not now, not at the first connect.
  for (auto& t : ep->transports_)
    if (config.transport == t->name() && !t->unavailable_reason().empty())
      return Status(Code::kUnavailable, "transport " + config.transport + " cannot be used here: " + t->unavailable_reason());
  ep->control_thread_ = std::thread([p = ep.get()] { p->control_loop(); });
  return ep;
}

EndpointImpl::~EndpointImpl() { close(); }

void EndpointImpl::close() {
  if (closing_.exchange(true)) return;
  gpu::KeepContext keep;
  {
    std::lock_guard lock(connecting_mu_);  // listed sockets are open: untracked before they are closed
    for (int fd : connecting_fds_) ::shutdown(fd, SHUT_RDWR);
  }
  wake_control();
  if (control_thread_.joinable()) control_thread_.join();
  std::vector<std::shared_ptr<PeerState>> all;
  {
    std::lock_guard lock(peers_mu_);
    for (auto& [id, p] : peers_) all.push_back(p);  // includes connect()'s peers not yet adopted
    for (auto& [s, p] : accepting_) all.push_back(p);
  }
  for (auto& p : all) p->fail(Status(Code::kCancelled, "endpoint closed"));
  for (auto& t : transports_) t->stop();  // lanes answer their in-flight chunks; every transfer finishes
  for (auto& p : all) p->let_go_control();  // the lanes let go in stop(): each peer's sockets close now
  {
    std::lock_guard lock(peers_mu_);
    peers_.clear();
    to_adopt_.clear();
    accepting_.clear();
  }
  for (auto& [fd, p] : pending_) ::close(fd);
  pending_.clear();
  registry_.clear();
  sys::close_fd(listen_fd_);
  sys::close_fd(epoll_fd_);
  sys::close_fd(event_fd_);
  notes_cv_.notify_all();
  trace::flush();  // TETHER_TRACE: this process's events so far
}

std::string EndpointImpl::address() const { return sys::join_host_port(config_.host, port_); }

std::string EndpointImpl::metadata() const {
  const std::string host = config_.host, hn = sys::hostname(), ctl = control_hint();
  MetadataHeader m{};
  m.magic = kMetadataMagic;
  m.version = wire::kVersion;
  m.port = port_;
  std::memcpy(m.endpoint, id_.data(), 16);
  std::memcpy(m.host_id, host_id_.data(), 32);
  m.host_len = uint16_t(host.size());
  m.hostname_len = uint16_t(hn.size());
  m.control_len = uint16_t(ctl.size());
  std::string out(reinterpret_cast<const char*>(&m), sizeof m);
  return out + host + hn + ctl;
}

std::string EndpointImpl::control_hint() const {
  if (!wildcard(config_.host)) return {};
  if (plan_.control >= 0) return plan_.all[size_t(plan_.control)].primary()->addr;
  return plan_.data.empty() ? std::string() : plan_.data.front().primary()->addr;
}

std::string EndpointImpl::advertised_nics() const {
  std::vector<sys::RemoteNic> out;
  for (const sys::Nic& n : plan_.data) {
    const sys::NicAddr* a = n.primary();
    if (!wildcard(config_.host) && a->addr != config_.host) continue;  // only what the listen socket serves
    out.push_back(sys::RemoteNic{n.name, *a});
  }
  std::string text = sys::encode_nic_list(out);
  return text.size() <= 0xffff ? text : std::string();
}

LanePath EndpointImpl::describe_lane(int fd, const sys::NicPair* pair) {
  LanePath p;
  p.local_addr = sys::local_addr(fd);
  p.remote_addr = sys::remote_addr(fd);
  p.nic = plan_.data_index_of_addr(p.local_addr);
  size_t counters = plan_.all.size();  // "other"
  for (size_t i = 0; i < plan_.all.size() && counters == plan_.all.size(); ++i)
    for (auto& a : plan_.all[i].addrs)
      if (a.addr == p.local_addr) {
        counters = i;
        p.local_nic = plan_.all[i].name;
        break;
      }
  if (pair) p.remote_nic = pair->remote_name;
  p.nic_counters = nic_counters_[counters].get();
  return p;
}

void EndpointImpl::pin_progress_thread(uint32_t index) const {
  if (index < plan_.threads.size()) (void)sys::pin_current_thread(plan_.threads[index].cpus);  // checked at create()
}

uint64_t EndpointImpl::chunk_for(uint64_t remote_chunk_bytes) const {
  return remote_chunk_bytes ? std::min<uint64_t>(config_.chunk_bytes, remote_chunk_bytes) : config_.chunk_bytes;
}

uint32_t EndpointImpl::heartbeat_for(uint32_t remote_timeout_ms) const {
  // Four heartbeats per remote timeout, so a peer with a short timeout never mistakes us for dead.
  const uint32_t needed = std::max<uint32_t>(10, remote_timeout_ms / 4);
  return std::min(config_.heartbeat_ms, remote_timeout_ms ? needed : config_.heartbeat_ms);
}

void EndpointImpl::wake_control() {
  if (event_fd_ < 0) return;
  uint64_t one = 1;
  ssize_t rc = ::write(event_fd_, &one, sizeof one);
  (void)rc;
}

namespace {
// What one queued notification costs: its bytes, the peer's name copied into it, the queue entry.
uint64_t note_cost(size_t data, size_t name) { return uint64_t(data) + name + 64; }
}  // namespace

Code EndpointImpl::push_notification(const PeerInfo& from, const uint8_t* data, size_t length) {
  if (length > config_.notify_max_bytes) return Code::kInvalidArgument;
  const uint64_t cost = note_cost(length, from.name.size());
  {
    std::lock_guard lock(notes_mu_);
    uint64_t& mine = notes_by_peer_[from.id];
    if (mine + cost > config_.notify_queue_peer_bytes || notes_bytes_ + cost > config_.notify_queue_bytes) {
      if (mine == 0) notes_by_peer_.erase(from.id);
      return Code::kResourceExhausted;
    }
    mine += cost;
    notes_bytes_ += cost;
    notes_.push_back(Notification{from.id, from.name, std::string(reinterpret_cast<const char*>(data), length)});
  }
  notes_cv_.notify_all();
  return Code::kOk;
}

std::vector<Notification> EndpointImpl::notifications(int64_t timeout_ms) {
  std::unique_lock lock(notes_mu_);
  if (timeout_ms > 0)
    notes_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return !notes_.empty() || closing_.load(); });
  std::vector<Notification> out(std::make_move_iterator(notes_.begin()), std::make_move_iterator(notes_.end()));
  std::deque<Notification>().swap(notes_);  // its blocks too: a burst must not keep its high-water mark
  if (notes_bytes_ >= (1u << 20)) trim_due_.store(true, std::memory_order_relaxed);
  notes_bytes_ = 0;
  notes_by_peer_.clear();
  return out;
}

void EndpointImpl::count_finished(bool ok) {
  (ok ? stats_.transfers_completed : stats_.transfers_failed).fetch_add(1, std::memory_order_relaxed);
}

void EndpointImpl::peer_failed(PeerState* peer) {
  {
    std::lock_guard lock(peers_mu_);
    to_reap_.push_back(peer->info().id);
  }
  wake_control();
}

std::vector<Peer> EndpointImpl::peers() const {
  std::lock_guard lock(peers_mu_);
  std::vector<Peer> out;
  for (auto& [id, p] : peers_) out.emplace_back(p);
  return out;
}

std::vector<std::pair<std::string, std::string>> EndpointImpl::transport_status() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (auto& t : transports_) out.emplace_back(t->name(), t->unavailable_reason());
  return out;
}

Result<Region> EndpointImpl::register_memory(void* ptr, uint64_t size, MemoryKind kind, int device, bool readonly) {
  if (closing_.load()) return Status(Code::kCancelled, "endpoint closed");
  gpu::KeepContext keep;
  if (ptr && size > 0) {
    // Ask CUDA what the memory is: a GPU range must lie in one allocation of the GPU it claims.
    auto info = gpu::pointer_info(ptr);
    if (!info.is_ok()) return info.status();
    const gpu::PointerInfo& p = info.value();
    if (kind == MemoryKind::kCuda) {
      std::string why;
      if (!gpu::cuda(&why)) return Status(Code::kUnavailable, "register: GPU memory needs CUDA: " + why);
      if (!p.is_device) return Status(Code::kInvalidArgument, "register: the pointer is not GPU memory (register it as host memory)");
      if (device >= 0 && device != p.device)
        return Status(Code::kInvalidArgument, "register: the memory is on GPU " + std::to_string(p.device) + ", not GPU " +
                                                  std::to_string(device));
      device = p.device;
      const uint64_t at = reinterpret_cast<uint64_t>(ptr);
      if (at + size > p.alloc_base + p.alloc_size && !gpu::mapped_through(at, size))
        return Status(Code::kOutOfRange, "register: the range runs " + std::to_string(at + size - p.alloc_base - p.alloc_size) +
                                             " bytes past the end of its GPU allocation");
    } else if (p.is_device) {
      return Status(Code::kInvalidArgument, "register: the pointer is GPU memory of GPU " + std::to_string(p.device) +
                                                "; register it as kind cuda");
    }
  }
  auto r = registry_.add(ptr, size, kind, device, readonly);
  if (!r.is_ok()) return r;
  Region region = r.take();
  wire::Offers exts;
  for (auto& t : transports_) {
    if (!t->unavailable_reason().empty()) continue;
    std::string ext;
    Status s = t->register_region(*region.state(), &ext);
    if (!s.is_ok()) {
      deregister(region);
      return Status(s.code(), std::string("register: transport ") + t->name() + ": " + s.message());
    }
    if (!ext.empty()) exts.emplace_back(t->name(), std::move(ext));
  }
  region.state()->desc_ext = wire::encode_offers(exts);
  return region;
}

Status EndpointImpl::deregister(const Region& region) {
  gpu::KeepContext keep;
  Status s = registry_.unpublish(region);
  if (!s.is_ok()) return s;
  std::vector<std::shared_ptr<PeerState>> all;
  {
    std::lock_guard lock(peers_mu_);
    for (auto& [id, p] : peers_) all.push_back(p);
  }
  for (auto& p : all) p->cancel_region(region.state().get());
  RegionRegistry::wait_unpinned(region, [&](int64_t waited_ms) {
    const bool force = waited_ms >= int64_t(config_.deregister_timeout_ms);
    // A peer that pulled a read from the region and does not take its bytes keeps a chunk of it unsent,
    // pinned: cut off, as ipc cuts a stalled reader (its read fails; the region is let go).
    if (force)
      for (auto& p : all)
        if (!p->failed() && p->pushes_from(region.state().get()))
          p->fail(Status(Code::kConnectionLost, "peer '" + p->info().name + "' did not take the bytes of a read it pulled from region " +
                                                    std::to_string(region.id()) + " while it was deregistered (deregister_timeout_ms)"));
    for (auto& t : transports_)
      if (t->unavailable_reason().empty()) t->region_stalled(*region.state(), force);
  });
  for (auto& t : transports_)
    if (t->unavailable_reason().empty()) t->deregister_region(*region.state());
  return Status::ok();
}

}  // namespace tether::core

// ---------------------------------------------------------------- public API

namespace tether {

Endpoint::Endpoint(std::shared_ptr<core::EndpointImpl> impl) : impl_(std::move(impl)) {}
Endpoint::~Endpoint() { close(); }

Result<std::unique_ptr<Endpoint>> Endpoint::create(const Config& config) {
  auto impl = core::EndpointImpl::create(config);
  if (!impl.is_ok()) return impl.status();
  return std::unique_ptr<Endpoint>(new Endpoint(impl.take()));
}

std::string Endpoint::address() const { return impl_->address(); }
std::string Endpoint::metadata() const { return impl_->metadata(); }
Result<MetadataInfo> Endpoint::parse_metadata(std::string_view bytes) {
  core::ParsedMetadata m;
  Status s = core::parse_metadata_bytes(bytes, &m);
  if (!s.is_ok()) return s;
  return m.info;
}
EndpointId Endpoint::id() const { return impl_->id(); }
std::string Endpoint::name() const { return impl_->name(); }
const Config& Endpoint::config() const { return impl_->config(); }
// Blocking calls hold their own reference: the Endpoint may be destroyed while they wait.
Result<Peer> Endpoint::connect(std::string_view target, int64_t timeout_ms) {
  auto impl = impl_;
  return impl->connect(target, timeout_ms);
}
Result<Region> Endpoint::register_memory(void* ptr, uint64_t size, MemoryKind kind, int device, bool readonly) {
  return impl_->register_memory(ptr, size, kind, device, readonly);
}
Status Endpoint::deregister(const Region& region) {
  auto impl = impl_;
  return impl->deregister(region);
}
std::vector<Notification> Endpoint::notifications() { return impl_->notifications(0); }
std::vector<Notification> Endpoint::wait_notifications(int64_t timeout_ms) {
  auto impl = impl_;
  return impl->notifications(timeout_ms);
}
std::vector<Peer> Endpoint::peers() const { return impl_->peers(); }
std::vector<std::pair<std::string, std::string>> Endpoint::transports() const { return impl_->transport_status(); }
void Endpoint::close() {
  auto impl = impl_;
  if (impl) impl->close();
}

EndpointStats Endpoint::stats() const {
  auto& s = impl_->stats();
  EndpointStats o;
  o.bytes_sent = s.bytes_sent.load();
  o.bytes_received = s.bytes_received.load();
  o.chunks_sent = s.chunks_sent.load();
  o.chunks_received = s.chunks_received.load();
  o.transfers_completed = s.transfers_completed.load();
  o.transfers_failed = s.transfers_failed.load();
  o.rejected_requests = s.rejected_requests.load();
  o.reads_pushed = s.reads_pushed.load();
  auto link = [](const core::LinkCounters& c) {
    return LinkStats{c.bytes_sent.load(), c.bytes_received.load(), c.chunks_sent.load(), c.chunks_received.load(),
                     c.errors.load(), c.resends.load(), double(c.send_ns.load()) * 1e-9, double(c.recv_ns.load()) * 1e-9,
                     double(c.staging_ns.load()) * 1e-9, c.staging_slots_peak.load()};
  };
  const auto& plan = impl_->plan();
  for (size_t i = 0; i <= plan.all.size(); ++i) {
    const std::string name = i < plan.all.size() ? plan.all[i].name : "other";
    const LinkStats l = link(impl_->nic_counters(i));
    const bool data = std::any_of(plan.data.begin(), plan.data.end(), [&](const sys::Nic& n) { return n.name == name; });
    if (data || l.bytes_sent || l.bytes_received || l.errors) o.nics.push_back(NicStats{name, l});
  }
  for (const Peer& p : impl_->peers()) {
    const auto& st = p.state();
    for (uint32_t i = 0; i < st->lanes() && i < st->lane_paths.size(); ++i) {
      const core::LanePath& lp = st->lane_paths[i];
      o.lanes.push_back(LaneStats{st->info().id, st->info().name, i, st->lane_alive(i), lp.local_nic, lp.local_addr,
                                  lp.remote_nic, lp.remote_addr, link(st->lane_counters(i))});
    }
  }
  impl_->transport_counters(o.transport_counters);
  return o;
}

}  // namespace tether
