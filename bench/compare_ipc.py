"""Side by side, one run, one machine: tether's same-host transport (ipc) against a single-thread
memcpy of the same size (the ipc host-memory goal: 256 MiB write >= 0.9 x memcpy), and beside
ipc through shared memory (TETHER_IPC_HOST=shm) and tcp. Two processes (tether bench's LocalPair).

    python bench/compare_ipc.py [--check] [--json out.json]

The host's speed drifts, so memcpy is measured right before and right after each 256 MiB ipc row
and the ratio uses their mean.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from rich.table import Table

from compare_tcp import CHECK, options
from tether import bench as B

BIG = 256 << 20


def memcpy_gbps(src: np.ndarray, dst: np.ndarray, iters: int = 5) -> float:
    """Median GB/s of libc memcpy (one thread) of src into dst, both already faulted in."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        ctypes.memmove(dst.ctypes.data, src.ctypes.data, src.nbytes)
        times.append(time.perf_counter() - t0)
    return src.nbytes / float(np.median(times)) / 1e9


def main() -> int:
    args, console = options()
    src = np.random.default_rng(1).integers(0, 256, BIG, dtype=np.uint8)
    dst = np.ones(BIG, dtype=np.uint8)
    memcpy_gbps(src, dst, 2)  # warm

    def cases(check):
        return [
            ("1 MiB write", B.Case("write", 1 << 20, 1, 300, 30, 0, check)),
            ("16 MiB write", B.Case("write", 16 << 20, 1, 40, 4, 0, check)),
            ("256 MiB write", B.Case("write", BIG, 1, 6, 1, 0, check)),
            ("128 x 1.15 MB writev", B.Case("write", 1179648, 128, 6, 1, 0, check)),
            ("256 MiB read", B.Case("read", BIG, 1, 6, 1, 0, check)),
        ]

    configs = [
        ("ipc", dict(transport="ipc")),
        ("ipc chunk 4 MiB", dict(transport="ipc", chunk_bytes=4 << 20)),
        ("ipc chunk 16 MiB", dict(transport="ipc", chunk_bytes=16 << 20)),
        ("ipc shm", dict(transport="ipc", ipc_host="shm")),
        ("tcp", dict(transport="tcp")),
    ]
    rows = []
    for label, opts in configs:
        pair = B.LocalPair(opts, BIG)
        try:
            for name, case in cases(args.check):
                if label.startswith("ipc chunk") and (case.size != BIG or case.mode != "write"):
                    continue  # the chunk sweep is about the large transfer
                big = case.size == BIG and case.mode == "write"
                before = memcpy_gbps(src, dst) if big else None
                r = B.run_case(pair, case, transport=pair.peer.transport)
                after = memcpy_gbps(src, dst) if big else None
                mc = (before + after) / 2 if before else None
                rows.append((label, name, r, mc))
        finally:
            pair.close()

    t = Table(title=f"tether ipc vs memcpy and tcp, two processes, {os.cpu_count()} CPUs ({time.strftime('%Y-%m-%d')})")
    for c in ("config", "case", "GB/s", "p50 µs", "memcpy GB/s", "vs memcpy", "CPU% c/s", "check"):
        t.add_column(c, justify="right")
    out = []
    for label, name, r, mc in rows:
        t.add_row(label, name, f"{r.gbps:.2f}", f"{r.lat_p50_us:.1f}", f"{mc:.2f}" if mc else "",
                  f"{r.gbps / mc:.2f}" if mc else "", f"{r.cpu_client:.0f}/{r.cpu_server:.0f}",
                  CHECK[r.check])
        out.append(dict(B.result_dict(r), config=label, case=name, memcpy_gbps=mc))
    console.print(t)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": B.machine_info(), "results": out}, indent=2))
    return 1 if any(r.check is False for _, _, r, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
