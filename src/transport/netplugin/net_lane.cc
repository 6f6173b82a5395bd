#include "transport/netplugin/net_lane.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "core/region.h"

namespace tether::transport {

using wire::FrameHeader;
using wire::FrameType;

namespace {
int tag_of(uint64_t seq, int part) { return int(((seq << 1) | uint64_t(part)) & 0x7fffffff); }
}  // namespace

// ---------------------------------------------------------------- region table

void RegionTable::add(core::RegionState* r) {
  std::unique_lock lock(mu_);
  regions_.push_back(r);
}
void RegionTable::remove(const core::RegionState* r) {
  std::unique_lock lock(mu_);
  regions_.erase(std::remove(regions_.begin(), regions_.end(), r), regions_.end());
}
core::RegionState* RegionTable::find(const uint8_t* p, uint64_t length) const {
  std::shared_lock lock(mu_);
  for (core::RegionState* r : regions_)
    if (p >= r->base && core::in_bounds(uint64_t(p - r->base), length, r->size)) return r;
  return nullptr;
}

// ---------------------------------------------------------------- lane

NetLane::NetLane(std::shared_ptr<NetPlugin> net, Host* host, std::shared_ptr<Link> peer,
                 uint32_t index, Comms comms, const RegionTable* regions, Options opts)
    : net_(std::move(net)), host_(host), peer_(std::move(peer)), index_(index), comms_(comms), regions_(regions),
      opts_(std::move(opts)),
      unpack_device_(comms.recv_dev && comms.recv_dev->type == netabi::kDeviceUnpack && comms.recv_dev->handle),
      consume_early_(opts_.consume_early && unpack_device_) {
  if (unpack_device_) unpack_ = static_cast<netabi::UnpackDeviceHandle*>(comms_.recv_dev->handle);
}

NetLane::~NetLane() {
  if (!retired_) retire();
}

Status NetLane::init() {
  // Unpack devices leave the posted buffer alone: one landing area serves every receive. Others write
  // it: one 4 MiB area per frame in flight (address space only until used).
  landing_bytes_ = unpack_device_ ? kMaxFrame : kMaxFrame * kFramesInFlight;
  landing_.reset(new uint8_t[landing_bytes_]);
  auto u = make_unpacker(opts_.unpack, unpack_device_ ? unpack_->bounce_buf : landing_.get());
  if (!u.is_ok()) return u.status();
  unpacker_ = u.take();
  int rc = net_->reg_mr(comms_.send, tx_hdr_.data(), tx_hdr_.size() * sizeof(FrameHeader), netabi::kPtrHost, &tx_hdr_mr_);
  if (rc == netabi::kSuccess)
    rc = net_->reg_mr(comms_.recv, rx_hdr_.data(), rx_hdr_.size() * sizeof(FrameHeader), netabi::kPtrHost, &rx_hdr_mr_);
  if (rc == netabi::kSuccess) rc = net_->reg_mr(comms_.recv, landing_.get(), landing_bytes_, netabi::kPtrHost, &landing_mr_);
  if (rc != netabi::kSuccess)
    return Status(Code::kUnavailable, "net plugin '" + net_->name() + "' regMr of host buffers: " + net_result_name(rc));
  return Status::ok();
}

void NetLane::kill(Status why) {
  if (dead_.exchange(true, std::memory_order_acq_rel)) return;
  peer_->fail(std::move(why));
}

bool NetLane::fail(Status why) {
  kill(std::move(why));
  return false;
}

bool NetLane::fail_plugin(const char* call, int rc) {
  return fail(Status(Code::kConnectionLost, "net plugin '" + net_->name() + "' " + call + " on a lane to peer '" +
                                                peer_->info().name + "': " + net_result_name(rc)));
}

bool NetLane::protocol_error(const char* what) {
  return fail(Status(Code::kProtocolError, std::string("peer '") + peer_->info().name + "' sent " + what));
}

const netabi::UnpackEntry* NetLane::unpack_frags(uint64_t k, uint64_t length, uint64_t* n) {
  const int slot = int(k % netabi::kUnpackQueueDepth);
  *n = unpack_->meta->cnt[slot];
  const netabi::UnpackEntry* frags = unpack_->meta->mem[slot];
  if (check_fragments(frags, *n, length) == Code::kOk) return frags;
  protocol_error("unpack metadata outside the message (plugin bug)");
  return nullptr;
}

bool NetLane::step() {
  if (dead()) return false;
  if (peer_->failed()) {
    kill(peer_->error());
    return false;
  }
  if (dereg_requested_.load(std::memory_order_acquire) != dereg_done_.load(std::memory_order_relaxed)) process_dereg();
  bool moved = progress_rx();
  if (!dead()) moved |= progress_tx();
  if (!dead()) moved |= post_receives();
  return moved;
}

// ---------------------------------------------------------------- registrations

void* NetLane::mr_for(Registrations& mrs, const void* owner, void* base, uint64_t size, int type, const char* call) {
  for (auto& [o, mh] : mrs)
    if (o == owner) return mh;
  // First payload from this region (or slot) on this comm: register it (the plugin pins / imports it once).
  void* mh = nullptr;
  const int rc = net_->reg_mr(comms_.send, base, size, type, &mh);
  if (rc != netabi::kSuccess) {
    fail_plugin(call, rc);
    return nullptr;
  }
  mrs.emplace_back(owner, mh);
  return mh;
}

core::RegionState* NetLane::region_of(const TxFrame& f) {
  core::RegionState* region = f.pin ? f.pin : regions_->find(f.payload, f.length);
  if (!region) kill(Status(Code::kInternal, "netplugin: a payload outside every registered region"));
  return region;
}

uint64_t NetLane::request_dereg(const core::RegionState* r) {
  std::lock_guard lock(dereg_mu_);
  dereg_queue_.push_back(r);
  return dereg_requested_.fetch_add(1, std::memory_order_acq_rel) + 1;
}

void NetLane::process_dereg() {
  std::vector<const core::RegionState*> todo;
  uint64_t upto;
  {
    std::lock_guard lock(dereg_mu_);
    todo.swap(dereg_queue_);
    upto = dereg_requested_.load(std::memory_order_acquire);
  }
  for (const core::RegionState* r : todo)
    for (size_t i = 0; i < mrs_.size(); ++i)
      if (mrs_[i].first == r) {
        net_->dereg_mr(comms_.send, mrs_[i].second);
        mrs_[i] = mrs_.back();
        mrs_.pop_back();
        break;
      }
  dereg_done_.store(upto, std::memory_order_release);
}

// ---------------------------------------------------------------- receive

bool NetLane::post_receives() {
  bool moved = false;
  // The window is checked before posting: a pair goes out only if both requests fit under the limit.
  while (rx_count_ < kFramesInFlight && rx_requests_ + 2 <= kRequestLimit) {
    const size_t i = (rx_head_ + rx_count_) % kFramesInFlight;
    RxPosted& r = rx_[i];
    r = RxPosted{};
    r.k = rx_posted_;
    uint8_t* land = unpack_device_ ? landing_.get() : landing_.get() + i * kMaxFrame;
    int rc = net_->irecv(comms_.recv, &rx_hdr_[i], sizeof(FrameHeader), tag_of(rx_seq_, 0), rx_hdr_mr_, &r.hreq);
    if (rc != netabi::kSuccess) return fail_plugin("irecv", rc);
    if (!r.hreq) break;  // the plugin asks us to come back later
    ++rx_posted_, ++rx_requests_;
    // The payload receive must follow at once (messages match in posting order); a plugin that
    // accepted the header but defers the payload gets asked again next pass.
    rc = net_->irecv(comms_.recv, land, kMaxFrame, tag_of(rx_seq_, 1), landing_mr_, &r.preq);
    if (rc != netabi::kSuccess) return fail_plugin("irecv", rc);
    if (!r.preq) return fail_plugin("irecv (payload deferred)", netabi::kInternalError);
    ++rx_posted_, ++rx_requests_;
    ++rx_seq_;
    ++rx_count_;
    moved = true;
  }
  return moved;
}

bool NetLane::consume(void* req) {
  // Host-type plugins free a receive when test() reports it done; unpack plugins when it is consumed.
  if (unpack_device_) {
    const int rc = net_->irecv_consumed(comms_.recv, req);
    if (rc != netabi::kSuccess) return fail_plugin("irecvConsumed", rc);
  }
  --rx_requests_;
  return true;
}

// Copies a small received message (a header) out of the bounce pages into host memory.
bool NetLane::read_unpacked(uint64_t k, void* out, uint64_t length) {
  uint64_t n = 0;
  const netabi::UnpackEntry* frags = unpack_frags(k, length, &n);
  if (!frags) return false;
  if (Status s = unpacker_->read(frags, n, static_cast<const uint8_t*>(unpack_->bounce_buf), out); !s.is_ok())
    return fail(s);
  return true;
}

bool NetLane::unpack_wait() {
  for (;;) {
    auto d = unpacker_->done();
    if (!d.is_ok()) return fail(d.status());
    if (d.value()) return true;
    std::this_thread::yield();
  }
}

bool NetLane::push_answer(const TxFrame& f) {
  if (txq_count_ == kTxQueue) return false;
  txq_[(txq_head_ + txq_count_) % kTxQueue] = f;
  ++txq_count_;
  return true;
}

bool NetLane::on_header(RxPosted& r) {
  const FrameHeader& h = r.hdr;
  if (h.flags & ~wire::kKnownFlags) return protocol_error("a malformed frame");
  switch (static_cast<FrameType>(h.type)) {
    case FrameType::kWrite:
    case FrameType::kSendData:
      if (h.length > kMaxFrame) return protocol_error("a frame larger than a plugin receive");
      r.plan = plan_target(*host_, *peer_, h);
      r.dest = r.plan.code == Code::kOk ? r.plan.dest : nullptr;  // null: discard, then answer the error
      r.device = r.plan.device;
      r.expect = h.length;
      return true;
    case FrameType::kReadReq: {
      r.plan = plan_target(*host_, *peer_, h);
      if (r.plan.code == Code::kOk && h.length > kMaxFrame) {
        r.plan.pin->unpin();
        r.plan = TargetPlan{};
        r.plan.code = Code::kInvalidArgument;  // the initiator's chunks exceed what one receive carries
      }
      TxFrame f;
      f.hdr = read_response(h, r.plan);
      if (r.plan.code == Code::kOk) f.payload = r.plan.source, f.length = h.length, f.pin = r.plan.pin;
      r.plan.pin = nullptr;  // the response owns the pin now
      push_answer(f);        // room was checked before the header was taken
      r.expect = 0;
      return true;
    }
    case FrameType::kReadResp:
      if (h.status == 0) {
        if (h.length > kMaxFrame || peer_->read_destination(index_, h.slot, h.gen, h.length, &r.dest, &r.device) != Code::kOk)
          return protocol_error("read data for no read");
        r.expect = h.length;
        return true;
      }
      [[fallthrough]];  // a refused read is answered like an ack
    case FrameType::kAck:
      if (peer_->answer(index_, h.slot, h.gen, h.status) != Code::kOk) return protocol_error("an answer to no request");
      r.expect = 0;
      return true;
    case FrameType::kWriteBatch:  // never sent to us: Caps::batch_fragments is 0
    case FrameType::kReadBatch:   // nor this: Caps::batch_reads is false
    case FrameType::kPull:        // nor this: Caps::pull_reads is false
      break;
  }
  return protocol_error("a frame of unknown type");
}

bool NetLane::finish_rx(RxPosted& r) {
  const FrameHeader& h = r.hdr;
  switch (static_cast<FrameType>(h.type)) {
    case FrameType::kWrite:
    case FrameType::kSendData: {
      TxFrame ack;
      ack.hdr = finish_placed(*host_, *peer_, h, r.plan);
      push_answer(ack);  // room was checked before the header was taken
      return true;
    }
    case FrameType::kReadResp:
      if (h.status == 0) {
        host_->traffic().bytes_received.fetch_add(h.length, std::memory_order_relaxed);
        host_->traffic().chunks_received.fetch_add(1, std::memory_order_relaxed);
        if (peer_->answer(index_, h.slot, h.gen, 0) != Code::kOk) return protocol_error("an answer to no request");
      }
      return true;
    default:
      return true;
  }
}

bool NetLane::finish_deferred() {
  if (!has_deferred_) return true;
  has_deferred_ = false;
  Status s = unpacker_->start(deferred_frags_.data(), deferred_frags_.size(),
                              static_cast<const uint8_t*>(unpack_->bounce_buf), deferred_.dest, deferred_.device);
  if (!s.is_ok()) return fail(s);
  return unpack_wait() && finish_rx(deferred_);
}

// Starts the copy of receive i's payload to its destination. Unpack devices: the plugin's fragments
// over its bounce pages. Others: one fragment, the whole payload in this receive's landing area.
bool NetLane::start_unpack(RxPosted& r, size_t i, uint64_t size) {
  const netabi::UnpackEntry* frags;
  uint64_t n = 1;
  const uint8_t* from;
  netabi::UnpackEntry whole{uint32_t(i * kMaxFrame), uint32_t(size), 0};
  if (unpack_device_) {
    frags = unpack_frags(r.k + 1, size, &n);
    if (!frags) return false;
    from = static_cast<const uint8_t*>(unpack_->bounce_buf);
  } else {
    frags = &whole;
    from = landing_.get();
  }
  if (Status s = unpacker_->start(frags, n, from, r.dest, r.device); !s.is_ok()) return fail(s);
  r.unpacking = true;
  return true;
}

bool NetLane::progress_rx() {
  bool moved = false;
  // (fault injection only) a deferred copy waits at most until the lane has nothing else to do.
  if (has_deferred_ && rx_count_ > 0 && rx_[rx_head_].stage == RxStage::kHeader && ++deferred_idle_ > 64) {
    deferred_idle_ = 0;
    if (!finish_deferred()) return false;
  }
  while (rx_count_ > 0 && !dead()) {
    const size_t i = rx_head_;
    RxPosted& r = rx_[i];
    if (r.stage == RxStage::kHeader) {
      // Each header may produce one answer: take it only if the answer has room.
      if (txq_count_ == kTxQueue) break;
      int done = 0;
      size_t size = 0;
      int rc = net_->test(r.hreq, &done, &size);
      if (rc != netabi::kSuccess) return fail_plugin("test (receive)", rc);
      if (!done) break;
      if (size != sizeof(FrameHeader)) return protocol_error("a frame header of the wrong size");
      if (unpack_device_) {
        if (!read_unpacked(r.k, &r.hdr, sizeof(FrameHeader))) return false;
      } else {
        std::memcpy(&r.hdr, &rx_hdr_[i], sizeof(FrameHeader));
      }
      if (!consume(r.hreq)) return false;  // the header is copied out: its pages may go back
      r.hreq = nullptr;
      if (!on_header(r)) return false;
      r.stage = RxStage::kPayload;
      moved = true;
    }
    if (r.stage == RxStage::kPayload) {
      int done = 0;
      size_t size = 0;
      int rc = net_->test(r.preq, &done, &size);
      if (rc != netabi::kSuccess) return fail_plugin("test (receive)", rc);
      if (!done) break;
      if (size != r.expect) return protocol_error("a payload whose length differs from its header");
      if (consume_early_ && r.dest && size > 0) {
        // The fault, on purpose: the pages go back at test-done and the copy runs later (as a careless
        // asynchronous unpack would), after the plugin has received the next frames.
        if (!finish_deferred()) return false;
        uint64_t n = 0;
        const netabi::UnpackEntry* frags = unpack_frags(r.k + 1, size, &n);
        if (!frags) return false;
        deferred_frags_.assign(frags, frags + n);
        if (!consume(r.preq)) return false;
        r.preq = nullptr;
        deferred_ = r;
        has_deferred_ = true;
        rx_head_ = (rx_head_ + 1) % kFramesInFlight;
        --rx_count_;
        moved = true;
        continue;
      }
      if (r.dest && size > 0 && !start_unpack(r, i, size)) return false;
      r.stage = RxStage::kUnpacking;
      moved = true;
    }
    // The pages go back only after the unpack has completed: the plugin reuses them at once.
    if (r.unpacking) {
      auto d = unpacker_->done();
      if (!d.is_ok()) return fail(d.status());
      if (!d.value()) {
        moved = true;  // a GPU copy finishes in microseconds: keep polling rather than sleep
        break;
      }
    }
    r.unpacking = false;
    if (r.preq && !consume(r.preq)) return false;
    r.preq = nullptr;
    if (!finish_rx(r)) return false;
    rx_head_ = (rx_head_ + 1) % kFramesInFlight;
    --rx_count_;
    moved = true;
  }
  return moved;
}

// ---------------------------------------------------------------- send

bool NetLane::progress_tx() {
  bool moved = false;
  auto& stats = host_->traffic();
  // Completions, oldest first (a request reported done is never tested again).
  while (tx_count_ > 0) {
    TxPosted& p = tx_[tx_head_];
    if (!p.payload_posted) break;
    if (!test_send(p.hreq, &p.hdone) || !test_send(p.preq, &p.pdone)) return false;
    if (!p.hdone || !p.pdone) break;
    if (p.f.length > 0) {
      stats.bytes_sent.fetch_add(p.f.length, std::memory_order_relaxed);
      stats.chunks_sent.fetch_add(1, std::memory_order_relaxed);
    }
    if (p.f.pin) p.f.pin->unpin();
    if (p.slot) tx_stage_->release(p.slot), p.slot = nullptr;  // the plugin has sent from it
    tx_head_ = (tx_head_ + 1) % kFramesInFlight;
    --tx_count_;
    moved = true;
  }
  // A frame whose payload is not posted yet (the plugin deferred it, or its pinned copy is not
  // done) goes first: messages match in posting order.
  if (tx_count_ > 0) {
    const size_t i = (tx_head_ + tx_count_ - 1) % kFramesInFlight;
    if (!tx_[i].payload_posted) {
      const Post r = post_payload(tx_[i], i);
      if (r == Post::kDead) return false;
      if (r == Post::kCopying) return true;  // a GPU copy finishes in microseconds: do not go to sleep
      if (r == Post::kLater) return moved;
    }
  }
  // Post: the window is checked before a frame is taken, so both its requests fit under the limit.
  while (tx_count_ < kFramesInFlight && tx_requests_ + 2 <= kRequestLimit) {
    if (txq_count_ == 0) {
      ChunkOp op;
      if (!peer_->next_chunk(index_, &op)) break;
      TxFrame f;
      f.hdr = op.hdr;
      f.payload = op.payload;
      f.length = op.length;
      txq_[(txq_head_ + txq_count_) % kTxQueue] = f;
      ++txq_count_;
    }
    TxFrame& f = txq_[txq_head_];
    const size_t i = (tx_head_ + tx_count_) % kFramesInFlight;
    TxPosted& p = tx_[i];
    p = TxPosted{};
    p.f = f;
    p.seq = tx_seq_;
    tx_hdr_[i] = f.hdr;
    int rc = net_->isend(comms_.send, &tx_hdr_[i], sizeof(FrameHeader), tag_of(tx_seq_, 0), tx_hdr_mr_, &p.hreq);
    if (rc != netabi::kSuccess) return fail_plugin("isend", rc);
    if (!p.hreq) break;  // come back later; the frame stays queued
    ++tx_requests_;
    txq_head_ = (txq_head_ + 1) % kTxQueue;
    --txq_count_;
    ++tx_count_;
    ++tx_seq_;
    moved = true;
    const Post r = post_payload(p, i);
    if (r == Post::kDead) return false;
    if (r != Post::kPosted) break;  // posted by a later pass, before anything else
  }
  return moved;
}

// Tests send request `req` unless it was already reported done (*done). False: the lane was killed.
bool NetLane::test_send(void* req, bool* done) {
  if (*done) return true;
  size_t sz;
  int d = 0;
  if (const int rc = net_->test(req, &d, &sz); rc != netabi::kSuccess) return fail_plugin("test (send)", rc);
  if (d) *done = true, --tx_requests_;
  return true;
}

NetLane::Post NetLane::post_payload(TxPosted& p, size_t i) {
  void* data = &tx_hdr_[i];  // an empty payload: any registered address will do
  void* mh = tx_hdr_mr_;
  if (p.f.length > 0) {
    core::RegionState* region = region_of(p.f);
    if (!region) return Post::kDead;
    if (region->kind == MemoryKind::kCuda && !opts_.cuda_send) {
      // The plugin takes host pointers only: copy the payload to a pinned slot first.
      if (!p.slot) {
        if (!tx_stage_) tx_stage_ = std::make_unique<gpu::StagingRing>(kStageSlots, kMaxFrame, 1);
        auto got = tx_stage_->acquire(region->device);
        if (!got.is_ok()) {
          kill(got.status());
          return Post::kDead;
        }
        if (!got.value()) return Post::kLater;  // every slot waits for its send to complete
        p.slot = got.value();
        const gpu::Fragment whole{0, const_cast<uint8_t*>(p.f.payload), p.f.length};
        if (Status s = tx_stage_->pack(p.slot, region->device, &whole, 1, gpu::Unpack::kD2D); !s.is_ok()) {
          kill(s);
          return Post::kDead;
        }
      }
      auto copied = tx_stage_->done(p.slot);
      if (!copied.is_ok()) {
        kill(copied.status());
        return Post::kDead;
      }
      if (!copied.value()) return Post::kCopying;
      data = p.slot->host;
      mh = mr_for(slot_mrs_, p.slot, p.slot->host, p.slot->capacity, netabi::kPtrHost, "regMr (staging)");
    } else {
      data = const_cast<uint8_t*>(p.f.payload);
      // A GPU region only when the plugin takes CUDA pointers (opts_.cuda_send).
      const int type = region->kind == MemoryKind::kCuda ? netabi::kPtrCuda : netabi::kPtrHost;
      mh = mr_for(mrs_, region, region->base, region->size, type, "regMr");
    }
    if (!mh) return Post::kDead;
  }
  const int rc = net_->isend(comms_.send, data, p.f.length, tag_of(p.seq, 1), mh, &p.preq);
  if (rc != netabi::kSuccess) {
    fail_plugin("isend", rc);
    return Post::kDead;
  }
  if (!p.preq) return Post::kLater;
  p.payload_posted = true;
  ++tx_requests_;
  return Post::kPosted;
}

// ---------------------------------------------------------------- teardown

void NetLane::retire() {
  if (retired_) return;
  retired_ = true;
  dead_.store(true, std::memory_order_release);
  // An unpack in flight still reads the bounce pages: let it finish before the comm goes away.
  if (unpacker_) unpacker_->wait();
  for (size_t k = 0; k < rx_count_; ++k) abandon(*peer_, rx_[(rx_head_ + k) % kFramesInFlight].plan);
  rx_count_ = 0;
  if (has_deferred_) abandon(*peer_, deferred_.plan), has_deferred_ = false;
  for (size_t k = 0; k < tx_count_; ++k) {
    TxPosted& p = tx_[(tx_head_ + k) % kFramesInFlight];
    if (p.f.pin) p.f.pin->unpin();
    if (p.slot) tx_stage_->release(p.slot), p.slot = nullptr;
  }
  tx_count_ = 0;
  for (size_t k = 0; k < txq_count_; ++k) {
    TxFrame& f = txq_[(txq_head_ + k) % kTxQueue];
    if (f.pin) f.pin->unpin();
  }
  txq_count_ = 0;
  peer_->release_lane(index_, Code::kConnectionLost);
  for (auto& [r, mh] : mrs_) net_->dereg_mr(comms_.send, mh);
  mrs_.clear();
  if (tx_stage_) tx_stage_->wait_all();  // copies into slots the plugin will not send now
  for (auto& [slot, mh] : slot_mrs_) net_->dereg_mr(comms_.send, mh);
  slot_mrs_.clear();
  {
    std::lock_guard lock(dereg_mu_);
    dereg_queue_.clear();
    dereg_done_.store(dereg_requested_.load());
  }
  if (tx_hdr_mr_) net_->dereg_mr(comms_.send, tx_hdr_mr_);
  if (rx_hdr_mr_) net_->dereg_mr(comms_.recv, rx_hdr_mr_);
  if (landing_mr_) net_->dereg_mr(comms_.recv, landing_mr_);
  tx_hdr_mr_ = rx_hdr_mr_ = landing_mr_ = nullptr;
  if (comms_.send) net_->close_send(comms_.send);
  if (comms_.recv) net_->close_recv(comms_.recv);
  comms_.send = comms_.recv = nullptr;
}

}  // namespace tether::transport
