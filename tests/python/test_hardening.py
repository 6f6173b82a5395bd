"""Hardening (docs/RELIABILITY.md): what a hostile or broken peer that can reach a listening endpoint must not
be able to do — spin it or starve it of file descriptors, grow it without bound with notifications,
make it open ipc lanes by claiming to be on its host, or block its deregistration by stopping — and
the typed errors at the API's edge. Each test drives the attack the way it was found: real sockets,
real processes, a lowered open-files limit in a child, and measures the target from /proc (CPU
seconds, descriptors, resident memory).
"""
from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest

import tether
from tether_testutil.data import MiB, assert_bytes_equal, outcome, poisoned, rand_bytes, wait_until
from tether_testutil.proc import cpu_seconds, fd_count, rss_bytes
from tether_testutil.sockets import raw_connect, read_server_hello, recv_exact
from tether_testutil.wire import (
    CLIENT_HELLO_SIZE, HELLO_BAD_REQUEST, HELLO_NOT_SAME_HOST, SERVER_DONE_SIZE, client_hello, client_proof,
    host_id_of, parse_client_hello, server_hello,
)

T = 20.0


def _timed_write(peer, src, desc) -> float:
    t0 = time.monotonic()
    peer.write(src, desc).wait(T)
    return time.monotonic() - t0


def _cpu_over(pid: int, seconds: float) -> float:
    """CPU seconds process `pid` used over the next `seconds` of wall time."""
    c0 = cpu_seconds(pid)
    time.sleep(seconds)
    return cpu_seconds(pid) - c0


def _open_idle(address: str, n: int) -> list:
    """`n` TCP connections to `address` that never send a byte (the kernel completes them from the
    listen backlog whether or not the endpoint accepts them)."""
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(5)
        host, port = address.rsplit(":", 1)
        s.connect((host, int(port)))
        out.append(s)
    return out


# --------------------------------------------------------------------------- 1. file descriptors


@pytest.mark.budget(90)
def test_fd_exhaustion_does_not_spin_and_recovers(endpoints, children, tmp_path):
    """A target limited to 128 open files. (a) The application has used up every descriptor and 60
    connections wait in the backlog: accept() fails with EMFILE. (b) Descriptors free again and 300
    idle connections are held open against the listener. In both the control thread must not spin
    (it burned a full core: 4.4 CPU-s in 6 s), a legitimate write by an existing peer stays fast, the
    exhaustion is logged once, and once the idle connections go a new peer connects."""
    c = children("fd-starved")
    c.call("setrlimit_nofile", 128)
    log = tmp_path / "stderr.txt"
    c.call("stderr_to", str(log))
    info = c.call("endpoint", name="fd-starved", transport="tcp", channels=2, handshake_timeout=5.0)
    desc = c.call("register", "dst", 1 * MiB)
    me = endpoints(name="legit", transport="tcp", channels=2)
    peer = me.connect(info["metadata"], timeout=5)
    src = me.register(rand_bytes(1, 1 * MiB))
    base = min(_timed_write(peer, src, desc) for _ in range(3))

    # (a) the application holds every descriptor; connections queue in the backlog
    assert c.call("hold_fds") > 0
    socks = _open_idle(info["address"], 60)
    time.sleep(0.3)
    cpu_a = _cpu_over(c.pid, 2.0)
    write_a = _timed_write(peer, src, desc)
    fds_a = fd_count(c.pid)
    c.call("release_fds")

    # (b) descriptors are back; 300 idle connections against 128
    socks += _open_idle(info["address"], 300)
    time.sleep(0.3)
    cpu_b = _cpu_over(c.pid, 2.0)
    write_b = _timed_write(peer, src, desc)
    fds_b = fd_count(c.pid)
    print(f"\nfd exhaustion: legit 1 MiB write {base * 1e3:.1f} ms alone, {write_a * 1e3:.1f} ms with every fd "
          f"held (+60 queued), {write_b * 1e3:.1f} ms with 360 idle connections; target CPU {cpu_a:.2f} s and "
          f"{cpu_b:.2f} s per 2 s; target fds {fds_a} / {fds_b} (limit 128)")
    assert cpu_a < 0.5, f"the target used {cpu_a:.2f} CPU-s in 2 s with accept() failing (spinning)"
    assert cpu_b < 0.5, f"the target used {cpu_b:.2f} CPU-s in 2 s holding 360 idle connections (spinning)"
    assert write_a < 1.0 and write_b < 1.0, (base, write_a, write_b)
    assert peer.connected

    # recovery: the idle connections go; a new peer connects and writes
    for s in socks:
        s.close()
    other = endpoints(name="newcomer", transport="tcp", channels=2)
    t0 = time.monotonic()
    p2 = other.connect(info["metadata"], timeout=10)
    took = time.monotonic() - t0
    mine = other.register(rand_bytes(2, 1 * MiB))
    p2.write(mine, desc).wait(T)
    assert_bytes_equal(np.frombuffer(c.call("get", "dst"), np.uint8), rand_bytes(2, 1 * MiB))
    assert took < 8.0, f"a new peer needed {took:.1f} s to connect after the attack ended"
    lines = [ln for ln in log.read_text().splitlines() if "out of file descriptors" in ln]
    assert len(lines) == 1, f"fd exhaustion must be logged once per episode, got {lines}"


