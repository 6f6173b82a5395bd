"""Transfer.cancel(): stops a transfer without blocking. No further chunk leaves; the transfer ends
with Cancelled once its chunks in flight are answered; its notification is never sent; the peer and
every other transfer go on untouched.

A stopped target (SIGSTOP) makes the outcome deterministic: chunks already sent wait for answers,
transfers queued behind them have sent nothing, so cancelling one must end it at once.
"""
from __future__ import annotations

import signal
import time

import numpy as np
import pytest

import tether
from tether_testutil.data import (
    MiB, assert_bytes_equal, assert_poison, poisoned, rand_bytes, wait_error, wait_until,
)

T = 20.0


@pytest.fixture(params=["tcp", "ipc"])
def stopped_target(request, children, endpoints):
    """(local endpoint, peer -> child, child, descriptor of the child's 64 MiB buffer)."""
    c = children("cancel-child")
    info = c.call("endpoint", name="target", transport=request.param, window=4, chunk_bytes=1 * MiB)
    desc = c.call("register", "dst", 64 * MiB)
    ep = endpoints(name="initiator", transport=request.param, window=4, chunk_bytes=1 * MiB)
    return ep, ep.connect(info["metadata"], timeout=5), c, desc


def test_cancel_a_queued_transfer_ends_it_at_once_and_the_rest_completes(stopped_target):
    ep, peer, c, desc = stopped_target
    src = rand_bytes(1, 64 * MiB)
    rs = ep.register(src)
    peer.write(rs, desc, length=1 * MiB).wait(T)  # the lanes are up before the target stops
    c.kill(signal.SIGSTOP)
    try:
        first = peer.write(rs, desc, length=32 * MiB)                   # fills the window, then waits
        queued = peer.write(rs, desc, local_offset=32 * MiB, remote_offset=32 * MiB, length=32 * MiB,
                            notify=b"never")
        time.sleep(0.2)
        assert not first.done() and not queued.done()
        t0 = time.monotonic()
        queued.cancel()
        err = wait_error(queued, timeout=5)
        took = time.monotonic() - t0
        assert isinstance(err, tether.Cancelled), err
        assert took < 1.0, f"a transfer with nothing in flight took {took:.2f} s to end after cancel()"
        assert not first.done()
    finally:
        c.kill(signal.SIGCONT)
    first.wait(T)
    got = np.frombuffer(c.call("get", "dst"), dtype=np.uint8)
    assert_bytes_equal(got[:32 * MiB], src[:32 * MiB])
    # Nothing of the cancelled transfer left this process before the cancel: the rest is poison.
    assert_poison(got[32 * MiB:], "bytes of the cancelled transfer")
    assert c.call("notifications", 1, 0.5) == []
    # The peer is fine: a new transfer with a notification completes.
    peer.write(rs, desc, length=2 * MiB, notify=b"after").wait(T)
    assert [n[2] for n in c.call("notifications", 1, T)] == [b"after"]


def test_cancel_with_chunks_in_flight_ends_after_they_are_answered(stopped_target):
    ep, peer, c, desc = stopped_target
    src = rand_bytes(2, 64 * MiB)
    rs = ep.register(src)
    peer.write(rs, desc, length=1 * MiB).wait(T)
    c.kill(signal.SIGSTOP)
    try:
        t = peer.write(rs, desc, length=64 * MiB, notify=b"never")
        time.sleep(0.2)
        t0 = time.monotonic()
        t.cancel()  # returns at once although the target cannot answer
        assert time.monotonic() - t0 < 0.1
        time.sleep(0.3)
        assert not t.done(), "a transfer whose chunks are still in flight must not end before they are answered"
    finally:
        c.kill(signal.SIGCONT)
    assert isinstance(wait_error(t, timeout=T), tether.Cancelled)
    got = np.frombuffer(c.call("get", "dst"), dtype=np.uint8)
    assert_poison(got[48 * MiB:], "bytes no chunk in flight carried (the window is 4 chunks)")
    assert c.call("notifications", 1, 0.5) == []
    ep.deregister(rs)  # nothing pins it any more


def test_cancel_a_finished_transfer_changes_nothing(pair):
    a, b, peer = pair
    src, dst = rand_bytes(3, 4096), poisoned(4096)
    done = peer.write(a.register(src), b.register(dst).descriptor())
    done.wait(T)
    done.cancel()
    assert done.status == "ok"
    assert_bytes_equal(dst, src)


def test_cancel_an_unmatched_recv_then_the_next_recv_matches(pair):
    a, b, peer = pair
    lost = peer.recv(a.register(poisoned(64)), tag=9)
    lost.cancel()
    assert isinstance(wait_error(lost, timeout=5), tether.Cancelled)
    back = poisoned(64)
    keep = peer.recv(a.register(back), tag=9)
    msg = rand_bytes(4, 64)
    assert wait_until(lambda: len(b.peers()) == 1, 5)
    b.peers()[0].send(b.register(msg), tag=9).wait(T)
    keep.wait(T)
    assert_bytes_equal(back, msg)


def test_cancel_a_send_waiting_for_its_receiver(pair):
    a, b, peer = pair
    s = peer.send(a.register(rand_bytes(5, 1000)), tag=77)
    time.sleep(0.05)
    s.cancel()
    assert isinstance(wait_error(s, timeout=5), tether.Cancelled)
