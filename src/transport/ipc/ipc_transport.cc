#include "transport/ipc/ipc_transport.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <thread>

#include "core/crypto.h"
#include "core/endpoint_impl.h"
#include "core/peer.h"
#include "core/region.h"
#include "sys/net.h"
#include "transport/ipc/host_mover.h"

namespace tether::transport {

using core::ChunkOp;
using core::PeerState;
using core::RegionState;
using core::TransferState;
using wire::FrameHeader;
using wire::FrameType;

namespace ipc {

constexpr uint32_t kHelloMagic = 0x43504954;  // "TIPC"
constexpr uint16_t kIpcVersion = 1;
constexpr int kSocketBuffer = 1 << 20;        // frames in flight per lane are bounded by the window
constexpr int64_t kParkedExpiryMs = 10000;    // lanes nobody claimed (their connect failed)

#pragma pack(push, 1)
// Every message on a lane after its setup: the tcp frame header, and for requests where the
// initiator's bytes are. The target trusts addr only as a place in the INITIATOR's memory.
struct Frame {
  FrameHeader hdr;
  uint8_t where;    // Where (requests); kNone in answers
  uint8_t pad[7];
  uint64_t addr;    // kCma: address in the initiator; kShm: offset in its bounce segment
};
// Lane setup. Stage 1: listener -> connector on every lane (segment fd on lane 0). Stage 2:
// connector -> listener on lane 0 (its segment fd, its verdict). Stage 3: listener -> connector.
struct Hello {
  uint32_t magic;
  uint16_t version;
  uint8_t stage;
  uint8_t verdict;       // stages 2, 3: the receiver may describe its chunks by address (kCma)
  uint64_t session;
  uint32_t lane, lanes;
  uint64_t cookie_addr;  // 8 bytes at this address in the sender hold `cookie`: the CMA probe
  uint64_t cookie;
};
#pragma pack(pop)
static_assert(sizeof(Frame) == 72);
static_assert(sizeof(Hello) == 40);

struct IpcPeer {
  uint64_t session = 0;
  pid_t pid = 0;                     // the other process, as the kernel names it (SO_PEERCRED)
  std::vector<int> fds;              // lane sockets (owned by PeerState::lane_fds)
  std::vector<std::weak_ptr<Lane>> lanes;
  uint64_t cookie = 0;               // the other side probes this
  Segment own;                       // our chunks' bounce slots (used when !out_cma)
  Segment theirs;                    // the other side's, mapped (their kShm chunks)
  std::unique_ptr<CmaMover> cma;     // set when our probe of the other side worked
  std::unique_ptr<ShmMover> shm;
  bool out_cma = false;              // our chunks are described by address
  uint64_t slot_bytes = 0;           // one chunk per core slot in `own`
  std::atomic<bool> ready{false};    // setup done: lanes may pull and serve
  std::atomic<uint32_t> next{0};
};

struct Lane {
  std::mutex mu;                     // guards letting go of peer/ip against stop()
  std::shared_ptr<PeerState> peer;   // held while the thread runs
  std::shared_ptr<IpcPeer> ip;
  uint32_t index = 0;
  int fd = -1;
  bool setup_first = false;          // listener's lane 0: finish the setup before serving
  std::thread thread;
  std::atomic<bool> finished{false};
};

namespace {

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

// One message, with an fd attached when fd >= 0.
bool send_msg(int fd, const void* buf, size_t len, int pass_fd) {
  iovec iov{const_cast<void*>(buf), len};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))];
  if (pass_fd >= 0) {
    std::memset(ctl, 0, sizeof ctl);
    m.msg_control = ctl;
    m.msg_controllen = sizeof ctl;
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
  }
  for (;;) {
    ssize_t n = ::sendmsg(fd, &m, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    return n == ssize_t(len);
  }
}

// One message (blocking, or bounded by deadline_ms when >= 0); *got_fd receives a passed fd.
ssize_t recv_msg(int fd, void* buf, size_t len, int* got_fd, int64_t deadline_ms) {
  if (deadline_ms >= 0) {
    pollfd p{fd, POLLIN, 0};
    for (;;) {
      const int64_t left = deadline_ms - sys::now_ms();
      if (left <= 0) { errno = ETIMEDOUT; return -1; }
      int r = ::poll(&p, 1, int(left));
      if (r > 0) break;
      if (r < 0 && errno != EINTR) return -1;
    }
  }
  iovec iov{buf, len};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))];
  m.msg_control = ctl;
  m.msg_controllen = sizeof ctl;
  ssize_t n;
  do n = ::recvmsg(fd, &m, MSG_CMSG_CLOEXEC);
  while (n < 0 && errno == EINTR);
  if (got_fd) *got_fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    int f;
    std::memcpy(&f, CMSG_DATA(c), sizeof f);
    if (got_fd && *got_fd < 0) *got_fd = f; else ::close(f);
  }
  if (n >= 0 && (m.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) { errno = EMSGSIZE; return -1; }
  return n;
}

