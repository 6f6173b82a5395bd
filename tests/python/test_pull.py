"""Pulled reads (wire::FrameType::kPull, wire version 8), the target's side, from a hand-made peer: a large
tcp read with GPU memory on either side is asked for in one kPull frame on a lane and the target pushes it
as kSendData chunks. Every check a kReadReq header meets applies to the kPull; a refusal comes back as
kPullFail (control) with the tether::Code; a malformed one drops that peer only; a kPull sent again after
its lane died (kFlagResent) is ignored while its token is pushed; a region deregistered while a reader
that does not take its bytes holds a pushed chunk is let go after deregister_timeout_ms, that peer cut off.
The initiator's side: test_pull_initiator.py (CPU) and test_gpu.py."""
from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from tether_testutil.data import MiB, assert_bytes_equal, poisoned, rand_bytes, wait_until
from tether_testutil.sockets import assert_drops_only_that_peer, raw_peer, recv_exact
from tether_testutil.wire import FRAME, KACK, KPULL, pull

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
