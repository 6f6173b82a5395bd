"""GPU test modules: the GPUs, torch and kernels here (skipping a module, saying why, where there
are none), this process's side of a two-process GPU test, and that side linked to a child's."""
from __future__ import annotations

from typing import Optional

import numpy as np
import pytest

import tether

from .data import poisoned, rand_bytes


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
