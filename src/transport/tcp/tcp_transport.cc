#include "transport/tcp/tcp_transport.h"

#include <linux/sockios.h>
#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "core/endpoint_impl.h"
#include "core/peer.h"
#include "core/region.h"
#include "core/trace.h"
#include "gpu/staging.h"
#include "sys/cpu.h"
#include "sys/env.h"
#include "sys/thread_name.h"
#include "transport/frame_target.h"

namespace tether::transport {

using core::ChunkOp;
using core::RegionState;
using core::TransferState;
namespace trace = core::trace;
using wire::FrameHeader;
using wire::FrameType;

namespace {

constexpr size_t kRxBuffer = 64 << 10;
constexpr size_t kTxRing = 1024;             // frames a lane holds unsent (chunks + answers)
constexpr size_t kAnswerRing = 512;          // answers produced by rx, waiting for the tx owner
constexpr size_t kMaxIov = 1024;            // IOV_MAX: a batched chunk is a header, a table and its pieces
constexpr uint64_t kRxBudget = 16ull << 20;  // bytes per lane per turn, for fairness
constexpr uint64_t kTxBudget = 16ull << 20;
constexpr uint64_t kPollBudget = 256 << 10;  // a waiting thread reads little: it wants its answer
constexpr uint32_t kStageSlots = 8;          // pinned bounce slots per lane and direction (GPU memory)

constexpr uint32_t kReadAnswers = 64;        // kReadBatch answers a lane holds at once (then it stops reading)
constexpr int kStagedLowat = 256 << 10;      // SO_RCVLOWAT while a staged payload arrives (staging_nap_us > 0)
constexpr uint64_t kSpinAfterBytes = 64 << 10;  // a progress loop that moved less is "small traffic"
constexpr uint64_t kLaneQueueChunks = 2;      // chunks a lane's socket may hold (ours + the kernel's)
constexpr uint64_t kSmallCopy = 256 << 10;    // staged copies up to this extend the busy window (run())

// Chunks' bytes a kWriteBatch from or to GPU memory may carry (Caps::gpu_batch_chunks): each batch is a
// gather kernel on the sender and an unpack kernel on the receiver, and between two processes on one
// GPU those take turns, so fewer, larger batches move scattered blocks faster and at less CPU per GB
// (docs/PERFORMANCE.md, "Defaults and why"). Both sides must agree (wire version 6): a receiver kills the lane on a longer batch.
constexpr uint32_t kGpuBatchChunks = 2;

// Bytes in the socket's send queue (unsent or unacknowledged).
inline uint64_t kernel_queued(int fd) {
  int q = 0;
  return ::ioctl(fd, SIOCOUTQ, &q) == 0 && q > 0 ? uint64_t(q) : 0;
}

// A kReadBatch being answered: its fragments' places, and their regions pinned until the answer is sent.
// The rx owner takes one (it grows the lane's set), the tx owner lets it go.
struct ReadAnswer {
  std::atomic<bool> busy{false};
  uint32_t n = 0;
  core::Piece pieces[wire::kMaxFragments];
  RegionState* pins[wire::kMaxFragments];
  void release() {
    for (uint32_t i = 0; i < n; ++i) pins[i]->unpin();
    n = 0;
    busy.store(false, std::memory_order_release);
  }
};

struct TxItem {
  FrameHeader hdr;
  const uint8_t* payload;
  uint64_t length;
  RegionState* pin;  // read responses keep their region pinned until sent
  int32_t device = -1;                  // payload is in this GPU's memory: stage it before sending
  uint32_t fragments = 0;               // kWriteBatch from host memory: the table, then the pieces;
  const wire::Fragment* frags = nullptr;  // a kReadBatch's answer: the pieces only (frags null)
  const core::Piece* pieces = nullptr;
  ReadAnswer* batch = nullptr;          // a kReadBatch's answer: released once sent
  bool mixed = false;                   // its pieces span host memory and GPUs, or several GPUs
  gpu::StagingSlot* stage = nullptr;    // payload was copied here (pinned); send once the copy is done
  bool staged = false;                  // the copy into `stage` has completed
  uint64_t stage_ns = 0;                // when that copy started (LinkCounters::staging_ns)
};

// A frame received into a bounce slot, waiting for its copy to the GPU before it is answered.
struct GpuRx {
  gpu::StagingSlot* slot = nullptr;
  FrameHeader hdr{};        // the frame (its answer goes out once the copy is done)
  uint8_t status = 0;
  RegionState* pin = nullptr;
  TransferState* recv = nullptr;
  uint32_t npins = 0;       // a batch's regions, held until its copy is done (in the lane's batch_pins)
  uint64_t start_ns = 0;    // when its copy to the GPU started
};

constexpr uint64_t kTableBytes = uint64_t(wire::kMaxFragments) * sizeof(wire::Fragment);

enum class RxState { kHeader, kPayload, kDiscard };

// First copies first: a lane that has a chunk to send starts no copy of its next one out of a GPU while
// another lane of this process waits for its copy out of that GPU with nothing to send. Without it a
// transfer's eight first copies finished in two waves, the late lanes' first copies far behind the
// early ones: the early lanes' second copies took the copy engines from the late lanes' first
// (docs/PERFORMANCE.md, "Defaults and why"). TETHER_X_FIRST_COPIES=0 turns it off, for A/B runs.
bool first_copies() {
  static const bool on = sys::env_flag("TETHER_X_FIRST_COPIES");
  return on;
}
constexpr int kMaxGpus = 64;
std::atomic<int> g_starving[kMaxGpus];  // per GPU: lanes whose every queued item waits for its copy out of it

using sys::cpu_relax;

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
  bool peek(TxItem* out) const {
    const size_t h = head_.load(std::memory_order_relaxed);
    if (h == tail_.load(std::memory_order_acquire)) return false;
    *out = items_[h % kAnswerRing];
    return true;
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
  std::shared_ptr<Link> peer;
  ProgressThread* thread = nullptr;
  uint32_t index = 0;
  int fd = -1;
  core::LinkCounters* ctr = nullptr;      // this lane's counters (owned by the peer)
  core::LinkCounters* nic_ctr = nullptr;  // its NIC's (owned by the endpoint)
  std::atomic<bool> dead{false};
  std::atomic<bool> tx_owned{false};
  std::atomic<bool> tx_backlog{false};  // unsent bytes wait for EPOLLOUT
  std::atomic<uint64_t> io_bytes{0};    // bytes through its socket, both ways (busy polling's "bulk")
  AnswerRing answers;

  // tx: owner only
  std::vector<TxItem> tx = std::vector<TxItem>(kTxRing);
  size_t tx_head = 0, tx_count = 0;
  uint64_t tx_head_sent = 0;   // bytes of the head item (header + payload) already sent
  uint64_t tx_unsent = 0;      // bytes queued and not yet sent
  uint32_t tx_unstaged = 0;    // queued items whose copy out of the GPU has not finished

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
  int32_t rx_device = -1;      // >= 0: payload lands in rx_slot, then is copied to rx_final on this GPU
  gpu::StagingSlot* rx_slot = nullptr;
  uint8_t* rx_final = nullptr;
  std::atomic<bool> rx_paused{false};   // no room to answer: stop reading until answers drain
  std::atomic<bool> rx_owned{false};    // the progress thread, or a thread polling for its answer
  uint32_t epoll_events = 0;            // progress thread only
  int rx_lowat = 1;                     // progress thread only: the socket's SO_RCVLOWAT

  // GPU staging, created on a lane's first GPU chunk. tx_stage belongs to the tx owner; rx_stage
  // and the gpu_rx FIFO (frames whose copy to the GPU is in flight) to the rx owner.
  std::unique_ptr<gpu::StagingRing> tx_stage, rx_stage;
  // The most slots each ring held at once, as last published to the counters (each its ring's owner's).
  uint32_t tx_stage_peak = 0, rx_stage_peak = 0;
  gpu::Fragment tx_gather[wire::kMaxFragments];  // tx owner: a GPU batch's pieces, for the gather
  // rx owner: the kWriteBatch being received (destinations checked and pinned before any byte lands)
  uint32_t rx_nfrags = 0, rx_frag = 0;
  bool rx_mixed = false;                          // its destinations span host and GPUs, or several GPUs
  uint8_t* rx_frag_dest[wire::kMaxFragments];
  uint64_t rx_frag_len[wire::kMaxFragments];
  RegionState* rx_frag_pin[wire::kMaxFragments];
  RegionState* gpu_rx_pins[kStageSlots][wire::kMaxFragments];
  gpu::Fragment rx_unpack[wire::kMaxFragments];
  GpuRx gpu_rx[kStageSlots];
  uint32_t gpu_rx_head = 0, gpu_rx_count = 0;
  std::vector<std::unique_ptr<ReadAnswer>> read_answers;  // grown by the rx owner, up to kReadAnswers
  std::atomic<uint32_t> gpu_inflight{0};  // staged copies in flight: the progress thread polls them (or naps)
  std::atomic<uint64_t> gpu_steps{0};     // staged copies started + finished: a turn that moved it did work
  std::atomic<bool> small_copy{false};    // the latest staged copy moved at most kSmallCopy bytes
  int stage_device = -1;                  // tx owner: the GPU of the latest copy out of one
  int starving_on = -1;                   // tx owner: the GPU whose g_starving counts this lane, or -1

  // Counts the lane in g_starving while it holds items but none it could send yet (first copies first).
  void note_starving() {
    const int now = tx_count > 0 && tx_unstaged == tx_count ? stage_device : -1;
    if (now == starving_on) return;
    if (starving_on >= 0) g_starving[starving_on].fetch_sub(1, std::memory_order_relaxed);
    if (now >= 0) g_starving[now].fetch_add(1, std::memory_order_relaxed);
    starving_on = now;
  }
  // Whether to leave the copy engines of its GPU to lanes that wait for their first copy.
  bool yield_copies() const {
    return first_copies() && tx_count > 0 && starving_on < 0 && stage_device >= 0 &&
           g_starving[stage_device].load(std::memory_order_relaxed) > 0;
  }

  void copy_started(uint64_t bytes) {
    gpu_inflight.fetch_add(1, std::memory_order_relaxed);
    gpu_steps.fetch_add(1, std::memory_order_relaxed);
    small_copy.store(bytes <= kSmallCopy, std::memory_order_relaxed);
  }
  void copy_finished() {
    gpu_inflight.fetch_sub(1, std::memory_order_relaxed);
    gpu_steps.fetch_add(1, std::memory_order_relaxed);
  }

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
};

namespace {

// A lane's staging rings, made on first need. A tx slot holds a batch's fragment table too.
gpu::StagingRing& tx_ring(Lane& l, core::EndpointImpl* ep) {
  if (!l.tx_stage)
    l.tx_stage = std::make_unique<gpu::StagingRing>(kStageSlots, ep->config().chunk_bytes + kTableBytes, wire::kMaxFragments);
  return *l.tx_stage;
}
gpu::StagingRing& rx_ring(Lane& l, core::EndpointImpl* ep) {
  if (!l.rx_stage) l.rx_stage = std::make_unique<gpu::StagingRing>(kStageSlots, ep->config().chunk_bytes, wire::kMaxFragments);
  return *l.rx_stage;
}

// Pins a lane's staging for the GPUs in `gpus` (a bit per device) before its first GPU chunk, which
// would otherwise pay for it: pinning is slow, and the first transfers would carry its whole cost.
// Skips a side another thread holds; that side prepares lazily. A failure here is met again, and
// reported, by the first transfer that needs the ring.
void prepare_staging(Lane& l, core::EndpointImpl* ep, uint64_t gpus) {
  auto each = [&](gpu::StagingRing& ring) {
    for (int d = 0; d < 64; ++d)
      if (gpus >> d & 1) (void)ring.prepare(d);
  };
  if (l.try_own()) {
    each(tx_ring(l, ep));
    l.disown();
  }
  if (l.try_own_rx()) {
    each(rx_ring(l, ep));
    l.disown_rx();
  }
}

// Publishes a staging ring's peak to the lane's counters when it grew past `*published` (the ring owner's
// copy: a compare per acquire, the atomics only when it grew).
void note_staging_peak(Lane& l, const gpu::StagingRing& ring, uint32_t* published) {
  if (ring.peak() <= *published) return;
  *published = ring.peak();
  core::count_peak(&core::LinkCounters::staging_slots_peak, l.ctr, l.nic_ctr, *published);
}

// Starts copying a GPU payload into a pinned tx slot. False without an error: no slot is free yet.
bool stage_tx(Lane& l, core::EndpointImpl* ep, TxItem& it, Status* error) {
  tx_ring(l, ep);
  auto slot = l.tx_stage->acquire(it.device, l.tx_stage->span_for(it.length));  // a batch may take more than one
  if (!slot.is_ok()) { *error = slot.status(); return false; }
  if (!slot.value()) return false;
  note_staging_peak(l, *l.tx_stage, &l.tx_stage_peak);
  gpu::StagingSlot* st = slot.value();
  gpu::Fragment one{0, const_cast<uint8_t*>(it.payload), it.length};
  const gpu::Fragment* frags = &one;
  uint32_t n = 1;
  if (it.fragments) {  // a batch: the slot holds the fragment table (writes), then every piece gathered
    const uint64_t table = it.frags ? uint64_t(it.fragments) * sizeof(wire::Fragment) : 0;
    if (table) std::memcpy(st->host, it.frags, table);
    uint64_t at = table;
    for (uint32_t i = 0; i < it.fragments; ++i) {
      l.tx_gather[i] = gpu::Fragment{at, const_cast<uint8_t*>(it.pieces[i].data), it.pieces[i].length};
      at += it.pieces[i].length;
    }
    frags = l.tx_gather;
    n = it.fragments;
    it.fragments = 0;  // from here on it is one contiguous payload
  }
  if (Status s = l.tx_stage->pack(st, it.device, frags, n, it.mixed ? gpu::Unpack::kD2D : ep->unpack_mode()); !s.is_ok()) {
    l.tx_stage->release(st);
    *error = s;
    return false;
  }
  it.stage = st;
  it.stage_ns = core::mono_ns();
  it.payload = st->host;
  it.device = -1;
  it.staged = false;
  ++l.tx_unstaged;
  if (st->device >= 0 && st->device < kMaxGpus) l.stage_device = st->device;
  l.copy_started(it.length);
  return true;
}

// Sends what the lane holds (answers first, then chunks it pulls while its socket keeps up).
// Caller owns tx. Returns false if the socket (or a GPU copy) failed.
bool drive_tx(Lane& l, core::EndpointImpl* ep, Status* error) {
  const uint64_t chunk = l.peer->info().chunk_bytes;
  uint64_t budget = kTxBudget;
  bool copy_wait = false;
  auto& stats = ep->stats();
  for (;;) {
    TxItem a;
    while (l.tx_count < kTxRing && l.answers.peek(&a)) {
      if (a.device >= 0 && l.tx_stage && !l.tx_stage->has_free(l.tx_stage->span_for(a.length))) break;  // the answer waits
      if (a.device >= 0 && l.tx_unstaged > 0) break;  // one copy out of the GPU at a time, as for chunks below
      trace::mark(trace::Event::kPulled, l.index, a.hdr.type, a.hdr.slot, a.hdr.gen);  // before staging
      if (a.device >= 0 && !stage_tx(l, ep, a, error)) {
        if (!error->is_ok()) return false;
        break;  // no free slot: the answer waits in the ring
      }
      TxItem taken;
      l.answers.pop(&taken);  // `a` is the (possibly staged) copy we queue
      l.queue(a);
    }
    // Pull only when what this socket holds has (almost) drained: faster sockets pull more. What the
    // kernel still queues counts too, or a slow link would swallow a socket buffer's worth of chunks
    // and set the pace at the end of every transfer.
    ChunkOp op;
    // (The kernel holds at most the lane's unanswered chunks, so ask it only when those are many.)
    const uint64_t limit = kLaneQueueChunks * chunk;
    const uint64_t queued = l.peer->has_work() && l.peer->lane_bytes(l.index) >= limit ? kernel_queued(l.fd) : 0;
    // A lane stages one chunk at a time: all lanes' copies share the GPU's copy engines, so at the
    // start of a transfer each lane's first chunk is out sooner (and on the wire sooner) when second
    // chunks wait; later ones are copied while the one before is sent (docs/PERFORMANCE.md, "Defaults and why").
    // (A lane writing holds at most three of its eight tx slots here, so a free run of two for a batch is
    // there and contiguous chunks do not wait on it; staged read answers it also serves may hold more.)
    const bool yield_copies = l.yield_copies();  // first copies first
    while (!yield_copies && l.tx_unsent + queued < limit && l.tx_count < kTxRing / 2 && l.tx_unstaged == 0 &&
           (!l.tx_stage || l.tx_stage->has_free(kGpuBatchChunks)) && l.peer->next_chunk(l.index, &op)) {
      TxItem it{op.hdr, op.payload, op.length, op.pin};  // a pushed send's chunk: unpinned once sent
      it.device = op.payload || op.fragments ? op.device : -1;
      if (static_cast<FrameType>(op.hdr.type) == FrameType::kReadBatch) {  // a request: header and table
        it.payload = reinterpret_cast<const uint8_t*>(op.frags);
        it.length = uint64_t(op.fragments) * sizeof(wire::Fragment);
        it.device = -1;
      } else if (op.fragments) {
        it.fragments = op.fragments;
        it.frags = op.frags;
        it.pieces = op.pieces;
        it.length = uint64_t(op.fragments) * sizeof(wire::Fragment) + op.length;
      }
      trace::mark(trace::Event::kPulled, l.index, it.hdr.type, it.hdr.slot, it.hdr.gen);  // before staging
      if (it.device >= 0 && !stage_tx(l, ep, it, error)) {
        if (error->is_ok()) *error = Status(Code::kInternal, "staging: no free slot after checking for one");
        return false;
      }
      l.queue(it);
    }
    if (l.tx_count == 0 || budget == 0) break;

    iovec iov[kMaxIov];
    size_t niov = 0;
    uint64_t skip = l.tx_head_sent;
    bool staged_now = false;  // an item's copy out of the GPU was seen finished on this pass
    // Every part of every item: header, then the payload (or a batch's table and pieces).
    auto add = [&](const void* p, uint64_t n) {
      if (skip >= n) {
        skip -= n;
        return;
      }
      iov[niov++] = {static_cast<uint8_t*>(const_cast<void*>(p)) + skip, n - skip};
      skip = 0;
    };
    for (size_t i = 0; i < l.tx_count; ++i) {
      TxItem& it = l.tx[(l.tx_head + i) % kTxRing];
      if (niov + 2 + it.fragments + 1 > kMaxIov) break;
      if (it.stage && !it.staged) {  // its copy out of the GPU must finish before its bytes go
        auto done = l.tx_stage->done(it.stage);
        if (!done.is_ok()) { *error = done.status(); return false; }
        if (!done.value()) break;
        it.staged = true;
        --l.tx_unstaged;
        staged_now = true;
        trace::mark(trace::Event::kStaged, l.index, it.hdr.type, it.hdr.slot, it.hdr.gen);
        core::count_time(&core::LinkCounters::staging_ns, l.ctr, l.nic_ctr, core::mono_ns() - it.stage_ns);
      }
      add(&it.hdr, sizeof(FrameHeader));
      if (it.fragments) {
        if (it.frags) add(it.frags, uint64_t(it.fragments) * sizeof(wire::Fragment));
        for (uint32_t k = 0; k < it.fragments; ++k) add(it.pieces[k].data, it.pieces[k].length);
      } else if (it.length > 0) {
        add(it.payload, it.length);
      }
    }
    l.note_starving();  // now, not after a send of 100s of µs: lanes yielding to this one stop sooner
    if (niov == 0) {  // the head waits for its GPU copy; the progress thread polls it
      copy_wait = true;
      break;
    }
    // A copy just finished: start the next one (the pulls above) before this sendmsg, which on loopback
    // moves the bytes to the receiver itself (as long as a copy, or longer). Else each chunk's copy waited for
    // the previous chunk's send and a staged lane took copy + send time per chunk, not the larger of the two.
    if (staged_now) continue;
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = niov;
    const uint64_t t0 = core::mono_ns();
    ssize_t n = ::sendmsg(l.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    core::count_time(&core::LinkCounters::send_ns, l.ctr, l.nic_ctr, core::mono_ns() - t0);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) break;
      *error = Status(Code::kConnectionLost, "data connection to peer '" + l.peer->info().name + "': " + std::strerror(errno));
      return false;
    }
    uint64_t sent = uint64_t(n);
    l.io_bytes.fetch_add(sent, std::memory_order_relaxed);
    budget -= std::min(budget, sent);
    l.tx_unsent -= sent;
    while (sent > 0) {
      TxItem& it = l.tx[l.tx_head];
      const uint64_t total = sizeof(FrameHeader) + it.length;
      const uint64_t take = std::min(sent, total - l.tx_head_sent);
      l.tx_head_sent += take;
      sent -= take;
      if (l.tx_head_sent == total) {
        trace::mark(trace::Event::kSent, l.index, it.hdr.type, it.hdr.slot, it.hdr.gen);
        if (it.length > 0 && static_cast<FrameType>(it.hdr.type) != FrameType::kReadBatch) {  // data, not a request's table
          stats.bytes_sent.fetch_add(it.hdr.length, std::memory_order_relaxed);
          stats.chunks_sent.fetch_add(1, std::memory_order_relaxed);
          core::count_sent(l.ctr, l.nic_ctr, it.length);
        }
        if (it.pin) it.pin->unpin();
        if (it.batch) it.batch->release();
        if (it.stage) {
          l.tx_stage->release(it.stage);
          l.copy_finished();
        }
        l.tx_head = (l.tx_head + 1) % kTxRing;
        --l.tx_count;
        l.tx_head_sent = 0;
      }
    }
  }
  l.note_starving();
  // A head waiting for its copy out of the GPU needs no EPOLLOUT when the thread naps between polls of
  // that copy: a writable socket would end every nap at once (level-triggered).
  l.tx_backlog.store(l.tx_count > 0 && !(copy_wait && ep->config().staging_nap_us), std::memory_order_relaxed);
  return true;
}

// A lane whose socket failed: the peer moves its chunks to surviving lanes, or fails if none is left.
void kill_lane(Lane& l, Status why) {
  if (l.dead.exchange(true)) return;
  l.peer->lane_failed(l.index, std::move(why));
}

bool on_header(Lane& l, core::EndpointImpl* ep);
bool on_batch(Lane& l, core::EndpointImpl* ep);
bool on_read_batch(Lane& l, core::EndpointImpl* ep);
void payload_done(Lane& l, core::EndpointImpl* ep);

// Answers, in order, the frames whose copy from a bounce slot to the GPU has finished. Caller owns rx.
void complete_gpu_rx(Lane& l, core::EndpointImpl* ep) {
  auto& stats = ep->stats();
  while (l.gpu_rx_count > 0) {
    GpuRx& g = l.gpu_rx[l.gpu_rx_head];
    auto done = l.rx_stage->done(g.slot);
    uint8_t status = g.status;
    if (!done.is_ok()) {
      status = uint8_t(Code::kInternal);
    } else if (!done.value()) {
      return;
    }
    if (g.start_ns) {
      core::count_time(&core::LinkCounters::staging_ns, l.ctr, l.nic_ctr, core::mono_ns() - g.start_ns);
      trace::mark(trace::Event::kUnpacked, l.index, g.hdr.type, g.hdr.slot, g.hdr.gen);
    }
    g.start_ns = 0;
    const bool read = static_cast<FrameType>(g.hdr.type) == FrameType::kReadResp;
    if (!read && l.answers.full()) return;  // the ack waits for room
    l.rx_stage->release(g.slot);
    l.copy_finished();
    if (g.pin) g.pin->unpin();
    for (uint32_t i = 0; i < g.npins; ++i) l.gpu_rx_pins[l.gpu_rx_head][i]->unpin();
    if (g.recv) l.peer->send_data_placed(g.recv, g.hdr.offset, g.hdr.length);
    if (status == 0) {
      stats.bytes_received.fetch_add(g.hdr.length, std::memory_order_relaxed);
      stats.chunks_received.fetch_add(1, std::memory_order_relaxed);
      core::count_received(l.ctr, l.nic_ctr, g.hdr.length);  // the lane's and NIC's too (GPU payloads were missing)
    }
    l.gpu_rx_head = (l.gpu_rx_head + 1) % kStageSlots;
    --l.gpu_rx_count;
    if (read) {
      trace::mark(trace::Event::kAnswered, l.index, g.hdr.type, g.hdr.slot, g.hdr.gen);
      if (l.peer->answer(l.index, g.hdr.slot, g.hdr.gen, status) != Code::kOk)
        kill_lane(l, Status(Code::kProtocolError, "peer '" + l.peer->info().name + "' answered no request"));
    } else {
      TxItem ack{};
      ack.hdr.type = static_cast<uint8_t>(FrameType::kAck);
      ack.hdr.status = status;
      ack.hdr.slot = g.hdr.slot;
      ack.hdr.gen = g.hdr.gen;
      l.answers.push(ack);
    }
  }
}

// Room to land one more GPU-bound payload of `length` bytes? (Checked before a frame is resolved, so
// nothing is undone.) No GPU-bound frame is longer than kGpuBatchChunks chunks: a longer one goes to host
// memory or is refused by land_in_bounce, and must not wait here for a run of slots the ring never has.
bool gpu_rx_room(const Lane& l, uint64_t length) {
  if (!l.rx_stage) return true;
  const uint32_t span = std::min(l.rx_stage->span_for(length), kGpuBatchChunks);
  return l.gpu_rx_count < kStageSlots && l.rx_stage->has_free(span);
}

// Points the payload of the frame being received at a bounce slot; payload_done copies it to `final`.
bool land_in_bounce(Lane& l, core::EndpointImpl* ep, int device, uint8_t* final) {
  const bool batch = static_cast<FrameType>(l.rx_hdr.type) == FrameType::kWriteBatch;
  if (l.rx_hdr.length > ep->config().chunk_bytes * (batch ? kGpuBatchChunks : 1)) {
    kill_lane(l, Status(Code::kProtocolError, "peer '" + l.peer->info().name + "' sent a frame longer than the agreed chunk size"));
    return false;
  }
  gpu::StagingRing& ring = rx_ring(l, ep);
  auto slot = ring.acquire(device, ring.span_for(l.rx_hdr.length));
  if (!slot.is_ok() || !slot.value()) {
    kill_lane(l, slot.is_ok() ? Status(Code::kInternal, "staging: no free slot after checking for one") : slot.status());
    return false;
  }
  note_staging_peak(l, ring, &l.rx_stage_peak);
  l.rx_slot = slot.value();
  l.rx_device = device;
  l.rx_final = final;
  l.rx_dest = l.rx_slot->host;
  return true;
}

// ---------------------------------------------------------------- receive

// Reads and handles what the lane's socket holds, up to `budget` bytes. Caller owns rx.
void receive(Lane& l, core::EndpointImpl* ep, uint64_t budget = kRxBudget) {
  if (l.gpu_rx_count > 0) complete_gpu_rx(l, ep);
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
        const uint64_t t0 = core::mono_ns();
        ssize_t r = ::recv(l.fd, dst, want, MSG_DONTWAIT);
        core::count_time(&core::LinkCounters::recv_ns, l.ctr, l.nic_ctr, core::mono_ns() - t0);
        if (r == 0) { kill_lane(l, Status(Code::kConnectionLost, "peer '" + l.peer->info().name + "' closed a data connection")); return; }
        if (r < 0) {
          if (errno == EAGAIN || errno == EINTR) return;
          kill_lane(l, Status(Code::kConnectionLost, "data connection to peer '" + l.peer->info().name + "': " + std::strerror(errno)));
          return;
        }
        n = size_t(r);
        l.io_bytes.fetch_add(n, std::memory_order_relaxed);
        l.rx_begin = l.rx_end = 0;
      }
      if (l.rx_dest) l.rx_dest += n;
      l.rx_left -= n;
      budget -= std::min<uint64_t>(budget, n);
      if (l.rx_left == 0) {
        if (l.rx_nfrags > 0 && !l.rx_slot && l.rx_state == RxState::kPayload && ++l.rx_frag < l.rx_nfrags) {
          l.rx_dest = l.rx_frag_dest[l.rx_frag];  // next piece of a batch, straight to its place
          l.rx_left = l.rx_frag_len[l.rx_frag];
        } else {
          payload_done(l, ep);
        }
      }
      continue;
    }
    if (buffered >= sizeof(FrameHeader)) {
      std::memcpy(&l.rx_hdr, l.rx.get() + l.rx_begin, sizeof(FrameHeader));
      size_t need = sizeof(FrameHeader);
      const auto type = static_cast<FrameType>(l.rx_hdr.type);
      if (type == FrameType::kWriteBatch || type == FrameType::kReadBatch) {
        if (l.rx_hdr.region_id < 2 || l.rx_hdr.region_id > wire::kMaxFragments) {
          kill_lane(l, Status(Code::kProtocolError, "peer '" + l.peer->info().name + "' sent a malformed batch"));
          return;
        }
        need += size_t(l.rx_hdr.region_id) * sizeof(wire::Fragment);  // the table is read with the header
      }
      if (buffered >= need) {
        if (!on_header(l, ep)) return;  // paused (no room to answer) or dead
        l.rx_begin += need;
        budget -= std::min<uint64_t>(budget, need);
        continue;
      }
    }
    if (l.rx_begin > 0) {
      std::memmove(l.rx.get(), l.rx.get() + l.rx_begin, buffered);
      l.rx_begin = 0;
      l.rx_end = buffered;
    }
    const uint64_t t0 = core::mono_ns();
    ssize_t r = ::recv(l.fd, l.rx.get() + l.rx_end, kRxBuffer - l.rx_end, MSG_DONTWAIT);
    core::count_time(&core::LinkCounters::recv_ns, l.ctr, l.nic_ctr, core::mono_ns() - t0);
    if (r == 0) { kill_lane(l, Status(Code::kConnectionLost, "peer '" + l.peer->info().name + "' closed a data connection")); return; }
    if (r < 0) {
      if (errno == EAGAIN || errno == EINTR) return;
      kill_lane(l, Status(Code::kConnectionLost, "data connection to peer '" + l.peer->info().name + "': " + std::strerror(errno)));
      return;
    }
    l.rx_end += size_t(r);
    l.io_bytes.fetch_add(uint64_t(r), std::memory_order_relaxed);
  }
}

