#!/usr/bin/env python3
"""Disaggregated prefill, end to end: a prefill process computes several prompts' KV cache into its paged
pool, a decode process pulls it into its own paged pool (one READ per request, all in flight at once)
and generates; its tokens must equal one-process generation. Runs every path it can: tether's own API,
NIXL with backends=["TETHER"], NIXL with backends=["UCX"].

    python examples/disagg_prefill/run.py                  # every path, table
    python examples/disagg_prefill/run.py --json out.json  # and the full record (--json - : JSON only)

Each path runs in a fresh pair of processes started by this script (`--role prefill|decode`, which also
run by hand on two hosts: --listen 0.0.0.0:PORT / --connect HOST:PORT, same TETHER_DISAGG_KEY).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import kv_engines  # noqa: E402
import llm  # noqa: E402

KEY_ENV = "TETHER_DISAGG_KEY"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paths", default=",".join(kv_engines.PATHS),
                   help="comma list of tether, nixl-TETHER, nixl-UCX (those that cannot run here are skipped)")
    p.add_argument("--model", choices=["auto", "llama", "fake"], default="auto",
                   help="llama: transformers model with random weights; fake: the NumPy stand-in (auto: llama "
                        "when torch and transformers import)")
    p.add_argument("--preset", choices=["auto", *llm.PRESETS], default="auto", help="model size (auto: small on GPU)")
    p.add_argument("--device", default="auto", help="cuda:N or cpu (auto: cuda:0 when torch sees a GPU)")
    p.add_argument("--dtype", default="float32", help="model and KV dtype (float32 keeps greedy ties away)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--prompt-lens", default="3,16,100,257,1000", help="prompt lengths in tokens, one request each")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="rounds of all requests; the table shows the last")
    p.add_argument("--transport", default="auto", help="tether transport (auto, tcp, ipc, ...), also TETHER's")
    p.add_argument("--dlist", choices=["blocks", "nx5"], default="blocks",
                   help="NIXL descriptor lists: one row per block (vLLM) or strided Nx5 rows (NIXL >= 1.5)")
    p.add_argument("--verify-bytes", action="store_true",
                   help="prefill also ships each request's blocks over the side channel; decode compares "
                        "them byte for byte (always: a BLAKE2b digest per block)")
    p.add_argument("--prefill-blocks", type=int, default=0, help="pool sizes in blocks (0: from the prompts)")
    p.add_argument("--decode-blocks", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any one wait may take")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write the record to PATH ('-': stdout only)")
    p.add_argument("--no-install", action="store_true", help="do not copy the TETHER plugin into NIXL's folder")
    p.add_argument("--fault", choices=["none", "misplace", "missing"], default="none",
                   help="tests: decode pulls the longest request wrongly; the run must report it and fail")
    p.add_argument("--role", choices=["prefill", "decode"],
                   help="run one side only (what the launcher starts; by hand on two hosts), with --path")
    p.add_argument("--path", choices=kv_engines.PATHS, help="the one path a --role process uses")
    p.add_argument("--listen", default="127.0.0.1:0", help="prefill's side channel (with --role prefill)")
    p.add_argument("--connect", help="prefill's side channel (with --role decode)")
    args = p.parse_args(argv)
    args.prompt_lens = [int(x) for x in str(args.prompt_lens).split(",") if x]
    known = {x.lower(): x for x in kv_engines.PATHS}
    try:
        args.paths = [known[x.strip().lower()] for x in args.paths.split(",") if x.strip()]
    except KeyError as e:
        p.error(f"unknown path {e.args[0]!r} (one of {', '.join(kv_engines.PATHS)})")
    if min(args.prompt_lens) < 2:
        p.error("prompts need at least 2 tokens (decode recomputes the last one)")
    return args


def resolve(args) -> str:
    """Concrete model, device and preset for both children; returns a note for the reader, or ""."""
    note = ""
    if args.model == "auto":
        why = llm.torch_available()
        args.model = "fake" if why else "llama"
        note = f"{why}: using the NumPy stand-in model" if why else ""
    if args.model == "fake":
        args.device = "cpu"
    elif args.device == "auto":
        import torch
        args.device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if args.preset == "auto":
        args.preset = "small" if args.device.startswith("cuda") else "tiny"
    return note


def child_argv(args, role: str, path: str) -> list[str]:
    argv = [sys.executable, str(HERE / "run.py"), "--role", role, "--path", path, "--model", args.model,
            "--preset", args.preset, "--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed),
            "--prompt-lens", ",".join(map(str, args.prompt_lens)), "--max-new-tokens", str(args.max_new_tokens),
            "--rounds", str(args.rounds), "--transport", args.transport, "--dlist", args.dlist,
            "--prefill-blocks", str(args.prefill_blocks), "--decode-blocks", str(args.decode_blocks),
            "--timeout", str(args.timeout), "--fault", args.fault]
    return argv + (["--verify-bytes"] if args.verify_bytes else [])


def _lines(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line)
    q.put(None)


def run_pair(args, path: str) -> dict:
    """Starts prefill, then decode against prefill's side channel; returns decode's record."""
    env = dict(os.environ, **{KEY_ENV: os.urandom(16).hex()})
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    pre = subprocess.Popen(child_argv(args, "prefill", path), stdout=subprocess.PIPE, text=True, env=env)
    dec = None
    try:
        q: queue.Queue = queue.Queue()
        threading.Thread(target=_lines, args=(pre.stdout, q), daemon=True).start()
        line = q.get(timeout=args.timeout)
        if not line or not line.startswith("SIDE_CHANNEL "):
            raise RuntimeError(f"{path}: prefill did not start (exit code {pre.wait(10)})")
        dec = subprocess.Popen(child_argv(args, "decode", path) + ["--connect", line.split()[1]],
                               stdout=subprocess.PIPE, text=True, env=env)
        out, _ = dec.communicate(timeout=args.timeout * 3)
        result = next((json.loads(x[7:]) for x in reversed(out.splitlines()) if x.startswith("RESULT ")), None)
        if dec.returncode or result is None:
            raise RuntimeError(f"{path}: decode failed (exit code {dec.returncode})")
        if pre.wait(args.timeout):
            raise RuntimeError(f"{path}: prefill failed (exit code {pre.returncode})")
        return result
    finally:
        for proc in (dec, pre):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def nixl_plugin_ready(install: bool) -> str:
    """"" when NIXL can create a TETHER backend from this tether's plugin, else why not."""
    try:
        import tether.nixl as tn
    except ImportError as e:
        return f"tether is not importable ({e})"
    st = tn.status(ask_nixl=False)
    if not st["plugin"]:
        return "this tether was built without its NIXL plugin (TETHER_NIXL=OFF)"
    if not st["installed_copy_current"]:
        if not install:
            return "the TETHER plugin is not installed in NIXL's folder (tether nixl install)"
        print(f"installing the TETHER plugin into {tn.install()} (what `tether nixl install` does)", file=sys.stderr)
    return ""


