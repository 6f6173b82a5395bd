#include "tether/config.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <variant>

#include "sys/env.h"

namespace tether {
namespace {

// What a value is, and so which parser reads it (sys/env.h). kSeconds fields hold milliseconds: their
// keyword counts seconds (as Python's does), their *_MS variable milliseconds; both take "ms"/"s" units.
enum class Kind { kText, kChoice, kBool, kCount, kSize, kSeconds, kMicros };

using Field = std::variant<std::monostate, std::string Config::*, uint16_t Config::*, uint32_t Config::*,
                           uint64_t Config::*, bool Config::*>;

// One knob (keyword nullptr: a process-wide knob, environment only).
struct Option {
  const char* keyword;
  const char* env;
  Field field;
  Kind kind;
  const char* help;
  const char* choices = nullptr;  // kChoice: the values, comma-separated ("" = the default, always)
  const char* fallback = "";      // process-wide knobs: the default
};

using C = Config;
constexpr Option kOptions[] = {
    {"host", "TETHER_HOST", &C::host, Kind::kText,
     "listen address; 0.0.0.0 to accept peers on every NIC and stripe lanes over every NIC pair"},
    {"port", "TETHER_PORT", &C::port, Kind::kCount, "listen port, for an address peers know in advance; 0 = ephemeral"},
    {"channels", "TETHER_CHANNELS", &C::channels, Kind::kCount,
     "progress threads: more drive more lanes on a many-core host, fewer leave cores to the application; "
     "lanes per peer = channels (default: half the CPUs, 4 to 16)"},
    {"chunk_bytes", "TETHER_CHUNK_BYTES", &C::chunk_bytes, Kind::kSize,
     "unit of pipelining and scheduling: larger costs less per byte, smaller overlaps sooner"},
    {"window", "TETHER_WINDOW", &C::window, Kind::kCount,
     "chunks in flight (unacknowledged) per peer; raise for a link with a long round trip"},
    {"socket_buffer", "TETHER_SOCKET_BUFFER", &C::socket_buffer, Kind::kSize,
     "SO_SNDBUF/SO_RCVBUF of each data socket; raise for a long fast link; 0 = the kernel autotunes"},
    {"connect_timeout", "TETHER_CONNECT_TIMEOUT_MS", &C::connect_timeout_ms, Kind::kSeconds,
     "connect() gives up after this long; raise for a peer that starts slowly"},
    {"peer_timeout", "TETHER_PEER_TIMEOUT_MS", &C::peer_timeout_ms, Kind::kSeconds,
     "a peer silent this long is declared dead: lower to fail over sooner, raise for peers that stall"},
    {"heartbeat", "TETHER_HEARTBEAT_MS", &C::heartbeat_ms, Kind::kSeconds,
     "interval of keep-alive messages; keep it well below peer_timeout and any firewall's idle timeout"},
    {"handshake_timeout", "TETHER_HANDSHAKE_TIMEOUT_MS", &C::handshake_timeout_ms, Kind::kSeconds,
     "unfinished incoming handshakes are dropped after this long, so a stalled client holds nothing"},
    {"busy_poll_us", "TETHER_BUSY_POLL_US", &C::busy_poll_us, Kind::kMicros,
     "wait() on any transfer, and an ipc lane after each message, spins this long before sleeping: latency "
     "for CPU; 0 where cores are scarce (default 1000 on 8 or more CPUs, else 0)"},
    {"auth_token", "TETHER_AUTH_TOKEN", &C::auth_token, Kind::kText,
     "shared secret peers must prove they hold, where others can reach the port; empty = no authentication"},
    {"name", "TETHER_NAME", &C::name, Kind::kText, "name peers see in their logs and notifications; empty = host:pid"},
    {"unpack", "TETHER_UNPACK", &C::unpack, Kind::kChoice,
     "how received GPU chunks are unpacked; d2d or host to rule out the kernel; empty = kernel when built, else d2d",
     "kernel,d2d,host"},
    {"transport", "TETHER_TRANSPORT", &C::transport, Kind::kChoice,
     "a transport to insist on (to compare, or to fail rather than fall back); auto = the best both sides offer",
     "auto,tcp,ipc,fabric,netplugin"},
    {"net_plugin", "TETHER_NET_PLUGIN", &C::net_plugin, Kind::kText,
     "path of an NCCL net plugin, to run over its network (e.g. TCPX) as the netplugin transport (docs/NETPLUGIN.md)"},
    {"net_comms", "TETHER_NET_COMMS", &C::net_comms, Kind::kCount,
     "netplugin lanes per peer, more to fill a device's bandwidth; 0 = one per plugin device, at least 2"},
    {"net_bindings", "TETHER_NET_BINDINGS", &C::net_bindings, Kind::kText,
     "\"nic:cpus;nic:cpus\": CPUs of the thread serving each netplugin device, to keep it beside its NIC"},
    {"nics", "TETHER_NICS", &C::nics, Kind::kText,
     "data NICs in order, \"eth1,eth2\", to keep tether off some; empty = every NIC that is up"},
    {"control_nic", "TETHER_CONTROL_NIC", &C::control_nic, Kind::kText,
     "NIC of the control connection, to keep it off the data NICs; empty = that of the listen or target address"},
    {"tx_cpus", "TETHER_TX_CPUS", &C::tx_cpus, Kind::kText,
     "\"eth1:8-21;eth2:22-35\": CPUs of the progress threads serving each NIC, to keep them off the application's"},
    {"rx_cpus", "TETHER_RX_CPUS", &C::rx_cpus, Kind::kText, "same form as tx_cpus; a thread drives both directions"},
    {"pin_threads", "TETHER_PIN_THREADS", &C::pin_threads, Kind::kBool,
     "pin progress threads to CPUs local to their NIC; off where the application places its own threads"},
    {"lane_timeout", "TETHER_LANE_TIMEOUT_MS", &C::lane_timeout_ms, Kind::kSeconds,
     "data unacknowledged this long kills a lane and its chunks move to the others: lower to leave a stalled NIC sooner"},
    {"deregister_timeout", "TETHER_DEREGISTER_TIMEOUT_MS", &C::deregister_timeout_ms, Kind::kSeconds,
     "an ipc peer still holding a region this long after deregister() is disconnected: bounds deregister()"},
    {"notify_max_bytes", "TETHER_NOTIFY_MAX_BYTES", &C::notify_max_bytes, Kind::kSize,
     "largest notification accepted, at most 1 MiB: raise for larger messages, lower to bound peers"},
    {"notify_queue_peer_bytes", "TETHER_NOTIFY_QUEUE_PEER_BYTES", &C::notify_queue_peer_bytes, Kind::kSize,
     "unread notifications kept from one peer (beyond, its sends fail): memory one peer can hold here"},
    {"notify_queue_bytes", "TETHER_NOTIFY_QUEUE_BYTES", &C::notify_queue_bytes, Kind::kSize,
     "unread notifications kept from all peers together: memory they can hold here"},
    {"disable_ipc", "TETHER_DISABLE_IPC", &C::disable_ipc, Kind::kBool,
     "never offer ipc; same-host peers use tcp (to measure tcp on one host, or where processes must not share memory)"},
    {"ipc_host", "TETHER_IPC_HOST", &C::ipc_host, Kind::kChoice,
     "host memory over ipc: cma (cross-memory attach; fail if refused), shm, or auto (cma where the kernel allows it)",
     "auto,cma,shm"},
    {"ipc_gpu_chunk_bytes", "TETHER_IPC_GPU_CHUNK_BYTES", &C::ipc_gpu_chunk_bytes, Kind::kSize,
     "chunk size over ipc when both ends are GPU memory; smaller spreads a transfer over more lanes"},
    {"ipc_one_sided_bytes", "TETHER_IPC_ONE_SIDED_BYTES", &C::ipc_one_sided_bytes, Kind::kSize,
     "ipc writes and reads up to this size of a granted descriptor, and batches of GPU blocks in one, are moved "
     "by the initiator itself, sooner than a request; 0 = off"},
    {"fabric_library", "TETHER_LIBFABRIC_SO", &C::fabric_library, Kind::kText,
     "path of libfabric, for a site's own build; empty = the system's libfabric.so.1"},
    {"fabric_provider", "TETHER_FABRIC_PROVIDER", &C::fabric_provider, Kind::kText,
     "libfabric provider (cxi, efa, verbs, tcp, shm) where several work; empty = the first of cxi, efa, verbs, tcp"},
    {"fabric_domains", "TETHER_FABRIC_DOMAINS", &C::fabric_domains, Kind::kText,
     "comma-separated fabric domains (NICs) to use, e.g. to keep a GPU on its own NIC; empty = all"},
    {"fabric_rails", "TETHER_FABRIC_RAILS", &C::fabric_rails, Kind::kCount,
     "at most this many fabric rails, to leave the others to other work; 0 = all"},
    {"fabric_busy_poll", "TETHER_FABRIC_BUSY_POLL", &C::fabric_busy_poll, Kind::kBool,
     "fabric progress threads never sleep in the completion queue: latency for a core each (always on for shm)"},
    {"fabric_delivery_complete", "TETHER_FABRIC_DELIVERY_COMPLETE", &C::fabric_delivery_complete, Kind::kBool,
     "ask the provider for delivery-complete writes; off for one that lacks them: writes end with a one-byte flush read"},
    // Process-wide, environment only: read once by the code they steer.
    {nullptr, "TETHER_TRACE", {}, Kind::kText,
     "file prefix: record every chunk's steps to <prefix>.<pid>.tsv, to see where a transfer's time goes "
     "(bench/tools/trace_report.py)"},
    {nullptr, "TETHER_LIBCUDA_SO", {}, Kind::kText,
     "path of the CUDA driver library, where the loader does not find it; empty = libcuda.so.1"},
    {nullptr, "TETHER_FABRIC_STAGE_HOST", {}, Kind::kBool,
     "test knob: fabric treats host regions like GPU memory on providers without FI_HMEM, so CPU-only tests "
     "cover staging",
     nullptr, "0"},
    {nullptr, "TETHER_NET_FAULT", {}, Kind::kChoice,
     "test fault: netplugin hands receives back before their unpack, to prove the tests catch it", "consume_early"},
};

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kText: return "text";
    case Kind::kChoice: return "choice";
    case Kind::kBool: return "bool";
    case Kind::kCount: return "count";
    case Kind::kSize: return "size";
    case Kind::kSeconds: return "seconds";
    case Kind::kMicros: return "microseconds";
  }
  return "";
}

