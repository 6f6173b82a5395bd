"""How wait() waits on a tcp transfer of 4 MiB or more where busy polling is on: a read in timed naps of
20 µs, a write asleep at once, instead of spinning (docs/ARCHITECTURE.md, "Waking up"). Either
must keep every property of a wait: the bytes arrive whole, a timeout is honoured while the peer is
silent, and the transfer still completes after it.

Busy polling is off by default on machines of fewer than 8 CPUs, so these tests turn it on.
"""
from __future__ import annotations

import signal
import time

import numpy as np
import pytest

import tether
from tether_testutil.data import MiB, assert_bytes_equal, poisoned, rand_bytes

T = 20.0
NAPPING = dict(transport="tcp", busy_poll_us=1000)


def test_large_reads_arrive_whole_while_the_waiter_naps(endpoints):
    a = endpoints(name="ep-a", **NAPPING)
    b = endpoints(name="ep-b", **NAPPING)
    peer = a.connect(b.metadata(), timeout=5)
    for i, size in enumerate([1 * MiB + 1, 4 * MiB, 5 * MiB + 7, 16 * MiB]):  # spins, then naps
        src = rand_bytes(100 + i, size)
        desc = b.register(src).descriptor()
        dst = poisoned(size + 64)
        rd = a.register(dst)
        for _ in range(3):
            dst[:] = 0xA5
            peer.read(rd, desc, length=size).wait(T)
            assert_bytes_equal(dst[:size], src, f"{size} B read")
            assert (dst[size:] == 0xA5).all(), "bytes past the read were written"


def test_a_napping_wait_honours_its_timeout_and_the_read_completes_after(children, endpoints):
    c = children("nap-target")
    info = c.call("endpoint", name="T", transport="tcp")
    size = 8 * MiB
    desc = c.call("register", "src", size, fill=("seed", 7))
    me = endpoints(name="I", **NAPPING)
    peer = me.connect(info["metadata"], timeout=5)
    dst = poisoned(size)
    rd = me.register(dst)
    peer.read(rd, desc, length=1 * MiB).wait(T)  # the lanes are up before the target stops
    c.kill(signal.SIGSTOP)  # returns once every thread is stopped
    try:
        dst[:] = 0xA5
        t = peer.read(rd, desc)
        t0 = time.monotonic()
        with pytest.raises(tether.TransferTimeout):
            t.wait(timeout=0.3)
        took = time.monotonic() - t0
        assert 0.25 < took < 1.5, f"wait(timeout=0.3) returned after {took:.2f} s"
        assert not t.done()
    finally:
        c.kill(signal.SIGCONT)
    t.wait(T)
    assert_bytes_equal(dst, rand_bytes(7, size), "the read finished after the timed-out wait")


def test_a_napping_wait_ends_when_the_target_dies(children, endpoints):
    c = children("nap-dying-target")
    info = c.call("endpoint", name="T", transport="tcp")
    desc = c.call("register", "src", 8 * MiB, fill=("seed", 8))
    me = endpoints(name="I", peer_timeout=2, **NAPPING)
    peer = me.connect(info["metadata"], timeout=5)
    rd = me.register(np.zeros(8 * MiB, dtype=np.uint8))
    c.kill(signal.SIGSTOP)
    t = peer.read(rd, desc)
    time.sleep(0.1)
    c.kill(signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(tether.TetherError) as e:
        t.wait(T)
    assert not isinstance(e.value, tether.TransferTimeout), e.value
    assert time.monotonic() - t0 < 5.0


def test_a_large_write_waiter_sleeps_and_a_small_ones_spins(children, endpoints):
    """Against a stopped target nothing finishes, so what wait() burns is its own choice: a 64 KiB write's
    waiter spins for busy_poll_us, a 16 MiB write's sleeps at once. Both writes land whole afterwards."""
    c = children("sleep-target")
    info = c.call("endpoint", name="T", transport="tcp")
    big, small = 16 * MiB, 64 << 10
    desc = c.call("register", "dst", big + small)
    me = endpoints(name="I", **dict(NAPPING, busy_poll_us=300_000))  # a spin long enough to see
    peer = me.connect(info["metadata"], timeout=5)
    src = rand_bytes(21, big + small)
    local = me.register(src)
    peer.write(local, desc, length=small).wait(T)  # the lanes are up before the target stops
    c.kill(signal.SIGSTOP)
    try:
        burnt = {}
        writes = {}
        for name, off, n in (("large", 0, big), ("small", big, small)):
            writes[name] = peer.write(local, desc, local_offset=off, remote_offset=off, length=n)
            t0 = time.thread_time()
            with pytest.raises(tether.TransferTimeout):
                writes[name].wait(timeout=0.5)
            burnt[name] = time.thread_time() - t0
    finally:
        c.kill(signal.SIGCONT)
    for t in writes.values():
        t.wait(T)
    assert burnt["large"] < 0.05, f"the 16 MiB write's waiter used {burnt['large']:.3f} CPU-s in 0.5 s"
    # Its spin of 0.3 s gets the CPU the machine leaves it (a third of a core beside two busy loops on two
    # cores); a waiter that sleeps uses milliseconds.
    assert burnt["small"] > max(0.05, 5 * burnt["large"]), \
        f"the 64 KiB write's waiter used only {burnt['small']:.3f} CPU-s (no spin?)"
    assert_bytes_equal(np.frombuffer(c.call("get", "dst"), dtype=np.uint8), src, "both writes after the stop")
