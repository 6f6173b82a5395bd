"""`tether bench`: transfers between two local processes (or two hosts), measured and verified.

The client process drives; the server process owns the target buffer and answers commands over
a pipe (two local processes) or over tether notifications (two hosts, or torchrun).
GB/s uses 1 GB = 1e9 B; bytes moved per op = size x num_iovs.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import platform
import resource
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import numpy as np

import tether

POISON = 0xA5
_FAILED = "__error"  # key of the message a server sends instead of an answer when a command failed


class BenchError(Exception):
    """The bench's own failure: a server that failed or died. The CLI prints it as one line."""


HUGE_PAGE = 2 << 20


def huge_aligned(n: int) -> np.ndarray:
    """n bytes of host memory starting on a 2 MiB boundary: unaligned, a small op at offset 0 would
    land in the 4 KiB pages before the first transparent huge page, unlike the bulk of the buffer."""
    raw = np.empty(n + HUGE_PAGE, dtype=np.uint8)
    pad = -raw.ctypes.data % HUGE_PAGE
    return raw[pad:pad + n]


class Mem:
    """A benchmark buffer in host memory (numpy) or on GPU `device` (a torch tensor)."""

    def __init__(self, n: int, device: Optional[int] = None):
        self.device = device
        if device is None:
            self.obj = huge_aligned(max(n, 1))
        else:
            import torch
            self.obj = torch.empty(max(n, 1), dtype=torch.uint8, device=f"cuda:{device}")

    def fill(self, value: int, n: Optional[int] = None) -> None:
        if self.device is None:
            self.obj[:n].fill(value)
        else:
            self.obj[:n].fill_(value)
            self._sync()

    def put(self, off: int, data: np.ndarray) -> None:
        if self.device is None:
            self.obj[off:off + data.size] = data
        else:
            import torch
            self.obj[off:off + data.size].copy_(torch.from_numpy(data))
            self._sync()

    def get(self, off: int, n: int) -> np.ndarray:
        if self.device is None:
            return self.obj[off:off + n]
        return self.obj[off:off + n].cpu().numpy()

    def randomize(self, off: int, n: int, rng: np.random.Generator) -> None:
        """Random bytes into [off, off+n). On a GPU they are made there (torch's generator, seeded from
        `rng`): a full mesh fills many GPU sources at once, and host-made bytes would serialise on the GIL."""
        if self.device is None:
            self.obj[off:off + n] = rng.integers(0, 256, n, dtype=np.uint8)
            return
        import torch
        gen = torch.Generator(device=f"cuda:{self.device}")
        gen.manual_seed(int(rng.integers(0, 2**62)))
        self.obj[off:off + n].random_(0, 256, generator=gen)
        self._sync()

    def randomize_spans(self, spans: list[tuple[int, int]], rng: np.random.Generator) -> None:
        """Random bytes into every (offset, length) span; on a GPU one kernel over the range they cover, not a
        generator, a kernel and a synchronize per span (4,096 of them per checked iteration of the scattered case)."""
        if self.device is None:
            for off, n in spans:
                self.randomize(off, n, rng)
        elif spans:
            lo, hi = min(o for o, _ in spans), max(o + n for o, n in spans)
            self.randomize(lo, hi - lo, rng)

    def pieces(self, spans: list[tuple[int, int]]) -> list[np.ndarray]:
        """The bytes of the (offset, length) spans, in order, to hash: views of host memory; off a GPU all of
        them in one copy, not one per span."""
        if self.device is None:
            return [self.obj[off:off + n] for off, n in spans]
        if not spans:
            return []
        import torch
        return [torch.cat([self.obj[off:off + n] for off, n in spans]).cpu().numpy()]

    def flip(self, off: int) -> None:
        self.put(off, self.get(off, 1) ^ 0xFF)

    def _sync(self) -> None:
        import torch
        torch.cuda.synchronize(self.device)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_ticks() -> tuple[int, int]:
    """(steal, all) clock ticks this machine's CPUs have spent so far, from /proc/stat's first line; (0, 0)
    where there is none. Steal is the time the hypervisor held the CPUs back: a figure taken while it grew
    measures the host as much as tether."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
        return ticks[7], sum(ticks)
    except (OSError, ValueError, IndexError):
        return 0, 0


def steal_share(before: tuple[int, int], after: Optional[tuple[int, int]] = None) -> float:
    """% of this machine's CPU time the hypervisor took between two cpu_ticks() readings (`after` defaults
    to now). Both counts tick alike, so a pass shorter than a tick reads 0-100 %, never more."""
    steal1, all1 = after if after is not None else cpu_ticks()
    ticks = all1 - before[1]
    return 100.0 * (steal1 - before[0]) / ticks if ticks > 0 else 0.0


def parse_size(text: str) -> int:
    """'4K', '1MiB', '1.5M', '256' -> bytes (K/M/G are binary, as in every peer's benchmark)."""
    t = text.strip().upper().replace("IB", "").replace("B", "")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    try:
        value = float(t) * mult
    except ValueError:
        value = -1.0
    if value <= 0 or value != int(value):
        raise ValueError(f"bad size {text!r}: a whole number of bytes, optionally with a binary suffix "
                         f"K, M or G (1K = 1024 B; KiB, MiB, GiB mean the same)")
    return int(value)


def human(n: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def human_approx(n: float) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m:
            return f"{n / m:.1f} {unit}"
    return f"{n:.0f} B"


# ---------------------------------------------------------------- memory, before a run starts

def _read_int(path: str) -> "Optional[int]":
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text)
    except (OSError, ValueError):  # missing, or "max"
        return None


def host_memory_available() -> "Optional[int]":
    """Bytes this host can still give: MemAvailable, or less where a cgroup limit says so (a container's
    /proc/meminfo shows the whole machine)."""
    avail = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        lim, used = _read_int(limit), _read_int(usage)
        if lim is not None and used is not None and lim < 1 << 60:
            avail.append(max(0, lim - used))
    return min(avail) if avail else None


def _vm_size() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def memory_shortfall(capacity: int, host_buffers: int, per_process: int, gpu_buffers: "dict[int, int]",
                     what: str) -> "Optional[str]":
    """Why buffers of `capacity` bytes (the largest case, `what`) cannot fit, or None: `host_buffers`
    in this host's memory, at most `per_process` of them in one process, `gpu_buffers[g]` on GPU g.
    Checked before a run, so no helper process dies allocating half-way through it."""
    case = f"the largest case ({what}) needs {human(capacity)} per buffer"
    if host_buffers:
        need, avail = host_buffers * capacity, host_memory_available()
        if avail is not None and need > 0.9 * avail:  # leave the rest to Python, tether and the OS
            return (f"{case}, {human_approx(need)} for its {host_buffers} buffers (source and target); "
                    f"{human_approx(avail)} of host memory available here")
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY and per_process * capacity + _vm_size() > soft:
            return (f"{case}, {human_approx(per_process * capacity)} in one process: more than its "
                    f"address-space limit (ulimit -v, {human_approx(soft)}) allows")
    for g, n in sorted(gpu_buffers.items()):
        import torch
        free = torch.cuda.mem_get_info(g)[0]
        if n * capacity > 0.95 * free:
            return f"{case}, {human_approx(n * capacity)} on GPU {g} for its {n} buffers; {human_approx(free)} free there"
    return None


def digest(buf: np.ndarray) -> bytes:
    return hashlib.blake2b(memoryview(buf), digest_size=16).digest()


def spans_digest(buf: Mem, spans: list[tuple[int, int]]) -> bytes:
    """digest() of the (offset, length) spans' bytes, concatenated in order."""
    h = hashlib.blake2b(digest_size=16)
    for p in buf.pieces(spans):
        h.update(memoryview(p))
    return h.digest()


@dataclass
class Case:
    mode: str          # write | read | send
    size: int          # bytes per block
    num_iovs: int      # blocks per op
    iters: int
    warmup: int
    async_depth: int   # 0: one op at a time; N: up to N ops in flight
    check: bool
    check_iters: int = 0  # checked operations before the timed pass (0: iters)
    # > 0: the timed pass takes more than `iters` ops where needed to last about this long (not sends:
    # the server counts their receives), its pace found by untimed ops first.
    min_seconds: float = 0.0


# The default timed pass (no --iters): a fixed count of a few large ops over NVLink lasts ~2 ms, and
# its figure is the warm-up's.
TIMED_PASS_S = 0.25
MAX_TIMED_ITERS = 200_000


def _timed_iters(case: Case, post: Callable) -> int:
    """How many ops the timed pass takes: case.iters, or as many as fill case.min_seconds at the pace
    of untimed ops run in doubling batches until one batch takes 20 ms (more warm-up, as well)."""
    if case.min_seconds <= 0 or case.mode == "send":
        return case.iters
    k = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(k):
            post().wait(120)
        took = time.perf_counter() - t0
        if took >= 0.02 or k >= 4096:
            break
        k *= 2
    return max(case.iters, min(MAX_TIMED_ITERS, int(case.min_seconds * k / max(took, 1e-9))))


@dataclass
class Result:
    mode: str
    transport: str
    device: str
    size: int
    num_iovs: int
    iters: int
    gbps: float
    lat_p50_us: float
    lat_p99_us: float
    cpu_client: float
    cpu_server: float
    check: Optional[bool]
    config: dict = field(default_factory=dict)
    ceiling_gbps: Optional[float] = None  # --ceiling: tcp_ceiling's GB/s with as many streams as lanes
    steal_pct: float = 0.0  # % of this machine's CPU time the hypervisor took during the timed pass (steal_share)


# ---------------------------------------------------------------- command channels
# The client drives; the server owns the target buffer and answers commands. Locally the commands
# travel over a multiprocessing pipe; between hosts they travel as tether notifications (JSON, so a
# peer's bytes are never unpickled).

def _encode(msg) -> bytes:
    def enc(x):
        if isinstance(x, (bytes, bytearray)):
            return {"__b": bytes(x).hex()}
        if isinstance(x, (list, tuple)):
            return [enc(v) for v in x]
        return x
    return json.dumps(enc(msg)).encode()


def _decode(data: bytes):
    def dec(x):
        if isinstance(x, dict) and "__b" in x:
            return bytes.fromhex(x["__b"])
        if isinstance(x, list):
            return [dec(v) for v in x]
        return x
    return dec(json.loads(data))


def _answer(msg):
    """A server's answer, or BenchError with the server's own error where its command failed."""
    if isinstance(msg, dict) and _FAILED in msg:
        raise BenchError(f"the bench server failed: {msg[_FAILED]}")
    return msg


def exit_text(code: "Optional[int]") -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        return f"killed by {name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    return f"exit code {code}"


class PipeChannel:
    """Commands over a pipe. Given the server's process, a receive ends as soon as that process
    dies (with its error) instead of waiting out the timeout."""

    def __init__(self, conn, process=None):
        self.conn, self.process = conn, process

    def send(self, msg) -> None:
        self.conn.send(msg)

    def recv(self, timeout: float = 300):
        waitables = [self.conn] + ([self.process.sentinel] if self.process is not None else [])
        if not mp.connection.wait(waitables, timeout):
            raise TimeoutError(f"the bench server did not answer in {timeout:.0f} s")
        try:
            if self.process is None or self.conn.poll():
                return _answer(self.conn.recv())
        except EOFError:
            pass
        raise BenchError(self.death())

    def death(self) -> str:
        """Why the server process is gone: its own error if it sent one, else how it ended."""
        try:
            while self.conn.poll():
                _answer(self.conn.recv())
        except BenchError as e:
            return str(e)
        except (EOFError, OSError):
            pass
        if self.process is None:
            return "the bench server closed its pipe"
        self.process.join(5)
        return f"the bench server process died ({exit_text(self.process.exitcode)})"


class NotifyChannel:
    """Commands and replies as tether notifications on an established peer link."""

    def __init__(self, ep: "tether.Endpoint", peer: "Optional[tether.Peer]" = None):
        self.ep, self.peer = ep, peer
        self.inbox: list = []

    def send(self, msg) -> None:
        self.peer.notify(_encode(msg)).wait(60)

    def recv(self, timeout: float = 300):
        deadline = time.monotonic() + timeout
        while not self.inbox:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the bench peer did not answer in {timeout:.0f} s")
            if self.peer is not None and not self.peer.connected:  # gone: say so now, not at the timeout
                raise BenchError(f"the bench peer went away ({self.peer.error or 'connection closed'})")
            for n in self.ep.notifications(timeout=min(left, 1.0)):
                if self.peer is None:
                    self.peer = next(p for p in self.ep.peers() if p.id == n.peer_id)
                if n.peer_id == self.peer.id:
                    self.inbox.append(_decode(n.data))
        return _answer(self.inbox.pop(0))


# ---------------------------------------------------------------- server side

def serve(ep: "tether.Endpoint", channel) -> bool:
    """Target side: answers one client's commands until 'exit' (returns False) or 'shutdown' (True).
    Every command is (name, slot, *args): a slot is one target buffer (full mesh drives several);
    ('setup', slot, capacity) (re)allocates it and answers with its descriptor. A command that fails
    (out of memory, ...) is answered with its error and ends the session (returns False)."""
    slots: dict[int, tuple[Mem, "tether.Region"]] = {}
    rng = np.random.default_rng()
    peer = getattr(channel, "peer", None)

    def setup(slot: int, n: int, device: Optional[int] = None):
        if slot in slots:
            ep.deregister(slots[slot][1])
            del slots[slot]
        b = Mem(n, device)
        b.fill(POISON)
        slots[slot] = (b, ep.register(b.obj))
        return slots[slot][1].descriptor()

    def answer(cmd: str, slot: int, args: list):
        nonlocal peer
        if cmd == "setup":
            return setup(slot, *args)
        buf, region = slots[slot]
        if cmd == "cpu":
            return cpu_seconds()
        if cmd == "stats":  # the target's counters (`tether bench --stats` shows both sides)
            return ep.stats()
        if cmd == "poison":
            buf.fill(POISON, args[0])
            return True
        if cmd == "corrupt":  # fault injection, so tests can prove --check catches a bad byte
            buf.flip(args[0])
            return True
        if cmd == "verify":  # [(offset, length), ...], expected digest of their concatenation
            spans, expect = args
            return spans_digest(buf, spans) == expect
        if cmd == "fill":  # random source data for reads; returns the digest of the spans
            buf.randomize_spans(args[0], rng)
            return spans_digest(buf, args[0])
        if peer is None:  # only receives need the link itself
            peer = getattr(channel, "peer", None) or ep.peers()[0]
        if cmd == "recv":  # post `count` receives of `size` bytes, one after another
            size, count = args
            channel.send(True)
            for _ in range(count):
                peer.recv(region, length=size).wait(300)
            return True
        if cmd == "recv_check":
            size, expect = args
            buf.fill(POISON, size)
            channel.send(True)
            t = peer.recv(region, length=size).wait(300)
            return t.bytes == size and digest(buf.get(0, size)) == expect
        raise ValueError(f"unknown bench command {cmd!r}")

    while True:
        cmd, slot, *args = channel.recv(timeout=24 * 3600)
        if cmd in ("exit", "shutdown"):
            return cmd == "shutdown"
        try:
            reply = answer(cmd, slot, args)
        except Exception as e:  # the client hears why, at once, instead of waiting for an answer
            channel.send({_FAILED: f"{type(e).__name__}: {e}"})
            return False
        channel.send(reply)


def _local_server(conn, options: dict) -> None:
    try:
        ep = tether.Endpoint(**options)
    except Exception as e:
        conn.send({_FAILED: f"{type(e).__name__}: {e}"})
        return
    try:
        channel = PipeChannel(conn)
        conn.send(ep.metadata())
        serve(ep, channel)
    except (BenchError, EOFError, OSError, KeyboardInterrupt):
        # The pipe to the bench's main process broke: it was killed (kill -TERM/-9) or interrupted. One
        # line, not this process's traceback; its own exit says the rest.
        print("tether bench: the bench's main process went away; its server process stops too", file=sys.stderr)
    finally:
        ep.close()


# ---------------------------------------------------------------- client side

class Pair:
    """A connected client endpoint, a source buffer, and a server that owns the target buffer
    (slot `slot` of the server; full mesh runs several slots over one link)."""

    def __init__(self, ep: "tether.Endpoint", peer: "tether.Peer", channel, capacity: int, connect_ms: float,
                 slot: int = 0, lock=None, device: Optional[int] = None, remote_device: Optional[int] = None):
        self.ep, self.peer, self.channel, self.capacity, self.connect_ms = ep, peer, channel, capacity, connect_ms
        self.slot, self.lock, self.device, self.remote_device = slot, lock, device, remote_device
        self.remote = self.ask("setup", capacity, remote_device)
        self.src = Mem(capacity, device)
        self.src_region = ep.register(self.src.obj)

    def ask(self, cmd, *args):
        with self.lock or contextlib.nullcontext():  # slots sharing one channel: each question by its answer
            self.channel.send((cmd, self.slot, *args))
            return self.channel.recv()

    def close(self, shutdown: bool = False) -> None:
        try:
            self.channel.send(("shutdown" if shutdown else "exit", self.slot))
        except Exception:  # the server may be gone already; closing must not fail
            pass
        self.ep.close()

    def failure(self, exc: Exception) -> Exception:
        """What to report when `exc` ended a run on this pair (LocalPair: a dead server's own error)."""
        return exc


class LocalPair(Pair):
    """Spawns the server as a second local process."""

    def __init__(self, options: dict, capacity: int, device: Optional[int] = None, remote_device: Optional[int] = None):
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_local_server, args=(child, options), daemon=True)
        self.proc.start()
        child.close()  # the server holds the only other end: its death reads as EOF here
        self.channel = channel = PipeChannel(conn, self.proc)
        ep = None
        try:
            metadata = channel.recv(timeout=60)
            ep = tether.Endpoint(**options)
            t0 = time.perf_counter()
            peer = ep.connect(metadata)
            super().__init__(ep, peer, channel, capacity, (time.perf_counter() - t0) * 1e3,
                             device=device, remote_device=remote_device)
        except BaseException as e:  # no half-made pair: say why it failed, then end the server
            report = self.failure(e) if isinstance(e, Exception) else e
            if ep is not None:
                ep.close()
            self.proc.kill()
            self.proc.join(10)
            if report is e:
                raise
            raise report from None

    def failure(self, exc: Exception) -> Exception:
        if isinstance(exc, BenchError):
            return exc
        self.proc.join(2)  # a transfer fails as the server dies: give its exit a moment to show
        if self.proc.is_alive():
            return exc
        return BenchError(f"{self.channel.death()}; here: {type(exc).__name__}: {exc}")

    def close(self, shutdown: bool = False) -> None:
        super().close(shutdown)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class RemotePair(Pair):
    """Connects to a `tether bench --role server` (metadata bytes or "host:port")."""

    def __init__(self, options: dict, capacity: int, target, device: Optional[int] = None,
                 remote_device: Optional[int] = None):
        ep = tether.Endpoint(**options)
        t0 = time.perf_counter()
        peer = ep.connect(target, timeout=30)
        super().__init__(ep, peer, NotifyChannel(ep, peer), capacity, (time.perf_counter() - t0) * 1e3,
                         device=device, remote_device=remote_device)


