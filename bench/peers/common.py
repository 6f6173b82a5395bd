"""What every driver shares: the workloads, the target process's command loop, the checked write
and the timing loop. Timing follows tether.bench.run_case (so rows are comparable): a warm-up, then
`iters` ops; p50/p99 are per-op issue-to-completion times; GB/s = bytes moved / elapsed / 1e9.

A driver is run by run.py as its own process (`python bench/peers/X_driver.py [variant]`) and prints
one `ROW {json}` line per finished workload, so rows finished before a hang or a crash still count.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

CAPACITY = 336 << 20  # source and target buffers; the largest workload (298 x 1.15 MB) fits
DEVICE = os.environ.get("PEERS_DEVICE", "cpu")  # "gpu": buffers in GPU memory (run.py --device)
POISON = 0xA5
PIPE_TIMEOUT = 60.0  # seconds a driver waits on its target process before giving up


@dataclass(frozen=True)
class Workload:
    name: str
    size: int      # bytes per block
    blocks: int    # blocks per op (one vectored/batched op when > 1)
    iters: int
    warmup: int
    depth: int     # 0: one op at a time; N: up to N ops in flight
    mode: str = "write"  # "read": the initiator pulls the target's blocks into its own buffer


# The iteration counts of bench/compare_tcp.py (so tether's rows match docs/PERFORMANCE.md); the
# slowest peer here (about 0.5 GB/s, 100 µs per small op) still finishes each workload in seconds
# and the whole run takes about a minute and a half.
WORKLOADS = [
    Workload("256 MiB write", 256 << 20, 1, 10, 2, 0),
    Workload("128 x 1.15 MB writev", 1179648, 128, 10, 2, 0),
    # The KV-cache shapes published for NIXL: one DeepSeek-R1 request's pages (351 MB), small pages.
    Workload("298 x 1.15 MB writev (KV)", 1179648, 298, 5, 1, 0),
    Workload("4096 x 16 KiB writev (KV)", 16 << 10, 4096, 10, 2, 0),
    # The decode side's pull of those pages (vLLM's NixlConnector READs the prefill worker's KV blocks).
    Workload("4096 x 16 KiB readv (KV pull)", 16 << 10, 4096, 10, 2, 0, "read"),
    Workload("64 KiB write", 64 << 10, 1, 5000, 200, 0),
    Workload("64 KiB write, 8 in flight", 64 << 10, 1, 5000, 200, 8),
    Workload("8 B write", 8, 1, 20000, 1000, 0),
]
# run.py --workloads: only these (names, comma-separated)
if os.environ.get("PEERS_WORKLOADS"):
    _names = os.environ["PEERS_WORKLOADS"].split(";")
    _unknown = set(_names) - {w.name for w in WORKLOADS}
    if _unknown:
        raise SystemExit(f"unknown workloads {sorted(_unknown)}; known: {[w.name for w in WORKLOADS]}")
    WORKLOADS = [w for w in WORKLOADS if w.name in _names]


def layout(w: Workload, rng: np.random.Generator) -> list[tuple[int, int, int]]:
    """(local offset, remote offset, length) per block; blocks land in shuffled order remotely
    (as tether.bench does), so a vectored op cannot pass as one contiguous copy."""
    order = rng.permutation(w.blocks) if w.blocks > 1 else [0]
    return [(i * w.size, int(order[i]) * w.size, w.size) for i in range(w.blocks)]


# ---------------------------------------------------------------- buffers

def gpus() -> tuple[int, int]:
    """The initiator's and the target's GPU with PEERS_DEVICE=gpu: GPU 0 -> GPU 1 where there are two
    (over NVLink or PCIe, as a prefill and a decode worker on one node), else GPU 0 on both sides."""
    import torch
    return 0, (1 if torch.cuda.device_count() > 1 else 0)


def alloc(n: int, fill: int = 0, target: bool = False):
    """A buffer of n bytes in host memory (numpy) or, with PEERS_DEVICE=gpu, the initiator's or the
    target's GPU (a torch tensor; gpus())."""
    if DEVICE == "gpu":
        import torch
        return torch.full((n,), fill, dtype=torch.uint8, device=f"cuda:{gpus()[1 if target else 0]}")
    from tether.bench import huge_aligned  # from a 2 MiB boundary, as tether bench's own buffers
    buf = huge_aligned(n)
    buf.fill(fill)
    return buf


def address(buf) -> int:
    return buf.ctypes.data if isinstance(buf, np.ndarray) else buf.data_ptr()


def mem_type(buf) -> str:
    return "DRAM" if isinstance(buf, np.ndarray) else "VRAM"


def device_id(buf) -> int:
    """The GPU ordinal a GPU buffer lies on (NIXL's devId), 0 for host memory."""
    return 0 if isinstance(buf, np.ndarray) else buf.device.index


def _fill_random(buf, lo: int, n: int, rng) -> None:
    data = rng.integers(0, 256, n, dtype=np.uint8)
    if isinstance(buf, np.ndarray):
        buf[lo:lo + n] = data
    else:
        import torch
        buf[lo:lo + n].copy_(torch.from_numpy(data))
        torch.cuda.synchronize(buf.device)


def _fill_value(buf, lo: int, n: int, value: int) -> None:
    if isinstance(buf, np.ndarray):
        buf[lo:lo + n] = value
    else:
        import torch
        buf[lo:lo + n].fill_(value)
        torch.cuda.synchronize(buf.device)


def _span(buf, lo: int, n: int):
    return memoryview(buf[lo:lo + n]) if isinstance(buf, np.ndarray) else buf[lo:lo + n].cpu().numpy().data


# ---------------------------------------------------------------- target side

