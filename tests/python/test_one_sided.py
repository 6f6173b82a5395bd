"""One-sided small ops over ipc (docs/ARCHITECTURE.md, "One-sided small ops"): after a target has
validated a descriptor once, its answer grants the initiator direct access, and writes and reads of
up to `ipc_one_sided_bytes` of that descriptor are moved by the initiator alone (no message). Two
real processes each time; random data, poisoned destinations, every byte checked.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

import tether
from tether_testutil.data import (
    MiB, POISON as POISON_BYTE, assert_bytes_equal, assert_poison, poisoned, rand_bytes, wait_error,
    wait_until,
)
from tether_testutil.wire import DESC_KEY, get_u64, set_u64

T = 20.0
KiB = 1 << 10
MAX = 64 * KiB  # the default ipc_one_sided_bytes


def _one_sided(ep) -> int:
    return ep.stats()["ipc_one_sided_chunks"]


def test_writes_and_reads_go_one_sided_after_the_first(ipc_target):
    me, peer, c = ipc_target()
    size = 1 * MiB
    desc = c.call("register", "dst", size)
    src = rand_bytes(1, size)
    rs = me.register(src)
    # the first small write asks for the grant (and goes as a request); then none needs the target
    peer.write(rs, desc, length=8).wait(T)
    assert _one_sided(me) == 0
    expect = poisoned(size)
    expect[:8] = src[:8]
    rng = np.random.default_rng(5)
    for n in (1, 7, 8, 4095, 4096, 8193, MAX - 1, MAX):
        off = int(rng.integers(0, size - n))
        peer.write(rs, desc, local_offset=off, remote_offset=off, length=n).wait(T)
        expect[off:off + n] = src[off:off + n]
    assert _one_sided(me) == 8
    assert_bytes_equal(np.frombuffer(c.call("get", "dst"), np.uint8), expect, "one-sided writes")
    # reads of the same descriptor use the same grant
    back = poisoned(size)
    rb = me.register(back)
    for n in (1, 100, MAX):
        off = int(rng.integers(0, size - n))
        peer.read(rb, desc, local_offset=off, remote_offset=off, length=n).wait(T)
        assert_bytes_equal(back[off:off + n], expect[off:off + n], f"one-sided read of {n}")
        back[off:off + n] = 0xA5
    assert_poison(back, "read destination outside the reads")
    assert _one_sided(me) == 11
    # larger than ipc_one_sided_bytes: requests, as before
    before = c.call("stats")["bytes_received"]
    peer.write(rs, desc, length=MAX + 1).wait(T)
    assert _one_sided(me) == 11 and c.call("stats")["bytes_received"] - before == MAX + 1
    expect[:MAX + 1] = src[:MAX + 1]
    assert_bytes_equal(np.frombuffer(c.call("get", "dst"), np.uint8), expect, "after the large write")


def test_a_sub_range_descriptor_is_granted_only_its_range(ipc_target):
    me, peer, c = ipc_target()
    c.call("register", "dst", 64 * KiB)
    desc = c.call("descriptor", "dst", 1000, 5000)
    src = rand_bytes(2, 64 * KiB)
    rs = me.register(src)
    peer.write(rs, desc, length=10).wait(T)               # asks for the grant
    peer.write(rs, desc, remote_offset=4990, length=10).wait(T)  # one-sided, at the range's end
    assert _one_sided(me) == 1
    # past the descriptor: refused before anything moves
    assert isinstance(wait_error(peer.write(rs, desc, remote_offset=4991, length=10)), tether.TetherError)
    assert _one_sided(me) == 1
    got = np.frombuffer(c.call("get", "dst"), np.uint8)
    assert_bytes_equal(got[1000:1010], src[:10], "first write")
    assert_bytes_equal(got[5990:6000], src[:10], "one-sided write at the end of the range")
    assert_poison(got[:1000], "before the descriptor")
    assert_poison(got[1010:5990], "between the writes")
    assert_poison(got[6000:], "after the descriptor")


def test_a_wrong_key_never_rides_a_grant(ipc_target):
    me, peer, c = ipc_target()
    desc = c.call("register", "dst", 64 * KiB)
    src = rand_bytes(3, 64 * KiB)
    rs = me.register(src)
    peer.write(rs, desc, length=16).wait(T)
    peer.write(rs, desc, length=16).wait(T)
    assert _one_sided(me) == 1
    bad = set_u64(desc, DESC_KEY, get_u64(desc, DESC_KEY) ^ 1)
    for _ in range(3):
        assert isinstance(wait_error(peer.write(rs, bad, remote_offset=100, length=16)), tether.AccessDenied)
    assert _one_sided(me) == 1
    got = np.frombuffer(c.call("get", "dst"), np.uint8)
    assert_bytes_equal(got[:16], src[:16], "granted writes")
    assert_poison(got[16:], "the rest, after writes with a wrong key")


def test_read_only_region_is_read_one_sided_and_never_written(ipc_target):
    me, peer, c = ipc_target()
    desc = c.call("register", "ro", 64 * KiB, fill=("seed", 4), readonly=True)
    back = poisoned(64 * KiB)
    rb = me.register(back)
    for _ in range(3):
        peer.read(rb, desc, length=4096).wait(T)
    assert _one_sided(me) == 2
    assert_bytes_equal(back[:4096], rand_bytes(4, 64 * KiB)[:4096], "reads of a read-only region")
    src = me.register(rand_bytes(5, 64 * KiB))
    for _ in range(3):
        assert isinstance(wait_error(peer.write(src, desc, length=64)), tether.AccessDenied)
    assert _one_sided(me) == 2
    assert_bytes_equal(np.frombuffer(c.call("get", "ro"), np.uint8), rand_bytes(4, 64 * KiB), "the read-only region")


def test_deregister_ends_one_sided_writes_before_it_returns(children):
    """The child writes into our region one-sided, 8 at a time, without pause; we deregister it,
    then poison it: from the moment deregister() returns, no byte may land there, and the child's
    writes fail instead."""
    me = tether.Endpoint(name="T")
    try:
        size = 64 * KiB
        dst = poisoned(size)
        rd = me.register(dst)
        c = children("one-sided-writer")
        c.call("endpoint", name="I")
        assert c.call("connect", me.metadata()) == "T"
        c.call("register", "src", size, fill=("seed", 6))
        assert c.call("start_stream", "write", "src", rd.descriptor(), 4 * KiB)
        assert wait_until(lambda: c.call("stats")["ipc_one_sided_chunks"] > 200, 10)
        me.deregister(rd)
        dst[:] = 0xEE
        time.sleep(0.3)
        assert_poison(dst, "a deregistered region while the peer kept writing", value=0xEE)
        errors, completed = c.call("stream_errors")
        assert errors and ("AccessDenied" in errors[0] or "NotFound" in errors[0]), errors
    finally:
        me.close()


@pytest.mark.parametrize("side", ["initiator", "target"])
def test_either_side_can_turn_it_off(ipc_target, side):
    off = {"TETHER_IPC_ONE_SIDED_BYTES": "0"}
    me, peer, c = ipc_target(env=off) if side == "target" else ipc_target(ipc_one_sided_bytes=0)
    desc = c.call("register", "dst", 64 * KiB)
    src = rand_bytes(7, 64 * KiB)
    rs = me.register(src)
    for i in range(5):
        peer.write(rs, desc, local_offset=i * 100, remote_offset=i * 100, length=100).wait(T)
    assert _one_sided(me) == 0 and c.call("stats")["bytes_received"] == 500
    got = np.frombuffer(c.call("get", "dst"), np.uint8)
    assert_bytes_equal(got[:500], src[:500], "writes")
    assert_poison(got[500:], "the rest")


def test_shared_memory_only_never_attaches(ipc_target):
    me, peer, c = ipc_target(env={"TETHER_IPC_HOST": "shm"})
    desc = c.call("register", "dst", 64 * KiB)
    rs = me.register(rand_bytes(8, 64 * KiB))
    for _ in range(3):
        peer.write(rs, desc, length=1000).wait(T)
    assert _one_sided(me) == 0  # the target would not let us reach it by address


def test_notification_follows_one_sided_data(ipc_target):
    me, peer, c = ipc_target()
    desc = c.call("register", "dst", 64 * KiB)
    src = rand_bytes(9, 64 * KiB)
    rs = me.register(src)
    peer.write(rs, desc, length=8).wait(T)
    for i in range(5):
        c.start("check_on_notify", "dst", 9, 0, 32 * KiB)
        peer.write(rs, desc, length=32 * KiB, notify=b"n%d" % i).wait(T)
        got = c.result(T)
        assert not got["timed_out"] and got["mismatch"] is None, got
        c.call("fill", "dst", ("poison", 0xA5))
    assert _one_sided(me) == 5


def test_a_killed_target_fails_writes_without_a_hang(ipc_target):
    me, peer, c = ipc_target()
    desc = c.call("register", "dst", 64 * KiB)
    rs = me.register(rand_bytes(10, 64 * KiB))
    peer.write(rs, desc, length=64).wait(T)
    peer.write(rs, desc, length=64).wait(T)
    assert _one_sided(me) == 1
    c.kill(signal.SIGKILL)
    c.proc.join(10)
    t0 = time.monotonic()
    e = wait_error(peer.write(rs, desc, length=64), timeout=10)
    assert isinstance(e, tether.TetherError), repr(e)
    assert time.monotonic() - t0 < 10


# -- deregister() against one-sided copies that stall or stop (docs/RELIABILITY.md, "The promise in a long-running, elastic fleet")

def _userfault():
    import userfault
    why = userfault.why_unavailable()
    if why:
        pytest.skip(why)
    return userfault


def _granted_writer(children, me, rd, name):
    """A child connected to `me` that holds a grant for `rd`'s descriptor (its second write went one-sided)."""
    c = children(name)
    c.call("endpoint", name="I")
    assert c.call("connect", me.metadata()) == "T"
    c.call("register", "warm", 8, fill=("seed", 11))
    for _ in range(2):
        assert c.call("write", "warm", rd.descriptor(), length=8)[0] == "ok"
    assert c.call("stats")["ipc_one_sided_chunks"] == 1
    return c


