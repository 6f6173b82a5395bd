"""Correctness of one-sided (write/read/writev/readv) and two-sided (send/recv) transfers and of
notifications between two endpoints of one process, in every configuration of `pair`; lanes, windows,
statistics and registration forms. Between two real processes: test_cross_process.py.

Every test uses random data, poisons destinations first, and checks every byte, including the
bytes around the written ranges (which must stay poison).
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import tether
from tether_testutil.data import (
    KiB, MiB, assert_bytes_equal, assert_poison, disjoint_blocks, poisoned, rand_bytes, wait_error, wait_until,
)

SIZES = [1, 4 * KiB + 3, 1 * MiB, 64 * MiB]
SIZE_IDS = ["1B", "4KiB+3", "1MiB", "64MiB"]
T = 20.0  # generous bound for any single wait()


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
def test_write_then_read_back(pair, size):
    a, b, peer = pair
    lo, ro, pad = 5, 11, 9  # non-zero local and remote offsets, and bytes past the end
    src = rand_bytes(size, size + lo + pad)
    dst = poisoned(size + ro + pad)
    rs, rd = a.register(src), b.register(dst)

    t = peer.write(rs, rd.descriptor(), local_offset=lo, remote_offset=ro, length=size)
    t.wait(T)
    assert t.status == "ok" and t.error is None and t.bytes == size
    assert_bytes_equal(dst[ro:ro + size], src[lo:lo + size], "written range")
    assert_poison(dst[:ro], "bytes before the written range")
    assert_poison(dst[ro + size:], "bytes after the written range")

    back = poisoned(size + 7 + pad)
    rb = a.register(back)
    t = peer.read(rb, rd.descriptor(), local_offset=7, remote_offset=ro, length=size)
    t.wait(T)
    assert t.status == "ok" and t.bytes == size
    assert_bytes_equal(back[7:7 + size], src[lo:lo + size], "read range")
    assert_poison(back[:7], "bytes before the read range")
    assert_poison(back[7 + size:], "bytes after the read range")


def test_sub_descriptor_offsets_are_relative(pair):
    """remote_offset is relative to the descriptor's own offset."""
    a, b, peer = pair
    src = rand_bytes(1, 5000)
    dst = poisoned(20000)
    rs, rd = a.register(src), b.register(dst)
    desc = rd.descriptor(offset=3001, length=9000)
    peer.write(rs, desc, local_offset=17, remote_offset=333, length=4000).wait(T)
    assert_bytes_equal(dst[3334:7334], src[17:4017])
    assert_poison(dst[:3334])
    assert_poison(dst[7334:])
    # Default length: the rest of the local region, which must fit from remote_offset on; a local
    # region longer than what is left of the range fails whole (it used to move what fitted).
    big = rand_bytes(2, 9000)
    e = wait_error(peer.write(a.register(big), desc, remote_offset=8000), T)
    assert isinstance(e, tether.OutOfRange) and "remote range [8000, +9000)" in str(e), repr(e)
    assert_poison(dst[7334:])
    t = peer.write(a.register(big), desc, remote_offset=8000, local_offset=8000)
    t.wait(T)
    assert t.bytes == 1000
    assert_bytes_equal(dst[11001:12001], big[8000:])
    assert_poison(dst[12001:])


def test_zero_length_write_and_read(pair):
    a, b, peer = pair
    src, dst, sink = rand_bytes(3, 64), poisoned(64), poisoned(64)
    rs, rd, rk = a.register(src), b.register(dst), a.register(sink)
    for t in (peer.write(rs, rd.descriptor(), remote_offset=64, length=0),
              peer.read(rk, rd.descriptor(), remote_offset=64, length=0),
              peer.write(rs, rd.descriptor(), local_offset=64)):  # default length: 0 left of the local region
        t.wait(T)
        assert t.status == "ok" and t.bytes == 0
    assert_poison(dst)
    assert_poison(sink)