def _layout(case: Case, capacity: int, rng: np.random.Generator) -> list[tuple[int, int, int]]:
    """(local offset, remote offset, length) per block: blocks land in a shuffled order remotely."""
    n = case.num_iovs
    order = rng.permutation(n) if n > 1 else np.zeros(1, dtype=np.int64)
    assert case.size * n <= capacity
    return [(i * case.size, int(order[i]) * case.size, case.size) for i in range(n)]


def run_case(pair: Pair, case: Case, transport: Optional[str] = None, progress: Optional[Callable] = None,
             before_timing: Optional[Callable[[], None]] = None) -> Result:
    """One case: the checked pass (with --check), warm-up, then the timed pass. `before_timing` runs
    right before the timed pass (a full mesh waits there for every flow, so the timed passes overlap)."""
    rng = np.random.default_rng()
    blocks = _layout(case, pair.capacity, rng)
    total = case.size * case.num_iovs
    remote = tether.RemoteRegion(pair.remote)
    peer, local = pair.peer, pair.src_region
    # Every block shares one local region and one remote range: the block API, its offset arrays
    # made once here, so the timed loop measures posting, not building a list per op.
    local_offsets = np.array([lo for lo, _, _ in blocks], dtype=np.uint64)
    remote_offsets = np.array([ro for _, ro, _ in blocks], dtype=np.uint64)

    one, many = (peer.write, peer.writev_blocks) if case.mode == "write" else (peer.read, peer.readv_blocks)

    def post():
        if case.mode == "send":
            return peer.send(local, length=total)
        if case.num_iovs == 1:
            return one(local, remote, local_offset=blocks[0][0], remote_offset=blocks[0][1], length=total)
        return many(local, remote, local_offsets, remote_offsets, case.size)

    if case.mode == "send" and case.num_iovs != 1:
        raise ValueError("send takes --num-iovs 1")
    check_ok: Optional[bool] = None
    if case.check:
        check_ok = True
        for _ in range(case.check_iters or case.iters):
            check_ok &= _checked_iteration(pair, case, blocks, post, rng)
            if progress:
                progress()
        # Timing comes from a separate unchecked pass, so hashing never counts as transfer time.
    if case.mode == "send":
        pair.ask("recv", total, case.warmup + case.iters)
    for _ in range(case.warmup):
        post().wait(120)
    iters = _timed_iters(case, post)
    if before_timing:
        before_timing()
    lat = np.empty(iters)
    cpu_c0, cpu_s0 = cpu_seconds(), pair.ask("cpu") if case.mode != "send" else None
    ticks0 = cpu_ticks()
    # The timed pass reports progress at most every 0.1 s: a progress bar's update costs a few µs of
    # Python, as much as a small op itself.
    shown, last = 0, time.perf_counter()
    t0 = last
    if case.async_depth <= 0:
        for i in range(iters):
            s = time.perf_counter()
            post().wait(120)
            lat[i] = time.perf_counter() - s
            if progress and s - last >= 0.1:
                progress(i + 1 - shown)
                shown, last = i + 1, s
    else:
        inflight: list[tuple[tether.Transfer, float]] = []
        for i in range(iters):
            if len(inflight) >= case.async_depth:
                t, s = inflight.pop(0)
                t.wait(120)
                lat[i - len(inflight) - 1] = time.perf_counter() - s
            posted = post()
            s = time.perf_counter()
            inflight.append((posted, s))
            if progress and s - last >= 0.1:
                progress(i + 1 - shown)
                shown, last = i + 1, s
        for j, (t, s) in enumerate(inflight):
            t.wait(120)
            lat[iters - len(inflight) + j] = time.perf_counter() - s
    elapsed = time.perf_counter() - t0
    if progress and shown < iters:
        progress(iters - shown)
    steal = steal_share(ticks0)
    cpu_c = cpu_seconds() - cpu_c0
    if case.mode == "send":
        pair.channel.recv()  # the server's receives are all done
        cpu_s = float("nan")
    else:
        cpu_s = pair.ask("cpu") - cpu_s0
    where = lambda d: "cpu" if d is None else f"gpu{d}"  # noqa: E731
    return Result(
        mode=case.mode, transport=transport or pair.peer.transport,
        device=f"{where(pair.device)}>{where(pair.remote_device)}" if pair.device is not None or pair.remote_device is not None else "cpu",
        size=case.size, num_iovs=case.num_iovs,
        iters=iters, gbps=total * iters / elapsed / 1e9,
        lat_p50_us=float(np.percentile(lat, 50) * 1e6), lat_p99_us=float(np.percentile(lat, 99) * 1e6),
        cpu_client=100.0 * cpu_c / elapsed, cpu_server=100.0 * cpu_s / elapsed, check=check_ok,
        steal_pct=steal)


