// tether's public C++ API: Endpoint, Region, RemoteRegion, Peer, Transfer.
// The same words name the same things in Python (python/tether) and in the docs.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tether/config.h"
#include "tether/status.h"

namespace tether {

namespace core {
struct RegionState;
struct TransferState;
class PeerState;
class EndpointImpl;
}  // namespace core

enum class MemoryKind : uint8_t { kHost = 0, kCuda = 1 };

using EndpointId = std::array<uint8_t, 16>;

// A registered memory range of this process. Copyable handle; deregistration is explicit.
class Region {
 public:
  Region() = default;
  uint32_t id() const;
  void* data() const;
  uint64_t size() const;
  MemoryKind kind() const;
  int device() const;  // GPU index, -1 for host memory
  bool readonly() const;
  bool valid() const { return state_ != nullptr; }
  // Bytes granting access to [offset, offset+length) of this region and nothing else.
  // length == UINT64_MAX means "to the end".
  Result<std::string> descriptor(uint64_t offset = 0, uint64_t length = UINT64_MAX) const;

  explicit Region(std::shared_ptr<core::RegionState> s) : state_(std::move(s)) {}
  const std::shared_ptr<core::RegionState>& state() const { return state_; }

 private:
  std::shared_ptr<core::RegionState> state_;
};

// A parsed descriptor: a range of a region that lives in another endpoint.
struct RemoteRegion {
  EndpointId endpoint{};
  uint32_t region_id = 0;
  uint64_t offset = 0;   // start of the granted range inside the region
  uint64_t length = 0;   // length of the granted range
  uint64_t key = 0;      // MAC over (region_id, offset, length) under the region's secret
  MemoryKind kind = MemoryKind::kHost;
  int32_t device = -1;
  // Transports' extensions (memory keys, IPC handles), after the 64 fixed bytes; not covered by key.
  std::string ext;
  std::string_view ext_for(std::string_view transport) const;
  static constexpr size_t kEncodedSize = 64;  // without extensions
  static Result<RemoteRegion> parse(std::string_view bytes);
  std::string encode() const;
  // Same endpoint, region, range, key, memory and extensions.
  friend bool operator==(const RemoteRegion&, const RemoteRegion&) = default;
};

// One entry of a vectored transfer.
struct IoEntry {
  Region local;
  uint64_t local_offset = 0;
  RemoteRegion remote;
  uint64_t remote_offset = 0;  // relative to the descriptor's range
  uint64_t length = 0;
};

// One block of a vectored transfer whose blocks share one local region and one remote range (the
// KV-cache pattern: thousands of fixed-size blocks scattered over one buffer on each side).
// Offsets are relative to the local region and to the descriptor's range. Laid out as three
// uint64_t, so an (n, 3) uint64 array can be passed as n Blocks.
struct Block {
  uint64_t local_offset = 0;
  uint64_t remote_offset = 0;
  uint64_t length = 0;
};
static_assert(sizeof(Block) == 3 * sizeof(uint64_t));

// Blocks between one local region and one remote range: one run of a transfer that spans several
// regions (a KV cache laid out as one region per layer, say). Pointers are read during the call only.
// The n blocks are `blocks`, or where that is null three columns read in place (numpy arrays posted
// without building a table first): local_offsets[i], remote_offsets[i] and lengths[i], or `length`
// for every block where `lengths` is null.
struct BlockRun {
  const Region* local = nullptr;
  const RemoteRegion* remote = nullptr;
  const Block* blocks = nullptr;
  size_t n = 0;
  const uint64_t* local_offsets = nullptr;
  const uint64_t* remote_offsets = nullptr;
  const uint64_t* lengths = nullptr;
  uint64_t length = 0;

  Block at(size_t i) const {
    return blocks ? blocks[i] : Block{local_offsets[i], remote_offsets[i], lengths ? lengths[i] : length};
  }
};

// What metadata bytes (Endpoint::metadata()) say about the endpoint that made them.
struct MetadataInfo {
  EndpointId endpoint{};
  std::string host;      // the address it listens on ("0.0.0.0" for every interface)
  uint16_t port = 0;
  std::string hostname;
};

// Handle to one asynchronous operation.
class Transfer {
 public:
  Transfer() = default;
  explicit Transfer(std::shared_ptr<core::TransferState> s) : state_(std::move(s)) {}
  bool done() const;
  // done(), after doing from the calling thread what finishes this transfer soonest, without blocking
  // (a small transfer's waiting answer, a one-sided GPU copy): a caller polling in a loop (NIXL's
  // checkXfer) sees a small transfer finish without waiting for another thread to wake.
  bool poll() const;
  // Waits up to timeout_ms (negative: forever). Returns the transfer's status, or kTimeout
  // if it is still running (it keeps running).
  Status wait(int64_t timeout_ms = -1) const;
  Status status() const;   // kTimeout-free: ok while running
  // Stops the transfer without blocking: no further chunk leaves, and it ends with kCancelled once
  // the chunks already in flight are answered (a deregistration of its regions waits for that).
  // No notification is sent unless it already was. Finished transfers are unaffected.
  void cancel() const;
  uint64_t bytes() const;  // payload bytes of the operation (for recv: the message length)
  const std::shared_ptr<core::TransferState>& state() const { return state_; }

 private:
  std::shared_ptr<core::TransferState> state_;
};

// The link to another endpoint.
class Peer {
 public:
  Peer() = default;
  explicit Peer(std::shared_ptr<core::PeerState> s) : state_(std::move(s)) {}

