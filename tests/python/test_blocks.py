"""writev_blocks / readv_blocks: many blocks between one local region and one remote range, given as
offset arrays (the KV-cache pattern), and the tuple path's shortcuts (one parse per distinct object).

Random data, poisoned destinations, every byte checked (gaps between blocks must stay poison).
`pair` runs each test on tcp and ipc in three shapes; `to_child` crosses a real process boundary;
error tests run on both transports (`duo`).
"""
from __future__ import annotations

import numpy as np
import pytest

import tether
from tether_testutil.child import child_endpoint
from tether_testutil.data import (
    KiB, POISON, assert_bytes_equal, assert_poison, immediate_error, poisoned, poisoned_target, rand_bytes,
)

T = 20.0


def _layout(rng, lengths, gap_max=50):
    """Disjoint ranges for blocks of `lengths`, in a shuffled order, with random gaps: offsets, extent."""
    n = len(lengths)
    order = rng.permutation(n)
    offsets = np.zeros(n, dtype=np.uint64)
    at = int(rng.integers(0, gap_max))
    for i in order:
        offsets[i] = at
        at += int(lengths[i]) + int(rng.integers(0, gap_max))
    return offsets, at


def _expected_scatter(dst_size, src, src_offsets, dst_offsets, lengths, dst_base=0):
    """dst after copying block i of src (at src_offsets[i]) to dst_base + dst_offsets[i]."""
    out = poisoned(dst_size)
    for s, d, n in zip(src_offsets.tolist(), dst_offsets.tolist(), lengths.tolist()):
        out[dst_base + d:dst_base + d + n] = src[s:s + n]
    return out


def _varied_lengths(rng, n, hi):
    """Lengths in [1, hi) with about one block in eight of length zero."""
    lengths = rng.integers(1, hi, n).astype(np.uint64)
    lengths[rng.random(n) < 0.125] = 0
    return lengths


@pytest.mark.parametrize("n,hi", [(700, 3000), (40, 200 * KiB)], ids=["700-small", "40-multichunk"])
def test_writev_readv_blocks_every_byte(pair, n, hi):
    """Shuffled remote offsets, varied lengths with zero-length blocks, a sub-range descriptor;
    then read everything back into a third layout."""
    a, b, peer = pair
    rng = np.random.default_rng(n)
    lengths = _varied_lengths(rng, n, hi)
    lo, local_size = _layout(rng, lengths)
    ro, remote_size = _layout(rng, lengths)
    src = rand_bytes(int(rng.integers(1 << 30)), local_size)
    base = 333  # remote offsets are relative to the descriptor's range
    dst = poisoned(base + remote_size + 77)
    rs, rd = a.register(src), b.register(dst)
    desc = rd.descriptor(offset=base, length=remote_size)

    t = peer.writev_blocks(rs, desc, lo, ro, lengths)
    t.wait(T)
    assert t.status == "ok" and t.bytes == int(lengths.sum())
    assert_bytes_equal(dst, _expected_scatter(dst.size, src, lo, ro, lengths, base), "remote after writev_blocks")

    back_offsets, back_size = _layout(rng, lengths)
    back = poisoned(back_size + 5)
    t = peer.readv_blocks(a.register(back), tether.RemoteRegion(desc), back_offsets, ro, lengths)
    t.wait(T)
    assert t.bytes == int(lengths.sum())
    expected = poisoned(back.size)
    for bo, r, k in zip(back_offsets.tolist(), ro.tolist(), lengths.tolist()):
        expected[bo:bo + k] = dst[base + r:base + r + k]
    assert_bytes_equal(back, expected, "local after readv_blocks")


