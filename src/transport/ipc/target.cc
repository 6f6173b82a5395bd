// The target side of an ipc lane: every request of the peer (kWrite, kReadReq, kSendData, kWriteBatch,
// kReadBatch) goes through the same steps — validated exactly as tcp validates it and its regions
// pinned; its bytes moved by the Mover for where the initiator said they are (or lent in place: a read
// the initiator copies itself holds its region until kReadDone); counted; answered, with a grant for
// one-sided access where the initiator asked for one (one_sided.h).
#include <cerrno>
#include <cstring>

#include "core/trace.h"
#include "core/transfer.h"
#include "gpu/copy_kernel.h"
#include "transport/ipc/lane.h"

namespace tether::transport::ipc {

namespace trace = core::trace;

namespace {

Mover* mover_for(Lane& l, uint8_t where) {
  IpcPeer& ip = *l.ip;
  return where == uint8_t(Where::kCma)    ? static_cast<Mover*>(ip.cma.get())
       : where == uint8_t(Where::kShm)    ? static_cast<Mover*>(ip.shm.get())
       : where == uint8_t(Where::kInline) ? static_cast<Mover*>(&l.inline_bytes)
                                          : nullptr;
}

Counters& counters(Lane& l) { return *l.ip->counters; }

// A request answered: refused (counted as such) or served (its bytes counted as moved).
void tally(Lane& l, Code c, bool read, uint64_t length) {
  if (c != Code::kOk) l.ip->host->traffic().rejected_requests.fetch_add(1, std::memory_order_relaxed);
  else count_moved(*l.ip->host, !read, length);
}

// What moving one piece came to: `code` answers the chunk; `err` (an errno) ends the lane (EPROTO: the
// request names memory this side cannot reach; else the other process is gone).
struct Moved {
  Code code = Code::kOk;
  int err = 0;
};

// Copies `len` initiator bytes, described by (where, addr, ref), to `dst` (host, or GPU `dev`).
Moved pull_piece(Lane& l, uint8_t where, uint64_t addr, const CudaRef* ref, uint8_t* dst, int dev, uint64_t len) {
  IpcPeer& ip = *l.ip;
  Counters& k = counters(l);
  Moved m;
  if (len == 0) return m;
  if (where == uint8_t(Where::kCuda)) {  // their GPU memory: opened once, copied by this GPU's copy engines
    auto map = ip.imports->get(*ref, dev);
    if (!map.is_ok()) return Moved{Code::kUnavailable, 0};
    const Mapping& mp = *map.value();
    if (addr > mp.size || len > mp.size - addr) return Moved{Code::kOk, EPROTO};
    if (!l.cuda->copy(mp.device, reinterpret_cast<uint64_t>(dst), mp.ptr + addr, len).is_ok()) return Moved{Code::kInternal, 0};
    k.cuda_chunks.fetch_add(1, std::memory_order_relaxed);
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
    if (!m.err) k.cuda_chunks.fetch_add(1, std::memory_order_relaxed);
  }
  if (!m.err)
    (where == uint8_t(Where::kCma)   ? k.cma_chunks
     : where == uint8_t(Where::kShm) ? k.shm_chunks
                                     : k.inline_chunks).fetch_add(1, std::memory_order_relaxed);
  return m;
}

// The answer to request `h`, of frame type `type`, with `c`.
Frame answer_to(const FrameHeader& h, uint8_t type, Code c) {
  Frame a{};
  a.hdr.type = type;
  a.hdr.status = uint8_t(c);
  a.hdr.slot = h.slot;
  a.hdr.gen = h.gen;
  a.hdr.length = h.length;
  return a;
}

// Where a request's bytes lie here, for an answer that lends them (a read the initiator copies) or
// grants their descriptor (one_sided.h: the header then names it).
struct Place {
  uint8_t where = 0;
  uint64_t addr = 0;
  const CudaRef* ref = nullptr;
  uint8_t grant = 0;
};

bool answer_frame(Lane& l, const FrameHeader& h, Code c, const Place& at = {}) {
  Frame a = answer_to(h, uint8_t(h.type == uint8_t(FrameType::kReadReq) ? FrameType::kReadResp : FrameType::kAck), c);
  if (at.grant) {
    a.hdr.region_id = h.region_id;
    a.hdr.key = h.key;
    a.hdr.desc_offset = h.desc_offset;
    a.hdr.desc_length = h.desc_length;
    a.hdr.offset = h.offset;
  }
  a.where = at.where;
  a.grant = at.grant;
  a.addr = at.addr;
  if (at.ref) a.cuda = *at.ref;
  if (!send_or_fail(*l.ip, *l.peer, l.index, &a, sizeof a)) return false;
  trace::mark(trace::Event::kSent, l.index, a.hdr.type, a.hdr.slot, a.hdr.gen);
  return true;
}

// Reads pinned here until their kReadDone are bounded by the peer's chunk slots, which bound its reads
// in flight (twice that: a kReadDone may reach us after the next read of its slot, by ring or socket):
// a peer that never says it is done cannot grow `held`. Past that it is dropped.
//
// A read the initiator copies itself: its `n` pins (a batch: one per run of fragments) stay until its
// kReadDone (or the lane ends). False (all unpinned, the peer dropped): past the bound.
bool hold(Lane& l, const FrameHeader& h, RegionState* const* pins, uint32_t n) {
  const uint32_t bound = 2 * l.peer->slot_count();
  {
    std::lock_guard lock(l.held_mu);  // never contended but by a deregister looking for stalled readers
    if (l.held_reads < bound) {
      for (uint32_t j = 0; j < n; ++j) l.held.push_back(Lane::Held{h.slot, h.gen, pins[j]});
      ++l.held_reads;
      return true;
    }
  }
  for (uint32_t j = 0; j < n; ++j) pins[j]->unpin();
  fail_peer(*l.peer, Code::kResourceExhausted,
            "more reads unfinished (no kReadDone) than twice its " + std::to_string(l.peer->slot_count()) + " chunk slots");
  return false;
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

// A request's bytes here, validated: a kSendData chunk's place in its matched recv, else the range of
// the region it names (pinned).
struct Target {
  Code c = Code::kOk;
  RegionState* pin = nullptr;
  core::TransferState* recv = nullptr;
  uint8_t* local = nullptr;
  int device = -1;
};

Target resolve(Lane& l, const FrameHeader& h, FrameType type) {
  Target t;
  if (type == FrameType::kSendData) {
    t.c = l.peer->resolve_send_data(h.recv_token, h.offset, h.length, h.sender_chunk, h.flags, &t.local, &t.recv, &t.device);
    return t;
  }
  t.c = l.ip->host->registry().resolve(h.region_id, h.key, h.desc_offset, h.desc_length, h.offset, h.length,
                                       type == FrameType::kWrite, &t.pin);
  if (t.c == Code::kOk) {
    t.local = t.pin->base + h.offset;
    t.device = t.pin->kind == MemoryKind::kCuda ? t.pin->device : -1;
  }
  return t;
}

// A read of our GPU bytes (the initiator copies them out of our allocation) or of our host bytes
// where it reads them itself by attach: answered with where they lie, the region pinned (deregister
// waits) until the initiator says it is done (kReadDone), or the lane ends.
bool lend(Lane& l, const Frame& f, const Target& t) {
  const FrameHeader& h = f.hdr;
  const bool gpu = t.device >= 0;
  CudaRef ref;
  Place at{uint8_t(gpu ? Where::kCuda : Where::kCma), reinterpret_cast<uint64_t>(t.local), gpu ? &ref : nullptr};
  if (gpu && !gpu_place(t.pin, t.local, h.length, &ref, &at.addr)) {
    t.pin->unpin();
    tally(l, Code::kUnavailable, true, h.length);
    return answer_frame(l, h, Code::kUnavailable);
  }
  at.grant = grant_for(*l.ip, f, *t.pin);
  if (!hold(l, h, &t.pin, 1)) return false;
  tally(l, Code::kOk, true, h.length);
  (gpu ? counters(l).cuda_chunks : counters(l).cma_chunks).fetch_add(1, std::memory_order_relaxed);
  return answer_frame(l, h, Code::kOk, at);
}

// Moves a request's bytes: a read's host bytes into the initiator's bounce area, a write's (or send's)
// from wherever the initiator said into ours.
Moved move(Lane& l, const Frame& f, FrameType type, const Target& t) {
  const FrameHeader& h = f.hdr;
  if (h.length == 0 || !t.local) return {};
  if (type != FrameType::kReadReq) return pull_piece(l, f.where, f.addr, &f.cuda, t.local, t.device, h.length);
  Moved m;
  Mover* mv = mover_for(l, f.where);
  m.err = f.where != uint8_t(Where::kShm) || !mv ? EPROTO : mv->push(t.local, f.addr, h.length);
  if (!m.err) counters(l).shm_chunks.fetch_add(1, std::memory_order_relaxed);
  return m;
}

// A write's answer may grant the initiator its next writes of this descriptor (one_sided.h).
Place write_grant(Lane& l, const Frame& f, const Target& t, CudaRef* ref) {
  Place at;
  if (t.device < 0) {
    at.where = uint8_t(Where::kCma);
    at.addr = reinterpret_cast<uint64_t>(t.local);
  } else if (gpu_place(t.pin, t.local, f.hdr.length, ref, &at.addr)) {
    at.where = uint8_t(Where::kCuda);
    at.ref = ref;
  }
  if (at.where) at.grant = grant_for(*l.ip, f, *t.pin);
  return at.grant ? at : Place{};
}

// A kWriteBatch's or kReadBatch's fragment, checked as a kWrite (kReadReq) header would be: the first
// of a run naming one descriptor through the registry, which pins its region into l.pins[(*pinned)++];
// the rest of the run by its bounds only (a lookup, a keyed hash and a shared pin per fragment cost
// more than the copy of a small fragment). On kOk the fragment's region is l.pins[*pinned - 1].
Code pin_fragment(Lane& l, const wire::Fragment& fr, bool write, uint32_t* pinned, wire::Fragment* run) {
  if (*pinned > 0 && same_descriptor(fr, *run))
    return fr.offset < fr.desc_offset || !core::in_bounds(fr.offset - fr.desc_offset, fr.length, fr.desc_length)
               ? Code::kOutOfRange
               : Code::kOk;
  const Code c = l.ip->host->registry().resolve(fr.region_id, fr.key, fr.desc_offset, fr.desc_length, fr.offset,
                                                fr.length, write, &l.pins[*pinned]);
  if (c == Code::kOk) {
    ++*pinned;
    *run = fr;
  }
  return c;
}

void unpin(Lane& l, uint32_t pinned) {
  for (uint32_t j = 0; j < pinned; ++j) l.pins[j]->unpin();
}

// A read batch's fragment `fr`, in region `r`: where it lies for the initiator (*a), lent in place
// (*lent: GPU, or host read by attach) or pushed into the initiator's slot after the `*pushed` bytes
// before it. kOk, or a code that answers the batch; *end: the batch's `pinned` pins are let go of and
// the peer failed (the lane must end).
Code place_read(Lane& l, const Frame& f, const wire::Fragment& fr, uint32_t pinned, BatchEntry* a, CudaRef* refs,
                uint32_t* nrefs, uint64_t* pushed, bool* lent, bool* end) {
  RegionState* r = l.pins[pinned - 1];
  uint8_t* at = r->base + fr.offset;
  a->frag = fr;
  if (r->kind == MemoryKind::kCuda) {
    CudaRef ref;
    if (!gpu_place(r, at, fr.length, &ref, &a->addr)) return Code::kUnavailable;
    a->ref = ref_slot(refs, nrefs, ref);
    a->pad = uint32_t(Where::kCuda);
    *lent = true;
    return Code::kOk;
  }
  if (f.where == uint8_t(Where::kCma)) {
    a->addr = reinterpret_cast<uint64_t>(at);
    a->pad = uint32_t(Where::kCma);
    *lent = true;
    return Code::kOk;
  }
  // Into the initiator's slot (hdr.key: its size), one piece after another.
  const bool fits = fr.length <= f.hdr.key && *pushed <= f.hdr.key - fr.length;
  a->addr = f.addr + *pushed;
  const int err = fits ? l.ip->shm->push(at, a->addr, fr.length) : 0;
  if (!fits || err) {
    unpin(l, pinned);
    *end = true;
    if (!fits) protocol_error(*l.peer, "a read batch larger than its slot");
    else lane_error(*l.peer, err);
    return Code::kProtocolError;
  }
  *pushed += fr.length;
  a->pad = uint32_t(Where::kShm);
  return Code::kOk;
}

// A write batch's pieces, all pinned (l.dests): GPU pieces from the initiator's allocations — mapped,
// each piece checked, then one launch when all of it is GPU memory of the GPU the mappings live on
// (else one async copy per piece; either way one wait); host pieces into host memory by attach in one
// process_vm_readv; anything else piece by piece.
Moved pull_batch(Lane& l, const Frame& f, const uint8_t* msg, uint32_t n, uint64_t total) {
  IpcPeer& ip = *l.ip;
  Moved m;
  if (f.where == uint8_t(Where::kCuda)) {
    const uint64_t nrefs = f.addr;
    uint32_t k = 0;
    for (; k < nrefs && m.code == Code::kOk; ++k) {
      auto mp = ip.imports->get(batch_ref(msg, n, k), l.dests[0]->kind == MemoryKind::kCuda ? l.dests[0]->device : -1);
      if (mp.is_ok()) l.maps[k] = mp.take(); else m.code = Code::kUnavailable;
    }
    const int dev = m.code == Code::kOk ? l.maps[0]->device : -1;
    bool one_kernel = m.code == Code::kOk && gpu::copy_kernel(dev).is_ok();
    for (uint32_t i = 0; i < n && m.code == Code::kOk && !m.err; ++i) {
      const BatchEntry e = batch_entry(msg, i);
      if (e.ref >= nrefs) { m.err = EPROTO; break; }
      const Mapping& mp = *l.maps[e.ref];
      if (e.addr > mp.size || e.frag.length > mp.size - e.addr) { m.err = EPROTO; break; }
      const RegionState* r = l.dests[i];
      one_kernel = one_kernel && mp.device == dev && r->kind == MemoryKind::kCuda && r->device == dev;
      l.triples[3 * i + 0] = mp.ptr + e.addr;
      l.triples[3 * i + 1] = reinterpret_cast<uint64_t>(r->base + e.frag.offset);
      l.triples[3 * i + 2] = e.frag.length;
    }
    if (m.code == Code::kOk && !m.err) m.code = copy_triples(l, dev, n, one_kernel);
    for (uint32_t j = 0; j < k; ++j) l.maps[j].reset();
    return m;
  }
  bool host_only = true;
  for (uint32_t i = 0; i < n; ++i) host_only = host_only && l.dests[i]->kind != MemoryKind::kCuda;
  if (f.where == uint8_t(Where::kCma) && ip.cma && host_only) {
    for (uint32_t i = 0; i < n; ++i) {
      const BatchEntry e = batch_entry(msg, i);
      l.local_iov[i] = iovec{l.dests[i]->base + e.frag.offset, e.frag.length};
      l.remote_iov[i] = iovec{reinterpret_cast<void*>(e.addr), e.frag.length};
    }
    m.err = ip.cma->pull_many(l.local_iov, l.remote_iov, n, total);
    if (!m.err) counters(l).cma_chunks.fetch_add(1, std::memory_order_relaxed);
    return m;
  }
  for (uint32_t i = 0; i < n && m.code == Code::kOk && !m.err; ++i) {
    const BatchEntry e = batch_entry(msg, i);
    const RegionState* r = l.dests[i];
    m = pull_piece(l, f.where, e.addr, nullptr, r->base + e.frag.offset, r->kind == MemoryKind::kCuda ? r->device : -1,
                   e.frag.length);
  }
  return m;
}

}  // namespace

bool lane_error(Link& p, int err) {
  fail_peer(p, err == EPROTO ? Code::kProtocolError : Code::kConnectionLost,
            err == EPROTO ? "a request names memory this side cannot reach"
                          : std::string("moving its bytes failed (") + std::strerror(err) + "); is the process gone?");
  return false;
}

// kWrite, kReadReq, kSendData.
bool serve(Lane& l, const Frame& f) {
  const FrameHeader& h = f.hdr;
  const auto type = static_cast<FrameType>(h.type);
  const bool read = type == FrameType::kReadReq;
  Target t = resolve(l, h, type);
  if (t.c == Code::kOk && read && (t.device >= 0 || f.where == uint8_t(Where::kCma))) return lend(l, f, t);
  Moved m;
  if (t.c == Code::kOk) {
    m = move(l, f, type, t);
    if (m.code != Code::kOk) t.c = m.code;
  }
  CudaRef gref;
  const Place grant = type == FrameType::kWrite && t.c == Code::kOk && !m.err && t.pin && (f.grant & kWantGrant)
                          ? write_grant(l, f, t, &gref)
                          : Place{};
  if (t.pin) t.pin->unpin();
  if (t.recv) {
    if (!m.err && t.c == Code::kOk) {
      l.peer->send_data_placed(t.recv, h.offset, h.length);
    } else {
      t.recv->record_error(m.err ? Status(Code::kConnectionLost, "lost the sender's data")
                                 : Status(t.c, "receiving GPU data over ipc failed"));
      t.recv->release();
    }
  }
  if (m.err) return lane_error(*l.peer, m.err);  // never with t.c failed: moving starts only on kOk
  tally(l, t.c, read, h.length);
  return answer_frame(l, h, t.c, grant);
}

// kReadDone: the initiator has copied a read out of our region; let go of it.
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
  return protocol_error(*l.peer, "read done for no read");
}

// A batch of GPU blocks that all lie in one descriptor, when the initiator asked: a grant of that
// descriptor (one_sided.h), so that its next batches there are copied by the initiator itself. Where
// its first fragment lies (the answer's header names that fragment) or, for a read batch, only the
// flag (the initiator knows where each fragment lies from the answer's entries).
Place batch_grant(Lane& l, const Frame& f, const uint8_t* msg, uint32_t pinned, CudaRef* ref) {
  RegionState* r = l.pins[0];
  if (!(f.grant & kWantGrant) || pinned != 1 || r->kind != MemoryKind::kCuda) return {};
  const wire::Fragment fr = batch_entry(msg, 0).frag;
  Place at{uint8_t(Where::kCuda), 0, ref};
  if (!gpu_place(r, r->base + fr.offset, fr.length, ref, &at.addr)) return {};
  at.grant = grant_for(*l.ip, f, *r);
  return at.grant ? at : Place{};
}

// A kWriteBatch: every fragment is checked and pinned before any byte lands; GPU pieces into GPU
// memory of one device go in one copy-kernel launch over peer pointers.
bool serve_batch(Lane& l, const uint8_t* msg, size_t bytes) {
  Frame f;
  std::memcpy(&f, msg, sizeof f);
  const FrameHeader& h = f.hdr;
  const uint32_t n = h.fragments;
  const bool gpu = f.where == uint8_t(Where::kCuda);
  if (!batch_fits(n, gpu ? f.addr : 0, bytes) || (gpu && f.addr == 0)) return protocol_error(*l.peer, "a malformed batch");
  Moved m;
  uint32_t pinned = 0;  // l.pins[0, pinned): one per run of fragments naming the same descriptor
  uint64_t total = 0;
  wire::Fragment run{};
  for (uint32_t i = 0; i < n && m.code == Code::kOk; ++i) {
    const wire::Fragment fr = batch_entry(msg, i).frag;
    if ((m.code = pin_fragment(l, fr, true, &pinned, &run)) != Code::kOk) break;
    l.dests[i] = l.pins[pinned - 1];
    total += fr.length;
  }
  if (m.code == Code::kOk) m = total != h.length ? Moved{Code::kOk, EPROTO} : pull_batch(l, f, msg, n, total);
  CudaRef gref;
  const Place grant = m.code == Code::kOk && !m.err ? batch_grant(l, f, msg, pinned, &gref) : Place{};
  unpin(l, pinned);
  if (m.err) return lane_error(*l.peer, m.err);
  tally(l, m.code, false, h.length);
  if (!grant.grant) return answer_frame(l, h, m.code);
  // The answer names the granted descriptor as a kWrite's would (its first fragment).
  const wire::Fragment fr = batch_entry(msg, 0).frag;
  FrameHeader named = h;
  named.region_id = fr.region_id;
  named.key = fr.key;
  named.desc_offset = fr.desc_offset;
  named.desc_length = fr.desc_length;
  named.offset = fr.offset;
  return answer_frame(l, named, m.code, grant);
}

// A kReadBatch: every fragment is checked and pinned first; the answer says where each lies — in our
// GPU allocation (kCuda) or at our address (kCma: the initiator reads both itself, and the pins stay
// until its kReadDone), or pushed into the initiator's slot (kShm: done here, nothing stays pinned).
bool serve_read_batch(Lane& l, const uint8_t* msg, size_t bytes) {
  Link& p = *l.peer;
  Frame f;
  std::memcpy(&f, msg, sizeof f);
  const FrameHeader& h = f.hdr;
  const uint32_t n = h.fragments;
  if (!batch_fits(n, 0, bytes) || (f.where != uint8_t(Where::kCma) && f.where != uint8_t(Where::kShm)))
    return protocol_error(p, "a malformed read batch");
  uint8_t* out = message_buffer();
  auto* ents = reinterpret_cast<BatchEntry*>(out + sizeof(Frame));
  auto* refs = reinterpret_cast<CudaRef*>(out + sizeof(Frame) + n * sizeof(BatchEntry));
  Code c = Code::kOk;
  uint32_t pinned = 0, nrefs = 0;
  uint64_t total = 0, pushed = 0;
  bool lent = false, end = false;
  wire::Fragment run{};
  for (uint32_t i = 0; i < n && c == Code::kOk; ++i) {
    const wire::Fragment fr = batch_entry(msg, i).frag;
    if ((c = pin_fragment(l, fr, false, &pinned, &run)) != Code::kOk) break;
    BatchEntry a{};
    c = place_read(l, f, fr, pinned, &a, refs, &nrefs, &pushed, &lent, &end);
    if (end) return false;
    ents[i] = a;
    total += fr.length;
  }
  if (c == Code::kOk && total != h.length) {
    unpin(l, pinned);
    return protocol_error(p, "a read batch whose fragments do not add up");
  }
  Frame a = answer_to(h, kReadBatchAnswer, c);
  size_t len = sizeof a;
  if (c == Code::kOk) {
    a.hdr.fragments = n;
    a.addr = nrefs;
    len += n * sizeof(BatchEntry) + nrefs * sizeof(CudaRef);
    CudaRef unused;
    a.grant = batch_grant(l, f, msg, pinned, &unused).grant;
  }
  tally(l, c, true, h.length);
  if (c == Code::kOk && lent) {
    if (!hold(l, h, l.pins, pinned)) return false;  // until its kReadDone (or the lane ends)
  } else {
    unpin(l, pinned);
  }
  std::memcpy(out, &a, sizeof a);
  return send_or_fail(*l.ip, p, l.index, out, len);
}

}  // namespace tether::transport::ipc
