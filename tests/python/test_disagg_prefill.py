"""examples/disagg_prefill: a prefill process hands a model's KV cache to a decode process, which pulls it
into its own paged pool and generates.

Without torch (CI) the example's own code runs with NumPy pools and its NumPy stand-in model: the pool,
the block tables, the pulls over tether's API and over NIXL (TETHER, and UCX beside it), every byte
checked. With torch and transformers the same runs use the Llama model (on the GPU when there is one);
without them those tests skip with that reason. Wrong pulls are injected to show the checks catch them.

    PYTHONPATH=python python -m pytest tests/python/test_disagg_prefill.py -q
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tether

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "disagg_prefill"
sys.path.insert(0, str(EXAMPLE))

import kv_engines  # noqa: E402
import llm  # noqa: E402
from paged_kv import PagedKVPool, host_bytes  # noqa: E402

NO_TORCH = llm.torch_available()
NIXL_WHY = kv_engines.path_unavailable("nixl-TETHER")


# ------------------------------------------------------------------------------------------- the pool


def _pool(blocks=40, seed=1, layers=3, heads=2, dim=8):
    return PagedKVPool.allocate("numpy", layers, blocks, 16, heads, dim, np.float32, seed=seed)


def _kv(rng, pool, n):
    return rng.standard_normal((pool.layers, 2, n, pool.kv_heads, pool.head_dim)).astype(np.float32)


def test_pool_scatter_gather_and_addresses():
    """Requests of several lengths land in random, interleaved blocks; gather returns them in token
    order; the flat index and byte offsets the engines use point at exactly those bytes."""
    rng = np.random.default_rng(0)
    pool = _pool()
    reqs = {n: (pool.alloc(n), _kv(rng, pool, n)) for n in (1, 15, 16, 17, 70)}
    assert [len(ids) for ids, _ in reqs.values()] == [1, 1, 1, 2, 5]
    assert len({b for ids, _ in reqs.values() for b in ids}) == 10
    spans = sorted((min(ids), max(ids)) for ids, _ in reqs.values())
    assert any(a[1] > b[0] for a, b in zip(spans, spans[1:])), "blocks of requests interleave"
    for n, (ids, kv) in reqs.items():
        pool.write(ids, kv)
    raw = pool.data.view(np.uint8).reshape(-1)
    for n, (ids, kv) in reqs.items():
        assert np.array_equal(pool.gather(ids, n), kv)
        flat = pool.geometry.flat(ids)
        blocks = pool.blocks(ids)  # [layers, 2, pages, 16, heads, dim]
        for j, f in enumerate(flat):
            slab, page = divmod(j, len(ids))
            layer, kvi = divmod(slab, 2)
            got = raw[f * pool.block_bytes:(f + 1) * pool.block_bytes]
            assert got.tobytes() == blocks[layer, kvi, page].tobytes()
    assert pool.untouched_is_poison()
    ids = reqs[70][0]
    pool.free(ids)
    with pytest.raises(AssertionError):
        pool.free(ids)
    with pytest.raises(MemoryError):
        pool.alloc(16 * 100)


def test_fake_model_tokens_depend_on_every_kv_byte():
    """The NumPy stand-in decodes what the pool holds: the reference from the same KV matches, one
    flipped byte anywhere in it changes the tokens."""
    m = llm.FakeModel("tiny", seed=3)
    prompt = list(range(5, 45))
    kv = m.prefill(prompt)
    toks, _ = m.decode(kv[:, :, :-1], prompt, 8)
    assert toks == m.reference(prompt, 8)
    for where in (0, kv[:, :, :-1].nbytes // 2, kv[:, :, :-1].nbytes - 1):
        bad = np.ascontiguousarray(kv[:, :, :-1])
        bad.view(np.uint8).reshape(-1)[where] ^= 1
        assert m.decode(bad, prompt, 8)[0] != toks


# ---------------------------------------------------------------------- pulls in one process (tether)


def test_tether_pull_in_process_every_byte():
    """The example's TetherSource/TetherPuller between two endpoints of this process: five requests'
    READs in flight at once into different places, a notification per request, every byte checked,
    and nothing written outside the requests' blocks."""
    rng = np.random.default_rng(1)
    pre, dec = _pool(blocks=60, seed=1), _pool(blocks=90, seed=2)
    src = kv_engines.TetherSource(pre, "prefill-t", {})
    pull = kv_engines.TetherPuller(dec, "decode-t", {})
    try:
        pull.connect(src.info())
        reqs = {}
        for i, n in enumerate((2, 16, 33, 100, 250)):
            ids = pre.alloc(n)
            pre.write(ids, _kv(rng, pre, n))
            reqs[i] = (n, ids, dec.alloc(n))
        handles = {i: pull.pull(dec.geometry.flat(lo), pull.remote_geometry.flat(ids), b"kv:%d" % i)
                   for i, (n, ids, lo) in reqs.items()}
        done: dict = {}
        while len(done) < len(handles):
            kv_engines.poll_done(pull, handles, done)
        for i, (n, ids, lo) in reqs.items():
            assert np.array_equal(host_bytes(dec.blocks(lo)), host_bytes(pre.blocks(ids))), f"request {i}"
            assert dec.digests(lo) == pre.digests(ids)
        assert dec.untouched_is_poison()
        notes: list = []
        while len(notes) < len(reqs):
            got = src.notifications(5)
            assert got, "notifications missing"
            notes += got
        assert sorted(notes) == sorted(b"kv:%d" % i for i in reqs)
    finally:
        pull.close()
        src.close()


# ------------------------------------------------------------------------------ the example, end to end


