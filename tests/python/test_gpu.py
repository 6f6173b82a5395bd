"""GPU memory over TCP between two processes (staged through pinned host memory): every pairing (GPU->GPU on different and on the
same GPU, host->GPU, GPU->host), every operation, each unpack mode; random data, poisoned
destinations, every byte checked. Needs CUDA, torch with a GPU; skipped otherwise, saying why. With
one GPU the GPU0->GPU1 pairings run GPU0->GPU0 between the two processes (GpuEnv.pairs)."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import tether
from tether_testutil.data import MiB, POISON, assert_bytes_equal, assert_poison, cancel_and_wait, poisoned, rand_bytes, wait_until
from tether_testutil.gpu import gpu_env, linked, read_checked, send_checked, shuffled_blocks, writev_readv_shuffled
from tether_testutil.sockets import raw_peer, recv_exact, recv_until_closed
from tether_testutil.wire import FRAME, KACK, KWRITE, KWRITE_BATCH, fragment, frame

GPU = gpu_env("GPU tests")
torch, _ngpu = GPU.torch, GPU.ngpu
_dev = GPU.device

T = 60
MODES = ["kernel", "d2d", "host"]
# (local memory, remote memory): "gpu0"/"gpu1" = that GPU, "host" = host memory
PAIRS = GPU.pairs([("gpu0", "gpu1"), ("gpu0", "gpu0"), ("host", "gpu1"), ("gpu0", "host")])
SIZE = 5 * MiB + 12345  # several chunks and a partial one


@pytest.fixture(params=MODES)
def mode(request):
    return GPU.unpack_mode(request.param)


@pytest.fixture
def pair(mode, children):
    """(local, peer, child) connected, both with `mode`: GPU over TCP staging."""
    yield from linked(children("gpu-peer", env={"TETHER_UNPACK": mode}),
                      lambda: GPU.local(unpack=mode, transport="tcp"), "tcp")


@pytest.mark.parametrize("lk,rk", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_write_and_notify(pair, lk, rk):
    local, peer, c = pair
    desc = c.call("register", "dst", SIZE, device=_dev(rk))
    src = local.region("src", lk, SIZE, seed=41)
    c.start("check_on_notify", "dst", 41, 0, SIZE)
    peer.write(src, desc, notify=b"done").wait(T)
    r = c.result(T)
    assert not r["timed_out"] and r["mismatch"] is None, r
    assert_bytes_equal(np.frombuffer(c.call("get", "dst"), np.uint8), rand_bytes(41, SIZE))


@pytest.mark.parametrize("lk,rk", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_read(pair, lk, rk):
    local, peer, c = pair
    desc = c.call("register", "src", SIZE, fill=("seed", 42), device=_dev(rk))
    read_checked(local, peer, lk, desc, SIZE, 42, T)
    # the lanes' counters: every byte received, and time waiting on staging copies where GPU memory is
    lanes = local.ep.stats()["lanes"]
    assert sum(x["bytes_received"] for x in lanes) == SIZE, lanes
    assert (sum(x["staging_s"] for x in lanes) > 0) == (lk != "host"), lanes
    theirs = c.call("stats")["lanes"]
    assert (sum(x["staging_s"] for x in theirs) > 0) == (rk != "host"), theirs
    # pinned staging slots a lane's ring held at once: some where GPU memory was staged, none elsewhere
    for side, kind in ((lanes, lk), (theirs, rk)):
        peaks = [x["staging_slots_peak"] for x in side]
        assert (max(peaks) >= 1) == (kind != "host") and max(peaks) <= 8, peaks


@pytest.mark.parametrize("lk,rk", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_a_large_staged_read_is_pushed_by_the_target(pair, lk, rk):
    """A contiguous tcp read with GPU memory on either side and two chunks or more per lane is one kPull:
    the target pushes it as a send (its reads_pushed counts it). Cancelled mid-way it ends cancelled or
    whole, and the next read of the same bytes is whole; a vectored read still goes as requests."""
    local, peer, c = pair
    n = 48 * MiB + 12345
    desc = c.call("register", "big", n, fill=("seed", 44), device=_dev(rk))
    dst = local.region("bigdst", lk, n + 100)
    before = c.call("stats")["reads_pushed"]
    peer.read(dst, desc, local_offset=100).wait(T)
    got = local.get("bigdst")
    assert_poison(got[:100])
    assert_bytes_equal(got[100:], rand_bytes(44, n))
    assert c.call("stats")["reads_pushed"] == before + 1
    t = peer.read(dst, desc, local_offset=100)
    cancel_and_wait(t, T)
    m = local.mem["bigdst"]
    m[:] = POISON
    if not isinstance(m, np.ndarray):
        import torch
        torch.cuda.synchronize()
    peer.read(dst, desc, local_offset=100).wait(T)
    assert_bytes_equal(local.get("bigdst")[100:], rand_bytes(44, n))
    pushed = c.call("stats")["reads_pushed"]
    peer.readv([(dst, 100 + i * (n // 4), desc, i * (n // 4), n // 4) for i in range(4)]).wait(T)
    assert c.call("stats")["reads_pushed"] == pushed


@pytest.mark.parametrize("lk,rk", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_vectored_write_and_read(pair, lk, rk):
    """Many small scattered blocks both ways (the KV-cache pattern), offsets shuffled."""
    local, peer, c = pair
    blocks, bs = 300, 16 * 1024 + 64
    desc = c.call("register", "dst", blocks * bs, device=_dev(rk))
    writev_readv_shuffled(local, peer, c, lk, desc, blocks, bs, T)


@pytest.fixture
def one_lane_pair(mode, children):
    """As `pair`, over one lane: which batch a lane cuts depends on what it already has in flight."""
    yield from linked(children("gpu-peer", env={"TETHER_UNPACK": mode, "TETHER_CHANNELS": "1"}),
                      lambda: GPU.local(unpack=mode, transport="tcp", channels=1), "tcp")


@pytest.mark.parametrize("lk,rk", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_small_gpu_blocks_batch_two_chunks_behind_one(one_lane_pair, lk, rk):
    """Where GPU memory is on either side, 256 blocks of 16 KiB (4 MiB, chunks of 1 MiB) go over one lane
    as kWriteBatch frames of 1, 2 and 1 MiB: an idle lane's first batch is one chunk, so its gather is
    short and the wire starts soon; behind it a batch carries two (Caps::gpu_batch_chunks: each batch is
    a kernel launch on each side). Read back as three kReadBatch requests alike; every byte lands in
    its place both ways."""
    local, peer, c = one_lane_pair
    blocks, bs = 256, 16 * 1024
    n = blocks * bs
    desc = c.call("register", "dst", n, device=_dev(rk))
    src = local.region("src", lk, n, seed=44)
    order = np.random.default_rng(8).permutation(blocks)
    before = local.ep.stats()["chunks_sent"]
    peer.writev([(src, int(i) * bs, desc, int(j) * bs, bs) for i, j in enumerate(order)]).wait(T)
    assert local.ep.stats()["chunks_sent"] - before == 3
    assert_bytes_equal(np.frombuffer(c.call("get", "dst"), np.uint8), shuffled_blocks(44, blocks, bs, order))
    back = local.region("back", lk, n)  # poisoned
    before = c.call("stats")["chunks_sent"]  # the target's answers, each carrying one batch's blocks
    peer.readv([(back, int(i) * bs, desc, int(j) * bs, bs) for i, j in enumerate(order)]).wait(T)
    assert c.call("stats")["chunks_sent"] - before == 3
    assert_bytes_equal(local.get("back"), rand_bytes(44, n))


def _two_batch_write(children, env, seed, fill_receiver_gpu=False):
    """256 x 16 KiB GPU blocks, GPU to GPU between two processes with `env` on both sides and one lane,
    shuffled, in three kWriteBatch frames (each a gather and an unpack kernel launch); every byte. With
    `fill_receiver_gpu` the receiver takes its GPU's memory first (after a contiguous warm-up write into
    another region, which readies the staging rings), so it finds no room for a scratch buffer (nor does
    the sender, where both share one GPU)."""
    env = {**env, "TETHER_CHANNELS": "1"}
    sender, receiver = children("sender", env=env), children("receiver", env=env)
    blocks, bs = 256, 16 * 1024
    n = blocks * bs
    target = receiver.call("endpoint", transport="tcp")["metadata"]
    sender.call("endpoint", transport="tcp")
    desc = receiver.call("register", "dst", n, device=_dev("gpu0"))
    sender.call("register", "src", n, fill=("seed", seed), device=_dev(GPU.kind("gpu1")))
    sender.call("connect", target)
    assert sender.call("transport") == "tcp"
    if fill_receiver_gpu:
        warm = receiver.call("register", "warm", n, device=_dev("gpu0"))
        assert sender.call("write", "src", warm)[0] == "ok"
        taken, free = receiver.call("fill_gpu", _dev("gpu0"), timeout=120)
        assert free < 2 * MiB, f"took {taken} bytes of GPU memory, {free} still free"
    order = np.random.default_rng(seed).permutation(blocks)
    before = sender.call("stats")["chunks_sent"]
    assert sender.call("writev", [("src", int(i) * bs, int(j) * bs, bs) for i, j in enumerate(order)], desc)[0] == "ok"
    assert sender.call("stats")["chunks_sent"] - before == 3
    if fill_receiver_gpu:
        receiver.call("free_gpu")
    assert_bytes_equal(np.frombuffer(receiver.call("get", "dst"), np.uint8), shuffled_blocks(seed, blocks, bs, order))


@pytest.mark.gpu_alone
def test_scattered_blocks_land_when_the_gpu_has_no_room_for_scratch(children):
    """Kernel-mode staging copies through a device scratch buffer; a GPU with no memory left for one (a
    serving engine took it) sends the ring's copies direct instead, and nothing is lost."""
    GPU.unpack_mode("kernel")
    _two_batch_write(children, {"TETHER_UNPACK": "kernel"}, 48, fill_receiver_gpu=True)


