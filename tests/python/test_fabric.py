"""The fabric transport on real libfabric (Debian's tcp;ofi_rxm provider over loopback, and between
two network namespaces): two processes, every operation, random data into poisoned destinations,
every byte checked; bad descriptors, deregistered and read-only targets; peer death.

Staged: the path for memory the provider cannot register (GPU memory without FI_HMEM), run on CPU: the
test knob TETHER_FABRIC_STAGE_HOST=1 makes an endpoint treat its *host* regions that way. A staged
initiator packs its chunks into registered slots (and unpacks reads from them); a staged target's
descriptors say "two-sided", so initiators send write/read messages that the target validates against
its registry, copies through its bounce buffers and answers."""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tether
from tether_testutil.child import child_bytes
from tether_testutil.data import (
    MiB, assert_bytes_equal, assert_poison, poisoned, rand_bytes, wait_error, wait_until,
)
from tether_testutil.transports import transport_unusable
from tether_testutil.wire import DESC_KEY, descriptor_extension, get_u64, set_u64

T = 20
FAB = dict(transport="fabric", fabric_provider="tcp")
_WHY = transport_unusable("fabric", **FAB)
pytestmark = pytest.mark.skipif(_WHY != "", reason=f"fabric transport unavailable: {_WHY}")


def _fabric_ext(desc: bytes) -> tuple:
    """(offset of the fabric extension's bytes in desc, rails)."""
    at, ext = descriptor_extension(desc, b"fabric")
    return at, ext[0]


def _assert_written_at_4097(c, src, n):
    """The child's "dst" holds `src` (`n` bytes) at offset 4097, poison around it."""
    got = child_bytes(c, "dst")
    assert_poison(got[:4097], "before the written range")
    assert_bytes_equal(got[4097:4097 + n], src, "written range")
    assert_poison(got[4097 + n:], "after the written range")


def _read_checked(me, c, peer, n):
    """The child's random region "src" (`n` bytes, seed 2) read into a poisoned buffer at offset 50,
    every byte and the poison around them checked; returns its descriptor."""
    d_src = c.call("register", "src", n, fill=("seed", 2))
    back = poisoned(n + 100)
    peer.read(me.register(back), d_src, local_offset=50, length=n).wait(T)
    assert_poison(back[:50])
    assert_bytes_equal(back[50:50 + n], rand_bytes(2, n))
    assert_poison(back[50 + n:])
    return d_src


def _kill_target_mid_transfer(me, c, peer, size, count):
    """`count` reads and writes of `size` bytes in flight when the target process is killed: each but
    the first one's outcome ("ok" or its error's name), the seconds since the kill, and the source region
    and the target's descriptor."""
    desc = c.call("register", "big", size, fill=("seed", 5))
    sink = me.register(poisoned(size))
    src = me.register(rand_bytes(6, size))
    ts = [peer.read(sink, desc) if i % 2 else peer.write(src, desc) for i in range(count)]
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
    return outs, time.monotonic() - t_kill, src, desc


def _survivor_serves_a_newcomer(me, children, src, env=None):
    """After a peer died, `me` still serves fabric peers: a new child takes 1 MiB of `src` (seed 6)."""
    c2 = children("newcomer", env=env)
    p2 = me.connect(c2.call("endpoint", name="newcomer", **FAB)["metadata"], timeout=5)
    d2 = c2.call("register", "d", 1 * MiB)
    p2.write(src, d2, length=1 * MiB).wait(T)
    assert_bytes_equal(child_bytes(c2, "d"), rand_bytes(6, 1 * MiB))