// The largest value the row's field holds.
uint64_t field_max(const Option& o) {
  return std::visit([](auto member) -> uint64_t {
    using M = decltype(member);
    if constexpr (std::is_same_v<M, std::monostate> || std::is_same_v<M, std::string Config::*>) {
      return 0;
    } else {
      using T = std::remove_cvref_t<decltype(std::declval<Config&>().*member)>;
      return std::numeric_limits<T>::max();
    }
  }, o.field);
}

// "kernel, d2d or host"
std::string choice_list(const char* choices) {
  std::string s;
  for (const char* p = choices; *p; ++p) s += *p == ',' ? std::string(std::strchr(p + 1, ',') ? ", " : " or ") : std::string(1, *p);
  return s;
}

bool is_choice(const char* choices, std::string_view text) {
  std::string_view all(choices);
  for (size_t start = 0; start <= all.size();) {
    const size_t end = std::min(all.find(',', start), all.size());
    if (all.substr(start, end - start) == text) return true;
    start = end + 1;
  }
  return false;
}

// What the row accepts, as the end of "...: expected <this>". `env`: the text came from the variable.
std::string expected(const Option& o, bool env) {
  const uint64_t max = field_max(o);
  switch (o.kind) {
    case Kind::kText: return "text";
    case Kind::kChoice: return choice_list(o.choices);
    case Kind::kBool: return "true or false (or 1/0, yes/no, on/off)";
    case Kind::kCount: return "a whole number from 0 to " + std::to_string(max);
    case Kind::kSize:
      return std::string("a size in bytes") + (max < UINT64_MAX ? " up to " + std::to_string(max) : "") +
             " (e.g. 4194304, 4M, 4MiB)";
    case Kind::kSeconds:
      return env ? "a duration in milliseconds (e.g. 2500, 2500ms, 2.5s)" : "a duration in seconds (e.g. 2.5, 2500ms, 2.5s)";
    case Kind::kMicros: return "a duration in microseconds (e.g. 50, 50us, 0.05ms)";
  }
  return "";
}

