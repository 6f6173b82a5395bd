"""`tether bench --device gpu` on the GPUs here: one pair GPU0 -> GPU1 (GPU0 -> GPU0 between two processes
on a one-GPU machine) over tcp and ipc, and the GPU full mesh: both ordered pairs of 2 GPUs
at once, every byte checked, in both shapes, with NCCL all-pairs beside it. Needs CUDA and torch with
a GPU; the mesh needs 2 (its flows pair distinct GPUs)."""
import json

import pytest

from tether_testutil.cli import run_cli
from tether_testutil.gpu import gpu_env, torch_gpus

GPU = gpu_env("GPU bench tests")
_ngpu = min(GPU.ngpu, torch_gpus()[1])  # the GPUs both tether and torch see
_other = 1 if _ngpu > 1 else 0
two_gpus = pytest.mark.skipif(_ngpu < 2,
                              reason=f"a GPU full mesh pairs distinct GPUs (flows i>j, i != j): needs 2, {_ngpu} here")


@pytest.mark.budget(300)
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_bench_gpu_pair_checked(tmp_path, transport):
    """The CLI's GPU path as a new user runs it: one write/read sweep, single and scattered, checked."""
    out = tmp_path / "pair.json"
    r = run_cli("bench", "--quiet", "--device", "gpu", "--local-gpu-idx", "0", "--remote-gpu-idx", str(_other),
                "--transport", transport, "--sizes", "1M,16M", "--num-iovs", "1,16", "--mode", "write,read",
                "--iters", "3", "--check", "--json", str(out), timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 8
    assert all(x["check"] is True and x["transport"] == transport and x["gbps"] > 0 for x in rows)
    assert {x["device"] for x in rows} == {f"gpu0>gpu{_other}"}


@two_gpus
@pytest.mark.budget(300)
@pytest.mark.parametrize("single", [False, True], ids=["process-per-gpu", "single-process"])
def test_gpu_mesh_two_gpus_checked(tmp_path, single):
    out = tmp_path / "mesh.json"
    r = run_cli("bench", "--quiet", "--full-mesh", "--device", "gpu", "--gpus", "2", "--transport", "tcp",
                "--sizes", "3M", "--mode", "write,read", "--iters", "2", "--check", "--json", str(out),
                *(["--single-process"] if single else []), timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 2 * 5  # 2 modes x (2 flows + 2 egress + aggregate)
    for k in range(2):
        block = rows[5 * k:5 * k + 5]
        assert [x["config"]["pair"] for x in block] == ["0>1", "1>0", "0>*", "1>*", "all"]
        assert [x["device"] for x in block[:2]] == ["gpu0>gpu1", "gpu1>gpu0"]
        assert all(x["check"] is True and x["transport"] == "tcp" for x in block)


@two_gpus
@pytest.mark.budget(300)
def test_nccl_all_pairs_checked(tmp_path):
    from tether import nccl_mesh
    if nccl_mesh.why_not(2):
        pytest.skip(nccl_mesh.why_not(2))
    out = tmp_path / "nccl.json"
    r = run_cli("bench", "--quiet", "--full-mesh", "--device", "gpu", "--gpus", "2", "--transport", "tcp",
                "--sizes", "1M", "--iters", "2", "--check", "--nccl", "default", "--json", str(out), timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    nccl = [x for x in rows if x["transport"] == "nccl"]
    assert [x["config"]["pair"] for x in nccl] == ["0>*", "1>*", "all"]
    assert all(x["check"] is True and x["gbps"] > 0 for x in nccl)
    assert "nccl" in r.stdout and "tcp" in r.stdout  # one table, both
