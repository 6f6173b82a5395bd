// The fabric transport object: rails opened on first use, the rail order per memory location,
// memory registration on every rail, waking a peer's lanes, and stopping (fabric_internal.h lists the rest).
#include <cstdio>

#include "sys/crypto.h"
#include "gpu/cuda_api.h"
#include "sys/topology.h"
#include "transport/fabric/fabric_internal.h"

namespace tether::transport::fabric {

namespace {

// sysfs PCI path and NUMA node of GPU `device` ({"", -1} when CUDA cannot say).
std::pair<std::string, int> gpu_location(int device) {
  const std::string id = gpu::pci_bus_id(device);
  if (id.empty()) return {"", -1};
  sys::Nic where;
  if (!sys::read_pci_location(where, "/sys/bus/pci/devices/" + id)) return {"", -1};
  return {where.pci_path, where.numa_node};
}

// What discovery is asked for, from the endpoint's fabric_* options (the transport and `tether doctor`).
DiscoveryOptions discovery_options(const Config& c) {
  DiscoveryOptions opt;
  opt.provider = c.fabric_provider;
  opt.domains = c.fabric_domains;
  opt.max_rails = c.fabric_rails;
  opt.host = c.host;
  opt.delivery_complete = c.fabric_delivery_complete != 0;
  opt.busy_poll = c.fabric_busy_poll != 0;
  return opt;
}

}  // namespace

FabricTransportImpl::FabricTransportImpl(Host* host) : host_(host) {
  const Config& c = host->config();
  std::string why;
  const Lib* lib = Lib::load(c.fabric_library, &why);
  if (!lib) {
    why_ = why;
    return;
  }
  if (!discover(*lib, discovery_options(c), &disc_, &why)) {
    why_ = why;
    return;
  }
  if (!disc_.warning.empty()) {
    static std::once_flag once;
    std::call_once(once, [&] { std::fprintf(stderr, "tether: warning: %s\n", disc_.warning.c_str()); });
  }
}

FabricTransportImpl::~FabricTransportImpl() {
  stop();
  // Registrations close before their domains.
  for (auto& [region, mrs] : regions_)
    for (uint32_t i = 0; i < mrs.size() && i < rails_.size(); ++i) rails_[i]->rail().deregister(&mrs[i]);
  regions_.clear();
  for (auto& r : rails_) r->free_bounce();
  rails_.clear();
}

Status FabricTransportImpl::open_rails() {
  std::lock_guard lock(open_mu_);
  if (opened_) return open_status_;
  opened_ = true;
  for (uint32_t i = 0; i < disc_.rails.size(); ++i) {
    std::string why;
    auto rail = Rail::open(disc_, i, &why);
    std::unique_ptr<RailThread> t;
    if (rail) t = std::make_unique<RailThread>(this, std::move(rail));
    if (!t || !t->start(bounce_payload(), &why)) {
      if (t) t->free_bounce();
      for (auto& r : rails_) r->free_bounce();
      rails_.clear();
      open_status_ = Status(Code::kUnavailable, why);
      open_failed_.store(true, std::memory_order_release);
      return open_status_;
    }
    rails_.push_back(std::move(t));
  }
  open_status_ = Status::ok();
  prepare_order(-1);
  return open_status_;
}

void FabricTransportImpl::prepare_order(int device) {
  if (device >= kOrderDevices || (device >= 0 && orders_[device + 1].load(std::memory_order_acquire))) return;
  if (device < 0 && orders_[0].load(std::memory_order_acquire)) return;
  // sysfs and CUDA queries outside the lock; a racing caller computes the same order and drops it.
  auto [path, numa] = device >= 0 ? gpu_location(device) : std::pair<std::string, int>{"", sys::affinity_numa_node()};
  auto order = std::make_unique<RailOrder>(rank_rails(disc_.locations, path, numa));
  std::lock_guard lock(order_mu_);
  std::atomic<const RailOrder*>& slot = orders_[device + 1];
  if (slot.load(std::memory_order_relaxed)) return;
  slot.store(order.get(), std::memory_order_release);
  order_store_.push_back(std::move(order));
}

// A region fabric cannot register fails registration only where fabric was asked for by name;
// otherwise its descriptors carry no fabric extension and a fabric peer's chunks say so.
Status FabricTransportImpl::register_region(RegionState& region, std::string* desc_ext) {
  const bool required = host_->config().transport == "fabric";
  Status s = open_rails();
  if (!s.is_ok()) return required ? s : Status::ok();
  const bool device = region.kind == MemoryKind::kCuda;
  if (device) prepare_order(region.device);  // this GPU's rail order, before its first chunk
  if (device ? !disc_.mr.hmem : stage_host_) {
    // The provider cannot reach this memory (no FI_HMEM): no registration. Local chunks go through
    // the lanes' staging slots; the descriptor tells initiators to send messages the target serves.
    desc_ext->assign({char(0), char(kExtTwoSided)});
    return Status::ok();
  }
  std::vector<RailMr> mrs(rails_.size());
  std::string ext(1, char(uint8_t(rails_.size())));
  for (uint32_t i = 0; i < rails_.size(); ++i) {
    std::string why;
    // Requested keys (when the provider does not pick them) are random: a key is a capability.
    if (!rails_[i]->rail().register_memory(region.base, region.size, device ? region.device : -1, tether::crypto::random_u64(),
                                           !region.readonly, &mrs[i], &why)) {
      for (uint32_t j = 0; j < i; ++j) rails_[j]->rail().deregister(&mrs[j]);
      return required ? Status(Code::kUnavailable, why) : Status::ok();
    }
    ext += u64_bytes(mrs[i].key) + u64_bytes(mrs[i].base);
  }
  {
    std::unique_lock lock(regions_mu_);
    regions_[&region] = std::move(mrs);
  }
  *desc_ext = std::move(ext);
  return Status::ok();
}

void FabricTransportImpl::deregister_region(RegionState& region) {
  std::vector<RailMr> mrs;
  {
    std::unique_lock lock(regions_mu_);
    auto it = regions_.find(&region);
    if (it == regions_.end()) return;
    mrs = std::move(it->second);
    regions_.erase(it);
  }
  for (uint32_t i = 0; i < mrs.size() && i < rails_.size(); ++i) rails_[i]->rail().deregister(&mrs[i]);
}

// Lane i sits on rail i. Few chunks rotate over the rails nearest their memory (rank_rails), so small
// transfers from a GPU stay on the NICs beside it; many chunks wake every lane, nearest first: one more
// PCIe hop costs less than an idle NIC, and a farther rail that drains slower takes fewer chunks anyway.
// To keep a GPU's traffic on its own NIC(s) name them in TETHER_FABRIC_DOMAINS.
void FabricTransportImpl::wake(Link* peer, uint64_t chunks, int device) {
  auto* state = static_cast<FabricPeer*>(peer->transport_state.get());
  if (!state || state->lanes.empty()) return;
  const size_t n = state->lanes.size();
  const size_t k = size_t(std::min<uint64_t>(std::max<uint64_t>(chunks, 1), n));
  const RailOrder* o = order_for(device);
  if (!o || o->rails.size() != rails_.size() || o->rails.size() > 256) {  // not ranked (yet): round-robin
    const uint32_t first = state->next.fetch_add(uint32_t(k), std::memory_order_relaxed);
    for (size_t i = 0; i < k; ++i)
      if (auto l = state->lanes[(first + i) % n].lock()) l->thread->wake();
    return;
  }
  uint32_t pick[256];  // rails are at most 255 (the offer counts them in a byte)
  const size_t count = pick_rails(*o, n, k, state->next.fetch_add(1, std::memory_order_relaxed), pick);
  for (size_t i = 0; i < count; ++i)
    if (auto l = state->lanes[pick[i]].lock()) l->thread->wake();
}

void FabricTransportImpl::stop() {
  if (stopped_.exchange(true)) return;
  for (auto& r : rails_) r->join();
  for (auto& r : rails_) r->cancel_all();
  for (auto& r : rails_) r->drop_lanes();
}

}  // namespace tether::transport::fabric

namespace tether::transport {

FabricRails fabric_rails(const Config& c, const std::vector<std::pair<std::string, int>>& devices) {
  using namespace fabric;
  FabricRails out;
  const Lib* lib = Lib::load(c.fabric_library, &out.why);
  if (!lib) return out;
  Discovery d;
  if (!discover(*lib, discovery_options(c), &d, &out.why)) return out;
  out.why.clear();  // discovery may have noted a weaker attempt that failed before one succeeded
  out.provider = d.provider;
  for (const sys::Nic& n : d.locations) out.rails.push_back({n.name, n.pci_path, n.numa_node});
  out.host_numa = sys::affinity_numa_node();
  out.host_order = rank_rails(d.locations, "", out.host_numa).rails;
  for (auto& [path, numa] : devices) out.device_orders.push_back(rank_rails(d.locations, path, numa).rails);
  return out;
}

std::unique_ptr<Transport> make_fabric_transport(Host* host) {
  return std::make_unique<fabric::FabricTransportImpl>(host);
}

}  // namespace tether::transport
