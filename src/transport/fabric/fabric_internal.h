// Internals of the fabric transport, shared by its files:
//   fabric_transport.cc  the transport object: rails opened, rail order, memory registration, wake/stop
//   attach.cc            offers (rail addresses) and attaching a peer: its lanes, one per rail
//   rail_thread.cc       a rail's progress thread and the initiator side of its lanes (post, complete)
//   target.cc            the target side: messages landing in the rail's bounce buffers, served and answered
#pragma once
#include <rdma/fi_errno.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/region.h"
#include "core/transfer.h"
#include "sys/env.h"
#include "transport/fabric/discovery.h"
#include "transport/fabric/fabric_transport.h"
#include "transport/fabric/libfabric.h"
#include "transport/fabric/rail.h"
#include "transport/fabric/stage.h"
#include "transport/host.h"
#include "transport/link.h"

namespace tether::transport::fabric {

using core::RegionState;
using wire::FrameType;

struct Lane;

// Names the offer and the message layout: raised with any layout change, so that a peer of another
// layout is refused at attach, saying so, not misread.
constexpr uint32_t kOfferMagic = 0x32414654;  // "TFA2"
constexpr uint32_t kBounceBuffers = 8;        // posted receives per rail (send/recv chunks)
constexpr int kIdleWaitMs = 20;               // a sleeping progress thread still notices failed peers
constexpr int kSpinTurns = 1;                 // idle turns polling before sleeping in the CQ (2 cores: spinning steals the peer's)
constexpr int64_t kMessageGraceMs = 100;      // a failed peer's lane waits this long for its sends (see drive)
constexpr uint32_t kStageSlots = 8;           // per lane: chunks of memory libfabric cannot reach, staged at once

// Descriptor extension of a region libfabric cannot reach (device memory without FI_HMEM): zero
// rails, then this flag. The initiator then moves its chunks two-sided (kWrite/kReadReq messages
// the target's CPU serves, copying through its bounce buffers).
constexpr uint8_t kExtTwoSided = 1;

// Two-sided messages: a send/recv chunk (header, then payload), answered by the receiver's ack once
// its bytes are in the recv buffer. Writes and reads of a region the provider cannot reach
// (kExtTwoSided) are messages too, validated by the target like any frame and answered with kAck
// (a write, or a refused read) or kReadData (a read's bytes).
enum class MsgType : uint8_t { kData = 1, kAck = 2, kWrite = 3, kReadReq = 4, kReadData = 5 };
struct SendHeader {
  uint64_t session;   // names the peer link on either side
  uint64_t offset;    // in the message (kData) or the target region (kWrite, kReadReq)
  uint64_t length;    // payload bytes that follow (kReadReq: bytes asked for)
  uint64_t unit;      // kData: the sender's chunk size (the receiver counts chunks once each); else the descriptor key
  uint32_t token;     // kData: the matched recv (from the core's CTS); else the target region id
  uint32_t slot, gen; // the sender's chunk, echoed in the ack
  uint16_t lane;      // the sender's lane, which is also the receiver's lane on this rail
  uint16_t flags;     // the chunk's frame flags (resent)
  uint8_t type;       // MsgType
  uint8_t status;     // ack: tether Code of the placement
  uint8_t pad[6];
  uint64_t desc_offset, desc_length;  // kWrite, kReadReq: the descriptor's range (its key covers it)
};
static_assert(sizeof(SendHeader) == 72);

enum class OpKind : uint8_t { kWrite, kFlush, kRead, kSend, kAck, kBounce, kResp };
enum class Phase : uint8_t { kIdle, kPacking, kUnpacking };  // a staged chunk's copy in flight

// Every posted operation's context: preallocated, recycled, first member a fi_context2.
struct OpCtx {
  fi_context2 ctx;
  OpKind kind = OpKind::kWrite;
  Lane* lane = nullptr;      // null for bounce buffers
  uint32_t slot = 0, gen = 0, index = 0;
  uint64_t length = 0;
  uint64_t raddr = 0, key = 0;   // writes: where they went (for the flush read)
  // Staged chunks (local memory libfabric cannot reach): the lane's slot, the copy's GPU, and the
  // chunk itself (posted once its bytes are packed; a read's destination for the unpack).
  int32_t stage = -1;
  int32_t device = -1;
  Phase phase = Phase::kIdle;
  bool in_use = false;       // taken from the lane's free list, not yet finished
  ChunkOp op{};
};


inline std::string u64_bytes(uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }  // host order

// Descriptor extension: u8 rails, then per rail {u64 key, u64 base}.
inline bool ext_rail(std::string_view ext, uint32_t rail, uint64_t* key, uint64_t* base) {
  if (ext.empty() || uint8_t(ext[0]) <= rail || ext.size() < 1 + 16 * size_t(uint8_t(ext[0]))) return false;
  std::memcpy(key, ext.data() + 1 + 16 * rail, 8);
  std::memcpy(base, ext.data() + 1 + 16 * rail + 8, 8);
  return true;
}

inline bool ext_two_sided(std::string_view ext) {
  return ext.size() >= 2 && uint8_t(ext[0]) == 0 && (uint8_t(ext[1]) & kExtTwoSided);
}

inline int device_of(const RegionState* r) { return r && r->kind == MemoryKind::kCuda ? r->device : -1; }

// A queue of fixed capacity, sized at attach: the data path never allocates.
template <typename T>
struct Ring {
  std::vector<T> items;
  size_t head = 0, count = 0;
  void resize(size_t n) { items.resize(n); }
  bool empty() const { return count == 0; }
  bool full() const { return count >= items.size(); }
  T& front() { return items[head]; }
  T& push(const T& v) { return items[(head + count++) % items.size()] = v; }
  void pop() {
    head = (head + 1) % items.size();
    --count;
  }
  void clear() { count = 0; }
};

class RailThread;

// One peer on one rail.
struct Lane {
  std::shared_ptr<Link> peer;
  RailThread* thread = nullptr;
  uint32_t index = 0;        // lane index within the peer
  uint32_t rail = 0;         // local rail == remote rail index in the descriptor extension
  fi_addr_t remote = FI_ADDR_NOTAVAIL;
  uint64_t session = 0;
  std::vector<OpCtx> ops;    // one per chunk the lane may have in flight
  std::vector<uint32_t> free_ops;
  std::vector<SendHeader> headers;  // registered (FI_MR_LOCAL): [0, window) chunks', then acks
  RailMr headers_mr;
  std::vector<OpCtx> ack_ops;       // one per ack header
  std::vector<uint32_t> free_acks;
  Ring<SendHeader> ack_queue;       // acks not yet posted (bounded by the peer's window)
  Ring<uint32_t> flushes;           // write ops whose flush read is not yet posted
  ChunkOp stalled{};         // pulled but refused with -FI_EAGAIN: posted again after progress
  bool has_stalled = false;
  // Staging (first use allocates): slots registered on the rail, the copies in and out of them,
  // and the ops whose copy is in flight, in the order they were started (a ring of op indices).
  std::unique_ptr<StageMem> stage;
  std::unique_ptr<Copier> copier;
  Ring<uint32_t> copying;
  uint32_t inflight = 0;
  bool dead = false;         // progress thread only
  bool released = false;
  int64_t dead_since = 0;
};

struct FabricPeer {
  std::vector<std::weak_ptr<Lane>> lanes;
  std::atomic<uint32_t> next{0};
};

// A rail and the thread that drives it.
class RailThread {
 public:
  RailThread(class FabricTransportImpl* owner, std::unique_ptr<Rail> rail) : owner_(owner), rail_(std::move(rail)) {}
  ~RailThread() { join(); }
  bool start(uint64_t bounce_bytes, std::string* why);
  void join() {
    stop_.store(true);
    rail_->wake();
    if (thread_.joinable()) thread_.join();
  }
  void adopt(std::shared_ptr<Lane> lane) {
    std::lock_guard lock(mu_);
    incoming_.push_back(std::move(lane));
    version_.fetch_add(1, std::memory_order_release);
    rail_->wake();
  }
  void wake() {
    woken_.store(true, std::memory_order_release);
    rail_->wake();
  }
  Rail& rail() { return *rail_; }
  void free_bounce();
  // Lanes still present at stop(): answer their chunks with kCancelled.
  void cancel_all();
  // After the thread has ended: close lanes' registrations and let go of them (lanes hold their
  // peers, which hold the endpoint that owns us).
  void drop_lanes();

