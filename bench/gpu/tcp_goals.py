#!/usr/bin/env python3
"""The tcp goals in one call (docs/PERFORMANCE.md, "GPU memory over TCP (staging)"): tether over tcp beside the loopback TCP ceiling at the same stream count.

    python3 bench/gpu/tcp_goals.py [--rounds 2] [--out DIR] [--env NAME=VALUE ...] [--host-only]

Each round runs, one after another (every figure with its own ceiling, `tether bench --ceiling`):
host memory 256 MiB write/read; GPU memory (GPU0 -> GPU0, two processes) 16 MiB, 64 MiB and 256 MiB
write/read; the 4,096 x 16 KiB scattered GPU write. Prints each goal with the figure, its ratio and
whether it is met; CPU-seconds per GB are both processes together against the ceiling tool's.
A goal is judged by the median of its rounds' ratios (rows of one call swing by 1.5-2 x between rounds:
docs/PERFORMANCE.md, "How we measure"). Beside it, the rate of the median transfer (size / p50 latency)
against the same ceiling: the mean rate includes the multi-millisecond stalls of a thread the scheduler
did not run, which the p50 leaves out; both are printed, the goal is read from the mean.

With --variant NAME=ENV[,ENV...] (repeatable, e.g. `--variant l8= --variant l7=TETHER_CHANNELS=7`) every
round runs each variant in turn (the order rotating by round) and the end compares them: per goal and
variant the median ratio and the median GB/s, since a variant that meets a ratio against a lower ceiling
(fewer lanes, fewer streams) may still move less.

--deadline S starts no round that would end after S seconds at the pace of the slowest round so far, and
SIGTERM (`timeout` running out) stops at once: either way the report covers the whole rounds run (every
variant of a round, or none of them).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep_env import Stopped, should_start  # noqa: E402

GOALS = [  # (what, device, mode, size, iovs, ratio to, goal)
    ("host 256 MiB write", "cpu", "write", 256 << 20, 1, "ceiling", 0.9),
    ("host 256 MiB read", "cpu", "read", 256 << 20, 1, "ceiling", 0.9),
    ("GPU 256 MiB write", "gpu", "write", 256 << 20, 1, "ceiling", 0.85),
    ("GPU 256 MiB read", "gpu", "read", 256 << 20, 1, "ceiling", 0.85),
    ("GPU 16 MiB write", "gpu", "write", 16 << 20, 1, "ceiling", 0.6),
    ("GPU 16 MiB read", "gpu", "read", 16 << 20, 1, "ceiling", 0.6),
    ("GPU 4,096 x 16 KiB write", "gpu", "write", 16 << 10, 4096, "GPU 64 MiB write", 0.7),
]


def bench(args: list[str], env: dict, path: str) -> list[dict]:
    cmd = [sys.executable, "-m", "tether", "bench", "--transport", "tcp", "--quiet", "--json", path, *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    if p.returncode != 0:
        print(f"failed: {' '.join(cmd)}\n{p.stdout[-2000:]}{p.stderr[-2000:]}", file=sys.stderr)
        return []
    d = json.load(open(path))
    both = {c["streams"]: c["cpu_s_per_gb"]["both"] for c in d.get("ceilings", [])}
    for r in d["results"]:
        r["ceiling_cpu"] = next(iter(both.values()), None)
    return d["results"]


def p50_ratio(r: dict, base: float | None) -> float:
    """The median transfer's rate (bytes per op / p50 latency) against `base` GB/s; nan where unknown."""
    p50 = r.get("lat_p50_us")
    if not base or not p50 or math.isnan(base):
        return float("nan")
    return r["size"] * r["num_iovs"] / (p50 * 1e-6) / 1e9 / base


