"""examples/vllm_disagg with real vLLM (the CPU build, in the example's own venv): a prefill and a decode
engine in two processes, vLLM's NixlConnector with backends ["TETHER"], over ipc and over tcp.

Each transport: the decode's greedy tokens equal a single-instance run for prompts of 16, 200 and 1,000
tokens, one at a time and batched; a control request decoded on another prompt's KV gives other tokens
(and exactly that prompt's), so the comparison can fail; a prefill frozen with SIGSTOP fails the decode's
request after tether's peer_timeout, and a killed one fails it at once: an error, never a hang.

The venv (~4 GB) is made by `python examples/vllm_disagg/vllm_venv.py` (.ci/run does, cached under
~/.cache/tether/) or here with TETHER_VLLM_MAKE_VENV=1; without it these tests skip with that reason, and
with TETHER_VLLM_REQUIRED=1 (CI) they fail instead.

    PYTHONPATH=python python -m pytest tests/python/test_vllm_disagg.py -q
"""
from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_disagg"
sys.path.insert(0, str(EXAMPLE))


def _load(name):  # under its own name: examples/disagg_prefill has a run.py too
    spec = importlib.util.spec_from_file_location(f"vllm_disagg_{name}", EXAMPLE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


run = _load("run")
import vllm_venv  # noqa: E402
from pair import Pair  # noqa: E402

PEER_TIMEOUT_S = 3.0
MAX_TOKENS = 8


def _unavailable(why):
    if os.environ.get("TETHER_VLLM_REQUIRED") == "1":
        pytest.fail(f"TETHER_VLLM_REQUIRED=1 but {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(venv python, PYTHONPATH with this tether, model folder, work folder)."""
    try:
        run.check_tether()
    except run.SetupError as e:
        _unavailable(str(e))
    if not vllm_venv.ready() and os.environ.get("TETHER_VLLM_MAKE_VENV") != "1":
        _unavailable(f"the vLLM venv {vllm_venv.default_dir()} is not made: `python examples/vllm_disagg/"
                     "vllm_venv.py` makes it (about 4 GB), or set TETHER_VLLM_MAKE_VENV=1")
    args = run.argparse.Namespace(venv=None, work=str(tmp_path_factory.mktemp("vllm")))
    try:
        return run.prepare(args, log=print)
    except vllm_venv.VenvError as e:
        _unavailable(f"the vLLM venv cannot be made here: {e}")


@pytest.mark.budget(420)
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_vllm_decode_tokens_equal_over_tether(setup, transport):
    python, pythonpath, model, work = setup
    with Pair(python, pythonpath, model, "TETHER", transport, work / "logs" / transport,
              peer_timeout_s=PEER_TIMEOUT_S) as pr:
        res = run.scenario(pr, seed=11, max_tokens=MAX_TOKENS, log=print)
        res["startup_s"] = pr.startup_s
        print(run.table(f"TETHER-{transport}", res))
        for r in res["rows"]:
            assert r["finish"] == "length", r
            assert r["kv_bytes"] and r["kv_bytes"] > 0 and r["xfer_ms"] is not None, r
            if r["case"] == "control":
                assert not r["equal"], "decoded on another prompt's KV, the tokens must differ"
                assert r["equal_to_kv_owner"], "...and be that prompt's tokens: the KV came from there"
            else:
                assert r["equal"], f"decode tokens differ from the single-instance run: {r}"
        assert [r["prompt_tokens"] for r in res["rows"] if r["case"] == "one"] == list(run.LENGTHS)
        stop, kill = run.faults(pr, seed=13, max_tokens=MAX_TOKENS, peer_timeout_s=PEER_TIMEOUT_S)
        print(run.table(f"TETHER-{transport} faults", dict(res, rows=[], faults=[stop, kill])))
        # A stopped prefill: the request fails once tether's peer_timeout declares the peer dead (counted
        # from the last heartbeat heard, 1 s apart), or, where the KV still arrives without the prefill's
        # threads (ipc reads blocks of up to ipc_one_sided_bytes from its memory), ends with the right tokens.
        assert stop["signal"] == "SIGSTOP" and run.fault_ok(stop), stop
        if stop["finish"] == "error":
            assert (PEER_TIMEOUT_S - 1.5) * 1e3 <= stop["ms"] <= (PEER_TIMEOUT_S + 10) * 1e3, stop
        else:
            assert stop["ms"] < PEER_TIMEOUT_S * 1e3, stop
        assert stop["after_heal_equal"], "the prefill that was stopped serves the decode again once it continued"
        assert kill["signal"] == "SIGKILL" and kill["finish"] == "error", kill
        assert kill["ms"] < (PEER_TIMEOUT_S + 2) * 1e3, kill  # the closed connection, or at worst peer_timeout
        assert pr.prefill.p.wait(timeout=30) == -signal.SIGKILL