bool peer_cred(int fd, ucred* out) {
  socklen_t len = sizeof *out;
  return ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, out, &len) == 0;
}

void fail_peer(PeerState& p, Code c, const std::string& why) { p.fail(Status(c, "ipc lane to peer '" + p.info().name + "': " + why)); }

// ---------------------------------------------------------------- initiator side

// Describes (and for shm, stages) a pulled chunk and sends it. False if the lane is gone.
bool send_chunk(IpcPeer& ip, PeerState& p, uint32_t lane, const ChunkOp& op) {
  if (op.device >= 0) {  // GPU memory needs the CUDA mover (not yet): refuse here, nothing moves
    p.answer(lane, op.hdr.slot, op.hdr.gen, uint8_t(Code::kUnavailable));
    return true;
  }
  Frame f{};
  f.hdr = op.hdr;
  // Reads always land in our segment: no process ever writes into another's memory, so a peer
  // we gave up on (its answer never came) cannot scribble over memory we have handed back.
  const bool read = op.hdr.type == uint8_t(FrameType::kReadReq);
  if (ip.out_cma && !read) {
    f.where = uint8_t(Where::kCma);
    f.addr = reinterpret_cast<uint64_t>(op.local);
  } else {
    f.where = uint8_t(Where::kShm);
    f.addr = uint64_t(op.hdr.slot) * ip.slot_bytes;
    if (op.length > 0) std::memcpy(ip.own.base() + f.addr, op.payload, op.length);  // slot is ours until answered
  }
  if (send_msg(ip.fds[lane], &f, sizeof f, -1)) return true;
  fail_peer(p, Code::kConnectionLost, std::strerror(errno));
  return false;
}

void pump_lane(IpcPeer& ip, PeerState& p, uint32_t lane) {
  ChunkOp op;
  while (p.next_chunk(lane, &op))
    if (!send_chunk(ip, p, lane, op)) return;
}

// Spreads queued chunks over every lane, one per lane per round, while windows allow.
void pump_all(IpcPeer& ip, PeerState& p) {
  const uint32_t n = uint32_t(ip.fds.size());
  const uint32_t first = ip.next.fetch_add(1, std::memory_order_relaxed);
  for (bool any = true; any;) {
    any = false;
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t lane = (first + i) % n;
      ChunkOp op;
      if (!p.next_chunk(lane, &op)) continue;
      if (!send_chunk(ip, p, lane, op)) return;
      any = true;
    }
  }
}

// ---------------------------------------------------------------- target side

