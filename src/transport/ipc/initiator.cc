// The initiator side of an ipc peer: each chunk the core hands a lane (Link::next_chunk) is described
// to the target — where its bytes are, staged in our bounce area when the target cannot reach
// them by address — and sent on the lane, or, for a small chunk of a descriptor the target granted
// us, moved by us and answered here (one_sided.h).
#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/trace.h"
#include "core/transfer.h"
#include "gpu/copy_kernel.h"
#include "transport/ipc/lane.h"

namespace tether::transport::ipc {

namespace trace = core::trace;

namespace {

// What became of a chunk handed to send_chunk.
enum class Sent { kSent, kRefused, kMoved, kLaneGone };  // kRefused: answered here, nothing sent;
                                                         // kMoved: moved by us one-sided, answered here

// A chunk that cannot go: answered at once, nothing moves.
Sent refuse(Link& p, uint32_t lane, const ChunkOp& op, Code c) {
  p.answer(lane, op.hdr.slot, op.hdr.gen, uint8_t(c));
  return Sent::kRefused;
}

Sent send(IpcPeer& ip, Link& p, uint32_t lane, const void* msg, size_t len) {
  return send_or_fail(ip, p, lane, msg, len) ? Sent::kSent : Sent::kLaneGone;
}

// A kWriteBatch: the fragments and where each piece is, in one message; host pieces
// are staged in the slot's part of the bounce area when the target cannot reach us by address.
Sent send_batch(IpcPeer& ip, Link& p, uint32_t lane, const ChunkOp& op, uint8_t grant) {
  const uint32_t n = op.fragments;
  uint8_t* msg = message_buffer();
  auto* ents = reinterpret_cast<BatchEntry*>(msg + sizeof(Frame));
  auto* refs = reinterpret_cast<CudaRef*>(msg + sizeof(Frame) + n * sizeof(BatchEntry));
  Frame f{};
  f.hdr = op.hdr;
  f.grant = grant;
  const bool gpu = op.device >= 0;
  f.where = uint8_t(gpu ? Where::kCuda : ip.out_cma.load(std::memory_order_relaxed) ? Where::kCma : Where::kShm);
  uint32_t nrefs = 0;
  uint64_t staged = uint64_t(op.hdr.slot) * ip.slot_bytes;
  const RegionState* last = nullptr;  // pieces of one region share its allocation's CudaRef: looked up once
  uint32_t k = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const Piece& pc = op.pieces[i];
    BatchEntry e{};
    e.frag = op.frags[i];
    if (gpu) {
      if (pc.region != last || !within(refs[k], pc.data, pc.length, &e.addr)) {
        CudaRef r;
        if (!gpu_place(pc.region, pc.data, pc.length, &r, &e.addr)) return refuse(p, lane, op, Code::kUnavailable);
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
  return send(ip, p, lane, msg, sizeof(Frame) + n * sizeof(BatchEntry) + nrefs * sizeof(CudaRef));
}

// A kReadBatch: the fragments, and whether the target may answer with addresses we read by attach
// (kCma: our pieces are host memory and we may attach to it) or must push its host bytes into our
// slot (kShm, from `addr`; `hdr.key`: the slot's size). GPU bytes are always answered as CudaRefs.
Sent send_read_batch(IpcPeer& ip, Link& p, uint32_t lane, const ChunkOp& op, uint8_t grant) {
  const uint32_t n = op.fragments;
  uint8_t* msg = message_buffer();
  Frame f{};
  f.hdr = op.hdr;
  f.grant = grant;
  f.hdr.key = ip.slot_bytes;
  f.where = uint8_t(op.device < 0 && ip.cma ? Where::kCma : Where::kShm);
  f.addr = uint64_t(op.hdr.slot) * ip.slot_bytes;
  std::memcpy(msg, &f, sizeof f);
  for (uint32_t i = 0; i < n; ++i) {
    BatchEntry e{};
    e.frag = op.frags[i];
    std::memcpy(msg + sizeof f + i * sizeof e, &e, sizeof e);
  }
  return send(ip, p, lane, msg, sizeof f + n * sizeof(BatchEntry));
}

void count_one_sided(IpcPeer& ip, bool read, uint64_t length) {
  ip.counters->one_sided_chunks.fetch_add(1, std::memory_order_relaxed);
  count_moved(*ip.host, read, length);
}

// A one-sided chunk moved (ok) or not: counted and answered here.
void answer_one_sided(IpcPeer& ip, Link& p, uint32_t lane, uint32_t slot, uint32_t gen, bool read, uint64_t length, bool ok) {
  if (ok) count_one_sided(ip, read, length);
  trace::mark(trace::Event::kAnswered, lane, uint8_t(read ? FrameType::kReadReq : FrameType::kWrite), slot, gen);
  p.answer(lane, slot, gen, ok ? 0 : uint8_t(Code::kInternal));
}

// A one-sided GPU copy the completer saw finish (or fail: the chunk fails, as no copy can be undone).
// Its answer frees a window slot that a queued chunk may be waiting for, and no lane thread hears
// of it (no message came): the chunks it lets go are taken here.
void finish_one_sided(GpuCompleter::Pending& q, bool ok) {
  q.os->leave(q.ctx);  // the copy touches the target's memory no more
  auto& p = *static_cast<Link*>(q.peer.get());
  auto& ip = *static_cast<IpcPeer*>(p.transport_state.get());  // kept by the hold one_sided() took
  answer_one_sided(ip, p, q.lane, q.slot, q.gen, q.read, q.length, ok);
  pump_all(ip, p, /*one_round=*/true);
  p.let_go();
}

// A write batch's further chunks, taken on the completer's thread (GpuCompleter::Pending::take_queued)
// while the poster takes others: cutting and launching a batch is per-fragment work on one core.
void take_queued_chunks(void* peer) {
  auto& p = *static_cast<Link*>(peer);
  const Link::Hold hold(&p);
  if (!hold) return;  // ending
  pump_all(*static_cast<IpcPeer*>(p.transport_state.get()), p, /*one_round=*/true);
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

// A one-sided GPU copy started on context `c`'s stream of `device`: handed to the completer, which
// answers the chunk (*handed), else (the completer is full) waited for here. False: it failed.
bool hand_over(IpcPeer& ip, Link& p, uint32_t lane, const ChunkOp& op, OneSidedInitiator::Context* c, int device,
               bool read, bool* handed) {
  GpuCompleter::Pending q;
  q.os = ip.os.get();
  q.ctx = c;
  q.device = device;
  q.done = [](GpuCompleter::Pending& x) { return x.ctx->cuda->done(x.device); };
  q.finish = finish_one_sided;
  // Write batches only: with two reads in flight a second launching thread lost (docs/PERFORMANCE.md,
  // "Same host: ipc, GPU memory").
  if (op.fragments > 0 && !read) q.take_queued = take_queued_chunks;
  q.peer = p.shared_from_this();
  q.lane = lane;
  q.slot = op.hdr.slot;
  q.gen = op.hdr.gen;
  q.length = op.hdr.length;
  q.read = read;
  if (p.hold()) {  // finish_one_sided lets go (the caller holds the peer too: this succeeds)
    if (ip.completer->push(std::move(q))) return *handed = true;
    p.let_go();
  }
  return c->cuda->wait(device).is_ok();
}

// A one-sided chunk of GPU memory at `at` in the granted allocation: copied here (small) or started
// and handed to the completer, which answers it (*handed; it leaves the hazard then). False: it failed.
bool one_sided_gpu(IpcPeer& ip, Link& p, uint32_t lane, const ChunkOp& op, const Grant& g, uint64_t at,
                   OneSidedInitiator::Context* c, bool* handed) {
  const FrameHeader& h = op.hdr;
  const bool read = h.type == uint8_t(FrameType::kReadReq);
  auto map = ip.imports->get(g.ref, op.device);
  if (!map.is_ok() || at > map.value()->size || h.length > map.value()->size - at) return false;
  const Mapping& mp = *map.value();
  if (!c->cuda) c->cuda = std::make_unique<CudaLane>();  // once per context
  const uint64_t local = reinterpret_cast<uint64_t>(read ? op.local : op.payload);
  const uint64_t dst = read ? local : mp.ptr + at, src = read ? mp.ptr + at : local;
  if (h.length <= kOneSidedGpuMax) return c->cuda->copy(mp.device, dst, src, h.length).is_ok();
  // The completer waits for it; the poster goes on (one_sided.h).
  if (!c->cuda->start(mp.device, dst, src, h.length).is_ok()) return false;
  return hand_over(ip, p, lane, op, c, mp.device, read, handed);
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
  if (!ip.os->find(h.region_id, h.key, h.desc_offset, h.desc_length, &g)) return OneSided::kAsk;
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
    bool handed = false;
    ok = one_sided_gpu(ip, p, lane, op, g, at, c, &handed);
    if (handed) return OneSided::kMoved;
  }
  ip.os->leave(c);
  if (!ok) return OneSided::kNo;
  answer_one_sided(ip, p, lane, h.slot, h.gen, read, h.length, true);  // traced with the request's type
  return OneSided::kMoved;
}

// The triples of a GPU batch whose fragments all lie in the granted descriptor `g`, mapped at `mp`
// (our pieces on its GPU), and the longest; false when a fragment falls outside (the target's answer
// says what is wrong).
bool batch_triples(const ChunkOp& op, const Grant& g, const Mapping& mp, bool read, uint64_t* t, uint64_t* longest) {
  *longest = 0;
  for (uint32_t i = 0; i < op.fragments; ++i) {
    const wire::Fragment& fr = op.frags[i];
    const uint64_t at = g.base + fr.offset;
    if (!same_descriptor(fr, op.frags[0]) || fr.offset < fr.desc_offset ||
        !core::in_bounds(fr.offset - fr.desc_offset, fr.length, fr.desc_length) || at < g.base ||
        !core::in_bounds(at, fr.length, mp.size) || !op.pieces[i].region || op.pieces[i].region->device != mp.device)
      return false;
    const uint64_t local = reinterpret_cast<uint64_t>(op.pieces[i].data), there = mp.ptr + at;
    t[3 * i] = read ? there : local;
    t[3 * i + 1] = read ? local : there;
    t[3 * i + 2] = fr.length;
    *longest = std::max<uint64_t>(*longest, fr.length);
  }
  return true;
}

// A batch of GPU blocks in one descriptor the target granted us (one_sided.h), whatever its size: one
// copy-kernel launch over the peer mapping, by us, answered by the completer, instead of a request the
// target validates and copies. Only with the completer (busy polling on): the poster then goes on.
OneSided one_sided_batch(IpcPeer& ip, Link& p, uint32_t lane, const ChunkOp& op) {
  const bool read = op.hdr.type == uint8_t(FrameType::kReadBatch);
  const wire::Fragment& f0 = op.frags[0];
  if (!ip.os || !ip.completer || op.device < 0 || p.failed()) return OneSided::kNo;
  Grant g;
  if (!ip.os->find(f0.region_id, f0.key, f0.desc_offset, f0.desc_length, &g)) return OneSided::kAsk;
  if (!g.gpu || (g.readonly && !read) || !gpu::copy_kernel(op.device).is_ok()) return OneSided::kNo;
  bool gone = false;
  OneSidedInitiator::Context* c = ip.os->enter(f0.region_id, false, &gone);
  if (!c) {
    if (!gone) return OneSided::kNo;
    ip.os->forget(f0.region_id);
    return OneSided::kAsk;
  }
  auto map = ip.imports->get(g.ref, op.device);
  if (!c->cuda) c->cuda = std::make_unique<CudaLane>();
  auto table = c->cuda->table();  // ours: the context's last copy has ended
  uint64_t longest = 0;
  bool ok = map.is_ok() && table.is_ok() && op.fragments <= kMaxBatch &&
            batch_triples(op, g, *map.value(), read, table.value(), &longest);
  if (!ok) {
    ip.os->leave(c);
    return OneSided::kNo;
  }
  const int dev = map.value()->device;
  trace::mark(trace::Event::kResolved, lane, op.hdr.type, op.hdr.slot, op.hdr.gen);
  bool handed = false;
  ok = c->cuda->start_table(dev, op.fragments, longest).is_ok();
  if (ok) trace::mark(trace::Event::kSent, lane, op.hdr.type, op.hdr.slot, op.hdr.gen);  // the copy kernel is launched
  ok = ok && hand_over(ip, p, lane, op, c, dev, read, &handed);
  if (handed) {
    trace::mark(trace::Event::kHanded, lane, op.hdr.type, op.hdr.slot, op.hdr.gen);
    return OneSided::kMoved;
  }
  ip.os->leave(c);
  // Started and failed, or waited for: either way no request may follow (the bytes may have moved).
  answer_one_sided(ip, p, lane, op.hdr.slot, op.hdr.gen, read, op.hdr.length, ok);
  return OneSided::kMoved;
}

// Describes (and for shm, stages) a pulled chunk and sends it.
Sent send_chunk(IpcPeer& ip, Link& p, uint32_t lane, const ChunkOp& op) {
  trace::mark(trace::Event::kTaken, lane, op.hdr.type, op.hdr.slot, op.hdr.gen);
  if (op.fragments > 0) {
    const OneSided os = one_sided_batch(ip, p, lane, op);
    if (os == OneSided::kMoved) return Sent::kMoved;
    const uint8_t grant = os == OneSided::kAsk ? kWantGrant : 0;
    return op.hdr.type == uint8_t(FrameType::kReadBatch) ? send_read_batch(ip, p, lane, op, grant)
                                                         : send_batch(ip, p, lane, op, grant);
  }
  const OneSided os = one_sided(ip, p, lane, op);
  if (os == OneSided::kMoved) return Sent::kMoved;
  Frame f{};
  f.hdr = op.hdr;
  f.grant = os == OneSided::kAsk ? kWantGrant : 0;
  // Reads are copied by us — out of the target's memory by attach where we may attach to it, out of
  // its GPU allocation, or out of our bounce area where it pushed them: no target ever writes into our
  // memory, so a peer we gave up on (its answer never came) cannot scribble over memory we have
  // handed back.
  const bool read = op.hdr.type == uint8_t(FrameType::kReadReq);
  const void* msg = &f;  // what goes: the frame, or (inline) the frame and the bytes
  size_t bytes = sizeof f;
  if (op.device >= 0 && !read) {  // our GPU bytes: the target opens our allocation and copies
    if (!gpu_place(op.local_region, op.payload, op.length, &f.cuda, &f.addr))
      return refuse(p, lane, op, Code::kUnavailable);
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
  const Sent r = send(ip, p, lane, msg, bytes);
  if (r == Sent::kSent) trace::mark(trace::Event::kSent, lane, op.hdr.type, op.hdr.slot, op.hdr.gen);
  return r;
}

}  // namespace

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
void pump_all(IpcPeer& ip, Link& p, bool one_round) {
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

}  // namespace tether::transport::ipc
