"""The ipc transport: two processes on one host move host memory without sockets carrying bytes.
Cross-memory attach where the kernel allows it, a shared-memory bounce area where it does not
(forced with TETHER_IPC_HOST=shm, or automatic when attach is refused), tcp when ipc is disabled.
Bad input, deregistration and dead peers are covered for both transports in test_access_checks.py and test_peer_failure.py.
"""
from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest

import tether
from conftest import CONFIGS
from tether_testutil.data import MiB, assert_bytes_equal, assert_poison, poisoned, rand_bytes
from tether_testutil.proc import refuse_cma
from tether_testutil.sockets import raw_connect, read_server_hello
from tether_testutil.wire import client_hello, host_id_of

T = 20.0


def _every_operation(me, peer, c, *, seed: int, size: int = 5 * MiB + 3):
    """`me` drives every operation against child `c` (connected to us as `peer`), and `c` drives
    writes/sends back through its accepted peer; random data, poisoned destinations, every byte."""
    # write: odd offsets and lengths, several chunks
    desc = c.call("register", "dst", size)
    src = rand_bytes(seed, size)
    rs = me.register(src)
    peer.write(rs, desc, local_offset=1, remote_offset=2, length=size - 3).wait(T)
    got = _get(c, "dst")
    assert_bytes_equal(got[2:size - 1], src[1:size - 2], "write")
    assert_poison(got[:2], "before the write")
    assert_poison(got[size - 1:], "after the write")
    # read back into a poisoned buffer
    back = poisoned(size)
    peer.read(me.register(back), desc, local_offset=3, remote_offset=2, length=size - 4).wait(T)
    assert_bytes_equal(back[3:size - 1], src[1:size - 3], "read")
    assert_poison(back[:3], "read head")
    # writev / readv: many small scattered entries across two remote regions
    d2 = c.call("register", "v", 1 * MiB)
    rng = np.random.default_rng(seed)
    entries, expect = [], poisoned(1 * MiB)
    for i in range(64):
        off, n = i * 16000 + int(rng.integers(100)), int(rng.integers(1, 15000))
        entries.append((rs, int(off), d2, int(off), n))
        expect[off:off + n] = src[off:off + n]
    peer.writev(entries, notify=b"vec-done").wait(T)
    assert [n[1:] for n in c.call("notifications", 1)] == [(me.name, b"vec-done")]
    assert_bytes_equal(_get(c, "v"), expect, "writev")
    sink = poisoned(1 * MiB)
    rsk = me.register(sink)
    peer.readv([(rsk, off, d2, off, n) for (_, off, _, _, n) in entries]).wait(T)
    assert_bytes_equal(sink, expect, "readv")
    # send/recv both ways; the child also writes into us through its accepted peer
    box = poisoned(3 * MiB)
    r = peer.recv(me.register(box), tag=7)
    c.call("register", "msg", 3 * MiB - 10, fill=("seed", seed + 1))
    assert c.call("send", "msg", tag=7, accepted=True) == ("ok", 3 * MiB - 10)
    r.wait(T)
    assert_bytes_equal(box[:3 * MiB - 10], rand_bytes(seed + 1, 3 * MiB - 10), "recv")
    assert_poison(box[3 * MiB - 10:], "recv tail")
    c.start("recv", "dst", length=size, tag=9, accepted=True)
    peer.send(rs, tag=9).wait(T)
    st = c.result(T)
    assert st[:2] == ("ok", size) and st[2] == src.tobytes()
    mine = poisoned(2 * MiB)
    assert c.call("write", "msg", me.register(mine).descriptor(), length=2 * MiB, accepted=True) == ("ok", 2 * MiB)
    assert_bytes_equal(mine, rand_bytes(seed + 1, 2 * MiB), "write from the child")
    # notify alone
    peer.notify(b"hello").wait(T)
    assert [n[1:] for n in c.call("notifications", 1)] == [(me.name, b"hello")]


def _get(c, name):
    return np.frombuffer(c.call("get", name), dtype=np.uint8)


def _connected_child(me, children, env=None, refuse=None, **ep):
    c = children("ipc-peer", env=env)
    if refuse is not None:
        c.call("refuse_cma", refuse)
    info = c.call("endpoint", name="ipc-peer", **ep)
    return c, info