@pytest.fixture(scope="session")
def nixl_plugin():
    """NIXL finds this build's TETHER plugin (tether.nixl.install, as test_nixl.py's fixture does)."""
    if NIXL_WHY:
        pytest.skip(NIXL_WHY)
    import tether.nixl as tn
    info = tn.nixl_installed()
    if tn.plugin_path() is None or info is None:
        pytest.skip("tether was built without its NIXL plugin (TETHER_NIXL=OFF), or NIXL has no plugin folder")
    tn.install(info["plugin_dir"])


def run_example(*args: str, expect_ok: bool = True, timeout: float = 600) -> dict:
    """examples/disagg_prefill/run.py as a user runs it; returns its --json record."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(tether.__file__).parents[1]), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, str(EXAMPLE / "run.py"), "--no-install", "--json", "-", *args],
                       capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == (0 if expect_ok else 1), f"exit code {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(r.stdout)


def check_record(rec: dict, path: str, lens: list[int], rounds: int, verify_bytes: bool) -> None:
    res = rec["paths"][path]
    assert "skipped" not in res, res
    assert res["ok"] and rec["ok"]
    assert res["prefill"]["all_blocks_freed"], "every READ's notification freed prefill's blocks"
    assert res["prefill"]["interleaved"]
    assert len(res["rounds"]) == rounds
    for rd in res["rounds"]:
        assert rd["poison_ok"] and rd["interleaved"]
        assert [x["prompt_tokens"] for x in rd["requests"]] == lens
        assert rd["total"]["kv_bytes"] == sum(x["kv_bytes"] for x in rd["requests"]) > 0
        for x in rd["requests"]:
            assert x["tokens"] == x["reference"] and len(x["tokens"]) > 0, x["req"]
            assert x["digests_ok"]
            assert x["bytes_ok"] is (True if verify_bytes else None)
            assert x["kv_bytes"] == x["blocks"] * res["block_bytes"]
            assert x["pages"] == len(x["decode_block_ids"]) == len(x["prefill_block_ids"])
            assert x["ttft_s"] == pytest.approx(x["prefill_s"] + x["transfer_s"] + x["first_step_s"])
            assert x["prefill_block_ids"] != x["decode_block_ids"]


FAKE_LENS = [3, 16, 100, 257, 1000]
PATHS = [pytest.param(("tether", "blocks"), id="tether"),
         pytest.param(("nixl-TETHER", "blocks"), id="nixl-TETHER"),
         pytest.param(("nixl-TETHER", "nx5"), id="nixl-TETHER-nx5"),
         pytest.param(("nixl-UCX", "blocks"), id="nixl-UCX")]


@pytest.mark.budget(240)
@pytest.mark.parametrize("path_form", PATHS)
def test_example_numpy(request, path_form):
    """CI's run: NumPy pools and the stand-in model, two processes, two rounds, every byte compared."""
    path, form = path_form
    if path != "tether":
        request.getfixturevalue("nixl_plugin")
    rec = run_example("--model", "fake", "--paths", path, "--dlist", form, "--verify-bytes",
                      "--prompt-lens", ",".join(map(str, FAKE_LENS)))
    check_record(rec, path, FAKE_LENS, rounds=2, verify_bytes=True)
    assert rec["paths"][path]["dlist"] == (None if path == "tether" else form)


@pytest.mark.budget(240)
@pytest.mark.parametrize("fault", ["misplace", "missing"])
@pytest.mark.parametrize("path", ["tether", "nixl-TETHER"])
def test_example_catches_wrong_blocks(request, path, fault):
    """Decode pulls the longest request wrongly (two K blocks swapped, or one not pulled): the run
    reports that request's blocks and tokens as wrong, the others right, and exits 1."""
    if path != "tether":
        request.getfixturevalue("nixl_plugin")
    rec = run_example("--model", "fake", "--paths", path, "--fault", fault, "--rounds", "1",
                      "--prompt-lens", "40,300,90", expect_ok=False)
    rows = rec["paths"][path]["rounds"][0]["requests"]
    assert [(x["digests_ok"], x["match"]) for x in rows] == [(True, True), (False, False), (True, True)]


# ------------------------------------------------------------------------------- with the real model


def _model_args() -> list[str]:
    """The GPU machine runs the default size (small, on cuda:0); a CPU run the tiny preset."""
    return ["--model", "llama"]


@pytest.mark.skipif(bool(NO_TORCH), reason=f"{NO_TORCH}: the Llama model path runs where torch is "
                                           "(the GPU machine); CI covers the same code with NumPy")
@pytest.mark.budget(900)
@pytest.mark.parametrize("path", ["tether", "nixl-TETHER", "nixl-UCX"])
def test_example_llama(request, path):
    """The example's point: a Llama model's KV handed over; decode's greedy tokens equal model.generate
    in one process, for five prompts of different lengths in flight together, blocks byte for byte."""
    if path != "tether":
        request.getfixturevalue("nixl_plugin")
    rec = run_example(*_model_args(), "--paths", path, "--verify-bytes", timeout=900)
    check_record(rec, path, [3, 16, 100, 257, 1000], rounds=2, verify_bytes=True)


@pytest.mark.skipif(bool(NO_TORCH), reason=f"{NO_TORCH}: runs where torch is")
@pytest.mark.budget(600)
def test_example_llama_wrong_block_changes_tokens():
    """With the real model too, two misplaced K blocks change the generated tokens."""
    rec = run_example(*_model_args(), "--paths", "tether", "--fault", "misplace", "--rounds", "1",
                      "--prompt-lens", "40,300,90", expect_ok=False, timeout=600)
    rows = rec["paths"]["tether"]["rounds"][0]["requests"]
    assert [(x["digests_ok"], x["match"]) for x in rows] == [(True, True), (False, False), (True, True)]
