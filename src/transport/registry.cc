#include "transport/registry.h"

#include "transport/fabric/fabric_transport.h"
#include "transport/ipc/ipc_transport.h"
#include "transport/netplugin/netplugin_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace tether::transport {

std::vector<std::unique_ptr<Transport>> make_transports(Host* host) {
  std::vector<std::unique_ptr<Transport>> all;
  all.push_back(std::make_unique<TcpTransport>(host));
  all.push_back(std::make_unique<NetpluginTransport>(host));
  all.push_back(std::make_unique<IpcTransport>(host));
  all.push_back(make_fabric_transport(host));
  return all;
}

}  // namespace tether::transport
