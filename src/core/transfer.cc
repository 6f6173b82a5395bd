#include "core/transfer.h"

#include <algorithm>
#include <chrono>
#include <ctime>

#include <sys/prctl.h>

#include "core/peer.h"
#include "core/trace.h"
#include "sys/cpu.h"

namespace tether::core {

const char* op_name(OpKind op) {
  switch (op) {
    case OpKind::kWrite: return "write";
    case OpKind::kRead: return "read";
    case OpKind::kSend: return "send";
    case OpKind::kRecv: return "recv";
    case OpKind::kNotify: return "notify";
  }
  return "?";
}

bool TransferState::record_error(const Status& s) {
  uint8_t expected = 0;
  if (!first_error.compare_exchange_strong(expected, static_cast<uint8_t>(s.code()))) return false;
  std::lock_guard lock(mu_);
  error_ = s;
  return true;
}

Status TransferState::error() const {
  if (first_error.load(std::memory_order_acquire) == 0) return Status::ok();
  std::lock_guard lock(mu_);
  return error_;
}

void TransferState::release(int64_t n) {
  if (pending.fetch_sub(n, std::memory_order_acq_rel) != n) return;
  if (peer) {
    peer->transfer_drained(this);
  } else {
    finish(error());
  }
}

void TransferState::finish(Status s) {
  if (finishing_.exchange(true, std::memory_order_acq_rel)) return;
  for (auto& r : local_pins) r->unpin();
  local_pins.clear();
  {
    std::lock_guard lock(mu_);
    final_ = std::move(s);
  }
  std::shared_ptr<TransferState> keep = std::move(self);  // may be the last engine reference
  if (peer && !pushed) peer->count_finished(final_.is_ok());  // before waiters wake: stats never lag wait()
  finished_.store(true, std::memory_order_seq_cst);
  if (waiters_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard lock(mu_);
    cv_.notify_all();
  }
}

Status TransferState::final_status() const {
  std::lock_guard lock(mu_);
  return final_;
}

namespace {
// Threads of this process spinning in wait(): one at most, so spinners never starve the progress threads.
std::atomic<int> g_spinners{0};
constexpr uint64_t kSpinMaxBytes = 256 << 10;  // larger transfers take long enough to sleep
// Reads this large nap, other transfers this large sleep at once: a late wake-up costs little beside them.
constexpr uint64_t kNapMinBytes = 4 << 20;
// A small transfer's waiter spins this long even with busy polling off: a one-chunk round trip on one
// host ends within it, and sleeping would add a cross-CPU wake-up to every small transfer.
constexpr uint32_t kSpinUs = 50;
constexpr uint32_t kWaitNapUs = 20;  // short beside a large read, long enough to leave the core to the lanes
}  // namespace

// A large read's waiter sleeps in timed naps: a timer wakes it on its own CPU (a lane's notify would
// need a slow cross-CPU wake-up), and, unlike a spinner, it leaves its core to the lanes' threads that
// land the read (docs/PERFORMANCE.md, "Defaults and why").
void TransferState::nap_until_done(std::chrono::steady_clock::time_point end, uint32_t nap_us) const {
  const int slack = ::prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
  ::prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // 1 us: the default 50 us would stretch every nap
  const timespec ts{time_t(nap_us / 1000000), long(nap_us % 1000000) * 1000};
  while (!is_finished() && std::chrono::steady_clock::now() < end) ::nanosleep(&ts, nullptr);
  if (slack > 0) ::prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(slack), 0, 0, 0);
}

Status TransferState::wait(int64_t timeout_ms) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const uint64_t n = bytes.load(std::memory_order_relaxed);
  uint32_t spin_us = peer ? kSpinUs : 0;
  const uint32_t busy_us = peer ? peer->busy_poll_us() : 0;
  // Naps only where the transport wants them (Caps::wait_naps); without busy_us it sleeps at once anyway.
  const bool large = peer && peer->wait_naps() && busy_us && n >= kNapMinBytes;
  if (large && op == OpKind::kRead) {
    nap_until_done(timeout_ms < 0 ? Clock::time_point::max() : start + std::chrono::milliseconds(timeout_ms), kWaitNapUs);
    spin_us = 0;  // done, or its time is up: what follows only collects the result
  } else if (large) {
    spin_us = 0;  // writes, sends: asleep on the condition variable at once
  } else {
    spin_us = n <= kSpinMaxBytes ? std::max(spin_us, busy_us) : busy_us;
  }
  if (!is_finished() && spin_us > 0) {
    if (g_spinners.fetch_add(1, std::memory_order_relaxed) == 0) {
      const auto spin_end = start + std::chrono::microseconds(spin_us);
      while (!is_finished() && Clock::now() < spin_end) {
        // Read the answer ourselves from the lane that carried our last chunk: no thread wake-up.
        const uint32_t lane = lane_hint.load(std::memory_order_relaxed);
        if (peer) peer->finish_here();  // one-sided GPU copies (Transport::finish_here)
        if (peer && lane != UINT32_MAX) {
          peer->progress_lane(lane);
        } else {
          sys::cpu_relax();
        }
      }
    }
    g_spinners.fetch_sub(1, std::memory_order_relaxed);
  }
  if (!is_finished()) {
    std::unique_lock lock(mu_);
    waiters_.fetch_add(1, std::memory_order_seq_cst);
    auto pred = [&] { return finished_.load(std::memory_order_seq_cst); };
    if (timeout_ms < 0) {
      cv_.wait(lock, pred);
    } else {
      cv_.wait_until(lock, start + std::chrono::milliseconds(timeout_ms), pred);
    }
    waiters_.fetch_sub(1);
    if (!finished_.load()) return Status(Code::kTimeout, "transfer still running after " + std::to_string(timeout_ms) + " ms");
    trace::mark(trace::Event::kWaited, 0);
    return final_;
  }
  trace::mark(trace::Event::kWaited, 0);
  return final_status();
}

}  // namespace tether::core