def serve(conn, buf: np.ndarray) -> None:
    """The target's command loop over a multiprocessing pipe, until 'exit' or the pipe closes.
    Transfers land in `buf` without the target doing anything; it only poisons and hashes."""
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            return
        if cmd == "exit":
            return
        if cmd == "poison":
            if isinstance(buf, np.ndarray):
                buf.fill(POISON)
            else:  # fill_ only queues a kernel: done before the initiator's write may land
                import torch
                buf.fill_(POISON)
                torch.cuda.synchronize(buf.device)
            conn.send(True)
        elif cmd == "randomize":  # [(offset, length), ...], seed: random bytes there (what a read fetches)
            rng = np.random.default_rng(args[1])
            for off, n in args[0]:
                _fill_random(buf, off, n, rng)
            conn.send(True)
        elif cmd == "digest":  # [(offset, length), ...] in remote-offset order
            h = hashlib.blake2b(digest_size=16)
            for off, n in args[0]:
                h.update(_span(buf, off, n))
            conn.send(h.digest())


# ---------------------------------------------------------------- initiator side

def ask(conn, *cmd):
    conn.send(cmd)
    if not conn.poll(PIPE_TIMEOUT):
        raise TimeoutError(f"target did not answer {cmd[0]!r} in {PIPE_TIMEOUT:.0f} s")
    return conn.recv()


def checked_write(conn, src, blocks, write_once: Callable[[], None], rng) -> bool:
    """Random source bytes, poisoned target, one write, then the target's hash of the written spans
    against the source's: a peer that silently does nothing (or writes elsewhere) fails here."""
    for lo, _, n in blocks:
        _fill_random(src, lo, n, rng)
    ask(conn, "poison")
    write_once()
    spans = sorted((ro, lo, n) for lo, ro, n in blocks)
    h = hashlib.blake2b(digest_size=16)
    for _, lo, n in spans:
        h.update(_span(src, lo, n))
    return ask(conn, "digest", [(ro, n) for ro, _, n in spans]) == h.digest()


def checked_read(conn, dst, blocks, read_once: Callable[[], None], rng) -> bool:
    """Random bytes in the target's blocks, our destinations poisoned, one read, then our spans' hash
    (in the target's order) against the target's hash of its own."""
    for lo, _, n in blocks:
        _fill_value(dst, lo, n, POISON)
    spans = sorted((ro, lo, n) for lo, ro, n in blocks)
    ask(conn, "randomize", [(ro, n) for ro, _, n in spans], int(rng.integers(1 << 31)))
    read_once()
    h = hashlib.blake2b(digest_size=16)
    for _, lo, n in spans:
        h.update(_span(dst, lo, n))
    return ask(conn, "digest", [(ro, n) for ro, _, n in spans]) == h.digest()


def checked(w: Workload, conn, buf, blocks, once: Callable[[], None], rng) -> bool:
    """checked_write or checked_read, as the workload's mode says."""
    return (checked_read if w.mode == "read" else checked_write)(conn, buf, blocks, once, rng)


def measure(w: Workload, post: Callable[[int], object], wait: Callable[[object], None]) -> dict:
    """post(i) issues op i (a sync API may finish it right there and return None); wait(h) completes
    it. With depth N the oldest op is waited for once N are in flight, as in tether.bench."""
    for i in range(w.warmup):
        wait(post(i))
    lat = np.empty(w.iters)
    t0 = time.perf_counter()
    if w.depth <= 0:
        for i in range(w.iters):
            s = time.perf_counter()
            wait(post(i))
            lat[i] = time.perf_counter() - s
    else:
        inflight: list[tuple[object, float, int]] = []
        for i in range(w.iters):
            if len(inflight) >= w.depth:
                h, s, j = inflight.pop(0)
                wait(h)
                lat[j] = time.perf_counter() - s
            inflight.append((post(i), time.perf_counter(), i))
        for h, s, j in inflight:
            wait(h)
            lat[j] = time.perf_counter() - s
    elapsed = time.perf_counter() - t0
    return {"gbps": w.size * w.blocks * w.iters / elapsed / 1e9,
            "p50_us": float(np.percentile(lat, 50) * 1e6), "p99_us": float(np.percentile(lat, 99) * 1e6)}


_rows_out = sys.stdout


def emit(system: str, workload: str, verified: Optional[bool] = None, **fields) -> None:
    """One result (or one 'why not' row, with note=...) for run.py, flushed at once."""
    row = {"system": system, "workload": workload, "verified": verified, **fields}
    print("ROW " + json.dumps(row), file=_rows_out, flush=True)


def quiet_stdout() -> None:
    """Native libraries may log to stdout: keep the real stdout for ROW lines only (a private
    duplicate of fd 1) and point fd 1 at stderr, which run.py shows only when a driver fails."""
    global _rows_out
    _rows_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)


def start_target(target: Callable, what: str):
    """Spawns the target side (`target(conn)`), waits for its ("ok", peer info, remote address) or
    ("error", message, None). Returns (process, pipe, peer info, remote address); raises on failure."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # the target inherits the environment set so far
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child,), daemon=True)
    proc.start()
    if not conn.poll(PIPE_TIMEOUT):
        proc.kill()
        raise TimeoutError(f"target {what} did not start")
    status, info, raddr = conn.recv()
    if status != "ok":
        proc.kill()
        raise RuntimeError(f"target: {info}")
    return proc, conn, info, raddr


def stop_target(proc, conn) -> None:
    """Asks the target side to exit; kills it where it has not within 10 s."""
    conn.send(("exit",))
    proc.join(10)
    if proc.is_alive():
        proc.kill()
