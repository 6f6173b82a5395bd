// Every knob of an Endpoint. Each field has a TETHER_* environment override, applied by
// Config::from_env() on top of the defaults (explicit options win over both). The option table with a
// help line per knob is in src/core/config.cc (Config::options()).
// Defaults are the measured ones recorded in docs/PERFORMANCE.md, "Defaults and why".
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tether/status.h"

namespace tether {

// Progress threads (channels) by default: half the CPUs, at least 4, at most 16. Measured: 4 is best on
// 2 cores, 16 on a 32-core GPU host (docs/PERFORMANCE.md, "Defaults and why").
uint32_t default_channels();
uint32_t default_busy_poll_us();

struct Config {
  std::string host = "127.0.0.1";   // TETHER_HOST: listen address ("0.0.0.0" for every interface)
  uint16_t port = 0;                // TETHER_PORT: 0 = ephemeral
  uint32_t channels = default_channels();            // TETHER_CHANNELS: progress threads; lanes per peer = channels x sockets
  uint32_t sockets_per_channel = 1; // TETHER_SOCKETS_PER_CHANNEL
  uint64_t chunk_bytes = 1 << 20;   // TETHER_CHUNK_BYTES: unit of pipelining and scheduling
  uint32_t window = 32;             // TETHER_WINDOW: chunks in flight (un-acknowledged) per peer
  uint32_t socket_buffer = 4 << 20; // TETHER_SOCKET_BUFFER: SO_SNDBUF/SO_RCVBUF bytes, 0 = kernel default
  uint32_t connect_timeout_ms = 5000;  // TETHER_CONNECT_TIMEOUT_MS
  uint32_t peer_timeout_ms = 10000;    // TETHER_PEER_TIMEOUT_MS: silence after which a peer is dead
  uint32_t heartbeat_ms = 1000;        // TETHER_HEARTBEAT_MS
  uint32_t handshake_timeout_ms = 2000;// TETHER_HANDSHAKE_TIMEOUT_MS: unfinished handshakes are dropped
  uint32_t spin_us = 50;            // TETHER_SPIN_US: wait() on a small transfer spins this long before sleeping
  uint32_t busy_poll_us = default_busy_poll_us();  // TETHER_BUSY_POLL_US: wait() on any transfer, and an ipc lane
                                    // after each message, spins this long before sleeping (0 = never); default
                                    // 1000 on a machine of 8 or more CPUs, else 0 (docs/ARCHITECTURE.md, "Waking up")
  uint32_t staging_nap_us = 8;      // TETHER_STAGING_NAP_US: a tcp progress thread whose lanes wait only on staged
                                    // GPU copies sleeps this long between polls of them (0 = spins; ARCHITECTURE.md)
  uint32_t wait_nap_us = 20;        // TETHER_WAIT_NAP_US: where busy_poll_us > 0, wait() on a tcp read of 4 MiB or
                                    // more sleeps in timed naps of this long instead of spinning, and on any other
                                    // tcp transfer that large sleeps at once (0 = both spin)
  std::string auth_token;           // TETHER_AUTH_TOKEN: shared secret; empty = no authentication
  std::string name;                 // TETHER_NAME: shown to peers; default "host:pid"
  std::string unpack;               // TETHER_UNPACK: kernel, d2d or host; empty = kernel when built, else d2d
  std::string transport = "auto";   // TETHER_TRANSPORT: auto (best both sides offer), tcp, ipc, fabric, netplugin
  // netplugin transport (docs/NETPLUGIN.md)
  std::string net_plugin;           // TETHER_NET_PLUGIN: path of an NCCL net plugin (e.g. the TCPX libnccl-net.so)
  uint32_t net_comms = 0;           // TETHER_NET_COMMS: lanes (send+recv comm pairs) per peer; 0 = one per plugin device, at least 2
  std::string net_bindings;         // TETHER_NET_BINDINGS: "nic:cpus;nic:cpus" pins the thread serving each plugin device
  // Many NICs (docs/ARCHITECTURE.md, "NICs, lanes and threads").
  std::string nics;                 // TETHER_NICS: data NICs in order, "eth1,eth2"; empty = every NIC that is up, ranked
  std::string control_nic;          // TETHER_CONTROL_NIC: NIC of the control connection; empty = the listen/target address
  std::string tx_cpus;              // TETHER_TX_CPUS: "eth1:8-21;eth2:22-35" CPUs of the progress threads serving a NIC
  std::string rx_cpus;              // TETHER_RX_CPUS: same form; a progress thread drives both directions (union)
  uint32_t pin_threads = 1;         // TETHER_PIN_THREADS: 0 = never pin; 1 = pin to CPUs local to the thread's NIC
  // Notifications a peer may leave unread here (docs/RELIABILITY.md, "The attacks, before and after"): one is at most
  // notify_max_bytes (peers learn it at connect and refuse larger ones before sending); what is queued
  // unread is bounded per peer and for the endpoint (each notification counts its bytes + 64). Over a
  // queue limit the sender's transfer fails with ResourceExhausted; nothing is dropped silently.
  uint32_t notify_max_bytes = 1 << 20;            // TETHER_NOTIFY_MAX_BYTES: at most 1 MiB
  uint64_t notify_queue_peer_bytes = 16ull << 20; // TETHER_NOTIFY_QUEUE_PEER_BYTES: unread, from one peer
  uint64_t notify_queue_bytes = 64ull << 20;      // TETHER_NOTIFY_QUEUE_BYTES: unread, from all peers together
  // deregister() waits for accesses in flight; over ipc a peer reading a region copies it itself and
  // holds it until it says it is done: a peer whose process is stopped is disconnected at once, any
  // other still holding it after this long too (docs/RELIABILITY.md, "The promise in a long-running, elastic fleet").
  uint32_t deregister_timeout_ms = 1000;  // TETHER_DEREGISTER_TIMEOUT_MS
  uint32_t lane_timeout_ms = 5000;  // TETHER_LANE_TIMEOUT_MS: unacknowledged data this long kills a lane (its chunks move)
  bool disable_ipc = false;         // TETHER_DISABLE_IPC=1: never offer ipc (same-host peers use tcp)
  std::string ipc_host = "auto";    // TETHER_IPC_HOST: host memory over ipc: auto (cross-memory attach
                                    // where the kernel allows it, else shared memory), cma (only), shm
  uint64_t ipc_one_sided_bytes = 64 << 10;  // TETHER_IPC_ONE_SIDED_BYTES: writes and reads up to this size of a
                                            // descriptor the target granted are moved by the initiator
                                            // itself, no message (docs/ARCHITECTURE.md, "One-sided small ops"); 0 = off
  uint64_t ipc_gpu_chunk_bytes = 256 << 20;  // TETHER_IPC_GPU_CHUNK_BYTES: chunk size over ipc when both ends are
                                            // GPU memory (measured on H200 NVLink: docs/PERFORMANCE.md, "Defaults and why")
  // fabric transport (libfabric, loaded at run time)
  std::string fabric_library;       // TETHER_LIBFABRIC_SO: path of libfabric; "" = the system's libfabric.so.1
  std::string fabric_provider;      // TETHER_FABRIC_PROVIDER: cxi, efa, verbs, tcp, shm; "" = auto (cxi, efa, verbs, tcp)
  std::string fabric_domains;       // TETHER_FABRIC_DOMAINS: comma-separated domains (NICs) to use; "" = all
  uint32_t fabric_rails = 0;        // TETHER_FABRIC_RAILS: at most this many rails (domains); 0 = all
  uint32_t fabric_busy_poll = 0;    // TETHER_FABRIC_BUSY_POLL: 1 = progress threads never sleep in the CQ
                                    // (always on for shm, whose CQ wait does not see its peers)
  uint32_t fabric_delivery_complete = 1;  // TETHER_FABRIC_DELIVERY_COMPLETE: 0 = never ask it (writes then
                                          // end with a one-byte flush read; for providers and tests)

