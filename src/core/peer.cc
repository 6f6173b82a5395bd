#include "core/peer.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/endpoint_impl.h"
#include "transport/transport.h"

namespace tether::core {
namespace {

// A transfer refused before any byte moved: finished at once, counted as failed.
Transfer invalid(const std::shared_ptr<PeerState>& p, OpKind op, Status s) {
  auto t = std::make_shared<TransferState>();
  t->op = op;
  t->peer = p;
  t->pending.store(0);
  t->finish(std::move(s));
  return Transfer(t);
}

const char* op_name(OpKind op) {
  switch (op) {
    case OpKind::kWrite: return "write";
    case OpKind::kRead: return "read";
    case OpKind::kSend: return "send";
    case OpKind::kRecv: return "recv";
    case OpKind::kNotify: return "notify";
  }
  return "?";
}

constexpr uint64_t kStagedReadChunks = 3;  // a staged read's smaller chunks a lane holds requested at once

// A staged GPU read moves each chunk three times in a row (the target copies it out of its GPU, sends
// it, we copy it into ours): a read of only a few chunks per lane cannot overlap them. Such reads use
// chunks of total / (8 x lanes), down to 256 KiB; from two full chunks per lane on, the full chunk
// (16 MiB over 8 lanes: Caps::read_depth's two requests per lane pipeline them), which cost less CPU
// than small chunks there. Writes lost with small chunks and keep full ones (docs/PERFORMANCE.md,
// "Defaults and why" and "Tried and lost").
uint64_t pipelined_chunk(uint64_t chunk, uint64_t total, uint32_t lanes) {
  if (total >= 2 * uint64_t(lanes) * chunk) return chunk;
  constexpr uint64_t kFloor = 256 << 10;
  const uint64_t want = (total / (8 * uint64_t(lanes))) & ~uint64_t((64 << 10) - 1);
  return std::min(chunk, std::max(want, kFloor));
}

}  // namespace

int64_t PeerState::now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

PeerState::PeerState(std::shared_ptr<EndpointImpl> endpoint, PeerInfo info, uint32_t lanes,
                     transport::Transport* transport)
    : Link(std::move(info), lanes, transport),
      endpoint_(std::move(endpoint)),
      batch_max_(transport ? transport->caps().batch_fragments : 0),
      batch_reads_(transport && transport->caps().batch_reads),
      gpu_batch_chunks_(transport ? std::max<uint32_t>(1, transport->caps().gpu_batch_chunks) : 1),
      gpu_chunk_(transport ? transport->caps().gpu_chunk_bytes : 0),
      read_depth_(transport ? transport->caps().read_depth : 0),
      staged_gpu_(transport && transport->caps().uses_tcp_lanes && !transport->caps().cuda_memory),
      wait_naps_(transport && transport->caps().wait_naps),
      pull_reads_(transport && transport->caps().pull_reads),
      lane_window_(std::max<uint32_t>(1, endpoint_->config().window / std::max<uint32_t>(1, lanes))),
      last_heard_ms_(now_ms()) {
  slots_.resize(size_t(lane_window_) * lanes_);
  free_slots_.reserve(slots_.size());
  for (uint32_t i = 0; i < slots_.size(); ++i) free_slots_.push_back(uint32_t(slots_.size()) - 1 - i);
  lane_inflight_.assign(lanes_, 0);
  lane_dead_.assign(lanes_, 0);
  live_lanes_ = lanes_;
  resend_.reserve(slots_.size());
  lane_counters_ = std::make_unique<LinkCounters[]>(lanes_);
  lane_bytes_ = std::make_unique<std::atomic<uint64_t>[]>(lanes_);
}

bool PeerState::lane_alive(uint32_t lane) const {
  std::lock_guard lock(mu_);
  return !failed_.load() && lane < lanes_ && !lane_dead_[lane];
}

uint32_t PeerState::spin_us() const { return endpoint_->config().spin_us; }
uint32_t PeerState::busy_poll_us() const { return endpoint_->config().busy_poll_us; }
uint32_t PeerState::wait_nap_us() const { return wait_naps_ ? endpoint_->config().wait_nap_us : 0; }

uint32_t PeerState::quietest_lane() const {
  std::lock_guard lock(mu_);
  uint32_t best = 0;
  for (uint32_t i = 1; i < lanes_; ++i)
    if (lane_dead_[best] || (!lane_dead_[i] && lane_inflight_[i] < lane_inflight_[best])) best = i;
  return best;
}

void PeerState::poll(uint32_t lane) {
  if (failed()) return;
  if (Hold h{this}) endpoint_->poll_lane(this, lane);
}

void PeerState::help() {
  if (failed()) return;
  if (Hold h{this}) transport->help(this);
}

PeerState::~PeerState() {
  // What was never released (a peer dropped before it was published, or whose lanes never ran).
  if (control_fd >= 0) ::close(control_fd);
  for (int fd : lane_fds)
    if (fd >= 0) ::close(fd);
}

bool PeerState::hold() {
  uint32_t n = holds_.load(std::memory_order_acquire);
  while (n != 0)
    if (holds_.compare_exchange_weak(n, n + 1, std::memory_order_acq_rel)) return true;
  return false;
}

void PeerState::let_go() {
  if (holds_.fetch_sub(1, std::memory_order_acq_rel) == 1) release_all();
}

void PeerState::let_go_control() {
  if (!control_let_go_.exchange(true)) let_go();
}

void PeerState::release_all() {
  // Nobody can use these numbers any more: every thread that could has let go, and hold() fails now.
  if (control_fd >= 0) ::close(control_fd);
  control_fd = -1;
  for (int& fd : lane_fds) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  if (transport) transport->detach(*this);
  std::string().swap(ctl_in);
  std::string().swap(ctl_pending);
  if (transport && transport->caps().lanes_hold) {
    std::lock_guard lock(mu_);  // only lanes use the chunk slots, and posts check failed_ first
    std::vector<Slot>().swap(slots_);
    std::vector<uint32_t>().swap(free_slots_);
    std::vector<uint32_t>().swap(resend_);
  }
  {
    std::lock_guard lock(released_mu_);
    released_.store(true, std::memory_order_release);
  }
  released_cv_.notify_all();
}

bool PeerState::wait_released(int64_t timeout_ms) {
  std::unique_lock lock(released_mu_);
  return released_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return released(); });
}

