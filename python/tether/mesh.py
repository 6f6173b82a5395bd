"""`tether bench --full-mesh`: many flows at once.

Flows: host memory (default), N pairs of one initiator and one target; GPU memory (--device gpu),
every ordered GPU pair i>j of N GPUs, N*(N-1) flows from GPU i memory to GPU j memory.

Shapes: one process per pair or GPU (default; a GPU's process drives the flows out of its GPU, a thread
each, and answers the flows into it), or --single-process: one endpoint on each side serves every flow,
a driver thread each, so the flows share lanes, NICs and progress threads.

Every case starts on a barrier and every flow waits once more right before its timed pass, so the timed
passes overlap. Rows: one per flow, then (GPU memory) one per GPU for its egress, then the aggregate
(all bytes moved / the slowest flow's time).
"""
from __future__ import annotations

import math
import multiprocessing as mp
import threading
import time
import traceback
from typing import Callable, Optional

from tether import bench as B

_BROKEN = "BrokenBarrierError"
Flow = tuple[int, Optional[int]]  # (initiating index, target GPU or None for host memory)


def flows(n: int, all_pairs: bool) -> list[Flow]:
    """All pairs (GPU memory): every ordered pair (i, j), i != j, i-major. Else N pairs (i, None)."""
    if all_pairs:
        return [(i, j) for i in range(n) for j in range(n) if i != j]
    return [(i, None) for i in range(n)]


def label(flow: Flow):
    """The `pair` of a row: "i>j" for a GPU flow, i for a host pair (as before GPU flows existed)."""
    i, j = flow
    return i if j is None else f"{i}>{j}"


def _moved(r: B.Result) -> int:
    return r.size * r.num_iovs * r.iters


def _seconds(r: B.Result) -> float:
    return _moved(r) / (r.gbps * 1e9)


def combine(rows: list[B.Result], pair, device: str, cpu: Callable[[list[float]], float],
            cpu_server: Optional[Callable[[list[float]], float]] = None) -> B.Result:
    """Rows measured at the same time as one: all their bytes / the slowest one's time.
    `cpu` folds the CPU% columns (sum for separate processes, max for shared ones);
    `cpu_server`, when given, folds the target side's."""
    first = rows[0]
    checks = [r.check for r in rows]
    return B.Result(
        mode=first.mode, transport=first.transport, device=device, size=first.size,
        num_iovs=first.num_iovs, iters=sum(r.iters for r in rows),
        gbps=sum(_moved(r) for r in rows) / max(_seconds(r) for r in rows) / 1e9,
        lat_p50_us=max(r.lat_p50_us for r in rows), lat_p99_us=max(r.lat_p99_us for r in rows),
        cpu_client=cpu([r.cpu_client for r in rows]), cpu_server=(cpu_server or cpu)([r.cpu_server for r in rows]),
        check=None if all(c is None for c in checks) else all(c is True for c in checks),
        config=dict(first.config, pair=pair))


def _per_process_cpu(rows: list[B.Result], key: Callable[[B.Result], int]) -> Callable[[list[float]], float]:
    """Each process counted once: its flows all report the whole process, so take the largest of each
    group and add the groups up."""
    def fold(values: list[float]) -> float:
        groups: dict[int, float] = {}
        for r, v in zip(rows, values):
            k = key(r)
            groups[k] = v if k not in groups or math.isnan(groups[k]) else max(groups[k], v)
        return sum(groups.values())
    return fold


def summarize(case_rows: list[B.Result], case_flows: list[Flow], single_process: bool,
              gpu: bool = True) -> list[B.Result]:
    """Per-GPU egress rows (all-pairs flows) and the aggregate row for one case's flow rows."""
    all_pairs = case_flows[0][1] is not None
    where = "gpu" if gpu else "proc"
    if single_process:
        cpu = max  # one process on each side measured every flow
    elif all_pairs:  # process i drives the flows out of GPU i and serves those into GPU i
        src = {id(r): f[0] for r, f in zip(case_rows, case_flows)}
        dst = {id(r): f[1] for r, f in zip(case_rows, case_flows)}
        cpu = _per_process_cpu(case_rows, lambda r: src[id(r)])
        cpu_server = _per_process_cpu(case_rows, lambda r: dst[id(r)])
    else:
        cpu = sum
    if single_process or not all_pairs:
        cpu_server = cpu
    out = []
    if all_pairs:
        n = max(max(f[0], f[1]) for f in case_flows) + 1
        for g in range(n):
            mine = [r for r, f in zip(case_rows, case_flows) if f[0] == g]
            if mine:
                out.append(combine(mine, f"{g}>*", f"{where}{g}>*", max))
    device = f"{where} x{len({f[0] for f in case_flows})}" if all_pairs else case_rows[0].device
    out.append(combine(case_rows, "all", device, cpu, cpu_server))
    return out


# ---------------------------------------------------------------- one process per pair, host memory