# --------------------------------------------------------------------------- 2. notifications


def _notify_all(peer, n, size):
    ts = [peer.notify(b"n" * size) for _ in range(n)]
    return [outcome(t, timeout=T) for t in ts]


@pytest.mark.budget(90)
def test_notifications_are_bounded_and_memory_returns(endpoints, children):
    """A token-less peer sends 150 notifications of ~1 MiB the application has not read. The target
    keeps at most its per-peer queue (16 MiB); every notification is delivered or refused with a
    typed error (none lost silently); memory returns once they are read and once the peer goes."""
    c = children("note-target")
    info = c.call("endpoint", name="note-target")
    me = endpoints(name="flooder")
    peer = me.connect(info["metadata"], timeout=5)
    c.call("drain_notifications")
    rss0 = rss_bytes(c.pid)
    size = MiB - 64
    outs = _notify_all(peer, 150, size)
    grown = rss_bytes(c.pid) - rss0
    ok = outs.count("ok")
    refused = [o for o in outs if o != "ok"]
    assert set(refused) <= {"ResourceExhausted"}, set(outs)
    assert 0 < ok * size <= 16 * MiB, ok
    assert peer.connected, peer.error
    got = c.call("drain_notifications")
    assert len(got) == ok and all(n == size for n, _ in got), (len(got), ok)
    wait_until(lambda: rss_bytes(c.pid) - rss0 < 12 * MiB, 2)  # the endpoint's next tick trims the heap
    drained = rss_bytes(c.pid) - rss0
    # room again once read
    assert _notify_all(peer, 4, size) == ["ok"] * 4
    assert len(c.call("drain_notifications")) == 4
    me.close()
    assert wait_until(lambda: c.call("peers") == [] or not c.call("peers")[0][2], 5)
    gone = rss_bytes(c.pid) - rss0
    print(f"\nnotifications: 150 x 1 MiB sent, {ok} queued, {len(refused)} refused; target RSS "
          f"+{grown / MiB:.0f} MiB queued, +{drained / MiB:.0f} MiB after reading, +{gone / MiB:.0f} MiB after the peer left")
    assert grown < 48 * MiB, f"the target grew by {grown / MiB:.0f} MiB"
    assert drained < 12 * MiB, f"{drained / MiB:.0f} MiB stayed after the notifications were read"
    assert gone < 12 * MiB, f"{gone / MiB:.0f} MiB stayed after the peer left"


def test_notification_size_limit_is_checked_before_sending(endpoints):
    """The target's limit travels in the handshake: a larger notification fails locally with
    InvalidArgument naming the limit, before a byte is sent; the limit is an option."""
    b = endpoints(name="small-notes", notify_max_bytes=1000)
    a = endpoints(name="sender")
    peer = a.connect(b.metadata(), timeout=5)
    with pytest.raises(tether.InvalidArgument, match="1000"):
        peer.notify(b"x" * 1001).wait(T)
    region = b.register(poisoned(4096))
    with pytest.raises(tether.InvalidArgument, match="1000"):
        peer.write(a.register(rand_bytes(3, 4096)), region.descriptor(), notify=b"y" * 1001).wait(T)
    peer.notify(b"z" * 1000).wait(T)
    assert [n.data for n in b.notifications(timeout=T)] == [b"z" * 1000]
    with pytest.raises(tether.InvalidArgument, match="notify_max_bytes"):
        tether.Endpoint(notify_max_bytes=(1 << 20) + 1)


