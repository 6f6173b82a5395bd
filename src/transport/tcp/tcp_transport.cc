#include "transport/tcp/tcp_transport.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/endpoint_impl.h"
#include "core/peer.h"
#include "core/region.h"

namespace tether::transport {

using core::ChunkOp;
using core::PeerState;
using core::RegionState;
using core::TransferState;
using wire::FrameHeader;
using wire::FrameType;

namespace {

constexpr size_t kRxBuffer = 64 << 10;
constexpr size_t kTxRing = 1024;             // frames a lane holds unsent (chunks + answers)
constexpr size_t kAnswerRing = 512;          // answers produced by rx, waiting for the tx owner
constexpr size_t kMaxIov = 64;
constexpr uint64_t kRxBudget = 16ull << 20;  // bytes per lane per turn, for fairness
constexpr uint64_t kTxBudget = 16ull << 20;
constexpr uint64_t kPollBudget = 256 << 10;  // a waiting thread reads little: it wants its answer

struct TxItem {
  FrameHeader hdr;
  const uint8_t* payload;
  uint64_t length;
  RegionState* pin;  // read responses keep their region pinned until sent
};

enum class RxState { kHeader, kPayload, kDiscard };

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// Single producer (the lane's rx, on its progress thread), single consumer (whoever owns tx).
class AnswerRing {
 public:
  bool full() const { return tail_.load(std::memory_order_relaxed) - head_.load(std::memory_order_acquire) >= kAnswerRing; }
  bool empty() const { return tail_.load(std::memory_order_seq_cst) == head_.load(std::memory_order_relaxed); }
  void push(const TxItem& it) {
    const size_t t = tail_.load(std::memory_order_relaxed);
    items_[t % kAnswerRing] = it;
    tail_.store(t + 1, std::memory_order_seq_cst);
  }
  bool pop(TxItem* out) {
    const size_t h = head_.load(std::memory_order_relaxed);
    if (h == tail_.load(std::memory_order_acquire)) return false;
    *out = items_[h % kAnswerRing];
    head_.store(h + 1, std::memory_order_release);
    return true;
  }

 private:
  std::vector<TxItem> items_ = std::vector<TxItem>(kAnswerRing);
  std::atomic<size_t> head_{0}, tail_{0};
};

}  // namespace

class ProgressThread;

// One data socket to one peer. Receive state belongs to the progress thread; send state belongs to
// whoever holds `tx_owned` (the progress thread, or a user thread sending a small transfer inline).
struct Lane {
  std::shared_ptr<PeerState> peer;
  ProgressThread* thread = nullptr;
  uint32_t index = 0;
  int fd = -1;
  std::atomic<bool> dead{false};
  std::atomic<bool> tx_owned{false};
  std::atomic<bool> tx_backlog{false};  // unsent bytes wait for EPOLLOUT
  AnswerRing answers;

  // tx: owner only
  std::vector<TxItem> tx = std::vector<TxItem>(kTxRing);
  size_t tx_head = 0, tx_count = 0;
  uint64_t tx_head_sent = 0;   // bytes of the head item (header + payload) already sent
  uint64_t tx_unsent = 0;      // bytes queued and not yet sent

  // rx: progress thread only
  std::unique_ptr<uint8_t[]> rx = std::make_unique<uint8_t[]>(kRxBuffer);
  size_t rx_begin = 0, rx_end = 0;
  RxState rx_state = RxState::kHeader;
  FrameHeader rx_hdr{};
  uint8_t* rx_dest = nullptr;  // null while discarding
  uint64_t rx_left = 0;
  uint8_t rx_status = 0;
  RegionState* rx_pin = nullptr;
  TransferState* rx_recv = nullptr;
  std::atomic<bool> rx_paused{false};   // no room to answer: stop reading until answers drain
  std::atomic<bool> rx_owned{false};    // the progress thread, or a thread polling for its answer
  uint32_t epoll_events = 0;            // progress thread only

