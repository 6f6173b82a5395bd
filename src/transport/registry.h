// The one list of transports an endpoint owns.
#pragma once
#include <memory>
#include <vector>

#include "transport/host.h"
#include "transport/transport.h"

namespace tether::transport {

// Every transport this build knows, usable or not (unavailable_reason() says which).
std::vector<std::unique_ptr<Transport>> make_transports(Host* host);

}  // namespace tether::transport
