#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <functional>

#include "core/crypto.h"
#include "core/endpoint_impl.h"
#include "core/trace.h"
#include "sys/net.h"
#include "sys/thread_name.h"
#include "transport/registry.h"

namespace tether::core {
namespace {

constexpr uint32_t kMetadataMagic = 0x4d525454;  // "TTRM"
constexpr uint32_t kMaxLanes = 256;
constexpr uint64_t kListenTag = 1ull << 62, kEventTag = 2ull << 62, kPendingTag = 3ull << 62;
constexpr uint64_t kTagMask = 3ull << 62;

#pragma pack(push, 1)
struct MetadataHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t port;
  uint8_t endpoint[16];
  uint8_t host_id[32];
  uint16_t host_len;      // listen host, then hostname, then control address, follow
  uint16_t hostname_len;
  uint16_t control_len;   // a wildcard listener's control NIC address ("" if none): where to connect
};
#pragma pack(pop)

bool wildcard(const std::string& h) { return h.empty() || h == "0.0.0.0" || h == "::" || h == "[::]"; }

void copy_name(char (&dst)[64], const std::string& src) {
  std::memset(dst, 0, sizeof dst);
  std::memcpy(dst, src.data(), std::min(src.size(), sizeof dst - 1));
}

std::string read_name(const char (&src)[64]) { return std::string(src, strnlen(src, sizeof src)); }

crypto::Digest proof(const std::string& token, const char* who, const uint8_t* cn, const uint8_t* sn,
                     uint64_t session = 0, uint32_t lane = 0) {
  uint8_t msg[16 + 16 + 16 + 8 + 4] = {};
  std::memcpy(msg, who, std::min<size_t>(16, std::strlen(who)));
  std::memcpy(msg + 16, cn, 16);
  std::memcpy(msg + 32, sn, 16);
  std::memcpy(msg + 48, &session, 8);
  std::memcpy(msg + 56, &lane, 4);
  return crypto::hmac_sha256(token, msg, sizeof msg);
}

}  // namespace

struct EndpointImpl::Pending {
  int fd = -1;
  int stage = 0;  // 0: reading ClientHello, 1: reading ClientProof, 2: reading the connector's offer
  size_t have = 0;
  uint8_t buf[sizeof(wire::ClientHello)];
  wire::ClientHello hello{};
  wire::ClientProof proof{};
  std::string offer;
  uint8_t server_nonce[16];
  int64_t deadline_ms = 0;
  int64_t since_ms = 0;  // accepted then
  uint64_t seq = 0;      // accept order (the oldest is shed first)
};

// ---------------------------------------------------------------- lifecycle

EndpointImpl::EndpointImpl(const Config& config, const EndpointId& id) : config_(config), id_(id), registry_(id) {}

