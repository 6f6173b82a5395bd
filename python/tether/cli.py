"""Command line: `tether bench` and `tether doctor`."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from typing import Optional

import tether

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M"


def _csv(kind):
    def parse(text: str):
        return [kind(x) for x in text.split(",") if x.strip()]
    return parse


def build_parser() -> argparse.ArgumentParser:
    from tether.bench import parse_size

    p = argparse.ArgumentParser(prog="tether", description="tether: point-to-point transfer engine")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="measure transfers between two local processes")
    b.add_argument("--transport", default="auto", choices=["auto", "tcp", "ipc", "fabric", "netplugin"])
    b.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    b.add_argument("--local-gpu-idx", type=int, default=0)
    b.add_argument("--remote-gpu-idx", type=int, default=0)
    b.add_argument("--sizes", type=_csv(parse_size), default=None, help=f"comma list, K/M/G suffixes (default {DEFAULT_SIZES})")
    b.add_argument("--num-iovs", type=_csv(int), default=[1], help="blocks per vectored op (comma list)")
    b.add_argument("--iters", type=int, default=None, help="measured ops per case (default: by size)")
    b.add_argument("--warmup", type=int, default=None, help="unmeasured ops first (default: 10%% of iters, at least 1)")
    b.add_argument("--mode", type=_csv(str), default=["write"], help="write,read,send (comma list)")
    b.add_argument("--async-api", action="store_true", help="keep --depth ops in flight instead of one at a time")
    b.add_argument("--depth", type=int, default=8, help="ops in flight with --async-api")
    b.add_argument("--check", action="store_true", help="random source, poisoned destination, every byte verified")
    b.add_argument("--json", metavar="PATH")
    b.add_argument("--plot", metavar="PATH", help="PNG: GB/s against size, a line per configuration")
    b.add_argument("--channels", type=_csv(int), default=None)
    b.add_argument("--sockets-per-channel", type=_csv(int), default=None)
    b.add_argument("--chunk-bytes", type=_csv(parse_size), default=None)
    b.add_argument("--window", type=_csv(int), default=None)
    b.add_argument("--unpack", choices=["kernel", "d2d", "host"], default=None)
    b.add_argument("--nics", default=None, help="data NICs in order, e.g. eth1,eth2 (sets TETHER_NICS)")
    b.add_argument("--stats", action="store_true", help="per-NIC and per-channel counters of the driving endpoint")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--role", choices=["local", "server", "client"], default=None,
                   help="local: two processes here (default); server/client: one side each on two hosts. "
                        "Under torchrun (2 ranks) rank 0 is the client, rank 1 the server.")
    b.add_argument("--listen", default=None, metavar="HOST:PORT", help="server: where to listen (default 0.0.0.0:0)")
    b.add_argument("--peer", default=None, metavar="HOST:PORT", help="client: the server's address")
    b.add_argument("--full-mesh", action="store_true",
                   help="many flows at once; per-flow and aggregate rows. Host memory: --gpus pairs. "
                        "--device gpu: every ordered GPU pair i>j of --gpus GPUs")
    b.add_argument("--gpus", type=int, default=2, help="full mesh: pairs (host memory) or GPUs (--device gpu)")
    b.add_argument("--single-process", action="store_true",
                   help="full mesh: one process (one endpoint) per side for all flows, not one per pair/GPU")
    b.add_argument("--nccl", nargs="?", const="default,socket", default=None, metavar="default,socket",
                   help="GPU full mesh: also run NCCL all-pairs send/recv on the same GPUs and sizes "
                        "(default transport, socket transport forced, or both)")

    d = sub.add_parser("doctor", help="what this machine offers and what tether will use")
    d.add_argument("--json", action="store_true")

    n = sub.add_parser("nixl", help="tether as a NIXL backend: put the plugin where NIXL finds it, or show its state")
    n.add_argument("action", choices=["install", "status"],
                   help="install: copy libplugin_TETHER.so into the installed NIXL's plugin folder; "
                        "status: NIXL's version and whether it sees TETHER")
    n.add_argument("--plugin-dir", default=None, help="install: this folder instead of the NIXL wheel's")
    n.add_argument("--json", action="store_true", help="status as JSON")
    return p


def _torchrun_role() -> Optional[tuple[int, int]]:
    """(rank, world size) when started by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def _torch_store():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.distributed_c10d._get_default_store()


