// EndpointImpl::connect, the connector's side: the control socket and its handshake (which chooses the
// transport), the data sockets a transport with tcp lanes needs, then the peer, attached and published.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>

#include "core/handshake.h"
#include "sys/net.h"

namespace tether::core {
namespace {

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

// A control handshake that failed names where it went; one that timed out says what that usually means.
Status at_address(const Status& s, const std::string& host, uint16_t port) {
  const std::string where = sys::join_host_port(host, port);
  if (s.code() == Code::kTimeout)
    return Status(s.code(), "connect to " + where + ": it accepted the connection but never answered the handshake; "
                            "is a tether endpoint listening there (or something else, on the wrong port)?");
  return Status(s.code(), "connect to " + where + ": " + s.message());
}
}  // namespace

// One connect() under way; its sockets stay in connecting_fds_ until handed to the peer or closed.
struct EndpointImpl::Connecting {
  EndpointImpl* ep;
  int64_t deadline;
  std::string host;  // where the listener is
  uint16_t port = 0;
  bool has_id = false;  // the metadata named the endpoint: the one answering must be it
  EndpointId id{};
  wire::ClientHello hello{};
  wire::ServerHello server{};
  transport::Transport* chosen = nullptr;
  transport::Transport* prepared = nullptr;  // connector_offer() ran: abandon() it if we fail before attach()
  std::string remote_offer;
  std::vector<int> fds;     // the control socket, then the data sockets
  uint32_t lanes = 0;       // TCP data sockets to open: known once the control handshake chose tcp
  std::string nic_text;     // the listener's data NICs
  std::vector<sys::NicPair> pairs;  // local/remote NIC per channel (src/sys/topology.h)
  std::vector<uint8_t> pair_bad;
  std::vector<LanePath> paths;

