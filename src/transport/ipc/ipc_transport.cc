#include "transport/ipc/ipc_transport.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <thread>

#include "sys/crypto.h"
#include "core/endpoint_impl.h"
#include "core/peer.h"
#include "core/region.h"
#include "core/trace.h"
#include "gpu/copy_kernel.h"
#include "sys/cpu.h"
#include "sys/net.h"
#include "sys/thread_name.h"
#include "transport/ipc/cuda_mover.h"
#include "transport/ipc/host_mover.h"
#include "transport/ipc/one_sided.h"
#include "sys/proc.h"
#include "transport/ipc/ring.h"

namespace tether::transport {

using core::ChunkOp;
using core::RegionState;
using core::TransferState;
namespace trace = core::trace;
using wire::FrameHeader;
using wire::FrameType;

namespace ipc {

constexpr uint32_t kHelloMagic = 0x43504954;  // "TIPC"
constexpr uint16_t kIpcVersion = 8;  // 2: GPU memory (CudaRef in every frame), batches; 3: kRelease, VMM;
                                     // 4: host reads copied by the initiator (kReadReq with kCma);
                                     // 5: the connector opens the lanes, to the listener (same host proven);
                                     // 6: message rings at the end of each bounce segment (ring.h);
                                     // 7: grants and one-sided small ops (one_sided.h);
                                     // 8: a hazard names the thread that holds it (one_sided.h)
constexpr const char* kSocketPrefix = "tether-ipc-";  // every endpoint's lane socket: this and 16 hex digits
constexpr int kSocketBuffer = 1 << 20;        // frames in flight per lane are bounded by the window
constexpr size_t kMaxParked = 1024;            // lane sockets accepted and not yet claimed by a handshake

#pragma pack(push, 1)
// Every message on a lane after its setup: the tcp frame header, and for requests where the
// initiator's bytes are. The target trusts addr only as a place in the INITIATOR's memory.
struct Frame {
  FrameHeader hdr;
  uint8_t where;    // Where (requests); kNone in answers, but those granting one-sided access
  uint8_t grant;    // kWantGrant (requests), kGranted | kGrantReadOnly (answers): one_sided.h
  uint8_t pad[6];
  uint64_t addr;    // kCma: address in the initiator; kShm: offset in its bounce segment; kCuda: offset in `cuda`
                    // (a kWriteBatch of GPU pieces: the number of CudaRefs at the end of the message)
  CudaRef cuda;     // kCuda: the allocation; in a kReadResp, the TARGET's (the initiator copies, then kReadDone)
};
// A kWriteBatch message: the Frame, `hdr.region_id` entries, then (kCuda) `addr` CudaRefs.
struct BatchEntry {
  wire::Fragment frag;  // checked like a kWrite header
  uint64_t addr;        // where the piece is (as Frame::addr for the frame's `where`)
  uint32_t ref;         // kCuda: index of its allocation among the CudaRefs
  uint32_t pad;
};
// Lane setup. Stage 1: connector -> listener on every lane, sent before the connector answers the
// TCP handshake (segment fd on lane 0). Stage 2: listener -> connector on lane 0 (its segment fd, its
// verdict). Stage 3: connector -> listener on lane 0 (its verdict).
struct Hello {
  uint32_t magic;
  uint16_t version;
  uint8_t stage;
  uint8_t verdict;       // stages 2, 3: the receiver may describe its chunks by address (kCma)
  uint64_t session;
  uint32_t lane, lanes;
  uint64_t cookie_addr;  // 8 bytes at this address in the sender hold `cookie`: the CMA probe
  uint64_t cookie;
  uint64_t challenge;    // stage 1: the challenge from the listener's offer for this session
};
#pragma pack(pop)
static_assert(sizeof(Frame) == 160);
static_assert(sizeof(BatchEntry) == 64);
constexpr size_t kMaxMsg = sizeof(Frame) + kMaxBatch * (sizeof(BatchEntry) + sizeof(CudaRef));  // ~152 KiB
// ipc's own frame type: initiator -> target, "the read of (slot, gen) is copied out, let go of the region".
constexpr uint8_t kReadDone = 0x40;
// ... and either way: "the GPU memory in `cuda` was deregistered here, close your mapping of it".
constexpr uint8_t kRelease = 0x41;
// target -> initiator: the answer to a kReadBatch. Frame (status; region_id = n, addr = CudaRefs), then
// on success n BatchEntry (the fragment as asked, `addr` and `ref` where it lies, `pad` its Where:
// kCuda, kCma = an address in the target, kShm = an offset in the initiator's segment), then the CudaRefs.
constexpr uint8_t kReadBatchAnswer = 0x42;
static_assert(sizeof(Hello) == 48);

struct IpcPeer {
  uint64_t session = 0;
  pid_t pid = 0;                     // the other process, as the kernel names it (SO_PEERCRED)
  std::vector<int> fds;              // lane sockets (owned by Link::lane_fds)
  std::vector<std::weak_ptr<Lane>> lanes;
  uint64_t cookie = 0;               // the other side probes this
  Segment own;                       // our chunks' bounce slots (used when !out_cma)
  Segment theirs;                    // the other side's, mapped (their kShm chunks)
  std::unique_ptr<CmaMover> cma;     // set when our probe of the other side worked
  std::unique_ptr<ShmMover> shm;
  // Our chunks are described by address. Set by the listener's lane 0 from the connector's verdict
  // while its other lanes already serve (grant_for reads it): atomic; senders read it after `sending`.
  std::atomic<bool> out_cma{false};
  uint64_t slot_bytes = 0;           // one chunk per core slot in `own`
  std::atomic<bool> ready{false};    // lanes may serve the other side's requests
  std::atomic<bool> sending{false};  // setup done: lanes may pull and send ours
  int64_t setup_deadline_ms = 0;     // listener: the connector's stage 3 must come by then
  std::unique_ptr<CudaImports> imports;  // the other side's GPU allocations we opened (kept until the peer goes)
  std::vector<std::unique_ptr<RingWriter>> out;  // per lane: our messages, in `own`
  std::vector<std::unique_ptr<RingReader>> in;   // per lane: theirs, in `theirs`
  core::EndpointImpl* ep = nullptr;
  uint64_t one_sided_max = 0;                    // Config::ipc_one_sided_bytes (0: off)
  OneSidedPage* os_own = nullptr;                // our liveness table and hazards, in `own`
  OneSidedPage* os_theirs = nullptr;             // theirs, in `theirs`
  std::unique_ptr<OneSidedInitiator> os;         // the grants we hold for their regions (one_sided_max > 0)
  GpuCompleter* completer = nullptr;             // the transport's (null: busy polling off)
};

struct Lane {
  std::mutex mu;                     // guards letting go of peer/ip against stop()
  std::shared_ptr<Link> peer;   // held while the thread runs
  std::shared_ptr<IpcPeer> ip;
  uint32_t index = 0;
  int fd = -1;
  RingReader* ring = nullptr;        // the other side's messages on this lane (IpcPeer::in)
  InlineMover inline_bytes;          // lane thread: the request being served, when its bytes came in it
  bool setup_first = false;          // listener's lane 0: finish the setup before serving
  std::thread thread;
  std::atomic<bool> finished{false};
  // Lane thread only:
  std::unique_ptr<uint8_t[]> rx;     // one message (kMaxMsg)
  std::unique_ptr<CudaLane> cuda;    // streams, bounce buffer
  struct Held { uint32_t slot, gen; RegionState* pin; };
  std::mutex held_mu;                // held: the lane thread changes it; deregister looks for a region in it
  std::vector<Held> held;            // regions pinned for reads the initiator is pulling (until kReadDone)
  uint32_t held_reads = 0;           // reads in `held` (a batch holds several pins): held_bound() at most
  RegionState* pins[kMaxBatch];     // a batch's pinned regions (one per run of one descriptor)
  RegionState* dests[kMaxBatch];    // each fragment's region
  std::shared_ptr<Mapping> maps[kMaxBatch];
  uint64_t triples[3 * kMaxBatch];
  iovec local_iov[kMaxBatch], remote_iov[kMaxBatch];  // a read batch's host pieces read by attach
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

// One message (blocking, or bounded by deadline_ms when >= 0); *got_fd receives a passed fd.
ssize_t recv_msg(int fd, void* buf, size_t len, int* got_fd, int64_t deadline_ms, int flags = 0) {
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

bool peer_cred(int fd, ucred* out) {
  socklen_t len = sizeof *out;
  return ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, out, &len) == 0;
}

void fail_peer(Link& p, Code c, const std::string& why) { p.fail(Status(c, "ipc lane to peer '" + p.info().name + "': " + why)); }

// ---------------------------------------------------------------- initiator side

// A chunk that cannot go: answered at once, nothing moves.
void refuse(Link& p, uint32_t lane, const ChunkOp& op, Code c) { p.answer(lane, op.hdr.slot, op.hdr.gen, uint8_t(c)); }

// [ptr, ptr+len) inside the allocation `ref` names; `offset`: where it starts there.
bool within(const CudaRef& ref, const uint8_t* ptr, uint64_t len, uint64_t* offset) {
  const uint64_t at = reinterpret_cast<uint64_t>(ptr);
  if (at < ref.base || at - ref.base > ref.size || len > ref.size - (at - ref.base)) return false;
  *offset = at - ref.base;
  return true;
}

// Where GPU bytes [ptr, ptr+len) of `region` lie for the other process: false if it cannot open them
// (the export failed at registration) or they leave the allocation.
bool gpu_place(const RegionState* region, const uint8_t* ptr, uint64_t len, CudaRef* ref, uint64_t* offset) {
  return region && region_ref(*region, ref) && within(*ref, ptr, len, offset);
}

// What became of a chunk handed to send_chunk.
enum class Sent { kSent, kRefused, kMoved, kLaneGone };  // kRefused: answered here, nothing sent;
                                                         // kMoved: moved by us one-sided, answered here

// Any thread may send: each builds its larger messages (batches, inline writes) in its own buffer,
// made on its first such message.
uint8_t* message_buffer() {
  thread_local std::unique_ptr<uint8_t[]> buffer;
  if (!buffer) buffer = std::make_unique<uint8_t[]>(kMaxMsg);
  return buffer.get();
}

// Where `r` is among the batch message's `*nrefs` CudaRefs, added if new (VMM spans may share a base).
uint32_t ref_slot(CudaRef* refs, uint32_t* nrefs, const CudaRef& r) {
  uint32_t k = 0;
  while (k < *nrefs && (refs[k].base != r.base || refs[k].size != r.size)) ++k;
  if (k == *nrefs) refs[(*nrefs)++] = r;
  return k;
}

// Entry i of a batch message (kWriteBatch, kReadBatch, or a read batch's answer): after the Frame.
BatchEntry batch_entry(const uint8_t* msg, uint32_t i) {
  BatchEntry e;
  std::memcpy(&e, msg + sizeof(Frame) + i * sizeof e, sizeof e);
  return e;
}

// A kWriteBatch: the fragments and where each piece is, in one message; host pieces
// are staged in the slot's part of the bounce segment when the target cannot reach us by address.
Sent send_batch(IpcPeer& ip, Link& p, uint32_t lane, const ChunkOp& op) {
  const uint32_t n = op.fragments;
  uint8_t* msg = message_buffer();
  auto* ents = reinterpret_cast<BatchEntry*>(msg + sizeof(Frame));
  auto* refs = reinterpret_cast<CudaRef*>(msg + sizeof(Frame) + n * sizeof(BatchEntry));
  Frame f{};
  f.hdr = op.hdr;
  const bool gpu = op.device >= 0;
  f.where = uint8_t(gpu ? Where::kCuda : ip.out_cma.load(std::memory_order_relaxed) ? Where::kCma : Where::kShm);
  uint32_t nrefs = 0;
  uint64_t staged = uint64_t(op.hdr.slot) * ip.slot_bytes;
  const RegionState* last = nullptr;  // pieces of one region share its allocation's CudaRef: looked up once
  uint32_t k = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const core::Piece& pc = op.pieces[i];
    BatchEntry e{};
    e.frag = op.frags[i];
    if (gpu) {
      if (pc.region != last || !within(refs[k], pc.data, pc.length, &e.addr)) {
        CudaRef r;
        if (!gpu_place(pc.region, pc.data, pc.length, &r, &e.addr)) {
          refuse(p, lane, op, Code::kUnavailable);
          return Sent::kRefused;
        }
        k = ref_slot(refs, &nrefs, r);
        last = pc.region;
      }
      e.ref = k;
    } else if (ip.out_cma.load(std::memory_order_relaxed)) {
      e.addr = reinterpret_cast<uint64_t>(pc.data);
    } else {
      e.addr = staged;
      if (pc.length) std::memcpy(ip.own.base() + staged, pc.data, pc.length);  // the batch fits a chunk: the slot
      staged += pc.length;
    }
    ents[i] = e;
  }
  f.addr = nrefs;
  std::memcpy(msg, &f, sizeof f);
  const size_t bytes = sizeof(Frame) + n * sizeof(BatchEntry) + nrefs * sizeof(CudaRef);
  if (send_lane(ip, lane, msg, bytes)) return Sent::kSent;
  fail_peer(p, Code::kConnectionLost, std::strerror(errno));
  return Sent::kLaneGone;
}

void count_one_sided(IpcPeer& ip, bool read, uint64_t length) {
  auto& stats = ip.ep->stats();
  stats.ipc_one_sided_chunks.fetch_add(1, std::memory_order_relaxed);
  (read ? stats.bytes_received : stats.bytes_sent).fetch_add(length, std::memory_order_relaxed);
  (read ? stats.chunks_received : stats.chunks_sent).fetch_add(1, std::memory_order_relaxed);
}

// A one-sided GPU copy the completer saw finish (or fail: the chunk fails, as no copy can be undone).
void finish_one_sided(GpuCompleter::Pending& q, bool ok) {
  auto& p = *static_cast<Link*>(q.peer.get());
  auto& ip = *static_cast<IpcPeer*>(p.transport_state.get());  // kept by the hold one_sided() took
  if (ok) count_one_sided(ip, q.read, q.length);
  const auto type = uint8_t(q.read ? FrameType::kReadReq : FrameType::kWrite);
  trace::mark(trace::Event::kAnswered, q.lane, type, q.slot, q.gen);
  p.answer(q.lane, q.slot, q.gen, ok ? 0 : uint8_t(Code::kInternal));
  p.let_go();
}

// Brings every page of `src` in before a one-sided write claims its hazard (one_sided.h): a fault of
// the source (swap-in, userfaultfd, a slow file mapping) then stalls the writer, not a copy the
// target's deregister() waits for. One load per page.
void fault_in(const uint8_t* src, uint64_t len) {
  const uint64_t page = 4096;
  const uintptr_t first = reinterpret_cast<uintptr_t>(src) & ~(page - 1);
  uint8_t sink = 0;
  for (uintptr_t a = first; a < reinterpret_cast<uintptr_t>(src) + len; a += page)
    sink ^= *reinterpret_cast<const volatile uint8_t*>(std::max(a, reinterpret_cast<uintptr_t>(src)));
  asm volatile("" : : "r"(sink));
}

// A small chunk of a descriptor the target granted us (one_sided.h): we move it ourselves and answer
// it here. kAsk: no grant (the request asks for one); kNo: it goes as a request (a copy that failed
// goes too: the target's answer says what is wrong).
enum class OneSided { kMoved, kAsk, kNo };
OneSided one_sided(IpcPeer& ip, Link& p, uint32_t lane, const ChunkOp& op) {
  const FrameHeader& h = op.hdr;
  const bool read = h.type == uint8_t(FrameType::kReadReq);
  const bool gpu = op.device >= 0;
  const uint64_t gpu_max = ip.completer ? ip.one_sided_max : std::min(ip.one_sided_max, kOneSidedGpuMax);
  if (!ip.os || op.fragments > 0 || h.length == 0 || h.length > (gpu ? gpu_max : ip.one_sided_max) ||
      (!read && h.type != uint8_t(FrameType::kWrite)) || (!gpu && !ip.cma))
    return OneSided::kNo;
  Grant g;
  if (!ip.os->find(h, &g)) return OneSided::kAsk;
  if (g.gpu != gpu || (g.readonly && !read) || h.offset < h.desc_offset || h.offset - h.desc_offset > h.desc_length ||
      h.length > h.desc_length - (h.offset - h.desc_offset) || p.failed())
    return OneSided::kNo;
  if (!gpu && !read) fault_in(op.payload, h.length);
  bool gone = false;
  OneSidedInitiator::Context* c = ip.os->enter(h.region_id, read && !gpu, &gone);
  if (!c) {
    if (!gone) return OneSided::kNo;
    ip.os->forget(h.region_id);  // deregistered there (or the peer ends): the request finds out which
    return OneSided::kAsk;
  }
  bool ok;
  const uint64_t at = g.base + h.offset;
  if (!gpu && read) {
    // The target does not wait for a read's hazard: what we read counts only if the region was still
    // live once the copy ended.
    ok = ip.cma->pull(at, op.local, h.length) == 0;
    if (ok && !ip.os->live(h.region_id)) {
      ip.os->leave(c);
      ip.os->forget(h.region_id);
      return OneSided::kAsk;
    }
  } else if (!gpu) {
    ok = ip.cma->push(op.payload, at, h.length) == 0;
  } else {
    auto map = ip.imports->get(g.ref, op.device);
    ok = map.is_ok() && at <= map.value()->size && h.length <= map.value()->size - at;
    if (ok) {
      const Mapping& mp = *map.value();
      if (!c->cuda) c->cuda = std::make_unique<CudaLane>();  // once per context
      const uint64_t local = reinterpret_cast<uint64_t>(read ? op.local : op.payload);
      const uint64_t dst = read ? local : mp.ptr + at, src = read ? mp.ptr + at : local;
      if (h.length > kOneSidedGpuMax) {  // the completer waits for it; the poster goes on (one_sided.h)
        ok = c->cuda->start(mp.device, dst, src, h.length).is_ok();
        if (ok) {
          GpuCompleter::Pending q;
          q.os = ip.os.get();
          q.ctx = c;
          q.device = mp.device;
          q.finish = finish_one_sided;
          q.peer = p.shared_from_this();
          q.lane = lane;
          q.slot = h.slot;
          q.gen = h.gen;
          q.length = h.length;
          q.read = read;
          if (p.hold()) {  // finish_one_sided lets go (the caller holds the peer too: this succeeds)
            if (ip.completer->push(std::move(q))) return OneSided::kMoved;  // it leaves the hazard
            p.let_go();
          }
          ok = c->cuda->wait(mp.device).is_ok();  // the completer is full: wait here
        }
      } else {
        ok = c->cuda->copy(mp.device, dst, src, h.length).is_ok();
      }
    }
  }
  ip.os->leave(c);
  if (!ok) return OneSided::kNo;
  count_one_sided(ip, read, h.length);
  trace::mark(trace::Event::kAnswered, lane, h.type, h.slot, h.gen);  // type: the request's
  p.answer(lane, h.slot, h.gen, 0);
  return OneSided::kMoved;
}

// A kReadBatch: the fragments, and whether the target may answer with addresses we read by attach
// (kCma: our pieces are host memory and we may attach to it) or must push its host bytes into our
// slot (kShm, from `addr`; `hdr.key`: the slot's size). GPU bytes are always answered as CudaRefs.
Sent send_read_batch(IpcPeer& ip, Link& p, uint32_t lane, const ChunkOp& op) {
  const uint32_t n = op.fragments;
  uint8_t* msg = message_buffer();
  Frame f{};
  f.hdr = op.hdr;
  f.hdr.key = ip.slot_bytes;
  f.where = uint8_t(op.device < 0 && ip.cma ? Where::kCma : Where::kShm);
  f.addr = uint64_t(op.hdr.slot) * ip.slot_bytes;
  std::memcpy(msg, &f, sizeof f);
  for (uint32_t i = 0; i < n; ++i) {
    BatchEntry e{};
    e.frag = op.frags[i];
    std::memcpy(msg + sizeof f + i * sizeof e, &e, sizeof e);
  }
  if (send_lane(ip, lane, msg, sizeof f + n * sizeof(BatchEntry))) return Sent::kSent;
  fail_peer(p, Code::kConnectionLost, std::strerror(errno));
  return Sent::kLaneGone;
}

// Describes (and for shm, stages) a pulled chunk and sends it.
Sent send_chunk(IpcPeer& ip, Link& p, uint32_t lane, const ChunkOp& op) {
  trace::mark(trace::Event::kPulled, lane, op.hdr.type, op.hdr.slot, op.hdr.gen);
  if (op.fragments > 0)
    return op.hdr.type == uint8_t(FrameType::kReadBatch) ? send_read_batch(ip, p, lane, op) : send_batch(ip, p, lane, op);
  const OneSided os = one_sided(ip, p, lane, op);
  if (os == OneSided::kMoved) return Sent::kMoved;
  Frame f{};
  f.hdr = op.hdr;
  f.grant = os == OneSided::kAsk ? kWantGrant : 0;
  // Reads are copied by us — out of the target's memory by attach where we may attach to it, out of
  // its GPU allocation, or out of our segment where it pushed them: no target ever writes into our
  // memory, so a peer we gave up on (its answer never came) cannot scribble over memory we have
  // handed back.
  const bool read = op.hdr.type == uint8_t(FrameType::kReadReq);
  const void* msg = &f;  // what goes: the frame, or (inline) the frame and the bytes
  size_t bytes = sizeof f;
  if (op.device >= 0 && !read) {  // our GPU bytes: the target opens our allocation and copies
    if (!gpu_place(op.segment ? op.segment->local_region : nullptr, op.payload, op.length, &f.cuda, &f.addr)) {
      refuse(p, lane, op, Code::kUnavailable);
      return Sent::kRefused;
    }
    f.where = uint8_t(Where::kCuda);
  } else if (!read && op.length <= kInlineMax) {  // small: the bytes travel in the message
    f.where = uint8_t(Where::kInline);
    uint8_t* buf = message_buffer();
    std::memcpy(buf, &f, sizeof f);
    if (op.length > 0) std::memcpy(buf + sizeof f, op.payload, op.length);
    msg = buf;
    bytes += op.length;
  } else if (ip.out_cma.load(std::memory_order_relaxed) && !read) {
    f.where = uint8_t(Where::kCma);
    f.addr = reinterpret_cast<uint64_t>(op.local);
  } else if (read && op.device < 0 && ip.cma) {  // "say where your bytes are: we read them ourselves"
    f.where = uint8_t(Where::kCma);
  } else {
    f.where = uint8_t(Where::kShm);
    f.addr = uint64_t(op.hdr.slot) * ip.slot_bytes;
    if (op.length > 0) std::memcpy(ip.own.base() + f.addr, op.payload, op.length);  // slot is ours until answered
  }
  if (send_lane(ip, lane, msg, bytes)) {
    trace::mark(trace::Event::kSent, lane, op.hdr.type, op.hdr.slot, op.hdr.gen);
    return Sent::kSent;
  }
  fail_peer(p, Code::kConnectionLost, std::strerror(errno));
  return Sent::kLaneGone;
}

void pump_lane(IpcPeer& ip, Link& p, uint32_t lane) {
  ChunkOp op;
  while (p.next_chunk(lane, &op))
    if (send_chunk(ip, p, lane, op) == Sent::kLaneGone) return;
}

// Spreads queued chunks over every lane, starting at the quietest (Link::quietest_lane), one
// per lane per round, while windows allow; `one_round`: stop after the first round that sent
// something. The posting thread takes one round only: lanes then have chunks in flight, and each
// lane's thread sends the rest as answers free its window, so the lanes send in parallel instead of
// the poster sending the whole window (a vectored op of many batches) one message after another. A
// round whose chunks were all refused here put nothing in flight, so nobody would come back for the
// rest: the loop goes on.
void pump_all(IpcPeer& ip, Link& p, bool one_round = false) {
  const uint32_t n = uint32_t(ip.fds.size());
  const uint32_t first = p.quietest_lane();
  for (bool any = true; any;) {
    any = false;
    bool sent = false;
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t lane = (first + i) % n;
      ChunkOp op;
      if (!p.next_chunk(lane, &op)) continue;
      const Sent r = send_chunk(ip, p, lane, op);
      if (r == Sent::kLaneGone) return;
      sent = sent || r == Sent::kSent;
      any = true;
    }
    if (one_round && sent) return;
  }
}

// ---------------------------------------------------------------- target side

Mover* mover_for(Lane& l, uint8_t where) {
  IpcPeer& ip = *l.ip;
  return where == uint8_t(Where::kCma)    ? static_cast<Mover*>(ip.cma.get())
       : where == uint8_t(Where::kShm)    ? static_cast<Mover*>(ip.shm.get())
       : where == uint8_t(Where::kInline) ? static_cast<Mover*>(&l.inline_bytes)
                                          : nullptr;
}

// What moving one piece came to: `code` answers the chunk; `err` (an errno) ends the lane (EPROTO: the
// request names memory this side cannot reach; else the other process is gone).
struct Moved {
  Code code = Code::kOk;
  int err = 0;
};

// Copies `len` initiator bytes, described by (where, addr, ref), to `dst` (host, or GPU `dev`).
Moved pull_piece(Lane& l, core::EndpointImpl* ep, uint8_t where, uint64_t addr, const CudaRef* ref, uint8_t* dst, int dev,
                 uint64_t len) {
  IpcPeer& ip = *l.ip;
  auto& stats = ep->stats();
  Moved m;
  if (len == 0) return m;
  if (where == uint8_t(Where::kCuda)) {  // their GPU memory: opened once, copied by this GPU's copy engines
    auto map = ip.imports->get(*ref, dev);
    if (!map.is_ok()) return Moved{Code::kUnavailable, 0};
    const Mapping& mp = *map.value();
    if (addr > mp.size || len > mp.size - addr) return Moved{Code::kOk, EPROTO};
    if (!l.cuda->copy(mp.device, reinterpret_cast<uint64_t>(dst), mp.ptr + addr, len).is_ok()) return Moved{Code::kInternal, 0};
    stats.ipc_cuda_chunks.fetch_add(1, std::memory_order_relaxed);
    return m;
  }
  Mover* mv = mover_for(l, where);
  if (!mv) return Moved{Code::kOk, EPROTO};
  if (dev < 0) {
    m.err = mv->pull(addr, dst, len);
  } else {  // their host bytes into our GPU: through a pinned bounce buffer
    auto b = l.cuda->bounce(len);
    if (!b.is_ok()) return Moved{Code::kInternal, 0};
    m.err = mv->pull(addr, b.value(), len);
    if (!m.err && !l.cuda->copy(dev, reinterpret_cast<uint64_t>(dst), reinterpret_cast<uint64_t>(b.value()), len).is_ok())
      m.code = Code::kInternal;
    if (!m.err) stats.ipc_cuda_chunks.fetch_add(1, std::memory_order_relaxed);
  }
  if (!m.err)
    (where == uint8_t(Where::kCma)    ? stats.ipc_cma_chunks
     : where == uint8_t(Where::kShm)  ? stats.ipc_shm_chunks
                                      : stats.ipc_inline_chunks).fetch_add(1, std::memory_order_relaxed);
  return m;
}

// `grant` (one_sided.h): where/addr/ref say where the chunk lies here, and the header names its
// descriptor, which the initiator may move chunks of itself from now on.
bool answer_frame(Lane& l, const FrameHeader& h, Code c, uint8_t where = 0, uint64_t addr = 0, const CudaRef* ref = nullptr,
                  uint8_t grant = 0) {
  Frame a{};
  a.hdr.type = uint8_t(h.type == uint8_t(FrameType::kReadReq) ? FrameType::kReadResp : FrameType::kAck);
  a.hdr.status = uint8_t(c);
  a.hdr.slot = h.slot;
  a.hdr.gen = h.gen;
  a.hdr.length = h.length;
  if (grant) {
    a.hdr.region_id = h.region_id;
    a.hdr.key = h.key;
    a.hdr.desc_offset = h.desc_offset;
    a.hdr.desc_length = h.desc_length;
    a.hdr.offset = h.offset;
  }
  a.where = where;
  a.grant = grant;
  a.addr = addr;
  if (ref) a.cuda = *ref;
  if (send_lane(*l.ip, l.index, &a, sizeof a)) {
    trace::mark(trace::Event::kSent, l.index, a.hdr.type, a.hdr.slot, a.hdr.gen);
    return true;
  }
  fail_peer(*l.peer, Code::kConnectionLost, std::strerror(errno));
  return false;
}

bool lane_error(Link& p, int err) {
  fail_peer(p, err == EPROTO ? Code::kProtocolError : Code::kConnectionLost,
            err == EPROTO ? "a request names memory this side cannot reach"
                          : std::string("moving its bytes failed (") + std::strerror(err) + "); is the process gone?");
  return false;
}

void count_served(core::EndpointImpl* ep, bool read, uint64_t length) {
  auto& stats = ep->stats();
  (read ? stats.bytes_sent : stats.bytes_received).fetch_add(length, std::memory_order_relaxed);
  (read ? stats.chunks_sent : stats.chunks_received).fetch_add(1, std::memory_order_relaxed);
}

// Reads pinned here until their kReadDone are bounded by the peer's chunk slots, which bound its reads
// in flight (twice that: a kReadDone may reach us after the next read of its slot, by ring or socket):
// a peer that never says it is done cannot grow `held`. Past that it is dropped.
uint32_t held_bound(const Lane& l) { return 2 * l.peer->slot_count(); }

bool too_many_held(Lane& l) {
  fail_peer(*l.peer, Code::kResourceExhausted,
            "more reads unfinished (no kReadDone) than twice its " + std::to_string(l.peer->slot_count()) + " chunk slots");
  return false;
}

// A read the initiator copies itself: the region stays pinned until its kReadDone (or the lane ends).
// False (the region unpinned, the peer dropped): past the bound above.
bool hold(Lane& l, const FrameHeader& h, RegionState* pin) {
  {
    std::lock_guard lock(l.held_mu);  // never contended but by a deregister looking for stalled readers
    if (l.held_reads < held_bound(l)) {
      l.held.push_back(Lane::Held{h.slot, h.gen, pin});
      ++l.held_reads;
      return true;
    }
  }
  pin->unpin();
  return too_many_held(l);
}

// Whether this answer may grant one-sided access to the request's descriptor (one_sided.h): the
// initiator asked, we offer it, it can reach the region (host memory: by attach), and the region
// got its slot in our liveness table. Called while the region is pinned (deregister revokes after).
uint8_t grant_for(IpcPeer& ip, const Frame& f, const RegionState& r) {
  if (!(f.grant & kWantGrant) || !ip.os_own || ip.one_sided_max == 0) return 0;
  if (r.kind != MemoryKind::kCuda && !ip.out_cma.load(std::memory_order_relaxed)) return 0;
  if (!mark_live(*ip.os_own, r.id)) return 0;
  return uint8_t(kGranted | (r.readonly ? kGrantReadOnly : 0));
}

// Validates a request exactly as tcp does, moves the bytes, answers. False: the lane must end.
bool serve(Lane& l, core::EndpointImpl* ep, const Frame& f) {
  Link& p = *l.peer;
  IpcPeer& ip = *l.ip;
  const FrameHeader& h = f.hdr;
  const auto type = static_cast<FrameType>(h.type);
  auto& stats = ep->stats();
  RegionState* pin = nullptr;
  TransferState* recv = nullptr;
  uint8_t* local = nullptr;
  int device = -1;
  Code c;
  if (type == FrameType::kSendData) {
    c = p.resolve_send_data(h.region_id, h.offset, h.length, h.key, h.flags, &local, &recv, &device);
  } else {
    c = ep->registry().resolve(h.region_id, h.key, h.desc_offset, h.desc_length, h.offset, h.length,
                               type == FrameType::kWrite, &pin);
    if (c == Code::kOk) {
      local = pin->base + h.offset;
      device = pin->kind == MemoryKind::kCuda ? pin->device : -1;
    }
  }
  if (c == Code::kOk && type == FrameType::kReadReq && device >= 0) {
    // Our GPU bytes: the initiator copies them out of our allocation itself; the region stays pinned
    // (deregister waits) until it says it is done (kReadDone), or the lane ends.
    CudaRef ref;
    uint64_t at = 0;
    if (!gpu_place(pin, local, h.length, &ref, &at)) {
      pin->unpin();
      stats.rejected_requests.fetch_add(1, std::memory_order_relaxed);
      return answer_frame(l, h, Code::kUnavailable);
    }
    const uint8_t grant = grant_for(ip, f, *pin);
    if (!hold(l, h, pin)) return false;
    count_served(ep, true, h.length);
    stats.ipc_cuda_chunks.fetch_add(1, std::memory_order_relaxed);
    return answer_frame(l, h, Code::kOk, uint8_t(Where::kCuda), at, &ref, grant);
  }
  if (c == Code::kOk && type == FrameType::kReadReq && f.where == uint8_t(Where::kCma)) {
    // Our host bytes, read by the initiator itself (one copy, by attach): pinned, as above, until it
    // says it is done.
    const uint8_t grant = grant_for(ip, f, *pin);
    if (!hold(l, h, pin)) return false;
    count_served(ep, true, h.length);
    stats.ipc_cma_chunks.fetch_add(1, std::memory_order_relaxed);
    return answer_frame(l, h, Code::kOk, uint8_t(Where::kCma), reinterpret_cast<uint64_t>(local), nullptr, grant);
  }
  Moved m;
  if (c == Code::kOk && h.length > 0 && local) {
    if (type == FrameType::kReadReq) {  // our host bytes into the initiator's segment
      Mover* mv = mover_for(l, f.where);
      if (f.where != uint8_t(Where::kShm) || !mv) m.err = EPROTO;
      else m.err = mv->push(local, f.addr, h.length);
      if (!m.err) stats.ipc_shm_chunks.fetch_add(1, std::memory_order_relaxed);
    } else {
      m = pull_piece(l, ep, f.where, f.addr, &f.cuda, local, device, h.length);
      if (m.code != Code::kOk) c = m.code;
    }
  }
  // A write's answer may grant the initiator its next writes of this descriptor (one_sided.h).
  uint8_t grant = 0, gwhere = 0;
  uint64_t gaddr = 0;
  CudaRef gref;
  if (type == FrameType::kWrite && c == Code::kOk && !m.err && pin && (f.grant & kWantGrant)) {
    if (device < 0) {
      gwhere = uint8_t(Where::kCma);
      gaddr = reinterpret_cast<uint64_t>(local);
    } else if (gpu_place(pin, local, h.length, &gref, &gaddr)) {
      gwhere = uint8_t(Where::kCuda);
    }
    if (gwhere) grant = grant_for(ip, f, *pin);
  }
  if (pin) pin->unpin();
  if (c != Code::kOk) stats.rejected_requests.fetch_add(1, std::memory_order_relaxed);
  if (recv) {
    if (!m.err && c == Code::kOk) {
      p.send_data_placed(recv, h.offset, h.length);
    } else {
      recv->record_error(m.err ? Status(Code::kConnectionLost, "lost the sender's data")
                               : Status(c, "receiving GPU data over ipc failed"));
      recv->release();
    }
  }
  if (m.err) return lane_error(p, m.err);
  if (c == Code::kOk) count_served(ep, type == FrameType::kReadReq, h.length);
  if (grant) return answer_frame(l, h, c, gwhere, gaddr, gwhere == uint8_t(Where::kCuda) ? &gref : nullptr, grant);
  return answer_frame(l, h, c);
}

// kReadDone: the initiator has copied a read out of our GPU region; let go of it.
bool read_done(Lane& l, const FrameHeader& h) {
  std::lock_guard lock(l.held_mu);
  bool found = false;  // a read batch holds one pin per run of fragments, all under its (slot, gen)
  for (size_t i = 0; i < l.held.size();) {
    if (l.held[i].slot != h.slot || l.held[i].gen != h.gen) {
      ++i;
      continue;
    }
    l.held[i].pin->unpin();
    l.held[i] = l.held.back();
    l.held.pop_back();
    found = true;
  }
  if (found) {
    --l.held_reads;
    return true;
  }
  fail_peer(*l.peer, Code::kProtocolError, "read done for no read");
  return false;
}

// A batch's fragment, checked as a kWrite (kReadReq) header would be: the first of a run naming one
// descriptor through the registry, which pins its region into l.pins[(*pinned)++]; the rest of the run
// by its bounds only (a lookup, a keyed hash and a shared pin per fragment cost more than the copy of
// 16 KiB). On kOk the fragment's region is l.pins[*pinned - 1].
Code pin_fragment(Lane& l, core::EndpointImpl* ep, const wire::Fragment& fr, bool write, uint32_t* pinned,
                  wire::Fragment* run) {
  if (*pinned > 0 && fr.region_id == run->region_id && fr.key == run->key && fr.desc_offset == run->desc_offset &&
      fr.desc_length == run->desc_length)
    return fr.offset < fr.desc_offset || !core::in_bounds(fr.offset - fr.desc_offset, fr.length, fr.desc_length)
               ? Code::kOutOfRange
               : Code::kOk;
  const Code c = ep->registry().resolve(fr.region_id, fr.key, fr.desc_offset, fr.desc_length, fr.offset, fr.length,
                                        write, &l.pins[*pinned]);
  if (c == Code::kOk) {
    ++*pinned;
    *run = fr;
  }
  return c;
}

void unpin(Lane& l, uint32_t pinned) {
  for (uint32_t j = 0; j < pinned; ++j) l.pins[j]->unpin();
}

// A kReadBatch: every fragment is checked and pinned first; the answer says where each lies — in our
// GPU allocation (kCuda) or at our address (kCma: the initiator reads both itself, and the pins stay
// until its kReadDone), or pushed into the initiator's slot (kShm: done here, nothing stays pinned).
// False: the lane must end.
bool serve_read_batch(Lane& l, core::EndpointImpl* ep, const uint8_t* msg, size_t bytes) {
  Link& p = *l.peer;
  IpcPeer& ip = *l.ip;
  Frame f;
  std::memcpy(&f, msg, sizeof f);
  const FrameHeader& h = f.hdr;
  const uint32_t n = h.region_id;
  if (n < 1 || n > kMaxBatch || bytes != sizeof(Frame) + n * sizeof(BatchEntry) ||
      (f.where != uint8_t(Where::kCma) && f.where != uint8_t(Where::kShm))) {
    fail_peer(p, Code::kProtocolError, "a malformed read batch");
    return false;
  }
  auto& stats = ep->stats();
  uint8_t* out = message_buffer();
  auto* ents = reinterpret_cast<BatchEntry*>(out + sizeof(Frame));
  auto* refs = reinterpret_cast<CudaRef*>(out + sizeof(Frame) + n * sizeof(BatchEntry));
  Code c = Code::kOk;
  uint32_t pinned = 0, nrefs = 0;
  uint64_t total = 0, pushed = 0;
  bool held = false;
  wire::Fragment run{};
  for (uint32_t i = 0; i < n; ++i) {
    const wire::Fragment fr = batch_entry(msg, i).frag;
    if ((c = pin_fragment(l, ep, fr, false, &pinned, &run)) != Code::kOk) break;
    RegionState* r = l.pins[pinned - 1];
    uint8_t* at = r->base + fr.offset;
    BatchEntry a{};
    a.frag = fr;
    if (r->kind == MemoryKind::kCuda) {
      CudaRef ref;
      if (!gpu_place(r, at, fr.length, &ref, &a.addr)) {
        c = Code::kUnavailable;
        break;
      }
      a.ref = ref_slot(refs, &nrefs, ref);
      a.pad = uint32_t(Where::kCuda);
      held = true;
    } else if (f.where == uint8_t(Where::kCma)) {
      a.addr = reinterpret_cast<uint64_t>(at);
      a.pad = uint32_t(Where::kCma);
      held = true;
    } else {  // into the initiator's slot, one piece after another
      if (fr.length > h.key || pushed > h.key - fr.length) {
        unpin(l, pinned);
        fail_peer(p, Code::kProtocolError, "a read batch larger than its slot");
        return false;
      }
      a.addr = f.addr + pushed;
      if (int e = ip.shm->push(at, a.addr, fr.length)) {
        unpin(l, pinned);
        return lane_error(p, e);
      }
      pushed += fr.length;
      a.pad = uint32_t(Where::kShm);
    }
    ents[i] = a;
    total += fr.length;
  }
  if (c == Code::kOk && total != h.length) {
    unpin(l, pinned);
    fail_peer(p, Code::kProtocolError, "a read batch whose fragments do not add up");
    return false;
  }
  Frame a{};
  a.hdr.type = kReadBatchAnswer;
  a.hdr.status = uint8_t(c);
  a.hdr.slot = h.slot;
  a.hdr.gen = h.gen;
  a.hdr.length = h.length;
  size_t len = sizeof a;
  if (c == Code::kOk) {
    a.hdr.region_id = n;
    a.addr = nrefs;
    len += n * sizeof(BatchEntry) + nrefs * sizeof(CudaRef);
    count_served(ep, true, h.length);
  } else {
    stats.rejected_requests.fetch_add(1, std::memory_order_relaxed);
  }
  if (c == Code::kOk && held) {
    bool room;
    {
      std::lock_guard lock(l.held_mu);  // until its kReadDone (or the lane ends)
      room = l.held_reads < held_bound(l);
      if (room) {
        for (uint32_t j = 0; j < pinned; ++j) l.held.push_back(Lane::Held{h.slot, h.gen, l.pins[j]});
        ++l.held_reads;
      }
    }
    if (!room) {
      unpin(l, pinned);
      return too_many_held(l);
    }
  } else {
    unpin(l, pinned);
  }
  std::memcpy(out, &a, sizeof a);
  if (send_lane(ip, l.index, out, len)) return true;
  fail_peer(p, Code::kConnectionLost, std::strerror(errno));
  return false;
}

// Every fragment of the batch being served lands in host memory (l.dests).
bool host_only(const Lane& l, uint32_t n) {
  for (uint32_t i = 0; i < n; ++i)
    if (l.dests[i]->kind == MemoryKind::kCuda) return false;
  return true;
}

// A kWriteBatch: every fragment is checked and pinned before any byte lands; GPU pieces into GPU
// memory of one device go in one copy-kernel launch over peer pointers. False: the lane must end.
bool serve_batch(Lane& l, core::EndpointImpl* ep, const uint8_t* msg, size_t bytes) {
  Link& p = *l.peer;
  IpcPeer& ip = *l.ip;
  Frame f;
  std::memcpy(&f, msg, sizeof f);
  const FrameHeader& h = f.hdr;
  const uint32_t n = h.region_id;
  const bool gpu = f.where == uint8_t(Where::kCuda);
  const uint64_t nrefs = gpu ? f.addr : 0;
  if (n < 1 || n > kMaxBatch || nrefs > n || (gpu && nrefs == 0) ||
      bytes != sizeof(Frame) + n * sizeof(BatchEntry) + nrefs * sizeof(CudaRef)) {
    fail_peer(p, Code::kProtocolError, "a malformed batch");
    return false;
  }
  auto entry = [&](uint32_t i) { return batch_entry(msg, i); };
  auto ref_at = [&](uint32_t k) {
    CudaRef r;
    std::memcpy(&r, msg + sizeof(Frame) + n * sizeof(BatchEntry) + k * sizeof(CudaRef), sizeof r);
    return r;
  };
  auto& stats = ep->stats();
  Code c = Code::kOk;
  uint32_t pinned = 0;  // l.pins[0, pinned): one per run of fragments naming the same descriptor
  uint64_t total = 0;
  wire::Fragment run{};
  for (uint32_t i = 0; i < n; ++i) {
    const wire::Fragment fr = entry(i).frag;
    if ((c = pin_fragment(l, ep, fr, true, &pinned, &run)) != Code::kOk) break;
    l.dests[i] = l.pins[pinned - 1];
    total += fr.length;
  }
  int err = c == Code::kOk && total != h.length ? EPROTO : 0;
  if (c == Code::kOk && !err && gpu) {
    // Map every allocation, check every piece, then one launch when all of it is GPU memory of the
    // GPU the mappings live on (else one async copy per piece; either way one wait).
    uint32_t k = 0;
    for (; k < nrefs && c == Code::kOk; ++k) {
      const CudaRef r = ref_at(k);
      auto m = ip.imports->get(r, l.dests[0]->kind == MemoryKind::kCuda ? l.dests[0]->device : -1);
      if (m.is_ok()) l.maps[k] = m.take(); else c = Code::kUnavailable;
    }
    const int dev = c == Code::kOk ? l.maps[0]->device : -1;
    bool one_kernel = c == Code::kOk && gpu::copy_kernel(dev).is_ok();
    for (uint32_t i = 0; i < n && c == Code::kOk && !err; ++i) {
      const BatchEntry e = entry(i);
      if (e.ref >= nrefs) { err = EPROTO; break; }
      const Mapping& mp = *l.maps[e.ref];
      if (e.addr > mp.size || e.frag.length > mp.size - e.addr) { err = EPROTO; break; }
      const RegionState* r = l.dests[i];
      one_kernel = one_kernel && mp.device == dev && r->kind == MemoryKind::kCuda && r->device == dev;
      l.triples[3 * i + 0] = mp.ptr + e.addr;
      l.triples[3 * i + 1] = reinterpret_cast<uint64_t>(r->base + e.frag.offset);
      l.triples[3 * i + 2] = e.frag.length;
    }
    if (c == Code::kOk && !err) {
      if (l.cuda->copy_many(dev, l.triples, n, one_kernel).is_ok()) stats.ipc_cuda_chunks.fetch_add(1, std::memory_order_relaxed);
      else c = Code::kInternal;
    }
    for (uint32_t j = 0; j < k; ++j) l.maps[j].reset();
  } else if (c == Code::kOk && !err && f.where == uint8_t(Where::kCma) && ip.cma && host_only(l, n)) {
    // Host pieces into host memory by attach: one process_vm_readv for the batch.
    for (uint32_t i = 0; i < n; ++i) {
      const BatchEntry e = entry(i);
      l.local_iov[i] = iovec{l.dests[i]->base + e.frag.offset, e.frag.length};
      l.remote_iov[i] = iovec{reinterpret_cast<void*>(e.addr), e.frag.length};
    }
    err = ip.cma->pull_many(l.local_iov, l.remote_iov, n, total);
    if (!err) stats.ipc_cma_chunks.fetch_add(1, std::memory_order_relaxed);
  } else if (c == Code::kOk && !err) {
    for (uint32_t i = 0; i < n && c == Code::kOk && !err; ++i) {
      const BatchEntry e = entry(i);
      const RegionState* r = l.dests[i];
      Moved m = pull_piece(l, ep, f.where, e.addr, nullptr, r->base + e.frag.offset,
                           r->kind == MemoryKind::kCuda ? r->device : -1, e.frag.length);
      c = m.code;
      err = m.err;
    }
  }
  unpin(l, pinned);
  if (err) return lane_error(p, err);
  if (c != Code::kOk) stats.rejected_requests.fetch_add(1, std::memory_order_relaxed);
  else count_served(ep, false, h.length);
  return answer_frame(l, h, c);
}

// A grant in a successful answer (one_sided.h). What the target says of its own memory can only
// mislead copies into its own memory, so it is kept as said; one we cannot use is ignored.
void take_grant(IpcPeer& ip, const Frame& f) {
  const FrameHeader& h = f.hdr;
  const bool gpu = f.where == uint8_t(Where::kCuda);
  if (!ip.os || h.region_id == 0 || f.addr < h.offset || (!gpu && (f.where != uint8_t(Where::kCma) || !ip.cma))) return;
  Grant g;
  g.region = h.region_id;
  g.key = h.key;
  g.desc_offset = h.desc_offset;
  g.desc_length = h.desc_length;
  g.gpu = gpu;
  g.readonly = (f.grant & kGrantReadOnly) != 0;
  g.base = f.addr - h.offset;
  if (gpu) g.ref = f.cuda;
  ip.os->remember(g);
}

// The answer to one of our kReadBatch chunks: checked against what we asked (the slot's fragments),
// then every piece copied — GPU pieces by one copy over the mapped allocations, host pieces by attach
// or out of our slot — and, where the target holds its regions for us, kReadDone. False: the lane must end.
bool take_read_batch(Lane& l, core::EndpointImpl* ep, const uint8_t* msg, size_t bytes) {
  Link& p = *l.peer;
  IpcPeer& ip = *l.ip;
  Frame f;
  std::memcpy(&f, msg, sizeof f);
  const FrameHeader& h = f.hdr;
  auto bad = [&](const char* why) {
    fail_peer(p, Code::kProtocolError, why);
    return false;
  };
  uint8_t status = h.status;
  if (status != 0) {
    if (bytes != sizeof f) return bad("a malformed read batch answer");
    if (p.answer(l.index, h.slot, h.gen, status) != Code::kOk) return bad("an answer to no request");
    return true;
  }
  const uint32_t n = h.region_id;
  const uint64_t nrefs = f.addr;
  const wire::Fragment* frags = nullptr;
  const core::Piece* pieces = nullptr;
  int device = -1;
  if (n < 1 || n > kMaxBatch || nrefs > n || bytes != sizeof f + n * sizeof(BatchEntry) + nrefs * sizeof(CudaRef) ||
      p.read_batch(l.index, h.slot, h.gen, n, &frags, &pieces, &device) != Code::kOk)
    return bad("a read batch answer to no read batch");
  auto entry = [&](uint32_t i) { return batch_entry(msg, i); };
  const uint64_t slot_at = uint64_t(h.slot) * ip.slot_bytes;
  bool held = false;  // the target holds its regions for us until kReadDone, whatever becomes of our copy
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t w = entry(i).pad;
    held = held || w == uint32_t(Where::kCuda) || w == uint32_t(Where::kCma);
  }
  uint32_t k = 0, v = 0;  // GPU pieces as copy triples; host pieces by attach as iovecs
  uint64_t by_attach = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const BatchEntry e = entry(i);
    const core::Piece& pc = pieces[i];
    if (e.frag.length != pc.length || e.frag.region_id != frags[i].region_id || e.frag.offset != frags[i].offset)
      return bad("a read batch answer for other fragments");
    if (e.pad == uint32_t(Where::kCuda)) {
      if (e.ref >= nrefs) return bad("a read batch answer naming no allocation");
      if (!l.maps[e.ref]) {
        CudaRef r;
        std::memcpy(&r, msg + sizeof f + n * sizeof(BatchEntry) + e.ref * sizeof r, sizeof r);
        auto m = ip.imports->get(r, device);
        if (!m.is_ok()) {
          status = uint8_t(Code::kUnavailable);
          break;
        }
        l.maps[e.ref] = m.take();
      }
      const Mapping& mp = *l.maps[e.ref];
      if (e.addr > mp.size || pc.length > mp.size - e.addr) return bad("read data outside the allocation it names");
      l.triples[3 * k + 0] = mp.ptr + e.addr;
      l.triples[3 * k + 1] = reinterpret_cast<uint64_t>(pc.data);
      l.triples[3 * k + 2] = pc.length;
      ++k;
    } else if (e.pad == uint32_t(Where::kCma)) {
      if (device >= 0 || !ip.cma) return bad("a read batch answered by address that was not asked so");
      l.local_iov[v] = iovec{pc.data, pc.length};
      l.remote_iov[v++] = iovec{reinterpret_cast<void*>(e.addr), pc.length};
      by_attach += pc.length;
    } else if (e.pad == uint32_t(Where::kShm)) {
      if (e.addr < slot_at || e.addr - slot_at > ip.slot_bytes || pc.length > ip.slot_bytes - (e.addr - slot_at))
        return bad("read batch data outside our slot");
      if (device < 0) std::memcpy(pc.data, ip.own.base() + e.addr, pc.length);
      else if (!l.cuda->copy(device, reinterpret_cast<uint64_t>(pc.data), reinterpret_cast<uint64_t>(ip.own.base() + e.addr), pc.length).is_ok())
        status = uint8_t(Code::kInternal);
    } else {
      return bad("a malformed read batch answer");
    }
  }
  if (status == 0 && v > 0)
    if (int err = ip.cma->pull_many(l.local_iov, l.remote_iov, v, by_attach)) return lane_error(p, err);
  auto& stats = ep->stats();
  if (status == 0 && k > 0) {
    // One launch when the pieces land in GPU memory of the GPU the mappings live on, else one
    // async copy each (into host memory); either way one wait.
    const int dev = l.maps[0] ? l.maps[0]->device : device;
    bool one_kernel = device >= 0 && device == dev && gpu::copy_kernel(dev).is_ok();
    for (uint64_t j = 0; j < nrefs; ++j) one_kernel = one_kernel && l.maps[j] && l.maps[j]->device == dev;
    if (l.cuda->copy_many(dev, l.triples, k, one_kernel).is_ok()) stats.ipc_cuda_chunks.fetch_add(1, std::memory_order_relaxed);
    else status = uint8_t(Code::kInternal);
  }
  for (uint64_t j = 0; j < nrefs; ++j) l.maps[j].reset();
  if (held) {
    // As for one read: the target must still guard what we copied (ring not closed), then let go.
    if (l.ring->closed()) {
      fail_peer(p, Code::kConnectionLost, "the peer let go of the regions while we read them");
      return false;
    }
    Frame done{};
    done.hdr.type = kReadDone;
    done.hdr.slot = h.slot;
    done.hdr.gen = h.gen;
    if (!send_lane(ip, l.index, &done, sizeof done)) {
      fail_peer(p, Code::kConnectionLost, std::strerror(errno));
      return false;
    }
  }
  if (status == 0) {
    stats.bytes_received.fetch_add(h.length, std::memory_order_relaxed);
    stats.chunks_received.fetch_add(1, std::memory_order_relaxed);
  }
  if (p.answer(l.index, h.slot, h.gen, status) != Code::kOk) return bad("an answer to no request");
  return true;
}