  bool try_own() { return !tx_owned.exchange(true, std::memory_order_acquire); }
  void disown() { tx_owned.store(false, std::memory_order_seq_cst); }
  bool try_own_rx() { return !rx_owned.exchange(true, std::memory_order_acquire); }
  void disown_rx() { rx_owned.store(false, std::memory_order_release); }
  void queue(const TxItem& it) {
    tx[(tx_head + tx_count) % kTxRing] = it;
    ++tx_count;
    tx_unsent += sizeof(FrameHeader) + it.length;
  }
};

struct TcpPeerLanes {
  std::vector<std::weak_ptr<Lane>> lanes;
  std::atomic<uint32_t> next{0};
};

namespace {

// Sends what the lane holds (answers first, then chunks it pulls while its socket keeps up).
// Caller owns tx. Returns false if the socket failed.
bool drive_tx(Lane& l, core::EndpointImpl* ep, Status* error) {
  const uint64_t chunk = ep->config().chunk_bytes;
  uint64_t budget = kTxBudget;
  auto& stats = ep->stats();
  for (;;) {
    TxItem a;
    while (l.tx_count < kTxRing && l.answers.pop(&a)) l.queue(a);
    // Pull only when what this socket holds has (almost) drained: faster sockets pull more.
    ChunkOp op;
    while (l.tx_unsent < chunk && l.tx_count < kTxRing / 2 && l.peer->next_chunk(l.index, &op))
      l.queue(TxItem{op.hdr, op.payload, op.length, nullptr});
    if (l.tx_count == 0 || budget == 0) break;

    iovec iov[kMaxIov];
    size_t niov = 0;
    uint64_t skip = l.tx_head_sent;
    for (size_t i = 0; i < l.tx_count && niov + 2 <= kMaxIov; ++i) {
      TxItem& it = l.tx[(l.tx_head + i) % kTxRing];
      if (skip < sizeof(FrameHeader)) {
        iov[niov++] = {reinterpret_cast<uint8_t*>(&it.hdr) + skip, sizeof(FrameHeader) - skip};
        skip = 0;
      } else {
        skip -= sizeof(FrameHeader);
      }
      if (it.length > skip) iov[niov++] = {const_cast<uint8_t*>(it.payload) + skip, it.length - skip};
      skip = 0;
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = niov;
    ssize_t n = ::sendmsg(l.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) break;
      *error = Status(Code::kConnectionLost, "data connection to peer '" + l.peer->info().name + "': " + std::strerror(errno));
      return false;
    }
    uint64_t sent = uint64_t(n);
    budget -= std::min(budget, sent);
    l.tx_unsent -= sent;
    while (sent > 0) {
      TxItem& it = l.tx[l.tx_head];
      const uint64_t total = sizeof(FrameHeader) + it.length;
      const uint64_t take = std::min(sent, total - l.tx_head_sent);
      l.tx_head_sent += take;
      sent -= take;
      if (l.tx_head_sent == total) {
        if (it.length > 0) {
          stats.bytes_sent.fetch_add(it.length, std::memory_order_relaxed);
          stats.chunks_sent.fetch_add(1, std::memory_order_relaxed);
        }
        if (it.pin) it.pin->unpin();
        l.tx_head = (l.tx_head + 1) % kTxRing;
        --l.tx_count;
        l.tx_head_sent = 0;
      }
    }
  }
  l.tx_backlog.store(l.tx_count > 0, std::memory_order_relaxed);
  return true;
}

// A lane whose socket failed: fail its peer (shutting down every socket of it) once.
void kill_lane(Lane& l, Status why) {
  if (l.dead.exchange(true)) return;
  l.peer->fail(std::move(why));
}

bool on_header(Lane& l, core::EndpointImpl* ep);
void payload_done(Lane& l, core::EndpointImpl* ep);

// ---------------------------------------------------------------- receive

// Reads and handles what the lane's socket holds, up to `budget` bytes. Caller owns rx.
void receive(Lane& l, core::EndpointImpl* ep, uint64_t budget = kRxBudget) {
  while (!l.dead.load(std::memory_order_relaxed) && !l.rx_paused.load(std::memory_order_relaxed) && budget > 0) {
    const size_t buffered = l.rx_end - l.rx_begin;
    if (l.rx_state != RxState::kHeader) {
      size_t n;
      if (buffered > 0) {
        n = size_t(std::min<uint64_t>(buffered, l.rx_left));
        if (l.rx_dest) std::memcpy(l.rx_dest, l.rx.get() + l.rx_begin, n);
        l.rx_begin += n;
      } else {
        // Payload goes straight to its destination; discarded bytes through the buffer.
        void* dst = l.rx_dest ? static_cast<void*>(l.rx_dest) : static_cast<void*>(l.rx.get());
        size_t want = size_t(std::min<uint64_t>(l.rx_left, l.rx_dest ? l.rx_left : kRxBuffer));
        ssize_t r = ::recv(l.fd, dst, want, MSG_DONTWAIT);
        if (r == 0) { kill_lane(l, Status(Code::kConnectionLost, "peer '" + l.peer->info().name + "' closed a data connection")); return; }
        if (r < 0) {
          if (errno == EAGAIN || errno == EINTR) return;
          kill_lane(l, Status(Code::kConnectionLost, "data connection to peer '" + l.peer->info().name + "': " + std::strerror(errno)));
          return;
        }
        n = size_t(r);
        l.rx_begin = l.rx_end = 0;
      }
      if (l.rx_dest) l.rx_dest += n;
      l.rx_left -= n;
      budget -= std::min<uint64_t>(budget, n);
      if (l.rx_left == 0) payload_done(l, ep);
      continue;
    }
    if (buffered >= sizeof(FrameHeader)) {
      std::memcpy(&l.rx_hdr, l.rx.get() + l.rx_begin, sizeof(FrameHeader));
      if (!on_header(l, ep)) return;  // paused (no room to answer) or dead
      l.rx_begin += sizeof(FrameHeader);
      budget -= std::min<uint64_t>(budget, sizeof(FrameHeader));
      continue;
    }
    if (l.rx_begin > 0) {
      std::memmove(l.rx.get(), l.rx.get() + l.rx_begin, buffered);
      l.rx_begin = 0;
      l.rx_end = buffered;
    }
    ssize_t r = ::recv(l.fd, l.rx.get() + l.rx_end, kRxBuffer - l.rx_end, MSG_DONTWAIT);
    if (r == 0) { kill_lane(l, Status(Code::kConnectionLost, "peer '" + l.peer->info().name + "' closed a data connection")); return; }
    if (r < 0) {
      if (errno == EAGAIN || errno == EINTR) return;
      kill_lane(l, Status(Code::kConnectionLost, "data connection to peer '" + l.peer->info().name + "': " + std::strerror(errno)));
      return;
    }
    l.rx_end += size_t(r);
  }
}

// Returns false if the header was not consumed (paused for backpressure, or lane killed).
bool on_header(Lane& l, core::EndpointImpl* ep) {
  const FrameHeader& h = l.rx_hdr;
  auto protocol_error = [&](const char* what) {
    kill_lane(l, Status(Code::kProtocolError, std::string("peer '") + l.peer->info().name + "' sent " + what));
    return false;
  };
  if (h.reserved != 0) return protocol_error("a malformed frame");
  const auto type = static_cast<FrameType>(h.type);
  const bool needs_answer = type == FrameType::kWrite || type == FrameType::kSendData || type == FrameType::kReadReq;
  if (needs_answer && l.answers.full()) {
    l.rx_paused.store(true, std::memory_order_relaxed);  // resumes once answers have drained
    return false;
  }
  auto& stats = ep->stats();
  switch (type) {
    case FrameType::kWrite:
    case FrameType::kSendData: {
      RegionState* pin = nullptr;
      TransferState* recv = nullptr;
      uint8_t* dest = nullptr;
      Code c;
      if (type == FrameType::kWrite) {
        c = ep->registry().resolve(h.region_id, h.key, h.desc_offset, h.desc_length, h.offset, h.length, true, &pin);
        if (c == Code::kOk) dest = pin->base + h.offset;
      } else {
        c = l.peer->resolve_send_data(h.region_id, h.offset, h.length, &dest, &recv);
      }
      if (c != Code::kOk) stats.rejected_requests.fetch_add(1, std::memory_order_relaxed);
      l.rx_status = static_cast<uint8_t>(c);
      l.rx_pin = pin;
      l.rx_recv = recv;
      l.rx_dest = dest;  // null: discard the payload, then answer with the error
      l.rx_left = h.length;
      l.rx_state = c == Code::kOk ? RxState::kPayload : RxState::kDiscard;
      if (l.rx_left == 0) payload_done(l, ep);
      return true;
    }
    case FrameType::kReadReq: {
      RegionState* pin = nullptr;
      Code c = ep->registry().resolve(h.region_id, h.key, h.desc_offset, h.desc_length, h.offset, h.length, false, &pin);
      TxItem it{};
      it.hdr.type = static_cast<uint8_t>(FrameType::kReadResp);
      it.hdr.status = static_cast<uint8_t>(c);
      it.hdr.slot = h.slot;
      it.hdr.gen = h.gen;
      if (c == Code::kOk) {
        it.hdr.length = h.length;
        it.payload = pin->base + h.offset;
        it.length = h.length;
        it.pin = pin;
      } else {
        stats.rejected_requests.fetch_add(1, std::memory_order_relaxed);
      }
      l.answers.push(it);
      return true;
    }
    case FrameType::kAck: {
      if (l.peer->answer(l.index, h.slot, h.gen, h.status) != Code::kOk) return protocol_error("an answer to no request");
      return true;
    }
    case FrameType::kReadResp: {
      if (h.status != 0) {
        if (l.peer->answer(l.index, h.slot, h.gen, h.status) != Code::kOk) return protocol_error("an answer to no request");
        return true;
      }
      uint8_t* dest = nullptr;
      if (l.peer->read_destination(l.index, h.slot, h.gen, h.length, &dest) != Code::kOk)
        return protocol_error("read data for no read");
      l.rx_dest = dest;
      l.rx_left = h.length;
      l.rx_status = 0;
      l.rx_state = RxState::kPayload;
      if (l.rx_left == 0) payload_done(l, ep);
      return true;
    }
  }
  return protocol_error("a frame of unknown type");
}

void payload_done(Lane& l, core::EndpointImpl* ep) {
  const FrameHeader& h = l.rx_hdr;
  l.rx_state = RxState::kHeader;
  l.rx_dest = nullptr;
  auto& stats = ep->stats();
  const auto type = static_cast<FrameType>(h.type);
  if (type == FrameType::kReadResp) {
    stats.bytes_received.fetch_add(h.length, std::memory_order_relaxed);
    stats.chunks_received.fetch_add(1, std::memory_order_relaxed);
    if (l.peer->answer(l.index, h.slot, h.gen, 0) != Code::kOk)
      kill_lane(l, Status(Code::kProtocolError, "peer '" + l.peer->info().name + "' answered no request"));
    return;
  }
  if (l.rx_pin) { l.rx_pin->unpin(); l.rx_pin = nullptr; }
  if (l.rx_recv) {
    l.peer->send_data_placed(l.rx_recv, h.length);
    l.rx_recv = nullptr;
  }
  if (l.rx_status == 0) {
    stats.bytes_received.fetch_add(h.length, std::memory_order_relaxed);
    stats.chunks_received.fetch_add(1, std::memory_order_relaxed);
  }
  TxItem ack{};
  ack.hdr.type = static_cast<uint8_t>(FrameType::kAck);
  ack.hdr.status = l.rx_status;
  ack.hdr.slot = h.slot;
  ack.hdr.gen = h.gen;
  l.answers.push(ack);
}

}  // namespace

class ProgressThread {
 public:
  ProgressThread(core::EndpointImpl* ep, uint32_t index) : ep_(ep), index_(index) {
    epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
    evfd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = nullptr;
    ::epoll_ctl(epfd_, EPOLL_CTL_ADD, evfd_, &ev);
    thread_ = std::thread([this] { run(); });
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
    kick();
  }
  void wake() {
    work_hint_.store(true, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst)) kick();
  }
  void stop() {
    if (stop_.exchange(true)) return;
    kick();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void kick() {
    uint64_t one = 1;
    ssize_t rc = ::write(evfd_, &one, sizeof one);
    (void)rc;
  }

  void run();
  void take_incoming();
  void update_events(Lane& l);
  void do_rx(Lane& l);
  void do_tx(Lane& l);
  void retire(Lane& l);

  core::EndpointImpl* ep_;
  const uint32_t index_;
  int epfd_ = -1, evfd_ = -1;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};
  std::atomic<bool> work_hint_{false};
  std::mutex mu_;
  std::vector<std::shared_ptr<Lane>> incoming_;
  std::vector<std::shared_ptr<Lane>> lanes_;  // owned by this thread only
};

