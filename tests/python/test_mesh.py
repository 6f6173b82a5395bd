"""Full mesh without GPUs: the flow enumeration, the egress/aggregate arithmetic, the
all-pairs process shape (process i drives i>j and serves k>i) over host memory on tcp and ipc, a
worker that cannot start failing the run clearly, and the CLI refusing what a GPU mesh cannot do."""
import json
import subprocess
import sys
import time

import pytest

from tether import bench as B
from tether import mesh
from tether_testutil.cli import ENV, run_cli


def run_cli_module(module, *args, timeout=170):
    return subprocess.run([sys.executable, "-m", module, *args], env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def test_flows_are_every_ordered_pair():
    assert mesh.flows(3, True) == [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]
    assert len(mesh.flows(8, True)) == 56 and len(set(mesh.flows(8, True))) == 56
    assert all(i != j for i, j in mesh.flows(8, True))
    assert mesh.flows(3, False) == [(0, None), (1, None), (2, None)]
    assert [mesh.label(f) for f in mesh.flows(2, True)] == ["0>1", "1>0"]
    assert [mesh.label(f) for f in mesh.flows(2, False)] == [0, 1]


def _row(seconds, size=1 << 20, iters=4, check=True, cpu=(10.0, 20.0), p50=5.0):
    return B.Result(mode="write", transport="tcp", device="gpu", size=size, num_iovs=2, iters=iters,
                    gbps=size * 2 * iters / seconds / 1e9, lat_p50_us=p50, lat_p99_us=2 * p50,
                    cpu_client=cpu[0], cpu_server=cpu[1], check=check, config={"pair": "x"})


def test_egress_and_aggregate_arithmetic():
    fl = mesh.flows(3, True)
    secs = [1.0, 2.0, 0.5, 4.0, 1.0, 1.0]  # flow 1>2 is the slowest
    rows = [_row(s, cpu=(10.0 * (i + 1), 1.0 * (j + 1)), p50=s) for s, (i, j) in zip(secs, fl)]
    out = mesh.summarize(rows, fl, single_process=False)
    assert [r.config["pair"] for r in out] == ["0>*", "1>*", "2>*", "all"]
    moved = (1 << 20) * 2 * 4
    # GPU 1's egress: its two flows' bytes over its slower flow's 4 s
    assert out[1].gbps == pytest.approx(2 * moved / 4.0 / 1e9)
    assert out[0].gbps == pytest.approx(2 * moved / 2.0 / 1e9) and out[0].device == "gpu0>*"
    agg = out[-1]
    assert agg.gbps == pytest.approx(6 * moved / 4.0 / 1e9) and agg.iters == 24 and agg.check is True
    assert agg.device == "gpu x3" and agg.lat_p50_us == 4.0
    # process per GPU: each process counted once per column (its flows all report the whole process)
    assert agg.cpu_client == pytest.approx(10 + 20 + 30)   # sources: processes 0, 1, 2
    assert agg.cpu_server == pytest.approx(1 + 2 + 3)      # targets: processes 0, 1, 2
    single = mesh.summarize(rows, fl, single_process=True)[-1]
    assert single.cpu_client == 30 and single.cpu_server == 3  # one process per side: the largest


def test_aggregate_check_is_false_if_any_flow_failed():
    fl = mesh.flows(2, True)
    assert mesh.summarize([_row(1, check=True), _row(1, check=False)], fl, False)[-1].check is False
    assert mesh.summarize([_row(1, check=None), _row(1, check=None)], fl, False)[-1].check is None
    # host pairs: no egress rows, CPU of separate processes adds up
    host = mesh.summarize([_row(1), _row(2)], mesh.flows(2, False), False)
    assert [r.config["pair"] for r in host] == ["all"] and host[0].cpu_client == 20


@pytest.mark.budget(240)
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
@pytest.mark.parametrize("single", [False, True], ids=["process-per-gpu", "single-process"])
def test_all_pairs_shape_over_host_memory(transport, single):
    """The GPU mesh's process shape, host memory in place of GPUs: 3 x 2 flows, every byte checked."""
    cases = [B.Case("write", 1 << 20, 1, 3, 1, 0, True), B.Case("read", 64 << 10, 4, 3, 1, 0, True)]
    rows = mesh.run(3, {"transport": transport}, 1 << 20, cases, single, gpu=False, all_pairs=True)
    per_case = 6 + 3 + 1
    assert len(rows) == 2 * per_case
    for k, case in enumerate(cases):
        block = rows[k * per_case:(k + 1) * per_case]
        assert [r.config["pair"] for r in block] == ["0>1", "0>2", "1>0", "1>2", "2>0", "2>1",
                                                     "0>*", "1>*", "2>*", "all"]
        assert all(r.check is True and r.mode == case.mode and r.transport == transport for r in block)
        assert all(r.config["shape"] == ("single-process" if single else "process-per-gpu") for r in block)
        assert block[-1].gbps == pytest.approx(6 * min(r.gbps for r in block[:6]), rel=1e-6)


@pytest.mark.budget(120)
def test_worker_that_cannot_start_fails_the_run_clearly():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="netplugin"):  # no plugin configured here (fabric works now)
        mesh.run(2, {"transport": "netplugin"}, 1 << 20, [B.Case("write", 4096, 1, 2, 1, 0, True)], False,
                 gpu=False, all_pairs=True)
    assert time.monotonic() - t0 < 90


