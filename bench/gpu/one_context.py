#!/usr/bin/env python3
"""Staged GPU transfers over tcp with both endpoints in ONE process (one CUDA context), to set beside
`tether bench --transport tcp --device gpu` (two processes, two contexts on the same GPU). The same
threads, sockets and staging run in both; what differs is whether the two sides' copies into and out
of the GPU come from one context or from two that the GPU time-slices. A probe for the one-GPU device
host (where a staged GPU read's time goes), not a gate.

    python3 bench/gpu/one_context.py [--sizes 16M,256M] [--iters 20] [--mode read,write]
    python3 bench/gpu/one_context.py --sizes 16K --blocks 4096 --mode write   (scattered blocks)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

import tether
from tether.bench import parse_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16M,256M", help="bytes per op, or per block with --blocks")
    ap.add_argument("--blocks", type=int, default=1,
                    help="blocks of SIZE per op through writev_blocks/readv_blocks, remote order shuffled "
                         "(--sizes 16K --blocks 4096: the scattered KV pattern)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mode", default="read,write")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: nothing to measure", file=sys.stderr)
        return 1
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    n = a.blocks
    big = max(sizes) * n
    order = np.random.default_rng().permutation(n)
    with tether.Endpoint(transport="tcp") as ea, tether.Endpoint(transport="tcp") as eb:
        mine = torch.empty(big, dtype=torch.uint8, device="cuda:0")
        theirs = torch.empty(big, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        ra, rb = ea.register(mine), eb.register(theirs)
        peer = ea.connect(eb.metadata(), timeout=10)
        desc = rb.descriptor()
        print(f"{'mode':>5} {'size':>8} {'blocks':>6} {'GB/s (median)':>14} {'p50 µs':>9}  one process, one CUDA context, tcp")
        for mode in a.mode.split(","):
            for size in sizes:
                local_offsets = np.arange(n, dtype=np.uint64) * size
                remote_offsets = order.astype(np.uint64) * size

                def post():
                    if n == 1:
                        return (peer.read if mode == "read" else peer.write)(ra, desc, length=size)
                    blocks = peer.readv_blocks if mode == "read" else peer.writev_blocks
                    return blocks(ra, desc, local_offsets, remote_offsets, size)

                # Verified once: random source, poisoned destination, every byte compared (block i of
                # ours is block order[i] of theirs).
                src, dst = (theirs, mine) if mode == "read" else (mine, theirs)
                src[:size * n].random_(0, 256)
                dst[:size * n].fill_(0xA5)
                torch.cuda.synchronize()
                post().wait(30)
                idx = torch.as_tensor(order, device="cuda:0")
                ours = mine[:size * n].view(n, size)
                if not torch.equal(ours, theirs[:size * n].view(n, size)[idx]):
                    print(f"{mode} {size} x {n}: bytes differ", file=sys.stderr)
                    return 2
                times = []
                for i in range(a.warmup + a.iters):
                    t0 = time.perf_counter()
                    post().wait(30)
                    if i >= a.warmup:
                        times.append(time.perf_counter() - t0)
                p50 = statistics.median(times)
                print(f"{mode:>5} {size >> 10:>6}Ki {n:>6} {size * n / p50 / 1e9:14.2f} {p50 * 1e6:9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
