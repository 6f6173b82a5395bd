// Every knob of an Endpoint. The option table in src/core/config.cc (kOptions) is the one list of
// keywords, TETHER_* variables, kinds and help lines; every other view (Python, NIXL, README, `tether
// doctor`) comes from it. Defaults: docs/PERFORMANCE.md, "Defaults and why".
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tether/status.h"

namespace tether {

// Defaults that depend on the machine: progress threads = half the CPUs, 4 to 16; busy polling 1000 µs
// where there are 8 or more CPUs, else 0 (spinning pays only where cores are plentiful: docs/PERFORMANCE.md).
uint32_t default_channels();
uint32_t default_busy_poll_us();

// Fields named *_ms hold milliseconds (their keywords count seconds); *_us microseconds.
struct Config {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  uint32_t channels = default_channels();
  uint64_t chunk_bytes = 1 << 20;
  uint32_t window = 32;
  uint32_t socket_buffer = 4 << 20;
  uint32_t connect_timeout_ms = 5000;
  uint32_t peer_timeout_ms = 10000;
  uint32_t heartbeat_ms = 1000;
  uint32_t handshake_timeout_ms = 2000;
  // Waiting (docs/ARCHITECTURE.md, "Waking up").
  uint32_t busy_poll_us = default_busy_poll_us();
  std::string auth_token;
  std::string name;
  std::string unpack;  // "" = kernel when built, else d2d
  std::string transport = "auto";
  // netplugin transport (docs/NETPLUGIN.md)
  std::string net_plugin;
  uint32_t net_comms = 0;
  std::string net_bindings;
  // Many NICs (docs/ARCHITECTURE.md, "NICs, lanes and threads")
  std::string nics;
  std::string control_nic;
  std::string tx_cpus;
  std::string rx_cpus;
  uint32_t pin_threads = 1;
  // What a peer may leave unread here (docs/RELIABILITY.md, "The attacks, before and after")
  uint32_t notify_max_bytes = 1 << 20;
  uint64_t notify_queue_peer_bytes = 16ull << 20;
  uint64_t notify_queue_bytes = 64ull << 20;
  // docs/RELIABILITY.md, "The promise in a long-running, elastic fleet"
  uint32_t deregister_timeout_ms = 1000;
  uint32_t lane_timeout_ms = 5000;
  // ipc transport
  bool disable_ipc = false;
  std::string ipc_host = "auto";
  uint64_t ipc_one_sided_bytes = 64 << 10;  // docs/ARCHITECTURE.md, "One-sided small ops"
  uint64_t ipc_gpu_chunk_bytes = 256 << 20;
  // fabric transport (docs/FABRIC.md)
  std::string fabric_library;
  std::string fabric_provider;
  std::string fabric_domains;
  uint32_t fabric_rails = 0;
  uint32_t fabric_busy_poll = 0;
  uint32_t fabric_delivery_complete = 1;

  // Defaults overridden by the TETHER_* variables set and not empty, parsed as set() parses its keyword
  // (*_MS variables count milliseconds); a bad value is kInvalidArgument naming the variable.
  static Result<Config> from_env();
  // The process-wide knobs (environment only: TETHER_TRACE, ...) checked the same way.
  static Status check_process_env();
  // Sets one option by the name Python's tether.Endpoint(...) keyword has ("channels", "peer_timeout"
  // in seconds, ...), from its text: kInvalidArgument names the option and what was wrong.
  Status set(std::string_view option, std::string_view value);
  // The option's value as set() takes it (seconds for timeouts); "" for an unknown name.
  std::string get(std::string_view option) const;
  // Every option name set() accepts, in declaration order.
  static std::vector<std::string> option_names();
  // The option table, a row per knob: keyword ("" for a process-wide one), variable, kind, default here,
  // allowed values (choice), help line, what its variable accepts, and the variable's text if set.
  struct OptionInfo {
    std::string keyword, env, kind, default_value, choices, help, accepts, env_value;
  };
  static std::vector<OptionInfo> options();
};

}  // namespace tether
