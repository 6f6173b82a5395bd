"""The netplugin transport with GPU memory, between two processes, against the testnet
plugin with its bounce pages in GPU memory (TETHER_TESTNET_BOUNCE=cuda: like TCPX devmem, sends
from CUDA pointers) and in host memory (GPU payloads staged through pinned memory): every
operation, every unpack mode, GPU0<->GPU1 (or one GPU twice), random data, poisoned destinations,
every byte checked. Plus the consume-early fault in GPU mode: handing pages back before the GPU
unpack has finished must corrupt data, and the check must see it.

Needs CUDA, torch with a GPU and cmake (the plugin is built like test_netplugin.py builds it, or
TETHER_TEST_NET_PLUGIN=path); skipped otherwise, saying why. Under compute-sanitizer:
    compute-sanitizer --tool memcheck --target-processes all python3 -m pytest tests/python/test_netplugin_gpu.py -k kernel -x -q
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import tether
from tether_testutil.child import Child
from tether_testutil.data import MiB, assert_bytes_equal, assert_poison, rand_bytes
from tether_testutil.gpu import (
    LocalMemory, gpu_env, linked, read_checked, send_checked, write_notify_checked, writev_readv_shuffled,
)

GPU = gpu_env("netplugin GPU tests")

ROOT = Path(__file__).resolve().parents[2]
T = 60
MODES = ["kernel", "d2d", "host"]
BOUNCES = ["cuda", "host"]
# (this process's memory, the child's memory): "gpu0"/"gpu1" = that GPU, "host" = host memory.
# The child's bounce pages are on GPU 1 when there are two (GPU 0 otherwise), ours on GPU 0, so
# gpu0-gpu1 takes the kernel path on both sides and gpu0-gpu0 the cross-GPU d2d fallback.
# One GPU: GpuEnv.pairs runs gpu0-gpu1 once, as gpu0-gpu0 (two processes sharing the GPU).
PAIRS = GPU.pairs([("gpu0", "gpu1"), ("gpu0", "gpu0"), ("host", "gpu1"), ("gpu0", "host")])
SIZE = 9 * MiB + 12345  # several 4 MiB frames and a partial one
CHILD_GPU = GPU.other


def _dev(kind):
    if kind == "host":
        return None
    d = int(kind[-1])
    return CHILD_GPU if d == 1 else 0  # one GPU: both "GPUs" are GPU 0


def _tool(name):
    """cmake / ninja from PATH, or from their pip packages (the build venv's bin may not be on PATH)."""
    found = shutil.which(name)
    if found:
        return found
    try:
        mod = __import__(name)
        path = Path(getattr(mod, "CMAKE_BIN_DIR", None) or getattr(mod, "BIN_DIR", "")) / name
        return str(path) if path.exists() else None
    except ImportError:
        return None


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
    """The testnet plugin, copied once per bounce kind: each copy is its own dlopen instance with
    its own settings (the plugin reads TETHER_TESTNET_* at init)."""
    src = os.environ.get("TETHER_TEST_NET_PLUGIN")
    if not src:
        cmake, ninja = _tool("cmake"), _tool("ninja")
        if cmake is None:
            pytest.skip("cmake not installed: the testnet plugin cannot be built")
        build = ROOT / "build" / "testnet-gpu"
        build.mkdir(parents=True, exist_ok=True)
        gen = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
        subprocess.run([cmake, str(ROOT), *gen, "-DTETHER_BUILD_PYTHON=OFF", "-DTETHER_BUILD_TEST_PLUGIN=ON",
                        "-DTETHER_CUDA=OFF", "-DCMAKE_BUILD_TYPE=Release"], cwd=build, check=True, capture_output=True)
        subprocess.run([cmake, "--build", ".", "--target", "tether_testnet"], cwd=build, check=True, capture_output=True)
        src = str(build / "libtether_testnet.so")
    d = tmp_path_factory.mktemp("testnet")
    for b in BOUNCES:
        shutil.copy(src, d / f"libtestnet_{b}.so")
    return d


def _env(bounce, mode, device, fault=None):
    env = {"TETHER_TESTNET_BOUNCE": bounce, "TETHER_TESTNET_CUDA_DEVICE": str(device), "TETHER_UNPACK": mode}
    if fault:
        env["TETHER_NET_FAULT"] = fault
    return env


class Local(LocalMemory):
    """This process's side: a netplugin endpoint and regions on host or GPU."""

    def __init__(self, plugin, bounce, mode, **kw):
        saved = {k: os.environ.get(k) for k in ("TETHER_TESTNET_BOUNCE", "TETHER_TESTNET_CUDA_DEVICE")}
        os.environ.update(TETHER_TESTNET_BOUNCE=bounce, TETHER_TESTNET_CUDA_DEVICE="0")
        try:  # the plugin reads them in init(), when the endpoint loads it
            self.ep = tether.Endpoint(transport="netplugin", net_plugin=plugin, unpack=mode, **kw)
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        assert self.ep.transports()["netplugin"] == "", self.ep.transports()["netplugin"]
        super().__init__(self.ep, _dev)


@pytest.fixture(scope="module", params=[(m, b) for b in BOUNCES for m in MODES], ids=lambda p: f"{p[0]}-{p[1]}bounce")
def pair(request, plugin_dir):
    """(local, peer, child) connected over netplugin, both sides with one unpack mode and bounce kind."""
    mode, bounce = request.param
    GPU.unpack_mode(mode)
    plugin = str(plugin_dir / f"libtestnet_{bounce}.so")
    c = Child(f"npgpu-{mode}-{bounce}", env=_env(bounce, mode, CHILD_GPU))
    try:
        yield from linked(c, lambda: Local(plugin, bounce, mode, chunk_bytes=4 * MiB), "netplugin",
                          name="npgpu-child", net_plugin=plugin, net_comms=3)
    finally:
        c.cleanup()


@pytest.mark.parametrize("lk,rk", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_write_and_notify(pair, lk, rk):
    local, peer, c = pair
    desc = c.call("register", "dst", SIZE + 200, device=_dev(rk))
    try:
        write_notify_checked(local, peer, c, lk, desc, SIZE, 100, 41, T)
    finally:
        c.call("deregister", "dst")


@pytest.mark.parametrize("lk,rk", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_read(pair, lk, rk):
    local, peer, c = pair
    desc = c.call("register", "src", SIZE, fill=("seed", 42), device=_dev(rk))
    try:
        read_checked(local, peer, lk, desc, SIZE, 42, T)
    finally:
        c.call("deregister", "src")


@pytest.mark.parametrize("lk,rk", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_writev_readv(pair, lk, rk):
    """Many small scattered blocks both ways, offsets shuffled."""
    local, peer, c = pair
    blocks, bs = 300, 16 * 1024 + 64
    desc = c.call("register", "dst", blocks * bs, device=_dev(rk))
    try:
        writev_readv_shuffled(local, peer, c, lk, desc, blocks, bs, T)
    finally:
        c.call("deregister", "dst")


@pytest.mark.parametrize("lk,rk", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_send_recv_both_ways(pair, lk, rk):
    local, peer, c = pair
    c.call("register", "rbuf", SIZE + 7, device=_dev(rk))
    try:
        send_checked(local, peer, c, lk, SIZE, T)
        c.call("fill", "rbuf", ("seed", 45))
        into = local.region("into", lk, SIZE + 64)
        t = peer.recv(into, tag=6)
        assert c.call("send", "rbuf", length=SIZE, tag=6, accepted=True) == ("ok", SIZE)
        t.wait(T)
        assert t.bytes == SIZE
        got = local.get("into")
        assert_bytes_equal(got[:SIZE], rand_bytes(45, SIZE + 7)[:SIZE], "message from the child")
        assert_poison(got[SIZE:])
    finally:
        c.call("deregister", "rbuf")


def test_notify_alone(pair):
    local, peer, c = pair
    peer.notify(b"alone").wait(T)
    assert [x[2] for x in c.call("notifications", 1)] == [b"alone"]


@pytest.mark.budget(120)
@pytest.mark.parametrize("mode", ["kernel", "d2d"])
def test_consuming_before_gpu_unpack_would_be_caught(plugin_dir, mode):
    """GPU bounce pages, a GPU destination: with the seeds' bug injected at the target (pages handed
    back before the unpack) the every-byte check sees corruption; without it the data is exact."""
    GPU.unpack_mode(mode)
    plugin = str(plugin_dir / "libtestnet_cuda.so")
    size = 16 * MiB
    src = rand_bytes(13, size)
    results = {}
    for fault in (None, "consume_early"):
        c = Child(f"npgpu-fault-{fault}", env=_env("cuda", mode, CHILD_GPU, fault))
        local = None
        try:
            info = c.call("endpoint", name="npgpu-fault", net_plugin=plugin)
            local = Local(plugin, "cuda", mode, chunk_bytes=256 << 10)
            peer = local.ep.connect(info["metadata"], timeout=10)
            desc = c.call("register", "dst", size, device=CHILD_GPU)
            peer.write(local.ep.register(src), desc).wait(T)  # completes: the fault only corrupts data
            got = np.frombuffer(c.call("get", "dst"), dtype=np.uint8)
            results[fault] = int(np.count_nonzero(got != src))
        finally:
            if local:
                local.ep.close()
            c.cleanup()
    assert results[None] == 0
    assert results["consume_early"] > 0, "consuming before the GPU unpack went unnoticed"