 private:
  void run();
  bool drive(Lane& l);
  ssize_t post(Lane& l, OpCtx& c, const ChunkOp& op);
  ssize_t transmit(Lane& l, OpCtx& c, const ChunkOp& op, const uint8_t* payload, uint8_t* local, void* desc);
  ssize_t send_message(Lane& l, OpCtx& c, const SendHeader& h, const uint8_t* payload, uint64_t length, void* desc);
  bool drive_copies(Lane& l);
  void finish(Lane& l, OpCtx& c, Code code);
  void forget(Lane& l);
  void complete(const fi_cq_msg_entry& e);
  void failed(OpCtx* c, int err);
  void ack_done(Lane& l, OpCtx& c);
  void response_done(uint32_t i);
  void bounce_arrived(OpCtx& c, uint64_t len);
  void repost(uint32_t i);
  void hold(uint32_t i, std::shared_ptr<Link> peer, std::shared_ptr<Lane> lane, const SendHeader& h,
            RegionState* pin, core::TransferState* recv, void* dst, const void* src, int device);
  bool advance(uint32_t i);
  void queue_ack(Lane& l, const SendHeader& h, Code code);
  void retire(Lane& l, Code code);

  FabricTransportImpl* owner_;
  std::unique_ptr<Rail> rail_;
  std::thread thread_;
  std::atomic<bool> stop_{false}, woken_{false};
  std::mutex mu_;
  std::vector<std::shared_ptr<Lane>> incoming_;  // guarded by mu_
  std::atomic<uint64_t> version_{0};
  std::vector<std::shared_ptr<Lane>> lanes_;     // thread only
  std::vector<std::shared_ptr<Lane>> retired_;   // kept until stop: late completions still name them
  std::vector<uint8_t> bounce_;                  // kBounceBuffers x (header + payload)
  uint64_t bounce_stride_ = 0;
  RailMr bounce_mr_;
  std::vector<OpCtx> bounce_ops_;
  // A bounce buffer kept from being posted again while its message is served: bytes being copied
  // to or from GPU memory (CUDA event), or a read's answer being sent from response slot i.
  struct Held {
    enum State : uint8_t { kIdle, kCopying, kRespond, kSending } state = kIdle;
    Code code = Code::kOk;
    std::shared_ptr<Link> peer;
    std::shared_ptr<Lane> lane;
    SendHeader h{};
    RegionState* pin = nullptr;          // the target region (registry pin), until the copy is done
    core::TransferState* recv = nullptr; // kData: the matched recv
  };
  std::vector<Held> held_ = std::vector<Held>(kBounceBuffers);
  uint32_t held_count_ = 0;
  Copier bounce_copier_{kBounceBuffers};
  StageMem resp_;                          // read answers of two-sided reads: header + bytes, slot i per bounce buffer i
  std::vector<OpCtx> resp_ops_;
};

class FabricTransportImpl final : public Transport {
 public:
  explicit FabricTransportImpl(Host* host);
  ~FabricTransportImpl() override;
  const char* name() const override { return "fabric"; }
  Caps caps() const override {
    Caps c;
    c.attach_before_answer = true;  // attaching inserts the connector's addresses; nothing to wait for
    return c;
  }
  // Hardware providers beat kernel TCP; libfabric's own tcp/shm providers do not (tether's tcp
  // transport is faster than tcp;ofi_rxm on the same sockets), so auto picks them only by request.
  int priority() const override { return disc_.provider == "tcp" || disc_.provider == "shm" ? -1 : 10; }
  std::string unavailable_reason() const override {
    if (open_failed_.load(std::memory_order_acquire)) return open_status_.message();
    return why_;
  }
  std::string offer(uint64_t session) override;
  uint32_t lanes_for(std::string_view remote_offer) const override;
  Status register_region(RegionState& region, std::string* desc_ext) override;
  void deregister_region(RegionState& region) override;
  Status attach(const std::shared_ptr<Link>& peer, const std::vector<int>& tcp_fds, std::string_view remote_offer,
                bool initiator, int64_t deadline_ms) override;
  void wake(Link* peer, uint64_t chunks, int device) override;
  void stop() override;

