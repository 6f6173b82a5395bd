#!/usr/bin/env python3
"""Real vLLM, disaggregated: a prefill engine and a decode engine in two processes with vLLM's own
NixlConnector (kv_buffer_device "cpu"), the decode pulling each prompt's KV blocks over NIXL with
backends ["TETHER"] (over ipc and over tcp) and ["UCX"] beside them. Its greedy tokens must equal a
single-instance run of the same prompt; a control request decoded against another prompt's KV must not.

    pip install . && python examples/vllm_disagg/run.py        # makes its venv once (vLLM's CPU build)
    python examples/vllm_disagg/run.py --faults --json out.json  # and SIGKILL / SIGSTOP of the prefill

README.md (this folder) says what each step does. Exit status 0 only if every check held.
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import vllm_venv  # noqa: E402
from pair import EngineError, Pair  # noqa: E402

PATHS = {"TETHER-ipc": ("TETHER", "ipc"), "TETHER-tcp": ("TETHER", "tcp"), "UCX": ("UCX", None)}
LENGTHS = (16, 200, 1000)
VOCAB = 512


def prompts(seed):
    r = random.Random(seed)
    return {n: [r.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS}


def other_prompt(p, seed):
    """Same length and last token, every other token different: decoded on p's KV it must give p's tokens,
    so its own single-instance tokens must differ (the decode's first step recomputes only the last token)."""
    r = random.Random(seed)
    return [(t + r.randrange(1, VOCAB - 3)) % VOCAB for t in p[:-1]] + [p[-1]]


def disagg(pr, reqs, max_tokens, deadline_s=120.0):
    """Prefill every prompt (one batch), then decode them together with the prefill's kv_transfer_params.
    reqs: [(prompt for the prefill, prompt for the decode)]."""
    pre = pr.prefill.call({"op": "prefill", "prompts": [a for a, _ in reqs]})
    return pr.decode.call({"op": "decode", "max_tokens": max_tokens, "deadline_s": deadline_s,
                           "requests": [{"prompt": b, "kv_transfer_params": p["kv_transfer_params"]}
                                        for (_, b), p in zip(reqs, pre)]}, timeout=deadline_s + 30)


def warm_up(pr, p, max_tokens, log):
    """The first pull does vLLM's side-channel handshake, whose reply has a fixed 5 s receive timeout that a
    loaded machine can miss: one retry, reported."""
    for attempt in (1, 2):
        d = disagg(pr, [(p, p)], max_tokens)[0]
        if d["finish"] != "error":
            return attempt
        log(f"  warm-up pull {attempt} failed ({d['finish']}); the prefill log says why: {pr.prefill.log_path}")
    raise EngineError("the warm-up pull failed twice")


def row(case, prompt, d, ref):
    return {"case": case, "prompt_tokens": len(prompt), "kv_bytes": d.get("kv_bytes"),
            "xfer_ms": None if d.get("xfer_us") is None else d["xfer_us"] / 1e3, "ttft_ms": d["ttft_ms"],
            "finish": d["finish"], "tokens": d["tokens"], "equal": d["tokens"] == ref}


def scenario(pr, seed, max_tokens, log):
    ps = prompts(seed)
    ctl_a, ctl_b = ps[200], other_prompt(ps[200], seed + 1)
    refs = pr.prefill.call({"op": "generate", "max_tokens": max_tokens, "prompts": list(ps.values()) + [ctl_b]})
    ref = {n: r["tokens"] for n, r in zip(LENGTHS, refs)}
    ref_b = refs[-1]["tokens"]
    attempts = warm_up(pr, ps[LENGTHS[0]], max_tokens, log)
    rows = [row("one", ps[n], disagg(pr, [(ps[n], ps[n])], max_tokens)[0], ref[n]) for n in LENGTHS]
    batch = disagg(pr, [(ps[n], ps[n]) for n in LENGTHS], max_tokens)
    rows += [row("batched", ps[n], d, ref[n]) for n, d in zip(LENGTHS, batch)]
    c = row("control", ctl_b, disagg(pr, [(ctl_a, ctl_b)], max_tokens)[0], ref_b)
    c["equal_to_kv_owner"] = c["tokens"] == ref[200]
    rows.append(c)
    return {"rows": rows, "warmup_attempts": attempts}


def fault(pr, sig, seed, max_tokens, bound_s):
    """Prefill one prompt, stop or kill the prefill process, then decode it. The request must end within
    bound_s, never hang: with an error, or with the right tokens (a stopped prefill's KV can still arrive:
    over ipc, blocks of at most `ipc_one_sided_bytes` are read from its memory without its threads).
    Returns {"signal", "finish", "ms", "equal", "kv_bytes" (NIXL's count, None: no READ finished)}."""
    p = prompts(seed)[200]
    ref = pr.prefill.call({"op": "generate", "max_tokens": max_tokens, "prompts": [p]})[0]["tokens"]
    pre = pr.prefill.call({"op": "prefill", "prompts": [p]})[0]
    pr.prefill.signal(sig)
    t0 = time.monotonic()
    try:
        d = pr.decode.call({"op": "decode", "max_tokens": max_tokens, "deadline_s": bound_s,
                            "requests": [{"prompt": p, "kv_transfer_params": pre["kv_transfer_params"]}]},
                           timeout=bound_s + 30)[0]
        res = {"finish": d["finish"], "ms": d["total_ms"], "equal": d["tokens"] == ref, "kv_bytes": d["kv_bytes"]}
    except EngineError as e:
        res = {"finish": f"no answer: {str(e).splitlines()[0]}", "ms": (time.monotonic() - t0) * 1e3,
               "equal": False}
    if sig == signal.SIGSTOP:
        pr.prefill.signal(signal.SIGCONT)
    return dict(res, signal=signal.Signals(sig).name)


def fault_ok(f):
    return f["finish"] == "error" or (f["finish"] == "length" and f["equal"])


def faults(pr, seed, max_tokens, peer_timeout_s):
    """SIGSTOP (bounded by tether's peer_timeout), then SIGKILL. After the stopped prefill continues, the
    next request to that same prefill must succeed: vLLM keeps its agent and never re-adds it, so the
    link heals inside the plugin (its next transfer reconnects)."""
    out = [fault(pr, signal.SIGSTOP, seed, max_tokens, peer_timeout_s + 20)]
    p = prompts(seed)[16]
    ref = pr.prefill.call({"op": "generate", "max_tokens": max_tokens, "prompts": [p]})[0]["tokens"]
    after = disagg(pr, [(p, p)], max_tokens)[0]
    out[0]["after_heal_equal"] = after["tokens"] == ref
    out.append(fault(pr, signal.SIGKILL, seed, max_tokens, 20))
    return out


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def table(name, res):
    lines = [f"{name}  (engines started in {res['startup_s']:.0f} s; warm-up pulls: {res['warmup_attempts']})",
             f"  {'request':<9} {'prompt tok':>10} {'KV bytes':>10} {'NIXL xfer ms':>12} {'decode TTFT ms':>14}"
             f"  equal to single-instance"]
    for r in res["rows"]:
        eq = "yes" if r["equal"] else "no"
        if r["case"] == "control":
            eq += (" (must be no: another prompt's KV; equals that prompt's tokens: "
                   f"{'yes' if r['equal_to_kv_owner'] else 'no'})")
        elif r["finish"] not in ("length", "stop"):
            eq += f" (finish: {r['finish']})"
        lines.append(f"  {r['case']:<9} {r['prompt_tokens']:>10} {fmt(r['kv_bytes'], ','):>10} "
                     f"{fmt(r['xfer_ms'], '.3f'):>12} {fmt(r['ttft_ms'], '.1f'):>14}  {eq}")
    for f in res.get("faults", []):
        done = (f" (tokens equal: {'yes' if f['equal'] else 'no'}; KV bytes read: {fmt(f.get('kv_bytes'), ',')})"
                if f["finish"] == "length" else "")
        lines.append(f"  prefill {f['signal']}: decode request finished '{f['finish']}'{done} after {f['ms']:.0f} ms"
                     + (f"; the same prefill's next request equal: {'yes' if f['after_heal_equal'] else 'no'}"
                        if "after_heal_equal" in f else ""))
    return "\n".join(lines)


def passed(res):
    rows = res["rows"]
    ok = all(r["equal"] for r in rows if r["case"] != "control")
    ok &= all(not r["equal"] and r["equal_to_kv_owner"] for r in rows if r["case"] == "control")
    for f in res.get("faults", []):
        ok &= fault_ok(f) and f.get("after_heal_equal", True)
    return ok


def run_path(name, python, pythonpath, model, args, log_dir, log):
    backend, transport = PATHS[name]
    with Pair(python, pythonpath, model, backend, transport, log_dir / name, args.peer_timeout,
              args.threads) as pr:
        res = scenario(pr, args.seed, args.max_tokens, log)
        res["startup_s"] = pr.startup_s
        if args.faults and backend == "TETHER":  # UCX has no timeout: a stopped peer hangs its pull
            res["faults"] = faults(pr, args.seed + 7, args.max_tokens, args.peer_timeout)
    return res


class SetupError(RuntimeError):
    """tether is missing here, or was built without its NIXL plugin."""


def check_tether():
    try:
        import tether  # noqa: F401
        from tether.nixl import plugin_path
    except ImportError:
        raise SetupError("tether is not importable here: `pip install .` in the repository first") from None
    if plugin_path() is None:
        raise SetupError("this tether was built without its NIXL plugin (CMake option TETHER_NIXL=OFF): "
                         "rebuild it with `pip install .`, which builds it by default")


def prepare(args, log):
    """The venv (made once), the link to this tether and its plugin in the venv's NIXL, and the model."""
    check_tether()
    venv = vllm_venv.ensure(Path(args.venv) if args.venv else None, log=log)
    work = Path(args.work or tempfile.mkdtemp(prefix="tether-vllm-"))
    pythonpath = vllm_venv.tether_link(work / "pythonpath")
    log("[setup] " + vllm_venv.install_plugin(venv, pythonpath).replace("\n", "; "))
    model = work / "model"
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import model; from pathlib import Path; " \
           f"model.write(Path({str(model)!r}))"
    subprocess.run([str(vllm_venv.python_of(venv)), "-c", code], check=True)
    return vllm_venv.python_of(venv), pythonpath, model, work


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--faults", action="store_true", help="also SIGSTOP and SIGKILL the prefill (TETHER paths)")
    ap.add_argument("--peer-timeout", type=float, default=5.0, help="tether's peer_timeout, seconds")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per engine")
    ap.add_argument("--venv", help="the example's venv (default ~/.cache/tether/vllm-venv-<key>)")
    ap.add_argument("--work", help="folder for the model, logs and the tether link (default: a new temp one)")
    ap.add_argument("--json", help="write every result here")
    args = ap.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    try:
        python, pythonpath, model, work = prepare(args, log)
    except (SetupError, vllm_venv.VenvError) as e:
        sys.exit(f"run.py: {e}")
    results, ok = {}, True
    for name in args.paths:
        log(f"[{name}] starting prefill and decode engines (logs under {work / 'logs' / name})")
        try:
            res = run_path(name, python, pythonpath, model, args, work / "logs", log)
        except EngineError as e:
            results[name] = {"error": str(e)}
            ok = False
            print(f"{name}: FAILED: {e}\n", flush=True)
            continue
        results[name] = res
        ok &= passed(res)
        print(table(name, res) + "\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("vLLM's decode tokens equal, over TETHER" if ok else "CHECKS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
