// PeerState, two-sided: sends and recvs meet by tag (RTS, CTS, the unexpected queue), the sender's
// chunks land in the matched recv, and pulled reads (Caps::pull_reads) travel as sends the target pushes.
#include <cstring>

#include "core/endpoint_impl.h"
#include "core/peer.h"

namespace tether::core {

// ---- pulled reads

bool PeerState::pulls(const TransferState& t) const {
  // Contiguous, staged GPU memory on either side, two chunks or more per lane: requested chunk by
  // chunk, the target's lanes sat idle while each chunk was copied into this side's GPU; pushed, they
  // take chunks as their sockets drain (docs/PERFORMANCE.md, "Defaults and why").
  if (!pull_reads_ || t.op != OpKind::kRead || t.segments.size() != 1) return false;
  const Run& r = t.runs[0];
  const bool gpu = device_of(r) >= 0 || remote_gpu(r);
  return gpu && t.bytes.load(std::memory_order_relaxed) >= uint64_t(2) * lanes_ * info_.chunk_bytes;
}

void PeerState::pull(TransferState* t) {
  const Segment& g = t->segments[0];
  const int device = device_of(t->run_of(g));
  {
    std::lock_guard lock(mu_);
    if (failed_.load()) {
      t->record_error(error_);
    } else {
      const uint32_t token = new_token();
      t->msg_id = token;
      t->expect_chunks(g.length, info_.chunk_bytes);  // the sender cuts by the chunk size both sides agreed on
      matched_[token] = t;
      pulls_out_.emplace_back(token, false);  // its kPull frame, for the next lane that looks (next_chunk)
      publish_resends();
      t = nullptr;
    }
  }
  if (t) {
    t->release();
    return;
  }
  // One frame: the posting thread sends it itself where a lane is free (TcpTransport::wake).
  endpoint_->wake_lanes(this, 1, device);
}

bool PeerState::on_pull(const wire::FrameHeader& h) {
  const uint32_t token = h.pull_token;
  if (token == 0 || h.gen != 0 || h.status != 0 || !pull_reads_) return false;
  const bool resent = h.flags & wire::kFlagResent;
  std::shared_ptr<RegionState> region;
  Code c = endpoint_->registry().resolve(h.region_id, h.key, h.desc_offset, h.desc_length, h.offset, h.length, false,
                                         &region);
  if (c == Code::kOk && h.length == 0) c = Code::kInvalidArgument;
  std::shared_ptr<TransferState> t;  // only for a pull that passed the checks: refusals cost no allocation
  bool again = false;  // a resent kPull for a read this side already pushes: its first copy got here
  if (c == Code::kOk) {
    t = std::make_shared<TransferState>();
    t->op = OpKind::kSend;
    t->pushed = true;
    t->msg_id = token;
    t->bytes = h.length;
    t->runs.push_back(Run{token, 0, 0, 0, region.get(), nullptr});
    t->segments.push_back(Segment{region->base + h.offset, h.length, 0, 0});
    t->source = region;  // kept, not pinned: each chunk pins it (next_chunk)
    std::lock_guard lock(mu_);
    if (failed_.load()) {
      c = Code::kCancelled;
    } else if (resent && pushes_.count(token)) {
      again = true;
    } else if (pushes_.size() >= slots_.size() * 4) {  // a peer's pulls beyond what it could have asked by chunks
      c = Code::kResourceExhausted;
    } else if (!pushes_.emplace(token, t.get()).second) {
      c = Code::kInvalidArgument;  // a token it already pulls with
    }
  }
  if (region) region->unpin();  // resolve's pin: the check is done
  if (again) return true;
  if (c != Code::kOk) {
    endpoint_->stats().rejected_requests.fetch_add(1, std::memory_order_relaxed);
    wire::PullFailBody f{token, static_cast<uint8_t>(c), {}};
    send_answer(wire::ControlType::kPullFail, &f, sizeof f);  // lanes are not throttled by the control backlog
    return true;
  }
  endpoint_->stats().reads_pushed.fetch_add(1, std::memory_order_relaxed);
  start(t);  // no handle: `self` keeps it until it finishes
  enqueue(t.get());
  return true;
}

bool PeerState::pushes_from(const RegionState* region) const {
  std::lock_guard lock(mu_);
  for (const auto& [token, t] : pushes_)
    if (t->source.get() == region) return true;
  return false;
}

void PeerState::push_stopped(TransferState* t) {
  if (t->record_error(Status(Code::kNotFound, "region deregistered while a peer read it"))) {
    wire::PullFailBody f{uint32_t(t->msg_id), static_cast<uint8_t>(Code::kNotFound), {}};
    send_control(wire::ControlType::kPullFail, &f, sizeof f);
  }
  t->release();
}

// ---- a matched recv's chunks (target side of kSendData)

Code PeerState::resolve_send_data(uint32_t token, uint64_t offset, uint64_t length, uint64_t unit, uint16_t flags,
                                  uint8_t** dest, TransferState** recv, int* device) {
  *device = -1;
  std::lock_guard lock(mu_);
  auto it = matched_.find(token);
  if (it == matched_.end()) {
    // A resent chunk of a message this side completed (and so forgot): its first copy was placed.
    if ((flags & wire::kFlagResent) && token != 0 && token < next_token_) {
      *dest = nullptr;
      *recv = nullptr;
      return Code::kOk;
    }
    return Code::kNotFound;
  }
  TransferState* r = it->second;
  const uint64_t total = r->bytes.load(std::memory_order_acquire);
  if (!in_bounds(offset, length, total)) return Code::kOutOfRange;
  // Chunks are whole units of the sender's chunk size (the last one may be short): one bit each.
  if (unit == 0 || offset % unit != 0 || (length != unit && offset + length != total)) return Code::kInvalidArgument;
  if (r->unit != unit) {
    for (uint64_t w : r->placed)
      if (w) return Code::kInvalidArgument;  // the unit changed mid-message
    r->expect_chunks(total, unit);  // sized at match for our own chunk size: rare
  }
  r->pending.fetch_add(1, std::memory_order_relaxed);
  *dest = r->segments[0].local + offset;
  *recv = r;
  *device = device_of(r->runs[0]);
  return Code::kOk;
}

void PeerState::send_data_placed(TransferState* recv, uint64_t offset, uint64_t length) {
  bool fresh;
  {
    std::lock_guard lock(mu_);
    const uint64_t i = offset / recv->unit;
    fresh = !(recv->placed[i / 64] >> (i % 64) & 1);
    recv->placed[i / 64] |= uint64_t(1) << (i % 64);
  }
  if (!fresh) {  // the same chunk again (resent): counted the first time
    recv->release();
    return;
  }
  const uint64_t total = recv->received.fetch_add(length, std::memory_order_acq_rel) + length;
  if (total == recv->bytes.load(std::memory_order_acquire)) {
    size_t erased;
    {
      std::lock_guard lock(mu_);
      erased = matched_.erase(static_cast<uint32_t>(recv->msg_id));
    }
    if (erased) recv->release();  // the hold: the whole message is in place (else fail() took it)
  }
  recv->release();    // this piece
}

void PeerState::abandon_send_data(TransferState* recv) {
  if (failed()) recv->record_error(error());
  recv->release();
}

// ---- matching sends and recvs by tag

bool PeerState::take_unexpected(uint64_t tag, wire::RtsBody* rts) {
  auto it = unexpected_.find(tag);
  if (it == unexpected_.end()) return false;
  Unmatched& u = it->second;
  *rts = u.rts[u.head++];
  --unexpected_count_;
  if (u.head == u.rts.size()) {
    unexpected_.erase(it);
  } else if (u.head * 2 >= u.rts.size()) {  // a tag that never drains must not keep what was taken
    u.rts.erase(u.rts.begin(), u.rts.begin() + ptrdiff_t(u.head));
    u.head = 0;
  }
  return true;
}

wire::CtsBody PeerState::match(TransferState* recv, const wire::RtsBody& rts, TransferState** release_now) {
  wire::CtsBody cts{};
  cts.msg_id = rts.msg_id;
  const uint64_t room = recv->segments[0].length;
  if (rts.length > room) {
    recv->record_error(Status(Code::kTruncated, "recv posted " + std::to_string(room) + " bytes for tag " +
                                                    std::to_string(rts.tag) + " but the message has " +
                                                    std::to_string(rts.length)));
    cts.status = static_cast<uint8_t>(Code::kTruncated);
    *release_now = recv;
    return cts;
  }
  recv->bytes.store(rts.length, std::memory_order_release);
  recv->expect_chunks(rts.length, info_.chunk_bytes);  // the chunk size both sides agreed on at connect
  if (rts.length == 0) {
    *release_now = recv;
    return cts;
  }
  const uint32_t token = new_token();
  recv->msg_id = token;
  matched_[token] = recv;
  cts.token = token;
  return cts;
}

// ---- control messages of the rendezvous (on_control): false for a malformed one

bool PeerState::on_rts(const uint8_t* body, uint32_t length) {
  wire::RtsBody rts;
  if (!body_as(body, length, &rts)) return false;
  wire::CtsBody cts{};
  bool answer = false;  // matched, or refused
  TransferState* release_now = nullptr;
  {
    std::lock_guard lock(mu_);
    auto it = posted_recvs_.find(rts.tag);
    if (it != posted_recvs_.end() && !it->second.empty()) {
      TransferState* r = it->second.front();
      it->second.pop_front();
      if (it->second.empty()) posted_recvs_.erase(it);
      cts = match(r, rts, &release_now);
      answer = true;
    } else if (unexpected_count_ >= kMaxUnexpected) {
      cts.msg_id = rts.msg_id;
      cts.status = uint8_t(Code::kResourceExhausted);
      answer = true;
    } else {
      unexpected_[rts.tag].rts.push_back(rts);
      ++unexpected_count_;
    }
  }
  if (answer) send_answer(wire::ControlType::kCts, &cts, sizeof cts);
  if (release_now) release_now->release();
  return true;
}

bool PeerState::on_cts(const uint8_t* body, uint32_t length) {
  wire::CtsBody cts;
  if (!body_as(body, length, &cts)) return false;
  TransferState* t = take_entry(awaiting_cts_, cts.msg_id);
  if (!t) {  // withdrawn (its region was deregistered): release the receiver's recv
    if (cts.status == 0 && cts.token != 0) send_answer(wire::ControlType::kCancel, &cts.token, sizeof cts.token);
    return true;
  }
  if (cts.status == uint8_t(Code::kResourceExhausted)) {
    t->record_error(Status(Code::kResourceExhausted,
                           "peer '" + info_.name + "' holds " + std::to_string(kMaxUnexpected) +
                               " unmatched messages from this side, its bound: the message (tag " + std::to_string(t->tag) +
                               ") was refused; send it again once recvs there have taken some"));
    t->release();
  } else if (cts.status != 0) {
    t->record_error(Status(static_cast<Code>(cts.status),
                           "peer '" + info_.name + "' posted a recv too small for this " +
                               std::to_string(t->bytes.load()) + "-byte message (tag " + std::to_string(t->tag) + ")"));
    t->release();
  } else if (t->bytes.load() == 0) {
    t->release();
  } else {
    t->runs[0].region_id = cts.token;
    enqueue(t);
  }
  return true;
}

bool PeerState::on_cancel(const uint8_t* body, uint32_t length) {
  uint32_t token;
  if (!body_as(body, length, &token)) return false;
  TransferState* r = take_entry(matched_, token);
  if (r) {
    r->record_error(Status(Code::kCancelled, "peer '" + info_.name + "' withdrew the message (tag " +
                                                 std::to_string(r->tag) + ")"));
    r->release();
  }
  return true;
}

bool PeerState::on_pull_fail(const uint8_t* body, uint32_t length) {
  wire::PullFailBody f;
  if (!body_as(body, length, &f) || f.status == 0) return false;
  TransferState* t = nullptr;
  {
    std::lock_guard lock(mu_);
    if (auto it = matched_.find(f.token); it != matched_.end() && it->second->op == OpKind::kRead) {
      t = it->second;
      matched_.erase(it);
    }
  }
  if (!t) return true;  // cancelled meanwhile
  t->record_error(refusal("read", t->bytes.load(std::memory_order_relaxed), f.status));
  t->release();
  return true;
}

bool PeerState::on_pull_cancel(const uint8_t* body, uint32_t length) {
  uint32_t token;
  if (!body_as(body, length, &token)) return false;
  std::shared_ptr<TransferState> t;
  {
    // Still in pushes_ (transfer_drained takes it out under this lock): `self` is alive; the copy keeps it so.
    std::lock_guard lock(mu_);
    if (auto it = pushes_.find(token); it != pushes_.end()) t = it->second->self;
  }
  if (t) cancel(t.get());
  return true;
}

}  // namespace tether::core
