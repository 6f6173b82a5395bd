// PeerState: the link to another endpoint. Holds the chunk scheduler every transport takes chunks
// from (work queue, window, chunk slots), the two-sided rendezvous (RTS/CTS), notifications
// and failure handling. Transports move frames; everything else about a transfer lives here.
// Its parts: peer.cc (life, holds, failure), peer_post.cc (user side: posts, cancel),
// chunk_scheduler.cc (chunks out, answers in), rendezvous.cc (send/recv, pulled reads),
// peer_control.cc (control messages, notifications).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/lanes.h"
#include "core/transfer.h"
#include "core/wire.h"
#include "sys/net.h"
#include "tether/endpoint.h"
#include "transport/link.h"

namespace tether::core {

class EndpointImpl;
using transport::ChunkOp;
using transport::PeerInfo;
using transport::Piece;

// What one peer can make this side hold (docs/RELIABILITY.md, "Bounds"): its control connection is not
// read while kControlBacklog bytes of control output wait for it; answers raised elsewhere (a refused
// kPull arrives on a data lane) drop it past kAnswerBacklog, which a throttled peer never reaches.
constexpr size_t kControlBacklog = 1 << 20;
constexpr size_t kAnswerBacklog = 4 * kControlBacklog;
// RTSs of one peer no recv here has matched yet; one more is refused (kResourceExhausted in its CTS).
constexpr size_t kMaxUnexpected = 1 << 14;

using tether::BlockRun;  // blocks sharing one local region and one descriptor; borrowed by post_rma only

class PeerState final : public transport::Link {
 public:
  PeerState(std::shared_ptr<EndpointImpl> endpoint, PeerInfo info, uint32_t lanes, transport::Transport* transport);
  ~PeerState();
  std::shared_ptr<PeerState> self() { return std::static_pointer_cast<PeerState>(shared_from_this()); }

  // The transport::Link overrides say what they do in transport/link.h.
  uint32_t slot_count() const override { return uint32_t(slots_.size()); }
  uint32_t busy_poll_us() const override;
  bool wait_naps() const { return wait_naps_; }  // the transport's Caps::wait_naps
  uint32_t quietest_lane() const override;
  // Reads `lane` from the calling thread if nobody else is (a waiter fetching its own answer).
  void progress_lane(uint32_t lane);
  // Finishes from the calling thread work another thread would hand back (Transport::finish_here).
  void finish_here();
  bool failed() const override { return failed_.load(std::memory_order_acquire); }
  Status error() const override;

  // ---- user side: validate, then queue. Errors finish the transfer before any byte moves.
  // Writes or reads the blocks of `runs` as one transfer. Errors name the block by its index over
  // all runs, as "(<noun> i)" ("entry" or "block"), when there is more than one block.
  Transfer post_rma(OpKind op, const BlockRun* runs, size_t nruns, const char* noun, std::string notify);
  Transfer post_send(const Region& local, uint64_t offset, uint64_t length, uint64_t tag);
  Transfer post_recv(const Region& local, uint64_t offset, uint64_t length, uint64_t tag);
  Transfer post_notify(std::string data);

  // ---- transport side (called by the lane's progress thread only)
  bool next_chunk(uint32_t lane, ChunkOp* op) override;
  bool has_work() const override {
    return queue_head_.load(std::memory_order_acquire) != nullptr || resend_count_.load(std::memory_order_acquire) > 0;
  }
  Code answer(uint32_t lane, uint32_t slot, uint32_t gen, uint8_t status) override;
  Code read_batch(uint32_t lane, uint32_t slot, uint32_t gen, uint32_t n, const wire::Fragment** frags,
                  const Piece** pieces, int* device) override;
  Code read_destination(uint32_t lane, uint32_t slot, uint32_t gen, uint64_t length, uint8_t** dest, int* device,
                        const Piece** pieces = nullptr, uint32_t* npieces = nullptr) override;
  Code resolve_send_data(uint32_t token, uint64_t offset, uint64_t length, uint64_t unit, uint16_t flags,
                         uint8_t** dest, TransferState** recv, int* device) override;
  void send_data_placed(TransferState* recv, uint64_t offset, uint64_t length) override;
  bool on_pull(const wire::FrameHeader& h) override;
  void abandon_send_data(TransferState* recv) override;
  void lane_failed(uint32_t lane, Status why) override;
  void release_lane(uint32_t lane, Code code) override;
  LinkCounters& lane_counters(uint32_t lane) override { return lane_counters_[lane]; }
  uint64_t lane_bytes(uint32_t lane) const override { return lane_bytes_[lane].load(std::memory_order_relaxed); }
  uint64_t unanswered_bytes() const override {
    uint64_t sum = 0;
    for (uint32_t i = 0; i < lanes_; ++i) sum += lane_bytes(i);
    return sum;
  }
  bool lane_alive(uint32_t lane) const override;

