#!/usr/bin/env python3
"""Staged GPU transfers over tcp with both endpoints in ONE process (one CUDA context), to set beside
`tether bench --transport tcp --device gpu` (two processes, two contexts on the same GPU). The same
threads, sockets and staging run in both; what differs is whether the two sides' copies into and out
of the GPU come from one context or from two that the GPU time-slices. A probe for the one-GPU device
host (issue 20: where a staged GPU read's time goes), not a gate.

    python3 bench/gpu/one_context.py [--sizes 16M,256M] [--iters 20] [--mode read,write]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import tether
from tether.bench import parse_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16M,256M")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mode", default="read,write")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: nothing to measure", file=sys.stderr)
        return 1
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    big = max(sizes)
    with tether.Endpoint(transport="tcp") as ea, tether.Endpoint(transport="tcp") as eb:
        mine = torch.empty(big, dtype=torch.uint8, device="cuda:0")
        theirs = torch.randint(0, 256, (big,), dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        ra, rb = ea.register(mine), eb.register(theirs)
        peer = ea.connect(eb.metadata(), timeout=10)
        desc = rb.descriptor()
        print(f"{'mode':>5} {'size':>8} {'GB/s (median)':>14} {'p50 µs':>9}  one process, one CUDA context, tcp")
        for mode in a.mode.split(","):
            for size in sizes:
                op = peer.read if mode == "read" else peer.write
                if mode == "read":  # verified once: poisoned destination, every byte compared
                    mine[:size].fill_(0xA5)
                    torch.cuda.synchronize()
                    op(ra, desc, length=size).wait(30)
                    if not torch.equal(mine[:size], theirs[:size]):
                        print(f"{mode} {size}: bytes differ", file=sys.stderr)
                        return 2
                times = []
                for i in range(a.warmup + a.iters):
                    t0 = time.perf_counter()
                    op(ra, desc, length=size).wait(30)
                    if i >= a.warmup:
                        times.append(time.perf_counter() - t0)
                p50 = statistics.median(times)
                print(f"{mode:>5} {size >> 20:>6}Mi {size / p50 / 1e9:14.2f} {p50 * 1e6:9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
