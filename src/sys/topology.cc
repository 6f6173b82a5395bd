#include "sys/topology.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

namespace tether::sys {
namespace {

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

int read_int(const std::string& path, int fallback) {
  const std::string s = read_line(path);
  if (s.empty()) return fallback;
  char* end = nullptr;
  long v = std::strtol(s.c_str(), &end, 10);
  return end == s.c_str() ? fallback : int(v);
}

bool is_pci_function(const std::string& component) {
  // "0000:00:03.0": domain:bus:device.function
  return component.size() == 12 && component[4] == ':' && component[7] == ':' && component[10] == '.';
}

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(sep, start);
    if (end == std::string_view::npos) end = s.size();
    out.emplace_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

std::string trim(std::string_view s) {
  size_t a = 0, b = s.size();
  while (a < b && (s[a] == ' ' || s[a] == '\t')) ++a;
  while (b > a && (s[b - 1] == ' ' || s[b - 1] == '\t')) --b;
  return std::string(s.substr(a, b - a));
}

// Speed, then PCI path, NUMA node and local CPUs from the nearest PCI function above the interface.
void read_sysfs(Nic& n) {
  n.speed_mbps = read_int("/sys/class/net/" + n.name + "/speed", -1);
  if (n.speed_mbps <= 0) n.speed_mbps = -1;
  read_pci_location(n, "/sys/class/net/" + n.name + "/device");  // false: virtual interface (veth, bridge, lo)
}

bool parse_addr(const std::string& s, int* family, uint8_t out[16]) {
  if (::inet_pton(AF_INET, s.c_str(), out) == 1) { *family = AF_INET; return true; }
  if (::inet_pton(AF_INET6, s.c_str(), out) == 1) { *family = AF_INET6; return true; }
  return false;
}

size_t common_prefix(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return 0;
  size_t n = 0;
  auto pa = split(a, '/'), pb = split(b, '/');
  for (size_t i = 0; i < std::min(pa.size(), pb.size()) && pa[i] == pb[i]; ++i) ++n;
  return n;
}

}  // namespace

bool read_pci_location(Nic& n, const std::string& device) {
  char real[PATH_MAX];
  if (!::realpath(device.c_str(), real)) return false;
  std::string path = real;
  // Walk up to the PCI function (virtio NICs sit one level below theirs).
  while (!path.empty()) {
    const std::string last = path.substr(path.rfind('/') + 1);
    if (is_pci_function(last)) break;
    path = path.substr(0, path.rfind('/'));
  }
  if (path.empty()) return false;
  n.pci_path = path;
  n.numa_node = read_int(path + "/numa_node", -1);
  auto cpus = parse_cpu_list(read_line(path + "/local_cpulist"));
  if (cpus.is_ok()) n.local_cpus = cpus.take();
  return true;
}

int affinity_numa_node() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return -1;
  int found = -1;
  for (int node = 0; node < 1024; ++node) {
    const std::string list = read_line("/sys/devices/system/node/node" + std::to_string(node) + "/cpulist");
    if (list.empty()) {
      if (::access(("/sys/devices/system/node/node" + std::to_string(node)).c_str(), F_OK) != 0) break;
      continue;  // a node without CPUs
    }
    auto cpus = parse_cpu_list(list);
    if (!cpus.is_ok()) return -1;
    for (int c : cpus.value()) {
      if (c < 0 || c >= CPU_SETSIZE || !CPU_ISSET(c, &set)) continue;
      if (found >= 0 && found != node) return -1;  // spans nodes
      found = node;
    }
  }
  return found;
}

const NicAddr* Nic::primary() const {
  for (auto& a : addrs)
    if (a.family == AF_INET) return &a;
  return addrs.empty() ? nullptr : &addrs.front();
}

