// One lane of the netplugin transport: a plugin send comm (our frames to the peer) and recv comm
// (the peer's frames to us), driven by one progress thread. A frame is two plugin messages, header
// then payload (possibly empty), each with a tag unique to it (2*seq, 2*seq+1), so the plugin's
// in-order matching is checked on every message.
//
// The request limit is honoured by counting BEFORE posting: a frame is posted only when both of its
// requests fit under kRequestLimit (16, TCPX's ring) on that comm. Receives are pre-posted in
// header/payload pairs under the same limit. A received header is checked (frame_target.h) before
// its payload is placed; the payload is unpacked from the plugin's bounce pages to the checked
// destination and the receive is handed back (irecvConsumed) only after the unpack has completed.
//
// GPU memory: received payload reaches GPU destinations through the lane's Unpacker (unpacker.h);
// payload from GPU memory goes to the plugin as a CUDA pointer when the device's ptrSupport has
// NCCL_PTR_CUDA, else it is first copied to a pinned host slot (gpu::StagingRing) and sent from there.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "core/wire.h"
#include "gpu/staging.h"
#include "tether/status.h"
#include "transport/frame_target.h"
#include "transport/host.h"
#include "transport/link.h"
#include "transport/netplugin/plugin.h"
#include "transport/netplugin/unpacker.h"

namespace tether::core {
struct RegionState;
}  // namespace tether::core

namespace tether::transport {

constexpr uint32_t kRequestLimit = 16;               // per comm, per direction
constexpr uint32_t kFramesInFlight = kRequestLimit / 2;
constexpr uint64_t kMaxFrame = netabi::kUnpackMaxRecv;  // 4 MiB: the most one unpack receive carries
constexpr uint32_t kStageSlots = 4;  // pinned copies of GPU payloads in flight per lane (plugins without CUDA pointers)

// Address -> registered region, for finding the registration a send payload belongs to.
class RegionTable {
 public:
  void add(core::RegionState* r);
  void remove(const core::RegionState* r);
  core::RegionState* find(const uint8_t* p, uint64_t length) const;

 private:
  mutable std::shared_mutex mu_;  // held for a lookup only, never across a plugin call
  std::vector<core::RegionState*> regions_;
};

class NetLane {
 public:
  struct Comms {
    int dev = 0;
    void* send = nullptr;
    void* recv = nullptr;
    netabi::DeviceHandle* recv_dev = nullptr;
  };
  struct Options {
    std::string unpack;          // TETHER_UNPACK
    bool cuda_send = false;      // the device takes CUDA pointers (ptrSupport & NCCL_PTR_CUDA)
    bool consume_early = false;  // test-only fault (TETHER_NET_FAULT=consume_early)
  };
  NetLane(std::shared_ptr<NetPlugin> net, Host* host, std::shared_ptr<Link> peer,
          uint32_t index, Comms comms, const RegionTable* regions, Options opts);
  ~NetLane();
  NetLane(const NetLane&) = delete;
  NetLane& operator=(const NetLane&) = delete;

  // Registers the header and landing buffers, makes the unpacker. Called once before the first step().
  Status init();
  // One pass over the lane: completes, unpacks, answers and posts what it can. True if anything moved.
  bool step();
  bool dead() const { return dead_.load(std::memory_order_acquire); }
  void kill(Status why);
  // Lets go of everything in flight (answers the peer's chunks with an error), waits for unpacks in
  // flight, deregisters and closes the comms. Progress thread only, once.
  void retire();

  // Deregistration of a region, asked by another thread, done by the lane's thread (the comm's owner).
  uint64_t request_dereg(const core::RegionState* r);
  bool dereg_done(uint64_t ticket) const { return dereg_done_.load(std::memory_order_acquire) >= ticket; }

  uint32_t index() const { return index_; }

 private:
  struct TxFrame {
    wire::FrameHeader hdr{};
    const uint8_t* payload = nullptr;
    uint64_t length = 0;
    core::RegionState* pin = nullptr;  // read responses keep their region pinned until sent
  };
  enum class Post { kPosted, kLater, kCopying, kDead };  // kCopying: a pinned copy is in flight (keep polling)
  struct TxPosted {
    TxFrame f;
    void* hreq = nullptr;
    void* preq = nullptr;
    uint64_t seq = 0;                  // frame number: tags 2*seq (header), 2*seq+1 (payload)
    bool payload_posted = false;
    bool hdone = false, pdone = false;
    gpu::StagingSlot* slot = nullptr;  // a GPU payload sent from this pinned copy, held until the send completes
  };
  enum class RxStage { kHeader, kPayload, kUnpacking };
  struct RxPosted {
    void* hreq = nullptr;
    void* preq = nullptr;
    uint64_t k = 0;                 // index of the header receive on the comm (payload: k + 1)
    RxStage stage = RxStage::kHeader;
    wire::FrameHeader hdr{};
    TargetPlan plan;
    uint8_t* dest = nullptr;        // null: nothing to place (no payload, or rejected)
    int device = -1;                // dest is memory of this GPU (-1: host)
    uint64_t expect = 0;            // payload bytes the header announced
    bool unpacking = false;
  };