@pytest.mark.budget(60)
def test_a_slow_source_page_lands_nothing_after_deregister(children):
    """The writer's own source page faults for 2 s (userfaultfd) in the middle of a one-sided write.
    deregister() must return at once, and the write must land nothing then or later: the writer brings
    its source pages in before it claims its hazard, so the fault stalled no copy the target waits for."""
    uf = _userfault()
    me = tether.Endpoint(name="T")
    pager = None
    try:
        dst = poisoned(MAX)
        rd = me.register(dst)
        c = _granted_writer(children, me, rd, "slow-source")
        _, fd, addr = c.call("register_slow", "slow", MAX)
        content = rand_bytes(12, MAX)
        pager = uf.Pager(uf.take_fd(c.pid, fd), addr, lambda off: bytes(content[off:off + uf.PAGE]))
        pager.arm(2.0)
        c.start("write", "slow", rd.descriptor(), length=MAX)
        assert pager.wait_fault(0, 10), "the writer never touched its source"
        time.sleep(0.2)  # it sits in the fault
        t0 = time.monotonic()
        me.deregister(rd)
        took = time.monotonic() - t0
        dst[:] = 0xEE
        status, detail = c.result(20)
        time.sleep(0.3)
        assert_poison(dst, "a region deregistered while a write's source page was slow", value=0xEE)
        print(f"slow source page: deregister() {took * 1e3:.1f} ms, the write {status}, nothing landed")
        assert status in ("RegionNotFound", "AccessDenied"), (status, detail)
        assert took < 1.0, f"deregister() waited {took:.2f} s for a copy that had not begun"
    finally:
        if pager:
            pager.close()
        me.close()


