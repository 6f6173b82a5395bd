#include "transport/fabric/discovery.h"

#include <rdma/fi_domain.h>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <set>
#include <sstream>

namespace tether::transport::fabric {

namespace {

constexpr uint64_t kCaps = FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_MSG;
// Every registration mode handled generically (FI_MR_RAW, FI_MR_MMU_NOTIFY are not: providers
// demanding them are left out by fi_getinfo).
constexpr int kMrModes =
    FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT | FI_MR_HMEM;

std::string core_name(const fi_info* info) {
  const char* p = info->fabric_attr && info->fabric_attr->prov_name ? info->fabric_attr->prov_name : "";
  const char* semi = std::strchr(p, ';');
  return semi ? std::string(p, semi) : std::string(p);
}

std::string domain_name(const fi_info* info) {
  return info->domain_attr && info->domain_attr->name ? info->domain_attr->name : "";
}

fi_info* make_hints(const Lib& lib, const std::string& provider, bool hmem, bool delivery_complete) {
  fi_info* h = lib.dupinfo(nullptr);
  if (!h) return nullptr;
  h->caps = kCaps | (hmem ? FI_HMEM : 0);
  h->mode = FI_CONTEXT | FI_CONTEXT2;   // our operation contexts start with a struct fi_context2
  h->ep_attr->type = FI_EP_RDM;
  h->domain_attr->mr_mode = kMrModes;
  h->domain_attr->threading = FI_THREAD_SAFE;
  if (delivery_complete) h->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
  if (!provider.empty()) h->fabric_attr->prov_name = ::strdup(provider.c_str());
  return h;
}

// fi_getinfo for `provider` ("" = any); null when nothing matches.
fi_info* query(const Lib& lib, const std::string& provider, const char* node, bool hmem, bool dc,
               std::string* why) {
  fi_info* hints = make_hints(lib, provider, hmem, dc);
  if (!hints) {
    *why = "fi_dupinfo failed";
    return nullptr;
  }
  fi_info* list = nullptr;
  const int rc = lib.getinfo(kApiVersion, node, nullptr, node ? FI_SOURCE : 0, hints, &list);
  lib.freeinfo(hints);
  if (rc != 0) {
    *why = "fi_getinfo(" + (provider.empty() ? std::string("any provider") : provider) + "): " + lib.error(rc);
    return nullptr;
  }
  return list;
}

std::set<std::string> split(const std::string& s) {
  std::set<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.insert(item);
  return out;
}

bool is_socket_provider(const std::string& p) { return p == "tcp"; }

// The interface holding the address `sa` (tcp's src_addr), or "".
std::string interface_of(const void* addr, size_t len) {
  if (!addr || len < sizeof(sockaddr)) return {};
  const auto* sa = static_cast<const sockaddr*>(addr);
  ifaddrs* ifa = nullptr;
  if (::getifaddrs(&ifa) != 0) return {};
  std::string name;
  for (ifaddrs* i = ifa; i && name.empty(); i = i->ifa_next) {
    if (!i->ifa_addr || !i->ifa_name || i->ifa_addr->sa_family != sa->sa_family) continue;
    if (sa->sa_family == AF_INET && len >= sizeof(sockaddr_in) &&
        reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr ==
            reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr)
      name = i->ifa_name;
    if (sa->sa_family == AF_INET6 && len >= sizeof(sockaddr_in6) &&
        std::memcmp(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr,
                    &reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr, 16) == 0)
      name = i->ifa_name;
  }
  ::freeifaddrs(ifa);
  return name;
}

}  // namespace

MrMode MrMode::from(const fi_info* info) {
  MrMode m;
  const int bits = info->domain_attr->mr_mode;
  m.virt_addr = bits & FI_MR_VIRT_ADDR;
  m.endpoint = bits & FI_MR_ENDPOINT;
  m.hmem = (bits & FI_MR_HMEM) || (info->caps & FI_HMEM);
  m.key_size = info->domain_attr->mr_key_size ? info->domain_attr->mr_key_size : 8;
  if (bits == FI_MR_BASIC) m.virt_addr = true;  // old style: virtual addresses, provider keys, allocated memory
  return m;
}

sys::Nic rail_location(const fi_info* info, const std::string& sysfs_root) {
  sys::Nic n;
  n.name = domain_name(info);
  const fid_nic* nic = info->nic;
  if (nic && nic->link_attr && nic->link_attr->speed > 0) n.speed_mbps = int(nic->link_attr->speed / 1000000);
  // The provider's PCI address: exact, and the only way for NICs without a netdev (cxi, HCAs).
  if (nic && nic->bus_attr && nic->bus_attr->bus_type == FI_BUS_PCI) {
    const fi_pci_attr& p = nic->bus_attr->attr.pci;
    char bdf[32];
    std::snprintf(bdf, sizeof bdf, "%04x:%02x:%02x.%x", unsigned(p.domain_id), unsigned(p.bus_id), unsigned(p.device_id),
                  unsigned(p.function_id));
    if (sys::read_pci_location(n, sysfs_root + "/bus/pci/devices/" + bdf)) return n;
  }
  // Else a device name sysfs knows: the NIC's, the domain's (tcp: the interface), the interface
  // holding the source address.
  std::vector<std::string> names;
  if (nic && nic->device_attr && nic->device_attr->name) names.emplace_back(nic->device_attr->name);
  names.push_back(n.name);
  names.push_back(interface_of(info->src_addr, info->src_addrlen));
  for (const std::string& name : names) {
    if (name.empty() || name.find('/') != std::string::npos) continue;
    for (const char* cls : {"/class/net/", "/class/infiniband/"})
      if (sys::read_pci_location(n, sysfs_root + cls + name + "/device")) return n;
  }
  return n;  // unknown: a virtual interface (lo, veth) or a provider that says nothing
}

RailOrder rank_rails(const std::vector<sys::Nic>& locations, const std::string& device_pci_path, int device_numa) {
  RailOrder o;
  for (size_t i : sys::rank_nics(locations, device_pci_path, device_numa)) o.rails.push_back(uint32_t(i));
  // Rails we cannot place go last (rank_nics could tie them with known rails on another NUMA node).
  std::stable_partition(o.rails.begin(), o.rails.end(), [&](uint32_t r) { return !locations[r].pci_path.empty(); });
  const auto near = [&](uint32_t r) { return sys::closeness(locations[r], device_pci_path, device_numa); };
  const bool first_known = !o.rails.empty() && !locations[o.rails[0]].pci_path.empty();
  while (o.best < o.rails.size() && near(o.rails[o.best]) == near(o.rails[0]) &&
         !locations[o.rails[o.best]].pci_path.empty() == first_known)
    ++o.best;
  return o;
}

size_t pick_rails(const RailOrder& order, size_t lanes, size_t k, uint64_t turn, uint32_t* out) {
  const std::vector<uint32_t>& r = order.rails;
  // The near tier among the rails this peer has a lane on (a peer with fewer rails than ours has
  // lanes on our first ones only); none there: all of its lanes are equally good.
  size_t tier_end = order.best, m = 0;
  for (size_t p = 0; p < tier_end; ++p) m += r[p] < lanes;
  if (m == 0) {
    tier_end = r.size();
    for (size_t p = 0; p < tier_end; ++p) m += r[p] < lanes;
  }
  if (m == 0) return 0;
  const size_t start = size_t(turn % m);
  size_t n = 0;
  for (size_t j = 0; j < m && n < k; ++j) {  // the near tier, rotated
    size_t want = (start + j) % m;
    for (size_t p = 0; p < tier_end; ++p)
      if (r[p] < lanes && want-- == 0) {
        out[n++] = r[p];
        break;
      }
  }
  for (size_t p = tier_end; p < r.size() && n < k; ++p)  // then the rest, nearest first
    if (r[p] < lanes) out[n++] = r[p];
  return n;
}

bool discover(const Lib& lib, const DiscoveryOptions& opt, Discovery* out, std::string* why) {
  std::string provider = opt.provider;
  if (!provider.empty()) {
    if (provider != "cxi" && provider != "efa" && provider != "verbs" && provider != "tcp" && provider != "shm") {
      *why = "TETHER_FABRIC_PROVIDER=" + provider + ": not one of cxi, efa, verbs, tcp, shm";
      return false;
    }
  } else {
    // auto: the first provider, in rank order, that offers an RDM endpoint with RMA.
    std::string err;
    fi_info* all = query(lib, "", nullptr, false, false, &err);
    for (const char* p : {"cxi", "efa", "verbs", "tcp"}) {
      for (fi_info* i = all; i && provider.empty(); i = i->next)
        if (core_name(i) == p) provider = p;
      if (!provider.empty()) break;
    }
    if (all) lib.freeinfo(all);
    if (provider.empty()) {
      *why = "no libfabric provider among cxi, efa, verbs, tcp offers RDM endpoints with RMA" +
             (err.empty() ? "" : " (" + err + ")");
      return false;
    }
  }

  // Socket providers follow the endpoint's address (its interface is the one rail) unless the
  // domains (interfaces) are named.
  const bool bind_host = is_socket_provider(provider) && opt.domains.empty() && !opt.host.empty() && opt.host != "0.0.0.0";
  const char* node = bind_host ? opt.host.c_str() : nullptr;

  // Best first: device memory and delivery-complete writes; then without each.
  fi_info* list = nullptr;
  bool hmem = false, dc = false;
  for (int attempt = opt.delivery_complete ? 0 : 2; attempt < 4 && !list; ++attempt) {
    hmem = !(attempt & 1);
    dc = attempt < 2;
    list = query(lib, provider, node, hmem, dc, why);
  }
  if (!list) return false;

  const std::set<std::string> keep = split(opt.domains);
  std::set<std::string> seen;
  Discovery d;
  d.lib = &lib;
  d.provider = provider;
  d.delivery_complete = dc;
  // shm's completion queue wait is not woken by its peers' progress, so its threads poll.
  d.busy_poll = opt.busy_poll || provider == "shm";
  for (fi_info* i = list; i; i = i->next) {
    if (core_name(i) != provider) continue;
    const std::string dom = domain_name(i);
    if (!keep.empty() && !keep.count(dom)) continue;
    if (!bind_host && is_socket_provider(provider) && dom == "lo" && keep.empty()) continue;
    if (!seen.insert(dom).second) continue;   // one rail per domain (NIC); the first is preferred
    if (opt.max_rails && d.rails.size() >= opt.max_rails) break;
    if (d.rails.empty()) {
      d.mr = MrMode::from(i);
      d.mr.hmem = d.mr.hmem && hmem;
      d.fence = i->caps & FI_FENCE;
      // Without delivery-complete writes each write chunk is followed by a one-byte read of its
      // last byte (fenced where offered, else ordered read-after-write); with neither, nothing
      // makes the data visible before the notification.
      if (!dc && !d.fence && !(i->tx_attr->msg_order & FI_ORDER_RAW))
        d.warning = "provider " + provider + " offers neither FI_DELIVERY_COMPLETE nor read-after-write "
                    "ordering: a notification may reach the target before the data it announces";
    }
    d.rails.emplace_back(lib.dupinfo(i), InfoFree{&lib});
    d.locations.push_back(rail_location(i));
  }
  lib.freeinfo(list);
  if (d.rails.empty()) {
    *why = "libfabric provider " + provider + " offers no usable domain" +
           (opt.domains.empty() ? "" : " among TETHER_FABRIC_DOMAINS=" + opt.domains);
    return false;
  }
  if (provider == "cxi" && lib.version() < FI_VERSION(2, 0))
    d.warning += "libfabric " + std::to_string(lib.major()) + "." + std::to_string(lib.minor()) +
                " with the cxi provider: throughput collapses once registrations pass ~1.5 GiB "
                "(fixed in libfabric 2.0); keep registered regions small or upgrade";
  *out = std::move(d);
  return true;
}

}  // namespace tether::transport::fabric
