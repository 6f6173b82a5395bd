#include "transport/frame_target.h"

#include "core/region.h"
#include "core/transfer.h"
#include "transport/host.h"
#include "transport/link.h"

namespace tether::transport {

using wire::FrameHeader;
using wire::FrameType;

TargetPlan plan_target(Host& host, Link& peer, const FrameHeader& h) {
  TargetPlan p;
  const auto type = static_cast<FrameType>(h.type);
  if (type == FrameType::kWrite || type == FrameType::kReadReq) {
    const bool write = type == FrameType::kWrite;
    p.code = host.registry().resolve(h.region_id, h.key, h.desc_offset, h.desc_length, h.offset, h.length, write, &p.pin);
    if (p.code == Code::kOk) {
      if (write) p.dest = p.pin->base + h.offset;
      else p.source = p.pin->base + h.offset;
      p.device = p.pin->kind == MemoryKind::kCuda ? p.pin->device : -1;
    }
  } else if (type == FrameType::kSendData) {
    p.code = peer.resolve_send_data(h.recv_token, h.offset, h.length, h.sender_chunk, h.flags, &p.dest, &p.recv, &p.device);
  } else {
    p.code = Code::kProtocolError;
  }
  if (p.code != Code::kOk) host.traffic().rejected_requests.fetch_add(1, std::memory_order_relaxed);
  return p;
}

FrameHeader finish_placed(Host& host, Link& peer, const FrameHeader& h, TargetPlan& plan) {
  if (plan.pin) { plan.pin->unpin(); plan.pin = nullptr; }
  if (plan.recv) {
    peer.send_data_placed(plan.recv, h.offset, h.length);
    plan.recv = nullptr;
  }
  if (plan.code == Code::kOk) {
    host.traffic().bytes_received.fetch_add(h.length, std::memory_order_relaxed);
    host.traffic().chunks_received.fetch_add(1, std::memory_order_relaxed);
  }
  FrameHeader ack{};
  ack.type = static_cast<uint8_t>(FrameType::kAck);
  ack.status = static_cast<uint8_t>(plan.code);
  ack.slot = h.slot;
  ack.gen = h.gen;
  return ack;
}

FrameHeader read_response(const FrameHeader& h, const TargetPlan& plan) {
  FrameHeader r{};
  r.type = static_cast<uint8_t>(FrameType::kReadResp);
  r.status = static_cast<uint8_t>(plan.code);
  r.slot = h.slot;
  r.gen = h.gen;
  if (plan.code == Code::kOk) r.length = h.length;
  return r;
}

void abandon(Link& peer, TargetPlan& plan) {
  if (plan.pin) { plan.pin->unpin(); plan.pin = nullptr; }
  if (plan.recv) {
    plan.recv->record_error(peer.error());
    plan.recv->release();
    plan.recv = nullptr;
  }
}

}  // namespace tether::transport
