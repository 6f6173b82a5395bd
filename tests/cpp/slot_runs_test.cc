// A staging ring's slot bookkeeping (src/gpu/slot_runs.h): the lowest free slot first, runs of adjacent
// slots that never wrap, a run freed whole; and random takes and gives against a plain model.
#include "gpu/slot_runs.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

namespace tether::gpu {
namespace {

TEST(SlotRuns, TheLowestFreeSlotFirst) {
  SlotRuns r(4);
  for (uint32_t i = 0; i < 4; ++i) {
    ASSERT_EQ(r.find(1), int(i));
    r.take(i, 1);
  }
  EXPECT_EQ(r.find(1), -1);
  r.give(2);
  EXPECT_FALSE(r.busy(2));
  EXPECT_EQ(r.find(1), 2);
  r.give(3);
  r.give(1);
  EXPECT_EQ(r.find(1), 1);  // freed last but lowest: a lane keeps reusing its lowest (cached) slots
  r.take(1, 1);
  EXPECT_EQ(r.find(1), 2);
  r.give(0);
  EXPECT_EQ(r.find(1), 0);
}

TEST(SlotRuns, ARunIsAdjacentInMemory) {
  SlotRuns r(8);
  for (uint32_t i = 0; i < 8; ++i) r.take(i, 1);
  r.give(7);
  r.give(0);
  EXPECT_EQ(r.find(1), 0);
  EXPECT_EQ(r.find(2), -1);  // 7 and 0 are free and neighbours on a ring, but not in memory
  r.give(1);
  EXPECT_EQ(r.find(2), 0);
  r.take(0, 2);
  EXPECT_TRUE(r.busy(0));
  EXPECT_TRUE(r.busy(1));
  EXPECT_FALSE(r.busy(7));
  EXPECT_EQ(r.find(1), 7);
}

TEST(SlotRuns, ARunSkipsABusySlotAndIsFreedWhole) {
  SlotRuns r(6);
  r.take(1, 1);
  r.take(3, 1);
  EXPECT_EQ(r.find(2), 4);  // 4-5; 0 alone, 2 alone
  r.take(4, 2);
  EXPECT_EQ(r.find(2), -1);
  EXPECT_EQ(r.find(1), 0);
  r.give(4);
  EXPECT_FALSE(r.busy(4));
  EXPECT_FALSE(r.busy(5));
  EXPECT_EQ(r.find(2), 4);
  r.give(1);
  EXPECT_EQ(r.find(2), 0);  // 0-1 now, below 4-5
}

TEST(SlotRuns, CountsTheSlotsTakenAndTheirPeak) {
  SlotRuns r(8);
  EXPECT_EQ(r.taken(), 0u);
  EXPECT_EQ(r.peak(), 0u);
  r.take(0, 1);
  r.take(1, 2);  // a two-slot run counts both
  EXPECT_EQ(r.taken(), 3u);
  EXPECT_EQ(r.peak(), 3u);
  r.give(1);
  EXPECT_EQ(r.taken(), 1u);
  EXPECT_EQ(r.peak(), 3u);  // the peak stays
  r.give(5);                // starts no run: nothing changes
  EXPECT_EQ(r.taken(), 1u);
  r.take(1, 1);
  EXPECT_EQ(r.peak(), 3u);
  r.take(2, 2);
  EXPECT_EQ(r.taken(), 4u);
  EXPECT_EQ(r.peak(), 4u);
}

TEST(SlotRuns, SpansItCannotHold) {
  SlotRuns r(4);
  EXPECT_EQ(r.find(0), -1);
  EXPECT_EQ(r.find(5), -1);
  EXPECT_EQ(r.find(4), 0);
  r.give(3);   // starts no run: nothing happens
  r.give(99);  // out of range: nothing happens
  r.take(0, 4);
  for (uint32_t i = 0; i < 4; ++i) EXPECT_TRUE(r.busy(i));
  r.give(1);  // inside a run, not its start: nothing happens
  EXPECT_TRUE(r.busy(1));
  r.give(0);
  for (uint32_t i = 0; i < 4; ++i) EXPECT_FALSE(r.busy(i));
}

TEST(SlotRuns, RandomTakesAndGivesNeverOverlap) {
  std::mt19937 rng(7);
  SlotRuns r(8);
  std::vector<int> owner(8, -1);  // the model: which run (by its first slot) holds each slot
  std::vector<uint32_t> runs;     // first slots of the runs held
  uint32_t peak = 0;              // the most slots the model held at once
  for (int step = 0; step < 20000; ++step) {
    if (!runs.empty() && rng() % 2) {
      const size_t j = rng() % runs.size();
      const uint32_t first = runs[j];
      r.give(first);
      for (int& o : owner)
        if (o == int(first)) o = -1;
      runs.erase(runs.begin() + long(j));
    } else {
      const uint32_t span = 1 + rng() % 3;
      const int first = r.find(span);
      // The model's lowest free run of `span` slots, or -1: the ring must give exactly that one.
      int lowest = -1;
      for (uint32_t f = 0; f + span <= 8 && lowest < 0; ++f) {
        bool free = true;
        for (uint32_t k = f; k < f + span; ++k) free = free && owner[k] < 0;
        if (free) lowest = int(f);
      }
      ASSERT_EQ(first, lowest) << "step " << step << " span " << span;
      if (first < 0) continue;
      ASSERT_LE(uint32_t(first) + span, 8u);
      for (uint32_t k = uint32_t(first); k < uint32_t(first) + span; ++k) {
        ASSERT_EQ(owner[k], -1) << "slot " << k << " handed out twice";
        owner[k] = first;
      }
      r.take(uint32_t(first), span);
      runs.push_back(uint32_t(first));
    }
    uint32_t held = 0;
    for (uint32_t k = 0; k < 8; ++k) {
      ASSERT_EQ(r.busy(k), owner[k] >= 0) << "step " << step << " slot " << k;
      held += owner[k] >= 0;
    }
    peak = std::max(peak, held);
    ASSERT_EQ(r.taken(), held) << "step " << step;
    ASSERT_EQ(r.peak(), peak) << "step " << step;
  }
}

}  // namespace
}  // namespace tether::gpu