Result<std::shared_ptr<EndpointImpl>> EndpointImpl::create(const Config& config) {
  if (Status s = Config::check_process_env(); !s.is_ok()) return s;
  if (config.chunk_bytes == 0 || config.window == 0 || config.channels == 0 || config.sockets_per_channel == 0)
    return Status(Code::kInvalidArgument, "chunk_bytes, window, channels and sockets_per_channel must be positive");
  if (uint64_t(config.channels) * config.sockets_per_channel > kMaxLanes)
    return Status(Code::kInvalidArgument, "channels x sockets_per_channel must be at most 256");
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

void EndpointImpl::track_connecting(int fd) {
  std::lock_guard lock(connecting_mu_);
  connecting_fds_.push_back(fd);
  if (closing_.load()) ::shutdown(fd, SHUT_RDWR);  // close() ran before we were listed
}

void EndpointImpl::untrack_connecting(const std::vector<int>& fds) {
  std::lock_guard lock(connecting_mu_);
  for (int fd : fds) connecting_fds_.erase(std::remove(connecting_fds_.begin(), connecting_fds_.end(), fd), connecting_fds_.end());
}

void EndpointImpl::close() {
  if (closing_.exchange(true)) return;
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

std::string EndpointImpl::address() const {
  const std::string& h = config_.host;
  return (h.find(':') != std::string::npos ? "[" + h + "]" : h) + ":" + std::to_string(port_);
}

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

// ---------------------------------------------------------------- connect (initiator side)

namespace {

bool looks_like_metadata(std::string_view b) {
  return b.size() >= sizeof(MetadataHeader) && std::memcmp(b.data(), &kMetadataMagic, 4) == 0;
}

struct ParsedMetadata {
  MetadataInfo info;
  uint8_t host_id[32];
  std::string control;  // a wildcard listener's control address
};

Status parse_metadata_bytes(std::string_view b, ParsedMetadata* out) {
  if (!looks_like_metadata(b)) return Status(Code::kInvalidArgument, "not tether endpoint metadata");
  MetadataHeader m;
  std::memcpy(&m, b.data(), sizeof m);
  if (m.version != wire::kVersion)
    return Status(Code::kProtocolError, "metadata from wire version " + std::to_string(m.version) +
                                            ", this build speaks " + std::to_string(wire::kVersion));
  if (b.size() != sizeof m + m.host_len + m.hostname_len + m.control_len)
    return Status(Code::kInvalidArgument, "metadata is truncated or malformed");
  if (m.port == 0) return Status(Code::kInvalidArgument, "metadata names port 0");
  out->info.host.assign(b.substr(sizeof m, m.host_len));
  out->info.hostname.assign(b.substr(sizeof m + m.host_len, m.hostname_len));
  out->control.assign(b.substr(sizeof m + m.host_len + m.hostname_len, m.control_len));
  out->info.port = m.port;
  std::memcpy(out->info.endpoint.data(), m.endpoint, 16);
  std::memcpy(out->host_id, m.host_id, 32);
  return Status::ok();
}

struct Target {
  std::string host;
  uint16_t port = 0;
  bool has_id = false;
  EndpointId id{};
};

// `choose` (control socket only) reads the listener's offers and fills in the transport choice.
using Chooser = std::function<Status(std::string_view offers, wire::ClientProof* cp, std::string* offer)>;

Status client_handshake(int fd, const wire::ClientHello& ch, const std::string& token, int64_t deadline,
                        wire::ServerHello* sh, const Chooser& choose, std::string* nic_list) {
  Status s = sys::write_all(fd, &ch, sizeof ch, deadline);
  if (s.is_ok()) s = sys::read_all(fd, sh, sizeof *sh, deadline);
  if (!s.is_ok()) return Status(s.code(), "handshake: " + s.message());
  if (sh->magic != wire::kMagic) return Status(Code::kProtocolError, "handshake: the other side is not a tether endpoint");
  if (sh->version != wire::kVersion || sh->status == uint8_t(wire::HelloStatus::kVersionMismatch))
    return Status(Code::kProtocolError, "handshake: peer speaks wire version " + std::to_string(sh->version) +
                                            ", this build speaks " + std::to_string(wire::kVersion));
  if (sh->status == uint8_t(wire::HelloStatus::kClosing)) return Status(Code::kConnectionLost, "handshake: peer is closing");
  if (sh->status != 0) return Status(Code::kProtocolError, "handshake: peer rejected the request");
  if (!token.empty()) {
    if (!sh->has_token) return Status(Code::kAuthFailed, "peer does not authenticate, but an auth token is set here");
    auto expect = proof(token, "tether-server", ch.nonce, sh->nonce);
    if (!crypto::equal(expect.data(), sh->proof, 32))
      return Status(Code::kAuthFailed, "peer failed to prove it holds the auth token");
  } else if (sh->has_token) {
    return Status(Code::kAuthFailed, "peer requires an auth token (set TETHER_AUTH_TOKEN or auth_token=)");
  }
  wire::ClientProof cp{};
  if (!token.empty()) {
    auto p = proof(token, "tether-client", ch.nonce, sh->nonce, ch.session, ch.lane);
    std::memcpy(cp.proof, p.data(), 32);
  }
  std::string offer;
  if (choose) {
    if (sh->offers_length > wire::kMaxOffers) return Status(Code::kProtocolError, "handshake: oversized transport offers");
    std::string offers(sh->offers_length, '\0');
    s = sys::read_all(fd, offers.data(), offers.size(), deadline);
    if (!s.is_ok()) return Status(s.code(), "handshake: " + s.message());
    s = choose(offers, &cp, &offer);
    if (!s.is_ok()) return s;
  }
  wire::ServerDone done{};
  s = sys::write_all(fd, &cp, sizeof cp, deadline);
  if (s.is_ok() && !offer.empty()) s = sys::write_all(fd, offer.data(), offer.size(), deadline);
  if (s.is_ok()) s = sys::read_all(fd, &done, sizeof done, deadline);
  if (!s.is_ok()) return Status(token.empty() ? s.code() : Code::kAuthFailed, "handshake: " + s.message());
  if (done.status == uint8_t(wire::HelloStatus::kAuthFailed))
    return Status(Code::kAuthFailed, "peer refused our auth token");
  if (done.status == uint8_t(wire::HelloStatus::kNotSameHost))
    return Status(Code::kAccessDenied, "handshake: the peer could not verify that we share its host (our lanes of a "
                                       "same-host transport did not reach it)");
  if (done.status != 0) return Status(Code::kProtocolError, "handshake: peer rejected the connection");
  if (done.nic_list > 0) {  // control socket: the listener's data NICs follow
    if (!nic_list || ch.kind != uint8_t(wire::SocketKind::kControl))
      return Status(Code::kProtocolError, "handshake: NIC list on a data connection");
    nic_list->resize(done.nic_list);
    s = sys::read_all(fd, nic_list->data(), nic_list->size(), deadline);
    if (!s.is_ok()) return Status(s.code(), "handshake: " + s.message());
  }
  return Status::ok();
}

}  // namespace

namespace {
// A control handshake that failed names where it went; one that timed out says what that usually means.
Status at_address(const Status& s, const std::string& host, uint16_t port) {
  const std::string where = host.find(':') != std::string::npos ? "[" + host + "]:" + std::to_string(port)
                                                                 : host + ":" + std::to_string(port);
  if (s.code() == Code::kTimeout)
    return Status(s.code(), "connect to " + where + ": it accepted the connection but never answered the handshake; "
                            "is a tether endpoint listening there (or something else, on the wrong port)?");
  return Status(s.code(), "connect to " + where + ": " + s.message());
}
}  // namespace

Result<Peer> EndpointImpl::connect(std::string_view target_bytes, int64_t timeout_ms) {
  if (closing_.load()) return Status(Code::kCancelled, "endpoint closed");
  const int64_t deadline = sys::now_ms() + (timeout_ms < 0 ? int64_t(config_.connect_timeout_ms) : timeout_ms);
  Target t;
  if (looks_like_metadata(target_bytes)) {
    ParsedMetadata m;
    Status ps = parse_metadata_bytes(target_bytes, &m);
    if (!ps.is_ok()) return ps;
    const bool same_host = std::memcmp(m.host_id, host_id_.data(), 32) == 0;
    t.host = !wildcard(m.info.host) ? m.info.host : same_host ? "127.0.0.1" : !m.control.empty() ? m.control : m.info.hostname;
    t.port = m.info.port;
    t.has_id = true;
    t.id = m.info.endpoint;
  } else {
    Status s = sys::split_host_port(target_bytes, &t.host, &t.port);
    if (!s.is_ok()) return Status(Code::kInvalidArgument, "connect: expected metadata bytes or \"host:port\"; " + s.message());
  }

  wire::ClientHello ch{};
  ch.magic = wire::kMagic;
  ch.version = wire::kVersion;
  ch.kind = uint8_t(wire::SocketKind::kControl);
  ch.has_token = !config_.auth_token.empty();
  std::memcpy(ch.endpoint_id, id_.data(), 16);
  ch.session = crypto::random_u64();
  ch.lanes = config_.channels * config_.sockets_per_channel;  // TCP data sockets, if tcp is chosen
  ch.peer_timeout_ms = config_.peer_timeout_ms;
  ch.chunk_bytes = config_.chunk_bytes;
  ch.max_notify = config_.notify_max_bytes;
  std::memcpy(ch.host_id, host_id_.data(), 32);
  copy_name(ch.name, name_);
  for (auto& tr : transports_)  // what we could choose: the listener offers no more than it must
    if (tr->unavailable_reason().empty() && (config_.transport == "auto" || config_.transport == tr->name()))
      ch.transports |= wire::transport_bit(tr->name());

  transport::Transport* chosen = nullptr;
  transport::Transport* prepared = nullptr;  // connector_offer() ran: abandon() it if we fail before attach()
  std::string remote_offer;
  wire::ServerHello sh{};
  auto choose = [&](std::string_view offers, wire::ClientProof* cp, std::string* offer) -> Status {
    wire::Offers theirs;
    if (!wire::decode_offers(offers, &theirs)) return Status(Code::kProtocolError, "handshake: malformed transport offers");
    auto r = choose_transport(theirs, std::memcmp(sh.host_id, host_id_.data(), 32) == 0);  // sh: read just now
    if (!r.is_ok()) return r.status();
    chosen = r.value().first;
    remote_offer = std::move(r.value().second);
    std::memcpy(cp->transport, chosen->name(), std::min(sizeof cp->transport - 1, std::strlen(chosen->name())));
    cp->lanes = chosen->lanes_for(remote_offer);
    auto mine = chosen->connector_offer(ch.session, remote_offer);
    if (!mine.is_ok()) return Status(mine.status().code(), "connect: transport " + std::string(chosen->name()) + ": " +
                                                               mine.status().message());
    prepared = chosen;
    *offer = mine.take();
    cp->offer_length = uint32_t(offer->size());
    return Status::ok();
  };

  std::vector<int> fds;
  struct Untrack {  // every way out of the handshake below
    EndpointImpl* ep;
    std::vector<int>* fds;
    ~Untrack() { ep->untrack_connecting(*fds); }
  } untrack{this, &fds};
  auto cleanup = [&] {
    untrack_connecting(fds);
    for (int fd : fds) ::close(fd);
    if (prepared) prepared->abandon(ch.session);
  };
  auto failed = [&](Status s) {  // a handshake that close() cut short says so
    cleanup();
    return closing_.load() ? Status(Code::kCancelled, "endpoint closed while connecting") : s;
  };
  uint32_t lanes = 0;  // TCP data sockets to open: known once the control handshake chose tcp
  std::string nic_text;
  std::vector<sys::NicPair> pairs;  // local/remote NIC per channel (src/sys/topology.h)
  std::vector<uint8_t> pair_bad;
  std::vector<LanePath> paths;
  const std::string control_bind = plan_.control >= 0 ? plan_.all[size_t(plan_.control)].primary()->addr : "";
  const uint32_t per_channel = config_.sockets_per_channel;
  for (uint32_t lane = 0; lane <= lanes; ++lane) {
    Result<int> fd = Status(Code::kInternal, "no lane");
    const sys::NicPair* pair = nullptr;
    if (lane == 0) {
      fd = sys::connect_tcp(t.host, t.port, deadline, 0, control_bind);
    } else {
      // Channel c uses pair c % n; a pair that cannot connect is skipped for the rest.
      const size_t first = ((lane - 1) / per_channel) % pairs.size();
      for (size_t k = 0; k < pairs.size(); ++k) {
        const size_t i = (first + k) % pairs.size();
        if (pair_bad[i]) continue;
        fd = sys::connect_tcp(pairs[i].remote_addr, t.port, deadline, config_.socket_buffer, pairs[i].local_addr);
        if (fd.is_ok()) { pair = &pairs[i]; break; }
        pair_bad[i] = 1;
      }
    }
    if (!fd.is_ok()) return failed(fd.status());
    fds.push_back(fd.value());
    track_connecting(fd.value());
    crypto::random_bytes(ch.nonce, sizeof ch.nonce);
    ch.kind = uint8_t(lane == 0 ? wire::SocketKind::kControl : wire::SocketKind::kData);
    ch.lane = lane == 0 ? 0 : lane - 1;
    Status s = client_handshake(fd.value(), ch, config_.auth_token, deadline, &sh, lane == 0 ? Chooser(choose) : Chooser(),
                                lane == 0 ? &nic_text : nullptr);
    if (!s.is_ok()) return failed(lane == 0 ? at_address(s, t.host, t.port) : s);
    if (lane == 0) {
      const std::string peer_ip = sys::remote_addr(fd.value());
      const bool same = std::memcmp(sh.host_id, host_id_.data(), 32) == 0;
      if (!same && !sys::is_loopback_host(peer_ip)) {
        auto remote = sys::decode_nic_list(nic_text);
        if (!remote.is_ok()) { cleanup(); return remote.status(); }
        pairs = sys::pair_nics(plan_.data, remote.value());
        if (pairs.empty())  // no common subnet with what it advertised: leave from our NIC toward its control address
          pairs = sys::pair_nics(plan_.data, {sys::RemoteNic{"", sys::NicAddr{peer_ip.find(':') != std::string::npos ? AF_INET6 : AF_INET, peer_ip, 0}}});
      }
      if (pairs.empty()) pairs.push_back(sys::NicPair{-1, "", "", t.host, ""});  // routing decides, as for one NIC
      pair_bad.assign(pairs.size(), 0);
    } else {
      sys::set_link_timeout(fd.value(), config_.lane_timeout_ms);
      paths.push_back(describe_lane(fd.value(), pair));
    }
    if (t.has_id && std::memcmp(sh.endpoint_id, t.id.data(), 16) != 0) {
      cleanup();
      return Status(Code::kInvalidArgument, "the endpoint at " + t.host + ":" + std::to_string(t.port) +
                                                " is not the one the metadata names (it restarted?)");
    }
    if (lane == 0 && chosen->caps().uses_tcp_lanes) lanes = ch.lanes;
  }
  PeerInfo info;
  info.id = next_peer_id_.fetch_add(1);
  std::memcpy(info.endpoint.data(), sh.endpoint_id, 16);
  info.name = read_name(sh.name);
  info.same_host = std::memcmp(sh.host_id, host_id_.data(), 32) == 0;
  info.heartbeat_ms = heartbeat_for(sh.peer_timeout_ms);
  info.chunk_bytes = chunk_for(sh.chunk_bytes);
  info.max_notify = std::min(uint32_t(sh.max_notify), wire::kMaxNotify);  // a copy: no reference to a packed field
  info.transport = chosen->name();
  untrack_connecting(fds);  // handed to the peer: closed with it, never while listed
  auto peer = std::make_shared<PeerState>(shared_from_this(), info, chosen->lanes_for(remote_offer), chosen);
  peer->control_fd = fds[0];
  peer->lane_fds.assign(fds.begin() + 1, fds.end());
  peer->lane_paths = std::move(paths);
  for (int fd : peer->lane_fds) sys::tune_data_socket(fd);
  Status s = chosen->attach(peer, peer->lane_fds, remote_offer, true, deadline);  // before anyone can post on the peer
  if (!s.is_ok()) {
    chosen->abandon(ch.session);  // whatever connector_offer() prepared and attach() did not take
    peer->lane_fds.clear();  // the transport owns (and closed) them; the control socket closes with the peer
    return Status(s.code(), "connect: transport " + info.transport + ": " + s.message());
  }
  {
    std::lock_guard lock(peers_mu_);
    if (closing_.load()) {
      peer->fail(Status(Code::kCancelled, "endpoint closed"));
      return Status(Code::kCancelled, "endpoint closed");
    }
    peers_[info.id] = peer;     // visible to peers() and deregister() at once
    to_adopt_.push_back(peer);  // the control thread starts reading its control socket
    // Failed since attach (its lanes saw the other side leave): reap() may have looked for it before
    // it was listed; listed again so it is reaped and its descriptors close.
    if (peer->failed()) to_reap_.push_back(info.id);
  }
  wake_control();
  return Peer(peer);
}

// The transport for a peer whose listener offered `theirs`: the configured one, else the highest
// priority both sides can use. Same-host-only transports need a peer on this host.
Result<std::pair<transport::Transport*, std::string>> EndpointImpl::choose_transport(const wire::Offers& theirs,
                                                                                     bool same_host) const {
  const std::string& want = config_.transport;
  transport::Transport* best = nullptr;
  std::string best_offer;
  for (auto& t : transports_) {
    if (!t->unavailable_reason().empty()) continue;
    if (t->caps().same_host_only && !same_host) continue;
    auto it = std::find_if(theirs.begin(), theirs.end(), [&](auto& o) { return o.first == t->name(); });
    if (it == theirs.end()) continue;
    if (want != "auto" && want != t->name()) continue;
    if (!best || t->priority() > best->priority()) {
      best = t.get();
      best_offer = it->second;
    }
  }
  if (!best) {
    std::string names;
    for (auto& o : theirs) names += (names.empty() ? "" : ", ") + o.first;
    return Status(Code::kUnavailable, "connect: no transport both sides can use (wanted " + want + "; peer offers " +
                                          (names.empty() ? "none" : names) + ")");
  }
  return std::make_pair(best, std::move(best_offer));
}

std::vector<std::pair<std::string, std::string>> EndpointImpl::transport_status() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (auto& t : transports_) out.emplace_back(t->name(), t->unavailable_reason());
  return out;
}

Result<Region> EndpointImpl::register_memory(void* ptr, uint64_t size, MemoryKind kind, int device, bool readonly) {
  if (closing_.load()) return Status(Code::kCancelled, "endpoint closed");
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

// Control thread: starts serving a published peer's control socket. A peer that failed already is
// skipped: reap() has taken it out of peers_, and a registration now would never be removed.
void EndpointImpl::adopt_peer(const std::shared_ptr<PeerState>& peer) {
  if (peer->failed()) return;
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = peer->info().id;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, peer->control_fd, &ev);
}

// ---------------------------------------------------------------- control thread

void EndpointImpl::control_loop() {
  sys::name_this_thread("control");
  epoll_event events[64];
  const int tick_ms = int(std::max<uint32_t>(10, std::min<uint32_t>({config_.heartbeat_ms, config_.peer_timeout_ms / 4, uint32_t(200)})));
  while (!closing_.load()) {
    int wait_ms = tick_ms;  // a paused listener is looked at again when its pause ends
    if (!listen_armed_) wait_ms = int(std::clamp<int64_t>(listen_retry_at_ms_ - sys::now_ms(), 1, tick_ms));
    int n = ::epoll_wait(epoll_fd_, events, 64, wait_ms);
    for (int i = 0; i < n && !closing_.load(); ++i) {
      const uint64_t tag = events[i].data.u64;
      if (tag == kListenTag) {
        accept_all();
      } else if (tag == kEventTag) {
        uint64_t v;
        ssize_t rc = ::read(event_fd_, &v, sizeof v);
        (void)rc;
      } else if ((tag & kTagMask) == kPendingTag) {
        advance_handshake(int(tag & ~kTagMask));
      } else {
        std::shared_ptr<PeerState> p;
        {
          std::lock_guard lock(peers_mu_);
          if (auto it = peers_.find(tag); it != peers_.end()) p = it->second;
        }
        if (p && !p->failed() && !p->ctl_backlogged) control_readable(*p);
      }
    }
    std::vector<std::shared_ptr<PeerState>> adopt;
    {
      std::lock_guard lock(peers_mu_);
      adopt.swap(to_adopt_);
    }
    for (auto& p : adopt) adopt_peer(p);
    resume_listening(sys::now_ms());
    reap();
    std::vector<std::shared_ptr<PeerState>> all;
    {
      std::lock_guard lock(peers_mu_);
      for (auto& [id, p] : peers_) all.push_back(p);
    }
    for (auto& p : all) flush_control(*p);
    if (sys::now_ms() - last_tick_ms_ >= tick_ms) tick(all);
  }
}


void EndpointImpl::listen_paused(bool paused) {
  if (listen_armed_ == !paused) return;
  listen_armed_ = !paused;
  if (paused) {
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listen_fd_, nullptr);
    return;
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kListenTag;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &ev);
}

