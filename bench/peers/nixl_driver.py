"""NIXL between two local processes, with its UCX backend or with tether's (TETHER, docs/NIXL.md).

    python nixl_driver.py tcp         # UCX, UCX_TLS=tcp UCX_NET_DEVICES=lo: the TCP row
    python nixl_driver.py default     # UCX picks; on one host that is a same-host copy path, not TCP
    python nixl_driver.py tether-tcp  # TETHER with transport=tcp
    python nixl_driver.py tether      # TETHER as configured by default (same host: ipc)

Host memory (DRAM descriptors), or GPU memory (VRAM, GPU 0 -> GPU 1 where two exist) with PEERS_DEVICE=gpu.

Each op is one NIXL transfer request, prepared once per workload and re-posted (NIXL's intended
use); the 128-block batch is one request with 128 descriptors; "8 in flight" keeps 8 requests.
Which UCX transport actually carried the writes is read from UCX's own protocol report
(UCX_PROTO_INFO) and shown in the system name.
"""
from __future__ import annotations

import glob
import os
import re
import sys
import tempfile
import time

import numpy as np

from common import (CAPACITY, DEVICE, POISON, WORKLOADS, address, alloc, checked, device_id, emit, layout, measure, mem_type,
                    quiet_stdout, serve, start_target, stop_target)

# variant: (backend, its parameters, environment)
VARIANTS = {"tcp": ("UCX", {}, {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}), "default": ("UCX", {}, {}),
            "tether-tcp": ("TETHER", {"transport": "tcp"}, {}), "tether": ("TETHER", {}, {})}
VARIANT = "tcp"


def _agent(name: str, progress_thread: bool):
    from nixl._api import nixl_agent, nixl_agent_config
    backend, params, _ = VARIANTS[VARIANT]
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=[]))
    agent.create_backend(backend, params)
    return agent


def _register(agent, buf) -> None:
    agent.register_memory([(address(buf), CAPACITY, device_id(buf), "")], mem_type(buf))


def target(conn) -> None:
    try:
        # The target's Python thread only waits on its pipe, so UCX needs the progress thread to take
        # in TCP data. It busy-polls (the Python API sets no delay): one core, all the time.
        agent = _agent("bench-target", progress_thread=True)
        buf = alloc(CAPACITY, POISON, target=True)
        _register(agent, buf)
        conn.send(("ok", agent.get_agent_metadata(), (address(buf), device_id(buf))))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}", 0))
        os._exit(0)
    serve(conn, buf)
    _exit()


def _exit() -> None:
    """os._exit: nixl-cu13 1.5.1 segfaults in its exit-time teardown, even for an idle agent. With
    TETHER_TRACE, first a control tick's wait, so the plugin's trace file has every event."""
    if os.environ.get("TETHER_TRACE"):
        time.sleep(0.3)
    os._exit(0)


def put_paths(logdir: str) -> str:
    """UCX transports chosen for ucp_put to the other process ('cma/memory', 'tcp/lo', ...), from
    the UCX_PROTO_INFO tables: a header '<worker> <intra-node|inter-node|self> cfg#N', then
    '| remote memory write by ucp_put* ...', then rows '| range | description | transport |'."""
    found: set[str] = set()
    for path in glob.glob(os.path.join(logdir, "*")):
        lines = open(path, errors="replace").read().splitlines()
        for i, line in enumerate(lines):
            if "remote memory write by ucp_put" not in line or " self " in lines[i - 1]:
                continue
            started = False  # data rows come after the column titles; the table ends with them
            for row in lines[i + 1:]:
                cells = [c.strip() for c in row.split("|")[1:-1]]
                if len(cells) == 3 and re.match(r"\d", cells[0]):
                    found.add(cells[2])
                    started = True
                elif started:
                    break
    return ", ".join(sorted(found)) or "path not reported"


