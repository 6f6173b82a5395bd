"""A vLLM-like paged KV pool: one preallocated array [layers, 2 (K, V), num_blocks, block_size, kv_heads,
head_dim], so each layer's K (and V) is a contiguous slab of fixed-size blocks, like vLLM's per-layer
cache tensors. Requests own blocks at random places (a block table per request), so several requests'
blocks interleave.

Written against what NumPy arrays and torch tensors share (indexing, reshape), and never imports torch
unless it is handed a torch tensor: CI runs this same code with NumPy arrays for the caches.
"""
from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

import numpy as np

POISON = 0xA5  # every byte of a fresh pool: a block nobody wrote still reads as poison


def is_torch(x: Any) -> bool:
    return hasattr(x, "data_ptr") and hasattr(x, "element_size")


def mem_info(x: Any) -> tuple[int, int, Optional[int]]:
    """(address, bytes, GPU index or None for host memory) of a C-contiguous array or tensor."""
    if is_torch(x):
        assert x.is_contiguous()
        return x.data_ptr(), x.numel() * x.element_size(), (x.device.index or 0) if x.is_cuda else None
    assert x.flags.c_contiguous
    return x.ctypes.data, x.nbytes, None


def host_bytes(x: Any) -> np.ndarray:
    """The bytes of `x` as a host uint8 array (a copy off the GPU; works for any dtype, bfloat16 too)."""
    if is_torch(x):
        import torch
        return x.detach().contiguous().view(torch.uint8).cpu().numpy().reshape(-1)
    return np.ascontiguousarray(x).view(np.uint8).reshape(-1)


def fill_bytes(x: Any, value: int) -> None:
    if is_torch(x):
        import torch
        x.view(torch.uint8).fill_(value)
    else:
        x.view(np.uint8)[...] = value


class Geometry:
    """Where blocks are, as both transfer engines name them: flat index = slab * num_blocks + block, with
    slab = layer * 2 + (0 for K, 1 for V); byte offset = flat index * block_bytes. Prefill's pool and
    decode's pool each have their own (their block counts differ)."""

    def __init__(self, slabs: int, num_blocks: int, block_bytes: int):
        self.slabs, self.num_blocks, self.block_bytes = slabs, num_blocks, block_bytes

    def flat(self, ids: Sequence[int]) -> np.ndarray:
        """Every (layer, K/V, block) of a block table, layer-major, then K/V, then table order."""
        slabs = np.arange(self.slabs, dtype=np.int64)[:, None] * self.num_blocks
        return (slabs + np.asarray(ids, dtype=np.int64)[None, :]).reshape(-1)

    def as_dict(self) -> dict:
        return {"slabs": self.slabs, "num_blocks": self.num_blocks, "block_bytes": self.block_bytes}


class PagedKVPool:
    """Blocks of `block_size` tokens for every (layer, K/V); a block id names the same place in every
    layer's K and V slab, as in vLLM. `alloc` hands out free ids in random order (seeded)."""

    def __init__(self, data: Any, block_size: int, seed: int):
        self.data = data
        self.layers, two, self.num_blocks, self.block_size, self.kv_heads, self.head_dim = data.shape
        assert two == 2 and self.block_size == block_size
        self.ptr, self.nbytes, self.device = mem_info(data)
        self.block_bytes = self.nbytes // (self.layers * 2 * self.num_blocks)
        self._rng = np.random.default_rng(seed)
        self._free = set(range(self.num_blocks))
        self.ever_used: set[int] = set()  # blocks handed out at least once (the rest must stay poison)

    @classmethod
    def allocate(cls, like: str, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: Any, seed: int, device: Any = None) -> "PagedKVPool":
        """A pool filled with POISON; `like` "numpy" (host) or "torch" (on `device`)."""
        shape = (layers, 2, num_blocks, block_size, kv_heads, head_dim)
        if like == "torch":
            import torch
            data = torch.empty(shape, dtype=dtype, device=device)
            fill_bytes(data, POISON)
            if data.is_cuda:  # the poison is in place before any engine writes into the pool
                torch.cuda.synchronize(data.device)
        else:
            data = np.empty(shape, dtype=dtype)
            fill_bytes(data, POISON)
        return cls(data, block_size, seed)

    # -- block table
    def pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def alloc(self, num_tokens: int) -> list[int]:
        n = self.pages(num_tokens)
        if n > len(self._free):
            raise MemoryError(f"KV pool full: {n} blocks wanted, {len(self._free)} of {self.num_blocks} free")
        ids = [int(b) for b in self._rng.choice(sorted(self._free), n, replace=False)]
        self._free.difference_update(ids)
        self.ever_used.update(ids)
        return ids

    def free(self, ids: Sequence[int]) -> None:
        assert not self._free.intersection(ids), "double free"
        self._free.update(ids)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    # -- data
    def write(self, ids: Sequence[int], kv: Any) -> None:
        """kv: [layers, 2, tokens, kv_heads, head_dim] -> the request's blocks (the last one partly)."""
        n = kv.shape[2]
        full, rem = divmod(n, self.block_size)
        assert len(ids) == self.pages(n)
        if full:
            self.data[:, :, list(ids[:full])] = kv[:, :, :full * self.block_size].reshape(
                self.layers, 2, full, self.block_size, self.kv_heads, self.head_dim)
        if rem:
            self.data[:, :, ids[full], :rem] = kv[:, :, full * self.block_size:]

    def blocks(self, ids: Sequence[int]) -> Any:
        """[layers, 2, len(ids), block_size, kv_heads, head_dim]: a copy of the request's blocks."""
        return self.data[:, :, list(ids)]

    def gather(self, ids: Sequence[int], num_tokens: int) -> Any:
        """[layers, 2, num_tokens, kv_heads, head_dim]: the request's KV in token order."""
        b = self.blocks(ids)
        return b.reshape(self.layers, 2, len(ids) * self.block_size, self.kv_heads, self.head_dim)[:, :, :num_tokens]

    # -- addressing for the transfer engines (same order on both sides: layer, K/V, block table order)
    def slab(self, layer: int, kv: int) -> Any:
        """One layer's K (kv=0) or V (kv=1): the contiguous region vLLM registers per layer."""
        return self.data[layer, kv]

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.layers * 2, self.num_blocks, self.block_bytes)

    def digests(self, ids: Sequence[int]) -> list[str]:
        """BLAKE2b of every (layer, K/V, block), in `Geometry.flat` order."""
        raw = host_bytes(self.blocks(ids)).reshape(self.layers * 2 * len(ids), self.block_bytes)
        return [hashlib.blake2b(row.tobytes(), digest_size=16).hexdigest() for row in raw]

    def untouched_is_poison(self) -> bool:
        """Blocks never handed out still hold nothing but POISON (no transfer wrote outside its blocks)."""
        never = sorted(set(range(self.num_blocks)) - self.ever_used)
        if not never:
            return True
        return bool((host_bytes(self.blocks(never)) == POISON).all())
