#include "sys/net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include "sys/crypto.h"

namespace tether::sys {
namespace {

std::string errstr(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

void size_buffers(int fd, uint32_t bytes) {
  if (bytes == 0) return;
  int b = int(bytes);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof b);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof b);
}

Result<addrinfo*> resolve(const std::string& host, uint16_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  const std::string p = std::to_string(port);
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), p.c_str(), &hints, &res);
  if (rc != 0) return Status(Code::kInvalidArgument, "cannot resolve '" + host + "': " + gai_strerror(rc));
  return res;
}

// Waits for `events` on fd until the deadline.
Status wait_fd(int fd, short events, int64_t deadline_ms) {
  for (;;) {
    int64_t left = deadline_ms - now_ms();
    if (left <= 0) return Status(Code::kTimeout, "socket operation timed out");
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, int(std::min<int64_t>(left, 1000)));
    if (rc > 0) return Status::ok();
    if (rc < 0 && errno != EINTR) return Status(Code::kConnectionLost, errstr("poll"));
  }
}

}  // namespace

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

static void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

Result<int> listen_tcp(const std::string& host, uint16_t port, uint32_t buffer_bytes) {
  auto res = resolve(host, port, true);
  if (!res.is_ok()) return res.status();
  const std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> ai(res.value(), freeaddrinfo);
  Status last(Code::kUnavailable, "no address to listen on for '" + host + "'");
  for (addrinfo* a = ai.get(); a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) { last = Status(Code::kUnavailable, errstr("socket")); continue; }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    size_buffers(fd, buffer_bytes);  // accepted sockets inherit them
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 512) != 0) {
      last = Status(Code::kUnavailable, errstr(("listen on " + host + ":" + std::to_string(port)).c_str()));
      ::close(fd);
      continue;
    }
    return fd;
  }
  return last;
}

uint16_t local_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
}

Result<int> connect_tcp(const std::string& host, uint16_t port, int64_t deadline_ms, uint32_t buffer_bytes,
                        const std::string& bind_addr) {
  auto res = resolve(host, port, false);
  if (!res.is_ok()) return res.status();
  const std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> ai(res.value(), freeaddrinfo);
  Status last(Code::kConnectionLost, "no address for '" + host + "'");
  for (addrinfo* a = ai.get(); a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) { last = Status(Code::kUnavailable, errstr("socket")); continue; }
    set_nodelay(fd);
    size_buffers(fd, buffer_bytes);
    if (!bind_addr.empty()) {
      sockaddr_storage ss{};
      socklen_t len = 0;
      if (a->ai_family == AF_INET && ::inet_pton(AF_INET, bind_addr.c_str(), &reinterpret_cast<sockaddr_in*>(&ss)->sin_addr) == 1) {
        ss.ss_family = AF_INET;
        len = sizeof(sockaddr_in);
      } else if (a->ai_family == AF_INET6 && ::inet_pton(AF_INET6, bind_addr.c_str(), &reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr) == 1) {
        ss.ss_family = AF_INET6;
        len = sizeof(sockaddr_in6);
      }
      if (len == 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&ss), len) != 0) {
        last = Status(Code::kUnavailable, "cannot leave from " + bind_addr + " to reach " + host + ": " +
                                              (len == 0 ? std::string("address family differs") : std::string(std::strerror(errno))));
        ::close(fd);
        continue;
      }
    }
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      Status w = wait_fd(fd, POLLOUT, deadline_ms);
      if (!w.is_ok()) { last = w; ::close(fd); continue; }
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc != 0) {
      last = Status(Code::kConnectionLost, "connect to " + host + ":" + std::to_string(port) + ": " + std::strerror(errno));
      ::close(fd);
      continue;
    }
    return fd;
  }
  return last;
}

Status write_all(int fd, const void* buf, size_t len, int64_t deadline_ms) {
  auto* p = static_cast<const char*>(buf);
  while (len > 0) {
    ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL);
    if (n > 0) { p += n; len -= size_t(n); continue; }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      Status w = wait_fd(fd, POLLOUT, deadline_ms);
      if (!w.is_ok()) return w;
      continue;
    }
    return Status(Code::kConnectionLost, errstr("send"));
  }
  return Status::ok();
}

Status read_all(int fd, void* buf, size_t len, int64_t deadline_ms) {
  auto* p = static_cast<char*>(buf);
  while (len > 0) {
    ssize_t n = ::recv(fd, p, len, 0);
    if (n > 0) { p += n; len -= size_t(n); continue; }
    if (n == 0) return Status(Code::kConnectionLost, "connection closed by the other side");
    if (errno == EAGAIN || errno == EINTR) {
      Status w = wait_fd(fd, POLLIN, deadline_ms);
      if (!w.is_ok()) return w;
      continue;
    }
    return Status(Code::kConnectionLost, errstr("recv"));
  }
  return Status::ok();
}

void set_link_timeout(int fd, uint32_t timeout_ms) {
  if (timeout_ms == 0) return;
  unsigned int t = timeout_ms;
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &t, sizeof t);
  int one = 1, idle = std::max<int>(1, int(timeout_ms / 2000)), intvl = 1, cnt = std::max<int>(2, int(timeout_ms / 1000));
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
}

namespace {
std::string numeric(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, buf, sizeof buf);
  } else if (ss.ss_family == AF_INET6) {
    const auto* a6 = reinterpret_cast<const sockaddr_in6*>(&ss);
    if (IN6_IS_ADDR_V4MAPPED(&a6->sin6_addr)) {
      ::inet_ntop(AF_INET, &a6->sin6_addr.s6_addr[12], buf, sizeof buf);
    } else {
      ::inet_ntop(AF_INET6, &a6->sin6_addr, buf, sizeof buf);
    }
  }
  return buf;
}
}  // namespace

std::string local_addr(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return {};
  return numeric(ss);
}

std::string remote_addr(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return {};
  return numeric(ss);
}

bool is_loopback_host(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

void tune_data_socket(int fd) {
  set_nonblocking(fd);
  set_nodelay(fd);
}

Status split_host_port(std::string_view s, std::string* host, uint16_t* port) {
  size_t colon = s.rfind(':');
  if (colon == std::string_view::npos || colon + 1 == s.size())
    return Status(Code::kInvalidArgument, "expected host:port, got '" + std::string(s) + "'");
  std::string_view h = s.substr(0, colon), p = s.substr(colon + 1);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  unsigned long v = 0;
  for (char c : p) {
    if (c < '0' || c > '9') return Status(Code::kInvalidArgument, "bad port in '" + std::string(s) + "'");
    v = v * 10 + unsigned(c - '0');
    if (v > 65535) return Status(Code::kInvalidArgument, "bad port in '" + std::string(s) + "'");
  }
  *host = std::string(h);
  *port = uint16_t(v);
  return Status::ok();
}

std::string join_host_port(const std::string& host, uint16_t port) {
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

std::array<uint8_t, 32> host_id() {
  std::string id;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::getline(boot, id);
  char ns[256] = {};
  ssize_t n = ::readlink("/proc/self/ns/net", ns, sizeof ns - 1);
  if (n > 0) id += std::string("|") + ns;
  auto d = crypto::sha256(id.data(), id.size());
  std::array<uint8_t, 32> out;
  std::memcpy(out.data(), d.data(), 32);
  return out;
}

std::string hostname() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

}  // namespace tether::sys
