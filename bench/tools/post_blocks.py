"""CPU cost of posting one vectored write of many blocks (the KV-cache pattern: 4,096 x 16 KiB, shuffled
at the target), by path: a list of tuples (`writev`) and one (n, 3) array (`writev_blocks`), with a
contiguous write of the same bytes for reference. Post = until the call returns (wall clock, and the
posting thread's CPU time), which includes the transport's first sends (ipc: the poster sends the
first window of requests itself); total = post to done. Last, the same posts with their last block out of
range: parse, checks and segments, then refused.

    PYTHONPATH=python python3 bench/tools/post_blocks.py [--blocks 4096] [--size 16K] [--iters 20]
    # GPU0 -> GPU1 (two GPUs, torch), the options of bench/gpu/compare_ipc_gpu.py, plus the bench's
    # own rate for the pattern (run_case: 2 ops in flight, every byte checked in a separate pass):
    python3 bench/tools/post_blocks.py --transports ipc --gpus --channels 8 --window 64
"""
import argparse
import statistics
import time

import numpy as np

import tether
from tether import bench as B


def measure(post, iters):
    posts, cpus, totals = [], [], []
    for _ in range(iters + 2):  # two warm-up rounds
        c0, t0 = time.thread_time(), time.perf_counter()
        t = post()
        t1, c1 = time.perf_counter(), time.thread_time()
        t.wait(30)
        t2 = time.perf_counter()
        del t  # freed outside the timed calls
        posts.append((t1 - t0) * 1e6)
        cpus.append((c1 - c0) * 1e6)
        totals.append((t2 - t0) * 1e6)
    posts, cpus, totals = posts[2:], cpus[2:], totals[2:]
    return statistics.median(posts), min(posts), statistics.median(cpus), statistics.median(totals)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--size", default="16K")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--transports", default="ipc,tcp")
    ap.add_argument("--gpus", action="store_true", help="GPU0 -> GPU1 (GPU0 -> GPU0 with one GPU) instead of host memory")
    ap.add_argument("--channels", type=int)
    ap.add_argument("--window", type=int)
    a = ap.parse_args()
    n, size = a.blocks, B.parse_size(a.size)
    for tr in a.transports.split(","):
        opts = {k: v for k, v in dict(transport=tr, channels=a.channels, window=a.window).items() if v is not None}
        other = None
        if a.gpus:
            import torch
            other = 1 if torch.cuda.device_count() > 1 else 0
        pair = B.LocalPair(opts, n * size, device=0 if a.gpus else None, remote_device=other)
        if a.gpus:
            r = B.run_case(pair, B.Case("write", size, n, 40, 3, 2, True))
            print(f"{tr:4} bench rate {r.gbps:.1f} GB/s (p50 {r.lat_p50_us:.0f} us, check {r.check})", flush=True)
        peer, local = pair.peer, pair.src_region
        remote = tether.RemoteRegion(pair.remote)
        order = np.random.default_rng().permutation(n)
        lo = np.arange(n, dtype=np.uint64) * size
        ro = order.astype(np.uint64) * size
        entries = [(local, int(lo[i]), remote, int(ro[i]), size) for i in range(n)]
        paths = {"tuples": lambda: peer.writev(entries),
                 "contiguous": lambda: peer.write(local, remote, length=n * size)}
        if hasattr(peer, "writev_blocks"):
            paths["blocks"] = lambda: peer.writev_blocks(local, remote, lo, ro, size)
        for name, post in paths.items():
            med, best, cpu, total = measure(post, a.iters)
            print(f"{tr:4} {name:10} post median {med:6.0f} us (min {best:5.0f}, CPU {cpu:5.0f})   "
                  f"total median {total:6.0f} us")
        # A post whose last block lies past the remote range is checked and stored block by block, then
        # refused: the posting cost without the queueing and the transport's first sends.
        bad_ro = ro.copy()
        bad_ro[-1] = np.uint64(n * size)
        refused = {"tuples": lambda: peer.writev(entries[:-1] + [(local, int(lo[-1]), remote, n * size, size)]),
                   "blocks": lambda: peer.writev_blocks(local, remote, lo, bad_ro, size)}
        for name, post in refused.items():
            if name == "blocks" and not hasattr(peer, "writev_blocks"):
                continue
            times = []
            for _ in range(a.iters * 5):
                t0 = time.perf_counter()
                t = post()
                times.append((time.perf_counter() - t0) * 1e6)
                assert t.status == "error", t
                del t
            print(f"{tr:4} {name:10} post refused at its last block: median {statistics.median(times):6.0f} us")
        pair.close()


if __name__ == "__main__":
    main()