  Transfer write(const Region& local, uint64_t local_offset, const RemoteRegion& remote,
                 uint64_t remote_offset, uint64_t length, std::string notify = {});
  Transfer read(const Region& local, uint64_t local_offset, const RemoteRegion& remote,
                uint64_t remote_offset, uint64_t length);
  // Many (local region, local offset, remote, remote offset, length) as one transfer. An error
  // (checked before any byte moves) names the entry: "... (entry 17)".
  Transfer writev(std::vector<IoEntry> entries, std::string notify = {});
  Transfer readv(std::vector<IoEntry> entries);
  // n blocks between one local region and one remote range as one transfer: the same checks as the
  // IoEntry form (errors name the block: "... (block 17)"), without an IoEntry (and its RemoteRegion
  // copy) per block. `blocks` is read during the call only; zero-length blocks are allowed.
  Transfer writev(const Region& local, const RemoteRegion& remote, const Block* blocks, size_t n,
                  std::string notify = {});
  // A read's notification reaches the target once every byte has arrived here (the target learns
  // that its memory may be reused).
  Transfer readv(const Region& local, const RemoteRegion& remote, const Block* blocks, size_t n,
                 std::string notify = {});
  // Runs of blocks over several regions as one transfer: one completion, one notification after all
  // of it. Errors name the block by its index over all runs.
  Transfer writev(const BlockRun* runs, size_t nruns, std::string notify = {});
  Transfer readv(const BlockRun* runs, size_t nruns, std::string notify = {});
  Transfer send(const Region& local, uint64_t offset, uint64_t length, uint64_t tag = 0);
  Transfer recv(const Region& local, uint64_t offset, uint64_t length, uint64_t tag = 0);
  Transfer notify(std::string data);

  uint64_t id() const;
  std::string name() const;
  std::string transport() const;  // the transport carrying this peer's data ("tcp", "ipc", ...)
  EndpointId endpoint_id() const;
  bool connected() const;
  Status error() const;  // why the peer is gone, ok while connected
  // Fails in-flight transfers with kCancelled and drops the link: its sockets, segments and lane
  // threads are let go before it returns (bounded wait), whoever else holds this handle; later posts
  // fail with kCancelled ("peer 'x' was closed locally").
  void close();
  const std::shared_ptr<core::PeerState>& state() const { return state_; }

 private:
  std::shared_ptr<core::PeerState> state_;
};

struct Notification {
  uint64_t peer_id = 0;
  std::string peer_name;
  std::string data;
};

// What a lane or a NIC carried. errors: lanes lost; resends: chunks moved off a lost lane.
struct LinkStats {
  uint64_t bytes_sent = 0, bytes_received = 0, chunks_sent = 0, chunks_received = 0, errors = 0, resends = 0;
  // tcp lanes (and their NICs; 0 elsewhere): seconds inside sendmsg / recv and waiting on GPU staging
  // copies: against wall time, where a lane's time goes.
  double send_s = 0, recv_s = 0, staging_s = 0;
  // tcp lanes staging GPU memory: the most staging slots one ring of the lane held at once (a NIC: of
  // its lanes); 0 where nothing was staged.
  uint64_t staging_slots_peak = 0;
};
struct NicStats {
  std::string name;   // interface; "other" for lanes on no known interface
  LinkStats link;
};
struct LaneStats {    // one lane of a live peer
  uint64_t peer_id = 0;
  std::string peer_name;
  uint32_t lane = 0;
  bool alive = true;
  std::string local_nic, local_addr, remote_nic, remote_addr;
  LinkStats link;
};

struct EndpointStats {
  uint64_t bytes_sent = 0, bytes_received = 0, chunks_sent = 0, chunks_received = 0;
  uint64_t transfers_completed = 0, transfers_failed = 0, rejected_requests = 0;
  uint64_t reads_pushed = 0;  // peers' reads this endpoint sent as pushes (tcp, GPU memory on either side)
  std::vector<NicStats> nics;    // NICs that are data NICs or carried a lane
  std::vector<LaneStats> lanes;  // lanes of the peers connected now
  // What each transport counts of its own, as (name, value), names prefixed by the transport ("ipc_cma_chunks").
  std::vector<std::pair<std::string, uint64_t>> transport_counters;
};

class Endpoint {
 public:
  static Result<std::unique_ptr<Endpoint>> create(const Config& config);
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  std::string address() const;    // "host:port" it listens on
  std::string metadata() const;   // bytes a peer passes to connect()
  // Checks metadata bytes without connecting: kInvalidArgument or kProtocolError says what is wrong.
  static Result<MetadataInfo> parse_metadata(std::string_view bytes);
  EndpointId id() const;
  std::string name() const;
  const Config& config() const;

  // metadata bytes from metadata(), or "host:port".
  Result<Peer> connect(std::string_view target, int64_t timeout_ms = -1);
  Result<Region> register_memory(void* ptr, uint64_t size, MemoryKind kind = MemoryKind::kHost,
                                 int device = -1, bool readonly = false);
  Status deregister(const Region& region);
  std::vector<Notification> notifications();   // drains what has arrived
  // Blocks up to timeout_ms for at least one notification.
  std::vector<Notification> wait_notifications(int64_t timeout_ms);
  std::vector<Peer> peers() const;
  EndpointStats stats() const;
  // Every transport this build knows: (name, why it cannot be used here — empty when it can).
  std::vector<std::pair<std::string, std::string>> transports() const;
  void close();  // idempotent; fails in-flight transfers with kCancelled

 private:
  explicit Endpoint(std::shared_ptr<core::EndpointImpl> impl);
  std::shared_ptr<core::EndpointImpl> impl_;
};

}  // namespace tether
