#include "transport/ipc/ring.h"

#include <cstring>

namespace tether::transport::ipc {

namespace {
// A record: its length (4 bytes), 4 spare, the message, padded to 8. kWrap: the rest up to the
// ring's end is unused, the next record starts at offset 0.
constexpr uint32_t kWrap = 0xFFFFFFFFu;
constexpr uint64_t kMask = kRingData - 1;
uint64_t record_bytes(uint64_t len) { return 8 + ((len + 7) & ~uint64_t(7)); }
}  // namespace

RingWriter::RingWriter(uint8_t* mem) : ctl_(reinterpret_cast<RingControl*>(mem)), data_(mem + 4096) {}

bool RingWriter::push(const void* msg, size_t len, bool* doorbell) {
  *doorbell = false;
  if (len == 0 || len > kMaxRecord) return false;
  const uint64_t need = record_bytes(len);
  {
    std::lock_guard lock(mu_);
    const uint64_t used = head_ - ctl_->tail.load(std::memory_order_acquire);
    if (used > kRingData) return false;  // the receiver wrote an index it cannot have: the socket still works
    uint64_t pos = head_ & kMask;
    const uint64_t to_end = kRingData - pos;  // a multiple of 8: records are
    if (kRingData - used < (need <= to_end ? need : to_end + need)) return false;
    if (need > to_end) {
      std::memcpy(data_ + pos, &kWrap, 4);
      head_ += to_end;
      pos = 0;
    }
    const uint32_t n = uint32_t(len);
    std::memcpy(data_ + pos, &n, 4);
    std::memcpy(data_ + pos + 8, msg, len);
    head_ += need;
    ctl_->head.store(head_, std::memory_order_release);
  }
  // Pairs with the fence in sleep_begin(): either the receiver sees our head before it blocks, or we
  // see it asleep. Only one sender rings for each sleep.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  *doorbell = ctl_->sleeping.load(std::memory_order_relaxed) != 0 && ctl_->sleeping.exchange(0) != 0;
  return true;
}

RingReader::RingReader(uint8_t* mem) : ctl_(reinterpret_cast<RingControl*>(mem)), data_(mem + 4096) {}

ssize_t RingReader::pop(uint8_t* dst, size_t cap) {
  uint64_t avail = ctl_->head.load(std::memory_order_acquire) - tail_;
  if (avail == 0) return 0;
  if (avail > kRingData || avail % 8 != 0) return -1;
  uint64_t pos = tail_ & kMask;
  uint32_t len;
  std::memcpy(&len, data_ + pos, 4);
  uint64_t skip = 0;
  if (len == kWrap) {
    skip = kRingData - pos;
    if (skip >= avail) return -1;  // a wrap is always published with the record after it
    avail -= skip;
    pos = 0;
    std::memcpy(&len, data_, 4);
  }
  if (len == 0 || len > kMaxRecord || len > cap) return -1;
  const uint64_t need = record_bytes(len);
  if (need > avail || pos + need > kRingData) return -1;
  // The sender could change these bytes while we copy: the copy is validated as any socket message is.
  std::memcpy(dst, data_ + pos + 8, len);
  tail_ += skip + need;
  ctl_->tail.store(tail_, std::memory_order_release);
  return ssize_t(len);
}

void RingReader::sleep_begin() {
  ctl_->sleeping.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

void RingReader::sleep_end() { ctl_->sleeping.store(0, std::memory_order_relaxed); }

}  // namespace tether::transport::ipc