// Every interface with its addresses (getifaddrs for this network namespace, sysfs for the rest).
static std::vector<Nic> discover_nics() {
  std::vector<Nic> out;
  std::map<std::string, size_t> index;
  ifaddrs* ifa = nullptr;
  if (::getifaddrs(&ifa) != 0) return out;
  for (ifaddrs* i = ifa; i; i = i->ifa_next) {
    if (!i->ifa_name) continue;
    auto [it, fresh] = index.try_emplace(i->ifa_name, out.size());
    if (fresh) {
      Nic n;
      n.name = i->ifa_name;
      out.push_back(std::move(n));
    }
    Nic& n = out[it->second];
    n.up = (i->ifa_flags & IFF_UP) && (i->ifa_flags & IFF_RUNNING);
    n.loopback = i->ifa_flags & IFF_LOOPBACK;
    if (!i->ifa_addr || (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6)) continue;
    NicAddr a;
    a.family = i->ifa_addr->sa_family;
    char buf[INET6_ADDRSTRLEN] = {};
    const void* src = a.family == AF_INET ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr)
                                          : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr);
    ::inet_ntop(a.family, src, buf, sizeof buf);
    a.addr = buf;
    if (a.family == AF_INET6 && IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr))
      continue;  // needs a scope id to be usable; never advertised
    if (i->ifa_netmask) {
      const auto* m = reinterpret_cast<const uint8_t*>(
          a.family == AF_INET ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(i->ifa_netmask)->sin_addr)
                              : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(i->ifa_netmask)->sin6_addr));
      const int bytes = a.family == AF_INET ? 4 : 16;
      for (int b = 0; b < bytes; ++b) a.prefix += __builtin_popcount(m[b]);
    }
    n.addrs.push_back(std::move(a));
  }
  ::freeifaddrs(ifa);
  for (auto& n : out) read_sysfs(n);
  return out;
}

Closeness closeness(const Nic& nic, const std::string& device_pci_path, int device_numa) {
  Closeness c;
  c.shared = common_prefix(device_pci_path, nic.pci_path);
  c.same_numa = device_numa >= 0 && nic.numa_node == device_numa;
  c.speed_mbps = nic.speed_mbps;
  return c;
}

std::vector<size_t> rank_nics(const std::vector<Nic>& nics, const std::string& device_pci_path, int device_numa) {
  std::vector<size_t> order(nics.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {  // ties keep discovery (kernel) order
    return closeness(nics[x], device_pci_path, device_numa).nearer_than(closeness(nics[y], device_pci_path, device_numa));
  });
  return order;
}

// ---------------------------------------------------------------- NIC lists and pairing

std::string encode_nic_list(const std::vector<RemoteNic>& nics) {
  std::string out;
  for (auto& n : nics) out += n.name + " " + n.addr.addr + "/" + std::to_string(n.addr.prefix) + "\n";
  return out;
}

Result<std::vector<RemoteNic>> decode_nic_list(std::string_view text) {
  std::vector<RemoteNic> out;
  for (const std::string& line : split(text, '\n')) {
    if (line.empty()) continue;
    std::istringstream in(line);
    RemoteNic n;
    std::string cidr;
    if (!(in >> n.name >> cidr)) return Status(Code::kProtocolError, "malformed NIC list from peer");
    const size_t slash = cidr.find('/');
    if (slash == std::string::npos) return Status(Code::kProtocolError, "malformed NIC address from peer");
    n.addr.addr = cidr.substr(0, slash);
    n.addr.prefix = std::atoi(cidr.c_str() + slash + 1);
    uint8_t raw[16];
    if (!parse_addr(n.addr.addr, &n.addr.family, raw) || n.addr.prefix < 0 || n.addr.prefix > 128)
      return Status(Code::kProtocolError, "malformed NIC address from peer");
    out.push_back(std::move(n));
  }
  return out;
}

bool same_subnet(const NicAddr& a, const std::string& b_addr, int b_prefix) {
  uint8_t x[16] = {}, y[16] = {};
  int fx = 0, fy = 0;
  if (!parse_addr(a.addr, &fx, x) || !parse_addr(b_addr, &fy, y) || fx != fy) return false;
  const int prefix = std::min(a.prefix, b_prefix > 0 ? b_prefix : a.prefix);
  if (prefix <= 0) return false;  // no netmask: cannot tell
  for (int bit = 0; bit < prefix; ++bit) {
    const uint8_t m = uint8_t(0x80 >> (bit % 8));
    if ((x[bit / 8] & m) != (y[bit / 8] & m)) return false;
  }
  return true;
}

