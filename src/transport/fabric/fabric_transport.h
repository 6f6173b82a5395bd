// The fabric transport: libfabric reliable-datagram endpoints (cxi, efa, verbs, tcp, shm),
// one rail per domain (NIC), one progress thread per rail.
//
// Writes and reads are one-sided (fi_writemsg with FI_DELIVERY_COMPLETE, fi_read) against the
// target's registration, whose key and base travel in the descriptor's "fabric" extension; the
// target's CPU only progresses its provider. Send/recv chunks are two-sided messages into bounce
// buffers the receiver posts, copied into the matched recv (the core's RTS/CTS picked it).
// A lane is (peer, rail): lane i of a peer uses local rail i and the peer's rail i (docs/FABRIC.md).
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tether/config.h"

#include "transport/transport.h"

namespace tether::transport {

class Host;

// Always returns a transport named "fabric"; built without libfabric headers, or when the library
// or a usable provider is missing at run time, its unavailable_reason() says why.
std::unique_ptr<Transport> make_fabric_transport(Host* host);

// What an endpoint with this Config would use (for `tether doctor`): the rails with their NIC's
// location, and the rail order for host memory and for each device given as (sysfs PCI path, NUMA
// node). `why` non-empty: fabric is unusable and the rest is empty.
struct FabricRails {
  struct Rail {
    std::string domain;
    std::string pci_path;   // empty: unknown
    int numa_node = -1;
  };
  std::string why;
  std::string provider;
  std::vector<Rail> rails;
  int host_numa = -1;                           // the process's NUMA node (-1: spans several / unknown)
  std::vector<uint32_t> host_order;             // rail indices, nearest first
  std::vector<std::vector<uint32_t>> device_orders;
};
FabricRails fabric_rails(const Config& config, const std::vector<std::pair<std::string, int>>& devices);

}  // namespace tether::transport
