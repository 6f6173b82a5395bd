#include "transport/netplugin/bindings.h"

#include <pthread.h>
#include <sched.h>

#include <cerrno>
#include <charconv>
#include <cstring>

namespace tether::transport {

namespace {

bool parse_int(std::string_view s, int* out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size() && *out >= 0 && *out < CPU_SETSIZE;
}

}  // namespace

Result<std::map<std::string, std::vector<int>>> parse_net_bindings(std::string_view text) {
  std::map<std::string, std::vector<int>> out;
  auto bad = [&](std::string_view why) {
    return Status(Code::kInvalidArgument, "TETHER_NET_BINDINGS '" + std::string(text) + "': " + std::string(why) +
                                              " (expected \"nic:cpus;nic:cpus\", cpus like 8-21,112-125)");
  };
  while (!text.empty()) {
    const size_t semi = text.find(';');
    std::string_view item = text.substr(0, semi);
    text = semi == std::string_view::npos ? std::string_view() : text.substr(semi + 1);
    if (item.empty()) continue;
    const size_t colon = item.find(':');
    if (colon == 0 || colon == std::string_view::npos) return bad("an entry without a NIC name");
    std::vector<int>& cpus = out[std::string(item.substr(0, colon))];
    std::string_view list = item.substr(colon + 1);
    if (list.empty()) return bad("a NIC without CPUs");
    while (!list.empty()) {
      const size_t comma = list.find(',');
      std::string_view range = list.substr(0, comma);
      list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
      const size_t dash = range.find('-');
      int lo, hi;
      if (dash == std::string_view::npos) {
        if (!parse_int(range, &lo)) return bad("not a CPU number");
        hi = lo;
      } else if (!parse_int(range.substr(0, dash), &lo) || !parse_int(range.substr(dash + 1), &hi) || hi < lo) {
        return bad("not a CPU range");
      }
      for (int c = lo; c <= hi; ++c) cpus.push_back(c);
    }
  }
  return out;
}

Status pin_this_thread(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  const int rc = ::pthread_setaffinity_np(::pthread_self(), sizeof set, &set);
  if (rc != 0) return Status(Code::kInvalidArgument, std::string("pinning a netplugin thread: ") + std::strerror(rc));
  return Status::ok();
}

}  // namespace tether::transport
