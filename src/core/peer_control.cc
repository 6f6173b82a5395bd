// PeerState, control connection: messages out (queued for the control thread), messages in (one
// handler each), and notifications, which follow a transfer's data.
#include <cstring>

#include "core/endpoint_impl.h"
#include "core/peer.h"

namespace tether::core {

void PeerState::transfer_drained(TransferState* t) {
  if (t->pushed) {
    std::lock_guard lock(mu_);
    if (auto it = pushes_.find(uint32_t(t->msg_id)); it != pushes_.end() && it->second == t) pushes_.erase(it);
  }
  Status err = t->error();
  if (!err.is_ok()) {
    t->finish(err);
    return;
  }
  // A write's notification follows its data into the target; a read's follows the last answer here.
  const bool notify = t->op == OpKind::kNotify || !t->notify.empty();
  if (!notify) {
    t->finish(Status::ok());
    return;
  }
  uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    if (failed_.load()) {
      err = error_;
    } else {
      id = next_msg_id_++;
      awaiting_ack_[id] = t;
    }
  }
  if (id == 0) {
    t->finish(err);
    return;
  }
  std::string body(8 + t->notify.size(), '\0');
  std::memcpy(body.data(), &id, 8);
  std::memcpy(body.data() + 8, t->notify.data(), t->notify.size());
  send_control(wire::ControlType::kNotify, body.data(), uint32_t(body.size()));
}

void PeerState::send_control(wire::ControlType type, const void* body, uint32_t length) {
  queue_control(type, body, length, SIZE_MAX);
}

bool PeerState::send_answer(wire::ControlType type, const void* body, uint32_t length) {
  if (failed()) return false;
  if (queue_control(type, body, length, kAnswerBacklog)) return true;
  fail(Status(Code::kResourceExhausted, "peer '" + info_.name + "' does not read its control connection: the answers to "
                                            "its requests waiting for it passed " + std::to_string(kAnswerBacklog >> 20) +
                                            " MiB (the bound on a peer's unsent control bytes)"));
  return false;
}

// Appends one message unless the unsent control bytes would pass `limit`.
bool PeerState::queue_control(wire::ControlType type, const void* body, uint32_t length, size_t limit) {
  wire::ControlHeader h{length, static_cast<uint8_t>(type), {}};
  {
    std::lock_guard lock(out_mu_);
    if (limit != SIZE_MAX && control_out_.size() + ctl_unsent_.load(std::memory_order_relaxed) + sizeof h + length > limit)
      return false;
    control_out_.append(reinterpret_cast<const char*>(&h), sizeof h);
    if (length > 0) control_out_.append(static_cast<const char*>(body), length);  // heartbeats have none
  }
  endpoint_->wake_control();
  return true;
}

bool PeerState::take_control_output(std::string* out, size_t sent) {
  std::lock_guard lock(out_mu_);
  if (control_out_.empty()) return false;
  if (out->empty()) {
    out->swap(control_out_);  // no copy; control_out_ keeps the drained buffer (given back when large)
  } else {
    out->append(control_out_);
    control_out_.clear();
  }
  ctl_unsent_.store(out->size() - sent, std::memory_order_relaxed);
  return true;
}

void PeerState::on_control(wire::ControlType type, const uint8_t* body, uint32_t length) {
  touch();
  bool ok = false;  // a message that is not one of these, or not well formed, drops the peer
  switch (type) {
    case wire::ControlType::kHeartbeat: ok = true; break;
    case wire::ControlType::kNotify: ok = on_notify(body, length); break;
    case wire::ControlType::kNotifyAck: ok = on_notify_ack(body, length); break;
    case wire::ControlType::kRts: ok = on_rts(body, length); break;
    case wire::ControlType::kCts: ok = on_cts(body, length); break;
    case wire::ControlType::kCancel: ok = on_cancel(body, length); break;
    case wire::ControlType::kPullFail: ok = on_pull_fail(body, length); break;
    case wire::ControlType::kPullCancel: ok = on_pull_cancel(body, length); break;
  }
  if (ok) return;
  fail(Status(Code::kProtocolError, "peer '" + info_.name + "' sent a malformed control message (type " +
                                        std::to_string(int(type)) + ", " + std::to_string(length) + " bytes)"));
}

bool PeerState::on_notify(const uint8_t* body, uint32_t length) {
  if (length < 8) return false;
  wire::NotifyAckBody ack{};
  std::memcpy(&ack.id, body, 8);
  // Queued for the application, or refused (too large, queue full): the sender learns which.
  ack.status = uint8_t(endpoint_->push_notification(info_, body + 8, length - 8));
  send_answer(wire::ControlType::kNotifyAck, &ack, sizeof ack);
  return true;
}

bool PeerState::on_notify_ack(const uint8_t* body, uint32_t length) {
  wire::NotifyAckBody ack;
  if (!body_as(body, length, &ack)) return false;
  TransferState* t = take_entry(awaiting_ack_, ack.id);
  if (!t) return false;  // no notification of ours has that id
  const Code c = static_cast<Code>(ack.status);
  if (c == Code::kOk) {
    t->finish(Status::ok());
    return true;
  }
  const bool write = t->op == OpKind::kWrite;
  t->finish(Status(c, "peer '" + info_.name + "' refused the notification: " +
                          (c == Code::kResourceExhausted
                               ? "its queue of unread notifications is full (notify_queue_peer_bytes / "
                                 "notify_queue_bytes there); retry once the application there has read them"
                               : std::string(code_name(c))) +
                          (write ? " (the write's data is in place)" : "")));
  return true;
}

}  // namespace tether::core
