"""NCCL all-pairs send/recv, the reference beside `tether bench --full-mesh --device gpu`.

N ranks, one process per GPU (torch.distributed, NCCL backend). Per op every rank sends to and receives
from every other rank in one batch_isend_irecv: the N*(N-1) flows of tether's GPU full mesh. Before the
timed pass one op from random sources into poisoned buffers is checked: the parent compares the digests
of each flow's two ends.

Rows (tether.bench.Result): one per rank for its egress (NCCL runs a batch as one group: there is no
per-flow time), then the aggregate: all bytes / the slowest rank's time. `--socket` forces NCCL's own
TCP path on loopback, the baseline for GPU memory over TCP.

    python3 -m tether.nccl_mesh --gpus N --sizes 16M,256M [--iters K] [--socket] [--json PATH]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

POISON = 0xA5
SOCKET_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
              "NCCL_SOCKET_IFNAME": "lo", "NCCL_NSOCKS_PERTHREAD": "4", "NCCL_SOCKET_NTHREADS": "4"}
RESULT_TIMEOUT = 600.0


def why_not(n: int, backend: str = "nccl") -> Optional[str]:
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:
        return f"import torch failed: {e}"
    if backend == "gloo":  # host memory, for testing this driver without GPUs
        return None if n >= 2 else "all-pairs needs at least 2 ranks"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    if torch.cuda.device_count() < n:
        return f"needs {n} CUDA GPUs, torch sees {torch.cuda.device_count()}"
    if n < 2:
        return "all-pairs needs at least 2 GPUs"
    if not dist.is_nccl_available():
        return "this torch build has no NCCL"
    return None


def _digests(bufs: dict, pool: ThreadPoolExecutor) -> dict:
    def one(t):
        return hashlib.blake2b(memoryview(t.cpu().numpy()), digest_size=16).hexdigest()
    keys = sorted(bufs)
    return dict(zip(keys, pool.map(one, [bufs[k] for k in keys])))


def _rank(rank: int, n: int, store: str, plan: list, out, backend: str = "nccl") -> None:
    import torch
    import torch.distributed as dist

    gpu = backend == "nccl"
    dev = f"cuda:{rank}" if gpu else "cpu"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    try:
        if gpu:
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=n)
        peers = [p for p in range(n) if p != rank]
        pool = ThreadPoolExecutor(max(1, len(peers)))
        for size, iters, warmup in plan:
            send = {p: torch.empty(size, dtype=torch.uint8, device=dev) for p in peers}
            recv = {p: torch.full((size,), POISON, dtype=torch.uint8, device=dev) for p in peers}
            gen = torch.Generator(device=dev)
            gen.manual_seed(int.from_bytes(os.urandom(7), "little"))
            for t in send.values():
                t.random_(0, 256, generator=gen)
            ops = ([dist.P2POp(dist.isend, send[p], p) for p in peers]
                   + [dist.P2POp(dist.irecv, recv[p], p) for p in peers])

            def once() -> None:
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                sync()

            once()  # the checked op: random sources, poisoned targets
            sent, got = _digests(send, pool), _digests(recv, pool)
            for _ in range(warmup):
                once()
            dist.barrier()
            sync()
            lat = np.empty(iters)
            t0 = time.perf_counter()
            for i in range(iters):
                s = time.perf_counter()
                once()
                lat[i] = time.perf_counter() - s
            elapsed = time.perf_counter() - t0
            out.put(("row", rank, size, elapsed, lat.tolist(), sent, got))
            del send, recv, ops
            if gpu:
                torch.cuda.empty_cache()
        dist.destroy_process_group()
    except BaseException as e:
        out.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise


def run(n: int, sizes: list[int], iters: Optional[int] = None, warmup: Optional[int] = None,
        socket: bool = False, backend: str = "nccl") -> list:
    """The rows (tether.bench.Result) for each size: per-rank egress, then the aggregate."""
    import multiprocessing as mp

    from tether import bench as B

    if socket:
        os.environ.update(SOCKET_ENV)  # inherited by the spawned ranks before NCCL initialises
    transport = ("nccl-socket" if socket else "nccl") if backend == "nccl" else backend
    why = why_not(n, backend)
    if why:
        raise RuntimeError(f"NCCL all-pairs not run: {why}")
    where = "gpu" if backend == "nccl" else "cpu"
    plan = []
    for size in sizes:
        it = iters or max(3, min(50, (2 << 30) // max(1, size * n * (n - 1))))
        plan.append((size, it, warmup if warmup is not None else max(1, it // 5)))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    fd, store = tempfile.mkstemp(prefix="tether-nccl-store-")
    os.close(fd)
    os.unlink(store)  # the file store creates it; a stale one would confuse the rendezvous
    procs = [ctx.Process(target=_rank, args=(r, n, store, plan, out, backend), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    rows = []
    try:
        for size, it, _ in plan:
            got: dict[int, tuple] = {}
            while len(got) < n:
                msg = out.get(timeout=RESULT_TIMEOUT)
                if msg[0] == "error":
                    raise RuntimeError(f"NCCL rank {msg[1]}: {msg[2]}")
                _, rank, s, elapsed, lat, sent, received = msg
                got[rank] = (elapsed, np.array(lat), sent, received)
            # flow i>j is good when what rank i sent to j hashes like what rank j received from i
            ok = all(got[i][2][j] == got[j][3][i] for i in range(n) for j in range(n) if i != j)
            per_op = np.max(np.stack([got[r][1] for r in range(n)]), axis=0)

            def row(pair: str, device: str, iters: int, gbps: float, lat, check: bool) -> B.Result:
                return B.Result(
                    mode="send", transport=transport, device=device, size=size, num_iovs=n - 1, iters=iters, gbps=gbps,
                    lat_p50_us=float(np.percentile(lat, 50) * 1e6), lat_p99_us=float(np.percentile(lat, 99) * 1e6),
                    cpu_client=float("nan"), cpu_server=float("nan"), check=check,
                    config={"pair": pair, "shape": "nccl all-pairs"})

            for r in range(n):
                elapsed, lat = got[r][0], got[r][1]
                flows_ok = all(got[r][2][j] == got[j][3][r] for j in range(n) if j != r)
                rows.append(row(f"{r}>*", f"{where}{r}>*", it, size * (n - 1) * it / elapsed / 1e9, lat, flows_ok))
            slowest = max(got[r][0] for r in range(n))
            rows.append(row("all", f"{where} x{n}", it * n, size * n * (n - 1) * it / slowest / 1e9, per_op, ok))
    finally:
        for p in procs:
            p.join(5 if rows and len(rows) == len(plan) * (n + 1) else 1)
            if p.is_alive():
                p.kill()
        if os.path.exists(store):
            os.unlink(store)
    return rows


def main(argv: Optional[list] = None) -> int:
    from tether import bench as B

    a = argparse.ArgumentParser(prog="python3 -m tether.nccl_mesh", description=__doc__.split("\n\n")[0])
    a.add_argument("--gpus", type=int, default=None, help="ranks (default: every visible GPU)")
    a.add_argument("--sizes", default="16M,256M")
    a.add_argument("--iters", type=int, default=None)
    a.add_argument("--warmup", type=int, default=None)
    a.add_argument("--socket", action="store_true", help="force NCCL's socket transport on loopback")
    a.add_argument("--json", metavar="PATH", help="rows as tether bench --json writes them")
    a.add_argument("--backend", choices=["nccl", "gloo"], default="nccl",
                   help="gloo: host memory over torch's gloo, to test this driver without GPUs")
    args = a.parse_args(argv)
    n = args.gpus
    if n is None:
        import torch
        n = torch.cuda.device_count()
    why = why_not(n, args.backend)
    if why:
        print(f"NCCL all-pairs not run: {why}", file=sys.stderr)
        return 2
    rows = run(n, [B.parse_size(s) for s in args.sizes.split(",")], args.iters, args.warmup, args.socket,
               args.backend)
    for r in rows:
        print(f"{r.transport:<12}{r.device:>10}{B.human(r.size):>10}{r.gbps:>10.2f} GB/s"
              f"  p50 {r.lat_p50_us:9.1f} us  check {'ok' if r.check else 'FAILED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"version": 1, "machine": B.machine_info(), "config": {"gpus": n, "socket": args.socket},
                       "results": [dict(B.result_dict(r), config=r.config) for r in rows]}, f, indent=2)
    return 0 if all(r.check for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