// Parses `text` by the row's kind into c's field (if the row has one); false: refused, nothing stored.
bool parse_value(const Option& o, std::string_view text, bool env, Config* c) {
  uint64_t n = 0;
  bool b = false;
  const uint64_t max = field_max(o);
  bool ok = true;
  switch (o.kind) {
    case Kind::kText: break;
    case Kind::kChoice: ok = is_choice(o.choices, text); break;
    case Kind::kBool:
      ok = sys::parse_bool(text, &b);
      n = b;
      break;
    case Kind::kCount: ok = sys::parse_uint(text, max, &n); break;
    case Kind::kSize: ok = sys::parse_size(text, max, &n); break;
    case Kind::kSeconds: ok = sys::parse_duration(text, env ? 1e3 : 1e6, 1e3, max, &n); break;
    case Kind::kMicros: ok = sys::parse_duration(text, 1, 1, max, &n); break;
  }
  if (!ok) return false;
  std::visit([&](auto member) {
    using M = decltype(member);
    if constexpr (std::is_same_v<M, std::string Config::*>) {
      c->*member = std::string(text);
    } else if constexpr (!std::is_same_v<M, std::monostate>) {
      using T = std::remove_cvref_t<decltype(c->*member)>;
      c->*member = static_cast<T>(n);
    }
  }, o.field);
  return true;
}

