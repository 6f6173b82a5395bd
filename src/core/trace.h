// A per-frame event trace, for finding where a transfer's time goes. Off unless TETHER_TRACE names a
// file prefix; then events go to a preallocated buffer (no allocation, lock or I/O on the path) that
// the control thread appends to <prefix>.<pid>.tsv every tick and at close. Both sides' files share
// CLOCK_MONOTONIC, so they merge into one timeline (bench/tools/trace_report.py).
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
  kCalled,    // an application's write or read entered the core (kPost follows once it is checked and queued)
  kResolved,  // a batch the initiator copies itself has its copy list written (ipc: before the launch)
  kHanded,    // a copy the initiator started went to the thread that answers it (ipc: the GPU completer)
};

extern bool g_on;  // set once, before any endpoint exists
void record(Event e, uint32_t lane, uint8_t type, uint32_t slot, uint32_t gen);
void flush();  // appends what was recorded since the last flush (control ticks, EndpointImpl::close)

inline void mark(Event e, uint32_t lane, uint8_t type = 0, uint32_t slot = 0, uint32_t gen = 0) {
  if (__builtin_expect(g_on, false)) record(e, lane, type, slot, gen);
}

}  // namespace tether::core::trace
