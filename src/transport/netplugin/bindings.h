// CPU bindings per NIC, NCCL_GPUDIRECTTCPX_TX_BINDINGS style: "eth1:8-21,112-125;eth2:22-35".
// TETHER_NET_BINDINGS pins the netplugin progress thread serving a plugin device (named by the
// plugin's getProperties) to those CPUs. (src/sys/topology has a parser of the same
// form for TCP threads; the two should fold into one.)
#pragma once
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "tether/status.h"

namespace tether::transport {

Result<std::map<std::string, std::vector<int>>> parse_net_bindings(std::string_view text);
Status pin_this_thread(const std::vector<int>& cpus);

}  // namespace tether::transport
