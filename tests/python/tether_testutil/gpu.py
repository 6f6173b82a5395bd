"""GPU test modules: the GPUs, torch and kernels here (skipping a module, saying why, where there
are none), this process's side of a two-process GPU test, that side linked to a child's, and the
checks several transports' GPU modules run alike."""
from __future__ import annotations

from typing import Optional

import numpy as np
import pytest

import tether

from .child import child_bytes
from .data import assert_bytes_equal, assert_poison, poisoned, rand_bytes


def torch_gpus() -> tuple:
    """(torch, the GPUs it sees), or (None, 0) without torch (CPU CI)."""
    try:
        import torch
    except ImportError:
        return None, 0
    return torch, torch.cuda.device_count() if torch.cuda.is_available() else 0


class GpuEnv:
    """What a GPU test module needs: torch, tether's GPU count and kernel status, and `device(kind)`
    mapping "host" / "gpu0" / "gpu1" to None or a GPU index (skipping where that GPU is missing).

    Tests written for two GPUs run on one too: `pairs()` maps "gpu1" to GPU 0 there (two processes
    sharing one GPU: CUDA IPC on one device, staging both ways through one PCIe link) and `other` is
    the second GPU's index (0 when there is one). Only what needs two devices asks `device("gpu1")`."""

    def __init__(self, torch, ngpu: int, kernels: bool, kernels_why: str):
        self.torch, self.ngpu, self.kernels, self.kernels_why = torch, ngpu, kernels, kernels_why
        self.other = 1 if ngpu > 1 else 0

    def kind(self, kind: str) -> str:
        """ "gpu1" is GPU 0 on a one-GPU machine."""
        return "gpu0" if kind == "gpu1" and self.ngpu < 2 else kind

    def pairs(self, pairs: list) -> list:
        """(local kind, remote kind) pairings written for two GPUs, on the GPUs here; pairings that
        become one (gpu0-gpu1 and gpu0-gpu0 on one GPU) run once. Test ids: "-".join(pair)."""
        out: list = []
        for p in pairs:
            q = tuple(self.kind(k) for k in p)
            if q not in out:
                out.append(q)
        return out

    def device(self, kind: str) -> Optional[int]:
        d = None if kind == "host" else int(kind[-1])
        if d is not None and d >= self.ngpu:
            pytest.skip(f"needs GPU {d}; {self.ngpu} visible")
        return d

    def unpack_mode(self, mode: str) -> str:
        """`mode`, skipping the test where it is "kernel" and the unpack kernels are unavailable."""
        if mode == "kernel" and not self.kernels:
            pytest.skip(f"unpack=kernel unavailable: {self.kernels_why}")
        return mode

    def local(self, **endpoint) -> "LocalMemory":
        """This process's side: a new endpoint with options `endpoint`, regions on host or a GPU."""
        return LocalMemory(tether.Endpoint(**endpoint), self.device)


def gpu_env(what: str) -> GpuEnv:
    """Call at import of a GPU test module: skips the whole module, saying why, where CUDA or torch
    with a GPU is missing (CPU machines, CI)."""
    torch, seen = torch_gpus()
    have_torch = seen > 0
    cuda, why, ngpu, kernels, kwhy = tether._tether.gpu_status()
    if not (cuda and have_torch):
        pytest.skip(f"{what} need CUDA and torch with a GPU (tether: {why or 'ok'}; torch cuda: {have_torch})",
                    allow_module_level=True)
    return GpuEnv(torch, ngpu, kernels, kwhy)


class LocalMemory:
    """This process's side of a two-process GPU test: endpoint `ep` and named regions in host memory
    or on a GPU; `device(kind)` maps "host" / "gpu0" / "gpu1" to a GPU index, or None for host."""

    def __init__(self, ep, device):
        self.ep, self.device, self.mem = ep, device, {}

    def region(self, name, kind, size, seed=None):
        buf = rand_bytes(seed, size) if seed is not None else poisoned(size)
        d = self.device(kind)
        if d is None:
            obj = buf
        else:
            import torch
            obj = torch.from_numpy(buf).to(f"cuda:{d}")
            torch.cuda.synchronize(d)
        self.mem[name] = obj
        return self.ep.register(obj)

    def get(self, name):
        obj = self.mem[name]
        return obj if isinstance(obj, np.ndarray) else obj.cpu().numpy()