// Returns false if the header was not consumed (paused for backpressure, or lane killed).
bool on_header(Lane& l, core::EndpointImpl* ep) {
  const FrameHeader& h = l.rx_hdr;
  auto protocol_error = [&](const char* what) {
    kill_lane(l, Status(Code::kProtocolError, std::string("peer '") + l.peer->info().name + "' sent " + what));
    return false;
  };
  if (h.flags & ~wire::kKnownFlags) return protocol_error("a malformed frame");
  trace::mark(trace::Event::kHeader, l.index, h.type, h.slot, h.gen);
  const auto type = static_cast<FrameType>(h.type);
  const bool needs_answer = type == FrameType::kWrite || type == FrameType::kSendData || type == FrameType::kReadReq ||
                            type == FrameType::kReadBatch;
  if (needs_answer && l.answers.full()) {
    l.rx_paused.store(true, std::memory_order_relaxed);  // resumes once answers have drained
    return false;
  }
  const bool has_payload = type == FrameType::kWrite || type == FrameType::kSendData || type == FrameType::kWriteBatch ||
                           (type == FrameType::kReadResp && h.status == 0);
  if (has_payload && !gpu_rx_room(l, h.length)) {
    l.rx_paused.store(true, std::memory_order_relaxed);  // resumes once a GPU copy has finished
    return false;
  }
  switch (type) {
    case FrameType::kWrite:
    case FrameType::kSendData: {
      const TargetPlan p = plan_target(*ep, *l.peer, h);  // region, key, bounds (or the matched recv)
      const Code c = p.code;
      RegionState* pin = p.pin;
      TransferState* recv = p.recv;
      uint8_t* dest = p.dest;
      const int device = p.device;
      l.rx_status = static_cast<uint8_t>(c);
      l.rx_pin = pin;
      l.rx_recv = recv;
      l.rx_dest = dest;  // null: discard the payload, then answer with the error
      l.rx_left = h.length;
      l.rx_state = c == Code::kOk ? RxState::kPayload : RxState::kDiscard;
      if (c == Code::kOk && device >= 0 && h.length > 0 && !land_in_bounce(l, ep, device, dest)) return false;
      if (l.rx_left == 0) payload_done(l, ep);
      return true;
    }
    case FrameType::kWriteBatch: return on_batch(l, ep);
    case FrameType::kReadReq: {
      const TargetPlan p = plan_target(*ep, *l.peer, h);
      const Code c = p.code;
      RegionState* pin = p.pin;
      TxItem it{};
      it.hdr.type = static_cast<uint8_t>(FrameType::kReadResp);
      it.hdr.status = static_cast<uint8_t>(c);
      it.hdr.slot = h.slot;
      it.hdr.gen = h.gen;
      if (c == Code::kOk) {
        if (pin->kind == MemoryKind::kCuda && h.length > ep->config().chunk_bytes) {
          pin->unpin();
          return protocol_error("a read request longer than the agreed chunk size");
        }
        it.hdr.length = h.length;
        it.payload = pin->base + h.offset;
        it.length = h.length;
        it.pin = pin;
        it.device = pin->kind == MemoryKind::kCuda ? pin->device : -1;  // the tx owner stages it
      }
      l.answers.push(it);
      return true;
    }
    case FrameType::kAck: {
      trace::mark(trace::Event::kAnswered, l.index, h.type, h.slot, h.gen);
      if (l.peer->answer(l.index, h.slot, h.gen, h.status) != Code::kOk) return protocol_error("an answer to no request");
      return true;
    }
    case FrameType::kReadResp: {
      if (h.status != 0) {
        if (l.peer->answer(l.index, h.slot, h.gen, h.status) != Code::kOk) return protocol_error("an answer to no request");
        return true;
      }
      uint8_t* dest = nullptr;
      int device = -1;
      const core::Piece* pieces = nullptr;
      uint32_t npieces = 0;
      if (l.peer->read_destination(l.index, h.slot, h.gen, h.length, &dest, &device, &pieces, &npieces) != Code::kOk)
        return protocol_error("read data for no read");
      l.rx_dest = dest;
      l.rx_left = h.length;
      l.rx_status = 0;
      l.rx_state = RxState::kPayload;
      if (npieces > 0) {  // a kReadBatch's answer: its pieces in order (they are never empty: see Link)
        for (uint32_t i = 0; i < npieces; ++i) {
          l.rx_frag_dest[i] = pieces[i].data;
          l.rx_frag_len[i] = pieces[i].length;
          l.rx_frag_pin[i] = nullptr;  // the transfer holds its own regions
        }
        l.rx_nfrags = npieces;
        l.rx_frag = 0;
        l.rx_mixed = false;  // a read batch's pieces share one device (Link::pack_batch)
        if (device >= 0) return land_in_bounce(l, ep, device, nullptr);  // all of it, then one unpack
        l.rx_dest = l.rx_frag_dest[0];
        l.rx_left = l.rx_frag_len[0];
        return true;
      }
      if (device >= 0 && h.length > 0 && !land_in_bounce(l, ep, device, dest)) return false;
      if (l.rx_left == 0) payload_done(l, ep);
      return true;
    }
    case FrameType::kReadBatch: return on_read_batch(l, ep);
    case FrameType::kPull:
      if (!l.peer->on_pull(h)) return protocol_error("a malformed kPull");
      return true;
  }
  return protocol_error("a frame of unknown type");
}

