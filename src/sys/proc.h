// What the kernel says of another process of this host.
#pragma once
#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tether::sys {

// The first bytes of a /proc file, NUL-terminated; false when it cannot be read.
inline bool read_proc(const char* path, char* buf, size_t size) {
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const ssize_t n = ::read(fd, buf, size - 1);
  ::close(fd);
  if (n <= 0) return false;
  buf[n] = 0;
  return true;
}

// The state letter in a stat file ('R', 'S', 'D', 'T' stopped, 't' traced, 'Z' zombie, ...), or 0.
inline char stat_state(const char* path) {
  char buf[512];
  if (!read_proc(path, buf, sizeof buf)) return 0;
  const char* paren = std::strrchr(buf, ')');  // "pid (comm) S ...": comm may hold spaces and parentheses
  return paren && paren[1] == ' ' ? paren[2] : 0;
}

// Process `pid`'s state letter; 0 when it cannot be read (gone, or another pid namespace: pid <= 0).
inline char process_state(pid_t pid) {
  if (pid <= 0) return 0;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", int(pid));
  return stat_state(path);
}

// Thread `tid` of process `pid` is stopped (SIGSTOP, a debugger) inside system call `nr`: stopped on
// its way out of it, so whatever the call did is done. False when it runs, is elsewhere, or cannot be
// read (/proc/PID/task/TID/syscall needs the access cross-memory attach needs).
inline bool stopped_in_syscall(pid_t pid, pid_t tid, long nr) {
  if (pid <= 0 || tid <= 0) return false;
  char path[96], buf[256];
  std::snprintf(path, sizeof path, "/proc/%d/task/%d/stat", int(pid), int(tid));
  const char state = stat_state(path);
  if (state != 'T' && state != 't') return false;
  std::snprintf(path, sizeof path, "/proc/%d/task/%d/syscall", int(pid), int(tid));
  if (!read_proc(path, buf, sizeof buf)) return false;
  char* end = nullptr;
  const long got = std::strtol(buf, &end, 10);  // "nr args... sp pc"; "-1 sp pc" outside a call; "running"
  return end != buf && got == nr;
}

}  // namespace tether::sys
