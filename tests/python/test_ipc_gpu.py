"""GPU memory over the ipc transport: two processes on one host, CUDA IPC handles opened once
per peer, copies by the copy engines, batches by one copy-kernel launch over peer pointers. Every
pairing (GPU0->GPU1, same GPU, host->GPU, GPU->host), every operation, random data, poisoned
destinations, every byte; the handle cache (no reopen; a freed and reallocated allocation is noticed);
a deregistered region is refused. Needs CUDA and torch with a GPU; skipped otherwise, saying why.
With one GPU the GPU0<->GPU1 pairings run GPU0->GPU0 between two processes (CUDA IPC on one device;
GpuEnv.pairs)."""
import ctypes
import os
import signal
import threading
import time

import numpy as np
import pytest

import tether
from tether_testutil.data import MiB, assert_bytes_equal, assert_poison, poisoned, rand_bytes
from tether_testutil.child import child_bytes
from tether_testutil.gpu import (gpu_env, linked, read_checked, send_checked, shuffled_blocks, write_notify_checked,
                                 writev_readv_shuffled)

GPU = gpu_env("ipc GPU tests")
torch = GPU.torch
_dev = GPU.device

T = 60
PAIRS = GPU.pairs([("gpu0", "gpu1"), ("gpu0", "gpu0"), ("host", "gpu1"), ("gpu1", "host"), ("gpu1", "gpu0")])
SIZE = 37 * MiB + 12345  # several 16 MiB GPU chunks and a partial one (see pair)


@pytest.fixture
def pair(children):
    # 16 MiB GPU chunks (the default is 256 MiB): a SIZE write goes as three chunks on three lanes.
    yield from linked(children("ipc-gpu-peer"), lambda: GPU.local(transport="ipc", ipc_gpu_chunk_bytes=16 * MiB),
                      "ipc", transport="ipc")


