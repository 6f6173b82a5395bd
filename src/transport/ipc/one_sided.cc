#include "transport/ipc/one_sided.h"

#include <sched.h>
#include <sys/syscall.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <thread>

#include "core/lanes.h"
#include "sys/cpu.h"
#include "sys/proc.h"
#include "sys/thread_name.h"

namespace tether::transport::ipc {

namespace {

int64_t steady_ms() {
  using namespace std::chrono;
  return duration_cast<milliseconds>(steady_clock::now().time_since_epoch()).count();
}

// The process has exited (or been reaped): none of its threads can copy any more. A zombie counts.
bool process_exited(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  const char state = sys::process_state(pid);
  return state == 0 || state == 'Z' || state == 'X';
}

// Whether a hazard of the peer may still copy into `region` (0: into anything). A host read's hazard
// never writes to us. With `pid` (a slow wait), a holder the kernel shows stopped on its way out of
// process_vm_writev has landed its bytes (a stopped thread is never inside a copy) and is passed over.
bool holds(const OneSidedPage& theirs, uint32_t region, pid_t pid = 0) {
  for (const auto& h : theirs.hazard) {
    const uint64_t r = h.region.load(std::memory_order_seq_cst);
    if (r == 0 || (r & kReadHazard) || (region != 0 && r != region)) continue;
    if (pid > 0) {
      const pid_t tid = h.tid.load(std::memory_order_seq_cst);
      if (sys::stopped_in_syscall(pid, tid, SYS_process_vm_writev) && h.region.load(std::memory_order_seq_cst) == r &&
          h.tid.load(std::memory_order_seq_cst) == tid)
        continue;
    }
    return true;
  }
  return false;
}

uint32_t cache_slot(uint32_t region, uint64_t key) { return uint32_t((region * 0x9E3779B1u) ^ (key >> 7)) % kGrantCache; }

}  // namespace

bool mark_live(OneSidedPage& ours, uint32_t region) {
  uint64_t expect = 0;
  auto& slot = ours.live[region % kLiveSlots];
  return slot.compare_exchange_strong(expect, region, std::memory_order_seq_cst) || expect == region;
}

bool revoke(OneSidedPage& ours, const OneSidedPage& theirs, uint32_t region, pid_t pid, uint32_t slow_ms,
            void (*on_slow)(void*), void* arg) {
  const int64_t slow_at = steady_ms() + slow_ms;
  if (region == 0) {
    ours.closed.store(1, std::memory_order_seq_cst);
  } else {
    uint64_t expect = region;
    ours.live[region % kLiveSlots].compare_exchange_strong(expect, 0, std::memory_order_seq_cst);
  }
  // A hazard is held for one copy that cannot wait on a fault of the initiator's memory; only a
  // thread stopped between its claim and its system call holds it longer, and it copies once it runs
  // again: we wait for it or for its process to end, never against a clock (one_sided.h).
  bool slow = false;
  for (uint32_t turn = 0; holds(theirs, region, turn >= 64 && turn % 16 == 0 ? pid : 0); ++turn) {
    if (turn < 64) {
      sched_yield();
      continue;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(turn < 2048 ? 50 : 1000));
    if (pid > 0 && turn % 16 == 0 && process_exited(pid)) return true;
    if (!slow && steady_ms() >= slow_at) {
      slow = true;
      if (on_slow) on_slow(arg);
      if (pid <= 0) return false;  // cannot tell whether it still lives: give up, as before
    }
  }
  return true;
}

bool OneSidedInitiator::find(uint32_t region, uint64_t key, uint64_t desc_offset, uint64_t desc_length,
                             Grant* out) const {
  std::lock_guard lock(mu_);
  const Grant& g = cache_[cache_slot(region, key)];
  if (g.region == 0 || g.region != region || g.key != key || g.desc_offset != desc_offset || g.desc_length != desc_length)
    return false;
  *out = g;
  return true;
}

void OneSidedInitiator::remember(const Grant& g) {
  std::lock_guard lock(mu_);
  cache_[cache_slot(g.region, g.key)] = g;
}

void OneSidedInitiator::forget(uint32_t region) {
  std::lock_guard lock(mu_);
  for (auto& g : cache_)
    if (g.region == region) g.region = 0;
}

OneSidedInitiator::Context* OneSidedInitiator::enter(uint32_t region, bool read, bool* gone) {
  *gone = false;
  // Threads start their search at different contexts, so two rarely meet on one.
  static std::atomic<uint32_t> next{0};
  thread_local uint32_t start = next.fetch_add(1, std::memory_order_relaxed);
  Context* c = nullptr;
  for (uint32_t i = 0; i < kHazards && !c; ++i) {
    Context& k = ctx_[(start + i) % kHazards];
    if (!k.busy.exchange(true, std::memory_order_acquire)) c = &k;
  }
  if (!c) return nullptr;
  thread_local const pid_t tid = pid_t(::syscall(SYS_gettid));
  ours_->hazard[c->index].tid.store(tid, std::memory_order_relaxed);  // ordered by the store below
  ours_->hazard[c->index].region.store(region | (read ? kReadHazard : 0), std::memory_order_seq_cst);
  if (live(region)) return c;
  *gone = true;
  leave(c);
  return nullptr;
}

bool OneSidedInitiator::live(uint32_t region) const {
  return target_->closed.load(std::memory_order_seq_cst) == 0 &&
         target_->live[region % kLiveSlots].load(std::memory_order_seq_cst) == region;
}

void OneSidedInitiator::leave(Context* c) {
  ours_->hazard[c->index].region.store(0, std::memory_order_seq_cst);
  c->busy.store(false, std::memory_order_release);
}

bool GpuCompleter::push(Pending&& p) {
  bool wake = false;
  {
    std::lock_guard lock(mu_);
    if (stopping_.load(std::memory_order_relaxed) || outstanding_.load(std::memory_order_relaxed) >= kMax) return false;
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    outstanding_.fetch_add(1, std::memory_order_relaxed);
    queue_[queued_++] = std::move(p);
    queued_hint_.store(queued_, std::memory_order_release);
    wake = sleeping_;
  }
  if (wake) cv_.notify_one();
  return true;
}

void GpuCompleter::stop() {
  {
    std::lock_guard lock(mu_);
    if (stopping_.load(std::memory_order_relaxed)) return;
    stopping_.store(true, std::memory_order_release);
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void GpuCompleter::poll_once(bool own) {
  if (polling_.exchange(true, std::memory_order_acquire)) return;
  std::shared_ptr<void> pump_peer;  // a newly taken batch's peer: its queued chunks are taken below
  void (*take_queued)(void*) = nullptr;
  if (queued_hint_.load(std::memory_order_acquire) > 0) {
    std::lock_guard lock(mu_);
    for (uint32_t i = 0; i < queued_; ++i) {
      if (own && !take_queued && queue_[i].take_queued) {
        take_queued = queue_[i].take_queued;
        pump_peer = queue_[i].peer;
      }
      flight_[flying_++] = std::move(queue_[i]);
    }
    queued_ = 0;
    queued_hint_.store(0, std::memory_order_relaxed);
  }
  for (uint32_t i = 0; i < flying_;) {
    Pending& p = flight_[i];
    auto done = p.done(p);
    if (done.is_ok() && !done.value()) {
      ++i;
      continue;
    }
    p.finish(p, done.is_ok());
    if (i != flying_ - 1) p = std::move(flight_[flying_ - 1]);
    flight_[--flying_] = Pending{};
    outstanding_.fetch_sub(1, std::memory_order_release);
  }
  polling_.store(false, std::memory_order_release);
  if (take_queued) take_queued(pump_peer.get());  // others poll the copies meanwhile
}

namespace {
// The completer's thread leaves the copies to a waiting thread that polled this recently, and naps
// meanwhile: spinning beside it would take a core (or its hyperthread) from the thread doing the work.
constexpr uint64_t kHelperQuietNs = 20'000;
}  // namespace

void GpuCompleter::finish_here() {
  // Only a lone copy: with more in flight the completer's thread polls them all (a caller's loop over
  // eight handles polling eight events each turn lost on NIXL's 8-in-flight row: docs/PERFORMANCE.md,
  // "Tried and lost").
  if (outstanding_.load(std::memory_order_acquire) != 1) return;
  helped_ns_.store(core::mono_ns(), std::memory_order_relaxed);
  poll_once(false);
}

void GpuCompleter::run() {
  sys::name_this_thread("ipcdone");
  const uint64_t busy_ns = uint64_t(busy_us_) * 1000;
  uint64_t idle_since = core::mono_ns();
  for (;;) {
    const bool stopping = stopping_.load(std::memory_order_acquire);
    if (stopping && outstanding_.load(std::memory_order_acquire) == 0) return;
    const uint64_t now = core::mono_ns();
    if (!stopping && now - helped_ns_.load(std::memory_order_relaxed) < kHelperQuietNs) {
      std::this_thread::sleep_for(std::chrono::nanoseconds(kHelperQuietNs));
      idle_since = core::mono_ns();
      continue;
    }
    poll_once(true);
    if (outstanding_.load(std::memory_order_acquire) > 0) {
      idle_since = now;
    } else if (!stopping && now - idle_since >= busy_ns) {
      std::unique_lock lock(mu_);
      // Asleep only while nothing is outstanding: a waiter's finish_here() may have taken what was
      // pushed (queued_ back to 0) and then stopped polling it, and only this thread is left to.
      sleeping_ = true;
      cv_.wait(lock, [&] {
        return queued_ > 0 || outstanding_.load(std::memory_order_relaxed) > 0 || stopping_.load(std::memory_order_relaxed);
      });
      sleeping_ = false;
      idle_since = core::mono_ns();
      continue;
    }
    sys::cpu_relax();
  }
}

}  // namespace tether::transport::ipc
