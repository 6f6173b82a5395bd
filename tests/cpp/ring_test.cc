// The ipc message ring (src/transport/ipc/ring.h): two mappings of one memfd, as the two processes
// have them; random messages checked byte for byte; a receiver that sleeps and is woken by doorbells;
// and what a hostile other side can write into the shared indexes and records.
#include "transport/ipc/ring.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace tether::transport::ipc {
namespace {

// One ring's memory mapped twice: `a` for the sender, `b` for the receiver.
struct Shared {
  int fd = -1;
  uint8_t* a = nullptr;
  uint8_t* b = nullptr;
  Shared() {
    fd = ::memfd_create("ring-test", MFD_CLOEXEC);
    EXPECT_EQ(::ftruncate(fd, kRingBytes), 0);
    a = static_cast<uint8_t*>(::mmap(nullptr, kRingBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    b = static_cast<uint8_t*>(::mmap(nullptr, kRingBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  }
  ~Shared() {
    ::munmap(a, kRingBytes);
    ::munmap(b, kRingBytes);
    ::close(fd);
  }
  RingControl& ctl() { return *reinterpret_cast<RingControl*>(b); }
  uint8_t* data() { return b + 4096; }
};

std::vector<uint8_t> random_bytes(std::mt19937_64& rng, size_t n) {
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = uint8_t(rng());
  return v;
}

TEST(Ring, CarriesRandomMessagesInOrderAcrossManyWraps) {
  Shared s;
  RingWriter w(s.a);
  RingReader r(s.b);
  std::mt19937_64 rng(7);
  std::vector<uint8_t> got(kMaxRecord, 0xEE);
  uint64_t moved = 0;
  for (int round = 0; round < 2000; ++round) {
    std::vector<std::vector<uint8_t>> sent;
    for (int k = int(rng() % 6) + 1; k > 0; --k) {
      const size_t len = rng() % 4 == 0 ? 1 + rng() % kMaxRecord : 1 + rng() % 300;
      auto m = random_bytes(rng, len);
      bool bell = true;
      if (!w.push(m.data(), m.size(), &bell)) break;  // full: take what is there first
      EXPECT_FALSE(bell);                             // nobody sleeps
      sent.push_back(std::move(m));
    }
    for (auto& m : sent) {
      std::memset(got.data(), 0xEE, got.size());
      ASSERT_EQ(r.pop(got.data(), got.size()), ssize_t(m.size()));
      ASSERT_EQ(std::memcmp(got.data(), m.data(), m.size()), 0);
      moved += m.size();
    }
    ASSERT_EQ(r.pop(got.data(), got.size()), 0);
  }
  EXPECT_GT(moved, 20 * kRingData);  // the ring wrapped many times
}

TEST(Ring, RefusesWhatDoesNotFitAndTakesItOnceThereIsRoom) {
  Shared s;
  RingWriter w(s.a);
  RingReader r(s.b);
  std::vector<uint8_t> m(kMaxRecord, 1), got(kMaxRecord + 64);
  bool bell;
  EXPECT_FALSE(w.push(m.data(), 0, &bell));
  std::vector<uint8_t> big(kMaxRecord + 1, 2);
  EXPECT_FALSE(w.push(big.data(), big.size(), &bell));  // goes over the socket instead
  int n = 0;
  while (w.push(m.data(), m.size(), &bell)) ++n;
  EXPECT_EQ(uint64_t(n), kRingData / (kMaxRecord + 8));
  EXPECT_EQ(r.pop(got.data(), got.size()), ssize_t(kMaxRecord));
  EXPECT_TRUE(w.push(m.data(), m.size(), &bell));
  for (int i = 0; i < n; ++i) EXPECT_EQ(r.pop(got.data(), got.size()), ssize_t(kMaxRecord));
  EXPECT_EQ(r.pop(got.data(), got.size()), 0);
}

// The sender asks for a doorbell only while the receiver sleeps, once per sleep.
TEST(Ring, DoorbellOnlyForASleepingReceiverAndOncePerSleep) {
  Shared s;
  RingWriter w(s.a);
  RingReader r(s.b);
  uint8_t m[16] = {}, got[64];
  bool bell = true;
  ASSERT_TRUE(w.push(m, sizeof m, &bell));
  EXPECT_FALSE(bell);
  r.sleep_begin();
  ASSERT_TRUE(w.push(m, sizeof m, &bell));
  EXPECT_TRUE(bell);
  ASSERT_TRUE(w.push(m, sizeof m, &bell));
  EXPECT_FALSE(bell);
  r.sleep_end();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(r.pop(got, sizeof got), 16);
}

// A receiver thread that sleeps in recv() between bursts, a sender ringing doorbells over a
// socketpair: every message arrives, in order, and nobody waits forever (a lost wake-up would hang
// this test until its deadline).
TEST(Ring, SleepingReceiverNeverMissesAMessage) {
  Shared s;
  RingWriter w(s.a);
  RingReader r(s.b);
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
  constexpr uint32_t kCount = 200000;
  std::thread sender([&] {
    std::mt19937_64 rng(3);
    for (uint32_t i = 0; i < kCount; ++i) {
      uint8_t m[64];
      std::memset(m, int(i & 0xFF), sizeof m);
      std::memcpy(m, &i, sizeof i);
      bool bell = false;
      while (!w.push(m, 8 + rng() % 56, &bell)) std::this_thread::yield();
      if (bell) {
        const char b = 0;
        ASSERT_EQ(::send(sv[0], &b, 1, MSG_NOSIGNAL), 1);
      }
      if (rng() % 1000 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));  // the receiver sleeps
    }
  });
  uint8_t got[kMaxRecord];
  uint32_t next = 0, sleeps = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (next < kCount && std::chrono::steady_clock::now() < deadline) {
    ssize_t n = r.pop(got, sizeof got);
    if (n == 0) {
      r.sleep_begin();
      n = r.pop(got, sizeof got);
      if (n == 0) {
        char b;
        pollfd p{sv[1], POLLIN, 0};
        if (::poll(&p, 1, 5000) == 1) ASSERT_EQ(::recv(sv[1], &b, 1, 0), 1);
        ++sleeps;
      }
      r.sleep_end();
      if (n == 0) continue;
    }
    ASSERT_GE(n, 8);
    uint32_t i;
    std::memcpy(&i, got, sizeof i);
    ASSERT_EQ(i, next);
    for (ssize_t k = 4; k < n; ++k) ASSERT_EQ(got[k], uint8_t(i & 0xFF));
    ++next;
  }
  sender.join();
  EXPECT_EQ(next, kCount);
  EXPECT_GT(sleeps, 0u);
  ::close(sv[0]);
  ::close(sv[1]);
}

// What the other process may write into the shared parts: the receiver reports a broken ring (the
// lane then fails the peer), the sender falls back to the socket; neither reads or writes outside.
TEST(Ring, HostileIndexesAndLengthsAreRefused) {
  std::vector<uint8_t> got(kMaxRecord);
  uint8_t m[32] = {};
  bool bell;
  {  // head far ahead of anything written
    Shared s;
    RingReader r(s.b);
    s.ctl().head.store(kRingData + 8);
    EXPECT_EQ(r.pop(got.data(), got.size()), -1);
  }
  {  // head not on a record boundary
    Shared s;
    RingReader r(s.b);
    s.ctl().head.store(13);
    EXPECT_EQ(r.pop(got.data(), got.size()), -1);
  }
  for (uint32_t len : {0u, kMaxRecord + 1, 0x7FFFFFFFu}) {  // record lengths that cannot be
    Shared s;
    RingWriter w(s.a);
    RingReader r(s.b);
    ASSERT_TRUE(w.push(m, sizeof m, &bell));
    std::memcpy(s.data(), &len, 4);
    EXPECT_EQ(r.pop(got.data(), got.size()), -1) << len;
  }
  {  // a length longer than what the head says was written
    Shared s;
    RingWriter w(s.a);
    RingReader r(s.b);
    ASSERT_TRUE(w.push(m, sizeof m, &bell));
    const uint32_t len = 4096;
    std::memcpy(s.data(), &len, 4);
    EXPECT_EQ(r.pop(got.data(), got.size()), -1);
  }
  {  // a wrap marker with nothing after it
    Shared s;
    RingWriter w(s.a);
    RingReader r(s.b);
    ASSERT_TRUE(w.push(m, sizeof m, &bell));
    const uint32_t wrap = 0xFFFFFFFFu;
    std::memcpy(s.data(), &wrap, 4);
    EXPECT_EQ(r.pop(got.data(), got.size()), -1);
  }
  {  // a message larger than the receiver's buffer
    Shared s;
    RingWriter w(s.a);
    RingReader r(s.b);
    ASSERT_TRUE(w.push(m, sizeof m, &bell));
    EXPECT_EQ(r.pop(got.data(), 16), -1);
  }
  for (uint64_t tail : {uint64_t(1) << 40, uint64_t(5)}) {  // the receiver's index, impossible
    Shared s;
    RingWriter w(s.a);
    s.ctl().tail.store(tail);
    EXPECT_FALSE(w.push(m, sizeof m, &bell));
  }
}

}  // namespace
}  // namespace tether::transport::ipc
