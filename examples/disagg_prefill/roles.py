"""The two processes. Prefill runs every prompt, writes its KV into its paged pool and tells decode the
block ids over the side channel; decode allocates its own blocks, PULLS each request with one READ
(all requests in flight at once), checks what landed, decodes from its pool, and compares its tokens
with one-process generation. A READ's notification tells prefill to free that request's blocks.

Per round (run twice by default: the first warms up connections and kernels):
  prefill: compute all prompts -> kv_ready x N, round_sent, verify (digests) -> free blocks as
           "kv:<req>" notifications arrive
  decode:  post one READ per kv_ready as it arrives -> wait all -> check against verify -> decode ->
           "round:<r>" notification
"""
from __future__ import annotations

import time

import numpy as np

import kv_engines
import llm
from paged_kv import PagedKVPool, host_bytes
from side_channel import SideChannel

BLOCK = 16  # tokens per block, vLLM's default


def prompts(seed: int, lens: list[int], vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, vocab, n)] for n in lens]


def _setup(args, role: str):
    device = args.device
    model = llm.build(args.model, args.preset, args.seed, device, args.dtype)
    need = sum(-(-n // BLOCK) for n in args.prompt_lens)
    # Different pool sizes and seeds on the two sides: the same request lands at different places.
    blocks = (args.prefill_blocks or 2 * need + 3) if role == "prefill" else (args.decode_blocks or 3 * need + 5)
    pool = PagedKVPool.allocate(model.array_kind, model.layers, blocks, BLOCK, model.kv_heads, model.head_dim,
                                model.pool_dtype(), seed=args.seed + (1 if role == "prefill" else 2),
                                device=device if model.array_kind == "torch" else None)
    options = {"transport": args.transport} if args.transport != "auto" else {}
    host = args.listen.rsplit(":", 1)[0]
    if role == "prefill" and host not in ("127.0.0.1", "localhost"):
        options["host"] = host  # decode on another host: tether listens where the side channel does
    return model, pool, options


def _interleaved(tables: list[list[int]]) -> bool:
    """True when some request's blocks lie between another request's (the pool is shared, not split)."""
    spans = [(min(t), max(t)) for t in tables if t]
    return any(lo_a < b < hi_a for i, (lo_a, hi_a) in enumerate(spans)
               for j, t in enumerate(tables) if j != i for b in t)


# ---------------------------------------------------------------------------------------------- prefill


def prefill_main(args, announce) -> int:
    model, pool, options = _setup(args, "prefill")
    source = kv_engines.make_source(args.path, pool, "prefill", options)
    host, port = args.listen.rsplit(":", 1)
    lst, address = SideChannel.listen(host, int(port), args.key)
    announce(address)
    ch = SideChannel.accept(lst)
    T = args.timeout
    ch.recv(T, "hello")
    ch.send("welcome", engine=source.info(), fingerprint=model.fingerprint(), block_bytes=pool.block_bytes)
    texts = prompts(args.seed, args.prompt_lens, model.vocab)
    notes: set[bytes] = set()
    tables: list[list[int]] = []

    def wait_for(want: set[bytes], on_note=lambda note: None) -> None:
        deadline = time.monotonic() + T
        while not want <= notes:
            for note in source.notifications(min(T, 1.0)):
                notes.add(note)
                on_note(note)
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill: no notification {sorted(want - notes)} within {T:.0f} s")

    for r in range(args.rounds):
        if r:
            wait_for({b"round:%d" % (r - 1)})  # decode is done with the last round: compute the next
        live = {}
        for i, p in enumerate(texts):
            model.sync()
            t0 = time.perf_counter()
            kv = model.prefill(p)
            ids = pool.alloc(len(p))
            pool.write(ids, kv)
            model.sync()
            live[f"{r}:{i}"] = (i, ids, time.perf_counter() - t0)
        tables = [ids for _, ids, _ in live.values()]
        for key, (i, ids, secs) in live.items():  # back to back, like one scheduler step: all in flight
            ch.send("kv_ready", req=key, index=i, prompt=texts[i], block_ids=ids, prefill_s=secs)
        ch.send("round_sent", count=len(live))
        # What decode checks its pulled blocks against, sent after the block ids so it delays no READ.
        ch.send("verify", blocks={key: {"digests": pool.digests(ids),
                                        **({"bytes": host_bytes(pool.blocks(ids))} if args.verify_bytes else {})}
                                  for key, (_, ids, _) in live.items()})

        def free(note: bytes, live=live) -> None:  # a READ's notification: decode has the blocks
            key = note[3:].decode() if note.startswith(b"kv:") else None
            if key in live:
                pool.free(live.pop(key)[1])
        wait_for({b"kv:%s" % key.encode() for key in live}, free)
    wait_for({b"round:%d" % (args.rounds - 1)})
    ch.send("bye", prefill={"all_blocks_freed": pool.free_blocks == pool.num_blocks, "num_blocks": pool.num_blocks,
                            "interleaved": _interleaved(tables), "notifications": len(notes)})
    try:
        ch.recv(T)  # decode closes the channel once its engine is closed: ours closes after
    except (EOFError, OSError):
        pass
    source.close()
    ch.close()
    lst.close()
    return 0


# ----------------------------------------------------------------------------------------------- decode


def decode_main(args) -> dict:
    model, pool, options = _setup(args, "decode")
    puller = kv_engines.make_puller(args.path, pool, "decode", options, args.dlist)
    T = args.timeout
    ch = SideChannel.connect(args.connect, args.key)
    ch.send("hello")
    welcome = ch.recv(T, "welcome")
    if welcome["fingerprint"] != model.fingerprint():
        raise RuntimeError("prefill and decode built different weights (seed, preset, dtype or device differ)")
    puller.connect(welcome["engine"])
    references: dict[int, list[int]] = {}
    faulty = max(range(len(args.prompt_lens)), key=lambda i: args.prompt_lens[i])  # the longest prompt
    rounds = []
    for r in range(args.rounds):
        reqs, handles, done_at = {}, {}, {}
        deadline, sent = time.monotonic() + T, False
        while not sent or len(done_at) < len(handles):
            # Post each READ the moment its block ids arrive; between messages, stamp finished READs.
            if not sent and ch.conn.poll(0):
                m = ch.recv(T)
                if m["op"] == "round_sent":
                    sent = True
                    continue
                assert m["op"] == "kv_ready", m
                local = pool.alloc(len(m["prompt"]))
                lf, rf = pool.geometry.flat(local), puller.remote_geometry.flat(m["block_ids"])
                if args.fault != "none" and m["index"] == faulty:
                    lf, rf = _inject(args.fault, lf, rf)
                t0 = time.perf_counter()
                handles[m["req"]] = puller.pull(lf, rf, b"kv:" + m["req"].encode())
                reqs[m["req"]] = dict(msg=m, local=local, posted=t0)
            kv_engines.poll_done(puller, handles, done_at)
            if time.monotonic() > deadline:
                raise TimeoutError(f"decode: round {r} not pulled within {T:.0f} s")
        for h in handles.values():
            puller.release(h)
        verify = ch.recv(T, "verify")["blocks"]
        rows = [_finish(model, pool, req, done_at[key], verify[key], args, references) for key, req in reqs.items()]
        first = min(q["posted"] for q in reqs.values())
        for row, key in zip(rows, reqs):  # when each READ was posted and seen done, from the round's first post
            row["posted_at_s"], row["done_at_s"] = reqs[key]["posted"] - first, done_at[key] - first
        poison_ok = pool.untouched_is_poison()
        tables = [req["local"] for req in reqs.values()]
        for req in reqs.values():
            pool.free(req["local"])
        last = max(done_at.values())
        total = sum(x["kv_bytes"] for x in rows)
        rounds.append({"round": r, "requests": rows, "poison_ok": poison_ok, "interleaved": _interleaved(tables),
                       "total": {"kv_bytes": total, "blocks": sum(x["blocks"] for x in rows),
                                 "window_s": last - first, "gbps": total / (last - first) / 1e9},
                       "mean": {k: float(np.mean([x[k] for x in rows]))
                                for k in ("prefill_s", "transfer_s", "first_step_s", "ttft_s")}})
        puller.notify(b"round:%d" % r)
    bye = ch.recv(T, "bye")
    transport = puller.transport
    puller.close()
    ch.close()
    ok = all(x["match"] and x["digests_ok"] and x["bytes_ok"] is not False for rd in rounds for x in rd["requests"])
    return {"path": args.path, "transport": transport, "model": model.kind, "preset": args.preset,
            "device": args.device, "dtype": args.dtype, "dlist": args.dlist if args.path != "tether" else None,
            "block_bytes": pool.block_bytes, "decode_pool_blocks": pool.num_blocks, "prefill": bye["prefill"],
            "ok": ok and all(rd["poison_ok"] for rd in rounds) and bye["prefill"]["all_blocks_freed"],
            "rounds": rounds}


def _finish(model, pool, req, done_at: float, want: dict, args, references) -> dict:
    """Checks one pulled request against prefill's blocks, decodes it from the pool, compares tokens."""
    m, local = req["msg"], req["local"]
    n = len(m["prompt"])
    digests_ok = pool.digests(local) == want["digests"]
    bytes_ok = None
    if "bytes" in want:
        bytes_ok = bool(np.array_equal(host_bytes(pool.blocks(local)), want["bytes"]))
    model.sync()
    t0 = time.perf_counter()
    kv = pool.gather(local, n)[:, :, :n - 1]  # the last prompt token is recomputed by the first step
    model.sync()
    gather_s = time.perf_counter() - t0
    tokens, step_s = model.decode(kv, m["prompt"], args.max_new_tokens)
    if m["index"] not in references:
        references[m["index"]] = model.reference(m["prompt"], args.max_new_tokens)
    ref = references[m["index"]]
    transfer_s = done_at - req["posted"]
    blocks = len(local) * pool.layers * 2
    first_step_s = gather_s + step_s
    return {"req": m["req"], "prompt_tokens": n, "pages": len(local), "blocks": blocks,
            "kv_bytes": blocks * pool.block_bytes, "transfer_s": transfer_s,
            "gbps": blocks * pool.block_bytes / transfer_s / 1e9, "prefill_s": m["prefill_s"],
            "gather_s": gather_s, "first_step_s": first_step_s, "ttft_s": m["prefill_s"] + transfer_s + first_step_s,
            "tokens": tokens, "reference": ref, "match": tokens == ref,
            "first_mismatch": next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), None),
            "digests_ok": digests_ok, "bytes_ok": bytes_ok,
            "prefill_block_ids": m["block_ids"], "decode_block_ids": local}


def _inject(fault: str, lf: np.ndarray, rf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For the tests' negative runs. "misplace": layer 0's K blocks 0 and 1 land swapped (K alone: swapping
    whole (K, V) pairs would leave attention, a sum over positions, unchanged); "missing": layer 0's first K
    block is not pulled. Either must show as a digest mismatch and different tokens."""
    if fault == "misplace":
        rf = rf.copy()
        rf[[0, 1]] = rf[[1, 0]]
        return lf, rf
    return lf[1:], rf[1:]