// Validates a request exactly as tcp does, moves the bytes, answers. False: the lane must end.
bool serve(Lane& l, core::EndpointImpl* ep, const Frame& f) {
  PeerState& p = *l.peer;
  IpcPeer& ip = *l.ip;
  const FrameHeader& h = f.hdr;
  const auto type = static_cast<FrameType>(h.type);
  auto& stats = ep->stats();
  RegionState* pin = nullptr;
  TransferState* recv = nullptr;
  uint8_t* local = nullptr;
  Code c;
  if (type == FrameType::kSendData) {
    int device = -1;
    c = p.resolve_send_data(h.region_id, h.offset, h.length, h.key, h.flags, &local, &recv, &device);
    if (c == Code::kOk && device >= 0) {  // into GPU memory: needs the CUDA mover (not yet)
      recv->release();
      recv = nullptr;
      c = Code::kUnavailable;
    }
  } else {
    c = ep->registry().resolve(h.region_id, h.key, h.desc_offset, h.desc_length, h.offset, h.length,
                               type == FrameType::kWrite, &pin);
    if (c == Code::kOk) local = pin->base + h.offset;
    // Host movers only; the GPU half adds a CUDA mover for kCuda regions.
    if (c == Code::kOk && pin->kind != MemoryKind::kHost) c = Code::kUnavailable;
  }
  int err = 0;
  if (c == Code::kOk && h.length > 0) {
    Mover* m = f.where == uint8_t(Where::kCma) ? static_cast<Mover*>(ip.cma.get())
             : f.where == uint8_t(Where::kShm) ? static_cast<Mover*>(ip.shm.get())
                                               : nullptr;
    if (!m || (type == FrameType::kReadReq && f.where != uint8_t(Where::kShm))) err = EPROTO;
    else if (type == FrameType::kReadReq) err = m->push(local, f.addr, h.length);
    else err = m->pull(f.addr, local, h.length);
    if (!err) (f.where == uint8_t(Where::kCma) ? stats.ipc_cma_chunks : stats.ipc_shm_chunks).fetch_add(1, std::memory_order_relaxed);
  }
  if (pin) pin->unpin();
  if (c != Code::kOk) stats.rejected_requests.fetch_add(1, std::memory_order_relaxed);
  if (recv) {
    if (!err) {
      p.send_data_placed(recv, h.offset, h.length);
    } else {
      recv->record_error(Status(Code::kConnectionLost, "lost the sender's data"));
      recv->release();
    }
  }
  if (err) {
    fail_peer(p, err == EPROTO ? Code::kProtocolError : Code::kConnectionLost,
              err == EPROTO ? "a request names memory this side cannot reach"
                            : std::string("moving its bytes failed (") + std::strerror(err) + "); is the process gone?");
    return false;
  }
  if (c == Code::kOk) {
    if (type == FrameType::kReadReq) {
      stats.bytes_sent.fetch_add(h.length, std::memory_order_relaxed);
      stats.chunks_sent.fetch_add(1, std::memory_order_relaxed);
    } else {
      stats.bytes_received.fetch_add(h.length, std::memory_order_relaxed);
      stats.chunks_received.fetch_add(1, std::memory_order_relaxed);
    }
  }
  Frame a{};
  a.hdr.type = uint8_t(type == FrameType::kReadReq ? FrameType::kReadResp : FrameType::kAck);
  a.hdr.status = uint8_t(c);
  a.hdr.slot = h.slot;
  a.hdr.gen = h.gen;
  a.hdr.length = h.length;
  if (send_msg(l.fd, &a, sizeof a, -1)) return true;
  fail_peer(p, Code::kConnectionLost, std::strerror(errno));
  return false;
}

