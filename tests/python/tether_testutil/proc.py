"""What /proc says about a process (CPU seconds, descriptors, memory, threads, stopped), and
dropping the privileges that let a process attach to another."""
from __future__ import annotations

import os
import time


def fd_count(pid: str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Until every thread of `pid` is stopped (SIGSTOP is delivered to each thread as it next leaves the
    kernel: one busy in a system call can still answer a chunk or two right after kill() returns)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            states = [open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0]
                      for t in os.listdir(f"/proc/{pid}/task")]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return  # gone, or a thread exited while we looked: nothing left to wait for
        if all(st in ("T", "t") for st in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} not stopped {timeout} s after SIGSTOP")


def refuse_cma(dumpable: bool) -> None:
    """Drops CAP_SYS_PTRACE from this process and optionally makes it non-dumpable (prctl)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    hdr, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    assert libc.capget(ctypes.byref(hdr), data) == 0, os.strerror(ctypes.get_errno())
    cap_sys_ptrace = 19
    data[0].effective &= ~(1 << cap_sys_ptrace)
    data[0].permitted &= ~(1 << cap_sys_ptrace)
    assert libc.capset(ctypes.byref(hdr), data) == 0, os.strerror(ctypes.get_errno())
    if not dumpable:
        assert libc.prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE
