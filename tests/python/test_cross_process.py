"""Transfers between two real processes: write/read, writev/readv, threads in flight, notifications only
after the data, send/recv, the accepted side writing back, and the child initiating. `to_child` connects
over each configuration; random data, poisoned destinations, every byte checked.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import tether
from tether_testutil.child import child_endpoint, write_then_read_child
from tether_testutil.data import (
    KiB, MiB, POISON, assert_bytes_equal, assert_poison, disjoint_blocks, poisoned, rand_bytes, wait_error,
)

SIZES = [1, 4 * KiB + 3, 1 * MiB, 64 * MiB]
SIZE_IDS = ["1B", "4KiB+3", "1MiB", "64MiB"]
T = 20.0  # generous bound for any single wait()


@pytest.fixture(scope="module")
def child():
    """One child process with an endpoint named 'child-ep' (default configuration)."""
    with child_endpoint("transfer-child", name="child-ep") as c:
        yield c


@pytest.fixture
def to_child(child, endpoints, config):
    """(local endpoint named 'parent-ep' with the parametrized config, peer -> child)."""
    ep = endpoints(name="parent-ep", **config)
    return ep, ep.connect(child.info["metadata"], timeout=5)


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
def test_cross_process_write_and_read(child, to_child, size):
    ep, peer = to_child
    assert peer.name == "child-ep"
    write_then_read_child(ep, peer, child, size, lo=3, ro=1001, pad=7, seeds=(size + 1, 77), timeout=T)


def test_cross_process_writev_readv(child, to_child):
    ep, peer = to_child
    rng = np.random.default_rng(3)
    layout, remote_size = disjoint_blocks(rng, 128, 1, 30000, 500)
    desc = child.call("register", "vec", remote_size)
    try:
        src = rand_bytes(31, remote_size + 1000)
        rs = ep.register(src)
        entries, expected = [], poisoned(remote_size)
        shift = 777  # local offset = remote offset + shift
        for roff, n in layout:
            entries.append((rs, roff + shift, desc, roff, n))
            expected[roff:roff + n] = src[roff + shift:roff + shift + n]
        peer.writev(entries).wait(T)
        got = np.frombuffer(child.call("get", "vec"), dtype=np.uint8)
        assert_bytes_equal(got, expected, "child buffer after writev")

        tiny, tiny_size = disjoint_blocks(rng, 1000, 1, 3, 3)
        assert tiny_size <= remote_size
        back = poisoned(tiny_size)
        rb = ep.register(back)
        peer.readv([(rb, off, desc, off, n) for off, n in tiny]).wait(T)
        exp_back = poisoned(tiny_size)
        for off, n in tiny:
            exp_back[off:off + n] = got[off:off + n]
        assert_bytes_equal(back, exp_back, "local buffer after readv of 1000 tiny entries")
    finally:
        child.call("deregister", "vec")


def test_cross_process_threads_in_flight(child, to_child):
    ep, peer = to_child
    slot, per, nthreads = 16 * KiB, 50, 4
    desc = child.call("register", "many", slot * per * nthreads)
    try:
        src = rand_bytes(41, slot * per * nthreads)
        rs = ep.register(src)
        out = []

        def worker(k):
            out.extend(peer.write(rs, desc, local_offset=(k * per + i) * slot, remote_offset=(k * per + i) * slot,
                                  length=slot - (i % 7)) for i in range(per))

        ths = [threading.Thread(target=worker, args=(k,)) for k in range(nthreads)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(20)
        assert len(out) == per * nthreads
        for t in out:
            t.wait(T)
        got = np.frombuffer(child.call("get", "many"), dtype=np.uint8)
        expected = poisoned(src.size)
        for k in range(nthreads):
            for i in range(per):
                o = (k * per + i) * slot
                expected[o:o + slot - (i % 7)] = src[o:o + slot - (i % 7)]
        assert_bytes_equal(got, expected)
    finally:
        child.call("deregister", "many")


def test_cross_process_notification_only_after_data(child, to_child):
    """In the target process, at the moment a notification is seen, its data must be complete."""
    ep, peer = to_child
    n = 16 * MiB
    desc = child.call("register", "nd", n + 100)
    try:
        for rnd in range(4):
            seed = 500 + rnd
            src = rand_bytes(seed, n)
            child.start("check_on_notify", "nd", seed, 50, n, timeout=T)
            t = peer.write(ep.register(src), desc, remote_offset=50, length=n, notify=b"round-%d" % rnd)
            res = child.result(T + 5)
            t.wait(T)
            assert not res["timed_out"], "the notification never arrived"
            assert res["mismatch"] is None, (
                f"round {rnd}: notification seen before the data was complete (first stale byte "
                f"{res['mismatch']})")
            assert [(x[1], x[2]) for x in res["notes"]] == [("parent-ep", b"round-%d" % rnd)]
    finally:
        child.call("deregister", "nd")


def test_cross_process_standalone_notify_and_names(child, to_child):
    ep, peer = to_child
    for i in range(10):
        peer.notify(b"hello-%d" % i).wait(T)
    notes = child.call("notifications", count=10, timeout=T)
    assert [x[2] for x in notes] == [b"hello-%d" % i for i in range(10)]
    assert {x[1] for x in notes} == {"parent-ep"}
    peers = child.call("peers")
    ids = [p[0] for p in peers if p[1] == "parent-ep" and p[2]]
    assert notes[0][0] in ids


def test_cross_process_accepted_peer_writes_back(child, to_child):
    """The child never connects: it writes and reads through the peer it accepted (ep.peers())."""
    ep, peer = to_child
    mine = poisoned(2 * MiB + 10)
    rm = ep.register(mine)
    child.call("register", "wb", 2 * MiB, fill=("seed", 61))
    try:
        st = _child_accepted_op(child, "write", "wb", rm.descriptor(), remote_offset=10, length=2 * MiB)
        assert st[0] == "ok", st
        assert_bytes_equal(mine[10:], rand_bytes(61, 2 * MiB))
        assert_poison(mine[:10])
        mine[10:20] = 1
        child.call("fill", "wb", ("poison", POISON))
        st = _child_accepted_op(child, "read", "wb", rm.descriptor(), length=2 * MiB)
        assert st[0] == "ok", st
        got = np.frombuffer(child.call("get", "wb"), dtype=np.uint8)
        assert_bytes_equal(got, mine[:2 * MiB])
        st = child.call("notify", b"back", accepted=True)
        assert st[0] == "ok"
        notes = ep.notifications(timeout=T)
        assert [(n.peer_name, n.data) for n in notes] == [("child-ep", b"back")]
    finally:
        child.call("deregister", "wb")


def _child_accepted_op(child, op, local, desc, **kw):
    """Runs op in the child through the newest peer it accepted (the one this test connected)."""
    return child.call(op, local, desc, accepted=True, **kw)


def test_cross_process_send_recv(child, to_child):
    ep, peer = to_child
    child.call("register", "msg", 5 * MiB, fill=("seed", 91))
    child.call("register", "inbox", 5 * MiB)
    try:
        # parent -> child, recv posted (in the child) after the send
        m = rand_bytes(92, 3 * MiB + 1)
        s = peer.send(ep.register(m), tag=42)
        st = child.call("recv", "inbox", offset=3, tag=42, accepted=True)
        s.wait(T)
        assert st[0] == "ok" and st[1] == m.size
        assert_bytes_equal(np.frombuffer(st[2], dtype=np.uint8), m)
        # child -> parent, recv posted first
        box = poisoned(5 * MiB + 2)
        r = peer.recv(ep.register(box), offset=2, tag=43)
        st = child.call("send", "msg", length=5 * MiB - 1, tag=43, accepted=True)
        assert st[0] == "ok"
        r.wait(T)
        assert r.bytes == 5 * MiB - 1
        assert_bytes_equal(box[2:2 + r.bytes], rand_bytes(91, 5 * MiB)[:-1])
        assert_poison(box[:2])
        assert_poison(box[2 + r.bytes:])
        # truncation across processes: both sides see Truncated
        r = peer.recv(ep.register(poisoned(10)), tag=44)
        st = child.call("send", "msg", length=11, tag=44, accepted=True)
        assert st[0] == "Truncated", st
        assert isinstance(wait_error(r), tether.Truncated)
    finally:
        child.call("deregister", "msg")
        child.call("deregister", "inbox")


@pytest.mark.parametrize("size", [1, 64 * MiB], ids=["1B", "64MiB"])
def test_cross_process_child_initiates(children, endpoints, size):
    """The child connects and is the initiator; this process is the target."""
    me = endpoints(name="target-parent")
    mine = poisoned(size + 20)
    rm = me.register(mine)
    c = children("initiator-child")
    c.call("endpoint", name="init-child")
    assert c.call("connect", me.metadata()) == "target-parent"
    c.call("register", "src", size, fill=("seed", 123))
    st = c.call("write", "src", rm.descriptor(), remote_offset=20, length=size, notify=b"done")
    assert st == ("ok", size)
    assert_bytes_equal(mine[20:], rand_bytes(123, size))
    assert_poison(mine[:20])
    notes = me.notifications(timeout=T)
    assert [(n.peer_name, n.data) for n in notes] == [("init-child", b"done")]
    mine[20:] = rand_bytes(124, size)
    c.call("fill", "src", ("poison", POISON))
    st = c.call("read", "src", rm.descriptor(), remote_offset=20, length=size)
    assert st == ("ok", size)
    assert_bytes_equal(np.frombuffer(c.call("get", "src"), dtype=np.uint8), mine[20:])
