"""`tether bench`: transfers between two local processes (or two hosts), measured and verified.

The client process drives; the server process owns the target buffer and answers commands over
a pipe (local mode) or over tether notifications (two-host mode is not in this module yet).
GB/s uses 1 GB = 1e9 B; bytes moved per op = size x num_iovs.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import platform
import resource
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import numpy as np

import tether

POISON = 0xA5


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def parse_size(text: str) -> int:
    """'4K', '1MiB', '1.5M', '256' -> bytes (K/M/G are binary, as in every peer's benchmark)."""
    t = text.strip().upper().replace("IB", "").replace("B", "")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    value = float(t) * mult
    if value <= 0 or value != int(value):
        raise ValueError(f"bad size {text!r}")
    return int(value)


def human(n: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def digest(buf: np.ndarray) -> bytes:
    return hashlib.blake2b(memoryview(buf), digest_size=16).digest()


@dataclass
class Case:
    mode: str          # write | read | send
    size: int          # bytes per block
    num_iovs: int      # blocks per op
    iters: int
    warmup: int
    async_depth: int   # 0: one op at a time; N: up to N ops in flight
    check: bool


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


# ---------------------------------------------------------------- server process

def _server_main(conn, options: dict, capacity: int) -> None:
    """Target side: owns one buffer, answers the client's commands until 'exit'."""
    ep = tether.Endpoint(**options)
    buf = np.empty(capacity, dtype=np.uint8)
    buf.fill(POISON)
    region = ep.register(buf)
    conn.send((ep.metadata(), region.descriptor()))
    peer = None
    rng = np.random.default_rng()
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "exit":
                break
            if cmd == "cpu":
                conn.send(cpu_seconds())
            elif cmd == "poison":
                buf[: args[0]].fill(POISON)
                conn.send(True)
            elif cmd == "verify":  # [(offset, length), ...], expected digest of their concatenation
                spans, expect = args
                h = hashlib.blake2b(digest_size=16)
                for off, n in spans:
                    h.update(memoryview(buf[off:off + n]))
                conn.send(h.digest() == expect)
            elif cmd == "fill":  # random source data for reads; returns the digest of the spans
                spans = args[0]
                h = hashlib.blake2b(digest_size=16)
                for off, n in spans:
                    buf[off:off + n] = rng.integers(0, 256, n, dtype=np.uint8)
                    h.update(memoryview(buf[off:off + n]))
                conn.send(h.digest())
            elif cmd == "recv":  # post `count` receives of `size` bytes, one after another
                size, count = args
                if peer is None:
                    peer = ep.peers()[0]
                conn.send(True)
                for _ in range(count):
                    peer.recv(region, length=size).wait(60)
                conn.send(True)
            elif cmd == "recv_check":
                size, expect = args
                if peer is None:
                    peer = ep.peers()[0]
                buf[:size].fill(POISON)
                conn.send(True)
                t = peer.recv(region, length=size).wait(60)
                conn.send(t.bytes == size and digest(buf[:size]) == expect)
    finally:
        ep.close()


# ---------------------------------------------------------------- client

class LocalPair:
    """A server process plus a connected client endpoint in this process."""

    def __init__(self, options: dict, capacity: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_server_main, args=(child, options, capacity), daemon=True)
        self.proc.start()
        if not self.conn.poll(60):
            raise RuntimeError("bench server did not start")
        metadata, self.remote = self.conn.recv()
        self.ep = tether.Endpoint(**options)
        t0 = time.perf_counter()
        self.peer = self.ep.connect(metadata)
        self.connect_ms = (time.perf_counter() - t0) * 1e3
        self.capacity = capacity
        self.src = np.empty(capacity, dtype=np.uint8)
        self.src_region = self.ep.register(self.src)

    def ask(self, *cmd):
        self.conn.send(cmd)
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(("exit",))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        self.ep.close()


def _layout(case: Case, capacity: int, rng: np.random.Generator) -> list[tuple[int, int, int]]:
    """(local offset, remote offset, length) per block: blocks land in a shuffled order remotely."""
    n = case.num_iovs
    order = rng.permutation(n) if n > 1 else np.zeros(1, dtype=np.int64)
    assert case.size * n <= capacity
    return [(i * case.size, int(order[i]) * case.size, case.size) for i in range(n)]


def run_case(pair: LocalPair, case: Case, transport: str = "tcp", progress: Optional[Callable] = None) -> Result:
    rng = np.random.default_rng()
    blocks = _layout(case, pair.capacity, rng)
    total = case.size * case.num_iovs
    remote = tether.RemoteRegion(pair.remote)
    peer, local = pair.peer, pair.src_region
    entries = [(local, lo, remote, ro, n) for lo, ro, n in blocks]

    def post():
        if case.mode == "write":
            if case.num_iovs == 1:
                return peer.write(local, remote, local_offset=blocks[0][0], remote_offset=blocks[0][1], length=total)
            return peer.writev(entries)
        if case.mode == "read":
            if case.num_iovs == 1:
                return peer.read(local, remote, local_offset=blocks[0][0], remote_offset=blocks[0][1], length=total)
            return peer.readv(entries)
        return peer.send(local, length=total)

    if case.mode == "send" and case.num_iovs != 1:
        raise ValueError("send takes --num-iovs 1")
    check_ok: Optional[bool] = None
    if case.check:
        check_ok = True
        for _ in range(case.iters):
            check_ok &= _checked_iteration(pair, case, blocks, post, rng)
            if progress:
                progress()
        # Timing comes from a separate unchecked pass, so hashing never counts as transfer time.
    if case.mode == "send":
        pair.conn.send(("recv", total, case.warmup + case.iters))
        pair.conn.recv()
    for _ in range(case.warmup):
        post().wait(120)
    lat = np.empty(case.iters)
    cpu_c0, cpu_s0 = cpu_seconds(), pair.ask("cpu") if case.mode != "send" else None
    t0 = time.perf_counter()
    if case.async_depth <= 0:
        for i in range(case.iters):
            s = time.perf_counter()
            post().wait(120)
            lat[i] = time.perf_counter() - s
            if progress:
                progress()
    else:
        inflight: list[tuple[tether.Transfer, float]] = []
        for i in range(case.iters):
            if len(inflight) >= case.async_depth:
                t, s = inflight.pop(0)
                t.wait(120)
                lat[i - len(inflight) - 1] = time.perf_counter() - s
            inflight.append((post(), time.perf_counter()))
            if progress:
                progress()
        for j, (t, s) in enumerate(inflight):
            t.wait(120)
            lat[case.iters - len(inflight) + j] = time.perf_counter() - s
    elapsed = time.perf_counter() - t0
    cpu_c = cpu_seconds() - cpu_c0
    if case.mode == "send":
        pair.conn.recv()
        cpu_s = float("nan")
    else:
        cpu_s = pair.ask("cpu") - cpu_s0
    return Result(
        mode=case.mode, transport=transport, device="cpu", size=case.size, num_iovs=case.num_iovs,
        iters=case.iters, gbps=total * case.iters / elapsed / 1e9,
        lat_p50_us=float(np.percentile(lat, 50) * 1e6), lat_p99_us=float(np.percentile(lat, 99) * 1e6),
        cpu_client=100.0 * cpu_c / elapsed, cpu_server=100.0 * cpu_s / elapsed, check=check_ok)


def _checked_iteration(pair: LocalPair, case: Case, blocks, post, rng) -> bool:
    total = case.size * case.num_iovs
    if case.mode == "write":
        for lo, _, n in blocks:
            pair.src[lo:lo + n] = rng.integers(0, 256, n, dtype=np.uint8)
        pair.ask("poison", pair.capacity)
        post().wait(120)
        h = hashlib.blake2b(digest_size=16)
        spans = sorted(((ro, lo, n) for lo, ro, n in blocks))
        for ro, lo, n in spans:
            h.update(memoryview(pair.src[lo:lo + n]))
        return pair.ask("verify", [(ro, n) for ro, _, n in spans], h.digest())
    if case.mode == "read":
        expect_by_remote = pair.ask("fill", [(ro, n) for _, ro, n in sorted(blocks, key=lambda b: b[1])])
        pair.src.fill(POISON)
        post().wait(120)
        h = hashlib.blake2b(digest_size=16)
        for lo, ro, n in sorted(blocks, key=lambda b: b[1]):
            h.update(memoryview(pair.src[lo:lo + n]))
        return h.digest() == expect_by_remote
    pair.src[:total] = rng.integers(0, 256, total, dtype=np.uint8)
    pair.conn.send(("recv_check", total, digest(pair.src[:total])))
    pair.conn.recv()
    post().wait(120)
    return bool(pair.conn.recv())


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
    return d
