// Transfer state: one user operation, cut into chunks by the peer's scheduler, done once all are answered.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/region.h"
#include "tether/status.h"

namespace tether::core {

class PeerState;

enum class OpKind : uint8_t { kWrite, kRead, kSend, kRecv, kNotify };

// What the blocks of one run share: the remote descriptor they name and the local region they lie in.
struct Run {
  uint32_t region_id = 0;  // remote region (a send's: the recv token)
  uint64_t key = 0, desc_offset = 0, desc_length = 0;
  const RegionState* local_region = nullptr;  // memory kind and device of the run's local bytes
  // The remote descriptor (memory kind, transports' extensions) in TransferState::remotes; null for send/recv.
  const RemoteRegion* remote = nullptr;
};

// One contiguous piece of a transfer: local bytes <-> a range of its run's descriptor. Small, because
// a post writes one per block and a KV pull posts thousands: what blocks share lives in their Run.
// Built with all four fields always (no member initialisers): Segments makes room for thousands of them
// without zeroing what the post then writes.
struct Segment {
  uint8_t* local;
  uint64_t length;
  uint64_t remote_offset;  // absolute offset in the remote region / message
  uint32_t run;            // index into TransferState::runs
};
static_assert(sizeof(Segment) == 32 && std::is_trivial_v<Segment>);

// An allocator whose value-initialisation default-initialises: resize() leaves trivial elements as
// they are, for a writer that fills them at once.
template <typename T>
struct NoZeroing : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = NoZeroing<U>;
  };
  NoZeroing() = default;
  template <typename U>
  NoZeroing(const NoZeroing<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
using Segments = std::vector<Segment, NoZeroing<Segment>>;

// GPU of a run's local bytes, -1 for host memory; whether its remote bytes are GPU memory.
inline int32_t device_of(const Run& r) {
  return r.local_region && r.local_region->kind == MemoryKind::kCuda ? r.local_region->device : -1;
}
inline bool remote_gpu(const Run& r) { return r.remote && r.remote->kind == MemoryKind::kCuda; }

const char* op_name(OpKind op);  // "write", "read", ... (error messages)

struct TransferState {
  OpKind op = OpKind::kWrite;
  // Payload bytes; for a recv, set by the control thread when a message matches (so atomic).
  std::atomic<uint64_t> bytes{0};
  Segments segments;
  std::vector<Run> runs;  // what segments share, by Segment::run
  const Run& run_of(const Segment& g) const { return runs[g.run]; }
  // write/read: the distinct descriptors segments point to, one copy each however many blocks use it
  // (reserved before the first segment, never resized once posted).
  std::vector<RemoteRegion> remotes;
  std::vector<std::shared_ptr<RegionState>> local_pins;  // unpinned when finished
  std::string notify;          // delivered after the data (writes) or alone (kNotify)
  std::shared_ptr<PeerState> peer;

  // Scheduler cursor, guarded by the peer's lock.
  size_t cur_segment = 0;
  uint64_t cur_offset = 0;
  TransferState* next_queued = nullptr;

  // Chunks issued and not yet answered, plus one "hold" released when issuing ends.
  std::atomic<int64_t> pending{1};
  std::atomic<uint32_t> lane_hint{UINT32_MAX};  // lane of the latest chunk: where its answer will come
  std::atomic<uint8_t> first_error{0};

  // Two-sided bookkeeping.
  uint64_t tag = 0;
  uint64_t msg_id = 0;                 // send: RTS id; recv and pulled read: token; pushed: the puller's token
  bool pushed = false;                 // a send this side runs for a peer's pulled read (no handle, no count)
  uint32_t pull_lane = UINT32_MAX;     // a pulled read: the lane its kPull frame went on, none yet (peer lock)
  std::shared_ptr<RegionState> source; // pushed: the region its chunks read, each pinned only while sent
  std::atomic<uint64_t> received{0};   // recv: payload bytes placed so far
  uint64_t unit = 0;                   // recv: the sender's chunk size; placed: one bit per chunk (peer lock)
  std::vector<uint64_t> placed;
  void expect_chunks(uint64_t length, uint64_t chunk) {
    unit = chunk;
    placed.assign((length / chunk + 64) / 64, 0);
  }

  // Keeps the state alive while the engine owns it; dropped by finish().
  std::shared_ptr<TransferState> self;

  // Records an error (the first one wins). Returns true if this call set it.
  bool record_error(const Status& s);
  Status error() const;
  // One chunk (or the hold) answered; finishes the transfer on the last one.
  void release(int64_t n = 1);
  void finish(Status s);
  bool is_finished() const { return finished_.load(std::memory_order_acquire); }
  // Spins, naps or sleeps by the transfer's size, busy_poll_us and the transport (transfer.cc).
  Status wait(int64_t timeout_ms);
  Status final_status() const;

 private:
  void nap_until_done(std::chrono::steady_clock::time_point end, uint32_t nap_us) const;
  std::atomic<bool> finishing_{false};
  std::atomic<bool> finished_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<int> waiters_{0};
  Status error_;        // guarded by mu_ until finished
  Status final_;
};

}  // namespace tether::core
