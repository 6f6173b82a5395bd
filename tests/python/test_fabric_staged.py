"""The fabric transport's path for memory the provider cannot register (GPU memory without FI_HMEM),
run on CPU: the test knob TETHER_FABRIC_STAGE_HOST=1 makes an endpoint treat its *host* regions that
way. A staged initiator packs its chunks into registered slots (and unpacks reads from them); a
staged target's descriptors say "two-sided", so initiators send write/read messages that the
target validates against its registry, copies through its bounce buffers and answers. Two
processes over tcp;ofi_rxm, random data into poisoned destinations, every byte checked."""
import signal
import time

import numpy as np
import pytest

import tether
from tether_testutil.data import (
    MiB, assert_bytes_equal, assert_poison, poisoned, rand_bytes, wait_error, wait_until,
)
from tether_testutil.transports import transport_unusable
from tether_testutil.wire import DESC_KEY, descriptor_extension, get_u64, set_u64

T = 20
FAB = dict(transport="fabric", fabric_provider="tcp")
STAGE = {"TETHER_FABRIC_STAGE_HOST": "1"}


_WHY = transport_unusable("fabric", **FAB)
pytestmark = pytest.mark.skipif(_WHY != "", reason=f"fabric transport unavailable: {_WHY}")


def _get(child, *args):
    return np.frombuffer(child.call("get", *args), dtype=np.uint8)


def _fabric_ext(desc: bytes) -> bytes:
    return descriptor_extension(desc, b"fabric")[1]


def _pair(endpoints, children, monkeypatch, staged: str, name="target"):
    """(our endpoint, child, peer): `staged` says which side runs with the knob."""
    if staged in ("both", "initiator"):
        monkeypatch.setenv("TETHER_FABRIC_STAGE_HOST", "1")
    else:
        monkeypatch.delenv("TETHER_FABRIC_STAGE_HOST", raising=False)
    me = endpoints(name="me", **FAB)
    # (a spawned child inherits our environment: say "0" explicitly)
    c = children(name, env=STAGE if staged in ("both", "target") else {"TETHER_FABRIC_STAGE_HOST": "0"})
    peer = me.connect(c.call("endpoint", name=name, **FAB)["metadata"], timeout=5)
    assert peer.transport == "fabric"
    return me, c, peer


def test_descriptor_of_a_staged_region_says_two_sided(endpoints, monkeypatch):
    monkeypatch.setenv("TETHER_FABRIC_STAGE_HOST", "1")
    ep = endpoints(**FAB)
    assert _fabric_ext(ep.register(poisoned(4096)).descriptor()) == b"\x00\x01"


@pytest.mark.parametrize("staged", ["both", "target", "initiator"])
def test_every_operation(endpoints, children, monkeypatch, staged):
    me, c, peer = _pair(endpoints, children, monkeypatch, staged)
    n = 5 * MiB + 12345   # several chunks and a ragged tail
    # write + notify: the note finds the data whole (answers come only after the target copied)
    d_dst = c.call("register", "dst", n + 8192)
    src = rand_bytes(1, n)
    rs = me.register(src)
    for round_ in range(2):
        c.call("fill", "dst", ("poison", 0xA5))
        c.start("check_on_notify", "dst", 1, 4097, n)
        peer.write(rs, d_dst, remote_offset=4097, length=n, notify=b"w%d" % round_).wait(T)
        res = c.result()
        assert not res["timed_out"] and res["mismatch"] is None, res
        assert res["notes"][0][2] == b"w%d" % round_
    got = _get(c, "dst")
    assert_poison(got[:4097], "before the written range")
    assert_bytes_equal(got[4097:4097 + n], src, "written range")
    assert_poison(got[4097 + n:], "after the written range")
    # read
    d_src = c.call("register", "src", n, fill=("seed", 2))
    back = poisoned(n + 100)
    peer.read(me.register(back), d_src, local_offset=50, length=n).wait(T)
    assert_poison(back[:50])
    assert_bytes_equal(back[50:50 + n], rand_bytes(2, n))
    assert_poison(back[50 + n:])
    # writev: scattered blocks of odd sizes, one spanning chunks
    c.call("fill", "dst", ("poison", 0xA5))
    whole = rand_bytes(3, 4 * MiB)
    region = me.register(whole)
    blocks = [(i * 40960 + 7 * i, i * 65536 + 3, 1000 + 97 * i) for i in range(48)] + [(2 * MiB, 3 * MiB + 1, 1536 * 1024)]
    peer.writev([(region, lo, d_dst, ro, ln) for lo, ro, ln in blocks]).wait(T)
    got = _get(c, "dst")
    expect = poisoned(n + 8192, 0xA5)
    for lo, ro, ln in blocks:
        expect[ro:ro + ln] = whole[lo:lo + ln]
    assert_bytes_equal(got, expect, "after writev")
    # readv: the child's random region into scattered places of a poisoned buffer
    sink = poisoned(n)
    rsink = me.register(sink)
    peer.readv([(rsink, ro, d_src, lo, ln) for lo, ro, ln in blocks]).wait(T)
    expect = poisoned(n)
    theirs = rand_bytes(2, n)
    for lo, ro, ln in blocks:
        expect[ro:ro + ln] = theirs[lo:lo + ln]
    assert_bytes_equal(sink, expect, "after readv")
    # send -> recv (the child receives), and back
    c.call("register", "rbuf", n + 64)
    c.start("recv", "rbuf", offset=64, length=n, tag=7, accepted=True)
    peer.send(rs, length=n, tag=7).wait(T)
    st, nbytes, data = c.result()
    assert (st, nbytes) == ("ok", n)
    assert_bytes_equal(np.frombuffer(data, dtype=np.uint8), src, "received")
    assert_poison(_get(c, "rbuf", 0, 64))
    c.call("register", "sbuf", n, fill=("seed", 9))
    mine = poisoned(n + 64)
    t = peer.recv(me.register(mine), offset=64, length=n, tag=8)
    assert c.call("send", "sbuf", tag=8, accepted=True)[0] == "ok"
    t.wait(T)
    assert_bytes_equal(mine[64:], rand_bytes(9, n))
    assert_poison(mine[:64])


