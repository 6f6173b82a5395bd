"""Pulled reads (wire::FrameType::kPull, wire version 8), the initiator's side, on the CPU: a read is pulled
when GPU memory is on either side, which the initiator learns from the descriptor's memory kind. A
descriptor whose kind byte says GPU, for a region the target holds in host memory, takes the whole pulled
path here: the kPull frame leaves on a lane (from the posting thread where one is free), the target pushes
the range as kSendData, cancel stops it. A hand-made target closes the lane its kPull came on before
pushing anything: the initiator sends the kPull again, flagged resent, on the surviving lane, and the read
completes byte for byte. Data a target pushes after the read was cancelled is refused and lands nowhere;
a pull leaves even while unanswered writes fill every lane's window.
The target's side is test_pull.py; GPU memory on the device, test_gpu.py."""
from __future__ import annotations

import os
import select
import socket
import struct
import threading

import pytest

import tether
from tether_testutil.data import MiB, assert_bytes_equal, assert_poison, poisoned, rand_bytes, wait_until
from tether_testutil.sockets import recv_exact
from tether_testutil.wire import (
    CLIENT_HELLO_SIZE, CLIENT_PROOF_SIZE, DESC_KIND, FRAME, KACK, descriptor, parse_client_hello, server_hello,
)

KSEND_DATA, KPULL = 5, 8     # wire::FrameType
RESENT = 1                   # wire::kFlagResent
T = 10


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
    t.cancel()
    try:
        t.wait(T)
    except tether.TetherError as e:
        assert "cancelled" in str(e), e
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