def _scatter(rng, a, b, peer, n, lo, hi, gap_max):
    """writev n entries from two local regions to two remote descriptors (a whole-region one and a
    sub-range one), local and remote layouts shuffled independently; then readv them back."""
    remote_layout, remote_size = disjoint_blocks(rng, n, lo, hi, gap_max)
    sizes = [s for _, s in remote_layout]
    perm = rng.permutation(n)  # local order differs from remote order
    local_layout, off = [None] * n, 3
    for i in perm:
        local_layout[i] = off
        off += sizes[i] + int(rng.integers(0, gap_max))
    src = [rand_bytes(int(rng.integers(1 << 30)), off + 5) for _ in range(2)]
    dst = poisoned(remote_size + 4096)
    rsrc = [a.register(s) for s in src]
    rd = b.register(dst)
    base = 1000  # the sub-range descriptor starts here
    whole, sub = rd.descriptor(), None
    # Shift the remote layout by `base` so both descriptors can address every entry.
    sub = rd.descriptor(offset=base, length=remote_size + 4096 - base)
    entries, expected = [], poisoned(dst.size)
    for i, (roff, size) in enumerate(remote_layout):
        roff += base
        which = i % 2
        loff = local_layout[i]
        if i % 3 == 0:
            entries.append((rsrc[which], loff, sub, roff - base, size))
        else:
            entries.append((rsrc[which], loff, whole, roff, size))
        expected[roff:roff + size] = src[which][loff:loff + size]
    t = peer.writev(entries)
    t.wait(T)
    assert t.status == "ok"
    assert t.bytes == sum(sizes)
    assert_bytes_equal(dst, expected, "remote buffer after writev (entries and gaps)")

    # readv the same ranges into a fresh poisoned buffer, in a third layout.
    back = poisoned(sum(sizes) + 2 * n + 10)
    rb = a.register(back)
    read_entries, off, expected_back = [], 1, poisoned(back.size)
    for i in rng.permutation(n):
        _, _, desc, roff, size = entries[i]
        read_entries.append((rb, off, desc, roff, size))
        absolute = roff + (base if desc is sub else 0)
        expected_back[off:off + size] = dst[absolute:absolute + size]
        off += size + 2
    t = peer.readv(read_entries)
    t.wait(T)
    assert t.status == "ok" and t.bytes == sum(sizes)
    assert_bytes_equal(back, expected_back, "local buffer after readv (entries and gaps)")


def test_writev_readv_128_odd_entries(pair):
    a, b, peer = pair
    _scatter(np.random.default_rng(128), a, b, peer, 128, 1, 40000, 4000)


def test_writev_readv_1000_tiny_entries(pair):
    a, b, peer = pair
    _scatter(np.random.default_rng(1000), a, b, peer, 1000, 1, 4, 3)


def test_writev_entries_larger_than_chunk(endpoints):
    """Entries of several chunks each (chunk 64 KiB, window 4): segments split across lanes."""
    a = endpoints(chunk_bytes=64 * KiB, window=4, channels=4)
    b = endpoints()
    peer = a.connect(b.metadata(), timeout=5)
    _scatter(np.random.default_rng(7), a, b, peer, 12, 100 * KiB, 700 * KiB, 5000)


@pytest.mark.parametrize("opts", [dict(window=1, chunk_bytes=4096, channels=1),
                                  dict(window=2, chunk_bytes=4099, channels=6)],
                         ids=["window1-chunk4k", "window2-chunk4099-6lanes"])
def test_small_window_odd_chunk(endpoints, opts):
    a, b = endpoints(**opts), endpoints()
    peer = a.connect(b.metadata(), timeout=5)
    src, dst = rand_bytes(9, 3 * MiB + 1), poisoned(3 * MiB + 10)
    peer.write(a.register(src), b.register(dst).descriptor(), remote_offset=4, length=src.size).wait(T)
    assert_bytes_equal(dst[4:4 + src.size], src)
    assert_poison(dst[:4])
    assert_poison(dst[4 + src.size:])