@pytest.mark.budget(90)
@pytest.mark.parametrize("shape", ["c1", "c4", "chunk64k"])
def test_every_operation_between_two_processes_over_ipc(endpoints, children, shape):
    config = CONFIGS["ipc-" + shape]
    me = endpoints(name="me", **config)
    c, info = _connected_child(me, children, **{k: v for k, v in config.items() if k != "transport"})
    peer = me.connect(info["metadata"], timeout=5)
    assert peer.transport == "ipc"
    assert c.call("transport", accepted=True) == "ipc"
    s0 = c.call("stats")
    _every_operation(me, peer, c, seed=11)
    s1 = c.call("stats")
    # every operation by cross-memory attach: writes and sends read by the target, reads by the
    # initiator out of the target's region (one copy); nothing through a bounce area
    assert s1["ipc_cma_chunks"] > s0["ipc_cma_chunks"] and s1["ipc_shm_chunks"] == s0["ipc_shm_chunks"]
    assert me.stats()["ipc_cma_chunks"] > 0 and me.stats()["ipc_shm_chunks"] == 0  # the child sent/wrote only


def test_forced_shared_memory_path(endpoints, children):
    """TETHER_IPC_HOST=shm on both sides: every operation goes through the bounce areas."""
    me = endpoints(name="me", ipc_host="shm", chunk_bytes=256 << 10)
    c, info = _connected_child(me, children, env={"TETHER_IPC_HOST": "shm"})
    peer = me.connect(info["metadata"], timeout=5)
    assert peer.transport == "ipc"
    _every_operation(me, peer, c, seed=21)
    theirs, mine = c.call("stats"), me.stats()
    assert theirs["ipc_cma_chunks"] == 0 and theirs["ipc_shm_chunks"] > 20
    assert mine["ipc_cma_chunks"] == 0 and mine["ipc_shm_chunks"] > 0


def test_automatic_fallback_when_cross_memory_attach_is_refused(children):
    """Two processes without CAP_SYS_PTRACE; A is also non-dumpable, so B may not attach to A
    (EPERM) while A may attach to B. A's chunks must go through shared memory, B's by attach.
    One-sided small ops are off: this counts the movers each target serves with (one-sided ops in
    test_one_sided.py)."""
    off = {"TETHER_IPC_ONE_SIDED_BYTES": "0"}
    a = children("nondumpable", env=off)
    b = children("dumpable", env=off)
    a.call("refuse_cma", False)
    b.call("refuse_cma", True)
    a.call("endpoint", name="A")
    info_b = b.call("endpoint", name="B")
    assert a.call("connect", info_b["metadata"]) == "B"
    assert a.call("transport") == "ipc" and b.call("transport", accepted=True) == "ipc"
    a0, b0 = a.call("stats"), b.call("stats")
    size = 3 * MiB + 7
    # A -> B: write (B may not attach to A: through A's bounce area), then read back (A may attach to B:
    # A reads B's region itself)
    db = b.call("register", "dst", size)
    a.call("register", "src", size, fill=("seed", 31))
    assert a.call("write", "src", db) == ("ok", size)
    assert_bytes_equal(_get(b, "dst"), rand_bytes(31, size), "A's write into B")
    a.call("register", "back", size)
    assert a.call("read", "back", db) == ("ok", size)
    assert_bytes_equal(_get(a, "back"), rand_bytes(31, size), "A's read from B")
    # B -> A through B's accepted peer: A serves B's chunks by attaching to B
    da = a.call("register", "land", size)
    b.call("register", "src", size, fill=("seed", 32))
    assert b.call("write", "src", da, accepted=True) == ("ok", size)
    assert_bytes_equal(_get(a, "land"), rand_bytes(32, size), "B's write into A")
    a1, b1 = a.call("stats"), b.call("stats")
    d = {k: (a1[k] - a0[k], b1[k] - b0[k]) for k in ("ipc_cma_chunks", "ipc_shm_chunks", "ipc_inline_chunks")}
    # 3 MiB + 7 is three full chunks and 7 bytes, which travel in their request message (inline)
    assert d["ipc_shm_chunks"][1] >= 3 and d["ipc_cma_chunks"][1] >= 4 and d["ipc_inline_chunks"][1] >= 1, d
    assert d["ipc_cma_chunks"][0] >= 3 and d["ipc_shm_chunks"][0] == 0 and d["ipc_inline_chunks"][0] >= 1, d
    # a read by B: B may not attach to A, so A pushes into B's bounce area
    b.call("register", "rb", size)
    assert b.call("read", "rb", da, accepted=True) == ("ok", size)
    assert_bytes_equal(_get(b, "rb"), rand_bytes(32, size), "B's read from A")
    assert a.call("stats")["ipc_shm_chunks"] - a1["ipc_shm_chunks"] >= 4


