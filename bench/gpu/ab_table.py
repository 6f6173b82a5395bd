#!/usr/bin/env python3
"""The verdict of an A/B (bench/gpu/ab.sh): per table row, each round's GB/s of both builds, the
medians, their ratio and how many rounds the new build won, from DIR/ab_{new,old}_ROUND.log. A row
without GB/s (a lone small op) is judged by its p50 µs, where lower wins.

    python3 bench/gpu/ab_table.py DIR

Rows are matched by what identifies them in `tether bench`'s table (mode, transport, device, size,
iovs, and config where a sweep prints one) and by their order among equal ones, so a command that runs
the same row twice keeps both; bench/peers/run.py's rows by system and workload.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import statistics
import sys

KEY_COLUMNS = ("system", "workload", "mode", "transport", "device", "size", "iovs", "config")


def cpu_s_per_gb(cells: list[str], header: list[str], gbps: float) -> float | None:
    """Both processes' CPU-seconds per GB from the CPU% column(s): rich prints "CPU%" over "client" and
    "server" (two columns) or over "c/s" (one column, "a/b"); "-" where not measured."""
    try:
        cpu = [c for h, c in zip(header, cells) if h.startswith("CPU%")]
        total = sum(float(x) for c in cpu for x in c.rstrip("%").split("/"))
    except ValueError:
        return None
    return total / 100.0 / gbps if cpu and gbps > 0 else None


def table_rows(path: str):
    """(row key, the row as {column: cell}, its figure, CPU-s per GB or None) for every row of every bench
    table in the log, in order. The figure is GB/s, or for a row without one (a lone small op) its p50 µs,
    whose key then ends in "p50 µs". bench/peers/run.py's tables leave `system` empty on a system's later
    rows: it is carried down."""
    header, seen, in_header, system = None, collections.Counter(), False, ""
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("┃"):  # a header spans lines ("CPU%" over "client"): join each column's
                cells = [c.strip() for c in line.strip().strip("┃").split("┃")]
                if in_header and header and len(header) == len(cells):
                    cells = [f"{a} {b}".strip() for a, b in zip(header, cells)]
                header, in_header = cells, True
                continue
            in_header = False
            if line.startswith("│") and header:
                cells = [c.strip() for c in line.strip().strip("│").split("│")]
                if header[0] == "system":
                    system = cells[0] or system
                    cells[0] = system
                if len(cells) != len(header) or not cells[0]:
                    continue
                row = dict(zip(header, cells))
                try:
                    gbps = float(row.get("GB/s", "").replace(",", "") or 0)
                    p50 = float(row.get("p50 µs", "").replace(",", "") or 0)
                except ValueError:
                    continue
                ident = tuple(row.get(k, "") for k in KEY_COLUMNS) + ("" if gbps > 0 else "p50 µs",)
                if gbps <= 0 and p50 <= 0:
                    continue
                seen[ident] += 1
                yield (*ident, seen[ident]), row, (gbps if gbps > 0 else p50), cpu_s_per_gb(cells, header, gbps)


def rows_of(path: str) -> list[tuple[tuple, float, float | None]]:
    """(row key, GB/s or p50 µs, CPU-s per GB or None) for every row of every bench table in the log, in order."""
    return [(key, gbps, cpu) for key, _, gbps, cpu in table_rows(path)]


def row_name(key: tuple) -> str:
    """A row's key (rows_of) as its table shows it: "read tcp gpu0>gpu0 16 MiB", "write ... 4096 x 16 KiB",
    "tether (ipc) 8 B write p50 µs"."""
    system, workload, mode, transport, device, size, iovs, config, unit, nth = key
    blocks = f"{iovs} x {size}" if iovs not in ("", "1") else size
    parts = (system, workload, mode, transport, device, blocks, config, unit)
    return " ".join(x for x in parts if x) + (f" (#{nth})" if nth > 1 else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="where ab.sh wrote ab_new_N.log and ab_old_N.log")
    a = ap.parse_args()
    runs = {"new": {}, "old": {}}
    cpus = {"new": {}, "old": {}}  # CPU-s per GB (both processes) where the table has CPU%
    for path in glob.glob(os.path.join(a.dir, "ab_*_*.log")):
        m = re.fullmatch(r"ab_(new|old)_(\d+)\.log", os.path.basename(path))
        if m:
            rows = rows_of(path)
            runs[m[1]][int(m[2])] = {k: g for k, g, _ in rows}
            cpus[m[1]][int(m[2])] = {k: c for k, _, c in rows if c is not None}
    rounds = sorted(set(runs["new"]) & set(runs["old"]))
    if not rounds:
        print(f"no rounds with both builds in {a.dir}", file=sys.stderr)
        return 1
    keys = [k for k in runs["new"][rounds[0]]]  # the first round's order
    print(f"A/B, {len(rounds)} rounds, GB/s (or p50 µs) new / old per round; median ratio new/old; rounds won by new")
    for key in keys:
        pairs = [(runs["new"][r].get(key), runs["old"][r].get(key)) for r in rounds]
        pairs = [(n, o) for n, o in pairs if n is not None and o is not None]
        if not pairs:
            continue
        new_med = statistics.median(n for n, _ in pairs)
        old_med = statistics.median(o for _, o in pairs)
        won = sum((n < o) if key[-2] else (n > o) for n, o in pairs)  # p50 µs: lower wins
        name = row_name(key)
        each = ", ".join(f"{n:g} / {o:g}" for n, o in pairs)
        ratio = new_med / old_med if old_med else float("inf")
        print(f"{name:44} {each:48} median {new_med:g} / {old_med:g} = {ratio:.2f}  won {won} of {len(pairs)}")
        cpu = [(cpus["new"][r].get(key), cpus["old"][r].get(key)) for r in rounds]
        cpu = [(n, o) for n, o in cpu if n is not None and o is not None]
        if cpu:
            cn, co = statistics.median(n for n, _ in cpu), statistics.median(o for _, o in cpu)
            each = ", ".join(f"{n:.3f} / {o:.3f}" for n, o in cpu)
            print(f"{'  CPU-s/GB':44} {each:48} median {cn:.3f} / {co:.3f} = {cn / co:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
