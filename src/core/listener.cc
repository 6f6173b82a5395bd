// The listener's side of a connection: accepting sockets (bounded against floods), each socket's
// handshake as its bytes arrive, then the peer: control socket accepted, data sockets joined, published.
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>

#include "core/handshake.h"
#include "sys/net.h"

namespace tether::core {
namespace {
// Replies are a few hundred bytes on a fresh socket: they fit its buffer; a short write is garbage.
bool reply(int fd, const void* data, size_t len) { return ::send(fd, data, len, MSG_NOSIGNAL | MSG_DONTWAIT) == ssize_t(len); }

// A refused socket hears why (kBadRequest, or `status`) and is closed.
void refuse(int fd, wire::HelloStatus status = wire::HelloStatus::kBadRequest) {
  wire::ServerDone done{};
  done.status = uint8_t(status);
  ::send(fd, &done, sizeof done, MSG_NOSIGNAL | MSG_DONTWAIT);
  ::close(fd);
}
}  // namespace

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

// Every turn: a paused listener resumes after its pause, or (paused for the cap) once a handshake ended.
void EndpointImpl::resume_listening(int64_t now) {
  if (listen_armed_) return;
  if (now >= listen_retry_at_ms_ || (!paused_for_fds_ && pending_.size() < max_pending_)) listen_paused(false);
}

// Sheds the oldest unfinished handshake once it is kHandshakeGraceMs old (a prompt connector is done
// long before): a flood of idle handshakes cannot keep new peers out. False, with *retry_at, if none is.
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
  if (p.stage == 0) {
    std::memcpy(&p.hello, p.buf, sizeof p.hello);
    if (!answer_hello(p)) {
      drop();
      return;
    }
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
  wire::ServerDone done{};
  const std::string& token = config_.auth_token;
  if (!token.empty()) {
    auto expect = proof(token, "tether-client", p.hello.nonce, p.server_nonce, p.hello.session, p.hello.lane);
    if (!crypto::equal(expect.data(), p.proof.proof, 32)) done.status = uint8_t(wire::HelloStatus::kAuthFailed);
  }
  if (done.status == 0) {
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
    std::unique_ptr<Pending> owned = std::move(it->second);
    pending_.erase(it);
    if (owned->hello.kind == uint8_t(wire::SocketKind::kControl)) {  // either takes the fd
      accept_control(*owned);
    } else {
      join_data_socket(*owned);
    }
    return;
  }
  reply(fd, &done, sizeof done);
  drop();
}

// Answers p.hello with our ServerHello (and, to a control socket, our offers); false: drop the socket.
bool EndpointImpl::answer_hello(Pending& p) {
  const wire::ClientHello& h = p.hello;
  if (h.magic != wire::kMagic) return false;  // not a tether peer: say nothing
  const std::string& token = config_.auth_token;
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
    out = offers_for(h);
    sh.offers_length = uint32_t(out.size());
  }
  out.insert(0, reinterpret_cast<const char*>(&sh), sizeof sh);
  return reply(p.fd, out.data(), out.size()) && !bad;
}

// Only the highest-priority transports the connector can choose (it takes the highest both offer):
// building an offer can be costly (fabric opens its rails).
std::string EndpointImpl::offers_for(const wire::ClientHello& h) {
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
  return wire::encode_offers(offers);
}

// A control socket whose handshake passed: its peer, with the transport the connector chose.
void EndpointImpl::accept_control(Pending& p) {
  const wire::ClientHello& h = p.hello;
  const int fd = p.fd;
  PeerInfo info = describe_peer(h);
  const wire::ClientProof& cp = p.proof;
  const std::string name(cp.transport, strnlen(cp.transport, sizeof cp.transport));
  transport::Transport* chosen = nullptr;
  for (auto& t : transports_)
    if (name == t->name() && t->unavailable_reason().empty() && (!t->caps().same_host_only || info.same_host)) chosen = t.get();
  const bool tcp_lanes = chosen && chosen->caps().uses_tcp_lanes;
  if (!chosen || cp.lanes == 0 || cp.lanes > kMaxLanes || (tcp_lanes && cp.lanes != h.lanes)) return refuse(fd);
  info.transport = name;
  auto peer = std::make_shared<PeerState>(shared_from_this(), info, uint32_t(cp.lanes), chosen);  // packed: a copy
  // A transport with its own lanes: attached and published, or failed (false, *why says why).
  auto attach = [&](Status* why) {
    *why = chosen->attach(peer, {}, p.offer, false, sys::now_ms() + config_.connect_timeout_ms);
    if (!why->is_ok()) {
      peer->fail(Status(why->code(), "accept: transport " + name + ": " + why->message()));
      return false;
    }
    std::lock_guard lock(peers_mu_);
    peers_[peer->info().id] = peer;
    return true;
  };
  Status why;
  const bool early = !tcp_lanes && chosen->caps().attach_before_answer;
  if (early && !attach(&why)) {  // attach first: connect() returning there means peers() shows it here
    refuse(fd, why.code() == Code::kAccessDenied ? wire::HelloStatus::kNotSameHost : wire::HelloStatus::kBadRequest);
    return;
  }
  peer->control_fd = fd;
  // Our data NICs follow the answer (a few hundred bytes: they fit a fresh socket's buffer).
  wire::ServerDone done{};
  const std::string nics = advertised_nics();
  done.nic_list = uint16_t(nics.size());
  std::string answer(reinterpret_cast<const char*>(&done), sizeof done);
  answer += nics;
  if (!reply(fd, answer.data(), answer.size())) {
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
  if (attach(&why)) adopt_peer(peer);  // after answering: attaching may need the connector to act
}

// A data socket of a peer accepted on its control socket: once the last one joins, the peer is attached.
void EndpointImpl::join_data_socket(Pending& p) {
  const wire::ClientHello& h = p.hello;
  const int fd = p.fd;
  auto it = accepting_.find(uint64_t(h.session));
  if (it == accepting_.end() || std::memcmp(it->second->info().endpoint.data(), h.endpoint_id, 16) != 0 ||
      it->second->lane_fds.size() != h.lanes || it->second->lane_fds[h.lane] != -1)
    return refuse(fd);
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
  wire::ServerDone done{};
  ::send(fd, &done, sizeof done, MSG_NOSIGNAL | MSG_DONTWAIT);
}

}  // namespace tether::core
