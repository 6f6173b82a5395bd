// One-sided small ops between two processes of one host (docs/ARCHITECTURE.md, "One-sided small
// ops"). A request the target validates and answers costs a round trip between two threads; UCX's
// cma and cuda_ipc skip it. Here the target still validates each descriptor once: its answer to a
// request that asked for it carries a GRANT (where that descriptor's bytes lie in its process and a
// mark in its liveness table), and from then on the initiator moves chunks of that descriptor itself
// (process_vm_writev/readv into host memory, a CUDA copy into the target's GPU allocation) and
// answers them locally, without any message. A batch of GPU blocks in one descriptor (a KV pull's
// shape) goes the same way whatever its size, as one copy-kernel launch over the target's allocation:
// its answer grants the descriptor as a single chunk's does.
//
// What keeps a one-sided copy from landing in memory the target has let go of is a hazard
// protocol over shared memory (both pages below live in each side's bounce area):
//   initiator: hazard := region id; then read `closed` and live[id % kLiveSlots]; copy only if the
//              region is still marked there; hazard := 0.
//   target:    (deregister) live slot := 0, or (peer ends) closed := 1; then wait until no hazard of
//              that peer names the region (every hazard, when closing).
// Both sides use sequentially consistent operations, so either the initiator sees the region gone
// and does not copy, or the target sees the hazard and waits for the copy to end. The target waits
// as long as the hazard's process lives, never against a clock: a copy that may still land is never
// raced by a timeout. Three rules keep that wait to the length of one small copy:
//  - a host write brings its source pages in (one load per page) before it claims its hazard, so a
//    fault of the initiator's source memory (swap-in, a slow file mapping, userfaultfd) stalls the
//    writer before its hazard, not a copy the target waits for;
//  - a hazard names the thread that holds it: a holder the kernel shows stopped on its way out of
//    process_vm_writev has finished its copy, and the target does not wait for it;
//  - a host read marks its hazard kReadHazard, which the target does not wait for: the reader checks
//    the region is still live after its copy and discards what it read otherwise.
// What remains is a thread stopped (SIGSTOP, a debugger) in the few instructions between its claim
// and its system call: it may copy when it runs again, and no system call lets the target revoke
// another process's cross-memory attach, so deregister() waits for it (docs/RELIABILITY.md).
#pragma once
#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>

#include "core/wire.h"
#include "transport/ipc/cuda_mover.h"

namespace tether::transport::ipc {

constexpr uint32_t kLiveSlots = 504;    // fills the first page after `closed`
constexpr uint32_t kHazards = 16;       // one-sided copies in flight per peer (one per thread at a time)
constexpr uint32_t kGrantCache = 64;    // descriptors an initiator remembers grants for, per peer
// GPU chunks go one-sided only up to here when the posting thread waits for the copy itself (no
// GpuCompleter: busy polling off): the copy and its wait cost about the same whatever the size, so ops posted
// back to back would run one after another, where as requests the lanes' threads copy them side by
// side (docs/PERFORMANCE.md, "Defaults and why").
constexpr uint64_t kOneSidedGpuMax = 8 << 10;
// A hazard naming a region for a host read: the target need not wait for it (the reader re-checks).
constexpr uint64_t kReadHazard = uint64_t(1) << 63;

// Each side's page pair, just before its message rings; the other side maps it.
struct OneSidedPage {
  // Written by this side as a target, read by the other:
  alignas(64) std::atomic<uint32_t> closed;             // 1 once this side honours no grant to the peer
  alignas(64) std::atomic<uint64_t> live[kLiveSlots];   // region id at [id % kLiveSlots] while granted, else 0
  // Written by this side as an initiator, read by the other:
  struct alignas(64) Hazard {
    std::atomic<uint64_t> region;  // the region a one-sided copy is using now, 0 when none
    std::atomic<int32_t> tid;      // the thread that set `region` (a host write's copier)
  };
  alignas(4096) Hazard hazard[kHazards];
};
constexpr uint64_t kOneSidedBytes = 8192;
static_assert(sizeof(OneSidedPage) == kOneSidedBytes);
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free);

// Frame::flags (ipc's own byte in its frame, not the wire header's flags).
constexpr uint8_t kWantGrant = 1;      // request: answer with a grant for this descriptor if you can
constexpr uint8_t kGranted = 1;        // answer: where/addr/cuda say where the chunk lies, marked live
constexpr uint8_t kGrantReadOnly = 2;  // answer: the region is read-only (no one-sided writes)

// What an initiator remembers of a grant: the descriptor it covers and where its region lies there.
struct Grant {
  uint32_t region = 0;  // 0: empty
  uint64_t key = 0, desc_offset = 0, desc_length = 0;
  bool gpu = false, readonly = false;
  uint64_t base = 0;    // host: the region's address in the target; GPU: its offset in `ref`
  CudaRef ref{};
};