def test_kv_cache_pattern_one_length(pair):
    """4,096 fixed-size blocks landing in a shuffled order; `lengths` one int; offsets as lists, int64,
    uint32 and uint64 arrays, and strided uint64 views alike (the core reads contiguous uint64 columns)."""
    a, b, peer = pair
    n, size = 4096, 1 * KiB
    rng = np.random.default_rng(4096)
    order = rng.permutation(n)
    src = rand_bytes(41, n * size)
    dst = poisoned(n * size)
    rs, rd = a.register(src), b.register(dst)
    lo = np.arange(n, dtype=np.int64) * size
    ro = order * size
    wide = np.repeat(np.stack([lo, ro]).astype(np.uint64), 2, axis=1)  # every offset twice: [::2] is a view
    for local_offsets, remote_offsets in ((lo, ro), (lo.astype(np.uint64), ro.astype(np.uint64)),
                                          (lo.tolist(), ro.tolist()), (lo.astype(np.uint32), ro.astype(np.uint32)),
                                          (wide[0, ::2], wide[1, ::2])):
        dst.fill(POISON)
        peer.writev_blocks(rs, rd.descriptor(), local_offsets, remote_offsets, size, notify=b"kv").wait(T)
        got = dst.reshape(n, size)
        assert_bytes_equal(got[order], src.reshape(n, size), "blocks in their shuffled places")
        assert [x.data for x in b.notifications(timeout=T)] == [b"kv"]


def test_zero_blocks_and_zero_lengths(pair):
    a, b, peer = pair
    dst = poisoned(100)
    rs, rd = a.register(rand_bytes(3, 100)), b.register(dst)
    for t in (peer.writev_blocks(rs, rd.descriptor(), [], [], 0),
              peer.writev_blocks(rs, rd.descriptor(), np.zeros(0, np.uint64), np.zeros(0, np.uint64), []),
              peer.writev_blocks(rs, rd.descriptor(), [0, 100, 7], [100, 0, 50], 0),
              peer.readv_blocks(a.register(poisoned(10)), rd.descriptor(), [10, 0], [100, 3], [0, 0])):
        t.wait(T)
        assert t.status == "ok" and t.bytes == 0
    assert_poison(dst)


# =========================================================================== errors


def test_out_of_range_block_names_it_and_writes_nothing(duo):
    a, b, peer = duo
    n, size = 64, 100
    dst, d, rs = poisoned_target(a, b, n * size, 9)
    lo = np.arange(n, dtype=np.uint64) * size
    ro = lo[::-1].copy()
    bad_local, bad_remote = lo.copy(), ro.copy()
    bad_local[17] = n * size - 99       # one byte past the local region
    bad_remote[41] = n * size - 50      # 50 bytes past the descriptor
    e = immediate_error(peer.writev_blocks(rs, d, bad_local, ro, size), tether.OutOfRange)
    assert "(block 17)" in str(e) and "local range" in str(e), str(e)
    e = immediate_error(peer.writev_blocks(rs, d, lo, bad_remote, size), tether.OutOfRange)
    assert "(block 41)" in str(e) and "remote range" in str(e), str(e)
    e = immediate_error(peer.writev_blocks(rs, d, bad_local, bad_remote, size), tether.OutOfRange)
    assert "(block 17)" in str(e), "the first block out of range is the one named: " + str(e)
    huge = lo.copy()
    huge[5] = (1 << 64) - 1  # offset + length wraps around 2**64
    e = immediate_error(peer.writev_blocks(rs, d, lo, huge, size), tether.OutOfRange)
    assert "(block 5)" in str(e)
    sink = poisoned(n * size)
    e = immediate_error(peer.readv_blocks(a.register(sink), d, bad_local, ro, size), tether.OutOfRange)
    assert "(block 17)" in str(e)
    assert_poison(dst, "no block of a rejected writev_blocks may land")
    assert_poison(sink, "no block of a rejected readv_blocks may land")
    # one block: no index in the message, as for write()
    e = immediate_error(peer.writev_blocks(rs, d, [n * size], [0], 1), tether.OutOfRange)
    assert "block" not in str(e)