Status PeerState::error() const {
  std::lock_guard lock(mu_);
  return error_;
}

// ---------------------------------------------------------------- user side

Transfer PeerState::start(std::shared_ptr<TransferState> t) {
  t->peer = self();
  t->self = t;
  return Transfer(std::move(t));
}

// The peer stated its limit at connect: a larger notification is refused here, before anything is sent.
Status PeerState::notify_too_large(size_t bytes) const {
  return Status(Code::kInvalidArgument, "a notification of " + std::to_string(bytes) + " bytes is larger than peer '" +
                                            info_.name + "' accepts (its notify_max_bytes: " +
                                            std::to_string(info_.max_notify) + ")");
}

namespace {
int32_t device_of(const Segment& g) {
  return g.local_region && g.local_region->kind == MemoryKind::kCuda ? g.local_region->device : -1;
}
bool remote_gpu(const Segment& g) { return g.remote && g.remote->kind == MemoryKind::kCuda; }

// A pulled read's kPull frame (wire::FrameType::kPull): its one segment, the recv token in `slot`.
void pull_frame(const TransferState& t, bool resent, ChunkOp* op) {
  const Segment& g = t.segments[0];
  *op = ChunkOp{};
  wire::FrameHeader& h = op->hdr;
  h.type = static_cast<uint8_t>(wire::FrameType::kPull);
  h.flags = resent ? wire::kFlagResent : 0;
  h.slot = uint32_t(t.msg_id);
  h.region_id = g.region_id;
  h.key = g.key;
  h.desc_offset = g.desc_offset;
  h.desc_length = g.desc_length;
  h.offset = g.remote_offset;
  h.length = g.length;
  op->segment = &g;
}
}  // namespace

namespace {
// Both ranges, whichever side is short: the caller sees what it asked to move where (error path only).
std::string out_of_range(const Block& b, uint64_t local_size, uint64_t remote_size) {
  auto range = [&](const char* side, uint64_t offset) {
    return std::string(side) + " range [" + std::to_string(offset) + ", +" + std::to_string(b.length) + ")";
  };
  const std::string local = range("local", b.local_offset), remote = range("remote", b.remote_offset);
  if (!in_bounds(b.local_offset, b.length, local_size))
    return local + " exceeds local region of " + std::to_string(local_size) + " bytes (" + remote + " of the descriptor's " +
           std::to_string(remote_size) + " bytes)";
  return remote + " exceeds the descriptor's " + std::to_string(remote_size) + " bytes (" + local +
         " of a local region of " + std::to_string(local_size) + " bytes)";
}
}  // namespace

Transfer PeerState::post_rma(OpKind op, const BlockRun* runs, size_t nruns, const char* noun, std::string notify) {
  const bool write = op == OpKind::kWrite;
  // A closed endpoint (or a dead link) says so, before its cleared regions could answer for it.
  if (failed()) return invalid(self(), op, error());
  if (notify.size() > info_.max_notify) return invalid(self(), op, notify_too_large(notify.size()));
  size_t total = 0;
  for (size_t r = 0; r < nruns; ++r) total += runs[r].n;
  // Messages are formatted only here, on the way out: the good path builds no strings.
  auto refuse = [&](size_t i, Code code, std::string msg) {
    if (total > 1) msg += " (" + std::string(noun) + " " + std::to_string(i) + ")";
    return invalid(self(), op, Status(code, std::move(msg)));
  };
  auto t = std::make_shared<TransferState>();
  t->op = op;
  t->notify = std::move(notify);
  t->segments.reserve(total);
  t->remotes.reserve(nruns);  // segments point into it: it must never reallocate
  uint64_t bytes = 0;
  size_t first = 0;  // index of the run's first block over all runs
  for (size_t r = 0; r < nruns; first += runs[r].n, ++r) {
    const BlockRun& run = runs[r];
    if (run.n == 0) continue;
    // What holds for the whole run is checked once, in the name of its first block.
    const auto& l = run.local->state();
    if (!l) return refuse(first, Code::kInvalidArgument, "no local region");
    if (!l->live.load()) return refuse(first, Code::kNotFound, "local region " + std::to_string(l->id) + " is deregistered");
    if (!write && l->readonly) return refuse(first, Code::kAccessDenied, "read into a read-only local region");
    const RemoteRegion& rr = *run.remote;
    if (rr.endpoint != info_.endpoint)
      return refuse(first, Code::kInvalidArgument, "descriptor belongs to another endpoint, not peer '" + info_.name + "'");
    // One copy per distinct descriptor: consecutive runs naming the same one share it.
    if (t->remotes.empty() || !(t->remotes.back() == rr)) t->remotes.push_back(rr);
    if (t->local_pins.empty() || t->local_pins.back() != l) t->local_pins.push_back(l);
    Segment proto;
    proto.region_id = rr.region_id;
    proto.key = rr.key;
    proto.desc_offset = rr.offset;
    proto.desc_length = rr.length;
    proto.local_region = l.get();
    proto.remote = &t->remotes.back();
    for (size_t j = 0; j < run.n; ++j) {  // every block's bounds, before any byte moves
      const Block& b = run.blocks[j];
      if (!in_bounds(b.local_offset, b.length, l->size) || !in_bounds(b.remote_offset, b.length, rr.length))
        return refuse(first + j, Code::kOutOfRange, out_of_range(b, l->size, rr.length));
      if (b.length == 0) continue;
      Segment& s = t->segments.emplace_back(proto);
      s.local = l->base + b.local_offset;
      s.length = b.length;
      s.remote_offset = rr.offset + b.remote_offset;
      bytes += b.length;
    }
  }
  t->bytes.store(bytes, std::memory_order_relaxed);
  for (auto& r : t->local_pins) r->pins.fetch_add(1, std::memory_order_acquire);
  Transfer handle = start(t);
  if (t->segments.empty()) {
    t->release();  // nothing to move: straight to completion (and notification)
  } else if (pulls(*t)) {
    pull(t.get());
  } else {
    enqueue(t.get());
  }
  return handle;
}

