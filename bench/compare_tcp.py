"""Side by side, one run, one machine: tether over TCP loopback against iperf3 and a plain TCP
ping-pong (the host-memory tcp goals, docs/PERFORMANCE.md, "Host memory over TCP"). Prints a table with the ratios.

    python bench/compare_tcp.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tether import bench as B

HERE = Path(__file__).resolve().parent
CHECK = {None: "-", True: "ok", False: "FAILED"}  # a Result's every-byte check, as the tables show it


def options() -> tuple[argparse.Namespace, Console]:
    """The options compare_tcp.py and compare_ipc.py take, and a console as wide as the terminal (or 160)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--check", action="store_true", help="also verify every byte (separate pass)")
    return ap.parse_args(), Console(width=None if sys.stdout.isatty() else 160)


def iperf3(seconds: int = 5) -> float | None:
    """GB/s of one iperf3 stream over loopback with 1 MiB writes."""
    if not shutil.which("iperf3"):
        return None
    srv = subprocess.Popen(["iperf3", "-s", "-1", "-p", "5299"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", "5299", "-l", "1M", "-t", str(seconds), "-J"],
                             capture_output=True, text=True, timeout=seconds + 30, check=True)
        return json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"] / 8e9
    finally:
        srv.wait(10)


def pingpong(iters: int = 20000) -> tuple[float, float] | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    exe = Path(tempfile.mkdtemp()) / "pingpong"
    subprocess.run([cc, "-O2", "-o", str(exe), str(HERE / "tools" / "pingpong.c")], check=True)
    p50, p99 = subprocess.run([str(exe), str(iters), "8"], capture_output=True, text=True, check=True).stdout.split()
    return float(p50), float(p99)


def main() -> int:
    args, console = options()
    rows = []
    ceiling = iperf3()
    pp = pingpong()
    pair = B.LocalPair({"transport": "tcp"}, 256 << 20)  # same host would pick ipc: this compares TCP
    try:
        cases = [
            ("256 MiB write", B.Case("write", 256 << 20, 1, 10, 2, 0, args.check)),
            ("256 MiB read", B.Case("read", 256 << 20, 1, 10, 2, 0, args.check)),
            ("128 x 1.15 MB writev", B.Case("write", 1179648, 128, 10, 2, 0, args.check)),
            ("128 x 1.15 MB readv", B.Case("read", 1179648, 128, 10, 2, 0, args.check)),
            ("64 KiB write", B.Case("write", 64 << 10, 1, 5000, 200, 0, args.check)),
            ("64 KiB read", B.Case("read", 64 << 10, 1, 5000, 200, 0, args.check)),
            ("64 KiB write, async depth 8", B.Case("write", 64 << 10, 1, 5000, 200, 8, args.check)),
            ("64 KiB read, async depth 8", B.Case("read", 64 << 10, 1, 5000, 200, 8, args.check)),
            ("64 KiB write, async depth 32", B.Case("write", 64 << 10, 1, 5000, 200, 32, args.check)),
            ("128 x 64 KiB writev", B.Case("write", 64 << 10, 128, 200, 20, 0, args.check)),
            ("128 x 64 KiB readv", B.Case("read", 64 << 10, 128, 200, 20, 0, args.check)),
            ("8 B write", B.Case("write", 8, 1, 20000, 1000, 0, args.check)),
        ]
        for name, case in cases:
            r = B.run_case(pair, case)
            rows.append((name, r))
    finally:
        pair.close()
    t = Table(title=f"tether tcp vs raw TCP, loopback, {os.cpu_count()} CPUs ({time.strftime('%Y-%m-%d')})")
    for c in ("case", "GB/s", "p50 µs", "p99 µs", "vs iperf3", "vs ping-pong p50", "CPU% c/s", "check"):
        t.add_column(c, justify="right")
    if ceiling:
        t.add_row("iperf3 -l 1M (1 stream)", f"{ceiling:.2f}", "", "", "1.00", "", "", "")
    if pp:
        t.add_row("TCP ping-pong 8 B (C)", "", f"{pp[0]:.1f}", f"{pp[1]:.1f}", "", "1.00", "", "")
    out = []
    for name, r in rows:
        vs_i = f"{r.gbps / ceiling:.2f}" if ceiling and r.size >= 64 << 10 else ""
        vs_p = f"{r.lat_p50_us / pp[0]:.2f}" if pp and r.size == 8 else ""
        t.add_row(name, f"{r.gbps:.2f}", f"{r.lat_p50_us:.1f}", f"{r.lat_p99_us:.1f}", vs_i, vs_p,
                  f"{r.cpu_client:.0f}/{r.cpu_server:.0f}", CHECK[r.check])
        out.append(dict(B.result_dict(r), case=name))
    console.print(t)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": B.machine_info(), "iperf3_gbps": ceiling,
                                               "pingpong_us": pp, "results": out}, indent=2))
    return 1 if any(r.check is False for _, r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
