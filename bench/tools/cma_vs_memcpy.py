"""Raw ceiling for the ipc transport: one thread of process_vm_readv (cross-memory attach) from a
second process against one thread of memcpy, same 256 MiB, several piece sizes.

    python bench/tools/cma_vs_memcpy.py
"""
import ctypes, os, time, numpy as np, multiprocessing as mp
libc = ctypes.CDLL(None, use_errno=True)
class Iov(ctypes.Structure): _fields_=[("base",ctypes.c_void_p),("len",ctypes.c_size_t)]
N = 256 << 20
def child(q, ev):
    a = np.random.default_rng(1).integers(0,256,N,dtype=np.uint8)
    q.put(a.ctypes.data); ev.wait()
if __name__ == "__main__":
    q, ev = mp.Queue(), mp.Event()
    p = mp.get_context("fork").Process(target=child, args=(q, ev)); p.start()
    addr = q.get(); dst = np.ones(N, np.uint8); src = np.random.default_rng(2).integers(0,256,N,dtype=np.uint8)
    for rep in range(3):
        for piece in (1<<20, 4<<20, N):
            t0 = time.perf_counter()
            for off in range(0, N, piece):
                l = Iov(dst.ctypes.data + off, piece); r = Iov(addr + off, piece)
                assert libc.process_vm_readv(p.pid, ctypes.byref(l), 1, ctypes.byref(r), 1, 0) == piece
            cma = N / (time.perf_counter() - t0) / 1e9
            t0 = time.perf_counter(); ctypes.memmove(dst.ctypes.data, src.ctypes.data, N); mc = N / (time.perf_counter() - t0) / 1e9
            print(f"piece {piece>>20} MiB: process_vm_readv {cma:.2f} GB/s, memcpy {mc:.2f} GB/s, ratio {cma/mc:.2f}")
    ev.set(); p.join()
