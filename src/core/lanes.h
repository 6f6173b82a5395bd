// Where a peer's lanes run (local NIC, remote address) and what they carried. Counters are relaxed
// atomics bumped by the lane's thread once per frame; NIC counters live in the endpoint (they outlive
// peers), lane counters in the peer (they outlive a dead lane, so stats show what it did).
#pragma once
#include <atomic>
#include <ctime>
#include <cstdint>
#include <string>

namespace tether::core {

struct LinkCounters {
  std::atomic<uint64_t> bytes_sent{0}, bytes_received{0}, chunks_sent{0}, chunks_received{0};
  std::atomic<uint64_t> errors{0};   // lanes lost (socket error, timeout, peer closed it)
  std::atomic<uint64_t> resends{0};  // chunks in flight on a lost lane, moved to a surviving one
  std::atomic<uint64_t> send_ns{0}, recv_ns{0}, staging_ns{0};  // tcp lanes: tether::LinkStats::send_s, ...
  std::atomic<uint64_t> staging_slots_peak{0};
};

inline uint64_t mono_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return uint64_t(t.tv_sec) * 1000000000u + uint64_t(t.tv_nsec);
}

struct LanePath {
  int nic = -1;                  // index into the endpoint's data NICs; -1: not on one (loopback)
  std::string local_nic, local_addr, remote_nic, remote_addr;
  LinkCounters* nic_counters = nullptr;  // endpoint-owned; never null once attached
};

// Both a lane's and its NIC's counters, one call per finished frame.
inline void count_sent(LinkCounters* lane, LinkCounters* nic, uint64_t bytes) {
  for (LinkCounters* c : {lane, nic}) {
    c->bytes_sent.fetch_add(bytes, std::memory_order_relaxed);
    c->chunks_sent.fetch_add(1, std::memory_order_relaxed);
  }
}
inline void count_time(std::atomic<uint64_t> LinkCounters::*what, LinkCounters* lane, LinkCounters* nic, uint64_t ns) {
  (lane->*what).fetch_add(ns, std::memory_order_relaxed);
  (nic->*what).fetch_add(ns, std::memory_order_relaxed);
}
// Raises `what` to `value` on the lane and its NIC where it is lower (written by the lane's thread,
// read by stats(); only called when the lane's own peak grew, so off the steady path).
inline void count_peak(std::atomic<uint64_t> LinkCounters::*what, LinkCounters* lane, LinkCounters* nic, uint64_t value) {
  for (LinkCounters* c : {lane, nic}) {
    uint64_t seen = (c->*what).load(std::memory_order_relaxed);
    while (seen < value && !(c->*what).compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
    }
  }
}
inline void count_received(LinkCounters* lane, LinkCounters* nic, uint64_t bytes) {
  for (LinkCounters* c : {lane, nic}) {
    c->bytes_received.fetch_add(bytes, std::memory_order_relaxed);
    c->chunks_received.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace tether::core