@pytest.mark.parametrize("lk,rk", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_write_and_notify(pair, lk, rk):
    local, peer, c = pair
    desc = c.call("register", "dst", SIZE + 10, device=_dev(rk))
    write_notify_checked(local, peer, c, lk, desc, SIZE, 5, 41, T)
    if lk != "host" and rk != "host":
        assert c.call("stats")["ipc_cuda_chunks"] >= 3  # the target's copy engines moved it


@pytest.mark.parametrize("lk,rk", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_read(pair, lk, rk):
    local, peer, c = pair
    desc = c.call("register", "src", SIZE, fill=("seed", 42), device=_dev(rk))
    read_checked(local, peer, lk, desc, SIZE, 42, T)
    # the target's region stayed pinned only until we said done: deregistering it does not hang
    c.call("deregister", "src", timeout=10)


@pytest.mark.parametrize("lk,rk", PAIRS, ids=["-".join(p) for p in PAIRS])
@pytest.mark.parametrize("blocks,bs", [(300, 16 * 1024 + 64), (4096, 16 * 1024)], ids=["300x16k+64", "4096x16k"])
def test_vectored_write_and_read(pair, lk, rk, blocks, bs):
    """Many small scattered blocks both ways in one writev/readv (batches: one kernel per batch)."""
    local, peer, c = pair
    desc = c.call("register", "dst", blocks * bs, device=_dev(rk))
    writev_readv_shuffled(local, peer, c, lk, desc, blocks, bs, T)


@pytest.mark.parametrize("lk,rk", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_send_recv(pair, lk, rk):
    local, peer, c = pair
    c.call("register", "rbuf", SIZE + 7, device=_dev(rk))
    send_checked(local, peer, c, lk, SIZE, T)


def test_child_writes_into_our_gpu(pair):
    """The other direction: the child initiates a GPU write into our GPU region."""
    local, peer, c = pair
    dst = local.region("dst", "gpu0", 3 * MiB)
    c.call("register", "s", 3 * MiB, fill=("seed", 45), device=GPU.other)
    assert c.call("write", "s", dst.descriptor(), accepted=True) == ("ok", 3 * MiB)
    assert_bytes_equal(local.get("dst"), rand_bytes(45, 3 * MiB))


def test_handle_cache_no_reopen_and_reallocation(pair):
    """The target opens our allocation once; later transfers reuse it. Freed and reallocated memory at
    the same address carries a new handle: the target notices, opens the new one, copies the new bytes."""
    local, peer, c = pair
    desc = c.call("register", "dst", 8 * MiB, device=0)
    src = local.region("src", "gpu0", 8 * MiB, seed=46)
    opens0 = c.call("stats")["ipc_cuda_opens"]
    peer.write(src, desc).wait(T)
    opens1 = c.call("stats")["ipc_cuda_opens"]
    assert opens1 == opens0 + 1
    for _ in range(5):
        peer.write(src, desc).wait(T)
    assert c.call("stats")["ipc_cuda_opens"] == opens1, "the target reopened a cached allocation"
    assert_bytes_equal(child_bytes(c, "dst"), rand_bytes(46, 8 * MiB))
    # free our allocation (for real: empty the caching allocator) and take a new one
    base = local.mem["src"].data_ptr()
    local.ep.deregister(src)
    del local.mem["src"]
    torch.cuda.synchronize(0)
    torch.cuda.empty_cache()
    src2 = local.region("src2", "gpu0", 8 * MiB, seed=47)
    peer.write(src2, desc).wait(T)
    assert_bytes_equal(child_bytes(c, "dst"), rand_bytes(47, 8 * MiB))
    if local.mem["src2"].data_ptr() == base:  # same address, new allocation: must have been reopened
        assert c.call("stats")["ipc_cuda_opens"] == opens1 + 1


def test_deregistering_closes_the_peers_mapping(pair):
    """Deregistration tells the peer to close its mapping of the allocation (else the peer would keep
    that GPU memory alive until it disconnects): registering the same tensor again makes it reopen."""
    local, peer, c = pair
    desc = c.call("register", "dst", 8 * MiB, device=GPU.other)
    src = local.region("src", "gpu0", 8 * MiB, seed=48)
    peer.write(src, desc).wait(T)
    opens1 = c.call("stats")["ipc_cuda_opens"]
    local.ep.deregister(src)
    again = local.ep.register(local.mem["src"])  # the same allocation, the same handle
    for _ in range(3):
        peer.write(again, desc).wait(T)
    assert c.call("stats")["ipc_cuda_opens"] == opens1 + 1, "the peer kept the deregistered allocation open"
    assert_bytes_equal(child_bytes(c, "dst"), rand_bytes(48, 8 * MiB))


def test_deregistered_region_refused(pair):
    local, peer, c = pair
    desc = c.call("register", "dst", 4 * MiB, device=0)
    src = local.region("src", "gpu0", 4 * MiB, seed=48)
    peer.write(src, desc).wait(T)
    c.call("deregister", "dst")
    with pytest.raises(tether.RegionNotFound):
        peer.write(src, desc).wait(T)
    with pytest.raises(tether.RegionNotFound):
        peer.read(src, desc).wait(T)
    assert peer.connected  # refused cleanly: the link lives on
    desc2 = c.call("register", "dst2", 4 * MiB, device=0)
    peer.write(src, desc2).wait(T)
    assert_bytes_equal(child_bytes(c, "dst2"), rand_bytes(48, 4 * MiB))


ONE_SIDED_PAIRS = GPU.pairs([("gpu0", "gpu1"), ("gpu1", "gpu0")])


@pytest.mark.parametrize("lk,rk", ONE_SIDED_PAIRS, ids=["-".join(p) for p in ONE_SIDED_PAIRS])
def test_one_sided_small_gpu_ops(pair, lk, rk):
    """Small writes and reads of a descriptor the target granted are moved by us alone: one CUDA
    copy into (out of) the target's allocation, no message (test_one_sided.py for host memory)."""
    local, peer, c = pair
    size = 1 * MiB
    desc = c.call("register", "dst", size, device=_dev(rk))
    data = rand_bytes(50, size)
    src = local.region("src", lk, size, seed=50)
    peer.write(src, desc, length=8).wait(T)  # its answer grants the descriptor
    s0 = local.ep.stats()["ipc_one_sided_chunks"]
    expect = poisoned(size)
    expect[:8] = data[:8]
    rng = np.random.default_rng(50)
    # Up to ipc_one_sided_bytes (64 KiB) where a completer thread finishes the copies (busy polling on);
    # else up to 8 KiB, waited for by the poster (one_sided.h, kOneSidedGpuMax).
    gpu_max = 64 * 1024 if tether._tether.Config.from_env().busy_poll_us > 0 else 8192
    sizes = (1, 8, 4096, 8192, 8193, 64 * 1024, 64 * 1024 + 1)
    for n in sizes:
        off = int(rng.integers(0, size - n))
        peer.write(src, desc, local_offset=off, remote_offset=off, length=n).wait(T)
        expect[off:off + n] = data[off:off + n]
    writes = sum(n <= gpu_max for n in sizes)
    assert local.ep.stats()["ipc_one_sided_chunks"] - s0 == writes
    assert_bytes_equal(child_bytes(c, "dst"), expect, "one-sided GPU writes")
    local.region("back", lk, size)
    back = local.ep.register(local.mem["back"])
    for n in (8, 8192, 64 * 1024):
        off = int(rng.integers(0, size - n))
        peer.read(back, desc, local_offset=off, remote_offset=off, length=n).wait(T)
        assert_bytes_equal(local.get("back")[off:off + n], expect[off:off + n], f"GPU read of {n}")
    assert local.ep.stats()["ipc_one_sided_chunks"] - s0 == writes + sum(n <= gpu_max for n in (8, 8192, 64 * 1024))


def test_one_sided_gpu_ops_in_flight_together(pair):
    """Many one-sided GPU writes and reads posted before any is waited for (the completer finishes
    them, one_sided.h): every byte lands, each op is answered once, and the stats count them."""
    local, peer, c = pair
    size = 4 * MiB
    desc = c.call("register", "dst", size, device=GPU.other)
    data = rand_bytes(52, size)
    src = local.region("src", "gpu0", size, seed=52)
    peer.write(src, desc, length=8).wait(T)  # the grant
    s0 = local.ep.stats()["ipc_one_sided_chunks"]
    n, block = 48, 64 * 1024  # 48 x 64 KiB at scattered offsets, all in flight
    offs = [i * (size // n) for i in range(n)]
    ops = [peer.write(src, desc, local_offset=o, remote_offset=o, length=block) for o in offs]
    for op in ops:
        op.wait(T)
    expect = poisoned(size)
    expect[:8] = data[:8]
    for o in offs:
        expect[o:o + block] = data[o:o + block]
    assert_bytes_equal(child_bytes(c, "dst"), expect, "one-sided GPU writes in flight together")
    local.region("back", "gpu0", size)
    back = local.ep.register(local.mem["back"])
    ops = [peer.read(back, desc, local_offset=o, remote_offset=o, length=block) for o in offs]
    for op in ops:
        op.wait(T)
    got = local.get("back")
    for o in offs:
        assert_bytes_equal(got[o:o + block], expect[o:o + block], f"GPU read at {o}")
    if tether._tether.Config.from_env().busy_poll_us > 0:
        # A peer has 16 one-sided copies in flight at most (one_sided.h kHazards); an op that finds them
        # all taken goes as a request. So the first 16 of each direction go one-sided, the rest may.
        moved = local.ep.stats()["ipc_one_sided_chunks"] - s0
        assert 2 * 16 <= moved <= 2 * n, f"{moved} of {2 * n} ops went one-sided"


def test_the_callers_cuda_context_is_handed_back(pair):
    """tether makes a GPU's primary context current for its own CUDA calls on the caller's thread (what
    registered memory is, a one-sided copy or batch the poster starts, a waiter finishing it), and the
    CUDA runtime (torch) runs on whatever context is current: each call hands back the context the thread
    had. Here one of the test's own, so the primary context left behind shows (as GPU 0 found current
    by an application working on GPU 1 would)."""
    local, peer, c = pair
    size = 4 * MiB
    desc = c.call("register", "dst", size, device=GPU.other)
    data = rand_bytes(53, size)
    local.region("src", "gpu0", size, seed=53)  # made by torch, which makes contexts current: before
    tensor = local.mem["src"]
    cu = ctypes.CDLL("libcuda.so.1")

    def current():
        ctx = ctypes.c_void_p()
        assert cu.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
        return ctx.value

    had = current()
    dev, mine = ctypes.c_int(), ctypes.c_void_p()
    assert cu.cuDeviceGet(ctypes.byref(dev), tensor.device.index) == 0
    assert cu.cuCtxCreate_v2(ctypes.byref(mine), 0, dev) == 0  # and makes it current
    try:
        assert current() == mine.value
        src = local.ep.register((tensor.data_ptr(), size))  # CUDA says what it is
        assert current() == mine.value, "register"
        peer.write(src, desc, length=8).wait(T)  # its answer grants the descriptor
        for n in (8, 64 * 1024, size):  # one-sided where small: copied by this thread or a waiter
            peer.write(src, desc, length=n).wait(T)
            assert current() == mine.value, f"a write of {n} bytes"
        bs = 16 * 1024
        peer.writev([(src, i * bs, desc, i * bs, bs) for i in range(size // bs)]).wait(T)  # one-sided batches
        assert current() == mine.value, "a writev of 16 KiB blocks"
        local.ep.deregister(src)
        assert current() == mine.value, "deregister"
    finally:
        cu.cuCtxSetCurrent(ctypes.c_void_p(had))
        cu.cuCtxDestroy_v2(mine)
    assert_bytes_equal(child_bytes(c, "dst"), data, "the written bytes")


@pytest.mark.parametrize("lk,rk", ONE_SIDED_PAIRS, ids=["-".join(p) for p in ONE_SIDED_PAIRS])
def test_one_sided_gpu_batches(pair, lk, rk):
    """Scattered GPU blocks of a granted descriptor (a KV pull's shape): the first writev's batches ask
    for the grant, later ones are copied by us alone, one kernel launch a batch over the target's
    allocation (with the completer, busy polling on). Random data, shuffled places, poisoned
    destinations, every byte, both ways; once the target deregisters, a batch is refused, not copied."""
    local, peer, c = pair
    blocks, bs = 4096, 16 * 1024
    desc = c.call("register", "dst", blocks * bs, device=_dev(rk))
    writev_readv_shuffled(local, peer, c, lk, desc, blocks, bs, T)  # asks for (and gets) the grant
    s0 = local.ep.stats()["ipc_one_sided_chunks"]
    src = local.region("src2", lk, blocks * bs, seed=53)
    order = np.random.default_rng(8).permutation(blocks)
    peer.writev([(src, int(i) * bs, desc, int(j) * bs, bs) for i, j in enumerate(order)]).wait(T)
    expect = shuffled_blocks(53, blocks, bs, order)
    assert_bytes_equal(child_bytes(c, "dst"), expect, "one-sided GPU write batches")
    back = local.region("back2", lk, blocks * bs)
    peer.readv([(back, int(j) * bs, desc, int(j) * bs, bs) for j in order]).wait(T)
    assert_bytes_equal(local.get("back2"), expect, "one-sided GPU read batches")
    completer = tether._tether.Config.from_env().busy_poll_us > 0
    if completer:
        assert local.ep.stats()["ipc_one_sided_chunks"] - s0 >= 2 * blocks // 1024, "the batches went as requests"
    # A descriptor only ever read (a KV pull): the first readv's answers grant it.
    kv = c.call("register", "kv", blocks * bs, fill=("seed", 54), device=_dev(rk))
    want = rand_bytes(54, blocks * bs).reshape(blocks, bs)[order].reshape(-1)
    for i in range(2):
        s1 = local.ep.stats()["ipc_one_sided_chunks"]
        got = local.region(f"kvback{i}", lk, blocks * bs)
        peer.readv([(got, k * bs, kv, int(j) * bs, bs) for k, j in enumerate(order)]).wait(T)
        assert_bytes_equal(local.get(f"kvback{i}"), want, f"KV pull {i}")
    if completer:
        assert local.ep.stats()["ipc_one_sided_chunks"] - s1 >= blocks // 1024, "the second pull went as requests"
    c.call("deregister", "dst")
    with pytest.raises(tether.RegionNotFound):
        peer.writev([(src, int(i) * bs, desc, int(j) * bs, bs) for i, j in enumerate(order)]).wait(T)
    with pytest.raises(tether.RegionNotFound):
        peer.readv([(back, int(j) * bs, desc, int(j) * bs, bs) for j in order]).wait(T)
    assert peer.connected


def _one_sided_gpu_stream(pair, block, seed):
    """The child writes `block`-byte pieces of its GPU memory into our GPU region one-sided without
    pause (at least 200 done when this returns): (local, child, our region). "batch": writevs of
    1,024 blocks of 4 KiB, each one copy-kernel launch over our allocation."""
    local, peer, c = pair
    if block == "batch" and tether._tether.Config.from_env().busy_poll_us == 0:
        pytest.skip("GPU batches go one-sided only where the completer runs (busy polling on)")
    blocks = 1024 if block == "batch" else 1
    block = 4096 if block == "batch" else block
    size = max(64 * 1024, blocks * block)
    dst = local.region("dst", "gpu0", size)
    c.call("register", "s", size, fill=("seed", seed), device=GPU.other)
    assert c.call("start_stream", "write", "s", dst.descriptor(), block, accepted=True, blocks=blocks)
    deadline = time.monotonic() + 10
    while c.call("stats")["ipc_one_sided_chunks"] < 200 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.call("stats")["ipc_one_sided_chunks"] >= 200
    return local, c, dst


@pytest.mark.parametrize("block", [4096, 64 * 1024, "batch"], ids=["waited-by-poster", "completer", "batches"])
def test_deregister_ends_one_sided_gpu_writes_before_it_returns(pair, block):
    """The child writes into our GPU region one-sided without pause; from the moment deregister()
    returns no byte may land there, and its writes fail instead. 64 KiB copies are finished by the
    child's completer thread (busy polling on), so their hazard outlives the posting call."""
    local, c, dst = _one_sided_gpu_stream(pair, block, 51)
    local.ep.deregister(dst)
    local.mem["dst"].fill_(0xEE)
    torch.cuda.synchronize(0)
    time.sleep(0.3)
    assert_poison(local.get("dst"), "a deregistered GPU region while the peer kept writing", value=0xEE)
    errors, _ = c.call("stream_errors")
    assert errors, "the child's writes went on succeeding"


def test_two_endpoints_of_one_process():
    """ipc between two endpoints of one process: CUDA will not open this process's own handles; the
    pointers are used as they are (nothing opened)."""
    with tether.Endpoint(transport="ipc") as a, tether.Endpoint(transport="ipc") as b:
        peer = a.connect(b.metadata(), timeout=10)
        assert peer.transport == "ipc"
        n = 9 * MiB + 3
        src = torch.from_numpy(rand_bytes(49, n)).to("cuda:0")
        dst = torch.from_numpy(poisoned(n + 1)).to(f"cuda:{GPU.other}")
        torch.cuda.synchronize()
        peer.write(a.register(src), b.register(dst).descriptor(), remote_offset=1).wait(T)
        got = dst.cpu().numpy()
        assert_poison(got[:1])
        assert_bytes_equal(got[1:], rand_bytes(49, n))
        assert a.stats()["ipc_cuda_opens"] == 0 and b.stats()["ipc_cuda_opens"] == 0


VMM_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # torch allocates with cuMemCreate + cuMemMap
VMM_PAIRS = GPU.pairs([("gpu0", "gpu1"), ("gpu1", "gpu0"), ("gpu0", "gpu0")])


@pytest.mark.parametrize("how", ["cuMemCreate", "expandable_segments"])
@pytest.mark.parametrize("lk,rk", VMM_PAIRS, ids=["-".join(p) for p in VMM_PAIRS])
def test_vmm_memory(children, lk, rk, how):
    """VMM memory has no legacy CUDA IPC handle: ipc exports each physical allocation behind a region
    as a POSIX fd and the other side maps them all at one pointer (transport/ipc/vmm.h). Two
    processes; a 45 MiB region spans several allocations on each side — three from cuMemCreate (a
    KV-cache pool's way), or torch's expandable segments. Write and read, random data, poisoned
    destinations, every byte."""
    env = VMM_ENV if how == "expandable_segments" else None
    a, b = children("vmm-a", env=env), children("vmm-b", env=env)
    a.call("endpoint", transport="ipc")
    info = b.call("endpoint", transport="ipc")
    a.call("connect", info["metadata"])
    assert a.call("transport") == "ipc"
    n = 45 * MiB + 77

    def region(c, name, size, device, **kw):
        if how == "cuMemCreate":
            return c.call("register_vmm", name, size, device, **kw)
        return c.call("register", name, size, device=device, **kw)

    desc = region(b, "dst", n + 10, _dev(rk))
    region(a, "src", n, _dev(lk), fill=("seed", 5))
    assert not a.call("legacy_ipc_capable", "src") and not b.call("legacy_ipc_capable", "dst"), "not VMM memory"
    assert a.call("write", "src", desc, remote_offset=3, length=n) == ("ok", n)
    got = child_bytes(b, "dst")
    assert_bytes_equal(got[3:3 + n], rand_bytes(5, n), "write into VMM memory")
    assert_poison(got[:3])
    assert_poison(got[3 + n:])
    region(a, "back", n + 5, _dev(lk))
    assert a.call("read", "back", desc, local_offset=5, remote_offset=3, length=n) == ("ok", n)
    back = child_bytes(a, "back")
    assert_bytes_equal(back[5:], rand_bytes(5, n), "read from VMM memory")
    assert_poison(back[:5])
    # each side mapped the other's region (b for the write, a for the read)
    assert b.call("stats")["ipc_cuda_opens"] >= 1 and a.call("stats")["ipc_cuda_opens"] >= 1
    if how == "cuMemCreate":
        # Two local regions with one base and two sizes (a pool and its first layer) are two VMM
        # spans; one batch of small blocks from both must name each by its own span.
        head = n // 3
        desc = region(b, "dst", n + 10, _dev(rk))  # a new, poisoned destination
        a.call("register_head", "src_head", "src", head)
        blocks = 64 * 1024
        entries = [("src_head", i, i, blocks) for i in range(0, head - blocks, 4 * blocks)]
        entries += [("src", i, i, blocks) for i in range(head, n - blocks, 4 * blocks)]
        assert a.call("writev", entries, desc) == ("ok", len(entries) * blocks)
        got = child_bytes(b, "dst")
        want = rand_bytes(5, n)
        for _, lo, ro, ln in entries:
            assert_bytes_equal(got[ro:ro + ln], want[lo:lo + ln], f"block at {lo} of a VMM region and its head")


@pytest.mark.parametrize("block", [4096, 64 * 1024, "batch"], ids=["waited-by-poster", "completer", "batches"])
def test_deregister_under_a_stopped_one_sided_gpu_writer(pair, block):
    """As above, but the child is SIGSTOPped mid-stream (its completer too, with copies queued on the
    GPU) and continued 1.5 s later: whenever deregister() returns, nothing lands after it."""
    local, c, dst = _one_sided_gpu_stream(pair, block, 52)
    c.kill(signal.SIGSTOP)
    timer = threading.Timer(1.5, lambda: os.kill(c.pid, signal.SIGCONT))
    timer.start()
    local.ep.deregister(dst)
    local.mem["dst"].fill_(0xEE)
    torch.cuda.synchronize(0)
    timer.join()
    time.sleep(0.3)
    torch.cuda.synchronize(0)
    assert_poison(local.get("dst"), "a deregistered GPU region under a stopped writer", value=0xEE)
