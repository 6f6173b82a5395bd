// The ipc GpuCompleter (src/transport/ipc/one_sided.h) without a GPU: each copy handed over is a flag
// the test raises when it wants the copy to have ended. Every copy handed over is finished exactly
// once, whichever thread polls it: the completer's own, or a waiter's finish_here() that took it and
// then went to sleep.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "transport/ipc/one_sided.h"

namespace tether::transport::ipc {
namespace {

using Clock = std::chrono::steady_clock;

struct FakeCopy {
  std::atomic<bool> ended{false};
  std::atomic<bool> fail{false};
  std::atomic<int> finished{0};
  std::atomic<bool> ok{false};
};

GpuCompleter::Pending pending(const std::shared_ptr<FakeCopy>& c) {
  GpuCompleter::Pending p;
  p.peer = c;
  p.done = [](GpuCompleter::Pending& q) -> Result<bool> {
    auto& f = *static_cast<FakeCopy*>(q.peer.get());
    if (f.fail.load()) return Status(Code::kInternal, "copy failed");
    return f.ended.load();
  };
  p.finish = [](GpuCompleter::Pending& q, bool ok) {
    auto& f = *static_cast<FakeCopy*>(q.peer.get());
    f.ok.store(ok);
    f.finished.fetch_add(1);
  };
  return p;
}

// Whether `c` was finished within `ms` milliseconds.
bool finished_within(const FakeCopy& c, int ms) {
  const auto end = Clock::now() + std::chrono::milliseconds(ms);
  while (c.finished.load() == 0 && Clock::now() < end) std::this_thread::sleep_for(std::chrono::microseconds(200));
  return c.finished.load() == 1;
}

// A waiter's finish_here() takes a copy pushed while the completer slept, before the completer wakes,
// and stops polling while the copy still runs (it went to sleep on its transfer): the completer must
// poll it to the end: a completer that sleeps while nothing is queued leaves it unpolled, and its
// transfer hangs.
TEST(GpuCompleter, FinishesACopyAWaiterTookAndLeft) {
  GpuCompleter completer(0);  // sleeps as soon as nothing is outstanding
  for (int round = 0; round < 200; ++round) {
    auto copy = std::make_shared<FakeCopy>();
    std::this_thread::sleep_for(std::chrono::microseconds(300));  // the completer is asleep by now
    ASSERT_TRUE(completer.push(pending(copy)));
    completer.finish_here();  // usually before the completer's thread has woken
    copy->ended.store(true);
    ASSERT_TRUE(finished_within(*copy, 5000)) << "round " << round << ": a copy handed over was never finished";
    EXPECT_TRUE(copy->ok.load());
  }
}

// Copies pushed from several threads end in a random order, some with an error; waiters poll now and
// then. Each is finished once, with its own outcome; stop() finishes what is still outstanding.
TEST(GpuCompleter, FinishesEveryCopyOnceWithItsOutcome) {
  constexpr int kThreads = 4, kEach = 200;
  std::vector<std::shared_ptr<FakeCopy>> copies(kThreads * kEach);
  for (auto& c : copies) c = std::make_shared<FakeCopy>();
  {
    GpuCompleter completer(20);
    std::vector<std::thread> posters;
    for (int t = 0; t < kThreads; ++t) {
      posters.emplace_back([&, t] {
        std::mt19937 rng(t);
        for (int i = 0; i < kEach; ++i) {
          auto& c = copies[t * kEach + i];
          c->fail.store(rng() % 7 == 0);
          while (!completer.push(pending(c))) std::this_thread::yield();  // full: kMax in flight
          if (rng() % 3 == 0) completer.finish_here();
          if (i >= 8) copies[t * kEach + i - 8 + rng() % 4]->ended.store(true);
        }
      });
    }
    for (auto& p : posters) p.join();
    std::mt19937 rng(99);
    std::vector<size_t> order(copies.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t i : order) copies[i]->ended.store(true);
  }  // ~GpuCompleter: stop() waits for every copy
  for (const auto& c : copies) {
    ASSERT_EQ(c->finished.load(), 1);
    EXPECT_EQ(c->ok.load(), !c->fail.load());
  }
}

}  // namespace
}  // namespace tether::transport::ipc