std::vector<NicPair> pair_nics(const std::vector<Nic>& local, const std::vector<RemoteNic>& remote) {
  // For each local NIC in use order, the remote NICs on its subnet; then round-robin over local NICs so
  // consecutive lanes land on different links, and within a local NIC over its remote candidates.
  std::vector<std::vector<NicPair>> per_local;
  for (size_t l = 0; l < local.size(); ++l) {
    std::vector<NicPair> cands;
    for (auto& r : remote)
      for (auto& a : local[l].addrs)
        if (a.family == r.addr.family && same_subnet(a, r.addr.addr, r.addr.prefix)) {
          cands.push_back(NicPair{int(l), a.addr, local[l].name, r.addr.addr, r.name});
          break;
        }
    if (!cands.empty()) per_local.push_back(std::move(cands));
  }
  std::vector<NicPair> out;
  size_t round = 0;
  for (bool more = true; more; ++round) {
    more = false;
    for (auto& c : per_local)
      if (round < c.size()) {
        out.push_back(c[round]);
        more = true;
      }
  }
  return out;
}

// ---------------------------------------------------------------- CPUs

Result<std::vector<int>> parse_cpu_list(std::string_view text) {
  std::set<int> cpus;
  const std::string t = trim(text);
  if (t.empty()) return std::vector<int>{};
  for (const std::string& part : split(t, ',')) {
    const std::string p = trim(part);
    const size_t dash = p.find('-');
    char* end = nullptr;
    const long a = std::strtol(p.c_str(), &end, 10);
    if (end == p.c_str() || a < 0 || a >= CPU_SETSIZE) return Status(Code::kInvalidArgument, "bad CPU list '" + t + "'");
    long b = a;
    if (dash != std::string::npos) {
      const char* bs = p.c_str() + dash + 1;
      b = std::strtol(bs, &end, 10);
      if (end == bs || b < a || b >= CPU_SETSIZE) return Status(Code::kInvalidArgument, "bad CPU list '" + t + "'");
    }
    if (*end != '\0') return Status(Code::kInvalidArgument, "bad CPU list '" + t + "'");
    for (long c = a; c <= b; ++c) cpus.insert(int(c));
  }
  return std::vector<int>(cpus.begin(), cpus.end());
}

std::string format_cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(cpus[i]);
    if (j > i) out += "-" + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

Result<std::vector<CpuBinding>> parse_cpu_bindings(std::string_view text) {
  std::vector<CpuBinding> out;
  for (const std::string& item : split(text, ';')) {
    const std::string it = trim(item);
    if (it.empty()) continue;
    const size_t colon = it.find(':');
    if (colon == std::string::npos || colon == 0)
      return Status(Code::kInvalidArgument, "CPU binding '" + it + "' is not NIC:CPUS (e.g. eth1:8-21)");
    auto cpus = parse_cpu_list(it.substr(colon + 1));
    if (!cpus.is_ok()) return cpus.status();
    if (cpus.value().empty()) return Status(Code::kInvalidArgument, "CPU binding '" + it + "' names no CPU");
    out.push_back(CpuBinding{trim(it.substr(0, colon)), cpus.take()});
  }
  return out;
}

static std::vector<int> online_cpus() {
  auto r = parse_cpu_list(read_line("/sys/devices/system/cpu/online"));
  if (r.is_ok() && !r.value().empty()) return r.take();
  std::vector<int> all;
  for (long i = 0; i < ::sysconf(_SC_NPROCESSORS_ONLN); ++i) all.push_back(int(i));
  return all;
}

Status pin_current_thread(const std::vector<int>& cpus) {
  if (cpus.empty()) return Status::ok();
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  const int rc = ::pthread_setaffinity_np(::pthread_self(), sizeof set, &set);
  if (rc != 0) return Status(Code::kInvalidArgument, "cannot pin to CPUs " + format_cpu_list(cpus) + ": " + std::strerror(rc));
  return Status::ok();
}

// ---------------------------------------------------------------- plan

uint32_t Plan::thread_for_lane(uint32_t lane, int nic, uint32_t earlier_on_nic) const {
  const uint32_t n = uint32_t(threads.size());
  if (n == 0) return 0;
  if (nic < 0 || data.empty()) return lane % n;
  std::vector<uint32_t> serving;
  for (uint32_t t = 0; t < n; ++t)
    if (threads[t].nic == nic) serving.push_back(t);
  if (serving.empty()) return uint32_t(nic) % n;  // fewer threads than NICs
  return serving[earlier_on_nic % serving.size()];
}

int Plan::data_index_of_addr(const std::string& addr) const {
  for (size_t i = 0; i < data.size(); ++i)
    for (auto& a : data[i].addrs)
      if (a.addr == addr) return int(i);
  return -1;
}

