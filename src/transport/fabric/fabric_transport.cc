#include "transport/fabric/fabric_transport.h"

#include <limits.h>
#include <rdma/fi_errno.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <unordered_map>

#include "sys/crypto.h"
#include "core/endpoint_impl.h"
#include "core/peer.h"
#include "core/region.h"
#include "gpu/cuda_api.h"
#include "sys/thread_name.h"
#include "sys/topology.h"
#include "transport/fabric/discovery.h"
#include "transport/fabric/libfabric.h"
#include "transport/fabric/rail.h"
#include "sys/net.h"
#include "transport/fabric/stage.h"
#include "sys/env.h"

namespace tether::transport::fabric {

using core::ChunkOp;
using core::RegionState;
using wire::FrameType;

struct Lane;

namespace {

// Names the offer and the message layout: "TFA2" since SendHeader grew to 72 bytes (staged GPU
// writes/reads), so a peer of the older layout is refused at attach, saying so, not misread.
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

// Two-sided messages: a send/recv chunk (header, then payload) and the receiver's answer to it.
// The sender's chunk is answered only by the ack, i.e. once its bytes are in the recv buffer.
// Writes and reads of a region the provider cannot reach (kExtTwoSided) are messages too: the
// target validates them against its registry like any transport's frames, copies, and answers
// with kAck (a write, or a refused read) or kReadData (a read's bytes).
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

std::string be_u64(uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }

// Offer: magic, session, bounce payload bytes, provider, rail addresses.
struct Offer {
  uint64_t session = 0;
  uint64_t bounce = 0;
  std::string provider;
  std::vector<std::string> rails;

