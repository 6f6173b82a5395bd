"""A two-host test bed on one machine: two network namespaces joined by veth pairs.

    bed = TestBed(links=4)            # namespaces <prefix>a and <prefix>b, link i = veth a<i> <-> b<i>
    bed.up()                          # 10.<net>.<i>.1/24 on a<i> (side "a"), 10.<net>.<i>.2/24 on b<i>
    bed.shape(2, "250mbit")           # tc tbf on both ends of link 2
    bed.down(2)                       # link 2 loses carrier (ip link set a2 down)
    bed.blackhole(1)                  # link 1 stays up but drops every packet (netem loss 100%)
    bed.cleanup()                     # deletes both namespaces (and so the veths); safe to call twice

The addresses exist only inside the namespaces. Processes enter a side with `bed.cmd("a", ...)`
(`ip netns exec`) or, from inside a Python process before it opens sockets, `enter(bed.ns["a"])`
(setns + a private /sys, as `ip netns exec` does). `available()` says whether namespaces can be made
here (root, iproute2, tc) and why not. Used by tests/python/test_nics.py and bench/nics_bench.py.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from typing import Optional, Sequence

PREFIX = "tether-nb-"


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def available() -> tuple[bool, str]:
    """(True, "") if two namespaces with a shaped veth pair can be made here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' (iproute2) is not installed"
    probe = TestBed(links=1, prefix=PREFIX + "probe-")
    try:
        probe.up()
        probe.shape(0, "100mbit")
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return False, f"cannot create network namespaces here: {e}"
    finally:
        probe.cleanup()
    return True, ""


def cleanup_stale(prefix: str = PREFIX) -> None:
    """Deletes namespaces left by test beds whose process is gone (a killed run)."""
    r = _run("ip", "netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(prefix):
            continue
        pid = next((p for p in name[len(prefix):].split("-") if p.isdigit()), "")
        if pid and not os.path.exists(f"/proc/{pid}"):
            _run("ip", "netns", "del", name, check=False)


class TestBed:
    __test__ = False  # not a pytest class

    def __init__(self, links: int = 4, prefix: str = PREFIX, net: Optional[int] = None):
        tag = f"{prefix}{os.getpid()}-"
        self.ns = {"a": tag + "a", "b": tag + "b"}
        self.links = links
        self.net = net if net is not None else 200 + os.getpid() % 50
        self._made: list[str] = []

    # -- names and addresses
    def dev(self, side: str, i: int) -> str:
        return f"{side}{i}"

    def addr(self, side: str, i: int) -> str:
        return f"10.{self.net}.{i}.{1 if side == 'a' else 2}"

    def nics(self, side: str, which: Optional[Sequence[int]] = None) -> str:
        """"a0,a1,..." for TETHER_NICS."""
        return ",".join(self.dev(side, i) for i in (range(self.links) if which is None else which))

    # -- lifecycle
    def up(self) -> "TestBed":
        for ns in self.ns.values():
            _run("ip", "netns", "del", ns, check=False)
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        for i in range(self.links):
            _run("ip", "link", "add", self.dev("a", i), "netns", self.ns["a"], "type", "veth",
                 "peer", "name", self.dev("b", i), "netns", self.ns["b"])
            for side in "ab":
                _run("ip", "-n", self.ns[side], "addr", "add", f"{self.addr(side, i)}/24", "dev", self.dev(side, i))
                _run("ip", "-n", self.ns[side], "link", "set", self.dev(side, i), "up")
        return self

    def cleanup(self) -> None:
        for ns in self._made:
            _run("ip", "netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> "TestBed":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.cleanup()

    # -- links
    def shape(self, i: int, rate: str, sides: str = "ab") -> None:
        """Token bucket at `rate` ("1gbit", "250mbit") on link i's egress, both ends by default."""
        bits = _rate_bits(rate)
        burst = max(32 << 10, bits // 8 // 250)  # 4 ms of traffic: room for GSO packets at any rate
        for side in sides:
            _run("ip", "netns", "exec", self.ns[side], "tc", "qdisc", "replace", "dev", self.dev(side, i), "root",
                 "tbf", "rate", rate, "burst", str(burst), "latency", "50ms")

    def unshape(self, i: int) -> None:
        for side in "ab":
            _run("ip", "netns", "exec", self.ns[side], "tc", "qdisc", "del", "dev", self.dev(side, i), "root", check=False)

    def down(self, i: int, side: str = "a") -> None:
        _run("ip", "-n", self.ns[side], "link", "set", self.dev(side, i), "down")

    def blackhole(self, i: int) -> None:
        """Link i stays up but loses every packet in both directions: netem loss 100% where the kernel
        has netem, else a 1 kbit/s token bucket with a one-packet queue (drops all but a packet every
        ~12 s: for TCP as good as dead)."""
        for side in "ab":
            base = ["ip", "netns", "exec", self.ns[side], "tc", "qdisc", "replace", "dev", self.dev(side, i), "root"]
            if _run(*base, "netem", "loss", "100%", check=False).returncode != 0:
                _run(*base, "tbf", "rate", "1kbit", "burst", "1600", "limit", "1600")

    def cmd(self, side: str, *args: str) -> list[str]:
        """argv that runs `args` inside side's namespace."""
        return ["ip", "netns", "exec", self.ns[side], *args]


def _rate_bits(rate: str) -> int:
    r = rate.lower().rstrip("bit").rstrip("bps")
    for suffix, m in (("g", 10**9), ("m", 10**6), ("k", 10**3)):
        if r.endswith(suffix):
            return int(float(r[:-1]) * m)
    return int(float(r))


# ------------------------------------------------------------------ entering a namespace in-process

_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_SLAVE = 1 << 14, 1 << 19
_MNT_DETACH = 2


def enter(ns: str) -> None:
    """Moves this (single-threaded) process into namespace `ns`, with its own /sys showing that
    namespace's interfaces — what `ip netns exec` does. Call before any socket or thread exists."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({ns})")
    finally:
        os.close(fd)
    # A private mount namespace whose /sys is this network namespace's (sysfs reflects the mounter's).
    if libc.unshare(_CLONE_NEWNS) != 0:
        return  # interfaces still work; only /sys/class/net shows the old namespace
    libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None)
    libc.umount2(b"/sys", _MNT_DETACH)
    libc.mount(ns.encode(), b"/sys", b"sysfs", 0, None)