  bool progress_rx();
  bool progress_tx();
  bool test_send(void* req, bool* done);
  bool post_receives();
  bool on_header(RxPosted& r);
  bool finish_rx(RxPosted& r);
  bool finish_deferred();
  bool start_unpack(RxPosted& r, size_t i, uint64_t size);
  bool fail(Status why);  // kills the lane; false
  bool fail_plugin(const char* call, int rc);
  bool protocol_error(const char* what);
  // Receive k's fragments in the unpack metadata (*n of them), checked against its `length`; null: lane killed.
  const netabi::UnpackEntry* unpack_frags(uint64_t k, uint64_t length, uint64_t* n);
  // Registrations on the send comm of regions (or staging slots), by their owner.
  using Registrations = std::vector<std::pair<const void*, void*>>;
  void* mr_for(Registrations& mrs, const void* owner, void* base, uint64_t size, int type, const char* call);
  core::RegionState* region_of(const TxFrame& f);  // null: the lane was killed
  Post post_payload(TxPosted& p, size_t i);
  void process_dereg();
  bool consume(void* req);
  bool read_unpacked(uint64_t k, void* out, uint64_t length);
  bool unpack_wait();  // finishes the copy in flight; false: the lane was killed
  bool push_answer(const TxFrame& f);

  const std::shared_ptr<NetPlugin> net_;
  Host* const host_;
  const std::shared_ptr<Link> peer_;
  const uint32_t index_;
  Comms comms_;
  std::unique_ptr<Unpacker> unpacker_;
  const RegionTable* const regions_;
  const Options opts_;
  const bool unpack_device_;
  const bool consume_early_;  // test-only fault (TETHER_NET_FAULT=consume_early): proves the tests catch it
  bool has_deferred_ = false;  // (fault only) a frame consumed before its copy
  uint32_t deferred_idle_ = 0;
  std::vector<netabi::UnpackEntry> deferred_frags_;
  netabi::UnpackDeviceHandle* unpack_ = nullptr;
  std::atomic<bool> dead_{false};
  bool retired_ = false;

  // Buffers the plugin sends headers from and receives into.
  std::vector<wire::FrameHeader> tx_hdr_ = std::vector<wire::FrameHeader>(kFramesInFlight);
  std::vector<wire::FrameHeader> rx_hdr_ = std::vector<wire::FrameHeader>(kFramesInFlight);
  std::unique_ptr<uint8_t[]> landing_;  // payload receives (unpack devices never write it)
  uint64_t landing_bytes_ = 0;
  void *tx_hdr_mr_ = nullptr, *rx_hdr_mr_ = nullptr, *landing_mr_ = nullptr;

  // tx: frames waiting (answers first in line with chunks), frames posted.
  static constexpr size_t kTxQueue = 1024;
  std::vector<TxFrame> txq_ = std::vector<TxFrame>(kTxQueue);
  size_t txq_head_ = 0, txq_count_ = 0;
  TxPosted tx_[kFramesInFlight];
  size_t tx_head_ = 0, tx_count_ = 0;
  uint32_t tx_requests_ = 0;   // isend requests the plugin holds
  uint64_t tx_seq_ = 0;

  // rx: pre-posted header/payload pairs, oldest first.
  RxPosted rx_[kFramesInFlight];
  RxPosted deferred_;  // (fault only)
  size_t rx_head_ = 0, rx_count_ = 0;
  uint32_t rx_requests_ = 0;   // irecv requests the plugin holds (until consumed)
  uint64_t rx_posted_ = 0;     // irecv calls made on the comm: the unpack metadata slot counter
  uint64_t rx_seq_ = 0;

  // Registrations of regions on the send comm (progress thread only).
  Registrations mrs_;
  // GPU payloads for a plugin without CUDA pointers: pinned copies, registered on first use.
  std::unique_ptr<gpu::StagingRing> tx_stage_;
  Registrations slot_mrs_;
  std::mutex dereg_mu_;
  std::vector<const core::RegionState*> dereg_queue_;
  std::atomic<uint64_t> dereg_requested_{0}, dereg_done_{0};
};

}  // namespace tether::transport