// A batch's fragments, checked and pinned (pin_batch).
struct BatchPlaces {
  Code code = Code::kOk;
  int32_t gpu = -1;    // the first GPU among the places (-1: all in host memory)
  bool mixed = false;  // they span host memory and GPUs, or several GPUs
  bool adds_up = true; // false: the fragments' bytes are not the header's length (a protocol error)
};

// Checks every fragment of a batch's table (region, key, bounds, for `write` access; a fragment is never
// empty) and pins its region: place i is at[i], len[i] bytes, in pins[i]. On a refusal, or a table whose
// bytes are not `length`, nothing stays pinned.
BatchPlaces pin_batch(core::EndpointImpl* ep, const uint8_t* table, uint32_t n, uint64_t length, bool write,
                      RegionState** pins, uint8_t** at, uint64_t* len) {
  BatchPlaces b;
  uint64_t sum = 0;
  int32_t first = -2;  // device of the first place (-1 host)
  for (uint32_t i = 0; i < n; ++i) {
    wire::Fragment f;
    std::memcpy(&f, table + size_t(i) * sizeof f, sizeof f);
    RegionState* pin = nullptr;
    b.code = f.reserved != 0 || f.length == 0
                 ? Code::kInvalidArgument
                 : ep->registry().resolve(f.region_id, f.key, f.desc_offset, f.desc_length, f.offset, f.length, write, &pin);
    if (b.code != Code::kOk) {
      for (uint32_t k = 0; k < i; ++k) pins[k]->unpin();
      ep->stats().rejected_requests.fetch_add(1, std::memory_order_relaxed);
      return b;
    }
    pins[i] = pin;
    at[i] = pin->base + f.offset;
    len[i] = f.length;
    sum += f.length;
    const int32_t d = pin->kind == MemoryKind::kCuda ? pin->device : -1;
    b.mixed |= first != -2 && d != first;
    if (first == -2) first = d;
    if (b.gpu < 0) b.gpu = d;
  }
  if (sum != length) {
    for (uint32_t i = 0; i < n; ++i) pins[i]->unpin();
    b.adds_up = false;
  }
  return b;
}