// An answer to one of our chunks. False: the lane must end.
bool take_answer(Lane& l, core::EndpointImpl* ep, const Frame& f) {
  Link& p = *l.peer;
  IpcPeer& ip = *l.ip;
  const FrameHeader& h = f.hdr;
  auto& stats = ep->stats();
  uint8_t status = h.status;
  if (h.type == uint8_t(FrameType::kReadResp) && h.status == 0) {
    uint8_t* dest = nullptr;
    int device = -1;
    if (p.read_destination(l.index, h.slot, h.gen, h.length, &dest, &device) != Code::kOk) {
      fail_peer(p, Code::kProtocolError, "read data for no read");
      return false;
    }
    const uint64_t dst = reinterpret_cast<uint64_t>(dest);
    if (f.where == uint8_t(Where::kCuda) || f.where == uint8_t(Where::kCma)) {
      // The target's region, pinned for us: we copy it out, then release it.
      if (f.where == uint8_t(Where::kCma)) {  // its host bytes, by attach (we asked so only for host memory)
        if (device >= 0 || !ip.cma) {
          fail_peer(p, Code::kProtocolError, "a read answered by address that was not asked so");
          return false;
        }
        if (int e = ip.cma->pull(f.addr, dest, h.length)) return lane_error(p, e);
      } else if (auto map = ip.imports->get(f.cuda, device); !map.is_ok()) {
        status = uint8_t(Code::kUnavailable);
      } else {
        const Mapping& mp = *map.value();
        if (f.addr > mp.size || h.length > mp.size - f.addr) {
          fail_peer(p, Code::kProtocolError, "read data outside the allocation it names");
          return false;
        }
        if (!l.cuda->copy(mp.device, dst, mp.ptr + f.addr, h.length).is_ok()) status = uint8_t(Code::kInternal);
        else stats.ipc_cuda_chunks.fetch_add(1, std::memory_order_relaxed);
      }
      Frame done{};
      done.hdr.type = kReadDone;
      done.hdr.slot = h.slot;
      done.hdr.gen = h.gen;
      // A target whose lane ended (it cut us: region_stalled, or it closed) marked its ring closed
      // before letting go of the region: then these bytes may be the application's new ones, and the
      // read fails instead of completing with bytes the target no longer guards.
      if (l.ring->closed()) {
        fail_peer(p, Code::kConnectionLost, "the peer let go of the region while we read it");
        return false;
      }
      if (!send_lane(ip, l.index, &done, sizeof done)) {
        fail_peer(p, Code::kConnectionLost, std::strerror(errno));
        return false;
      }
    } else if (f.where == uint8_t(Where::kNone)) {  // reads of host regions come via our segment
      if (h.length > ip.slot_bytes) {
        fail_peer(p, Code::kProtocolError, "read data longer than a chunk");
        return false;
      }
      const uint8_t* from = ip.own.base() + uint64_t(h.slot) * ip.slot_bytes;
      if (device < 0) {
        std::memcpy(dest, from, h.length);
      } else if (!l.cuda->copy(device, dst, reinterpret_cast<uint64_t>(from), h.length).is_ok()) {
        status = uint8_t(Code::kInternal);
      } else {
        stats.ipc_cuda_chunks.fetch_add(1, std::memory_order_relaxed);
      }
    } else {
      fail_peer(p, Code::kProtocolError, "a malformed read answer");
      return false;
    }
    if (status == 0) {
      stats.bytes_received.fetch_add(h.length, std::memory_order_relaxed);
      stats.chunks_received.fetch_add(1, std::memory_order_relaxed);
    }
  } else if (h.type == uint8_t(FrameType::kAck) && h.status == 0) {
    stats.bytes_sent.fetch_add(h.length, std::memory_order_relaxed);
    stats.chunks_sent.fetch_add(1, std::memory_order_relaxed);
  }
  if (status == 0 && (f.grant & kGranted)) take_grant(ip, f);
  if (p.answer(l.index, h.slot, h.gen, status) != Code::kOk) {
    fail_peer(p, Code::kProtocolError, "an answer to no request");
    return false;
  }
  return true;
}

