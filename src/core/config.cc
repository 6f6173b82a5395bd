#include "tether/config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <thread>
#include <variant>

namespace tether {
namespace {

// One option: its keyword (Python's tether.Endpoint, NIXL backend parameters), its environment
// variable and its field. Keywords of *_ms fields take seconds, as Python's do; variables milliseconds.
using Field = std::variant<std::string Config::*, uint16_t Config::*, uint32_t Config::*, uint64_t Config::*,
                           bool Config::*>;
struct Option {
  const char* keyword;
  const char* env;
  Field field;
  bool seconds = false;
};

const Option kOptions[] = {
    {"host", "TETHER_HOST", &Config::host},
    {"port", "TETHER_PORT", &Config::port},
    {"channels", "TETHER_CHANNELS", &Config::channels},
    {"sockets_per_channel", "TETHER_SOCKETS_PER_CHANNEL", &Config::sockets_per_channel},
    {"chunk_bytes", "TETHER_CHUNK_BYTES", &Config::chunk_bytes},
    {"window", "TETHER_WINDOW", &Config::window},
    {"socket_buffer", "TETHER_SOCKET_BUFFER", &Config::socket_buffer},
    {"connect_timeout", "TETHER_CONNECT_TIMEOUT_MS", &Config::connect_timeout_ms, true},
    {"peer_timeout", "TETHER_PEER_TIMEOUT_MS", &Config::peer_timeout_ms, true},
    {"heartbeat", "TETHER_HEARTBEAT_MS", &Config::heartbeat_ms, true},
    {"handshake_timeout", "TETHER_HANDSHAKE_TIMEOUT_MS", &Config::handshake_timeout_ms, true},
    {"spin_us", "TETHER_SPIN_US", &Config::spin_us},
    {"busy_poll_us", "TETHER_BUSY_POLL_US", &Config::busy_poll_us},
    {"staging_nap_us", "TETHER_STAGING_NAP_US", &Config::staging_nap_us},
    {"wait_nap_us", "TETHER_WAIT_NAP_US", &Config::wait_nap_us},
    {"auth_token", "TETHER_AUTH_TOKEN", &Config::auth_token},
    {"name", "TETHER_NAME", &Config::name},
    {"unpack", "TETHER_UNPACK", &Config::unpack},
    {"transport", "TETHER_TRANSPORT", &Config::transport},
    {"net_plugin", "TETHER_NET_PLUGIN", &Config::net_plugin},
    {"net_comms", "TETHER_NET_COMMS", &Config::net_comms},
    {"net_bindings", "TETHER_NET_BINDINGS", &Config::net_bindings},
    {"nics", "TETHER_NICS", &Config::nics},
    {"control_nic", "TETHER_CONTROL_NIC", &Config::control_nic},
    {"tx_cpus", "TETHER_TX_CPUS", &Config::tx_cpus},
    {"rx_cpus", "TETHER_RX_CPUS", &Config::rx_cpus},
    {"pin_threads", "TETHER_PIN_THREADS", &Config::pin_threads},
    {"lane_timeout", "TETHER_LANE_TIMEOUT_MS", &Config::lane_timeout_ms, true},
    {"deregister_timeout", "TETHER_DEREGISTER_TIMEOUT_MS", &Config::deregister_timeout_ms, true},
    {"notify_max_bytes", "TETHER_NOTIFY_MAX_BYTES", &Config::notify_max_bytes},
    {"notify_queue_peer_bytes", "TETHER_NOTIFY_QUEUE_PEER_BYTES", &Config::notify_queue_peer_bytes},
    {"notify_queue_bytes", "TETHER_NOTIFY_QUEUE_BYTES", &Config::notify_queue_bytes},
    {"disable_ipc", "TETHER_DISABLE_IPC", &Config::disable_ipc},
    {"ipc_host", "TETHER_IPC_HOST", &Config::ipc_host},
    {"ipc_gpu_chunk_bytes", "TETHER_IPC_GPU_CHUNK_BYTES", &Config::ipc_gpu_chunk_bytes},
    {"ipc_one_sided_bytes", "TETHER_IPC_ONE_SIDED_BYTES", &Config::ipc_one_sided_bytes},
    {"fabric_library", "TETHER_LIBFABRIC_SO", &Config::fabric_library},
    {"fabric_provider", "TETHER_FABRIC_PROVIDER", &Config::fabric_provider},
    {"fabric_domains", "TETHER_FABRIC_DOMAINS", &Config::fabric_domains},
    {"fabric_rails", "TETHER_FABRIC_RAILS", &Config::fabric_rails},
    {"fabric_busy_poll", "TETHER_FABRIC_BUSY_POLL", &Config::fabric_busy_poll},
    {"fabric_delivery_complete", "TETHER_FABRIC_DELIVERY_COMPLETE", &Config::fabric_delivery_complete},
};

// Strict: the whole text must be a number in the field's range.
template <typename T>
bool parse_uint(std::string_view text, T* out) {
  if (text.empty() || text.size() > 24) return false;
  const std::string s(text);
  if (!std::isdigit(static_cast<unsigned char>(s[0]))) return false;  // strtoull would take "-1" and " 1"
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 0);
  if (errno != 0 || *end != '\0' || v > std::numeric_limits<T>::max()) return false;
  *out = static_cast<T>(v);
  return true;
}

bool parse_bool(std::string_view text, bool* out) {
  if (text == "1" || text == "true" || text == "True" || text == "yes") return *out = true, true;
  if (text == "0" || text == "false" || text == "False" || text == "no") return *out = false, true;
  return false;
}

// Seconds (a decimal number) into whole milliseconds.
bool parse_seconds_ms(std::string_view text, uint32_t* out) {
  if (text.empty() || text.size() > 24) return false;
  const std::string s(text);
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (*end != '\0' || !std::isfinite(v) || v < 0 || v * 1000.0 > double(std::numeric_limits<uint32_t>::max())) return false;
  *out = static_cast<uint32_t>(std::llround(v * 1000.0));
  return true;
}

// Environment variables keep their historic leniency (strtoull, milliseconds for *_MS).
void apply_env(Config& c, const Option& o) {
  const char* v = std::getenv(o.env);
  if (!v) return;
  std::visit([&](auto member) {
    using T = std::remove_reference_t<decltype(c.*member)>;
    if constexpr (std::is_same_v<T, std::string>) {
      c.*member = v;
    } else if (*v) {
      c.*member = static_cast<T>(std::strtoull(v, nullptr, 0));
    }
  }, o.field);
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
  for (const Option& o : kOptions) apply_env(c, o);
  return c;
}

std::vector<std::string> Config::option_names() {
  std::vector<std::string> out;
  for (const Option& o : kOptions) out.emplace_back(o.keyword);
  return out;
}

std::string Config::get(std::string_view option) const {
  for (const Option& o : kOptions) {
    if (option != o.keyword) continue;
    return std::visit([&](auto member) -> std::string {
      using T = std::remove_cvref_t<decltype(this->*member)>;
      if constexpr (std::is_same_v<T, std::string>) {
        return this->*member;
      } else if constexpr (std::is_same_v<T, bool>) {
        return this->*member ? "1" : "0";
      } else if (o.seconds) {
        std::string s = std::to_string(double(this->*member) / 1000.0);
        s.erase(s.find_last_not_of('0') + 1);  // "2.500000" -> "2.5", "5.000000" -> "5."
        if (s.back() == '.') s.pop_back();
        return s;
      } else {
        return std::to_string(this->*member);
      }
    }, o.field);
  }
  return {};
}

Status Config::set(std::string_view option, std::string_view value) {
  const Option* o = nullptr;
  for (const Option& x : kOptions)
    if (option == x.keyword) o = &x;
  if (!o) return Status(Code::kInvalidArgument, "unknown option '" + std::string(option) + "'");
  bool ok = false;
  const char* expected = "";
  std::visit([&](auto member) {
    using T = std::remove_cvref_t<decltype(this->*member)>;
    if constexpr (std::is_same_v<T, std::string>) {
      this->*member = std::string(value);
      ok = true;
    } else if constexpr (std::is_same_v<T, bool>) {
      ok = parse_bool(value, &(this->*member));
      expected = "0/1 or true/false";
    } else if constexpr (std::is_same_v<T, uint32_t>) {
      ok = o->seconds ? parse_seconds_ms(value, &(this->*member)) : parse_uint(value, &(this->*member));
      expected = o->seconds ? "a number of seconds" : "a non-negative integer";
    } else {
      ok = parse_uint(value, &(this->*member));
      expected = "a non-negative integer in range";
    }
  }, o->field);
  if (!ok)
    return Status(Code::kInvalidArgument,
                  "option " + std::string(option) + ": expected " + expected + ", got '" + std::string(value) + "'");
  return Status::ok();
}

}  // namespace tether