def test_endpoint_queue_limit_spans_peers(endpoints):
    """The per-endpoint limit bounds what all peers together may queue."""
    b = endpoints(name="target", notify_queue_peer_bytes=1 * MiB, notify_queue_bytes=2 * MiB)
    senders = [endpoints(name=f"s{i}") for i in range(3)]
    peers = [s.connect(b.metadata(), timeout=5) for s in senders]
    outs = [_notify_all(p, 4, 256 << 10) for p in peers]
    total_ok = sum(o.count("ok") for o in outs)
    assert all(o.count("ok") <= 4 for o in outs)
    assert total_ok * (256 << 10) <= 2 * MiB, outs
    assert set(x for o in outs for x in o) <= {"ok", "ResourceExhausted"}, outs
    assert len(b.notifications()) == total_ok


# --------------------------------------------------------------------------- 3. same host


def _forge_ipc(address: str, host: bytes, strip: bool):
    """One forged same-host handshake: a TCP client echoes the listener's host identity, picks ipc
    and answers with the listener's own ipc offer (`strip`: cut to version, session and challenge,
    the shape of a connector's offer). Returns (the connection, the listener's answer)."""
    s = raw_connect(address)
    s.sendall(client_hello(host_id=host, transports=2))  # 2: ipc
    h = read_server_hello(s)
    if h["status"] != 0 or "ipc" not in h["offers"]:
        return s, ("hello", h["status"])
    offer = h["offers"]["ipc"][:18] if strip else h["offers"]["ipc"]
    s.sendall(client_proof(b"ipc", lanes=4, offer=offer))
    done = recv_exact(s, SERVER_DONE_SIZE)
    return s, done[0] if done else "closed"


@pytest.mark.budget(60)
def test_remote_connector_cannot_claim_the_host_for_ipc(endpoints, children):
    """A TCP connector echoes the listener's host identity, picks ipc and hands back the listener's
    own ipc offer (before the fix the listener connected 4 lanes to its own socket per handshake:
    200 grew it from 25 to 632 fds), or that offer cut to a connector's shape. Done 200 times, holding
    the control connections: the listener refuses every one, with "not on this host" where only the
    proof is missing, opens no descriptors for them, and a legitimate same-host peer's 1 MiB write
    stays fast; afterwards a new same-host peer still gets ipc."""
    c = children("ipc-target")
    info = c.call("endpoint", name="ipc-target")
    host = host_id_of(info["metadata"])
    desc = c.call("register", "d", 1 * MiB)
    me = endpoints(name="neighbour")
    peer = me.connect(info["metadata"], timeout=5)
    assert peer.transport == "ipc"
    src = me.register(rand_bytes(4, 1 * MiB))
    base = min(_timed_write(peer, src, desc) for _ in range(3))
    time.sleep(0.2)
    fds0, rss0 = fd_count(c.pid), rss_bytes(c.pid)
    held, answers = [], {False: set(), True: set()}
    try:
        for i in range(200):
            s, answer = _forge_ipc(info["address"], host, strip=bool(i % 2))
            held.append(s)
            answers[bool(i % 2)].add(answer)
        during = _timed_write(peer, src, desc)
        time.sleep(0.3)
        fds1, rss1 = fd_count(c.pid), rss_bytes(c.pid)
        peers = c.call("peers")
    finally:
        for s in held:
            s.close()
    print(f"\nforged same-host ipc handshakes: 200 held; target fds {fds0} -> {fds1}, RSS {rss0 / MiB:.0f} -> "
          f"{rss1 / MiB:.0f} MiB; legit 1 MiB ipc write {base * 1e3:.2f} ms before, {during * 1e3:.2f} ms with them held; "
          f"answers: own offer {answers[False]}, cut offer {answers[True]}")
    assert answers[False] == {HELLO_BAD_REQUEST}, answers   # a listener's offer is no connector's offer
    assert answers[True] == {HELLO_NOT_SAME_HOST}, answers  # well formed, but no lanes reached this host
    assert fds1 - fds0 <= 5, f"the target holds {fds1 - fds0} more descriptors after 200 forged ipc handshakes"
    assert rss1 - rss0 < 16 * MiB, (rss0, rss1)
    assert [p[1] for p in peers] == ["neighbour"], peers
    assert during < 1.0, (base, during)
    assert wait_until(lambda: fd_count(c.pid) <= fds0 + 2, 5), (fd_count(c.pid), fds0)
    other = endpoints(name="newcomer")
    p2 = other.connect(info["metadata"], timeout=5)
    assert p2.transport == "ipc"
    src2 = rand_bytes(5, 1 * MiB)
    p2.write(other.register(src2), desc).wait(T)
    assert_bytes_equal(np.frombuffer(c.call("get", "d"), np.uint8), src2)


