// A lane's small messages in shared memory, one direction. The sender writes records into a ring in
// its own bounce area; the receiver, which maps that area, copies them out. A polling receiver
// costs the sender no system call; one asleep in recv() on the lane socket is woken by a one-byte
// message there (a doorbell). Messages too large for a record, or that find the ring full, go over
// the socket: the protocol needs no order between two messages of a lane.
//
// Each side keeps its own index privately and reads the other's from shared memory only to bound
// its own: what the other process wrote there is checked before it is used, never trusted.
#pragma once
#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>

namespace tether::transport::ipc {

constexpr uint64_t kRingData = 1 << 18;                 // record bytes per ring (a power of two)
constexpr uint64_t kRingBytes = kRingData + 4096;       // with its control page
constexpr uint32_t kMaxRecord = 32 << 10;               // larger messages go over the socket

// The control page at a ring's start.
struct RingControl {
  alignas(64) std::atomic<uint64_t> head;      // sender: bytes written
  alignas(64) std::atomic<uint64_t> tail;      // receiver: bytes taken
  alignas(64) std::atomic<uint32_t> sleeping;  // receiver: 1 while it sleeps in recv() (wants a doorbell)
  alignas(64) std::atomic<uint32_t> closed;    // sender: 1 once its lane ended and let go of what it
                                               // held for the receiver's reads (never back to 0)
};
static_assert(sizeof(RingControl) <= 4096);

// The sending side, over its own memory. Any thread may push.
class RingWriter {
 public:
  explicit RingWriter(uint8_t* mem);
  // Copies the message in; false when it is too large, the ring has no room now, or the receiver's
  // index is impossible (the caller sends over the socket instead). *doorbell: the receiver sleeps
  // and must be woken.
  bool push(const void* msg, size_t len, bool* doorbell);
  // Before the lane lets go of regions pinned for the other side's reads: a read copied out of them
  // from now on must fail (RingReader::closed), as the memory may already be reused.
  void close() { ctl_->closed.store(1, std::memory_order_seq_cst); }

 private:
  RingControl* ctl_;
  uint8_t* data_;
  std::mutex mu_;     // held for the copy only
  uint64_t head_ = 0;  // ours: never read back from shared memory
};

// The receiving side, over the other process's memory.
class RingReader {
 public:
  explicit RingReader(uint8_t* mem);
  // The next message copied into dst (up to cap bytes): its length, 0 when there is none, or -1
  // when the sender broke the ring's rules (an index or length that cannot be).
  ssize_t pop(uint8_t* dst, size_t cap);
  // Around a blocking recv(): after sleep_begin() the sender rings a doorbell for its next message;
  // the caller must pop() once more before it blocks (a message may have come just before).
  void sleep_begin();
  void sleep_end();
  // The sender's lane ended (RingWriter::close): checked after copying a read out of its memory.
  bool closed() const { return ctl_->closed.load(std::memory_order_seq_cst) != 0; }

 private:
  RingControl* ctl_;
  const uint8_t* data_;
  uint64_t tail_ = 0;  // ours
};

}  // namespace tether::transport::ipc
