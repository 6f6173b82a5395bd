#!/usr/bin/env python3
"""What the fabric transport does with GPU memory on this machine's libfabric: two endpoints (one
process) over `fabric`, 8 MiB GPU0 -> GPU1 write and read back, every byte checked; prints the
provider, whether it passed, or the error. A probe for the device machine, not a benchmark.

    python3 bench/gpu/fabric_gpu_probe.py
"""
import os
import sys

import torch

import tether


def main() -> int:
    n = 8 << 20
    ngpu = torch.cuda.device_count()
    with tether.Endpoint(transport="fabric") as a, tether.Endpoint(transport="fabric") as b:
        print("fabric:", a.transports().get("fabric") or "usable", "provider", os.environ.get("TETHER_FABRIC_PROVIDER", "auto"))
        peer = a.connect(b.metadata(), timeout=10)
        print("peer transport:", peer.transport)
        for src_dev, dst_dev in (("cpu", "cuda:0"), ("cuda:0", "cpu"), ("cuda:0", f"cuda:{min(1, ngpu - 1)}")):
            src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=src_dev)
            dst = torch.full((n,), 0xA5, dtype=torch.uint8, device=dst_dev)
            rs, rd = a.register(src), b.register(dst)
            try:
                peer.write(rs, rd.descriptor(), length=n).wait(20)
                ok = torch.equal(src.cpu(), dst.cpu())
                print(f"write {src_dev} -> {dst_dev}: {'ok' if ok else 'BYTES WRONG'}")
            except tether.TetherError as e:
                print(f"write {src_dev} -> {dst_dev}: {type(e).__name__}: {e}")
            a.deregister(rs), b.deregister(rd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
