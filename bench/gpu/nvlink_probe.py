#!/usr/bin/env python3
"""The NVLink ceiling between GPU0 and GPU1 as the ipc transport can use it: one process, torch,
256 MiB GPU0 -> GPU1 copied by the copy engines of the destination GPU (pull: what ipc writes do,
the target copies) or of the source GPU (push), split over 1..16 streams. Prints GB/s per row. A probe for the device, not a gate.

    python3 bench/gpu/nvlink_probe.py [--mib 256] [--iters 20]
"""
import argparse
import sys

import torch


def timed(fn, iters, devs):
    for d in devs:
        torch.cuda.synchronize(d)
    fn()
    for d in devs:
        torch.cuda.synchronize(d)
    import time
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    for d in devs:
        torch.cuda.synchronize(d)
    return (time.perf_counter() - t0) / iters


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print("needs two GPUs")
        return 2
    n = a.mib << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(n, dtype=torch.uint8, device="cuda:1")
    # The driver's cuMemcpyAsync on a stream of the chosen GPU (torch's own cross-device copy always
    # runs on the source GPU). A torch copy each way first enables peer access both ways.
    import ctypes
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    dst.copy_(src)
    src[:16].copy_(dst[:16])
    print(f"{'engine':<8}{'streams':>8}{'GB/s':>10}")
    for side in ("pull", "push"):
        dev = 1 if side == "pull" else 0
        for k in (1, 2, 4, 8, 16):
            streams = [torch.cuda.Stream(device=dev) for _ in range(k)]
            piece = n // k

            def run():
                torch.cuda.set_device(dev)
                for i, s in enumerate(streams):
                    r = cu.cuMemcpyAsync(dst.data_ptr() + i * piece, src.data_ptr() + i * piece, piece, s.cuda_stream)
                    assert r == 0, f"cuMemcpyAsync: CUresult {r}"
            sec = timed(run, a.iters, (0, 1))
            print(f"{side:<8}{k:>8}{n / sec / 1e9:>10.1f}")
    ok = torch.equal(src[:1 << 20].cpu(), dst[:1 << 20].cpu())
    print("bytes", "ok" if ok else "WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
