// PeerState: the link to another endpoint. Holds the chunk scheduler every transport pulls
// from (work queue, window, chunk slots), the two-sided rendezvous (RTS/CTS), notifications
// and failure handling. Transports move frames; everything else about a transfer lives here.
#pragma once
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/transfer.h"
#include "core/wire.h"
#include "tether/endpoint.h"

namespace tether::transport {
class Transport;
}

namespace tether::core {

class EndpointImpl;

// What a lane puts on the wire next: a header and, for writes and sends, the local payload.
struct ChunkOp {
  wire::FrameHeader hdr;
  const uint8_t* payload = nullptr;
  uint64_t length = 0;
  uint8_t* local = nullptr;          // the chunk's local bytes (a read's destination)
  const Segment* segment = nullptr;  // local region, remote descriptor (transport extensions)
  uint64_t segment_offset = 0;       // where in the segment this chunk starts
};

struct PeerInfo {
  uint64_t id = 0;
  EndpointId endpoint{};
  std::string name;
  bool same_host = false;
  std::string transport;         // the transport carrying its data
  uint32_t heartbeat_ms = 1000;  // ours, or sooner if the other side's peer_timeout needs it
};

class PeerState : public std::enable_shared_from_this<PeerState> {
 public:
  PeerState(std::shared_ptr<EndpointImpl> endpoint, PeerInfo info, uint32_t lanes, transport::Transport* transport);
  ~PeerState();

  const PeerInfo& info() const { return info_; }
  uint32_t lanes() const { return lanes_; }
  uint32_t spin_us() const;
  // Reads `lane` from the calling thread if nobody else is (a waiter fetching its own answer).
  void poll(uint32_t lane);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  Status error() const;

  // ---- user side: validate, then queue. Errors finish the transfer before any byte moves.
  Transfer post_rma(OpKind op, std::vector<IoEntry> entries, std::string notify);
  Transfer post_send(const Region& local, uint64_t offset, uint64_t length, uint64_t tag);
  Transfer post_recv(const Region& local, uint64_t offset, uint64_t length, uint64_t tag);
  Transfer post_notify(std::string data);

  // ---- transport side (called by the lane's progress thread only)
  // Next chunk for `lane` if the lane's window allows; fills op and claims a slot.
  bool next_chunk(uint32_t lane, ChunkOp* op);
  bool has_work() const { return queue_head_.load(std::memory_order_acquire) != nullptr; }
  // A target answered chunk (slot, gen). kProtocolError if the answer names no chunk of this lane.
  Code answer(uint32_t lane, uint32_t slot, uint32_t gen, uint8_t status);
  // Where a kReadResp payload of `length` bytes goes.
  Code read_destination(uint32_t lane, uint32_t slot, uint32_t gen, uint64_t length, uint8_t** dest);
  // Target side of kSendData: where the bytes go inside the matched recv `token`.
  Code resolve_send_data(uint32_t token, uint64_t offset, uint64_t length, uint8_t** dest, TransferState** recv);
  void send_data_placed(TransferState* recv, uint64_t length);
  // The lane is gone: answer everything it had in flight with `code`.
  void release_lane(uint32_t lane, Code code);

  // ---- control side (control thread)
  void on_control(wire::ControlType type, const uint8_t* body, uint32_t length);
  // Takes the queued control bytes to send (called by the control thread).
  bool take_control_output(std::string* out);
  void touch() { last_heard_ms_.store(now_ms(), std::memory_order_relaxed); }
  int64_t last_heard_ms() const { return last_heard_ms_.load(std::memory_order_relaxed); }
  void send_control(wire::ControlType type, const void* body, uint32_t length);

  // Fails sends still waiting for a CTS and recvs still unmatched that use `region`.
  void cancel_region(const RegionState* region);
  // Fails the peer once: every transfer still using it ends with `s`, sockets are shut down.
  void fail(Status s);
  // Called by TransferState when its last chunk is answered.
  void transfer_drained(TransferState* t);
  void count_finished(bool ok);

  transport::Transport* const transport;  // owned by the endpoint, which outlives the peer
  int control_fd = -1;
  std::vector<int> lane_fds;
  // The transport's per-peer state (its lanes), opaque to the core; set before the peer is used.
  std::shared_ptr<void> transport_state;
  // Control-thread-only I/O state.
  std::string ctl_in, ctl_pending;
  size_t ctl_sent = 0;
  int64_t last_sent_ms = 0;
  bool ctl_epollout = false;
  int64_t accept_deadline_ms = 0;   // listener side: all lanes must join by then
  static int64_t now_ms();

 private:
  struct Slot {
    TransferState* transfer = nullptr;
    uint8_t* local = nullptr;   // read destination
    uint64_t length = 0;
    uint32_t gen = 0;
    uint32_t lane = 0;
    bool used = false;
  };

  Transfer start(std::shared_ptr<TransferState> t);  // registers the keepalive
  void enqueue(TransferState* t);                    // puts on the work queue, wakes lanes
  Transfer finished_with(std::shared_ptr<TransferState> t, Status s);
  // Pairs a recv with an RTS (mu_ held); returns the CTS to send once the lock is dropped.
  wire::CtsBody match(TransferState* recv, const wire::RtsBody& rts, TransferState** release_now);
  Status chunk_error(const Slot& s, uint8_t status) const;

  const std::shared_ptr<EndpointImpl> endpoint_;
  PeerInfo info_;
  const uint32_t lanes_;
  const uint32_t lane_window_;
  std::atomic<bool> failed_{false};
  std::atomic<int64_t> last_heard_ms_;

  mutable std::mutex mu_;  // never held across a system call
  Status error_;
  std::atomic<TransferState*> queue_head_{nullptr};
  TransferState* queue_tail_ = nullptr;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_slots_;
  std::vector<uint32_t> lane_inflight_;

  // Two-sided rendezvous and notifications (control path; allocation allowed).
  uint64_t next_msg_id_ = 1;
  uint32_t next_token_ = 1;
  std::unordered_map<uint64_t, TransferState*> awaiting_cts_;     // msg id -> send
  std::unordered_map<uint64_t, std::deque<TransferState*>> posted_recvs_;  // tag -> recvs
  std::unordered_map<uint64_t, std::deque<wire::RtsBody>> unexpected_;     // tag -> RTSs
  std::unordered_map<uint32_t, TransferState*> matched_;          // token -> recv
  std::unordered_map<uint64_t, TransferState*> awaiting_ack_;     // notify id -> transfer

  std::mutex out_mu_;
  std::string control_out_;
};

}  // namespace tether::core
