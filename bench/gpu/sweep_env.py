#!/usr/bin/env python3
"""Several environments of one build, side by side in one device call: the same command run under
each, rounds interleaved (the order rotates each round, since whichever runs later in a round has been
a few % faster on the GPU host), then per table row each environment's median GB/s, its ratio to the
first environment's, the rounds it won against it, and both processes' CPU-seconds per GB.

    python3 bench/gpu/sweep_env.py --rounds 3 --env kernel= --env d2d=TETHER_UNPACK=d2d \\
        -- 'tether bench --transport tcp --device gpu --local-gpu-idx 0 --remote-gpu-idx 0 --sizes 16M --mode read'

--env NAME=ASSIGNMENTS (space-separated NAME=VALUE; empty for the defaults). Logs in --out.
--ceiling STREAMS opens each round with a 1 s loopback ceiling (tcp_ceiling -n STREAMS): the GPU host has
slow phases in which every build runs at a third to a half of its rate, and a round in one says little.
Each run's line gives the share of the machine's CPU time the hypervisor took meanwhile (steal: the GPU
host is a VM, and its half-rate rows came with it, docs/PERFORMANCE.md, "How we measure"); --skip-steal PCT leaves out
of the table every round in which some run's share exceeded PCT.
--deadline S starts no round that would end after S seconds at the pace of the slowest round so far, and
SIGTERM (`timeout` running out) stops at once: either way the table covers the whole rounds run (a
device call that ran out of time used to lose it).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_table import row_name, table_rows  # noqa: E402

LATENCY_ROW_GBPS = 2.0  # rows slower than this are about latency: their p50 is printed too


def number(cell: str | None) -> float | None:
    """A table cell as a number ("1,079" -> 1079.0), None where it is not one."""
    try:
        return float((cell or "").replace(",", ""))
    except ValueError:
        return None


def ceiling_gbps(streams: int) -> float:
    """GB/s of a 1 s loopback TCP ceiling run (bench/tools/tcp_ceiling.c) at `streams` streams; nan if it fails."""
    from tether.bench import BenchError, ceiling_tool  # here: the tables alone need no tether
    try:
        out = subprocess.run([ceiling_tool(), "-n", str(streams), "-t", "1", "--json"], capture_output=True,
                             text=True, timeout=60).stdout
        return float(json.loads(out)["gbps"])
    except (BenchError, OSError, ValueError, KeyError, subprocess.TimeoutExpired):
        return float("nan")


class Stopped(Exception):
    """SIGTERM: stop the sweep and print the table of the rounds that finished."""


def run_group(command: str, env: dict, out, timeout: float) -> int:
    """Runs `command` under bash in a process group of its own and returns its exit status (124 when it
    outlived `timeout`: the group is killed and the sweep goes on). The group is killed too if the sweep is
    stopped: its benches' processes, not only the shell."""
    p = subprocess.Popen(["bash", "-c", command], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return p.wait(timeout=timeout)
    except BaseException as e:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        if isinstance(e, subprocess.TimeoutExpired):
            return 124
        raise


def should_start(elapsed: float, durations: list[float], deadline: float) -> bool:
    """Whether another round fits: it would end by `deadline` seconds at the pace of the slowest one so far
    (always the first round; always with no deadline)."""
    return not deadline or not durations or elapsed + max(durations) <= deadline


def rounds_to_keep(steal_by_round: list[float], pct: float | None) -> list[int]:
    """Indexes of the rounds whose runs all stayed at or under `pct` % steal (all of them when pct is None)."""
    return [r for r, s in enumerate(steal_by_round) if pct is None or s <= pct]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--env", action="append", required=True, help="NAME=ASSIGNMENTS (the first is the baseline)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out") + "/sweep")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--deadline", type=float, default=0,
                    help="seconds: start no round that would end after this, at the slowest round's pace so far "
                         "(the table covers the rounds run)")
    ap.add_argument("--ceiling", type=int, default=0, metavar="STREAMS",
                    help="run the loopback TCP ceiling with this many streams before each round (0: no)")
    ap.add_argument("--skip-steal", type=float, default=None, metavar="PCT",
                    help="leave out rounds in which a run lost more than PCT %% of the CPUs' time to the hypervisor")
    ap.add_argument("command", help="the shell command each environment runs (its bench tables are read)")
    a = ap.parse_args()
    configs = []
    for spec in a.env:
        name, _, assigns = spec.partition("=")
        env = dict(os.environ)
        for kv in assigns.split():
            k, _, v = kv.partition("=")
            env[k] = v
        configs.append((name, env))
    os.makedirs(a.out, exist_ok=True)
    runs = {name: [] for name, _ in configs}  # name -> per round: [(key, gbps, cpu)]
    p50s = {name: [] for name, _ in configs}  # name -> per round: {key: p50 us}
    ceilings = []  # GB/s before each round (--ceiling)
    steal = []  # per round: the largest share of CPU time stolen during one of its runs, %

    def stop(signum, frame):
        raise Stopped()

    signal.signal(signal.SIGTERM, stop)
    start = time.monotonic()
    durations = []  # seconds each whole round took
    try:
        sweep(a, configs, runs, p50s, ceilings, steal, start, durations)
    except Stopped:
        whole = len(durations)
        print(f"stopped (SIGTERM) during round {whole + 1}: the table covers the {whole} whole round(s)", flush=True)
        for per in (runs, p50s):
            for name in per:
                del per[name][whole:]
        del steal[whole:]
        del ceilings[whole:]
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    print_table(a, configs, runs, p50s, ceilings, steal)
    return 0