// Control thread, every turn: a paused listener is tried again after its pause, or, paused for the
// handshake cap, as soon as a handshake has ended.
void EndpointImpl::resume_listening(int64_t now) {
  if (listen_armed_) return;
  if (now >= listen_retry_at_ms_ || (!paused_for_fds_ && pending_.size() < max_pending_)) listen_paused(false);
}

// Sheds the unfinished handshake accepted first, once it has had kHandshakeGraceMs: a connector that
// answers promptly is done long before, so under a flood of idle or slow handshakes new connections
// still get in, while a burst of real ones (each done within the grace) is not cut. False, with *retry_at
// the moment one will be old enough, when none is yet.
bool EndpointImpl::shed_oldest_pending(int64_t now, int64_t* retry_at) {
  auto oldest = pending_.end();
  for (auto it = pending_.begin(); it != pending_.end(); ++it)
    if (oldest == pending_.end() || it->second->seq < oldest->second->seq) oldest = it;
  if (oldest == pending_.end() || now - oldest->second->since_ms < kHandshakeGraceMs) {
    *retry_at = oldest == pending_.end() ? now : oldest->second->since_ms + kHandshakeGraceMs;
    return false;
  }
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, oldest->first, nullptr);
  ::close(oldest->first);
  pending_.erase(oldest);
  return true;
}