def linked(child, make_local, transport: str, /, **child_endpoint):
    """A two-process GPU test's pair, for a fixture to `yield from`: the child makes its endpoint
    (options `child_endpoint`), then `make_local()` this process's side (a LocalMemory), which connects
    to it and must get `transport`. Yields (local, peer, child); closes the local endpoint after."""
    info = child.call("endpoint", **child_endpoint)
    local = make_local()
    peer = local.ep.connect(info["metadata"], timeout=10)
    assert peer.transport == transport
    yield local, peer, child
    local.ep.close()


# The checks below take (local, peer, child) from `linked` and a local memory kind ("host", "gpu0", ...).

def write_notify_checked(local, peer, child, kind: str, desc, size: int, offset: int, seed: int, timeout: float):
    """`size` random bytes (`seed`) from a `kind` region written with a notification to `offset` of the
    child's poisoned "dst" (`desc`): the child sees the data whole at the notification; poison around it."""
    src = local.region("src", kind, size, seed=seed)
    child.start("check_on_notify", "dst", seed, offset, size)
    peer.write(src, desc, remote_offset=offset, length=size, notify=b"done").wait(timeout)
    r = child.result(timeout)
    assert not r["timed_out"] and r["mismatch"] is None, r
    got = child_bytes(child, "dst")
    assert_bytes_equal(got[offset:offset + size], rand_bytes(seed, size))
    assert_poison(got[:offset])
    assert_poison(got[offset + size:])


def read_checked(local, peer, kind: str, desc, size: int, seed: int, timeout: float):
    """The child's `size` random bytes (`seed`, at `desc`) read to offset 100 of a poisoned `kind` region "dst"."""
    dst = local.region("dst", kind, size + 100)
    peer.read(dst, desc, local_offset=100).wait(timeout)
    got = local.get("dst")
    assert_poison(got[:100])
    assert_bytes_equal(got[100:], rand_bytes(seed, size))


def shuffled_blocks(seed: int, blocks: int, bs: int, order) -> np.ndarray:
    """What a destination holds once block i of `seed`'s random bytes went to block order[i]."""
    want = rand_bytes(seed, blocks * bs).reshape(blocks, bs)
    expect = np.empty_like(want)
    expect[order] = want
    return expect.reshape(-1)


def writev_readv_shuffled(local, peer, child, kind: str, desc, blocks: int, bs: int, timeout: float):
    """`blocks` blocks of `bs` bytes (seed 43) from a `kind` region written to shuffled places of the
    child's "dst" (`desc`) in one writev, then read back from there in one readv: every byte both ways."""
    src = local.region("src", kind, blocks * bs, seed=43)
    order = np.random.default_rng(7).permutation(blocks)
    peer.writev([(src, int(i) * bs, desc, int(j) * bs, bs) for i, j in enumerate(order)]).wait(timeout)
    expect = shuffled_blocks(43, blocks, bs, order)
    assert_bytes_equal(child_bytes(child, "dst"), expect)
    back = local.region("back", kind, blocks * bs)
    peer.readv([(back, int(j) * bs, desc, int(j) * bs, bs) for j in order]).wait(timeout)
    assert_bytes_equal(local.get("back"), expect)


def send_checked(local, peer, child, kind: str, size: int, timeout: float):
    """`size` random bytes (seed 44) from a `kind` region sent (tag 5) into the child's poisoned "rbuf",
    which the caller registered, longer than `size`: every byte, and poison after them."""
    child.start("recv", "rbuf", tag=5, accepted=True)
    src = local.region("src", kind, size, seed=44)
    peer.send(src, tag=5).wait(timeout)
    assert child.result(timeout)[:2] == ("ok", size)
    got = child_bytes(child, "rbuf")
    assert_bytes_equal(got[:size], rand_bytes(44, size))
    assert_poison(got[size:])
