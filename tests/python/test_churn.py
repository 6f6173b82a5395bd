"""Links made and dropped over and over leave nothing behind: closing a peer lets go of its sockets,
segments and threads at once, whoever still holds a handle to it (tether's own API; the same churn
through NIXL's API is in test_nixl_links.py).
"""
from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest

import tether
from tether_testutil.data import MiB, poisoned, rand_bytes, wait_error, wait_until
from tether_testutil.proc import fd_count, rss_bytes, thread_count

T = 20.0
BLOCK = 256


def _usage() -> tuple:
    gc.collect()
    return fd_count(), thread_count(), rss_bytes(os.getpid())


def _settled(base: tuple, slack_fds: int = 2) -> bool:
    fds, threads, _ = _usage()
    return fds <= base[0] + slack_fds and threads <= base[1]


@pytest.mark.budget(90)
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_connect_write_close_churn_keeps_fds_threads_and_memory_flat(endpoints, transport):
    """1,000 connect / write / close cycles, every Peer handle kept: descriptors, threads and RSS stay
    where they were after a warm-up, and every cycle's bytes landed."""
    warm, cycles = 50, 1000
    b = endpoints(name="b", transport=transport, channels=2)
    a = endpoints(name="a", transport=transport, channels=2)
    src = rand_bytes(11, (warm + cycles) * BLOCK)
    dst = poisoned(src.size)
    rs, d = a.register(src), b.register(dst).descriptor()
    md = b.metadata()
    kept = []

    def cycle(i):
        p = a.connect(md, timeout=5)
        assert p.transport == transport
        p.write(rs, d, local_offset=i * BLOCK, remote_offset=i * BLOCK, length=BLOCK).wait(T)
        p.close()
        kept.append(p)  # a handle someone still holds must not keep the link's resources

    for i in range(warm):
        cycle(i)
    assert wait_until(lambda: b.peers() == [], 5)
    before = _usage()
    t0 = time.monotonic()
    for i in range(warm, warm + cycles):
        cycle(i)
    took = time.monotonic() - t0
    wait_until(lambda: b.peers() == [] and _settled(before), 5)  # the far side lets go as it sees each EOF
    after = _usage()
    print(f"\n{transport}: {cycles} cycles in {took:.1f} s ({cycles / took:.0f}/s); fds {before[0]} -> {after[0]}, "
          f"threads {before[1]} -> {after[1]}, RSS {before[2] / MiB:.1f} -> {after[2] / MiB:.1f} MiB")
    assert after[0] <= before[0] + 2, f"fds {before[0]} -> {after[0]} over {cycles} cycles"
    assert after[1] <= before[1], f"threads {before[1]} -> {after[1]} over {cycles} cycles"
    assert after[2] <= before[2] + 8 * MiB, f"RSS {before[2] / MiB:.1f} -> {after[2] / MiB:.1f} MiB over {cycles} cycles"
    assert np.array_equal(dst, src), "a cycle's bytes did not land"
    assert took < 60, f"{cycles} cycles took {took:.1f} s"


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_close_releases_at_once_while_handles_live(endpoints, transport):
    """close() returns with the link's descriptors closed and its threads gone, though the Peer
    object lives on; calls on it then fail with Cancelled naming the peer, and a new link works."""
    b = endpoints(name="far", transport=transport)
    a = endpoints(name="near", transport=transport)
    src = rand_bytes(12, 64 * 1024)
    dst = poisoned(src.size)
    rs, d = a.register(src), b.register(dst).descriptor()
    p0 = a.connect(b.metadata(), timeout=5)
    p0.write(rs, d).wait(T)
    p0.close()
    assert wait_until(lambda: b.peers() == [], 5)
    base = _usage()
    kept = []
    for _ in range(20):
        p = a.connect(b.metadata(), timeout=5)
        p.write(rs, d).wait(T)
        p.close()
        kept.append(p)
        fds, threads, _ = _usage()  # this side let go inside close(); the far side as it sees the EOF
        assert fds <= base[0] + 12, f"fds {base[0]} -> {fds}: closed links keep their descriptors"
    assert wait_until(lambda: b.peers() == [] and _settled(base), 5), (base, _usage())
    for p in kept:
        assert not p.connected and "closed" in p.error
        e = wait_error(p.write(rs, d, length=10), 2)
        assert isinstance(e, tether.Cancelled) and "'far'" in str(e), repr(e)
    dst[:] = 0xA5
    p = a.connect(b.metadata(), timeout=5)
    p.write(rs, d).wait(T)
    assert np.array_equal(dst, src)
