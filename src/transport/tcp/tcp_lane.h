// The tcp transport's internals, shared by its files: a Lane (one data socket to one peer) and what it
// holds, and the functions each file gives the others.
//   tcp_lane.cc       the socket engine: tx and rx state machines over the lane's socket
//   tcp_staging.cc    GPU staging of a lane: bounce slots, copies out of and into GPU memory, first copies first
//   tcp_batch.cc      batch frames (kWriteBatch, kReadBatch): tables checked and pinned, answers gathered
//   tcp_transport.cc  progress threads and the TcpTransport object
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/lanes.h"
#include "core/region.h"
#include "core/transfer.h"
#include "core/wire.h"
#include "gpu/staging.h"
#include "transport/host.h"
#include "transport/link.h"

namespace tether::transport::tcp {

using core::RegionState;
using core::TransferState;
using wire::FrameHeader;
using wire::FrameType;

constexpr size_t kRxBuffer = 64 << 10;
constexpr size_t kTxRing = 1024;             // frames a lane holds unsent (chunks + answers)
constexpr size_t kAnswerRing = 512;          // answers produced by rx, waiting for the tx owner
constexpr size_t kMaxIov = 1024;             // IOV_MAX: a batched chunk is a header, a table and its pieces
constexpr uint64_t kRxBudget = 16ull << 20;  // bytes per lane per turn, for fairness
constexpr uint64_t kTxBudget = 16ull << 20;
constexpr uint64_t kYieldingSendBytes = 256 << 10;  // one sendmsg of a lane yielding its copies (drive_tx)
constexpr uint64_t kPollBudget = 256 << 10;  // a waiting thread reads little: it wants its answer
constexpr uint32_t kStageSlots = 8;          // pinned bounce slots per lane and direction (GPU memory)

constexpr uint32_t kReadAnswers = 64;           // kReadBatch answers a lane holds at once (then it stops reading)
constexpr int kStagedLowat = 256 << 10;         // SO_RCVLOWAT while a staged payload arrives (kStagingNapUs)
// A thread whose lanes wait only on staged GPU copies naps this long between polls of them: short beside
// a copy, yet it leaves the core to the kernel's TCP work.
constexpr uint32_t kStagingNapUs = 8;
constexpr uint64_t kSpinAfterBytes = 64 << 10;  // a progress loop that moved less is "small traffic"
constexpr uint64_t kTinyRequest = 4 << 10;      // a write or read request this small: its next comes soon
constexpr uint32_t kRequestSpinUs = 50;         // ... so its thread polls this long after it (run())
constexpr uint64_t kLaneQueueChunks = 2;        // chunks a lane's socket may hold (ours + the kernel's)
constexpr uint64_t kSmallCopy = 256 << 10;      // staged copies up to this extend the busy window (run())
// A copy this small ends within microseconds of its start: a thread waiting on it polls instead of
// napping, as a nap and its wake-up would take longer than the copy (a lone small GPU op's latency);
// for kTinyCopyPollUs after the last copy started or finished at most (a copy queued behind other
// work on the GPU does not hold a core).
constexpr uint64_t kTinyCopy = 64 << 10;
constexpr uint32_t kTinyCopyPollUs = 50;

// Chunks' bytes a kWriteBatch or kReadBatch from or to GPU memory may carry (Caps::gpu_batch_chunks): each
// batch costs a gather and an unpack kernel, so fewer, larger batches move scattered blocks faster. Both
// sides must agree (wire::kVersion): a receiver kills the lane on a longer batch.
constexpr uint32_t kGpuBatchChunks = 2;

constexpr uint64_t kTableBytes = uint64_t(wire::kMaxFragments) * sizeof(wire::Fragment);

// First copies first (tcp_staging.cc): per GPU, the lanes whose every queued item waits for its copy out of it.
constexpr int kMaxGpus = 64;
extern std::atomic<int> g_starving[kMaxGpus];

// A kReadBatch being answered: its fragments' places, and their regions pinned until the answer is sent.
// The rx owner takes one (it grows the lane's set), the tx owner lets it go.
struct ReadAnswer {
  std::atomic<bool> busy{false};
  uint32_t n = 0;
  Piece pieces[wire::kMaxFragments];
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
  const Piece* pieces = nullptr;
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
  uint32_t npins = 0;       // a batch's regions, held until its copy is done (in LaneStaging::gpu_rx_pins)
  uint64_t start_ns = 0;    // when its copy to the GPU started
};

enum class RxState { kHeader, kPayload, kDiscard };

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
    if (!peek(out)) return false;
    head_.store(head_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    return true;
  }