// A kWriteBatch header and its table (both in the rx buffer): every fragment is checked and pinned
// before any byte lands; one refused fragment refuses the whole batch (its payload is discarded).
bool on_batch(Lane& l, core::EndpointImpl* ep) {
  const FrameHeader& h = l.rx_hdr;
  const uint32_t n = h.region_id;
  const uint8_t* table = l.rx.get() + l.rx_begin + sizeof(FrameHeader);
  const BatchPlaces b = pin_batch(ep, table, n, h.length, true, l.rx_frag_pin, l.rx_frag_dest, l.rx_frag_len);
  if (!b.adds_up) {
    kill_lane(l, Status(Code::kProtocolError, "peer '" + l.peer->info().name + "' sent a batch whose table does not add up"));
    return false;
  }
  l.rx_pin = nullptr;
  l.rx_recv = nullptr;
  l.rx_left = h.length;
  if (b.code != Code::kOk) {
    l.rx_status = static_cast<uint8_t>(b.code);
    l.rx_dest = nullptr;
    l.rx_nfrags = 0;
    l.rx_state = RxState::kDiscard;
    return true;
  }
  l.rx_status = 0;
  l.rx_nfrags = n;
  l.rx_frag = 0;
  l.rx_mixed = b.mixed;
  l.rx_state = RxState::kPayload;
  if (b.gpu >= 0)  // some piece goes to a GPU: the whole payload lands in a bounce slot first
    return land_in_bounce(l, ep, b.gpu, nullptr);
  l.rx_dest = l.rx_frag_dest[0];
  l.rx_left = l.rx_frag_len[0];
  return true;
}