# ----------------------------------------------------------------------------------------------- output


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def print_tables(record: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    con = Console(width=max(Console().width, 132))
    for path, res in record["paths"].items():
        if "skipped" in res:
            con.print(f"[yellow]{path}: skipped[/] — {res['skipped']}")
            continue
        rd = res["rounds"][-1]
        t = Table(title=f"{path} ({res['transport']}) · {res['model']} {res['preset']} on {res['device']} · "
                        f"round {rd['round'] + 1} of {len(res['rounds'])}",
                  caption="TTFT = prefill compute + KV transfer + first decode step (gather from the pool included); "
                          "all requests' READs in flight together; total: first post to last done, all bytes over that",
                  caption_justify="left")
        for col in ("request", "prompt tokens", "blocks", "KV bytes", "KV xfer ms", "GB/s", "prefill ms",
                    "1st step ms", "TTFT ms", "tokens = 1-process"):
            t.add_column(col, justify="left" if col in ("request", "tokens = 1-process") else "right", no_wrap=True)
        for x in rd["requests"]:
            ok = x["match"] and x["digests_ok"] and x["bytes_ok"] is not False
            t.add_row(x["req"], str(x["prompt_tokens"]), str(x["blocks"]), _size(x["kv_bytes"]), _ms(x["transfer_s"]),
                      f"{x['gbps']:.2f}", _ms(x["prefill_s"]), _ms(x["first_step_s"]), _ms(x["ttft_s"]),
                      "[green]yes[/]" if ok else f"[red]NO[/] (step {x['first_mismatch']}, digests {x['digests_ok']})")
        tot, mean = rd["total"], rd["mean"]
        t.add_section()
        t.add_row("total", "", str(tot["blocks"]), _size(tot["kv_bytes"]), _ms(tot["window_s"]), f"{tot['gbps']:.2f}",
                  "", "", "", "[green]all rounds[/]" if res["ok"] else "[red]FAILED[/]")
        t.add_row("mean", "", "", "", _ms(mean["transfer_s"]), "", _ms(mean["prefill_s"]), _ms(mean["first_step_s"]),
                  _ms(mean["ttft_s"]), "")
        con.print(t)
    if not any("skipped" not in r for r in record["paths"].values()):
        con.print("[red]no path could run here[/]")
    elif record["ok"]:
        con.print("[green]every path run: decode's tokens equal one-process generation; every pulled block equals "
                  "prefill's; every READ's notification freed prefill's blocks[/]")
    else:
        con.print("[red]FAILED: see the rows marked NO[/]")


def main(argv=None) -> int:
    args = parse(argv)
    args.key = bytes.fromhex(os.environ.get(KEY_ENV, "")) or b"tether-disagg"
    if args.role:
        import roles
        if args.role == "prefill":
            rc = roles.prefill_main(args, lambda addr: print(f"SIDE_CHANNEL {addr}", flush=True))
        else:
            print("RESULT " + json.dumps(roles.decode_main(args)), flush=True)
            rc = 0
        if args.path == "nixl-UCX":
            # NIXL 1.5.1's UCX backend dies of SIGSEGV in interpreter teardown (even a bare agent, seen on a
            # CPU machine): everything is closed and flushed by now, so leave without that teardown.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
        return rc
    note = resolve(args)
    if note:
        print(note, file=sys.stderr)
    record = {"ok": True, "paths": {}}
    ran = 0
    for path in args.paths:
        why = kv_engines.path_unavailable(path)
        if not why and path == "nixl-TETHER":
            why = nixl_plugin_ready(not args.no_install)
        if why:
            record["paths"][path] = {"skipped": why}
            continue
        print(f"running {path} ...", file=sys.stderr, flush=True)
        res = run_pair(args, path)
        record["paths"][path] = res
        record["ok"] &= res["ok"]
        ran += 1
    record["ok"] &= ran > 0  # every path skipped: nothing was shown
    if args.json and args.json != "-":
        Path(args.json).write_text(json.dumps(record, indent=1))
    if args.json == "-":
        print(json.dumps(record, indent=1))
    else:
        print_tables(record)
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
