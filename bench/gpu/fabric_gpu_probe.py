#!/usr/bin/env python3
"""What the fabric transport does with GPU memory on this machine's libfabric: two endpoints (one
process) over `fabric`, 8 MiB writes and reads between host, GPU0 and GPU1, every byte checked;
prints the provider and, per pairing, `ok` or the error. With FI_HMEM the GPU regions are
registered directly; without it (Debian's libfabric, tcp;ofi_rxm) they go through staging and
two-sided messages (docs/FABRIC.md, GPU memory): either way every line should say ok. Exit status
1 if any did not. A probe for the device machine, not a benchmark.

    python3 bench/gpu/fabric_gpu_probe.py
"""
import os
import sys

import torch

import tether


def main() -> int:
    n = 8 << 20
    ngpu = torch.cuda.device_count()
    bad = 0
    with tether.Endpoint(transport="fabric") as a, tether.Endpoint(transport="fabric") as b:
        print("fabric:", a.transports().get("fabric") or "usable", "provider", os.environ.get("TETHER_FABRIC_PROVIDER", "auto"))
        peer = a.connect(b.metadata(), timeout=10)
        print("peer transport:", peer.transport)
        gpu1 = f"cuda:{min(1, ngpu - 1)}"
        for src_dev, dst_dev in (("cpu", "cuda:0"), ("cuda:0", "cpu"), ("cuda:0", gpu1)):
            src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=src_dev)
            dst = torch.full((n,), 0xA5, dtype=torch.uint8, device=dst_dev)
            back = torch.full((n,), 0x5A, dtype=torch.uint8, device=src_dev)
            rs, rd, rb = a.register(src), b.register(dst), a.register(back)
            for op in ("write", "read"):
                try:
                    if op == "write":
                        peer.write(rs, rd.descriptor(), length=n).wait(20)
                        ok = torch.equal(src.cpu(), dst.cpu())
                    else:  # the written bytes back into a third buffer on the source's device
                        peer.read(rb, rd.descriptor(), length=n).wait(20)
                        ok = torch.equal(src.cpu(), back.cpu())
                    print(f"{op} {src_dev} {'->' if op == 'write' else '<-'} {dst_dev}: {'ok' if ok else 'BYTES WRONG'}")
                except tether.TetherError as e:
                    ok = False
                    print(f"{op} {src_dev} {'->' if op == 'write' else '<-'} {dst_dev}: {type(e).__name__}: {e}")
                bad += not ok
            a.deregister(rs), b.deregister(rd), a.deregister(rb)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
