"""Command line: `tether bench` and `tether doctor`."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import os
import shutil
import sys
import time
import textwrap
import traceback
from typing import Optional

import tether

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M"


DEFAULT_CHECK_ITERS = 5  # checked operations per case: enough to catch a misplaced block, bounded in time
UNPACK = ("kernel", "d2d", "host")
MODES = ("write", "read", "send")

# One paragraph per line: the help wraps each at the terminal's width (_Wrapping).
EPILOG = "\n".join([
    "units: sizes take binary suffixes K, M, G (1K = 1024 bytes; KiB, MiB, GiB are the same); GB/s is 10^9 "
    "bytes per second (the JSON key gbps), bytes per op = size x num_iovs; p50/p99 are per-op latencies in "
    "microseconds (lat_p50_us, lat_p99_us).",
    "Knobs given as comma lists (--channels, --chunk-bytes, --window, --unpack) sweep: "
    "every combination runs.",
    "Expected failures print one line; --debug (or TETHER_DEBUG=1) prints the traceback too.",
])


class _Wrapping(argparse.HelpFormatter):
    """Wraps the description and the epilog at the terminal's width (COLUMNS when piped, else 80), each
    line of them a paragraph of its own."""

    def _fill_text(self, text, width, indent):
        return "\n".join(textwrap.fill(par, width, initial_indent=indent, subsequent_indent=indent) if par else ""
                         for par in text.splitlines())


def _csv(kind, what: str = "value"):
    """A comma-list argument; a bad item is one argparse error line naming it and what is accepted."""
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = what  # argparse names the type in its messages
    return parse


def _count(minimum: int = 1):
    """A whole number >= minimum (0 iovs or channels would fail deep inside a run, not here)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text.strip()!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value
    parse.__name__ = "count"
    return parse


def _host_port(least_port: int):
    """HOST:PORT (IPv6 in brackets or bare: the port follows the last colon), checked before a run."""
    def parse(text: str) -> str:
        host, sep, port = text.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not least_port <= int(port) <= 65535:
            raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port {least_port}-65535, got {text!r}")
        return text.strip()
    parse.__name__ = "address"
    return parse


def _choice(what: str, *allowed: str):
    def parse(text: str) -> str:
        t = text.strip()
        if t not in allowed:
            raise ValueError(f"unknown {what} {t!r} (choose from {', '.join(allowed)})")
        return t
    return parse


