"""`tether bench` / `tether doctor`: argument parsing, --check catching a planted corruption,
--json output, the two-host roles, and an idle endpoint not burning CPU."""
import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

import tether
from tether import bench as B
from tether import cli

TETHER_PATH = os.path.dirname(os.path.dirname(os.path.abspath(tether.__file__)))
ENV = dict(os.environ, PYTHONPATH=TETHER_PATH + os.pathsep + os.environ.get("PYTHONPATH", ""))
ENV.pop("COLUMNS", None)  # piped with no COLUMNS: the table at full width (the tests read its cells)


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "tether", *args], env=ENV, capture_output=True, text=True,
                          timeout=timeout)


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


def _traced_bench(tmp_path, *args):
    """Runs `tether bench --quiet ARGS` with TETHER_TRACE; (prefix, initiator's events, target's events),
    each a set of (event, frame type, slot, gen)."""
    prefix = str(tmp_path / "tr")
    r = subprocess.run([sys.executable, "-m", "tether", "bench", "--quiet", *args], env=dict(ENV, TETHER_TRACE=prefix),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted(tmp_path.glob("tr.*.tsv"))
    assert len(files) == 2, files
    events = []
    for f in files:
        rows = [line.split("\t") for line in f.read_text().splitlines() if not line.startswith(("#", "ns\t"))]
        assert all(len(r) == 7 and int(r[6]) >= 0 for r in rows)  # the last column: the CPU the thread ran on
        events.append({(e, int(t), int(s), int(g)) for _, e, _, t, s, g, _cpu in rows})
    init, target = (events[0], events[1]) if any(e[0] == "post" for e in events[0]) else (events[1], events[0])
    return prefix, init, target


def test_trace_records_each_chunk_on_both_sides_and_the_report_reads_it(tmp_path):
    """TETHER_TRACE (src/core/trace.h): both bench processes write their events; every chunk of a tcp
    write is pulled and sent by the initiator, landed by the target and answered; the report pairs them."""
    prefix, init, target = _traced_bench(tmp_path, "--transport", "tcp", "--sizes", "2M", "--chunk-bytes", "512K",
                                         "--iters", "4", "--warmup", "1", "--check")
    writes = {(s, g) for e, t, s, g in init if e == "sent" and t == 1}
    assert len(writes) >= 4  # 2 MiB in 512 KiB chunks, several transfers
    for s, g in writes:
        assert ("pulled", 1, s, g) in init and ("answered", 2, s, g) in init
        assert ("header", 1, s, g) in target and ("landed", 1, s, g) in target and ("sent", 2, s, g) in target
    report = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "tools",
                                                          "trace_report.py"), prefix],
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    assert "T:landed/write" in report.stdout and "chunk, first event to last" in report.stdout
    # Each wait() that returned a finished transfer is marked (the bench waits on every op), so the
    # report splits the time outside the chunk steps: the post's own work, then the application's.
    assert any(e[0] == "waited" for e in init) and not any(e[0] == "waited" for e in target)
    assert "post → its chunk's first step" in report.stdout and "chunk's last step → wait() returns" in report.stdout
    # --lanes: one line per transfer with every lane's chunk count; 2 MiB in 512 KiB chunks is 4 per transfer.
    lanes = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "tools",
                                                         "trace_report.py"), prefix, "--lanes", "3"],
                           capture_output=True, text=True, timeout=60)
    assert lanes.returncode == 0, lanes.stderr
    rows = [line for line in lanes.stdout.splitlines() if " µs | " in line and "| cpus I/T " in line]
    assert len(rows) == 3, lanes.stdout
    for row in rows:
        assert sum(int(c) for c in row.split(" | ")[2].split()) == 4, row
        # each lane that carried a chunk: the CPUs its threads ran on, initiator/target ("-": none seen)
        cells = row.split(" | cpus I/T ")[1].split(" | shared ")[0].split()
        assert any(c != "-" and all(part.replace(",", "").isdigit() for part in c.split("/")) for c in cells), row