void ProgressThread::update_events(Lane& l) {
  uint32_t ev = EPOLLRDHUP;
  if (!l.rx_paused.load(std::memory_order_relaxed)) ev |= EPOLLIN;
  if (l.tx_backlog.load(std::memory_order_relaxed)) ev |= EPOLLOUT;
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
    lanes_.push_back(std::move(l));
  }
}

void ProgressThread::run() {
  epoll_event events[64];
  while (!stop_.load(std::memory_order_acquire)) {
    sleeping_.store(true, std::memory_order_seq_cst);
    const bool hinted = work_hint_.exchange(false, std::memory_order_seq_cst);
    int n = ::epoll_wait(epfd_, events, 64, hinted ? 0 : 1000);
    sleeping_.store(false, std::memory_order_relaxed);
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
    for (auto& l : lanes_) {
      if (l->dead.load(std::memory_order_relaxed)) continue;
      if (l->peer->failed()) {
        kill_lane(*l, l->peer->error());
        continue;
      }
      do_tx(*l);
      // Resume what backpressure held back; rx may pause again at once, so loop a few times and,
      // if it still could resume, come back without sleeping.
      for (int k = 0; k < 8 && l->rx_paused.load(std::memory_order_relaxed) && !l->answers.full() &&
                      !l->dead.load(std::memory_order_relaxed);
           ++k) {
        l->rx_paused.store(false, std::memory_order_relaxed);
        do_rx(*l);
        do_tx(*l);
      }
      if (l->rx_paused.load(std::memory_order_relaxed) && !l->answers.full()) work_hint_.store(true, std::memory_order_relaxed);
      if (!l->dead.load(std::memory_order_relaxed)) update_events(*l);
    }
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
  take_incoming();
  for (auto& l : lanes_) {
    kill_lane(*l, Status(Code::kCancelled, "endpoint closed"));
    retire(*l);
  }
  lanes_.clear();
}

void ProgressThread::do_rx(Lane& l) {
  if (!l.try_own_rx()) return;  // a waiting thread is reading its answer; it gives rx back at once
  receive(l, ep_);
  l.disown_rx();
}

void ProgressThread::retire(Lane& l) {
  ::epoll_ctl(epfd_, EPOLL_CTL_DEL, l.fd, nullptr);
  while (!l.try_own()) cpu_relax();     // a user thread may be mid-send; it holds tx for one sendmsg
  while (!l.try_own_rx()) cpu_relax();  // ... or reading its answer; it holds rx for one pass
  if (l.rx_pin) { l.rx_pin->unpin(); l.rx_pin = nullptr; }
  if (l.rx_recv) {
    l.rx_recv->record_error(l.peer->error());
    l.rx_recv->release();
    l.rx_recv = nullptr;
  }
  for (size_t i = 0; i < l.tx_count; ++i) {
    TxItem& it = l.tx[(l.tx_head + i) % kTxRing];
    if (it.pin) it.pin->unpin();
  }
  l.tx_count = 0;
  TxItem a;
  while (l.answers.pop(&a))
    if (a.pin) a.pin->unpin();
  l.peer->release_lane(l.index, Code::kConnectionLost);
  // tx stays owned: the lane is dead. The fd is closed with the PeerState, so its number is not
  // reused while other threads may still shut it down.
}

void ProgressThread::do_tx(Lane& l) {
  if (!l.try_own()) return;  // a user thread is sending inline; it re-checks after letting go
  Status err;
  const bool ok = drive_tx(l, ep_, &err);
  l.disown();
  if (!ok) kill_lane(l, err);
}

// ---------------------------------------------------------------- transport

TcpTransport::TcpTransport(core::EndpointImpl* endpoint) : endpoint_(endpoint) {
  const uint32_t n = std::max<uint32_t>(1, endpoint->config().channels);
  for (uint32_t i = 0; i < n; ++i) threads_.push_back(std::make_unique<ProgressThread>(endpoint, i));
}

TcpTransport::~TcpTransport() { stop(); }

Caps TcpTransport::caps() const {
  Caps c;
  c.host_memory = true;
  c.uses_tcp_lanes = true;
  return c;
}

uint32_t TcpTransport::lanes_for(std::string_view) const {
  return endpoint_->config().channels * endpoint_->config().sockets_per_channel;
}

Status TcpTransport::attach(const std::shared_ptr<PeerState>& peer, const std::vector<int>& fds, std::string_view,
                            bool) {
  const uint32_t per_channel = std::max<uint32_t>(1, endpoint_->config().sockets_per_channel);
  auto state = std::make_shared<TcpPeerLanes>();
  std::vector<std::shared_ptr<Lane>> lanes;
  for (uint32_t i = 0; i < fds.size(); ++i) {
    auto lane = std::make_shared<Lane>();
    lane->peer = peer;
    lane->index = i;
    lane->fd = fds[i];
    state->lanes.push_back(lane);
    lanes.push_back(std::move(lane));
  }
  peer->transport_state = state;  // weak references: lanes own the peer, not the other way round
  for (uint32_t i = 0; i < lanes.size(); ++i) threads_[(i / per_channel) % threads_.size()]->adopt(std::move(lanes[i]));
  return Status::ok();
}

void TcpTransport::wake(PeerState* peer, uint64_t chunks) {
  auto* state = static_cast<TcpPeerLanes*>(peer->transport_state.get());
  if (chunks <= 1 && state && !state->lanes.empty()) {
    // A one-chunk transfer is sent by the posting thread itself when a lane's tx is free: that
    // saves waking a progress thread (a third of a small write's latency on few cores).
    const size_t n = state->lanes.size();
    const uint32_t first = state->next.fetch_add(1, std::memory_order_relaxed);
    for (size_t i = 0; i < n; ++i) {
      std::shared_ptr<Lane> l = state->lanes[(first + i) % n].lock();
      if (!l || l->dead.load(std::memory_order_relaxed) || !l->try_own()) continue;
      Status err;
      const bool ok = !l->dead.load(std::memory_order_relaxed) && drive_tx(*l, endpoint_, &err);
      const bool backlog = l->tx_count > 0;
      l->disown();
      if (!ok) {
        kill_lane(*l, err);
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

void TcpTransport::poll(PeerState* peer, uint32_t lane) {
  auto* state = static_cast<TcpPeerLanes*>(peer->transport_state.get());
  if (!state || lane >= state->lanes.size()) return;
  std::shared_ptr<Lane> l = state->lanes[lane].lock();
  if (!l || l->dead.load(std::memory_order_relaxed) || !l->try_own_rx()) return;
  if (!l->dead.load(std::memory_order_relaxed)) receive(*l, endpoint_, kPollBudget);
  l->disown_rx();
  // Answers this read produced (acks for the peer's own writes) go out from the progress thread.
  if (!l->answers.empty() || l->rx_paused.load(std::memory_order_relaxed)) l->thread->wake();
}

void TcpTransport::stop() {
  if (stopped_.exchange(true)) return;
  for (auto& t : threads_) t->stop();
}

}  // namespace tether::transport