bool PeerState::pulls(const TransferState& t) const {
  // Contiguous, GPU memory staged on either side, and long enough that every lane moves two chunks or
  // more: requested chunk by chunk, a staged read's lane got its depth back only after the chunk's copy
  // into this side's GPU and its target lanes sat idle much of a large read; pushed, the target's lanes
  // take chunks as their sockets drain, as a write's do (docs/PERFORMANCE.md, "Defaults and why").
  // Host-memory reads were level and keep their requests.
  if (!pull_reads_ || t.op != OpKind::kRead || t.segments.size() != 1) return false;
  const Segment& g = t.segments[0];
  const bool gpu = device_of(g) >= 0 || remote_gpu(g);
  return gpu && t.bytes.load(std::memory_order_relaxed) >= uint64_t(2) * lanes_ * info_.chunk_bytes;
}

void PeerState::pull(TransferState* t) {
  const Segment& g = t->segments[0];
  const int device = device_of(g);
  {
    std::lock_guard lock(mu_);
    if (failed_.load()) {
      t->record_error(error_);
    } else {
      uint32_t token = next_token_++;
      if (token == 0) token = next_token_++;
      t->msg_id = token;
      t->unit = info_.chunk_bytes;  // the sender cuts by the chunk size both sides agreed on
      t->placed.assign((g.length / t->unit + 64) / 64, 0);
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
  // One frame: the posting thread sends it itself where a lane is free (TcpTransport::wake), so no
  // control thread stands between the post and the target's lanes (wire version 8).
  endpoint_->wake_lanes(this, 1, device);
}

bool PeerState::on_pull(const wire::FrameHeader& h) {
  const uint32_t token = h.slot;
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
    t->segments.push_back(Segment{region->base + h.offset, h.length, token, 0, 0, 0, 0, region.get(), nullptr});
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

Transfer PeerState::post_send(const Region& local, uint64_t offset, uint64_t length, uint64_t tag) {
  if (failed()) return invalid(self(), OpKind::kSend, error());
  const auto& l = local.state();
  if (!l || !l->live.load()) return invalid(self(), OpKind::kSend, Status(Code::kNotFound, "send: local region is not registered"));
  if (!in_bounds(offset, length, l->size))
    return invalid(self(), OpKind::kSend, Status(Code::kOutOfRange, "send: range exceeds local region of " + std::to_string(l->size) + " bytes"));
  auto t = std::make_shared<TransferState>();
  t->op = OpKind::kSend;
  t->tag = tag;
  t->bytes = length;
  t->segments.push_back(Segment{l->base + offset, length, 0, 0, 0, length, 0, l.get(), nullptr});
  t->local_pins.push_back(l);
  l->pins.fetch_add(1);
  Transfer handle = start(t);
  wire::RtsBody rts{};
  {
    std::lock_guard lock(mu_);
    if (failed_.load()) {
      t->record_error(error_);
    } else {
      rts = {next_msg_id_++, tag, length};
      t->msg_id = rts.msg_id;
      awaiting_cts_[rts.msg_id] = t.get();
    }
  }
  if (rts.msg_id == 0) {
    t->release();
  } else {
    send_control(wire::ControlType::kRts, &rts, sizeof rts);
  }
  return handle;
}

Transfer PeerState::post_recv(const Region& local, uint64_t offset, uint64_t length, uint64_t tag) {
  if (failed()) return invalid(self(), OpKind::kRecv, error());
  const auto& l = local.state();
  if (!l || !l->live.load()) return invalid(self(), OpKind::kRecv, Status(Code::kNotFound, "recv: local region is not registered"));
  if (l->readonly) return invalid(self(), OpKind::kRecv, Status(Code::kAccessDenied, "recv into a read-only region"));
  if (!in_bounds(offset, length, l->size))
    return invalid(self(), OpKind::kRecv, Status(Code::kOutOfRange, "recv: range exceeds local region of " + std::to_string(l->size) + " bytes"));
  auto t = std::make_shared<TransferState>();
  t->op = OpKind::kRecv;
  t->tag = tag;
  t->segments.push_back(Segment{l->base + offset, length, 0, 0, 0, 0, 0, l.get(), nullptr});
  t->local_pins.push_back(l);
  l->pins.fetch_add(1);
  Transfer handle = start(t);
  wire::CtsBody cts{};
  bool matched = false;
  TransferState* release_now = nullptr;
  {
    std::lock_guard lock(mu_);
    if (failed_.load()) {
      t->record_error(error_);
      release_now = t.get();
    } else if (wire::RtsBody rts; take_unexpected(tag, &rts)) {
      cts = match(t.get(), rts, &release_now);
      matched = true;
    } else {
      posted_recvs_[tag].push_back(t.get());
    }
  }
  if (matched) send_control(wire::ControlType::kCts, &cts, sizeof cts);
  if (release_now) release_now->release();
  return handle;
}

Transfer PeerState::post_notify(std::string data) {
  if (failed()) return invalid(self(), OpKind::kNotify, error());
  if (data.size() > info_.max_notify) return invalid(self(), OpKind::kNotify, notify_too_large(data.size()));
  auto t = std::make_shared<TransferState>();
  t->op = OpKind::kNotify;
  t->notify = std::move(data);
  Transfer handle = start(t);
  t->release();  // drained at once: transfer_drained() sends the notification
  return handle;
}

uint64_t PeerState::read_chunk(const TransferState& t, int local_device, const RemoteRegion* remote, uint64_t chunk) const {
  const bool gpu = local_device >= 0 || (remote && remote->kind == MemoryKind::kCuda);
  if (!staged_gpu_ || t.op != OpKind::kRead || !gpu) return chunk;
  return pipelined_chunk(chunk, t.bytes.load(std::memory_order_relaxed), lanes_);
}

void PeerState::enqueue(TransferState* t) {
  // Where the local bytes live (the first segment's region: a transfer's blocks share one local
  // region in the common case), so a transport can wake the lanes on the NICs nearest them.
  const RegionState* first = t->segments.empty() ? nullptr : t->segments.front().local_region;
  const int device = first && first->kind == MemoryKind::kCuda ? first->device : -1;
  const RemoteRegion* remote = t->segments.empty() ? nullptr : t->segments.front().remote;
  // As next_chunk() will cut it (roughly: for how many lanes to wake).
  const uint64_t chunk = read_chunk(*t, device, remote, info_.chunk_bytes);
  uint64_t chunks = 0;
  for (const Segment& s : t->segments) {
    chunks += (s.length + chunk - 1) / chunk;
    if (chunks >= lanes_) break;
  }
  {
    std::lock_guard lock(mu_);
    if (!failed_.load()) {
      t->next_queued = nullptr;
      if (queue_tail_) {
        queue_tail_->next_queued = t;
      } else {
        queue_head_.store(t, std::memory_order_release);
      }
      queue_tail_ = t;
      t = nullptr;
    } else {
      t->record_error(error_);
    }
  }
  if (t) {
    t->release();
    return;
  }
  endpoint_->wake_lanes(this, chunks, device);
}

// ---------------------------------------------------------------- transport side

// Pieces under `chunk` each, `limit` bytes in all.
uint32_t PeerState::pack_batch(TransferState* t, Slot& s, uint64_t chunk, uint64_t limit) {
  const std::vector<Segment>& segs = t->segments;
  const Segment& first = segs[t->cur_segment];
  const uint64_t rest = first.length - t->cur_offset;
  if (rest >= chunk || t->cur_segment + 1 >= segs.size()) return 0;
  const int32_t dev = device_of(first);
  size_t end = t->cur_segment + 1;
  uint64_t total = rest;
  // A read batch keeps to one kind of remote memory: the chunk size was chosen for the first one's.
  const bool read = t->op == OpKind::kRead;
  while (end < segs.size() && end - t->cur_segment < batch_max_ && total + segs[end].length <= limit &&
         device_of(segs[end]) == dev && (!read || remote_gpu(segs[end]) == remote_gpu(first)))
    total += segs[end++].length;
  const uint32_t n = uint32_t(end - t->cur_segment);
  if (n < 2) return 0;
  if (!s.frags) {  // once per slot, on its first batch
    s.frags = std::make_unique<wire::Fragment[]>(batch_max_);
    s.pieces = std::make_unique<Piece[]>(batch_max_);
  }
  for (uint32_t i = 0; i < n; ++i) {
    const Segment& g = segs[t->cur_segment + i];
    const uint64_t skip = i == 0 ? t->cur_offset : 0;
    s.frags[i] = wire::Fragment{g.region_id, 0, g.key, g.desc_offset, g.desc_length, g.remote_offset + skip, g.length - skip};
    s.pieces[i] = Piece{g.local + skip, g.length - skip, g.local_region};
  }
  t->cur_segment = end;
  t->cur_offset = 0;
  s.length = total;
  return n;
}

bool PeerState::next_chunk(uint32_t lane, ChunkOp* op) {
  // Nothing queued: answered without the lock. Spinning progress threads (busy_poll_us) ask on every
  // turn, and taking mu_ each time made posters wait for it (tcp: 3-7 us per small op on 16 cores). A
  // chunk queued just after this check is followed by the poster's wake().
  if (!has_work()) return false;
  TransferState* drained = nullptr;
  {
    std::unique_lock lock(mu_);
    if (lane_dead_[lane]) return false;
    // Pulls first: a kPull takes no slot and gets no answer, so neither a full window nor a transfer
    // queued ahead of it holds it back (a read's start would wait on another transfer's chunks).
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
    if (lane_inflight_[lane] >= lane_window_) return false;
    // A pushed send's chunk reads the region it names: pinned while the transport reads it (as a read's
    // answer is), so deregister waits for chunks being sent, never for a stalled reader's answers.
    auto pin = [&](TransferState* t) -> RegionState* {
      return t->pushed && endpoint_->registry().pin_published(*t->source) ? t->source.get() : nullptr;
    };
    if (!resend_.empty()) {  // chunks of a lost lane go first: their transfers are the oldest
      const uint32_t idx = resend_.back();
      resend_.pop_back();
      publish_resends();
      Slot& s = slots_[idx];
      RegionState* pinned = pin(s.transfer);
      if (s.transfer->pushed && !pinned) {  // its region is gone: the chunk cannot be read again, answered here
        TransferState* stopped = s.transfer;
        s.used = false;
        s.transfer = nullptr;
        ++s.gen;
        free_slots_.push_back(idx);
        lock.unlock();
        push_stopped(stopped);
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
    TransferState* t = queue_head_.load(std::memory_order_relaxed);
    if (!t || free_slots_.empty()) return false;
    RegionState* pinned = pin(t);
    if (t->pushed && !pinned) {  // deregistered mid-read: no further chunk; its hold is ours to release
      queue_head_.store(t->next_queued, std::memory_order_release);
      if (!t->next_queued) queue_tail_ = nullptr;
      t->next_queued = nullptr;
      lock.unlock();
      push_stopped(t);
      return false;
    }
    const Segment& seg = t->segments[t->cur_segment];
    // GPU to GPU (writes, reads): the transport may want bigger chunks (ipc: copy engines over NVLink).
    const bool gpu_both = gpu_chunk_ && device_of(seg) >= 0 && seg.remote && seg.remote->kind == MemoryKind::kCuda;
    const uint64_t chunk = read_chunk(*t, device_of(seg), seg.remote, gpu_both ? gpu_chunk_ : info_.chunk_bytes);
    // A read request costs its lane nothing to send, so without this the first lanes to run took their
    // whole windows of large chunks and the rest of the transfer waited on them (Caps::read_depth; in
    // bytes, so small reads still fill the window: a round trip each, they need the depth).
    if (read_depth_ && t->op == OpKind::kRead) {
      uint64_t depth = uint64_t(read_depth_) * info_.chunk_bytes;
      // A staged read cut into chunks of a quarter of chunk_bytes or less (pipelined_chunk: reads under
      // 16 MiB over 8 lanes) keeps at most kStagedReadChunks of them per lane: less is left on each
      // lane when the last is handed out; larger reads in 512 KiB chunks lost and keep the window
      // (docs/PERFORMANCE.md, "Defaults and why").
      if (staged_gpu_ && chunk * 4 <= info_.chunk_bytes) depth = std::min(depth, kStagedReadChunks * chunk);
      if (lane_bytes_[lane].load(std::memory_order_relaxed) >= depth) return false;
    }
    const uint32_t idx = free_slots_.back();
    free_slots_.pop_back();
    Slot& s = slots_[idx];
    s.used = true;
    s.transfer = t;
    s.lane = lane;
    s.local = seg.local + t->cur_offset;
    s.device = device_of(seg);
    ++lane_inflight_[lane];
    t->pending.fetch_add(1, std::memory_order_relaxed);
    t->lane_hint.store(lane, std::memory_order_relaxed);

    wire::FrameHeader& h = op->hdr;
    h = {};
    h.slot = idx;
    h.gen = s.gen;
    op->segment = &seg;
    op->segment_offset = t->cur_offset;
    op->pin = pinned;
    op->device = s.device;
    op->local = s.local;
    const bool batches = t->op == OpKind::kWrite || (t->op == OpKind::kRead && batch_reads_);
    // A write batch that GPU memory stages on either side may carry more: each costs a kernel launch there,
    // and two processes' kernels on one GPU take turns (Caps::gpu_batch_chunks).
    const bool gpu_batch = t->op == OpKind::kWrite && (device_of(seg) >= 0 || remote_gpu(seg));
    const uint64_t limit = gpu_batch ? chunk * gpu_batch_chunks_ : chunk;
    const uint32_t n = batches && batch_max_ >= 2 ? pack_batch(t, s, chunk, limit) : 0;
    if (n >= 2) {  // many small writes (reads): one frame, one answer
      const bool write = t->op == OpKind::kWrite;
      h.type = static_cast<uint8_t>(write ? wire::FrameType::kWriteBatch : wire::FrameType::kReadBatch);
      h.region_id = n;
      h.length = s.length;
      op->payload = nullptr;
      op->length = write ? s.length : 0;
      op->fragments = n;
      op->frags = s.frags.get();
      op->pieces = s.pieces.get();
    } else {
      const uint64_t len = std::min<uint64_t>(chunk, seg.length - t->cur_offset);
      s.length = len;
      h.type = static_cast<uint8_t>(t->op == OpKind::kWrite  ? wire::FrameType::kWrite
                                    : t->op == OpKind::kRead ? wire::FrameType::kReadReq
                                                             : wire::FrameType::kSendData);
      h.region_id = seg.region_id;
      h.key = seg.key;
      h.desc_offset = seg.desc_offset;
      h.desc_length = seg.desc_length;
      h.offset = seg.remote_offset + t->cur_offset;
      h.length = len;
      const bool has_payload = t->op != OpKind::kRead;
      op->payload = has_payload ? s.local : nullptr;
      op->length = has_payload ? len : 0;
      op->fragments = 0;
      if (t->op == OpKind::kSend) h.key = chunk;  // the receiver's dedupe unit (one bit per chunk)
      t->cur_offset += len;
      if (t->cur_offset == seg.length) {
        t->cur_offset = 0;
        ++t->cur_segment;
      }
    }
    lane_bytes_[lane].fetch_add(s.length, std::memory_order_relaxed);
    s.op = *op;  // kept for a resend on another lane (frags/pieces live in the slot too)
    if (t->cur_segment == t->segments.size()) {
      queue_head_.store(t->next_queued, std::memory_order_release);
      if (!t->next_queued) queue_tail_ = nullptr;
      drained = t;
    }
  }
  if (drained) drained->release();  // the hold; this chunk keeps it pending
  return true;
}

Status PeerState::chunk_error(const Slot& s, uint8_t status) const {
  return refusal(s.transfer ? op_name(s.transfer->op) : "chunk", s.length, status);
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
    if (status != 0) err = chunk_error(s, status);
    t = s.transfer;
    s.used = false;
    s.transfer = nullptr;
    ++s.gen;
    free_slots_.push_back(slot);
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
    r->unit = unit;
    r->placed.assign((total / unit + 64) / 64, 0);  // sized at match for our own chunk size: rare
  }
  r->pending.fetch_add(1, std::memory_order_relaxed);
  *dest = r->segments[0].local + offset;
  *recv = r;
  const RegionState* l = r->segments[0].local_region;
  *device = l && l->kind == MemoryKind::kCuda ? l->device : -1;
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

void PeerState::lane_failed(uint32_t lane, Status why) {
  const bool link = why.code() == Code::kConnectionLost || why.code() == Code::kTimeout;
  bool last = false;
  {
    std::lock_guard lock(mu_);
    if (failed_.load() || lane >= lanes_ || lane_dead_[lane]) return;
    if (link && live_lanes_ > 1) {
      lane_dead_[lane] = 1;
      --live_lanes_;
    } else {
      last = link;
    }
  }
  LinkCounters& c = lane_counters_[lane];
  c.errors.fetch_add(1, std::memory_order_relaxed);
  if (lane < lane_paths.size() && lane_paths[lane].nic_counters)
    lane_paths[lane].nic_counters->errors.fetch_add(1, std::memory_order_relaxed);
  if (!link) {
    fail(std::move(why));
  } else if (last) {
    fail(Status(why.code(), "every data connection to peer '" + info_.name + "' failed; the last: " + why.message()));
  } else if (lane < lane_fds.size() && lane_fds[lane] >= 0) {
    ::shutdown(lane_fds[lane], SHUT_RDWR);  // its thread sees the lane dead and retires it
  }
}

void PeerState::release_lane(uint32_t lane, Code code) {
  std::vector<TransferState*> orphans;
  Status why;
  uint64_t moved = 0;
  {
    std::lock_guard lock(mu_);
    why = error_.is_ok() ? Status(code, "connection to peer '" + info_.name + "' lost") : error_;
    lane_dead_[lane] = 1;
    const bool survivors = !failed_.load();
    for (uint32_t i = 0; i < slots_.size(); ++i) {
      Slot& s = slots_[i];
      if (!s.used || s.lane != lane) continue;
      ++s.gen;  // an answer to the lost copy can no longer match
      if (survivors) {
        s.lane = UINT32_MAX;
        resend_.push_back(i);
        ++moved;
        continue;
      }
      orphans.push_back(s.transfer);
      s.used = false;
      s.transfer = nullptr;
      free_slots_.push_back(i);
    }
    if (survivors)  // a pull that went on this lane may never have reached the target: sent again
      for (const auto& [token, t] : matched_)
        if (t->pull_lane == lane) {  // recvs in matched_ never set it
          t->pull_lane = UINT32_MAX;
          pulls_out_.emplace_back(token, true);
          ++moved;
        }
    publish_resends();
    lane_inflight_[lane] = 0;
    lane_bytes_[lane].store(0, std::memory_order_relaxed);
  }
  for (TransferState* t : orphans) {
    t->record_error(why);
    t->release();
  }
  if (moved > 0) {
    lane_counters_[lane].resends.fetch_add(moved, std::memory_order_relaxed);
    if (lane < lane_paths.size() && lane_paths[lane].nic_counters)
      lane_paths[lane].nic_counters->resends.fetch_add(moved, std::memory_order_relaxed);
    endpoint_->wake_lanes(this, uint64_t(1) << 20);  // every thread: whichever holds a survivor takes them
  }
}

// ---------------------------------------------------------------- completion

void PeerState::transfer_drained(TransferState* t) {
  if (t->pushed) {
    std::lock_guard lock(mu_);
    if (auto it = pushes_.find(uint32_t(t->msg_id)); it != pushes_.end() && it->second == t) pushes_.erase(it);
  }
  Status err = t->error();
  if (!err.is_ok()) {
    t->finish(err);
    return;
  }
  // A write's notification follows its data into the target; a read's follows the last answer here.
  const bool notify = t->op == OpKind::kNotify || !t->notify.empty();
  if (!notify) {
    t->finish(Status::ok());
    return;
  }
  uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    if (failed_.load()) {
      err = error_;
    } else {
      id = next_msg_id_++;
      awaiting_ack_[id] = t;
    }
  }
  if (id == 0) {
    t->finish(err);
    return;
  }
  std::string body(8 + t->notify.size(), '\0');
  std::memcpy(body.data(), &id, 8);
  std::memcpy(body.data() + 8, t->notify.data(), t->notify.size());
  send_control(wire::ControlType::kNotify, body.data(), uint32_t(body.size()));
}

void PeerState::count_finished(bool ok) { endpoint_->count_finished(ok); }

// ---------------------------------------------------------------- control side

void PeerState::send_control(wire::ControlType type, const void* body, uint32_t length) {
  queue_control(type, body, length, SIZE_MAX);
}

bool PeerState::send_answer(wire::ControlType type, const void* body, uint32_t length) {
  if (failed()) return false;
  if (queue_control(type, body, length, kAnswerBacklog)) return true;
  fail(Status(Code::kResourceExhausted, "peer '" + info_.name + "' does not read its control connection: the answers to "
                                            "its requests waiting for it passed " + std::to_string(kAnswerBacklog >> 20) +
                                            " MiB (the bound on a peer's unsent control bytes)"));
  return false;
}

// Appends one message unless the unsent control bytes would pass `limit`.
bool PeerState::queue_control(wire::ControlType type, const void* body, uint32_t length, size_t limit) {
  wire::ControlHeader h{length, static_cast<uint8_t>(type), {}};
  {
    std::lock_guard lock(out_mu_);
    if (limit != SIZE_MAX && control_out_.size() + ctl_unsent_.load(std::memory_order_relaxed) + sizeof h + length > limit)
      return false;
    control_out_.append(reinterpret_cast<const char*>(&h), sizeof h);
    if (length > 0) control_out_.append(static_cast<const char*>(body), length);  // heartbeats have none
  }
  endpoint_->wake_control();
  return true;
}

bool PeerState::take_control_output(std::string* out, size_t sent) {
  std::lock_guard lock(out_mu_);
  if (control_out_.empty()) return false;
  if (out->empty()) {
    out->swap(control_out_);  // no copy; control_out_ keeps the drained buffer (given back when large)
  } else {
    out->append(control_out_);
    control_out_.clear();
  }
  ctl_unsent_.store(out->size() - sent, std::memory_order_relaxed);
  return true;
}

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
  recv->unit = info_.chunk_bytes;  // the chunk size both sides agreed on at connect
  recv->placed.assign((rts.length / recv->unit + 64) / 64, 0);
  if (rts.length == 0) {
    *release_now = recv;
    return cts;
  }
  uint32_t token = next_token_++;
  if (token == 0) token = next_token_++;
  recv->msg_id = token;
  matched_[token] = recv;
  cts.token = token;
  return cts;
}

void PeerState::on_control(wire::ControlType type, const uint8_t* body, uint32_t length) {
  touch();
  switch (type) {
    case wire::ControlType::kHeartbeat:
      return;
    case wire::ControlType::kNotify: {
      if (length < 8) break;
      wire::NotifyAckBody ack{};
      std::memcpy(&ack.id, body, 8);
      // Queued for the application, or refused (too large, queue full): the sender learns which.
      ack.status = uint8_t(endpoint_->push_notification(info_, body + 8, length - 8));
      send_answer(wire::ControlType::kNotifyAck, &ack, sizeof ack);
      return;
    }
    case wire::ControlType::kNotifyAck: {
      if (length != sizeof(wire::NotifyAckBody)) break;
      wire::NotifyAckBody ack;
      std::memcpy(&ack, body, sizeof ack);
      TransferState* t = nullptr;
      {
        std::lock_guard lock(mu_);
        if (auto it = awaiting_ack_.find(ack.id); it != awaiting_ack_.end()) {
          t = it->second;
          awaiting_ack_.erase(it);
        }
      }
      if (!t) break;
      const Code c = static_cast<Code>(ack.status);
      if (c == Code::kOk) {
        t->finish(Status::ok());
      } else {
        const bool write = t->op == OpKind::kWrite;
        t->finish(Status(c, "peer '" + info_.name + "' refused the notification: " +
                                (c == Code::kResourceExhausted
                                     ? "its queue of unread notifications is full (notify_queue_peer_bytes / "
                                       "notify_queue_bytes there); retry once the application there has read them"
                                     : std::string(code_name(c))) +
                                (write ? " (the write's data is in place)" : "")));
      }
      return;
    }
    case wire::ControlType::kRts: {
      if (length != sizeof(wire::RtsBody)) break;
      wire::RtsBody rts;
      std::memcpy(&rts, body, sizeof rts);
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
      return;
    }
    case wire::ControlType::kCancel: {
      if (length != sizeof(uint32_t)) break;
      uint32_t token;
      std::memcpy(&token, body, sizeof token);
      size_t erased = 0;
      TransferState* r = nullptr;
      {
        std::lock_guard lock(mu_);
        if (auto it = matched_.find(token); it != matched_.end()) {
          r = it->second;
          matched_.erase(it);
          erased = 1;
        }
      }
      if (erased) {
        r->record_error(Status(Code::kCancelled, "peer '" + info_.name + "' withdrew the message (tag " +
                                                     std::to_string(r->tag) + ")"));
        r->release();
      }
      return;
    }
    case wire::ControlType::kPullFail: {
      if (length != sizeof(wire::PullFailBody)) break;
      wire::PullFailBody f;
      std::memcpy(&f, body, sizeof f);
      if (f.status == 0) break;
      TransferState* t = nullptr;
      {
        std::lock_guard lock(mu_);
        if (auto it = matched_.find(f.token); it != matched_.end() && it->second->op == OpKind::kRead) {
          t = it->second;
          matched_.erase(it);
        }
      }
      if (!t) return;  // cancelled meanwhile
      t->record_error(refusal("read", t->bytes.load(std::memory_order_relaxed), f.status));
      t->release();
      return;
    }
    case wire::ControlType::kPullCancel: {
      if (length != sizeof(uint32_t)) break;
      uint32_t token;
      std::memcpy(&token, body, sizeof token);
      std::shared_ptr<TransferState> t;
      {
        // Still in pushes_: not drained, so not finished, and `self` is not being dropped (transfer_drained
        // takes it out under this lock first). The copy keeps it alive through cancel().
        std::lock_guard lock(mu_);
        if (auto it = pushes_.find(token); it != pushes_.end()) t = it->second->self;
      }
      if (t) cancel(t.get());
      return;
    }
    case wire::ControlType::kCts: {
      if (length != sizeof(wire::CtsBody)) break;
      wire::CtsBody cts;
      std::memcpy(&cts, body, sizeof cts);
      TransferState* t = nullptr;
      {
        std::lock_guard lock(mu_);
        if (auto it = awaiting_cts_.find(cts.msg_id); it != awaiting_cts_.end()) {
          t = it->second;
          awaiting_cts_.erase(it);
        }
      }
      if (!t) {  // withdrawn (its region was deregistered): release the receiver's recv
        if (cts.status == 0 && cts.token != 0) send_answer(wire::ControlType::kCancel, &cts.token, sizeof cts.token);
        return;
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
        t->segments[0].region_id = cts.token;
        enqueue(t);
      }
      return;
    }
  }
  fail(Status(Code::kProtocolError, "peer '" + info_.name + "' sent a malformed control message (type " +
                                        std::to_string(int(type)) + ", " + std::to_string(length) + " bytes)"));
}

void PeerState::cancel(TransferState* t) {
  if (t->is_finished()) return;
  bool taken = false;  // off the queue or out of the rendezvous: its hold is ours to release
  uint32_t pull_token = 0;  // a pulled read: tell the target to stop sending it
  {
    std::lock_guard lock(mu_);
    TransferState* prev = nullptr;
    for (TransferState* q = queue_head_.load(std::memory_order_relaxed); q; prev = q, q = q->next_queued) {
      if (q != t) continue;
      if (prev) {
        prev->next_queued = t->next_queued;
      } else {
        queue_head_.store(t->next_queued, std::memory_order_release);
      }
      if (queue_tail_ == t) queue_tail_ = prev;
      t->next_queued = nullptr;
      taken = true;
      break;
    }
    if (!taken && t->op == OpKind::kSend && awaiting_cts_.erase(t->msg_id) > 0) taken = true;
    if (!taken && t->op == OpKind::kRecv)
      if (auto it = posted_recvs_.find(t->tag); it != posted_recvs_.end()) {
        auto& q = it->second;
        for (auto qi = q.begin(); qi != q.end(); ++qi)
          if (*qi == t) {
            q.erase(qi);
            taken = true;
            break;
          }
        if (q.empty()) posted_recvs_.erase(it);
      }
    if (!taken && t->op == OpKind::kRead && t->msg_id != 0)
      if (auto it = matched_.find(uint32_t(t->msg_id)); it != matched_.end() && it->second == t) {
        matched_.erase(it);
        taken = true;
        pull_token = uint32_t(t->msg_id);
      }
  }
  t->record_error(Status(Code::kCancelled, std::string(op_name(t->op)) + " cancelled"));
  if (pull_token) send_control(wire::ControlType::kPullCancel, &pull_token, sizeof pull_token);
  if (taken) t->release();
}

void PeerState::cancel_region(const RegionState* region) {
  auto uses = [region](const TransferState* t) {
    for (auto& p : t->local_pins)
      if (p.get() == region) return true;
    return false;
  };
  std::vector<TransferState*> cancelled;
  {
    std::lock_guard lock(mu_);
    for (auto it = awaiting_cts_.begin(); it != awaiting_cts_.end();) {
      if (uses(it->second)) {
        cancelled.push_back(it->second);
        it = awaiting_cts_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = posted_recvs_.begin(); it != posted_recvs_.end();) {
      auto& q = it->second;
      for (auto qi = q.begin(); qi != q.end();) {
        if (uses(*qi)) {
          cancelled.push_back(*qi);
          qi = q.erase(qi);
        } else {
          ++qi;
        }
      }
      it = q.empty() ? posted_recvs_.erase(it) : std::next(it);
    }
  }
  for (TransferState* t : cancelled) {
    t->record_error(Status(Code::kCancelled, "its region was deregistered before the message was matched"));
    t->release();
  }
}

void PeerState::fail(Status s) {
  std::vector<TransferState*> release, finish;
  {
    std::lock_guard lock(mu_);
    if (failed_.load()) return;
    error_ = s;
    failed_.store(true, std::memory_order_release);
    for (TransferState* t = queue_head_.load(); t; t = t->next_queued) release.push_back(t);
    queue_head_.store(nullptr);
    queue_tail_ = nullptr;
    for (auto& [id, t] : awaiting_cts_) release.push_back(t);
    for (auto& [tag, q] : posted_recvs_) release.insert(release.end(), q.begin(), q.end());
    for (auto& [token, t] : matched_) release.push_back(t);
    for (auto& [id, t] : awaiting_ack_) finish.push_back(t);
    for (uint32_t i : resend_) {  // chunks waiting for a surviving lane: there is none now
      Slot& s = slots_[i];
      release.push_back(s.transfer);
      s.used = false;
      s.transfer = nullptr;
      ++s.gen;
      free_slots_.push_back(i);
    }
    resend_.clear();
    pulls_out_.clear();  // their reads are in matched_, released above
    publish_resends();
    awaiting_cts_.clear();
    posted_recvs_.clear();
    unexpected_.clear();
    unexpected_count_ = 0;
    matched_.clear();
    awaiting_ack_.clear();
    pushes_.clear();  // their sends are on the queue or on lanes: released above or by release_lane()
  }
  for (TransferState* t : release) {
    t->record_error(s);
    t->release();  // the hold; chunks on lanes are answered by release_lane()
  }
  for (TransferState* t : finish) t->finish(s);
  // Wake every thread that owns one of our sockets: they see the shutdown and let go. Held, so that
  // Endpoint::close, having failed every peer, cannot release them under a fail() still shutting down.
  if (Hold h{this}) {
    if (control_fd >= 0) ::shutdown(control_fd, SHUT_RDWR);
    for (int fd : lane_fds)
      if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
  }
  endpoint_->peer_failed(this);
}

}  // namespace tether::core
