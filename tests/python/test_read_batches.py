"""Reads of many small blocks go as read batches (kReadBatch): one request for many fragments, every
fragment checked and pinned by the target, one answer. Over ipc (up to 1,024 fragments) the answer says
where each lies and the initiator copies them all (by attach in one system call, or out of its slot where
the target pushed them); over tcp (up to 128) the answer carries the fragments' bytes in order and the
initiator lands each in its place. Two real processes; random data, poisoned destinations, every byte.
GPU pairings: the vectored tests of test_ipc_gpu.py and test_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

import tether
from tether_testutil.data import assert_bytes_equal, assert_poison, poisoned, rand_bytes, wait_error, wait_until
from tether_testutil.wire import DESC_KEY, get_u64, set_u64

T = 20.0
MAX_FRAGMENTS = {"ipc": 1024, "tcp": 128}  # per batch (ipc kMaxBatch, wire::kMaxFragments)
TRANSPORTS = ["ipc", "tcp"]


@pytest.mark.parametrize("transport,host", [("ipc", "auto"), ("ipc", "shm"), ("tcp", None)],
                         ids=["ipc-by-attach", "ipc-pushed", "tcp"])
@pytest.mark.parametrize("blocks,bs", [(512, 4096), (300, 1000), (2, 7)])
def test_scattered_reads_come_in_batches(target, transport, host, blocks, bs):
    me, peer, c = target(transport, env={"TETHER_IPC_HOST": host} if host == "shm" else None)
    n = blocks * bs
    desc = c.call("register", "src", n + 100, fill=("seed", 60))
    data = rand_bytes(60, n + 100)
    dst = poisoned(2 * n)
    rd = me.register(dst)
    rng = np.random.default_rng(blocks)
    remote = (rng.permutation(blocks) * bs + 50).astype(np.uint64)
    local = (np.arange(blocks) * 2 * bs).astype(np.uint64)  # a gap after every block: must stay poison
    sent0 = c.call("stats")["chunks_sent"]
    peer.readv_blocks(rd, desc, local, remote, bs).wait(T)
    per_batch = min(MAX_FRAGMENTS[transport], (1 << 20) // bs)
    want = -(-blocks // per_batch)  # one answer per batch, not per block
    # The target counts an answer once its sendmsg() returned, which may come after our bytes landed.
    sent = lambda: c.call("stats")["chunks_sent"] - sent0  # noqa: E731
    wait_until(lambda: sent() >= want, 10)
    assert sent() == want, sent()
    for i in range(blocks):
        got = dst[int(local[i]):int(local[i]) + bs]
        assert_bytes_equal(got, data[int(remote[i]):int(remote[i]) + bs], f"block {i}")
        assert_poison(dst[int(local[i]) + bs:int(local[i]) + 2 * bs], f"the gap after block {i}")
    # the target held its region only until we were done: deregistering does not wait
    c.call("deregister", "src", timeout=5)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_one_bad_fragment_refuses_the_whole_batch(target, transport):
    me, peer, c = target(transport)
    good = c.call("register", "a", 64 * 1024, fill=("seed", 61))
    other = c.call("register", "b", 64 * 1024, fill=("seed", 62))
    bad = set_u64(other, DESC_KEY, get_u64(other, DESC_KEY) ^ 1)
    dst = poisoned(32 * 1024)
    rd = me.register(dst)
    entries = [(rd, i * 1024, good if i != 9 else bad, i * 1024, 1024) for i in range(32)]
    e = wait_error(peer.readv(entries))
    assert isinstance(e, tether.AccessDenied), repr(e)
    assert_poison(dst, "the destination of a refused batch")
    # the same blocks with the right key: every byte, and the link lives on
    entries[9] = (rd, 9 * 1024, other, 9 * 1024, 1024)
    peer.readv(entries).wait(T)
    a, b = rand_bytes(61, 64 * 1024), rand_bytes(62, 64 * 1024)
    for i in range(32):
        want = (b if i == 9 else a)[i * 1024:(i + 1) * 1024]
        assert_bytes_equal(dst[i * 1024:(i + 1) * 1024], want, f"block {i}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_blocks_from_several_regions_in_one_read(target, transport):
    me, peer, c = target(transport)
    descs = [c.call("register", f"r{k}", 40_000, fill=("seed", 70 + k)) for k in range(3)]
    dst = poisoned(3 * 40_000)
    rd = me.register(dst)
    entries = [(rd, k * 40_000 + i * 4000, descs[k], 40_000 - (i + 1) * 4000, 4000) for i in range(10) for k in range(3)]
    peer.readv(entries).wait(T)
    for k in range(3):
        src = rand_bytes(70 + k, 40_000)
        for i in range(10):
            at = k * 40_000 + i * 4000
            assert_bytes_equal(dst[at:at + 4000], src[40_000 - (i + 1) * 4000:40_000 - i * 4000], f"region {k} block {i}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_deregistered_region_refuses_the_batch_and_the_link_lives(target, transport):
    me, peer, c = target(transport)
    keep = c.call("register", "keep", 64 * 1024, fill=("seed", 80))
    gone = c.call("register", "gone", 64 * 1024, fill=("seed", 81))
    c.call("deregister", "gone", timeout=5)
    dst = poisoned(64 * 1024)
    rd = me.register(dst)
    entries = [(rd, i * 2048, gone if i == 20 else keep, i * 2048, 2048) for i in range(32)]
    e = wait_error(peer.readv(entries))
    assert isinstance(e, tether.RegionNotFound), repr(e)
    assert_poison(dst, "the destination of a refused batch")
    del entries[20]
    peer.readv(entries).wait(T)
    src = rand_bytes(80, 64 * 1024)
    for i in [i for i in range(32) if i != 20]:
        assert_bytes_equal(dst[i * 2048:(i + 1) * 2048], src[i * 2048:(i + 1) * 2048], f"block {i}")
    assert_poison(dst[20 * 2048:21 * 2048], "the block left out")


def test_tcp_many_batches_in_flight_on_one_lane(target):
    """More read batches asked at once than a tcp lane keeps answers for (kReadAnswers): the target
    stops reading until answers have gone out, and every byte still arrives."""
    me, peer, c = target("tcp", channels=1, window=256)
    n, bs = 20_000, 64
    desc = c.call("register", "src", n * bs, fill=("seed", 82))
    dst = poisoned(n * bs)
    rd = me.register(dst)
    order = np.random.default_rng(82).permutation(n).astype(np.uint64)
    peer.readv_blocks(rd, desc, np.arange(n, dtype=np.uint64) * bs, order * bs, bs).wait(T)
    src = rand_bytes(82, n * bs).reshape(n, bs)
    assert_bytes_equal(dst.reshape(n, bs), src[order.astype(np.int64)], "blocks")
