#!/usr/bin/env python3
"""Many NICs on one machine: two network namespaces joined by four veth pairs, each shaped with tc,
one tether endpoint process in each; a large write striped over the four links, every byte checked.

    sudo python3 bench/nics_bench.py                      # both cases, 1 GiB, 3 runs each
    sudo python3 bench/nics_bench.py --size 256M --runs 1 --cases 4x1g
    sudo python3 bench/nics_bench.py --stats              # per-NIC bytes of every run

Cases: 4x1g (four links at 1 Gbit/s), 3x1g+250m (one of them at 250 Mbit/s). Gbit/s counts payload
(1 Gbit = 1e9 bits) over the write's wall time; "of links" divides by the sum of the shaped rates.
Test bed helpers: tests/python/netns.py.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
sys.path.insert(0, os.path.join(ROOT, "python"))

CASES = {
    "4x1g": ["1gbit"] * 4,
    "3x1g+250m": ["1gbit", "1gbit", "1gbit", "250mbit"],
}


def parse_size(t: str) -> int:
    t = t.upper().rstrip("B").rstrip("I")
    m = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if m > 1 else t) * m)


def digest(buf) -> str:
    return hashlib.blake2b(memoryview(buf), digest_size=16).hexdigest()


# ------------------------------------------------------------------ the two endpoint processes

def serve(args) -> None:
    import numpy as np
    import tether

    ep = tether.Endpoint(host="0.0.0.0", nics=args.nics)
    buf = np.full(args.size, 0xA5, dtype=np.uint8)
    region = ep.register(buf)
    print(json.dumps({"metadata": ep.metadata().hex(), "desc": region.descriptor().hex()}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "digest":
            print(json.dumps({"digest": digest(buf)}), flush=True)
        elif cmd[0] == "poison":
            buf.fill(0xA5)
            print(json.dumps({"ok": True}), flush=True)
        elif cmd[0] == "exit":
            break
    ep.close()


def drive(args) -> None:
    import numpy as np
    import tether

    ep = tether.Endpoint(nics=args.nics)
    src = np.random.default_rng(args.seed).integers(0, 256, args.size, dtype=np.uint8)
    region = ep.register(src)
    peer = ep.connect(bytes.fromhex(args.metadata), timeout=10)
    desc = bytes.fromhex(args.desc)
    peer.write(region, desc, length=min(args.size, 64 << 20)).wait(120)  # warm-up: sockets open up
    before = {n["name"]: n["bytes_sent"] for n in ep.stats()["nics"]}
    t0 = time.perf_counter()
    peer.write(region, desc).wait(600)
    elapsed = time.perf_counter() - t0
    after = ep.stats()
    nics = {n["name"]: n["bytes_sent"] - before.get(n["name"], 0) for n in after["nics"]}
    print(json.dumps({"seconds": elapsed, "nics": nics, "digest": digest(src),
                      "lanes": [(l["local_nic"], l["remote_addr"]) for l in after["lanes"]]}), flush=True)
    ep.close()


# ------------------------------------------------------------------ orchestration

def run_case(bed, name: str, rates: list[str], args) -> list[dict]:
    for i, r in enumerate(rates):
        bed.shape(i, r)
    me = [sys.executable, os.path.abspath(__file__)]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    server = subprocess.Popen(bed.cmd("b", *me, "--role", "server", "--size", str(args.size), "--nics", bed.nics("b")),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    rows = []
    try:
        hello = json.loads(server.stdout.readline())
        for run in range(args.runs):
            server.stdin.write("poison\n")
            server.stdin.flush()
            json.loads(server.stdout.readline())
            out = subprocess.run(bed.cmd("a", *me, "--role", "client", "--size", str(args.size), "--nics", bed.nics("a"),
                                         "--metadata", hello["metadata"], "--desc", hello["desc"], "--seed", str(run)),
                                 capture_output=True, text=True, env=env, timeout=900)
            if out.returncode != 0:
                raise RuntimeError(out.stderr[-3000:])
            res = json.loads(out.stdout.strip().splitlines()[-1])
            server.stdin.write("digest\n")
            server.stdin.flush()
            res["check"] = json.loads(server.stdout.readline())["digest"] == res["digest"]
            res["gbit"] = args.size * 8 / res["seconds"] / 1e9
            res["links_gbit"] = sum(_rate(r) for r in rates) / 1e9
            res["case"], res["run"] = name, run
            rows.append(res)
            print(f"  {name} run {run}: {res['gbit']:.2f} Gbit/s ({res['gbit'] / res['links_gbit']:.0%} of links)"
                  f" check={'ok' if res['check'] else 'FAILED'}", flush=True)
    finally:
        server.stdin.write("exit\n")
        server.stdin.flush()
        server.wait(30)
        for i in range(len(rates)):
            bed.unshape(i)
    return rows


def _rate(r: str) -> float:
    r = r.lower().replace("bit", "")
    return float(r[:-1]) * {"g": 1e9, "m": 1e6, "k": 1e3}[r[-1]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["orchestrate", "server", "client"], default="orchestrate")
    ap.add_argument("--size", type=parse_size, default=1 << 30)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--stats", action="store_true", help="per-NIC bytes of every run")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--nics", default="")
    ap.add_argument("--metadata", default="")
    ap.add_argument("--desc", default="")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.role == "server":
        serve(args)
        return 0
    if args.role == "client":
        drive(args)
        return 0

    import netns
    ok, why = netns.available()
    if not ok:
        print(f"cannot build the test bed: {why}")
        return 2
    netns.cleanup_stale()
    rows = []
    with netns.TestBed(links=4) as bed:
        for name in args.cases.split(","):
            rows += run_case(bed, name, CASES[name], args)
    print()
    print(f"| case | size | Gbit/s (runs) | best % of links | check |" + (" per-NIC MiB (best run) |" if args.stats else ""))
    print("|---|---|---|---|---|" + ("---|" if args.stats else ""))
    for name in args.cases.split(","):
        rs = [r for r in rows if r["case"] == name]
        best = max(rs, key=lambda r: r["gbit"])
        runs = ", ".join("%.2f" % r["gbit"] for r in rs)
        line = (f"| {name} | {args.size >> 20} MiB | {runs} | "
                f"{best['gbit'] / best['links_gbit']:.0%} of {best['links_gbit']:.2f} | "
                f"{'ok' if all(r['check'] for r in rs) else 'FAILED'} |")
        if args.stats:
            line += " " + ", ".join(f"{k} {v / (1 << 20):.0f}" for k, v in sorted(best["nics"].items()) if v) + " |"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["check"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
