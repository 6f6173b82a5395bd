#!/usr/bin/env python3
"""Is the unpack fast enough to stay off the netplugin's critical path? The unpack kernel on 4 MiB chunks of scattered 4 KiB fragments must
reach >= 70% of the device-to-device copy bandwidth measured in the same run.

Rows: `kernel` (what the netplugin unpacker runs), `kernel-wide` (64-bit triples), `kernel-table` (the
kernel reads the triples from mapped pinned memory, nothing copied on the host: the ipc batches' form), `d2d`, `contiguous`.
Runs tether's own kernel (the fatbin embedded in the module, launched by src/gpu/copy_kernel.cc
exactly as the netplugin unpacker does: one launch per chunk, its descriptors carried in the
launch parameters) against one
cuMemcpyAsync per fragment (d2d) and one contiguous cuMemcpyAsync of the same bytes. CUDA events time
each method back to back ("stream") and one operation at a time ("alone"); every destination byte is
checked once per method (the check always runs; --check is accepted for symmetry with other benches).

    python3 bench/gpu/unpack_bench.py [--device 0] [--chunk-mib 4] [--frag-kib 4] [--iters 2000] [--json F]
"""
import argparse
import json
import sys

import tether
from tether import _gpubench


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--chunk-mib", type=float, default=4)
    ap.add_argument("--frag-kib", type=float, default=4)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--check", action="store_true", help="(always on) every byte checked")
    ap.add_argument("--json", help="write the rows and ratios here")
    a = ap.parse_args()
    cuda, why, ngpu, kernels, kwhy = tether._tether.gpu_status()
    if not cuda or not kernels:
        print(f"unpack_bench needs CUDA and the built kernels: cuda={cuda} ({why}) kernels={kernels} ({kwhy})")
        return 2
    chunk, frag = int(a.chunk_mib * (1 << 20)), int(a.frag_kib * 1024)
    rows = _gpubench.unpack_bench(a.device, chunk, frag, a.iters, a.seed)
    by = {r["method"]: r for r in rows}
    print(f"GPU {a.device}: {chunk >> 10} KiB chunks of {chunk // frag} shuffled {frag} B fragments, {a.iters} iterations")
    print(f"{'method':<12}{'stream GB/s':>14}{'alone GB/s':>14}{'host us/op':>12}{'bad bytes':>12}")
    for r in rows:
        print(f"{r['method']:<12}{r['stream_gbps']:>14.1f}{r['alone_gbps']:>14.1f}{r['host_us']:>12.2f}{r['mismatches']:>12}")
    ratios = {}
    for kind in ("stream", "alone"):
        base = by["contiguous"][f"{kind}_gbps"]
        ratios[f"kernel/contiguous ({kind})"] = by["kernel"][f"{kind}_gbps"] / base
        ratios[f"kernel-wide/contiguous ({kind})"] = by["kernel-wide"][f"{kind}_gbps"] / base
        ratios[f"kernel-table/contiguous ({kind})"] = by["kernel-table"][f"{kind}_gbps"] / base
        ratios[f"d2d/contiguous ({kind})"] = by["d2d"][f"{kind}_gbps"] / base
    for k, v in ratios.items():
        print(f"{k:<28}{v:>8.2f}")
    for kind in ("alone", "stream"):
        v = ratios[f"kernel/contiguous ({kind})"]
        print(f"unpack target, kernel >= 0.70 x contiguous d2d ({kind}): {'MET' if v >= 0.70 else 'NOT MET'} ({v:.2f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "ratios": ratios, "chunk": chunk, "frag": frag, "iters": a.iters}, f, indent=1)
    bad = sum(r["mismatches"] for r in rows)
    if bad:
        print(f"FAILED: {bad} destination bytes wrong")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