def test_two_processes_every_operation(endpoints, children):
    me = endpoints(name="me", **FAB)
    c = children("other")
    info = c.call("endpoint", name="other", **FAB)
    peer = me.connect(info["metadata"], timeout=5)
    assert peer.transport == "fabric"
    n = 5 * MiB + 12345   # several chunks and a ragged tail
    # write: into a poisoned window of the child's region, at an odd offset
    d_dst = c.call("register", "dst", n + 8192)
    src = rand_bytes(1, n)
    rs = me.register(src)
    peer.write(rs, d_dst, remote_offset=4097, length=n).wait(T)
    _assert_written_at_4097(c, src, n)
    _read_checked(me, c, peer, n)  # the child's random region back into a poisoned buffer
    # vectored write: many small entries into disjoint ranges
    region = me.register(rand_bytes(3, 64 * 1024))
    c.call("fill", "dst", ("poison", 0xA5))
    entries = [(region, i * 1024, d_dst, i * 2048, 1000) for i in range(64)]
    peer.writev(entries).wait(T)
    got = child_bytes(c, "dst")
    whole = rand_bytes(3, 64 * 1024)
    for i in range(64):
        assert_bytes_equal(got[i * 2048:i * 2048 + 1000], whole[i * 1024:i * 1024 + 1000], f"entry {i}")
        assert_poison(got[i * 2048 + 1000:(i + 1) * 2048], f"gap after entry {i}")
    # send/recv both ways (two-sided: bounce buffers on the receiver)
    c.start("recv", "dst", length=3 * MiB, tag=7, accepted=True)
    sent = rand_bytes(4, 3 * MiB)
    peer.send(me.register(sent), tag=7).wait(T)
    status, nbytes, data = c.result()
    assert (status, nbytes) == ("ok", 3 * MiB)
    assert_bytes_equal(np.frombuffer(data, np.uint8), sent, "received message")
    c.call("register", "msg", 2 * MiB + 3, fill=("seed", 5))
    inbox = poisoned(3 * MiB)
    r = peer.recv(me.register(inbox), tag=9)
    assert c.call("send", "msg", tag=9, accepted=True) == ("ok", 2 * MiB + 3)
    r.wait(T)
    assert_bytes_equal(inbox[:2 * MiB + 3], rand_bytes(5, 2 * MiB + 3))
    assert_poison(inbox[2 * MiB + 3:])


@pytest.mark.parametrize("dc", [1, 0], ids=["delivery-complete", "flush-read"])
def test_notification_arrives_after_the_data(endpoints, children, dc):
    """The notification travels on the TCP control socket; the data on the fabric. Writes complete
    with FI_DELIVERY_COMPLETE (or, without it, after a one-byte read of their last byte), so the
    note (sent after the last completion) finds the data whole."""
    me = endpoints(name="me", fabric_delivery_complete=dc, **FAB)
    c = children("target")
    info = c.call("endpoint", name="target", **FAB)
    peer = me.connect(info["metadata"], timeout=5)
    n = 24 * MiB
    d = c.call("register", "dst", n)
    src = me.register(rand_bytes(11, n))
    for round_ in range(3):
        c.call("fill", "dst", ("poison", 0xA5))
        c.start("check_on_notify", "dst", 11, 0, n)
        peer.write(src, d, notify=b"done %d" % round_).wait(T)
        res = c.result()
        assert not res["timed_out"]
        assert res["mismatch"] is None, f"round {round_}: byte {res['mismatch']} not yet in place at the note"
        assert res["notes"][0][2] == b"done %d" % round_


def test_multi_rail_stripes_and_delivers(endpoints):
    """Two rails (lo and the host's other interface): lanes are (peer, rail), chunks go to both."""
    o = dict(FAB, fabric_domains="lo,eth0")
    a = endpoints(**o)
    b = endpoints(**o)
    if len(b.register(poisoned(8)).descriptor()) == len(a.register(poisoned(8)).descriptor()) and \
            _fabric_ext(a.register(poisoned(8)).descriptor())[1] < 2:
        pytest.skip("this machine offers one tcp domain only")
    peer = a.connect(b.metadata(), timeout=5)
    desc = b.register(dst := poisoned(40 * MiB)).descriptor()
    assert _fabric_ext(desc)[1] == 2
    src = rand_bytes(21, 40 * MiB)
    peer.write(a.register(src), desc).wait(T)
    assert_bytes_equal(dst, src)
    small = [peer.write(a.register(rand_bytes(30 + i, 4096)), desc, remote_offset=i * 4096, length=4096) for i in range(16)]
    for t in small:
        t.wait(T)
    for i in range(16):
        assert_bytes_equal(dst[i * 4096:(i + 1) * 4096], rand_bytes(30 + i, 4096))


def test_out_of_range_is_refused_before_any_byte(endpoints, children):
    me = endpoints(**FAB)
    c = children("target")
    peer = me.connect(c.call("endpoint", **FAB)["metadata"], timeout=5)
    c.call("register", "dst", 1 * MiB)
    part = c.call("descriptor", "dst", 4096, 8192)
    src = me.register(rand_bytes(1, 1 * MiB))
    for kw in (dict(remote_offset=8000, length=1000), dict(length=8193)):
        err = wait_error(peer.write(src, part, **kw), 5)
        assert isinstance(err, (tether.OutOfRange, tether.InvalidArgument)), err
    assert_poison(child_bytes(c, "dst"))
    peer.write(src, part, length=8192).wait(T)   # the peer is fine
    assert_bytes_equal(child_bytes(c, "dst", 4096, 8192), rand_bytes(1, 8192))


