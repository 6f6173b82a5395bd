// PeerState, user side: a post is checked, then queued for the lanes (or handed to the rendezvous);
// errors finish the transfer before any byte moves. Cancelling takes a transfer back out.
#include <cstring>

#include "core/endpoint_impl.h"
#include "core/peer.h"

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

// Why a send or recv cannot use [offset, +length) of `local` (ok: it can).
Status check_two_sided(OpKind op, const Region& local, uint64_t offset, uint64_t length) {
  const auto& l = local.state();
  if (!l || !l->live.load()) return Status(Code::kNotFound, std::string(op_name(op)) + ": local region is not registered");
  if (op == OpKind::kRecv && l->readonly) return Status(Code::kAccessDenied, "recv into a read-only region");
  if (!in_bounds(offset, length, l->size))
    return Status(Code::kOutOfRange, std::string(op_name(op)) + ": range exceeds local region of " + std::to_string(l->size) + " bytes");
  return Status::ok();
}

// A send's or recv's transfer over [offset, +length) of `local`, which it pins. A send knows its bytes
// (its segment's desc_length bounds its chunks); a recv learns them when a send matches it.
std::shared_ptr<TransferState> two_sided(OpKind op, const Region& local, uint64_t offset, uint64_t length, uint64_t tag) {
  const auto& l = local.state();
  auto t = std::make_shared<TransferState>();
  t->op = op;
  t->tag = tag;
  const uint64_t known = op == OpKind::kSend ? length : 0;
  t->bytes = known;
  t->runs.push_back(Run{0, 0, 0, known, l.get(), nullptr});
  t->segments.push_back(Segment{l->base + offset, length, 0, 0});
  t->local_pins.push_back(l);
  l->pins.fetch_add(1);
  return t;
}

// Both ends of block `b` inside their ranges, without a branch: the store loop checks every block and
// looks for the first bad one only when some block was out of range.
inline bool fits(const Block& b, uint64_t local_size, uint64_t remote_length) {
  return in_bounds(b.local_offset, b.length, local_size) & in_bounds(b.remote_offset, b.length, remote_length);
}

// Checks each block of `run` against both ranges and stores it as a segment (zero-length blocks are
// skipped); `at(j)` reads block j. Returns the index of the first block out of range, else run.n. One
// pass writing through a pointer into room made once (no zeroing: Segments): push_back per block
// re-read the vector's end after every store. Not inlined: inside post_rma its values were spilled.
template <typename At>
[[gnu::noinline]] size_t store_blocks(const At& at, const BlockRun& run, const RegionState& l, uint32_t index,
                                      Segments& segs, uint64_t* bytes) {
  const RemoteRegion& rr = *run.remote;
  const uint64_t lsize = l.size, rlen = rr.length, roff = rr.offset;
  uint8_t* const base = l.base;
  const size_t before = segs.size();
  segs.resize(before + run.n);
  Segment* out = segs.data() + before;
  uint64_t sum = 0;
  bool ok = true;
  for (size_t j = 0; j < run.n; ++j) {
    const Block b = at(j);
    ok &= fits(b, lsize, rlen);
    *out = Segment{base + b.local_offset, b.length, roff + b.remote_offset, index};
    out += b.length != 0;
    sum += b.length;
  }
  segs.resize(size_t(out - segs.data()));
  if (!ok) {
    size_t j = 0;
    while (fits(at(j), lsize, rlen)) ++j;
    return j;
  }
  *bytes += sum;
  return run.n;
}

// store_blocks over whichever form the run's blocks take (a table, or columns: BlockRun).
size_t store_run(const BlockRun& run, const RegionState& l, uint32_t index, Segments& segs, uint64_t* bytes) {
  if (run.blocks) return store_blocks([&](size_t j) { return run.blocks[j]; }, run, l, index, segs, bytes);
  const uint64_t *lo = run.local_offsets, *ro = run.remote_offsets;
  if (run.lengths)
    return store_blocks([&](size_t j) { return Block{lo[j], ro[j], run.lengths[j]}; }, run, l, index, segs, bytes);
  const uint64_t len = run.length;
  return store_blocks([&](size_t j) { return Block{lo[j], ro[j], len}; }, run, l, index, segs, bytes);
}

}  // namespace

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

Transfer PeerState::post_rma(OpKind op, const BlockRun* runs, size_t nruns, const char* noun, std::string notify) {
  trace::mark(trace::Event::kCalled, 0);
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
  t->runs.reserve(nruns);
  t->remotes.reserve(nruns);  // runs point into it: it must never reallocate
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
    const uint32_t index = uint32_t(t->runs.size());
    t->runs.push_back(Run{rr.region_id, rr.key, rr.offset, rr.length, l.get(), &t->remotes.back()});
    // Every block's bounds, before any byte moves.
    if (const size_t j = store_run(run, *l, index, t->segments, &bytes); j < run.n)
      return refuse(first + j, Code::kOutOfRange, out_of_range(run.at(j), l->size, rr.length));
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

Transfer PeerState::post_send(const Region& local, uint64_t offset, uint64_t length, uint64_t tag) {
  if (failed()) return invalid(self(), OpKind::kSend, error());
  if (Status s = check_two_sided(OpKind::kSend, local, offset, length); !s.is_ok()) return invalid(self(), OpKind::kSend, s);
  auto t = two_sided(OpKind::kSend, local, offset, length, tag);
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
  if (Status s = check_two_sided(OpKind::kRecv, local, offset, length); !s.is_ok()) return invalid(self(), OpKind::kRecv, s);
  auto t = two_sided(OpKind::kRecv, local, offset, length, tag);
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

void PeerState::enqueue(TransferState* t) {
  // Where the local bytes live (the first segment's region: a transfer's blocks share one local
  // region in the common case), so a transport can wake the lanes on the NICs nearest them.
  const Run* first = t->segments.empty() ? nullptr : &t->run_of(t->segments.front());
  const int device = first ? device_of(*first) : -1;
  const RemoteRegion* remote = first ? first->remote : nullptr;
  // As next_chunk() will cut it (roughly: for how many lanes to wake).
  const uint64_t chunk = read_chunk_bytes(*t, device, remote, info_.chunk_bytes);
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

}  // namespace tether::core
