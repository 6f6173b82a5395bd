"""What one staging copy's launch costs the calling thread: cuMemcpyAsync (and the direction-specific
calls) between GPU memory and pinned host memory like a staging slot's (cuMemHostAlloc, portable and
mapped), by size, from one thread on an idle stream (ctypes to libcuda; torch only makes the context).
Run two at once to see two processes sharing one GPU.

    python3 bench/gpu/launch_cost.py [--iters 300]
"""
import argparse
import ctypes
import statistics
import time

import torch

U64, SZ, P, U32 = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint
cu = ctypes.CDLL("libcuda.so.1")


def check(r, what):
    if r != 0:
        raise SystemExit(f"{what}: CUDA error {r}")


def setup():
    cu.cuMemcpyAsync.argtypes = [U64, U64, SZ, P]
    cu.cuMemcpyDtoHAsync_v2.argtypes = [P, U64, SZ, P]
    cu.cuMemcpyHtoDAsync_v2.argtypes = [U64, P, SZ, P]
    cu.cuMemHostAlloc.argtypes = [ctypes.POINTER(P), SZ, U32]
    cu.cuStreamSynchronize.argtypes = [P]
    cu.cuEventRecord.argtypes = [P, P]
    cu.cuEventQuery.argtypes = [P]
    cu.cuCtxSetCurrent.argtypes = [P]


class Lane:
    def __init__(self, size):
        self.dev = torch.empty(size, dtype=torch.uint8, device="cuda:0")
        self.host = P()
        check(cu.cuMemHostAlloc(ctypes.byref(self.host), size, 1 | 2), "cuMemHostAlloc")  # portable | devicemap
        self.stream, self.event = P(), P()
        check(cu.cuStreamCreate(ctypes.byref(self.stream), 1), "cuStreamCreate")
        check(cu.cuEventCreate(ctypes.byref(self.event), 2), "cuEventCreate")

    def calls(self, n):
        d, h, s = self.dev.data_ptr(), self.host.value, self.stream
        return {
            "memcpy d2h": lambda: cu.cuMemcpyAsync(h, d, n, s),
            "memcpy h2d": lambda: cu.cuMemcpyAsync(d, h, n, s),
            "DtoHAsync": lambda: cu.cuMemcpyDtoHAsync_v2(P(h), d, n, s),
            "HtoDAsync": lambda: cu.cuMemcpyHtoDAsync_v2(d, P(h), n, s),
        }


def timed(f, lane, iters):
    """Median µs the call takes, each launch on an idle stream (synchronized after, not timed)."""
    out = []
    for i in range(iters):
        t = time.perf_counter()
        check(f(), "copy")
        out.append(time.perf_counter() - t)
        check(cu.cuEventRecord(lane.event, lane.stream), "record")
        check(cu.cuStreamSynchronize(lane.stream), "sync")
    return statistics.median(out[iters // 10:]) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    setup()
    torch.cuda.init()
    torch.zeros(1, device="cuda:0")
    sizes = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
    one = Lane(4 << 20)
    print(f"{'call':<12}" + "".join(f"{s >> 10:>9} KiB" for s in sizes) + "   (µs per call, one thread)")
    for name in one.calls(0):
        print(f"{name:<12}" + "".join(f"{timed(one.calls(s)[name], one, args.iters):>13.1f}" for s in sizes))


if __name__ == "__main__":
    main()