def test_many_async_writes_from_threads(pair):
    """4 threads x 50 async writes to disjoint ranges, all in flight together, then verify."""
    a, b, peer = pair
    threads_n, per_thread, slot = 4, 50, 40 * KiB
    rng = np.random.default_rng(4)
    sizes = (rng.integers(1, slot - 8, (threads_n, per_thread)) | 1).tolist()
    src = rand_bytes(44, threads_n * per_thread * slot)
    dst = poisoned(src.size)
    rs, rd = a.register(src), b.register(dst)
    desc = rd.descriptor()
    transfers = [[] for _ in range(threads_n)]
    barrier = threading.Barrier(threads_n)
    errors = []

    def worker(k):
        try:
            barrier.wait(5)
            for i in range(per_thread):
                off = (k * per_thread + i) * slot + 3
                # local and remote offsets differ: local is shifted by one slot (mod the buffer)
                loff = (off + slot) % (src.size - slot)
                transfers[k].append((peer.write(rs, desc, local_offset=loff, remote_offset=off,
                                                 length=sizes[k][i]), loff, off, sizes[k][i]))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ths = [threading.Thread(target=worker, args=(k,)) for k in range(threads_n)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(20)
    assert not errors, errors
    expected = poisoned(dst.size)
    for k in range(threads_n):
        assert len(transfers[k]) == per_thread
        for t, loff, off, n in transfers[k]:
            t.wait(T)
            assert t.status == "ok" and t.bytes == n
            expected[off:off + n] = src[loff:loff + n]
    assert_bytes_equal(dst, expected, "destination after 200 concurrent writes")


def test_concurrent_reads_and_writes_from_threads(pair):
    """2 threads write into one half, 2 threads read the other (pre-filled) half, concurrently."""
    a, b, peer = pair
    half = 8 * MiB
    remote = poisoned(2 * half)
    remote[half:] = rand_bytes(5, half)
    rr = b.register(remote)
    src = rand_bytes(6, half)
    rs = a.register(src)
    sink = poisoned(half)
    rk = a.register(sink)
    desc = rr.descriptor()
    piece = 64 * KiB + 1
    errors = []

    def writer(k):
        try:
            ts = [peer.write(rs, desc, local_offset=o, remote_offset=o, length=min(piece, half - o))
                  for o in range(k * piece, half, 2 * piece)]
            for t in ts:
                t.wait(T)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def reader(k):
        try:
            ts = [peer.read(rk, desc, local_offset=o, remote_offset=half + o, length=min(piece, half - o))
                  for o in range(k * piece, half, 2 * piece)]
            for t in ts:
                t.wait(T)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ths = [threading.Thread(target=f, args=(k,)) for f in (writer, reader) for k in (0, 1)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(30)
    assert not errors, errors
    assert_bytes_equal(remote[:half], src, "written half")
    assert_bytes_equal(sink, remote[half:], "read half")


# --------------------------------------------------------------------------- send / recv


def test_send_recv_out_of_order_tags(pair):
    a, b, peer = pair
    bp = _accepted(b)
    msgs = {tag: rand_bytes(tag, 1000 * tag + 1) for tag in (1, 2, 3)}
    sends = [peer.send(a.register(m), tag=tag) for tag, m in msgs.items()]
    bufs = {tag: poisoned(10000) for tag in msgs}
    # recvs posted after the sends, in a different order than the sends
    recvs = {tag: bp.recv(b.register(bufs[tag]), offset=5, tag=tag) for tag in (3, 1, 2)}
    for t in sends:
        t.wait(T)
    for tag, t in recvs.items():
        t.wait(T)
        n = msgs[tag].size
        assert t.bytes == n
        assert_bytes_equal(bufs[tag][5:5 + n], msgs[tag], f"message tag {tag}")
        assert_poison(bufs[tag][:5])
        assert_poison(bufs[tag][5 + n:])


def test_recv_posted_before_send_and_fifo_per_tag(pair):
    a, b, peer = pair
    bp = _accepted(b)
    r1, r2 = poisoned(5000), poisoned(5000)
    t1 = bp.recv(b.register(r1), tag=7)
    t2 = bp.recv(b.register(r2), tag=7)
    assert not t1.done()
    m1, m2 = rand_bytes(71, 3000), rand_bytes(72, 4000)
    s1 = peer.send(a.register(m1), tag=7)
    s2 = peer.send(a.register(m2), tag=7)
    for t in (s1, s2, t1, t2):
        t.wait(T)
    # same tag: matched in posting order
    assert t1.bytes == 3000 and t2.bytes == 4000
    assert_bytes_equal(r1[:3000], m1)
    assert_poison(r1[3000:])
    assert_bytes_equal(r2[:4000], m2)
    assert_poison(r2[4000:])


def test_send_recv_both_directions_and_large(pair):
    """A 16 MiB message (many chunks) each way; the accepted side sends too."""
    a, b, peer = pair
    bp = _accepted(b)
    m_ab, m_ba = rand_bytes(81, 16 * MiB + 3), rand_bytes(82, 16 * MiB - 3)
    in_b, in_a = poisoned(17 * MiB), poisoned(17 * MiB)
    rb = bp.recv(b.register(in_b), offset=1, tag=99)
    ra = peer.recv(a.register(in_a), tag=98)
    sa = peer.send(a.register(m_ab), tag=99)
    sb = bp.send(b.register(m_ba), tag=98)
    for t in (sa, sb, ra, rb):
        t.wait(T)
    assert rb.bytes == m_ab.size and ra.bytes == m_ba.size
    assert_bytes_equal(in_b[1:1 + m_ab.size], m_ab)
    assert_poison(in_b[1 + m_ab.size:])
    assert_bytes_equal(in_a[:m_ba.size], m_ba)
    assert_poison(in_a[m_ba.size:])


def test_zero_length_message(pair):
    a, b, peer = pair
    bp = _accepted(b)
    buf = poisoned(100)
    r = bp.recv(b.register(buf), tag=5)
    s = peer.send(a.register(rand_bytes(1, 10)), length=0, tag=5)
    s.wait(T)
    r.wait(T)
    assert r.status == "ok" and r.bytes == 0 and s.bytes == 0
    assert_poison(buf)
    # posted after the send, too
    s = peer.send(a.register(rand_bytes(1, 10)), offset=10, length=0, tag=6)
    r = bp.recv(b.register(buf), tag=6)
    s.wait(T)
    r.wait(T)
    assert r.bytes == 0
    assert_poison(buf)


@pytest.mark.parametrize("recv_first", [True, False], ids=["recv-first", "send-first"])
def test_message_larger_than_recv_is_truncated_on_both_sides(pair, recv_first):
    a, b, peer = pair
    bp = _accepted(b)
    buf = poisoned(1000)
    rb = b.register(buf)
    msg = a.register(rand_bytes(3, 1001))
    if recv_first:
        r = bp.recv(rb, length=999, tag=1)
        s = peer.send(msg, tag=1)
    else:
        s = peer.send(msg, tag=1)
        r = bp.recv(rb, length=999, tag=1)
    assert isinstance(wait_error(s), tether.Truncated)
    assert isinstance(wait_error(r), tether.Truncated)
    assert_poison(buf, "recv buffer after a truncated message")
    # The link still works afterwards, on the same tag.
    ok = rand_bytes(4, 999)
    r = bp.recv(rb, length=999, tag=1)
    peer.send(a.register(ok), tag=1).wait(T)
    r.wait(T)
    assert r.bytes == 999
    assert_bytes_equal(buf[:999], ok)


# --------------------------------------------------------------------------- notifications


def test_write_notify_arrives_after_data_with_sender_name(pair):
    a, b, peer = pair
    src, dst = rand_bytes(11, 8 * MiB + 5), poisoned(8 * MiB + 5)
    rs, rd = a.register(src), b.register(dst)
    t = peer.write(rs, rd.descriptor(), notify=b"data-ready\x00\xff")
    notes = b.notifications(timeout=T)
    # Whenever the notification is visible, the data must be complete.
    assert_bytes_equal(dst, src, "data when its notification arrived")
    t.wait(T)
    assert len(notes) == 1
    n = notes[0]
    assert isinstance(n, tether.Notification)
    assert n.data == b"data-ready\x00\xff"
    assert n.peer_name == "ep-a"
    assert wait_until(lambda: len(b.peers()) == 1, 5)
    assert n.peer_id == b.peers()[0].id
    assert b.notifications() == []  # consumed


@pytest.mark.parametrize("form", ["read", "readv", "readv_blocks"])
def test_read_notify_reaches_the_target_after_every_byte_arrived(pair, form):
    """A read's notification tells the target its memory was read: it is sent once the last byte is
    in the reader's memory, so whenever the target sees it, the reader's copy is complete."""
    a, b, peer = pair
    n = 6 * MiB + 3
    src, dst = rand_bytes(14, n), poisoned(n)
    rd, rs = a.register(dst), b.register(src)
    desc = rs.descriptor()
    if form == "read":
        t = peer.read(rd, desc, notify=b"read-done")
    elif form == "readv":
        t = peer.readv([(rd, 0, desc, 0, n // 2), (rd, n // 2, desc, n // 2, n - n // 2)], notify=b"read-done")
    else:
        t = peer.readv_blocks(rd, desc, [n // 2, 0], [n // 2, 0], [n - n // 2, n // 2], notify=b"read-done")
    notes = b.notifications(timeout=T)
    assert [(x.peer_name, x.data) for x in notes] == [("ep-a", b"read-done")]
    assert_bytes_equal(dst, src, "the reader's copy when the target got the notification")
    t.wait(T)
    assert b.notifications() == []


def test_writev_notify_and_standalone_notify_in_order(pair):
    a, b, peer = pair
    src, dst = rand_bytes(12, 50000), poisoned(50000)
    rs, rd = a.register(src), b.register(dst)
    desc = rd.descriptor()
    t = peer.writev([(rs, i * 1000, desc, i * 1000, 999) for i in range(50)], notify=b"v")
    got = b.notifications(timeout=T)
    for i in range(50):
        assert_bytes_equal(dst[i * 1000:i * 1000 + 999], src[i * 1000:i * 1000 + 999])
    t.wait(T)
    assert [n.data for n in got] == [b"v"]
    ts = [peer.notify(b"n%03d" % i) for i in range(30)]
    for t in ts:
        t.wait(T)
    notes = []
    assert wait_until(lambda: notes.extend(b.notifications(timeout=0.05)) or len(notes) >= 30, 10)
    assert [n.data for n in notes] == [b"n%03d" % i for i in range(30)]
    assert {n.peer_name for n in notes} == {"ep-a"}


def test_notify_size_limits(pair):
    a, b, peer = pair
    biggest = bytes(rand_bytes(13, 1 << 20))  # notify_max_bytes, by default 1 MiB (a peer's bound)
    peer.notify(biggest).wait(T)
    got = b.notifications(timeout=T)
    assert len(got) == 1 and got[0].data == biggest
    assert isinstance(wait_error(peer.notify(biggest + b"x")), tether.InvalidArgument)
    assert isinstance(wait_error(peer.read(a.register(poisoned(8)), b.register(poisoned(8)).descriptor(),
                                           notify=biggest + b"x")), tether.InvalidArgument)
    empty = peer.notify(b"")
    empty.wait(T)
    got = b.notifications(timeout=T)
    assert [n.data for n in got] == [b""]


def test_accepted_peer_writes_and_reads_back(pair):
    a, b, peer = pair
    bp = _accepted(b)
    assert bp.name == "ep-a" and bp.connected
    assert peer.name == "ep-b"
    mine = poisoned(3 * MiB)
    ra = a.register(mine)
    theirs = rand_bytes(21, 3 * MiB)
    rb = b.register(theirs)
    bp.write(rb, ra.descriptor(), remote_offset=1, length=3 * MiB - 1).wait(T)
    assert_bytes_equal(mine[1:], theirs[:-1])
    assert_poison(mine[:1])
    sink = poisoned(3 * MiB)
    bp.read(b.register(sink), ra.descriptor()).wait(T)
    assert_bytes_equal(sink, mine)
    bp.notify(b"from-b").wait(T)
    notes = a.notifications(timeout=T)
    assert [(n.peer_name, n.data) for n in notes] == [("ep-b", b"from-b")]
    assert notes[0].peer_id == peer.id


def _accepted(ep, n=1):
    assert wait_until(lambda: len(ep.peers()) >= n, 5), "the accepted peer never appeared in peers()"
    return ep.peers()[-1]


@pytest.mark.parametrize("ca,cb", [
    (dict(channels=4), dict(channels=3)),
    (dict(channels=8, window=3), dict(channels=1)),
    (dict(channels=1), dict(channels=16, chunk_bytes=4096)),
], ids=["4-to-3", "8w3-to-1", "1-to-16"])
def test_asymmetric_configurations_both_directions(endpoints, ca, cb):
    """Lanes are decided by the connector; the acceptor spreads them over its own threads."""
    a, b = endpoints(name="a", **ca), endpoints(name="b", **cb)
    peer = a.connect(b.metadata(), timeout=5)
    n = 6 * MiB + 7
    src, dst = rand_bytes(1, n), poisoned(n)
    rs, rd = a.register(src), b.register(dst)
    peer.write(rs, rd.descriptor()).wait(T)
    assert_bytes_equal(dst, src)
    bp = _accepted(b)
    back, src2 = poisoned(n), rand_bytes(2, n)
    bp.read(b.register(back), rs.descriptor()).wait(T)
    assert_bytes_equal(back, src)
    landing = poisoned(n)
    bp.write(b.register(src2), a.register(landing).descriptor()).wait(T)
    assert_bytes_equal(landing, src2)


def test_huge_window_many_tiny_entries(endpoints):
    """window=100000 on one lane: thousands of requests in flight at once, so the target's answer
    queue fills, its lane pauses reading and must resume as soon as answers drain."""
    # Regression (fixed): with a window above ~1000 chunks per lane, a readv/writev of 3000 two-byte entries takes
    # seconds instead of ~10 ms: the target lane pauses rx when its answer ring (512) is full, then
    # sends everything and goes to sleep in epoll_wait(1000 ms) with rx still paused (EPOLLIN off,
    # no EPOLLOUT, no wake-up), so every ~1000 requests cost a 1 s stall. Seen with the .so built
    # from the working tree at 13:54 (AnswerRing / inline-send change in tcp_transport.cc); the
    # previous build finished 20000 entries in 0.03 s. Repro: Endpoint(window=4096, channels=1) on
    # both sides, peer.readv([(local, 3*i, desc, 3*i, 2) for i in range(5000)]) -> ~8 s.
    a, b = endpoints(window=100000, channels=1), endpoints(window=100000, channels=1)
    peer = a.connect(b.metadata(), timeout=5)
    n = 3000
    remote = rand_bytes(5, 3 * n)
    original = remote.copy()
    d = b.register(remote).descriptor()
    local = poisoned(3 * n)
    t0 = time.monotonic()
    t = peer.readv([(a.register(local), 3 * i, d, 3 * i + 1, 2) for i in range(n)])
    try:
        t.wait(2.0)
    except tether.TransferTimeout:
        pytest.fail(f"readv of {n} tiny entries (window=100000) still running after 2 s; normal: ~10 ms")
    read_s = time.monotonic() - t0
    expected = poisoned(3 * n)
    for k in (0, 1):
        expected[k::3] = original[1 + k::3]
    assert_bytes_equal(local, expected)
    src = rand_bytes(6, 3 * n)
    rs = a.register(src)
    t0 = time.monotonic()
    t = peer.writev([(rs, 3 * i, d, 3 * i, 1) for i in range(n)])
    try:
        t.wait(2.0)
    except tether.TransferTimeout:
        pytest.fail(f"writev of {n} tiny entries (window=100000) still running after 2 s; normal: ~10 ms")
    write_s = time.monotonic() - t0
    assert_bytes_equal(remote[0::3], src[0::3])
    assert_bytes_equal(remote[1::3], original[1::3], "bytes between the written ones")
    assert_bytes_equal(remote[2::3], original[2::3], "bytes between the written ones")
    print(f"\n{n} tiny entries with window=100000: readv {read_s * 1e3:.1f} ms, writev {write_s * 1e3:.1f} ms")


def test_self_connect(endpoints):
    ep = endpoints(name="selfie")
    peer = ep.connect(ep.metadata(), timeout=5)
    src, dst = rand_bytes(7, 2 * MiB), poisoned(2 * MiB + 1)
    peer.write(ep.register(src), ep.register(dst).descriptor(), remote_offset=1).wait(T)
    assert_bytes_equal(dst[1:], src)
    assert_poison(dst[:1])
    peer.notify(b"me").wait(T)
    assert [(n.peer_name, n.data) for n in ep.notifications(timeout=T)] == [("selfie", b"me")]
    assert sorted(p.name for p in ep.peers()) == ["selfie", "selfie"]


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_stats_count_bytes_exactly(endpoints, transport):
    a, b = endpoints(chunk_bytes=1 * MiB, transport=transport, ipc_host="cma"), endpoints()
    peer = a.connect(b.metadata(), timeout=5)
    assert peer.transport == transport
    # chunks b served over ipc, all by cross-memory attach: writes b read, the read a read out of b
    # ipc: three 1 MiB chunks read by attach and the last 5 bytes carried in their request; the
    # 1000-byte read is moved by A itself, as the 5-byte write's answer granted it that descriptor
    # (one-sided small ops, test_one_sided.py), so B never sees that read
    cma, shm, inline = (3, 0, 1) if transport == "ipc" else (0, 0, 0)
    one_sided = 1 if transport == "ipc" else 0
    n = 3 * MiB + 5
    src, dst = rand_bytes(8, n), poisoned(n)
    rs, rd = a.register(src), b.register(dst)
    a0, b0 = a.stats(), b.stats()
    scalars = {"bytes_sent", "bytes_received", "chunks_sent", "chunks_received",
               "transfers_completed", "transfers_failed", "rejected_requests", "reads_pushed", "ipc_cma_chunks", "ipc_shm_chunks",
               "ipc_inline_chunks", "ipc_cuda_chunks", "ipc_cuda_opens", "ipc_one_sided_chunks"}
    assert set(a0) == scalars | {"nics", "lanes"}
    peer.write(rs, rd.descriptor()).wait(T)
    peer.read(a.register(poisoned(1000)), rd.descriptor(), length=1000).wait(T)

    def delta(ep, base):
        s = ep.stats()
        return {k: s[k] - base[k] for k in scalars}

    want_a = {"bytes_sent": n, "bytes_received": 1000, "chunks_sent": 4, "chunks_received": 1,
              "transfers_completed": 2, "transfers_failed": 0, "rejected_requests": 0, "reads_pushed": 0,
              "ipc_cma_chunks": 0, "ipc_shm_chunks": 0, "ipc_inline_chunks": 0, "ipc_cuda_chunks": 0,
              "ipc_cuda_opens": 0, "ipc_one_sided_chunks": one_sided}
    want_b = {"bytes_sent": 1000 - 1000 * one_sided, "bytes_received": n, "chunks_sent": 1 - one_sided, "chunks_received": 4,
              "transfers_completed": 0, "transfers_failed": 0, "rejected_requests": 0, "reads_pushed": 0,
              "ipc_cma_chunks": cma, "ipc_shm_chunks": shm, "ipc_inline_chunks": inline, "ipc_cuda_chunks": 0,
              "ipc_cuda_opens": 0, "ipc_one_sided_chunks": 0}
    assert wait_until(lambda: delta(a, a0) == want_a and delta(b, b0) == want_b, 2), (delta(a, a0), delta(b, b0))
    # per channel (lane) and per NIC: the same bytes, split by where they went (loopback here; tcp lanes)
    for ep, sent, received, chunks in ((a, n, 1000, 4), (b, 1000, n, 1)) if transport == "tcp" else ():
        lanes = ep.stats()["lanes"]
        assert len(lanes) == 4 and all(l["alive"] and l["local_nic"] == "lo" for l in lanes), lanes
        assert sum(l["bytes_sent"] for l in lanes) == sent and sum(l["bytes_received"] for l in lanes) == received
        assert sum(l["chunks_sent"] for l in lanes) == chunks
        assert sum(l["errors"] + l["resends"] for l in lanes) == 0
        # where the lanes' time went: inside sendmsg and recv; no GPU staging with host memory
        assert sum(l["send_s"] for l in lanes) > 0 and sum(l["recv_s"] for l in lanes) > 0, lanes
        assert all(l["staging_s"] == 0 and l["staging_slots_peak"] == 0 for l in lanes), lanes
        lo = [x for x in ep.stats()["nics"] if x["name"] == "lo"]
        assert lo and lo[0]["bytes_sent"] >= sent, ep.stats()["nics"]
    bad = bytearray(rd.descriptor())
    bad[48] ^= 1
    wait_error(peer.write(rs, bytes(bad), length=10))
    assert wait_until(lambda: delta(b, b0)["rejected_requests"] == 1 and delta(a, a0)["transfers_failed"] == 1, 2)


def test_tags_extremes_and_many_unexpected_messages(pair):
    a, b, peer = pair
    bp = _accepted(b)
    rng = np.random.default_rng(9)
    tags = [0, 1, (1 << 64) - 1]
    msgs = {tag: [rand_bytes(int(rng.integers(1 << 30)), int(rng.integers(1, 3000))) for _ in range(40)]
            for tag in tags}
    # all sends first (they wait as unexpected messages), interleaved across tags
    sends = [peer.send(a.register(msgs[tag][i]), tag=tag) for i in range(40) for tag in tags]
    # recvs per tag in FIFO order, tags interleaved differently
    boxes = {tag: [poisoned(3000) for _ in range(40)] for tag in tags}
    recvs = [(tag, i, bp.recv(b.register(boxes[tag][i]), tag=tag)) for tag in reversed(tags) for i in range(40)]
    for t in sends:
        t.wait(T)
    for tag, i, t in recvs:
        t.wait(T)
        m = msgs[tag][i]
        assert t.bytes == m.size, f"tag {tag} #{i}: got {t.bytes} bytes, expected {m.size} (FIFO per tag)"
        assert_bytes_equal(boxes[tag][i][:m.size], m, f"tag {tag} message {i}")
        assert_poison(boxes[tag][i][m.size:])


def test_registration_forms(endpoints):
    a, b = endpoints(), endpoints()
    peer = a.connect(b.metadata(), timeout=5)
    src = rand_bytes(10, 4096)
    rs = a.register(src)
    # bytearray, memoryview, 2-D float array, (pointer, nbytes)
    ba = bytearray(4096)
    mv_target = poisoned(4096)
    f2 = np.zeros((16, 32), dtype=np.float64)  # 4096 bytes
    raw = poisoned(4096)
    targets = [(b.register(ba), lambda: np.frombuffer(ba, dtype=np.uint8)),
               (b.register(memoryview(mv_target)), lambda: mv_target),
               (b.register(f2), lambda: f2.view(np.uint8).reshape(-1)),
               (b.register((raw.ctypes.data, raw.nbytes)), lambda: raw)]
    for region, view in targets:
        assert region.size == 4096 and not region.readonly and region.kind == "host"
        peer.write(rs, region.descriptor()).wait(T)
        assert_bytes_equal(view(), src, f"target registered as {type(region)}")
    ro = b.register((raw.ctypes.data, raw.nbytes), readonly=True)
    assert ro.readonly
    assert isinstance(wait_error(peer.write(rs, ro.descriptor())), tether.AccessDenied)
    with pytest.raises(tether.InvalidArgument):
        b.register(np.zeros(0, np.uint8))
    with pytest.raises(tether.InvalidArgument):
        b.register(np.zeros((8, 8), np.uint8)[:, ::2])  # not contiguous
    with pytest.raises(tether.InvalidArgument):
        b.register(object())
    with pytest.raises(tether.InvalidArgument):
        b.register((0, 100))  # null pointer
    region = b.register(poisoned(100))
    with pytest.raises(tether.OutOfRange):
        region.descriptor(offset=101)
    with pytest.raises(tether.OutOfRange):
        region.descriptor(offset=50, length=51)
    assert tether.RemoteRegion(region.descriptor(offset=100)).length == 0


@pytest.mark.parametrize("socket_buffer", [4096, 16384, 0], ids=["4KiB", "16KiB", "kernel-default"])
def test_socket_buffer_sizes(endpoints, socket_buffer):
    # Regression (socket_buffer=4096, fixed: buffers are now sized before connect/listen): with a small socket_buffer, a 1 MiB write (one chunk) never completes
    # (stalls indefinitely; 100 KB takes ~0.7 s). tune_data_socket() sets SO_RCVBUF/SO_SNDBUF on data
    # sockets *after* connect()/accept(); shrinking SO_RCVBUF on an established connection makes
    # Linux drop in-window segments, and retransmission backoff stalls the stream (tcp(7): buffer
    # sizes must be set before listen()/connect()). Plain Python sockets with setsockopt after
    # connect show the same stall. Repro: Endpoint(socket_buffer=4096, channels=1) on both sides,
    # peer.write(src_1MiB, desc).wait(3) -> TransferTimeout; bytes_sent stays 0.
    a = endpoints(socket_buffer=socket_buffer, channels=1)
    b = endpoints(socket_buffer=socket_buffer, channels=1)
    peer = a.connect(b.metadata(), timeout=5)
    src, dst = rand_bytes(3, 1 * MiB), poisoned(1 * MiB)
    rs, rd = a.register(src), b.register(dst)
    t = peer.write(rs, rd.descriptor())
    try:
        t.wait(3.0)
    except tether.TransferTimeout:
        pytest.fail(f"1 MiB write with socket_buffer={socket_buffer} still running after 3 s")
    assert_bytes_equal(dst, src)
    back = poisoned(1 * MiB)
    t = peer.read(a.register(back), rd.descriptor())
    try:
        t.wait(3.0)
    except tether.TransferTimeout:
        pytest.fail(f"1 MiB read with socket_buffer={socket_buffer} still running after 3 s")
    assert_bytes_equal(back, src)


def test_many_small_blocks_batched_every_byte(pair_ab=None):
    """Thousands of small blocks (1 B .. 20 KiB, shuffled) in one writev and one readv: writes travel
    as batched frames (many fragments per chunk, each checked by the target), reads as chunks."""
    rng = np.random.default_rng(11)
    sizes = rng.integers(1, 20 * 1024, 3000)
    total = int(sizes.sum())
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    order = rng.permutation(len(sizes))
    remote_offs = np.empty_like(offs)
    acc = 0
    for i in order:  # blocks land in a shuffled order at the target
        remote_offs[i] = acc
        acc += sizes[i]
    with tether.Endpoint() as a, tether.Endpoint() as b:
        peer = a.connect(b.metadata(), timeout=5)
        src = rand_bytes(77, total)
        dst = poisoned(total + 64)
        rs, rd = a.register(src), b.register(dst)
        d = rd.descriptor()
        entries = [(rs, int(offs[i]), d, int(remote_offs[i]), int(sizes[i])) for i in range(len(sizes))]
        peer.writev(entries, notify=b"kv").wait(30)
        expect = np.empty(total, np.uint8)
        for i in range(len(sizes)):
            expect[remote_offs[i]:remote_offs[i] + sizes[i]] = src[offs[i]:offs[i] + sizes[i]]
        assert_bytes_equal(dst[:total], expect)
        assert_poison(dst[total:])
        back = poisoned(total)
        rb = a.register(back)
        peer.readv([(rb, int(offs[i]), d, int(remote_offs[i]), int(sizes[i])) for i in range(len(sizes))]).wait(30)
        assert_bytes_equal(back, src)
        assert b.notifications(timeout=5)[0].data == b"kv"


def test_batch_with_one_refused_fragment_writes_nothing_of_it():
    """A batch whose table names a deregistered region is refused whole: no fragment of it lands."""
    with tether.Endpoint(chunk_bytes=1 << 20, transport="tcp") as a, tether.Endpoint() as b:
        peer = a.connect(b.metadata(), timeout=5)
        src = rand_bytes(5, 64 * 1024)
        good, gone = poisoned(64 * 1024), poisoned(4096)
        rs, rg, rgone = a.register(src), b.register(good), b.register(gone)
        dg, dgone = rg.descriptor(), rgone.descriptor()
        b.deregister(rgone)
        entries = [(rs, i * 1024, dg, i * 1024, 1024) for i in range(16)] + [(rs, 0, dgone, 0, 1024)]
        with pytest.raises(tether.RegionNotFound):
            peer.writev(entries).wait(10)
        assert_poison(good, "blocks batched with a refused fragment")
        peer.write(rs, dg, length=1024).wait(10)  # the link is fine afterwards
        assert_bytes_equal(good[:1024], src[:1024])


def test_a_large_read_spreads_over_the_lanes(endpoints):
    """A read request costs its lane nothing to send, so a lane that filled its window at once took a
    transfer's chunks from lanes that ran later (a 16 MiB read went over 2 of 4 lanes). Reads are paced
    like writes now (tcp's Caps::read_depth: two chunks' bytes requested per lane): a read of half the
    peer's window in chunks spreads over more than two of four lanes, and every byte arrives."""
    opts = dict(transport="tcp", channels=4, chunk_bytes=1 << 20, window=128)  # 32 chunks a lane
    a, b = endpoints(name="ra", **opts), endpoints(name="rb", **opts)
    peer = a.connect(b.metadata(), timeout=5)
    n = 64 << 20
    src, dst = rand_bytes(91, n), poisoned(n)
    desc, rd = b.register(src).descriptor(), a.register(dst)

    def received():
        return [l["chunks_received"] for l in sorted(a.stats()["lanes"], key=lambda l: l["lane"])]

    used = []  # lanes that carried part of each read
    for _ in range(3):
        before = received()
        peer.read(rd, desc).wait(T)
        per_lane = [x - y for x, y in zip(received(), before)]
        assert sum(per_lane) == 64, per_lane
        used.append(sum(1 for c in per_lane if c > 0))
    # Faster lanes still take more, and a lane whose thread runs late may carry little; filling windows
    # at once put every read on exactly two lanes (32 + 32).
    assert max(used) >= 3, used
    assert_bytes_equal(dst, src)


def test_lone_transfers_keep_to_the_quietest_lane(endpoints):
    """A transfer starts on the lane with the fewest chunks in flight, the lowest on ties: lone writes
    all take lane 0, whose threads on both sides are still awake from the last one (on the GPU host a
    woken thread cost ~250 µs a transfer; docs/ARCHITECTURE.md, "Waking up"). Eight posted at once
    all arrive (whether they spread depends on how fast each is answered)."""
    a, b = endpoints(name="qa", transport="tcp", channels=4), endpoints(name="qb", transport="tcp", channels=4)
    peer = a.connect(b.metadata(), timeout=5)
    src, dst = rand_bytes(90, 8 * 4096), poisoned(8 * 4096)
    rs, desc = a.register(src), b.register(dst).descriptor()

    def sent():
        return [l["chunks_sent"] for l in sorted(a.stats()["lanes"], key=lambda l: l["lane"])]

    before = sent()
    for i in range(20):
        peer.write(rs, desc, local_offset=0, remote_offset=0, length=4096).wait(T)
    lone = [x - y for x, y in zip(sent(), before)]
    # all on lane 0, but for a write that found lane 0's send side busy with its progress thread
    # (round robin would give each lane 5)
    assert sum(lone) == 20 and lone[0] >= 15, lone
    before = sent()
    ts = [peer.write(rs, desc, local_offset=i * 4096, remote_offset=i * 4096, length=4096) for i in range(8)]
    for t in ts:
        t.wait(T)
    assert sum(sent()) - sum(before) == 8
    assert_bytes_equal(dst, src)
