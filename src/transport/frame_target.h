// The target side of a frame, shared by every frame-style transport (tcp, netplugin): an incoming
// kWrite, kSendData or kReadReq header is checked (RegionRegistry::resolve: region, key, bounds; or
// the matched recv for kSendData) before a byte is touched, and what the check pinned is let go
// exactly once when the payload has been placed, answered, or abandoned.
#pragma once
#include <cstdint>

#include "core/wire.h"
#include "tether/status.h"

namespace tether::core {
struct RegionState;
struct TransferState;
}  // namespace tether::core

namespace tether::transport {

class Host;
class Link;

struct TargetPlan {
  Code code = Code::kOk;
  uint8_t* dest = nullptr;              // kWrite / kSendData: where the payload goes; null: discard it
  const uint8_t* source = nullptr;      // kReadReq: the bytes to send back
  core::RegionState* pin = nullptr;     // pinned until finish_placed / the response is sent / abandon
  core::TransferState* recv = nullptr;  // kSendData: the matched recv, held until finish_placed / abandon
  int32_t device = -1;                  // >= 0: dest / source is memory of this GPU
};

// Checks an incoming kWrite, kSendData or kReadReq header and counts a rejection.
TargetPlan plan_target(Host& host, Link& peer, const wire::FrameHeader& h);

// A kWrite / kSendData payload has been placed (or discarded): lets go of the region, credits the recv,
// counts the bytes, and returns the kAck to send back.
wire::FrameHeader finish_placed(Host& host, Link& peer, const wire::FrameHeader& h,
                                TargetPlan& plan);

// The kReadResp header answering kReadReq `h` (payload: plan.source, h.length bytes when plan.code is ok).
wire::FrameHeader read_response(const wire::FrameHeader& h, const TargetPlan& plan);

// The lane died before the payload was placed: lets go of what the plan holds.
void abandon(Link& peer, TargetPlan& plan);

}  // namespace tether::transport
