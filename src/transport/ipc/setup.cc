// Connecting an ipc peer. The listener's offer names its rendezvous socket (an abstract unix socket,
// reachable only from this host's network namespace) and a challenge for the session; the connector
// opens its lanes there and introduces each (Hello stage 1, its bounce area on lane 0) before it
// answers the handshake, so the listener's attach finds them parked: the proof that both are on one
// host and one user. Then each side maps the other's bounce area and probes whether it may reach the other
// by cross-memory attach (stages 2 and 3 carry the verdicts), and the lanes' threads start.
#include <fcntl.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <unordered_map>

#include "sys/crypto.h"
#include "sys/net.h"
#include "transport/ipc/lane.h"

namespace tether::transport::ipc {

namespace {

constexpr const char* kSocketPrefix = "tether-ipc-";  // every endpoint's lane socket: this and 16 hex digits
constexpr int kSocketBuffer = 1 << 20;        // frames in flight per lane are bounded by the window
constexpr size_t kMaxParked = 1024;            // lane sockets accepted and not yet claimed by a handshake

std::string hex(uint64_t v) {
  static const char* d = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) s[i] = d[v & 15];
  return s;
}

socklen_t abstract_addr(const std::string& name, sockaddr_un* a) {
  std::memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  std::memcpy(a->sun_path + 1, name.data(), std::min(name.size(), sizeof a->sun_path - 2));
  return socklen_t(offsetof(sockaddr_un, sun_path) + 1 + std::min(name.size(), sizeof a->sun_path - 2));
}

Status errno_status(Code c, const std::string& what, int e = errno) { return Status(c, what + ": " + std::strerror(e)); }

bool peer_cred(int fd, ucred* out) {
  socklen_t len = sizeof *out;
  return ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, out, &len) == 0;
}

// A lane socket a connector opened to us, accepted by the control thread, with its introduction.
struct Parked {
  int fd;
  Hello hello;
  int area_fd;
  ucred cred;
  int64_t at_ms;
};

void close_parked(Parked& m) {
  ::close(m.fd);
  if (m.area_fd >= 0) ::close(m.area_fd);
}

// A bounce area: the slots, the one-sided pages (one_sided.h), then a message ring per lane
// (page-aligned, at the end).
uint64_t area_bytes(uint64_t slots_bytes, uint32_t lanes) {
  return ((slots_bytes + 4095) & ~uint64_t(4095)) + kOneSidedBytes + lanes * kRingBytes;
}

// Our side of a peer: a fresh cookie and our bounce area of `slots` chunks and `lanes` rings.
std::shared_ptr<IpcPeer> new_peer(uint64_t session, uint64_t chunk_bytes, uint64_t slots, uint32_t lanes, Status* s) {
  auto ip = std::make_shared<IpcPeer>();
  ip->session = session;
  ip->cookie = crypto::random_u64() | 1;
  ip->slot_bytes = chunk_bytes;
  if (int e = ip->own.create(area_bytes(slots * chunk_bytes, lanes)))
    *s = Status(Code::kUnavailable, std::string("bounce area: ") + std::strerror(e));
  return ip;
}

// Our rings and one-sided pages at the end of our bounce area, theirs at the end of theirs (mapped);
// false when theirs has no room.
bool make_rings(IpcPeer& ip, uint32_t lanes, std::string* why) {
  const uint64_t need = uint64_t(lanes) * kRingBytes + kOneSidedBytes;
  if (ip.theirs.size() < need || (ip.theirs.size() - need) % 4096 != 0 || ip.own.size() < need) {
    *why = "the peer's bounce area has no room for its message rings";
    return false;
  }
  ip.os_own = reinterpret_cast<OneSidedPage*>(ip.own.base() + (ip.own.size() - need));
  ip.os_theirs = reinterpret_cast<OneSidedPage*>(ip.theirs.base() + (ip.theirs.size() - need));
  uint8_t* ours = ip.own.base() + (ip.own.size() - need) + kOneSidedBytes;
  uint8_t* other = ip.theirs.base() + (ip.theirs.size() - need) + kOneSidedBytes;
  for (uint32_t i = 0; i < lanes; ++i) {
    ip.out.push_back(std::make_unique<RingWriter>(ours + i * kRingBytes));
    ip.in.push_back(std::make_unique<RingReader>(other + i * kRingBytes));
  }
  return true;
}