// The value as the message shows it: one line, bounded.
std::string shown(std::string_view v) {
  std::string s(v.substr(0, 80));
  for (char& ch : s)
    if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) ch = '?';
  return v.size() > 80 ? s + "..." : s;
}

// kInvalidArgument: "TETHER_CHUNK_BYTES='4Q': expected a size in bytes (e.g. 4194304, 4M, 4MiB)".
Status refused(const std::string& what, const Option& o, std::string_view value, bool env) {
  return Status(Code::kInvalidArgument, what + "='" + shown(value) + "': expected " + expected(o, env));
}

const Option* by_env(const char* name) {
  for (const Option& o : kOptions)
    if (std::strcmp(o.env, name) == 0) return &o;
  return nullptr;
}

const Option* by_keyword(std::string_view keyword) {
  for (const Option& o : kOptions)
    if (o.keyword && keyword == o.keyword) return &o;
  return nullptr;
}

// A set, non-empty variable (an empty one counts as unset, as an empty NIXL parameter does).
const char* env_value(const Option& o) {
  const char* v = std::getenv(o.env);
  return v && *v ? v : nullptr;
}

}  // namespace

namespace sys {
// A process-wide knob's text: its variable's if the row accepts it, else the row's default.
std::string env_text(const char* name) {
  const Option* o = by_env(name);
  if (!o) return {};
  const char* v = env_value(*o);
  Config scratch;
  return v && parse_value(*o, v, true, &scratch) ? std::string(v) : std::string(o->fallback);
}
bool env_flag(const char* name) {
  bool b = false;
  return parse_bool(env_text(name), &b) && b;
}
}  // namespace sys

uint32_t default_channels() {
  const unsigned n = std::thread::hardware_concurrency();
  return std::clamp<uint32_t>(n / 2, 4, 16);
}

uint32_t default_busy_poll_us() { return std::thread::hardware_concurrency() >= 8 ? 1000 : 0; }

Result<Config> Config::from_env() {
  Config c;
  for (const Option& o : kOptions) {
    const char* v = env_value(o);
    if (v && !parse_value(o, v, true, &c)) return refused(o.env, o, v, true);
  }
  return c;
}

Status Config::check_process_env() {
  Config scratch;
  for (const Option& o : kOptions) {
    const char* v = o.keyword ? nullptr : env_value(o);
    if (v && !parse_value(o, v, true, &scratch)) return refused(o.env, o, v, true);
  }
  return Status::ok();
}

std::vector<std::string> Config::option_names() {
  std::vector<std::string> out;
  for (const Option& o : kOptions)
    if (o.keyword) out.emplace_back(o.keyword);
  return out;
}

std::vector<Config::OptionInfo> Config::options() {
  const Config defaults;
  std::vector<OptionInfo> out;
  for (const Option& o : kOptions) {
    const char* v = env_value(o);
    out.push_back({o.keyword ? o.keyword : "", o.env, kind_name(o.kind),
                   o.keyword ? defaults.get(o.keyword) : o.fallback, o.choices ? o.choices : "", o.help,
                   expected(o, true), v ? v : ""});
  }
  return out;
}

std::string Config::get(std::string_view option) const {
  const Option* o = by_keyword(option);
  if (!o) return {};
  return std::visit([&](auto member) -> std::string {
    using M = decltype(member);
    if constexpr (std::is_same_v<M, std::monostate>) {
      return {};
    } else {
      using T = std::remove_cvref_t<decltype(this->*member)>;
      if constexpr (std::is_same_v<T, std::string>) {
        return this->*member;
      } else if constexpr (std::is_same_v<T, bool>) {
        return this->*member ? "1" : "0";
      } else if (o->kind == Kind::kSeconds) {
        std::string s = std::to_string(double(this->*member) / 1000.0);
        s.erase(s.find_last_not_of('0') + 1);  // "2.500000" -> "2.5", "5.000000" -> "5."
        if (s.back() == '.') s.pop_back();
        return s;
      } else {
        return std::to_string(this->*member);
      }
    }
  }, o->field);
}

Status Config::set(std::string_view option, std::string_view value) {
  const Option* o = by_keyword(option);
  if (!o) return Status(Code::kInvalidArgument, "unknown option '" + shown(option) + "'");
  if (o->kind == Kind::kChoice && value.empty()) {  // "" is the default, as an unset variable
    const Config defaults;
    std::visit([&](auto member) {
      if constexpr (std::is_same_v<decltype(member), std::string Config::*>) this->*member = defaults.*member;
    }, o->field);
    return Status::ok();
  }
  if (!parse_value(*o, value, false, this)) return refused("option " + std::string(option), *o, value, false);
  return Status::ok();
}

}  // namespace tether
