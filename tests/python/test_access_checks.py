"""What a peer may touch and what the API accepts: keys, descriptor ranges, read-only and deregistered
regions, malformed descriptors, on both transports alike; a refused transfer fails with a typed error on
every wait and never delivers its notification; bad options and arguments are typed errors at the API's
edge. Random data, poisoned destinations, every byte checked."""
from __future__ import annotations

import os

import numpy as np
import pytest

import tether
from tether_testutil.data import (
    MiB, assert_bytes_equal, assert_poison, immediate_error, poisoned, poisoned_target, rand_bytes, wait_error,
)
from tether_testutil.wire import DESC_KEY, DESC_LENGTH, DESC_OFFSET, DESC_REGION_ID, get_u64, set_u32, set_u64

T = 20.0


def _fails_with(fn, exc, *args, **kw):
    """The error may be raised by the call itself or through the returned Transfer."""
    try:
        t = fn(*args, **kw)
    except tether.TetherError as e:
        assert isinstance(e, exc), f"expected {exc.__name__}, got {type(e).__name__}: {e}"
        return e
    e = wait_error(t)
    assert isinstance(e, exc), f"expected {exc.__name__}, got {type(e).__name__}: {e}"
    assert t.status == "error" and t.error
    return e


# --------------------------------------------------------------------------- keys


@pytest.mark.parametrize("size", [64, 3 * MiB + 5], ids=["64B", "3MiB+5"])
def test_wrong_key_is_denied_and_memory_untouched(duo, size):
    a, b, peer = duo
    dst = poisoned(size)
    rd = b.register(dst)
    good = rd.descriptor()
    src = rand_bytes(1, size)
    sink = poisoned(size)
    rs, rk = a.register(src), a.register(sink)
    for flip in (1, 1 << 63, 0xFFFFFFFFFFFFFFFF):
        bad = set_u64(good, DESC_KEY, get_u64(good, DESC_KEY) ^ flip)
        e = wait_error(peer.write(rs, bad))
        assert isinstance(e, tether.AccessDenied), repr(e)
        assert isinstance(e, PermissionError)
        assert isinstance(wait_error(peer.read(rk, bad)), tether.AccessDenied)
    assert_poison(dst, "target memory after writes with a wrong key")
    assert_poison(sink, "local memory after reads with a wrong key")
    assert b.stats()["rejected_requests"] > 0
    # the genuine descriptor still works on the same link
    peer.write(rs, good).wait(T)
    assert_bytes_equal(dst, src)


def test_widened_descriptor_length_is_denied(duo):
    a, b, peer = duo
    dst = poisoned(1000)
    rd = b.register(dst)
    narrow = rd.descriptor(offset=0, length=100)
    wide = set_u64(narrow, DESC_LENGTH, 1000)
    rs = a.register(rand_bytes(2, 1000))
    # beyond the granted range, and even inside it: the key covers (region, offset, length)
    assert isinstance(wait_error(peer.write(rs, wide)), tether.AccessDenied)
    assert isinstance(wait_error(peer.write(rs, wide, length=50)), tether.AccessDenied)
    assert isinstance(wait_error(peer.read(a.register(poisoned(1000)), wide)), tether.AccessDenied)
    assert_poison(dst)


def test_moved_descriptor_offset_is_denied(duo):
    a, b, peer = duo
    dst = poisoned(1000)
    rd = b.register(dst)
    d = rd.descriptor(offset=500, length=100)
    moved = set_u64(d, DESC_OFFSET, 0)
    assert isinstance(wait_error(peer.write(a.register(rand_bytes(3, 100)), moved)), tether.AccessDenied)
    assert_poison(dst)


def test_descriptor_retargeted_to_another_region_is_denied(duo):
    a, b, peer = duo
    d1, d2 = poisoned(4096), poisoned(4096)
    r1, r2 = b.register(d1), b.register(d2)
    retargeted = set_u32(r1.descriptor(), DESC_REGION_ID, r2.id)
    rs = a.register(rand_bytes(4, 4096))
    assert isinstance(wait_error(peer.write(rs, retargeted)), tether.AccessDenied)
    missing = set_u32(r1.descriptor(), DESC_REGION_ID, 999999)
    assert isinstance(wait_error(peer.write(rs, missing)), tether.RegionNotFound)
    assert_poison(d1)
    assert_poison(d2)


# --------------------------------------------------------------------------- ranges