// An answer to one of our chunks. False: the lane must end.
bool take_answer(Lane& l, core::EndpointImpl* ep, const Frame& f) {
  PeerState& p = *l.peer;
  IpcPeer& ip = *l.ip;
  const FrameHeader& h = f.hdr;
  auto& stats = ep->stats();
  if (h.type == uint8_t(FrameType::kReadResp) && h.status == 0) {
    uint8_t* dest = nullptr;
    int device = -1;
    if (p.read_destination(l.index, h.slot, h.gen, h.length, &dest, &device) != Code::kOk || device >= 0) {
      fail_peer(p, Code::kProtocolError, "read data for no read");
      return false;
    }
    std::memcpy(dest, ip.own.base() + uint64_t(h.slot) * ip.slot_bytes, h.length);  // reads come via our segment
    stats.bytes_received.fetch_add(h.length, std::memory_order_relaxed);
    stats.chunks_received.fetch_add(1, std::memory_order_relaxed);
  } else if (h.type == uint8_t(FrameType::kAck) && h.status == 0) {
    stats.bytes_sent.fetch_add(h.length, std::memory_order_relaxed);
    stats.chunks_sent.fetch_add(1, std::memory_order_relaxed);
  }
  if (p.answer(l.index, h.slot, h.gen, h.status) != Code::kOk) {
    fail_peer(p, Code::kProtocolError, "an answer to no request");
    return false;
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

bool take_verdict(IpcPeer& ip, uint8_t verdict, int host_mode, std::string* why) {
  ip.out_cma = verdict != 0 && host_mode != 2;
  if (host_mode == 1 && !ip.out_cma) {
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

// Listener's lane 0: the connector's stage 2 arrives, we probe it and send our verdict.
bool finish_listener_setup(Lane& l, int host_mode) {
  PeerState& p = *l.peer;
  IpcPeer& ip = *l.ip;
  Hello m{};
  int fd = -1;
  ssize_t n = recv_msg(l.fd, &m, sizeof m, &fd, -1);
  if (n != ssize_t(sizeof m) || !valid_hello(m, 2, ip.session) || fd < 0) {
    if (fd >= 0) ::close(fd);
    if (!p.failed()) fail_peer(p, n <= 0 ? Code::kConnectionLost : Code::kProtocolError, "setup failed");
    return false;
  }
  std::string why;
  if (int e = ip.theirs.map(fd)) why = std::string("cannot map the peer's bounce segment: ") + std::strerror(e);
  else ip.shm = std::make_unique<ShmMover>(ip.theirs);
  if (why.empty()) probe_other(ip, m, host_mode, &why);
  if (why.empty()) take_verdict(ip, m.verdict, host_mode, &why);
  if (!why.empty()) {
    fail_peer(p, Code::kUnavailable, why);
    return false;
  }
  Hello r = hello(ip, 3, 0, uint32_t(ip.fds.size()));
  r.verdict = ip.cma != nullptr;
  ip.ready.store(true, std::memory_order_seq_cst);  // before the connector may send requests
  if (!send_msg(l.fd, &r, sizeof r, -1)) {
    fail_peer(p, Code::kConnectionLost, std::strerror(errno));
    return false;
  }
  pump_all(ip, p);  // chunks posted while we were setting up
  return true;
}

void lane_main(Lane* l, core::EndpointImpl* ep, int host_mode) {
  PeerState& p = *l->peer;
  if (!l->setup_first || finish_listener_setup(*l, host_mode)) {
    Frame f;
    for (;;) {
      ssize_t n = ::recv(l->fd, &f, sizeof f, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        fail_peer(p, Code::kConnectionLost, n == 0 ? "the peer closed it" : std::strerror(errno));
        break;
      }
      const auto type = static_cast<FrameType>(f.hdr.type);
      const bool request = type == FrameType::kWrite || type == FrameType::kReadReq || type == FrameType::kSendData;
      const bool answer = type == FrameType::kAck || type == FrameType::kReadResp;
      if (n != ssize_t(sizeof f) || (f.hdr.flags & ~wire::kKnownFlags) != 0 || (!request && !answer) ||
          !l->ip->ready.load(std::memory_order_acquire)) {
        fail_peer(p, Code::kProtocolError, "the peer sent a malformed frame");
        break;
      }
      if (request) {
        if (!serve(*l, ep, f)) break;
      } else {
        if (!take_answer(*l, ep, f)) break;
        pump_lane(*l->ip, p, l->index);  // the answer freed room in this lane's window
      }
    }
  }
  p.release_lane(l->index, Code::kConnectionLost);  // after fail(): nothing new can be pulled
  // Let go at once, so a dead peer's sockets and segments go with it; the thread is joined later.
  // Never the endpoint's last reference: close() joins every lane thread before it lets go.
  std::shared_ptr<PeerState> peer;
  std::shared_ptr<IpcPeer> ip;
  {
    std::lock_guard lock(l->mu);
    peer.swap(l->peer);
    ip.swap(l->ip);
  }
  l->finished.store(true, std::memory_order_release);
}

// The connector's side of lane matching: lanes of every concurrent connect arrive at one socket;
// whoever accepts parks each lane under its session for the attach that waits for it.
struct Accepted {
  int fd;
  Hello hello;
  int seg_fd;
  ucred cred;
  int64_t at_ms;
};

}  // namespace

// Per endpoint: the socket listeners connect their lanes to, and the lanes parked by session.
struct Rendezvous {
  int fd = -1;
  std::string name;
  std::mutex mu;
  std::condition_variable cv;
  bool accepting = false;
  std::unordered_map<uint64_t, std::vector<Accepted>> parked;
};

}  // namespace ipc

using namespace ipc;

// ---------------------------------------------------------------- transport

IpcTransport::IpcTransport(core::EndpointImpl* endpoint) : endpoint_(endpoint) {
  const Config& c = endpoint->config();
  host_mode_ = c.ipc_host == "cma" ? 1 : c.ipc_host == "shm" ? 2 : 0;
  if (c.disable_ipc) {
    unavailable_ = "disabled (disable_ipc / TETHER_DISABLE_IPC=1)";
    return;
  }
  Segment probe;
  if (int e = probe.create(4096)) {
    unavailable_ = std::string("memfd_create refused: ") + std::strerror(e);
    return;
  }
  rendezvous_ = std::make_unique<Rendezvous>();
  Rendezvous* rv = rendezvous_.get();
  rv->name = "tether-ipc-" + hex(crypto::random_u64());
  rv->fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  sockaddr_un a;
  const socklen_t len = abstract_addr(rv->name, &a);
  if (rv->fd < 0 || ::bind(rv->fd, reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(rv->fd, 1024) != 0)
    unavailable_ = std::string("abstract unix sockets refused: ") + std::strerror(errno);
}

IpcTransport::~IpcTransport() {
  stop();
  if (!rendezvous_) return;
  for (auto& [s, v] : rendezvous_->parked)
    for (auto& m : v) { ::close(m.fd); if (m.seg_fd >= 0) ::close(m.seg_fd); }
  if (rendezvous_->fd >= 0) ::close(rendezvous_->fd);
}

Caps IpcTransport::caps() const {
  Caps c;
  c.host_memory = true;
  c.same_host_only = true;
  return c;
}

// version, session, then the name of this endpoint's lane socket. Stateless: the listener offers
// it to every connector, and the session in it tells each attach() which lanes are its own.
std::string IpcTransport::offer(uint64_t session) {
  if (!rendezvous_) return {};
  const std::string& name = rendezvous_->name;
  std::string out(2 + 8, '\0');
  std::memcpy(out.data(), &kIpcVersion, 2);
  std::memcpy(out.data() + 2, &session, 8);
  return out + name;
}

namespace {
bool parse_offer(std::string_view o, uint64_t* session, std::string* name) {
  uint16_t v;
  if (o.size() < 11 || o.size() > 100) return false;
  std::memcpy(&v, o.data(), 2);
  std::memcpy(session, o.data() + 2, 8);
  *name = std::string(o.substr(10));
  return v == kIpcVersion;
}
}  // namespace

uint32_t IpcTransport::lanes_for(std::string_view) const { return std::max<uint32_t>(1, endpoint_->config().channels); }

Status IpcTransport::attach(const std::shared_ptr<PeerState>& peer, const std::vector<int>&, std::string_view remote_offer,
                            bool initiator) {
  {
    std::lock_guard lock(mu_);
    if (stopped_) return Status(Code::kCancelled, "endpoint closed");
    reap_finished();
  }
  return initiator ? attach_connector(peer, remote_offer) : attach_listener(peer, remote_offer);
}

namespace {
std::shared_ptr<IpcPeer> new_peer(PeerState& p, uint64_t session, uint64_t chunk_bytes, Status* s) {
  auto ip = std::make_shared<IpcPeer>();
  ip->session = session;
  ip->cookie = crypto::random_u64() | 1;
  const uint64_t chunk = chunk_bytes;
  ip->slot_bytes = chunk;
  if (int e = ip->own.create(uint64_t(p.slot_count()) * chunk)) *s = Status(Code::kUnavailable, std::string("bounce segment: ") + std::strerror(e));
  return ip;
}
}  // namespace

// Control thread, right after answering the handshake: connect every lane to the connector's
// socket (never blocks: a full backlog is an error) and introduce it; lane 0's thread finishes.
Status IpcTransport::attach_listener(const std::shared_ptr<PeerState>& peer, std::string_view remote_offer) {
  uint64_t session;
  std::string name;
  if (!parse_offer(remote_offer, &session, &name)) return Status(Code::kProtocolError, "malformed ipc offer");
  Status s;
  auto ip = new_peer(*peer, session, endpoint_->config().chunk_bytes, &s);
  if (!s.is_ok()) return s;
  const uint32_t lanes = peer->lanes();
  std::vector<int> fds;
  auto cleanup = [&] { for (int fd : fds) ::close(fd); };
  sockaddr_un a;
  const socklen_t alen = abstract_addr(name, &a);
  for (uint32_t i = 0; i < lanes; ++i) {
    int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) { s = errno_status(Code::kUnavailable, "socket"); break; }
    fds.push_back(fd);
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &kSocketBuffer, sizeof kSocketBuffer);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), alen) != 0) { s = errno_status(Code::kConnectionLost, "connect to the peer's lane socket"); break; }
    ucred cred{};
    if (!peer_cred(fd, &cred) || cred.uid != ::geteuid()) { s = Status(Code::kAccessDenied, "the peer's lane socket belongs to another user"); break; }
    if (i == 0) ip->pid = cred.pid;
    else if (cred.pid != ip->pid) { s = Status(Code::kProtocolError, "lanes lead to different processes"); break; }
    Hello m = hello(*ip, 1, i, lanes);
    if (!send_msg(fd, &m, sizeof m, i == 0 ? ip->own.fd() : -1)) { s = errno_status(Code::kConnectionLost, "introducing a lane"); break; }
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // the lane thread blocks in recv()
  }
  if (!s.is_ok()) { cleanup(); return s; }
  ip->fds = fds;
  peer->lane_fds = fds;  // the peer owns them now: fail() shuts them down, its destructor closes them
  return start_lanes(peer, ip, true);
}

