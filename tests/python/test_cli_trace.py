"""`tether bench --trace`: each chunk recorded on both sides, over tcp and ipc, reaching its file even when
the endpoint is never closed, and the trace report's views (reader time per receiving lane, the slowest
transfers lane by lane, one transfer's timeline)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tether_testutil.cli import ENV

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
    write is taken and sent by the initiator, landed by the target and answered; the report pairs them."""
    prefix, init, target = _traced_bench(tmp_path, "--transport", "tcp", "--sizes", "2M", "--chunk-bytes", "512K",
                                         "--iters", "4", "--warmup", "1", "--check")
    writes = {(s, g) for e, t, s, g in init if e == "sent" and t == 1}
    assert len(writes) >= 4  # 2 MiB in 512 KiB chunks, several transfers
    for s, g in writes:
        assert ("taken", 1, s, g) in init and ("answered", 2, s, g) in init
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
        assert ("taken", 1, s, g) in init and ("answered", 2, s, g) in init
        assert ("header", 1, s, g) in target and ("sent", 2, s, g) in target