  // ---- control side (control thread)
  void on_control(wire::ControlType type, const uint8_t* body, uint32_t length);
  // Appends the queued control bytes to `out` (unsent from `sent` on); ctl_unsent_ counts them until the
  // next set_control_unsent().
  bool take_control_output(std::string* out, size_t sent);
  void set_control_unsent(size_t bytes) { ctl_unsent_.store(bytes, std::memory_order_relaxed); }
  void touch() { last_heard_ms_.store(sys::now_ms(), std::memory_order_relaxed); }
  int64_t last_heard_ms() const { return last_heard_ms_.load(std::memory_order_relaxed); }
  void send_control(wire::ControlType type, const void* body, uint32_t length);
  // An answer to a request of the peer: queued, or, past kAnswerBacklog unsent control bytes, the peer is
  // failed (it does not read its control connection) and false comes back.
  bool send_answer(wire::ControlType type, const void* body, uint32_t length);

  // Transfer::cancel(): takes `t` off the work queue (and a send or recv out of the rendezvous) so no
  // further chunk leaves; it ends with kCancelled once its chunks in flight are answered.
  void cancel(TransferState* t);
  // Fails sends still waiting for a CTS and recvs still unmatched that use `region`.
  void cancel_region(const RegionState* region);
  // A read this side pushes to the peer still reads `region` (deregister() waits on its chunks' pins).
  bool pushes_from(const RegionState* region) const;
  void fail(Status s) override;

  // ---- holds (transport/link.h): the control side holds the peer too, until let_go_control().
  bool hold() override;
  void let_go() override;
  void let_go_control();            // the control side's hold; once
  bool released() const override { return released_.load(std::memory_order_acquire); }
  bool wait_released(int64_t timeout_ms);  // true once released
  // Called by TransferState when its last chunk is answered.
  void transfer_drained(TransferState* t);
  void count_finished(bool ok);

  int control_fd = -1;
  // Control-thread-only I/O state.
  std::string ctl_in, ctl_pending;
  size_t ctl_sent = 0;
  int64_t last_sent_ms = 0;
  bool ctl_epollout = false;
  bool ctl_backlogged = false;      // too much unsent control output: not read until it drains
  int64_t accept_deadline_ms = 0;   // listener side: all lanes must join by then

 private:
  struct Slot {
    ChunkOp op;                 // what was sent: sent again as is if its lane dies
    TransferState* transfer = nullptr;
    uint8_t* local = nullptr;   // read destination
    uint64_t length = 0;
    uint32_t gen = 0;
    uint32_t lane = 0;
    int32_t device = -1;        // GPU of `local`, -1 for host memory
    bool used = false;
    std::unique_ptr<wire::Fragment[]> frags;  // a batched chunk's fragments (allocated once, on first batch)
    std::unique_ptr<Piece[]> pieces;
  };
  // The chunk scheduler's steps (chunk_scheduler.cc; mu_ held).
  bool take_chunk(uint32_t lane, ChunkOp* op, TransferState** drained, TransferState** stopped);
  bool take_pull(uint32_t lane, ChunkOp* op);
  bool take_resend(uint32_t lane, ChunkOp* op, TransferState** stopped);
  RegionState* pin_source(const TransferState& t);
  void pop_queue_head(TransferState* t);
  uint64_t chunk_bytes_for(const TransferState& t, const Segment& seg) const;
  bool gpu_batched(const TransferState& t, const Segment& seg, uint64_t chunk) const;
  bool read_depth_reached(const TransferState& t, const Segment& seg, uint32_t lane, uint64_t chunk) const;
  TransferState* free_slot(uint32_t idx);  // back to the free list; its gen moves on, so late answers miss
  uint32_t new_token();                     // a recv token, never 0
  Slot& claim_slot(TransferState* t, uint32_t lane, const Segment& seg, RegionState* pinned, ChunkOp* op);
  bool cut_batch(TransferState* t, Slot& s, const Segment& seg, uint64_t chunk, ChunkOp* op);
  void cut_chunk(TransferState* t, Slot& s, const Segment& seg, uint64_t chunk, ChunkOp* op);
  uint32_t pack_batch(TransferState* t, Slot& s, uint64_t chunk, uint64_t limit);

  Transfer start(std::shared_ptr<TransferState> t);  // registers the keepalive
  void enqueue(TransferState* t);                    // puts on the work queue, wakes lanes
  // Pairs a recv with an RTS (mu_ held); returns the CTS to send once the lock is dropped.
  wire::CtsBody match(TransferState* recv, const wire::RtsBody& rts, TransferState** release_now);
  // Control messages in, one handler each (on_control): false for a malformed one, which drops the peer.
  bool on_notify(const uint8_t* body, uint32_t length);
  bool on_notify_ack(const uint8_t* body, uint32_t length);
  bool on_rts(const uint8_t* body, uint32_t length);
  bool on_cts(const uint8_t* body, uint32_t length);
  bool on_cancel(const uint8_t* body, uint32_t length);
  bool on_pull_fail(const uint8_t* body, uint32_t length);
  bool on_pull_cancel(const uint8_t* body, uint32_t length);
  // Takes `key` out of one of the maps of transfers (under mu_): its transfer, or null if it has none.
  template <class Map>
  TransferState* take_entry(Map& map, const typename Map::key_type& key) {
    std::lock_guard lock(mu_);
    auto it = map.find(key);
    if (it == map.end()) return nullptr;
    TransferState* t = it->second;
    map.erase(it);
    return t;
  }
  // A control message's fixed-size body; false if `length` is not its size.
  template <class T>
  static bool body_as(const uint8_t* body, uint32_t length, T* out) {
    if (length != sizeof(T)) return false;
    std::memcpy(out, body, sizeof(T));
    return true;
  }
  Status refusal(const char* what, uint64_t bytes, uint8_t status) const;
  // A read the target pushes (Caps::pull_reads): one kPull frame, moved by the target as a send.
  bool pulls(const TransferState& t) const;
  void pull(TransferState* t);

