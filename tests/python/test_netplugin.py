"""The netplugin transport against the testnet plugin (tests/netplugin: TCPX-like, over loopback),
between two real processes: every operation, random data, every byte checked, poison around.

testnet fails a comm that is asked for a 17th request, checks every message's tag against the
receive it was posted for, and scatters payload over 4 KiB bounce pages that it reuses right after
irecvConsumed: a transport that posts before checking its window, reuses a tag, or consumes before
unpacking fails these tests (the last one is shown by injecting that fault).
TETHER_TEST_NET_PLUGIN=path runs them against another build of the plugin (e.g. a GPU bounce build).
"""
from __future__ import annotations

import numpy as np
import pytest

import tether
from tether_testutil.child import child_endpoint, write_then_read_child
from tether_testutil.data import KiB, MiB, assert_bytes_equal, assert_poison, poisoned, rand_bytes
from tether_testutil.transports import build_testnet_plugin
from tether_testutil.wire import DESC_KEY, get_u64, set_u64

T = 30.0


@pytest.fixture(scope="session")
def plugin_path() -> str:
    return build_testnet_plugin()


def _child(plugin_path, name, env=None):
    return child_endpoint(name, env, name=name, net_plugin=plugin_path, net_comms=3)


@pytest.fixture(scope="module")
def child(plugin_path):
    with _child(plugin_path, "np-child") as c:
        yield c


@pytest.fixture(params=[dict(), dict(chunk_bytes=64 << 10, net_comms=4)], ids=["default", "chunk64k-comms4"])
def to_child(request, child, endpoints, plugin_path):
    ep = endpoints(name="np-parent", transport="netplugin", net_plugin=plugin_path, **request.param)
    assert ep.transports()["netplugin"] == ""
    peer = ep.connect(child.info["metadata"], timeout=10)
    assert peer.transport == "netplugin"
    return ep, peer


@pytest.mark.parametrize("size", [1, 4 * KiB + 3, 1 * MiB + 5, 24 * MiB], ids=["1B", "4KiB+3", "1MiB+5", "24MiB"])
def test_write_and_read_every_byte(child, to_child, size):
    ep, peer = to_child
    write_then_read_child(ep, peer, child, size, lo=3, ro=4097, pad=9, seeds=(size, 99), timeout=T)


def test_writev_readv_every_byte(child, to_child):
    ep, peer = to_child
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 70000, 300) | 1
    gaps = rng.integers(1, 500, 300)
    offsets = np.cumsum(gaps + np.concatenate([[0], sizes[:-1]]))
    remote_size = int(offsets[-1] + sizes[-1] + 11)
    desc = child.call("register", "vec", remote_size)
    try:
        src = rand_bytes(7, remote_size + 100)
        rs = ep.register(src)
        expected = poisoned(remote_size)
        entries = []
        for off, n in zip(offsets.tolist(), sizes.tolist()):
            entries.append((rs, off + 50, desc, off, n))
            expected[off:off + n] = src[off + 50:off + 50 + n]
        peer.writev(entries).wait(T)
        got = np.frombuffer(child.call("get", "vec"), dtype=np.uint8)
        assert_bytes_equal(got, expected, "child buffer after writev")
        back = poisoned(remote_size)
        rb = ep.register(back)
        peer.readv([(rb, off, desc, off, n) for off, n in zip(offsets.tolist(), sizes.tolist())]).wait(T)
        assert_bytes_equal(back, expected, "readv back")
    finally:
        child.call("deregister", "vec")


@pytest.mark.parametrize("size", [1, 3 * MiB + 7], ids=["1B", "3MiB+7"])
def test_send_recv_both_ways(child, to_child, size):
    ep, peer = to_child
    child.call("register", "rbuf", size + 64)
    try:
        src = rand_bytes(size, size)
        child.start("recv", "rbuf", length=size + 64, tag=11, accepted=True)
        peer.send(ep.register(src), tag=11).wait(T)
        status, n, data = child.result(T)
        assert (status, n) == ("ok", size)
        assert_bytes_equal(np.frombuffer(data, dtype=np.uint8), src, "received message")

        child.call("fill", "rbuf", ("seed", 5))
        into = poisoned(size + 64)
        t = peer.recv(ep.register(into), tag=12)
        assert child.call("send", "rbuf", length=size, tag=12, accepted=True) == ("ok", size)
        t.wait(T)
        assert t.bytes == size
        assert_bytes_equal(into[:size], rand_bytes(5, size + 64)[:size], "message from the child")
        assert_poison(into[size:])
    finally:
        child.call("deregister", "rbuf")


def test_notify_after_data_and_alone(child, to_child):
    ep, peer = to_child
    n = 5 * MiB + 3
    desc = child.call("register", "nbuf", n)
    try:
        child.start("check_on_notify", "nbuf", 21, 0, n)
        peer.write(ep.register(rand_bytes(21, n)), desc, notify=b"data-ready").wait(T)
        res = child.result(T)
        assert not res["timed_out"] and res["mismatch"] is None, res
        assert res["notes"][0][2] == b"data-ready"
        peer.notify(b"alone").wait(T)
        notes = child.call("notifications", 1)
        assert [x[2] for x in notes] == [b"alone"]
    finally:
        child.call("deregister", "nbuf")


