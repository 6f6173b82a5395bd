#include "tether/config.h"

#include <cstdlib>
#include <string>
#include <thread>
#include <algorithm>

namespace tether {
namespace {

template <typename T>
void env_uint(const char* name, T& field) {
  if (const char* v = std::getenv(name); v && *v) field = static_cast<T>(std::strtoull(v, nullptr, 0));
}
void env_str(const char* name, std::string& field) {
  if (const char* v = std::getenv(name)) field = v;
}

}  // namespace

uint32_t default_channels() {
  const unsigned n = std::thread::hardware_concurrency();
  return std::clamp<uint32_t>(n / 2, 4, 16);
}

// A thread woken from sleep costs tens to hundreds of microseconds on the H200 hosts (lone ipc
// transfers: ~250 us on lanes left idle, 17 us on a busy one), more than an NVLink copy of several
// MiB; spinning pays only where cores are plentiful, as CUDA's own default scheduling assumes.
uint32_t default_busy_poll_us() { return std::thread::hardware_concurrency() >= 8 ? 1000 : 0; }

Config Config::from_env() {
  Config c;
  env_str("TETHER_HOST", c.host);
  env_uint("TETHER_PORT", c.port);
  env_uint("TETHER_CHANNELS", c.channels);
  env_uint("TETHER_SOCKETS_PER_CHANNEL", c.sockets_per_channel);
  env_uint("TETHER_CHUNK_BYTES", c.chunk_bytes);
  env_uint("TETHER_WINDOW", c.window);
  env_uint("TETHER_SOCKET_BUFFER", c.socket_buffer);
  env_uint("TETHER_CONNECT_TIMEOUT_MS", c.connect_timeout_ms);
  env_uint("TETHER_PEER_TIMEOUT_MS", c.peer_timeout_ms);
  env_uint("TETHER_HEARTBEAT_MS", c.heartbeat_ms);
  env_uint("TETHER_HANDSHAKE_TIMEOUT_MS", c.handshake_timeout_ms);
  env_uint("TETHER_SPIN_US", c.spin_us);
  env_uint("TETHER_BUSY_POLL_US", c.busy_poll_us);
  env_str("TETHER_AUTH_TOKEN", c.auth_token);
  env_str("TETHER_NAME", c.name);
  env_str("TETHER_TRANSPORT", c.transport);
  env_str("TETHER_NET_PLUGIN", c.net_plugin);
  env_uint("TETHER_NET_COMMS", c.net_comms);
  env_str("TETHER_NET_BINDINGS", c.net_bindings);
  env_str("TETHER_UNPACK", c.unpack);
  env_str("TETHER_NICS", c.nics);
  env_str("TETHER_CONTROL_NIC", c.control_nic);
  env_str("TETHER_TX_CPUS", c.tx_cpus);
  env_str("TETHER_RX_CPUS", c.rx_cpus);
  env_uint("TETHER_PIN_THREADS", c.pin_threads);
  env_uint("TETHER_LANE_TIMEOUT_MS", c.lane_timeout_ms);
  env_uint("TETHER_DEREGISTER_TIMEOUT_MS", c.deregister_timeout_ms);
  env_uint("TETHER_NOTIFY_MAX_BYTES", c.notify_max_bytes);
  env_uint("TETHER_NOTIFY_QUEUE_PEER_BYTES", c.notify_queue_peer_bytes);
  env_uint("TETHER_NOTIFY_QUEUE_BYTES", c.notify_queue_bytes);
  env_uint("TETHER_DISABLE_IPC", c.disable_ipc);
  env_str("TETHER_IPC_HOST", c.ipc_host);
  env_uint("TETHER_IPC_GPU_CHUNK_BYTES", c.ipc_gpu_chunk_bytes);
  env_str("TETHER_LIBFABRIC_SO", c.fabric_library);
  env_str("TETHER_FABRIC_PROVIDER", c.fabric_provider);
  env_str("TETHER_FABRIC_DOMAINS", c.fabric_domains);
  env_uint("TETHER_FABRIC_RAILS", c.fabric_rails);
  env_uint("TETHER_FABRIC_DELIVERY_COMPLETE", c.fabric_delivery_complete);
  env_uint("TETHER_FABRIC_BUSY_POLL", c.fabric_busy_poll);
  return c;
}

}  // namespace tether
