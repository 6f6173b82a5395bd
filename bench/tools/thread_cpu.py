#!/usr/bin/env python3
"""CPU time of every thread of a command's process tree, by thread name, split into user and system
time: which of tether's threads spend the CPU-seconds that `tether bench` reports per GB, and whether
in syscalls (send/recv, epoll) or in user space (polling, the CUDA driver). Threads are named by tether
("tether-tcp3", "tether-ipc0", "tether-control"); digits are folded so lanes add up.

    python3 bench/tools/thread_cpu.py [--gb GB] -- tether bench --transport tcp --sizes 256M --iters 60

/proc is sampled every --interval seconds; a thread's figure is its last sample, so one that ends
between two samples loses at most an interval of time. With --gb (bytes moved, in 10^9), each figure
is also given per GB. Linux only; a probe of where the CPU goes, not a gate.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def children_of() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = collections.defaultdict(list)
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids[ppid].append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def tree(root: int) -> list[int]:
    kids, out, todo = children_of(), [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def sample(pids: list[int], seen: dict) -> None:
    """seen[(pid, tid)] = (name, user s, system s), the latest figures."""
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            name = text[text.index("(") + 1:text.rindex(")")]
            fields = text.rsplit(")", 1)[1].split()
            seen[(pid, int(tid))] = (name, int(fields[11]) / TICK, int(fields[12]) / TICK)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=0.0, help="bytes the command moves, in 10^9, for per-GB figures")
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command")
    proc = subprocess.Popen(cmd)
    seen: dict = {}
    order: list[int] = []  # processes in the order first seen: the command's own first
    while proc.poll() is None:
        pids = tree(proc.pid)
        order.extend(p for p in pids if p not in order)
        sample(pids, seen)
        time.sleep(a.interval)
    groups: dict = collections.defaultdict(lambda: [0, 0.0, 0.0])  # (process #, name) -> threads, user, sys
    for (pid, _), (name, user, system) in seen.items():
        g = groups[(order.index(pid), re.sub(r"\d+$", "", name))]
        g[0] += 1
        g[1] += user
        g[2] += system
    per = f"{'per GB':>8}" if a.gb else ""
    print(f"\n{'process':>7} {'threads':<18} {'n':>3} {'user s':>8} {'sys s':>8} {'total s':>8} {per}")
    total = [0.0, 0.0]
    for (p, name), (n, user, system) in sorted(groups.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
        if user + system < 0.005:
            continue
        total[0] += user
        total[1] += system
        pg = f"{(user + system) / a.gb:8.3f}" if a.gb else ""
        print(f"{p:>7} {name:<18} {n:>3} {user:8.2f} {system:8.2f} {user + system:8.2f} {pg}")
    pg = f"{sum(total) / a.gb:8.3f}" if a.gb else ""
    print(f"{'all':>7} {'':<18} {'':>3} {total[0]:8.2f} {total[1]:8.2f} {sum(total):8.2f} {pg}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