def test_cma_required_but_refused_fails_connect_clearly(children):
    a = children("nondumpable", env={"TETHER_IPC_HOST": "cma"})
    b = children("dumpable")
    a.call("refuse_cma", False)
    b.call("refuse_cma", True)
    a.call("endpoint", name="A")
    info_b = b.call("endpoint", name="B")
    with pytest.raises(AssertionError, match="TETHER_IPC_HOST=cma"):
        a.call("connect", info_b["metadata"])
    # the listener is not hurt: a plain connect works
    c = children("plain")
    c.call("endpoint", name="C")
    assert c.call("connect", info_b["metadata"]) == "B" and c.call("transport") == "ipc"


def test_disable_ipc_falls_back_to_tcp(endpoints, children, monkeypatch):
    c = children("no-ipc", env={"TETHER_DISABLE_IPC": "1"})
    info = c.call("endpoint", name="no-ipc")
    me = endpoints(name="me")
    assert me.transports()["ipc"] == ""
    peer = me.connect(info["metadata"], timeout=5)
    assert peer.transport == "tcp"  # the listener did not offer ipc
    desc = c.call("register", "d", 1 * MiB)
    src = rand_bytes(41, 1 * MiB)
    peer.write(me.register(src), desc).wait(T)
    assert_bytes_equal(_get(c, "d"), src)
    monkeypatch.setenv("TETHER_DISABLE_IPC", "1")
    off = endpoints(name="off")
    assert "TETHER_DISABLE_IPC" in off.transports()["ipc"]
    assert off.connect(me.metadata(), timeout=5).transport == "tcp"  # connector side disabled
    assert endpoints(disable_ipc=True).connect(me.metadata(), timeout=5).transport == "tcp"
    with pytest.raises(tether.Unavailable, match="transport ipc cannot be used here: disabled"):
        endpoints(transport="ipc", disable_ipc=True)


def test_bad_ipc_host_value_is_refused():
    with pytest.raises(tether.InvalidArgument, match="ipc_host"):
        tether.Endpoint(ipc_host="dma")


def test_concurrent_connects_from_one_endpoint_get_their_own_lanes(endpoints):
    """Lanes of many simultaneous connects arrive at one socket; each connect must get its own."""
    me = endpoints(name="hub", channels=3)
    others = [endpoints(name=f"o{i}", channels=3) for i in range(4)]
    targets = [o for o in others for _ in range(2)]  # two links to each
    peers, errors = [None] * len(targets), []

    def go(i):
        try:
            peers[i] = me.connect(targets[i].metadata(), timeout=10)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ths = [threading.Thread(target=go, args=(i,)) for i in range(len(targets))]
    for th in ths:
        th.start()
    for th in ths:
        th.join(30)
    assert not errors, errors
    for i, (p, o) in enumerate(zip(peers, targets)):
        assert p.transport == "ipc"
        dst = poisoned(2 * MiB + i)
        src = rand_bytes(50 + i, 2 * MiB + i)
        p.write(me.register(src), o.register(dst).descriptor()).wait(T)
        assert_bytes_equal(dst, src, f"link {i}")


def _offers(server, **hello) -> set:
    s = raw_connect(server.address)
    try:
        s.sendall(client_hello(**hello))
        return set(read_server_hello(s)["offers"])
    finally:
        s.close()


def test_listener_offers_only_what_the_connector_would_choose(endpoints):
    """Offers cost (fabric opens its rails for one): the listener offers the highest-priority
    transports among those the connector says it can take, ipc only to a same-host connector."""
    me = endpoints(name="me")
    same = host_id_of(me.metadata())
    assert _offers(me, host_id=same) == {"ipc"}
    assert _offers(me, host_id=same, transports=1) == {"tcp"}           # the connector pinned tcp
    assert "ipc" not in _offers(me)                                    # another host: no ipc
    assert "tcp" in _offers(me, transports=1 | 2)                      # another host, tcp or ipc: tcp
    assert _offers(me, host_id=same, transports=8) == set()            # nothing both can use


