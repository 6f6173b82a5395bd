#!/usr/bin/env python3
"""The verdict of an A/B (bench/gpu/ab.sh): per table row, each round's GB/s of both builds, the
medians, their ratio and how many rounds the new build won, from DIR/ab_{new,old}_ROUND.log.

    python3 bench/gpu/ab_table.py DIR

Rows are matched by what identifies them in `tether bench`'s table (mode, transport, device, size,
iovs, and config where a sweep prints one) and by their order among equal ones, so a command that runs
the same row twice keeps both. A round counts as won when the new build's GB/s is higher.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import statistics
import sys

KEY_COLUMNS = ("mode", "transport", "device", "size", "iovs", "config")


def rows_of(path: str) -> list[tuple[tuple, float]]:
    """(row key, GB/s) for every row of every bench table in the log, in order."""
    out, header, seen = [], None, collections.Counter()
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("┃") and "mode" in line:
                header = [c.strip() for c in line.strip().strip("┃").split("┃")]
            elif line.startswith("│") and header:
                cells = [c.strip() for c in line.strip().strip("│").split("│")]
                if len(cells) != len(header) or not cells[0]:
                    continue
                row = dict(zip(header, cells))
                try:
                    gbps = float(row.get("GB/s", "").replace(",", ""))
                except ValueError:
                    continue
                ident = tuple(row.get(k, "") for k in KEY_COLUMNS)
                seen[ident] += 1
                out.append(((*ident, seen[ident]), gbps))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="where ab.sh wrote ab_new_N.log and ab_old_N.log")
    a = ap.parse_args()
    runs = {"new": {}, "old": {}}
    for path in glob.glob(os.path.join(a.dir, "ab_*_*.log")):
        m = re.fullmatch(r"ab_(new|old)_(\d+)\.log", os.path.basename(path))
        if m:
            runs[m[1]][int(m[2])] = dict(rows_of(path))
    rounds = sorted(set(runs["new"]) & set(runs["old"]))
    if not rounds:
        print(f"no rounds with both builds in {a.dir}", file=sys.stderr)
        return 1
    keys = [k for k in runs["new"][rounds[0]]]  # the first round's order
    print(f"A/B, {len(rounds)} rounds, GB/s new / old per round; median ratio new/old; rounds won by new")
    for key in keys:
        pairs = [(runs["new"][r].get(key), runs["old"][r].get(key)) for r in rounds]
        pairs = [(n, o) for n, o in pairs if n is not None and o is not None]
        if not pairs:
            continue
        new_med = statistics.median(n for n, _ in pairs)
        old_med = statistics.median(o for _, o in pairs)
        won = sum(n > o for n, o in pairs)
        mode, transport, device, size, iovs, config, nth = key
        blocks = f"{iovs} x {size}" if iovs not in ("", "1") else size
        name = " ".join(x for x in (mode, transport, device, blocks, config) if x) + (f" (#{nth})" if nth > 1 else "")
        each = ", ".join(f"{n:g} / {o:g}" for n, o in pairs)
        ratio = new_med / old_med if old_med else float("inf")
        print(f"{name:44} {each:48} median {new_med:g} / {old_med:g} = {ratio:.2f}  won {won} of {len(pairs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