// A bounce segment: the slots, the one-sided pages (one_sided.h), then a message ring per lane
// (page-aligned, at the end).
uint64_t segment_bytes(uint64_t slots_bytes, uint32_t lanes) {
  return ((slots_bytes + 4095) & ~uint64_t(4095)) + kOneSidedBytes + lanes * kRingBytes;
}

// Our rings and one-sided pages at the end of our segment, theirs at the end of theirs (mapped);
// false when theirs has no room.
bool make_rings(IpcPeer& ip, uint32_t lanes, std::string* why) {
  const uint64_t need = uint64_t(lanes) * kRingBytes + kOneSidedBytes;
  if (ip.theirs.size() < need || (ip.theirs.size() - need) % 4096 != 0 || ip.own.size() < need) {
    *why = "the peer's bounce segment has no room for its message rings";
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

// Listener's lane 0: the connector's stage 3 (its verdict: may we describe our chunks by address?).
// Our lanes serve from the start (attach_listener); we send only from here on.
bool finish_listener_setup(Lane& l, int host_mode) {
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
  if (!take_verdict(ip, m.verdict, host_mode, &why)) {
    fail_peer(p, Code::kUnavailable, why);
    return false;
  }
  ip.sending.store(true, std::memory_order_seq_cst);
  pump_all(ip, p);  // chunks posted while we were setting up
  return true;
}

// The lane's next message, from its ring or its socket: its length, 0 when the other side closed the
// lane, -1 (errno) when the socket failed, kRingBroken when the other side broke the ring's rules.
// Within `busy_us` of the last message it polls without sleeping: a request or an answer usually
// follows soon, and a sleeping thread takes longer to wake than an NVLink copy of a few MiB takes
// (docs/ARCHITECTURE.md, "Waking up"). Doorbells (one byte) only wake it.
//
// Polling lanes do not send queued chunks themselves: tried, it made lone and many-in-flight
// transfers slower — packing a batch holds the peer's mutex, and lanes that met it slept on it
// (docs/PERFORMANCE.md, "Tried and lost").
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

void lane_main(Lane* l, core::EndpointImpl* ep, int host_mode) {
  sys::name_this_thread("ipc", int(l->index));
  Link& p = *l->peer;
  const uint32_t busy_us = ep->config().busy_poll_us;
  auto last = std::chrono::steady_clock::now();
  if (!l->setup_first || finish_listener_setup(*l, host_mode)) {
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
      if (size_t(n) >= sizeof f) std::memcpy(&f, l->rx.get(), sizeof f);
      const auto type = static_cast<FrameType>(f.hdr.type);
      const bool batch = type == FrameType::kWriteBatch;
      const bool read_batch = type == FrameType::kReadBatch;
      const bool read_batch_answer = f.hdr.type == kReadBatchAnswer;
      const bool done = f.hdr.type == kReadDone;
      const bool release = f.hdr.type == kRelease;
      const bool request = type == FrameType::kWrite || type == FrameType::kReadReq || type == FrameType::kSendData;
      const bool answer = type == FrameType::kAck || type == FrameType::kReadResp;
      const bool carried = f.where == uint8_t(Where::kInline) && type != FrameType::kReadReq && request;
      const uint64_t extra = size_t(n) >= sizeof f ? uint64_t(n) - sizeof f : 0;  // inline bytes
      const bool listed = batch || read_batch || read_batch_answer;  // their entries follow the frame
      if (size_t(n) < sizeof f || (!listed && (extra != (carried ? f.hdr.length : 0) || extra > kInlineMax)) || (f.hdr.flags & ~wire::kKnownFlags) != 0 ||
          (!request && !answer && !listed && !done && !release) || !l->ip->ready.load(std::memory_order_acquire)) {
        fail_peer(p, Code::kProtocolError, "the peer sent a malformed frame");
        break;
      }
      l->inline_bytes.set(carried ? l->rx.get() + sizeof f : nullptr, carried ? extra : 0);
      const auto step = answer ? trace::Event::kAnswered : trace::Event::kHeader;
      trace::mark(step, l->index, f.hdr.type, f.hdr.slot, f.hdr.gen);
      if (request) {
        if (!serve(*l, ep, f)) break;
      } else if (batch) {
        if (!serve_batch(*l, ep, l->rx.get(), size_t(n))) break;
      } else if (read_batch) {
        if (!serve_read_batch(*l, ep, l->rx.get(), size_t(n))) break;
      } else if (read_batch_answer) {
        if (!take_read_batch(*l, ep, l->rx.get(), size_t(n))) break;
        pump_lane(*l->ip, p, l->index);  // the answer freed room in this lane's window
      } else if (done) {
        if (!read_done(*l, f.hdr)) break;
      } else if (release) {
        l->ip->imports->forget(f.cuda);  // copies still using the mapping keep it until they finish
      } else {
        if (!take_answer(*l, ep, f)) break;
        pump_lane(*l->ip, p, l->index);  // the answer freed room in this lane's window
      }
    }
  }
  if (l->index < l->ip->out.size()) l->ip->out[l->index]->close();  // before the unpins below (take_answer)
  // No grant of ours holds for this peer any more, and its one-sided copies under way end before we
  // let go of anything (one_sided.h).
  if (IpcPeer& ip = *l->ip; ip.os_own) (void)revoke(*ip.os_own, *ip.os_theirs, 0, ip.pid, ep->config().deregister_timeout_ms);
  {
    std::lock_guard lock(l->held_mu);
    for (auto& h : l->held) h.pin->unpin();  // reads the initiator never finished: it cannot any more
    l->held.clear();
    l->held_reads = 0;
  }
  l->cuda.reset();  // waits for its streams
  p.release_lane(l->index, Code::kConnectionLost);  // after fail(): nothing new can be pulled
  // Let go at once, so a dead peer's sockets and segments go with it (the last hold closes them, even
  // while the application keeps a Peer handle); the thread is joined within a tick.
  // Never the endpoint's last reference: close() joins every lane thread before it lets go.
  std::shared_ptr<Link> peer;
  std::shared_ptr<IpcPeer> ip;
  {
    std::lock_guard lock(l->mu);
    peer.swap(l->peer);
    ip.swap(l->ip);
  }
  peer->let_go();
  ip.reset();
  peer.reset();
  l->finished.store(true, std::memory_order_release);
}

// A lane socket a connector opened to us, accepted by the control thread, with its introduction.
struct Parked {
  int fd;
  Hello hello;
  int seg_fd;
  ucred cred;
  int64_t at_ms;
};

void close_parked(Parked& m) {
  ::close(m.fd);
  if (m.seg_fd >= 0) ::close(m.seg_fd);
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
      const ssize_t n = recv_msg(m.fd, &m.hello, sizeof m.hello, &m.seg_fd, -1, MSG_DONTWAIT);
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

  ~Rendezvous() {
    for (auto& m : fresh) close_parked(m);
    for (auto& [session, v] : parked)
      for (auto& m : v) close_parked(m);
    if (fd >= 0) ::close(fd);
  }
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
  for (auto& [session, ip] : prepared_)
    for (int fd : ip->fds) ::close(fd);
}

Caps IpcTransport::caps() const {
  Caps c;
  c.host_memory = true;
  c.cuda_memory = gpu::cuda() != nullptr;
  c.same_host_only = true;
  c.attach_before_answer = true;  // the connector's lanes are here before it answers: attach needs nothing more
  c.batch_fragments = kMaxBatch;
  c.batch_reads = true;
  c.gpu_chunk_bytes = endpoint_->config().ipc_gpu_chunk_bytes;
  c.lanes_hold = true;  // attach() takes a hold per lane; retiring the lane lets go
  return c;
}

// GPU regions are exported once, here: every chunk from or to them names this handle.
Status IpcTransport::register_region(RegionState& region, std::string*) { return export_region(region); }

// No grant for the region holds any more, and one-sided copies into it end first (one_sided.h); then
// peers that opened the region's allocation close their mapping (else it would hold the memory until
// they disconnect: the driver keeps an allocation alive while another process has it open).
void IpcTransport::deregister_region(RegionState& region) {
  std::vector<std::pair<std::shared_ptr<ipc::IpcPeer>, std::shared_ptr<Link>>> peers;
  {
    std::lock_guard lock(mu_);
    for (auto& l : lanes_) {
      if (l->index != 0) continue;
      std::lock_guard ll(l->mu);
      // Past setup, and held: its lane sockets stay open while we send on them below.
      if (l->ip && l->ip->ready.load(std::memory_order_acquire) && l->peer->hold()) peers.emplace_back(l->ip, l->peer);
    }
  }
  struct LetGo {
    decltype(peers)& all;
    ~LetGo() { for (auto& [ip, peer] : all) peer->let_go(); }
  } let_go{peers};
  for (auto& [ip, peer] : peers) {
    if (!ip->os_own) continue;
    // A copy that may still land is waited for as long as its process lives (one_sided.h); past
    // deregister_timeout_ms the peer is dropped meanwhile, so its transfers end.
    struct Slow {
      Link* peer;
      uint32_t region;
    } slow{peer.get(), region.id};
    (void)revoke(*ip->os_own, *ip->os_theirs, region.id, ip->pid, endpoint_->config().deregister_timeout_ms,
                 [](void* arg) {
                   auto* s = static_cast<Slow*>(arg);
                   s->peer->fail(Status(Code::kConnectionLost,
                                        "peer '" + s->peer->info().name + "' held a one-sided copy into region " +
                                            std::to_string(s->region) + " while it was deregistered (stopped?)"));
                 },
                 &slow);
  }
  ipc::Frame f{};
  if (!ipc::region_ref(region, &f.cuda)) return;
  f.hdr.type = ipc::kRelease;
  // Never blocks: a peer that stopped reading keeps its mapping until it is dropped (peer timeout).
  for (auto& [ip, peer] : peers) (void)::send(ip->fds[0], &f, sizeof f, MSG_NOSIGNAL | MSG_DONTWAIT);
}

namespace {
// The process is stopped (SIGSTOP, a debugger): it cannot answer until someone continues it. False
// where we cannot tell (another pid namespace).
bool process_stopped(pid_t pid) {
  const char state = sys::process_state(pid);
  return state == 'T' || state == 't';
}
}  // namespace

// deregister() is waiting for `region`: readers over ipc copy it themselves and hold it until their
// kReadDone. One that cannot answer is disconnected, which shuts its lanes: our lane threads unpin
// what it held, and its own copy, should its process run again, ends in a failed send of kReadDone,
// so that read fails rather than completing with bytes the application wrote after deregister().
void IpcTransport::region_stalled(RegionState& region, bool force) {
  std::vector<std::shared_ptr<Link>> cut;
  {
    std::lock_guard lock(mu_);
    for (auto& l : lanes_) {
      std::shared_ptr<Link> peer;
      pid_t pid = 0;
      {
        std::lock_guard ll(l->mu);
        if (!l->peer || !l->ip) continue;
        peer = l->peer;
        pid = l->ip->pid;
      }
      bool holds = false;
      {
        std::lock_guard hl(l->held_mu);
        for (auto& h : l->held) holds = holds || h.pin == &region;
      }
      if (holds && !peer->failed() && std::find(cut.begin(), cut.end(), peer) == cut.end() &&
          (force || process_stopped(pid)))
        cut.push_back(peer);
    }
  }
  for (auto& p : cut)
    p->fail(Status(Code::kConnectionLost, "peer '" + p->info().name + "' held region " + std::to_string(region.id) +
                                              " while it was deregistered and did not let go (" +
                                              (force ? "deregister_timeout_ms" : "its process is stopped") + ")"));
}

// The listener's offer: version, session, the challenge for that session, then the name of our lane
// socket. The connector's: version, session, challenge (it has opened its lanes to that socket).
std::string IpcTransport::offer(uint64_t session) {
  if (!rendezvous_) return {};
  const uint64_t challenge = rendezvous_->challenge(session);
  std::string out(2 + 8 + 8, '\0');
  std::memcpy(out.data(), &kIpcVersion, 2);
  std::memcpy(out.data() + 2, &session, 8);
  std::memcpy(out.data() + 10, &challenge, 8);
  return out + rendezvous_->name;
}

namespace {
bool parse_offer(std::string_view o, uint64_t* session, uint64_t* challenge, std::string* name) {
  uint16_t v;
  if (o.size() < 18 || o.size() > 120) return false;
  std::memcpy(&v, o.data(), 2);
  std::memcpy(session, o.data() + 2, 8);
  std::memcpy(challenge, o.data() + 10, 8);
  *name = std::string(o.substr(18));
  return v == kIpcVersion;
}
}  // namespace

uint32_t IpcTransport::lanes_for(std::string_view) const { return std::max<uint32_t>(1, endpoint_->config().channels); }

// Connector, before it answers the listener's handshake: opens every lane to the listener's socket and
// introduces it (stage 1, our segment on lane 0). An abstract unix socket can be reached only from
// this host's network namespace, so lanes arriving there are what proves to the listener that we share
// its host; it never connects anywhere itself.
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
  const Config& c = endpoint_->config();
  const uint32_t lanes = lanes_for(remote_offer);
  auto ip = std::make_shared<IpcPeer>();
  ip->session = session;
  ip->cookie = crypto::random_u64() | 1;
  ip->slot_bytes = c.chunk_bytes;
  const uint64_t slots = uint64_t(std::max<uint32_t>(1, c.window / lanes)) * lanes;  // as Link sizes its slots
  if (int e = ip->own.create(segment_bytes(slots * c.chunk_bytes, lanes))) return Status(Code::kUnavailable, std::string("bounce segment: ") + std::strerror(e));
  std::vector<int> fds;
  auto cleanup = [&] { for (int fd : fds) ::close(fd); };
  sockaddr_un a;
  const socklen_t alen = abstract_addr(name, &a);
  Status s;
  for (uint32_t i = 0; i < lanes && s.is_ok(); ++i) {
    const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) { s = errno_status(Code::kUnavailable, "socket"); break; }
    fds.push_back(fd);
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &kSocketBuffer, sizeof kSocketBuffer);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), alen) != 0) {  // into its backlog: never blocks
      s = errno == EAGAIN ? Status(Code::kUnavailable, "the peer's ipc socket accepts no more lanes (its backlog is full)")
                          : errno_status(Code::kConnectionLost, "connect to the peer's ipc socket");
      break;
    }
    ucred cred{};
    if (!peer_cred(fd, &cred) || cred.uid != ::geteuid()) { s = Status(Code::kAccessDenied, "the peer's ipc socket belongs to another user"); break; }
    if (i == 0) ip->pid = cred.pid;
    else if (cred.pid != ip->pid) { s = Status(Code::kProtocolError, "lanes lead to different processes"); break; }
    Hello m = hello(*ip, 1, i, lanes);
    m.challenge = challenge;
    if (!send_msg(fd, &m, sizeof m, i == 0 ? ip->own.fd() : -1)) { s = errno_status(Code::kConnectionLost, "introducing a lane"); break; }
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // the lane thread blocks in recv()
  }
  if (!s.is_ok()) { cleanup(); return s; }
  ip->fds = fds;
  {
    std::lock_guard lock(mu_);
    if (stopped_) {
      cleanup();
      return Status(Code::kCancelled, "endpoint closed");
    }
    prepared_[session] = ip;
  }
  std::string out(2 + 8 + 8, '\0');
  std::memcpy(out.data(), &kIpcVersion, 2);
  std::memcpy(out.data() + 2, &session, 8);
  std::memcpy(out.data() + 10, &challenge, 8);
  return out;
}

