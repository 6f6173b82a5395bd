// A per-frame event trace, for finding where a transfer's time goes (staging copies, socket calls,
// wake-ups; tcp and ipc lanes mark their steps). Off unless TETHER_TRACE names a file prefix;
// then each process records events into a preallocated buffer (no allocation, no lock, no I/O on the
// path), and the control thread appends them to <prefix>.<pid>.tsv every tick (≤ 200 ms) and when an
// endpoint closes: a process that never closes its endpoint (os._exit, NIXL's examples) loses only its
// last tick. CLOCK_MONOTONIC is shared by the processes of a host, so both sides' files merge into one
// timeline (bench/tools/trace_report.py).
#pragma once
#include <cstdint>

namespace tether::core::trace {

enum class Event : uint8_t {
  kPost,      // a transfer handed to the transport (arg: its chunks)
  kWake,      // a progress thread woke from a sleeping wait (lane: thread, arg: events)
  kTaken,    // a lane took a frame to send (a request, or an answer with a payload)
  kStaged,    // its copy out of the GPU was seen finished
  kSent,      // its last byte went into the socket
  kHeader,    // a frame's header was read
  kLanded,    // its payload is in (memory or a bounce slot)
  kUnpacked,  // its copy into the GPU was seen finished
  kAnswered,  // the initiator took the answer (ack or read response)
  kWaited,    // a wait() returned on its finished transfer (the application has it back)
};

extern bool g_on;  // set once, before any endpoint exists
void record(Event e, uint32_t lane, uint8_t type, uint32_t slot, uint32_t gen);
void flush();  // appends what was recorded since the last flush (control ticks, EndpointImpl::close)

inline void mark(Event e, uint32_t lane, uint8_t type = 0, uint32_t slot = 0, uint32_t gen = 0) {
  if (__builtin_expect(g_on, false)) record(e, lane, type, slot, gen);
}

}  // namespace tether::core::trace
