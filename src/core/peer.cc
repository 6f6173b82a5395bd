// PeerState's life: construction, the holds that keep its sockets and transport state alive, and
// failure (a lane, or the whole peer).
#include "core/peer.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "core/endpoint_impl.h"
#include "sys/net.h"
#include "transport/transport.h"

namespace tether::core {

PeerState::PeerState(std::shared_ptr<EndpointImpl> endpoint, PeerInfo info, uint32_t lanes,
                     transport::Transport* transport)
    : Link(std::move(info), lanes, transport),
      endpoint_(std::move(endpoint)),
      batch_max_(transport ? transport->caps().batch_fragments : 0),
      batch_reads_(transport && transport->caps().batch_reads),
      gpu_batch_chunks_(transport ? std::max<uint32_t>(1, transport->caps().gpu_batch_chunks) : 1),
      gpu_chunk_(transport ? transport->caps().gpu_chunk_bytes : 0),
      read_depth_(transport ? transport->caps().read_depth : 0),
      staged_gpu_(transport && transport->caps().staged_gpu),
      wait_naps_(transport && transport->caps().wait_naps),
      pull_reads_(transport && transport->caps().pull_reads),
      lane_window_(std::max<uint32_t>(1, endpoint_->config().window / std::max<uint32_t>(1, lanes))),
      last_heard_ms_(sys::now_ms()) {
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

uint32_t PeerState::busy_poll_us() const { return endpoint_->config().busy_poll_us; }

uint32_t PeerState::quietest_lane() const {
  std::lock_guard lock(mu_);
  uint32_t best = 0;
  for (uint32_t i = 1; i < lanes_; ++i)
    if (lane_dead_[best] || (!lane_dead_[i] && lane_inflight_[i] < lane_inflight_[best])) best = i;
  return best;
}

// Both run on a waiting application's thread: whatever context the transport makes current is undone.
void PeerState::progress_lane(uint32_t lane) {
  if (failed()) return;
  gpu::KeepContext keep;
  if (Hold h{this}) transport->progress_lane(this, lane);
}

void PeerState::finish_here() {
  if (failed()) return;
  gpu::KeepContext keep;
  if (Hold h{this}) transport->finish_here(this);
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
      if (!survivors) {
        orphans.push_back(free_slot(i));
        continue;
      }
      ++s.gen;  // an answer to the lost copy can no longer match
      s.lane = UINT32_MAX;
      resend_.push_back(i);
      ++moved;
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

void PeerState::count_finished(bool ok) { endpoint_->count_finished(ok); }

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
    for (uint32_t i : resend_) release.push_back(free_slot(i));  // waiting for a surviving lane: none now
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