// A free ReadAnswer of the lane's, or null when kReadAnswers are all waiting to be sent. Caller owns rx.
ReadAnswer* take_read_answer(Lane& l) {
  for (auto& a : l.read_answers)
    if (!a->busy.load(std::memory_order_acquire)) {
      a->busy.store(true, std::memory_order_relaxed);
      return a.get();
    }
  if (l.read_answers.size() >= kReadAnswers) return nullptr;
  l.read_answers.push_back(std::make_unique<ReadAnswer>());
  l.read_answers.back()->busy.store(true, std::memory_order_relaxed);
  return l.read_answers.back().get();
}

// A kReadBatch header and its table (in the rx buffer): every fragment is checked and pinned, and one
// kReadResp carries their bytes back in table order (gathered from GPU memory into a staging slot by the
// tx owner). One refused fragment refuses the whole batch: the answer then carries only its status.
bool on_read_batch(Lane& l, core::EndpointImpl* ep) {
  const FrameHeader& h = l.rx_hdr;
  if (h.length > ep->config().chunk_bytes) {
    kill_lane(l, Status(Code::kProtocolError, "peer '" + l.peer->info().name + "' sent a read batch longer than the agreed chunk size"));
    return false;
  }
  ReadAnswer* a = take_read_answer(l);
  if (!a) {
    l.rx_paused.store(true, std::memory_order_relaxed);  // resumes once answers have gone out
    return false;
  }
  const uint32_t n = h.region_id;
  const uint8_t* table = l.rx.get() + l.rx_begin + sizeof(FrameHeader);
  uint8_t* at[wire::kMaxFragments];
  uint64_t len[wire::kMaxFragments];
  const BatchPlaces b = pin_batch(ep, table, n, h.length, false, a->pins, at, len);
  if (!b.adds_up) {
    a->release();  // pin_batch let its pins go
    kill_lane(l, Status(Code::kProtocolError, "peer '" + l.peer->info().name + "' sent a read batch whose table does not add up"));
    return false;
  }
  TxItem it{};
  it.hdr.type = static_cast<uint8_t>(FrameType::kReadResp);
  it.hdr.status = static_cast<uint8_t>(b.code);
  it.hdr.slot = h.slot;
  it.hdr.gen = h.gen;
  if (b.code != Code::kOk) {
    a->release();
  } else {
    a->n = n;
    for (uint32_t i = 0; i < n; ++i) a->pieces[i] = core::Piece{at[i], len[i], a->pins[i]};
    it.hdr.length = h.length;
    it.length = h.length;
    it.fragments = n;
    it.pieces = a->pieces;
    it.batch = a;
    it.device = b.gpu;  // GPU memory among them: the tx owner gathers them into a staging slot
    it.mixed = b.mixed;
  }
  l.answers.push(it);
  return true;
}