def test_out_of_range_remote_offset_fails_locally(duo):
    a, b, peer = duo
    dst, d, rs = poisoned_target(a, b, 1000, 5)
    immediate_error(peer.write(rs, d, remote_offset=995, length=10), tether.OutOfRange)
    immediate_error(peer.write(rs, d, remote_offset=1001, length=0), tether.OutOfRange)
    immediate_error(peer.write(rs, d, remote_offset=1 << 63, length=1), tether.OutOfRange)
    immediate_error(peer.write(rs, d, remote_offset=1, length=(1 << 64) - 1), tether.OutOfRange)
    immediate_error(peer.read(a.register(poisoned(1000)), d, remote_offset=999, length=2), tether.OutOfRange)
    e = immediate_error(peer.write(rs, d, remote_offset=995, length=10), tether.OutOfRange)
    assert isinstance(e, IndexError)
    assert_poison(dst)


def test_negative_offsets_and_lengths_are_rejected(duo):
    a, b, peer = duo
    dst, d, rs = poisoned_target(a, b, 100, 6)
    for kw in (dict(remote_offset=-1, length=1), dict(local_offset=-1, length=1), dict(length=-1)):
        with pytest.raises((TypeError, OverflowError, tether.TetherError)):
            peer.write(rs, d, **kw).wait(T)
    assert_poison(dst)


def test_descriptor_grants_only_its_range(duo):
    a, b, peer = duo
    dst = poisoned(1000)
    rd = b.register(dst)
    d = rd.descriptor(offset=100, length=50)
    assert tether.RemoteRegion(d).offset == 100 and tether.RemoteRegion(d).length == 50
    src = rand_bytes(7, 200)
    rs = a.register(src)
    immediate_error(peer.write(rs, d, length=51), tether.OutOfRange)
    immediate_error(peer.write(rs, d, remote_offset=1, length=50), tether.OutOfRange)
    immediate_error(peer.read(a.register(poisoned(200)), d, length=51), tether.OutOfRange)
    assert_poison(dst)
    peer.write(rs, d, length=50).wait(T)
    assert_bytes_equal(dst[100:150], src[:50], "granted range")
    assert_poison(dst[:100], "before the granted range")
    assert_poison(dst[150:], "after the granted range")
    # default length = the rest of the local region: 140 bytes do not fit the grant of 50, and none move
    e = wait_error(peer.write(rs, d, local_offset=60), T)
    assert isinstance(e, tether.OutOfRange) and "exceeds the descriptor's 50 bytes" in str(e), repr(e)
    assert_bytes_equal(dst[100:150], src[:50])
    t = peer.write(rs, d, local_offset=150)
    t.wait(T)
    assert t.bytes == 50
    assert_bytes_equal(dst[100:150], src[150:200])
    assert_poison(dst[150:])


def test_local_range_out_of_bounds(duo):
    a, b, peer = duo
    dst = poisoned(1000)
    d = b.register(dst).descriptor()
    small = a.register(rand_bytes(8, 100))
    immediate_error(peer.write(small, d, length=101), tether.OutOfRange)
    immediate_error(peer.write(small, d, local_offset=50, length=51), tether.OutOfRange)
    immediate_error(peer.write(small, d, local_offset=101, length=0), tether.OutOfRange)
    immediate_error(peer.read(a.register(poisoned(100)), d, local_offset=1, length=100), tether.OutOfRange)
    immediate_error(peer.send(small, offset=90, length=11), tether.OutOfRange)
    immediate_error(peer.recv(a.register(poisoned(10)), offset=5, length=6), tether.OutOfRange)
    assert_poison(dst)


def test_one_bad_entry_rejects_the_whole_writev(duo):
    a, b, peer = duo
    dst, d, rs = poisoned_target(a, b, 10000, 9)
    good = [(rs, i * 100, d, i * 100, 100) for i in range(20)]
    for bad in ((rs, 9990, d, 0, 11), (rs, 0, d, 9990, 11)):
        e = immediate_error(peer.writev(good + [bad] + good), tether.OutOfRange)
        assert "entry 20" in str(e)
    assert_poison(dst, "no entry of a rejected writev may land")
    e = immediate_error(peer.readv([(a.register(poisoned(100)), 0, d, 0, 100), (rs, 0, d, 0, 10001)]),
                        tether.OutOfRange)
    assert "entry 1" in str(e)


# --------------------------------------------------------------------------- regions


def test_deregistered_remote_region(duo):
    a, b, peer = duo
    dst = poisoned(4096)
    rd = b.register(dst)
    d = rd.descriptor()
    rs = a.register(rand_bytes(10, 4096))
    peer.write(rs, d, length=10).wait(T)  # works while registered
    dst[:10] = 0xA5
    b.deregister(rd)
    assert isinstance(wait_error(peer.write(rs, d)), tether.RegionNotFound)
    e = wait_error(peer.read(a.register(poisoned(4096)), d))
    assert isinstance(e, tether.RegionNotFound) and isinstance(e, LookupError)
    assert_poison(dst)
    with pytest.raises(tether.RegionNotFound):
        rd.descriptor()
    with pytest.raises(tether.RegionNotFound):
        b.deregister(rd)
    # registering the same memory again gives a new region; the old descriptor stays dead
    rd2 = b.register(dst)
    assert rd2.id != rd.id
    assert isinstance(wait_error(peer.write(rs, d)), tether.RegionNotFound)
    peer.write(rs, rd2.descriptor()).wait(T)
    assert_bytes_equal(dst, rand_bytes(10, 4096))