def _host_worker(index: int, options: dict, capacity: int, cases: list, barrier, timing, out) -> None:
    pair = None
    try:
        pair = B.LocalPair(options, capacity)  # inside: a transport that cannot work here is reported
        for k, case in enumerate(cases):
            barrier.wait(600)
            r = B.run_case(pair, case, before_timing=lambda: timing.wait(600))
            r.config = dict(options, pair=index, connect_ms=round(pair.connect_ms, 2))
            out.put((index, k, r))
    except BaseException:
        timing.abort()
        out.put((index, -1, traceback.format_exc()))
        raise
    finally:
        if pair is not None:
            pair.close()


# ---------------------------------------------------------------- one process per GPU, GPU memory

def _gpu_worker(g: int, options: dict, capacity: int, cases: list, outgoing: list, incoming: list,
                meta_out, meta_in, barrier, timing, out, gpu: bool) -> None:
    """Process g: owns GPU g and one endpoint; drives the flows g>j, serves the flows k>g.
    (gpu=False: the same shape over host memory, so the CPU suite covers it.)"""
    import tether

    ep = None
    servers: list[threading.Thread] = []
    pairs: list[tuple[int, B.Pair]] = []
    try:
        ep = tether.Endpoint(**options)  # inside: a transport that cannot work here fails it (reported below)
        servers = [threading.Thread(target=B.serve, args=(ep, B.PipeChannel(c)), daemon=True) for _, c in incoming]
        for t in servers:
            t.start()
        meta_out.put((g, ep.metadata()))
        metadata = meta_in.recv()
        for j, conn in outgoing:
            t0 = time.perf_counter()
            peer = ep.connect(metadata[j], timeout=60)
            pairs.append((j, B.Pair(ep, peer, B.PipeChannel(conn), capacity, (time.perf_counter() - t0) * 1e3,
                                    device=g if gpu else None, remote_device=j if gpu else None)))
        for k, case in enumerate(cases):
            barrier.wait(600)
            errors: list[str] = []

            def drive(j: int, pair: B.Pair) -> None:
                try:
                    r = B.run_case(pair, case, before_timing=lambda: timing.wait(600))
                    r.config = dict(options, pair=f"{g}>{j}", connect_ms=round(pair.connect_ms, 2))
                    out.put(((g, j), k, r))
                except BaseException:  # reported below; the others must not wait for this flow
                    errors.append(traceback.format_exc())
                    timing.abort()

            _all_at_once(drive, pairs)
            if errors:  # a flow's own failure, not the broken barrier it left the others
                raise RuntimeError(f"GPU {g}: " + next((e for e in errors if _BROKEN not in e), errors[0]))
        for _, pair in pairs:
            pair.channel.send(("exit", 0))
        for t in servers:  # every initiator into GPU g said exit: nothing lands here any more
            t.join(120)
    except BaseException:
        timing.abort()
        barrier.abort()
        out.put(((g, None), -1, traceback.format_exc()))
        raise
    finally:
        if ep is not None:
            ep.close()


