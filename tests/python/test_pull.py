"""Pulled reads (wire::FrameType::kPull, wire version 8): a large tcp read with GPU memory on either side is
asked for in one kPull frame on a lane and the target pushes it as kSendData chunks.

The target's side, from a hand-made peer: every check a kReadReq header meets applies to the kPull; a refusal
comes back as kPullFail (control) with the tether::Code; a malformed one drops that peer only; a kPull sent
again after its lane died (kFlagResent) is ignored while its token is pushed; a region deregistered while a
reader that does not take its bytes holds a pushed chunk is let go after deregister_timeout_ms, that peer cut
off.

The initiator's side, on the CPU: a read is pulled when GPU memory is on either side, which the initiator
learns from the descriptor's memory kind. A descriptor whose kind byte says GPU, for a region the target holds
in host memory, takes the whole pulled path here: the kPull frame leaves on a lane (from the posting thread
where one is free), the target pushes the range as kSendData, cancel stops it. A hand-made target closes the
lane its kPull came on before pushing anything: the initiator sends the kPull again, flagged resent, on the
surviving lane, and the read completes byte for byte. Data a target pushes after the read was cancelled is
refused and lands nowhere; a pull leaves even while unanswered writes fill every lane's window.
GPU memory on the device: test_gpu.py."""
from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time

import numpy as np
import pytest

import tether
from tether_testutil.data import MiB, assert_bytes_equal, assert_poison, cancel_and_wait, poisoned, rand_bytes, wait_until
from tether_testutil.sockets import assert_drops_only_that_peer, raw_peer, recv_exact
from tether_testutil.wire import (
    CLIENT_HELLO_SIZE, CLIENT_PROOF_SIZE, DESC_KIND, FRAME, KACK, KPULL, descriptor, parse_client_hello,
    pull, server_hello,
)

CONTROL = struct.Struct("<IB3x")              # wire::ControlHeader: body length, type
PULL_FAIL = struct.Struct("<IB3x")            # wire::PullFailBody: token, status
KPULL_FAIL, KHEARTBEAT = 8, 1                 # wire::ControlType
KOLD_CONTROL_PULL = 7                         # wire::ControlType 7: kPull before wire version 8
KSEND_DATA = 5                                # wire::FrameType
RESENT = 1                                    # wire::kFlagResent
NOT_FOUND, ACCESS_DENIED, OUT_OF_RANGE, INVALID, EXHAUSTED = 2, 3, 4, 1, 13  # tether::Code
T = 10


def control_messages(s: socket.socket, want: int, timeout: float = T) -> list:
    """The next `want` control messages other than heartbeats, as (type, body)."""
    out = []
    end = time.monotonic() + timeout
    while len(out) < want:
        length, kind = CONTROL.unpack(recv_exact(s, CONTROL.size, timeout=max(0.1, end - time.monotonic())))
        body = recv_exact(s, length) if length else b""
        if kind != KHEARTBEAT:
            out.append((kind, body))
    return out


def take_pushed(data: socket.socket, token: int, length: int) -> bytes:
    """Receives a pushed read's kSendData chunks, acking each; returns its bytes in message order."""
    got = bytearray(length)
    seen = 0
    while seen < length:
        h = FRAME.unpack(recv_exact(data, FRAME.size))
        kind, status, flags, slot, gen, rid, unit, _, _, offset, n = h
        assert (kind, status, rid) == (KSEND_DATA, 0, token), h
        assert offset % unit == 0 and (n == unit or offset + n == length), h
        got[offset:offset + n] = recv_exact(data, n)
        seen += n
        data.sendall(FRAME.pack(KACK, 0, 0, slot, gen, 0, 0, 0, 0, 0, 0))
    return bytes(got)


@pytest.fixture
def raw(endpoints):
    """A server, one of its regions (random bytes, 3 MiB + 5), and a hand-made peer's sockets."""
    server = endpoints(name="server")
    src = rand_bytes(71, 3 * MiB + 5)
    region = server.register(src)
    socks = raw_peer(server.address, lanes=1)
    assert wait_until(lambda: len(server.peers()) == 1, 5)
    yield server, src, region, socks
    for s in socks:
        s.close()