class _Parser(argparse.ArgumentParser):
    """A usage mistake is one line naming the option, not the whole usage block that would bury it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from tether.bench import parse_size

    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help="on failure, print the traceback too (also TETHER_DEBUG=1)")
    p = _Parser(prog="tether", description="tether: point-to-point transfer engine")
    p.add_argument("--version", action="version", version=f"tether {tether.__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    b = sub.add_parser("bench", parents=[common], help="measure transfers between two local processes",
                       description="Measure transfers between two local processes (or two hosts: --role). "
                                   "Prints a table; --json keeps every figure.",
                       epilog=EPILOG, formatter_class=_Wrapping)
    b.add_argument("--transport", default="auto", choices=["auto", "tcp", "ipc", "fabric", "netplugin"],
                   help="the transport to measure (default auto: ipc between two processes of one host, "
                        "tcp between hosts)")
    b.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"],
                   help="memory of the source and target buffers (default auto: host memory; gpu: "
                        "--local-gpu-idx and --remote-gpu-idx, needs torch with CUDA)")
    b.add_argument("--local-gpu-idx", metavar="GPU", type=int, default=0, help="--device gpu: the driving side's GPU (default 0)")
    b.add_argument("--remote-gpu-idx", metavar="GPU", type=int, default=0, help="--device gpu: the target side's GPU (default 0)")
    b.add_argument("--sizes", metavar="LIST", type=_csv(parse_size, "size"), default=None,
                   help=f"bytes per block, comma list with binary suffixes K, M, G (default {DEFAULT_SIZES})")
    b.add_argument("--num-iovs", metavar="LIST", type=_csv(_count(), "count"), default=[1],
                   help="blocks per vectored op, comma list; crossed with --sizes (default 1)")
    b.add_argument("--iters", metavar="N", type=_count(), default=None, help="measured ops per case (default: by size, and as many more as fill 0.25 s)")
    b.add_argument("--warmup", metavar="N", type=_count(0), default=None, help="unmeasured ops first (default: 10%% of iters, at least 1)")
    b.add_argument("--mode", metavar="LIST", type=_csv(_choice("mode", *MODES), "mode"), default=["write"],
                   help="operations to measure, comma list of write, read, send (default: write)")
    b.add_argument("--async-api", action="store_true", help="keep --depth ops in flight instead of one at a time")
    b.add_argument("--depth", metavar="N", type=_count(), default=8, help="ops in flight with --async-api (default 8)")
    b.add_argument("--check", action="store_true",
                   help="verify: random source, poisoned destination, every byte compared, for the first "
                        "--check-iters ops of each case (not timed)")
    b.add_argument("--check-iters", type=_count(0), default=DEFAULT_CHECK_ITERS, metavar="N",
                   help=f"ops verified per case with --check (default {DEFAULT_CHECK_ITERS}; 0: as many as --iters)")
    b.add_argument("--json", metavar="PATH",
                   help="write machine, configuration and every result to PATH (gbps in 10^9 B/s, latencies in µs)")
    b.add_argument("--plot", metavar="PATH",
                   help="PNG: GB/s against size, a line per configuration (needs matplotlib: pip install matplotlib)")
    b.add_argument("--channels", metavar="LIST", type=_csv(_count(), "count"), default=None,
                   help="progress threads / lanes per peer, comma list to sweep (default: the endpoint's)")
    b.add_argument("--chunk-bytes", metavar="LIST", type=_csv(parse_size, "size"), default=None,
                   help="chunk size (unit of pipelining), comma list with K/M/G suffixes to sweep")
    b.add_argument("--window", metavar="LIST", type=_csv(_count(), "count"), default=None,
                   help="chunks in flight per peer, comma list to sweep")
    b.add_argument("--unpack", metavar="LIST", type=_csv(_choice("unpack", *UNPACK), "unpack"), default=None,
                   help="GPU memory over staging: how received bytes reach their places, comma list of "
                        "kernel, d2d, host to sweep (default: the endpoint's, kernel where built)")
    b.add_argument("--ceiling", action="store_true",
                   help="beside tether, in the same call: plain loopback TCP (bench/tools/tcp_ceiling.c) with as "
                        "many streams as tether has lanes, its socket options and chunk size, page-locked "
                        "buffers; the table gets each row's fraction of it, the caption its GB/s and CPU-s "
                        "per GB (--transport tcp, --role local)")
    b.add_argument("--nics", metavar="LIST", default=None, help="data NICs in order, e.g. eth1,eth2 (sets TETHER_NICS)")
    b.add_argument("--stats", action="store_true", help="per-NIC and per-channel counters of both endpoints (tcp lanes also: seconds in sendmsg, recv and GPU staging copies, and the most staging slots a lane held)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--role", choices=["local", "server", "client"], default=None,
                   help="local: two processes here (default); server/client: one side each on two hosts. "
                        "Under torchrun (2 ranks) rank 0 is the client, rank 1 the server.")
    b.add_argument("--listen", default=None, metavar="HOST:PORT", type=_host_port(0), help="server: where to listen (default 0.0.0.0:0)")
    b.add_argument("--peer", default=None, metavar="HOST:PORT", type=_host_port(1), help="client: the server's address")
    b.add_argument("--full-mesh", action="store_true",
                   help="many flows at once; per-flow and aggregate rows. Host memory: --gpus pairs. "
                        "--device gpu: every ordered GPU pair i>j of --gpus GPUs")
    b.add_argument("--gpus", metavar="N", type=_count(), default=2, help="full mesh: pairs (host memory) or GPUs (--device gpu)")
    b.add_argument("--single-process", action="store_true",
                   help="full mesh: one process (one endpoint) per side for all flows, not one per pair/GPU")
    b.add_argument("--nccl", nargs="?", const="default,socket", default=None, metavar="default,socket",
                   help="GPU full mesh: also run NCCL all-pairs send/recv on the same GPUs and sizes "
                        "(default transport, socket transport forced, or both)")

    d = sub.add_parser("doctor", parents=[common], help="what this machine offers and what tether will use")
    d.add_argument("--json", action="store_true", help="the report as JSON on stdout, for tools")

    n = sub.add_parser("nixl", parents=[common],
                       help="tether as a NIXL backend: put the plugin where NIXL finds it, or show its state")
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

    console = Console(stderr=True)
    host, port = "0.0.0.0", 0
    if args.listen:
        host, _, p = args.listen.rpartition(":")
        host, port = host.strip("[]"), int(p)
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


def print_whole(table, stderr: bool = False) -> None:
    """Prints `table` at the terminal's width (COLUMNS when piped; no limit without it), wider only
    where its figures would not fit otherwise: text columns wrap, figures are never cut."""
    from rich.console import Console

    m = Console(width=10_000).measure(table)
    width = _width(sys.stderr if stderr else sys.stdout)
    Console(stderr=stderr, width=m.maximum if width is None else max(width, m.minimum)).print(table)


def stats_tables(stats: dict, combo: dict, side: str = "driving side") -> None:
    """Per-NIC and per-channel (lane) counters over the run so far (tether.EndpointStats's LinkStats)."""
    from rich.table import Table

    cols = ("MiB sent", "MiB received", "chunks sent", "chunks received", "errors", "resends",
            "ms in send", "ms in recv", "ms staging", "staging slots peak")

    def nums(x):
        return [f"{x['bytes_sent'] / 2**20:.1f}", f"{x['bytes_received'] / 2**20:.1f}", str(x["chunks_sent"]),
                str(x["chunks_received"]), str(x["errors"]), str(x["resends"]),
                f"{x['send_s'] * 1e3:.1f}", f"{x['recv_s'] * 1e3:.1f}", f"{x['staging_s'] * 1e3:.1f}",
                str(x["staging_slots_peak"])]

    def table(title, text_cols):
        t = Table(title=title)
        for c in text_cols:
            t.add_column(c, justify="right", overflow="fold")
        for c in cols:  # headers wrap at their spaces, figures never
            t.add_column(c, justify="right", overflow="fold", min_width=max(len(w) for w in c.split()))
        return t

    t = table(f"{side}: per NIC {combo or ''}", ("NIC",))
    for n in stats["nics"]:
        t.add_row(n["name"], *nums(n))
    print_whole(t, stderr=True)
    t = table(f"{side}: per channel (lane)", ("peer", "lane", "local NIC", "local", "remote", "alive"))
    for l in stats["lanes"]:
        t.add_row(l["peer"], str(l["lane"]), l["local_nic"] or "-", l["local_addr"], l["remote_addr"],
                  "yes" if l["alive"] else "[red]no[/red]", *nums(l))
    print_whole(t, stderr=True)


def _err(console, text: str) -> None:
    """One red line, never hard-wrapped (so it stays one line in a log or a narrow terminal)."""
    from rich.markup import escape

    console.print(f"[red]{escape(text)}[/red]", soft_wrap=True)


def _buffers(role: str, device: str, args) -> tuple[int, int, dict[int, int]]:
    """(host buffers on this host, host buffers in the fullest process, {GPU: buffers}) that a run
    allocates, each of the largest case's size: source and target, per pair or flow."""
    if role == "client":
        return (0, 0, {args.local_gpu_idx: 1}) if device == "gpu" else (1, 1, {})
    if args.full_mesh and device == "gpu":  # GPU g holds the sources of flows g>j and targets of k>g
        return 0, 0, {g: 2 * (args.gpus - 1) for g in range(args.gpus)}
    if args.full_mesh:
        return 2 * args.gpus, args.gpus if args.single_process else 1, {}
    if device == "gpu":
        gpus = {args.local_gpu_idx: 1}
        gpus[args.remote_gpu_idx] = gpus.get(args.remote_gpu_idx, 0) + 1
        return 0, 0, gpus
    return 2, 1, {}


class _Refused(Exception):
    """Options a run cannot take, found before anything starts: one red line, exit status 2."""


@dataclasses.dataclass
class _Plan:
    """What `tether bench` will run, settled (and checked) before anything starts."""
    role: str
    torchrun: Optional[tuple[int, int]]
    device: str
    ngpu: int
    transport_opts: dict
    gpu_kw: dict
    sizes: list
    knobs: dict
    target: object = None
    combos: list = dataclasses.field(default_factory=list)
    cases: list = dataclasses.field(default_factory=list)
    capacity: int = 0
    nccl_variants: list = dataclasses.field(default_factory=list)


def _role(args) -> tuple[str, Optional[tuple[int, int]]]:
    """(this process's role, torchrun's (rank, world size) or None)."""
    torchrun = _torchrun_role()
    role = args.role
    if role is None:
        role = ("client" if torchrun[0] == 0 else "server") if torchrun else "local"
    if torchrun and torchrun[1] != 2:
        raise _Refused("under torchrun, tether bench takes exactly 2 ranks (--nnodes=2 --nproc_per_node=1)")
    if role == "client" and not (args.peer or torchrun):
        raise _Refused("--role client needs --peer HOST:PORT (or torchrun)")
    return role, torchrun


def _check_outputs(args) -> None:
    """Where --json and --plot write, found before the run, not after it."""
    for opt, path in (("--json", args.json), ("--plot", args.plot)):
        if path and not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            raise _Refused(f"{opt} {path}: cannot write there (no such directory, or no permission)")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise _Refused("--plot needs matplotlib, not installed here: pip install matplotlib "
                       "(in tether's source tree: pip install \".[plot]\")")


def _device(args) -> tuple[str, int]:
    """(the memory the run moves, cpu or gpu; the GPUs visible here)."""
    device = args.device
    cuda, why, ngpu = tether._tether.gpu_status()[:3]
    if device == "auto":
        device = "cpu"  # GPU memory on request (--device gpu): same-host ipc moves host memory only so far
    if device == "gpu":
        if not cuda or not _torch_cuda():
            raise _Refused(f"--device gpu needs CUDA and torch with a GPU here ({why or 'torch has no CUDA'})")
        for idx in (args.local_gpu_idx, args.remote_gpu_idx):
            if not 0 <= idx < ngpu:
                raise _Refused(f"GPU {idx} does not exist ({ngpu} visible)")
    return device, ngpu


def _transport_options(args, role: str) -> dict:
    """The endpoints' transport option; the tcp ceiling tool found (or built) before the run, not after it."""
    from tether import bench as B

    if args.transport != "auto":
        with tether.Endpoint(port=0) as probe:
            why = probe.transports().get(args.transport, "not built into this tether")
        if why:
            raise _Refused(f"--transport {args.transport}: not available here ({why})")
    if args.ceiling:
        if args.transport != "tcp" or role != "local" or args.full_mesh:
            raise _Refused("--ceiling measures loopback TCP beside tether's tcp transport: it goes with "
                           "--transport tcp, two local processes (--role local), no --full-mesh")
        B.ceiling_tool()
    return {} if args.transport == "auto" else {"transport": args.transport}


def _plan(args) -> _Plan:
    """Who runs what, with what memory and transport; the first check that fails is the one reported."""
    from tether import bench as B

    role, torchrun = _role(args)
    _check_outputs(args)
    device, ngpu = _device(args)
    transport_opts = _transport_options(args, role)
    if args.nics:
        os.environ["TETHER_NICS"] = args.nics  # both endpoints (a local server inherits it)
    return _Plan(
        role=role, torchrun=torchrun, device=device, ngpu=ngpu, transport_opts=transport_opts,
        gpu_kw=dict(device=args.local_gpu_idx, remote_device=args.remote_gpu_idx) if device == "gpu" else {},
        sizes=args.sizes or _csv(B.parse_size)(DEFAULT_SIZES),
        knobs={"channels": args.channels, "chunk_bytes": args.chunk_bytes, "window": args.window, "unpack": args.unpack})


def _plan_cases(args, plan: _Plan) -> None:
    """The driving side's part of the plan: every combination of the swept knobs, the cases each runs,
    the peer to run them against."""
    from tether import bench as B

    if plan.role == "client" and plan.torchrun:
        plan.target = _torch_store().get("tether/bench/metadata")
    else:
        plan.target = args.peer
    names = [k for k, v in plan.knobs.items() if v]
    plan.combos = [dict(zip(names, values)) for values in itertools.product(*(plan.knobs[k] for k in names))] or [{}]
    plan.capacity = max(plan.sizes) * max(args.num_iovs)
    plan.cases = [
        B.Case(mode=m, size=s, num_iovs=n, iters=args.iters or B.auto_iters(s, n),
               warmup=args.warmup if args.warmup is not None else max(1, (args.iters or B.auto_iters(s, n)) // 10),
               async_depth=args.depth if args.async_api else 0, check=args.check,
               check_iters=args.check_iters, min_seconds=0.0 if args.iters or args.full_mesh else B.TIMED_PASS_S)
        for m in args.mode for n in args.num_iovs for s in plan.sizes if not (m == "send" and n != 1)
    ]
    if not plan.cases:  # --mode send --num-iovs 4: nothing would run, and an empty table says nothing
        raise _Refused("nothing to measure: send moves one block per op (--num-iovs 1); "
                       "vectored ops are write and read")
    if args.full_mesh and (plan.role != "local" or args.gpus < 1):
        raise _Refused("--full-mesh runs locally (two hosts: start one bench pair per device) with --gpus >= 1")
    if args.nccl and not (args.full_mesh and plan.device == "gpu"):
        raise _Refused("--nccl goes with --full-mesh --device gpu")
    plan.nccl_variants = [v for v in (args.nccl or "").split(",") if v]
    if any(v not in ("default", "socket") for v in plan.nccl_variants):
        raise _Refused(f"--nccl takes default, socket or both, not {args.nccl!r}")
    if args.full_mesh and plan.device == "gpu":
        if not 2 <= args.gpus <= plan.ngpu:
            raise _Refused(f"a GPU full mesh takes 2 <= --gpus <= {plan.ngpu} (the GPUs visible here)")
        if "send" in args.mode:
            raise _Refused("a GPU full mesh runs write and read (send needs a receiver per flow)")
    # A case that cannot fit is refused before anything starts: a helper that dies allocating it
    # would end the run half-way, with nothing to show for the rows before it.
    too_big = B.memory_shortfall(plan.capacity, *_buffers(plan.role, plan.device, args),
                                 what=f"{B.human(max(plan.sizes))} x {max(args.num_iovs)} iovs")
    if too_big:
        raise _Refused(f"refused: {too_big}; lower --sizes or --num-iovs")


def _run_pair(args, plan: _Plan, combo: dict, last: bool, progress, task) -> tuple[list, tuple]:
    """One combination's cases over one pair of endpoints: (its rows, the pair's (lanes, chunk bytes,
    socket buffer): the shape of a tcp ceiling beside it)."""
    from tether import bench as B

    pair = None
    rows: list = []
    opts = dict(combo, **plan.transport_opts)
    try:
        pair = (B.LocalPair(opts, plan.capacity, **plan.gpu_kw) if plan.role == "local"
                else B.RemotePair(opts, plan.capacity, plan.target, **plan.gpu_kw))
        for case in plan.cases:
            progress.update(task, description=f"{case.mode} {B.human(case.size)} x{case.num_iovs} {combo or ''}")
            r = B.run_case(pair, case, transport=pair.peer.transport, progress=lambda k=1: progress.advance(task, k))
            r.config = dict(combo, connect_ms=round(pair.connect_ms, 2))
            rows.append(r)
        if args.stats:
            stats_tables(pair.ep.stats(), combo)
            stats_tables(pair.ask("stats"), combo, side="target side")
        lanes = sum(1 for l in pair.ep.stats()["lanes"] if l["peer_id"] == pair.peer.id)
        return rows, (lanes, pair.ep.config.chunk_bytes, pair.ep.config.socket_buffer)
    except Exception as e:
        raise (pair.failure(e) if pair else e) from None  # a dead server: its error, not ours
    finally:
        if pair:
            pair.close(shutdown=last and bool(plan.torchrun))


def _run(args, plan: _Plan, console) -> Optional[tuple[list, dict]]:
    """Every combination in turn: (the rows, {shape: tcp_ceiling's result}); None when a full mesh
    failed (said on stderr)."""
    from rich.progress import Progress

    from tether import bench as B
    from tether import mesh

    n_flows = len(mesh.flows(args.gpus, plan.device == "gpu"))
    total_ops = len(plan.combos) * sum(c.iters + (c.check_iters or c.iters if c.check else 0) for c in plan.cases)
    if args.full_mesh:
        total_ops = len(plan.combos) * len(plan.cases) * n_flows
    results: list = []
    ceilings: dict = {}  # (lanes, chunk bytes, socket buffer) -> tcp_ceiling's result
    # A progress bar only on a terminal: in a log or a pipe it is noise (and leaves a blank line).
    with Progress(console=console, transient=True, disable=args.quiet or not console.is_terminal) as progress:
        task = progress.add_task("bench", total=total_ops)
        for i, combo in enumerate(plan.combos):
            if args.full_mesh:
                progress.update(task, description=f"full mesh, {n_flows} flows {combo or ''}")
                try:
                    results.extend(mesh.run(args.gpus, dict(combo, **plan.transport_opts), plan.capacity, plan.cases,
                                            args.single_process, gpu=plan.device == "gpu",
                                            progress=lambda: progress.advance(task)))
                except Exception as e:  # a worker's traceback in full, then its cause on one line
                    text = str(e).strip() or type(e).__name__
                    print(text, file=sys.stderr)
                    _err(console, f"full mesh failed: {text.splitlines()[-1]}")
                    return None
                continue
            rows, shape = _run_pair(args, plan, combo, i == len(plan.combos) - 1, progress, task)
            results.extend(rows)
            if args.ceiling:  # after the pair has gone: the ceiling has the CPUs to itself
                if shape not in ceilings:
                    progress.update(task, description=f"tcp_ceiling, {shape[0]} streams")
                    ceilings[shape] = B.tcp_ceiling(*shape, cuda=plan.device == "gpu")
                for r in rows:
                    r.ceiling_gbps = ceilings[shape]["gbps"]
    return results, ceilings


def _report(args, plan: _Plan, console, results: list, ceilings: dict, elapsed: float) -> int:
    """The table (NCCL's rows beside tether's), --json and --plot; the exit status."""
    from tether import bench as B

    nccl_failed = False
    for variant in plan.nccl_variants:
        rows, why = _nccl_rows(args.gpus, plan.sizes, args.iters, variant == "socket")
        if why:
            _err(console, f"NCCL all-pairs ({variant}) failed: {why}")
            nccl_failed = True
        results.extend(rows)
    print_results(results, full_mesh=args.full_mesh, show_config=len(plan.combos) > 1,
                  elapsed=elapsed, ceilings=list(ceilings.values()))
    if args.json:
        doc = {
            "version": 1, "machine": B.machine_info(),
            "config": {"transport": ",".join(sorted({r.transport for r in results})) or args.transport,
                       "device": plan.device, "async_api": args.async_api,
                       "check_iters": args.check_iters if args.check else 0, "combos": plan.combos},
            "results": [dict(B.result_dict(r), config=r.config) for r in results],
            **({"ceilings": list(ceilings.values())} if ceilings else {}),
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    if args.plot:
        _plot(results, args.plot)
    failed = [r for r in results if r.check is False]
    if failed:
        _err(console, f"--check found corrupted bytes in {len(failed)} case(s)")
        return 1
    return 1 if nccl_failed else 0


def bench(args) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    try:
        plan = _plan(args)
        if plan.role == "server":
            return _run_server(args, dict({k: v[0] for k, v in plan.knobs.items() if v}, **plan.transport_opts))
        _plan_cases(args, plan)
    except _Refused as e:
        _err(console, str(e))
        return 2
    t_start = time.perf_counter()
    ran = _run(args, plan, console)
    if ran is None:
        return 1
    return _report(args, plan, console, *ran, time.perf_counter() - t_start)


# ---------------------------------------------------------------- the results table

def fmt_gbps(v: float) -> str:
    return f"{v:.2f}"


def fmt_us(v: float) -> str:
    """Latency in µs: one decimal where it tells something, whole µs from 1,000 up."""
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def fmt_cpu(v: float) -> str:
    return "-" if v != v else f"{v:.0f}"


def _width(stream=None) -> Optional[int]:
    """Columns to fit: the terminal's, or COLUMNS when piped; None (no limit) when piped without it."""
    if (stream or sys.stdout).isatty():
        return shutil.get_terminal_size().columns
    cols = os.environ.get("COLUMNS", "")
    return int(cols) if cols.isdigit() and int(cols) > 0 else None


def ceiling_line(c: dict) -> str:
    """One ceiling, for the table's caption."""
    from tether import bench as B

    per = c["cpu_s_per_gb"]
    n = c["streams"]
    return (f"ceiling: loopback TCP, {n} stream{'s' if n != 1 else ''} (tether's lanes), {B.human(c['chunk_bytes'])} "
            f"sends: {c['gbps']:.2f} GB/s, {per['both']:.3f} CPU-s per GB (sender {per['sender']:.3f}, "
            f"receiver {per['receiver']:.3f}); buffers {c['pinned']['receiver']}")


STEAL_FLAG_PCT = 1.0  # rows during which the hypervisor took at least this % of the CPUs' time are named


def steal_line(results) -> Optional[str]:
    """The rows during which the hypervisor held this machine's CPUs back (bench.steal_share), for the
    caption; None when none was."""
    from tether import bench as B

    hit = [r for r in results if r.steal_pct >= STEAL_FLAG_PCT]
    if not hit:
        return None
    rows = ", ".join(f"{r.mode} {B.human(r.size)}{f' x{r.num_iovs}' if r.num_iovs > 1 else ''} ({r.steal_pct:.1f} %)"
                     for r in hit)
    return f"CPU time stolen by the hypervisor during: {rows}; those figures measure the host as much as tether"


def results_table(results, full_mesh: bool, show_config: bool, elapsed: float, width: Optional[int],
                  ceilings: Optional[list] = None):
    """(table, the width to print it at). The figures (size, GB/s, p50, p99) are never cut: what a narrow
    terminal cannot hold goes first — columns equal on every row move into the title, the two CPU%
    columns fold into one, then CPU% is dropped (--json keeps it), and each config is listed once below."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from tether import bench as B

    check = {None: "-", True: "ok", False: "FAILED"}
    cols: dict[str, list[str]] = {
        "mode": [r.mode for r in results], "transport": [r.transport for r in results],
        "device": [r.device for r in results], "size": [B.human(r.size) for r in results],
        "iovs": [str(r.num_iovs) for r in results], "GB/s": [fmt_gbps(r.gbps) for r in results],
        "of ceiling": [f"{r.gbps / r.ceiling_gbps:.2f}" if r.ceiling_gbps else "-" for r in results],
        "p50 µs": [fmt_us(r.lat_p50_us) for r in results], "p99 µs": [fmt_us(r.lat_p99_us) for r in results],
        "CPU% client": [fmt_cpu(r.cpu_client) for r in results],
        "CPU% server": [fmt_cpu(r.cpu_server) for r in results],
        "check": [check[r.check] for r in results],
    }
    if full_mesh:
        cols["pair"] = [str(r.config.get("pair")) for r in results]
    if show_config:
        cols["config"] = [" ".join(f"{k}={v}" for k, v in r.config.items()
                                   if k not in ("connect_ms", "pair", "mesh_s", "shape", "transport"))
                          for r in results]
    if all(c == "-" for c in cols["of ceiling"]):
        del cols["of ceiling"]  # no --ceiling
    if all(c == "-" for c in cols["check"]):
        del cols["check"]  # nothing was checked: the column would say nothing
    title = [f"tether bench ({elapsed:.1f} s)"]
    caption: list[str] = [ceiling_line(c) for c in ceilings or ()]
    if stolen := steal_line(results):
        caption.append(stolen)

    def build():
        t = Table(title=" · ".join(title), caption="\n".join(caption) or None)
        for name in cols:
            # Nothing wraps (rich would squeeze a wrapable column mid-word): the steps above fold.
            t.add_column(name.replace("% ", "%\n"), justify="left" if name == "config" else "right", no_wrap=True)
        for i in range(len(results)):
            t.add_row(*(Text(c[i], style="red" if c[i] == "FAILED" else "") for c in cols.values()))
        return t

    def need() -> int:  # the width without wrapping anything
        return Console(width=10_000).measure(build()).maximum

    steps = []
    if results:
        def constants():  # lossless: "write · ipc · cpu" once in the title
            for name in ("mode", "transport", "device", "iovs", "check"):
                values = set(cols.get(name, ()))
                if len(values) == 1 and "FAILED" not in values:
                    value = values.pop()
                    title.append(f"{name} {value}" if name in ("iovs", "check") else value)
                    del cols[name]

        def fold_cpu():
            cols["CPU% c/s"] = [f"{a}/{b}" for a, b in zip(cols.pop("CPU% client"), cols.pop("CPU% server"))]
            if "check" in cols:
                cols["check"] = cols.pop("check")

        def drop_cpu():
            del cols["CPU% c/s"]
            caption.append("CPU% left out to fit the terminal (--json has it).")

        def config_legend():  # each configuration once, under the table; a number in the rows
            if "config" in cols:
                names = list(dict.fromkeys(cols["config"]))
                cols["config"] = [str(names.index(c) + 1) for c in cols["config"]]
                caption.extend(f"config {i + 1}: {c}" for i, c in enumerate(names))
        steps = [constants, fold_cpu, drop_cpu, config_legend]
    for step in steps:
        if width is None or need() <= width:
            break
        step()
    # Wider than `width` only when even the figures alone do not fit: lines wrap, numbers stay whole.
    return build(), need() if width is None else max(width, need())


def print_results(results, full_mesh: bool, show_config: bool, elapsed: float,
                  ceilings: Optional[list] = None) -> None:
    from rich.console import Console

    table, width = results_table(results, full_mesh, show_config, elapsed, _width(), ceilings)
    Console(width=width).print(table)


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
    fields = set(B.Result.__dataclass_fields__)  # derived keys (cpu_s_per_gb, of_ceiling) are not fields
    return [B.Result(**{k: v for k, v in r.items() if k in fields}) for r in doc["results"]], None


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


# Failures a user can cause or meet (a refused connection, a dead server, no memory): one line, not a
# traceback. Anything else is a bug in tether and keeps its traceback.
def _expected() -> tuple:
    from tether import bench as B
    return (tether.TetherError, B.BenchError, OSError, TimeoutError, MemoryError, EOFError)


def main(argv: Optional[list] = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # plain `tether`: what it can do, not an error line
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("TETHER_DEBUG", "") not in ("", "0")
    try:
        if args.command == "bench":
            return bench(args)
        if args.command == "nixl":
            from tether.nixl import cli
            return cli(args)
        return doctor(args)
    except KeyboardInterrupt:
        print(f"tether {args.command}: interrupted", file=sys.stderr)
        return 130
    except _expected() as e:
        if debug:
            traceback.print_exc()
        text = " ".join(str(e).split()) or "(no message)"  # one line
        print(f"tether {args.command}: {type(e).__name__}: {text}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