def test_deregistered_local_region(duo):
    a, b, peer = duo
    d = b.register(poisoned(100)).descriptor()
    rs = a.register(rand_bytes(11, 100))
    a.deregister(rs)
    immediate_error(peer.write(rs, d), tether.RegionNotFound)
    immediate_error(peer.send(rs), tether.RegionNotFound)


@pytest.mark.parametrize("how", ["bytes", "readonly=True", "numpy-readonly-flag"])
def test_readonly_region_rejects_writes_serves_reads(duo, how):
    a, b, peer = duo
    data = rand_bytes(12, 5000)
    if how == "bytes":
        obj = data.tobytes()
        region = b.register(obj)
        view = np.frombuffer(obj, dtype=np.uint8)
    elif how == "readonly=True":
        view = data.copy()
        region = b.register(view, readonly=True)
    else:
        view = data.copy()
        view.flags.writeable = False
        region = b.register(view)
    assert region.readonly
    d = region.descriptor()
    rs = a.register(rand_bytes(13, 5000))
    e = wait_error(peer.write(rs, d))
    assert isinstance(e, tether.AccessDenied), repr(e)
    assert isinstance(wait_error(peer.write(rs, d, remote_offset=4999, length=1)), tether.AccessDenied)
    assert_bytes_equal(view, data, "read-only region after refused writes")
    sink = poisoned(5000)
    peer.read(a.register(sink), d).wait(T)
    assert_bytes_equal(sink, data, "read from a read-only region")


def test_readonly_local_region_cannot_receive(duo):
    a, b, peer = duo
    d = b.register(rand_bytes(14, 100)).descriptor()
    ro = a.register(bytes(100))
    immediate_error(peer.read(ro, d), tether.AccessDenied)
    immediate_error(peer.recv(ro), tether.AccessDenied)
    with pytest.raises(tether.InvalidArgument):
        a.register(bytes(10), readonly=False)
    # a read-only region is a fine source
    peer.write(a.register(rand_bytes(15, 100).tobytes()), d).wait(T)


def test_descriptor_of_another_endpoint_on_wrong_peer(endpoints):
    a, b, c = endpoints(name="a"), endpoints(name="b"), endpoints(name="c")
    peer_ab = a.connect(b.metadata(), timeout=5)
    c_mem = poisoned(100)
    d_c = c.register(c_mem).descriptor()
    rs = a.register(rand_bytes(16, 100))
    e = immediate_error(peer_ab.write(rs, d_c), tether.InvalidArgument)
    assert isinstance(e, ValueError)
    immediate_error(peer_ab.read(a.register(poisoned(100)), d_c), tether.InvalidArgument)
    immediate_error(peer_ab.writev([(rs, 0, b.register(poisoned(100)).descriptor(), 0, 10), (rs, 0, d_c, 0, 10)]),
               tether.InvalidArgument)
    # a's own region descriptor is also not b's
    immediate_error(peer_ab.write(rs, rs.descriptor()), tether.InvalidArgument)
    assert_poison(c_mem)


def _desc_variants(good: bytes):
    b = bytearray(good)
    out = {
        "empty": b"",
        "63-bytes": good[:63],
        "65-bytes": good + b"\0",
        "bad-magic": bytes(b"XXXX" + good[4:]),
        "version-2": bytes(good[:4] + b"\x02" + good[5:]),
        "kind-7": bytes(good[:5] + b"\x07" + good[6:]),
        "reserved-u16": bytes(good[:6] + b"\x01\x00" + good[8:]),
        "reserved-tail": bytes(good[:56] + b"\x01" + good[57:]),
        "range-overflow": set_u64(set_u64(good, DESC_OFFSET, (1 << 64) - 10), DESC_LENGTH, 100),
        "random": os.urandom(64),
    }
    del b
    return out