void IpcTransport::abandon(uint64_t session) {
  std::lock_guard lock(mu_);
  auto it = prepared_.find(session);
  if (it == prepared_.end()) return;
  for (int fd : it->second->fds) ::close(fd);
  prepared_.erase(it);
}

// Control thread, every tick: lanes of handshakes that never came, or came and failed, are closed.
void IpcTransport::tick(int64_t now_ms) {
  if (rendezvous_) rendezvous_->drain(now_ms, endpoint_->config().handshake_timeout_ms);
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

namespace {
std::shared_ptr<IpcPeer> new_peer(Link& p, uint64_t session, uint64_t chunk_bytes, Status* s) {
  auto ip = std::make_shared<IpcPeer>();
  ip->session = session;
  ip->cookie = crypto::random_u64() | 1;
  const uint64_t chunk = chunk_bytes;
  ip->slot_bytes = chunk;
  if (int e = ip->own.create(segment_bytes(uint64_t(p.slot_count()) * chunk, p.lanes()))) *s = Status(Code::kUnavailable, std::string("bounce segment: ") + std::strerror(e));
  return ip;
}
}  // namespace

// Control thread, before the handshake is answered: the connector's lanes must be here already (it
// opened them before answering), from one process of our user, each once, with the challenge we gave
// that session. Then we probe the connector, answer on lane 0 (stage 2) and serve; the lane-0 thread
// waits for the connector's verdict (stage 3) before we send. Nothing here blocks.
Status IpcTransport::attach_listener(const std::shared_ptr<Link>& peer, std::string_view remote_offer, int64_t deadline) {
  uint64_t session = 0, challenge = 0;
  std::string name;
  Rendezvous& rv = *rendezvous_;
  if (!parse_offer(remote_offer, &session, &challenge, &name) || !name.empty())
    return Status(Code::kProtocolError, "malformed ipc offer");
  if (challenge != rv.challenge(session)) return Status(Code::kAccessDenied, "the ipc offer does not answer our challenge");
  rv.drain(sys::now_ms(), endpoint_->config().handshake_timeout_ms);
  std::vector<Parked> mine;
  if (auto it = rv.parked.find(session); it != rv.parked.end()) {
    mine = std::move(it->second);
    rv.count -= mine.size();
    rv.parked.erase(it);
  }
  auto cleanup = [&] { for (auto& m : mine) close_parked(m); };
  const uint32_t lanes = peer->lanes();
  if (mine.size() != lanes) {
    cleanup();
    return Status(Code::kAccessDenied, std::to_string(mine.size()) + " of the connector's " + std::to_string(lanes) +
                                           " ipc lanes reached this host: it is not on this host, or not this user");
  }
  std::vector<int> fds(lanes, -1);
  const Parked* zero = nullptr;
  for (auto& m : mine) {
    const Hello& h = m.hello;
    if (h.lanes != lanes || h.lane >= lanes || fds[h.lane] >= 0 || h.challenge != challenge ||
        m.cred.pid != mine[0].cred.pid || (h.lane == 0) != (m.seg_fd >= 0)) {
      cleanup();
      return Status(Code::kProtocolError, "malformed ipc lanes from the peer");
    }
    fds[h.lane] = m.fd;
    if (h.lane == 0) zero = &m;
  }
  Status s;
  auto ip = new_peer(*peer, session, endpoint_->config().chunk_bytes, &s);
  if (!s.is_ok()) { cleanup(); return s; }
  ip->pid = zero->cred.pid;
  ip->fds = fds;
  ip->setup_deadline_ms = deadline;
  const int seg_fd = zero->seg_fd;
  for (auto& m : mine) m.seg_fd = -1;  // the segment takes it
  std::string why;
  if (int e = ip->theirs.map(seg_fd)) why = std::string("cannot map the peer's bounce segment: ") + std::strerror(e);
  else ip->shm = std::make_unique<ShmMover>(ip->theirs);
  if (why.empty()) make_rings(*ip, lanes, &why);
  if (why.empty()) probe_other(*ip, zero->hello, host_mode_, &why);
  if (!why.empty()) { cleanup(); return Status(Code::kUnavailable, why); }
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
  auto cleanup = [&] { for (int fd : ip->fds) ::close(fd); };
  const uint32_t lanes = uint32_t(ip->fds.size());
  if (lanes != peer->lanes() || uint64_t(peer->slot_count()) * ip->slot_bytes > ip->own.size()) {
    cleanup();
    return Status(Code::kInternal, "ipc lanes opened for another shape of peer");
  }
  Hello m2{};
  int seg_fd = -1;
  const ssize_t got = recv_msg(ip->fds[0], &m2, sizeof m2, &seg_fd, deadline);
  if (got != ssize_t(sizeof m2) || !valid_hello(m2, 2, session) || seg_fd < 0) {
    const bool late = got < 0 && errno == ETIMEDOUT;  // alive but silent (stopped, overloaded)
    if (seg_fd >= 0) ::close(seg_fd);
    cleanup();
    return late ? Status(Code::kTimeout, "ipc setup: the peer did not finish it in time")
                : Status(Code::kConnectionLost, "ipc setup: the peer refused our lanes (see its error)");
  }
  std::string why;
  if (int e = ip->theirs.map(seg_fd)) why = std::string("cannot map the peer's bounce segment: ") + std::strerror(e);
  else ip->shm = std::make_unique<ShmMover>(ip->theirs);
  if (why.empty()) make_rings(*ip, lanes, &why);
  if (why.empty()) probe_other(*ip, m2, host_mode_, &why);
  if (why.empty()) take_verdict(*ip, m2.verdict, host_mode_, &why);
  if (!why.empty()) { cleanup(); return Status(Code::kUnavailable, why); }
  Hello m3 = hello(*ip, 3, 0, lanes);
  m3.verdict = ip->cma != nullptr;
  ip->ready.store(true, std::memory_order_seq_cst);
  ip->sending.store(true, std::memory_order_seq_cst);
  if (!send_msg(ip->fds[0], &m3, sizeof m3, -1)) { cleanup(); return Status(Code::kConnectionLost, "ipc setup: the peer is gone"); }
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
    l->ring = ip->in[i].get();
    l->rx = std::make_unique<uint8_t[]>(kMaxMsg);
    l->cuda = std::make_unique<CudaLane>();
    l->held.reserve(std::min<uint32_t>(peer->slot_count(), 4096));
    ip->lanes.push_back(l);
    made.push_back(std::move(l));
  }
  ip->imports = std::make_unique<CudaImports>(ip->pid, &endpoint_->stats().ipc_cuda_opens);
  ip->ep = endpoint_;
  ip->one_sided_max = endpoint_->config().ipc_one_sided_bytes;
  if (ip->one_sided_max > 0) ip->os = std::make_unique<OneSidedInitiator>(ip->os_theirs, ip->os_own);
  ip->completer = completer_.get();
  peer->transport_state = ip;
  std::lock_guard lock(mu_);
  if (stopped_) return Status(Code::kCancelled, "endpoint closed");  // the peer closes the fds
  for (auto& l : made) {
    (void)peer->hold();  // the lane thread's; it lets go as it ends
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

void IpcTransport::help(Link*) {
  if (completer_) completer_->help();
}

void IpcTransport::wake(Link* peer, uint64_t, int) {
  auto* ip = static_cast<IpcPeer*>(peer->transport_state.get());
  if (!ip || !ip->sending.load(std::memory_order_seq_cst)) return;  // setup pumps when it finishes
  pump_all(*ip, *peer, /*one_round=*/true);
}

void IpcTransport::detach(Link& peer) { peer.transport_state.reset(); }

void IpcTransport::stop() {
  std::vector<std::shared_ptr<Lane>> all;
  {
    std::lock_guard lock(mu_);
    if (stopped_) return;
    stopped_ = true;
    all.swap(lanes_);
  }
  for (auto& l : all) {
    std::shared_ptr<Link> p;
    {
      std::lock_guard lock(l->mu);
      p = l->peer;
    }
    if (p) p->fail(Status(Code::kCancelled, "endpoint closed"));  // shuts the lanes down: recv() returns
  }
  for (auto& l : all)
    if (l->thread.joinable()) l->thread.join();
  if (completer_) completer_->stop();  // one-sided copies still running finish and are answered
}

}  // namespace tether::transport