 private:
  std::vector<TxItem> items_ = std::vector<TxItem>(kAnswerRing);
  std::atomic<size_t> head_{0}, tail_{0};
};

// Send state: belongs to whoever holds `owned` (the progress thread, or a user thread sending inline).
struct LaneTx {
  std::atomic<bool> owned{false};
  std::atomic<bool> backlog{false};  // unsent bytes wait for EPOLLOUT
  std::vector<TxItem> ring = std::vector<TxItem>(kTxRing);
  size_t head = 0, count = 0;
  uint64_t head_sent = 0;   // bytes of the head item (header + payload) already sent
  uint64_t unsent = 0;      // bytes queued and not yet sent
  uint32_t unstaged = 0;    // queued items whose copy out of the GPU has not finished
};

// Receive state: belongs to whoever holds `owned` (the progress thread, or a thread polling for its answer).
struct LaneRx {
  std::atomic<bool> owned{false};
  std::atomic<bool> paused{false};  // no room to answer: stop reading until answers drain
  std::unique_ptr<uint8_t[]> buf = std::make_unique<uint8_t[]>(kRxBuffer);  // headers, tables, small frames
  size_t begin = 0, end = 0;
  RxState state = RxState::kHeader;
  FrameHeader hdr{};            // the frame being received
  uint8_t* dest = nullptr;      // where its payload goes next; null while discarding
  uint64_t left = 0;
  uint8_t status = 0;           // its answer
  RegionState* pin = nullptr;
  TransferState* recv = nullptr;
  int32_t device = -1;          // >= 0: payload lands in `slot`, then is copied to `final` on this GPU
  gpu::StagingSlot* slot = nullptr;
  uint8_t* final = nullptr;
  int lowat = 1;                // the socket's SO_RCVLOWAT
  // The kWriteBatch (or kReadBatch answer) being received: destinations checked and pinned before any byte lands.
  uint32_t nfrags = 0, frag = 0;
  bool mixed = false;           // its destinations span host and GPUs, or several GPUs
  uint8_t* frag_dest[wire::kMaxFragments];
  uint64_t frag_len[wire::kMaxFragments];
  RegionState* frag_pin[wire::kMaxFragments];
  std::vector<std::unique_ptr<ReadAnswer>> read_answers;  // kReadBatch answers, grown up to kReadAnswers
};

// GPU staging, created on a lane's first GPU chunk. The tx_* fields, device and starving_on belong to
// the tx owner; the rx_* and gpu_rx* fields (frames whose copy to the GPU is in flight) to the rx owner.
struct LaneStaging {
  std::unique_ptr<gpu::StagingRing> tx_ring, rx_ring;
  uint32_t tx_peak = 0, rx_peak = 0;  // the most slots each ring held at once, as last published
  gpu::Fragment tx_gather[wire::kMaxFragments];  // a GPU batch's pieces, for the gather
  gpu::Fragment rx_unpack[wire::kMaxFragments];
  GpuRx gpu_rx[kStageSlots];
  RegionState* gpu_rx_pins[kStageSlots][wire::kMaxFragments];
  uint32_t gpu_rx_head = 0, gpu_rx_count = 0;
  std::atomic<uint32_t> inflight{0};   // staged copies in flight: the progress thread polls them (or naps)
  std::atomic<uint64_t> steps{0};      // staged copies started + finished: a turn that moved it did work
  std::atomic<uint64_t> latest_copy{0}; // bytes the latest staged copy moved
  int device = -1;                     // the GPU of the latest copy out of one
  int starving_on = -1;                // the GPU whose g_starving counts this lane, or -1
};

class ProgressThread;

// One data socket to one peer.
struct Lane {
  std::shared_ptr<Link> peer;
  ProgressThread* thread = nullptr;
  uint32_t index = 0;
  int fd = -1;
  core::LinkCounters* ctr = nullptr;      // this lane's counters (owned by the peer)
  core::LinkCounters* nic_ctr = nullptr;  // its NIC's (owned by the endpoint)
  std::atomic<bool> dead{false};
  std::atomic<uint64_t> io_bytes{0};      // bytes through its socket, both ways (busy polling's "bulk")
  std::atomic<uint64_t> small_requests{0};  // writes and read requests of <= kTinyRequest bytes it served
  uint32_t epoll_events = 0;              // progress thread only
  AnswerRing answers;                     // produced by rx, sent by tx
  LaneTx tx;
  LaneRx rx;
  LaneStaging stage;

