"""The model both processes run: a Llama-architecture `transformers` model with fixed random weights
(built from a config and one seed, nothing downloaded), or — where torch is missing (CI) — a NumPy
stand-in with the same interface, whose next token hashes every byte of the KV it is given.

Interface: prefill(prompt) -> KV [layers, 2, tokens, kv_heads, head_dim]; decode(kv of prompt[:-1],
prompt, n) -> n greedy tokens from that cache (the first step recomputes the last prompt token, as
vLLM's decode does after a remote prefill); reference(prompt, n) -> n greedy tokens from one process
with no hand-off (model.generate).
"""
from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np

# Llama shapes. "small" is TinyLlama-1.1B's geometry (22 -> 16 layers); "tiny" runs on a laptop CPU.
PRESETS = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=8192),
    "small": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=32000),
}


def torch_available() -> str:
    """"" when torch and transformers import, else why not."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return f"torch/transformers not installed ({e.name})"
    return ""


class LlamaModel:
    kind = "llama"
    array_kind = "torch"

    def __init__(self, preset: str, seed: int, device: str, dtype: str = "float32"):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        self.torch = torch
        # Exact token equality across processes: no TF32, deterministic kernels where torch has them.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        cfg = LlamaConfig(**PRESETS[preset], max_position_embeddings=4096, bos_token_id=None,
                          eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
                          # larger than the default 0.02 so greedy picks are decided by wide margins
                          initializer_range=0.1)
        cfg._attn_implementation = "eager"
        torch.manual_seed(seed)  # same seed, same device kind -> the same weights in both processes
        with torch.device(self.device):
            self.model = LlamaForCausalLM(cfg).to(self.dtype).eval()
        self.config = cfg
        self.layers = cfg.num_hidden_layers
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.vocab = cfg.vocab_size
        # transformers 5.2x renamed forward's `past_key_values` to `cache` (the old name warns)
        import inspect
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def fingerprint(self) -> str:
        """A digest of every weight: both processes must hold the same model."""
        h = hashlib.blake2b(digest_size=8)
        with self.torch.no_grad():
            for p in self.model.parameters():
                h.update(np.float64(p.double().sum().item()).tobytes())
        return h.hexdigest()

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def pool_dtype(self) -> Any:
        return self.dtype

    def _ids(self, tokens) -> Any:
        return self.torch.tensor([list(tokens)], dtype=self.torch.long, device=self.device)

    def prefill(self, prompt) -> Any:
        with self.torch.no_grad():
            out = self.model(input_ids=self._ids(prompt), use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        kv = [_layer_kv(cache, layer) for layer in range(self.layers)]
        # [1, heads, tokens, dim] per layer -> [layers, 2, tokens, heads, dim] (the pool's layout)
        return self.torch.stack([self.torch.stack((k[0], v[0])) for k, v in kv]).transpose(2, 3)

    def decode(self, kv_prefix, prompt, max_new: int) -> tuple[list[int], float]:
        """Greedy decoding from a cache built of `kv_prefix` (prompt[:-1]'s KV, pulled and gathered);
        returns the tokens and the seconds of the first step (cache build included)."""
        torch = self.torch
        t0 = time.perf_counter()
        with torch.no_grad():
            cache = _make_cache(self.config, [(kv_prefix[layer, 0].transpose(0, 1)[None].contiguous(),
                                               kv_prefix[layer, 1].transpose(0, 1)[None].contiguous())
                                              for layer in range(self.layers)])
            token, out, first = int(prompt[-1]), [], 0.0
            for _ in range(max_new):
                logits = self.model(input_ids=self._ids([token]), use_cache=True, **{self._cache_kw: cache}).logits
                token = int(logits[0, -1].argmax())
                out.append(token)
                if not first:
                    first = time.perf_counter() - t0  # .item() above synchronized the device
        return out, first

    def reference(self, prompt, max_new: int) -> list[int]:
        with self.torch.no_grad():
            ids = self._ids(prompt)
            gen = self.model.generate(ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=max_new,
                                      min_new_tokens=max_new, do_sample=False, pad_token_id=0)
        return [int(t) for t in gen[0, len(prompt):]]


def _layer_kv(cache, layer: int):
    """(keys, values) of one layer from whatever cache class this transformers version returns."""
    if hasattr(cache, "layers"):              # transformers >= 4.56
        return cache.layers[layer].keys, cache.layers[layer].values
    if hasattr(cache, "key_cache"):           # DynamicCache before that
        return cache.key_cache[layer], cache.value_cache[layer]
    return cache[layer][0], cache[layer][1]   # legacy tuple of tuples


def _make_cache(config, per_layer):
    """A DynamicCache holding the given (keys, values) per layer, for this transformers version."""
    from transformers import DynamicCache
    try:
        cache = DynamicCache(config=config)
    except TypeError:
        cache = DynamicCache()
    for layer, (k, v) in enumerate(per_layer):
        cache.update(k, v, layer)
    return cache


class FakeModel:
    """NumPy stand-in (CI has no torch). The KV of token t is a pseudo-random function of tokens[:t+1]
    (causal, like attention's), and each next token is a hash of every byte of the cache it decodes
    from, so one wrong, missing or misplaced KV byte changes the tokens."""

    kind = "fake"
    array_kind = "numpy"

    def __init__(self, preset: str, seed: int, device: str = "cpu", dtype: str = "float32"):
        self.seed = seed
        self.layers, self.kv_heads, self.head_dim = (4, 2, 32) if preset == "tiny" else (16, 8, 128)
        self.vocab = 50_000
        self.dtype = np.dtype(dtype)

    def fingerprint(self) -> str:
        return f"fake-{self.seed}-{self.layers}x{self.kv_heads}x{self.head_dim}"

    def sync(self) -> None:
        pass

    def pool_dtype(self) -> Any:
        return self.dtype

    def _chain(self, h: bytes, token: int) -> bytes:
        return hashlib.blake2b(h + int(token).to_bytes(8, "little"), digest_size=16).digest()

    def _token_kv(self, h: bytes) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int.from_bytes(h[:8], "little")])
        return rng.standard_normal((self.layers, 2, self.kv_heads, self.head_dim)).astype(self.dtype)

    def _kv(self, tokens) -> tuple[np.ndarray, bytes]:
        h, rows = b"", []
        for t in tokens:
            h = self._chain(h, t)
            rows.append(self._token_kv(h))
        kv = np.stack(rows, axis=2) if rows else np.zeros((self.layers, 2, 0, self.kv_heads, self.head_dim), self.dtype)
        return kv, h

    def prefill(self, prompt) -> np.ndarray:
        return self._kv(prompt)[0]

    def _generate(self, kv_prefix: np.ndarray, h: bytes, last: int, max_new: int) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        state = hashlib.blake2b(np.ascontiguousarray(kv_prefix.transpose(2, 0, 1, 3, 4)).tobytes())
        token, out, first = int(last), [], 0.0
        for _ in range(max_new):
            h = self._chain(h, token)
            state.update(self._token_kv(h).tobytes())
            token = int.from_bytes(state.copy().digest()[:8], "little") % self.vocab
            out.append(token)
            first = first or time.perf_counter() - t0
        return out, first

    def decode(self, kv_prefix, prompt, max_new: int) -> tuple[list[int], float]:
        h = b""
        for t in prompt[:-1]:  # the token chain only: the KV comes from the pulled blocks
            h = self._chain(h, t)
        return self._generate(kv_prefix, h, prompt[-1], max_new)

    def reference(self, prompt, max_new: int) -> list[int]:
        kv, h = self._kv(prompt[:-1])
        return self._generate(kv, h, prompt[-1], max_new)[0]


def build(kind: str, preset: str, seed: int, device: str, dtype: str):
    return (LlamaModel if kind == "llama" else FakeModel)(preset, seed, device, dtype)