def test_long_frames_from_a_hand_made_peer_of_a_gpu_target(endpoints):
    """A hand-made peer of a target whose lane stages GPU memory. A 9 MiB kWrite into host memory (longer
    than any GPU-bound frame) lands and is answered: it does not wait for a run of nine staging slots the
    ring never has. A kWriteBatch of three chunks' bytes into GPU memory, one more than a GPU batch
    carries, drops that peer with the GPU bytes untouched; the target keeps serving."""
    server = endpoints(name="server", transport="tcp")
    dev = _dev("gpu0")
    gpu = torch.full((4 * MiB,), POISON, dtype=torch.uint8, device=f"cuda:{dev}")
    gdesc = server.register(gpu).descriptor()
    host = poisoned(9 * MiB)
    hdesc = server.register(host).descriptor()
    small, big = rand_bytes(46, 4096), rand_bytes(47, 9 * MiB)
    socks = raw_peer(server.address)
    try:
        data = socks[1]
        data.sendall(frame(KWRITE, 1, gdesc, 0, small.size) + small.tobytes())  # through a bounce slot
        h = FRAME.unpack(recv_exact(data, FRAME.size, timeout=T))
        assert (h[0], h[1], h[3]) == (KACK, 0, 1), h
        data.sendall(frame(KWRITE, 2, hdesc, 0, big.size) + big.tobytes())
        h = FRAME.unpack(recv_exact(data, FRAME.size, timeout=T))
        assert (h[0], h[1], h[3]) == (KACK, 0, 2), h
        assert_bytes_equal(host, big, "9 MiB host write")
        table = b"".join(fragment(gdesc, i * MiB, MiB) for i in range(3))
        try:
            data.sendall(frame(KWRITE_BATCH, 3, region_id=3, length=3 * MiB) + table + bytes(3 * MiB))
        except OSError:
            pass  # the target may close while the payload is still going
        for s in socks:
            recv_until_closed(s, timeout=10)
        assert wait_until(lambda: server.peers() == [], 5), server.peers()
    finally:
        for s in socks:
            s.close()
    torch.cuda.synchronize(dev)
    got = gpu.cpu().numpy()
    assert_bytes_equal(got[:small.size], small, "GPU region")
    assert_poison(got[small.size:], "GPU region after the refused batch")
    client = endpoints(name="client", transport="tcp")
    peer = client.connect(server.metadata(), timeout=10)
    src = rand_bytes(48, 2 * MiB)
    peer.write(client.register(src), gdesc, remote_offset=MiB, length=src.size).wait(T)
    torch.cuda.synchronize(dev)
    assert_bytes_equal(gpu[MiB:3 * MiB].cpu().numpy(), src, "write after the dropped peer")


