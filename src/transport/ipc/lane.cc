// A lane of the ipc transport: its messages (ring or socket) and its thread, which serves the peer's
// requests (target.cc) and takes the answers to ours (answers.cc).
#include <poll.h>
#include <sched.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "core/trace.h"
#include "sys/cpu.h"
#include "sys/net.h"
#include "sys/thread_name.h"
#include "transport/ipc/lane.h"

namespace tether::transport::ipc {

namespace trace = core::trace;

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

namespace {
// One message on a lane: through its ring where it fits (a doorbell on the socket if the other side
// sleeps), else over the socket. False (errno set): the lane is gone.
bool send_lane(IpcPeer& ip, uint32_t lane, const void* buf, size_t len) {
  bool doorbell = false;
  if (lane < ip.out.size() && ip.out[lane]->push(buf, len, &doorbell)) {
    if (!doorbell) return true;
    const char bell = 0;
    // EAGAIN: its socket is full, so it has something to read and wakes without us.
    return ::send(ip.fds[lane], &bell, 1, MSG_NOSIGNAL | MSG_DONTWAIT) == 1 || errno == EAGAIN || errno == EWOULDBLOCK;
  }
  return send_msg(ip.fds[lane], buf, len, -1);
}
}  // namespace

bool send_or_fail(IpcPeer& ip, Link& p, uint32_t lane, const void* msg, size_t len) {
  if (send_lane(ip, lane, msg, len)) return true;
  fail_peer(p, Code::kConnectionLost, std::strerror(errno));
  return false;
}

ssize_t recv_msg(int fd, void* buf, size_t len, int* got_fd, int64_t deadline_ms, int flags) {
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
  do n = ::recvmsg(fd, &m, MSG_CMSG_CLOEXEC | flags);
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

uint8_t* message_buffer() {
  thread_local std::unique_ptr<uint8_t[]> buffer;
  if (!buffer) buffer = std::make_unique<uint8_t[]>(kMaxMsg);
  return buffer.get();
}

void fail_peer(Link& p, Code c, const std::string& why) { p.fail(Status(c, "ipc lane to peer '" + p.info().name + "': " + why)); }

bool protocol_error(Link& p, const std::string& why) {
  fail_peer(p, Code::kProtocolError, why);
  return false;
}

bool batch_fits(uint32_t n, uint64_t nrefs, size_t bytes) {
  return n >= 1 && n <= kMaxBatch && nrefs <= n && bytes == sizeof(Frame) + n * sizeof(BatchEntry) + nrefs * sizeof(CudaRef);
}

BatchEntry batch_entry(const uint8_t* msg, uint32_t i) {
  BatchEntry e;
  std::memcpy(&e, msg + sizeof(Frame) + i * sizeof e, sizeof e);
  return e;
}

CudaRef batch_ref(const uint8_t* msg, uint32_t n, uint64_t k) {
  CudaRef r;
  std::memcpy(&r, msg + sizeof(Frame) + n * sizeof(BatchEntry) + k * sizeof r, sizeof r);
  return r;
}

uint32_t ref_slot(CudaRef* refs, uint32_t* nrefs, const CudaRef& r) {
  uint32_t k = 0;
  while (k < *nrefs && (refs[k].base != r.base || refs[k].size != r.size)) ++k;
  if (k == *nrefs) refs[(*nrefs)++] = r;
  return k;
}

bool within(const CudaRef& ref, const uint8_t* ptr, uint64_t len, uint64_t* offset) {
  const uint64_t at = reinterpret_cast<uint64_t>(ptr);
  if (at < ref.base || at - ref.base > ref.size || len > ref.size - (at - ref.base)) return false;
  *offset = at - ref.base;
  return true;
}

bool gpu_place(const RegionState* region, const uint8_t* ptr, uint64_t len, CudaRef* ref, uint64_t* offset) {
  return region && region_ref(*region, ref) && within(*ref, ptr, len, offset);
}

void count_moved(Host& host, bool received, uint64_t length) {
  Traffic& t = host.traffic();
  (received ? t.bytes_received : t.bytes_sent).fetch_add(length, std::memory_order_relaxed);
  (received ? t.chunks_received : t.chunks_sent).fetch_add(1, std::memory_order_relaxed);
}

Code copy_triples(Lane& l, int device, uint32_t n, bool one_kernel) {
  if (!l.cuda->copy_many(device, l.triples, n, one_kernel).is_ok()) return Code::kInternal;
  l.ip->counters->cuda_chunks.fetch_add(1, std::memory_order_relaxed);
  return Code::kOk;
}

namespace {

// The lane's next message, from its ring or its socket: its length, 0 when the other side closed the
// lane, -1 (errno) when the socket failed, kRingBroken when the other side broke the ring's rules.
// Within `busy_us` of the last message it polls without sleeping: an answer usually follows soon, and
// a wake-up takes longer than a copy of a few MiB (docs/ARCHITECTURE.md, "Waking up"). Doorbells (one
// byte) only wake it. Polling lanes send no queued chunks: lanes meeting the peer's mutex slept on it.
constexpr ssize_t kRingBroken = -2;
ssize_t next_msg(Lane& l, uint32_t busy_us, std::chrono::steady_clock::time_point* last) {
  using Clock = std::chrono::steady_clock;
  RingReader& ring = *l.ring;
  uint8_t* rx = l.rx.get();
  for (;;) {
    if (busy_us > 0) {
      const auto until = *last + std::chrono::microseconds(busy_us);
      uint32_t spins = 0;
      do {
        if (const ssize_t n = ring.pop(rx, kMaxMsg); n != 0) {
          *last = Clock::now();
          return n > 0 ? n : kRingBroken;
        }
        if ((++spins & 3) == 0) {  // large messages, a closed lane: the socket, every few turns
          const ssize_t n = ::recv(l.fd, rx, kMaxMsg, MSG_DONTWAIT);
          if (n == 1) continue;
          if (n >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
            *last = Clock::now();
            return n;
          }
          sched_yield();  // a runnable thread of ours (or the peer's) gets the core first
        } else {
          sys::cpu_relax();
        }
      } while (Clock::now() < until);
    }
    ring.sleep_begin();
    if (const ssize_t n = ring.pop(rx, kMaxMsg); n != 0) {
      ring.sleep_end();
      *last = Clock::now();
      return n > 0 ? n : kRingBroken;
    }
    const ssize_t n = ::recv(l.fd, rx, kMaxMsg, 0);
    ring.sleep_end();
    *last = Clock::now();
    if (n != 1) return n;
  }
}

enum class Msg { kMalformed, kRequest, kWriteBatch, kReadBatch, kReadBatchAnswer, kAnswer, kReadDone, kRelease };

// What the message of `n` bytes in `rx` is, its frame in *f; kMalformed when its length does not fit
// its kind (batches and their answers list entries after the frame; only an inline request carries
// bytes) or it sets flags we do not know.
Msg classify(const uint8_t* rx, size_t n, Frame* f) {
  if (n < sizeof *f) return Msg::kMalformed;
  std::memcpy(f, rx, sizeof *f);
  const auto type = static_cast<FrameType>(f->hdr.type);
  Msg m = Msg::kMalformed;
  if (type == FrameType::kWrite || type == FrameType::kReadReq || type == FrameType::kSendData) m = Msg::kRequest;
  else if (type == FrameType::kAck || type == FrameType::kReadResp) m = Msg::kAnswer;
  else if (type == FrameType::kWriteBatch) m = Msg::kWriteBatch;
  else if (type == FrameType::kReadBatch) m = Msg::kReadBatch;
  else if (f->hdr.type == kReadBatchAnswer) m = Msg::kReadBatchAnswer;
  else if (f->hdr.type == kReadDone) m = Msg::kReadDone;
  else if (f->hdr.type == kRelease) m = Msg::kRelease;
  const bool carried = m == Msg::kRequest && f->where == uint8_t(Where::kInline) && type != FrameType::kReadReq;
  const uint64_t extra = n - sizeof *f;  // inline bytes
  const bool listed = m == Msg::kWriteBatch || m == Msg::kReadBatch || m == Msg::kReadBatchAnswer;
  if ((!listed && (extra != (carried ? f->hdr.length : 0) || extra > kInlineMax)) || (f->hdr.flags & ~wire::kKnownFlags) != 0)
    return Msg::kMalformed;
  return m;
}

// Hands a message to its taker; false: the lane must end.
bool take_message(Lane& l, Msg m, const Frame& f, size_t n) {
  IpcPeer& ip = *l.ip;
  const uint8_t* rx = l.rx.get();
  switch (m) {
    case Msg::kRequest: return serve(l, f);
    case Msg::kWriteBatch: return serve_batch(l, rx, n);
    case Msg::kReadBatch: return serve_read_batch(l, rx, n);
    case Msg::kReadDone: return read_done(l, f.hdr);
    case Msg::kRelease:
      ip.imports->forget(f.cuda);  // copies still using the mapping keep it until they finish
      return true;
    case Msg::kReadBatchAnswer:
    case Msg::kAnswer:
      if (!(m == Msg::kAnswer ? take_answer(l, f) : take_read_batch(l, rx, n))) return false;
      pump_lane(ip, *l.peer, l.index);  // the answer freed room in this lane's window
      return true;
    case Msg::kMalformed: break;
  }
  return false;
}

// The lane ended: nothing of ours holds for the peer any more, and the peer is let go of.
void retire_lane(Lane* l) {
  Link& p = *l->peer;
  IpcPeer& ip = *l->ip;
  if (l->index < ip.out.size()) ip.out[l->index]->close();  // before the unpins below (take_answer)
  // No grant of ours holds for this peer any more, and its one-sided copies under way end before we
  // let go of anything (one_sided.h).
  if (ip.os_own) (void)revoke(*ip.os_own, *ip.os_theirs, 0, ip.pid, ip.host->config().deregister_timeout_ms);
  {
    std::lock_guard lock(l->held_mu);
    for (auto& h : l->held) h.pin->unpin();  // reads the initiator never finished: it cannot any more
    l->held.clear();
    l->held_reads = 0;
  }
  l->cuda.reset();  // waits for its streams
  p.release_lane(l->index, Code::kConnectionLost);  // after fail(): nothing new can be pulled
  // Let go at once, so a dead peer's sockets and bounce areas go with it even while the application keeps
  // a Peer handle; the thread is joined within a tick. Never the endpoint's last reference.
  std::shared_ptr<Link> peer;
  std::shared_ptr<IpcPeer> held_ip;
  {
    std::lock_guard lock(l->mu);
    peer.swap(l->peer);
    held_ip.swap(l->ip);
  }
  peer->let_go();
  held_ip.reset();
  peer.reset();
  l->finished.store(true, std::memory_order_release);
}

}  // namespace

void lane_main(Lane* l) {
  sys::name_this_thread("ipc", int(l->index));
  Link& p = *l->peer;
  const uint32_t busy_us = l->ip->host->config().busy_poll_us;
  auto last = std::chrono::steady_clock::now();
  if (!l->setup_first || finish_listener_setup(*l)) {
    for (;;) {
      ssize_t n = next_msg(*l, busy_us, &last);
      if (n < 0 && n != kRingBroken && errno == EINTR) continue;
      if (n == kRingBroken) {
        fail_peer(p, Code::kProtocolError, "the peer broke its message ring");
        break;
      }
      if (n <= 0) {
        fail_peer(p, Code::kConnectionLost, n == 0 ? "the peer closed it" : std::strerror(errno));
        break;
      }
      Frame f{};
      const Msg m = classify(l->rx.get(), size_t(n), &f);
      if (m == Msg::kMalformed || !l->ip->ready.load(std::memory_order_acquire)) {
        fail_peer(p, Code::kProtocolError, "the peer sent a malformed frame");
        break;
      }
      const bool carried = m == Msg::kRequest && f.where == uint8_t(Where::kInline) && f.hdr.type != uint8_t(FrameType::kReadReq);
      l->inline_bytes.set(carried ? l->rx.get() + sizeof f : nullptr, carried ? uint64_t(n) - sizeof f : 0);
      trace::mark(m == Msg::kAnswer ? trace::Event::kAnswered : trace::Event::kHeader, l->index, f.hdr.type, f.hdr.slot,
                  f.hdr.gen);
      if (!take_message(*l, m, f, size_t(n))) break;
    }
  }
  retire_lane(l);
}

}  // namespace tether::transport::ipc