@pytest.mark.budget(60)
def test_deregister_waits_for_a_copy_in_progress(children):
    """A one-sided write is inside its copy, stalled on a page of the target's own region that arrives
    after 2 s (longer than deregister_timeout_ms). deregister() waits for that copy to end instead of
    giving up at its timeout; after it returns nothing lands."""
    uf = _userfault()
    me = tether.Endpoint(name="T", deregister_timeout=0.5)
    slow = uf.SlowMemory(2 * MAX)
    pager = uf.Pager(slow.fd, slow.addr, lambda off: bytes([POISON_BYTE]) * uf.PAGE)
    try:
        rd = me.register(slow.array)
        slow.array[:MAX] = POISON_BYTE  # the first half present; the second faults when written
        c = _granted_writer(children, me, rd, "copy-in-progress")
        c.call("register", "src", MAX, fill=("seed", 13))
        seen = len(pager.faults)
        pager.arm(2.0)
        c.start("write", "src", rd.descriptor(), remote_offset=MAX, length=MAX)
        assert pager.wait_fault(seen, 10), "the write never reached the slow page"
        time.sleep(0.1)
        t0 = time.monotonic()
        me.deregister(rd)
        took = time.monotonic() - t0
        landed = slow.array[MAX:].copy()
        slow.array[:] = 0xEE
        c.result(20)
        time.sleep(0.3)
        assert_poison(slow.array, "a region after deregister() returned", value=0xEE)
        assert pager.served_slow is not None and t0 + took >= pager.served_slow, \
            "deregister() returned while the copy was still stalled"
        assert_bytes_equal(landed, rand_bytes(13, MAX), "the write deregister() waited for")
        print(f"copy in progress: deregister() waited {took:.2f} s for it (deregister_timeout 0.5 s), nothing landed after")
    finally:
        pager.close()
        me.close()


