// Which slots of a staging ring are taken, in runs of adjacent slots: a write batch of two chunks stages
// through two neighbours as one buffer. A run never wraps past the last slot (its buffer must be one
// piece of the ring's block), and the search starts after the last run taken, so single slots are used
// round-robin as before. No CUDA here: tests/cpp/slot_runs_test.cc checks it on any machine.
#pragma once
#include <cstdint>
#include <vector>

namespace tether::gpu {

class SlotRuns {
 public:
  explicit SlotRuns(uint32_t slots) : run_(slots, 0), busy_(slots, 0) {}

  uint32_t size() const { return uint32_t(run_.size()); }
  bool busy(uint32_t i) const { return busy_[i] != 0; }

  // The first of `span` adjacent free slots from the cursor on, or -1 (also for span 0 or > size()).
  int find(uint32_t span) const {
    const uint32_t n = size();
    if (span == 0 || span > n) return -1;
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t first = (next_ + i) % n;
      if (first + span > n) continue;
      bool free = true;
      for (uint32_t k = first; k < first + span && free; ++k) free = !busy(k);
      if (free) return int(first);
    }
    return -1;
  }

  // Takes the run find() returned; the next search starts after it.
  void take(uint32_t first, uint32_t span) {
    run_[first] = span;
    for (uint32_t k = first; k < first + span; ++k) busy_[k] = 1;
    next_ = (first + span) % size();
  }

  // Frees the run that starts at `first` (a slot that starts none: nothing happens).
  void give(uint32_t first) {
    if (first >= size()) return;
    for (uint32_t k = first; k < first + run_[first]; ++k) busy_[k] = 0;
    run_[first] = 0;
  }

 private:
  std::vector<uint32_t> run_;  // at a run's first slot, its length; 0 elsewhere
  std::vector<uint8_t> busy_;  // slot i is in a run
  uint32_t next_ = 0;
};

}  // namespace tether::gpu
