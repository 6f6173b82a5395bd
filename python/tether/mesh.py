"""`tether bench --full-mesh`: N pairs at once, the seeds' run_p2p_fullmesh.sh done as a feature.

Pair i drives device i on the initiating side. Two shapes, as the seeds compared them:
- one process per device (default): N driver processes, each with its own endpoint and its own server
  process, start every case together (a barrier) so the pairs really overlap;
- one process for all (--single-process): one endpoint on each side serves every pair; N driver
  threads share the link, so the pairs share the lanes, NICs and progress threads.
Aggregate GB/s = all bytes moved / the slowest pair's time.
"""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Callable, Optional

from tether import bench as B


def _aggregate(case_results: list[B.Result], one_process: bool) -> B.Result:
    first = case_results[0]
    moved = [r.size * r.num_iovs * r.iters for r in case_results]
    slowest = max(m / (r.gbps * 1e9) for m, r in zip(moved, case_results))
    checks = [r.check for r in case_results]
    return B.Result(
        mode=first.mode, transport=first.transport, device=first.device, size=first.size,
        num_iovs=first.num_iovs, iters=sum(r.iters for r in case_results), gbps=sum(moved) / slowest / 1e9,
        lat_p50_us=max(r.lat_p50_us for r in case_results), lat_p99_us=max(r.lat_p99_us for r in case_results),
        # One process for all pairs: every pair measured that same process, so take the largest.
        cpu_client=(max if one_process else sum)(r.cpu_client for r in case_results),
        cpu_server=(max if one_process else sum)(r.cpu_server for r in case_results),
        check=None if all(c is None for c in checks) else all(c is True for c in checks),
        config=dict(first.config, pair="all"))


def _worker(index: int, options: dict, capacity: int, cases: list, barrier, out) -> None:
    pair = B.LocalPair(options, capacity)
    try:
        for k, case in enumerate(cases):
            barrier.wait(600)
            r = B.run_case(pair, case)
            r.config = dict(options, pair=index, connect_ms=round(pair.connect_ms, 2))
            out.put((index, k, r))
    finally:
        pair.close()


def run_processes(n: int, options: dict, capacity: int, cases: list, progress: Optional[Callable] = None):
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(i, options, capacity, cases, barrier, out)) for i in range(n)]
    for p in procs:
        p.start()
    results: dict[tuple[int, int], B.Result] = {}
    try:
        while len(results) < n * len(cases):
            if not any(p.is_alive() for p in procs) and out.empty():
                raise RuntimeError("a full-mesh worker died; see its error above")
            try:
                i, k, r = out.get(timeout=1)
            except Exception:  # queue.Empty: look at the workers again
                continue
            results[(i, k)] = r
            if progress:
                progress()
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return [[results[(i, k)] for i in range(n)] for k in range(len(cases))]


def run_single_process(n: int, options: dict, capacity: int, cases: list, progress: Optional[Callable] = None):
    first = B.LocalPair(options, capacity)
    lock = threading.Lock()
    first.lock = lock
    pairs = [first] + [B.Pair(first.ep, first.peer, first.channel, capacity, first.connect_ms, slot=i, lock=lock)
                       for i in range(1, n)]
    out: list[list[Optional[B.Result]]] = [[None] * n for _ in cases]
    errors: list[BaseException] = []
    try:
        for k, case in enumerate(cases):
            if case.mode == "send":
                raise ValueError("--single-process full mesh runs write and read (send needs a server per pair)")
            barrier = threading.Barrier(n)

            def drive(i: int) -> None:
                try:
                    barrier.wait(600)
                    r = B.run_case(pairs[i], case)
                    r.config = dict(options, pair=i, connect_ms=round(first.connect_ms, 2))
                    out[k][i] = r
                except BaseException as e:  # surfaced below, after every thread has ended
                    errors.append(e)
                    barrier.abort()

            threads = [threading.Thread(target=drive, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            if progress:
                for _ in range(n):
                    progress()
    finally:
        first.close()
    return out


def run(n: int, options: dict, capacity: int, cases: list, single_process: bool,
        progress: Optional[Callable] = None) -> list[B.Result]:
    """Per case: the N per-pair results, then their aggregate."""
    t0 = time.perf_counter()
    per_case = (run_single_process if single_process else run_processes)(n, options, capacity, cases, progress)
    rows: list[B.Result] = []
    for case_results in per_case:
        rows.extend(case_results)
        rows.append(_aggregate(case_results, single_process))
    for r in rows:
        r.config["mesh_s"] = round(time.perf_counter() - t0, 2)
    return rows