void EndpointImpl::accept_all() {
  // Level-triggered: a listener left armed while accept() cannot succeed would wake us forever.
  constexpr int64_t kRetryMs = 100;
  constexpr int64_t kLogEveryMs = 10000;  // episodes a flood starts and ends in turn are logged at most this often
  for (;;) {
    const int64_t now = sys::now_ms();
    int64_t retry_at = now;
    if (pending_.size() >= max_pending_) {
      if (!logged_pending_ && now >= quiet_log_until_ms_)
        std::fprintf(stderr, "tether: endpoint '%s': %zu handshakes under way at once (the limit: a quarter of the "
                             "open-files limit); the oldest unfinished after %lld ms are dropped for new connections\n",
                     name_.c_str(), pending_.size(), static_cast<long long>(kHandshakeGraceMs));
      if (!logged_pending_) quiet_log_until_ms_ = now + kLogEveryMs;
      logged_pending_ = true;
      if (!shed_oldest_pending(now, &retry_at)) {
        listen_retry_at_ms_ = retry_at;
        paused_for_fds_ = false;
        listen_paused(true);
        return;
      }
    }
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        if (shed_oldest_pending(now, &retry_at)) continue;  // its descriptor is free for the next in line
        if (!logged_fds_ && sys::now_ms() >= quiet_log_until_ms_)
          std::fprintf(stderr, "tether: endpoint '%s': out of file descriptors (accept: %s; %zu handshakes under way); "
                               "new connections wait until descriptors free up\n", name_.c_str(), std::strerror(errno),
                       pending_.size());
        if (!logged_fds_) quiet_log_until_ms_ = sys::now_ms() + kLogEveryMs;
        logged_fds_ = true;
        listen_retry_at_ms_ = pending_.empty() ? now + kRetryMs : std::min(now + kRetryMs, retry_at);
        paused_for_fds_ = true;
        listen_paused(true);
      }
      return;  // EAGAIN: nothing queued; ECONNABORTED and the like: the next event retries
    }
    logged_fds_ = false;  // an episode ends when accept() works again
    if (pending_.size() + 1 < max_pending_ / 2) logged_pending_ = false;
    sys::set_nodelay(fd);  // control messages are small: Nagle + delayed ACK would add 40 ms stalls
    auto p = std::make_unique<Pending>();
    p->fd = fd;
    p->since_ms = sys::now_ms();
    p->deadline_ms = p->since_ms + config_.handshake_timeout_ms;
    p->seq = next_pending_seq_++;
    crypto::random_bytes(p->server_nonce, 16);
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.u64 = kPendingTag | uint64_t(fd);
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
    pending_[fd] = std::move(p);
    advance_handshake(fd);  // its hello usually came with it: answered before a later accept can shed it
  }
}