Result<Plan> make_plan(const Config& config) {
  Plan plan;
  plan.all = discover_nics();
  auto find = [&](const std::string& name) -> int {
    for (size_t i = 0; i < plan.all.size(); ++i)
      if (plan.all[i].name == name) return int(i);
    return -1;
  };
  auto unknown = [&](const std::string& what, const std::string& name) {  // "<what> 'eth9', which ..."
    std::string known;
    for (auto& n : plan.all) known += (known.empty() ? "" : ", ") + n.name;
    return Status(Code::kInvalidArgument, what + " '" + name + "', which this host does not have (it has: " + known + ")");
  };
  if (!config.nics.empty()) {
    for (const std::string& raw : split(config.nics, ',')) {
      const std::string name = trim(raw);
      if (name.empty()) continue;
      const int i = find(name);
      if (i < 0) return unknown("TETHER_NICS names", name);
      const Nic& n = plan.all[size_t(i)];
      if (!n.primary()) return Status(Code::kInvalidArgument, "TETHER_NICS names '" + name + "', which has no IP address");
      if (std::none_of(plan.data.begin(), plan.data.end(), [&](const Nic& d) { return d.name == name; })) plan.data.push_back(n);
    }
  } else {
    std::vector<Nic> usable;
    for (auto& n : plan.all)
      if (n.up && !n.loopback && n.primary()) usable.push_back(n);
    for (size_t i : rank_nics(usable, "", -1)) plan.data.push_back(usable[i]);  // host memory: by speed
  }
  if (!config.control_nic.empty()) {
    plan.control = find(config.control_nic);
    if (plan.control < 0) return unknown("TETHER_CONTROL_NIC names", config.control_nic);
    if (!plan.all[size_t(plan.control)].primary())
      return Status(Code::kInvalidArgument, "TETHER_CONTROL_NIC names '" + config.control_nic + "', which has no IP address");
  }

  // Progress threads: thread t serves data NIC t % n; it runs on that NIC's explicit CPUs (TX ∪ RX:
  // one thread drives both directions of its lanes), else on the CPUs local to the NIC's PCI device.
  auto tx = parse_cpu_bindings(config.tx_cpus);
  if (!tx.is_ok()) return Status(Code::kInvalidArgument, "TETHER_TX_CPUS: " + tx.status().message());
  auto rx = parse_cpu_bindings(config.rx_cpus);
  if (!rx.is_ok()) return Status(Code::kInvalidArgument, "TETHER_RX_CPUS: " + rx.status().message());
  std::map<std::string, std::set<int>> explicit_cpus;
  const std::vector<int> online = online_cpus();
  for (auto* list : {&tx.value(), &rx.value()})
    for (auto& b : *list) {
      if (find(b.nic) < 0) return unknown(list == &tx.value() ? "TETHER_TX_CPUS names NIC" : "TETHER_RX_CPUS names NIC", b.nic);
      for (int c : b.cpus)
        if (std::find(online.begin(), online.end(), c) == online.end())
          return Status(Code::kInvalidArgument, "CPU " + std::to_string(c) + " bound to " + b.nic + " is not online (online: " +
                                                    format_cpu_list(online) + ")");
      explicit_cpus[b.nic].insert(b.cpus.begin(), b.cpus.end());
    }
  const uint32_t threads = std::max<uint32_t>(1, config.channels);
  for (uint32_t t = 0; t < threads; ++t) {
    ThreadPlacement p;
    if (plan.data.empty()) {
      p.why = "not pinned: no data NIC";
      plan.threads.push_back(p);
      continue;
    }
    p.nic = int(t % plan.data.size());
    const Nic& n = plan.data[size_t(p.nic)];
    if (auto it = explicit_cpus.find(n.name); it != explicit_cpus.end()) {
      p.cpus.assign(it->second.begin(), it->second.end());
      p.why = "TETHER_TX_CPUS/TETHER_RX_CPUS for " + n.name;
    } else if (!config.pin_threads) {
      p.why = "not pinned: TETHER_PIN_THREADS=0";
    } else if (n.local_cpus.empty()) {
      p.why = "not pinned: " + n.name + " has no local CPU list (virtual NIC)";
    } else if (n.local_cpus == online) {
      p.why = "not pinned: every CPU is local to " + n.name;
    } else {
      p.cpus = n.local_cpus;
      p.why = "NUMA-local to " + n.name;
    }
    plan.threads.push_back(std::move(p));
  }
  return plan;
}

}  // namespace tether::sys