def test_wrong_fabric_key_fails_the_transfer_not_the_process(endpoints, children):
    me = endpoints(**FAB)
    c = children("target")
    peer = me.connect(c.call("endpoint", **FAB)["metadata"], timeout=5)
    d = c.call("register", "dst", 1 * MiB)
    at, rails = _fabric_ext(d)
    forged = bytearray(d)
    for r in range(rails):
        key = at + 1 + 16 * r
        forged[key:key + 8] = bytes(b ^ 0x5A for b in forged[key:key + 8])
    src = me.register(rand_bytes(2, 1 * MiB))
    t0 = time.monotonic()
    err = wait_error(peer.write(src, bytes(forged)), 10)
    assert isinstance(err, (tether.AccessDenied, tether.ConnectionLost)), err
    assert time.monotonic() - t0 < 10
    assert_poison(child_bytes(c, "dst"), "target after a forged key")
    # the tcp provider drops the connection on a remote access error; either way the endpoints
    # serve a fresh connection
    peer2 = me.connect(c.call("endpoint", name="again", **FAB)["metadata"], timeout=5)
    d2 = c.call("register", "dst2", 4096)
    peer2.write(src, d2, length=4096).wait(T)
    assert_bytes_equal(child_bytes(c, "dst2"), rand_bytes(2, 4096))


def test_deregistered_and_readonly_targets_fail_cleanly(endpoints, children):
    me = endpoints(**FAB)
    c = children("target")
    peer = me.connect(c.call("endpoint", **FAB)["metadata"], timeout=5)
    ro = c.call("register", "ro", 64 * 1024, fill=("seed", 3), readonly=True)
    src = me.register(rand_bytes(4, 64 * 1024))
    back = poisoned(64 * 1024)
    peer.read(me.register(back), ro).wait(T)           # reading a read-only region is fine
    assert_bytes_equal(back, rand_bytes(3, 64 * 1024))
    err = wait_error(peer.write(src, ro), 10)          # writing it is refused (core or NIC)
    assert isinstance(err, (tether.AccessDenied, tether.ConnectionLost, tether.InvalidArgument)), err
    assert_bytes_equal(child_bytes(c, "ro"), rand_bytes(3, 64 * 1024), "read-only region")
    # deregistered: a fresh link, then the target lets the region go before the write
    peer = me.connect(c.call("endpoint", name="t2", **FAB)["metadata"], timeout=5)
    d = c.call("register", "gone", 64 * 1024)
    c.call("deregister", "gone")
    t0 = time.monotonic()
    err = wait_error(peer.write(src, d), 10)
    assert isinstance(err, (tether.AccessDenied, tether.ConnectionLost, tether.RegionNotFound)), err
    assert time.monotonic() - t0 < 10
    assert_poison(child_bytes(c, "gone"), "deregistered region")


def test_peer_killed_mid_transfer_fails_in_bounded_time(endpoints, children):
    me = endpoints(name="survivor", **FAB)
    c = children("victim")
    peer = me.connect(c.call("endpoint", name="victim", **FAB)["metadata"], timeout=5)
    outs, elapsed, src, desc = _kill_target_mid_transfer(me, c, peer, 64 * MiB, 24)
    assert "Timeout" not in outs, f"transfers still running {elapsed:.1f} s after the peer died: {outs}"
    assert set(outs) <= {"ok", "ConnectionLost"}, outs
    assert "ConnectionLost" in outs
    assert wait_until(lambda: not peer.connected, 5)
    assert isinstance(wait_error(peer.write(src, desc), timeout=5), tether.ConnectionLost)
    _survivor_serves_a_newcomer(me, children, src)


# ---------------------------------------------------------------- two network namespaces

NS_PEER = Path(__file__).with_name("fabric_ns_peer.py")


def _can_netns():
    if os.geteuid() != 0 or not shutil.which("ip"):
        return "needs root and iproute2"
    r = subprocess.run(["ip", "netns", "add", "tfab_probe"], capture_output=True, text=True)
    if r.returncode:
        return "cannot create network namespaces: " + r.stderr.strip()
    subprocess.run(["ip", "netns", "del", "tfab_probe"], check=False)
    return ""


