// Offers and attaching: each side offers its rails' addresses (with the session naming the link and
// its bounce size), and attaching inserts the other side's addresses and makes the peer's lanes.
#include <cstring>

#include "sys/crypto.h"
#include "transport/fabric/fabric_internal.h"

namespace tether::transport::fabric {

namespace {

// Offer: magic, session, bounce payload bytes, provider, rail addresses.
struct Offer {
  uint64_t session = 0;
  uint64_t bounce = 0;
  std::string provider;
  std::vector<std::string> rails;

  std::string encode() const {
    std::string o(reinterpret_cast<const char*>(&kOfferMagic), 4);
    o += u64_bytes(session) + u64_bytes(bounce);
    o += char(uint8_t(provider.size()));
    o += provider;
    o += char(uint8_t(rails.size()));
    for (auto& r : rails) {
      const uint16_t n = uint16_t(r.size());
      o.append(reinterpret_cast<const char*>(&n), 2).append(r);
    }
    return o;
  }
  static bool parse(std::string_view in, Offer* out) {
    auto take = [&](void* p, size_t n) {
      if (in.size() < n) return false;
      std::memcpy(p, in.data(), n);
      in.remove_prefix(n);
      return true;
    };
    uint32_t magic = 0;
    uint8_t n = 0;
    if (!take(&magic, 4) || magic != kOfferMagic || !take(&out->session, 8) || !take(&out->bounce, 8) || !take(&n, 1) ||
        in.size() < n)
      return false;
    out->provider.assign(in.substr(0, n));
    in.remove_prefix(n);
    if (!take(&n, 1) || n == 0) return false;
    for (uint8_t i = 0; i < n; ++i) {
      uint16_t len = 0;
      if (!take(&len, 2) || in.size() < len) return false;
      out->rails.emplace_back(in.substr(0, len));
      in.remove_prefix(len);
    }
    return true;
  }
};

}  // namespace

std::string FabricTransportImpl::offer(uint64_t session) {
  if (!open_rails().is_ok()) return {};
  Offer o;
  o.session = session;
  o.bounce = bounce_payload();
  o.provider = disc_.provider;
  for (auto& r : rails_) o.rails.push_back(r->rail().address());
  return o.encode();
}

uint32_t FabricTransportImpl::lanes_for(std::string_view remote_offer) const {
  Offer o;
  if (!Offer::parse(remote_offer, &o)) return 1;  // attach() reports the problem
  return uint32_t(std::max<size_t>(1, std::min(o.rails.size(), disc_.rails.size())));
}

Status FabricTransportImpl::attach(const std::shared_ptr<Link>& peer, const std::vector<int>&,
                                   std::string_view remote_offer, bool, int64_t) {
  if (stopped_.load()) return Status(Code::kCancelled, "endpoint closed");
  Status s = open_rails();
  if (!s.is_ok()) return s;
  Offer o;
  if (!Offer::parse(remote_offer, &o))
    return Status(Code::kProtocolError, "malformed fabric offer from the peer (or a tether build with another fabric layout)");
  if (o.provider != disc_.provider)
    return Status(Code::kUnavailable, "the peer uses libfabric provider '" + o.provider + "', this endpoint '" +
                                          disc_.provider + "' (set TETHER_FABRIC_PROVIDER alike on both sides)");
  if (o.bounce < host_->config().chunk_bytes)
    return Status(Code::kInvalidArgument, "the peer receives send/recv chunks of at most " + std::to_string(o.bounce) +
                                              " bytes; this endpoint's chunk_bytes is " +
                                              std::to_string(host_->config().chunk_bytes) + " (set them alike)");
  const uint32_t window = std::max<uint32_t>(1, host_->config().window);
  auto state = std::make_shared<FabricPeer>();
  std::vector<std::shared_ptr<Lane>> lanes;
  auto undo = [&](Status err) {
    for (auto& l : lanes) {
      l->thread->rail().deregister(&l->headers_mr);
      l->thread->rail().remove(l->remote);
    }
    return err;
  };
  for (uint32_t i = 0; i < peer->lanes(); ++i) {
    auto l = std::make_shared<Lane>();
    l->peer = peer;
    l->index = i;
    l->rail = i % rails_.size();
    l->session = o.session;
    l->thread = rails_[l->rail].get();
    Rail& rail = l->thread->rail();
    std::string why;
    l->remote = rail.insert(o.rails[i % o.rails.size()], &why);
    if (l->remote == FI_ADDR_NOTAVAIL) return undo(Status(Code::kConnectionLost, why));
    l->ops.resize(window);
    l->flushes.resize(window);
    l->copying.resize(window);
    l->ack_ops.resize(window);
    l->ack_queue.resize(2 * size_t(window) + kBounceBuffers);
    l->headers.resize(2 * size_t(window));
    for (uint32_t k = 0; k < window; ++k) {
      l->ops[k].index = k;
      l->ops[k].lane = l.get();
      l->free_ops.push_back(window - 1 - k);
      l->ack_ops[k].index = window + k;
      l->ack_ops[k].lane = l.get();
      l->ack_ops[k].kind = OpKind::kAck;
      l->free_acks.push_back(window - 1 - k);
    }
    if (!rail.register_memory(l->headers.data(), l->headers.size() * sizeof(SendHeader), -1, tether::crypto::random_u64(),
                              false, &l->headers_mr, &why)) {
      rail.remove(l->remote);
      return undo(Status(Code::kUnavailable, why));
    }
    state->lanes.push_back(l);
    lanes.push_back(std::move(l));
  }
  {
    std::lock_guard lock(sessions_mu_);
    for (auto it = sessions_.begin(); it != sessions_.end();) it = it->second.expired() ? sessions_.erase(it) : std::next(it);
    sessions_[o.session] = peer;
  }
  peer->transport_state = state;  // weak references: lanes own the peer
  for (auto& l : lanes) l->thread->adopt(std::move(l));
  return Status::ok();
}

}  // namespace tether::transport::fabric
