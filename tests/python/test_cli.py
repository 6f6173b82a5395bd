"""`tether bench` / `tether doctor`: argument parsing, --check catching a planted corruption,
--json output, the two-host roles, and an idle endpoint not burning CPU."""
import json
import os
import resource
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
    16 MiB GPU read's rare multi-ms transfers were traced to one thread that did not run."""
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
    at half their rate came with it. Rows below the mark, and tables without any, say nothing."""
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
