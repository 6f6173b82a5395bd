"""The KV hand-off, three ways, behind one small interface (no torch here: pools may be NumPy arrays).

Prefill side (`Source`): registers its pool, says how to reach it (`info()`, sent over the side
channel), and hears from decode (`notifications()`: a READ's notification means "I have your blocks,
free them"). Decode side (`Puller`): registers its pool, connects from prefill's `info()`, and `pull()`s
one request: ONE READ of every layer's K and V blocks, carrying a notification back to prefill.

- "tether":      tether's own API: one region per pool, one `Peer.readv_blocks` per request.
- "nixl-TETHER": NIXL's Python API with backends=["TETHER"], called the way vLLM's NixlConnector does
                 (per-layer K/V regions, prepped descriptor lists of every block, make_prepped_xfer).
- "nixl-UCX":    the same NIXL calls with NIXL's own UCX backend, for comparison.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from paged_kv import Geometry, PagedKVPool

PATHS = ("tether", "nixl-TETHER", "nixl-UCX")


def path_unavailable(path: str) -> str:
    """"" if `path` can run here, else why not."""
    if path not in PATHS:
        return f"unknown path {path!r} (one of {', '.join(PATHS)})"
    if path.startswith("nixl-"):
        try:
            import nixl._api  # noqa: F401
        except ImportError:
            return "NIXL is not installed (pip install nixl)"
    return ""


class TransferFailed(RuntimeError):
    pass


def _remote_geometry(local: PagedKVPool, info: dict) -> Geometry:
    """Prefill's pool as decode sees it: the same slabs and block size, its own block count."""
    if info["block_bytes"] != local.block_bytes:
        raise RuntimeError("prefill and decode disagree on the block layout (model or dtype differ)")
    return Geometry(local.layers * 2, info["num_blocks"], info["block_bytes"])


# --------------------------------------------------------------------------------------- tether


class TetherSource:
    def __init__(self, pool: PagedKVPool, name: str, options: dict):
        import tether
        self.pool = pool
        self.ep = tether.Endpoint(name=name, **options)
        # Decode only reads: a read-only registration refuses any remote write into prefill's pool.
        self.region = self.ep.register(pool.data, readonly=True)

    def info(self) -> dict:
        return {"metadata": self.ep.metadata(), "descriptor": self.region.descriptor(),
                "num_blocks": self.pool.num_blocks, "block_bytes": self.pool.block_bytes}

    def notifications(self, timeout: float) -> list[bytes]:
        return [n.data for n in self.ep.notifications(timeout)]

    def close(self) -> None:
        self.ep.close()


class TetherPuller:
    def __init__(self, pool: PagedKVPool, name: str, options: dict):
        import tether
        self.pool = pool
        self.ep = tether.Endpoint(name=name, **options)
        self.region = self.ep.register(pool.data)

    def connect(self, info: dict) -> None:
        self.peer = self.ep.connect(info["metadata"], timeout=30)
        self.remote = info["descriptor"]
        self.remote_geometry = _remote_geometry(self.pool, info)

    def pull(self, local_flat: np.ndarray, remote_flat: np.ndarray, notify: bytes) -> Any:
        bb = np.uint64(self.pool.block_bytes)
        return self.peer.readv_blocks(self.region, self.remote, local_flat.astype(np.uint64) * bb,
                                      remote_flat.astype(np.uint64) * bb, self.pool.block_bytes, notify=notify)

    def done(self, t) -> bool:
        if not t.done():
            return False
        t.wait(0)  # raises the transfer's typed error (ConnectionLost, OutOfRange, ...), if any
        return True

    def release(self, t) -> None:
        pass

    def notify(self, msg: bytes) -> None:
        self.peer.notify(msg).wait(30)

    @property
    def transport(self) -> str:
        return self.peer.transport

    def close(self) -> None:
        self.ep.close()


# ----------------------------------------------------------------------------------------- NIXL


def _agent(name: str, backend: str, params: dict):
    from nixl._api import nixl_agent, nixl_agent_config
    if not params:  # vLLM's form: the backend named in the agent's config
        return nixl_agent(name, nixl_agent_config(backends=[backend]))
    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    agent.create_backend(backend, params)
    return agent


def _register(agent, pool: PagedKVPool):
    """Each layer's K and V slab as its own region, as vLLM registers its per-layer caches."""
    slabs = [pool.slab(layer, kv) for layer in range(pool.layers) for kv in (0, 1)]
    if pool.device is None and not hasattr(slabs[0], "data_ptr"):  # NumPy: (addr, len, dev) rows
        rows = np.array([[s.ctypes.data, s.nbytes, 0] for s in slabs], dtype=np.uint64)
        descs = agent.get_reg_descs(rows, "DRAM")
    else:                                                           # torch: the tensor list
        descs = agent.get_reg_descs(slabs)
    agent.register_memory(descs)
    return descs


def _mem_type(pool: PagedKVPool) -> str:
    return "DRAM" if pool.device is None else "VRAM"


def _slab_addrs(pool: PagedKVPool) -> list[int]:
    return [pool.ptr + s * pool.num_blocks * pool.block_bytes for s in range(pool.layers * 2)]