  bool try_own_tx() { return !tx.owned.exchange(true, std::memory_order_acquire); }
  void disown_tx() { tx.owned.store(false, std::memory_order_seq_cst); }
  bool try_own_rx() { return !rx.owned.exchange(true, std::memory_order_acquire); }
  void disown_rx() { rx.owned.store(false, std::memory_order_release); }
  void queue(const TxItem& it) {
    tx.ring[(tx.head + tx.count) % kTxRing] = it;
    ++tx.count;
    tx.unsent += sizeof(FrameHeader) + it.length;
  }

  // Counts the lane in g_starving while it holds items but none it could send yet (first copies first).
  void note_starving() {
    const int now = tx.count > 0 && tx.unstaged == tx.count ? stage.device : -1;
    if (now == stage.starving_on) return;
    if (stage.starving_on >= 0) g_starving[stage.starving_on].fetch_sub(1, std::memory_order_relaxed);
    if (now >= 0) g_starving[now].fetch_add(1, std::memory_order_relaxed);
    stage.starving_on = now;
  }
  // Whether to leave the copy engines of its GPU to lanes that wait for their first copy.
  bool yield_copies() const {
    return tx.count > 0 && stage.starving_on < 0 && stage.device >= 0 &&
           g_starving[stage.device].load(std::memory_order_relaxed) > 0;
  }
  void copy_started(uint64_t bytes) {
    stage.inflight.fetch_add(1, std::memory_order_relaxed);
    stage.steps.fetch_add(1, std::memory_order_relaxed);
    stage.latest_copy.store(bytes, std::memory_order_relaxed);
  }
  void copy_finished() {
    stage.inflight.fetch_sub(1, std::memory_order_relaxed);
    stage.steps.fetch_add(1, std::memory_order_relaxed);
  }
};

// ---- the socket engine (tcp_lane.cc)
// Sends what the lane holds (answers first, then chunks it takes while its socket keeps up).
// Caller owns tx. Returns false if the socket (or a GPU copy) failed.
bool drive_tx(Lane& l, Host* host, Status* error);
// Reads and handles what the lane's socket holds, up to `budget` bytes. Caller owns rx.
void receive(Lane& l, Host* host, uint64_t budget = kRxBudget);
// A lane whose socket failed: the peer moves its chunks to surviving lanes, or fails if none is left.
void kill_lane(Lane& l, Status why);
// Kills the lane for a frame the peer should not have sent: "peer '<name>' <what>". Returns false.
bool protocol_error(Lane& l, const char* what);
// A frame's payload has landed in host memory, or its copy to the GPU has finished: counts it received.
void count_landed(Lane& l, Host* host, uint64_t length);
// Queues the kAck answering frame `h` with `status`.
void push_ack(Lane& l, const FrameHeader& h, uint8_t status);
// The payload of the frame being received is complete: answers it (or starts its copy to the GPU).
void payload_done(Lane& l, Host* host);

// ---- GPU staging (tcp_staging.cc)
// Pins a lane's staging for the GPUs in `gpus` (a bit per device) ahead of its first GPU chunk.
void prepare_staging(Lane& l, Host* host, uint64_t gpus);
// Starts copying a GPU payload into a pinned tx slot. False without an error: no slot is free yet.
bool stage_tx(Lane& l, Host* host, TxItem& it, Status* error);
// Room to land one more GPU-bound payload of `length` bytes?
bool gpu_rx_room(const Lane& l, uint64_t length);
// Points the payload of the frame being received at a bounce slot; payload_done copies it to `final`.
bool land_in_bounce(Lane& l, Host* host, int device, uint8_t* final);
// The frame received into a bounce slot is complete: starts its copy to the GPU, then answers it once done.
void unpack_to_gpu(Lane& l, Host* host);
// Answers, in order, the frames whose copy from a bounce slot to the GPU has finished. Caller owns rx.
void complete_gpu_rx(Lane& l, Host* host);

// ---- batch frames (tcp_batch.cc): a kWriteBatch / kReadBatch header and its table (in the rx buffer).
bool on_batch(Lane& l, Host* host);
bool on_read_batch(Lane& l, Host* host);

}  // namespace tether::transport::tcp