def _checked_iteration(pair: Pair, case: Case, blocks, post, rng) -> bool:
    total = case.size * case.num_iovs
    if case.mode == "write":
        pair.src.randomize_spans([(lo, n) for lo, _, n in blocks], rng)
        pair.ask("poison", pair.capacity)
        post().wait(120)
        spans = sorted(((ro, lo, n) for lo, ro, n in blocks))
        return pair.ask("verify", [(ro, n) for ro, _, n in spans], spans_digest(pair.src, [(lo, n) for _, lo, n in spans]))
    if case.mode == "read":
        by_remote = sorted(blocks, key=lambda b: b[1])
        expect_by_remote = pair.ask("fill", [(ro, n) for _, ro, n in by_remote])
        pair.src.fill(POISON)
        post().wait(120)
        return spans_digest(pair.src, [(lo, n) for lo, _, n in by_remote]) == expect_by_remote
    data = rng.integers(0, 256, total, dtype=np.uint8)
    pair.src.put(0, data)
    pair.ask("recv_check", total, digest(data))
    post().wait(120)
    return bool(pair.channel.recv())


def auto_iters(size: int, num_iovs: int) -> int:
    """Enough iterations for a stable figure, bounded so the default sweep fits in seconds."""
    per_op = size * num_iovs
    return int(min(2000, max(5, (512 << 20) // per_op)))


def machine_info() -> dict:
    return {
        "hostname": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(), "tether": tether.__version__,
    }


def result_dict(r: Result) -> dict:
    d = asdict(r)
    d.pop("config", None)
    if r.ceiling_gbps is None:
        d.pop("ceiling_gbps")
    else:
        d["of_ceiling"] = round(r.gbps / r.ceiling_gbps, 4) if r.ceiling_gbps else None
    if r.gbps > 0 and r.cpu_client == r.cpu_client and r.cpu_server == r.cpu_server:  # not NaN
        d["cpu_s_per_gb"] = round((r.cpu_client + r.cpu_server) / 100.0 / r.gbps, 5)  # both sides
    return d


# ---------------------------------------------------------------- the loopback TCP ceiling
# bench/tools/tcp_ceiling.c: N plain TCP streams over loopback with tether's socket options, chunk size
# and framing, page-locked buffers, one thread per stream on each side; GB/s and CPU-s per GB.

CEILING_SOURCE = os.path.join("bench", "tools", "tcp_ceiling.c")


def ceiling_tool() -> str:
    """The tcp_ceiling executable: $TETHER_TCP_CEILING, the one installed in this package (CMake target
    tcp_ceiling), or one compiled with cc from the source tree (cached under ~/.cache/tether, by the
    source's hash). Raises BenchError saying why there is none."""
    import shutil
    import subprocess

    env = os.environ.get("TETHER_TCP_CEILING")
    if env:
        if not os.access(env, os.X_OK):
            raise BenchError(f"TETHER_TCP_CEILING={env} is not an executable")
        return env
    here = os.path.dirname(os.path.abspath(tether.__file__))
    installed = os.path.join(here, "tcp_ceiling")
    if os.access(installed, os.X_OK):
        return installed
    source = os.path.join(os.path.dirname(os.path.dirname(here)), CEILING_SOURCE)
    if not os.path.exists(source):
        raise BenchError("tcp_ceiling is not installed here (build with CMake's tcp_ceiling target, or set "
                         "TETHER_TCP_CEILING to its path)")
    with open(source, "rb") as f:
        tag = hashlib.sha256(f.read()).hexdigest()[:12]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tether")
    exe = os.path.join(cache, f"tcp_ceiling-{tag}")
    if os.access(exe, os.X_OK):
        return exe
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise BenchError(f"no C compiler to build {CEILING_SOURCE} (set CC, or TETHER_TCP_CEILING)")
    os.makedirs(cache, exist_ok=True)
    tmp = f"{exe}.{os.getpid()}"
    p = subprocess.run([cc, "-O2", "-pthread", "-o", tmp, source, "-ldl"], capture_output=True, text=True)
    if p.returncode != 0:
        raise BenchError(f"building {CEILING_SOURCE} failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    os.replace(tmp, exe)
    return exe


def tcp_ceiling(streams: int, chunk_bytes: int = 1 << 20, socket_buffer: int = 4 << 20, seconds: float = 2.0,
                cuda: bool = False, buffer_bytes: int = 256 << 20) -> dict:
    """Runs tcp_ceiling once: its JSON (gbps, per_stream_gbps, cpu_s_per_gb {sender, receiver, both},
    pinned, ...) plus "command". Raises BenchError on failure."""
    import subprocess

    cmd = [ceiling_tool(), "-n", str(streams), "-t", str(seconds), "-c", str(chunk_bytes),
           "-s", str(socket_buffer), "-b", str(max(buffer_bytes, 2 * chunk_bytes * streams)), "--json"]
    if cuda:
        cmd.append("--cuda")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    except subprocess.TimeoutExpired:
        raise BenchError(f"tcp_ceiling gave no result in {seconds + 60:.0f} s") from None
    if p.returncode != 0:
        raise BenchError(f"tcp_ceiling failed: {(p.stderr.strip().splitlines() or [f'exit {p.returncode}'])[-1]}")
    out = json.loads(p.stdout)
    out["command"] = " ".join(["tcp_ceiling"] + cmd[1:])
    return out
