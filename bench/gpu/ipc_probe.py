#!/usr/bin/env python3
"""Where the ipc transport's GPU0 -> GPU1 time goes, without the transport: the same copies between
raw pointers, in one process (peer access) and between two processes (CUDA IPC handles, as ipc
opens them), by the destination GPU (pull: what ipc's target lanes do) and by the source GPU (push).

Rows: 256 MiB by the copy engines over 1, 2 and 4 streams; 4,096 x 16 KiB fragments (destinations
shuffled) by tether's copy kernel in launches of 128 or 1,344 fragments over 1, 4 and 16 streams.
Each operation is submitted and waited for, as a lane does (wall clock); every byte is checked.
A probe for the device, not a gate. With one GPU, "GPU1" is GPU 0 again: the two-process rows are
CUDA IPC on one device, and the one-process rows copy within GPU 0 (no peer access to enable).

    python3 bench/gpu/ipc_probe.py [--iters 20]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys

import numpy as np

from tether import _gpubench

BIG, FRAG, NFRAG = 256 << 20, 16 << 10, 4096


class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # not c_char: its value stops at the first zero byte


class Cuda:
    """The driver API through ctypes, on the primary contexts tether's module uses too."""

    def __init__(self):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.ok(self.cu.cuInit(0), "cuInit")
        self.ctx = {}

    def ok(self, r, what):
        if r != 0:
            raise RuntimeError(f"{what}: CUresult {r}")

    def use(self, dev):
        if dev not in self.ctx:
            d, c = ctypes.c_int(), ctypes.c_void_p()
            self.ok(self.cu.cuDeviceGet(ctypes.byref(d), dev), "cuDeviceGet")
            self.ok(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), d), "cuDevicePrimaryCtxRetain")
            self.ctx[dev] = c
        self.ok(self.cu.cuCtxSetCurrent(self.ctx[dev]), "cuCtxSetCurrent")

    def alloc(self, dev, n, fill=None):
        self.use(dev)
        p = ctypes.c_uint64()
        self.ok(self.cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)), "cuMemAlloc")
        if fill is not None:
            self.ok(self.cu.cuMemcpyHtoD_v2(p, fill.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(n)), "cuMemcpyHtoD")
        return p.value

    def count(self) -> int:
        n = ctypes.c_int()
        self.ok(self.cu.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        return n.value

    def peer(self, dev, other):
        self.use(other)
        self.use(dev)
        r = self.cu.cuCtxEnablePeerAccess(self.ctx[other], 0)
        if r not in (0, 704):  # 704: already enabled
            self.ok(r, "cuCtxEnablePeerAccess")

    def export(self, dev, ptr):
        self.use(dev)
        h = Handle()
        self.ok(self.cu.cuIpcGetMemHandle(ctypes.byref(h), ctypes.c_uint64(ptr)), "cuIpcGetMemHandle")
        return bytes(bytearray(h.reserved)).hex()

    def open(self, dev, hexed):
        self.use(dev)
        h = Handle.from_buffer_copy(bytes.fromhex(hexed))
        p = ctypes.c_uint64()
        self.ok(self.cu.cuIpcOpenMemHandle_v2(ctypes.byref(p), h, 1), "cuIpcOpenMemHandle")
        return p.value


def rows(dev, src, dst, iters):
    """(name, result) of every case, copies issued on `dev`."""
    out = []
    for k in (1, 2, 4):
        out.append((f"256 MiB copy, {k} stream(s)", _gpubench.copy_bench(dev, src, dst, BIG, 4096, k, 1, iters, False, 1)))
    for batch in (128, 1344):
        for k in (1, 4, 16):
            r = _gpubench.copy_bench(dev, src, dst, FRAG * NFRAG, FRAG, k, batch, iters, True, 1)
            out.append((f"4096x16K kernel, {batch}/launch, {k} stream(s)", r))
    return out


def show(title, got):
    print(f"\n{title}")
    print(f"{'case':<42}{'GB/s':>9}{'us/op':>10}{'submit us':>11}{'bad':>6}")
    for name, r in got:
        print(f"{name:<42}{r['gbps']:>9.1f}{r['us_per_op']:>10.1f}{r['submit_us']:>11.1f}{r['mismatches']:>6}")


def child(iters):
    """The other process: owns the GPU0 source; pushes into the parent's GPU1 destination when told."""
    cu = Cuda()
    src = cu.alloc(0, BIG, np.random.default_rng(2).integers(0, 256, BIG, dtype=np.uint8))
    print("SRC", cu.export(0, src), flush=True)
    dst_hex = sys.stdin.readline().split()[1]  # "DST <hex>" once the parent has pulled
    dst = cu.open(0, dst_hex)
    print("RESULT", json.dumps(rows(0, src, dst, iters)), flush=True)
    sys.stdin.readline()  # the parent is done with our memory


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.iters)
        return 0
    cu = Cuda()
    data = np.random.default_rng(1).integers(0, 256, BIG, dtype=np.uint8)
    src = cu.alloc(0, BIG, data)
    g1 = 1 if cu.count() > 1 else 0  # the destination GPU
    dst = cu.alloc(g1, BIG)
    if g1 != 0:
        cu.peer(1, 0)
        cu.peer(0, 1)
    one = [(f"pull {n}", r) for n, r in rows(g1, src, dst, a.iters)] + [(f"push {n}", r) for n, r in rows(0, src, dst, a.iters)]
    show(f"one process{', peer access' if g1 else ''} (GPU0 -> GPU{g1})", one)
    p = subprocess.Popen([sys.executable, __file__, "--child", "--iters", str(a.iters)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        their_src = cu.open(g1, p.stdout.readline().split()[1])  # opened on the destination GPU, as ipc's target does
        two = [(f"pull {n}", r) for n, r in rows(g1, their_src, dst, a.iters)]
        p.stdin.write(f"DST {cu.export(g1, dst)}\n")
        p.stdin.flush()
        line = p.stdout.readline()
        two += [(f"push {n}", r) for n, r in json.loads(line.split(" ", 1)[1])]
        show(f"two processes, CUDA IPC (GPU0 of one -> GPU{g1} of the other)", two)
        p.stdin.write("DONE\n")
        p.stdin.flush()
    finally:
        p.wait(30)
    bad = sum(r["mismatches"] for _, r in one + two)
    print("\nbytes", "ok" if bad == 0 else f"WRONG ({bad})")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