void EndpointImpl::advance_handshake(int fd) {
  auto it = pending_.find(fd);
  if (it == pending_.end()) return;
  Pending& p = *it->second;
  auto drop = [&] {
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
    ::close(fd);
    pending_.erase(it);
  };
  const size_t need = p.stage == 0 ? sizeof(wire::ClientHello) : p.stage == 1 ? sizeof(wire::ClientProof) : p.offer.size();
  uint8_t* into = p.stage == 2 ? reinterpret_cast<uint8_t*>(p.offer.data()) : p.buf;
  while (p.have < need) {
    ssize_t n = ::recv(fd, into + p.have, need - p.have, MSG_DONTWAIT);
    if (n > 0) { p.have += size_t(n); continue; }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    drop();  // closed or failed mid-handshake
    return;
  }
  // Replies are a few hundred bytes on a fresh socket: they fit its buffer; a short write is garbage.
  auto reply = [&](const void* data, size_t len) {
    return ::send(fd, data, len, MSG_NOSIGNAL | MSG_DONTWAIT) == ssize_t(len);
  };
  const std::string& token = config_.auth_token;
  if (p.stage == 0) {
    std::memcpy(&p.hello, p.buf, sizeof p.hello);
    const wire::ClientHello& h = p.hello;
    if (h.magic != wire::kMagic) { drop(); return; }  // not a tether peer: say nothing
    wire::ServerHello sh{};
    sh.magic = wire::kMagic;
    sh.version = wire::kVersion;
    sh.has_token = !token.empty();
    sh.peer_timeout_ms = config_.peer_timeout_ms;
    sh.chunk_bytes = config_.chunk_bytes;
    sh.max_notify = config_.notify_max_bytes;
    std::memcpy(sh.endpoint_id, id_.data(), 16);
    std::memcpy(sh.nonce, p.server_nonce, 16);
    std::memcpy(sh.host_id, host_id_.data(), 32);
    copy_name(sh.name, name_);
    bool bad = false;
    if (h.version != wire::kVersion) {
      sh.status = uint8_t(wire::HelloStatus::kVersionMismatch);
      bad = true;
    } else if (closing_.load()) {
      sh.status = uint8_t(wire::HelloStatus::kClosing);
      bad = true;
    } else if ((h.kind != uint8_t(wire::SocketKind::kControl) && h.kind != uint8_t(wire::SocketKind::kData)) ||
               h.lanes == 0 || h.lanes > kMaxLanes || h.lane >= h.lanes) {
      sh.status = uint8_t(wire::HelloStatus::kBadRequest);
      bad = true;
    }
    if (!token.empty()) {
      auto pr = proof(token, "tether-server", h.nonce, p.server_nonce);
      std::memcpy(sh.proof, pr.data(), 32);
    }
    std::string out;
    if (!bad && h.kind == uint8_t(wire::SocketKind::kControl)) {
      // Only the transports the connector can choose, and of those only the ones of the highest
      // priority (it takes the highest both offer): building an offer can be costly (fabric opens
      // its rails), and a same-host peer that will take ipc needs no other.
      const bool same = std::memcmp(h.host_id, host_id_.data(), 32) == 0;
      auto usable = [&](const transport::Transport& t) {
        return t.unavailable_reason().empty() && (h.transports == 0 || (h.transports & wire::transport_bit(t.name()))) &&
               (!t.caps().same_host_only || same);
      };
      int best = INT_MIN;
      for (auto& t : transports_)
        if (usable(*t)) best = std::max(best, t->priority());
      wire::Offers offers;
      for (auto& t : transports_)
        if (usable(*t) && t->priority() == best) offers.emplace_back(t->name(), t->offer(h.session));
      out = wire::encode_offers(offers);
      sh.offers_length = uint32_t(out.size());
    }
    out.insert(0, reinterpret_cast<const char*>(&sh), sizeof sh);
    if (!reply(out.data(), out.size()) || bad) { drop(); return; }
    p.stage = 1;
    p.have = 0;
    return;
  }
  if (p.stage == 1) {
    std::memcpy(&p.proof, p.buf, sizeof p.proof);
    const bool control = p.hello.kind == uint8_t(wire::SocketKind::kControl);
    if (control && p.proof.offer_length > wire::kMaxOffers) { drop(); return; }
    if (control && p.proof.offer_length > 0) {
      p.offer.resize(p.proof.offer_length);
      p.stage = 2;
      p.have = 0;
      advance_handshake(fd);  // it may have arrived with the proof
      return;
    }
  }
  const wire::ClientProof& cp = p.proof;
  wire::ServerDone done{};
  if (!token.empty()) {
    auto expect = proof(token, "tether-client", p.hello.nonce, p.server_nonce, p.hello.session, p.hello.lane);
    if (!crypto::equal(expect.data(), cp.proof, 32)) done.status = uint8_t(wire::HelloStatus::kAuthFailed);
  }
  if (done.status == 0) {
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
    std::unique_ptr<Pending> owned = std::move(it->second);
    pending_.erase(it);
    finish_accept(*owned);  // takes the fd
    return;
  }
  reply(&done, sizeof done);
  drop();
}

