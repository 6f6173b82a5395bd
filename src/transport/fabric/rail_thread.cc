// A rail's progress thread and the initiator side of its lanes: taking chunks from the peer,
// posting them (one-sided RMA, two-sided messages, or through a staging slot), and completing them.
#include "sys/crypto.h"
#include "sys/net.h"
#include "sys/thread_name.h"
#include "transport/fabric/fabric_internal.h"

namespace tether::transport::fabric {

namespace {

bool connection_error(int err) {
  switch (err) {
    case FI_ENOTCONN: case FI_ECONNRESET: case FI_ECONNREFUSED: case FI_ECONNABORTED: case FI_EHOSTUNREACH:
    case FI_ETIMEDOUT: case FI_ESHUTDOWN: case FI_ENETDOWN: case FI_ENETUNREACH:
    case FI_ECANCELED:  // flushed: the provider's connection went away under it
      return true;
    default:
      return false;
  }
}

using sys::now_ms;

// True when everything the lane has in flight is a message (sends, acks), no RMA.
bool only_messages(const Lane& l) {
  uint32_t n = uint32_t(l.ack_ops.size() - l.free_acks.size());
  for (const OpCtx& c : l.ops)
    if (c.in_use) {
      if (c.kind != OpKind::kSend || c.phase != Phase::kIdle) return false;
      ++n;
    }
  return n == l.inflight;
}

}  // namespace

bool RailThread::start(uint64_t bounce_bytes, std::string* why) {
  bounce_stride_ = (sizeof(SendHeader) + bounce_bytes + 63) & ~uint64_t(63);
  bounce_.resize(bounce_stride_ * kBounceBuffers);
  if (!rail_->register_memory(bounce_.data(), bounce_.size(), -1, tether::crypto::random_u64(), false, &bounce_mr_, why))
    return false;
  bounce_ops_.resize(kBounceBuffers);
  resp_ops_.resize(kBounceBuffers);
  for (uint32_t i = 0; i < kBounceBuffers; ++i) {
    resp_ops_[i].kind = OpKind::kResp;
    resp_ops_[i].index = i;
    OpCtx& c = bounce_ops_[i];
    c.kind = OpKind::kBounce;
    c.index = i;
    ssize_t rc;
    while ((rc = rail_->post_recv(bounce_.data() + i * bounce_stride_, bounce_stride_, bounce_mr_.desc, &c)) == -FI_EAGAIN) {
      fi_cq_msg_entry e[8];
      void* f = nullptr;
      int err = 0;
      rail_->poll(e, 8, &f, &err);
    }
    if (rc) {
      *why = "rail " + rail_->domain() + ": fi_recv: " + rail_->lib().error(int(rc));
      return false;
    }
  }
  thread_ = std::thread([this] { run(); });
  return true;
}

void RailThread::free_bounce() {
  drop_lanes();
  bounce_copier_.wait_all();
  resp_.release();
  rail_->deregister(&bounce_mr_);
}

// A lane's registrations close while its rail lives; its staging copies finish first.
void RailThread::forget(Lane& l) {
  rail_->deregister(&l.headers_mr);
  if (l.copier) l.copier->wait_all();
  if (l.stage) l.stage->release();
}

void RailThread::drop_lanes() {
  std::lock_guard lock(mu_);
  for (auto* set : {&lanes_, &retired_, &incoming_}) {
    for (auto& l : *set) forget(*l);
    set->clear();
  }
  bounce_copier_.wait_all();
  for (Held& h : held_) {
    if (h.pin) h.pin->unpin();
    h = Held{};
  }
  held_count_ = 0;
}

void RailThread::run() {
  sys::name_this_thread("fabric");
  uint64_t seen = ~0ull;
  int idle = 0;
  fi_cq_msg_entry done[64];
  while (!stop_.load(std::memory_order_acquire)) {
    if (const uint64_t v = version_.load(std::memory_order_acquire); v != seen) {
      std::lock_guard lock(mu_);
      seen = v;
      for (auto& l : incoming_) lanes_.push_back(std::move(l));
      incoming_.clear();
    }
    woken_.store(false, std::memory_order_relaxed);
    bool busy = false;
    for (size_t i = 0; i < lanes_.size();) {
      busy |= drive(*lanes_[i]);
      if (lanes_[i]->released) {
        retired_.push_back(std::move(lanes_[i]));
        lanes_[i] = std::move(lanes_.back());
        lanes_.pop_back();
      } else {
        ++i;
      }
    }
    for (size_t i = 0; i < retired_.size();) {
      Lane& l = *retired_[i];
      if (!l.copying.empty()) busy |= drive_copies(l);  // staged copies still finish before their slots go
      if (l.inflight == 0) {
        forget(l);
        retired_[i] = std::move(retired_.back());
        retired_.pop_back();
      } else {
        ++i;
      }
    }
    // Bounce buffers held for a GPU copy (polled: CUDA events cannot wake the CQ) or an answer to send.
    if (held_count_ > 0) {
      for (uint32_t i = 0; i < kBounceBuffers; ++i)
        if (held_[i].state == Held::kCopying || held_[i].state == Held::kRespond) advance(i);
      busy = true;
    }
    // Sleep in the completion queue only when nothing is pending: a provider with manual
    // progress (tcp) moves data, ours and incoming, only while someone reads this queue.
    const bool sleep = !busy && !woken_.load(std::memory_order_acquire) && ++idle > kSpinTurns;
    void* bad = nullptr;
    int err = 0;
    const ssize_t n = rail_->poll(done, 64, &bad, &err, sleep ? kIdleWaitMs : 0);
    if (n > 0) {
      for (ssize_t i = 0; i < n; ++i) complete(done[i]);
      idle = 0;
    } else if (n == -FI_EAVAIL) {
      failed(static_cast<OpCtx*>(bad), err);
      idle = 0;
    }
    if (busy) idle = 0;
  }
}

// Pulls and posts what the lane has room for. True if it did anything (or copies are in flight).
bool RailThread::drive(Lane& l) {
  if (l.released) return false;
  Link& peer = *l.peer;
  if (!l.dead && peer.failed()) {
    l.dead = true;
    l.dead_since = now_ms();
  }
  bool did = !l.copying.empty() && drive_copies(l);
  if (l.dead) {
    // Nothing more is posted: flush reads not yet sent fail now, acks are dropped.
    while (!l.flushes.empty()) {
      OpCtx& c = l.ops[l.flushes.front()];
      l.flushes.pop();
      finish(l, c, Code::kConnectionLost);
    }
    l.ack_queue.clear();
    // Wait for the provider to hand back what is in flight (it fails them once the connection
    // is gone), but not forever: after the grace period the lane lets go regardless. Messages are
    // let go sooner: rxm keeps a rendezvous send to a dead peer forever, and only that peer would
    // ever read its buffer.
    const int64_t waited = now_ms() - l.dead_since;
    if (l.inflight == 0 || waited > owner_->grace_ms() || (waited > kMessageGraceMs && only_messages(l)))
      retire(l, Code::kConnectionLost);
    return did;
  }
  while (!l.flushes.empty()) {
    OpCtx& c = l.ops[l.flushes.front()];
    const ssize_t rc = rail_->flush_read(&l.headers[c.index], l.headers_mr.desc, l.remote, c.raddr + c.length - 1, c.key, &c);
    if (rc == -FI_EAGAIN) break;
    l.flushes.pop();
    did = true;
    if (rc != 0) finish(l, c, Code::kConnectionLost);
  }
  while (!l.ack_queue.empty() && !l.free_acks.empty()) {
    OpCtx& c = l.ack_ops[l.free_acks.back()];
    SendHeader& sh = l.headers[c.index];
    sh = l.ack_queue.front();
    iovec iov{&sh, sizeof sh};
    void* desc = l.headers_mr.desc;
    const ssize_t rc = rail_->send(&iov, &desc, 1, l.remote, &c);
    if (rc == -FI_EAGAIN) break;
    l.free_acks.pop_back();
    l.ack_queue.pop();
    did = true;
    if (rc == 0) ++l.inflight;  // else lost: the sender's chunk fails when its peer does
  }
  if (!l.has_stalled && !peer.has_work()) return did || !l.copying.empty();
  while (!l.free_ops.empty()) {
    if (!l.has_stalled) {
      if (!peer.next_chunk(l.index, &l.stalled)) break;
      l.has_stalled = true;
    }
    OpCtx& c = l.ops[l.free_ops.back()];
    const ssize_t rc = post(l, c, l.stalled);
    if (rc == -FI_EAGAIN) break;  // progress (the CQ read that follows, a staging slot freed), then retry
    l.has_stalled = false;
    did = true;
    if (rc == 0) {
      l.free_ops.pop_back();
      c.in_use = true;
      ++l.inflight;
      continue;
    }
    // Refused locally (no registration for this rail, provider error): this chunk fails alone.
    const wire::FrameHeader& h = l.stalled.hdr;
    const Code code = rc > 0 ? Code(rc) : Code::kInvalidArgument;
    peer.answer(l.index, h.slot, h.gen, uint8_t(code));
  }
  return did || !l.copying.empty();
}

// 0 posted (or its staging copy started), -FI_EAGAIN retry later, <0 provider error, >0 a tether
// Code for a local refusal.
ssize_t RailThread::post(Lane& l, OpCtx& c, const ChunkOp& op) {
  const wire::FrameHeader& h = op.hdr;
  c.slot = h.slot;
  c.gen = h.gen;
  c.stage = -1;
  c.phase = Phase::kIdle;
  const RegionState* region = op.local_region;
  void* desc = region ? owner_->local_desc(region, l.rail) : nullptr;
  const FrameType type = FrameType(h.type);
  const bool read = type == FrameType::kReadReq;
  const uint64_t n = type == FrameType::kSendData ? op.length : h.length;
  // Local memory libfabric cannot reach (device memory without FI_HMEM): through a staging slot.
  // A read from a two-sided target needs none: its bytes arrive in a bounce buffer and are copied
  // from there (bounce_arrived).
  const bool staged = region && n > 0 && !desc && !owner_->local_registered(region) &&
                      !(read && op.remote && ext_two_sided(op.remote->ext_for("fabric")));
  if (!staged) return transmit(l, c, op, op.payload, op.local, desc);
  if (!l.stage) {
    l.stage = std::make_unique<StageMem>();
    l.copier = std::make_unique<Copier>(kStageSlots);
  }
  if (!l.stage->ready())  // first staged chunk of this lane: slots pinned for its GPU
    if (Status s = l.stage->allocate(*rail_, kStageSlots, owner_->bounce_payload(), device_of(region)); !s.is_ok())
      return ssize_t(s.code());
  if (n > l.stage->bytes()) return ssize_t(Code::kInternal);  // chunks never exceed chunk_bytes
  const int s = l.stage->acquire();
  if (s < 0) return -FI_EAGAIN;  // every slot busy: a completion frees one
  c.stage = s;
  c.device = device_of(region);
  c.op = op;
  c.kind = read ? OpKind::kRead : type == FrameType::kSendData ? OpKind::kSend : OpKind::kWrite;
  if (read) {  // lands in the slot; complete() unpacks it to the region, then the chunk is answered
    const ssize_t rc = transmit(l, c, op, nullptr, l.stage->at(uint32_t(s)), l.stage->desc());
    if (rc != 0) {
      l.stage->free_slot(s);
      c.stage = -1;
    }
    return rc;
  }
  // Writes and sends: pack, then post from the slot once the copy is done (drive_copies).
  if (Status st = l.copier->start(uint32_t(s), l.stage->at(uint32_t(s)), op.payload, n, c.device); !st.is_ok()) {
    l.stage->free_slot(s);
    c.stage = -1;
    return ssize_t(st.code());
  }
  c.phase = Phase::kPacking;
  l.copying.push(c.index);
  return 0;
}

// Posts a chunk whose local bytes are `payload` (writes, sends) or `local` (reads), registered as `desc`.
ssize_t RailThread::transmit(Lane& l, OpCtx& c, const ChunkOp& op, const uint8_t* payload, uint8_t* local, void* desc) {
  const wire::FrameHeader& h = op.hdr;
  switch (FrameType(h.type)) {
    case FrameType::kWrite:
    case FrameType::kReadReq: {
      const bool write = FrameType(h.type) == FrameType::kWrite;
      const std::string_view ext = op.remote ? op.remote->ext_for("fabric") : std::string_view();
      uint64_t key = 0, base = 0;
      if (ext_rail(ext, l.rail, &key, &base)) {  // one-sided: the target's NIC checks key and bounds
        c.kind = write ? OpKind::kWrite : OpKind::kRead;
        c.length = h.length;
        c.raddr = base + h.offset;
        c.key = key;
        return write ? rail_->write(payload, h.length, desc, l.remote, base + h.offset, key, &c)
                     : rail_->read(local, h.length, desc, l.remote, base + h.offset, key, &c);
      }
      if (!ext_two_sided(ext)) return ssize_t(Code::kNotFound);  // the descriptor carries no fabric registration for this rail
      // Two-sided: the target's CPU validates and copies; answered by its kAck / kReadData.
      const MsgType type = write ? MsgType::kWrite : MsgType::kReadReq;
      return send_message(l, c, SendHeader{l.session, h.offset, h.length, h.key, h.region_id, h.slot, h.gen, uint16_t(l.index),
                                           h.flags, uint8_t(type), 0, {}, h.desc_offset, h.desc_length},
                          payload, write ? h.length : 0, desc);
    }
    case FrameType::kSendData:
      return send_message(l, c, SendHeader{l.session, h.offset, h.length, h.sender_chunk, h.recv_token, h.slot, h.gen,
                                           uint16_t(l.index), h.flags, uint8_t(MsgType::kData), 0, {}, 0, 0},
                          payload, op.length, desc);
    default:
      return ssize_t(Code::kProtocolError);
  }
}

// Posts message `h` from the lane's header slot of c, followed by `length` payload bytes registered as `desc`.
ssize_t RailThread::send_message(Lane& l, OpCtx& c, const SendHeader& h, const uint8_t* payload, uint64_t length,
                                 void* desc) {
  SendHeader& sh = l.headers[c.index];
  sh = h;
  iovec iov[2] = {{&sh, sizeof sh}, {const_cast<uint8_t*>(payload), length}};
  void* descs[2] = {l.headers_mr.desc, desc};
  c.kind = OpKind::kSend;
  c.length = length;
  return rail_->send(iov, descs, length ? 2 : 1, l.remote, &c);
}

// Staged chunks whose copy has finished, in order: packed ones are posted from their slot,
// unpacked reads are answered. True if any moved.
bool RailThread::drive_copies(Lane& l) {
  bool did = false;
  while (!l.copying.empty()) {
    OpCtx& c = l.ops[l.copying.front()];
    Result<bool> d = l.copier->done(uint32_t(c.stage));
    if (d.is_ok() && !d.value()) break;
    Code code = d.is_ok() ? Code::kOk : Code::kInternal;
    if (code == Code::kOk && c.phase == Phase::kPacking) {
      if (l.dead || l.released) {
        code = Code::kConnectionLost;
      } else {
        const ssize_t rc = transmit(l, c, c.op, l.stage->at(uint32_t(c.stage)), nullptr, l.stage->desc());
        if (rc == -FI_EAGAIN) break;  // posted again after the CQ read that follows
        if (rc == 0) {
          c.phase = Phase::kIdle;   // in flight: its completion frees the slot
          l.copying.pop();
          did = true;
          continue;
        }
        code = rc > 0 ? Code(rc) : Code::kConnectionLost;
      }
    }
    l.copying.pop();
    did = true;
    finish(l, c, code);  // an unpacked read (kOk: answered now), or a chunk that failed
  }
  return did;
}

// The op is done: its slot and context are free again; the chunk is answered unless a message's
// answer is still to come from the peer (sends and two-sided writes/reads that went out).
void RailThread::finish(Lane& l, OpCtx& c, Code code) {
  --l.inflight;
  if (c.stage >= 0) l.stage->free_slot(c.stage);
  c.stage = -1;
  c.phase = Phase::kIdle;
  c.in_use = false;
  l.free_ops.push_back(c.index);
  if (code == Code::kOk) {
    auto& stats = owner_->host()->traffic();
    if (c.kind == OpKind::kRead) stats.bytes_received.fetch_add(c.length, std::memory_order_relaxed);
    else stats.bytes_sent.fetch_add(c.length, std::memory_order_relaxed);
    stats.chunks_sent.fetch_add(1, std::memory_order_relaxed);
  }
  if (!l.released && (code != Code::kOk || c.kind != OpKind::kSend)) l.peer->answer(l.index, c.slot, c.gen, uint8_t(code));
}

void RailThread::complete(const fi_cq_msg_entry& e) {
  auto* c = static_cast<OpCtx*>(e.op_context);
  if (!c) return;
  if (c->kind == OpKind::kBounce) {
    bounce_arrived(*c, e.len);
    return;
  }
  if (c->kind == OpKind::kResp) return response_done(c->index);  // a read's answer left response slot i
  Lane& l = *c->lane;
  if (c->kind == OpKind::kRead && c->stage >= 0 && !l.released) {
    // Landed in a staging slot: unpack to the region; answered once that copy is done.
    c->length = c->op.hdr.length;
    if (l.copier->start(uint32_t(c->stage), c->op.local, l.stage->at(uint32_t(c->stage)), c->length, c->device).is_ok()) {
      c->phase = Phase::kUnpacking;
      l.copying.push(c->index);
      return;
    }
    finish(l, *c, Code::kInternal);
    return;
  }
  if (c->stage >= 0) {  // a write or send from a slot: the provider is done with its bytes
    l.stage->free_slot(c->stage);
    c->stage = -1;
  }
  if (c->kind == OpKind::kWrite && c->length > 0 && !rail_->delivery_complete() && !l.released) {
    // Transmit-complete only: a one-byte read of its last byte, after it, says it is in place.
    c->kind = OpKind::kFlush;
    l.flushes.push(c->index);
    return;
  }
  if (c->kind == OpKind::kAck) return ack_done(l, *c);
  // A send chunk is answered by the receiver's ack (its bytes placed), not by its own completion.
  finish(l, *c, Code::kOk);
}

// An ack left (or failed to): its context is free again.
void RailThread::ack_done(Lane& l, OpCtx& c) {
  --l.inflight;
  l.free_acks.push_back(c.index - uint32_t(l.ops.size()));
}

void RailThread::failed(OpCtx* c, int err) {
  if (!c) return;
  if (c->kind == OpKind::kBounce) {
    if (!stop_.load()) bounce_arrived(*c, 0);  // repost
    return;
  }
  if (c->kind == OpKind::kResp) return response_done(c->index);  // the reader's chunk fails with its peer
  Lane& l = *c->lane;
  if (c->kind == OpKind::kAck) return ack_done(l, *c);  // failed: the sender's chunk fails with its peer
  if (l.released) {
    finish(l, *c, Code::kConnectionLost);  // answers nothing: the lane is gone
    return;
  }
  if (connection_error(err)) {
    finish(l, *c, Code::kConnectionLost);
    // tcp and verbs also drop the connection when the target refuses an access (wrong key,
    // deregistered region), so the cause may be either; say both.
    l.peer->fail(Status(Code::kConnectionLost, "fabric rail " + rail_->domain() + " to peer '" + l.peer->info().name +
                                                   "': " + rail_->lib().error(-err) +
                                                   " (the peer died, or it refused an access: wrong key or deregistered region)"));
  } else {
    // The target refused the access (wrong key, deregistered region, out of its bounds). Some
    // providers (tcp, verbs) drop the connection with it; what follows then fails as above.
    finish(l, *c, Code::kAccessDenied);
  }
}

void RailThread::retire(Lane& l, Code code) {
  if (l.released) return;
  l.released = true;
  l.has_stalled = false;
  l.peer->release_lane(l.index, code);  // answers what is still in flight on it
  if (l.inflight == 0) rail_->remove(l.remote);
}

void RailThread::cancel_all() {
  for (auto& l : lanes_) retire(*l, Code::kCancelled);
  std::lock_guard lock(mu_);
  for (auto& l : incoming_) retire(*l, Code::kCancelled);
}

}  // namespace tether::transport::fabric