// Target side. Marks `region` live for one-sided access by the peer whose page is `ours`; false
// when its slot holds another region (that region keeps it; this one stays two-sided).
bool mark_live(OneSidedPage& ours, uint32_t region);
// Unmarks `region` (0: closes the page for every region), then waits until the peer's hazards in
// `theirs` let go of it (0: of everything) or process `pid` has exited. After `slow_ms` it calls
// `on_slow` once (the caller drops the peer) and goes on waiting; only where the process cannot be
// seen (pid 0: another pid namespace) does it give up then and return false.
bool revoke(OneSidedPage& ours, const OneSidedPage& theirs, uint32_t region, pid_t pid, uint32_t slow_ms,
            void (*on_slow)(void*) = nullptr, void* arg = nullptr);

// Initiator side, one per peer.
class OneSidedInitiator {
 public:
  // Both pages: the target's (read) and our own (our hazards).
  OneSidedInitiator(const OneSidedPage* target, OneSidedPage* ours) : target_(target), ours_(ours) {
    for (uint32_t i = 0; i < kHazards; ++i) ctx_[i].index = i;
  }
  // The grant covering the descriptor a chunk (or a batch's fragment) names, if we have one.
  bool find(uint32_t region, uint64_t key, uint64_t desc_offset, uint64_t desc_length, Grant* out) const;
  void remember(const Grant& g);
  void forget(uint32_t region);

  // A claimed hazard slot and its CUDA streams (with the table a GPU batch's triples are written to):
  // one thread at a time, until its copy has ended.
  struct Context {
    std::atomic<bool> busy{false};
    uint32_t index = 0;
    std::unique_ptr<CudaLane> cuda;
  };
  // A free context with its hazard naming `region` (a host read's: `read`), if the region is still
  // live for us; nullptr when none is free or the grant is gone (`*gone` then says which).
  Context* enter(uint32_t region, bool read, bool* gone);
  void leave(Context* c);
  // Whether `region` is still live for us (a host read checks it after its copy).
  bool live(uint32_t region) const;

 private:
  const OneSidedPage* target_;
  OneSidedPage* ours_;
  mutable std::mutex mu_;  // the cache; held for a lookup or an update, never across a copy
  Grant cache_[kGrantCache];
  Context ctx_[kHazards];
};

// Finishes one-sided GPU copies off the posting thread: the poster starts the copy and hands it
// here; whoever polls the copies' events lets go of each hazard and answers the chunk, so ops posted
// back to back copy side by side (docs/PERFORMANCE.md, "Defaults and why"). A thread
// waiting for a lone op polls its copy itself (finish_here()), as UCX's progress does, so the op starts,
// finishes and is answered on one core; the completer's own thread polls the rest (ops in flight), for
// `busy_us` after the last copy, then sleeps.
class GpuCompleter {
 public:
  struct Pending {
    std::shared_ptr<void> peer;  // what `finish` answers (a Link); keeps `os` alive through it
    OneSidedInitiator* os = nullptr;
    OneSidedInitiator::Context* ctx = nullptr;
    int device = -1;
    // Whether the copy has ended (an error: it failed); polled by whichever thread polls.
    Result<bool> (*done)(Pending&) = nullptr;
    // Lets go of the hazard and answers the chunk, on the thread that saw the copy end.
    void (*finish)(Pending&, bool ok) = nullptr;
    // Set for a write batch: takes the peer's further queued chunks, called by the completer's own
    // thread once it has taken this one, so an op's next batch is cut and launched beside the poster's.
    void (*take_queued)(void* peer) = nullptr;
    uint32_t lane = 0, slot = 0, gen = 0;
    uint64_t length = 0;
    bool read = false;
  };
  explicit GpuCompleter(uint32_t busy_us) : busy_us_(busy_us) {}
  ~GpuCompleter() { stop(); }
  GpuCompleter(const GpuCompleter&) = delete;
  GpuCompleter& operator=(const GpuCompleter&) = delete;
  // False when it is full or stopped: the caller then waits for the copy itself.
  bool push(Pending&& p);
  // From a thread waiting for a transfer: polls a lone copy in flight and answers it once it ended.
  // Never blocks (returns at once when another thread is polling); lock-free when none is in flight.
  void finish_here();
  // Finishes every copy handed over (waiting for it), then ends the thread.
  void stop();

 private:
  static constexpr uint32_t kMax = 256;
  void run();
  // Takes what was pushed and polls every copy in flight once; returns at once when another thread is at it.
  // `own`: on the completer's thread, which then runs the `take_queued` of one newly taken batch.
  void poll_once(bool own);
  const uint32_t busy_us_;
  std::mutex mu_;  // the queue; held for a push or a take, never across a CUDA call
  std::condition_variable cv_;
  Pending queue_[kMax];
  uint32_t queued_ = 0;
  std::atomic<uint32_t> queued_hint_{0};   // queued_, read without the lock while polling
  std::atomic<uint32_t> outstanding_{0};   // handed over and not yet finished (at most kMax)
  std::atomic<bool> stopping_{false};      // written under mu_
  std::atomic<bool> polling_{false};       // held by the one thread polling `flight_`
  std::atomic<uint64_t> helped_ns_{0};     // when a waiting thread last polled (core::mono_ns)
  Pending flight_[kMax];                   // copies in flight: only the holder of polling_ touches them
  uint32_t flying_ = 0;
  bool sleeping_ = false;
  std::thread thread_;  // started by the first push
};

}  // namespace tether::transport::ipc