@pytest.mark.parametrize("mode", ["write", "read"])
def test_trace_report_reader_time_splits_each_receiving_lane(tmp_path, mode):
    """trace_report.py --reader-time: per receiving lane and transfer (a write's target, a read's initiator)
    its chunks, the time from header to payload landed, the time between chunks, and when its first header
    and last landing came. 2 MiB in 512 KiB chunks: 4 chunks a transfer, spread over the lanes."""
    prefix, _init, _target = _traced_bench(tmp_path, "--transport", "tcp", "--sizes", "2M", "--chunk-bytes", "512K",
                                           "--mode", mode, "--iters", "6", "--warmup", "1")
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "tools", "trace_report.py")
    r = subprocess.run([sys.executable, tool, prefix, "--reader-time"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    head = r.stdout.splitlines()[0]
    assert int(head.split()[0]) >= 6 and "receiving lanes" in head, r.stdout
    rows = {line[:22].strip(): [float(x) for x in line[22:].split()] for line in r.stdout.splitlines()[2:]}
    assert set(rows) == {"chunks", "inside recv µs", "between chunks µs", "first header µs", "last landed µs"}, r.stdout
    assert 1 <= rows["chunks"][1] <= 4 and all(v >= 0 for vs in rows.values() for v in vs), r.stdout
    assert rows["first header µs"][1] <= rows["last landed µs"][1], r.stdout


def test_trace_report_outliers_lists_the_slowest_transfers_lane_by_lane(tmp_path):
    """trace_report.py --outliers N: the transfers' times, then the median transfer and the N slowest with
    a line per lane of each side (its events, when it was active, its CPUs, its longest silence): how a
    16 MiB GPU read's rare multi-ms transfers were traced to one thread that did not run (session 19)."""
    prefix, _init, _target = _traced_bench(tmp_path, "--transport", "tcp", "--sizes", "2M", "--chunk-bytes", "512K",
                                           "--mode", "read", "--iters", "8", "--warmup", "1")
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "tools", "trace_report.py")
    r = subprocess.run([sys.executable, tool, prefix, "--outliers", "2"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    n = int(lines[0].split()[0])
    assert " p50 " in lines[0] and n >= 8, r.stdout  # the 8 timed reads at least (the warm-up too)
    buckets = lines[1].split("): ")[1].split(", ")
    assert lines[1].startswith("histogram (") and sum(int(c.split(": ")[1]) for c in buckets) == n
    heads = [i for i, line in enumerate(lines) if line.startswith("-- ")]
    assert [lines[i].split(" transfer")[0] for i in heads] == ["-- median", "-- slow", "-- slow"], r.stdout
    for i in heads:  # each listed transfer: 2 MiB in 512 KiB chunks went over some lane of each side
        rows = lines[i + 1:(heads + [len(lines)])[heads.index(i) + 1]]
        for who in ("I", "T"):
            mine = [row for row in rows if row.strip().startswith(f"{who} lane ")]
            assert mine and all(" cpus " in row and "longest silence" in row for row in mine), r.stdout


def test_trace_report_timeline_prints_one_transfer_lane_by_lane(tmp_path):
    """trace_report.py --timeline Q: the transfer at quantile Q of their times, both sides' events lane by
    lane in µs after its post: every chunk the initiator sent of a tcp write is landed by the target on the
    same line's lane number, and the waiter's return closes it."""
    prefix, _init, _target = _traced_bench(tmp_path, "--transport", "tcp", "--sizes", "2M", "--chunk-bytes", "512K",
                                           "--iters", "6", "--warmup", "1")
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "tools", "trace_report.py")
    r = subprocess.run([sys.executable, tool, prefix, "--timeline", "0.5"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    total = float(lines[0].split(": ")[1].split(" µs")[0])
    assert lines[0].startswith("the transfer at quantile 0.5 of ") and total > 0, r.stdout
    events = {}  # (side, lane) -> [(event, type, slot.gen, µs)]
    for line in lines[1:]:
        who, kind, n = line.split(":")[0].split()
        for ev in line.split(": ", 1)[1].split(", "):
            parts = ev.split()
            events.setdefault((who, kind, int(n)), []).append((parts[0], *parts[1:-1], float(parts[-1][1:])))
    sent = {(lane, e[2]) for (who, kind, lane), evs in events.items() if who == "I" and kind == "lane"
            for e in evs if e[:2] == ("sent", "write")}
    landed = {(lane, e[2]) for (who, kind, lane), evs in events.items() if who == "T" and kind == "lane"
              for e in evs if e[:2] == ("landed", "write")}
    assert len(sent) == 4 and sent == landed, r.stdout  # 2 MiB in 512 KiB chunks, each on one lane pair
    assert events[("I", "op", 0)][-1][0] == "waited" and events[("I", "op", 0)][-1][-1] == pytest.approx(total, abs=1)
    assert all(0 <= e[-1] <= total + 1 for evs in events.values() for e in evs), r.stdout


def test_rows_the_hypervisor_took_cpu_time_from_are_named_under_the_table():
    """A row during whose timed pass the hypervisor took >= 1 % of the machine's CPU time (/proc/stat's
    steal, bench.stolen_seconds) is named in the caption with its share; on the GPU host the rows that ran
    at half their rate came with it (session 20). Rows below the mark, and tables without any, say nothing."""
    def row(mode, size, steal):
        return B.Result(mode=mode, transport="tcp", device="cpu", size=size, num_iovs=1, iters=5, gbps=20.0,
                        lat_p50_us=10.0, lat_p99_us=12.0, cpu_client=700.0, cpu_server=650.0, check=None,
                        steal_pct=steal)
    quiet = [row("write", 256 << 20, 0.0), row("read", 256 << 20, 0.4)]
    assert cli.steal_line(quiet) is None
    line = cli.steal_line(quiet + [row("write", 16 << 20, 3.25)])
    assert line.startswith("CPU time stolen by the hypervisor during: write 16 MiB (3.2 %);"), line
    assert "256 MiB" not in line
    table, _width = cli.results_table(quiet + [row("write", 16 << 20, 3.25)], False, False, 1.0, 300)
    assert "stolen by the hypervisor" in str(table.caption)
    first = B.stolen_seconds()
    assert 0.0 <= first <= B.stolen_seconds()  # a counter: never goes back (0 where /proc/stat has no steal)


def test_kernel_counters_prints_each_run_beside_the_counters_that_moved():
    """bench/tools/kernel_counters.py N <bench args>: per run, the bench rows, then the kernel counters that
    moved during it (a run that moves bytes over loopback TCP burns user and sys ticks and sends segments)."""
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "tools", "kernel_counters.py")
    r = subprocess.run([sys.executable, tool, "2", "--transport", "tcp", "--sizes", "1M", "--mode", "write,read",
                        "--iters", "5"], env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["run 0", "run 1"], r.stdout
    for line in lines:
        rows, moved = line.split(" | ")
        assert "write cpu 1 MiB " in rows and "read cpu 1 MiB " in rows and " GB/s p50 " in rows, line
        counters = dict(kv.split("=") for kv in moved.split())
        assert int(counters["user"]) + int(counters["sys"]) > 0, line
    bad = subprocess.run([sys.executable, tool, "--sizes", "1M"], env=ENV, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Runs `tether bench` N times" in bad.stderr  # the usage


def test_tcp_goals_judges_each_goal_by_the_median_of_its_rounds(tmp_path):
    """bench/gpu/tcp_goals.py --host-only runs the host-memory goals for real (tether beside the C ceiling
    at the same stream count) and judges each by the median of its rounds' ratios, with the median
    transfer's rate (size / p50) against the same ceiling beside it; the GPU goals are "n/a" here."""
    here = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu")
    r = subprocess.run([sys.executable, os.path.join(here, "tcp_goals.py"), "--rounds", "2", "--host-only", "--out",
                        str(tmp_path)], env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    at = lines.index("by the median of the rounds (the p50 transfer's rate against the same ceiling in brackets):")
    per_round = {line.split(" goal ")[0].strip(): line for line in lines[1:at]}
    verdicts = {line[:30].strip(): line[30:].strip() for line in lines[at + 1:] if not line.startswith("  CPU ")}
    for what in ("host 256 MiB write", "host 256 MiB read"):
        ratios = sorted(float(cell.split(" = ")[1].split()[0]) for cell in per_round[what].split(" | "))
        assert len(ratios) == 2, per_round[what]
        median, rest = verdicts[what].split(" (p50 ")
        assert float(median) == pytest.approx(sum(ratios) / 2, abs=0.011), verdicts[what]  # two rounds: their mean
        assert rest.split(")")[0].replace(".", "").isdigit() and " over 2 round(s): " in rest
        assert rest.endswith("(goal >= 0.9)") and ("NOT met" in rest) == (float(median) < 0.9)
    assert verdicts["GPU 16 MiB read"] == "n/a"
    sys.path.insert(0, here)
    try:
        import tcp_goals
    finally:
        sys.path.remove(here)
    # Three rounds: the median decides, not the best round nor the mean (0.2 + 0.61 + 0.95 averages 0.59).
    assert tcp_goals.verdict([(0.95, 1.0), (0.2, 0.9), (0.61, 0.7)], 0.6).startswith("0.61 (p50 0.90) over 3 round(s): met")
    assert tcp_goals.verdict([(0.95, 1.0), (0.2, 0.9), (0.59, 0.7)], 0.6).endswith("NOT met (goal >= 0.6)")


def test_tcp_goals_compares_variants_round_by_round(tmp_path):
    """tcp_goals.py --variant runs each variant in every round (their own ceilings: two lanes against two
    streams) and ends with them side by side: per goal, each variant's median ratio and median GB/s."""
    here = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu")
    r = subprocess.run([sys.executable, os.path.join(here, "tcp_goals.py"), "--rounds", "1", "--host-only", "--out",
                        str(tmp_path), "--variant", "base=", "--variant", "two=TETHER_CHANNELS=2"],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "== base: the environment as is" in out and "== two: TETHER_CHANNELS=2" in out
    side = out.split("variants side by side")[1].splitlines()
    row = next(line for line in side if "host 256 MiB write" in line)
    cells = row.split("host 256 MiB write")[1].split(" | ")
    assert [c.split()[0] for c in cells] == ["base", "two"], row
    for c in cells:  # ratio (a * where met), then GB/s
        ratio, gbps = c.split()[1].rstrip("*"), c.split()[-1]
        assert float(ratio) > 0 and float(gbps) > 0, row
    streams = {}
    for name in ("base", "two"):
        d = json.load(open(tmp_path / f"{name}-r0-host.json"))
        streams[name] = {c["streams"] for c in d["ceilings"]}
    assert streams["two"] == {2} and streams["base"] != {2}, streams  # each ceiling at its own lane count
    sys.path.insert(0, here)
    try:
        import tcp_goals
    finally:
        sys.path.remove(here)
    assert tcp_goals.parse_variant("l7=TETHER_CHANNELS=7,TETHER_X=a=b") == ("l7", {"TETHER_CHANNELS": "7", "TETHER_X": "a=b"})
    assert tcp_goals.parse_variant("base=") == ("base", {})
    for bad in ("=X=1", "l7=TETHER_CHANNELS"):
        with pytest.raises(Exception, match="NAME"):
            tcp_goals.parse_variant(bad)


def test_tcp_goals_stops_at_its_deadline_or_on_sigterm_with_whole_rounds(tmp_path):
    """tcp_goals.py --deadline starts no round that would end past it (the first always runs), and SIGTERM
    (a device call's `timeout`) stops at once: either way the report covers the whole rounds run."""
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu", "tcp_goals.py")
    args = [sys.executable, tool, "--rounds", "3", "--host-only", "--out"]
    r = subprocess.run([*args, str(tmp_path / "d"), "--deadline", "1"], env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "deadline: 1 round(s) run" in r.stdout and "issue 20 goals, 1 rounds" in r.stdout, r.stdout
    p = subprocess.Popen([*args, str(tmp_path / "s")], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    lines = []
    while not lines or not lines[-1].startswith("round 1 done"):  # printed as each round ends
        lines.append(p.stdout.readline())
        assert lines[-1], "".join(lines)
    p.send_signal(signal.SIGTERM)  # during round 2, whose bench takes seconds
    out = "".join(lines) + p.communicate(timeout=120)[0]
    assert p.returncode == 0, out
    assert "stopped (SIGTERM) during round 2: the report covers the 1 whole round(s)" in out, out
    assert "issue 20 goals, 1 rounds" in out and "host 256 MiB write" in out, out


def test_ab_table_pairs_each_row_over_the_rounds(tmp_path):
    """bench/gpu/ab_table.py (an A/B's verdict) reads real `tether bench` tables. Two runs' logs are
    crossed (round 1: run A new, run B old; round 2: B new, A old), so every row's medians are equal
    (ratio 1.00) and the new build won exactly one round of two; a row printed twice in one log is kept
    as its own row."""
    outs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-m", "tether", "bench", "--quiet", "--transport", "tcp", "--sizes", "64K,1M",
                            "--mode", "write,read", "--iters", "20"], env=ENV, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        outs.append(r.stdout)
    for name, text in (("ab_new_1", outs[0] * 2), ("ab_old_1", outs[1] * 2), ("ab_new_2", outs[1] * 2),
                       ("ab_old_2", outs[0] * 2)):
        (tmp_path / f"{name}.log").write_text(text)
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu", "ab_table.py")
    t = subprocess.run([sys.executable, tool, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert t.returncode == 0, t.stderr
    rows = [line for line in t.stdout.splitlines() if " won " in line and " = " in line]
    assert len(rows) == 8, t.stdout  # write/read x 64 KiB/1 MiB, each twice
    assert sum("(#2)" in row for row in rows) == 4, t.stdout
    for row in rows:
        assert " = 1.00 " in row, row
        won = row.split(" won ")[1]
        assert won in ("1 of 2", "0 of 2"), row  # 0 only where both runs printed the same GB/s


def test_sweep_env_runs_each_environment_per_round_beside_a_ceiling(tmp_path):
    """bench/gpu/sweep_env.py: one command under two environments, rounds interleaved, a loopback ceiling
    opening each round; its table has every row once, with the ratio to the first environment, and the
    p50 of a latency row (64 B moves far under 2 GB/s)."""
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu", "sweep_env.py")
    cmd = f"{sys.executable} -m tether bench --quiet --transport tcp --sizes 64,1M --iters 20"
    t = subprocess.run([sys.executable, tool, "--rounds", "2", "--ceiling", "2", "--out", str(tmp_path),
                        "--env", "base=", "--env", "small=TETHER_CHUNK_BYTES=262144", cmd],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert t.returncode == 0, t.stdout + t.stderr
    ceilings = [line for line in t.stdout.splitlines() if line.startswith("== round ") and "ceiling" in line]
    assert len(ceilings) == 2 and all(float(c.split()[-2]) > 0 for c in ceilings), t.stdout
    assert sorted(os.listdir(tmp_path)) == ["base_1.log", "base_2.log", "small_1.log", "small_2.log"]
    table = t.stdout.split("median GB/s over 2 rounds")[1].splitlines()[1:]
    rows = {line.split("  base ")[0].strip(): line for line in table if "  base " in line}
    assert set(rows) == {"write tcp cpu 64 B", "write tcp cpu 1 MiB"}, t.stdout
    assert " p50 " in rows["write tcp cpu 64 B"] and "small " in rows["write tcp cpu 64 B"], t.stdout
    assert "x, " in rows["write tcp cpu 1 MiB"], t.stdout  # the ratio to base and the rounds won
    # Each run's line carries the hypervisor's share of the CPU time while it ran (0 where there is none).
    runs = [line for line in t.stdout.splitlines() if line.startswith(("== base round", "== small round"))]
    assert len(runs) == 4 and all(0.0 <= float(line.split(" steal ")[1].split(" %")[0]) <= 100.0 for line in runs)
    sys.path.insert(0, os.path.dirname(tool))
    try:
        import sweep_env
    finally:
        sys.path.remove(os.path.dirname(tool))
    # --skip-steal PCT: rounds in which some run lost more than PCT % are left out; without it, none is.
    assert sweep_env.rounds_to_keep([0.0, 3.5, 0.4, 1.0], 1.0) == [0, 2, 3]
    assert sweep_env.rounds_to_keep([0.0, 3.5], None) == [0, 1]
    # --deadline: a round starts only where it would end in time at the slowest round's pace so far.
    assert sweep_env.should_start(0.0, [], 10.0) and sweep_env.should_start(500.0, [400.0], 0)
    assert sweep_env.should_start(6.0, [3.0, 4.0], 10.0) and not sweep_env.should_start(6.5, [3.0, 4.0], 10.0)
    # A run past --timeout is killed with its process group and counts as exit status 124; the sweep goes on.
    t0 = time.monotonic()
    assert sweep_env.run_group("sleep 30", dict(os.environ), subprocess.DEVNULL, 1) == 124
    assert time.monotonic() - t0 < 10


def test_sweep_env_stopped_by_sigterm_prints_the_table_of_its_whole_rounds(tmp_path):
    """`timeout` ending a device call's sweep mid-round (SIGTERM) still gets the table, over the rounds
    that finished: a call that ran out of time used to lose every figure it had measured."""
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu", "sweep_env.py")
    nap = tmp_path / "nap"  # once it exists, every run sleeps a minute after its bench
    cmd = f"{sys.executable} -m tether bench --quiet --transport tcp --sizes 1M --iters 10; [ -e {nap} ] && sleep 60; true"
    p = subprocess.Popen([sys.executable, tool, "--rounds", "4", "--out", str(tmp_path / "logs"),
                          "--env", "base=", "--env", "slow=TETHER_CHUNK_BYTES=262144", cmd],
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in p.stdout:  # round 1: base, then slow
            seen.append(line)
            if line.startswith("== slow round 1"):
                break
        nap.touch()
        time.sleep(8)  # round 2's first run has run its bench and sleeps
        p.terminate()
        out = "".join(seen) + p.communicate(timeout=60)[0]
    finally:
        p.kill()
    assert p.returncode == 0, out
    assert "stopped (SIGTERM) during round 2: the table covers the 1 whole round(s)" in out, out
    table = out.split("median GB/s over 1 rounds")[1].splitlines()[1:]
    assert any(line.strip().startswith("write tcp cpu 1 MiB") and "slow " in line for line in table), out


def test_trace_reaches_its_file_without_the_endpoint_closing(tmp_path):
    """A process that never closes its endpoint (os._exit, as NIXL's examples and our NIXL driver end)
    still leaves its events: the control thread appends them every tick."""
    prefix = str(tmp_path / "tr")
    code = ("import os, time, numpy as np, tether\n"
            "a = tether.Endpoint(transport='tcp'); b = tether.Endpoint(transport='tcp')\n"
            "dst = b.register(np.zeros(1 << 20, np.uint8)); src = a.register(np.ones(1 << 20, np.uint8))\n"
            "a.connect(b.metadata(), timeout=10).write(src, dst.descriptor()).wait(10)\n"
            "time.sleep(0.5)\n"
            "os._exit(0)\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(ENV, TETHER_TRACE=prefix), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    files = list(tmp_path.glob("tr.*.tsv"))
    assert len(files) == 1, files
    events = [line.split("\t")[1] for line in files[0].read_text().splitlines() if line[:1].isdigit()]
    assert "post" in events and "answered" in events and "landed" in events, events


def test_trace_follows_ipc_requests_too(tmp_path):
    """ipc lanes mark their steps as well: the initiator pulls, sends and takes each answer; the target
    reads the request and sends its answer."""
    _, init, target = _traced_bench(tmp_path, "--transport", "ipc", "--sizes", "1M", "--iters", "4", "--warmup", "1",
                                    "--check")
    writes = {(s, g) for e, t, s, g in init if e == "sent" and t == 1}
    assert len(writes) >= 4
    for s, g in writes:
        assert ("pulled", 1, s, g) in init and ("answered", 2, s, g) in init
        assert ("header", 1, s, g) in target and ("sent", 2, s, g) in target