def test_a_pulled_read_is_pushed_as_send_data(raw):
    server, src, region, (ctl, data) = raw
    desc = region.descriptor()
    data.sendall(pull(7, desc, 1000, len(src) - 1000))
    assert_bytes_equal(np.frombuffer(take_pushed(data, 7, len(src) - 1000), np.uint8), src[1000:])
    assert server.stats()["reads_pushed"] == 1
    data.sendall(pull(8, desc, 0, 1))  # a second, under another token, once the first is done
    assert take_pushed(data, 8, 1) == src[:1].tobytes()
    assert server.stats()["reads_pushed"] == 2


@pytest.mark.parametrize("case,code", [("key", ACCESS_DENIED), ("range", OUT_OF_RANGE), ("region", NOT_FOUND),
                                       ("empty", INVALID)])
def test_a_refused_pull_answers_its_code_and_sends_nothing(raw, case, code):
    server, src, region, (ctl, data) = raw
    desc = region.descriptor()
    msg = {"key": pull(9, desc, 0, 4096, key_xor=1), "range": pull(9, desc, len(src) - 10, 11),
           "region": pull(9, desc, 0, 4096, region_id=999), "empty": pull(9, desc, 0, 0)}[case]
    data.sendall(msg)
    [(kind, body)] = control_messages(ctl, 1)
    assert kind == KPULL_FAIL and PULL_FAIL.unpack(body) == (9, code), (kind, body)
    data.settimeout(0.2)
    with pytest.raises(socket.timeout):
        data.recv(1)
    assert server.stats()["reads_pushed"] == 0 and server.stats()["rejected_requests"] == 1
    data.sendall(pull(10, desc, 0, 4096))  # the peer is still served
    assert take_pushed(data, 10, 4096) == src[:4096].tobytes()


def test_a_token_already_pulling_is_refused(raw):
    server, src, region, (ctl, data) = raw
    desc = region.descriptor()
    data.sendall(pull(11, desc, 0, len(src)) + pull(11, desc, 0, 10))
    [(kind, body)] = control_messages(ctl, 1)
    assert kind == KPULL_FAIL and PULL_FAIL.unpack(body) == (11, INVALID)
    assert_bytes_equal(np.frombuffer(take_pushed(data, 11, len(src)), np.uint8), src)


def test_pulls_beyond_the_bound_are_refused(raw):
    """A peer cannot queue unbounded pushes: past four times its chunk slots they are refused, nothing lost."""
    server, src, region, (ctl, data) = raw
    desc = region.descriptor()
    data.sendall(b"".join(pull(100 + i, desc, i, 1) for i in range(6000)))  # never acked, so never finished
    fails = []
    while not fails:
        kind, body = control_messages(ctl, 1)[0]
        if kind == KPULL_FAIL:
            fails.append(PULL_FAIL.unpack(body))
    assert fails[0][1] == EXHAUSTED, fails
    assert 0 < server.stats()["reads_pushed"] < 6000


def test_a_resent_pull_is_ignored_while_its_token_is_pushed(raw):
    """The reader's lane died after it sent a kPull; it sends the kPull again (kFlagResent) on another lane.
    A target that got the first pushes the read once; one that did not starts it then."""
    server, src, region, (ctl, data) = raw
    desc = region.descriptor()
    data.sendall(pull(12, desc, 0, len(src)) + pull(12, desc, 0, len(src), flags=RESENT))
    assert_bytes_equal(np.frombuffer(take_pushed(data, 12, len(src)), np.uint8), src)
    data.settimeout(0.3)
    with pytest.raises(socket.timeout):  # nothing more: no second push, no refusal
        data.recv(1)
    with pytest.raises(socket.timeout):  # nor a refusal
        control_messages(ctl, 1, timeout=0.3)
    assert server.stats()["reads_pushed"] == 1 and server.stats()["rejected_requests"] == 0
    data.sendall(pull(13, desc, 5, 4096, flags=RESENT))  # a resent kPull whose first never arrived
    assert take_pushed(data, 13, 4096) == src[5:4101].tobytes()
    assert server.stats()["reads_pushed"] == 2


@pytest.mark.parametrize("case", ["token-0", "gen", "status", "control"])
def test_a_malformed_pull_drops_only_that_peer(endpoints, case):
    """A kPull with token 0, a generation or a status (fields a request never carries), or the control
    message kPull was before wire version 8: that peer is dropped, nothing else."""
    if case == "control":
        body = struct.pack("<IIQQQQQ", 5, 1, 0, 0, 0, 0, 1)
        send = lambda socks: socks[0].sendall(CONTROL.pack(len(body), KOLD_CONTROL_PULL) + body)  # noqa: E731
    else:
        msg = FRAME.pack(KPULL, 1 if case == "status" else 0, 0, 0 if case == "token-0" else 5,
                         1 if case == "gen" else 0, 1, 0, 0, 0, 0, 1)
        send = lambda socks: socks[1].sendall(msg)  # noqa: E731
    assert_drops_only_that_peer(endpoints, send, "a malformed kPull", seed=72, timeout=T)