def _all_at_once(target: Callable, args: list) -> None:
    """target(*a) for every a, each in its own thread; returns once all have ended."""
    threads = [threading.Thread(target=target, args=a) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _collect(procs, out, want: int, progress: Optional[Callable]) -> dict:
    results: dict = {}
    while len(results) < want:
        # A worker that died without a word (killed, out of memory) would leave the others waiting on
        # it at a barrier or a pipe: end the run now.
        dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead and out.empty():
            raise RuntimeError(f"full-mesh worker {dead[0]} died ({B.exit_text(procs[dead[0]].exitcode)})")
        if not any(p.is_alive() for p in procs) and out.empty():
            raise RuntimeError("a full-mesh worker died; see its error above")
        try:
            key, k, r = out.get(timeout=1)
        except Exception:  # queue.Empty: look at the workers again
            continue
        if k < 0:  # other workers fail in turn at the barrier this one broke: report the cause
            first, deadline = (key, r), time.monotonic() + 3
            while _BROKEN in first[1] and time.monotonic() < deadline:
                try:
                    key, k, r = out.get(timeout=0.5)
                except Exception:  # queue.Empty
                    continue
                if k < 0 and _BROKEN not in r:
                    first = (key, r)
            raise RuntimeError(f"full-mesh worker {first[0]} failed:\n{first[1]}")
        results[(key, k)] = r
        if progress:
            progress()
    return results


def _join(procs, failed: bool) -> None:
    """Wait for the workers; after a failure the others may wait on a barrier or a pipe forever: end them."""
    for p in procs:
        p.join(2 if failed else 30)
        if p.is_alive():
            p.kill()


def run_processes(n: int, options: dict, capacity: int, cases: list, gpu: bool = False,
                  all_pairs: bool = False, progress: Optional[Callable] = None) -> list[list[B.Result]]:
    ctx = mp.get_context("spawn")
    fl = flows(n, all_pairs)
    barrier, timing, out = ctx.Barrier(n), ctx.Barrier(len(fl)), ctx.Queue()
    if not all_pairs:
        procs = [ctx.Process(target=_host_worker, args=(i, options, capacity, cases, barrier, timing, out))
                 for i in range(n)]
        keys = list(range(n))
    else:
        outgoing: list[list] = [[] for _ in range(n)]
        incoming: list[list] = [[] for _ in range(n)]
        for i, j in fl:  # one command pipe per flow: initiator in process i, target thread in process j
            a, b = ctx.Pipe()
            outgoing[i].append((j, a))
            incoming[j].append((i, b))
        meta_out = ctx.Queue()
        meta_pipes = [ctx.Pipe() for _ in range(n)]
        procs = [ctx.Process(target=_gpu_worker, args=(g, options, capacity, cases, outgoing[g], incoming[g],
                                                       meta_out, meta_pipes[g][1], barrier, timing, out, gpu))
                 for g in range(n)]
        keys = fl
    for p in procs:
        p.start()
    try:
        if all_pairs:  # every endpoint's metadata to every process, once all exist
            metadata: dict[int, bytes] = {}
            deadline = time.monotonic() + 300
            while len(metadata) < n:
                if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                    err = out.get(timeout=5) if not out.empty() else None
                    raise RuntimeError(f"full-mesh GPU workers did not start: {err[2] if err else 'timeout'}")
                try:
                    g, m = meta_out.get(timeout=1)
                    metadata[g] = m
                except Exception:  # queue.Empty
                    continue
            for conn, _ in meta_pipes:
                conn.send(metadata)
        results = _collect(procs, out, len(keys) * len(cases), progress)
    except BaseException:
        _join(procs, failed=True)
        raise
    _join(procs, failed=False)
    return [[results[(key, k)] for key in keys] for k in range(len(cases))]


# ---------------------------------------------------------------- one process for all

def run_single_process(n: int, options: dict, capacity: int, cases: list, gpu: bool = False,
                       all_pairs: bool = False, progress: Optional[Callable] = None) -> list[list[B.Result]]:
    fl = flows(n, all_pairs)
    for case in cases:
        if case.mode == "send":
            raise ValueError("--single-process full mesh runs write and read (send needs a server per pair)")
    first = B.LocalPair(options, capacity, device=fl[0][0] if gpu else None, remote_device=fl[0][1] if gpu else None)
    lock = threading.Lock()
    first.lock = lock
    pairs = [first]
    out: list[list[Optional[B.Result]]] = [[None] * len(fl) for _ in cases]
    try:
        for s, (i, j) in enumerate(fl[1:], start=1):
            pairs.append(B.Pair(first.ep, first.peer, first.channel, capacity, first.connect_ms, slot=s, lock=lock,
                                device=i if gpu else None, remote_device=j if gpu else None))
        for k, case in enumerate(cases):
            start, timing = threading.Barrier(len(fl)), threading.Barrier(len(fl))
            errors: list[BaseException] = []

            def drive(s: int) -> None:
                try:
                    start.wait(600)
                    r = B.run_case(pairs[s], case, before_timing=lambda: timing.wait(600))
                    r.config = dict(options, pair=label(fl[s]), connect_ms=round(first.connect_ms, 2))
                    out[k][s] = r
                except BaseException as e:  # surfaced below, after every thread has ended
                    errors.append(e)
                    start.abort()
                    timing.abort()

            _all_at_once(drive, [(s,) for s in range(len(fl))])
            if errors:
                raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
            if progress:
                for _ in fl:
                    progress()
    finally:
        first.close()
    return out


def run(n: int, options: dict, capacity: int, cases: list, single_process: bool, gpu: bool = False,
        progress: Optional[Callable] = None, all_pairs: Optional[bool] = None) -> list[B.Result]:
    """Per case: one row per flow, then (all pairs) one egress row per GPU, then the aggregate.
    GPU memory runs all pairs; `all_pairs=True` runs that shape over host memory too (tests)."""
    all_pairs = gpu if all_pairs is None else all_pairs
    if all_pairs and any(c.mode == "send" for c in cases):
        raise ValueError("an all-pairs mesh runs write and read (send needs a receiver per flow)")
    t0 = time.perf_counter()
    per_case = (run_single_process if single_process else run_processes)(n, options, capacity, cases, gpu,
                                                                         all_pairs, progress)
    fl = flows(n, all_pairs)
    rows: list[B.Result] = []
    for case_results in per_case:
        rows.extend(case_results)
        rows.extend(summarize(case_results, fl, single_process, gpu))
    shape = "single-process" if single_process else ("process-per-gpu" if all_pairs else "process-per-pair")
    for r in rows:
        r.config["mesh_s"] = round(time.perf_counter() - t0, 2)
        r.config["shape"] = shape
    return rows
