"""GPU full mesh (issue 9): both ordered pairs of 2 GPUs at once, GPU memory to GPU memory, every
byte checked, in both shapes; and NCCL all-pairs beside it. Needs CUDA, torch and 2 GPUs."""
import json

import pytest

import tether
from test_cli import run_cli

try:
    import torch
    _ngpu_torch = torch.cuda.device_count() if torch.cuda.is_available() else 0
except ImportError:  # CPU CI
    _ngpu_torch = 0
_cuda, _why, _ngpu = tether._tether.gpu_status()[:3]
if not (_cuda and _ngpu >= 2 and _ngpu_torch >= 2):
    pytest.skip(f"GPU mesh tests need CUDA, torch and 2 GPUs (tether: {_why or f'{_ngpu} GPUs'}; "
                f"torch sees {_ngpu_torch})", allow_module_level=True)


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
