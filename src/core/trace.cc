#include "core/trace.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "core/lanes.h"

namespace tether::core::trace {
namespace {

struct Record {
  uint64_t ns;
  uint32_t slot, gen, lane;
  uint8_t event, type;
};

constexpr uint64_t kCapacity = 1u << 21;  // events kept per process (48 MiB); later ones are counted, not kept

struct Buffer {
  std::string prefix;
  std::unique_ptr<Record[]> records;
  std::atomic<uint64_t> next{0};
  std::mutex flush_mu;
  Buffer() {
    const char* p = std::getenv("TETHER_TRACE");
    if (!p || !*p) return;
    prefix = p;
    records = std::make_unique<Record[]>(kCapacity);
    g_on = true;
  }
};

const char* const kNames[] = {"post", "wake", "pulled", "staged", "sent", "header", "landed", "unpacked", "answered", "waited"};

}  // namespace

bool g_on = false;
static Buffer g_buffer;  // after g_on: initialised in order within this file

void record(Event e, uint32_t lane, uint8_t type, uint32_t slot, uint32_t gen) {
  const uint64_t i = g_buffer.next.fetch_add(1, std::memory_order_relaxed);
  if (i >= kCapacity) return;
  g_buffer.records[i] = Record{mono_ns(), slot, gen, lane, uint8_t(e), type};
}

void flush() {
  if (!g_on) return;
  std::lock_guard lock(g_buffer.flush_mu);
  const std::string path = g_buffer.prefix + "." + std::to_string(::getpid()) + ".tsv";
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return;
  const uint64_t total = g_buffer.next.load(std::memory_order_relaxed);
  const uint64_t n = total < kCapacity ? total : kCapacity;
  std::fprintf(f, "# pid %d, %llu events, %llu dropped\nns\tevent\tlane\ttype\tslot\tgen\n", int(::getpid()),
               (unsigned long long)total, (unsigned long long)(total - n));
  for (uint64_t i = 0; i < n; ++i) {
    const Record& r = g_buffer.records[i];
    if (r.ns == 0) continue;  // claimed but not yet written by its thread
    std::fprintf(f, "%llu\t%s\t%u\t%u\t%u\t%u\n", (unsigned long long)r.ns, kNames[r.event], r.lane, unsigned(r.type),
                 r.slot, r.gen);
  }
  std::fclose(f);
}

}  // namespace tether::core::trace