def test_deregistered_readonly_and_foreign(duo, endpoints):
    a, b, peer = duo
    dst, d, rs = poisoned_target(a, b, 1000, 11)
    a.deregister(rs)
    e = immediate_error(peer.writev_blocks(rs, d, [0, 10], [0, 10], 10), tether.RegionNotFound)
    assert "deregistered (block 0)" in str(e)
    ro_local = a.register(rand_bytes(12, 1000), readonly=True)
    immediate_error(peer.readv_blocks(ro_local, d, [0, 10], [0, 10], 10), tether.AccessDenied)
    other = endpoints(name="other").register(poisoned(1000)).descriptor()
    rs2 = a.register(rand_bytes(13, 1000))
    immediate_error(peer.writev_blocks(rs2, other, [0, 10], [0, 10], 10), tether.InvalidArgument)
    with pytest.raises(tether.InvalidArgument):
        peer.writev_blocks(rs2, b"not a descriptor", [0], [0], 10)
    assert_poison(dst)


def test_bad_block_arrays_are_refused_clearly(duo):
    a, b, peer = duo
    dst, d, rs = poisoned_target(a, b, 1000, 14)
    # The Python API: what the columns may be.
    with pytest.raises(TypeError, match="integers"):
        peer.writev_blocks(rs, d, [0.0, 8.0], [0, 8], 8)
    with pytest.raises(TypeError, match="integers"):
        peer.writev_blocks(rs, d, [0, 8], [0, 8], np.array([8.0, 8.0]))
    with pytest.raises(ValueError, match="one-dimensional"):
        peer.writev_blocks(rs, d, [[0, 8]], [0, 8], 8)
    with pytest.raises(ValueError, match="blocks"):
        peer.writev_blocks(rs, d, [0, 8, 16], [0, 8], 8)
    with pytest.raises(ValueError, match="entries for"):
        peer.writev_blocks(rs, d, [0, 8], [0, 8], [8, 8, 8])
    with pytest.raises(ValueError, match="negative"):
        peer.writev_blocks(rs, d, [0, -8], [0, 8], 8)
    with pytest.raises(ValueError):
        peer.writev_blocks(rs, d, [0, 8], [0, 8], -1)
    # The binding: C-contiguous 1-D uint64 columns in host memory, read in place; lengths an int or a column.
    good = np.array([0, 8], dtype=np.uint64)
    with pytest.raises(TypeError, match="local_offsets must have dtype uint64"):
        peer._p.writev_blocks(rs._r, d, good.astype(np.int64), good, 8, b"")
    with pytest.raises(TypeError, match="remote_offsets must have dtype uint64"):
        peer._p.readv_blocks(rs._r, d, good, good.astype(np.uint32), 8, b"")
    with pytest.raises(ValueError, match="lengths must be one-dimensional"):
        peer._p.writev_blocks(rs._r, d, good, good, np.full((2, 1), 8, dtype=np.uint64), b"")
    with pytest.raises(ValueError, match="local_offsets must be contiguous"):
        peer._p.writev_blocks(rs._r, d, np.repeat(good, 2)[::2], good, 8, b"")
    with pytest.raises(ValueError, match="2 blocks but remote_offsets has 1"):
        peer._p.writev_blocks(rs._r, d, good, good[:1].copy(), 8, b"")
    with pytest.raises(ValueError, match="lengths has 3 entries for 2 blocks"):
        peer._p.writev_blocks(rs._r, d, good, good, np.full(3, 8, dtype=np.uint64), b"")
    with pytest.raises(TypeError, match="local_offsets must be a uint64 array"):
        peer._p.writev_blocks(rs._r, d, [0, 8], good, 8, b"")
    with pytest.raises(OverflowError):
        peer._p.writev_blocks(rs._r, d, good, good, -8, b"")
    assert_poison(dst)
    # Read-only columns are fine (the core only reads them), and so is a column of lengths.
    good.flags.writeable = False
    lengths = np.full(2, 8, dtype=np.uint64)
    lengths.flags.writeable = False
    peer._p.writev_blocks(rs._r, d, good, good, lengths, b"")._wait(T)
    assert_bytes_equal(dst[:16], rand_bytes(14, 1000)[:16])


# =========================================================================== the tuple path