  void push_stopped(TransferState* t);     // its region was deregistered: fail it, tell the reader
  Status notify_too_large(size_t bytes) const;
  // `chunk`, or smaller for a GPU read staged through host (pipelined_chunk, chunk_scheduler.cc).
  uint64_t read_chunk_bytes(const TransferState& t, int local_device, const RemoteRegion* remote, uint64_t chunk) const;

  const std::shared_ptr<EndpointImpl> endpoint_;
  const uint32_t batch_max_;  // the transport's Caps::batch_fragments: most fragments in a kWriteBatch chunk
  const bool batch_reads_;    // the transport's Caps::batch_reads
  const uint32_t gpu_batch_chunks_;  // the transport's Caps::gpu_batch_chunks
  const uint64_t gpu_chunk_;  // the transport's chunk size between GPU memory on both ends (0: none)
  const uint32_t read_depth_; // the transport's Caps::read_depth (0: reads fill the lane's window)
  const bool staged_gpu_;     // Caps::staged_gpu: GPU reads pipeline smaller chunks
  const bool wait_naps_;      // Caps::wait_naps
  const bool pull_reads_;     // Caps::pull_reads
  const uint32_t lane_window_;
  std::atomic<bool> failed_{false};
  std::atomic<int64_t> last_heard_ms_;
  std::atomic<uint32_t> holds_{1};  // the control side's; lanes and calls add theirs (hold())
  std::atomic<bool> control_let_go_{false};
  void release_all();               // the last hold went: close the sockets, drop the transport's state
  std::atomic<bool> released_{false};  // release_all() finished
  std::mutex released_mu_;
  std::condition_variable released_cv_;

  mutable std::mutex mu_;  // never held across a system call
  Status error_;
  std::atomic<TransferState*> queue_head_{nullptr};
  TransferState* queue_tail_ = nullptr;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_slots_;
  std::vector<uint32_t> lane_inflight_;
  std::vector<uint8_t> lane_dead_;
  uint32_t live_lanes_;
  std::vector<uint32_t> resend_;         // slots whose lane died, for the next lane with room (capacity: all slots)
  // kPull frames to send: (token, resent); their reads are in matched_ from the post on.
  std::deque<std::pair<uint32_t, bool>> pulls_out_;
  std::atomic<uint32_t> resend_count_{0};  // resend_ + pulls_out_ (has_work() reads it without the lock)
  void publish_resends() { resend_count_.store(uint32_t(resend_.size() + pulls_out_.size()), std::memory_order_release); }
  std::unique_ptr<LinkCounters[]> lane_counters_;
  std::unique_ptr<std::atomic<uint64_t>[]> lane_bytes_;  // written under mu_

  // Two-sided rendezvous and notifications (control path; allocation allowed).
  uint64_t next_msg_id_ = 1;
  uint32_t next_token_ = 1;
  std::unordered_map<uint64_t, TransferState*> awaiting_cts_;     // msg id -> send
  std::unordered_map<uint64_t, std::deque<TransferState*>> posted_recvs_;  // tag -> recvs
  // RTSs of one tag no recv matched yet, from `head` on (not a deque: its first block alone is 512
  // bytes, and a peer chooses how many tags it uses).
  struct Unmatched {
    std::vector<wire::RtsBody> rts;
    size_t head = 0;
  };
  std::unordered_map<uint64_t, Unmatched> unexpected_;  // tag -> RTSs
  size_t unexpected_count_ = 0;                         // RTSs in unexpected_ (at most kMaxUnexpected)
  // Takes the oldest RTS of `tag` out of unexpected_ into *rts (mu_ held); false if there is none.
  bool take_unexpected(uint64_t tag, wire::RtsBody* rts);
  std::unordered_map<uint32_t, TransferState*> matched_;          // token -> recv
  std::unordered_map<uint64_t, TransferState*> awaiting_ack_;     // notify id -> transfer
  std::unordered_map<uint32_t, TransferState*> pushes_;           // the peer's pull token -> our send of it

  std::mutex out_mu_;
  std::string control_out_;
  std::atomic<size_t> ctl_unsent_{0};  // control bytes the control thread took and has not sent yet
  bool queue_control(wire::ControlType type, const void* body, uint32_t length, size_t limit);
};

}  // namespace tether::core