// Decides, from our probe of the other side, how we serve its chunks; false (and *why) when the
// configuration forbids the outcome.
bool probe_other(IpcPeer& ip, const Hello& theirs, int host_mode, std::string* why) {
  if (host_mode == 2) return true;  // shm only: never touch the other address space
  auto cma = std::make_unique<CmaMover>(ip.pid);
  const int e = cma->probe(theirs.cookie_addr, theirs.cookie);
  if (e == 0) {
    ip.cma = std::move(cma);
    return true;
  }
  if (host_mode == 1) {
    *why = std::string("cross-memory attach to the peer is refused (") + std::strerror(e) + ") and TETHER_IPC_HOST=cma";
    return false;
  }
  return true;
}

// The other side's bounce area (`area_fd`, ours now) mapped, the rings in both, our probe of it;
// false (and *why) when any of it fails.
bool map_theirs(IpcPeer& ip, int area_fd, uint32_t lanes, const Hello& theirs, int host_mode, std::string* why) {
  if (int e = ip.theirs.map(area_fd)) {
    *why = std::string("cannot map the peer's bounce area: ") + std::strerror(e);
    return false;
  }
  ip.shm = std::make_unique<ShmMover>(ip.theirs);
  return make_rings(ip, lanes, why) && probe_other(ip, theirs, host_mode, why);
}

bool take_verdict(IpcPeer& ip, uint8_t verdict, int host_mode, std::string* why) {
  const bool by_address = verdict != 0 && host_mode != 2;
  ip.out_cma.store(by_address, std::memory_order_relaxed);
  if (host_mode == 1 && !by_address) {
    *why = "the peer cannot attach to this process's memory (non-dumpable, ptrace rules or seccomp?) and TETHER_IPC_HOST=cma";
    return false;
  }
  return true;
}

Hello hello(const IpcPeer& ip, uint8_t stage, uint32_t lane, uint32_t lanes) {
  Hello m{};
  m.magic = kHelloMagic;
  m.version = kIpcVersion;
  m.stage = stage;
  m.session = ip.session;
  m.lane = lane;
  m.lanes = lanes;
  m.cookie_addr = reinterpret_cast<uint64_t>(&ip.cookie);
  m.cookie = ip.cookie;
  return m;
}

bool valid_hello(const Hello& m, uint8_t stage, uint64_t session) {
  return m.magic == kHelloMagic && m.version == kIpcVersion && m.stage == stage && m.session == session;
}

// Both sides' offers start with version, session and the challenge for that session; the listener's
// then names its lane socket.
std::string offer_bytes(uint64_t session, uint64_t challenge, const std::string& name) {
  std::string out(2 + 8 + 8, '\0');
  std::memcpy(out.data(), &kIpcVersion, 2);
  std::memcpy(out.data() + 2, &session, 8);
  std::memcpy(out.data() + 10, &challenge, 8);
  return out + name;
}

bool parse_offer(std::string_view o, uint64_t* session, uint64_t* challenge, std::string* name) {
  uint16_t v;
  if (o.size() < 18 || o.size() > 120) return false;
  std::memcpy(&v, o.data(), 2);
  std::memcpy(session, o.data() + 2, 8);
  std::memcpy(challenge, o.data() + 10, 8);
  *name = std::string(o.substr(18));
  return v == kIpcVersion;
}

// Connector: opens `lanes` lanes to the listener's socket `name` and introduces each (stage 1, our
// area on lane 0); ip.fds gets them, ip.pid the listener's process.
Status open_lanes(IpcPeer& ip, const std::string& name, uint32_t lanes, uint64_t challenge) {
  sockaddr_un a;
  const socklen_t alen = abstract_addr(name, &a);
  for (uint32_t i = 0; i < lanes; ++i) {
    const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return errno_status(Code::kUnavailable, "socket");
    ip.fds.push_back(fd);
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &kSocketBuffer, sizeof kSocketBuffer);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), alen) != 0)  // into its backlog: never blocks
      return errno == EAGAIN ? Status(Code::kUnavailable, "the peer's ipc socket accepts no more lanes (its backlog is full)")
                             : errno_status(Code::kConnectionLost, "connect to the peer's ipc socket");
    ucred cred{};
    if (!peer_cred(fd, &cred) || cred.uid != ::geteuid()) return Status(Code::kAccessDenied, "the peer's ipc socket belongs to another user");
    if (i == 0) ip.pid = cred.pid;
    else if (cred.pid != ip.pid) return Status(Code::kProtocolError, "lanes lead to different processes");
    Hello m = hello(ip, 1, i, lanes);
    m.challenge = challenge;
    if (!send_msg(fd, &m, sizeof m, i == 0 ? ip.own.fd() : -1)) return errno_status(Code::kConnectionLost, "introducing a lane");
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // the lane thread blocks in recv()
  }
  return Status::ok();
}

