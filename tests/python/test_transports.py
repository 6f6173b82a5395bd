"""Transport selection at connect, and descriptor extensions (the plumbing every transport uses)."""
import struct

import pytest

import tether
from tether_testutil.data import assert_bytes_equal, poisoned, rand_bytes, wait_until
from tether_testutil.wire import DESC_SIZE

T = 10


def test_every_transport_reports_whether_it_is_usable():
    with tether.Endpoint() as ep:
        ts = ep.transports()
        assert ts["tcp"] == ""
        for name, why in ts.items():
            assert isinstance(why, str), name


def test_auto_picks_a_transport_both_sides_offer_and_data_flows():
    with tether.Endpoint() as a, tether.Endpoint() as b:
        peer = a.connect(b.metadata(), timeout=5)
        assert peer.transport in a.transports() and a.transports()[peer.transport] == ""
        assert wait_until(lambda: len(b.peers()) == 1, 5)
        assert b.peers()[0].transport == peer.transport
        src = rand_bytes(1, 3 << 20)
        dst = poisoned(3 << 20)
        peer.write(a.register(src), b.register(dst).descriptor()).wait(T)
        assert_bytes_equal(dst, src)


def test_forced_tcp_is_used():
    with tether.Endpoint(transport="tcp") as a, tether.Endpoint() as b:
        assert a.connect(b.address, timeout=5).transport == "tcp"


@pytest.mark.parametrize("want", ["no-such-transport", "fabric", "netplugin"])
def test_unusable_transport_request_fails_at_creation(want):
    """A transport named by transport= must exist and work here: an unknown name is InvalidArgument
    and an unusable one Unavailable with its reason, when the endpoint is made, not at the first connect."""
    with tether.Endpoint() as probe:
        why = probe.transports().get(want)
    if why == "":
        pytest.skip(f"{want} is usable on this machine")
    exc, match = (tether.InvalidArgument, want) if why is None else (tether.Unavailable, f"transport {want} cannot")
    with pytest.raises(exc, match=match):
        tether.Endpoint(transport=want)


def test_transport_the_peer_does_not_offer_fails_connect_clearly():
    with tether.Endpoint(transport="ipc") as a, tether.Endpoint(disable_ipc=True) as b:
        with pytest.raises(tether.Unavailable, match="wanted ipc; peer offers"):
            a.connect(b.metadata(), timeout=5)
        assert a.peers() == [] and b.peers() == []
    with tether.Endpoint() as a, tether.Endpoint() as b:  # the endpoint still connects normally afterwards
        a.connect(b.metadata(), timeout=5)


def _ext(entries):
    out = b""
    for name, data in entries:
        out += bytes([len(name)]) + name + struct.pack("<I", len(data)) + data
    return out


def test_descriptor_extensions_parse_and_malformed_ones_are_refused():
    with tether.Endpoint() as ep:
        d = ep.register(poisoned(100)).descriptor()
        # only fabric (where usable) registers anything here; keep the fixed part
        assert len(d) == DESC_SIZE or ep.transports().get("fabric") == ""
        d = d[:DESC_SIZE]
        ok = d + _ext([(b"fabric", b"\x01" * 24), (b"ipc", b"")])
        r = tether.RemoteRegion(ok)
        assert bytes(r) == ok
        for bad in (d + b"\x05ab", d + _ext([(b"x", b"123")])[:-1], d + b"\x00"):
            with pytest.raises(tether.InvalidArgument, match="extensions|descriptor"):
                tether.RemoteRegion(bad)



def test_bad_unpack_mode_is_refused_and_gpu_memory_needs_cuda():
    with pytest.raises(tether.InvalidArgument, match="kernel, d2d or host"):
        tether.Endpoint(unpack="bogus")
    cuda, why = tether._tether.gpu_status()[:2]
    if cuda:
        pytest.skip("CUDA is present: tests/python/test_gpu.py covers GPU registration")
    with tether.Endpoint() as ep:
        buf = poisoned(4096)
        with pytest.raises(tether.Unavailable, match="GPU memory needs CUDA"):
            ep.register((buf.ctypes.data, buf.nbytes), device=0)
        assert ep.register(buf).kind == "host"
def test_missing_libfabric_makes_fabric_unavailable_and_nothing_else():
    with tether.Endpoint(fabric_library="/nonexistent/libfabric.so.1") as a, tether.Endpoint() as b:
        why = a.transports()["fabric"]
        assert why, "fabric usable without its library"
        assert "/nonexistent/libfabric.so.1" in why or "without libfabric headers" in why, why
        peer = a.connect(b.metadata(), timeout=5)
        assert peer.transport != "fabric"
        src, dst = rand_bytes(2, 1 << 20), poisoned(1 << 20)
        peer.write(a.register(src), b.register(dst).descriptor()).wait(T)
        assert_bytes_equal(dst, src)
    # asked for by name, it fails at creation with the reason, not at the first connect
    with pytest.raises(tether.Unavailable, match="/nonexistent/libfabric.so.1|without libfabric headers"):
        tether.Endpoint(fabric_library="/nonexistent/libfabric.so.1", transport="fabric")


def test_unknown_fabric_provider_is_explained():
    with tether.Endpoint(fabric_provider="carrier-pigeon") as ep:
        why = ep.transports()["fabric"]
        assert "carrier-pigeon" in why or "without libfabric headers" in why, why
