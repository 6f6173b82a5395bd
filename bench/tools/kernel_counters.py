#!/usr/bin/env python3
"""Runs `tether bench` N times and prints, per run, its rows beside what the kernel counted meanwhile:
/proc/stat (user, sys, softirq, steal... in ticks), /proc/vmstat (page faults, THP, compaction),
TCP counters (retransmissions, receive-queue pruning and collapsing, zero windows) and softnet drops.
This is how the GPU host's half-rate rows were tied to CPU steal (docs/PERFORMANCE.md, "How we measure").

    python3 bench/tools/kernel_counters.py 8 --transport tcp --sizes 256M --mode write,read --ceiling --check

Everything after N goes to `tether bench` (which gets --quiet and --json). Only counters that moved print.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from tether.bench import human

TCP = {"PruneCalled", "RcvPruned", "TCPRcvCollapsed", "TCPMemoryPressures", "TCPBacklogDrop", "TCPRcvQDrop",
       "RetransSegs", "TCPOFOQueue", "TCPZeroWindowDrop", "TCPToZeroWindowAdv", "TCPFromZeroWindowAdv",
       "TCPWantZeroWindowAdv", "DelayedACKs", "TCPBacklogCoalesce", "TCPRcvCoalesce"}
VM = ("compact_stall", "thp_fault", "pgfault", "pgmajfault", "numa_hint", "pgmigrate")


def snapshot() -> dict[str, int]:
    out: dict[str, int] = {}
    fields = open("/proc/stat").readline().split()[1:9]
    out.update(zip(("user", "nice", "sys", "idle", "iowait", "irq", "softirq", "steal"), map(int, fields)))
    for line in open("/proc/vmstat"):
        k, v = line.split()
        if k.startswith(VM):
            out[k] = int(v)
    for path in ("/proc/net/netstat", "/proc/net/snmp"):
        lines = open(path).read().splitlines()
        for names, values in zip(lines[::2], lines[1::2]):  # a header line, then its values
            group = names.split(":")[0]
            for k, v in zip(names.split()[1:], values.split()[1:]):
                if k in TCP:
                    out[f"{group}.{k}"] = int(v)
    rows = [line.split() for line in open("/proc/net/softnet_stat")]
    out["softnet.dropped"] = sum(int(r[1], 16) for r in rows)
    out["softnet.squeezed"] = sum(int(r[2], 16) for r in rows)
    return out


def main() -> int:
    if len(sys.argv) < 2 or not sys.argv[1].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    runs, args = int(sys.argv[1]), sys.argv[2:]
    path = os.path.join(tempfile.mkdtemp(prefix="kernel_counters-"), "run.json")
    for i in range(runs):
        before, t0 = snapshot(), time.time()
        p = subprocess.run([sys.executable, "-m", "tether", "bench", "--quiet", "--json", path, *args],
                           capture_output=True, text=True)
        after, took = snapshot(), time.time() - t0
        if p.returncode != 0:
            print(f"run {i}: tether bench failed: {(p.stdout + p.stderr).strip()[-500:]}")
            return 1
        rows = " ".join(f"{r['mode']} {r['device']} {human(r['size'])} {r['gbps']:.2f} GB/s p50 {r['lat_p50_us']:.0f} us"
                        for r in json.load(open(path))["results"])
        moved = " ".join(f"{k}={after[k] - before.get(k, 0)}" for k in sorted(after) if after[k] != before.get(k))
        print(f"run {i} ({took:.1f} s): {rows} | {moved}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
