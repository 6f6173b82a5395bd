// Which slots of a staging ring are taken, in runs of adjacent slots: a write batch of two chunks stages
// through two neighbours as one buffer. A run never wraps past the last slot (its buffer must be one
// piece of the ring's block). The lowest free run is taken, so a lane keeps reusing its few lowest slots
// while their lines are still cached, where cycling through the whole ring (8 MiB per lane and
// direction) touched cold memory (docs/PERFORMANCE.md, "Defaults and why"). No CUDA here: tests/cpp/slot_runs_test.cc checks it.
#pragma once
#include <cstdint>
#include <vector>

namespace tether::gpu {

class SlotRuns {
 public:
  explicit SlotRuns(uint32_t slots) : run_(slots, 0), busy_(slots, 0) {}

  uint32_t size() const { return uint32_t(run_.size()); }
  bool busy(uint32_t i) const { return busy_[i] != 0; }
  uint32_t taken() const { return taken_; }  // slots in runs now
  uint32_t peak() const { return peak_; }    // the most slots ever in runs at once (pinned memory a lane used)

  // The lowest first slot of `span` adjacent free slots, or -1 (also for span 0 or > size()).
  int find(uint32_t span) const {
    const uint32_t n = size();
    if (span == 0 || span > n) return -1;
    for (uint32_t first = 0; first + span <= n; ++first) {
      bool free = true;
      for (uint32_t k = first; k < first + span && free; ++k) free = !busy(k);
      if (free) return int(first);
    }
    return -1;
  }

  // Takes the run find() returned.
  void take(uint32_t first, uint32_t span) {
    run_[first] = span;
    for (uint32_t k = first; k < first + span; ++k) busy_[k] = 1;
    taken_ += span;
    if (taken_ > peak_) peak_ = taken_;
  }

  // Frees the run that starts at `first` (a slot that starts none: nothing happens).
  void give(uint32_t first) {
    if (first >= size()) return;
    for (uint32_t k = first; k < first + run_[first]; ++k) busy_[k] = 0;
    taken_ -= run_[first];
    run_[first] = 0;
  }

 private:
  std::vector<uint32_t> run_;  // at a run's first slot, its length; 0 elsewhere
  std::vector<uint8_t> busy_;  // slot i is in a run
  uint32_t taken_ = 0, peak_ = 0;
};

}  // namespace tether::gpu