def _block_rows(addrs: list[int], num_blocks: int, block_bytes: int, dev: int, form: str) -> np.ndarray:
    """Every block of every slab, descriptor index slab * num_blocks + block: one (addr, len, dev) row
    per block (vLLM's per-block list), or one strided (addr, len, dev, stride, count) row per slab."""
    if form == "nx5":
        return np.array([[a, block_bytes, dev, block_bytes, num_blocks] for a in addrs], dtype=np.uint64)
    rows = np.empty((len(addrs) * num_blocks, 3), dtype=np.uint64)
    rows[:, 0] = (np.asarray(addrs, dtype=np.uint64)[:, None]
                  + np.arange(num_blocks, dtype=np.uint64)[None, :] * np.uint64(block_bytes)).reshape(-1)
    rows[:, 1] = block_bytes
    rows[:, 2] = dev
    return rows


class NixlSource:
    def __init__(self, pool: PagedKVPool, name: str, backend: str, params: dict):
        self.pool, self.name = pool, name
        self.agent = _agent(name, backend, params)
        self.descs = _register(self.agent, pool)

    def info(self) -> dict:
        # What vLLM's NixlAgentMetadata carries: agent metadata, region addresses, block geometry.
        return {"agent_metadata": self.agent.get_agent_metadata(), "slab_addrs": _slab_addrs(self.pool),
                "num_blocks": self.pool.num_blocks, "block_bytes": self.pool.block_bytes,
                "device_id": self.pool.device or 0, "mem_type": _mem_type(self.pool)}

    def notifications(self, timeout: float) -> list[bytes]:
        """NIXL has no blocking wait: poll get_new_notifs (as vLLM's engine loop does each step)."""
        deadline = time.monotonic() + timeout
        while True:
            got = [m for msgs in self.agent.get_new_notifs().values() for m in msgs]
            if got or time.monotonic() >= deadline:
                return got
            time.sleep(0.0005)

    def close(self) -> None:
        self.agent.deregister_memory(self.descs)


class NixlPuller:
    def __init__(self, pool: PagedKVPool, name: str, backend: str, params: dict, form: str = "blocks"):
        self.pool, self.form, self.backend = pool, form, backend
        self.agent = _agent(name, backend, params)
        self.descs = _register(self.agent, pool)

    def connect(self, info: dict) -> None:
        a = self.agent
        name = a.add_remote_agent(info["agent_metadata"])
        self.remote_name = name.decode() if isinstance(name, bytes) else name
        mem = _mem_type(self.pool)
        p = self.pool
        local = _block_rows(_slab_addrs(p), p.num_blocks, p.block_bytes, p.device or 0, self.form)
        remote = _block_rows(info["slab_addrs"], info["num_blocks"], info["block_bytes"], info["device_id"], self.form)
        self.local_h = a.prep_xfer_dlist("NIXL_INIT_AGENT", local, mem)
        self.remote_h = a.prep_xfer_dlist(self.remote_name, remote, info["mem_type"])
        self.remote_geometry = _remote_geometry(self.pool, info)

    def pull(self, local_flat: np.ndarray, remote_flat: np.ndarray, notify: bytes) -> Any:
        # The prepped lists hold every block in flat order, so a flat index is a descriptor index.
        h = self.agent.make_prepped_xfer("READ", self.local_h, local_flat, self.remote_h, remote_flat,
                                         notif_msg=notify)
        state = self.agent.transfer(h)
        if state == "ERR":
            self.agent.release_xfer_handle(h)
            raise TransferFailed(f"NIXL {self.backend} READ could not be posted")
        return h

    def done(self, h) -> bool:
        state = self.agent.check_xfer_state(h)
        if state == "ERR":
            raise TransferFailed(f"NIXL {self.backend} READ failed")
        return state == "DONE"

    def release(self, h) -> None:
        self.agent.release_xfer_handle(h)

    def notify(self, msg: bytes) -> None:
        self.agent.send_notif(self.remote_name, notif_msg=msg)

    @property
    def transport(self) -> str:
        return f"NIXL {self.backend}"

    def close(self) -> None:
        a = self.agent
        a.release_dlist_handle(self.local_h)
        a.release_dlist_handle(self.remote_h)
        a.remove_remote_agent(self.remote_name)
        a.deregister_memory(self.descs)


def make_source(path: str, pool: PagedKVPool, name: str, options: dict) -> Any:
    if path == "tether":
        return TetherSource(pool, name, options)
    return NixlSource(pool, name, path.split("-", 1)[1], _nixl_params(path, options))


def make_puller(path: str, pool: PagedKVPool, name: str, options: dict, form: str = "blocks") -> Any:
    if path == "tether":
        return TetherPuller(pool, name, options)
    return NixlPuller(pool, name, path.split("-", 1)[1], _nixl_params(path, options), form)


def _nixl_params(path: str, options: dict) -> dict:
    """tether's options are TETHER's backend parameters (strings); UCX takes none of them."""
    if path != "nixl-TETHER":
        return {}
    return {k: str(v) for k, v in options.items() if k != "name"}


def poll_done(puller, handles: dict, done_at: dict) -> None:
    """Stamps every READ seen finished for the first time: done_at[key] = time.perf_counter()."""
    for key, h in handles.items():
        if key not in done_at and puller.done(h):
            done_at[key] = time.perf_counter()