  // Defaults overridden by the TETHER_* variables that are set and not empty, each parsed as its keyword
  // is by set() (sizes with K/M/G units, booleans, durations; *_MS variables count milliseconds). A value
  // its option does not accept is kInvalidArgument naming the variable, its value and what it accepts.
  static Result<Config> from_env();
  // The process-wide knobs (environment only: TETHER_TRACE, TETHER_KERNEL_STAGING, ...) checked the
  // same way; Endpoint::create calls it.
  static Status check_process_env();
  // Sets one option by the name Python's tether.Endpoint(...) keyword has ("channels", "peer_timeout"
  // in seconds, ...), from its text: kInvalidArgument names the option and what was wrong.
  Status set(std::string_view option, std::string_view value);
  // The option's value as set() takes it (seconds for timeouts); "" for an unknown name.
  std::string get(std::string_view option) const;
  // Every option name set() accepts, in declaration order.
  static std::vector<std::string> option_names();
  // The option table: every knob, with its keyword ("" for a process-wide one), variable, kind (text,
  // choice, bool, count, size, seconds, microseconds), default here, allowed values (choice), help line,
  // and what its variable accepts.
  struct OptionInfo {
    std::string keyword, env, kind, default_value, choices, help, accepts;
  };
  static std::vector<OptionInfo> options();
};

}  // namespace tether
