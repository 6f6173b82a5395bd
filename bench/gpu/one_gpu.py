#!/usr/bin/env python3
"""The one-GPU table: tether between two processes sharing GPU 0 (GPU0 -> GPU0), over tcp
(staging through pinned host memory both ways, one PCIe link) and ipc (CUDA IPC on one device), with
the ceilings measured in the same call: pinned copies each way, a device-to-device copy on GPU 0, and
loopback TCP (bench/tools/tcp_ceiling.c, page-locked by cudaHostAlloc): each tcp row runs
`tether bench --ceiling` (as many streams as tether's lanes, right after the row), and 8 streams once. Rows: 1 MiB, 16 MiB and 256 MiB writes one at a time, and the 4,096 x
16 KiB scattered write (one vectored op), every one byte-checked (`tether bench --check`).
Each step is bounded; the markdown table comes last (docs/PERFORMANCE.md, "Same host: ipc, GPU memory", its GPU0 → GPU0 table).

    python3 bench/gpu/one_gpu.py [--remote-gpu 0] [--json out.json] [--step-timeout 150]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

MiB = 1 << 20


def _ceiling_tool() -> bool:
    try:
        from tether import bench as B
        B.ceiling_tool()
        return True
    except Exception as e:  # no compiler, not installed: the Python streams stand in
        print(f"no tcp_ceiling ({e}): tcp rows without their own ceiling", flush=True)
        return False


CEILING_TOOL = _ceiling_tool()
CASES = [("256 MiB write", ["--sizes", "256M"]), ("16 MiB write", ["--sizes", "16M"]),
         ("1 MiB write", ["--sizes", "1M"]), ("4,096 x 16 KiB write", ["--sizes", "16K", "--num-iovs", "4096"])]


def tether_row(transport: str, remote: int, args: list, timeout: float) -> dict:
    """One `tether bench` case in its own processes: {"gbps", "p50", "check"} or {"error"}."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "r.json")
        cmd = [sys.executable, "-m", "tether", "bench", "--transport", transport, "--device", "gpu",
               "--local-gpu-idx", "0", "--remote-gpu-idx", str(remote), "--mode", "write", "--check", "--quiet",
               "--json", path, *args] + (["--ceiling"] if transport == "tcp" and CEILING_TOOL else [])
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"no result in {timeout:.0f} s"}
        if p.returncode != 0 or not os.path.exists(path):
            return {"error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:60]}
        doc = json.load(open(path))
        r = doc["results"][0]
        c = (doc.get("ceilings") or [{}])[0]
        return {"gbps": r["gbps"], "p50": r["lat_p50_us"], "check": r["check"], "device": r["device"],
                "cpu_s_per_gb": r.get("cpu_s_per_gb"), "ceiling": c.get("gbps"), "ceiling_streams": c.get("streams"),
                "ceiling_cpu_s_per_gb": (c.get("cpu_s_per_gb") or {}).get("both")}


def copy_ceilings(iters: int = 20, n: int = 256 * MiB) -> dict:
    """GB/s of 256 MiB copies on GPU 0 timed by CUDA events: pinned host -> GPU, GPU -> pinned host,
    GPU -> GPU (device-to-device, bytes copied per second)."""
    import torch

    dev = torch.device("cuda:0")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty(n, dtype=torch.uint8, device=dev)

    def timed(fn) -> float:
        fn()  # warm-up
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return n * iters / (start.elapsed_time(end) / 1e3) / 1e9

    return {"h2d": timed(lambda: a.copy_(host, non_blocking=True)),
            "d2h": timed(lambda: host.copy_(a, non_blocking=True)),
            "d2d": timed(lambda: b.copy_(a, non_blocking=True))}


def _stream(start, seconds: float, out) -> None:
    """One loopback TCP stream: a sender thread and this receiver, 4 MiB at a time, for `seconds`."""
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen(1)
    tx = socket.create_connection(lsn.getsockname())
    rx, _ = lsn.accept()
    buf, sink = bytearray(4 * MiB), bytearray(4 * MiB)
    stop = threading.Event()

    def send():
        view = memoryview(buf)
        try:
            while not stop.is_set():
                tx.sendall(view)
        except OSError:
            pass
        tx.close()

    start.wait(30)
    t0 = time.perf_counter()
    sender = threading.Thread(target=send)
    sender.start()
    got, view = 0, memoryview(sink)
    while time.perf_counter() - t0 < seconds:
        got += rx.recv_into(view)
    elapsed = time.perf_counter() - t0
    stop.set()
    while rx.recv_into(view):  # drain so the sender's last sendall returns
        pass
    sender.join(10)
    out.put((got, elapsed))


def loopback_tcp(streams: int = 8, seconds: float = 3.0) -> float:
    """GB/s of `streams` loopback TCP streams: bench/tools/tcp_ceiling.c (tether's socket options and
    framing, cudaHostAlloc'd buffers, a thread per stream each side), else Python, one process each."""
    if CEILING_TOOL:
        from tether import bench as B
        try:
            return B.tcp_ceiling(streams, seconds=seconds, cuda=True)["gbps"]
        except B.BenchError as e:
            print(f"tcp_ceiling failed ({e}); Python streams instead", flush=True)
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(streams + 1), ctx.Queue()
    procs = [ctx.Process(target=_stream, args=(start, seconds, out), daemon=True) for _ in range(streams)]
    for p in procs:
        p.start()
    start.wait(30)
    results = [out.get(timeout=seconds + 30) for _ in procs]
    for p in procs:
        p.join(10)
    return sum(g for g, _ in results) / max(e for _, e in results) / 1e9


def bounded(fn, timeout: float):
    """fn() in a thread; None after `timeout` s (the step is reported, the table still printed)."""
    box: list = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    return box[0] if box else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--remote-gpu", type=int, default=0, help="the target's GPU (default 0: GPU0 -> GPU0)")
    ap.add_argument("--step-timeout", type=float, default=150)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows: dict = {}
    for name, args in CASES:
        for transport in ("tcp", "ipc"):
            r = rows[(name, transport)] = tether_row(transport, a.remote_gpu, args, a.step_timeout)
            print(f"{transport} {name}: {r}", flush=True)
    copies = bounded(copy_ceilings, 120) or {}
    print(f"copies: {copies}", flush=True)
    tcp8 = bounded(loopback_tcp, 60)
    print(f"loopback TCP, 8 streams: {tcp8}", flush=True)

    def gb(v):
        return "-" if v is None else f"{v:,.1f}"

    d2d = copies.get("d2d")
    print(f"\nGPU0 -> GPU{a.remote_gpu}, two processes, --check; ceilings from this call")
    print("| write | tcp GB/s | tcp p50 µs | tcp / ceiling | ipc GB/s | ipc p50 µs | ipc / D2D copy |")
    print("|---|---|---|---|---|---|---|")
    for name, _ in CASES:
        t, i = rows[(name, "tcp")], rows[(name, "ipc")]
        cells = []
        # tcp's ceiling: the row's own loopback TCP (same call, tether's lanes) or the 8-stream one, and
        # the pinned copies both ways (staging crosses PCIe on each side)
        row_ceiling = min([v for v in (t.get("ceiling") or tcp8, copies.get("h2d"), copies.get("d2h")) if v] or [0]) or None
        for r, ceiling in ((t, row_ceiling), (i, d2d)):
            if "error" in r:
                cells += [f"failed: {r['error']}", "", ""]
                continue
            ok = "" if r["check"] else " (check FAILED)"
            cells += [gb(r["gbps"]) + ok, gb(r["p50"]), f"{r['gbps'] / ceiling:.2f}" if ceiling else "-"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\n| ceiling (same call) | GB/s |")
    print("|---|---|")
    print(f"| pinned host -> GPU copy, 256 MiB | {gb(copies.get('h2d'))} |")
    print(f"| GPU -> pinned host copy, 256 MiB | {gb(copies.get('d2h'))} |")
    print(f"| device-to-device copy on GPU 0, 256 MiB | {gb(d2d)} |")
    print(f"| loopback TCP, 8 streams ({'tcp_ceiling, 1 MiB sends' if CEILING_TOOL else 'Python, 4 MiB sends'}, 3 s) | {gb(tcp8)} |")
    for name, _ in CASES:
        t = rows[(name, "tcp")]
        if t.get("ceiling"):
            print(f"| loopback TCP beside tcp {name}, {t['ceiling_streams']} streams (tether's lanes; "
                  f"{t['ceiling_cpu_s_per_gb']:.3f} CPU-s/GB, tether {t['cpu_s_per_gb'] or float('nan'):.3f}) "
                  f"| {gb(t['ceiling'])} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": {f"{t} {n}": r for (n, t), r in rows.items()}, "copies": copies, "loopback_tcp_8": tcp8},
                      f, indent=1)
    bad = [k for k, r in rows.items() if "error" in r or not r.get("check")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
