"""Latency of one small GPU-to-GPU copy and its wait, by every way the driver offers (ctypes to
libcuda; torch only allocates). Why ipc's one-sided GPU chunks stop at 8 KiB: docs/PERFORMANCE.md,
"Defaults and why".   python3 bench/gpu/copy_latency.py [--iters N]"""
import argparse
import ctypes
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=3000)
    args = ap.parse_args()
    cu = ctypes.CDLL("libcuda.so.1")
    torch.cuda.init()
    a = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    b = torch.ones_like(a)
    torch.cuda.synchronize()
    U64, SZ, P = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
    for f in (cu.cuMemcpyAsync, cu.cuMemcpyDtoDAsync_v2):
        f.argtypes = [U64, U64, SZ, P]
    cu.cuMemcpyDtoD_v2.argtypes = cu.cuMemcpy.argtypes = [U64, U64, SZ]
    cu.cuStreamSynchronize.argtypes = cu.cuStreamQuery.argtypes = cu.cuEventSynchronize.argtypes = [P]
    cu.cuEventQuery.argtypes = [P]
    cu.cuEventRecord.argtypes = [P, P]
    nonblocking, blocking, event = P(), P(), P()
    for r in (cu.cuStreamCreate(ctypes.byref(nonblocking), 1), cu.cuStreamCreate(ctypes.byref(blocking), 0),
              cu.cuEventCreate(ctypes.byref(event), 2)):
        if r != 0:
            raise SystemExit(f"CUDA error {r}")
    per_thread = P(2)  # CU_STREAM_PER_THREAD
    dst, src = a.data_ptr(), b.data_ptr()

    def run(name, f):
        for _ in range(200):
            f()
        t = time.perf_counter()
        for _ in range(args.iters):
            f()
        print(f"{name:52s} {(time.perf_counter() - t) / args.iters * 1e6:6.2f} us", flush=True)

    def spin(query, h):
        while query(h) != 0:
            pass

    for n in (8, 65536):
        run(f"{n} B cuMemcpyAsync, event record + synchronize", lambda: (
            cu.cuMemcpyAsync(dst, src, n, nonblocking), cu.cuEventRecord(event, nonblocking), cu.cuEventSynchronize(event)))
        run(f"{n} B cuMemcpyAsync, event record + spin on query", lambda: (
            cu.cuMemcpyAsync(dst, src, n, nonblocking), cu.cuEventRecord(event, nonblocking), spin(cu.cuEventQuery, event)))
        run(f"{n} B cuMemcpyAsync, stream synchronize", lambda: (
            cu.cuMemcpyAsync(dst, src, n, nonblocking), cu.cuStreamSynchronize(nonblocking)))
        run(f"{n} B cuMemcpyAsync, spin on stream query", lambda: (
            cu.cuMemcpyAsync(dst, src, n, nonblocking), spin(cu.cuStreamQuery, nonblocking)))
        run(f"{n} B cuMemcpyDtoDAsync, stream synchronize", lambda: (
            cu.cuMemcpyDtoDAsync_v2(dst, src, n, nonblocking), cu.cuStreamSynchronize(nonblocking)))
        run(f"{n} B cuMemcpyAsync on a blocking stream", lambda: (
            cu.cuMemcpyAsync(dst, src, n, blocking), cu.cuStreamSynchronize(blocking)))
        run(f"{n} B cuMemcpyAsync on the per-thread stream", lambda: (
            cu.cuMemcpyAsync(dst, src, n, per_thread), cu.cuStreamSynchronize(per_thread)))
        run(f"{n} B cuMemcpy (synchronous, legacy stream)", lambda: cu.cuMemcpy(dst, src, n))
        run(f"{n} B cuMemcpyDtoD (synchronous, legacy stream)", lambda: cu.cuMemcpyDtoD_v2(dst, src, n))
        run(f"{n} B one ctypes call (cuEventQuery): the loop's own cost", lambda: cu.cuEventQuery(event))


if __name__ == "__main__":
    main()
