// The initiator's side of the target's answers: a write's answer only ends its chunk; a read's
// answer says where the bytes are — in the target's region, lent to us (we copy them out by attach or
// out of its GPU allocation, then kReadDone lets the target go of the region), or pushed into our
// slot — and we copy them to where the read lands. An answer may grant us one-sided access to its
// descriptor (one_sided.h).
#include <cerrno>
#include <cstring>

#include "gpu/copy_kernel.h"
#include "transport/ipc/lane.h"

namespace tether::transport::ipc {

namespace {

// Keeps a grant of the descriptor `named` names (a FrameHeader or a wire::Fragment), its offset 0 at
// `base` in the target (GPU: in the allocation `ref`). What the target says of its own memory can
// only mislead copies into its own memory, so it is kept as said.
template <typename Named>
void remember(IpcPeer& ip, const Named& named, uint8_t grant, bool gpu, uint64_t base, const CudaRef& ref) {
  Grant g;
  g.region = named.region_id;
  g.key = named.key;
  g.desc_offset = named.desc_offset;
  g.desc_length = named.desc_length;
  g.gpu = gpu;
  g.readonly = (grant & kGrantReadOnly) != 0;
  g.base = base;
  if (gpu) g.ref = ref;
  ip.os->remember(g);
}

// A grant in a successful answer (one_sided.h); one we cannot use is ignored.
void take_grant(IpcPeer& ip, const Frame& f) {
  const FrameHeader& h = f.hdr;
  const bool gpu = f.where == uint8_t(Where::kCuda);
  if (!ip.os || h.region_id == 0 || f.addr < h.offset || (!gpu && (f.where != uint8_t(Where::kCma) || !ip.cma))) return;
  remember(ip, h, f.grant, gpu, f.addr - h.offset, f.cuda);
}

// A grant in a read batch's answer: for the descriptor of its fragments (all one), lying where the
// answer's first entry says.
void take_batch_grant(IpcPeer& ip, const Frame& f, const uint8_t* msg, const wire::Fragment& first) {
  const BatchEntry e = batch_entry(msg, 0);
  if (!ip.os || e.pad != uint32_t(Where::kCuda) || e.addr < first.offset || e.ref >= f.addr) return;
  remember(ip, first, f.grant, true, e.addr - first.offset, batch_ref(msg, f.hdr.fragments, e.ref));
}

// Hands the answer to the core, its bytes counted when it succeeded (`received`: a read's).
bool settle(Lane& l, const FrameHeader& h, uint8_t status, bool received) {
  if (status == 0) count_moved(*l.ip->host, received, h.length);
  if (l.peer->answer(l.index, h.slot, h.gen, status) != Code::kOk) return protocol_error(*l.peer, "an answer to no request");
  return true;
}

// We have copied what the target lent us for read (slot, gen): let it go of its regions. A target
// whose lane ended (it cut us: region_stalled, or it closed) marked its ring closed before letting go
// of them: then the bytes we copied may be the application's new ones, and the read fails instead of
// completing with bytes the target no longer guards.
bool done_reading(Lane& l, const FrameHeader& h, const char* let_go) {
  if (l.ring->closed()) {
    fail_peer(*l.peer, Code::kConnectionLost, let_go);
    return false;
  }
  Frame done{};
  done.hdr.type = kReadDone;
  done.hdr.slot = h.slot;
  done.hdr.gen = h.gen;
  return send_or_fail(*l.ip, *l.peer, l.index, &done, sizeof done);
}

// The bytes of a successful kReadResp, copied to where the read lands; *status kOk or the code the
// read fails with. False: the lane must end.
bool take_read(Lane& l, const Frame& f, uint8_t* status) {
  Link& p = *l.peer;
  IpcPeer& ip = *l.ip;
  const FrameHeader& h = f.hdr;
  uint8_t* dest = nullptr;
  int device = -1;
  if (p.read_destination(l.index, h.slot, h.gen, h.length, &dest, &device) != Code::kOk)
    return protocol_error(p, "read data for no read");
  const uint64_t dst = reinterpret_cast<uint64_t>(dest);
  if (f.where == uint8_t(Where::kCma)) {  // its host bytes, by attach (we asked so only for host memory)
    if (device >= 0 || !ip.cma) return protocol_error(p, "a read answered by address that was not asked so");
    if (int e = ip.cma->pull(f.addr, dest, h.length)) return lane_error(p, e);
    return done_reading(l, h, "the peer let go of the region while we read it");
  }
  if (f.where == uint8_t(Where::kCuda)) {  // its GPU allocation
    if (auto map = ip.imports->get(f.cuda, device); !map.is_ok()) {
      *status = uint8_t(Code::kUnavailable);
    } else {
      const Mapping& mp = *map.value();
      if (f.addr > mp.size || h.length > mp.size - f.addr) return protocol_error(p, "read data outside the allocation it names");
      if (!l.cuda->copy(mp.device, dst, mp.ptr + f.addr, h.length).is_ok()) *status = uint8_t(Code::kInternal);
      else ip.counters->cuda_chunks.fetch_add(1, std::memory_order_relaxed);
    }
    return done_reading(l, h, "the peer let go of the region while we read it");
  }
  if (f.where != uint8_t(Where::kNone)) return protocol_error(p, "a malformed read answer");
  // Reads of host regions come via our bounce area.
  if (h.length > ip.slot_bytes) return protocol_error(p, "read data longer than a chunk");
  const uint8_t* from = ip.own.base() + uint64_t(h.slot) * ip.slot_bytes;
  if (device < 0) std::memcpy(dest, from, h.length);
  else if (!l.cuda->copy(device, dst, reinterpret_cast<uint64_t>(from), h.length).is_ok()) *status = uint8_t(Code::kInternal);
  else ip.counters->cuda_chunks.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// Copies every piece of a read batch's answer (checked against what we asked: `frags`, landing in
// `pieces` on `device`): GPU pieces by one copy over the mapped allocations, host pieces by attach
// (one call) or out of our slot. *status kOk or the code the read fails with. False: the lane must end.
bool copy_read_batch(Lane& l, const Frame& f, const uint8_t* msg, const wire::Fragment* frags, const Piece* pieces,
                     int device, uint8_t* status) {
  Link& p = *l.peer;
  IpcPeer& ip = *l.ip;
  const uint32_t n = f.hdr.fragments;
  const uint64_t nrefs = f.addr;
  const uint64_t slot_at = uint64_t(f.hdr.slot) * ip.slot_bytes;
  uint32_t k = 0, v = 0;  // GPU pieces as copy triples; host pieces by attach as iovecs
  uint64_t by_attach = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const BatchEntry e = batch_entry(msg, i);
    const Piece& pc = pieces[i];
    if (e.frag.length != pc.length || e.frag.region_id != frags[i].region_id || e.frag.offset != frags[i].offset)
      return protocol_error(p, "a read batch answer for other fragments");
    if (e.pad == uint32_t(Where::kCuda)) {
      if (e.ref >= nrefs) return protocol_error(p, "a read batch answer naming no allocation");
      if (!l.maps[e.ref]) {
        auto m = ip.imports->get(batch_ref(msg, n, e.ref), device);
        if (!m.is_ok()) {
          *status = uint8_t(Code::kUnavailable);
          break;
        }
        l.maps[e.ref] = m.take();
      }
      const Mapping& mp = *l.maps[e.ref];
      if (e.addr > mp.size || pc.length > mp.size - e.addr) return protocol_error(p, "read data outside the allocation it names");
      l.triples[3 * k + 0] = mp.ptr + e.addr;
      l.triples[3 * k + 1] = reinterpret_cast<uint64_t>(pc.data);
      l.triples[3 * k + 2] = pc.length;
      ++k;
    } else if (e.pad == uint32_t(Where::kCma)) {
      if (device >= 0 || !ip.cma) return protocol_error(p, "a read batch answered by address that was not asked so");
      l.local_iov[v] = iovec{pc.data, pc.length};
      l.remote_iov[v++] = iovec{reinterpret_cast<void*>(e.addr), pc.length};
      by_attach += pc.length;
    } else if (e.pad == uint32_t(Where::kShm)) {
      if (e.addr < slot_at || e.addr - slot_at > ip.slot_bytes || pc.length > ip.slot_bytes - (e.addr - slot_at))
        return protocol_error(p, "read batch data outside our slot");
      if (device < 0) std::memcpy(pc.data, ip.own.base() + e.addr, pc.length);
      else if (!l.cuda->copy(device, reinterpret_cast<uint64_t>(pc.data), reinterpret_cast<uint64_t>(ip.own.base() + e.addr), pc.length).is_ok())
        *status = uint8_t(Code::kInternal);
    } else {
      return protocol_error(p, "a malformed read batch answer");
    }
  }
  if (*status == 0 && v > 0)
    if (int err = ip.cma->pull_many(l.local_iov, l.remote_iov, v, by_attach)) return lane_error(p, err);
  if (*status == 0 && k > 0) {
    // One launch when the pieces land in GPU memory of the GPU the mappings live on, else one
    // async copy each (into host memory); either way one wait.
    const int dev = l.maps[0] ? l.maps[0]->device : device;
    bool one_kernel = device >= 0 && device == dev && gpu::copy_kernel(dev).is_ok();
    for (uint64_t j = 0; j < nrefs; ++j) one_kernel = one_kernel && l.maps[j] && l.maps[j]->device == dev;
    *status = uint8_t(copy_triples(l, dev, k, one_kernel));
  }
  for (uint64_t j = 0; j < nrefs; ++j) l.maps[j].reset();
  return true;
}

}  // namespace

// An answer to one of our chunks (kAck, kReadResp).
bool take_answer(Lane& l, const Frame& f) {
  const FrameHeader& h = f.hdr;
  const bool read = h.type == uint8_t(FrameType::kReadResp);
  uint8_t status = h.status;
  if (read && status == 0 && !take_read(l, f, &status)) return false;
  if (status == 0 && (f.grant & kGranted)) take_grant(*l.ip, f);
  return settle(l, h, status, read);
}

// The answer to one of our kReadBatch chunks: checked against what we asked (the slot's fragments),
// then every piece copied and, where the target lent us its regions, kReadDone.
bool take_read_batch(Lane& l, const uint8_t* msg, size_t bytes) {
  Link& p = *l.peer;
  Frame f;
  std::memcpy(&f, msg, sizeof f);
  const FrameHeader& h = f.hdr;
  uint8_t status = h.status;
  if (status != 0) return bytes == sizeof f ? settle(l, h, status, true) : protocol_error(p, "a malformed read batch answer");
  const uint32_t n = h.fragments;
  const wire::Fragment* frags = nullptr;
  const Piece* pieces = nullptr;
  int device = -1;
  if (!batch_fits(n, f.addr, bytes) || p.read_batch(l.index, h.slot, h.gen, n, &frags, &pieces, &device) != Code::kOk)
    return protocol_error(p, "a read batch answer to no read batch");
  bool lent = false;  // the target holds its regions for us until kReadDone, whatever becomes of our copy
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t w = batch_entry(msg, i).pad;
    lent = lent || w == uint32_t(Where::kCuda) || w == uint32_t(Where::kCma);
  }
  if (!copy_read_batch(l, f, msg, frags, pieces, device, &status)) return false;
  if (status == 0 && (f.grant & kGranted)) take_batch_grant(*l.ip, f, msg, frags[0]);
  if (lent && !done_reading(l, h, "the peer let go of the regions while we read them")) return false;
  return settle(l, h, status, true);
}

}  // namespace tether::transport::ipc