// The connecting thread: collect our lanes (parked by session), probe, exchange verdicts.
Status IpcTransport::attach_connector(const std::shared_ptr<PeerState>& peer, std::string_view remote_offer) {
  uint64_t session;
  std::string name;
  if (!parse_offer(remote_offer, &session, &name)) return Status(Code::kProtocolError, "malformed ipc offer");
  Rendezvous& rv = *rendezvous_;
  const uint32_t lanes = peer->lanes();
  const int64_t deadline = sys::now_ms() + endpoint_->config().connect_timeout_ms;
  std::vector<Accepted> mine;
  auto cleanup = [&] {
    for (auto& m : mine) {
      ::close(m.fd);
      if (m.seg_fd >= 0) ::close(m.seg_fd);
    }
  };
  Status s;
  {
    std::unique_lock lock(rv.mu);
    for (;;) {
      if (auto it = rv.parked.find(session); it != rv.parked.end()) {
        for (auto& m : it->second) mine.push_back(m);
        rv.parked.erase(it);
      }
      if (mine.size() >= lanes) break;
      const int64_t now = sys::now_ms();
      if (now >= deadline) { s = Status(Code::kTimeout, "the peer never opened its ipc lanes"); break; }
      if (rv.accepting) {
        rv.cv.wait_for(lock, std::chrono::milliseconds(std::min<int64_t>(deadline - now, 20)));
        continue;
      }
      // This thread accepts for everyone for a while.
      rv.accepting = true;
      lock.unlock();
      std::vector<Accepted> got;
      pollfd pf[2] = {{rv.fd, POLLIN, 0}, {peer->control_fd, POLLRDHUP, 0}};
      int r = ::poll(pf, 2, int(std::min<int64_t>(deadline - now, 20)));
      bool gone = r > 0 && (pf[1].revents & (POLLRDHUP | POLLHUP | POLLERR));
      for (;;) {
        int fd = ::accept4(rv.fd, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) break;
        Accepted m{fd, {}, -1, {}, sys::now_ms()};
        // The introduction follows the connect at once; a same-user stranger could stall us, briefly.
        if (!peer_cred(fd, &m.cred) || m.cred.uid != ::geteuid() ||
            recv_msg(fd, &m.hello, sizeof m.hello, &m.seg_fd, sys::now_ms() + 1000) != ssize_t(sizeof m.hello) ||
            m.hello.magic != kHelloMagic || m.hello.version != kIpcVersion || m.hello.stage != 1) {
          ::close(fd);
          if (m.seg_fd >= 0) ::close(m.seg_fd);
          continue;
        }
        got.push_back(m);
      }
      lock.lock();
      rv.accepting = false;
      for (auto& m : got) rv.parked[m.hello.session].push_back(m);
      for (auto it = rv.parked.begin(); it != rv.parked.end();) {  // lanes of connects that failed
        if (it->first != session && sys::now_ms() - it->second.front().at_ms > kParkedExpiryMs) {
          for (auto& m : it->second) { ::close(m.fd); if (m.seg_fd >= 0) ::close(m.seg_fd); }
          it = rv.parked.erase(it);
        } else {
          ++it;
        }
      }
      rv.cv.notify_all();
      if (gone) { s = Status(Code::kConnectionLost, "the peer closed the connection during ipc setup"); break; }
    }
  }
  if (!s.is_ok()) { cleanup(); return s; }
  // Every lane once, all from one process; lane 0 carries the listener's bounce segment.
  std::vector<int> fds(lanes, -1);
  auto ip = new_peer(*peer, session, endpoint_->config().chunk_bytes, &s);
  for (auto& m : mine) {
    if (!s.is_ok()) break;
    if (m.hello.lanes != lanes || m.hello.lane >= lanes || fds[m.hello.lane] >= 0 || m.cred.pid != mine[0].cred.pid ||
        (m.hello.lane == 0) != (m.seg_fd >= 0))
      s = Status(Code::kProtocolError, "malformed ipc lanes from the peer");
    else fds[m.hello.lane] = m.fd;
  }
  if (!s.is_ok()) { cleanup(); return s; }
  const Accepted* zero = nullptr;
  for (auto& m : mine) if (m.hello.lane == 0) zero = &m;
  ip->pid = zero->cred.pid;
  ip->fds = fds;
  for (int fd : fds) ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &kSocketBuffer, sizeof kSocketBuffer);
  std::string why;
  const int seg_fd = zero->seg_fd;
  for (auto& m : mine) m.seg_fd = -1;  // the segment takes it
  if (int e = ip->theirs.map(seg_fd)) why = std::string("cannot map the peer's bounce segment: ") + std::strerror(e);
  else ip->shm = std::make_unique<ShmMover>(ip->theirs);
  if (why.empty()) probe_other(*ip, zero->hello, host_mode_, &why);
  if (!why.empty()) { cleanup(); return Status(Code::kUnavailable, why); }
  Hello m2 = hello(*ip, 2, 0, lanes);
  m2.verdict = ip->cma != nullptr;
  Hello m3{};
  if (!send_msg(fds[0], &m2, sizeof m2, ip->own.fd()) ||
      recv_msg(fds[0], &m3, sizeof m3, nullptr, deadline) != ssize_t(sizeof m3) || !valid_hello(m3, 3, session)) {
    cleanup();
    return Status(Code::kConnectionLost, "ipc setup: the peer did not finish it (see its error)");
  }
  if (!take_verdict(*ip, m3.verdict, host_mode_, &why)) { cleanup(); return Status(Code::kUnavailable, why); }
  ip->ready.store(true, std::memory_order_seq_cst);
  peer->lane_fds = fds;
  return start_lanes(peer, ip, false);
}