@pytest.fixture
def netns_pair():
    why = _can_netns()
    if why:
        pytest.skip(why)
    tag = f"{os.getpid() % 100000}"
    a, b = f"tfa{tag}", f"tfb{tag}"
    va, vb = f"tfva{tag}", f"tfvb{tag}"
    sh = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True)  # noqa: E731
    try:
        sh("ip", "netns", "add", a)
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        sh("ip", "link", "set", va, "netns", a)
        sh("ip", "link", "set", vb, "netns", b)
        sh("ip", "-n", a, "addr", "add", "10.77.0.1/24", "dev", va)
        sh("ip", "-n", b, "addr", "add", "10.77.0.2/24", "dev", vb)
        for ns, dev in ((a, va), (b, vb)):
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield (a, "10.77.0.1"), (b, "10.77.0.2")
    finally:
        subprocess.run(["ip", "netns", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", b], capture_output=True)


def test_between_two_network_namespaces(netns_pair):
    (ns_a, ip_a), (ns_b, ip_b) = netns_pair
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    target = subprocess.Popen(["ip", "netns", "exec", ns_a, sys.executable, str(NS_PEER), "target", ip_a],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = target.stdout.readline()
        assert line.startswith("ready "), line + target.stderr.read()
        metadata_hex = line.split()[1]
        out = subprocess.run(["ip", "netns", "exec", ns_b, sys.executable, str(NS_PEER), "initiator", ip_b, metadata_hex],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "initiator ok" in out.stdout, out.stdout
        verdict = target.stdout.readline()
        assert verdict.startswith("target ok"), verdict + target.stderr.read()
    finally:
        target.kill()
        target.wait(10)


def test_fabric_endpoints_close_without_leaking_threads_or_fds():
    from tether_testutil.proc import fd_count, thread_count

    def cycle():
        with tether.Endpoint(**FAB) as a, tether.Endpoint(**FAB) as b:
            p = a.connect(b.metadata(), timeout=5)
            d = b.register(dst := poisoned(1 * MiB)).descriptor()
            p.write(a.register(src := rand_bytes(9, 1 * MiB)), d).wait(T)
            assert_bytes_equal(dst, src)

    cycle()  # libfabric's one-time state (providers, their threads) first
    fds, threads = fd_count(), thread_count()
    for _ in range(5):
        cycle()
    assert wait_until(lambda: thread_count() <= threads, 5), (thread_count(), threads)
    assert wait_until(lambda: fd_count() <= fds + 2, 5), (fd_count(), fds)


def test_bench_cli_runs_over_fabric_and_checks_every_byte():
    r = subprocess.run([sys.executable, "-m", "tether", "bench", "--transport", "fabric", "--sizes", "64K,3M",
                        "--mode", "write,read,send", "--iters", "6", "--check", "--quiet"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, TETHER_FABRIC_PROVIDER="tcp"))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if "fabric" in line]
    assert len(rows) == 6 and all(" ok " in line for line in rows), r.stdout


def test_shm_provider_moves_every_byte(endpoints):
    """Same-host libfabric shm (its threads busy-poll: its CQ wait does not see peers)."""
    o = dict(transport="fabric", fabric_provider="shm")
    why = transport_unusable("fabric", fabric_provider="shm")
    if why:
        pytest.skip("shm provider unusable here: " + why)
    a = endpoints(**o)
    b = endpoints(**o)
    peer = a.connect(b.metadata(), timeout=5)
    n = 3 * MiB + 5
    desc = b.register(dst := poisoned(n + 10)).descriptor()
    peer.write(a.register(src := rand_bytes(40, n)), desc, length=n).wait(T)
    assert_bytes_equal(dst[:n], src)
    assert_poison(dst[n:])
    back = poisoned(n)
    peer.read(a.register(back), desc, length=n).wait(T)
    assert_bytes_equal(back, src)


def test_accepting_side_shows_the_peer_when_connect_returns(endpoints):
    """The listener attaches fabric peers before answering: once connect() returns, peers() there
    lists the peer (the bench's server relies on it)."""
    b = endpoints(**FAB)
    for _ in range(20):
        a = tether.Endpoint(**FAB)
        try:
            a.connect(b.metadata(), timeout=5)
            assert any(p.connected and p.transport == "fabric" for p in b.peers()), b.peers()
        finally:
            a.close()


def test_rails_show_their_location_and_rail_order():
    """Rail ranking as the doctor shows it: the tcp provider over loopback has one rail whose NIC has
    no PCI location (unknown); it is still every order's only rail, for host memory and any GPU."""
    from tether import _tether
    from tether import doctor

    c = _tether.Config.from_env()
    c.fabric_provider, c.fabric_domains = "tcp", "lo"
    r = _tether.fabric_rails(c, [("", 0), ("/sys/devices/pci0000:00/0000:00:01.0", -1)])
    assert r["why"] == "" and r["provider"] == "tcp"
    assert r["rails"] == [{"domain": "lo", "pci_path": None, "numa_node": -1}]
    assert r["host_order"] == ["lo"] and r["device_orders"] == [["lo"], ["lo"]]
    c.fabric_provider = "carrier-pigeon"
    assert "carrier-pigeon" in _tether.fabric_rails(c, [])["why"]
    env = dict(os.environ, TETHER_FABRIC_PROVIDER="tcp", TETHER_FABRIC_DOMAINS="lo")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        rails = doctor.fabric_rails([{"index": 0, "pci_path": None, "numa_node": -1}])
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert rails["rails"][0]["domain"] == "lo" and rails["gpu_orders"] == {"0": ["lo"]}


# ---------------------------------------------------------------- staged: memory the provider cannot register

STAGE = {"TETHER_FABRIC_STAGE_HOST": "1"}


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
    assert descriptor_extension(ep.register(poisoned(4096)).descriptor(), b"fabric")[1] == b"\x00\x01"


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
    _assert_written_at_4097(c, src, n)
    d_src = _read_checked(me, c, peer, n)
    # writev: scattered blocks of odd sizes, one spanning chunks
    c.call("fill", "dst", ("poison", 0xA5))
    whole = rand_bytes(3, 4 * MiB)
    region = me.register(whole)
    blocks = [(i * 40960 + 7 * i, i * 65536 + 3, 1000 + 97 * i) for i in range(48)] + [(2 * MiB, 3 * MiB + 1, 1536 * 1024)]
    peer.writev([(region, lo, d_dst, ro, ln) for lo, ro, ln in blocks]).wait(T)
    got = child_bytes(c, "dst")
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
    assert_poison(child_bytes(c, "rbuf", 0, 64))
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
    assert_poison(child_bytes(c, "dst"), "target after a bad key")
    assert_poison(sink, "reader after a bad key")
    ro = c.call("register", "ro", 64 * 1024, fill=("seed", 3), readonly=True)
    err = wait_error(peer.write(src, ro, length=64 * 1024), 10)
    assert isinstance(err, (tether.AccessDenied, tether.InvalidArgument)), err
    assert_bytes_equal(child_bytes(c, "ro"), rand_bytes(3, 64 * 1024), "read-only region")
    peer.read(rsink, ro, length=64 * 1024).wait(T)   # reading it is fine
    assert_bytes_equal(sink[:64 * 1024], rand_bytes(3, 64 * 1024))
    g = c.call("register", "gone", 64 * 1024)
    c.call("deregister", "gone")
    err = wait_error(peer.write(src, g, length=64 * 1024), 10)
    assert isinstance(err, (tether.RegionNotFound, tether.AccessDenied)), err
    assert_poison(child_bytes(c, "gone"), "deregistered region")
    # the same peer still works
    assert peer.connected
    peer.write(src, d).wait(T)
    assert_bytes_equal(child_bytes(c, "dst"), rand_bytes(4, 1 * MiB))


@pytest.mark.parametrize("staged", ["both", "target"])
def test_staged_peer_killed_mid_transfer_fails_in_bounded_time(endpoints, children, monkeypatch, staged):
    me, c, peer = _pair(endpoints, children, monkeypatch, staged, name="victim")
    outs, _, src, _ = _kill_target_mid_transfer(me, c, peer, 32 * MiB, 16)
    assert "Timeout" not in outs, f"transfers still running after the peer died: {outs}"
    assert set(outs) <= {"ok", "ConnectionLost"}, outs
    assert wait_until(lambda: not peer.connected, 5)
    _survivor_serves_a_newcomer(me, children, src, STAGE if staged == "both" else {"TETHER_FABRIC_STAGE_HOST": "0"})


def test_many_small_transfers_in_flight(endpoints, children, monkeypatch):
    """More chunks than staging slots and bounce buffers at once: slots and buffers recycle."""
    me, c, peer = _pair(endpoints, children, monkeypatch, "both")
    d = c.call("register", "dst", 256 * 4096)
    data = rand_bytes(12, 256 * 4096)
    src = me.register(data)
    ts = [peer.write(src, d, local_offset=i * 4096, remote_offset=i * 4096, length=4096) for i in range(256)]
    for t in ts:
        t.wait(T)
    assert_bytes_equal(child_bytes(c, "dst"), data)
    back = poisoned(256 * 4096)
    rb = me.register(back)
    ts = [peer.read(rb, d, local_offset=i * 4096, remote_offset=i * 4096, length=4096) for i in range(256)]
    for t in ts:
        t.wait(T)
    assert_bytes_equal(back, data)
