"""`tether bench` / `tether doctor`: argument parsing, --check catching a planted corruption, --json
output, the two-host roles, torchrun ranks, the full mesh, sweeps, plots, per-NIC statistics, the loopback
TCP ceiling beside tether, and an idle endpoint not burning CPU. What the command prints: test_cli_output.py;
bad input and dead helpers: test_cli_failures.py; --trace: test_cli_trace.py."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import pytest

import tether
from tether import bench as B, cli
from tether_testutil.cli import ENV, cells, run_cli

@pytest.mark.parametrize("text,value", [("4K", 4096), ("4KiB", 4096), ("1M", 1 << 20), ("1MiB", 1 << 20),
                                        ("2G", 2 << 30), ("1.5M", 3 << 19), ("123", 123), ("64kib", 65536)])
def test_parse_size(text, value):
    assert B.parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "0", "-4K", "1.3", "abc", "4X"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        B.parse_size(bad)


def test_parser_lists_and_defaults():
    a = cli.build_parser().parse_args(["bench", "--sizes", "4K,1MiB", "--num-iovs", "1,128", "--mode", "write,read",
                                       "--channels", "1,2", "--chunk-bytes", "256K", "--check", "--async-api"])
    assert a.sizes == [4096, 1 << 20] and a.num_iovs == [1, 128] and a.mode == ["write", "read"]
    assert a.channels == [1, 2] and a.chunk_bytes == [256 << 10] and a.check and a.async_api
    d = cli.build_parser().parse_args(["bench"])
    assert d.sizes is None and d.mode == ["write"] and d.num_iovs == [1] and d.transport == "auto"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--transport", "carrier-pigeon"])


def test_unavailable_choices_fail_clearly():
    r = run_cli("bench", "--transport", "netplugin", "--quiet")
    assert r.returncode == 2 and "not available" in r.stderr
    r = run_cli("bench", "--mode", "teleport", "--quiet")
    assert r.returncode == 2 and "unknown mode" in r.stderr
    r = run_cli("bench", "--role", "client", "--quiet")
    assert r.returncode == 2 and "--peer" in r.stderr


def test_json_output_and_check(tmp_path):
    out = tmp_path / "r.json"
    r = run_cli("bench", "--quiet", "--sizes", "4K,1M", "--mode", "write,read,send", "--num-iovs", "1",
                "--iters", "4", "--check", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert {"version", "machine", "config", "results"} <= doc.keys()
    assert len(doc["results"]) == 6
    for res in doc["results"]:
        assert {"mode", "transport", "device", "size", "num_iovs", "iters", "gbps", "lat_p50_us", "lat_p99_us",
                "check"} <= res.keys()
        assert res["check"] is True and res["gbps"] > 0 and res["iters"] == 4
        assert 0.0 <= res["steal_pct"] <= 100.0  # the hypervisor's share of the CPUs during the timed pass
    assert "GB/s" in r.stdout  # the table


@pytest.mark.parametrize("transport,expect", [("auto", "ipc"), ("ipc", "ipc"), ("tcp", "tcp")])
def test_bench_reports_the_transport_it_used(tmp_path, transport, expect):
    """A local pair shares the host: auto picks ipc; --transport pins one."""
    out = tmp_path / "r.json"
    r = run_cli("bench", "--quiet", "--sizes", "1M", "--mode", "write,read", "--iters", "3", "--check",
                "--transport", transport, "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [x["transport"] for x in doc["results"]] == [expect, expect] and doc["config"]["transport"] == expect
    assert all(x["check"] is True for x in doc["results"])


def test_json_check_is_null_when_not_asked(tmp_path):
    out = tmp_path / "r.json"
    r = run_cli("bench", "--quiet", "--sizes", "64K", "--iters", "3", "--num-iovs", "1,4", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [x["num_iovs"] for x in results] == [1, 4] and all(x["check"] is None for x in results)


class CorruptingPair(B.LocalPair):
    """Flips one byte at the target between the transfer and the verification."""

    def ask(self, *cmd):
        if cmd[0] == "verify":
            spans = cmd[1]
            self.channel.send(("corrupt", self.slot, spans[len(spans) // 2][0] + 7))
            self.channel.recv()
        return super().ask(*cmd)


@pytest.mark.parametrize("num_iovs", [1, 16])
def test_check_catches_planted_corruption(num_iovs):
    pair = CorruptingPair({}, 1 << 20)
    try:
        bad = B.run_case(pair, B.Case("write", 32 << 10, num_iovs, 2, 0, 0, True))
    finally:
        pair.close()
    assert bad.check is False
    pair = B.LocalPair({}, 1 << 20)
    try:
        good = B.run_case(pair, B.Case("write", 32 << 10, num_iovs, 2, 0, 0, True))
    finally:
        pair.close()
    assert good.check is True


@pytest.mark.parametrize("depth", [0, 4])
def test_timed_pass_reports_progress_seldom_and_completely(depth):
    # A progress bar's update costs a few µs of Python: called per op it was part of every small op's
    # time. The timed pass reports at most every 0.1 s and still accounts for every op.
    calls = []
    pair = B.LocalPair({}, 1 << 20)
    try:
        r = B.run_case(pair, B.Case("write", 8, 1, 400, 0, depth, False), progress=lambda k=1: calls.append(k))
    finally:
        pair.close()
    timed_s = r.iters * 8 / (r.gbps * 1e9)
    assert sum(calls) == 400
    assert len(calls) <= timed_s / 0.1 + 2, (len(calls), timed_s)


def test_default_timed_pass_lasts_long_enough():
    # Eight 64 MiB ops over NVLink took 2 ms: the figure was the warm-up's. Without --iters the timed
    # pass takes as many ops as fill TIMED_PASS_S; a fixed count and sends (the server counts their
    # receives) keep theirs.
    pair = B.LocalPair({}, 1 << 20)
    try:
        timed = B.run_case(pair, B.Case("write", 8, 1, 5, 1, 0, False, min_seconds=0.1))
        fixed = B.run_case(pair, B.Case("write", 8, 1, 5, 1, 0, False))
        sends = B.run_case(pair, B.Case("send", 8, 1, 5, 1, 0, False, min_seconds=0.1))
    finally:
        pair.close()
    assert timed.iters > 5 and timed.iters * 8 / (timed.gbps * 1e9) >= 0.05, timed
    assert fixed.iters == 5 and sends.iters == 5
    assert "fill 0.25 s" in run_cli("bench", "--help").stdout


def test_failed_check_exits_nonzero(monkeypatch, capsys):
    monkeypatch.setattr(B, "LocalPair", CorruptingPair)
    rc = cli.main(["bench", "--quiet", "--sizes", "4K", "--iters", "2", "--check"])
    assert rc == 1
    assert "corrupted" in capsys.readouterr().err


def test_server_and_client_roles():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "tether", "bench", "--role", "server", "--listen",
                               f"127.0.0.1:{port}"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        r = None
        while time.monotonic() < deadline:  # the server needs a moment to import and listen
            r = run_cli("bench", "--quiet", "--role", "client", "--peer", f"127.0.0.1:{port}", "--sizes", "64K,2M",
                        "--mode", "write,read,send", "--iters", "3", "--check")
            if "Connection refused" not in r.stderr:
                break
            time.sleep(0.3)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.count(" ok ") == 6
    finally:
        server.kill()
        server.wait(10)


def test_doctor_json():
    r = run_cli("doctor", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["transports"]["tcp"]["available"] is True
    assert d["cpus"] >= 1 and isinstance(d["nics"], list) and "lo" in [n["name"] for n in d["nics"]]
    assert "TOKEN" not in json.dumps(d["env"])  # secrets are never printed
    assert d["busy_poll_us"] == (1000 if os.cpu_count() >= 8 else 0)  # the default for this machine
    r = run_cli("doctor")
    assert r.returncode == 0 and "Transports" in r.stdout and "Busy polling" in r.stdout


def test_idle_endpoints_do_not_burn_cpu():
    a, b = tether.Endpoint(), tether.Endpoint()
    try:
        a.connect(b.metadata(), timeout=5)
        time.sleep(0.2)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        time.sleep(2.0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
        # two endpoints, 4 progress threads each, one connected peer: heartbeats only
        assert cpu / (time.monotonic() - t0) < 0.02, f"idle endpoints used {cpu:.3f} s of CPU in 2 s"
    finally:
        a.close()
        b.close()


def test_torchrun_two_ranks():
    pytest.importorskip("torch", reason="torch not installed: the torchrun recipe is not exercised here")
    import shutil
    import socket

    if not shutil.which("torchrun"):
        pytest.skip("torchrun not on PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run(["torchrun", "--nnodes=1", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                        f"--master_port={port}", "-m", "tether", "bench", "--quiet", "--sizes", "64K",
                        "--mode", "write,read", "--iters", "3", "--check"],
                       env=ENV, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count(" ok ") == 2


@pytest.mark.parametrize("single", [False, True], ids=["process-per-pair", "single-process"])
def test_full_mesh(tmp_path, single):
    out = tmp_path / "mesh.json"
    args = ["bench", "--quiet", "--full-mesh", "--gpus", "3", "--sizes", "64K,1M", "--mode", "write,read",
            "--iters", "3", "--check", "--json", str(out)] + (["--single-process"] if single else [])
    r = run_cli(*args, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert len(results) == 4 * (3 + 1)  # 4 cases x (3 pairs + aggregate)
    for k in range(4):
        rows = results[4 * k: 4 * k + 4]
        assert [x["config"]["pair"] for x in rows] == [0, 1, 2, "all"]
        assert all(x["check"] is True for x in rows)
        agg = rows[3]
        # every pair moves the same bytes, so all bytes / slowest pair's time = 3 x the slowest rate
        assert agg["iters"] == 9
        assert agg["gbps"] == pytest.approx(3 * min(x["gbps"] for x in rows[:3]), rel=1e-6)


def test_full_mesh_single_process_refuses_send():
    r = run_cli("bench", "--quiet", "--full-mesh", "--single-process", "--mode", "send", "--sizes", "4K",
                "--iters", "2", timeout=120)
    assert r.returncode != 0 and "single-process" in r.stderr


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed: --plot not exercised")
    png = tmp_path / "bench.png"
    r = run_cli("bench", "--quiet", "--sizes", "4K,64K,1M", "--iters", "3", "--mode", "write,read",
                "--plot", str(png))
    assert r.returncode == 0, r.stderr[-2000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_bench_stats_per_nic_and_channel():
    r = run_cli("bench", "--transport", "tcp", "--sizes", "3M", "--iters", "2", "--warmup", "0", "--channels", "2", "--stats", "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stderr + r.stdout
    for side in ("driving side", "target side"):
        assert f"{side}: per NIC" in out and f"{side}: per channel (lane)" in out, out[-3000:]
    # loopback: the two lanes (and so the "lo" row) carried the 2 x 3 MiB writes, which took time in sendmsg
    lo = [line.split("│") for line in out.splitlines() if line.strip("│ ").startswith("lo ")]
    assert len(lo) == 2 and float(lo[0][2]) >= 6.0 and float(lo[1][3]) >= 6.0, out[-3000:]
    assert float(lo[0][8]) > 0 and float(lo[1][9]) > 0 and float(lo[0][10]) == 0, out[-3000:]  # send, recv; no GPU
    assert int(lo[0][11]) == 0 and int(lo[1][11]) == 0, out[-3000:]  # no staging slot: host memory
    lanes = [line.split("│") for line in out.splitlines() if line.count("│") == 17 and " lo " in line]
    assert len(lanes) == 4 and sum(float(x[13]) for x in lanes[:2]) > 0 and sum(float(x[14]) for x in lanes[2:]) > 0, out[-3000:]
    assert all(int(x[16]) == 0 for x in lanes), out[-3000:]


def test_doctor_shows_threads_and_refuses_bad_nics():
    r = run_cli("doctor", "--json")
    d = json.loads(r.stdout)
    assert d["topology"]["threads"] and "why" in d["topology"]["threads"][0]
    env = dict(ENV, TETHER_NICS="no-such-nic7")
    r = subprocess.run([sys.executable, "-m", "tether", "doctor"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "no-such-nic7" in r.stdout, r.stdout[-2000:]


@pytest.mark.budget(90)
def test_unpack_sweeps(tmp_path):
    a = cli.build_parser().parse_args(["bench", "--unpack", "kernel,d2d"])
    assert a.unpack == ["kernel", "d2d"]
    r = run_cli("bench", "--unpack", "kernel,teleport")
    assert r.returncode == 2 and "unknown unpack 'teleport'" in r.stderr
    out = tmp_path / "r.json"
    r = run_cli("bench", "--quiet", "--unpack", "d2d,host", "--sizes", "64K", "--iters", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert [x["config"]["unpack"] for x in json.loads(out.read_text())["results"]] == ["d2d", "host"]


# ---------------------------------------------------------------- the loopback TCP ceiling

def test_tcp_ceiling_tool_runs():
    """bench/tools/tcp_ceiling.c, built (or found) as `tether bench --ceiling` finds it: N streams,
    GB/s, per-stream rates and CPU-seconds per GB on each side."""
    try:
        exe = B.ceiling_tool()
    except B.BenchError as e:
        pytest.skip(str(e))
    r = subprocess.run([exe, "-n", "3", "-t", "0.3", "-b", "8M", "-c", "256K", "--json"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["streams"] == 3 and len(out["per_stream_gbps"]) == 3 and out["gbps"] > 0
    assert out["chunk_bytes"] == 256 << 10 and out["socket_buffer"] == 4 << 20
    assert 0 < out["cpu_s_per_gb"]["both"] == pytest.approx(out["cpu_s_per_gb"]["sender"] + out["cpu_s_per_gb"]["receiver"], rel=1e-3)
    assert out["pinned"]["sender"]  # "mlock", or why not
    r = subprocess.run([exe, "-n", "0"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "STREAMS" in r.stderr


@pytest.mark.budget(60)
def test_bench_ceiling_beside_tether(tmp_path):
    """--ceiling: the same call runs tcp_ceiling with N = tether's lanes; each row gets its fraction."""
    try:
        B.ceiling_tool()
    except B.BenchError as e:
        pytest.skip(str(e))
    out = tmp_path / "r.json"
    r = run_cli("bench", "--transport", "tcp", "--ceiling", "--channels", "2", "--sizes", "256K", "--iters", "3",
                "--json", str(out), env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    (c,) = doc["ceilings"]
    assert c["streams"] == 2 and c["gbps"] > 0 and c["chunk_bytes"] == 1 << 20
    (x,) = doc["results"]
    # of_ceiling is rounded to 4 decimals (bench.py): at a small ratio that is more than a relative 1e-3
    assert x["ceiling_gbps"] == c["gbps"] and x["of_ceiling"] == pytest.approx(x["gbps"] / c["gbps"], abs=5e-5)
    assert x["cpu_s_per_gb"] > 0
    assert "of ceiling" in r.stdout and "2 streams (tether's lanes)" in r.stdout
    assert f"{x['gbps'] / c['gbps']:.2f}" in cells(r.stdout)
    r = run_cli("bench", "--ceiling", "--sizes", "4K")  # auto: ipc between two local processes
    assert r.returncode == 2 and "--transport tcp" in r.stderr and len(r.stderr.strip().splitlines()) == 1