  // Progress threads' lookups (brief locks, no system calls under them).
  void* local_desc(const RegionState* region, uint32_t rail) {
    std::shared_lock lock(regions_mu_);
    auto it = regions_.find(region);
    return it == regions_.end() || rail >= it->second.size() ? nullptr : it->second[rail].desc;
  }
  bool local_registered(const RegionState* region) {
    std::shared_lock lock(regions_mu_);
    return regions_.count(region) != 0;
  }
  std::shared_ptr<Link> peer_by_session(uint64_t session) {
    std::lock_guard lock(sessions_mu_);
    auto it = sessions_.find(session);
    return it == sessions_.end() ? nullptr : it->second.lock();
  }
  Host* host() { return host_; }
  uint64_t bounce_payload() const { return host_->config().chunk_bytes; }

  // Rail order for memory on GPU `device` (-1: host), computed once per device (prepare_order) off
  // the data path; the data path only loads a pointer. Null before the device's first region.
  static constexpr int kOrderDevices = 64;   // GPUs beyond this use the host order
  const RailOrder* order_for(int device) const {
    const RailOrder* o = device >= 0 && device < kOrderDevices ? orders_[device + 1].load(std::memory_order_acquire) : nullptr;
    return o ? o : orders_[0].load(std::memory_order_acquire);
  }
  void prepare_order(int device);
  int64_t grace_ms() const { return host_->config().peer_timeout_ms; }

 private:
  Status open_rails();   // lazily, on first offer/registration/attach

  Host* const host_;
  std::string why_;
  Discovery disc_;
  // Test knob TETHER_FABRIC_STAGE_HOST=1: host regions are treated like device memory on a provider
  // without FI_HMEM, so the staged path runs on machines without a GPU.
  const bool stage_host_ = sys::env_flag("TETHER_FABRIC_STAGE_HOST");
  std::mutex open_mu_;
  bool opened_ = false;
  Status open_status_;
  std::atomic<bool> open_failed_{false};
  std::vector<std::unique_ptr<RailThread>> rails_;
  std::atomic<bool> stopped_{false};
  // [0] host memory, [d + 1] GPU d; published once, owned by order_store_ (order_mu_).
  std::atomic<const RailOrder*> orders_[kOrderDevices + 1] = {};
  std::mutex order_mu_;
  std::vector<std::unique_ptr<RailOrder>> order_store_;

  std::shared_mutex regions_mu_;
  std::unordered_map<const RegionState*, std::vector<RailMr>> regions_;
  std::mutex sessions_mu_;
  std::unordered_map<uint64_t, std::weak_ptr<Link>> sessions_;
};

}  // namespace tether::transport::fabric
