"""NCCL point-to-point send/recv through torch.distributed: rank 0 (initiator, cuda:0) sends, rank 1
(target, cuda:1) receives into its buffer at the same (shuffled) offsets the other peers write to.

NCCL moves GPU memory only, so unlike the other rows these buffers live on GPUs; it needs two GPUs
(NCCL refuses two ranks on one device). Where that is not so, the driver prints one row saying why.
A 128-block op is one batch_isend_irecv of 128 P2POps; "8 in flight" keeps 8 isends outstanding.
An op completes when its NCCL work reports completed on the GPU (Work.is_completed()).
"""
from __future__ import annotations

import hashlib
import socket
import sys

import numpy as np

from common import CAPACITY, POISON, WORKLOADS, emit, layout, measure, quiet_stdout

SYSTEM = "NCCL send/recv (GPU memory)"
# `socket` mode: NCCL's own TCP path (the baseline tether's GPU-over-TCP issue is measured against):
# no NVLink/P2P, no shared memory, no InfiniBand; 4 helper threads x 4 sockets on loopback.
SOCKET_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
              "NCCL_SOCKET_IFNAME": "lo", "NCCL_NSOCKS_PERTHREAD": "4", "NCCL_SOCKET_NTHREADS": "4"}
RESULT_TIMEOUT = 120.0


def _why_not() -> str | None:
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:
        return f"import torch failed: {e}"
    if not torch.cuda.is_available():
        return f"no CUDA GPU here (torch {torch.__version__}, torch.cuda.is_available() is False)"
    if torch.cuda.device_count() < 2:
        return f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}"
    if not dist.is_nccl_available():
        return "this torch build has no NCCL"
    return None


def _digest(t, spans) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for off, n in spans:
        h.update(memoryview(t[off:off + n].cpu().numpy()))
    return h.digest()


def rank_main(rank: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.full((CAPACITY,), POISON, dtype=torch.uint8, device="cuda")
    peer = 1 - rank
    layout_rng = np.random.default_rng(1234)  # same seed on both ranks: same block layout
    data_rng = torch.Generator(device="cuda").manual_seed(rank)
    for w in WORKLOADS:
        if w.mode != "write":
            continue  # no one-sided reads: main() says so
        try:
            blocks = layout(w, layout_rng)
            if rank == 0:
                views = [buf[lo:lo + n] for lo, _, n in blocks]
                op = dist.isend
            else:
                views = [buf[ro:ro + n] for _, ro, n in blocks]
                op = dist.irecv

            def post(i):
                if len(views) == 1:
                    return [op(views[0], peer)]
                return dist.batch_isend_irecv([dist.P2POp(op, v, peer) for v in views])

            def wait(works):
                for wk in works:
                    while not wk.is_completed():
                        pass

            # Checked op: random source, poisoned target, one op, then hash both sides' spans.
            spans = sorted((ro, lo, n) for lo, ro, n in blocks)
            if rank == 0:
                for v in views:
                    v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, device="cuda", generator=data_rng))
            else:
                buf.fill_(POISON)
            torch.cuda.synchronize()
            wait(post(0))
            torch.cuda.synchronize()
            digest = _digest(buf, [(lo if rank == 0 else ro, n) for ro, lo, n in spans])
            r = measure(w, post, wait)  # the target runs the same loop: its recvs pair with the sends
            results.put((rank, w.name, digest, r, None))
        except Exception as e:
            results.put((rank, w.name, None, None, f"{type(e).__name__}: {e}"))
            break
    dist.destroy_process_group()


def main() -> int:
    global SYSTEM
    quiet_stdout()
    if "socket" in sys.argv[1:]:
        import os

        os.environ.update(SOCKET_ENV)  # inherited by the spawned ranks before NCCL initialises
        SYSTEM = "NCCL send/recv, socket transport forced (GPU memory)"
    why = _why_not()
    if why:
        emit(SYSTEM, "not run", note=why)
        return 0
    import torch.multiprocessing as tmp
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = tmp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, results), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    got: dict[str, dict[int, tuple]] = {}
    try:
        for w in WORKLOADS:
            if w.mode != "write":
                emit(SYSTEM, w.name, note="send/recv only: a pull is the other rank's send (the write rows)")
                continue
            while len(got.get(w.name, {})) < 2:
                rank, name, digest, r, err = results.get(timeout=RESULT_TIMEOUT)
                got.setdefault(name, {})[rank] = (digest, r, err)
            (d0, r0, e0), (d1, _, e1) = got[w.name][0], got[w.name][1]
            if e0 or e1:
                emit(SYSTEM, w.name, note=e0 or e1)
                break
            emit(SYSTEM, w.name, d0 == d1, **r0)
    except Exception as e:  # queue.Empty: a rank died or hung
        emit(SYSTEM, "stopped", note=f"no result in {RESULT_TIMEOUT:.0f} s ({type(e).__name__})")
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