def main(variant: str) -> int:
    global VARIANT
    quiet_stdout()
    VARIANT = variant
    os.environ["PEERS_NIXL_VARIANT"] = variant  # the target process reads it (spawned: a fresh module)
    backend, params, env = VARIANTS[variant]
    for key in ("UCX_TLS", "UCX_NET_DEVICES"):
        os.environ.pop(key, None)
    os.environ.update(env)
    if variant == "tcp" and (DEVICE == "gpu" or os.path.exists("/dev/nvidiactl")):
        # NIXL refuses UCX_TLS=tcp where NVIDIA GPUs are present ("does not enable CUDA memory support");
        # cuda_copy only adds GPU memory registration: host memory still moves over TCP.
        os.environ["UCX_TLS"] = "tcp,cuda_copy"
    logdir = tempfile.mkdtemp(prefix="nixl-ucx-")
    os.environ.update(UCX_PROTO_INFO="y", UCX_LOG_FILE=os.path.join(logdir, "ucx.%p.log"))
    system = {"tcp": "NIXL/UCX UCX_TLS=tcp", "default": "NIXL/UCX default", "tether-tcp": "NIXL + TETHER (tcp)",
              "tether": "NIXL + TETHER (default: ipc)"}[variant]
    try:
        import nixl._api  # noqa: F401
    except Exception as e:
        emit(system, "not run", note=f"import nixl._api failed: {e}")
        return 0
    if backend == "TETHER":
        from nixl._api import nixl_agent, nixl_agent_config
        if "TETHER" not in nixl_agent("probe", nixl_agent_config(backends=[])).get_plugin_list():
            emit(system, "not run", note="NIXL does not see the TETHER plugin: run `tether nixl install`")
            return 0
    proc = None
    try:
        proc, conn, metadata, (raddr, rdev) = start_target(target, "agent")  # inherits the UCX environment above
        # No progress thread here: a second spinning thread on a 2-core host pushed 64 KiB writes
        # from ~0.1 ms to 4-8 ms. The initiator progresses UCX itself in check_xfer_state().
        agent = _agent("bench-initiator", progress_thread=False)
        src = alloc(CAPACITY)
        _register(agent, src)
        remote_name = agent.add_remote_agent(metadata)
    except Exception as e:
        emit(system, "not run", note=f"start failed: {type(e).__name__}: {e}")
        if proc:
            proc.kill()
        return 0

    rng = np.random.default_rng()
    base = address(src)
    mem = mem_type(src)
    ldev = device_id(src)
    named = backend != "UCX"  # UCX's own report names its transport; TETHER's is its parameter
    for w in WORKLOADS:
        handles = []
        try:
            blocks = layout(w, rng)
            local = agent.get_xfer_descs([(base + lo, n, ldev) for lo, _, n in blocks], mem)
            remote = agent.get_xfer_descs([(raddr + ro, n, rdev) for _, ro, n in blocks], mem)
            op = "READ" if w.mode == "read" else "WRITE"
            handles = [agent.initialize_xfer(op, local, remote, remote_name) for _ in range(max(1, w.depth))]

            def post(i):
                h = handles[i % len(handles)]  # measure() has waited for op i - depth already
                s = agent.transfer(h)
                if s == "ERR":
                    raise RuntimeError("transfer() returned ERR")
                return h if s == "PROC" else None

            def wait(h):
                if h is None:  # done inside transfer() already
                    return
                while (s := agent.check_xfer_state(h)) == "PROC":
                    os.sched_yield()  # as for Mooncake: leave the CPU to UCX's threads
                if s != "DONE":
                    raise RuntimeError(f"check_xfer_state returned {s}")

            ok = checked(w, conn, src, blocks, lambda: wait(post(0)), rng)
            if not named:  # the first write has made UCX choose (and report) its put transport
                path = put_paths(logdir)
                system += f" ({path}{'' if 'tcp' in path else ', not TCP'})"
                named = True
            emit(system, w.name, ok, **measure(w, post, wait))
        except Exception as e:
            emit(system, w.name, note=f"{type(e).__name__}: {e}")
        for h in handles:
            h.release()
    stop_target(proc, conn)
    sys.stdout.flush()
    sys.stderr.flush()
    _exit()


VARIANT = os.environ.get("PEERS_NIXL_VARIANT", VARIANT)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "tcp"))