void EndpointImpl::finish_accept(Pending& p) {
  const wire::ClientHello& h = p.hello;
  wire::ServerDone done{};
  int fd = p.fd;
  if (h.kind == uint8_t(wire::SocketKind::kControl)) {
    PeerInfo info;
    info.id = next_peer_id_.fetch_add(1);
    std::memcpy(info.endpoint.data(), h.endpoint_id, 16);
    info.name = read_name(h.name);
    info.same_host = std::memcmp(h.host_id, host_id_.data(), 32) == 0;
    info.heartbeat_ms = heartbeat_for(h.peer_timeout_ms);
    info.chunk_bytes = chunk_for(h.chunk_bytes);
    info.max_notify = std::min(uint32_t(h.max_notify), wire::kMaxNotify);  // a copy: no reference to a packed field
    const wire::ClientProof& cp = p.proof;
    const std::string name(cp.transport, strnlen(cp.transport, sizeof cp.transport));
    transport::Transport* chosen = nullptr;
    for (auto& t : transports_)
      if (name == t->name() && t->unavailable_reason().empty() && (!t->caps().same_host_only || info.same_host)) chosen = t.get();
    const bool tcp_lanes = chosen && chosen->caps().uses_tcp_lanes;
    if (!chosen || cp.lanes == 0 || cp.lanes > kMaxLanes || (tcp_lanes && cp.lanes != h.lanes)) {
      done.status = uint8_t(wire::HelloStatus::kBadRequest);
      ::send(fd, &done, sizeof done, MSG_NOSIGNAL | MSG_DONTWAIT);
      ::close(fd);
      return;
    }
    info.transport = name;
    auto peer = std::make_shared<PeerState>(shared_from_this(), info, uint32_t(cp.lanes), chosen);  // packed: a copy
    const bool early = !tcp_lanes && chosen->caps().attach_before_answer;
    if (early) {  // attach and publish first: connect() returning there means peers() shows it here
      Status s = chosen->attach(peer, {}, p.offer, false, sys::now_ms() + config_.connect_timeout_ms);
      if (!s.is_ok()) {
        done.status = uint8_t(s.code() == Code::kAccessDenied ? wire::HelloStatus::kNotSameHost : wire::HelloStatus::kBadRequest);
        ::send(fd, &done, sizeof done, MSG_NOSIGNAL | MSG_DONTWAIT);
        ::close(fd);
        peer->fail(Status(s.code(), "accept: transport " + name + ": " + s.message()));
        return;
      }
      std::lock_guard lock(peers_mu_);
      peers_[peer->info().id] = peer;
    }
    peer->control_fd = fd;
    // Our data NICs follow the answer (a few hundred bytes: they fit a fresh socket's buffer).
    const std::string nics = advertised_nics();
    done.nic_list = uint16_t(nics.size());
    std::string reply(reinterpret_cast<const char*>(&done), sizeof done);
    reply += nics;
    if (::send(fd, reply.data(), reply.size(), MSG_NOSIGNAL | MSG_DONTWAIT) != ssize_t(reply.size())) {
      if (early) peer->fail(Status(Code::kConnectionLost, "accept: the connector left during the handshake"));
      return;  // peer closes fd
    }
    if (early) {
      adopt_peer(peer);
      return;
    }
    if (tcp_lanes) {  // the data sockets join next
      peer->lane_fds.assign(h.lanes, -1);
      peer->lane_paths.resize(h.lanes);
      peer->accept_deadline_ms = sys::now_ms() + config_.handshake_timeout_ms;
      accepting_[uint64_t(h.session)] = peer;  // packed field: a copy, not a reference
      return;
    }
    // Its own lanes: attach after answering, since attaching may need the connector to act.
    Status s = chosen->attach(peer, {}, p.offer, false, sys::now_ms() + config_.connect_timeout_ms);
    if (!s.is_ok()) {
      peer->fail(Status(s.code(), "accept: transport " + name + ": " + s.message()));
      return;
    }
    {
      std::lock_guard lock(peers_mu_);
      peers_[peer->info().id] = peer;
    }
    adopt_peer(peer);
    return;
  }
  auto it = accepting_.find(uint64_t(h.session));
  if (it == accepting_.end() || std::memcmp(it->second->info().endpoint.data(), h.endpoint_id, 16) != 0 ||
      it->second->lane_fds.size() != h.lanes || it->second->lane_fds[h.lane] != -1) {
    done.status = uint8_t(wire::HelloStatus::kBadRequest);
    ::send(fd, &done, sizeof done, MSG_NOSIGNAL | MSG_DONTWAIT);
    ::close(fd);
    return;
  }
  auto peer = it->second;
  peer->lane_fds[h.lane] = fd;
  peer->lane_paths[h.lane] = describe_lane(fd, nullptr);
  sys::tune_data_socket(fd);
  sys::set_link_timeout(fd, config_.lane_timeout_ms);
  bool complete = true;
  for (int lfd : peer->lane_fds) complete &= lfd >= 0;
  if (complete) {  // publish before the last answer: when connect() returns there, peers() shows it here
    accepting_.erase(it);
    Status s = peer->transport->attach(peer, peer->lane_fds, {}, false, sys::now_ms() + config_.connect_timeout_ms);
    if (!s.is_ok()) peer->fail(s);
    {
      std::lock_guard lock(peers_mu_);
      peers_[peer->info().id] = peer;
    }
    adopt_peer(peer);
  }
  ::send(fd, &done, sizeof done, MSG_NOSIGNAL | MSG_DONTWAIT);
}

