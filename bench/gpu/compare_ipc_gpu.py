"""GPU0 -> GPU1 writes between two processes over the ipc transport (CUDA IPC, NVLink), in one run
(GPU0 -> GPU0, two processes sharing it, on a one-GPU machine):
1 MiB, 16 MiB, 256 MiB, 128 x 1.15 MB vectored, 4,096 x 16 KiB scattered vectored; connect time to a
same-host peer; first write to a newly registered remote region (and from a new local allocation)
against a warm one. The ipc GPU goals (docs/PERFORMANCE.md, "Same host: ipc, GPU memory") are printed beside each row.

    python bench/gpu/compare_ipc_gpu.py [--check] [--json out.json] [--channels N] [--gpu-chunk BYTES]

Needs torch and a GPU (tether bench's LocalPair with device=0, remote_device=1, or 0 with one GPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np

import tether
from tether import bench as B

GOALS = {"1 MiB": 100, "256 MiB": 385, "128 x 1.15 MB": 330, "4096 x 16 KiB": 250}


def timed_write(pair, remote_desc, n) -> float:
    t0 = time.perf_counter()
    pair.peer.write(pair.src_region, tether.RemoteRegion(remote_desc), length=n).wait(60)
    return (time.perf_counter() - t0) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--check", action="store_true", help="also verify every byte (separate pass)")
    ap.add_argument("--check-iters", type=int, default=5, help="checked operations per case with --check")
    ap.add_argument("--channels", type=int, default=8)
    ap.add_argument("--gpu-chunk", type=int, default=None, help="ipc_gpu_chunk_bytes (default: the endpoint's)")
    args = ap.parse_args()
    opts = dict(transport="ipc", channels=args.channels, window=64)
    if args.gpu_chunk:
        opts["ipc_gpu_chunk_bytes"] = args.gpu_chunk
    cap = 256 << 20
    cases = [
        ("1 MiB", B.Case("write", 1 << 20, 1, 2000, 100, 16, args.check)),
        ("1 MiB (one at a time)", B.Case("write", 1 << 20, 1, 500, 50, 0, False)),
        ("16 MiB", B.Case("write", 16 << 20, 1, 200, 10, 4, args.check)),
        ("256 MiB", B.Case("write", cap, 1, 20, 2, 2, args.check)),
        ("256 MiB (one at a time)", B.Case("write", cap, 1, 20, 2, 0, False)),
        # 200 ops (~50-80 ms): with 40 a run's figure swung by +-15 % between runs of one build.
        ("128 x 1.15 MB", B.Case("write", 1179648, 128, 200, 10, 2, args.check)),
        ("4096 x 16 KiB", B.Case("write", 16 << 10, 4096, 200, 10, 2, args.check)),
    ]
    if args.check:
        cases = [(n, dataclasses.replace(c, check_iters=args.check_iters)) for n, c in cases]
    rows, extra = [], {}
    import torch
    other = 1 if torch.cuda.device_count() > 1 else 0
    pair = B.LocalPair(opts, cap, device=0, remote_device=other)
    try:
        assert pair.peer.transport == "ipc", pair.peer.transport
        extra["connect_ms"] = pair.connect_ms
        for name, case in cases:
            r = B.run_case(pair, case)
            rows.append((name, r))
            print(f"{name:24s} {r.gbps:8.1f} GB/s  p50 {r.lat_p50_us:9.1f} us  p99 {r.lat_p99_us:9.1f} us"
                  f"  check={r.check}  goal>={GOALS.get(name, '-')}", flush=True)
        # First write to a newly registered remote region vs a warm one (16 MiB).
        n = 16 << 20
        firsts, warms = [], []
        for _ in range(5):
            desc = pair.ask("setup", cap, other)  # the server deregisters and allocates anew
            pair.remote = desc
            firsts.append(timed_write(pair, desc, n))
            warms.append(float(np.median([timed_write(pair, desc, n) for _ in range(20)])))
        extra["first_remote_us"], extra["warm_us"] = float(np.median(firsts)), float(np.median(warms))
        # First write from a new local allocation (the target opens its handle once) vs warm.
        lfirst = []
        for _ in range(5):
            pair.ep.deregister(pair.src_region)
            pair.src = B.Mem(cap, 0)
            torch.cuda.empty_cache()
            pair.src_region = pair.ep.register(pair.src.obj)
            lfirst.append(timed_write(pair, pair.remote, n))
        extra["first_local_us"] = float(np.median(lfirst))
    finally:
        pair.close()
    print()
    print(f"{'case':24s} {'GB/s':>8s} {'goal':>6s}")
    for name, r in rows:
        g = GOALS.get(name)
        ok = "" if g is None else ("ok" if r.gbps >= g else "BELOW")
        print(f"{name:24s} {r.gbps:8.1f} {g if g else '':>6} {ok}")
    print(f"connect to a same-host peer: {extra['connect_ms']:.1f} ms (goal <= 20)")
    ratio = extra["first_remote_us"] / extra["warm_us"]
    print(f"16 MiB write, new remote region: first {extra['first_remote_us']:.0f} us, warm {extra['warm_us']:.0f} us,"
          f" ratio {ratio:.2f} (goal <= 2)")
    print(f"16 MiB write from a new local allocation (target opens its handle): {extra['first_local_us']:.0f} us"
          f" = {extra['first_local_us'] / extra['warm_us']:.2f} x warm")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [{"case": n, **r.__dict__} for n, r in rows], **extra}, f, indent=1)
    return 0 if all(r.check in (None, True) for _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