def verdict(pairs: list[tuple[float, float]], goal: float) -> str:
    """One goal over all rounds: the median ratio of the mean rates, met or not, and the p50 rates' median."""
    means = [m for m, _ in pairs if not math.isnan(m)]
    p50s = [p for _, p in pairs if not math.isnan(p)]
    if not means:
        return "n/a"
    med = statistics.median(means)
    p50 = f" (p50 {statistics.median(p50s):.2f})" if p50s else ""
    return f"{med:.2f}{p50} over {len(means)} round(s): {'met' if med >= goal else 'NOT met'} (goal >= {goal})"


def parse_variant(text: str) -> tuple[str, dict]:
    """`NAME=K=V,K=V` (or `NAME=` for the environment as it is) -> (NAME, {K: V})."""
    name, _, rest = text.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: NAME=ENV[,ENV...], e.g. l7=TETHER_CHANNELS=7")
    env = {}
    for kv in filter(None, rest.split(",")):
        k, eq, v = kv.partition("=")
        if not eq or not k:
            raise argparse.ArgumentTypeError(f"--variant {text!r}: {kv!r} is not NAME=VALUE")
        env[k] = v
    return name, env


def run_round(env: dict, prefix: str, host_only: bool) -> list[dict]:
    res = bench(["--sizes", "256M", "--mode", "write,read", "--ceiling", "--check"], env, f"{prefix}host.json")
    gpu = ["--device", "gpu", "--local-gpu-idx", "0", "--remote-gpu-idx", "0"]
    if not host_only:
        res += bench([*gpu, "--sizes", "16M,64M,256M", "--mode", "write,read", "--ceiling", "--check"], env,
                     f"{prefix}gpu.json")
        res += bench([*gpu, "--sizes", "16K", "--num-iovs", "4096", "--mode", "write", "--iters", "20", "--check"],
                     env, f"{prefix}scatter.json")
    return res


def judge(res: list[dict]) -> dict:
    """Per goal of one round: {what: (GB/s, what it is compared with, ratio, p50 ratio, steal %)}; a goal
    whose row is missing is left out. And per CPU row ("cpu 256 MiB write", ...): (CPU-s/GB, the ceiling's)."""
    def find(device, mode, size, iovs):
        for r in res:
            if r["mode"] == mode and r["size"] == size and r["num_iovs"] == iovs and \
                    (r["device"] == "cpu") == (device == "cpu"):
                return r
        return None

    out = {}
    for what, device, mode, size, iovs, to, _goal in GOALS:
        r = find(device, mode, size, iovs)
        if not r:
            continue
        other = None if to == "ceiling" else find("gpu", "write", 64 << 20, 1) or {}
        base = r.get("ceiling_gbps") if other is None else other.get("gbps")
        ratio = r["gbps"] / base if base else float("nan")
        # Against the ceiling, or the other row's median transfer where the goal compares two rows.
        p50_base = base if other is None else p50_ratio(other, 1.0)
        out[what] = (r["gbps"], base or float("nan"), ratio, p50_ratio(r, p50_base), r.get("steal_pct", 0.0))
    for device, mode in (("cpu", "write"), ("gpu", "write"), ("gpu", "read")):
        r = find(device, mode, 256 << 20, 1)
        if r and r.get("cpu_s_per_gb") and r.get("ceiling_cpu"):
            out[f"{device} 256 MiB {mode}"] = (r["cpu_s_per_gb"], r["ceiling_cpu"])
    return out


