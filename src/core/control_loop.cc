// The control thread: one epoll loop over the listening socket, handshakes under way and every peer's
// control socket; it answers control messages, heartbeats, times out silent peers and reaps failed ones.
#include <sys/epoll.h>
#include <sys/socket.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/handshake.h"
#include "core/trace.h"
#include "sys/net.h"
#include "sys/thread_name.h"

namespace tether::core {

namespace {
constexpr size_t kControlRead = 64 << 10;      // bytes read from a control socket at a time
constexpr int kControlReadsPerTurn = 16;       // then other sockets get their turn (level-triggered: we come back)
constexpr size_t kKeepCapacity = 256 << 10;    // a control buffer larger than this is given back once empty
}  // namespace

// Starts serving a published peer's control socket; not a failed one's (reap() would never remove it).
void EndpointImpl::adopt_peer(const std::shared_ptr<PeerState>& peer) {
  if (peer->failed()) return;
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = peer->info().id;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, peer->control_fd, &ev);
}

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

// Sends what the peer's control output holds; past kControlBacklog unsent bytes the peer is not read
// either (core/peer.h), so it falls silent to us and peer_timeout_ms ends it.
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
  // glibc keeps freed heap unless asked: a burst of large notifications, read by now, would stay resident.
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
