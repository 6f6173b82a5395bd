"""tether over TCP loopback (`tcp`, default) or same-host ipc (`ipc`), otherwise default options, driven by its own bench module so its rows match
`tether bench` and bench/compare_tcp.py. Each workload runs twice: a one-op case with check=True
(random source, poisoned target, target-side hash compared with the source's), then the timed case.
"""
from __future__ import annotations

import sys

from common import CAPACITY, DEVICE, WORKLOADS, emit, gpus, quiet_stdout


def main(transport: str) -> int:
    SYSTEM = f"tether ({transport})"
    gpu, remote_gpu = gpus() if DEVICE == "gpu" else (None, None)
    quiet_stdout()
    try:
        from tether import bench as B
    except Exception as e:
        emit(SYSTEM, "not run", note=f"import tether failed (PYTHONPATH=python?): {e}")
        return 0
    try:
        pair = B.LocalPair({"transport": transport}, CAPACITY, device=gpu, remote_device=remote_gpu)
    except Exception as e:
        emit(SYSTEM, "not run", note=f"start failed: {type(e).__name__}: {e}")
        return 0
    try:
        for w in WORKLOADS:
            def case(check: bool, iters: int, warmup: int):
                return B.Case(mode=w.mode, size=w.size, num_iovs=w.blocks, iters=iters, warmup=warmup,
                              async_depth=w.depth, check=check)
            try:
                ok = B.run_case(pair, case(True, 1, 0)).check
                r = B.run_case(pair, case(False, w.iters, w.warmup))
                emit(SYSTEM, w.name, ok, gbps=r.gbps, p50_us=r.lat_p50_us, p99_us=r.lat_p99_us)
            except Exception as e:
                emit(SYSTEM, w.name, note=f"{type(e).__name__}: {e}")
    finally:
        pair.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "tcp"))