def _run_server(args, options: dict) -> int:
    from rich.console import Console

    from tether import bench as B
    import tether

    console = Console(stderr=True)
    host, port = "0.0.0.0", 0
    if args.listen:
        host, _, p = args.listen.rpartition(":")
        port = int(p)
    ep = tether.Endpoint(host=host, port=port, **options)
    torchrun = _torchrun_role()
    if torchrun:
        _torch_store().set("tether/bench/metadata", ep.metadata())
    console.print(f"tether bench server listening on {ep.address} (Ctrl-C to stop)")
    try:
        while not B.serve(ep, B.NotifyChannel(ep)):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        ep.close()
    return 0


def _torch_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def stats_tables(console, stats: dict, combo: dict) -> None:
    """Per-NIC and per-channel (lane) counters: bytes, chunks, lanes lost, chunks resent elsewhere."""
    from rich.table import Table

    cols = ("MiB sent", "MiB received", "chunks sent", "chunks received", "errors", "resends")

    def nums(x):
        return [f"{x['bytes_sent'] / 2**20:.1f}", f"{x['bytes_received'] / 2**20:.1f}", str(x["chunks_sent"]),
                str(x["chunks_received"]), str(x["errors"]), str(x["resends"])]

    t = Table(title=f"per NIC {combo or ''}")
    for c in ("NIC",) + cols:
        t.add_column(c, justify="right")
    for n in stats["nics"]:
        t.add_row(n["name"], *nums(n))
    console.print(t)
    t = Table(title="per channel (lane)")
    for c in ("peer", "lane", "local NIC", "local", "remote", "alive") + cols:
        t.add_column(c, justify="right")
    for l in stats["lanes"]:
        t.add_row(l["peer"], str(l["lane"]), l["local_nic"] or "-", l["local_addr"], l["remote_addr"],
                  "yes" if l["alive"] else "[red]no[/red]", *nums(l))
    console.print(t)


