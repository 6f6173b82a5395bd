"""What `tether` prints for a new user: tables whole and readable at 80 columns (and narrower, piped), the
rows the hypervisor took CPU time from named under the table, doctor at 80 columns, and help texts that
cover every option and wrap at the terminal's width."""
from __future__ import annotations

import json
import os
import time

import pytest

import tether
from tether import bench as B, cli
from tether_testutil.cli import cells, run_cli

# ---------------------------------------------------------------- tables at 80 columns

@pytest.mark.budget(120)
@pytest.mark.parametrize("columns", [80, 50])
def test_bench_table_whole_when_narrow_and_piped(tmp_path, columns):
    """Piped with COLUMNS=80 (and narrower than the figures need): every figure comes out whole."""
    out = tmp_path / "r.json"
    r = run_cli("bench", "--quiet", "--sizes", "4K,1M", "--mode", "write,read", "--num-iovs", "1,4",
                "--channels", "1,2", "--iters", "3", "--check", "--json", str(out), env={"COLUMNS": str(columns)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "…" not in r.stdout, r.stdout
    if columns == 80:
        assert max(len(line) for line in r.stdout.splitlines()) <= 80, r.stdout
    words = cells(r.stdout)
    results = json.loads(out.read_text())["results"]
    assert len(results) == 16
    for x in results:
        for figure in (cli.fmt_gbps(x["gbps"]), cli.fmt_us(x["lat_p50_us"]), cli.fmt_us(x["lat_p99_us"])):
            assert figure in words, (figure, r.stdout)
        assert B.human(x["size"]) in r.stdout
    assert "channels=1" in words and "channels=2" in words


def _results(n=3, **kw):
    rows = []
    for i in range(n):
        base = dict(mode="write", transport="tcp", device="gpu0>gpu1", size=256 << 20, num_iovs=4096, iters=10,
                    gbps=1144.23 + i, lat_p50_us=190123.4 + i, lat_p99_us=201234.5 + i, cpu_client=149.0,
                    cpu_server=102.0, check=True, config={"channels": 8, "chunk_bytes": 1 << 20, "pair": f"{i}>1"})
        base.update(kw)
        rows.append(B.Result(**base))
    return rows


@pytest.mark.parametrize("width", [80, 60, 40])
@pytest.mark.parametrize("mixed", [False, True], ids=["constant", "mixed"])
def test_results_table_keeps_figures(width, mixed):
    """Figures that were once cut (14.… GB/s, 190… µs, wri…, tra…) rendered at a narrow width: all whole."""
    from rich.console import Console

    rows = _results()
    if mixed:
        rows[1].mode, rows[1].transport, rows[1].check, rows[2].device = "read", "ipc", False, "gpu0>gpu0"
    table, w = cli.results_table(rows, full_mesh=True, show_config=True, elapsed=1.0, width=width)
    c = Console(width=w, record=True, file=open(os.devnull, "w"))
    c.print(table)
    text = c.export_text()
    assert "…" not in text
    words = cells(text)
    for r in rows:
        for figure in ("256", "MiB", cli.fmt_gbps(r.gbps), cli.fmt_us(r.lat_p50_us), cli.fmt_us(r.lat_p99_us)):
            assert figure in words, (figure, text)
    for word in ("write", "tcp", "gpu0>gpu1", "channels=8", "chunk_bytes=1048576") + (
            ("read", "ipc", "FAILED", "gpu0>gpu0") if mixed else ()):
        assert word in words, (word, text)
    assert max(len(line) for line in text.splitlines()) <= w
    if width == 80 and not mixed:  # mixed rows need more: printed wider, figures still whole
        assert w == 80, text


@pytest.mark.budget(60)
def test_doctor_piped_at_80_columns():
    """Addresses and PCI paths whole; unknown NUMA printed one way."""
    report = json.loads(run_cli("doctor", "--json").stdout)
    r = run_cli("doctor", env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout, r.stdout
    words = cells(r.stdout)
    for n in report["nics"]:
        for addr in n["addrs"]:
            assert addr in words, (addr, r.stdout)
        if n["pci_path"]:
            assert n["pci_path"] in r.stdout, (n["pci_path"], r.stdout)
        assert n["numa_node"] is None or n["numa_node"] >= 0  # unknown is null, never -1
    assert " -1 " not in r.stdout


def test_rows_the_hypervisor_took_cpu_time_from_are_named_under_the_table():
    """A row during whose timed pass the hypervisor took >= 1 % of the machine's CPU time (/proc/stat's
    steal, bench.steal_share) is named in the caption with its share; on the GPU host the rows that ran
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


def test_steal_share_is_a_share_of_the_ticks_that_passed_never_of_wall_time():
    """The hypervisor's share is steal ticks over all ticks of the same interval: a pass shorter than one
    tick that saw a steal tick land reads 100 %, not the thousands of % that dividing by its wall time gave."""
    assert B.steal_share((10, 1000), (13, 1100)) == 3.0
    assert B.steal_share((10, 1000), (11, 1001)) == 100.0
    assert B.steal_share((10, 1000), (10, 1000)) == 0.0  # no tick passed: nothing to share
    steal0, all0 = B.cpu_ticks()
    time.sleep(0.05)
    steal1, all1 = B.cpu_ticks()
    assert 0 <= steal0 <= steal1 and 0 <= all0 <= all1  # counters: never go back ((0, 0) without /proc/stat)
    assert 0.0 <= B.steal_share((steal0, all0)) <= 100.0


def test_every_option_has_help():
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in subs.items():
        for action in sub._actions:
            assert action.help and action.help.strip(), f"tether {name} {action.option_strings}: no help"
    bench = subs["bench"]
    mode = next(a for a in bench._actions if a.dest == "mode")
    assert "default: write" in mode.help
    text = bench.format_help()
    assert "1K = 1024" in text and "10^9 bytes per second" in text and "gbps" in text


def test_plain_tether_prints_its_help():
    r = run_cli()
    assert r.returncode == 2 and "bench" in r.stderr and "doctor" in r.stderr and "required" not in r.stderr
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"tether {tether.__version__}"


@pytest.mark.budget(60)
def test_bench_help_wraps_at_the_terminal_width():
    """`tether bench --help` printed its description and notes as written, lines up to 112 characters on
    an 80-column terminal; now every part wraps at the width (COLUMNS when piped)."""
    narrow = run_cli("bench", "--help", env={"COLUMNS": "80"})
    wide = run_cli("bench", "--help", env={"COLUMNS": "200"})
    assert narrow.returncode == 0 and wide.returncode == 0, narrow.stderr + wide.stderr
    too_long = [line for line in narrow.stdout.splitlines() if len(line) > 80]
    assert not too_long, too_long
    assert "Measure transfers between two local processes (or two hosts: --role). Prints a table;" in wide.stdout
    assert len(wide.stdout.splitlines()) < len(narrow.stdout.splitlines())
    assert "every combination runs" in narrow.stdout and "TETHER_DEBUG=1) prints the" in narrow.stdout
