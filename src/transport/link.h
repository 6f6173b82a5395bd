// Link: a peer as its transport sees it — the one view of the core's per-peer state a transport has
// (with transport::Host for the endpoint). Lanes take chunks from it (next_chunk), give it the peer's
// answers, ask it where incoming bytes go and tell it when a lane fails. core::PeerState implements it:
// windows, chunk slots, rendezvous and notifications stay in the core.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/lanes.h"
#include "core/wire.h"
#include "tether/endpoint.h"
#include "tether/status.h"

namespace tether::core {
struct RegionState;
struct TransferState;
}  // namespace tether::core

namespace tether::transport {

class Transport;
using core::LanePath;
using core::LinkCounters;

// Local bytes of one fragment of a batched chunk.
struct Piece {
  uint8_t* data = nullptr;  // a write's source, a read's destination
  uint64_t length = 0;
  const core::RegionState* region = nullptr;  // the local region it lies in
};

// What a lane puts on the wire next: a header and, for writes and sends, the local payload.
// A kWriteBatch chunk instead carries `fragments` small writes: frags[i] describes where piece i goes;
// a kReadBatch chunk (Caps::batch_reads) `fragments` small reads: piece i is where frags[i] lands.
struct ChunkOp {
  wire::FrameHeader hdr;
  const uint8_t* payload = nullptr;
  uint64_t length = 0;
  uint8_t* local = nullptr;                // the chunk's local bytes (a read's destination)
  const core::RegionState* local_region = nullptr;  // where the local bytes lie (memory kind, device)
  const RemoteRegion* remote = nullptr;             // the remote descriptor (transport extensions); null for sends
  uint32_t fragments = 0;                  // kWriteBatch and kReadBatch only
  const wire::Fragment* frags = nullptr;
  const Piece* pieces = nullptr;
  int32_t device = -1;                     // GPU of the local bytes (all pieces share it), -1 for host memory
  core::RegionState* pin = nullptr;        // a pushed send's chunk: its region, pinned until the transport has sent it
};

struct PeerInfo {
  uint64_t id = 0;
  EndpointId endpoint{};
  std::string name;
  bool same_host = false;
  std::string transport;           // the transport carrying its data
  uint64_t chunk_bytes = 1 << 20;  // min of both sides' chunk_bytes: no frame between them is longer
  uint32_t heartbeat_ms = 1000;    // ours, or sooner if the other side's peer_timeout needs it
  uint32_t max_notify = wire::kMaxNotify;  // the largest notification it accepts (its notify_max_bytes)
};

class Link : public std::enable_shared_from_this<Link> {
 public:
  virtual ~Link() = default;
  const PeerInfo& info() const { return info_; }
  uint32_t lanes() const { return lanes_; }
  virtual uint32_t slot_count() const = 0;    // chunk slots (indices in FrameHeader::slot)
  virtual uint32_t busy_poll_us() const = 0;  // Config::busy_poll_us
  // The live lane with the fewest chunks in flight, the lowest such index on ties: where a transport
  // starts handing out a transfer's chunks (its threads are still awake from the last one).
  virtual uint32_t quietest_lane() const = 0;
  virtual bool failed() const = 0;
  virtual Status error() const = 0;
  // Fails the peer once: every transfer still using it ends with `s`, sockets are shut down.
  virtual void fail(Status s) = 0;

  // ---- called by the lane's progress thread
  // Next chunk for `lane` if the lane's window allows; fills op and claims a slot.
  virtual bool next_chunk(uint32_t lane, ChunkOp* op) = 0;
  virtual bool has_work() const = 0;
  // A target answered chunk (slot, gen). kProtocolError if the answer names no chunk of this lane.
  virtual Code answer(uint32_t lane, uint32_t slot, uint32_t gen, uint8_t status) = 0;
  // The pieces of kReadBatch chunk (slot, gen): `n` fragments, where each lands, on GPU `device` (-1: host).
  virtual Code read_batch(uint32_t lane, uint32_t slot, uint32_t gen, uint32_t n, const wire::Fragment** frags,
                          const Piece** pieces, int* device) = 0;
  // Where a kReadResp payload of `length` bytes goes; `device` the GPU it goes to, or -1 for host memory.
  // Given `pieces`, a kReadBatch chunk's answer lands in its `npieces` pieces, in order (*dest null).
  virtual Code read_destination(uint32_t lane, uint32_t slot, uint32_t gen, uint64_t length, uint8_t** dest,
                                int* device, const Piece** pieces = nullptr, uint32_t* npieces = nullptr) = 0;
  // Target side of kSendData: where the bytes go inside the matched recv `token` (`unit`: the sender's
  // chunk size, `flags`: the frame's). kOk with *dest null: a resent chunk already placed; discard it.
  virtual Code resolve_send_data(uint32_t token, uint64_t offset, uint64_t length, uint64_t unit, uint16_t flags,
                                 uint8_t** dest, core::TransferState** recv, int* device) = 0;
  // A chunk of a recv is in place; counted once even if it arrived twice (resent after a lost answer).
  virtual void send_data_placed(core::TransferState* recv, uint64_t offset, uint64_t length) = 0;
  // Target side of a kPull frame (Caps::pull_reads): checks the range as a kReadReq's, then starts the
  // send, or answers kPullFail. False: malformed (the caller drops the peer).
  virtual bool on_pull(const wire::FrameHeader& h) = 0;
  // A lane died with a kSendData chunk half received: the sender resends it, unless the peer is gone.
  virtual void abandon_send_data(core::TransferState* recv) = 0;
  // A lane's link failed. A link-level failure (connection lost, timeout) kills only the lane while another
  // survives; anything else, or the last lane, fails the peer.
  virtual void lane_failed(uint32_t lane, Status why) = 0;
  // The lane is retired: its chunks in flight move to the surviving lanes, or (peer failed) are answered with `code`.
  virtual void release_lane(uint32_t lane, Code code) = 0;
  virtual LinkCounters& lane_counters(uint32_t lane) = 0;
  // Payload bytes of the chunks `lane` holds unanswered (a lock-free hint).
  virtual uint64_t lane_bytes(uint32_t lane) const = 0;
  virtual uint64_t unanswered_bytes() const = 0;  // of every lane
  virtual bool lane_alive(uint32_t lane) const = 0;

  // ---- who may still touch the peer's sockets and transport state (docs/ARCHITECTURE.md, "Shutdown"):
  // each lane's thread from attach until it retires its lane, and any other thread for one call (Hold).
  // The last to let go closes the sockets and has the transport drop its state (Transport::detach).
  virtual bool hold() = 0;  // false once everything was let go
  virtual void let_go() = 0;
  virtual bool released() const = 0;
  class Hold {
   public:
    explicit Hold(Link* p) : p_(p->hold() ? p : nullptr) {}
    ~Hold() { if (p_) p_->let_go(); }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    explicit operator bool() const { return p_ != nullptr; }
   private:
    Link* p_;
  };

  Transport* const transport;  // owned by the endpoint, which outlives the peer
  std::vector<int> lane_fds;         // connected data sockets (Caps::uses_tcp_lanes)
  std::vector<LanePath> lane_paths;  // set with lane_fds, before the transport attaches
  // The transport's per-peer state (its lanes), opaque to the core; set before the peer is used.
  std::shared_ptr<void> transport_state;

 protected:
  Link(PeerInfo info, uint32_t lanes, Transport* t) : transport(t), info_(std::move(info)), lanes_(lanes) {}
  PeerInfo info_;
  const uint32_t lanes_;
};

}  // namespace tether::transport