def test_listener_offer_naming_the_connector_itself_is_refused(endpoints):
    """The other way round: a hostile listener echoes the connector's host identity and offers ipc
    naming the CONNECTOR's own ipc socket (or another service's socket). The connector must not
    open lanes there (into itself they would sit parked); it refuses with a clear error, holding
    nothing afterwards. Connecting to its own address (which offers the same socket, with its own
    challenge) keeps working."""
    me = endpoints(name="connector")
    s = raw_connect(me.address)
    s.sendall(client_hello(host_id=host_id_of(me.metadata())))
    real = read_server_hello(s)["offers"]["ipc"]
    own, version = real[18:], struct.unpack_from("<H", real)[0]  # the ipc version this build speaks
    s.close()
    cases = [(own, "own ipc socket"), (own, "own ipc socket"), (b"some-other-service", "malformed ipc offer")]
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(4)
    seen = []

    def fake_listener():
        for name, _ in cases:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            with conn:
                h = parse_client_hello(recv_exact(conn, CLIENT_HELLO_SIZE))
                offer = struct.pack("<HQQ", version, h["session"], int.from_bytes(os.urandom(8), "little")) + name
                conn.sendall(server_hello(h["host_id"], {"ipc": offer}))
                seen.append(recv_exact(conn, 56, timeout=2))  # a proof would mean it went ahead

    t = threading.Thread(target=fake_listener, daemon=True)
    t.start()
    fds0 = fd_count()
    try:
        for _, match in cases:
            with pytest.raises(tether.ProtocolError, match=match):
                me.connect("127.0.0.1:%d" % lsock.getsockname()[1], timeout=3)
    finally:
        lsock.close()
        t.join(5)
    assert seen == [b""] * len(cases), "the connector answered a handshake whose offer names a socket not its peer's"
    time.sleep(0.3)  # a tick: anything parked would still be there
    assert fd_count() <= fds0, (fds0, fd_count())
    assert me.connect(me.metadata(), timeout=5).transport == "ipc"


# --------------------------------------------------------------------------- 5. typed errors


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


# --------------------------------------------------------------------------- 6. stopped reader


@pytest.mark.budget(60)
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_stopped_reader_does_not_block_deregister(endpoints, children, transport):
    """A peer streaming reads out of our region is SIGSTOPped. deregister() must not wait for it
    (ipc waited for the peer timeout: 2.8 s; tcp 7 ms); over ipc the stopped reader is cut off, so a
    read it resumes later can never complete with the memory's later contents."""
    me = endpoints(name="target", peer_timeout=3.0, heartbeat=0.2)
    mine = rand_bytes(6, 64 * MiB)
    rm = me.register(mine)
    c = children("stopped-reader")
    c.call("endpoint", name="stopped-reader", transport=transport, peer_timeout=3.0, heartbeat=0.2)
    c.call("connect", me.metadata())
    c.call("register", "dst", 64 * MiB)
    assert c.call("start_stream", "read", "dst", rm.descriptor(), 64 * MiB) is True
    assert wait_until(lambda: len(me.peers()) == 1, 5)
    accepted = me.peers()[0]
    assert accepted.transport == transport
    time.sleep(0.2)
    c.kill(signal.SIGSTOP)  # returns once every thread is stopped
    try:
        time.sleep(0.05)
        t0 = time.monotonic()
        done = threading.Event()
        threading.Thread(target=lambda: (me.deregister(rm), done.set()), daemon=True).start()
        assert done.wait(10), "deregister() hung on a stopped reader"
        took = time.monotonic() - t0
        mine[:] = 0  # the application reuses the memory at once
    finally:
        os.kill(c.pid, signal.SIGCONT)
    print(f"\n{transport}: deregister with a stopped reader took {took * 1e3:.0f} ms")
    assert took < 1.0, f"deregister waited {took:.2f} s for a stopped reader ({transport})"
    if transport == "ipc":
        errors, _ = c.call("stream_errors") if wait_until(lambda: c.call("stream_errors")[0], 5) else ([], 0)
        assert errors, "the stopped reader's reads went on after its region was deregistered"