def bench(args) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from tether import bench as B

    console = Console(stderr=True)
    role = args.role
    torchrun = _torchrun_role()
    if role is None:
        role = ("client" if torchrun[0] == 0 else "server") if torchrun else "local"
    if torchrun and torchrun[1] != 2:
        console.print("[red]under torchrun, tether bench takes exactly 2 ranks (--nnodes=2 --nproc_per_node=1)[/red]")
        return 2
    if role == "client" and not (args.peer or torchrun):
        console.print("[red]--role client needs --peer HOST:PORT (or torchrun)[/red]")
        return 2
    device = args.device
    cuda, why, ngpu = tether._tether.gpu_status()[:3]
    if device == "auto":
        device = "cpu"  # GPU memory on request (--device gpu): same-host ipc moves host memory only so far
    if device == "gpu":
        if not cuda or not _torch_cuda():
            console.print(f"[red]--device gpu needs CUDA and torch with a GPU here ({why or 'torch has no CUDA'})[/red]")
            return 2
        for idx in (args.local_gpu_idx, args.remote_gpu_idx):
            if not 0 <= idx < ngpu:
                console.print(f"[red]GPU {idx} does not exist ({ngpu} visible)[/red]")
                return 2
    transport_opts = {} if args.transport == "auto" else {"transport": args.transport}
    if args.transport != "auto":
        with tether.Endpoint(port=0) as probe:
            why = probe.transports().get(args.transport, "not built into this tether")
        if why:
            console.print(f"[red]--transport {args.transport}: not available here ({why})[/red]")
            return 2
    if args.nics:
        os.environ["TETHER_NICS"] = args.nics  # both endpoints (a local server inherits it)
    gpu_kw = dict(device=args.local_gpu_idx, remote_device=args.remote_gpu_idx) if device == "gpu" else {}
    modes = args.mode
    for m in modes:
        if m not in ("write", "read", "send"):
            console.print(f"[red]unknown mode {m!r}[/red]")
            return 2
    sizes = args.sizes or _csv(B.parse_size)(DEFAULT_SIZES)
    if role == "server":
        single = {k: v[0] for k, v in (("channels", args.channels), ("sockets_per_channel", args.sockets_per_channel),
                                         ("chunk_bytes", args.chunk_bytes), ("window", args.window)) if v}
        return _run_server(args, dict(single, **transport_opts))
    if role == "client" and torchrun:
        target = _torch_store().get("tether/bench/metadata")
    else:
        target = args.peer
    knobs = {
        "channels": args.channels, "sockets_per_channel": args.sockets_per_channel,
        "chunk_bytes": args.chunk_bytes, "window": args.window,
    }
    names = [k for k, v in knobs.items() if v]
    combos = [dict(zip(names, values)) for values in itertools.product(*(knobs[k] for k in names))] or [{}]
    capacity = max(sizes) * max(args.num_iovs)

    results: list = []
    cases_per_combo = [
        B.Case(mode=m, size=s, num_iovs=n, iters=args.iters or B.auto_iters(s, n),
               warmup=args.warmup if args.warmup is not None else max(1, (args.iters or B.auto_iters(s, n)) // 10),
               async_depth=args.depth if args.async_api else 0, check=args.check)
        for m in modes for n in args.num_iovs for s in sizes if not (m == "send" and n != 1)
    ]
    if args.full_mesh and (role != "local" or args.gpus < 1):
        console.print("[red]--full-mesh runs locally (two hosts: start one bench pair per device) with --gpus >= 1[/red]")
        return 2
    if args.nccl and not (args.full_mesh and device == "gpu"):
        console.print("[red]--nccl goes with --full-mesh --device gpu[/red]")
        return 2
    nccl_variants = [v for v in (args.nccl or "").split(",") if v]
    if any(v not in ("default", "socket") for v in nccl_variants):
        console.print(f"[red]--nccl takes default, socket or both, not {args.nccl!r}[/red]")
        return 2
    if args.full_mesh and device == "gpu":
        if not 2 <= args.gpus <= ngpu:
            console.print(f"[red]a GPU full mesh takes 2 <= --gpus <= {ngpu} (the GPUs visible here)[/red]")
            return 2
        if "send" in modes:
            console.print("[red]a GPU full mesh runs write and read (send needs a receiver per flow)[/red]")
            return 2
    from tether import mesh
    n_flows = len(mesh.flows(args.gpus, device == "gpu"))
    total_ops = len(combos) * sum(c.iters * (2 if c.check else 1) for c in cases_per_combo)
    if args.full_mesh:
        total_ops = len(combos) * len(cases_per_combo) * n_flows
    t_start = time.perf_counter()
    with Progress(console=console, transient=True, disable=args.quiet) as progress:
        task = progress.add_task("bench", total=total_ops)
        for i, combo in enumerate(combos):
            if args.unpack:
                combo = dict(combo, unpack=args.unpack)
            opts = dict(combo, **transport_opts)
            if args.full_mesh:
                progress.update(task, description=f"full mesh, {n_flows} flows {combo or ''}")
                try:
                    results.extend(mesh.run(args.gpus, opts, capacity, cases_per_combo, args.single_process,
                                            gpu=device == "gpu", progress=lambda: progress.advance(task)))
                except Exception as e:  # a worker's traceback in full, then its cause on one line
                    text = str(e).strip() or type(e).__name__
                    print(text, file=sys.stderr)
                    console.print(f"[red]full mesh failed: {text.splitlines()[-1]}[/red]")
                    return 1
                continue
            pair = (B.LocalPair(opts, capacity, **gpu_kw) if role == "local"
                    else B.RemotePair(opts, capacity, target, **gpu_kw))
            last = i == len(combos) - 1
            try:
                for case in cases_per_combo:
                    progress.update(task, description=f"{case.mode} {B.human(case.size)} x{case.num_iovs} {combo or ''}")
                    r = B.run_case(pair, case, transport=pair.peer.transport, progress=lambda: progress.advance(task))
                    r.config = dict(combo, connect_ms=round(pair.connect_ms, 2))
                    results.append(r)
                if args.stats:
                    stats_tables(console, pair.ep.stats(), combo)
            finally:
                pair.close(shutdown=last and bool(torchrun))

    nccl_failed = False
    for variant in nccl_variants:
        rows, why = _nccl_rows(args.gpus, sizes, args.iters, variant == "socket")
        if why:
            console.print(f"[red]NCCL all-pairs ({variant}) failed: {why}[/red]")
            nccl_failed = True
        results.extend(rows)

    table = Table(title=f"tether bench ({time.perf_counter() - t_start:.1f} s)")
    for col in ("mode", "transport", "device", "size", "num_iovs", "GB/s", "p50 µs", "p99 µs", "CPU% client", "CPU% server", "check"):
        table.add_column(col, justify="right")
    if args.full_mesh:
        table.add_column("pair")
    if len(combos) > 1:
        table.add_column("config")
    for r in results:
        row = [r.mode, r.transport, r.device, B.human(r.size), str(r.num_iovs), f"{r.gbps:.2f}",
               f"{r.lat_p50_us:.1f}", f"{r.lat_p99_us:.1f}",
               "-" if r.cpu_client != r.cpu_client else f"{r.cpu_client:.0f}",
               "-" if r.cpu_server != r.cpu_server else f"{r.cpu_server:.0f}",
               {None: "-", True: "ok", False: "[red]FAILED[/red]"}[r.check]]
        if args.full_mesh:
            row.append(str(r.config.get("pair")))
        if len(combos) > 1:
            row.append(" ".join(f"{k}={v}" for k, v in r.config.items()
                                if k not in ("connect_ms", "pair", "mesh_s", "shape", "transport", "unpack")))
        table.add_row(*row)
    Console(width=None if sys.stdout.isatty() else 160).print(table)

    if args.json:
        doc = {
            "version": 1, "machine": B.machine_info(),
            "config": {"transport": ",".join(sorted({r.transport for r in results})) or args.transport, "device": device, "async_api": args.async_api, "combos": combos},
            "results": [dict(B.result_dict(r), config=r.config) for r in results],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    if args.plot:
        _plot(results, args.plot)
    failed = [r for r in results if r.check is False]
    if failed:
        console.print(f"[red]--check found corrupted bytes in {len(failed)} case(s)[/red]")
        return 1
    return 1 if nccl_failed else 0


def _nccl_rows(n: int, sizes: list, iters: Optional[int], socket: bool) -> tuple[list, Optional[str]]:
    """NCCL all-pairs rows from `python -m tether.nccl_mesh` in its own process (NCCL's environment
    and state stay out of this one). Returns (rows, None) or ([], why)."""
    import subprocess
    import tempfile

    from tether import bench as B

    with tempfile.TemporaryDirectory(prefix="tether-nccl-") as tmp:
        path = os.path.join(tmp, "nccl.json")
        cmd = [sys.executable, "-m", "tether.nccl_mesh", "--gpus", str(n), "--sizes", ",".join(map(str, sizes)),
               "--json", path] + (["--iters", str(iters)] if iters else []) + (["--socket"] if socket else [])
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            return [], "no result in 900 s"
        if not os.path.exists(path):
            return [], (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        with open(path) as f:
            doc = json.load(f)
    return [B.Result(**r) for r in doc["results"]], None


def _plot(results, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict = {}
    for r in results:
        key = f"{r.mode} {r.transport} {r.device} iovs={r.num_iovs} " + " ".join(
            f"{k}={v}" for k, v in r.config.items() if k != "connect_ms")
        lines.setdefault(key, []).append((r.size, r.gbps))
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, pts in lines.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key.strip())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size per block (bytes)")
    ax.set_ylabel("GB/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def doctor(args) -> int:
    from tether import doctor as D

    report = D.collect()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        D.render(report)
    return 0


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        return bench(args)
    if args.command == "nixl":
        from tether.nixl import cli
        return cli(args)
    return doctor(args)


if __name__ == "__main__":
    sys.exit(main())