def test_deregister_while_a_puller_stalls(endpoints):
    """A peer pulls 64 MiB and stops reading its socket. deregister() returns at once: a pushed chunk pins
    the region only until the kernel has its bytes, and no chunk is taken while the socket is full (a
    chunk left half sent would be cut off after deregister_timeout_ms). When the peer reads again, every
    byte it gets is the region's content from before deregister(), and the read ends in kPullFail
    (kNotFound): nothing of the memory's later use leaks."""
    server = endpoints(name="server", deregister_timeout=0.3)
    src = rand_bytes(73, 64 * MiB)
    orig = src.copy()
    region = server.register(src)
    ctl, data = raw_peer(server.address, lanes=1)
    try:
        assert wait_until(lambda: len(server.peers()) == 1, 5)
        data.sendall(pull(5, region.descriptor(), 0, len(src)))
        assert wait_until(lambda: server.stats()["reads_pushed"] == 1, 5)
        time.sleep(0.2)  # the lane fills the socket
        t0 = time.monotonic()
        server.deregister(region)
        assert time.monotonic() - t0 < 3.0
        src[:] = 0  # the application reuses the memory at once
        got, wrong = 0, []

        def drain():  # the peer reads again: each chunk holds the old bytes, and is acked
            nonlocal got
            try:
                while True:
                    h = FRAME.unpack(recv_exact(data, FRAME.size))
                    chunk = np.frombuffer(recv_exact(data, h[10]), np.uint8)
                    if not np.array_equal(chunk, orig[h[9]:h[9] + h[10]]):
                        wrong.append(h[9])
                    got += h[10]
                    data.sendall(FRAME.pack(KACK, 0, 0, h[3], h[4], 0, 0, 0, 0, 0, 0))
            except (OSError, struct.error):  # closed, or quiet for 5 s
                pass

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        if server.peers():  # not cut off: the read is refused once a chunk finds the region gone
            [(kind, body)] = control_messages(ctl, 1)
            assert kind == KPULL_FAIL and PULL_FAIL.unpack(body) == (5, NOT_FOUND), (kind, body)
        ctl.close()
        try:
            data.shutdown(socket.SHUT_RDWR)  # ends the reader (the server may have closed it already)
        except OSError:
            pass
        reader.join(10)
        assert not wrong, f"chunks at {wrong} carried bytes written after deregister()"
        assert 0 < got < len(src)
    finally:
        ctl.close()
        data.close()
    client = endpoints(name="after")
    peer = client.connect(server.metadata(), timeout=5)
    dst = poisoned(4096)
    peer.read(client.register(dst), server.register(rand_bytes(74, 4096)).descriptor()).wait(T)
    assert_bytes_equal(dst, rand_bytes(74, 4096))


