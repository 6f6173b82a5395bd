#!/usr/bin/env python3
"""Where a 4,096 x 16 KiB scattered GPU0 -> GPU1 write over ipc spends its time: the posting
thread's share (post() returning, one op at a time) against the whole op, and the rate with 1, 2, 4
and 8 ops in flight, for a few lane counts. If the rate keeps rising with depth, ops do not overlap
and a per-op cost (posting, a lane's host work) bounds the figure; if it is flat, the copies are.
A probe for the device (GPU0 -> GPU1; GPU0 -> GPU0 between two processes with one GPU), not a gate.

    python3 bench/gpu/scatter_probe.py [--channels 16,32] [--depths 1,2,4,8] [--host]
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import tether
from tether import bench as B

N, SIZE = 4096, 16 << 10


def post_split(pair, iters: int) -> tuple[float, float]:
    """Median post() time and median post-to-done time (µs), one op at a time."""
    rng = np.random.default_rng(3)
    local = np.arange(N, dtype=np.uint64) * SIZE
    remote = rng.permutation(N).astype(np.uint64) * SIZE
    rr = tether.RemoteRegion(pair.remote)
    posts, totals = [], []
    for i in range(iters):
        t0 = time.perf_counter()
        t = pair.peer.writev_blocks(pair.src_region, rr, local, remote, SIZE)
        t1 = time.perf_counter()
        t.wait(60)
        t2 = time.perf_counter()
        if i >= iters // 5:
            posts.append((t1 - t0) * 1e6)
            totals.append((t2 - t0) * 1e6)
    return float(np.median(posts)), float(np.median(totals))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--channels", default="16,32")
    ap.add_argument("--depths", default="1,2,4,8")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--host", action="store_true", help="host memory on both sides (a dry run without GPUs)")
    a = ap.parse_args()
    rows = []
    other = 0
    if not a.host:
        import torch
        other = 1 if torch.cuda.device_count() > 1 else 0
    for ch in (int(x) for x in a.channels.split(",")):
        pair = B.LocalPair(dict(transport="ipc", channels=ch, window=64), N * SIZE,
                          **({} if a.host else dict(device=0, remote_device=other)))
        try:
            post_us, total_us = post_split(pair, a.iters)
            print(f"channels {ch}: one at a time, post {post_us:.1f} us of {total_us:.1f} us", flush=True)
            for d in (int(x) for x in a.depths.split(",")):
                r = B.run_case(pair, B.Case("write", SIZE, N, a.iters, 5, d, False))
                rows.append((ch, d, r.gbps, r.lat_p50_us))
                print(f"channels {ch} depth {d}: {r.gbps:.1f} GB/s p50 {r.lat_p50_us:.1f} us", flush=True)
        finally:
            pair.close()
    print(f"\n{'channels':>8} {'depth':>5} {'GB/s':>8} {'p50 us':>8}")
    for ch, d, g, p in rows:
        print(f"{ch:>8} {d:>5} {g:>8.1f} {p:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
