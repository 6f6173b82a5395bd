"""Mooncake Transfer Engine over TCP loopback: P2PHANDSHAKE (no metadata server; peers exchange
segment descriptors over the engine's own RPC port), protocol "tcp", host memory.

Writes use the sync calls (transfer_sync_write; batch_transfer_sync_write for the 128-block batch);
"8 in flight" submits with transfer_submit_write and polls transfer_check_status.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from common import (CAPACITY, POISON, WORKLOADS, alloc, checked, emit, layout, measure, quiet_stdout, serve,
                    start_target, stop_target)

SYSTEM = "Mooncake TE (tcp)"


def _engine():
    from mooncake.engine import TransferEngine
    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize returned {rc}")
    return te


def target(conn) -> None:
    try:
        te = _engine()
        buf = alloc(CAPACITY, POISON, target=True)
        rc = te.register_memory(buf.ctypes.data, buf.nbytes)
        if rc != 0:
            raise RuntimeError(f"register_memory returned {rc}")
        conn.send(("ok", f"127.0.0.1:{te.get_rpc_port()}", buf.ctypes.data))
    except Exception as e:  # report to the initiator instead of leaving it waiting
        conn.send(("error", f"{type(e).__name__}: {e}", 0))
        return
    serve(conn, buf)


def _ok(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} returned {rc}")


def main() -> int:
    quiet_stdout()
    try:
        import mooncake.engine  # noqa: F401  (fails here if the wheel or libibverbs.so.1 is missing)
    except Exception as e:
        emit(SYSTEM, "not run", note=f"import mooncake.engine failed: {e}")
        return 0
    proc = None
    try:
        proc, conn, peer, raddr = start_target(target, "engine")
        te = _engine()
        src = alloc(CAPACITY)
        _ok(te.register_memory(src.ctypes.data, src.nbytes), "register_memory")
    except Exception as e:
        emit(SYSTEM, "not run", note=f"start failed: {type(e).__name__}: {e}")
        if proc:
            proc.kill()
        return 0

    rng = np.random.default_rng()
    base = src.ctypes.data
    for w in WORKLOADS:
        blocks = layout(w, rng)
        local = [base + lo for lo, _, _ in blocks]
        remote = [raddr + ro for _, ro, _ in blocks]
        lens = [n for _, _, n in blocks]
        if w.mode == "read":
            if w.depth or w.blocks == 1:
                emit(SYSTEM, w.name, note="only batched reads are driven for Mooncake")
                continue
            post = lambda i: _ok(te.batch_transfer_sync_read(peer, local, remote, lens), "batch_transfer_sync_read")
            wait = lambda h: None
        elif w.depth:
            def post(i):
                bid = te.transfer_submit_write(peer, local[0], remote[0], lens[0])
                if bid < 0:
                    raise RuntimeError(f"transfer_submit_write returned {bid}")
                return bid

            def wait(bid):
                # 1 done, 0 running, < 0 failed/timed out. Yield between polls: on 2 cores a hot
                # Python loop would starve the engine's own worker threads.
                while (s := te.transfer_check_status(bid)) == 0:
                    os.sched_yield()
                _ok(0 if s == 1 else s, "transfer_check_status")
        elif w.blocks > 1:
            post = lambda i: _ok(te.batch_transfer_sync_write(peer, local, remote, lens), "batch_transfer_sync_write")
            wait = lambda h: None
        else:
            post = lambda i: _ok(te.transfer_sync_write(peer, local[0], remote[0], lens[0]), "transfer_sync_write")
            wait = lambda h: None
        try:
            ok = checked(w, conn, src, blocks, lambda: wait(post(0)), rng)
            emit(SYSTEM, w.name, ok, **measure(w, post, wait))
        except Exception as e:
            emit(SYSTEM, w.name, note=f"{type(e).__name__}: {e}")
    stop_target(proc, conn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
