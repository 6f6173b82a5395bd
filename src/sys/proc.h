// What the kernel says of another process of this host.
#pragma once
#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

namespace tether::sys {

// The state letter of process `pid` in /proc/PID/stat ('R', 'S', 'D', 'T' stopped, 't' traced,
// 'Z' zombie, ...); 0 when it cannot be read (gone, or another pid namespace: pid <= 0).
inline char process_state(pid_t pid) {
  if (pid <= 0) return 0;
  char path[64], buf[512];
  std::snprintf(path, sizeof path, "/proc/%d/stat", int(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  const char* paren = std::strrchr(buf, ')');  // "pid (comm) S ...": comm may hold spaces and parentheses
  return paren && paren[1] == ' ' ? paren[2] : 0;
}

}  // namespace tether::sys