def test_tuple_path_mixes_objects_and_forms(pair):
    """Runs of identical objects, equal descriptors as different objects, bytes and RemoteRegion,
    tether.Region and its inner region: every entry lands where it says."""
    a, b, peer = pair
    rng = np.random.default_rng(5)
    src = [rand_bytes(51, 50000), rand_bytes(52, 50000)]
    rs = [a.register(s) for s in src]
    dst = poisoned(100000)
    rd = b.register(dst)
    desc = rd.descriptor()
    # The sub-range descriptor covers the upper half: no two entries' ranges overlap.
    forms = [desc, tether.RemoteRegion(desc), bytes(desc), rd.descriptor(offset=50000, length=50000)]
    entries, expected = [], poisoned(dst.size)
    slots = rng.permutation(500)
    for i in range(500):
        k = (i // 37) % 2  # runs of one local region
        f = forms[(i // 11) % 4] if i % 5 else forms[i % 4]  # runs, broken now and then
        local = rs[k] if i % 3 else rs[k]._r
        n = int(rng.integers(0, 100))
        lo, at = i * 100, int(slots[i]) * 100
        base = 50000 if f is forms[3] else 0
        entries.append((local, lo, f, at, n))
        expected[base + at:base + at + n] = src[k][lo:lo + n]
    t = peer.writev(entries)
    t.wait(T)
    assert t.bytes == sum(e[4] for e in entries)
    assert_bytes_equal(dst, expected, "remote after writev of mixed entries")


def test_tuple_path_errors_keep_their_index(duo):
    a, b, peer = duo
    d = b.register(poisoned(1000)).descriptor()
    rs = a.register(rand_bytes(15, 1000))
    dead = a.register(rand_bytes(16, 1000))
    a.deregister(dead)
    e = immediate_error(peer.writev([(rs, 0, d, 0, 10)] * 5 + [(dead, 0, d, 0, 10)]), tether.RegionNotFound)
    assert "deregistered (entry 5)" in str(e), str(e)
    e = immediate_error(peer.readv([(rs, 0, d, 0, 10), (rs, 0, d, 995, 10)]), tether.OutOfRange)
    assert "(entry 1)" in str(e), str(e)
    with pytest.raises(tether.InvalidArgument, match="each entry"):
        peer.writev([(rs, 0, d, 0)])
    with pytest.raises(tether.InvalidArgument, match="each entry"):
        peer.writev([[rs, 0, d, 0, 10]])
    with pytest.raises(tether.InvalidArgument, match="remote must be"):
        peer.writev([(rs, 0, 17, 0, 10)])
    with pytest.raises(TypeError, match="Region"):
        peer.writev([(object(), 0, d, 0, 10)])
    with pytest.raises(OverflowError):
        peer.writev([(rs, -1, d, 0, 10)])


# =========================================================================== two processes


@pytest.fixture(scope="module")
def child():
    with child_endpoint("blocks-child", name="child-ep") as c:
        yield c


@pytest.fixture(params=["tcp", "ipc"])
def to_child(child, endpoints, request):
    ep = endpoints(name="parent-ep", transport=request.param)
    return ep, ep.connect(child.info["metadata"], timeout=5)


def test_cross_process_blocks(child, to_child):
    ep, peer = to_child
    rng = np.random.default_rng(77)
    lengths = _varied_lengths(rng, 1000, 5000)
    lo, local_size = _layout(rng, lengths)
    ro, remote_size = _layout(rng, lengths)
    desc = child.call("register", "blocks", remote_size)
    try:
        src = rand_bytes(78, local_size)
        peer.writev_blocks(ep.register(src), desc, lo, ro, lengths, notify=b"in place").wait(T)
        got = np.frombuffer(child.call("get", "blocks"), dtype=np.uint8)
        assert_bytes_equal(got, _expected_scatter(remote_size, src, lo, ro, lengths), "child buffer after writev_blocks")
        assert [n[2] for n in child.call("notifications", 1)] == [b"in place"]

        child.call("fill", "blocks", ("seed", 79))
        theirs = rand_bytes(79, remote_size)
        back = poisoned(local_size)
        peer.readv_blocks(ep.register(back), desc, lo, ro, lengths).wait(T)
        assert_bytes_equal(back, _expected_scatter(local_size, theirs, ro, lo, lengths), "local buffer after readv_blocks")
    finally:
        child.call("deregister", "blocks")