def report(rounds: list[dict], steal_flag: float) -> None:
    """One variant's goals: each round, then the median verdicts, then the CPU rows."""
    print(f"tcp goals, {len(rounds)} rounds (GB/s: tether / what it is compared with = ratio)")
    for what, *rest in GOALS:
        goal = rest[-1]
        cells = []
        for j in rounds:
            if what not in j:
                cells.append("n/a")
                continue
            gbps, base, ratio, _p50, steal = j[what]
            cells.append(f"{gbps:.2f} / {base:.2f} = {ratio:.2f} {'met' if ratio >= goal else 'NOT met'}"
                         + (f" (steal {steal:.1f} %)" if steal >= steal_flag else ""))
        print(f"  {what:28} goal >= {goal:<4} " + " | ".join(cells))
    print("by the median of the rounds (the p50 transfer's rate against the same ceiling in brackets):")
    for what, *rest in GOALS:
        print(f"  {what:28} {verdict([j[what][2:4] for j in rounds if what in j], rest[-1])}")
    for n, j in enumerate(rounds):
        for row in ("cpu 256 MiB write", "gpu 256 MiB write", "gpu 256 MiB read"):
            if row in j:
                used, ceiling = j[row]
                q = used / ceiling
                print(f"  CPU round {n + 1} {row}: {used:.3f} vs ceiling {ceiling:.3f} CPU-s/GB = {q:.2f} x "
                      f"({'met' if q <= 1.2 else 'NOT met'}) (goal <= 1.2 x)")


def compare(by_variant: dict[str, list[dict]]) -> None:
    """The variants side by side: per goal, each one's median ratio and median GB/s over its rounds."""
    print("variants side by side (median ratio, median GB/s over the rounds; * = goal met):")
    for what, *rest in GOALS:
        cells = []
        for name, rounds in by_variant.items():
            got = [j[what] for j in rounds if what in j]
            if not got:
                cells.append(f"{name} n/a")
                continue
            ratio = statistics.median(g[2] for g in got)
            cells.append(f"{name} {ratio:.2f}{'*' if ratio >= rest[-1] else ' '} {statistics.median(g[0] for g in got):6.2f}")
        print(f"  {what:28} " + " | ".join(cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="tcp_goals-"))
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the bench processes")
    ap.add_argument("--variant", action="append", type=parse_variant, default=[],
                    help="NAME=ENV[,ENV...]: compare variants round by round (repeat; NAME= is the environment as is)")
    ap.add_argument("--host-only", action="store_true", help="only the host-memory goals (a machine without a GPU)")
    ap.add_argument("--deadline", type=float, default=0,
                    help="seconds: start no round that would end after this, at the slowest round's pace so far")
    a = ap.parse_args()
    from tether.cli import STEAL_FLAG_PCT  # the mark `tether bench` names rows by
    env = dict(os.environ)
    for kv in a.env:
        k, _, v = kv.partition("=")
        env[k] = v
    os.makedirs(a.out, exist_ok=True)
    variants = a.variant or [("", {})]
    by_variant: dict[str, list[dict]] = {name: [] for name, _ in variants}

    def stop(signum, frame):
        raise Stopped()

    signal.signal(signal.SIGTERM, stop)
    start, durations = time.monotonic(), []  # seconds each whole round took
    try:
        for rnd in range(a.rounds):
            if not should_start(time.monotonic() - start, durations, a.deadline):
                print(f"deadline: {rnd} round(s) run", flush=True)
                break
            t0, got = time.monotonic(), {}
            for k in range(len(variants)):
                name, extra = variants[(rnd + k) % len(variants)]  # rotate: no variant always runs first
                prefix = os.path.join(a.out, f"{name + '-' if name else ''}r{rnd}-")
                got[name] = judge(run_round({**env, **extra}, prefix, a.host_only))
            for name, j in got.items():  # a round counts once every variant has run it
                by_variant[name].append(j)
            durations.append(time.monotonic() - t0)
            print(f"round {rnd + 1} done in {durations[-1]:.0f} s", flush=True)
    except Stopped:
        print(f"stopped (SIGTERM) during round {len(durations) + 1}: the report covers the {len(durations)} whole "
              "round(s)", flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for name, rounds in by_variant.items():
        if name:
            print(f"== {name}: {', '.join(f'{k}={v}' for k, v in dict(variants)[name].items()) or 'the environment as is'}")
        report(rounds, STEAL_FLAG_PCT)
    print(f"JSON in {a.out}")
    if a.variant:
        compare(by_variant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
