"""tether as a NIXL backend with GPU memory (VRAM), two agents in two processes (device machine).

With one GPU both processes use GPU 0 (a real path: CUDA IPC on one device, tcp staging both ways
through one PCIe link); with two, the target uses GPU 1. TETHER runs over ipc and over tcp (the
transport parameter forces it), NIXL's UCX backend beside it. Random data, poisoned destinations,
every byte checked.
"""
from __future__ import annotations

import numpy as np
import pytest

from nixl_agent import POISON, rand_bytes
from test_nixl import SITES, T, _whole, agents, nixl_site, spawn, vllm_teardown  # noqa: F401  (fixtures)
from tether_testutil.data import MiB
from tether_testutil.gpu import torch_gpus

GPUS = torch_gpus()[1]
pytestmark = [
    pytest.mark.skipif(not SITES, reason="NIXL is not installed"),
    pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU (torch.cuda) on this machine: VRAM tests run on the device machine"),
]
DEV_A, DEV_B = "cuda:0", f"cuda:{min(1, GPUS - 1)}" if GPUS else "cuda:0"

# (backend, backend parameters): TETHER forced onto each transport; UCX as NIXL ships it.
BACKENDS = {"TETHER-ipc": ("TETHER", {"transport": "ipc"}), "TETHER-tcp": ("TETHER", {"transport": "tcp"}),
            "UCX": ("UCX", {})}


@pytest.fixture(params=list(BACKENDS))
def gpair(request, spawn):  # noqa: F811
    backend, params = BACKENDS[request.param]
    a, b = spawn(), spawn()
    a.call("create", "A", backend, params, capture_telemetry=True)
    b.call("create", "B", backend, params, capture_telemetry=True)
    return a, b


def _rows(addr: int, block: int, count: int, dev: int) -> np.ndarray:
    r = np.zeros((count, 3), dtype=np.uint64)
    r[:, 0] = addr + np.arange(count, dtype=np.uint64) * block
    r[:, 1] = block
    r[:, 2] = dev
    return r


def _bytes(agent, name) -> np.ndarray:
    return np.frombuffer(agent.call("get", name, timeout=T), dtype=np.uint8)


def _write_and_read_back(a, b, size, seed, a_dev, b_dev):
    """A: "src" (random, seed) and "back" (poison); B: "dst" (poison). Prepped lists "l" (src, back)
    and "r" (dst); None for a device means host memory (DRAM)."""
    a.call("alloc", "src", size, seed=seed, device=a_dev)
    a.call("alloc", "back", size, device=a_dev)
    b.call("alloc", "dst", size, device=b_dev)
    a.call("register", ["src", "back"])
    b.call("register", ["dst"])
    assert a.call("add_remote", b.call("metadata")) == "B"
    mem = lambda dev: "VRAM" if dev else "DRAM"  # noqa: E731
    a.call("prep", "l", "NIXL_INIT_AGENT", np.vstack([_whole(a, "src"), _whole(a, "back")]), mem(a_dev))
    a.call("prep", "r", "B", _whole(b, "dst"), mem(b_dev))


@pytest.mark.parametrize("size", [4096 + 3, 64 * MiB + 5])
def test_vram_write_then_read_every_byte(gpair, size):
    a, b = gpair
    _write_and_read_back(a, b, size, 11, DEV_A, DEV_B)
    a.call("xfer", "w", "WRITE", "l", [0], "r", [0], notif=b"written")
    assert a.call("run", "w", timeout=T)[0] == "DONE"
    assert b.call("notifs", 1, T) == {"A": [b"written"]}
    assert _bytes(b, "dst").tobytes() == rand_bytes(11, size).tobytes()
    b.call("fill", "dst", 12)  # new bytes at the target, then read them back
    a.call("xfer", "r", "READ", "l", [1], "r", [0])
    assert a.call("run", "r", timeout=T)[0] == "DONE"
    assert _bytes(a, "back").tobytes() == rand_bytes(12, size).tobytes()