def test_malformed_descriptors_are_invalid(duo):
    a, b, peer = duo
    dst, good, rs = poisoned_target(a, b, 100, 17)
    for name, bad in _desc_variants(good).items():
        with pytest.raises(tether.InvalidArgument):
            tether.RemoteRegion(bad)
        _fails_with(peer.write, tether.InvalidArgument, rs, bad, length=10)
        _fails_with(peer.write, tether.InvalidArgument, rs, bad)
        _fails_with(peer.read, tether.InvalidArgument, a.register(poisoned(100)), bad, length=10)
        _fails_with(peer.writev, tether.InvalidArgument, [(rs, 0, bad, 0, 10)])
    with pytest.raises((TypeError, tether.InvalidArgument)):
        peer.write(rs, "not a descriptor", length=1)
    assert_poison(dst)


def test_failed_transfer_raises_on_every_wait(duo):
    a, b, peer = duo
    d = set_u64(b.register(poisoned(10)).descriptor(), DESC_KEY, 0)
    t = peer.write(a.register(rand_bytes(1, 10)), d)
    for _ in range(3):
        with pytest.raises(tether.AccessDenied):
            t.wait(T)
    assert t.status == "error" and "key" in t.error


def test_failed_write_does_not_notify(duo):
    """notify= announces data that is in place: a refused write must not deliver its notification."""
    a, b, peer = duo
    dst = poisoned(4096)
    rd = b.register(dst)
    good = rd.descriptor()
    rs = a.register(rand_bytes(22, 4096))
    bad_key = set_u64(good, DESC_KEY, get_u64(good, DESC_KEY) ^ 2)
    assert isinstance(wait_error(peer.write(rs, bad_key, notify=b"bad-key")), tether.AccessDenied)
    assert isinstance(wait_error(peer.writev([(rs, 0, good, 0, 10), (rs, 0, bad_key, 0, 10)], notify=b"partial")),
                      tether.AccessDenied)
    immediate_error(peer.write(rs, good, remote_offset=4000, length=100, notify=b"oob"), tether.OutOfRange)
    b2 = b.register(poisoned(10))
    d2 = b2.descriptor()
    b.deregister(b2)
    assert isinstance(wait_error(peer.write(rs, d2, length=10, notify=b"gone")), tether.RegionNotFound)
    peer.notify(b"marker").wait(T)  # ordered after everything above on the control stream
    notes = b.notifications(timeout=T)
    assert [n.data for n in notes] == [b"marker"], notes


# --------------------------------------------------------------------------- typed errors


@pytest.mark.parametrize("option, value", [("channels", "x"), ("chunk_bytes", -1), ("port", 1 << 20),
                                           ("peer_timeout", "soon"), ("connect_timeout", -2),
                                           ("disable_ipc", "maybe")])
def test_bad_option_values_are_invalid_argument(option, value):
    with pytest.raises(tether.InvalidArgument, match=option):
        tether.Endpoint(**{option: value})


def test_negative_lengths_and_offsets_are_invalid_argument(endpoints):
    a, b = endpoints(), endpoints()
    peer = a.connect(b.metadata(), timeout=5)
    d = b.register(poisoned(100)).descriptor()
    src = a.register(rand_bytes(5, 100))
    for kw in ("length", "local_offset", "remote_offset"):
        with pytest.raises(tether.InvalidArgument, match=kw):
            peer.write(src, d, **{kw: -1})
        with pytest.raises(tether.InvalidArgument, match=kw):
            peer.read(src, d, **{kw: -1})
    for kw in ("offset", "length", "tag"):
        with pytest.raises(tether.InvalidArgument, match=kw):
            peer.send(src, **{kw: -1})
    with pytest.raises(tether.InvalidArgument, match="length"):
        b.register(poisoned(100)).descriptor(0, -5)


def test_unknown_transport_name_fails_at_creation():
    with pytest.raises(tether.InvalidArgument, match="fabirc"):
        tether.Endpoint(transport="fabirc")


def test_requested_transport_that_cannot_work_fails_at_creation():
    with pytest.raises(tether.Unavailable, match="/nonexistent/libfabric.so.1|without libfabric"):
        tether.Endpoint(transport="fabric", fabric_library="/nonexistent/libfabric.so.1")
    with pytest.raises(tether.Unavailable, match="carrier-pigeon|without libfabric"):
        tether.Endpoint(transport="fabric", fabric_provider="carrier-pigeon")
    with pytest.raises(tether.Unavailable, match="ipc"):
        tether.Endpoint(transport="ipc", disable_ipc=True)
    # the environment override is checked the same way
    old = os.environ.get("TETHER_TRANSPORT")
    os.environ["TETHER_TRANSPORT"] = "fabirc"
    try:
        with pytest.raises(tether.InvalidArgument, match="TETHER_TRANSPORT|fabirc"):
            tether.Endpoint()
    finally:
        if old is None:
            del os.environ["TETHER_TRANSPORT"]
        else:
            os.environ["TETHER_TRANSPORT"] = old