@pytest.mark.budget(120)
@pytest.mark.parametrize("single", [False, True], ids=["process-per-gpu", "single-process"])
def test_flow_failing_mid_run_fails_the_run_with_its_cause(single):
    """A flow that fails inside its case (here: a block larger than its buffer) ends every process
    and the run names that failure, not the barrier it broke for the others."""
    t0 = time.monotonic()
    with pytest.raises((RuntimeError, AssertionError)) as e:
        mesh.run(3, {"transport": "tcp"}, 4096, [B.Case("write", 1 << 20, 1, 2, 1, 0, True)], single,
                 gpu=False, all_pairs=True)
    text = str(e.value) if e.type is RuntimeError else "AssertionError"
    assert "AssertionError" in text and "BrokenBarrierError" not in text.splitlines()[-1]
    assert time.monotonic() - t0 < 90
    with pytest.raises(ValueError, match="write and read"):
        mesh.run(2, {}, 4096, [B.Case("send", 4096, 1, 2, 1, 0, False)], single, all_pairs=True)


def test_cli_refuses_what_a_gpu_mesh_cannot_do():
    r = run_cli("bench", "--quiet", "--full-mesh", "--nccl", "--sizes", "4K", "--iters", "2")
    assert r.returncode == 2 and "--nccl goes with --full-mesh --device gpu" in r.stderr
    r = run_cli("bench", "--quiet", "--full-mesh", "--device", "gpu", "--sizes", "4K")
    assert r.returncode == 2 and ("GPU" in r.stderr or "gpu" in r.stderr)


def test_nccl_mesh_says_why_not_without_gpus():
    from tether import nccl_mesh
    why = nccl_mesh.why_not(2)
    try:
        import torch
        have = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    except ImportError:
        have = False
    assert (why is None) == have and (have or why)


@pytest.mark.budget(180)
def test_all_pairs_driver_over_gloo(tmp_path):
    """The NCCL all-pairs driver's rendezvous, batching, digests and rows, on torch's gloo backend
    (host memory): 3 ranks, every flow checked at both ends. Skips without torch (CPU CI)."""
    pytest.importorskip("torch.distributed")
    out = tmp_path / "allpairs.json"
    r = run_cli_module("tether.nccl_mesh", "--backend", "gloo", "--gpus", "3", "--sizes", "64K,1M",
                       "--iters", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [x["config"]["pair"] for x in rows] == ["0>*", "1>*", "2>*", "all"] * 2
    assert all(x["check"] is True and x["transport"] == "gloo" and x["gbps"] > 0 for x in rows)
    for k in (0, 4):  # aggregate: all 6 flows' bytes over the slowest rank's time
        per_rank_s = [x["size"] * 2 * x["iters"] / (x["gbps"] * 1e9) for x in rows[k:k + 3]]
        assert rows[k + 3]["gbps"] == pytest.approx(rows[k]["size"] * 6 * 2 / max(per_rank_s) / 1e9, rel=1e-6)
