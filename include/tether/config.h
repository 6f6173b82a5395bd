// Every knob of an Endpoint. Each field has a TETHER_* environment override,
// applied by Config::from_env() on top of the defaults (explicit options win over both).
// Defaults are the measured ones recorded in docs/PERFORMANCE.md.
#pragma once
#include <cstdint>
#include <string>

namespace tether {

struct Config {
  std::string host = "127.0.0.1";   // TETHER_HOST: listen address ("0.0.0.0" for every interface)
  uint16_t port = 0;                // TETHER_PORT: 0 = ephemeral
  uint32_t channels = 4;            // TETHER_CHANNELS: progress threads; lanes per peer = channels x sockets
  uint32_t sockets_per_channel = 1; // TETHER_SOCKETS_PER_CHANNEL
  uint64_t chunk_bytes = 1 << 20;   // TETHER_CHUNK_BYTES: unit of pipelining and scheduling
  uint32_t window = 32;             // TETHER_WINDOW: chunks in flight (un-acknowledged) per peer
  uint32_t socket_buffer = 4 << 20; // TETHER_SOCKET_BUFFER: SO_SNDBUF/SO_RCVBUF bytes, 0 = kernel default
  uint32_t connect_timeout_ms = 5000;  // TETHER_CONNECT_TIMEOUT_MS
  uint32_t peer_timeout_ms = 10000;    // TETHER_PEER_TIMEOUT_MS: silence after which a peer is dead
  uint32_t heartbeat_ms = 1000;        // TETHER_HEARTBEAT_MS
  uint32_t handshake_timeout_ms = 2000;// TETHER_HANDSHAKE_TIMEOUT_MS: unfinished handshakes are dropped
  uint32_t spin_us = 50;            // TETHER_SPIN_US: wait() on a small transfer spins this long before sleeping
  std::string auth_token;           // TETHER_AUTH_TOKEN: shared secret; empty = no authentication
  std::string name;                 // TETHER_NAME: shown to peers; default "host:pid"
  std::string transport = "auto";   // TETHER_TRANSPORT: auto (best both sides offer), tcp, ipc, fabric, netplugin
  // fabric transport (libfabric, loaded at run time)
  std::string fabric_library;       // TETHER_LIBFABRIC_SO: path of libfabric; "" = the system's libfabric.so.1
  std::string fabric_provider;      // TETHER_FABRIC_PROVIDER: cxi, efa, verbs, tcp, shm; "" = auto (cxi, efa, verbs, tcp)
  std::string fabric_domains;       // TETHER_FABRIC_DOMAINS: comma-separated domains (NICs) to use; "" = all
  uint32_t fabric_rails = 0;        // TETHER_FABRIC_RAILS: at most this many rails (domains); 0 = all
  uint32_t fabric_busy_poll = 0;    // TETHER_FABRIC_BUSY_POLL: 1 = progress threads never sleep in the CQ
                                    // (always on for shm, whose CQ wait does not see its peers)
  uint32_t fabric_delivery_complete = 1;  // TETHER_FABRIC_DELIVERY_COMPLETE: 0 = never ask it (writes then
                                          // end with a one-byte flush read; for providers and tests)

  // Defaults overridden by TETHER_* variables that are set.
  static Config from_env();
};

}  // namespace tether