def test_refusals_come_back_as_codes_and_touch_nothing(endpoints, children, monkeypatch):
    """A staged target checks every message against its registry: a bad key, a widened descriptor,
    a read-only or deregistered region are refused with their Code, nothing lands, and (unlike a
    NIC's refusal on tcp) the link stays up."""
    me, c, peer = _pair(endpoints, children, monkeypatch, "target")
    d = c.call("register", "dst", 1 * MiB)
    src = me.register(rand_bytes(4, 1 * MiB))
    sink = poisoned(1 * MiB)
    rsink = me.register(sink)
    bad_key = set_u64(d, DESC_KEY, get_u64(d, DESC_KEY) ^ 1)
    for op in ("write", "read"):
        t = peer.write(src, bad_key) if op == "write" else peer.read(rsink, bad_key)
        err = wait_error(t, 10)
        assert isinstance(err, tether.AccessDenied), (op, err)
    assert_poison(_get(c, "dst"), "target after a bad key")
    assert_poison(sink, "reader after a bad key")
    ro = c.call("register", "ro", 64 * 1024, fill=("seed", 3), readonly=True)
    err = wait_error(peer.write(src, ro, length=64 * 1024), 10)
    assert isinstance(err, (tether.AccessDenied, tether.InvalidArgument)), err
    assert_bytes_equal(_get(c, "ro"), rand_bytes(3, 64 * 1024), "read-only region")
    peer.read(rsink, ro, length=64 * 1024).wait(T)   # reading it is fine
    assert_bytes_equal(sink[:64 * 1024], rand_bytes(3, 64 * 1024))
    g = c.call("register", "gone", 64 * 1024)
    c.call("deregister", "gone")
    err = wait_error(peer.write(src, g, length=64 * 1024), 10)
    assert isinstance(err, (tether.RegionNotFound, tether.AccessDenied)), err
    assert_poison(_get(c, "gone"), "deregistered region")
    # the same peer still works
    assert peer.connected
    peer.write(src, d).wait(T)
    assert_bytes_equal(_get(c, "dst"), rand_bytes(4, 1 * MiB))


@pytest.mark.parametrize("staged", ["both", "target"])
def test_peer_killed_mid_transfer_fails_in_bounded_time(endpoints, children, monkeypatch, staged):
    me, c, peer = _pair(endpoints, children, monkeypatch, staged, name="victim")
    desc = c.call("register", "big", 32 * MiB, fill=("seed", 5))
    sink = me.register(poisoned(32 * MiB))
    src = me.register(rand_bytes(6, 32 * MiB))
    ts = [peer.read(sink, desc) if i % 2 else peer.write(src, desc) for i in range(16)]
    ts[0].wait(T)
    t_kill = time.monotonic()
    c.kill(signal.SIGKILL)
    outs = []
    for t in ts[1:]:
        try:
            t.wait(max(0.01, 8.0 - (time.monotonic() - t_kill)))
            outs.append("ok")
        except tether.TetherError as e:
            outs.append(type(e).__name__)
    assert "Timeout" not in outs, f"transfers still running after the peer died: {outs}"
    assert set(outs) <= {"ok", "ConnectionLost"}, outs
    assert wait_until(lambda: not peer.connected, 5)
    # the survivor still serves fabric peers
    c2 = children("newcomer", env=STAGE if staged == "both" else {"TETHER_FABRIC_STAGE_HOST": "0"})
    p2 = me.connect(c2.call("endpoint", name="newcomer", **FAB)["metadata"], timeout=5)
    d2 = c2.call("register", "d", 1 * MiB)
    p2.write(src, d2, length=1 * MiB).wait(T)
    assert_bytes_equal(_get(c2, "d"), rand_bytes(6, 1 * MiB))


def test_many_small_transfers_in_flight(endpoints, children, monkeypatch):
    """More chunks than staging slots and bounce buffers at once: slots and buffers recycle."""
    me, c, peer = _pair(endpoints, children, monkeypatch, "both")
    d = c.call("register", "dst", 256 * 4096)
    data = rand_bytes(12, 256 * 4096)
    src = me.register(data)
    ts = [peer.write(src, d, local_offset=i * 4096, remote_offset=i * 4096, length=4096) for i in range(256)]
    for t in ts:
        t.wait(T)
    assert_bytes_equal(_get(c, "dst"), data)
    back = poisoned(256 * 4096)
    rb = me.register(back)
    ts = [peer.read(rb, d, local_offset=i * 4096, remote_offset=i * 4096, length=4096) for i in range(256)]
    for t in ts:
        t.wait(T)
    assert_bytes_equal(back, data)