void payload_done(Lane& l, core::EndpointImpl* ep) {
  const FrameHeader& h = l.rx_hdr;
  trace::mark(trace::Event::kLanded, l.index, h.type, h.slot, h.gen);
  l.rx_state = RxState::kHeader;
  l.rx_dest = nullptr;
  if (l.rx_slot) {  // in a bounce slot: copy it to the GPU; answer when that copy has finished
    const uint32_t at = (l.gpu_rx_head + l.gpu_rx_count) % kStageSlots;
    GpuRx& g = l.gpu_rx[at];
    g.slot = l.rx_slot;
    g.hdr = h;
    g.status = l.rx_status;
    g.pin = l.rx_pin;
    g.recv = l.rx_recv;
    const bool answer = static_cast<FrameType>(h.type) == FrameType::kReadResp;
    g.npins = answer ? 0 : l.rx_nfrags;  // a read's pieces are the transfer's, not pinned here
    g.start_ns = core::mono_ns();
    l.rx_slot = nullptr;
    l.rx_pin = nullptr;
    l.rx_recv = nullptr;
    gpu::Unpack mode = ep->unpack_mode();
    uint32_t n = 1;
    l.rx_unpack[0] = gpu::Fragment{0, l.rx_final, h.length};
    if (l.rx_nfrags > 0) {  // a batch: one descriptor per piece (one kernel launch in kernel mode)
      uint64_t off = 0;
      for (uint32_t i = 0; i < l.rx_nfrags; ++i) {
        l.gpu_rx_pins[at][i] = l.rx_frag_pin[i];
        l.rx_unpack[i] = gpu::Fragment{off, l.rx_frag_dest[i], l.rx_frag_len[i]};
        off += l.rx_frag_len[i];
      }
      n = l.rx_nfrags;
      if (l.rx_mixed) mode = gpu::Unpack::kD2D;  // pieces on several devices: one copy each
      l.rx_nfrags = 0;
    }
    if (!l.rx_stage->unpack(g.slot, l.rx_device, l.rx_unpack, n, mode).is_ok()) g.status = uint8_t(Code::kInternal);
    l.rx_device = -1;
    ++l.gpu_rx_count;
    l.copy_started(h.length);
    complete_gpu_rx(l, ep);  // small copies may be done already
    return;
  }
  auto& stats = ep->stats();
  const auto type = static_cast<FrameType>(h.type);
  if (type == FrameType::kReadResp) {
    l.rx_nfrags = 0;
    trace::mark(trace::Event::kAnswered, l.index, h.type, h.slot, h.gen);
    stats.bytes_received.fetch_add(h.length, std::memory_order_relaxed);
    stats.chunks_received.fetch_add(1, std::memory_order_relaxed);
    core::count_received(l.ctr, l.nic_ctr, h.length);
    if (l.peer->answer(l.index, h.slot, h.gen, 0) != Code::kOk)
      kill_lane(l, Status(Code::kProtocolError, "peer '" + l.peer->info().name + "' answered no request"));
    return;
  }
  if (l.rx_pin) { l.rx_pin->unpin(); l.rx_pin = nullptr; }
  for (uint32_t i = 0; i < l.rx_nfrags; ++i) l.rx_frag_pin[i]->unpin();
  l.rx_nfrags = 0;
  if (l.rx_recv) {
    l.peer->send_data_placed(l.rx_recv, h.offset, h.length);
    l.rx_recv = nullptr;
  }
  if (l.rx_status == 0) {
    stats.bytes_received.fetch_add(h.length, std::memory_order_relaxed);
    stats.chunks_received.fetch_add(1, std::memory_order_relaxed);
    core::count_received(l.ctr, l.nic_ctr, h.length);
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
    kick();
  }
  void wake() {
    work_hint_.store(true, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst)) kick();
  }
  // GPUs whose memory is registered (a bit per device): this thread's lanes prepare staging for them.
  void want_gpus(uint64_t gpus) {
    want_gpus_.store(gpus, std::memory_order_relaxed);
    wake();
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
  void update_lowat(Lane& l);
  void update_events(Lane& l);
  void do_rx(Lane& l);
  void do_tx(Lane& l);
  void retire(Lane& l);
  uint64_t moved() const;  // bytes through this thread's lanes' sockets so far
  uint64_t copy_steps() const;  // staged GPU copies of this thread's lanes started + finished so far
  int nap(epoll_event* events, int max, uint32_t us);

  core::EndpointImpl* ep_;
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

uint64_t ProgressThread::copy_steps() const {
  uint64_t n = 0;
  for (auto& l : lanes_) n += l->gpu_steps.load(std::memory_order_relaxed);
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
  // A staged payload wakes a napping thread by the 256 KiB, not per segment. The rx state belongs to
  // whoever owns rx: read unowned (TSAN found it), a stale rx_left could set a mark above what is
  // still to come, and the last bytes would wait out epoll's 1 s. While a waiter reads its own answer
  // (TcpTransport::poll) a raised mark is left as it is and the thread comes back without sleeping,
  // until it owns rx again and can lower it: the waiter may finish the payload and not wake us.
  if (!ep_->config().staging_nap_us) return;
  if (!l.try_own_rx()) {
    if (l.rx_lowat != 1) work_hint_.store(true, std::memory_order_relaxed);
    return;
  }
  // Never more than is still to come, nor than a quarter of a small socket buffer (the kernel does
  // not grow a buffer set with SO_RCVBUF to fit the low mark).
  const uint32_t buf = ep_->config().socket_buffer;
  const uint64_t most = buf ? std::min<uint64_t>(kStagedLowat, std::max<uint32_t>(buf / 4, 1)) : kStagedLowat;
  const int lowat = l.rx_state == RxState::kPayload && l.rx_device >= 0 ? int(std::min<uint64_t>(l.rx_left, most)) : 1;
  if (lowat != l.rx_lowat && lowat > 0) {  // still owning rx: a waiter cannot move the state under it
    ::setsockopt(l.fd, SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof lowat);
    l.rx_lowat = lowat;
  }
  l.disown_rx();
}

void ProgressThread::update_events(Lane& l) {
  update_lowat(l);
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
    if (prepared_gpus_) prepare_staging(*l, ep_, prepared_gpus_);
    lanes_.push_back(std::move(l));
  }
}