@pytest.mark.parametrize("lk,rk", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_send_recv(pair, lk, rk):
    local, peer, c = pair
    c.call("register", "rbuf", SIZE + 7, device=_dev(rk))
    send_checked(local, peer, c, lk, SIZE, T)


def test_staging_nap(children):
    """A progress thread whose lanes wait only on staged copies naps between polls (tcp_lane.h
    kStagingNapUs). Every byte must move, and a nap must never stall a transfer: a copy is polled again
    after every nap, a staged payload's SO_RCVLOWAT never asks for more than is still to come."""
    c = children("gpu-peer")
    local = GPU.local(transport="tcp")
    try:
        peer = local.ep.connect(c.call("endpoint")["metadata"], timeout=10)
        n = 3 * SIZE
        desc = c.call("register", "dst", n, device=_dev(GPU.kind("gpu1")))  # GPU 1, or GPU 0 again
        src = local.region("src", "gpu0", n, seed=45)
        peer.write(src, desc).wait(T)
        assert_bytes_equal(np.frombuffer(c.call("get", "dst"), np.uint8), rand_bytes(45, n))
        back = local.region("back", "gpu0", n + 3)
        peer.read(back, desc, local_offset=3).wait(T)
        got = local.get("back")
        assert_poison(got[:3])
        assert_bytes_equal(got[3:], rand_bytes(45, n))
        blocks, bs = 257, 16 * 1024 + 8  # small blocks: read and write batches
        peer.readv([(back, i * bs, desc, (blocks - 1 - i) * bs, bs) for i in range(blocks)]).wait(T)
        want = rand_bytes(45, blocks * bs).reshape(blocks, bs)[::-1].reshape(-1)
        assert_bytes_equal(local.get("back")[:blocks * bs], want)
    finally:
        local.ep.close()


def test_no_stall_after_the_waiter_lands_a_staged_payload(children):
    """wait() reads its lane itself for its first busy_poll_us and may land a staged payload there,
    starting its copy into the GPU, then go to sleep. The lane's progress thread, asleep in epoll with
    nothing on its socket, had to learn of that copy, or the transfer sat out the thread's 1 s epoll
    timeout: 4,096 x 16 KiB GPU reads stalled for ~1 s several times per 150 on an H200 before the fix
    (docs/PERFORMANCE.md, "Defaults and why"). Every read here must end far sooner; the last one's bytes are checked."""
    c = children("gpu-peer")
    local = GPU.local(transport="tcp")
    try:
        peer = local.ep.connect(c.call("endpoint")["metadata"], timeout=10)
        blocks, bs = 4096, 16 * 1024
        desc = c.call("register", "src", blocks * bs, fill=("seed", 46), device=_dev(GPU.kind("gpu1")))
        back = local.region("back", "gpu0", blocks * bs)
        order = [(back, i * bs, desc, (blocks - 1 - i) * bs, bs) for i in range(blocks)]
        slowest = 0.0
        for _ in range(300):
            t0 = time.perf_counter()
            peer.readv(order).wait(T)
            slowest = max(slowest, time.perf_counter() - t0)
        want = rand_bytes(46, blocks * bs).reshape(blocks, bs)[::-1].reshape(-1)
        assert_bytes_equal(local.get("back"), want)
        assert slowest < 0.5, f"a 64 MiB read of 4,096 blocks took {slowest:.3f} s (a lost wake-up: ~1 s)"
    finally:
        local.ep.close()


def _read_requests(tmp_path, size: str) -> tuple:
    """From a traced `tether bench` of GPU reads of `size` (TETHER_TRACE: a request is taken, its answer
    answered, on one lane): the read requests per transfer (its chunks), and the most one lane of the
    initiator held unanswered at once."""
    prefix = str(tmp_path / f"tr{size}")
    env = dict(os.environ, TETHER_TRACE=prefix,
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(tether.__file__))) + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    remote = "1" if _ngpu > 1 else "0"
    r = subprocess.run([sys.executable, "-m", "tether", "bench", "--quiet", "--transport", "tcp", "--device", "gpu",
                        "--local-gpu-idx", "0", "--remote-gpu-idx", remote, "--channels", "8", "--sizes", size,
                        "--mode", "read", "--iters", "6", "--check"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for f in sorted(tmp_path.glob(f"tr{size}.*.tsv")):
        rows = [line.split("\t") for line in f.read_text().splitlines() if not line.startswith(("#", "ns\t"))]
        posts = sum(row[1] == "post" for row in rows)
        if not posts:
            continue  # the target's file
        held: dict = {}
        most = requests = 0
        for _ns, event, lane, typ, *_rest in sorted(rows, key=lambda row: int(row[0])):
            if event == "taken" and typ == "3":  # a read request taken by its lane
                requests += 1
                held[lane] = held.get(lane, 0) + 1
                most = max(most, held[lane])
            elif event == "answered" and typ == "4":
                held[lane] = held.get(lane, 0) - 1
        return requests / posts, most
    raise AssertionError(f"no initiator trace among {list(tmp_path.iterdir())}")


def test_a_staged_read_cuts_its_chunks_by_how_many_each_lane_gets(tmp_path):
    """A staged GPU read of fewer than two full chunks per lane is cut into smaller chunks (8 MiB over 8
    lanes: 256 KiB), and a lane holds at most three of them requested (PeerState::next_chunk,
    kStagedReadChunks: a lane's chunks land sooner). From two full chunks per lane on (16 MiB) the read is
    pulled (wire::kPull): the target pushes it, and no chunk is requested."""
    assert _read_requests(tmp_path, "8M") == (32, 3)
    assert _read_requests(tmp_path, "16M") == (0, 0)
    assert _read_requests(tmp_path, "64M") == (0, 0)


def test_gpu_region_checks():
    with tether.Endpoint() as ep:
        t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
        r = ep.register(t)
        assert r.kind == "cuda" and r.device == 0 and r.size == 1 << 20
        r2 = ep.register((t.data_ptr(), 4096))  # raw pointer: CUDA says it is GPU 0
        assert r2.kind == "cuda" and r2.device == 0
        with pytest.raises(tether.OutOfRange, match="past the end of its GPU allocation"):
            ep.register((t.data_ptr(), (1 << 20) + (64 << 20)), device=0)
        if _ngpu > 1:
            with pytest.raises(tether.InvalidArgument, match="not GPU 1"):
                ep.register((t.data_ptr(), 4096), device=1)
        with pytest.raises(tether.InvalidArgument, match="non-contiguous"):
            ep.register(torch.zeros(64, 64, dtype=torch.uint8, device="cuda:0")[:, :8])
        h = np.zeros(4096, np.uint8)
        with pytest.raises(tether.InvalidArgument, match="not GPU memory"):
            ep.register((h.ctypes.data, h.nbytes), device=0)



def test_vmm_memory_over_tcp(children):
    """A region of VMM memory spanning three physical allocations (cuMemCreate + cuMemMap back to
    back, as KV-cache pools and torch's expandable segments make it) registers whole and moves over
    tcp both ways; random data, poisoned destinations, every byte."""
    a, b = children("vmm-tcp-a"), children("vmm-tcp-b")
    a.call("endpoint", transport="tcp")
    info = b.call("endpoint", transport="tcp")
    a.call("connect", info["metadata"])
    n = 13 * MiB + 5
    desc = b.call("register_vmm", "dst", n + 10, GPU.other)  # GPU 1, or GPU 0 again on a one-GPU machine
    a.call("register_vmm", "src", n, 0, fill=("seed", 6))
    assert a.call("write", "src", desc, remote_offset=7, length=n) == ("ok", n)
    got = np.frombuffer(b.call("get", "dst"), np.uint8)
    assert_bytes_equal(got[7:7 + n], rand_bytes(6, n), "write into VMM memory")
    assert_poison(got[:7])
    assert_poison(got[7 + n:])
    a.call("register_vmm", "back", n, 0)
    assert a.call("read", "back", desc, remote_offset=7, length=n) == ("ok", n)
    assert_bytes_equal(np.frombuffer(a.call("get", "back"), np.uint8), rand_bytes(6, n), "read from VMM memory")