def test_a_pushed_chunk_is_resent_when_its_lane_dies(endpoints):
    """The reader closes one of its two lanes mid-read: the target resends that lane's unacknowledged
    chunks on the other (each pinning the region again), and every byte arrives."""
    server = endpoints(name="server")
    src = rand_bytes(75, 12 * MiB + 3)
    region = server.register(src)
    ctl, lane0, lane1 = raw_peer(server.address, lanes=2)
    try:
        assert wait_until(lambda: len(server.peers()) == 1, 5)
        got = np.zeros(len(src), np.uint8)
        have: set = set()
        lane1.sendall(pull(3, region.descriptor(), 0, len(src)))
        h = FRAME.unpack(recv_exact(lane0, FRAME.size))  # one chunk on lane 0, never acked: then it dies
        assert h[0] == KSEND_DATA, h
        lane0.close()
        while len(have) * h[6] < len(src):
            f = FRAME.unpack(recv_exact(lane1, FRAME.size))
            kind, status, flags, slot, gen, rid, unit, _, _, offset, n = f
            assert (kind, status, rid) == (KSEND_DATA, 0, 3), f
            got[offset:offset + n] = np.frombuffer(recv_exact(lane1, n), np.uint8)
            have.add(offset // unit)
            lane1.sendall(FRAME.pack(KACK, 0, 0, slot, gen, 0, 0, 0, 0, 0, 0))
        assert_bytes_equal(got, src)
        lanes = server.stats()["lanes"]
        assert sum(x["resends"] for x in lanes) >= 1, lanes
    finally:
        for s in (ctl, lane0, lane1):
            s.close()


# --------------------------------------------------------------------------- the initiator's side


def as_gpu(desc: bytes) -> bytes:
    """The same descriptor claiming GPU memory: the initiator pulls what it reads through it."""
    return desc[:DESC_KIND] + b"\x01" + desc[DESC_KIND + 1:]


def test_a_read_of_gpu_memory_goes_as_one_pull(endpoints):
    """The pulled path end to end against a real target: the bytes, one push per read (reads_pushed), no
    request per chunk; cancelled mid-way it ends cancelled or whole and the next read is whole."""
    server = endpoints(name="server")
    client = endpoints(name="client", channels=2, chunk_bytes=64 << 10, transport="tcp")
    n = 8 * MiB + 4321
    src = rand_bytes(81, n)
    desc = as_gpu(server.register(src).descriptor())
    peer = client.connect(server.metadata(), timeout=5)
    dst = poisoned(n + 100)
    region = client.register(dst)
    peer.read(region, desc, local_offset=100).wait(T)
    assert_poison(dst[:100])
    assert_bytes_equal(dst[100:], src)
    assert server.stats()["reads_pushed"] == 1
    # pushed by the target, not answered requests (its counter moves once sendmsg returns: maybe after our wait)
    assert wait_until(lambda: server.stats()["chunks_sent"] >= n // (64 << 10), 5), server.stats()["chunks_sent"]
    t = peer.read(region, desc, local_offset=100)
    cancel_and_wait(t, T)
    dst[:] = 0xEE
    peer.read(region, desc, local_offset=100).wait(T)
    assert_bytes_equal(dst[100:], src)
    pushed = server.stats()["reads_pushed"]
    peer.read(region, server.register(src).descriptor(), local_offset=100).wait(T)  # host memory: requests
    assert server.stats()["reads_pushed"] == pushed


class FakeTarget:
    """A hand-made tcp listener: completes the handshake of a control socket and its data sockets, then
    the test speaks the lanes' frames itself."""

    def __init__(self):
        self.eid, self.host = os.urandom(16), os.urandom(32)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.control, self.lanes, self.error = None, [], None
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _handshake(self, offers: dict) -> tuple[socket.socket, dict, int]:
        conn, _ = self.listener.accept()
        raw = recv_exact(conn, CLIENT_HELLO_SIZE)
        hello = parse_client_hello(raw)
        lane, lanes = struct.unpack_from("<II", raw, 48)
        conn.sendall(server_hello(self.host, offers, endpoint_id=self.eid))
        proof = recv_exact(conn, CLIENT_PROOF_SIZE)
        recv_exact(conn, struct.unpack_from("<I", proof, 52)[0])  # the connector's offer
        conn.sendall(struct.pack("<BBH4x", 0, 0, 0))  # ServerDone: accepted, no NIC list
        return conn, hello, lanes

    def _accept(self):
        try:
            self.control, _, lanes = self._handshake({"tcp": b""})
            self.lanes = [self._handshake({})[0] for _ in range(lanes)]
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def descriptor(self, region_id: int, length: int, key: int) -> bytes:
        return descriptor(self.eid, region_id, length, key, kind=1, device=0)

    def close(self):
        for s in [self.control, *self.lanes, self.listener]:
            if s:
                s.close()


@pytest.fixture
def linked(endpoints):
    """(the hand-made target, an endpoint connected to it over two lanes of 64 KiB chunks, its peer)."""
    target = FakeTarget()
    try:
        client = endpoints(name="client", channels=2, chunk_bytes=64 << 10)
        peer = client.connect(target.address, timeout=5)
        target.thread.join(5)
        assert target.error is None and len(target.lanes) == 2, target.error
        yield target, client, peer
    finally:
        target.close()


def next_frame(socks: list, timeout: float = T) -> tuple[socket.socket, tuple]:
    ready, _, _ = select.select(socks, [], [], timeout)
    assert ready, "no frame came"
    return ready[0], FRAME.unpack(recv_exact(ready[0], FRAME.size))


def test_a_pull_whose_lane_dies_is_sent_again_on_another(linked):
    fake, client, peer = linked
    n, unit = 1 * MiB + 77, 64 << 10
    payload = rand_bytes(82, n)
    dst = poisoned(n)
    t = peer.read(client.register(dst), fake.descriptor(7, n, 0x5A5A))
    first, f = next_frame(fake.lanes)
    kind, status, flags, token, gen, rid, key, doff, dlen, offset, length = f
    assert (kind, status, flags, gen, rid, key, doff, dlen, offset, length) == \
        (KPULL, 0, 0, 0, 7, 0x5A5A, 0, n, 0, n), f
    first.close()  # its lane dies before any byte of the read moved
    other = fake.lanes[1 - fake.lanes.index(first)]
    _, again = next_frame([other])
    assert again == (KPULL, 0, RESENT, token, 0, 7, 0x5A5A, 0, n, 0, n), again
    for i, off in enumerate(range(0, n, unit)):  # the push, as a target's lanes send it
        m = min(unit, n - off)
        other.sendall(FRAME.pack(KSEND_DATA, 0, 0, i, 1, token, unit, 0, 0, off, m) + payload[off:off + m].tobytes())
        _, ack = next_frame([other])
        assert ack[:5] == (KACK, 0, 0, i, 1), ack
    t.wait(T)
    assert_bytes_equal(dst, payload)
    lanes = client.stats()["lanes"]
    assert wait_until(lambda: sum(not x["alive"] for x in client.stats()["lanes"]) == 1, 5), lanes
    assert sum(x["resends"] for x in client.stats()["lanes"]) == 1, client.stats()["lanes"]


def test_data_for_a_cancelled_pull_is_refused_and_lands_nowhere(linked):
    """The reader cancels a pulled read (kPullCancel on the control socket); a target the cancel reached
    too late (it travels on another socket than the kPull) pushes anyway: each chunk is answered with
    kNotFound and no byte of it lands; the read ends cancelled, the peer keeps working."""
    fake, client, peer = linked
    n, unit = 512 << 10, 64 << 10
    dst = poisoned(n)
    t = peer.read(client.register(dst), fake.descriptor(9, n, 0x77))
    lane, f = next_frame(fake.lanes)
    assert f[0] == KPULL, f
    token = f[3]
    t.cancel()
    with pytest.raises(tether.TetherError, match="cancelled"):
        t.wait(T)
    while True:  # the cancel reaches the target: [length u32, type u8, pad 3], heartbeats (1) skipped
        length, kind = struct.unpack("<IB3x", recv_exact(fake.control, 8))
        body = recv_exact(fake.control, length)
        if kind != 1:
            break
    assert (kind, body) == (9, struct.pack("<I", token)), (kind, body)
    lane.sendall(FRAME.pack(KSEND_DATA, 0, 0, 3, 1, token, unit, 0, 0, 0, unit) + bytes([0xAB]) * unit)
    _, ack = next_frame([lane])
    assert ack[:5] == (KACK, 2, 0, 3, 1), ack  # kNotFound: the token is no longer ours
    assert_poison(dst)
    assert all(x["alive"] for x in client.stats()["lanes"]) and len(client.peers()) == 1


def test_a_pull_is_not_held_back_by_a_full_window(linked):
    """Writes the target never answers fill every lane's window of chunks; a pull takes no chunk slot and
    gets no answer, so it still leaves at once."""
    fake, client, peer = linked
    src = client.register(rand_bytes(83, 16 * MiB))
    w = peer.write(src, fake.descriptor(1, 16 * MiB, 0x11))  # 256 chunks: far more than the windows hold
    writes = 0
    while writes < 8:  # the windows are taken (their chunks read and never answered)
        lane, f = next_frame(fake.lanes)
        assert f[0] == 1, f  # kWrite
        recv_exact(lane, f[10])
        writes += 1
    t = peer.read(client.register(poisoned(1 * MiB)), fake.descriptor(2, 1 * MiB, 0x22))
    while True:
        lane, f = next_frame(fake.lanes, timeout=5)
        if f[0] == KPULL:
            break
        assert f[0] == 1, f
        recv_exact(lane, f[10])
    assert f[5:] == (2, 0x22, 0, 1 * MiB, 0, 1 * MiB), f
    t.cancel()
    w.cancel()