@pytest.mark.budget(90)
@pytest.mark.parametrize("sig", ["SIGSTOP", "SIGKILL"])
def test_a_stopped_or_killed_writer_lands_nothing_after_deregister(children, sig):
    """A child streams one-sided writes into our region and is stopped (continued 1.5 s later) or
    killed at a random moment; we deregister. Whenever deregister() returns, nothing lands after it,
    however long the writer was stopped. Five rounds."""
    rng = np.random.default_rng(14 if sig == "SIGSTOP" else 15)
    took = []
    for round_ in range(5):
        me = tether.Endpoint(name="T", deregister_timeout=0.3)
        try:
            dst = poisoned(MAX)
            rd = me.register(dst)
            c = _granted_writer(children, me, rd, f"writer-{round_}")
            c.call("register", "src", 4 * KiB, fill=("seed", 16))
            assert c.call("start_stream", "write", "src", rd.descriptor(), 4 * KiB)
            time.sleep(float(rng.uniform(0.01, 0.1)))
            c.kill(getattr(signal, sig))
            timer = threading.Timer(1.5, lambda: os.kill(c.pid, signal.SIGCONT)) if sig == "SIGSTOP" else None
            if timer:
                timer.start()
            t0 = time.monotonic()
            me.deregister(rd)
            took.append(time.monotonic() - t0)
            dst[:] = 0xEE
            if timer:
                timer.join()
            time.sleep(0.3)
            assert_poison(dst, f"round {round_}: a region deregistered under a {sig}ed writer", value=0xEE)
        finally:
            me.close()
    print(f"{sig}: deregister() took " + ", ".join(f"{t * 1e3:.0f}" for t in took) + " ms"
          + (" (the writer continued at 1500 ms)" if sig == "SIGSTOP" else ""))
