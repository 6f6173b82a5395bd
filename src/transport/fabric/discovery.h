// Which provider and which rails (one domain per NIC) this endpoint uses, and how that provider
// wants memory registered. Everything here is decided from fi_getinfo's answer, never from a
// provider's name, except the provider ranking for "auto" and known-bad-version warnings.
#pragma once
#include <rdma/fabric.h>

#include <cstdint>
#include <string>
#include <vector>

#include "transport/fabric/libfabric.h"

namespace tether::transport::fabric {

struct DiscoveryOptions {
  std::string provider;   // cxi | efa | verbs | tcp | shm | "" (auto: cxi, efa, verbs, tcp)
  std::string domains;    // comma-separated domain names to keep; "" = all the provider offers
  uint32_t max_rails = 0; // 0 = every domain
  std::string host;       // socket providers (tcp): bind rails to this address ("0.0.0.0": any)
  bool delivery_complete = true;  // ask FI_DELIVERY_COMPLETE where the provider takes it
  bool busy_poll = false;         // never sleep in the completion queue
};

// How a provider wants memory registered (fi_info domain_attr->mr_mode, caps).
struct MrMode {
  bool local = false;      // FI_MR_LOCAL: local buffers of an operation need their MR descriptor
  bool virt_addr = false;  // FI_MR_VIRT_ADDR: remote addresses are virtual addresses, else offsets
  bool prov_key = false;   // FI_MR_PROV_KEY: the provider picks keys; else we request one
  bool allocated = false;  // FI_MR_ALLOCATED: only backed memory (tether regions always are)
  bool endpoint = false;   // FI_MR_ENDPOINT: bind each MR to the endpoint, then enable it
  bool hmem = false;       // FI_MR_HMEM (and caps FI_HMEM): device memory registers directly
  size_t key_size = 8;     // bytes of a key (cxi uses small keys)

  static MrMode from(const fi_info* info);
  std::string describe() const;   // "local,virt_addr,..." for doctor and logs
};

struct Discovery {
  const Lib* lib = nullptr;
  std::string provider;            // core provider name (first of "tcp;ofi_rxm")
  std::string provider_full;       // as libfabric names it
  std::vector<fi_info*> rails;     // one per domain, owned
  MrMode mr;
  bool delivery_complete = false;  // writes can ask FI_DELIVERY_COMPLETE (tx op_flags accepted)
  bool fence = false;              // FI_FENCE: a fenced read waits for earlier writes (caps)
  bool busy_poll = false;          // progress threads poll without sleeping in fi_cq_sread
  std::string warning;             // known-bad version, printed once by the transport

  Discovery() = default;
  Discovery(const Discovery&) = delete;
  Discovery& operator=(const Discovery&) = delete;
  Discovery(Discovery&& o) noexcept { *this = std::move(o); }
  Discovery& operator=(Discovery&& o) noexcept;
  ~Discovery();
};

// Fills *out, or returns false with *why (no library, no provider, no RDM+RMA domain).
bool discover(const Lib& lib, const DiscoveryOptions& opt, Discovery* out, std::string* why);

// The provider names tether knows, in "auto" order, and whether `name` is one of them.
const std::vector<std::string>& known_providers();

}  // namespace tether::transport::fabric
