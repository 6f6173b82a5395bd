"""tether beside its peers: the same workloads, one run, one machine, TCP loopback, one table.

    cd /work/main && PYTHONPATH=python python3 bench/peers/run.py [--json PATH] [--only NAME ...]

Rows: iperf3 (the raw TCP ceiling), tether, Mooncake Transfer Engine (tcp), NIXL/UCX forced onto
TCP, NIXL/UCX with UCX's own choice (a same-host copy path, not TCP: shown so, for reference), and
NCCL send/recv where there are two GPUs. Each system runs in its own driver process (X_driver.py)
under a time limit; a peer that is missing, fails or hangs becomes a row saying so.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
DRIVER_TIMEOUT = 240  # seconds per driver; the slowest (NIXL/UCX over TCP) needs about a minute and a half

# (name for --only, driver file, its arguments, system name for a row if it yields none)
DRIVERS = [
    ("tether", "tether_driver.py", ["tcp"], "tether (tcp)"),
    ("nixl-tether-tcp", "nixl_driver.py", ["tether-tcp"], "NIXL + TETHER (tcp)"),
    ("mooncake", "mooncake_driver.py", [], "Mooncake TE (tcp)"),
    ("nixl-tcp", "nixl_driver.py", ["tcp"], "NIXL/UCX UCX_TLS=tcp"),
    ("tether-ipc", "tether_driver.py", ["ipc"], "tether (ipc)"),
    ("nixl-tether", "nixl_driver.py", ["tether"], "NIXL + TETHER (default: ipc)"),
    ("nixl-default", "nixl_driver.py", ["default"], "NIXL/UCX default"),
    ("nccl", "nccl_driver.py", [], "NCCL send/recv"),
    ("nccl-socket", "nccl_driver.py", ["socket"], "NCCL send/recv, socket transport forced"),
]
GPU_DRIVERS = {"tether", "tether-ipc", "nixl-tether-tcp", "nixl-tether", "nixl-tcp", "nixl-default", "nccl",
               "nccl-socket"}  # the systems with a GPU-memory path here
PACKAGES = ["mooncake-transfer-engine-non-cuda", "nixl", "nixl-cu13", "torch", "numpy"]


def iperf3_row() -> dict:
    row = {"system": "iperf3 (1 stream, -l 1M, 5 s)", "workload": "TCP stream", "verified": None}
    try:
        sys.path.insert(0, str(HERE.parent))
        from compare_tcp import iperf3
        gbps = iperf3()
    except Exception as e:  # a failed iperf3 is a row, not a crash
        return {**row, "note": f"failed: {type(e).__name__}: {e}"}
    return {**row, "gbps": gbps} if gbps else {**row, "note": "iperf3 not installed"}


def run_driver(script: str, args: list[str], system: str, console: Console) -> list[dict]:
    """Runs one driver in its own session (so a hung peer and its children can be killed as a
    group) and returns the rows it printed, plus a row saying why if it failed or timed out."""
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, str(HERE / script), *args], stdout=subprocess.PIPE,
                            stderr=err, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=DRIVER_TIMEOUT)
        problem = f"driver exited with {proc.returncode}" if proc.returncode else None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        problem = f"killed after {DRIVER_TIMEOUT} s"
    rows = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
    if problem or not rows:
        err.seek(0)
        tail = [line for line in err.read().decode(errors="replace").splitlines() if line.strip()][-1:]
        note = "; ".join([problem or "driver printed no rows", *tail])
        console.print(f"[yellow]{script} {' '.join(args)}: {note}[/]")
        rows.append({"system": rows[-1]["system"] if rows else system, "workload": "stopped",
                     "verified": None, "note": note})
    return rows


def fmt_us(v) -> str:
    return "" if v is None else f"{v:.1f}" if v < 1000 else f"{v:,.0f}"


def merge_rounds(rows: list[dict]) -> list[dict]:
    """One row per (system, workload): the median of each figure over the rounds, `each` the rounds'
    own p50 (µs) for latency rows or GB/s for the rest, in round order; verified only if every round was."""
    import statistics
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["system"], r["workload"]), []).append(r)
    merged = []
    for (system, workload), rs in groups.items():
        m = {"system": system, "workload": workload, "rounds": len(rs),
             "verified": None if all(r["verified"] is None for r in rs) else all(r["verified"] is True for r in rs)}
        for k in ("gbps", "p50_us", "p99_us"):
            vals = [r[k] for r in rs if r.get(k) is not None]
            if vals:
                m[k] = statistics.median(vals)
                m[k + "_each"] = vals
        latency = workload.startswith("8 B") or (workload.startswith("64 KiB write") and "flight" not in workload)
        m["each"] = ([fmt_us(r.get("p50_us")) for r in rs] if latency else
                     [f"{r['gbps']:.2f}" if r.get("gbps") is not None else "-" for r in rs])
        notes = sorted({r["note"] for r in rs if r.get("note")})
        if notes:
            m["note"] = "; ".join(notes)
        merged.append(m)
    return merged


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the rows and the machine's details here")
    ap.add_argument("--only", nargs="+", choices=["iperf3"] + [d[0] for d in DRIVERS], help="run only these")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                    help="cpu: host memory (default); gpu: GPU memory, GPU 0 -> GPU 1 where two exist, else GPU 0 "
                         "on both sides (two processes)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the drivers this many times, interleaved; rows show the median (and each round's "
                         "p50, or GB/s for bulk rows), for machines whose figures swing between runs")
    ap.add_argument("--workloads", help="only these workloads, by name, separated by ';' "
                    "(e.g. '64 KiB write;8 B write')")
    args = ap.parse_args()
    os.environ["PEERS_DEVICE"] = args.device
    if args.workloads:
        os.environ["PEERS_WORKLOADS"] = args.workloads
    console = Console(width=None if sys.stdout.isatty() else 150)
    log = Console(stderr=True)
    wanted = set(args.only or ["iperf3"] + [d[0] for d in DRIVERS])
    if args.device == "gpu":
        wanted &= GPU_DRIVERS
    t0 = time.time()
    rows = []
    if "iperf3" in wanted:
        log.log("iperf3")
        rows.append(iperf3_row())
    for r in range(args.rounds):
        for name, script, dargs, system in DRIVERS:
            if name in wanted:
                log.log(name + (f" (round {r + 1} of {args.rounds})" if args.rounds > 1 else ""))
                rows.extend(run_driver(script, dargs, system, log))
    if args.rounds > 1:
        rows = merge_rounds(rows)

    memory = "host memory"
    if args.device == "gpu":
        sys.path.insert(0, str(Path(__file__).parent))
        from common import gpus
        memory = "GPU {} -> GPU {}".format(*gpus())
    table = Table(title=f"tether vs peers: two processes on one host, {memory}, TCP loopback unless the "
                        f"system says otherwise — {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}, "
                        f"{time.time() - t0:.0f} s")
    cols = ["system", "workload", "GB/s", "p50 µs", "p99 µs", "verified"]
    if args.rounds > 1:
        cols.append("each round")
    for col in cols:
        table.add_column(col, justify="left" if col in ("system", "workload") else "right")
    for i, r in enumerate(rows):
        workload = r["workload"] + (f": {r['note']}" if r.get("note") else "")
        small = r["workload"].startswith("8 B")  # a latency workload: its GB/s says nothing
        gbps = "" if small or r.get("gbps") is None else f"{r['gbps']:.2f}"
        verified = {None: "-", True: "ok", False: "FAILED"}[r["verified"]]
        first = i == 0 or rows[i - 1]["system"] != r["system"]
        last = i == len(rows) - 1 or rows[i + 1]["system"] != r["system"]
        cells = [r["system"] if first else "", workload, gbps, fmt_us(r.get("p50_us")), fmt_us(r.get("p99_us")), verified]
        if args.rounds > 1:
            cells.append(" / ".join(r.get("each", [])))
        table.add_row(*cells, end_section=last)
    console.print(table)
    if args.json:
        versions = {}
        for p in PACKAGES:
            try:
                versions[p] = metadata.version(p)
            except metadata.PackageNotFoundError:
                versions[p] = None
        machine = {"hostname": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform(),
                   "python": platform.python_version(), "packages": versions, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    return 1 if any(r["verified"] is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
