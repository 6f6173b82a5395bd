#!/usr/bin/env python3
"""Issue 20's goals in one call: tether over tcp beside the loopback TCP ceiling at the same stream count.

    python3 bench/gpu/tcp_goals.py [--rounds 2] [--out DIR] [--env NAME=VALUE ...]

Each round runs, one after another (every figure with its own ceiling, `tether bench --ceiling`):
host memory 256 MiB write/read; GPU memory (GPU0 -> GPU0, two processes) 16 MiB, 64 MiB and 256 MiB
write/read; the 4,096 x 16 KiB scattered GPU write. Prints each goal with the figure, its ratio and
whether it is met; CPU-seconds per GB are both processes together against the ceiling tool's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="tcp_goals-"))
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the bench processes")
    a = ap.parse_args()
    env = dict(os.environ)
    for kv in a.env:
        k, _, v = kv.partition("=")
        env[k] = v
    os.makedirs(a.out, exist_ok=True)
    rows: dict[str, list[str]] = {g[0]: [] for g in GOALS}
    cpu: list[str] = []
    for rnd in range(a.rounds):
        res = []
        res += bench(["--sizes", "256M", "--mode", "write,read", "--ceiling", "--check"], env, f"{a.out}/host{rnd}.json")
        gpu = ["--device", "gpu", "--local-gpu-idx", "0", "--remote-gpu-idx", "0"]
        res += bench([*gpu, "--sizes", "16M,64M,256M", "--mode", "write,read", "--ceiling", "--check"], env,
                     f"{a.out}/gpu{rnd}.json")
        res += bench([*gpu, "--sizes", "16K", "--num-iovs", "4096", "--mode", "write", "--iters", "20", "--check"], env,
                     f"{a.out}/scatter{rnd}.json")

        def find(device, mode, size, iovs):
            for r in res:
                if r["mode"] == mode and r["size"] == size and r["num_iovs"] == iovs and \
                        (r["device"] == "cpu") == (device == "cpu"):
                    return r
            return None

        for what, device, mode, size, iovs, to, goal in GOALS:
            r = find(device, mode, size, iovs)
            if not r:
                rows[what].append("n/a")
                continue
            base = r.get("ceiling_gbps") if to == "ceiling" else (find("gpu", "write", 64 << 20, 1) or {}).get("gbps")
            ratio = r["gbps"] / base if base else float("nan")
            rows[what].append(f"{r['gbps']:.2f} / {base or float('nan'):.2f} = {ratio:.2f} {'met' if ratio >= goal else 'NOT met'}")
        for device, mode in (("cpu", "write"), ("gpu", "write"), ("gpu", "read")):
            r = find(device, mode, 256 << 20, 1)
            if r and r.get("cpu_s_per_gb") and r.get("ceiling_cpu"):
                q = r["cpu_s_per_gb"] / r["ceiling_cpu"]
                cpu.append(f"round {rnd + 1} {device} 256 MiB {mode}: {r['cpu_s_per_gb']:.3f} vs ceiling "
                           f"{r['ceiling_cpu']:.3f} CPU-s/GB = {q:.2f} x ({'met' if q <= 1.2 else 'NOT met'})")
    print(f"issue 20 goals, {a.rounds} rounds (GB/s: tether / what it is compared with = ratio); JSON in {a.out}")
    for what, *_rest in GOALS:
        goal = _rest[-1]
        print(f"  {what:28} goal >= {goal:<4} " + " | ".join(rows[what]))
    for line in cpu:
        print("  CPU " + line + " (goal <= 1.2 x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