  std::string encode() const {
    std::string o(reinterpret_cast<const char*>(&kOfferMagic), 4);
    o += be_u64(session) + be_u64(bounce);
    o += char(uint8_t(provider.size()));
    o += provider;
    o += char(uint8_t(rails.size()));
    for (auto& r : rails) {
      const uint16_t n = uint16_t(r.size());
      o.append(reinterpret_cast<const char*>(&n), 2).append(r);
    }
    return o;
  }
  static bool parse(std::string_view in, Offer* out) {
    auto take = [&](void* p, size_t n) {
      if (in.size() < n) return false;
      std::memcpy(p, in.data(), n);
      in.remove_prefix(n);
      return true;
    };
    uint32_t magic = 0;
    uint8_t n = 0;
    if (!take(&magic, 4) || magic != kOfferMagic || !take(&out->session, 8) || !take(&out->bounce, 8) || !take(&n, 1) ||
        in.size() < n)
      return false;
    out->provider.assign(in.substr(0, n));
    in.remove_prefix(n);
    if (!take(&n, 1) || n == 0) return false;
    for (uint8_t i = 0; i < n; ++i) {
      uint16_t len = 0;
      if (!take(&len, 2) || in.size() < len) return false;
      out->rails.emplace_back(in.substr(0, len));
      in.remove_prefix(len);
    }
    return true;
  }
};

// Descriptor extension: u8 rails, then per rail {u64 key, u64 base}.
bool ext_rail(std::string_view ext, uint32_t rail, uint64_t* key, uint64_t* base) {
  if (ext.empty() || uint8_t(ext[0]) <= rail || ext.size() < 1 + 16 * size_t(uint8_t(ext[0]))) return false;
  std::memcpy(key, ext.data() + 1 + 16 * rail, 8);
  std::memcpy(base, ext.data() + 1 + 16 * rail + 8, 8);
  return true;
}

bool ext_two_sided(std::string_view ext) {
  return ext.size() >= 2 && uint8_t(ext[0]) == 0 && (uint8_t(ext[1]) & kExtTwoSided);
}

int device_of(const RegionState* r) { return r && r->kind == MemoryKind::kCuda ? r->device : -1; }

bool connection_error(int err) {
  switch (err) {
    case FI_ENOTCONN: case FI_ECONNRESET: case FI_ECONNREFUSED: case FI_ECONNABORTED: case FI_EHOSTUNREACH:
    case FI_ETIMEDOUT: case FI_ESHUTDOWN: case FI_ENETDOWN: case FI_ENETUNREACH:
    case FI_ECANCELED:  // flushed: the provider's connection went away under it
      return true;
    default:
      return false;
  }
}

using sys::now_ms;

// sysfs PCI path and NUMA node of GPU `device` ({"", -1} when CUDA cannot say).
std::pair<std::string, int> gpu_location(int device) {
  const std::string id = gpu::pci_bus_id(device);
  if (id.empty()) return {"", -1};
  sys::Nic where;
  if (!sys::read_pci_location(where, "/sys/bus/pci/devices/" + id)) return {"", -1};
  return {where.pci_path, where.numa_node};
}

// What discovery is asked for, from the endpoint's fabric_* options (the transport and `tether doctor`).
DiscoveryOptions discovery_options(const Config& c) {
  DiscoveryOptions opt;
  opt.provider = c.fabric_provider;
  opt.domains = c.fabric_domains;
  opt.max_rails = c.fabric_rails;
  opt.host = c.host;
  opt.delivery_complete = c.fabric_delivery_complete != 0;
  opt.busy_poll = c.fabric_busy_poll != 0;
  return opt;
}

}  // namespace

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
  std::vector<SendHeader> ack_queue; // acks not yet posted (a ring; bounded by the peer's window)
  size_t ack_head = 0, ack_count = 0;
  std::vector<uint32_t> flushes;    // write ops whose flush read is not yet posted (a ring)
  size_t flush_head = 0, flush_count = 0;
  ChunkOp stalled{};         // pulled but refused with -FI_EAGAIN: posted again after progress
  bool has_stalled = false;
  // Staging (first use allocates): slots registered on the rail, the copies in and out of them,
  // and the ops whose copy is in flight, in the order they were started (a ring of op indices).
  std::unique_ptr<StageMem> stage;
  std::unique_ptr<Copier> copier;
  std::vector<uint32_t> copying;
  size_t copy_head = 0, copy_count = 0;
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
  bool drive_copies(Lane& l);
  void finish(Lane& l, OpCtx& c, Code code);
  void forget(Lane& l);
  void complete(const fi_cq_msg_entry& e);
  void failed(OpCtx* c, int err);
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
  explicit FabricTransportImpl(core::EndpointImpl* endpoint);
  ~FabricTransportImpl() override;
  const char* name() const override { return "fabric"; }
  Caps caps() const override {
    Caps c;
    c.host_memory = true;
    c.cuda_memory = true;  // directly with FI_HMEM, else staged (docs/FABRIC.md, GPU memory)
    c.one_sided = true;
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
  core::EndpointImpl* endpoint() { return endpoint_; }
  uint64_t bounce_payload() const { return endpoint_->config().chunk_bytes; }

  // Rail order for memory on GPU `device` (-1: host), computed once per device (prepare_order) off
  // the data path; the data path only loads a pointer. Null before the device's first region.
  static constexpr int kOrderDevices = 64;   // GPUs beyond this use the host order
  const RailOrder* order_for(int device) const {
    const RailOrder* o = device >= 0 && device < kOrderDevices ? orders_[device + 1].load(std::memory_order_acquire) : nullptr;
    return o ? o : orders_[0].load(std::memory_order_acquire);
  }
  void prepare_order(int device);
  int64_t grace_ms() const { return endpoint_->config().peer_timeout_ms; }

 private:
  Status open_rails();   // lazily, on first offer/registration/attach

  core::EndpointImpl* endpoint_;
  std::string why_;
  Discovery disc_;
  // Test knob TETHER_FABRIC_STAGE_HOST=1: host regions are treated like device memory on a provider
  // without FI_HMEM (not registered; reached through staging and two-sided messages), so that path
  // runs for real on machines without a GPU.
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

// ---------------------------------------------------------------- transport

FabricTransportImpl::FabricTransportImpl(core::EndpointImpl* endpoint) : endpoint_(endpoint) {
  const Config& c = endpoint->config();
  std::string why;
  const Lib* lib = Lib::load(c.fabric_library, &why);
  if (!lib) {
    why_ = why;
    return;
  }
  if (!discover(*lib, discovery_options(c), &disc_, &why)) {
    why_ = why;
    return;
  }
  if (!disc_.warning.empty()) {
    static std::once_flag once;
    std::call_once(once, [&] { std::fprintf(stderr, "tether: warning: %s\n", disc_.warning.c_str()); });
  }
}

FabricTransportImpl::~FabricTransportImpl() {
  stop();
  // Registrations close before their domains.
  for (auto& [region, mrs] : regions_)
    for (uint32_t i = 0; i < mrs.size() && i < rails_.size(); ++i) rails_[i]->rail().deregister(&mrs[i]);
  regions_.clear();
  for (auto& r : rails_) r->free_bounce();
  rails_.clear();
}

Status FabricTransportImpl::open_rails() {
  std::lock_guard lock(open_mu_);
  if (opened_) return open_status_;
  opened_ = true;
  for (uint32_t i = 0; i < disc_.rails.size(); ++i) {
    std::string why;
    auto rail = Rail::open(disc_, i, &why);
    std::unique_ptr<RailThread> t;
    if (rail) t = std::make_unique<RailThread>(this, std::move(rail));
    if (!t || !t->start(bounce_payload(), &why)) {
      if (t) t->free_bounce();
      for (auto& r : rails_) r->free_bounce();
      rails_.clear();
      open_status_ = Status(Code::kUnavailable, why);
      open_failed_.store(true, std::memory_order_release);
      return open_status_;
    }
    rails_.push_back(std::move(t));
  }
  open_status_ = Status::ok();
  prepare_order(-1);
  return open_status_;
}

void FabricTransportImpl::prepare_order(int device) {
  if (device >= kOrderDevices || (device >= 0 && orders_[device + 1].load(std::memory_order_acquire))) return;
  if (device < 0 && orders_[0].load(std::memory_order_acquire)) return;
  // sysfs and CUDA queries outside the lock; a racing caller computes the same order and drops it.
  auto [path, numa] = device >= 0 ? gpu_location(device) : std::pair<std::string, int>{"", sys::affinity_numa_node()};
  auto order = std::make_unique<RailOrder>(rank_rails(disc_.locations, path, numa));
  std::lock_guard lock(order_mu_);
  std::atomic<const RailOrder*>& slot = orders_[device + 1];
  if (slot.load(std::memory_order_relaxed)) return;
  slot.store(order.get(), std::memory_order_release);
  order_store_.push_back(std::move(order));
}

std::string FabricTransportImpl::offer(uint64_t session) {
  if (!open_rails().is_ok()) return {};
  Offer o;
  o.session = session;
  o.bounce = bounce_payload();
  o.provider = disc_.provider;
  for (auto& r : rails_) o.rails.push_back(r->rail().address());
  return o.encode();
}

uint32_t FabricTransportImpl::lanes_for(std::string_view remote_offer) const {
  Offer o;
  if (!Offer::parse(remote_offer, &o)) return 1;  // attach() reports the problem
  return uint32_t(std::max<size_t>(1, std::min(o.rails.size(), disc_.rails.size())));
}

// A region fabric cannot register fails registration only where fabric was asked for by name;
// otherwise its descriptors carry no fabric extension and a fabric peer's chunks say so.
Status FabricTransportImpl::register_region(RegionState& region, std::string* desc_ext) {
  const bool required = endpoint_->config().transport == "fabric";
  Status s = open_rails();
  if (!s.is_ok()) return required ? s : Status::ok();
  const bool device = region.kind == MemoryKind::kCuda;
  if (device) prepare_order(region.device);  // this GPU's rail order, before its first chunk
  if (device ? !disc_.mr.hmem : stage_host_) {
    // The provider cannot reach this memory (no FI_HMEM): no registration. Local chunks go through
    // the lanes' staging slots; the descriptor tells initiators to send messages the target serves.
    desc_ext->assign({char(0), char(kExtTwoSided)});
    return Status::ok();
  }
  std::vector<RailMr> mrs(rails_.size());
  std::string ext(1, char(uint8_t(rails_.size())));
  for (uint32_t i = 0; i < rails_.size(); ++i) {
    std::string why;
    // Requested keys (when the provider does not pick them) are random: a key is a capability.
    if (!rails_[i]->rail().register_memory(region.base, region.size, device ? region.device : -1, tether::crypto::random_u64(),
                                           !region.readonly, &mrs[i], &why)) {
      for (uint32_t j = 0; j < i; ++j) rails_[j]->rail().deregister(&mrs[j]);
      return required ? Status(Code::kUnavailable, why) : Status::ok();
    }
    ext += be_u64(mrs[i].key) + be_u64(mrs[i].base);
  }
  {
    std::unique_lock lock(regions_mu_);
    regions_[&region] = std::move(mrs);
  }
  *desc_ext = std::move(ext);
  return Status::ok();
}

void FabricTransportImpl::deregister_region(RegionState& region) {
  std::vector<RailMr> mrs;
  {
    std::unique_lock lock(regions_mu_);
    auto it = regions_.find(&region);
    if (it == regions_.end()) return;
    mrs = std::move(it->second);
    regions_.erase(it);
  }
  for (uint32_t i = 0; i < mrs.size() && i < rails_.size(); ++i) rails_[i]->rail().deregister(&mrs[i]);
}

Status FabricTransportImpl::attach(const std::shared_ptr<Link>& peer, const std::vector<int>&,
                                   std::string_view remote_offer, bool, int64_t) {
  if (stopped_.load()) return Status(Code::kCancelled, "endpoint closed");
  Status s = open_rails();
  if (!s.is_ok()) return s;
  Offer o;
  if (!Offer::parse(remote_offer, &o))
    return Status(Code::kProtocolError, "malformed fabric offer from the peer (or a tether build with another fabric layout)");
  if (o.provider != disc_.provider)
    return Status(Code::kUnavailable, "the peer uses libfabric provider '" + o.provider + "', this endpoint '" +
                                          disc_.provider + "' (set TETHER_FABRIC_PROVIDER alike on both sides)");
  if (o.bounce < endpoint_->config().chunk_bytes)
    return Status(Code::kInvalidArgument, "the peer receives send/recv chunks of at most " + std::to_string(o.bounce) +
                                              " bytes; this endpoint's chunk_bytes is " +
                                              std::to_string(endpoint_->config().chunk_bytes) + " (set them alike)");
  const uint32_t window = std::max<uint32_t>(1, endpoint_->config().window);
  auto state = std::make_shared<FabricPeer>();
  std::vector<std::shared_ptr<Lane>> lanes;
  auto undo = [&](Status err) {
    for (auto& l : lanes) {
      l->thread->rail().deregister(&l->headers_mr);
      l->thread->rail().remove(l->remote);
    }
    return err;
  };
  for (uint32_t i = 0; i < peer->lanes(); ++i) {
    auto l = std::make_shared<Lane>();
    l->peer = peer;
    l->index = i;
    l->rail = i % rails_.size();
    l->session = o.session;
    l->thread = rails_[l->rail].get();
    Rail& rail = l->thread->rail();
    std::string why;
    l->remote = rail.insert(o.rails[i % o.rails.size()], &why);
    if (l->remote == FI_ADDR_NOTAVAIL) return undo(Status(Code::kConnectionLost, why));
    l->ops.resize(window);
    l->flushes.resize(window);
    l->copying.resize(window);
    l->ack_ops.resize(window);
    l->ack_queue.resize(2 * size_t(window) + kBounceBuffers);
    l->headers.resize(2 * size_t(window));
    for (uint32_t k = 0; k < window; ++k) {
      l->ops[k].index = k;
      l->ops[k].lane = l.get();
      l->free_ops.push_back(window - 1 - k);
      l->ack_ops[k].index = window + k;
      l->ack_ops[k].lane = l.get();
      l->ack_ops[k].kind = OpKind::kAck;
      l->free_acks.push_back(window - 1 - k);
    }
    if (!rail.register_memory(l->headers.data(), l->headers.size() * sizeof(SendHeader), -1, tether::crypto::random_u64(),
                              false, &l->headers_mr, &why)) {
      rail.remove(l->remote);
      return undo(Status(Code::kUnavailable, why));
    }
    state->lanes.push_back(l);
    lanes.push_back(std::move(l));
  }
  {
    std::lock_guard lock(sessions_mu_);
    for (auto it = sessions_.begin(); it != sessions_.end();) it = it->second.expired() ? sessions_.erase(it) : std::next(it);
    sessions_[o.session] = peer;
  }
  peer->transport_state = state;  // weak references: lanes own the peer
  for (auto& l : lanes) l->thread->adopt(std::move(l));
  return Status::ok();
}

// Lane i sits on rail i, so waking lane i's thread offers the queued chunks to rail i. Which rails
// are offered them first follows the rail order of the memory they come from (rank_rails):
//  - few chunks (fewer than the peer's lanes): rotate over the rails nearest that memory (`best`,
//    equally near), so small transfers from a GPU stay on the NICs beside it; only when there are
//    more chunks than near rails do the next-ranked rails get woken.
//  - many chunks: every lane is woken, nearest first, and lanes pull as fast as their rails drain.
//    Large transfers use all rails on purpose: one more hop over PCIe or the socket link costs less
//    than leaving NICs idle, and the pull model already gives a slower (farther) rail fewer chunks.
//    To keep a GPU's traffic on its own NIC(s) name them in TETHER_FABRIC_DOMAINS.
void FabricTransportImpl::wake(Link* peer, uint64_t chunks, int device) {
  auto* state = static_cast<FabricPeer*>(peer->transport_state.get());
  if (!state || state->lanes.empty()) return;
  const size_t n = state->lanes.size();
  const size_t k = size_t(std::min<uint64_t>(std::max<uint64_t>(chunks, 1), n));
  const RailOrder* o = order_for(device);
  if (!o || o->rails.size() != rails_.size() || o->rails.size() > 256) {  // not ranked (yet): round-robin
    const uint32_t first = state->next.fetch_add(uint32_t(k), std::memory_order_relaxed);
    for (size_t i = 0; i < k; ++i)
      if (auto l = state->lanes[(first + i) % n].lock()) l->thread->wake();
    return;
  }
  uint32_t pick[256];  // rails are at most 255 (the offer counts them in a byte)
  const size_t count = pick_rails(*o, n, k, state->next.fetch_add(1, std::memory_order_relaxed), pick);
  for (size_t i = 0; i < count; ++i)
    if (auto l = state->lanes[pick[i]].lock()) l->thread->wake();
}

void FabricTransportImpl::stop() {
  if (stopped_.exchange(true)) return;
  for (auto& r : rails_) r->join();
  for (auto& r : rails_) r->cancel_all();
  for (auto& r : rails_) r->drop_lanes();
}

// ---------------------------------------------------------------- rail threads

bool RailThread::start(uint64_t bounce_bytes, std::string* why) {
  bounce_stride_ = (sizeof(SendHeader) + bounce_bytes + 63) & ~uint64_t(63);
  bounce_.resize(bounce_stride_ * kBounceBuffers);
  if (!rail_->register_memory(bounce_.data(), bounce_.size(), -1, tether::crypto::random_u64(), false, &bounce_mr_, why))
    return false;
  bounce_ops_.resize(kBounceBuffers);
  resp_ops_.resize(kBounceBuffers);
  for (uint32_t i = 0; i < kBounceBuffers; ++i) {
    resp_ops_[i].kind = OpKind::kResp;
    resp_ops_[i].index = i;
    OpCtx& c = bounce_ops_[i];
    c.kind = OpKind::kBounce;
    c.index = i;
    ssize_t rc;
    while ((rc = rail_->post_recv(bounce_.data() + i * bounce_stride_, bounce_stride_, bounce_mr_.desc, &c)) == -FI_EAGAIN) {
      fi_cq_msg_entry e[8];
      void* f = nullptr;
      int err = 0;
      rail_->poll(e, 8, &f, &err);
    }
    if (rc) {
      *why = "rail " + rail_->domain() + ": fi_recv: " + rail_->lib().error(int(rc));
      return false;
    }
  }
  thread_ = std::thread([this] { run(); });
  return true;
}

void RailThread::free_bounce() {
  drop_lanes();
  bounce_copier_.wait_all();
  resp_.release();
  rail_->deregister(&bounce_mr_);
}

// True when everything the lane has in flight is a message (sends, acks), no RMA.
bool only_messages(const Lane& l) {
  uint32_t n = uint32_t(l.ack_ops.size() - l.free_acks.size());
  for (const OpCtx& c : l.ops)
    if (c.in_use) {
      if (c.kind != OpKind::kSend || c.phase != Phase::kIdle) return false;
      ++n;
    }
  return n == l.inflight;
}

// A lane's registrations close while its rail lives; its staging copies finish first.
void RailThread::forget(Lane& l) {
  rail_->deregister(&l.headers_mr);
  if (l.copier) l.copier->wait_all();
  if (l.stage) l.stage->release();
}

void RailThread::drop_lanes() {
  std::lock_guard lock(mu_);
  for (auto* set : {&lanes_, &retired_, &incoming_}) {
    for (auto& l : *set) forget(*l);
    set->clear();
  }
  bounce_copier_.wait_all();
  for (Held& h : held_) {
    if (h.pin) h.pin->unpin();
    h = Held{};
  }
  held_count_ = 0;
}

void RailThread::run() {
  sys::name_this_thread("fabric");
  uint64_t seen = ~0ull;
  int idle = 0;
  fi_cq_msg_entry done[64];
  while (!stop_.load(std::memory_order_acquire)) {
    if (const uint64_t v = version_.load(std::memory_order_acquire); v != seen) {
      std::lock_guard lock(mu_);
      seen = v;
      for (auto& l : incoming_) lanes_.push_back(std::move(l));
      incoming_.clear();
    }
    woken_.store(false, std::memory_order_relaxed);
    bool busy = false;
    for (size_t i = 0; i < lanes_.size();) {
      busy |= drive(*lanes_[i]);
      if (lanes_[i]->released) {
        retired_.push_back(std::move(lanes_[i]));
        lanes_[i] = std::move(lanes_.back());
        lanes_.pop_back();
      } else {
        ++i;
      }
    }
    for (size_t i = 0; i < retired_.size();) {
      Lane& l = *retired_[i];
      if (l.copy_count > 0) busy |= drive_copies(l);  // staged copies still finish before their slots go
      if (l.inflight == 0) {
        forget(l);
        retired_[i] = std::move(retired_.back());
        retired_.pop_back();
      } else {
        ++i;
      }
    }
    // Bounce buffers held for a GPU copy (polled: CUDA events cannot wake the CQ) or an answer to send.
    if (held_count_ > 0) {
      for (uint32_t i = 0; i < kBounceBuffers; ++i)
        if (held_[i].state == Held::kCopying || held_[i].state == Held::kRespond) advance(i);
      busy = true;
    }
    // Sleep in the completion queue only when nothing is pending: a provider with manual
    // progress (tcp) moves data, ours and incoming, only while someone reads this queue.
    const bool sleep = !busy && !woken_.load(std::memory_order_acquire) && ++idle > kSpinTurns;
    void* bad = nullptr;
    int err = 0;
    const ssize_t n = rail_->poll(done, 64, &bad, &err, sleep ? kIdleWaitMs : 0);
    if (n > 0) {
      for (ssize_t i = 0; i < n; ++i) complete(done[i]);
      idle = 0;
    } else if (n == -FI_EAVAIL) {
      failed(static_cast<OpCtx*>(bad), err);
      idle = 0;
    }
    if (busy) idle = 0;
  }
}

// Pulls and posts what the lane has room for. True if it did anything (or copies are in flight).
bool RailThread::drive(Lane& l) {
  if (l.released) return false;
  Link& peer = *l.peer;
  if (!l.dead && peer.failed()) {
    l.dead = true;
    l.dead_since = now_ms();
  }
  bool did = l.copy_count > 0 && drive_copies(l);
  if (l.dead) {
    // Nothing more is posted: flush reads not yet sent fail now, acks are dropped.
    while (l.flush_count > 0) {
      OpCtx& c = l.ops[l.flushes[l.flush_head]];
      l.flush_head = (l.flush_head + 1) % l.flushes.size();
      --l.flush_count;
      finish(l, c, Code::kConnectionLost);
    }
    l.ack_count = 0;
    // Wait for the provider to hand back what is in flight (it fails them once the connection
    // is gone), but not forever: after the grace period the lane lets go regardless. Messages are
    // let go sooner: rxm keeps a rendezvous send to a dead peer forever, and only that peer would
    // ever read its buffer.
    const int64_t waited = now_ms() - l.dead_since;
    if (l.inflight == 0 || waited > owner_->grace_ms() || (waited > kMessageGraceMs && only_messages(l)))
      retire(l, Code::kConnectionLost);
    return did;
  }
  while (l.flush_count > 0) {
    OpCtx& c = l.ops[l.flushes[l.flush_head]];
    const ssize_t rc = rail_->flush_read(&l.headers[c.index], l.headers_mr.desc, l.remote, c.raddr + c.length - 1, c.key, &c);
    if (rc == -FI_EAGAIN) break;
    l.flush_head = (l.flush_head + 1) % l.flushes.size();
    --l.flush_count;
    did = true;
    if (rc != 0) finish(l, c, Code::kConnectionLost);
  }
  while (l.ack_count > 0 && !l.free_acks.empty()) {
    OpCtx& c = l.ack_ops[l.free_acks.back()];
    SendHeader& sh = l.headers[c.index];
    sh = l.ack_queue[l.ack_head];
    iovec iov{&sh, sizeof sh};
    void* desc = l.headers_mr.desc;
    const ssize_t rc = rail_->send(&iov, &desc, 1, l.remote, &c);
    if (rc == -FI_EAGAIN) break;
    l.free_acks.pop_back();
    l.ack_head = (l.ack_head + 1) % l.ack_queue.size();
    --l.ack_count;
    did = true;
    if (rc == 0) ++l.inflight;  // else lost: the sender's chunk fails when its peer does
  }
  if (!l.has_stalled && !peer.has_work()) return did || l.copy_count > 0;
  while (!l.free_ops.empty()) {
    if (!l.has_stalled) {
      if (!peer.next_chunk(l.index, &l.stalled)) break;
      l.has_stalled = true;
    }
    OpCtx& c = l.ops[l.free_ops.back()];
    const ssize_t rc = post(l, c, l.stalled);
    if (rc == -FI_EAGAIN) break;  // progress (the CQ read that follows, a staging slot freed), then retry
    l.has_stalled = false;
    did = true;
    if (rc == 0) {
      l.free_ops.pop_back();
      c.in_use = true;
      ++l.inflight;
      continue;
    }
    // Refused locally (no registration for this rail, provider error): this chunk fails alone.
    const wire::FrameHeader& h = l.stalled.hdr;
    const Code code = rc > 0 ? Code(rc) : Code::kInvalidArgument;
    peer.answer(l.index, h.slot, h.gen, uint8_t(code));
  }
  return did || l.copy_count > 0;
}

// 0 posted (or its staging copy started), -FI_EAGAIN retry later, <0 provider error, >0 a tether
// Code for a local refusal.
ssize_t RailThread::post(Lane& l, OpCtx& c, const ChunkOp& op) {
  const wire::FrameHeader& h = op.hdr;
  c.slot = h.slot;
  c.gen = h.gen;
  c.stage = -1;
  c.phase = Phase::kIdle;
  const core::Segment* seg = op.segment;
  const RegionState* region = seg ? seg->local_region : nullptr;
  void* desc = region ? owner_->local_desc(region, l.rail) : nullptr;
  const FrameType type = FrameType(h.type);
  const bool read = type == FrameType::kReadReq;
  const uint64_t n = type == FrameType::kSendData ? op.length : h.length;
  // Local memory libfabric cannot reach (device memory without FI_HMEM): through a staging slot.
  // A read from a two-sided target needs none: its bytes arrive in a bounce buffer and are copied
  // from there (bounce_arrived).
  const bool staged = region && n > 0 && !desc && !owner_->local_registered(region) &&
                      !(read && seg->remote && ext_two_sided(seg->remote->ext_for("fabric")));
  if (!staged) return transmit(l, c, op, op.payload, op.local, desc);
  if (!l.stage) {
    l.stage = std::make_unique<StageMem>();
    l.copier = std::make_unique<Copier>(kStageSlots);
  }
  if (!l.stage->ready())  // first staged chunk of this lane: slots pinned for its GPU
    if (Status s = l.stage->allocate(*rail_, kStageSlots, owner_->bounce_payload(), device_of(region)); !s.is_ok())
      return ssize_t(s.code());
  if (n > l.stage->bytes()) return ssize_t(Code::kInternal);  // chunks never exceed chunk_bytes
  const int s = l.stage->acquire();
  if (s < 0) return -FI_EAGAIN;  // every slot busy: a completion frees one
  c.stage = s;
  c.device = device_of(region);
  c.op = op;
  c.kind = read ? OpKind::kRead : type == FrameType::kSendData ? OpKind::kSend : OpKind::kWrite;
  if (read) {  // lands in the slot; complete() unpacks it to the region, then the chunk is answered
    const ssize_t rc = transmit(l, c, op, nullptr, l.stage->at(uint32_t(s)), l.stage->desc());
    if (rc != 0) {
      l.stage->free_slot(s);
      c.stage = -1;
    }
    return rc;
  }
  // Writes and sends: pack, then post from the slot once the copy is done (drive_copies).
  if (Status st = l.copier->start(uint32_t(s), l.stage->at(uint32_t(s)), op.payload, n, c.device); !st.is_ok()) {
    l.stage->free_slot(s);
    c.stage = -1;
    return ssize_t(st.code());
  }
  c.phase = Phase::kPacking;
  l.copying[(l.copy_head + l.copy_count++) % l.copying.size()] = c.index;
  return 0;
}

// Posts a chunk whose local bytes are `payload` (writes, sends) or `local` (reads), registered as `desc`.
ssize_t RailThread::transmit(Lane& l, OpCtx& c, const ChunkOp& op, const uint8_t* payload, uint8_t* local, void* desc) {
  const wire::FrameHeader& h = op.hdr;
  const core::Segment* seg = op.segment;
  switch (FrameType(h.type)) {
    case FrameType::kWrite:
    case FrameType::kReadReq: {
      const bool write = FrameType(h.type) == FrameType::kWrite;
      const std::string_view ext = seg && seg->remote ? seg->remote->ext_for("fabric") : std::string_view();
      uint64_t key = 0, base = 0;
      if (ext_rail(ext, l.rail, &key, &base)) {  // one-sided: the target's NIC checks key and bounds
        c.kind = write ? OpKind::kWrite : OpKind::kRead;
        c.length = h.length;
        c.raddr = base + h.offset;
        c.key = key;
        return write ? rail_->write(payload, h.length, desc, l.remote, base + h.offset, key, &c)
                     : rail_->read(local, h.length, desc, l.remote, base + h.offset, key, &c);
      }
      if (!ext_two_sided(ext)) return ssize_t(Code::kNotFound);  // the descriptor carries no fabric registration for this rail
      // Two-sided: the target's CPU validates and copies; answered by its kAck / kReadData.
      SendHeader& sh = l.headers[c.index];
      sh = SendHeader{l.session, h.offset, h.length, h.key, h.region_id, h.slot, h.gen, uint16_t(l.index),
                      h.flags, uint8_t(write ? MsgType::kWrite : MsgType::kReadReq), 0, {}, h.desc_offset, h.desc_length};
      iovec iov[2] = {{&sh, sizeof sh}, {const_cast<uint8_t*>(payload), h.length}};
      void* descs[2] = {l.headers_mr.desc, desc};
      c.kind = OpKind::kSend;
      c.length = write ? h.length : 0;
      return rail_->send(iov, descs, write && h.length ? 2 : 1, l.remote, &c);
    }
    case FrameType::kSendData: {
      SendHeader& sh = l.headers[c.index];
      sh = SendHeader{l.session, h.offset, h.length, h.key, h.region_id, h.slot, h.gen, uint16_t(l.index),
                      h.flags, uint8_t(MsgType::kData), 0, {}, 0, 0};
      iovec iov[2] = {{&sh, sizeof sh}, {const_cast<uint8_t*>(payload), op.length}};
      void* descs[2] = {l.headers_mr.desc, desc};
      c.kind = OpKind::kSend;
      c.length = op.length;
      return rail_->send(iov, descs, op.length ? 2 : 1, l.remote, &c);
    }
    default:
      return ssize_t(Code::kProtocolError);
  }
}

// Staged chunks whose copy has finished, in order: packed ones are posted from their slot,
// unpacked reads are answered. True if any moved.
bool RailThread::drive_copies(Lane& l) {
  bool did = false;
  while (l.copy_count > 0) {
    OpCtx& c = l.ops[l.copying[l.copy_head]];
    Result<bool> d = l.copier->done(uint32_t(c.stage));
    if (d.is_ok() && !d.value()) break;
    Code code = d.is_ok() ? Code::kOk : Code::kInternal;
    if (code == Code::kOk && c.phase == Phase::kPacking) {
      if (l.dead || l.released) {
        code = Code::kConnectionLost;
      } else {
        const ssize_t rc = transmit(l, c, c.op, l.stage->at(uint32_t(c.stage)), nullptr, l.stage->desc());
        if (rc == -FI_EAGAIN) break;  // posted again after the CQ read that follows
        if (rc == 0) {
          c.phase = Phase::kIdle;   // in flight: its completion frees the slot
          l.copy_head = (l.copy_head + 1) % l.copying.size();
          --l.copy_count;
          did = true;
          continue;
        }
        code = rc > 0 ? Code(rc) : Code::kConnectionLost;
      }
    }
    l.copy_head = (l.copy_head + 1) % l.copying.size();
    --l.copy_count;
    did = true;
    finish(l, c, code);  // an unpacked read (kOk: answered now), or a chunk that failed
  }
  return did;
}

// The op is done: its slot and context are free again; the chunk is answered unless a message's
// answer is still to come from the peer (sends and two-sided writes/reads that went out).
void RailThread::finish(Lane& l, OpCtx& c, Code code) {
  --l.inflight;
  if (c.stage >= 0) l.stage->free_slot(c.stage);
  c.stage = -1;
  c.phase = Phase::kIdle;
  c.in_use = false;
  l.free_ops.push_back(c.index);
  if (code == Code::kOk) {
    auto& stats = owner_->endpoint()->stats();
    if (c.kind == OpKind::kRead) stats.bytes_received.fetch_add(c.length, std::memory_order_relaxed);
    else stats.bytes_sent.fetch_add(c.length, std::memory_order_relaxed);
    stats.chunks_sent.fetch_add(1, std::memory_order_relaxed);
  }
  if (!l.released && (code != Code::kOk || c.kind != OpKind::kSend)) l.peer->answer(l.index, c.slot, c.gen, uint8_t(code));
}

void RailThread::complete(const fi_cq_msg_entry& e) {
  auto* c = static_cast<OpCtx*>(e.op_context);
  if (!c) return;
  if (c->kind == OpKind::kBounce) {
    bounce_arrived(*c, e.len);
    return;
  }
  if (c->kind == OpKind::kResp) {  // a read's answer left response slot i: its bounce buffer is free
    held_[c->index].state = Held::kIdle;
    advance(c->index);
    return;
  }
  Lane& l = *c->lane;
  if (c->kind == OpKind::kRead && c->stage >= 0 && !l.released) {
    // Landed in a staging slot: unpack to the region; answered once that copy is done.
    c->length = c->op.hdr.length;
    if (l.copier->start(uint32_t(c->stage), c->op.local, l.stage->at(uint32_t(c->stage)), c->length, c->device).is_ok()) {
      c->phase = Phase::kUnpacking;
      l.copying[(l.copy_head + l.copy_count++) % l.copying.size()] = c->index;
      return;
    }
    finish(l, *c, Code::kInternal);
    return;
  }
  if (c->stage >= 0) {  // a write or send from a slot: the provider is done with its bytes
    l.stage->free_slot(c->stage);
    c->stage = -1;
  }
  if (c->kind == OpKind::kWrite && c->length > 0 && !rail_->delivery_complete() && !l.released) {
    // Transmit-complete only: a one-byte read of its last byte, after it, says it is in place.
    c->kind = OpKind::kFlush;
    l.flushes[(l.flush_head + l.flush_count++) % l.flushes.size()] = c->index;
    return;
  }
  if (c->kind == OpKind::kAck) {
    --l.inflight;
    l.free_acks.push_back(c->index - uint32_t(l.ops.size()));
    return;
  }
  // A send chunk is answered by the receiver's ack (its bytes placed), not by its own completion.
  finish(l, *c, Code::kOk);
}

void RailThread::failed(OpCtx* c, int err) {
  if (!c) return;
  if (c->kind == OpKind::kBounce) {
    if (!stop_.load()) bounce_arrived(*c, 0);  // repost
    return;
  }
  if (c->kind == OpKind::kResp) {  // the reader's chunk fails with its peer
    held_[c->index].state = Held::kIdle;
    advance(c->index);
    return;
  }
  Lane& l = *c->lane;
  if (c->kind == OpKind::kAck) {
    --l.inflight;
    l.free_acks.push_back(c->index - uint32_t(l.ops.size()));
    return;  // the sender's chunk fails with its peer
  }
  if (l.released) {
    finish(l, *c, Code::kConnectionLost);  // answers nothing: the lane is gone
    return;
  }
  if (connection_error(err)) {
    finish(l, *c, Code::kConnectionLost);
    // tcp and verbs also drop the connection when the target refuses an access (wrong key,
    // deregistered region), so the cause may be either; say both.
    l.peer->fail(Status(Code::kConnectionLost, "fabric rail " + rail_->domain() + " to peer '" + l.peer->info().name +
                                                   "': " + rail_->lib().error(-err) +
                                                   " (the peer died, or it refused an access: wrong key or deregistered region)"));
  } else {
    // The target refused the access (wrong key, deregistered region, out of its bounds). Some
    // providers (tcp, verbs) drop the connection with it; what follows then fails as above.
    finish(l, *c, Code::kAccessDenied);
  }
}

void RailThread::queue_ack(Lane& l, const SendHeader& h, Code code) {
  if (l.ack_count >= l.ack_queue.size()) return;  // bounded by the window: cannot happen with an honest peer
  SendHeader& ack = l.ack_queue[(l.ack_head + l.ack_count++) % l.ack_queue.size()];
  ack = h;
  ack.type = uint8_t(MsgType::kAck);
  ack.length = 0;
  ack.status = uint8_t(code);
}

// A message landed in bounce buffer c. Acks answer our chunks; send chunks, two-sided writes and
// read answers are copied to their place (validated first: the recv match, the registry, our own
// read); two-sided reads are copied into response slot c.index and sent back. A copy to or from
// GPU memory keeps the buffer (hold) until its CUDA event says done; host copies finish here.
void RailThread::bounce_arrived(OpCtx& c, uint64_t len) {
  const uint32_t i = c.index;
  uint8_t* buf = bounce_.data() + i * bounce_stride_;
  auto& stats = owner_->endpoint()->stats();
  SendHeader h{};
  if (len >= sizeof(SendHeader)) std::memcpy(&h, buf, sizeof h);
  std::shared_ptr<Link> peer = len >= sizeof(SendHeader) ? owner_->peer_by_session(h.session) : nullptr;
  auto* state = peer ? static_cast<FabricPeer*>(peer->transport_state.get()) : nullptr;
  std::shared_ptr<Lane> lane = state && h.lane < state->lanes.size() ? state->lanes[h.lane].lock() : nullptr;
  uint8_t* payload = buf + sizeof(SendHeader);
  const bool sized = len >= sizeof(SendHeader) && h.length == len - sizeof(SendHeader);  // the payload is all there
  if (!lane || lane->thread != this) {
    stats.rejected_requests.fetch_add(1, std::memory_order_relaxed);
  } else if (h.type == uint8_t(MsgType::kAck)) {
    peer->answer(lane->index, h.slot, h.gen, h.status);
  } else if (h.type == uint8_t(MsgType::kData)) {
    uint8_t* dest = nullptr;
    core::TransferState* recv = nullptr;
    int device = -1;
    const Code code = sized ? peer->resolve_send_data(h.token, h.offset, h.length, h.unit, h.flags, &dest, &recv, &device)
                            : Code::kProtocolError;
    if (code == Code::kOk && dest) return hold(i, peer, lane, h, nullptr, recv, dest, payload, device);
    if (code != Code::kOk) stats.rejected_requests.fetch_add(1, std::memory_order_relaxed);
    queue_ack(*lane, h, code);  // kOk with no destination: a resent chunk already placed
  } else if (h.type == uint8_t(MsgType::kWrite) || h.type == uint8_t(MsgType::kReadReq)) {
    const bool write = h.type == uint8_t(MsgType::kWrite);
    RegionState* pin = nullptr;
    // Checked exactly as every transport's frames: region, key over the descriptor's range, bounds, read-only.
    Code code = !(write ? sized : len == sizeof(SendHeader) && h.length <= owner_->bounce_payload()) || (h.flags & ~wire::kKnownFlags)
                    ? Code::kProtocolError
                    : owner_->endpoint()->registry().resolve(h.token, h.unit, h.desc_offset, h.desc_length, h.offset,
                                                             h.length, write, &pin);
    if (code == Code::kOk && write) return hold(i, peer, lane, h, pin, nullptr, pin->base + h.offset, payload, device_of(pin));
    if (code == Code::kOk && !resp_.ready())  // first two-sided read served on this rail
      code = resp_.allocate(*rail_, kBounceBuffers, sizeof(SendHeader) + owner_->bounce_payload(), device_of(pin)).code();
    if (code == Code::kOk)
      return hold(i, peer, lane, h, pin, nullptr, resp_.at(i) + sizeof(SendHeader), pin->base + h.offset, device_of(pin));
    if (pin) pin->unpin();
    stats.rejected_requests.fetch_add(1, std::memory_order_relaxed);
    queue_ack(*lane, h, code);  // refused: nothing was touched
  } else if (h.type == uint8_t(MsgType::kReadData)) {
    uint8_t* dest = nullptr;
    int device = -1;
    if (sized && peer->read_destination(lane->index, h.slot, h.gen, h.length, &dest, &device) == Code::kOk)
      return hold(i, peer, lane, h, nullptr, nullptr, dest, payload, device);
    stats.rejected_requests.fetch_add(1, std::memory_order_relaxed);  // data for no read of ours: dropped
  } else {
    stats.rejected_requests.fetch_add(1, std::memory_order_relaxed);
  }
  repost(i);
}

// Keeps bounce buffer i while `src` is copied to `dst` for its message, then serves it (advance).
void RailThread::hold(uint32_t i, std::shared_ptr<Link> peer, std::shared_ptr<Lane> lane, const SendHeader& h,
                      RegionState* pin, core::TransferState* recv, void* dst, const void* src, int device) {
  Held& hd = held_[i];
  hd.state = Held::kCopying;
  hd.peer = std::move(peer);
  hd.lane = std::move(lane);
  hd.h = h;
  hd.pin = pin;
  hd.recv = recv;
  hd.code = h.length ? bounce_copier_.start(i, dst, src, h.length, device).code() : Code::kOk;
  ++held_count_;
  advance(i);  // host copies are done already
}

// Moves held bounce buffer i on: once its copy is done, answers (ack, read data) and posts the
// buffer again. True while it is still held.
bool RailThread::advance(uint32_t i) {
  Held& hd = held_[i];
  auto& stats = owner_->endpoint()->stats();
  if (hd.state == Held::kCopying) {
    if (hd.code == Code::kOk) {
      Result<bool> d = bounce_copier_.done(i);
      if (d.is_ok() && !d.value()) return true;
      if (!d.is_ok()) hd.code = Code::kInternal;
    }
    const SendHeader& h = hd.h;
    Lane& l = *hd.lane;
    if (hd.pin) {  // the region's bytes are no longer touched: deregistration may go ahead
      hd.pin->unpin();
      hd.pin = nullptr;
    }
    if (hd.code == Code::kOk && h.type != uint8_t(MsgType::kReadReq)) {
      stats.bytes_received.fetch_add(h.length, std::memory_order_relaxed);
      stats.chunks_received.fetch_add(1, std::memory_order_relaxed);
    }
    hd.state = Held::kIdle;
    switch (MsgType(h.type)) {
      case MsgType::kData:
        if (hd.code == Code::kOk) hd.peer->send_data_placed(hd.recv, h.offset, h.length);
        else hd.peer->abandon_send_data(hd.recv);
        queue_ack(l, h, hd.code);
        break;
      case MsgType::kWrite:
        queue_ack(l, h, hd.code);
        break;
      case MsgType::kReadReq:
        if (hd.code != Code::kOk) queue_ack(l, h, hd.code);
        else hd.state = Held::kRespond;
        break;
      case MsgType::kReadData:
        hd.peer->answer(l.index, h.slot, h.gen, uint8_t(hd.code));
        break;
      default:
        break;
    }
  }
  if (hd.state == Held::kRespond) {
    Lane& l = *hd.lane;
    if (!l.released && !l.dead && !hd.peer->failed()) {
      uint8_t* slot = resp_.at(i);
      SendHeader rh = hd.h;
      rh.type = uint8_t(MsgType::kReadData);
      rh.status = 0;
      std::memcpy(slot, &rh, sizeof rh);
      iovec iov{slot, sizeof rh + rh.length};
      void* desc = resp_.desc();
      const ssize_t rc = rail_->send(&iov, &desc, 1, l.remote, &resp_ops_[i]);
      if (rc == -FI_EAGAIN) return true;  // again on the next turn, after progress
      if (rc == 0) {
        hd.state = Held::kSending;  // its completion (complete/failed: kResp) lets the buffer go
        return true;
      }
    }
    hd.state = Held::kIdle;  // not sent: the reader's chunk fails with its peer
  }
  if (hd.state == Held::kSending) return true;
  hd.peer.reset();
  hd.lane.reset();
  hd.recv = nullptr;
  --held_count_;
  repost(i);
  return false;
}

// Posts bounce buffer i again. A full queue: progress and retry (the queue drains as we read it).
void RailThread::repost(uint32_t i) {
  uint8_t* buf = bounce_.data() + i * bounce_stride_;
  while (rail_->post_recv(buf, bounce_stride_, bounce_mr_.desc, &bounce_ops_[i]) == -FI_EAGAIN && !stop_.load()) {
    fi_cq_msg_entry e[1];
    void* f = nullptr;
    int err = 0;
    if (rail_->poll(e, 1, &f, &err) > 0) complete(e[0]);
  }
}

void RailThread::retire(Lane& l, Code code) {
  if (l.released) return;
  l.released = true;
  l.has_stalled = false;
  l.peer->release_lane(l.index, code);  // answers what is still in flight on it
  if (l.inflight == 0) rail_->remove(l.remote);
}

void RailThread::cancel_all() {
  for (auto& l : lanes_) retire(*l, Code::kCancelled);
  std::lock_guard lock(mu_);
  for (auto& l : incoming_) retire(*l, Code::kCancelled);
}

}  // namespace tether::transport::fabric

namespace tether::transport {

FabricRails fabric_rails(const Config& c, const std::vector<std::pair<std::string, int>>& devices) {
  using namespace fabric;
  FabricRails out;
  const Lib* lib = Lib::load(c.fabric_library, &out.why);
  if (!lib) return out;
  Discovery d;
  if (!discover(*lib, discovery_options(c), &d, &out.why)) return out;
  out.why.clear();  // discovery may have noted a weaker attempt that failed before one succeeded
  out.provider = d.provider;
  for (const sys::Nic& n : d.locations) out.rails.push_back({n.name, n.pci_path, n.numa_node});
  out.host_numa = sys::affinity_numa_node();
  out.host_order = rank_rails(d.locations, "", out.host_numa).rails;
  for (auto& [path, numa] : devices) out.device_orders.push_back(rank_rails(d.locations, path, numa).rails);
  return out;
}

std::unique_ptr<Transport> make_fabric_transport(core::EndpointImpl* endpoint) {
  return std::make_unique<fabric::FabricTransportImpl>(endpoint);
}

}  // namespace tether::transport