def test_tampered_descriptor_is_refused_and_writes_nothing(child, to_child):
    ep, peer = to_child
    desc = child.call("register", "guard", 1 * MiB)
    try:
        bad = set_u64(desc, DESC_KEY, get_u64(desc, DESC_KEY) ^ 1)
        with pytest.raises(tether.AccessDenied):
            peer.write(ep.register(rand_bytes(1, 1 * MiB)), bad).wait(T)
        assert_poison(np.frombuffer(child.call("get", "guard"), dtype=np.uint8), "refused write target")
        with pytest.raises(tether.OutOfRange):
            peer.read(ep.register(poisoned(2 * MiB)), desc, length=2 * MiB).wait(T)
        # the lanes survive a refused request
        src = rand_bytes(2, 1 * MiB)
        peer.write(ep.register(src), desc).wait(T)
        assert_bytes_equal(np.frombuffer(child.call("get", "guard"), dtype=np.uint8), src)
    finally:
        child.call("deregister", "guard")


def test_many_in_flight_never_exceed_the_request_limit(child, to_child):
    """Hundreds of small transfers at once: testnet fails a comm asked for a 17th request."""
    ep, peer = to_child
    slot, count = 4 * KiB + 1, 400
    desc = child.call("register", "many", slot * count)
    try:
        src = rand_bytes(9, slot * count)
        rs = ep.register(src)
        ts = [peer.write(rs, desc, local_offset=i * slot, remote_offset=i * slot, length=slot) for i in range(count)]
        for t in ts:
            t.wait(T)
        assert_bytes_equal(np.frombuffer(child.call("get", "many"), dtype=np.uint8), src)
        back = poisoned(slot * count)
        rb = ep.register(back)
        ts = [peer.read(rb, desc, local_offset=i * slot, remote_offset=i * slot, length=slot) for i in range(count)]
        for t in ts:
            t.wait(T)
        assert_bytes_equal(back, src)
        assert peer.connected
    finally:
        child.call("deregister", "many")


@pytest.mark.budget(90)
def test_consuming_before_unpack_would_be_caught(plugin_path, endpoints):
    """The same write with the seeds' bug injected at the target (pages handed back before the
    unpack): the every-byte check sees corruption. Without the fault the data is exact."""
    size = 16 * MiB
    src = rand_bytes(13, size)
    results = {}
    for fault in (None, "consume_early"):
        with _child(plugin_path, f"np-fault-{fault}", env={"TETHER_NET_FAULT": fault} if fault else None) as c:
            ep = endpoints(transport="netplugin", net_plugin=plugin_path, chunk_bytes=256 << 10)
            peer = ep.connect(c.info["metadata"], timeout=10)
            desc = c.call("register", "dst", size)
            peer.write(ep.register(src), desc).wait(T)  # completes: the fault only corrupts data
            got = np.frombuffer(c.call("get", "dst"), dtype=np.uint8)
            results[fault] = int(np.count_nonzero(got != src))
    assert results[None] == 0
    assert results["consume_early"] > 0, "consuming before the unpack went unnoticed"


def test_unavailable_without_a_plugin_and_creation_says_why(endpoints):
    ep = endpoints(net_plugin="/nonexistent/libnccl-net.so")
    assert "cannot load net plugin" in ep.transports()["netplugin"]
    # asked for by name, the endpoint is refused at once with the reason, not at the first connect
    with pytest.raises(tether.Unavailable, match="cannot load net plugin"):
        endpoints(transport="netplugin", net_plugin="/nonexistent/libnccl-net.so")
    ep2 = endpoints(net_plugin="")
    assert "TETHER_NET_PLUGIN" in ep2.transports()["netplugin"]


def test_bad_bindings_make_the_transport_unavailable(endpoints, plugin_path):
    ep = endpoints(net_plugin=plugin_path, net_bindings="testnet0:3-1")
    assert "TETHER_NET_BINDINGS" in ep.transports()["netplugin"]
    ok = endpoints(net_plugin=plugin_path, net_bindings="testnet0:0;testnet1:0")
    assert ok.transports()["netplugin"] == ""


def test_self_connect_over_netplugin(plugin_path, endpoints):
    """An endpoint connecting to itself makes two offers in one handshake session (the NIXL plugin's
    intra-agent transfers): each side must attach to its own."""
    ep = endpoints(name="selfie", transport="netplugin", net_plugin=plugin_path)
    peer = ep.connect(ep.metadata(), timeout=10)
    assert peer.transport == "netplugin"
    src, dst = rand_bytes(9, 3 * MiB), poisoned(3 * MiB)
    peer.write(ep.register(src), ep.register(dst).descriptor(), notify=b"me").wait(T)
    assert_bytes_equal(dst, src)
    assert [n.data for n in ep.notifications(timeout=T)] == [b"me"]
