"""Side by side, one run, one machine: tether's fabric transport against the provider's own ceiling
(a bare fi_write loop between two processes, bench/tools/fi_write_loop.c), tether's tcp transport
and iperf3. Rounds interleave the contenders so a drifting host hurts them alike; the table shows
medians and the ratio tether-fabric / raw fi_write (odd rounds run in reverse order).

    python bench/compare_fabric.py [--provider tcp] [--rounds 3] [--seconds 3] [--check] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tether import bench as B

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compare_tcp import iperf3  # noqa: E402


def build_raw() -> Path | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    exe = Path(tempfile.mkdtemp()) / "fi_write_loop"
    r = subprocess.run([cc, "-O2", "-o", str(exe), str(HERE / "tools" / "fi_write_loop.c"), "-lfabric"],
                       capture_output=True, text=True)
    if r.returncode:
        print("cannot build fi_write_loop (libfabric-dev missing?):", r.stderr.strip()[:300], file=sys.stderr)
        return None
    return exe


def raw_write(exe: Path, provider: str, size: int, window: int, seconds: float, dc: bool, ring: int = 0,
              port: int = 5399) -> float:
    """GB/s of the bare loop: -S size writes walking a `ring`-byte buffer, `window` in flight,
    FI_DELIVERY_COMPLETE if dc."""
    srv = subprocess.Popen([str(exe), "-s", "-p", provider, "-S", str(size), "-R", str(ring), "-P", str(port)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if srv.stdout.readline().strip() != "ready":
            raise RuntimeError("fi_write_loop target: " + srv.stderr.read())
        cmd = [str(exe), "-c", "127.0.0.1", "-p", provider, "-S", str(size), "-w", str(window), "-t", str(seconds),
               "-R", str(ring), "-P", str(port)] + (["-d"] if dc else [])
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, check=True).stdout.split()
        return float(out[1])
    finally:
        srv.wait(30)


def tether_write(options: dict, size: int, iters: int, check: bool, depth: int = 0) -> B.Result:
    pair = B.LocalPair(options, size)
    try:
        case = B.Case("write", size, 1, iters, max(1, iters // 10), depth, check)
        return B.run_case(pair, case, transport=pair.peer.transport)
    finally:
        pair.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--provider", default=os.environ.get("TETHER_FABRIC_PROVIDER", "tcp"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--size", type=B.parse_size, default=256 << 20, help="tether write size (chunks of chunk_bytes)")
    ap.add_argument("--check", action="store_true", help="also verify every byte (separate pass)")
    ap.add_argument("--json")
    args = ap.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 160)
    chunk = 1 << 20                          # tether's default chunk_bytes: what each fi_write moves
    window = 32                              # tether's default window (chunks in flight)
    iters = max(10, int(args.seconds * 1.5e9 / args.size))
    exe = build_raw()
    fab = {"transport": "fabric", "fabric_provider": args.provider}
    rows: dict[str, list[float]] = {k: [] for k in ("iperf3", "raw_warm", "raw", "raw_dc", "fabric", "fabric_async", "tcp")}
    checks = []
    for rnd in range(args.rounds):
        console.print(f"round {rnd + 1}/{args.rounds}", style="dim")
        if rnd == 0 and (g := iperf3(int(args.seconds))):
            rows["iperf3"].append(g)
        runs = []
        if exe:
            runs += [("raw_warm", lambda: raw_write(exe, args.provider, chunk, window, args.seconds, dc=True)),
                     ("raw", lambda: raw_write(exe, args.provider, chunk, window, args.seconds, dc=False, ring=args.size)),
                     ("raw_dc", lambda: raw_write(exe, args.provider, chunk, window, args.seconds, dc=True, ring=args.size))]
        runs += [("fabric", lambda: tether_write(fab, args.size, iters, False).gbps),
                 ("fabric_async", lambda: tether_write(fab, 64 << 20, 4 * iters, False, depth=4).gbps),
                 ("tcp", lambda: tether_write({"transport": "tcp"}, args.size, iters, False).gbps)]
        for name, run in (runs if rnd % 2 == 0 else runs[::-1]):  # alternate the order: no contender always first
            rows[name].append(run())
    if args.check:
        for name, opts in (("fabric", fab), ("tcp", {"transport": "tcp"})):
            checks.append((name, tether_write(opts, args.size, 3, True).check))

    med = {k: statistics.median(v) if v else None for k, v in rows.items()}
    t = Table(title=f"tether fabric ({args.provider}) vs its provider's ceiling, loopback, {os.cpu_count()} CPUs "
                    f"({time.strftime('%Y-%m-%d')}), median of {args.rounds} interleaved rounds")
    for c in ("contender", "GB/s (median)", "per round", "÷ raw fi_write DC, same round (median)"):
        t.add_column(c, justify="right")
    names = {
        "iperf3": "iperf3 -l 1M, 1 stream",
        "raw_warm": f"raw fi_write 1 MiB x{window}, delivery complete, one cache-warm 1 MiB buffer",
        "raw": f"raw fi_write 1 MiB x{window}, transmit complete, over {B.human(args.size)}",
        "raw_dc": f"raw fi_write 1 MiB x{window}, delivery complete, over {B.human(args.size)} (ceiling)",
        "fabric": f"tether-fabric {B.human(args.size)} writes, one at a time (1 MiB chunks, window {window})",
        "fabric_async": "tether-fabric 64 MiB writes, 4 in flight",
        "tcp": f"tether-tcp {B.human(args.size)} writes (defaults)",
    }
    for k, label in names.items():
        if med[k] is None:
            continue
        # the host drifts: compare with the ceiling measured in the same round
        per = [x / c for x, c in zip(rows[k], rows["raw_dc"])] if k != "iperf3" else [rows[k][0] / rows["raw_dc"][0]] if rows["raw_dc"] else []
        ratio = f"{statistics.median(per):.2f}" if per else ""
        t.add_row(label, f"{med[k]:.2f}", " ".join(f"{x:.2f}" for x in rows[k]), ratio)
    console.print(t)
    for name, ok in checks:
        console.print(f"--check {name}: {'ok' if ok else 'FAILED'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": B.machine_info(), "provider": args.provider, "rounds": rows, "ratio_vs_raw_dc": {k: [x / c for x, c in zip(v, rows["raw_dc"])] for k, v in rows.items() if k != "iperf3"},
                                               "median": med, "checks": checks}, indent=2))
    return 1 if any(ok is False for _, ok in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
