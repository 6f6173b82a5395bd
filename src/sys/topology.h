// NIC topology: this host's interfaces, which an endpoint uses for data and control, how they rank for
// a device, how lanes pair local and remote NICs, where progress threads run. Read once, at create().
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tether/config.h"
#include "tether/status.h"

namespace tether::sys {

struct NicAddr {
  int family = 0;      // AF_INET or AF_INET6
  std::string addr;    // numeric form
  int prefix = 0;      // netmask length
};

struct Nic {
  std::string name;
  std::vector<NicAddr> addrs;
  bool up = false;          // IFF_UP and IFF_RUNNING (carrier)
  bool loopback = false;
  int speed_mbps = -1;      // /sys/class/net/X/speed; -1 unknown
  int numa_node = -1;
  std::string pci_path;     // sysfs path of the PCI function behind it; empty for virtual interfaces
  std::vector<int> local_cpus;  // the device's local_cpulist; empty when unknown
  // First IPv4 address, else first IPv6, else empty.
  const NicAddr* primary() const;
};

// Fills pci_path, numa_node and local_cpus from the PCI function at or above the sysfs path `device`
// (a virtio NIC sits one level below its function). False, nothing filled: no PCI function there.
bool read_pci_location(Nic& n, const std::string& device);

// How near a NIC is to a device: shared leading sysfs PCI path components (fewer bridges) count most,
// then a shared NUMA node, then speed.
struct Closeness {
  size_t shared = 0;        // leading path components in common (0: either path unknown)
  bool same_numa = false;
  int speed_mbps = -1;
  bool operator==(const Closeness& o) const {
    return shared == o.shared && same_numa == o.same_numa && speed_mbps == o.speed_mbps;
  }
  bool nearer_than(const Closeness& o) const {
    if (shared != o.shared) return shared > o.shared;
    if (same_numa != o.same_numa) return same_numa;
    return speed_mbps > o.speed_mbps;
  }
};
Closeness closeness(const Nic& nic, const std::string& device_pci_path, int device_numa);

// Indices of `nics`, nearest first (by closeness; ties keep the given order).
std::vector<size_t> rank_nics(const std::vector<Nic>& nics, const std::string& device_pci_path, int device_numa);

// The NUMA node every CPU this process may run on belongs to, or -1 (several, or unknown): where its
// host memory lands (first touch).
int affinity_numa_node();

// A NIC as the other side advertises it (the listener's data NICs travel in the handshake).
struct RemoteNic {
  std::string name;
  NicAddr addr;
};
std::string encode_nic_list(const std::vector<RemoteNic>& nics);
Result<std::vector<RemoteNic>> decode_nic_list(std::string_view text);

// One lane's path: local NIC (index into the endpoint's data NICs, -1 none: let routing choose) and
// remote address to connect to.
struct NicPair {
  int local = -1;
  std::string local_addr;   // bind address; empty: no bind
  std::string local_name;
  std::string remote_addr;
  std::string remote_name;
};
// Pairs of (local data NIC, remote NIC) that share a subnet, in local use order, consecutive entries on
// different local NICs; empty when none share one.
std::vector<NicPair> pair_nics(const std::vector<Nic>& local, const std::vector<RemoteNic>& remote);
bool same_subnet(const NicAddr& a, const std::string& b_addr, int b_prefix);

// "0-3,8,10-11" -> {0,1,2,3,8,10,11}.
Result<std::vector<int>> parse_cpu_list(std::string_view text);
std::string format_cpu_list(const std::vector<int>& cpus);
struct CpuBinding {
  std::string nic;
  std::vector<int> cpus;
};
// "eth1:8-21;eth2:22-35".
Result<std::vector<CpuBinding>> parse_cpu_bindings(std::string_view text);
Status pin_current_thread(const std::vector<int>& cpus);

// What an endpoint decided from its Config and this host.
struct ThreadPlacement {
  int nic = -1;               // data NIC this progress thread serves first (-1: none)
  std::vector<int> cpus;      // empty: not pinned
  std::string why;            // "TETHER_TX_CPUS/TETHER_RX_CPUS", "NUMA-local to eth1", "not pinned: ..."
};
struct Plan {
  std::vector<Nic> all;                 // every interface
  std::vector<Nic> data;                // data NICs in use order (TETHER_NICS, else ranked)
  int control = -1;                     // index into `all` of the control NIC, -1: routing decides
  std::vector<ThreadPlacement> threads; // one per progress thread (Config::channels)
  // Progress thread for lane `i` of a peer whose lane sits on data NIC `nic` (-1: unknown), given how
  // many earlier lanes of that peer sit on the same NIC.
  uint32_t thread_for_lane(uint32_t lane, int nic, uint32_t earlier_on_nic) const;
  int data_index_of_addr(const std::string& addr) const;
};
Result<Plan> make_plan(const Config& config);

}  // namespace tether::sys