def test_vram_write_notification_only_after_data(gpair):
    a, b = gpair
    size, parts = 32 * MiB, 16
    a.call("alloc", "src", size, seed=21, device=DEV_A)
    b.call("alloc", "dst", size, device=DEV_B)
    a.call("register", ["src"])
    b.call("register", ["dst"])
    assert a.call("add_remote", b.call("metadata")) == "B"
    dev_a, dev_b = a.call("addr", "src")[3], b.call("addr", "dst")[3]
    a.call("prep", "l", "NIXL_INIT_AGENT", _rows(a.call("addr", "src")[1], size // parts, parts, dev_a), "VRAM")
    a.call("prep", "r", "B", _rows(b.call("addr", "dst")[1], size // parts, parts, dev_b), "VRAM")
    b.start("on_notif_check", "dst", 21)
    a.call("xfer", "w", "WRITE", "l", list(range(parts)), "r", list(range(parts)), notif=b"layer-0")
    assert a.call("run", "w", timeout=T)[0] == "DONE"
    got, complete = b.result(T)
    assert got == {"A": [b"layer-0"]}
    assert complete, "the notification arrived before all of the data"


def test_vllm_call_pattern_with_cuda_tensors(gpair, nixl_site):  # noqa: F811
    """vLLM's NixlConnector on GPU KV caches: per-layer K and V tensors of 16-token blocks, strided
    (Nx5) lists where NIXL has them, decode pulls permuted block ids with "req:consumers" notifications,
    telemetry, heartbeats, teardown."""
    a, b = gpair
    strided = tuple(int(x) for x in nixl_site["version"].split(".")[:2]) >= (1, 5)
    layers, blocks, block = 4, 64, 16 * 8 * 128 * 2  # 16 tokens x 8 heads x 128 dims x fp16 = 32 KiB
    b_names = [f"kv{r}" for r in range(2 * layers)]
    a_names = list(b_names)
    b_addrs = [b.call("alloc", n, blocks * block, seed=300 + i, device=DEV_B) for i, n in enumerate(b_names)]
    a_addrs = [a.call("alloc", n, blocks * block, device=DEV_A) for n in a_names]
    b.call("register", b_names)
    a.call("register", a_names)
    dev_a, dev_b = a.call("addr", a_names[0])[3], b.call("addr", b_names[0])[3]
    remote = a.call("add_remote", b.call("metadata"))
    assert a.call("check_remote", remote)

    def rows(addrs, dev):
        if strided:
            return np.array([[x, block, dev, block, blocks] for x in addrs], dtype=np.uint64)
        return np.vstack([_rows(x, block, blocks, dev) for x in addrs])

    a.call("prep", "local", "NIXL_INIT_AGENT", rows(a_addrs, dev_a), "VRAM")
    a.call("prep", "remote", remote, rows(b_addrs, dev_b), "VRAM")
    rng = np.random.default_rng(5)
    filled = {}  # decode block -> prefill block it must now hold
    sizes = []   # bytes per request
    for req in range(3):  # three requests in flight at once, their blocks interleaved in both pools
        free = [i for i in range(blocks) if i not in filled]
        n = int(rng.integers(4, 16))
        lid = rng.choice(free, n, replace=False)
        rid = rng.choice(blocks, n, replace=False)
        filled.update(zip(map(int, lid), map(int, rid)))
        sizes.append(n * block * 2 * layers)
        flat = lambda ids: [r * blocks + int(i) for r in range(2 * layers) for i in ids]  # noqa: E731
        a.call("xfer", f"req{req}", "READ", "local", flat(lid), "remote", flat(rid), notif=b"req-%d:1" % req)
        assert a.call("post", f"req{req}") in ("PROC", "DONE")
    for req in range(3):
        assert a.call("wait", f"req{req}", T)[0] == "DONE"
        assert a.call("telemetry", f"req{req}")["bytes"] == sizes[req]
        a.call("release", f"req{req}")
    for r in range(2 * layers):
        got = _bytes(a, a_names[r]).reshape(blocks, block)
        want = rand_bytes(300 + r, blocks * block).reshape(blocks, block)
        for d in range(blocks):
            if d in filled:
                assert got[d].tobytes() == want[filled[d]].tobytes(), f"layer row {r} block {d}"
            else:
                assert (got[d] == POISON).all(), f"block {d} was written though no request named it"
    vllm_teardown(a, b, remote, "A", 3, a_names)


def test_dram_to_vram_and_back(spawn):  # noqa: F811
    """Mixed memory: host buffer to a GPU buffer over tcp (staged) and back."""
    a, b = agents(spawn, "TETHER", {"transport": "tcp"})
    size = 8 * MiB + 1
    _write_and_read_back(a, b, size, 31, None, DEV_B)
    a.call("xfer", "w", "WRITE", "l", [0], "r", [0])
    assert a.call("run", "w", timeout=T)[0] == "DONE"
    assert _bytes(b, "dst").tobytes() == rand_bytes(31, size).tobytes()
    a.call("xfer", "r", "READ", "l", [1], "r", [0])
    assert a.call("run", "r", timeout=T)[0] == "DONE"
    assert _bytes(a, "back").tobytes() == rand_bytes(31, size).tobytes()
