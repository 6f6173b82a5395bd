"""Memory whose pages arrive late: userfaultfd (Linux) on private anonymous memory, for tests of what
a slow page fault (swap-in, a mapping on slow storage) does to a copy in flight.

`SlowMemory(size)` maps `size` bytes and registers them with a userfaultfd; no page is present until
a `Pager` holding that userfaultfd supplies it. The pager may live in another process than the
memory (it takes the descriptor with pidfd_getfd), so a process blocked on one of its own pages, GIL
held, can still be served. x86-64 only (the system call numbers); `why_unavailable()` says why not.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import platform
import select
import struct
import threading
import time
from typing import Optional

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_SYS_USERFAULTFD, _SYS_PIDFD_OPEN, _SYS_PIDFD_GETFD = 323, 434, 438


def _iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (0xAA << 8) | nr


_UFFDIO_API = _iowr(0x3F, 24)
_UFFDIO_REGISTER = _iowr(0x00, 32)
_UFFDIO_COPY = _iowr(0x03, 40)
_UFFD_API = 0xAA
_MODE_MISSING = 1
_EVENT_PAGEFAULT = 0x12


def _check(rc: int, what: str) -> int:
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return rc


def _ioctl(fd: int, req: int, buf: bytearray) -> None:
    arg = (ctypes.c_char * len(buf)).from_buffer(buf)
    _check(_libc.ioctl(fd, ctypes.c_ulong(req), arg), "userfaultfd ioctl")


def why_unavailable() -> Optional[str]:
    """None where userfaultfd works here, else why not (a skip reason)."""
    if platform.machine() != "x86_64":
        return f"userfaultfd helpers use x86-64 system call numbers (this is {platform.machine()})"
    try:
        m = SlowMemory(PAGE)
        m.close()
    except OSError as e:
        return f"userfaultfd is not permitted here ({e}; root or vm.unprivileged_userfaultfd=1 needed)"
    return None


class SlowMemory:
    """`size` bytes (rounded up to pages) that fault to a userfaultfd. `.array` is a uint8 view."""

    def __init__(self, size: int):
        import numpy as np

        self.size = (size + PAGE - 1) // PAGE * PAGE
        self.map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.fd = _check(_libc.syscall(_SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK), "userfaultfd")
        try:
            _ioctl(self.fd, _UFFDIO_API, bytearray(struct.pack("QQQ", _UFFD_API, 0, 0)))
            _ioctl(self.fd, _UFFDIO_REGISTER, bytearray(struct.pack("QQQQ", self.addr, self.size, _MODE_MISSING, 0)))
        except OSError:
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self.map, dtype=np.uint8)

    def close(self) -> None:
        os.close(self.fd)


def take_fd(pid: int, fd: int) -> int:
    """A copy of process `pid`'s descriptor `fd` (pidfd_getfd: needs ptrace access to it)."""
    pidfd = _check(_libc.syscall(_SYS_PIDFD_OPEN, pid, 0), "pidfd_open")
    try:
        return _check(_libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0), "pidfd_getfd")
    finally:
        os.close(pidfd)


class Pager:
    """Serves the page faults of a userfaultfd `fd` (it owns and closes it) from a thread: once
    `arm(delay)` was called, the next fault waits `delay` seconds before its page arrives; every
    other fault is served at once. Page contents come from `content(page_offset) -> bytes`, offsets
    counted from `base` (the memory's address in its process)."""

    def __init__(self, fd: int, base: int, content):
        self.fd, self.base, self.content = fd, base, content
        self.faults: list = []          # (monotonic time, page offset) of every fault seen
        self.served_slow: Optional[float] = None  # when the delayed page was supplied
        self._delay: Optional[float] = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="pager", daemon=True)
        self._thread.start()

    def arm(self, delay: float) -> None:
        self._delay = delay

    def wait_fault(self, after: int, timeout: float) -> bool:
        """Until more than `after` faults were seen."""
        end = time.monotonic() + timeout
        while len(self.faults) <= after and time.monotonic() < end:
            time.sleep(0.005)
        return len(self.faults) > after

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        os.close(self.fd)

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while not self._stop:
            if not poller.poll(50):
                continue
            try:
                msg = os.read(self.fd, 32)
            except BlockingIOError:
                continue
            if len(msg) < 32 or msg[0] != _EVENT_PAGEFAULT:
                continue
            addr = struct.unpack_from("Q", msg, 16)[0] & ~(PAGE - 1)
            offset = addr - self.base
            self.faults.append((time.monotonic(), offset))
            if self._delay is not None:
                delay, self._delay = self._delay, None
                time.sleep(delay)
                self.served_slow = time.monotonic()
            page = bytearray(self.content(offset))
            src = (ctypes.c_char * PAGE).from_buffer(page)
            req = bytearray(struct.pack("QQQQq", addr, ctypes.addressof(src), PAGE, 0, 0))
            try:
                _ioctl(self.fd, _UFFDIO_COPY, req)
            except OSError:
                pass  # EEXIST: another thread's fault brought the page meanwhile
