#include "transport/registry.h"

#include "core/endpoint_impl.h"  // EndpointImpl is the transports' Host

#include "transport/netplugin/netplugin_transport.h"
#include "transport/ipc/ipc_transport.h"
#include "transport/fabric/fabric_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace tether::transport {

std::vector<std::unique_ptr<Transport>> make_transports(core::EndpointImpl* endpoint) {
  std::vector<std::unique_ptr<Transport>> all;
  all.push_back(std::make_unique<TcpTransport>(endpoint));
  all.push_back(std::make_unique<NetpluginTransport>(endpoint));
  all.push_back(std::make_unique<IpcTransport>(endpoint));
  all.push_back(make_fabric_transport(endpoint));
  return all;
}

}  // namespace tether::transport
