// PeerState, the chunk scheduler every transport's lanes take chunks from: resends, pulls, the
// window, batching, chunk sizes, read depth, slot claims; and the answers that free the slots.
#include <algorithm>

#include "core/endpoint_impl.h"
#include "core/peer.h"

namespace tether::core {
namespace {

constexpr uint64_t kStagedReadChunks = 3;  // a staged read's smaller chunks a lane holds requested at once

// A staged GPU read moves each chunk three times in a row (out of the target's GPU, over the wire,
// into ours): a read of only a few chunks per lane cuts smaller ones so the copies overlap; from two
// full chunks per lane on, read_depth pipelines full ones (docs/PERFORMANCE.md, "Defaults and why").
uint64_t pipelined_chunk(uint64_t chunk, uint64_t total, uint32_t lanes) {
  if (total >= 2 * uint64_t(lanes) * chunk) return chunk;
  constexpr uint64_t kFloor = 256 << 10;
  const uint64_t want = (total / (8 * uint64_t(lanes))) & ~uint64_t((64 << 10) - 1);
  return std::min(chunk, std::max(want, kFloor));
}

// The remote range a frame names: `length` bytes of `g`'s descriptor (its run's), `skip` bytes into the segment.
void name_range(const Run& r, const Segment& g, uint64_t skip, uint64_t length, wire::FrameHeader* h) {
  h->region_id = r.region_id;  // a send's run holds its recv token there (kSendData's recv_token)
  h->key = r.key;
  h->desc_offset = r.desc_offset;
  h->desc_length = r.desc_length;
  h->offset = g.remote_offset + skip;
  h->length = length;
}

// A pulled read's kPull frame (wire::FrameType::kPull): its one segment, the recv token in `pull_token`.
void pull_frame(const TransferState& t, bool resent, ChunkOp* op) {
  const Segment& g = t.segments[0];
  *op = ChunkOp{};
  wire::FrameHeader& h = op->hdr;
  h.type = static_cast<uint8_t>(wire::FrameType::kPull);
  h.flags = resent ? wire::kFlagResent : 0;
  h.pull_token = uint32_t(t.msg_id);
  const Run& r = t.run_of(g);
  name_range(r, g, 0, g.length, &h);
  op->local_region = r.local_region;
  op->remote = r.remote;
}

}  // namespace

uint64_t PeerState::read_chunk_bytes(const TransferState& t, int local_device, const RemoteRegion* remote, uint64_t chunk) const {
  const bool gpu = local_device >= 0 || (remote && remote->kind == MemoryKind::kCuda);
  if (!staged_gpu_ || t.op != OpKind::kRead || !gpu) return chunk;
  return pipelined_chunk(chunk, t.bytes.load(std::memory_order_relaxed), lanes_);
}

// Pieces under `chunk` each, `limit` bytes in all.
uint32_t PeerState::pack_batch(TransferState* t, Slot& s, uint64_t chunk, uint64_t limit) {
  const Segments& segs = t->segments;
  const Segment& first = segs[t->cur_segment];
  const uint64_t rest = first.length - t->cur_offset;
  if (rest >= chunk || t->cur_segment + 1 >= segs.size()) return 0;
  const Run& run = t->run_of(first);
  const int32_t dev = device_of(run);
  size_t end = t->cur_segment + 1;
  uint64_t total = rest;
  // A read batch keeps to one kind of remote memory: the chunk size was chosen for the first one's.
  const bool read = t->op == OpKind::kRead;
  auto alike = [&](const Segment& g) {
    if (g.run == first.run) return true;
    const Run& r = t->run_of(g);
    return device_of(r) == dev && (!read || remote_gpu(r) == remote_gpu(run));
  };
  while (end < segs.size() && end - t->cur_segment < batch_max_ && total + segs[end].length <= limit && alike(segs[end]))
    total += segs[end++].length;
  const uint32_t n = uint32_t(end - t->cur_segment);
  if (n < 2) return 0;
  if (!s.frags) {  // once per slot, on its first batch
    s.frags = std::make_unique<wire::Fragment[]>(batch_max_);
    s.pieces = std::make_unique<Piece[]>(batch_max_);
  }
  for (uint32_t i = 0; i < n; ++i) {
    const Segment& g = segs[t->cur_segment + i];
    const Run& r = t->run_of(g);
    const uint64_t skip = i == 0 ? t->cur_offset : 0;
    s.frags[i] = wire::Fragment{r.region_id, 0, r.key, r.desc_offset, r.desc_length, g.remote_offset + skip, g.length - skip};
    s.pieces[i] = Piece{g.local + skip, g.length - skip, r.local_region};
  }
  t->cur_segment = end;
  t->cur_offset = 0;
  s.length = total;
  return n;
}

bool PeerState::next_chunk(uint32_t lane, ChunkOp* op) {
  // Without the lock: spinning threads ask on every turn; a chunk queued after this check is followed
  // by the poster's wake().
  if (!has_work()) return false;
  TransferState* drained = nullptr;  // its last chunk left: the queue's hold is released
  TransferState* stopped = nullptr;  // a pushed send whose region went: failed, the reader told
  bool taken;
  {
    std::lock_guard lock(mu_);
    taken = take_chunk(lane, op, &drained, &stopped);
  }
  if (stopped) push_stopped(stopped);
  if (drained) drained->release();  // this chunk keeps it pending
  return taken;
}

bool PeerState::take_chunk(uint32_t lane, ChunkOp* op, TransferState** drained, TransferState** stopped) {
  if (lane_dead_[lane]) return false;
  // Pulls first: a kPull takes no slot and gets no answer, so neither a full window nor a transfer
  // queued ahead of it holds it back (a read's start would wait on another transfer's chunks).
  if (take_pull(lane, op)) return true;
  if (lane_inflight_[lane] >= lane_window_) return false;
  if (!resend_.empty()) return take_resend(lane, op, stopped);  // a lost lane's chunks: the oldest transfers
  TransferState* t = queue_head_.load(std::memory_order_relaxed);
  if (!t || free_slots_.empty()) return false;
  RegionState* pinned = pin_source(*t);
  if (t->pushed && !pinned) {  // deregistered mid-read: no further chunk; its hold is ours to release
    pop_queue_head(t);
    *stopped = t;
    return false;
  }
  const Segment& seg = t->segments[t->cur_segment];
  const uint64_t chunk = chunk_bytes_for(*t, seg);
  if (read_depth_reached(*t, seg, lane, chunk)) return false;
  Slot& s = claim_slot(t, lane, seg, pinned, op);
  if (!cut_batch(t, s, seg, chunk, op)) cut_chunk(t, s, seg, chunk, op);
  lane_bytes_[lane].fetch_add(s.length, std::memory_order_relaxed);
  s.op = *op;  // kept for a resend on another lane (frags/pieces live in the slot too)
  if (t->cur_segment == t->segments.size()) {
    pop_queue_head(t);
    *drained = t;
  }
  return true;
}

bool PeerState::take_pull(uint32_t lane, ChunkOp* op) {
  while (!pulls_out_.empty()) {
    const auto [token, resent] = pulls_out_.front();
    pulls_out_.pop_front();
    publish_resends();
    auto it = matched_.find(token);
    if (it == matched_.end()) continue;  // finished, failed or cancelled meanwhile
    TransferState* t = it->second;
    t->pull_lane = lane;
    t->lane_hint.store(lane, std::memory_order_relaxed);
    pull_frame(*t, resent, op);
    return true;
  }
  return false;
}

bool PeerState::take_resend(uint32_t lane, ChunkOp* op, TransferState** stopped) {
  const uint32_t idx = resend_.back();
  resend_.pop_back();
  publish_resends();
  Slot& s = slots_[idx];
  RegionState* pinned = pin_source(*s.transfer);
  if (s.transfer->pushed && !pinned) {  // its region is gone: the chunk cannot be read again, answered here
    *stopped = free_slot(idx);
    return false;
  }
  s.lane = lane;
  ++lane_inflight_[lane];
  lane_bytes_[lane].fetch_add(s.length, std::memory_order_relaxed);
  *op = s.op;
  op->pin = pinned;
  op->hdr.gen = s.gen;
  op->hdr.flags |= wire::kFlagResent;
  s.transfer->lane_hint.store(lane, std::memory_order_relaxed);
  return true;
}

// A pushed send's region, pinned while this chunk is sent (deregister waits for that, never for a
// stalled reader); null: not a pushed send, or its region is no longer published.
RegionState* PeerState::pin_source(const TransferState& t) {
  return t.pushed && endpoint_->registry().pin_published(*t.source) ? t.source.get() : nullptr;
}

void PeerState::pop_queue_head(TransferState* t) {
  queue_head_.store(t->next_queued, std::memory_order_release);
  if (!t->next_queued) queue_tail_ = nullptr;
  t->next_queued = nullptr;
}

uint64_t PeerState::chunk_bytes_for(const TransferState& t, const Segment& seg) const {
  // GPU to GPU (writes, reads): the transport may want bigger chunks (ipc: copy engines over NVLink).
  const Run& r = t.run_of(seg);
  const bool gpu_both = gpu_chunk_ && device_of(r) >= 0 && remote_gpu(r);
  return read_chunk_bytes(t, device_of(r), r.remote, gpu_both ? gpu_chunk_ : info_.chunk_bytes);
}

// Whether the chunk at the cursor (`seg`'s) is a batch of small blocks to or from GPU memory, which may
// carry gpu_batch_chunks_ chunks' bytes.
bool PeerState::gpu_batched(const TransferState& t, const Segment& seg, uint64_t chunk) const {
  if (gpu_batch_chunks_ < 2 || seg.length - t.cur_offset >= chunk) return false;
  const Run& r = t.run_of(seg);
  return device_of(r) >= 0 || remote_gpu(r);
}

// A read request costs its lane nothing to send: unbounded, the first lanes to run took whole windows
// of large chunks (Caps::read_depth; in bytes, so small reads, a round trip each, still fill the window).
bool PeerState::read_depth_reached(const TransferState& t, const Segment& seg, uint32_t lane, uint64_t chunk) const {
  if (!read_depth_ || t.op != OpKind::kRead) return false;
  uint64_t depth = uint64_t(read_depth_) * info_.chunk_bytes;
  // Larger GPU read batches: as many of them in flight as there would be chunks.
  if (gpu_batched(t, seg, chunk)) depth *= gpu_batch_chunks_;
  // Small pipelined chunks: few per lane, so less is left on each lane when the last is handed out.
  if (staged_gpu_ && chunk * 4 <= info_.chunk_bytes) depth = std::min(depth, kStagedReadChunks * chunk);
  return lane_bytes_[lane].load(std::memory_order_relaxed) >= depth;
}

TransferState* PeerState::free_slot(uint32_t idx) {
  Slot& s = slots_[idx];
  TransferState* t = s.transfer;
  s.used = false;
  s.transfer = nullptr;
  ++s.gen;
  free_slots_.push_back(idx);
  return t;
}

uint32_t PeerState::new_token() {
  const uint32_t token = next_token_++;
  return token != 0 ? token : next_token_++;
}

// A free slot for the chunk at `t`'s cursor on `lane`; fills what the transport needs of the local side.
PeerState::Slot& PeerState::claim_slot(TransferState* t, uint32_t lane, const Segment& seg, RegionState* pinned,
                                       ChunkOp* op) {
  const uint32_t idx = free_slots_.back();
  free_slots_.pop_back();
  Slot& s = slots_[idx];
  s.used = true;
  s.transfer = t;
  s.lane = lane;
  const Run& r = t->run_of(seg);
  s.local = seg.local + t->cur_offset;
  s.device = device_of(r);
  ++lane_inflight_[lane];
  t->pending.fetch_add(1, std::memory_order_relaxed);
  t->lane_hint.store(lane, std::memory_order_relaxed);
  op->hdr = {};
  op->hdr.slot = idx;
  op->hdr.gen = s.gen;
  op->local_region = r.local_region;
  op->remote = r.remote;
  op->pin = pinned;
  op->device = s.device;
  op->local = s.local;
  return s;
}

// Many small writes (reads) after the cursor as one kWriteBatch (kReadBatch) chunk: one frame, one
// answer. False where the transport batches nothing or fewer than two segments fit.
bool PeerState::cut_batch(TransferState* t, Slot& s, const Segment& seg, uint64_t chunk, ChunkOp* op) {
  const bool write = t->op == OpKind::kWrite;
  const bool batches = write || (t->op == OpKind::kRead && batch_reads_);
  if (!batches || batch_max_ < 2) return false;
  // A batch staged through GPU memory may carry more: each costs a gather and an unpack kernel
  // (Caps::gpu_batch_chunks). Not on an idle lane: there the gather is the wait before the lane's first
  // byte is on the wire, while behind a batch in flight a larger one's gather hides under its send.
  const bool gpu_batch = gpu_batched(*t, seg, chunk) && lane_bytes_[s.lane].load(std::memory_order_relaxed) > 0;
  const uint32_t n = pack_batch(t, s, chunk, gpu_batch ? chunk * gpu_batch_chunks_ : chunk);
  if (n < 2) return false;
  wire::FrameHeader& h = op->hdr;
  h.type = static_cast<uint8_t>(write ? wire::FrameType::kWriteBatch : wire::FrameType::kReadBatch);
  h.fragments = n;
  h.length = s.length;
  op->payload = nullptr;
  op->length = write ? s.length : 0;
  op->fragments = n;
  op->frags = s.frags.get();
  op->pieces = s.pieces.get();
  return true;
}

// One chunk of `seg` from the cursor: a kWrite, kReadReq or kSendData frame; the cursor moves past it.
void PeerState::cut_chunk(TransferState* t, Slot& s, const Segment& seg, uint64_t chunk, ChunkOp* op) {
  const uint64_t len = std::min<uint64_t>(chunk, seg.length - t->cur_offset);
  s.length = len;
  wire::FrameHeader& h = op->hdr;
  h.type = static_cast<uint8_t>(t->op == OpKind::kWrite  ? wire::FrameType::kWrite
                                : t->op == OpKind::kRead ? wire::FrameType::kReadReq
                                                         : wire::FrameType::kSendData);
  name_range(t->run_of(seg), seg, t->cur_offset, len, &h);
  const bool has_payload = t->op != OpKind::kRead;
  op->payload = has_payload ? s.local : nullptr;
  op->length = has_payload ? len : 0;
  op->fragments = 0;
  if (t->op == OpKind::kSend) h.sender_chunk = chunk;  // the receiver's dedupe unit (one bit per chunk)
  t->cur_offset += len;
  if (t->cur_offset == seg.length) {
    t->cur_offset = 0;
    ++t->cur_segment;
  }
}

Status PeerState::refusal(const char* what, uint64_t bytes, uint8_t status) const {
  const Code c = static_cast<Code>(status);
  std::string msg = std::string(what) + " of " + std::to_string(bytes) + " bytes refused by peer '" + info_.name + "': ";
  switch (c) {
    case Code::kNotFound: msg += "the remote region is not registered (deregistered, or the descriptor names none)"; break;
    case Code::kAccessDenied: msg += "the key does not grant this access (wrong key, or read-only region)"; break;
    case Code::kOutOfRange: msg += "the range lies outside the region"; break;
    case Code::kUnavailable:
      msg += "the " + info_.transport + " transport cannot move this memory (GPU memory it cannot share across processes, "
             "e.g. VMM memory not created with POSIX-fd handle types; transport=tcp moves any memory)";
      break;
    default: msg += code_name(c);
  }
  return Status(c, msg);
}

Code PeerState::answer(uint32_t lane, uint32_t slot, uint32_t gen, uint8_t status) {
  TransferState* t;
  Status err;
  {
    std::lock_guard lock(mu_);
    if (slot >= slots_.size()) return Code::kProtocolError;
    Slot& s = slots_[slot];
    if (!s.used || s.gen != gen || s.lane != lane) return Code::kProtocolError;
    if (status != 0) err = refusal(s.transfer ? op_name(s.transfer->op) : "chunk", s.length, status);
    t = free_slot(slot);
    --lane_inflight_[lane];
    lane_bytes_[lane].fetch_sub(s.length, std::memory_order_relaxed);
  }
  if (!err.is_ok()) t->record_error(err);
  t->release();
  return Code::kOk;
}

Code PeerState::read_batch(uint32_t lane, uint32_t slot, uint32_t gen, uint32_t n, const wire::Fragment** frags,
                           const Piece** pieces, int* device) {
  std::lock_guard lock(mu_);
  if (slot >= slots_.size()) return Code::kProtocolError;
  const Slot& s = slots_[slot];
  if (!s.used || s.gen != gen || s.lane != lane || !s.transfer || s.transfer->op != OpKind::kRead ||
      s.op.fragments != n || n == 0)
    return Code::kProtocolError;
  *frags = s.frags.get();
  *pieces = s.pieces.get();
  *device = s.device;
  return Code::kOk;
}

Code PeerState::read_destination(uint32_t lane, uint32_t slot, uint32_t gen, uint64_t length, uint8_t** dest,
                                 int* device, const Piece** pieces, uint32_t* npieces) {
  std::lock_guard lock(mu_);
  if (slot >= slots_.size()) return Code::kProtocolError;
  Slot& s = slots_[slot];
  if (!s.used || s.gen != gen || s.lane != lane || s.length != length || !s.transfer ||
      s.transfer->op != OpKind::kRead || (s.op.fragments != 0 && !pieces))
    return Code::kProtocolError;
  *dest = s.op.fragments ? nullptr : s.local;
  *device = s.device;
  if (pieces) {
    *pieces = s.op.fragments ? s.pieces.get() : nullptr;
    *npieces = s.op.fragments;
  }
  return Code::kOk;
}

}  // namespace tether::core
