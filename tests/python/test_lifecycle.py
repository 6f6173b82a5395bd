"""Lifecycle: connect time, closing endpoints and peers in every order with transfers in flight,
resource leaks (fds, threads), and process exit without close().
"""
from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import tether
from tether_testutil.data import (
    MiB, POISON, assert_bytes_equal, outcome, poisoned, rand_bytes, wait_error, wait_until,
)
from tether_testutil.proc import fd_count, thread_count

T = 20.0
# Children import tether from wherever this process did (source tree with a built module, or site-packages).
TETHER_PATH = os.path.dirname(os.path.dirname(os.path.abspath(tether.__file__)))


def test_connect_time(endpoints, children):
    server = endpoints(name="server")
    times = []
    for i in range(10):
        client = endpoints(name=f"c{i}")
        t0 = time.perf_counter()
        peer = client.connect(server.metadata(), timeout=5)
        times.append(time.perf_counter() - t0)
        assert peer.connected
    c = children("connect-child")
    info = c.call("endpoint", name="far")
    cross = []
    for i in range(5):
        client = endpoints(name=f"x{i}", channels=8)  # 9 sockets
        t0 = time.perf_counter()
        client.connect(info["metadata"], timeout=5)
        cross.append(time.perf_counter() - t0)
    med, worst, xmed = sorted(times)[len(times) // 2], max(times), sorted(cross)[len(cross) // 2]
    print(f"\nconnect (same process, 3 sockets): median {med * 1e3:.2f} ms, max {worst * 1e3:.2f} ms; "
          f"to another process (9 sockets): median {xmed * 1e3:.2f} ms, max {max(cross) * 1e3:.2f} ms")
    assert med < 0.2 and xmed < 0.2


def test_first_write_right_after_connect(endpoints):
    """Operations posted before the connector's progress threads have adopted the lanes."""
    b = endpoints()
    dst = poisoned(4096)
    d = b.register(dst).descriptor()
    for i in range(20):
        a = endpoints(channels=4)
        src = rand_bytes(i, 4096)
        rs = a.register(src)
        peer = a.connect(b.metadata(), timeout=5)
        peer.write(rs, d).wait(5)
        assert_bytes_equal(dst, src)
        a.close()


def _inflight(n=20, size=32 * MiB, **opts):
    """Helper for close tests: a -> b with n writes of `size` posted (same source/destination)."""
    a = tether.Endpoint(name="initiator", **opts)
    b = tether.Endpoint(name="target")
    peer = a.connect(b.metadata(), timeout=5)
    src = rand_bytes(1, size)
    dst = poisoned(size)
    rs, rd = a.register(src), b.register(dst)
    ts = [peer.write(rs, rd.descriptor()) for _ in range(n)]
    return a, b, peer, ts, (src, dst)


def _close_in_thread(ep, limit=5.0):
    done = threading.Event()
    th = threading.Thread(target=lambda: (ep.close(), done.set()), daemon=True)
    t0 = time.monotonic()
    th.start()
    assert done.wait(limit), f"close() did not return within {limit} s"
    return time.monotonic() - t0


def test_close_initiator_with_writes_in_flight():
    a, b, peer, ts, _ = _inflight()
    try:
        ts[0].wait(T)  # running for real
        _close_in_thread(a)
        outs = [outcome(t, timeout=5) for t in ts[1:]]
        assert "TIMEOUT" not in outs, outs
        assert set(outs) <= {"ok", "Cancelled", "ConnectionLost"}, outs
        assert set(outs) & {"Cancelled", "ConnectionLost"}, "closing must cut 19 x 32 MiB writes short"
        assert not peer.connected
        # the target notices, and keeps serving
        assert wait_until(lambda: b.peers() == [], 5)
        with tether.Endpoint() as c:
            p = c.connect(b.metadata(), timeout=5)
            dst = poisoned(1000)
            src = rand_bytes(2, 1000)
            p.write(c.register(src), b.register(dst).descriptor()).wait(T)
            assert_bytes_equal(dst, src)
        # operations on the closed endpoint fail fast, saying so (test_first_use.py: every call, its peers')
        with pytest.raises(tether.Cancelled, match="endpoint closed"):
            a.register(rand_bytes(3, 10))
        with pytest.raises(tether.TetherError):
            a.connect(b.metadata(), timeout=2)
    finally:
        a.close()
        b.close()


def test_close_target_with_writes_in_flight():
    a, b, peer, ts, _ = _inflight()
    try:
        ts[0].wait(T)
        _close_in_thread(b)
        outs = [outcome(t, timeout=5) for t in ts[1:]]
        assert "TIMEOUT" not in outs, outs
        assert set(outs) <= {"ok", "ConnectionLost"}, outs
        assert "ConnectionLost" in outs
        assert wait_until(lambda: not peer.connected, 5)
        # the initiator still works with someone else
        with tether.Endpoint() as c:
            p = a.connect(c.metadata(), timeout=5)
            dst = poisoned(1000)
            src = rand_bytes(4, 1000)
            p.write(a.register(src), c.register(dst).descriptor()).wait(T)
            assert_bytes_equal(dst, src)
    finally:
        a.close()
        b.close()


def test_close_both_concurrently_with_reads_and_writes_in_flight():
    a, b, peer, ts, _ = _inflight(n=10)
    rk = a.register(poisoned(32 * MiB))
    d = b.register(rand_bytes(5, 32 * MiB)).descriptor()
    ts += [peer.read(rk, d) for _ in range(10)]
    try:
        ths = [threading.Thread(target=ep.close) for ep in (a, b)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(5)
        assert not any(th.is_alive() for th in ths), "close() hung"
        outs = [outcome(t, timeout=5) for t in ts]
        assert "TIMEOUT" not in outs
        assert set(outs) <= {"ok", "Cancelled", "ConnectionLost"}, outs
    finally:
        a.close()
        b.close()


def test_peer_close_then_ops_fail_fast(endpoints):
    a, b = endpoints(name="a"), endpoints(name="b")
    peer = a.connect(b.metadata(), timeout=5)
    src = a.register(rand_bytes(6, 32 * MiB))
    d = b.register(poisoned(32 * MiB)).descriptor()
    inflight = [peer.write(src, d) for _ in range(10)]
    recv_pending = peer.recv(a.register(poisoned(100)), tag=1)
    send_pending = peer.send(a.register(rand_bytes(7, 100)), tag=2)  # never received
    inflight[0].wait(T)
    peer.close()
    assert not peer.connected
    assert "cancelled" in peer.error
    outs = [outcome(t, 5) for t in inflight[1:]]
    assert "TIMEOUT" not in outs and set(outs) <= {"ok", "Cancelled"}, outs
    assert outcome(recv_pending, 5) == "Cancelled"
    assert outcome(send_pending, 5) == "Cancelled"
    sink = a.register(poisoned(100))
    for op in (lambda: peer.write(src, d, length=10), lambda: peer.read(sink, d, length=10),
               lambda: peer.writev([(src, 0, d, 0, 10)]), lambda: peer.readv([(sink, 0, d, 0, 10)]),
               lambda: peer.send(sink), lambda: peer.recv(sink), lambda: peer.notify(b"x"),
               lambda: peer.write(src, d, length=10, notify=b"n")):
        t0 = time.monotonic()
        e = wait_error(op(), timeout=2)
        assert isinstance(e, tether.Cancelled), repr(e)
        assert time.monotonic() - t0 < 1.0
    peer.close()  # twice is fine
    # the other side notices the link is gone
    assert wait_until(lambda: b.peers() == [], 5)
    # and a new link between the same endpoints works
    p2 = a.connect(b.metadata(), timeout=5)
    p2.write(src, d, length=1000).wait(T)


def test_close_twice_and_context_manager(endpoints):
    with tether.Endpoint(name="ctx") as ep:
        addr = ep.address
        assert repr(ep).startswith("Endpoint(")
        other = endpoints()
        p = other.connect(ep.metadata(), timeout=5)
        dst = poisoned(100)
        src = rand_bytes(8, 100)
        p.write(other.register(src), ep.register(dst).descriptor()).wait(T)
        assert_bytes_equal(dst, src)
    ep.close()
    ep.close()
    # it no longer listens
    with pytest.raises(tether.TetherError):
        other.connect(addr, timeout=2)
    assert wait_until(lambda: not p.connected, 5)
    with pytest.raises(tether.Cancelled, match="endpoint closed"):
        ep.notifications(timeout=0.1)
    with pytest.raises(tether.TetherError):
        ep.connect(other.metadata(), timeout=1)
    # context manager closes even when the body raises
    with pytest.raises(ZeroDivisionError):
        with tether.Endpoint() as ep2:
            addr2 = ep2.address
            1 / 0
    with pytest.raises(tether.TetherError):
        other.connect(addr2, timeout=2)


def test_notifications_wait_returns_on_close():
    ep = tether.Endpoint()
    got = []
    th = threading.Thread(target=lambda: got.append(ep.notifications(timeout=10)))
    th.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    ep.close()
    th.join(5)
    assert not th.is_alive(), "notifications(timeout=10) kept waiting on a closed endpoint"
    assert time.monotonic() - t0 < 2
    assert got == [[]]


@pytest.mark.budget(60)
def test_create_close_many_endpoints_no_leak():
    def cycle(i):
        a = tether.Endpoint(name=f"a{i}")
        b = tether.Endpoint(name=f"b{i}", channels=1)
        p = a.connect(b.metadata(), timeout=5)
        src, dst = rand_bytes(i, 10000), poisoned(10000)
        t = p.write(a.register(src), b.register(dst).descriptor(), notify=b"x")
        t.wait(T)
        assert_bytes_equal(dst, src)
        assert b.notifications(timeout=5)
        a.close()
        b.close()

    for i in range(3):  # warm up (lazy allocations, imports)
        cycle(i)
    gc.collect()
    fds0, threads0 = fd_count(), thread_count()
    for i in range(50):
        cycle(i)
    gc.collect()
    assert wait_until(lambda: thread_count() <= threads0 + 2, 5), (
        f"native threads: {threads0} before, {thread_count()} after 50 endpoint pairs")
    fds1 = fd_count()
    assert fds1 <= fds0 + 4, f"fd leak: {fds0} open before, {fds1} after 50 endpoint pairs"


def test_peer_handles_outliving_their_endpoint(endpoints):
    """Python keeps Peer and Transfer objects after close(): using them must not crash."""
    a = tether.Endpoint()
    b = endpoints()
    p = a.connect(b.metadata(), timeout=5)
    rs = a.register(rand_bytes(9, 1000))
    d = b.register(poisoned(1000)).descriptor()
    t = p.write(rs, d)
    t.wait(T)
    a.close()
    del a
    gc.collect()
    assert not p.connected
    # fails fast with some TetherError (the local region was withdrawn by close(): RegionNotFound)
    assert outcome(p.write(rs, d), 2) not in ("ok", "TIMEOUT")
    assert outcome(t, 1) == "ok"
    p.close()


EXIT_SCRIPT = textwrap.dedent("""
    import sys, threading, numpy as np, tether
    mode = sys.argv[1]
    a = tether.Endpoint(name="a")
    b = tether.Endpoint(name="b", channels=4)
    p = a.connect(b.metadata(), timeout=5)
    src = np.random.default_rng(1).integers(0, 256, 32 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    rs, rd = a.register(src), b.register(dst)
    ts = [p.write(rs, rd.descriptor()) for _ in range(20)]
    ts += [p.read(a.register(np.zeros_like(src)), rd.descriptor()) for _ in range(5)]
    ts[0].wait(10)
    bp = b.peers()[0] if b.peers() else None
    r = p.recv(a.register(np.zeros(10, np.uint8)), tag=3)   # never matched
    if mode == "waiter":  # (a daemon thread in Transfer.wait(): see test_process_exit_with_daemon_thread_in_wait)
        threading.Thread(target=lambda: b.notifications(timeout=30), daemon=True).start()
    if mode == "sysexit":
        sys.exit(0)
    print("returning", flush=True)
""")


@pytest.mark.parametrize("mode", ["return", "waiter", "sysexit"])
def test_process_exit_without_close(mode):
    env = dict(os.environ, PYTHONPATH=TETHER_PATH + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, mode], env=env, capture_output=True,
                           timeout=30, text=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"a process that did not close its endpoints hung at exit: {e.stderr!r}")
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, f"exit code {r.returncode}; stderr:\n{r.stderr[-3000:]}"
    assert "terminate called" not in r.stderr and "Segmentation" not in r.stderr, r.stderr[-3000:]
    assert elapsed < 15, f"exit took {elapsed:.1f} s"


def test_child_process_exits_while_peer_in_other_process(children, endpoints):
    """A spawned child with live links and transfers in flight in both directions leaves its
    command loop without close(): it exits with code 0, and this side sees ConnectionLost."""
    me = endpoints(name="me")
    rm = me.register(poisoned(64 * MiB))
    c = children("leaver")
    info = c.call("endpoint", name="leaver")
    c.call("connect", me.metadata())
    c.call("register", "src", 64 * MiB, fill=("seed", 3))
    assert c.call("post", "write", "src", rm.descriptor(), 20) == 20  # nobody waits for these
    p = me.connect(info["metadata"], timeout=5)
    their = c.call("descriptor", "src")
    ts = [p.read(me.register(poisoned(64 * MiB)), their) for _ in range(10)]
    ts[0].wait(T)
    c.parent_conn.close()  # EOF: the agent loop returns and the process exits normally
    c.proc.join(20)
    assert c.proc.exitcode == 0, f"child exit code {c.proc.exitcode}"
    outs = [outcome(t, 5) for t in ts]
    assert "TIMEOUT" not in outs and set(outs) <= {"ok", "ConnectionLost"}, outs
    assert wait_until(lambda: not p.connected, 5)
    assert wait_until(lambda: me.peers() == [], 5)


DAEMON_WAIT_SCRIPT = textwrap.dedent("""
    import threading, numpy as np, tether
    a, b = tether.Endpoint(name="a"), tether.Endpoint(name="b")
    p = a.connect(b.metadata(), timeout=5)
    src = np.zeros(16 << 20, np.uint8)
    dst = np.zeros_like(src)
    rs, rd = a.register(src), b.register(dst)
    d = rd.descriptor()
    started = threading.Event()

    def loop():  # a daemon thread that keeps transfers going and waits on them
        while True:
            ts = [p.write(rs, d) for _ in range(8)]
            for t in ts:
                t.wait(30)
            started.set()

    threading.Thread(target=loop, daemon=True).start()
    assert started.wait(10)
    print("main thread returns", flush=True)
""")


def test_process_exit_with_daemon_thread_in_wait():
    # Regression (fixed): a process whose daemon thread is blocked in Transfer.wait() when the main thread
    # returns dies with SIGABRT ("terminate called without an active exception", exit code -6)
    # instead of exiting with 0. The transfer completes during interpreter finalization; the
    # waiting thread's gil_scoped_release destructor (noexcept) calls PyEval_RestoreThread, which
    # during finalization calls pthread_exit(); its forced unwind through the noexcept frame calls
    # std::terminate (src/bindings/module.cc, Transfer._wait; same pattern in connect/notifications/
    # deregister/close). Reproduces 5/5 with DAEMON_WAIT_SCRIPT.
    env = dict(os.environ, PYTHONPATH=TETHER_PATH + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        r = subprocess.run([sys.executable, "-c", DAEMON_WAIT_SCRIPT], env=env, capture_output=True,
                           timeout=30, text=True)
    except subprocess.TimeoutExpired:
        pytest.fail("process with a daemon thread in Transfer.wait() hung at exit")
    assert "main thread returns" in r.stdout, r.stderr[-2000:]
    assert r.returncode == 0, f"exit code {r.returncode}; stderr tail:\n{r.stderr[-600:]}"


@pytest.mark.parametrize("what", ["busy-port", "unresolvable-host", "foreign-address"])
def test_endpoint_creation_failure_raises(what):
    # Regression (fixed): when the listening socket cannot be created (port already in use, host that does not
    # resolve, address not on this machine), Endpoint() crashes the process with SIGSEGV instead of
    # raising tether.Unavailable / InvalidArgument. EndpointImpl::create returns early after
    # listen_tcp fails; the half-built EndpointImpl's destructor calls close(), which dereferences
    # transport_ (still null) in `transport_->stop()` (src/core/endpoint.cc). Run in a subprocess
    # because it kills the interpreter.
    script = textwrap.dedent("""
        import sys, tether
        what = sys.argv[1]
        keep = tether.Endpoint()
        opts = {"busy-port": dict(port=int(keep.address.rsplit(":", 1)[1])),
                "unresolvable-host": dict(host="no-such-host.invalid"),
                "foreign-address": dict(host="192.0.2.1")}[what]
        try:
            tether.Endpoint(**opts)
        except tether.TetherError as e:
            print("raised", type(e).__name__, e, flush=True)
            keep.close()
            sys.exit(0)
        print("no error", flush=True)
        sys.exit(3)
    """)
    env = dict(os.environ, PYTHONPATH=TETHER_PATH + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", script, what], env=env, capture_output=True, timeout=30, text=True)
    assert r.returncode != 3, "a second endpoint could listen on a busy port / bad host"
    assert r.returncode == 0, f"Endpoint({what}) killed the process: exit code {r.returncode}; {r.stderr[-500:]}"
    assert "raised" in r.stdout


def test_deregister_with_pending_recv_does_not_hang(endpoints):
    # Regression (fixed): deregister() of a region that has a posted recv which no message has matched yet blocks
    # forever (RegionRegistry::remove spins until pins == 0, and the unmatched recv holds a pin for
    # as long as it is posted) although the peer is healthy; it only returns once a matching
    # message arrives or the endpoint closes. The same holds for a send whose receiver never posts
    # a recv. Expected: deregister() returns in bounded time (failing the pending recv, e.g. with
    # Cancelled/RegionNotFound) or refuses with an error.
    a, b = endpoints(), endpoints()
    peer = a.connect(b.metadata(), timeout=5)
    box = poisoned(100)
    rbox = a.register(box)
    r = peer.recv(rbox, tag=5)
    returned = threading.Event()
    errors = []

    def dereg():
        try:
            a.deregister(rbox)
        except tether.TetherError as e:
            errors.append(e)
        returned.set()

    th = threading.Thread(target=dereg, daemon=True)
    th.start()
    try:
        assert returned.wait(2.0), "deregister() of a region with a pending recv did not return within 2 s"
        assert outcome(r, 2) != "TIMEOUT" or errors, "the pending recv neither failed nor blocked deregister"
    finally:
        if not returned.is_set():  # unblock it so the test stays bounded
            bp = b.peers()[0]
            bp.send(b.register(rand_bytes(1, 10)), tag=5).wait(5)
            returned.wait(5)


def test_deregister_waits_for_inflight_then_releases(endpoints):
    """deregister() of a local source with writes in flight returns once they are done (bounded)."""
    a, b = endpoints(), endpoints()
    peer = a.connect(b.metadata(), timeout=5)
    src = rand_bytes(2, 32 * MiB)
    rs = a.register(src)
    dst = poisoned(32 * MiB)
    d = b.register(dst).descriptor()
    ts = [peer.write(rs, d) for _ in range(8)]
    t0 = time.monotonic()
    th = threading.Thread(target=a.deregister, args=(rs,), daemon=True)
    th.start()
    th.join(10)
    assert not th.is_alive(), "deregister hung with writes in flight to a healthy peer"
    assert time.monotonic() - t0 < 10
    for t in ts:
        assert t.done(), "deregister returned while a transfer still used the region"
        t.wait(0)
    assert_bytes_equal(dst, src)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_deregister_of_a_region_being_read(endpoints, transport):
    """The target deregisters a region while reads of it are in flight. Over ipc the initiator copies
    out of the target's pinned region itself until it says it is done (kReadDone): deregister() must
    wait for that, every read that succeeded must hold every byte, and one that lost the race fails
    with RegionNotFound."""
    a, b = endpoints(transport=transport), endpoints(transport=transport)
    peer = a.connect(b.metadata(), timeout=5)
    assert peer.transport == transport
    n = 24 * MiB
    src = rand_bytes(4, n)
    rs = b.register(src)
    d = rs.descriptor()
    outs = [poisoned(n) for _ in range(6)]
    ts = [peer.read(a.register(o), d) for o in outs]
    ts[0].wait(T)  # the rest are in flight, or about to be
    th = threading.Thread(target=b.deregister, args=(rs,), daemon=True)
    th.start()
    th.join(10)
    assert not th.is_alive(), "deregister hung while peers were reading the region"
    for t, out in zip(ts, outs):
        try:
            t.wait(10)
        except tether.RegionNotFound:
            # chunks served before the deregistration landed whole; the refused ones left poison
            assert np.all((out == src) | (out == POISON)), "a refused read's bytes are neither the data nor poison"
            continue
        assert_bytes_equal(out, src, "a read that raced deregistration")
    assert isinstance(wait_error(peer.read(a.register(poisoned(4096)), d, length=4096)), tether.RegionNotFound)


# --------------------------------------------------------------------------- connect failures


def test_connect_failures_are_typed_and_bounded(endpoints):
    a = endpoints()
    # stale metadata: the endpoint restarted on the same port
    old = tether.Endpoint()
    port = int(old.address.rsplit(":", 1)[1])
    stale = old.metadata()
    old.close()
    try:
        new = endpoints(port=port)
    except tether.TetherError:
        new = None  # port taken by someone else meanwhile: skip this part
    if new is not None:
        with pytest.raises(tether.InvalidArgument, match="restarted"):
            a.connect(stale, timeout=2)
    for bad in (b"", b"garbage", b"127.0.0.1", b"127.0.0.1:99999", b"127.0.0.1:x1"):
        with pytest.raises(tether.InvalidArgument):
            a.connect(bad, timeout=1)
    meta = a.metadata()
    for bad in (meta[:-1], meta + b"x"):
        with pytest.raises(tether.InvalidArgument):
            a.connect(bad, timeout=1)
    with pytest.raises(tether.ProtocolError):
        a.connect(meta[:4] + b"\x63\x00" + meta[6:], timeout=1)  # metadata from wire version 99
    # nobody listening: refused at once
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    free_port = s.getsockname()[1]
    s.close()
    t0 = time.monotonic()
    with pytest.raises(tether.ConnectionLost):
        a.connect(f"127.0.0.1:{free_port}", timeout=2)
    assert time.monotonic() - t0 < 1.5
    # a listener that never answers: TransferTimeout after `timeout`
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        t0 = time.monotonic()
        with pytest.raises(tether.TransferTimeout):
            a.connect("127.0.0.1:%d" % silent.getsockname()[1], timeout=0.5)
        assert 0.4 < time.monotonic() - t0 < 2.0
    finally:
        silent.close()
    assert a.peers() == []


def test_connect_to_stopped_process_times_out(endpoints, children):
    a = endpoints()
    c = children("frozen")
    info = c.call("endpoint")
    c.kill(signal.SIGSTOP)  # returns once every thread is stopped
    t0 = time.monotonic()
    with pytest.raises(tether.TransferTimeout):
        a.connect(info["metadata"], timeout=0.5)
    assert time.monotonic() - t0 < 2.0
    os.kill(c.pid, signal.SIGCONT)


def test_close_ends_a_connect_under_way_to_a_stopped_process(children):
    """A connect waiting on a stopped peer's handshake ends as soon as its endpoint closes (the NIXL
    plugin's engine closes its endpoint, then joins the threads still connecting), not at
    connect_timeout."""
    c = children("frozen")
    info = c.call("endpoint")
    c.kill(signal.SIGSTOP)  # returns once every thread is stopped
    a = tether.Endpoint(connect_timeout=20)
    out = {}

    def connect():
        t0 = time.monotonic()
        try:
            a.connect(info["metadata"])
        except tether.TetherError as e:
            out["error"] = e
        out["seconds"] = time.monotonic() - t0

    th = threading.Thread(target=connect)
    th.start()
    time.sleep(0.5)
    a.close()
    th.join(5)
    os.kill(c.pid, signal.SIGCONT)
    assert not th.is_alive(), "connect still waiting after close()"
    assert isinstance(out.get("error"), tether.Cancelled), out
    assert out["seconds"] < 2.0, out


def test_invalid_configuration():
    for kw in (dict(channels=0), dict(channels=257), dict(chunk_bytes=0), dict(window=0)):
        with pytest.raises(tether.InvalidArgument):
            tether.Endpoint(**kw)
    with pytest.raises(TypeError):
        tether.Endpoint(no_such_option=1)
    with tether.Endpoint(channels=256) as ep:  # 256 lanes is the maximum
        assert ep.config.channels == 256


@pytest.mark.budget(60)
def test_server_does_not_leak_across_many_clients(endpoints):
    """One long-lived server; 30 clients connect, transfer, and go away in different ways.
    Afterwards the server lists no peers and the process holds no extra fds or threads."""
    server = endpoints(name="server", auth_token="tok")
    dst = poisoned(10000)
    d = server.register(dst).descriptor()

    def client(i):
        c = tether.Endpoint(name=f"c{i}", auth_token="tok" if i % 5 else "bad")
        try:
            p = c.connect(server.metadata(), timeout=5)
        except tether.AuthError:
            c.close()
            return
        p.write(c.register(rand_bytes(i, 10000)), d).wait(T)
        if i % 3 == 0:
            p.close()
        c.close()

    for i in range(5):
        client(i)
    gc.collect()
    assert wait_until(lambda: server.peers() == [], 5)
    fds0, threads0 = fd_count(), thread_count()
    for i in range(30):
        client(i)
    gc.collect()
    assert wait_until(lambda: server.peers() == [], 5), server.peers()
    assert wait_until(lambda: fd_count() <= fds0 + 2, 5), f"fds: {fds0} before, {fd_count()} after 30 clients"
    assert wait_until(lambda: thread_count() <= threads0 + 1, 5), (threads0, thread_count())


STRESS_SCRIPT = textwrap.dedent("""
    import random, sys, threading, time, numpy as np, tether
    iters, seed = int(sys.argv[1]), int(sys.argv[2])
    random.seed(seed)
    src = np.random.default_rng(1).integers(0, 256, 4 << 20, dtype=np.uint8)
    for it in range(iters):
        a = tether.Endpoint(channels=random.choice([1, 2, 4]),
                            chunk_bytes=random.choice([64 << 10, 1 << 20]))
        b = tether.Endpoint()
        p = a.connect(b.metadata(), timeout=5)
        dst = np.zeros(4 << 20, np.uint8)
        rs, rd = a.register(src), b.register(dst)
        d = rd.descriptor()
        stop = threading.Event()
        timeouts = []

        def settle(t):
            try:
                t.wait(10)
            except tether.TransferTimeout:
                timeouts.append(t)
            except tether.TetherError:
                pass

        def worker(k):
            ts = []
            while not stop.is_set():
                op = random.randrange(5)
                try:
                    if op == 0:
                        ts.append(p.write(rs, d, notify=b"n" if k else None))
                    elif op == 1:
                        ts.append(p.read(a.register(np.zeros(1 << 20, np.uint8)), d, length=1 << 20))
                    elif op == 2:
                        ts.append(p.send(rs, length=1000, tag=k))
                    elif op == 3:
                        ts.append(p.recv(a.register(np.zeros(1000, np.uint8)), tag=k))
                    else:
                        ts.append(p.notify(b"x"))
                except tether.TetherError:
                    pass
                if len(ts) > 16:
                    settle(ts.pop(0))
            for t in ts:
                settle(t)

        def other_side():
            while not stop.is_set():
                for bp in b.peers():
                    try:
                        bp.send(b.register(np.ones(500, np.uint8)), tag=random.randrange(4))
                        bp.write(b.register(np.ones(100, np.uint8)), d, length=100)
                    except tether.TetherError:
                        pass
                b.notifications(timeout=0.001)

        ths = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
        ths.append(threading.Thread(target=other_side))
        for th in ths:
            th.start()
        time.sleep(random.uniform(0.0, 0.05))
        order = random.randrange(4)
        if order == 0:
            p.close(); a.close(); b.close()
        elif order == 1:
            b.close(); a.close()
        elif order == 2:
            a.close(); b.close()
        else:
            c = threading.Thread(target=a.close); c.start(); b.close(); c.join()
        stop.set()
        for th in ths:
            th.join(15)
            if th.is_alive():
                print("HANG: iteration", it, "close order", order, flush=True)
                sys.exit(2)
        if timeouts:
            print("TRANSFER STILL RUNNING after close: iteration", it, "order", order, flush=True)
            sys.exit(3)
    print("ok", flush=True)
""")


@pytest.mark.budget(60)
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
@pytest.mark.parametrize("seed", [1, 2])
def test_close_in_random_orders_under_mixed_load(seed, transport):
    """3 threads post writes/reads/sends/recvs/notifies (and the accepted side sends and writes
    back) while the endpoints and the peer are closed in a random order; 25 rounds. No crash,
    no hang, no transfer left running. Runs in a subprocess so a crash is reported, not fatal."""
    env = dict(os.environ, PYTHONPATH=TETHER_PATH + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TETHER_TRANSPORT=transport)
    try:
        r = subprocess.run([sys.executable, "-c", STRESS_SCRIPT, "25", str(seed)], env=env,
                           capture_output=True, timeout=45, text=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"stress run hung: {e.stdout!r}")
    assert r.returncode == 0 and "ok" in r.stdout, f"rc={r.returncode} {r.stdout[-500:]} {r.stderr[-1500:]}"


def test_short_peer_timeout_on_one_side_only(endpoints):
    """A peer with the default heartbeat must not be declared dead by a side with a short
    peer_timeout: the handshake tells it how often to speak."""
    strict = endpoints(name="strict", peer_timeout=0.4)
    relaxed = endpoints(name="relaxed")  # heartbeat 1 s by default
    peer = relaxed.connect(strict.metadata(), timeout=5)
    time.sleep(1.5)  # idle for several of strict's timeouts
    assert peer.connected and all(p.connected for p in strict.peers())
    back = strict.peers()[0]
    buf = np.zeros(16, np.uint8)
    back.write(strict.register(np.ones(16, np.uint8)), relaxed.register(buf).descriptor()).wait(5)
    assert buf.sum() == 16


def test_empty_notify_on_write_is_rejected(endpoints):
    a, b = endpoints(), endpoints()
    peer = a.connect(b.metadata(), timeout=5)
    dst = b.register(np.zeros(8, np.uint8))
    with pytest.raises(tether.InvalidArgument):
        peer.write(a.register(np.ones(8, np.uint8)), dst.descriptor(), notify=b"")


def test_threads_are_named_and_end_with_the_endpoint():
    """tether's threads carry names (top -H, perf, bench/tools/thread_cpu.py tell them apart), one
    tcp progress thread per channel, and none outlives close(). In a fresh process: other tests'
    endpoints live on in this one."""
    script = textwrap.dedent("""
        import os, time, tether
        def names():
            out = []
            for tid in os.listdir("/proc/self/task"):
                try:
                    out.append(open(f"/proc/self/task/{tid}/comm").read().strip())
                except OSError:
                    pass  # a thread that ended meanwhile
            return out
        def settle(cond):
            deadline = time.monotonic() + 5
            while not cond(names()) and time.monotonic() < deadline:
                time.sleep(0.01)
            return names()
        ep = tether.Endpoint(transport="tcp", channels=3)
        got = settle(lambda n: "tether-control" in n)  # the control thread names itself once it runs
        assert sorted(n for n in got if n.startswith("tether-tcp")) == ["tether-tcp0", "tether-tcp1", "tether-tcp2"], got
        assert "tether-control" in got, got
        ep.close()
        left = settle(lambda n: not any(x.startswith("tether-") for x in n))
        assert not [n for n in left if n.startswith("tether-")], left
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