def sweep(a, configs, runs, p50s, ceilings, steal, start: float, durations: list[float]) -> None:
    """Runs the rounds, appending to runs, p50s, ceilings, steal and (per whole round) durations."""
    from tether.bench import cpu_ticks, steal_share  # here, as in ceiling_gbps: the tables alone need no tether
    for r in range(a.rounds):
        if not should_start(time.monotonic() - start, durations, a.deadline):
            print(f"deadline: {r} rounds run", flush=True)
            break
        round_start = time.monotonic()
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        if a.ceiling:
            ceilings.append(ceiling_gbps(a.ceiling))
            print(f"== round {r + 1}: loopback ceiling at {a.ceiling} streams {ceilings[-1]:.2f} GB/s", flush=True)
        steal.append(0.0)
        for name, env in order:
            log = f"{a.out}/{name}_{r + 1}.log"
            ticks0 = cpu_ticks()
            with open(log, "w") as f:
                rc = run_group(a.command, env, f, a.timeout)
            share = steal_share(ticks0)
            steal[-1] = max(steal[-1], share)
            parsed = list(table_rows(log))
            rows = [(k, g, c) for k, _, g, c in parsed]
            runs[name].append(rows)
            p50s[name].append({k: p50 for k, row, _, _ in parsed if (p50 := number(row.get("p50 µs"))) is not None})
            print(f"== {name} round {r + 1} rc={rc} steal {share:.1f} %: "
                  + ", ".join(f"{row_name(k)} {g:.2f}" for k, g, _ in rows), flush=True)
        durations.append(time.monotonic() - round_start)


def print_table(a, configs, runs, p50s, ceilings, steal) -> None:
    """Each row's median per environment, its ratio to the first and the rounds won (the rounds in runs)."""
    if ceilings:
        lo, hi = min(ceilings), max(ceilings)
        print(f"\nloopback ceiling per round: {', '.join(f'{c:.2f}' for c in ceilings)} GB/s"
              + (" (varied by more than 20 %: a slow phase; read the rounds apart)" if lo < 0.8 * hi else ""))
    keep = rounds_to_keep(steal, a.skip_steal)
    if len(keep) < len(steal):
        print(f"\nleft out (a run lost more than {a.skip_steal} % of the CPUs' time to the hypervisor): round(s) "
              + ", ".join(str(r + 1) for r in range(len(steal)) if r not in keep))
        runs = {name: [rnd for r, rnd in enumerate(per) if r in keep] for name, per in runs.items()}
        p50s = {name: [rnd for r, rnd in enumerate(per) if r in keep] for name, per in p50s.items()}
    base = configs[0][0]
    keys = [k for k, _, _ in runs[base][0]] if runs[base] and runs[base][0] else []
    print(f"\nmedian GB/s over {len(runs[base])} rounds (ratio to '{base}', rounds won against it; CPU-s/GB both sides;"
          f" p50 latency where a row moves under {LATENCY_ROW_GBPS} GB/s)")
    for key in keys:
        label = row_name(key)
        cells = []
        base_by_round = [next((g for k, g, _ in rnd if k == key), None) for rnd in runs[base]]
        base_med = statistics.median([g for g in base_by_round if g is not None] or [float("nan")])
        for name, _ in configs:
            per = [next(((g, c) for k, g, c in rnd if k == key), (None, None)) for rnd in runs[name]]
            g = [x for x, _ in per if x is not None]
            c = [y for _, y in per if y is not None]
            if not g:
                cells.append(f"{name} n/a")
                continue
            med = statistics.median(g)
            won = sum(1 for (x, _), b in zip(per, base_by_round) if x is not None and b is not None and x > b)
            cell = f"{name} {med:.2f}"
            if name != base and base_med > 0:
                cell += f" ({med / base_med:.2f}x, {won}/{len(g)})"
            if c:
                cell += f" cpu {statistics.median(c):.3f}"
            lat = [rnd[key] for rnd in p50s[name] if key in rnd]
            if base_med < LATENCY_ROW_GBPS and lat:
                cell += f" p50 {statistics.median(lat):.1f} us"
            cells.append(cell)
        print(f"  {label:36} " + " | ".join(cells))


if __name__ == "__main__":
    sys.exit(main())