void ProgressThread::run() {
  sys::name_this_thread("tcp", int(index_));
  ep_->pin_progress_thread(index_);
  started_.store(true, std::memory_order_release);
  epoll_event events[64];
  // Within busy_poll_us of the last event of small traffic or of staged GPU copies the thread polls
  // instead of sleeping: a request or an answer usually follows soon, and waking a sleeping thread
  // costs more than a small transfer (docs/ARCHITECTURE.md, "Waking up"; 0 on small machines, where
  // the other side needs the core).
  using Clock = std::chrono::steady_clock;
  const auto busy = std::chrono::microseconds(ep_->config().busy_poll_us);
  auto last_event = Clock::now() - busy;
  // Staged GPU copies keep the thread polling, but a turn that found nothing to do (no socket event, no
  // byte moved, no copy started or finished) is followed by a nap of staging_nap_us, not a spin: 16
  // lanes' threads spinning on 16 cores cost CPU-seconds per GB and gained nothing over short naps
  // (docs/PERFORMANCE.md, "Defaults and why").
  const uint32_t nap_us = ep_->config().staging_nap_us;
  if (nap_us) ::prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // 1 us: the default 50 us slack would stretch a nap
  bool copies = false;  // the last turn left staged GPU copies in flight: the next one polls them
  bool napping = false;  // ... and did nothing else: the next wait is a nap of nap_us, not a spin
  while (!stop_.load(std::memory_order_acquire)) {
    sleeping_.store(true, std::memory_order_seq_cst);
    const bool hinted = work_hint_.exchange(false, std::memory_order_seq_cst);
    const bool spinning = busy.count() > 0 && Clock::now() - last_event < busy;
    const bool nap_now = napping && !hinted;
    int n = nap_now ? nap(events, 64, nap_us) : ::epoll_wait(epfd_, events, 64, hinted || spinning || copies ? 0 : 1000);
    sleeping_.store(false, std::memory_order_relaxed);
    if (n > 0 && !hinted && !spinning && !copies) trace::mark(trace::Event::kWake, index_, 0, uint32_t(n));
    const uint64_t moved_before = moved();
    const uint64_t steps_before = copy_steps();
    if (n == 0 && spinning && !hinted && !copies) sched_yield();  // copies yield below
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
    if (const uint64_t want = want_gpus_.load(std::memory_order_relaxed); want != prepared_gpus_) {
      for (auto& l : lanes_)
        if (!l->dead.load(std::memory_order_relaxed)) prepare_staging(*l, ep_, want & ~prepared_gpus_);
      prepared_gpus_ = want;
    }
    bool staging = false;  // a lane has staged GPU copies in flight
    bool small_staging = false;  // ... of at most kSmallCopy bytes
    napping = false;
    for (auto& l : lanes_) {
      if (l->dead.load(std::memory_order_relaxed)) continue;
      if (l->peer->failed()) {
        kill_lane(*l, l->peer->error());
        continue;
      }
      do_tx(*l);
      if (l->gpu_inflight.load(std::memory_order_relaxed) > 0) {  // GPU copies in flight: poll them
        staging = true;
        small_staging |= l->small_copy.load(std::memory_order_relaxed);
        if (l->try_own_rx()) {
          if (l->gpu_rx_count > 0) complete_gpu_rx(*l, ep_);
          l->disown_rx();
        }
      }
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
    copies = staging;
    if (staging) {
      // Copies in flight keep the thread polling them (`copies`): each chunk's next step (its copy done,
      // the next chunk to stage or to land) follows within microseconds, and a sleeping thread's wake-up
      // there slowed staged transfers (docs/PERFORMANCE.md, "Tried and lost"). Only copies of chunks up to
      // 256 KiB (small transfers, and staged reads under two full chunks per lane, whose 256 KiB chunks
      // were slower without it) keep it spinning after them: after larger ones every lane's thread spun
      // for busy_poll_us at each transfer's end, more CPU-seconds per GB for the same rates
      // (docs/PERFORMANCE.md, "Defaults and why").
      if (small_staging) last_event = Clock::now();
      // A turn that only polled the GPU (no socket event, no byte moved, no copy started or finished)
      // naps (above), or with staging_nap_us 0 lets another runnable thread on this core go first: 16
      // lanes' threads polling copies share 16 cores with the kernel's TCP work.
      if (n == 0 && moved() == moved_before && copy_steps() == steps_before) {
        if (nap_us) napping = true;
        else sched_yield();
      }
    } else if (n > 0 && busy.count() > 0) {
      // Otherwise only small traffic does: a host bulk flow's next event comes soon from its own
      // socket (data in, room to send), and a lane with unsent bytes is woken by EPOLLOUT; spinning
      // through them cost more CPU per GB with no gain (docs/PERFORMANCE.md, "Defaults and why").
      bool backlog = false;
      for (auto& l : lanes_) backlog |= l->tx_backlog.load(std::memory_order_relaxed);
      if (moved() - moved_before < kSpinAfterBytes && !backlog) last_event = Clock::now();
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
  // Copies still running may touch user memory: they finish before any region is let go.
  if (l.tx_stage) l.tx_stage->wait_all();
  if (l.rx_stage) l.rx_stage->wait_all();
  if (l.rx_pin) { l.rx_pin->unpin(); l.rx_pin = nullptr; }
  if (l.rx_recv) {
    l.peer->abandon_send_data(l.rx_recv);
    l.rx_recv = nullptr;
  }
  for (uint32_t i = 0; i < l.rx_nfrags; ++i)  // a batch cut short (a read's answer pins nothing here)
    if (l.rx_frag_pin[i]) l.rx_frag_pin[i]->unpin();
  l.rx_nfrags = 0;
  for (; l.gpu_rx_count > 0; --l.gpu_rx_count, l.gpu_rx_head = (l.gpu_rx_head + 1) % kStageSlots) {
    GpuRx& g = l.gpu_rx[l.gpu_rx_head];
    if (g.pin) g.pin->unpin();
    for (uint32_t i = 0; i < g.npins; ++i) l.gpu_rx_pins[l.gpu_rx_head][i]->unpin();
    if (g.recv) {
      g.recv->record_error(l.peer->error());
      g.recv->release();
    }
  }
  for (size_t i = 0; i < l.tx_count; ++i) {
    TxItem& it = l.tx[(l.tx_head + i) % kTxRing];
    if (it.pin) it.pin->unpin();
    if (it.batch) it.batch->release();
  }
  l.tx_count = 0;
  l.note_starving();  // no longer counted in g_starving
  TxItem a;
  while (l.answers.pop(&a)) {
    if (a.pin) a.pin->unpin();
    if (a.batch) a.batch->release();
  }
  l.peer->release_lane(l.index, Code::kConnectionLost);
  // tx and rx stay owned: the lane is dead and no other thread touches its socket. The fd is closed
  // when the peer's last hold goes (Link::hold), so its number is not reused while another
  // thread may still shut it down.
  l.peer->let_go();
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
  c.staged_gpu = true;
  c.batch_fragments = wire::kMaxFragments;
  // Reads are paced like writes (kLaneQueueChunks chunks' bytes per socket): a lane asks for more only
  // as answers come in, so a transfer's chunks spread over every lane and faster lanes still take more.
  // Filling the window at once left a large host read on a few of its lanes (docs/PERFORMANCE.md,
  // "Defaults and why").
  c.read_depth = uint32_t(kLaneQueueChunks);
  c.wait_naps = true;  // every lane's answers are landed by its thread (ARCHITECTURE.md, "Waking up")
  // Small reads travel as kReadBatch chunks: one request and one answer for up to kMaxFragments blocks
  // (a KV pull of 4,096 × 16 KiB blocks from GPU memory was 4,096 round trips and copies otherwise).
  c.batch_reads = true;
  c.gpu_batch_chunks = kGpuBatchChunks;
  // Large reads staged through GPU memory are pushed by the target (wire::kPull, Link::pulls); a
  // pushed chunk keeps its region pinned until sent (TxItem::pin), as a read's answer does.
  c.pull_reads = true;
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
  return endpoint_->config().channels * endpoint_->config().sockets_per_channel;
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
    thread_of[i] = endpoint_->thread_for_lane(i, path.nic, earlier) % threads_.size();
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
    // A one-chunk transfer is sent by the posting thread itself when a lane's tx is free: that
    // saves waking a progress thread (a third of a small write's latency on few cores).
    // From the quietest lane (Link::quietest_lane): lone transfers keep to one lane, whose
    // progress threads on both sides are still awake from the last one.
    const size_t n = state->lanes.size();
    const uint32_t first = peer->quietest_lane();
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

void TcpTransport::poll(Link* peer, uint32_t lane) {
  auto* state = static_cast<TcpPeerLanes*>(peer->transport_state.get());
  if (!state || lane >= state->lanes.size()) return;
  std::shared_ptr<Lane> l = state->lanes[lane].lock();
  if (!l || l->dead.load(std::memory_order_relaxed) || !l->try_own_rx()) return;
  if (!l->dead.load(std::memory_order_relaxed)) receive(*l, endpoint_, kPollBudget);
  // What this read leaves for the progress thread, which may be asleep in epoll with nothing to tell it:
  // a copy into the GPU it started (only rx polling finishes it), a staged payload it left half in (the
  // socket's low mark still asks for the bytes it took). The caller may stop polling at any time (wait()
  // spins for busy_poll_us only): without this wake a transfer sat out the thread's 1 s epoll timeout.
  const bool left = l->gpu_rx_count > 0 || (l->rx_state == RxState::kPayload && l->rx_device >= 0);
  l->disown_rx();
  // Answers this read produced (acks for the peer's own writes) go out from the progress thread.
  if (left || !l->answers.empty() || l->rx_paused.load(std::memory_order_relaxed)) l->thread->wake();
}

void TcpTransport::detach(Link& peer) { peer.transport_state.reset(); }

void TcpTransport::stop() {
  if (stopped_.exchange(true)) return;
  for (auto& t : threads_) t->stop();
}

}  // namespace tether::transport
