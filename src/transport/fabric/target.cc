// The target side of a rail: messages landing in its bounce buffers, checked, copied, answered, and
// the buffer posted again.
#include <cstring>

#include "transport/fabric/fabric_internal.h"

namespace tether::transport::fabric {

void RailThread::queue_ack(Lane& l, const SendHeader& h, Code code) {
  if (l.ack_queue.full()) return;  // bounded by the window: cannot happen with an honest peer
  SendHeader& ack = l.ack_queue.push(h);
  ack.type = uint8_t(MsgType::kAck);
  ack.length = 0;
  ack.status = uint8_t(code);
}

// A message landed in bounce buffer c. Acks answer our chunks; send chunks, two-sided writes and
// read answers are copied to their place (validated first: the recv match, the registry, our own
// read); two-sided reads are copied into response slot c.index and sent back. A copy to or from
// GPU memory keeps the buffer (hold) until its CUDA event says done; host copies finish here.
void RailThread::bounce_arrived(OpCtx& c, uint64_t len) {
  const uint32_t i = c.index;
  uint8_t* buf = bounce_.data() + i * bounce_stride_;
  auto& stats = owner_->host()->traffic();
  SendHeader h{};
  if (len >= sizeof(SendHeader)) std::memcpy(&h, buf, sizeof h);
  std::shared_ptr<Link> peer = len >= sizeof(SendHeader) ? owner_->peer_by_session(h.session) : nullptr;
  auto* state = peer ? static_cast<FabricPeer*>(peer->transport_state.get()) : nullptr;
  std::shared_ptr<Lane> lane = state && h.lane < state->lanes.size() ? state->lanes[h.lane].lock() : nullptr;
  uint8_t* payload = buf + sizeof(SendHeader);
  const bool sized = len >= sizeof(SendHeader) && h.length == len - sizeof(SendHeader);  // the payload is all there
  if (!lane || lane->thread != this) {
    stats.rejected_requests.fetch_add(1, std::memory_order_relaxed);
  } else if (h.type == uint8_t(MsgType::kAck)) {
    peer->answer(lane->index, h.slot, h.gen, h.status);
  } else if (h.type == uint8_t(MsgType::kData)) {
    uint8_t* dest = nullptr;
    core::TransferState* recv = nullptr;
    int device = -1;
    const Code code = sized ? peer->resolve_send_data(h.token, h.offset, h.length, h.unit, h.flags, &dest, &recv, &device)
                            : Code::kProtocolError;
    if (code == Code::kOk && dest) return hold(i, peer, lane, h, nullptr, recv, dest, payload, device);
    if (code != Code::kOk) stats.rejected_requests.fetch_add(1, std::memory_order_relaxed);
    queue_ack(*lane, h, code);  // kOk with no destination: a resent chunk already placed
  } else if (h.type == uint8_t(MsgType::kWrite) || h.type == uint8_t(MsgType::kReadReq)) {
    const bool write = h.type == uint8_t(MsgType::kWrite);
    RegionState* pin = nullptr;
    // Checked exactly as every transport's frames: region, key over the descriptor's range, bounds, read-only.
    Code code = !(write ? sized : len == sizeof(SendHeader) && h.length <= owner_->bounce_payload()) || (h.flags & ~wire::kKnownFlags)
                    ? Code::kProtocolError
                    : owner_->host()->registry().resolve(h.token, h.unit, h.desc_offset, h.desc_length, h.offset,
                                                             h.length, write, &pin);
    if (code == Code::kOk && write) return hold(i, peer, lane, h, pin, nullptr, pin->base + h.offset, payload, device_of(pin));
    if (code == Code::kOk && !resp_.ready())  // first two-sided read served on this rail
      code = resp_.allocate(*rail_, kBounceBuffers, sizeof(SendHeader) + owner_->bounce_payload(), device_of(pin)).code();
    if (code == Code::kOk)
      return hold(i, peer, lane, h, pin, nullptr, resp_.at(i) + sizeof(SendHeader), pin->base + h.offset, device_of(pin));
    if (pin) pin->unpin();
    stats.rejected_requests.fetch_add(1, std::memory_order_relaxed);
    queue_ack(*lane, h, code);  // refused: nothing was touched
  } else if (h.type == uint8_t(MsgType::kReadData)) {
    uint8_t* dest = nullptr;
    int device = -1;
    if (sized && peer->read_destination(lane->index, h.slot, h.gen, h.length, &dest, &device) == Code::kOk)
      return hold(i, peer, lane, h, nullptr, nullptr, dest, payload, device);
    stats.rejected_requests.fetch_add(1, std::memory_order_relaxed);  // data for no read of ours: dropped
  } else {
    stats.rejected_requests.fetch_add(1, std::memory_order_relaxed);
  }
  repost(i);
}

// Keeps bounce buffer i while `src` is copied to `dst` for its message, then serves it (advance).
void RailThread::hold(uint32_t i, std::shared_ptr<Link> peer, std::shared_ptr<Lane> lane, const SendHeader& h,
                      RegionState* pin, core::TransferState* recv, void* dst, const void* src, int device) {
  Held& hd = held_[i];
  hd.state = Held::kCopying;
  hd.peer = std::move(peer);
  hd.lane = std::move(lane);
  hd.h = h;
  hd.pin = pin;
  hd.recv = recv;
  hd.code = h.length ? bounce_copier_.start(i, dst, src, h.length, device).code() : Code::kOk;
  ++held_count_;
  advance(i);  // host copies are done already
}

// Moves held bounce buffer i on: once its copy is done, answers (ack, read data) and posts the
// buffer again. True while it is still held.
bool RailThread::advance(uint32_t i) {
  Held& hd = held_[i];
  auto& stats = owner_->host()->traffic();
  if (hd.state == Held::kCopying) {
    if (hd.code == Code::kOk) {
      Result<bool> d = bounce_copier_.done(i);
      if (d.is_ok() && !d.value()) return true;
      if (!d.is_ok()) hd.code = Code::kInternal;
    }
    const SendHeader& h = hd.h;
    Lane& l = *hd.lane;
    if (hd.pin) {  // the region's bytes are no longer touched: deregistration may go ahead
      hd.pin->unpin();
      hd.pin = nullptr;
    }
    if (hd.code == Code::kOk && h.type != uint8_t(MsgType::kReadReq)) {
      stats.bytes_received.fetch_add(h.length, std::memory_order_relaxed);
      stats.chunks_received.fetch_add(1, std::memory_order_relaxed);
    }
    hd.state = Held::kIdle;
    switch (MsgType(h.type)) {
      case MsgType::kData:
        if (hd.code == Code::kOk) hd.peer->send_data_placed(hd.recv, h.offset, h.length);
        else hd.peer->abandon_send_data(hd.recv);
        queue_ack(l, h, hd.code);
        break;
      case MsgType::kWrite:
        queue_ack(l, h, hd.code);
        break;
      case MsgType::kReadReq:
        if (hd.code != Code::kOk) queue_ack(l, h, hd.code);
        else hd.state = Held::kRespond;
        break;
      case MsgType::kReadData:
        hd.peer->answer(l.index, h.slot, h.gen, uint8_t(hd.code));
        break;
      default:
        break;
    }
  }
  if (hd.state == Held::kRespond) {
    Lane& l = *hd.lane;
    if (!l.released && !l.dead && !hd.peer->failed()) {
      uint8_t* slot = resp_.at(i);
      SendHeader rh = hd.h;
      rh.type = uint8_t(MsgType::kReadData);
      rh.status = 0;
      std::memcpy(slot, &rh, sizeof rh);
      iovec iov{slot, sizeof rh + rh.length};
      void* desc = resp_.desc();
      const ssize_t rc = rail_->send(&iov, &desc, 1, l.remote, &resp_ops_[i]);
      if (rc == -FI_EAGAIN) return true;  // again on the next turn, after progress
      if (rc == 0) {
        hd.state = Held::kSending;  // its completion (complete/failed: kResp) lets the buffer go
        return true;
      }
    }
    hd.state = Held::kIdle;  // not sent: the reader's chunk fails with its peer
  }
  if (hd.state == Held::kSending) return true;
  hd.peer.reset();
  hd.lane.reset();
  hd.recv = nullptr;
  --held_count_;
  repost(i);
  return false;
}

// A read's answer left response slot i (or failed to): its bounce buffer may go.
void RailThread::response_done(uint32_t i) {
  held_[i].state = Held::kIdle;
  advance(i);
}

// Posts bounce buffer i again. A full queue: progress and retry (the queue drains as we read it).
void RailThread::repost(uint32_t i) {
  uint8_t* buf = bounce_.data() + i * bounce_stride_;
  while (rail_->post_recv(buf, bounce_stride_, bounce_mr_.desc, &bounce_ops_[i]) == -FI_EAGAIN && !stop_.load()) {
    fi_cq_msg_entry e[1];
    void* f = nullptr;
    int err = 0;
    if (rail_->poll(e, 1, &f, &err) > 0) complete(e[0]);
  }
}

}  // namespace tether::transport::fabric
