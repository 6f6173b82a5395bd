"""GPU memory over the fabric transport: two processes, transport="fabric". Where the provider
offers FI_HMEM, GPU regions are registered directly; without it (the device machine's distro
libfabric, tcp;ofi_rxm) a GPU source or destination on the initiator goes through the lane's pinned
staging slots, and a GPU target is reached by two-sided messages its CPU serves (copy through the
bounce buffers, then the answer). Pairings GPU0->GPU1, host->GPU1, GPU0->host; every operation,
random data, poisoned destinations, every byte. Needs CUDA and torch with a GPU (with one, GPU0->GPU1
runs GPU0->GPU0 between the two processes: GpuEnv.pairs) and a usable fabric transport; skipped
otherwise, saying why."""
import numpy as np
import pytest

import tether
from tether_testutil.data import MiB, POISON, assert_bytes_equal, assert_poison, rand_bytes
from tether_testutil.child import child_bytes
from tether_testutil.gpu import gpu_env, linked, read_checked, send_checked
from tether_testutil.transports import transport_unusable

GPU = gpu_env("fabric GPU tests")
_dev = GPU.device

FAB = dict(transport="fabric")


_FWHY = transport_unusable("fabric", **FAB)
if _FWHY:
    pytest.skip(f"fabric transport unavailable: {_FWHY}", allow_module_level=True)

T = 60
PAIRS = GPU.pairs([("gpu0", "gpu1"), ("host", "gpu1"), ("gpu0", "host")])
IDS = ["-".join(p) for p in PAIRS]
SIZE = 9 * MiB + 12345  # several chunks and a ragged tail


@pytest.fixture
def pair(children):
    yield from linked(children("fabric-gpu-peer"), lambda: GPU.local(name="fabric-gpu-me", **FAB), "fabric",
                      name="fabric-gpu-peer", **FAB)


@pytest.mark.parametrize("lk,rk", PAIRS, ids=IDS)
def test_write_and_notify(pair, lk, rk):
    local, peer, c = pair
    desc = c.call("register", "dst", SIZE + 10, device=_dev(rk))
    src = local.region("src", lk, SIZE, seed=41)
    for round_ in range(2):
        c.call("fill", "dst", ("poison", POISON))
        c.start("check_on_notify", "dst", 41, 5, SIZE)
        peer.write(src, desc, remote_offset=5, length=SIZE, notify=b"done%d" % round_).wait(T)
        r = c.result(T)
        assert not r["timed_out"] and r["mismatch"] is None, r
        assert r["notes"][0][2] == b"done%d" % round_
    got = child_bytes(c, "dst")
    assert_bytes_equal(got[5:5 + SIZE], rand_bytes(41, SIZE))
    assert_poison(got[:5])
    assert_poison(got[5 + SIZE:])


@pytest.mark.parametrize("lk,rk", PAIRS, ids=IDS)
def test_read(pair, lk, rk):
    local, peer, c = pair
    desc = c.call("register", "src", SIZE, fill=("seed", 42), device=_dev(rk))
    read_checked(local, peer, lk, desc, SIZE, 42, T)
    c.call("deregister", "src", timeout=10)  # its pins were let go: does not hang


@pytest.mark.parametrize("lk,rk", PAIRS, ids=IDS)
def test_vectored_write_and_read(pair, lk, rk):
    """Scattered blocks of odd sizes both ways (one spans chunks)."""
    local, peer, c = pair
    n = 6 * MiB
    # disjoint destinations: 48 small blocks below 3.1 MB, one of 1.5 MiB spanning chunks above
    blocks = [(i * 40960 + 7 * i, i * 65536 + 3, 1000 + 97 * i) for i in range(48)] + [(2 * MiB, 3 * MiB + 524283, 1536 * 1024)]
    desc = c.call("register", "dst", n + 4096, device=_dev(rk))
    src = local.region("src", lk, n, seed=43)
    peer.writev([(src, lo, desc, ro, ln) for lo, ro, ln in blocks]).wait(T)
    want = rand_bytes(43, n)
    expect = np.full(n + 4096, POISON, np.uint8)
    for lo, ro, ln in blocks:
        expect[ro:ro + ln] = want[lo:lo + ln]
    assert_bytes_equal(child_bytes(c, "dst"), expect, "after writev (blocks written, the rest still poison)")
    back = local.region("back", lk, n + 4096)
    peer.readv([(back, ro, desc, ro, ln) for _, ro, ln in blocks]).wait(T)
    assert_bytes_equal(local.get("back"), expect, "after readv (blocks read, the rest still poison)")


@pytest.mark.parametrize("lk,rk", PAIRS, ids=IDS)
def test_send_recv(pair, lk, rk):
    local, peer, c = pair
    c.call("register", "rbuf", SIZE + 7, device=_dev(rk))
    send_checked(local, peer, c, lk, SIZE, T)
    # and back: the child sends from its memory into ours
    c.call("register", "sbuf", SIZE, fill=("seed", 45), device=_dev(rk))
    mine = local.region("mine", lk, SIZE + 3)
    t = peer.recv(mine, length=SIZE, tag=6)
    assert c.call("send", "sbuf", tag=6, accepted=True)[0] == "ok"
    t.wait(T)
    got = local.get("mine")
    assert_bytes_equal(got[:SIZE], rand_bytes(45, SIZE))
    assert_poison(got[SIZE:])


def test_child_writes_into_our_gpu(pair):
    """The other direction: the child initiates; our GPU region is the target."""
    local, peer, c = pair
    d = GPU.other
    ours = local.region("ours", GPU.kind("gpu1"), SIZE)
    desc = ours.descriptor()
    c.call("register", "src", SIZE, fill=("seed", 46), device=_dev("gpu0"))
    assert c.call("write", "src", desc, accepted=True)[0] == "ok"
    assert_bytes_equal(local.get("ours"), rand_bytes(46, SIZE))
    c.call("register", "back", SIZE, device=d)
    assert c.call("read", "back", desc, accepted=True)[0] == "ok"
    assert_bytes_equal(child_bytes(c, "back"), rand_bytes(46, SIZE))


def test_refusals_on_a_gpu_target(pair):
    """A bad key and a deregistered GPU region are refused; nothing lands; the peer keeps working."""
    from tether_testutil.wire import DESC_KEY, get_u64, set_u64
    local, peer, c = pair
    d = c.call("register", "dst", 1 * MiB, device=GPU.other)
    src = local.region("src", "gpu0", 1 * MiB, seed=47)
    bad = set_u64(d, DESC_KEY, get_u64(d, DESC_KEY) ^ 1)
    with pytest.raises((tether.AccessDenied, tether.ConnectionLost)):
        peer.write(src, bad).wait(T)
    assert_poison(child_bytes(c, "dst"), "GPU target after a bad key")
    if not peer.connected:  # an HMEM provider's NIC may drop the link on a refused key
        return
    g = c.call("register", "gone", 1 * MiB, device=GPU.other)
    c.call("deregister", "gone")
    with pytest.raises((tether.RegionNotFound, tether.AccessDenied, tether.ConnectionLost)):
        peer.write(src, g).wait(T)
    if peer.connected:
        peer.write(src, d).wait(T)
        assert_bytes_equal(child_bytes(c, "dst"), rand_bytes(47, 1 * MiB))
