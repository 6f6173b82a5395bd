#include "core/trace.h"

#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "core/lanes.h"
#include "sys/env.h"

namespace tether::core::trace {
namespace {

struct Record {
  uint64_t ns;
  uint32_t slot, gen, lane;
  uint8_t event, type;
  int16_t cpu;  // where the thread ran (sched_getcpu, a vDSO read): shows threads sharing a core
};

constexpr uint64_t kCapacity = 1u << 21;  // events kept per process (48 MiB); later ones are counted, not kept

struct Buffer {
  std::string prefix;
  std::unique_ptr<Record[]> records;
  std::atomic<uint64_t> next{0};
  std::mutex flush_mu;
  FILE* file = nullptr;  // opened by the first flush; each flush appends what was recorded since
  uint64_t flushed = 0;  // records written to it so far
  Buffer() {
    prefix = sys::env_text("TETHER_TRACE");
    if (prefix.empty()) return;
    records = std::make_unique<Record[]>(kCapacity);
    g_on = true;
  }
};

const char* const kNames[] = {"post",     "wake",   "taken",  "staged",   "sent",  "header", "landed",
                               "unpacked", "answered", "waited", "called", "resolved", "handed"};
static_assert(sizeof(kNames) / sizeof(kNames[0]) == size_t(Event::kHanded) + 1, "a name for every Event");

}  // namespace

bool g_on = false;
static Buffer g_buffer;  // after g_on: initialised in order within this file

void record(Event e, uint32_t lane, uint8_t type, uint32_t slot, uint32_t gen) {
  const uint64_t i = g_buffer.next.fetch_add(1, std::memory_order_relaxed);
  if (i >= kCapacity) return;
  Record& r = g_buffer.records[i];
  r.slot = slot;
  r.gen = gen;
  r.lane = lane;
  r.event = uint8_t(e);
  r.type = type;
  r.cpu = int16_t(::sched_getcpu());
  std::atomic_ref<uint64_t>(r.ns).store(mono_ns(), std::memory_order_release);  // last: the record is whole
}

void flush() {
  if (!g_on) return;
  std::lock_guard lock(g_buffer.flush_mu);
  Buffer& b = g_buffer;
  if (!b.file) {
    const std::string path = b.prefix + "." + std::to_string(::getpid()) + ".tsv";
    b.file = std::fopen(path.c_str(), "w");
    if (!b.file) return;
    std::fprintf(b.file, "# pid %d\nns\tevent\tlane\ttype\tslot\tgen\tcpu\n", int(::getpid()));
  }
  const uint64_t total = b.next.load(std::memory_order_acquire);
  const uint64_t n = total < kCapacity ? total : kCapacity;
  uint64_t i = b.flushed;
  for (; i < n; ++i) {
    const Record& r = b.records[i];
    const uint64_t ns = std::atomic_ref<uint64_t>(const_cast<uint64_t&>(r.ns)).load(std::memory_order_acquire);
    if (ns == 0) break;  // claimed but not yet written by its thread: the next flush takes it
    std::fprintf(b.file, "%llu\t%s\t%u\t%u\t%u\t%u\t%d\n", (unsigned long long)ns, kNames[r.event], r.lane,
                 unsigned(r.type), r.slot, r.gen, int(r.cpu));
  }
  b.flushed = i;
  if (total > kCapacity) std::fprintf(b.file, "# %llu events dropped so far\n", (unsigned long long)(total - kCapacity));
  std::fflush(b.file);
}

}  // namespace tether::core::trace