void close_fds(IpcPeer& ip) {
  for (int fd : ip.fds) ::close(fd);
}

}  // namespace

// Per endpoint: the socket connectors open their lanes to, and those lanes parked by session until
// the handshake that names them attaches. Control thread only.
struct Rendezvous {
  int fd = -1;
  std::string name;
  uint8_t secret[16];                 // keys the challenge in each offer (never leaves the process)
  std::vector<Parked> fresh;          // accepted, introduction not read yet
  std::unordered_map<uint64_t, std::vector<Parked>> parked;
  size_t count = 0;                   // sockets in fresh and parked: at most kMaxParked

  uint64_t challenge(uint64_t session) const { return crypto::siphash24(secret, &session, sizeof session); }

  // Accepts what connectors opened, parks it by session; drops strangers (another user), garbage,
  // and whatever no handshake claimed within `expiry_ms`.
  void drain(int64_t now, int64_t expiry_ms) {
    for (;;) {
      const int fd = ::accept4(this->fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) break;
      ucred cred{};
      if (count >= kMaxParked || !peer_cred(fd, &cred) || cred.uid != ::geteuid()) {
        ::close(fd);
        continue;
      }
      fresh.push_back(Parked{fd, {}, -1, cred, now});
      ++count;
    }
    for (size_t i = 0; i < fresh.size();) {  // the introduction follows the connect at once
      Parked& m = fresh[i];
      const ssize_t n = recv_msg(m.fd, &m.hello, sizeof m.hello, &m.area_fd, -1, MSG_DONTWAIT);
      if (n < 0 && errno == EAGAIN && now - m.at_ms <= expiry_ms) {
        ++i;
        continue;
      }
      if (n == ssize_t(sizeof m.hello) && m.hello.magic == kHelloMagic && m.hello.version == kIpcVersion &&
          m.hello.stage == 1) {
        parked[uint64_t(m.hello.session)].push_back(m);  // packed field: a copy, not a reference
      } else {
        close_parked(m);
        --count;
      }
      fresh[i] = fresh.back();
      fresh.pop_back();
    }
    for (auto it = parked.begin(); it != parked.end();) {
      if (now - it->second.front().at_ms > expiry_ms) {
        for (auto& m : it->second) close_parked(m);
        count -= it->second.size();
        it = parked.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Listener: the `lanes` lanes parked for `session`, taken out (*mine) and checked: from one process
  // of our user, each lane once, with `challenge`; fds[i] is lane i, *zero the one with the bounce area.
  Status claim(uint64_t session, uint64_t challenge, uint32_t lanes, std::vector<Parked>* mine, std::vector<int>* fds,
               const Parked** zero) {
    if (auto it = parked.find(session); it != parked.end()) {
      *mine = std::move(it->second);
      count -= mine->size();
      parked.erase(it);
    }
    if (mine->size() != lanes)
      return Status(Code::kAccessDenied, std::to_string(mine->size()) + " of the connector's " + std::to_string(lanes) +
                                             " ipc lanes reached this host: it is not on this host, or not this user");
    fds->assign(lanes, -1);
    for (auto& m : *mine) {
      const Hello& h = m.hello;
      if (h.lanes != lanes || h.lane >= lanes || (*fds)[h.lane] >= 0 || h.challenge != challenge ||
          m.cred.pid != (*mine)[0].cred.pid || (h.lane == 0) != (m.area_fd >= 0))
        return Status(Code::kProtocolError, "malformed ipc lanes from the peer");
      (*fds)[h.lane] = m.fd;
      if (h.lane == 0) *zero = &m;
    }
    return Status::ok();
  }

  ~Rendezvous() {
    for (auto& m : fresh) close_parked(m);
    for (auto& [session, v] : parked)
      for (auto& m : v) close_parked(m);
    if (fd >= 0) ::close(fd);
  }
};

// Our lanes serve from the start (attach_listener); we send only once the connector's verdict is in.
bool finish_listener_setup(Lane& l) {
  Link& p = *l.peer;
  IpcPeer& ip = *l.ip;
  Hello m{};
  const ssize_t n = recv_msg(l.fd, &m, sizeof m, nullptr, ip.setup_deadline_ms);
  if (n != ssize_t(sizeof m) || !valid_hello(m, 3, ip.session)) {
    const Code c = n < 0 && errno == ETIMEDOUT ? Code::kTimeout : n <= 0 ? Code::kConnectionLost : Code::kProtocolError;
    if (!p.failed()) fail_peer(p, c, "setup failed");
    return false;
  }
  std::string why;
  if (!take_verdict(ip, m.verdict, l.host_mode, &why)) {
    fail_peer(p, Code::kUnavailable, why);
    return false;
  }
  ip.sending.store(true, std::memory_order_seq_cst);
  pump_all(ip, p);  // chunks posted while we were setting up
  return true;
}

}  // namespace tether::transport::ipc

namespace tether::transport {

using namespace ipc;

IpcTransport::IpcTransport(Host* host) : host_(host) {
  const Config& c = host->config();
  host_mode_ = c.ipc_host == "cma" ? 1 : c.ipc_host == "shm" ? 2 : 0;
  if (c.disable_ipc) {
    unavailable_ = "disabled (disable_ipc / TETHER_DISABLE_IPC=1)";
    return;
  }
  BounceArea probe;
  if (int e = probe.create(4096)) {
    unavailable_ = std::string("memfd_create refused: ") + std::strerror(e);
    return;
  }
  rendezvous_ = std::make_unique<Rendezvous>();
  if (c.busy_poll_us > 0) completer_ = std::make_unique<GpuCompleter>(c.busy_poll_us);  // its thread starts at first use
  Rendezvous* rv = rendezvous_.get();
  rv->name = kSocketPrefix + hex(crypto::random_u64());
  crypto::random_bytes(rv->secret, sizeof rv->secret);
  rv->fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  sockaddr_un a;
  const socklen_t len = abstract_addr(rv->name, &a);
  if (rv->fd < 0 || ::bind(rv->fd, reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(rv->fd, 1024) != 0)
    unavailable_ = std::string("abstract unix sockets refused: ") + std::strerror(errno);
}

IpcTransport::~IpcTransport() {
  stop();
  for (auto& [session, ip] : prepared_) close_fds(*ip);
}

std::string IpcTransport::offer(uint64_t session) {
  if (!rendezvous_) return {};
  return offer_bytes(session, rendezvous_->challenge(session), rendezvous_->name);
}

// Connector, before it answers the listener's handshake: opens and introduces every lane (open_lanes).
// The listener never connects anywhere itself: lanes reaching its abstract socket prove we share its host.
Result<std::string> IpcTransport::connector_offer(uint64_t session, std::string_view remote_offer) {
  uint64_t theirs = 0, challenge = 0;
  std::string name;
  // Only a tether endpoint's socket: a hostile listener must not point our lanes at another service.
  if (!rendezvous_ || !parse_offer(remote_offer, &theirs, &challenge, &name) || theirs != session ||
      name.rfind(kSocketPrefix, 0) != 0)
    return Status(Code::kProtocolError, "malformed ipc offer");
  // Our own socket is fine when we are the listener (an endpoint connecting to itself), which only an
  // offer carrying our challenge for this session shows: anyone else naming it would have us park our
  // own lanes until they expire.
  if (name == rendezvous_->name && challenge != rendezvous_->challenge(session))
    return Status(Code::kProtocolError, "the peer's ipc offer names this endpoint's own ipc socket");
  const Config& c = host_->config();
  const uint32_t lanes = lanes_for(remote_offer);
  const uint64_t slots = uint64_t(std::max<uint32_t>(1, c.window / lanes)) * lanes;  // as Link sizes its slots
  Status s;
  auto ip = new_peer(session, c.chunk_bytes, slots, lanes, &s);
  if (!s.is_ok()) return s;
  if (s = open_lanes(*ip, name, lanes, challenge); !s.is_ok()) {
    close_fds(*ip);
    return s;
  }
  {
    std::lock_guard lock(mu_);
    if (stopped_) {
      close_fds(*ip);
      return Status(Code::kCancelled, "endpoint closed");
    }
    prepared_[session] = ip;
  }
  return offer_bytes(session, challenge, "");
}

void IpcTransport::abandon(uint64_t session) {
  std::lock_guard lock(mu_);
  auto it = prepared_.find(session);
  if (it == prepared_.end()) return;
  close_fds(*it->second);
  prepared_.erase(it);
}

// Control thread, every tick: lanes of handshakes that never came, or came and failed, are closed.
void IpcTransport::tick(int64_t now_ms) {
  if (rendezvous_) rendezvous_->drain(now_ms, host_->config().handshake_timeout_ms);
  std::lock_guard lock(mu_);
  if (!stopped_) reap_finished();  // lane threads of peers that ended: their stacks go now, not at the next connect
}

Status IpcTransport::attach(const std::shared_ptr<Link>& peer, const std::vector<int>&, std::string_view remote_offer,
                            bool initiator, int64_t deadline) {
  {
    std::lock_guard lock(mu_);
    if (stopped_) return Status(Code::kCancelled, "endpoint closed");
    reap_finished();
  }
  return initiator ? attach_connector(peer, remote_offer, deadline) : attach_listener(peer, remote_offer, deadline);
}

// Control thread, before the handshake is answered: the connector's lanes must be parked here already
// (Rendezvous::claim). Then we probe the connector, answer on lane 0 (stage 2) and serve; the lane-0
// thread waits for the connector's verdict (stage 3) before we send. Nothing here blocks.
Status IpcTransport::attach_listener(const std::shared_ptr<Link>& peer, std::string_view remote_offer, int64_t deadline) {
  uint64_t session = 0, challenge = 0;
  std::string name;
  Rendezvous& rv = *rendezvous_;
  if (!parse_offer(remote_offer, &session, &challenge, &name) || !name.empty())
    return Status(Code::kProtocolError, "malformed ipc offer");
  if (challenge != rv.challenge(session)) return Status(Code::kAccessDenied, "the ipc offer does not answer our challenge");
  rv.drain(sys::now_ms(), host_->config().handshake_timeout_ms);
  std::vector<Parked> mine;
  auto cleanup = [&] { for (auto& m : mine) close_parked(m); };
  const uint32_t lanes = peer->lanes();
  std::vector<int> fds;
  const Parked* zero = nullptr;
  Status s = rv.claim(session, challenge, lanes, &mine, &fds, &zero);
  if (!s.is_ok()) { cleanup(); return s; }
  auto ip = new_peer(session, host_->config().chunk_bytes, peer->slot_count(), lanes, &s);
  if (!s.is_ok()) { cleanup(); return s; }
  ip->pid = zero->cred.pid;
  ip->fds = fds;
  ip->setup_deadline_ms = deadline;
  const int area_fd = zero->area_fd;
  for (auto& m : mine) m.area_fd = -1;  // the bounce area takes it
  std::string why;
  if (!map_theirs(*ip, area_fd, lanes, zero->hello, host_mode_, &why)) { cleanup(); return Status(Code::kUnavailable, why); }
  for (int fd : fds) {
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // the lane thread blocks in recv()
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &kSocketBuffer, sizeof kSocketBuffer);
  }
  Hello m2 = hello(*ip, 2, 0, lanes);
  m2.verdict = ip->cma != nullptr;
  ip->ready.store(true, std::memory_order_seq_cst);  // before the connector can have our answer
  if (!send_msg(fds[0], &m2, sizeof m2, ip->own.fd())) { cleanup(); return errno_status(Code::kConnectionLost, "ipc setup"); }
  peer->lane_fds = fds;  // the peer owns them now: fail() shuts them down, its destructor closes them
  return start_lanes(peer, ip, true);
}

// The connecting thread, after the handshake: the listener's answer on lane 0 (stage 2), our probe of
// it, our verdict (stage 3).
Status IpcTransport::attach_connector(const std::shared_ptr<Link>& peer, std::string_view remote_offer,
                                      int64_t deadline) {
  uint64_t session = 0, challenge = 0;
  std::string name;
  if (!parse_offer(remote_offer, &session, &challenge, &name)) return Status(Code::kProtocolError, "malformed ipc offer");
  std::shared_ptr<IpcPeer> ip;
  {
    std::lock_guard lock(mu_);
    if (auto it = prepared_.find(session); it != prepared_.end()) {
      ip = it->second;
      prepared_.erase(it);
    }
  }
  if (!ip) return Status(Code::kInternal, "ipc lanes were not opened for this connect");
  const uint32_t lanes = uint32_t(ip->fds.size());
  if (lanes != peer->lanes() || uint64_t(peer->slot_count()) * ip->slot_bytes > ip->own.size()) {
    close_fds(*ip);
    return Status(Code::kInternal, "ipc lanes opened for another shape of peer");
  }
  Hello m2{};
  int area_fd = -1;
  const ssize_t got = recv_msg(ip->fds[0], &m2, sizeof m2, &area_fd, deadline);
  if (got != ssize_t(sizeof m2) || !valid_hello(m2, 2, session) || area_fd < 0) {
    const bool late = got < 0 && errno == ETIMEDOUT;  // alive but silent (stopped, overloaded)
    if (area_fd >= 0) ::close(area_fd);
    close_fds(*ip);
    return late ? Status(Code::kTimeout, "ipc setup: the peer did not finish it in time")
                : Status(Code::kConnectionLost, "ipc setup: the peer refused our lanes (see its error)");
  }
  std::string why;
  if (!map_theirs(*ip, area_fd, lanes, m2, host_mode_, &why) || !take_verdict(*ip, m2.verdict, host_mode_, &why)) {
    close_fds(*ip);
    return Status(Code::kUnavailable, why);
  }
  Hello m3 = hello(*ip, 3, 0, lanes);
  m3.verdict = ip->cma != nullptr;
  ip->ready.store(true, std::memory_order_seq_cst);
  ip->sending.store(true, std::memory_order_seq_cst);
  if (!send_msg(ip->fds[0], &m3, sizeof m3, -1)) {
    close_fds(*ip);
    return Status(Code::kConnectionLost, "ipc setup: the peer is gone");
  }
  peer->lane_fds = ip->fds;
  return start_lanes(peer, ip, false);
}

Status IpcTransport::start_lanes(const std::shared_ptr<Link>& peer, const std::shared_ptr<IpcPeer>& ip, bool listener) {
  std::vector<std::shared_ptr<Lane>> made;
  for (uint32_t i = 0; i < ip->fds.size(); ++i) {
    auto l = std::make_shared<Lane>();
    l->peer = peer;
    l->ip = ip;
    l->index = i;
    l->fd = ip->fds[i];
    l->setup_first = listener && i == 0;
    l->host_mode = host_mode_;
    l->ring = ip->in[i].get();
    l->rx = std::make_unique<uint8_t[]>(kMaxMsg);
    l->cuda = std::make_unique<CudaLane>();
    l->held.reserve(std::min<uint32_t>(peer->slot_count(), 4096));
    ip->lanes.push_back(l);
    made.push_back(std::move(l));
  }
  ip->imports = std::make_unique<CudaImports>(ip->pid, &counters_.cuda_opens);
  ip->host = host_;
  ip->counters = &counters_;
  ip->one_sided_max = host_->config().ipc_one_sided_bytes;
  if (ip->one_sided_max > 0) ip->os = std::make_unique<OneSidedInitiator>(ip->os_theirs, ip->os_own);
  ip->completer = completer_.get();
  peer->transport_state = ip;
  std::lock_guard lock(mu_);
  if (stopped_) return Status(Code::kCancelled, "endpoint closed");  // the peer closes the fds
  for (auto& l : made) {
    (void)peer->hold();  // the lane thread's; it lets go as it ends
    l->thread = std::thread(lane_main, l.get());
    lanes_.push_back(std::move(l));
  }
  return Status::ok();
}

}  // namespace tether::transport