  Connecting(EndpointImpl* e, int64_t d) : ep(e), deadline(d) {}
  ~Connecting() { ep->untrack_connecting(fds); }  // every way out of the handshake
  bool same_host() const { return std::memcmp(server.host_id, ep->host_id_.data(), 32) == 0; }
  void cleanup() {
    ep->untrack_connecting(fds);
    for (int fd : fds) ::close(fd);
    if (prepared) prepared->abandon(hello.session);
  }
  Status failed(Status s) {  // a handshake that close() cut short says so
    cleanup();
    return ep->closing_.load() ? Status(Code::kCancelled, "endpoint closed while connecting") : s;
  }
};

void EndpointImpl::track_connecting(int fd) {
  std::lock_guard lock(connecting_mu_);
  connecting_fds_.push_back(fd);
  if (closing_.load()) ::shutdown(fd, SHUT_RDWR);  // close() ran before we were listed
}

void EndpointImpl::untrack_connecting(const std::vector<int>& fds) {
  std::lock_guard lock(connecting_mu_);
  for (int fd : fds) connecting_fds_.erase(std::remove(connecting_fds_.begin(), connecting_fds_.end(), fd), connecting_fds_.end());
}

Result<Peer> EndpointImpl::connect(std::string_view target, int64_t timeout_ms) {
  if (closing_.load()) return Status(Code::kCancelled, "endpoint closed");
  gpu::KeepContext keep;
  Connecting c(this, sys::now_ms() + (timeout_ms < 0 ? int64_t(config_.connect_timeout_ms) : timeout_ms));
  if (Status s = resolve_target(target, c); !s.is_ok()) return s;
  c.hello = client_hello();
  if (Status s = open_sockets(c); !s.is_ok()) return s;
  return attach_connected(c);
}

// Where to connect: metadata bytes (Endpoint::metadata) or "host:port".
Status EndpointImpl::resolve_target(std::string_view target, Connecting& c) const {
  if (!looks_like_metadata(target)) {
    Status s = sys::split_host_port(target, &c.host, &c.port);
    if (!s.is_ok()) return Status(Code::kInvalidArgument, "connect: expected metadata bytes or \"host:port\"; " + s.message());
    return Status::ok();
  }
  ParsedMetadata m;
  Status ps = parse_metadata_bytes(target, &m);
  if (!ps.is_ok()) return ps;
  const bool same_host = std::memcmp(m.host_id, host_id_.data(), 32) == 0;
  c.host = !wildcard(m.info.host) ? m.info.host : same_host ? "127.0.0.1" : !m.control.empty() ? m.control : m.info.hostname;
  c.port = m.info.port;
  c.has_id = true;
  c.id = m.info.endpoint;
  return Status::ok();
}

wire::ClientHello EndpointImpl::client_hello() const {
  wire::ClientHello ch{};
  ch.magic = wire::kMagic;
  ch.version = wire::kVersion;
  ch.kind = uint8_t(wire::SocketKind::kControl);
  ch.has_token = !config_.auth_token.empty();
  std::memcpy(ch.endpoint_id, id_.data(), 16);
  ch.session = crypto::random_u64();
  ch.lanes = config_.channels;  // TCP data sockets, if tcp is chosen
  ch.peer_timeout_ms = config_.peer_timeout_ms;
  ch.chunk_bytes = config_.chunk_bytes;
  ch.max_notify = config_.notify_max_bytes;
  std::memcpy(ch.host_id, host_id_.data(), 32);
  copy_name(ch.name, name_);
  for (auto& tr : transports_)  // what we could choose: the listener offers no more than it must
    if (tr->unavailable_reason().empty() && (config_.transport == "auto" || config_.transport == tr->name()))
      ch.transports |= wire::transport_bit(tr->name());
  return ch;
}

// The control handshake's choice: the transport (from the listener's offers) and our offer for it.
Status EndpointImpl::choose_offer(Connecting& c, std::string_view offers, wire::ClientProof* cp, std::string* offer) {
  wire::Offers theirs;
  if (!wire::decode_offers(offers, &theirs)) return Status(Code::kProtocolError, "handshake: malformed transport offers");
  auto r = choose_transport(theirs, c.same_host());  // c.server: read just now
  if (!r.is_ok()) return r.status();
  c.chosen = r.value().first;
  c.remote_offer = std::move(r.value().second);
  std::memcpy(cp->transport, c.chosen->name(), std::min(sizeof cp->transport - 1, std::strlen(c.chosen->name())));
  cp->lanes = c.chosen->lanes_for(c.remote_offer);
  auto mine = c.chosen->connector_offer(c.hello.session, c.remote_offer);
  if (!mine.is_ok())
    return Status(mine.status().code(), "connect: transport " + std::string(c.chosen->name()) + ": " + mine.status().message());
  c.prepared = c.chosen;
  *offer = mine.take();
  cp->offer_length = uint32_t(offer->size());
  return Status::ok();
}

// The control socket, then the data sockets of a transport with tcp lanes, each with its handshake.
Status EndpointImpl::open_sockets(Connecting& c) {
  const std::string control_bind = plan_.control >= 0 ? plan_.all[size_t(plan_.control)].primary()->addr : "";
  const Chooser choose = [&](std::string_view offers, wire::ClientProof* cp, std::string* offer) {
    return choose_offer(c, offers, cp, offer);
  };
  for (uint32_t lane = 0; lane <= c.lanes; ++lane) {
    const sys::NicPair* pair = nullptr;
    Result<int> fd = lane == 0 ? sys::connect_tcp(c.host, c.port, c.deadline, 0, control_bind) : connect_data(c, lane, &pair);
    if (!fd.is_ok()) return c.failed(fd.status());
    c.fds.push_back(fd.value());
    track_connecting(fd.value());
    crypto::random_bytes(c.hello.nonce, sizeof c.hello.nonce);
    c.hello.kind = uint8_t(lane == 0 ? wire::SocketKind::kControl : wire::SocketKind::kData);
    c.hello.lane = lane == 0 ? 0 : lane - 1;
    Status s = client_handshake(fd.value(), c.hello, config_.auth_token, c.deadline, &c.server,
                                lane == 0 ? choose : Chooser(), lane == 0 ? &c.nic_text : nullptr);
    if (!s.is_ok()) return c.failed(lane == 0 ? at_address(s, c.host, c.port) : s);
    if (lane == 0) {
      if (s = choose_nic_pairs(c, fd.value()); !s.is_ok()) {
        c.cleanup();
        return s;
      }
    } else {
      sys::set_link_timeout(fd.value(), config_.lane_timeout_ms);
      c.paths.push_back(describe_lane(fd.value(), pair));
    }
    if (c.has_id && std::memcmp(c.server.endpoint_id, c.id.data(), 16) != 0) {
      c.cleanup();
      return Status(Code::kInvalidArgument, "the endpoint at " + c.host + ":" + std::to_string(c.port) +
                                                " is not the one the metadata names (it restarted?)");
    }
    if (lane == 0 && c.chosen->caps().uses_tcp_lanes) c.lanes = c.hello.lanes;
  }
  return Status::ok();
}

// Which of our data NICs goes to which of the listener's (the control socket `fd` told us its list).
Status EndpointImpl::choose_nic_pairs(Connecting& c, int fd) const {
  const std::string peer_ip = sys::remote_addr(fd);
  if (!c.same_host() && !sys::is_loopback_host(peer_ip)) {
    auto remote = sys::decode_nic_list(c.nic_text);
    if (!remote.is_ok()) return remote.status();
    c.pairs = sys::pair_nics(plan_.data, remote.value());
    if (c.pairs.empty())  // no common subnet with what it advertised: leave from our NIC toward its control address
      c.pairs = sys::pair_nics(plan_.data, {sys::RemoteNic{"", sys::NicAddr{peer_ip.find(':') != std::string::npos ? AF_INET6 : AF_INET, peer_ip, 0}}});
  }
  if (c.pairs.empty()) c.pairs.push_back(sys::NicPair{-1, "", "", c.host, ""});  // routing decides, as for one NIC
  c.pair_bad.assign(c.pairs.size(), 0);
  return Status::ok();
}

// Data socket `lane` (from 1): channel c uses NIC pair c % n; a pair that cannot connect is skipped for the rest.
Result<int> EndpointImpl::connect_data(Connecting& c, uint32_t lane, const sys::NicPair** pair) const {
  Result<int> fd = Status(Code::kInternal, "no lane");
  const size_t first = (lane - 1) % c.pairs.size();
  for (size_t k = 0; k < c.pairs.size(); ++k) {
    const size_t i = (first + k) % c.pairs.size();
    if (c.pair_bad[i]) continue;
    fd = sys::connect_tcp(c.pairs[i].remote_addr, c.port, c.deadline, config_.socket_buffer, c.pairs[i].local_addr);
    if (fd.is_ok()) {
      *pair = &c.pairs[i];
      break;
    }
    c.pair_bad[i] = 1;
  }
  return fd;
}

// Every socket is open and answered: the peer, attached to its transport, then published.
Result<Peer> EndpointImpl::attach_connected(Connecting& c) {
  PeerInfo info = describe_peer(c.server);
  info.transport = c.chosen->name();
  untrack_connecting(c.fds);  // handed to the peer: closed with it, never while listed
  auto peer = std::make_shared<PeerState>(shared_from_this(), info, c.chosen->lanes_for(c.remote_offer), c.chosen);
  peer->control_fd = c.fds[0];
  peer->lane_fds.assign(c.fds.begin() + 1, c.fds.end());
  peer->lane_paths = std::move(c.paths);
  for (int fd : peer->lane_fds) sys::tune_data_socket(fd);
  Status s = c.chosen->attach(peer, peer->lane_fds, c.remote_offer, true, c.deadline);  // before anyone can post on the peer
  if (!s.is_ok()) {
    c.chosen->abandon(c.hello.session);  // whatever connector_offer() prepared and attach() did not take
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
    // Failed since attach: reap() may have looked for it before it was listed.
    if (peer->failed()) to_reap_.push_back(info.id);
  }
  wake_control();
  return Peer(peer);
}

// The configured transport, else the highest priority one both sides can use.
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

}  // namespace tether::core