namespace {
constexpr size_t kControlRead = 64 << 10;      // bytes read from a control socket at a time
constexpr int kControlReadsPerTurn = 16;       // then other sockets get their turn (level-triggered: we come back)
constexpr size_t kKeepCapacity = 256 << 10;    // a control buffer larger than this is given back once empty
}  // namespace

// Reads and handles whole control messages. The input buffer never holds more than one partial
// message plus one read (parsing follows every read), so a fast sender cannot grow it.
void EndpointImpl::control_readable(PeerState& peer) {
  for (int reads = 0; reads < kControlReadsPerTurn; ++reads) {
    const size_t had = peer.ctl_in.size();
    peer.ctl_in.resize(had + kControlRead);
    ssize_t n = ::recv(peer.control_fd, peer.ctl_in.data() + had, kControlRead, MSG_DONTWAIT);
    peer.ctl_in.resize(had + size_t(std::max<ssize_t>(n, 0)));
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
      peer.fail(Status(Code::kConnectionLost, n == 0 ? "peer '" + peer.info().name + "' closed the connection"
                                                     : "control connection to peer '" + peer.info().name + "': " + std::strerror(errno)));
      return;
    }
    if (!parse_control(peer)) return;
    if (n < 0) break;  // drained
  }
  if (peer.ctl_in.empty() && peer.ctl_in.capacity() > kKeepCapacity) std::string().swap(peer.ctl_in);
}

// Handles every whole message in peer.ctl_in and keeps the partial rest; false if the peer failed.
bool EndpointImpl::parse_control(PeerState& peer) {
  size_t pos = 0;
  while (peer.ctl_in.size() - pos >= sizeof(wire::ControlHeader)) {
    wire::ControlHeader h;
    std::memcpy(&h, peer.ctl_in.data() + pos, sizeof h);
    if (h.length > wire::kMaxControlBody || h.pad[0] || h.pad[1] || h.pad[2]) {
      peer.fail(Status(Code::kProtocolError, "peer '" + peer.info().name + "' sent garbage on the control connection"));
      return false;
    }
    if (peer.ctl_in.size() - pos < sizeof h + h.length) break;
    peer.on_control(static_cast<wire::ControlType>(h.type),
                    reinterpret_cast<const uint8_t*>(peer.ctl_in.data() + pos + sizeof h), h.length);
    pos += sizeof h + h.length;
    if (peer.failed()) return false;
  }
  peer.ctl_in.erase(0, pos);
  return true;
}

// Sends what the peer's control output holds. A peer that does not read its control connection is
// not read either while more than kControlBacklog bytes wait for it (its answers cannot pile up
// here); it then falls silent to us and peer_timeout_ms ends it. Answers raised on its data lanes are
// bounded by kAnswerBacklog instead (PeerState::send_answer).
void EndpointImpl::flush_control(PeerState& peer) {
  if (peer.failed()) return;
  if (peer.take_control_output(&peer.ctl_pending, peer.ctl_sent)) peer.last_sent_ms = sys::now_ms();
  while (peer.ctl_sent < peer.ctl_pending.size()) {
    ssize_t n = ::send(peer.control_fd, peer.ctl_pending.data() + peer.ctl_sent, peer.ctl_pending.size() - peer.ctl_sent,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) { peer.ctl_sent += size_t(n); continue; }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) break;
    peer.fail(Status(Code::kConnectionLost, "control connection to peer '" + peer.info().name + "': " + std::strerror(errno)));
    return;
  }
  if (peer.ctl_sent == peer.ctl_pending.size()) {
    if (peer.ctl_pending.capacity() > kKeepCapacity) std::string().swap(peer.ctl_pending);
    peer.ctl_pending.clear();
    peer.ctl_sent = 0;
  }
  peer.set_control_unsent(peer.ctl_pending.size() - peer.ctl_sent);
  const bool out = !peer.ctl_pending.empty();
  const bool backlogged = peer.ctl_pending.size() - peer.ctl_sent > kControlBacklog;
  if (out != peer.ctl_epollout || backlogged != peer.ctl_backlogged) {
    epoll_event ev{};
    // Backlogged: writable only (a hang-up still shows as EPOLLHUP/EPOLLERR, and the send then fails).
    ev.events = backlogged ? uint32_t(EPOLLOUT) : EPOLLIN | EPOLLRDHUP | (out ? uint32_t(EPOLLOUT) : 0u);
    ev.data.u64 = peer.info().id;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, peer.control_fd, &ev);
    peer.ctl_epollout = out;
    peer.ctl_backlogged = backlogged;
  }
}

void EndpointImpl::tick(const std::vector<std::shared_ptr<PeerState>>& peers) {
  const int64_t now = sys::now_ms();
  last_tick_ms_ = now;
  trace::flush();  // TETHER_TRACE only: what was recorded since the last tick
#ifdef __GLIBC__
  // Notifications read by now were freed by the caller; glibc keeps freed heap (thread arenas, a raised
  // mmap threshold) unless asked, so a burst of large ones would stay resident (docs/RELIABILITY.md, the notification attack).
  if (trim_due_.exchange(false, std::memory_order_relaxed)) ::malloc_trim(0);
#endif
  for (auto& p : peers) {
    if (p->failed()) continue;
    if (now - p->last_heard_ms() > int64_t(config_.peer_timeout_ms)) {
      p->fail(Status(Code::kConnectionLost, "peer '" + p->info().name + "' silent for " +
                                                std::to_string(now - p->last_heard_ms()) + " ms (peer_timeout_ms)"));
      continue;
    }
    if (now - p->last_sent_ms >= int64_t(p->info().heartbeat_ms)) p->send_control(wire::ControlType::kHeartbeat, nullptr, 0);
  }
  for (auto& t : transports_)
    if (t->unavailable_reason().empty()) t->tick(now);
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (now > it->second->deadline_ms) {
      ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, it->first, nullptr);
      ::close(it->first);
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = accepting_.begin(); it != accepting_.end();) {
    if (now > it->second->accept_deadline_ms) {
      it->second->fail(Status(Code::kTimeout, "peer never opened all its data connections"));
      it = accepting_.erase(it);
    } else {
      ++it;
    }
  }
}

