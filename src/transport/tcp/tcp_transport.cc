// The tcp transport object and its progress threads. Each thread owns a set of lanes (of any peers):
// it waits on their sockets with epoll, runs their rx and tx state machines (tcp_lane.cc), polls their
// GPU copies (tcp_staging.cc), and retires lanes that died.
#include "transport/tcp/tcp_transport.h"

#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <mutex>
#include <thread>

#include "core/trace.h"
#include "sys/cpu.h"
#include "sys/thread_name.h"
#include "transport/tcp/tcp_lane.h"

namespace tether::transport {

namespace tcp {

namespace trace = core::trace;
using sys::cpu_relax;

class ProgressThread {
 public:
  ProgressThread(Host* host, uint32_t index) : host_(host), index_(index) {
    epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
    evfd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = nullptr;
    ::epoll_ctl(epfd_, EPOLL_CTL_ADD, evfd_, &ev);
    thread_ = std::thread([this] { run(); });
    while (!started_.load(std::memory_order_acquire)) std::this_thread::yield();  // pinned before we return
  }
  ~ProgressThread() {
    stop();
    ::close(epfd_);
    ::close(evfd_);
  }

  void adopt(std::shared_ptr<Lane> lane) {
    lane->thread = this;
    {
      std::lock_guard lock(mu_);
      incoming_.push_back(std::move(lane));
    }
    write_eventfd();
  }
  void wake() {
    work_hint_.store(true, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst)) write_eventfd();
  }
  // GPUs whose memory is registered (a bit per device): this thread's lanes prepare staging for them.
  void want_gpus(uint64_t gpus) {
    want_gpus_.store(gpus, std::memory_order_relaxed);
    wake();
  }
  void stop() {
    if (stop_.exchange(true)) return;
    write_eventfd();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void write_eventfd() {
    uint64_t one = 1;
    ssize_t rc = ::write(evfd_, &one, sizeof one);
    (void)rc;
  }

  void run();
  void on_events(const epoll_event* events, int n);
  void prepare_wanted_gpus();
  bool serve_lanes(uint64_t* smallest_copy);
  void retire_dead();
  void take_incoming();
  void update_lowat(Lane& l);
  void update_events(Lane& l);
  void do_rx(Lane& l);
  void do_tx(Lane& l);
  void retire(Lane& l);
  uint64_t moved() const;  // bytes through this thread's lanes' sockets so far
  uint64_t small_requests() const;  // small requests this thread's lanes served so far
  bool nothing_under_way() const;
  uint64_t copy_steps() const;  // staged GPU copies of this thread's lanes started + finished so far
  int nap(epoll_event* events, int max, uint32_t us);

  Host* host_;
  const uint32_t index_;
  int epfd_ = -1, evfd_ = -1;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> started_{false};
  std::atomic<bool> sleeping_{false};
  std::atomic<bool> work_hint_{false};
  std::atomic<uint64_t> want_gpus_{0};
  uint64_t prepared_gpus_ = 0;  // what this thread's lanes were prepared for
  std::mutex mu_;
  std::vector<std::shared_ptr<Lane>> incoming_;
  std::vector<std::shared_ptr<Lane>> lanes_;  // owned by this thread only
};

uint64_t ProgressThread::moved() const {
  uint64_t b = 0;
  for (auto& l : lanes_) b += l->io_bytes.load(std::memory_order_relaxed);
  return b;
}

uint64_t ProgressThread::small_requests() const {
  uint64_t n = 0;
  for (auto& l : lanes_) n += l->small_requests.load(std::memory_order_relaxed);
  return n;
}

// No lane of this thread has bytes to send, copies in flight or chunks of its own unanswered.
bool ProgressThread::nothing_under_way() const {
  for (auto& l : lanes_)
    if (l->tx.backlog.load(std::memory_order_relaxed) || l->stage.inflight.load(std::memory_order_relaxed) > 0 ||
        l->peer->has_work() || l->peer->unanswered_bytes() > 0)
      return false;
  return true;
}

uint64_t ProgressThread::copy_steps() const {
  uint64_t n = 0;
  for (auto& l : lanes_) n += l->stage.steps.load(std::memory_order_relaxed);
  return n;
}

// epoll_wait for at most `us` microseconds (epoll_wait's own timeout counts whole milliseconds).
int ProgressThread::nap(epoll_event* events, int max, uint32_t us) {
  const timespec ts{time_t(us / 1000000), long(us % 1000000) * 1000};
  int n = ::epoll_pwait2(epfd_, events, max, &ts, nullptr);
  if (n < 0 && errno == ENOSYS) {  // kernels before 5.11: wait on the epoll fd itself, then collect
    pollfd p{epfd_, POLLIN, 0};
    ::ppoll(&p, 1, &ts, nullptr);
    n = ::epoll_wait(epfd_, events, max, 0);
  }
  return n < 0 ? 0 : n;  // EINTR: an empty turn
}

void ProgressThread::update_lowat(Lane& l) {
  // A staged payload wakes a napping thread by the 256 KiB, not per segment. Only rx's owner may read
  // rx.left: a stale one could set a mark above what is still to come, and the last bytes would wait
  // out epoll's 1 s. While a waiter owns rx the thread comes back without sleeping until it can lower it.
  if (!l.try_own_rx()) {
    if (l.rx.lowat != 1) work_hint_.store(true, std::memory_order_relaxed);
    return;
  }
  // Never more than is still to come, nor than a quarter of a small socket buffer (the kernel does
  // not grow a buffer set with SO_RCVBUF to fit the low mark).
  const uint32_t buf = host_->config().socket_buffer;
  const uint64_t most = buf ? std::min<uint64_t>(kStagedLowat, std::max<uint32_t>(buf / 4, 1)) : kStagedLowat;
  const int lowat = l.rx.state == RxState::kPayload && l.rx.device >= 0 ? int(std::min<uint64_t>(l.rx.left, most)) : 1;
  if (lowat != l.rx.lowat && lowat > 0) {  // still owning rx: a waiter cannot move the state under it
    ::setsockopt(l.fd, SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof lowat);
    l.rx.lowat = lowat;
  }
  l.disown_rx();
}

void ProgressThread::update_events(Lane& l) {
  update_lowat(l);
  uint32_t ev = EPOLLRDHUP;
  if (!l.rx.paused.load(std::memory_order_relaxed)) ev |= EPOLLIN;
  if (l.tx.backlog.load(std::memory_order_relaxed)) ev |= EPOLLOUT;
  if (ev == l.epoll_events) return;
  epoll_event e{};
  e.events = ev;
  e.data.ptr = &l;
  ::epoll_ctl(epfd_, EPOLL_CTL_MOD, l.fd, &e);
  l.epoll_events = ev;
}

void ProgressThread::take_incoming() {
  std::vector<std::shared_ptr<Lane>> fresh;
  {
    std::lock_guard lock(mu_);
    fresh.swap(incoming_);
  }
  for (auto& l : fresh) {
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.ptr = l.get();
    l->epoll_events = ev.events;
    ::epoll_ctl(epfd_, EPOLL_CTL_ADD, l->fd, &ev);
    if (prepared_gpus_) prepare_staging(*l, host_, prepared_gpus_);
    lanes_.push_back(std::move(l));
  }
}

void ProgressThread::run() {
  sys::name_this_thread("tcp", int(index_));
  host_->pin_progress_thread(index_);
  started_.store(true, std::memory_order_release);
  epoll_event events[64];
  // Within busy_poll_us of the last event of small traffic or of staged GPU copies the thread polls
  // instead of sleeping: an answer usually follows soon, and a wake-up costs more than a small transfer.
  using Clock = std::chrono::steady_clock;
  const auto busy = std::chrono::microseconds(host_->config().busy_poll_us);
  auto spin_until = Clock::now();  // the thread polls until then (busy polling, or the request spin)
  // Staged GPU copies keep the thread polling, but a turn that did nothing (no socket event, no byte
  // moved, no copy started or finished) is followed by a short nap: spinning cost CPU and gained nothing.
  // Not while a tiny copy (kTinyCopy) is in flight: it ends sooner than a nap would.
  const auto tiny_poll = std::chrono::microseconds(kTinyCopyPollUs);
  auto last_step = Clock::now();  // when a staged copy last started or finished (by any thread)
  uint64_t seen_steps = 0;
  ::prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // 1 us: the default 50 us slack would stretch a nap
  bool copies = false;  // the last turn left staged GPU copies in flight: the next one polls them
  bool napping = false;  // ... and did nothing else: the next wait is a nap, not a spin
  // Without busy polling, a thread that served a small request (and has nothing else under way) still
  // polls kRequestSpinUs for the next: its wake-up would cost more than the request (the waiter on the
  // other side spins kSpinUs for the answer alike).
  const auto request_spin = std::chrono::microseconds(busy.count() == 0 ? kRequestSpinUs : 0);
  while (!stop_.load(std::memory_order_acquire)) {
    sleeping_.store(true, std::memory_order_seq_cst);
    const bool hinted = work_hint_.exchange(false, std::memory_order_seq_cst);
    const bool spinning = Clock::now() < spin_until;
    const bool nap_now = napping && !hinted;
    int n = nap_now ? nap(events, 64, kStagingNapUs) : ::epoll_wait(epfd_, events, 64, hinted || spinning || copies ? 0 : 1000);
    sleeping_.store(false, std::memory_order_relaxed);
    if (n > 0 && !hinted && !spinning && !copies) trace::mark(trace::Event::kWake, index_, 0, uint32_t(n));
    const uint64_t moved_before = moved();
    const uint64_t steps_before = copy_steps();
    const uint64_t served_before = request_spin.count() > 0 ? small_requests() : 0;
    if (n == 0 && spinning && !hinted && !copies) sched_yield();  // copies yield below
    on_events(events, n);
    prepare_wanted_gpus();
    napping = false;
    uint64_t smallest = UINT64_MAX;  // the smallest latest copy of a lane with staged GPU copies in flight
    const bool staging = serve_lanes(&smallest);
    copies = staging;
    if (staging) {
      // Each chunk's next step follows its copy within microseconds, so copies in flight keep the thread
      // polling; only small copies (up to kSmallCopy) also keep it spinning for busy_poll_us after them,
      // as spinning at the end of every large transfer cost CPU for no gain.
      const auto now = Clock::now();
      if (smallest <= kSmallCopy) spin_until = now + busy;
      const uint64_t steps = copy_steps();
      if (steps != seen_steps) last_step = now;
      seen_steps = steps;
      const bool tiny = smallest <= kTinyCopy && now - last_step < tiny_poll;
      if (!tiny && n == 0 && moved() == moved_before && steps == steps_before) napping = true;
    } else if (n > 0 && busy.count() > 0) {
      // Otherwise only small traffic spins: a bulk flow's next event comes from its own socket
      // (data in, or EPOLLOUT for unsent bytes).
      bool backlog = false;
      for (auto& l : lanes_) backlog |= l->tx.backlog.load(std::memory_order_relaxed);
      if (moved() - moved_before < kSpinAfterBytes && !backlog) spin_until = Clock::now() + busy;
    } else if (n > 0 && request_spin.count() > 0 && small_requests() != served_before && nothing_under_way()) {
      spin_until = Clock::now() + request_spin;
    }
    retire_dead();
  }
  take_incoming();
  for (auto& l : lanes_) {
    kill_lane(*l, Status(Code::kCancelled, "endpoint closed"));
    retire(*l);
  }
  lanes_.clear();
}

// Sockets epoll reported ready are read; the eventfd brings lanes to adopt.
void ProgressThread::on_events(const epoll_event* events, int n) {
  for (int i = 0; i < n; ++i) {
    auto* l = static_cast<Lane*>(events[i].data.ptr);
    if (!l) {
      uint64_t v;
      ssize_t rc = ::read(evfd_, &v, sizeof v);
      (void)rc;
      take_incoming();
      continue;
    }
    if (!l->dead.load(std::memory_order_relaxed) && (events[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP | EPOLLRDHUP)))
      do_rx(*l);
  }
}

void ProgressThread::prepare_wanted_gpus() {
  const uint64_t want = want_gpus_.load(std::memory_order_relaxed);
  if (want == prepared_gpus_) return;
  for (auto& l : lanes_)
    if (!l->dead.load(std::memory_order_relaxed)) prepare_staging(*l, host_, want & ~prepared_gpus_);
  prepared_gpus_ = want;
}

// Sends what each live lane has, polls its GPU copies, resumes what backpressure held back and updates
// what epoll watches for it. Returns whether a lane has staged GPU copies in flight (*smallest_copy: the
// fewest bytes the latest copy of such a lane moved).
bool ProgressThread::serve_lanes(uint64_t* smallest_copy) {
  bool staging = false;
  for (auto& l : lanes_) {
    if (l->dead.load(std::memory_order_relaxed)) continue;
    if (l->peer->failed()) {
      kill_lane(*l, l->peer->error());
      continue;
    }
    do_tx(*l);
    if (l->stage.inflight.load(std::memory_order_relaxed) > 0) {  // GPU copies in flight: poll them
      staging = true;
      *smallest_copy = std::min(*smallest_copy, l->stage.latest_copy.load(std::memory_order_relaxed));
      if (l->try_own_rx()) {
        if (l->stage.gpu_rx_count > 0) complete_gpu_rx(*l, host_);
        l->disown_rx();
      }
    }
    // Resume what backpressure held back; rx may pause again at once, so loop a few times and,
    // if it still could resume, come back without sleeping.
    for (int k = 0; k < 8 && l->rx.paused.load(std::memory_order_relaxed) && !l->answers.full() &&
                    !l->dead.load(std::memory_order_relaxed);
         ++k) {
      l->rx.paused.store(false, std::memory_order_relaxed);
      do_rx(*l);
      do_tx(*l);
    }
    if (l->rx.paused.load(std::memory_order_relaxed) && !l->answers.full()) work_hint_.store(true, std::memory_order_relaxed);
    if (!l->dead.load(std::memory_order_relaxed)) update_events(*l);
  }
  return staging;
}

void ProgressThread::retire_dead() {
  for (size_t i = 0; i < lanes_.size();) {
    if (lanes_[i]->dead.load(std::memory_order_relaxed)) {
      retire(*lanes_[i]);
      lanes_[i] = std::move(lanes_.back());
      lanes_.pop_back();
    } else {
      ++i;
    }
  }
}

void ProgressThread::do_rx(Lane& l) {
  if (!l.try_own_rx()) return;  // a waiting thread is reading its answer; it gives rx back at once
  receive(l, host_);
  l.disown_rx();
}

void ProgressThread::retire(Lane& l) {
  ::epoll_ctl(epfd_, EPOLL_CTL_DEL, l.fd, nullptr);
  while (!l.try_own_tx()) cpu_relax();     // a user thread may be mid-send; it holds tx for one sendmsg
  while (!l.try_own_rx()) cpu_relax();  // ... or reading its answer; it holds rx for one pass
  // Copies still running may touch user memory: they finish before any region is let go.
  if (l.stage.tx_ring) l.stage.tx_ring->wait_all();
  if (l.stage.rx_ring) l.stage.rx_ring->wait_all();
  if (l.rx.pin) { l.rx.pin->unpin(); l.rx.pin = nullptr; }
  if (l.rx.recv) {
    l.peer->abandon_send_data(l.rx.recv);
    l.rx.recv = nullptr;
  }
  for (uint32_t i = 0; i < l.rx.nfrags; ++i)  // a batch cut short (a read's answer pins nothing here)
    if (l.rx.frag_pin[i]) l.rx.frag_pin[i]->unpin();
  l.rx.nfrags = 0;
  for (; l.stage.gpu_rx_count > 0; --l.stage.gpu_rx_count, l.stage.gpu_rx_head = (l.stage.gpu_rx_head + 1) % kStageSlots) {
    GpuRx& g = l.stage.gpu_rx[l.stage.gpu_rx_head];
    if (g.pin) g.pin->unpin();
    for (uint32_t i = 0; i < g.npins; ++i) l.stage.gpu_rx_pins[l.stage.gpu_rx_head][i]->unpin();
    if (g.recv) {
      g.recv->record_error(l.peer->error());
      g.recv->release();
    }
  }
  auto drop = [](const TxItem& it) {
    if (it.pin) it.pin->unpin();
    if (it.batch) it.batch->release();
  };
  for (size_t i = 0; i < l.tx.count; ++i) drop(l.tx.ring[(l.tx.head + i) % kTxRing]);
  l.tx.count = 0;
  l.note_starving();  // no longer counted in g_starving
  TxItem a;
  while (l.answers.pop(&a)) drop(a);
  l.peer->release_lane(l.index, Code::kConnectionLost);
  // tx and rx stay owned: the lane is dead and no other thread touches its socket. The fd is closed
  // when the peer's last hold goes (Link::hold), so its number is not reused while another
  // thread may still shut it down.
  l.peer->let_go();
}

void ProgressThread::do_tx(Lane& l) {
  if (!l.try_own_tx()) return;  // a user thread is sending inline; it re-checks after letting go
  Status err;
  const bool ok = drive_tx(l, host_, &err);
  l.disown_tx();
  if (!ok) kill_lane(l, err);
}

}  // namespace tcp

// ---------------------------------------------------------------- transport

using tcp::Lane;

namespace {
// The transport's state of one peer (Link::transport_state): weak references, lanes own the peer.
struct TcpPeerLanes {
  std::vector<std::weak_ptr<Lane>> lanes;
};
}  // namespace

TcpTransport::TcpTransport(Host* host) : host_(host) {
  const uint32_t n = std::max<uint32_t>(1, host->config().channels);
  for (uint32_t i = 0; i < n; ++i) threads_.push_back(std::make_unique<tcp::ProgressThread>(host, i));
}

TcpTransport::~TcpTransport() { stop(); }

Caps TcpTransport::caps() const {
  Caps c;
  c.uses_tcp_lanes = true;
  c.staged_gpu = true;
  c.batch_fragments = wire::kMaxFragments;
  // Reads are paced like writes (kLaneQueueChunks chunks' bytes per socket): a lane asks for more only
  // as answers come in, so a transfer's chunks spread over every lane and faster lanes still take more.
  c.read_depth = uint32_t(tcp::kLaneQueueChunks);
  c.wait_naps = true;  // every lane's answers are landed by its thread (ARCHITECTURE.md, "Waking up")
  c.batch_reads = true;  // one request and one answer for up to kMaxFragments small reads
  c.gpu_batch_chunks = tcp::kGpuBatchChunks;
  c.pull_reads = true;  // large staged GPU reads are pushed by the target (wire::kPull)
  c.lanes_hold = true;  // attach() takes a hold per lane; retiring the lane lets go
  return c;
}

Status TcpTransport::register_region(core::RegionState& region, std::string*) {
  if (region.kind != MemoryKind::kCuda || region.device < 0 || region.device >= 64) return Status::ok();
  const uint64_t bit = uint64_t(1) << region.device;
  const uint64_t before = gpus_.fetch_or(bit, std::memory_order_relaxed);
  if (!(before & bit))
    for (auto& t : threads_) t->want_gpus(before | bit);
  return Status::ok();
}

uint32_t TcpTransport::lanes_for(std::string_view) const {
  return host_->config().channels;
}

Status TcpTransport::attach(const std::shared_ptr<Link>& peer, const std::vector<int>& fds, std::string_view,
                            bool, int64_t) {
  auto state = std::make_shared<TcpPeerLanes>();
  std::vector<std::shared_ptr<Lane>> lanes;
  std::vector<uint32_t> thread_of(fds.size());
  std::vector<uint32_t> on_nic;  // lanes of this peer per NIC so far
  for (uint32_t i = 0; i < fds.size(); ++i) {
    auto lane = std::make_shared<Lane>();
    lane->peer = peer;
    lane->index = i;
    lane->fd = fds[i];
    lane->ctr = &peer->lane_counters(i);
    const core::LanePath& path = peer->lane_paths[i];
    lane->nic_ctr = path.nic_counters;
    // Lanes on one NIC go to the threads serving that NIC (pinned near it); the rest by channel.
    uint32_t earlier = 0;
    if (path.nic >= 0) {
      if (on_nic.size() <= size_t(path.nic)) on_nic.resize(size_t(path.nic) + 1, 0);
      earlier = on_nic[size_t(path.nic)]++;
    }
    thread_of[i] = host_->thread_for_lane(i, path.nic, earlier) % threads_.size();
    (void)peer->hold();  // let go when its thread retires the lane (the control side holds the peer now)
    state->lanes.push_back(lane);
    lanes.push_back(std::move(lane));
  }
  peer->transport_state = state;  // weak references: lanes own the peer, not the other way round
  for (uint32_t i = 0; i < lanes.size(); ++i) threads_[thread_of[i]]->adopt(std::move(lanes[i]));
  return Status::ok();
}

void TcpTransport::wake(Link* peer, uint64_t chunks, int) {
  auto* state = static_cast<TcpPeerLanes*>(peer->transport_state.get());
  if (chunks <= 1 && state && !state->lanes.empty()) {
    // A one-chunk transfer is sent by the posting thread itself when a lane's tx is free (a wake-up is
    // much of a small write's latency), from the quietest lane, whose threads are still awake.
    const size_t n = state->lanes.size();
    const uint32_t first = peer->quietest_lane();
    for (size_t i = 0; i < n; ++i) {
      std::shared_ptr<Lane> l = state->lanes[(first + i) % n].lock();
      if (!l || l->dead.load(std::memory_order_relaxed) || !l->try_own_tx()) continue;
      Status err;
      const bool ok = !l->dead.load(std::memory_order_relaxed) && tcp::drive_tx(*l, host_, &err);
      const bool backlog = l->tx.count > 0;
      l->disown_tx();
      if (!ok) {
        tcp::kill_lane(*l, err);
        l->thread->wake();  // it retires the lane
      } else if (backlog || !l->answers.empty() || peer->has_work()) {
        l->thread->wake();  // the progress thread arms EPOLLOUT / sends what arrived meanwhile
      }
      return;
    }
  }
  // A one-chunk transfer wakes one thread, not all: on few cores a spurious wake costs a core.
  const size_t n = threads_.size();
  const size_t k = size_t(std::min<uint64_t>(std::max<uint64_t>(chunks, 1), n));
  const uint32_t first = next_wake_.fetch_add(1, std::memory_order_relaxed);
  for (size_t i = 0; i < k; ++i) threads_[(first + i) % n]->wake();
}

void TcpTransport::progress_lane(Link* peer, uint32_t lane) {
  auto* state = static_cast<TcpPeerLanes*>(peer->transport_state.get());
  if (!state || lane >= state->lanes.size()) return;
  std::shared_ptr<Lane> l = state->lanes[lane].lock();
  if (!l || l->dead.load(std::memory_order_relaxed) || !l->try_own_rx()) return;
  if (!l->dead.load(std::memory_order_relaxed)) tcp::receive(*l, host_, tcp::kPollBudget);
  // The progress thread may sleep in epoll (up to 1 s) unaware of what this read left (a GPU copy to
  // poll, a staged payload half in, answers to send), and the caller may stop polling at any time.
  const bool left = l->stage.gpu_rx_count > 0 || (l->rx.state == tcp::RxState::kPayload && l->rx.device >= 0);
  l->disown_rx();
  if (left || !l->answers.empty() || l->rx.paused.load(std::memory_order_relaxed)) l->thread->wake();
}

void TcpTransport::detach(Link& peer) { peer.transport_state.reset(); }

void TcpTransport::stop() {
  if (stopped_.exchange(true)) return;
  for (auto& t : threads_) t->stop();
}

}  // namespace tether::transport