def test_strangers_on_the_lane_socket_do_not_disturb_connects(endpoints):
    """The lane socket's name is in the listener's handshake offer; anyone on the host may connect to
    it and send garbage, a forged introduction or nothing. Real connects keep working (the listener
    accepts lanes and parks each under the session it names)."""
    me = endpoints(name="me")
    other = endpoints(name="other")
    s = raw_connect(other.address)
    s.sendall(client_hello(host_id=host_id_of(other.metadata())))  # a same-host peer is offered ipc
    offer = read_server_hello(s)["offers"]["ipc"]
    s.close()
    version, session, challenge = struct.unpack_from("<HQQ", offer, 0)
    name = offer[18:]
    forged = struct.pack("<IHBBQIIQQQ", 0x43504954, version, 1, 0, session, 0, 1, 0, 0, challenge)
    junk = []
    for payload in (b"", b"x" * 40, forged, forged[:20], b"y" * 500):
        u = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        u.connect(b"\0" + name)
        if payload:
            u.send(payload)
        junk.append(u)
    for i in range(3):
        p = me.connect(other.metadata(), timeout=5)
        assert p.transport == "ipc"
        dst, src = poisoned(100000), rand_bytes(60 + i, 100000)
        p.write(me.register(src), other.register(dst).descriptor()).wait(T)
        assert_bytes_equal(dst, src)
    for u in junk:
        u.close()


def test_refuse_cma_helper_really_refuses_here(children):
    """The fallback tests rely on the kernel refusing attach to a non-dumpable process from one
    without CAP_SYS_PTRACE; check that premise on this machine with a raw process_vm_readv."""
    import ctypes
    import os
    import subprocess
    import sys
    code = ("import ctypes,os,sys,time; sys.path.insert(0, sys.argv[1]); from tether_testutil.proc import refuse_cma;"
            "refuse_cma(False); buf=ctypes.create_string_buffer(b'cookie!!'); print(os.getpid(), ctypes.addressof(buf), flush=True);"
            "time.sleep(30)")
    p = subprocess.Popen([sys.executable, "-c", code, os.path.dirname(__file__)], stdout=subprocess.PIPE, text=True)
    try:
        pid, addr = map(int, p.stdout.readline().split())
        r, w = os.pipe()
        child = os.fork()
        if child == 0:  # no CAP_SYS_PTRACE here either, then try to read the cookie
            try:
                refuse_cma(True)
                libc = ctypes.CDLL(None, use_errno=True)

                class Iov(ctypes.Structure):
                    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
                out = ctypes.create_string_buffer(8)
                loc, rem = Iov(ctypes.addressof(out), 8), Iov(addr, 8)
                n = libc.process_vm_readv(pid, ctypes.byref(loc), 1, ctypes.byref(rem), 1, 0)
                os.write(w, b"refused" if n < 0 else b"allowed")
            finally:
                os._exit(0)
        os.waitpid(child, 0)
        assert os.read(r, 16) == b"refused"
    finally:
        p.kill()
        p.wait()


def test_many_small_blocks_go_in_batches_of_up_to_1024(endpoints):
    """ipc batches take up to 1,024 fragments (tcp's 128 would mean 24 frames here): 3,000 shuffled
    blocks of 100 bytes arrive in three batches, every byte in place, nothing outside them touched."""
    a, b = endpoints(name="a"), endpoints(name="b")
    peer = a.connect(b.metadata(), timeout=5)
    assert peer.transport == "ipc"
    n, size = 3000, 100
    src, dst = rand_bytes(77, n * size), poisoned(n * size + 64)
    order = np.random.default_rng(7).permutation(n)
    local = np.arange(n, dtype=np.uint64) * size
    remote = order.astype(np.uint64) * size + 32
    before = b.stats()["chunks_received"]
    peer.writev_blocks(a.register(src), b.register(dst).descriptor(), local, remote, size).wait(T)
    assert b.stats()["chunks_received"] - before == 3
    expect = poisoned(n * size + 64)
    for i in range(n):
        expect[int(remote[i]):int(remote[i]) + size] = src[i * size:(i + 1) * size]
    assert_bytes_equal(dst, expect, "3,000 blocks")