void EndpointImpl::reap() {
  std::vector<uint64_t> ids;
  std::vector<std::shared_ptr<PeerState>> gone;
  {
    std::lock_guard lock(peers_mu_);
    ids.swap(to_reap_);
    for (uint64_t id : ids) {
      if (auto it = peers_.find(id); it != peers_.end()) {
        gone.push_back(it->second);
        peers_.erase(it);
      }
    }
  }
  for (auto& p : gone) {
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, p->control_fd, nullptr);
    p->let_go_control();  // fail() has shut its sockets down; this thread never reads them again
  }
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

// Peer
Transfer Peer::write(const Region& local, uint64_t local_offset, const RemoteRegion& remote, uint64_t remote_offset,
                     uint64_t length, std::string notify) {
  const Block b{local_offset, remote_offset, length};
  return writev(local, remote, &b, 1, std::move(notify));
}
Transfer Peer::read(const Region& local, uint64_t local_offset, const RemoteRegion& remote, uint64_t remote_offset,
                    uint64_t length) {
  const Block b{local_offset, remote_offset, length};
  return readv(local, remote, &b, 1);
}

namespace {
// An IoEntry list as runs of blocks: consecutive entries with the same local region and an equal
// descriptor form one run, so the core keeps one copy of each descriptor rather than one per entry.
struct EntryRuns {
  std::vector<Block> blocks;
  std::vector<BlockRun> runs;
  explicit EntryRuns(const std::vector<IoEntry>& entries) {
    blocks.reserve(entries.size());  // runs point into it
    for (size_t i = 0; i < entries.size(); ++i) {
      const IoEntry& e = entries[i];
      blocks.push_back(Block{e.local_offset, e.remote_offset, e.length});
      if (i == 0 || e.local.state() != entries[i - 1].local.state() || !(e.remote == entries[i - 1].remote))
        runs.push_back(BlockRun{&e.local, &e.remote, &blocks.back(), 0});
      ++runs.back().n;
    }
  }
};
}  // namespace

Transfer Peer::writev(std::vector<IoEntry> entries, std::string notify) {
  const EntryRuns r(entries);
  return state_->post_rma(core::OpKind::kWrite, r.runs.data(), r.runs.size(), "entry", std::move(notify));
}
Transfer Peer::readv(std::vector<IoEntry> entries) {
  const EntryRuns r(entries);
  return state_->post_rma(core::OpKind::kRead, r.runs.data(), r.runs.size(), "entry", {});
}
Transfer Peer::writev(const Region& local, const RemoteRegion& remote, const Block* blocks, size_t n, std::string notify) {
  const BlockRun run{&local, &remote, blocks, n};
  return state_->post_rma(core::OpKind::kWrite, &run, 1, "block", std::move(notify));
}
Transfer Peer::readv(const Region& local, const RemoteRegion& remote, const Block* blocks, size_t n, std::string notify) {
  const BlockRun run{&local, &remote, blocks, n};
  return state_->post_rma(core::OpKind::kRead, &run, 1, "block", std::move(notify));
}
Transfer Peer::writev(const BlockRun* runs, size_t nruns, std::string notify) {
  return state_->post_rma(core::OpKind::kWrite, runs, nruns, "block", std::move(notify));
}
Transfer Peer::readv(const BlockRun* runs, size_t nruns, std::string notify) {
  return state_->post_rma(core::OpKind::kRead, runs, nruns, "block", std::move(notify));
}
Transfer Peer::send(const Region& local, uint64_t offset, uint64_t length, uint64_t tag) {
  return state_->post_send(local, offset, length, tag);
}
Transfer Peer::recv(const Region& local, uint64_t offset, uint64_t length, uint64_t tag) {
  return state_->post_recv(local, offset, length, tag);
}
Transfer Peer::notify(std::string data) { return state_->post_notify(std::move(data)); }
uint64_t Peer::id() const { return state_->info().id; }
std::string Peer::name() const { return state_->info().name; }
std::string Peer::transport() const { return state_->info().transport; }
EndpointId Peer::endpoint_id() const { return state_->info().endpoint; }
bool Peer::connected() const { return !state_->failed(); }
Status Peer::error() const { return state_->error(); }
void Peer::close() {
  state_->fail(Status(Code::kCancelled, "peer '" + state_->info().name + "' was closed locally"));
  // Its sockets, segments and lane threads go as soon as every thread using them lets go: the control
  // thread within a wake-up, lanes once they answered what they held (bounded: deregister_timeout).
  (void)state_->wait_released(2000);
}

// Transfer
bool Transfer::done() const { return state_->is_finished(); }
Status Transfer::wait(int64_t timeout_ms) const {
  const core::PeerState* p = state_->peer.get();
  return state_->wait(timeout_ms, p ? p->spin_us() : 0, p ? p->busy_poll_us() : 0, p ? p->wait_nap_us() : 0);
}
bool Transfer::poll() const {
  if (state_->is_finished()) return true;
  core::PeerState* p = state_->peer.get();
  if (!p) return false;
  p->help();  // one-sided GPU copies: the caller finishes them itself (Transport::help)
  const uint32_t lane = state_->lane_hint.load(std::memory_order_relaxed);
  // A small transfer's answer is read by the caller where no other thread is reading that lane. Where
  // progress threads spin, only for a lone transfer (nothing else in flight or queued on the peer):
  // NIXL's checkXfer would otherwise wait for a tcp thread tether's own wait() never waits for, but a
  // caller polling beside threads busy with other transfers slowed the many-in-flight rows
  // (docs/PERFORMANCE.md, "Defaults and why"). Large transfers: their lanes' threads are awake anyway.
  const uint64_t bytes = state_->bytes.load(std::memory_order_relaxed);
  if (lane != UINT32_MAX && bytes <= (256u << 10) &&
      (p->busy_poll_us() == 0 || (!p->has_work() && p->unanswered_bytes() <= bytes)))
    p->poll(lane);
  return state_->is_finished();
}
Status Transfer::status() const { return state_->is_finished() ? state_->final_status() : Status::ok(); }
void Transfer::cancel() const {
  if (state_->peer) state_->peer->cancel(state_.get());
}
uint64_t Transfer::bytes() const { return state_->bytes.load(std::memory_order_acquire); }

}  // namespace tether