Status IpcTransport::start_lanes(const std::shared_ptr<PeerState>& peer, const std::shared_ptr<IpcPeer>& ip, bool listener) {
  std::vector<std::shared_ptr<Lane>> made;
  for (uint32_t i = 0; i < ip->fds.size(); ++i) {
    auto l = std::make_shared<Lane>();
    l->peer = peer;
    l->ip = ip;
    l->index = i;
    l->fd = ip->fds[i];
    l->setup_first = listener && i == 0;
    ip->lanes.push_back(l);
    made.push_back(std::move(l));
  }
  peer->transport_state = ip;
  std::lock_guard lock(mu_);
  if (stopped_) return Status(Code::kCancelled, "endpoint closed");  // the peer closes the fds
  for (auto& l : made) {
    l->thread = std::thread(lane_main, l.get(), endpoint_, host_mode_);
    lanes_.push_back(std::move(l));
  }
  return Status::ok();
}

void IpcTransport::reap_finished() {
  for (size_t i = 0; i < lanes_.size();) {
    if (lanes_[i]->finished.load(std::memory_order_acquire)) {
      lanes_[i]->thread.join();
      lanes_[i] = std::move(lanes_.back());
      lanes_.pop_back();
    } else {
      ++i;
    }
  }
}

void IpcTransport::wake(PeerState* peer, uint64_t) {
  auto* ip = static_cast<IpcPeer*>(peer->transport_state.get());
  if (!ip || !ip->ready.load(std::memory_order_seq_cst)) return;  // setup pumps when it finishes
  pump_all(*ip, *peer);
}

void IpcTransport::stop() {
  std::vector<std::shared_ptr<Lane>> all;
  {
    std::lock_guard lock(mu_);
    if (stopped_) return;
    stopped_ = true;
    all.swap(lanes_);
  }
  for (auto& l : all) {
    std::shared_ptr<PeerState> p;
    {
      std::lock_guard lock(l->mu);
      p = l->peer;
    }
    if (p) p->fail(Status(Code::kCancelled, "endpoint closed"));  // shuts the lanes down: recv() returns
  }
  for (auto& l : all)
    if (l->thread.joinable()) l->thread.join();
}

}  // namespace tether::transport
