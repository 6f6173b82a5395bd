// Which provider and which rails (one domain per NIC) this endpoint uses, and how that provider
// wants memory registered. Everything here is decided from fi_getinfo's answer, never from a
// provider's name, except the provider ranking for "auto" and known-bad-version warnings.
#pragma once
#include <rdma/fabric.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sys/topology.h"
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

// How a provider wants memory registered (fi_info domain_attr->mr_mode, caps). FI_MR_LOCAL,
// FI_MR_PROV_KEY and FI_MR_ALLOCATED need no choice: every operation passes its descriptor, every
// registration requests a key the provider may override, and tether regions are always backed.
struct MrMode {
  bool virt_addr = false;  // FI_MR_VIRT_ADDR: remote addresses are virtual addresses, else offsets
  bool endpoint = false;   // FI_MR_ENDPOINT: bind each MR to the endpoint, then enable it
  bool hmem = false;       // FI_MR_HMEM (and caps FI_HMEM): device memory registers directly
  size_t key_size = 8;     // bytes of a key (cxi uses small keys)

  static MrMode from(const fi_info* info);
};

// An fi_info of our own (fi_dupinfo), freed through the library that made it.
struct InfoFree {
  const Lib* lib = nullptr;
  void operator()(fi_info* i) const { lib->freeinfo(i); }
};

struct Discovery {
  const Lib* lib = nullptr;
  std::string provider;            // core provider name (first of "tcp;ofi_rxm")
  std::vector<std::unique_ptr<fi_info, InfoFree>> rails;  // one per domain
  std::vector<sys::Nic> locations; // per rail: its NIC's PCI path and NUMA node (empty path: unknown)
  MrMode mr;
  bool delivery_complete = false;  // writes can ask FI_DELIVERY_COMPLETE (tx op_flags accepted)
  bool fence = false;              // FI_FENCE: a fenced read waits for earlier writes (caps)
  bool busy_poll = false;          // progress threads poll without sleeping in fi_cq_sread
  std::string warning;             // known-bad version, printed once by the transport
};

// Fills *out, or returns false with *why (no library, no provider, no RDM+RMA domain).
bool discover(const Lib& lib, const DiscoveryOptions& opt, Discovery* out, std::string* why);

// Where a rail's NIC sits: name = the domain's name; pci_path / numa_node / local_cpus from sysfs
// (under `sysfs_root`, "/sys" but for tests). From the PCI address the provider reports
// (fi_info->nic->bus_attr: cxi, efa, verbs), else from the network or RDMA device named by the NIC's
// device name, the domain name or the interface holding src_addr (tcp). Left empty when none leads
// to a PCI function. speed_mbps from the NIC's link attributes where given.
sys::Nic rail_location(const fi_info* info, const std::string& sysfs_root = "/sys");

// Rails in the order a device (GPU PCI path and NUMA node; "" and the process's node for host
// memory) should use them: nearest first by sys::rank_nics, rails of unknown location last in
// discovery order. `best` leading entries are equally near (the rails small chunks rotate over).
struct RailOrder {
  std::vector<uint32_t> rails;
  uint32_t best = 0;
};
RailOrder rank_rails(const std::vector<sys::Nic>& locations, const std::string& device_pci_path, int device_numa);

// Which rails to offer `k` new chunks of a peer with lanes on rails [0, lanes): up to k of them into
// out[] (room for min(k, lanes)), returns how many. The nearest rails the peer has a lane on come
// first, rotated by `turn` (round-robin among the equally near), then the others nearest first.
// Allocates nothing (the data path calls it).
size_t pick_rails(const RailOrder& order, size_t lanes, size_t k, uint64_t turn, uint32_t* out);

}  // namespace tether::transport::fabric
